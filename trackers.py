"""The run's log: RunLog writes log.jsonl (rank 0) and the console's step line, and hands each record to the trackers,
TensorBoard and W&B, where it becomes scalars named by its type (train/loss, val/loss, hellaswag/acc_norm...) at the
record's step. Both packages are optional and imported only when asked for. open_run_log prepares a resumed run's log.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import secrets
import statistics
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common import checkpoints, iter_log, same_verdict, write_error

# a record's numbers that are not its figures (counters, timings); all others are scalars, named after the record's
# type unprefixed (val_loss -> val/loss): a figure a stage adds to log.jsonl reaches the trackers with no list to extend
NOT_SCALARS = ("step", "tokens", "ms", "n", "examples_per_sec")


def scalars(record: dict) -> dict[str, float]:
    """The record's scalars by tag: {"train/loss": 10.9, "train/lr": 6e-05, ...}; a None (no MFU on CPU) is left out."""
    kind = record["type"]
    keys = [key for key, value in record.items() if key not in NOT_SCALARS and type(value) in (int, float)]
    each_task = {f"{kind}/{name}": float(acc) for name, acc in record.get("results", {}).items()}  # CORE's, ChatCORE's
    return {**each_task, **{f"{kind}/{key.removeprefix(kind + '_')}": float(record[key])
                            for key in keys}}  # the mean wins a clash with a task named like it


def missing_package(tensorboard: bool, wandb_project: str) -> str | None:
    """Why --tensorboard or --wandb cannot run here (its package is not installed), or None."""
    return next((f"{flag} needs the {package} package: pip install {package}" for flag, package, wanted in
                 (("--tensorboard", "tensorboard", tensorboard), ("--wandb", "wandb", wandb_project))
                 if wanted and importlib.util.find_spec(package) is None), None)


class TensorBoard:
    """Event files in the run's out dir. A run hides the steps from `forget` on that earlier event files hold, as
    log.jsonl drops them: an interrupted run's past its checkpoint, or all of a dead attempt's (a fresh start)."""

    def __init__(self, out_dir: Path, forget: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir), purge_step=forget)
        if getattr(threading.excepthook, "func", None) is not quiet_writer_thread:  # once; before it, the hook in place
            threading.excepthook = functools.partial(quiet_writer_thread, hook=threading.excepthook)

    def write(self, record: dict) -> None:
        if record["type"] == "config":
            self.writer.add_text("config", f"```\n{json.dumps(record, indent=1)}\n```", record["step"])
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self.writer.close()


def quiet_writer_thread(args: Any, hook: Callable[[Any], None]) -> None:
    """No traceback from TensorBoard's writer thread for a failed write (a full disk): the next add_scalar or close
    raises it again in the run, where RunLog.writing makes it one line."""
    if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
        hook(args)


class WandB:
    """A W&B run (offline too, WANDB_MODE=offline) whose id is kept in out_dir/wandb_run_id, so a resumed run logs on
    into the same W&B run. Its files go into the out dir unless WANDB_DIR says where."""

    def __init__(self, project: str, out_dir: Path, resume_step: int | None):
        import wandb

        id_file = out_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        try:
            self.run = wandb.init(project=project, id=run_id, resume="allow", name=out_dir.name,
                                  dir=os.environ.get("WANDB_DIR") or str(out_dir))
        except Exception as e:  # no API key, no network...: one line, before training, on every rank (setup)
            why = (str(e) or type(e).__name__).splitlines()[0]
            raise ValueError(f"--wandb {project}: W&B did not start ({why}); run `wandb login`, or set "
                             "WANDB_MODE=offline to log without an account") from None

    def write(self, record: dict) -> None:
        if record["type"] == "config":
            config = {key: value for key, value in record.items() if key not in ("type", "step")}
            self.run.config.update(config, allow_val_change=True)
        elif values := scalars(record):
            # online, W&B ignores a step it already has: the interrupted run's, with the same loss (exact resume)
            self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()


# ----------------------------------------------------------------------------------------------------------------------
# The run's log: log.jsonl, the console's step line, and these trackers fed its records


class RunLog:
    """The run's log.jsonl (rank 0, not for --eval-only), the trackers that get its records too (TensorBoard, W&B),
    and the console's step line every --log-every steps, with the ETA from the median of the last 20 step times."""

    def __init__(self, path: Path | None, master: bool, max_steps: int, log_every: int, trackers: list[Any],
                 held: list[dict] | None = None):
        self.path, self.master, self.trackers, self.held = path, master, trackers, {r["type"]: r for r in held or ()}
        self.max_steps, self.log_every = max_steps, log_every
        self.recent_ms: list[float] = []
        self.losses: list[float] = []  # every step's loss, all ranks together

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A failed write of log.jsonl or a tracker's file (a full disk) as one line naming the file."""
        try:
            yield
        except OSError as e:
            where = Path(os.fsdecode(e.filename or self.path or os.devnull))  # bytes, from TensorBoard
            raise ValueError(f"cannot append to {where}: {'; '.join(write_error(e, where))}") from None

    def write(self, *records: dict) -> None:
        with self.writing():
            # made again, or put back: they replace the held records, all in one rewrite
            if stale := [self.held.pop(r["type"]) for r in records if r["type"] in self.held]:
                write_records(self.path, [*(r for r in iter_log(self.path) if r not in stale), *records])
            else:  # opened per write, as a rewrite replaces it; no log.jsonl (another rank, --eval-only): nowhere
                with open(self.path or os.devnull, "a") as file:
                    file.write("".join(json.dumps(record) + "\n" for record in records))
            for record in records:
                for tracker in self.trackers:
                    tracker.write(record)

    def say(self, text: str, **kwargs: Any) -> None:
        """print on rank 0."""
        if self.master:
            print(text, **kwargs)

    def checkpointed(self) -> None:
        """The run owns the newest checkpoint now: a rewind's set-aside records (open_run_log) are no one's."""
        if self.path is not None:
            Path(f"{self.path}.rewound").unlink(missing_ok=True)

    def step(self, step: int, record: dict) -> None:
        """Log one optimizer step's record; the ETA leaves out the oldest of the last 21 step times: 20 of them, and
        never the time of this run's first step (its compile) once there is another."""
        self.losses.append(record["loss"])
        self.recent_ms = (self.recent_ms + [record["ms"]])[-21:]
        self.write(*self.held.values(), {"type": "train", "step": step, **record})  # the held ones put back first
        if record.get("skipped"):
            self.say(f"step {step:6d} | update skipped: {record['skipped']}")
        if step % self.log_every == 0 or step == self.max_steps - 1:
            eta = statistics.median_high(self.recent_ms[1:] or self.recent_ms) * (self.max_steps - step - 1) / 1000
            util = record["mfu"]
            self.say(f"step {step:6d}/{self.max_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | norm "
                     f"{record['grad_norm']:.3f} | {record['ms']:7.1f} ms | {record['tok_s']:,.0f} tok/s | mfu "
                     f"{f'{util:.1%}' if util else 'n/a'} | eta {fmt_time(eta)}", flush=True)

    def close(self) -> None:
        # the resumed step's evaluation records not made again (no step came): to the trackers, to log.jsonl's end
        self.write(*self.held.values())
        with self.writing():
            for each in self.trackers:
                each.close()


def write_records(path: Path, records: list[dict]) -> None:
    tmp = Path(f"{os.path.realpath(path)}.tmp")  # beside a link's file: replacing the link would leave the log behind
    tmp.write_text("".join(json.dumps(record) + "\n" for record in records))
    os.replace(tmp, tmp.with_suffix(""))


def fmt_time(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def open_run_log(cfg: Any, resume_step: int | None, rewinding: bool, rank: int, world: int) -> RunLog:
    """log.jsonl and the trackers on rank 0; an evaluation-only run leaves out_dir alone (its log may be a run's).
    A resumed run keeps the records before its step; a rewind keeps those it drops in log.jsonl.rewound until its
    first checkpoint, and a run that finds them there puts them back first. The trackers get them again."""
    if rank != 0 or cfg.eval_only:
        same_verdict(lambda: None, world)  # rank 0's trackers starting, below
        return RunLog(None, rank == 0, cfg.max_steps, cfg.log_every, [])
    path = Path(cfg.out_dir) / "log.jsonl"
    side, first, newest = Path(f"{path}.rewound"), resume_step or 0, checkpoints(path.parent)
    # a rewind's set-aside records are the log's while the newest checkpoint is the one it found (the rewound run's
    # first drops them): the side file names it (a coarse clock ties mtimes) by what a copy with its times keeps
    mark = [newest[-1].name, newest[-1].stat().st_mtime_ns] if newest else []
    records = list(iter_log(path)) if path.is_file() and resume_step is not None else []
    head, *moved = (list(iter_log(side)) if records and side.is_file() else []) or [{}]  # the mark, then in step order
    if head and "newest" not in head:  # an older version's, unmarked: the log's if written after the newest checkpoint
        late = not mark or side.stat().st_mtime_ns > mark[1]
        head, moved = {"step": head["step"], "newest": mark if late else None}, [head, *moved]
    if head.get("newest") == mark:
        records = [r for r in records if r["type"] == "config" or r["step"] < head["step"]] + moved
        first = min(resume_step, head["step"])
    kept = [r for r in records if r["type"] == "config" or r["step"] < resume_step]
    cut = [r for r in records if r["type"] != "config" and r["step"] >= resume_step]
    path.parent.mkdir(parents=True, exist_ok=True)  # for the trackers' files too
    wanted = ((cfg.tensorboard, lambda: TensorBoard(path.parent, first)),
              (cfg.wandb, lambda: WandB(cfg.wandb, path.parent, resume_step)))
    trackers = same_verdict(lambda: [start() for on, start in wanted if on], world)
    # after the trackers start (one that cannot leaves the log as it was); the cut goes aside first, with the set-aside
    # records taken back (from `first`), and they leave the side file only once the log holds them: a crash loses none
    if rewinding and cut:
        write_records(side, [{"type": "rewound", "step": first, "newest": mark},
                             *(r for r in records if r["type"] != "config" and r["step"] >= first)])
    held = [r for r in cut if r["step"] == resume_step and r["type"] != "train"]  # in the log till replaced (write)
    write_records(path, kept + held)
    if not (rewinding and cut):
        side.unlink(missing_ok=True)
    replay = [r for r in kept if r["type"] != "config" and r["step"] >= first]
    for tracker in trackers:
        for record in replay:
            tracker.write(record)
    return RunLog(path, True, cfg.max_steps, cfg.log_every, trackers, held)
