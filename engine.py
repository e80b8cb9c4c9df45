"""The training engine every stage runs on (train.py, sft.py, prefs.py, rl.py): the loop, the lr schedule, and one
small object per concern, each owning its state and its cadence.

    train(run)    the loop: evaluate once in a while, one optimizer step, log, checkpoint or stop
    Run           what the loop drives: a stage's step, model, evaluations and checkpointed parts
    get_lr        every stage's schedule: warmup, then cosine, linear, constant or wsd
    Checkpointer  find, agree across ranks, restore, due(step), save with prune, judge (a NaN sets one aside)
    Eval          one evaluation (name, every, fn): due every N steps and at the end
    SpikeGuard    llm.c's loss/grad-norm z-scores that skip an outlier update
    StopFlags     SIGTERM, Ctrl-C and the wall-clock budget, agreed across ranks (a context manager)
    Profiler      a few profiled steps after warmup
    agree_fingerprint  one comparison of what every rank must share: the command, the data, the starting weights

A checkpoint is the model, the optimizer, every rank's RNG and the state_dict() of each part in Run.parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import torch
import torch.distributed as dist
import torch.nn as nn

import common
from common import LOCAL, all_sum, checkpoints, device_name, load_checkpoint, mfu, same_verdict, trim_heap, write_error
from parallel import StepArgs, Trainable, check_flags
from trackers import RunLog, fmt_time, open_run_log


@dataclass
class RunArgs(StepArgs):
    """Where a run writes, how it checkpoints, resumes, logs and stops."""

    max_steps: int = 19073  # optimizer steps (19073 * 524288 tokens ~ 10B)
    seed: int = 1337  # seeds the init, dropout, the data order and sampling (rl.py's rollouts, train.py's samples)
    out_dir: Annotated[str, LOCAL] = "out/gpt2-124m"  # checkpoints, log.jsonl and profiler traces go here
    ckpt_every: int = 5000  # checkpoint every N steps (and at the end, on SIGTERM and Ctrl-C); 0 = only at the end
    keep_last: Annotated[int, LOCAL] = 3  # keep the newest K checkpoints (0 = all)
    keep_every: Annotated[int, LOCAL] = 0  # never delete a checkpoint whose step is a multiple of N (0 = none)
    resume: Annotated[str, LOCAL] = ""  # '' (fresh run), 'auto' (latest valid checkpoint in out_dir) or a path
    eval_only: bool = False  # evaluate the starting weights once and exit: no training, checkpoint or log
    log_every: int = 1  # print a step line every N steps
    tensorboard: Annotated[bool, LOCAL] = False  # also log the scalars as TensorBoard event files in out_dir
    wandb: Annotated[str, LOCAL] = ""  # also log them to this W&B project ('' = off; WANDB_MODE=offline works)
    max_time: Annotated[float, LOCAL] = 0.0  # wall-clock budget in minutes; checkpoint and stop when reached (0 = none)
    profile: bool = False  # profile a few steps after warmup; writes a Chrome/Perfetto trace to out_dir
    profile_steps: int = 3  # steps to profile
    eval_every: int = 250  # evaluate every N steps (and at the last step); 0 = never (no val split is read)
    # the learning rate: --max-lr after a linear warmup, then the schedule (get_lr)
    warmup_steps: int = 715  # linear warmup steps
    lr_schedule: str = "cosine"  # after warmup: cosine or linear decay, constant, wsd (stable, then decay)
    min_lr_frac: float = 0.1  # the schedule decays to min_lr_frac * max_lr
    decay_frac: float = 0.2  # wsd: the fraction of max_steps spent decaying to the min
    print_config: bool = False  # print the resolved config (the preset, then the flags) as JSON and exit
    MIN_STEPS = 1  # not a flag: the least --max-steps a stage takes (prune.py's 0: prune, evaluate, save)
    SHARDS = False  # not a flag: whether the stage trains under --tp/--pp (train.py's language model does)

    def __post_init__(self) -> None:
        super().__post_init__()
        lows = {"max_steps": self.MIN_STEPS, "log_every": 1, "profile_steps": 1, "ckpt_every": 0, "keep_last": 0,
                "keep_every": 0, "max_time": 0, "eval_every": 0, "warmup_steps": 0}
        check_flags([*((getattr(self, key) >= low, f"--{common.flag(key)} must be >= {low}; got {getattr(self, key)}")
                       for key, low in lows.items()),
                     (self.lr_schedule in SCHEDULES,
                      f"--lr-schedule must be one of {', '.join(SCHEDULES)}; got {self.lr_schedule!r}"),
                     (0.0 <= self.min_lr_frac <= 1.0, f"--min-lr-frac must be in [0, 1]; got {self.min_lr_frac}"),
                     (0.0 < self.decay_frac <= 1.0, f"--decay-frac must be in (0, 1]; got {self.decay_frac}"),
                     # torch and numpy take 64-bit seeds; each rank adds its rank
                     (0 <= self.seed < 2**63 - 2**16, f"--seed must be in [0, 2**63 - 2**16); got {self.seed}"),
                     (not ((self.tp or self.pp) and not self.SHARDS),
                      "--tp/--pp shard pretraining's language model only (train.py): drop them here"),
                     (not (self.keep_every and self.ckpt_every and self.keep_every % self.ckpt_every),
                      f"--keep-every {self.keep_every} must be a multiple of --ckpt-every {self.ckpt_every}")])


SCHEDULES = ("cosine", "linear", "constant", "wsd")
TRIM_EVERY = 100  # CPU steps between handing the heap's free pages back (common.trim_heap)


@dataclass(frozen=True)
class Context:
    """Where this process runs: its rank, its rank on the node, the world size and its device; and its command line."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    argv: tuple[str, ...] | None = None  # the stage's script and the flags stage.main parsed (None: stage.run's)

    @property
    def master(self) -> bool:
        return self.rank == 0


def get_lr(step: int, cfg: RunArgs) -> float:
    """Linear warmup, then cosine or linear decay to min_lr_frac * max_lr at max_steps, or constant; wsd holds max_lr,
    then decays linearly over the last decay_frac of the steps, so a run can be extended from before its decay."""
    min_lr = cfg.min_lr_frac * cfg.max_lr
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.max_lr
    if step >= cfg.max_steps:
        return min_lr
    start = cfg.warmup_steps  # of the decay; wsd's: decay_frac of max_steps before the end
    if cfg.lr_schedule == "wsd":
        start = max(start, cfg.max_steps - round(cfg.decay_frac * cfg.max_steps))
    progress = max(0, step - start) / max(1, cfg.max_steps - start)
    if cfg.lr_schedule == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.max_lr - min_lr)
    return cfg.max_lr - progress * (cfg.max_lr - min_lr)


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: RunArgs) -> float:
    """Give every param group the schedule's lr for `step`; returns it."""
    lr = get_lr(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


# ----------------------------------------------------------------------------------------------------------------------
# The training loop


def train(run: Run) -> dict[str, Any]:
    """Evaluate once in a while, take one optimizer step, log, checkpoint or stop. `step` counts the optimizer steps
    done: the evaluations at last_step score the final weights. Returns run.result(step)."""
    stop = run.stop
    step = run.start_step
    for step in range(run.start_step, run.last_step + 1):
        final = step == run.last_step
        stop.last = final  # no step left to stop after: a Ctrl-C during the final evaluations quits at once

        # evaluate once in a while; a signal that came meanwhile stops the run here, not a step later
        evaluated = run.attempt(step, run.evaluate, step, final)
        if final:
            break
        if evaluated and (stopping := stop.should_stop()):
            if step > run.start_step and not run.checkpointer.due(step):
                run.checkpoint(step)
            run.halt(stopping, f"at step {step}, before training it", resumable=step > run.start_step or run.resumed)
            break

        # one optimizer step
        run.profiler.step_begins(step)
        t0 = time.time()
        record = run.attempt(step, run.step_fn, step)  # read on the host (it waited for the device): dt is real
        dt = time.time() - t0
        run.after_step(step)

        # log
        if run.diverged(step, record):
            break
        run.log.step(step, run.record(record, dt))

        # checkpoint or stop
        stopping = stop.should_stop()
        if run.checkpointer.due(step + 1) or stopping:
            run.checkpoint(step + 1)
        if stopping:
            run.halt(stopping, f"after step {step}")
            break
    return run.result(step)


@dataclass(kw_only=True)
class Run:
    """One training (or evaluation) run as the loop sees it: a stage gives its step, model, evaluations and the parts it
    checkpoints; the stop flags and the profiler follow from the flags."""

    cfg: RunArgs
    ctx: Context
    step_fn: Callable[[int], dict[str, Any]]  # one optimizer step -> its record: loss, grad_norm, lr, tokens...
    raw: nn.Module  # the unwrapped, uncompiled model: state dicts, evaluation, samples
    trainable: Trainable  # what steps call: the wrapped model, the optimizer, the precision
    checkpointer: Checkpointer
    log: RunLog
    evals: list[Eval]
    parts: dict[str, Any]  # the other checkpointed components, by checkpoint key: each has state_dict()
    start_step: int = 0
    resumed: bool = False
    flops_per_token: float = 0.0  # for MFU (0: not reported)
    peak_flops: float | None = None  # per device, None: common.py's table

    def __post_init__(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.tokens: TokenCount = self.parts["tokens"]  # trained on, all ranks together
        self.last_step = self.start_step if cfg.eval_only else cfg.max_steps
        if self.resumed and not cfg.eval_only and self.start_step == cfg.max_steps and ctx.master:  # a sweep's rerun
            print(f"note: the checkpoint is at --max-steps {cfg.max_steps} already: this run trains no step, it only "
                  "evaluates; raise --max-steps to train on, or start a new run in a new --out-dir")
        self.latest: dict[str, dict[str, Any]] = {}  # each evaluation's last record, by name
        self.stop = StopFlags(cfg.max_time, not cfg.eval_only, ctx.master, ctx.device, ctx.world)
        self.profiler = Profiler(cfg.profile and not cfg.eval_only, self.start_step, cfg.profile_steps,
                                 Path(cfg.out_dir), ctx.rank)
        self.device_name = device_name(ctx.device)
        self.stopped: str | None = None  # "signal", "max_time" or "nan"
        self.t_start = time.time()

    def evaluate(self, step: int, final: bool) -> bool:
        """The evaluations due at `step`; whether any ran."""
        due = [e for e in self.evals if (final or (e.every > 0 and step % e.every == 0))
               and (e.at_start or step > 0 or self.cfg.eval_only)]
        for e in due:
            if (record := e.fn(step)) is not None:
                self.latest[e.name] = record
                self.log.write({"type": e.name, "step": step, "tokens": self.tokens.value, **record})
        return bool(due)

    def attempt(self, step: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) at `step`; where it raises a ResumableError, its random draws are put back and the state after the
        steps done is saved, and the error says so (unless none was done since the run started or resumed)."""
        rng = rng_state()
        try:
            return fn(*args)
        except common.ResumableError as e:
            if step == self.start_step:
                raise
            set_rng_state(rng)
            if not self.checkpointer.due(step):  # else written after the step before
                self.checkpoint(step)
            raise ValueError(f"{e} at step {step}; {self.checkpointer.last} holds the steps before it: fix that, "
                             "then --resume auto goes on from there") from None

    def record(self, record: dict[str, Any], dt: float) -> dict[str, Any]:
        """The step's record for the log: its own fields, the running token count and the speed."""
        record = dict(record)
        tokens = record.pop("tokens", 0)
        self.tokens.value += tokens
        tok_s = tokens / dt
        util = mfu(self.flops_per_token, tok_s / self.ctx.world, self.device_name, self.peak_flops) \
            if self.flops_per_token else None
        return {"tokens": self.tokens.value, **record, "ms": dt * 1000, "tok_s": tok_s, "mfu": util}

    def after_step(self, step: int) -> None:
        device = self.ctx.device
        if self.ctx.master and device.type == "cuda" and step == self.start_step:
            # the room --batch-size leaves: the first step has made everything a step holds (AdamW's moments too)
            total = torch.cuda.get_device_properties(device).total_memory
            print(f"memory: peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated, "
                  f"{torch.cuda.max_memory_reserved(device) / 2**30:.1f} GiB reserved by PyTorch, of "
                  f"{total / 2**30:.1f} GiB on {self.device_name} (rank 0, after the first step)")
        if device.type == "cpu" and (step + 1) % TRIM_EVERY == 0:
            trim_heap()  # the next step faults its blocks in again once: about 1% at this cadence
        self.profiler.step_ends(step)

    def diverged(self, step: int, record: dict[str, Any]) -> bool:
        """A NaN/inf loss, or gradient norm (already applied by clipping), ends the run without a checkpoint, and sets
        aside the one holding the weights that gave it. Under fp16 the GradScaler skips inf-gradient steps itself."""
        loss, norm = record["loss"], record.get("grad_norm", 0.0)
        finite = math.isfinite(loss) and (self.trainable.scaler is not None or math.isfinite(norm))
        aside = self.checkpointer.judge(step, finite)
        if finite:
            return False
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm}"
        why = f" {aside.name} holds the weights that gave it: renamed {aside.name}.diverged." if aside else ""
        self.log.say(f"error: {what} at step {step}; stopping without writing a checkpoint.{why} Lower --max-lr, raise "
                     "--warmup-steps, or resume from the last good checkpoint.", file=sys.stderr)
        self.stopped = "nan"
        return True

    def checkpoint(self, step: int) -> None:
        self.checkpointer.save(step, self.raw, self.trainable.optimizer, self.parts)
        self.log.checkpointed()

    def halt(self, stopping: str, when: str, resumable: bool = True) -> None:
        self.log.say(f"stopping {when} ({self.stop.reason}); "
                     + ("resume with --resume auto" if resumable else "nothing trained yet"))
        self.stopped = stopping

    def result(self, step: int) -> dict[str, Any]:
        """{"losses", "step", each evaluation's latest record (a one-field record as that field), its fields named
        after it as themselves too ("val_loss", "val_bpb"), and when they happened "checkpoint", "stopped"}."""
        self.profiler.finish(step)
        took = fmt_time(time.time() - self.t_start)
        self.log.say(f"done: evaluated the weights at step {step} in {took}" if self.cfg.eval_only else
                     f"done: {len(self.log.losses)} steps in {took}; outputs in {self.checkpointer.out_dir}")
        self.log.close()
        result: dict[str, Any] = {"losses": self.log.losses}
        for name, record in self.latest.items():
            result.update(record if len(record) == 1 else {name: record})
            result.update({k: v for k, v in record.items() if k.startswith(name + "_")})  # val_loss, val_bpb
        when = {"checkpoint": self.checkpointer.last, "stopped": self.stopped}
        return {**result, **{key: value for key, value in when.items() if value}, "step": step}


@dataclass
class TokenCount:
    """Tokens trained on, all ranks together: a checkpointed part, so the log's token axis survives a batch change."""

    value: int = 0

    def state_dict(self) -> int:
        return self.value

    def load_state_dict(self, value: int) -> None:
        self.value = int(value)


# ----------------------------------------------------------------------------------------------------------------------
# Checkpointer


def optimizer_kind(optimizer: torch.optim.Optimizer, parallel: str) -> str:
    """What a checkpoint's optimizer state is: ZeRO-1's own format, or the parameter-keyed one of everything else."""
    return "zero1" if hasattr(optimizer, "consolidate_state_dict") else parallel if dist.is_initialized() else "single"


def step_of(path: Path) -> int:
    return int(path.stem.removeprefix("ckpt_"))


class Checkpointer:
    """Finds the checkpoint a run continues (the same on every rank), restores it, saves every --ckpt-every steps and
    prunes (prune, judge). `args` is the run's full config, recorded in each checkpoint as train_config; `chat`
    whether the weights speak chat_format's conversations (chat_format.is_chat)."""

    def __init__(self, args: RunArgs, rank: int = 0, world: int = 1, prov: dict | None = None, chat: bool = False):
        self.args, self.rank, self.world, self.prov, self.chat = args, rank, world, prov or {}, chat
        self.out_dir = Path(args.out_dir)
        self.master = rank == 0
        self.say = print if self.master else lambda text: None
        self.unreadable: list[Path] = []
        self.last: str | None = None  # the path written last
        self.newest: Path | None = None  # this run's newest checkpoint (resumed or written), resolved
        self.good: Path | None = None  # the newest whose weights trained a step to a finite loss and gradient norm
        self.rewinding = False  # resuming a checkpoint older than the newest in out_dir

    def due(self, step: int) -> bool:
        """Whether the state after `step` optimizer steps is saved: every --ckpt-every, and at the end."""
        return (self.args.ckpt_every > 0 and step % self.args.ckpt_every == 0) or step == self.args.max_steps

    def find(self) -> tuple[Path, dict] | None:
        """find_resume, agreed: every rank resumes the same checkpoint, or all stop before a collective could hang."""
        found = same_verdict(self.find_resume, self.world)  # OSError too: a --resume PATH this node cannot read
        if self.world > 1:
            # the weights tell two runs' checkpoints of the same step apart (each node's own out-dir, say), step 0's too
            mine = (int(found[1]["step"]), weights_digest(found[1]["model"].values())) if found else (None, None)
            seen: list[tuple] = [mine] * self.world
            dist.all_gather_object(seen, mine)
            if any(other != seen[0] for other in seen):
                steps = [step for step, _ in seen]
                which = "different checkpoints" if len(set(steps)) == 1 else \
                    f"different steps {steps} (None: none found)"
                raise ValueError(f"ranks resumed {which}: every node must see the same checkpoints in --out-dir "
                                 f"{self.out_dir} (put it on a shared filesystem, or copy the checkpoint to each node "
                                 "and pass --resume PATH)")
        self.newest = found[0].resolve() if found else None
        self.rewinding = bool(found) and any(p.resolve() != self.newest for p in checkpoints(self.out_dir)[-1:])
        return found

    def find_resume(self) -> tuple[Path, dict] | None:
        """The checkpoint this run continues (path, loaded dict), None for a fresh start, or a ValueError where
        starting would bury another run (truncate its log, prune its checkpoints)."""
        args, out_dir = self.args, self.out_dir
        existing = checkpoints(out_dir)  # none where out_dir does not exist
        if not args.resume:
            existing = existing or sorted(out_dir.glob("ckpt_*.pt.diverged"))  # a NaN-stopped run's
            if existing and not args.eval_only:  # an evaluation writes nothing there
                last, found = existing[-1].name, find_checkpoint(out_dir, [])  # --resume auto refuses another stage's
                if found and stage_of(found[1].get("train_config", {})) != stage_of(dataclasses.asdict(args)):
                    raise ValueError(f"--out-dir {out_dir} holds another stage's or --objective's checkpoints ({last} "
                                     "the last written), which this run cannot continue: start it in a new --out-dir "
                                     f"(from their weights: --init-from {found[0]})")
                raise ValueError(f"--out-dir {out_dir} holds another run's checkpoints ({last} the last written): "
                                 "continue that run with --resume auto, or start this one in a new --out-dir (or "
                                 "delete them first)")
            return None
        if args.resume != "auto":
            return Path(args.resume), load_checkpoint(args.resume, mmap=True)
        found = find_checkpoint(out_dir, self.unreadable)
        # name the checkpoints set aside after the one resumed was written: a NaN-stopped run's (judge)
        after = common.written(found[0]) if found else (-1, -1, "")
        asides = [p for p in out_dir.glob("ckpt_*.pt.diverged") if re.fullmatch(r"ckpt_\d+\.pt\.diverged", p.name)]
        for aside in sorted(asides, key=common.written):
            if common.written(aside) > after:
                self.say(f"note: passing over {aside.name}: the run that wrote it set it aside, as its weights gave a "
                         f"NaN/inf loss or gradient norm at step {step_of(Path(aside.stem))}")
        if found is None:
            check_flags([(not existing, f"none of the {len(existing)} checkpoints in {out_dir} can be read (see the "
                          "warnings above): resume one with --resume PATH, or move them away to start afresh"),
                         # it would score a random model as if it were the run's
                         (not args.eval_only, f"--eval-only --resume auto: no checkpoint in {out_dir} to evaluate")])
            init_from = getattr(args, "init_from", "")
            self.say(f"resume: no checkpoint in {out_dir}; starting "
                     + (f"from --init-from {init_from}" if init_from else "from scratch"))
            return None
        # passed over for an older write with a later step; not those written after it, which could not be read
        later = [p for p in existing[:existing.index(found[0])] if step_of(p) > int(found[1]["step"])]
        if later:
            self.say(f"note: resuming {found[0].name}, the checkpoint written last; {later[-1].name} has a later step "
                     "but was written earlier, as a rewind leaves it (--resume PATH takes another)")
        return found

    def restore(self, ckpt: dict, raw: nn.Module, optimizer: torch.optim.Optimizer, parts: dict[str, Any]) -> int:
        """Load the weights, and unless --eval-only the optimizer, each part's state and the RNG; returns the step."""
        from torch.distributed.checkpoint import state_dict as dcp

        if hasattr(raw, "local_state"):  # --tp/--pp shards (parallelize.Sharded) take their part of the full state
            ckpt = raw.local_state(ckpt)
        dcp.set_model_state_dict(raw, ckpt["model"], options=dcp.StateDictOptions(full_state_dict=True))
        if self.args.eval_only:  # it needs no more, so it scores any checkpoint
            return int(ckpt["step"])
        kind, saved = optimizer_kind(optimizer, self.args.parallel), ckpt["optimizer_kind"]
        how = "under torchrun with --parallel zero1" if saved == "zero1" else "without --parallel zero1"
        check_flags([(saved == kind or "zero1" not in (saved, kind), f"the checkpoint's optimizer state was saved by "
                      f"parallel={saved} and this run's optimizer is {kind}: ZeRO-1 keeps its own format, so resume "
                      f"it {how}")])
        optim_sd = swap_8bit_state(ckpt["optimizer"], pack=True)
        built = [{k: g[k] for k in ("fused", "capturable") if k in g} for g in optimizer.param_groups]
        if kind != "zero1":
            dcp.set_optimizer_state_dict(raw, optimizer, optim_sd, options=dcp.StateDictOptions(full_state_dict=True))
            if not optim_sd["state"]:  # a fresh optimizer's (prune.py's step 0): the load's own lr-0 step is undone
                optimizer.state.clear()
        else:
            optimizer.load_state_dict(optim_sd)
            optimizer.state.clear()  # ZeRO's load kept a second device copy of this rank's moments, never read again
        use_built_kernel(optimizer, built)
        for key, part in parts.items():
            if part is not None and ckpt.get(key) is not None:
                part.load_state_dict(ckpt[key])
        if len(ckpt["rng"]) == self.world:
            set_rng_state(ckpt["rng"][self.rank])
        else:
            self.say(f"note: the checkpoint came from world size {len(ckpt['rng'])}, this run has {self.world}: the "
                     "data stream goes on where it was, the RNG streams restart (not the run an unchanged world would "
                     "give)")
        return int(ckpt["step"])

    def save(self, step: int, raw: nn.Module, optimizer: torch.optim.Optimizer, parts: dict[str, Any]) -> Path:
        """Write ckpt_{step}.pt on rank 0 (every rank helps gather it), then prune; a failed write stops every rank."""
        path = self.out_dir / f"ckpt_{step:06d}.pt"
        self.unreadable = [p for p in self.unreadable if p != path]  # written anew, and readable now
        model_sd, optim_sd = state_dicts(raw, optimizer)
        rngs = [rng_state()] * self.world
        if self.world > 1:
            dist.all_gather_object(rngs, rngs[0])  # dropout masks differ per rank, so every rank's RNG is saved

        def write() -> None:  # rank 0's
            write_atomically(path, {
                "model": model_sd, "optimizer": swap_8bit_state(optim_sd, pack=False),
                "optimizer_kind": optimizer_kind(optimizer, self.args.parallel), "step": step, "rng": rngs,
                "model_config": dataclasses.asdict(raw.config), "train_config": dataclasses.asdict(self.args),
                "provenance": self.prov, "world_size": self.world, "chat": self.chat,
                **{key: part.state_dict() if part is not None else None for key, part in parts.items()}})

        same_verdict(write if self.master else lambda: None, self.world)
        self.last, self.newest = str(path), path.resolve()
        if self.master:
            self.prune()
            print(f"saved {path}")
        return path

    def prune(self) -> None:
        """Keep the newest --keep-last readable checkpoints, every multiple of --keep-every, and the newest known good:
        the newer ones may yet be set aside by a NaN."""
        readable = [p for p in checkpoints(self.out_dir) if p not in self.unreadable]
        for stale in readable[:-self.args.keep_last]:  # --keep-last 0: [:-0] is empty, all are kept
            milestone = self.args.keep_every and step_of(stale) % self.args.keep_every == 0
            if not milestone and stale.resolve() != self.good:
                stale.unlink()

    def judge(self, step: int, finite: bool) -> Path | None:
        """Step `step` trained from this run's ckpt_{step}, if any: a finite loss makes it the newest known good, a NaN
        sets it aside as .diverged (rank 0) so that --resume auto takes the one before. Returns the path set aside."""
        path = self.out_dir / f"ckpt_{step:06d}.pt"
        if path.resolve() != self.newest:  # not this run's, or none
            return None
        if finite:
            self.good = self.newest
            return None
        self.newest = self.last = None
        if self.master:  # out of checkpoints()'s pattern: never resumed
            os.replace(path, path.with_name(path.name + ".diverged"))
        return path

    def remove_partial_writes(self) -> None:
        """A .tmp left by a run killed mid-write is never a valid checkpoint. Not for --eval-only, which may sit beside
        a live run whose .tmp is a checkpoint in flight."""
        if self.master and not self.args.eval_only:
            for stale in self.out_dir.glob("ckpt_*.pt.tmp"):
                stale.unlink()


def rng_state() -> dict[str, torch.Tensor | None]:
    """This rank's RNG state: the CPU's, and the GPU's in a CUDA run (is_initialized, not is_available: a --device cpu
    run on a GPU host has no CUDA context to read)."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}


def set_rng_state(rng: dict[str, torch.Tensor | None]) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and torch.cuda.is_initialized():  # a CUDA run's
        torch.cuda.set_rng_state(rng["cuda"])


def use_built_kernel(optimizer: torch.optim.Optimizer, built: list[dict[str, bool]]) -> None:
    """Each group gets this run's fused/capturable back (the load brought the checkpoint's: a CPU run's False, resumed
    on CUDA under fp16, met GradScaler's found_inf), each `step` where they need it: the param's device, or the CPU."""
    state = getattr(optimizer, "optim", optimizer).state  # ZeRO-1's shard holds this rank's; its step syncs the flags
    for group, flags in zip(optimizer.param_groups, built, strict=True):
        group.update(flags)
        for p in group["params"] if flags else ():  # Muon's and 8-bit AdamW's groups have neither flag
            if torch.is_tensor(step := state.get(p, {}).get("step")):
                state[p]["step"] = step.to(p.device if any(flags.values()) else "cpu", torch.float32)


def write_atomically(path: Path, ckpt: dict) -> None:
    """torch.save to a .tmp, fsync, rename: a kill mid-write leaves the previous checkpoint untouched. A write that
    fails (a full disk, a file-size limit) removes the .tmp and is a one-line ValueError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save's zip writer turns the OSError into a RuntimeError
        if isinstance(e, RuntimeError) and not re.search(r"unexpected pos|file write failed", str(e)):
            raise
        what, fix = write_error(e, tmp)
        tmp.unlink(missing_ok=True)
        raise ValueError(f"cannot write checkpoint {path}: {what}; the partial file is removed and the earlier "
                         f"checkpoints are intact; {fix}") from e


def state_dicts(raw: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict | None]:
    """Full (unsharded, unwrapped) model and optimizer state; collective under ZeRO-1/FSDP, so every rank calls it."""
    from torch.distributed.checkpoint import state_dict as dcp

    if hasattr(raw, "full_state"):  # --tp/--pp shards (parallelize.Sharded) gather the GPT's full state
        return raw.full_state(optimizer)
    opts = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = dcp.get_model_state_dict(raw, options=opts)
    if "lm_head.weight" in model_sd and raw.lm_head.weight is raw.transformer.wte.weight:
        # the offload copies each name on its own: one tensor under both names stores the tied matrix once
        model_sd["transformer.wte.weight"] = model_sd["lm_head.weight"]
    if not hasattr(optimizer, "consolidate_state_dict"):  # keyed by parameter name: DDP, FSDP, single interchange
        fresh = not optimizer.state  # DCP fills a fresh one by a step at lr 0, which AdamW counts: stay at step 0
        optim_sd = dcp.get_optimizer_state_dict(raw, optimizer, options=opts)
        if fresh:
            optimizer.state.clear()
            optim_sd["state"] = {}
        return model_sd, optim_sd
    optimizer.consolidate_state_dict(to=0)  # ZeRO-1: gather every rank's shard on rank 0
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the gathered state arrives by non_blocking copies that nothing else waits for
    return model_sd, optimizer.state_dict() if dist.get_rank() == 0 else None


def swap_8bit_state(optim_sd: dict, pack: bool) -> dict:
    """torchao's 8-bit states (OptimState8bit) as dicts of plain tensors, so that any tool loads the checkpoint with
    weights_only=True and without torchao, or (pack) back. A new dict: the one given may be the live state."""
    def swap(v: Any) -> Any:
        if pack and isinstance(v, dict) and "codes" in v:
            from torchao.optim.subclass_8bit import OptimState8bit

            return OptimState8bit(v["codes"], v["scale"], v["qmap"], v["signed"])
        if not pack and type(v).__name__ == "OptimState8bit":
            return {"codes": v.codes, "scale": v.scale, "qmap": v.qmap, "signed": v.signed}
        return v

    return {**optim_sd, "state": {k: {name: swap(v) for name, v in state.items()}
                                  for k, state in optim_sd["state"].items()}}


def stage_of(config: dict[str, Any]) -> tuple:
    """The stage a run's config is of: its --objective (lm: train.py's old ones), rl.py's algo, prune.py's sparsity
    (masks), and pretraining (also "lm"): train.py's hellaswag, or before sft.py split from it, --data-kind tokens."""
    return (config.get("objective", "lm"), "algo" in config, "sparsity" in config,
            config.get("data_kind", "tokens" if "hellaswag" in config else "") == "tokens")


def find_checkpoint(out_dir: Path, unreadable: list[Path]) -> tuple[Path, dict] | None:
    """The newest checkpoint in out_dir that loads; unreadable ones are reported, skipped and added to `unreadable`."""
    for path in reversed(checkpoints(out_dir)):
        try:
            return path, load_checkpoint(path, mmap=True)
        except (ValueError, OSError) as e:
            print(f"warning: skipping unreadable checkpoint {path}: {e} (left in place; --keep-last does not count "
                  "it)", file=sys.stderr)
            unreadable.append(path)
    return None


def resumed_start(cfg: Any, found: tuple[Path, dict] | None, ctx: Context) -> Any:
    """cfg whose --init-from is the resumed run's start, which its checkpoint records, where the command gives none."""
    start = (found[1].get("train_config", {}).get("init_from") if found else "") or cfg.init_from
    if start == cfg.init_from or not ctx.argv or "init_from" in dict(common.split_argv(list(ctx.argv[1:]))):
        return cfg  # the same, or the command's (a config made in Python is taken as given)
    if ctx.master:  # a preset's or the stage's default is no run's start: DPO and RL read theirs again
        print(f"note: --init-from {start}, the resumed run's start (its checkpoint records it; none given here)")
    return dataclasses.replace(cfg, init_from=start)


def open_log(cfg: RunArgs, raw: nn.Module, built: Trainable, ctx: Context, checkpointer: Checkpointer,
             found: tuple[Path, dict] | None, start: int) -> RunLog:
    """log.jsonl and the trackers, its first record what the run is: its command (the stage's script and flags), the
    full config and what its auto flags came to (the header's), the model's config and the provenance."""
    checkpointer.remove_partial_writes()
    log = open_run_log(cfg, start if found else None, checkpointer.rewinding, ctx.rank, ctx.world)
    log.write({"type": "config", "step": start, "argv": ctx.argv, "config": dataclasses.asdict(cfg),
               "resolved": built.resolved(), "model_config": dataclasses.asdict(raw.config),
               "provenance": checkpointer.prov})
    return log


# ----------------------------------------------------------------------------------------------------------------------
# Evaluations


@dataclass
class Eval:
    """One evaluation: fn(step) scores the weights after `step` steps: its log.jsonl record's fields, or None."""

    name: str
    every: int  # every N steps, and at the last step in any case (0: the last step only)
    fn: Callable[[int], dict[str, Any] | None]
    at_start: bool = True  # also at a training run's first step 0 (samples of untrained weights say nothing)


@torch.no_grad()
def val_metrics(model: nn.Module, loader: Any, windows: int, autocast: contextlib.AbstractContextManager,
                world_size: int, token_bytes: torch.Tensor) -> dict[str, float]:
    """{"loss": the mean loss over the split's first `windows` windows, all ranks together; "bpb": nanochat's bits per
    byte, the nats of the targets with bytes over their bytes (token_bytes: each id's UTF-8 bytes, common.token_bytes)}.
    Rank r scores windows r, r + world_size, ...: every rank runs as many forwards (collective under FSDP), and a turn
    past `windows` is scored and left out.
    world_size counts data-parallel ranks: under --tp/--pp each of them is several ranks that score the same windows."""
    model.eval()
    loader.reset()
    sums = torch.zeros(3, dtype=torch.float64, device=loader.device)  # window means, nats with bytes, bytes
    for turn in range(-(-windows // world_size)):
        x, y = loader.next_batch()
        with autocast:
            part = window_sums(model, x, y, token_bytes)
        if turn * world_size + loader.rank < windows:
            sums += part
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)  # SUM: gloo has no AVG
        sums[0] /= dist.get_world_size() // world_size  # bpb is a ratio: a window's --tp/--pp copies count alike
    model.train()
    return {"loss": sums[0].item() / windows, "bpb": (sums[1] / sums[2]).item() / math.log(2)}


def window_sums(model: nn.Module, x: torch.Tensor, y: torch.Tensor, token_bytes: torch.Tensor) -> torch.Tensor:
    """(mean loss, summed nats of the targets with bytes, their bytes) of one window: a special token (0 bytes) and an
    ignored target count in neither sum. One forward's per-token losses give all three; --tp/--pp's shards
    (parallelize.Sharded) return the mean alone, so their nats take a second forward, on every rank (collective)."""
    nbytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0)
    counted = torch.where(nbytes > 0, y, -1)
    if hasattr(model, "forward_backward"):
        mean, n = model(x, y)[1].double(), (counted >= 0).sum()
        nats = torch.where(n > 0, model(x, counted)[1].double() * n, 0.0)
        return torch.stack([mean, nats, nbytes.sum().double()])
    losses = model(x, y, per_token=True)[1].double()
    return torch.stack([losses.sum() / (y >= 0).sum(), (losses * (counted >= 0)).sum(), nbytes.sum().double()])


# ----------------------------------------------------------------------------------------------------------------------
# SpikeGuard


OUTLIER_WINDOW = 128  # steps of history behind a z-score, as in llm.c


class OutlierDetector:
    """z-score of a value against its last OUTLIER_WINDOW values, as llm.c's -sl/-sg update skipping computes it.
    0 until the window is full, so nothing is skipped early in a run; a NaN or inf never enters the window."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def __call__(self, x: float) -> float:
        if not math.isfinite(x):
            return 0.0
        full = len(self.values) >= OUTLIER_WINDOW
        self.values = (self.values + [x])[-OUTLIER_WINDOW:]
        mean = sum(self.values) / len(self.values)
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / len(self.values))
        return (x - mean) / std if full and std > 0 else 0.0


class SpikeGuard:
    """llm.c's spike guard: no update from a step whose loss or gradient norm z-score exceeds --skip-loss-z /
    --skip-norm-z. Its history is kept and checkpointed even when it is off, so a resumed run can turn it on."""

    def __init__(self, skip_loss_z: float = 0.0, skip_norm_z: float = 0.0, world: int = 1):
        self.skip_loss_z, self.skip_norm_z, self.world = skip_loss_z, skip_norm_z, world
        self.on = skip_loss_z > 0 or skip_norm_z > 0  # deciding syncs the host on loss and norm: only when asked
        self.detectors = {"loss": OutlierDetector(), "norm": OutlierDetector()}
        self.skipped = ""  # why this step's update was dropped, or ""

    def for_step(self) -> Callable[[torch.Tensor, torch.Tensor], bool] | None:
        """train_step's `update` for the next step (None when the guard is off), with no skip recorded yet."""
        self.skipped = ""
        return self.update if self.on else None

    def update(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """train_step's `update`: whether to apply this step. Every rank must decide the same, so both figures are
        averaged over the ranks in one all-reduce, which hands every rank the same history and verdict."""
        stats = all_sum(torch.stack([loss.detach().float(), norm.detach().float()]), self.world) / self.world
        mean_loss, mean_norm = stats.tolist()
        z_loss, z_norm = self.detectors["loss"](mean_loss), self.detectors["norm"](mean_norm)
        self.skipped = next((f"{what} z-score {z:.1f} > {limit}" for what, z, limit in
                             (("loss", z_loss, self.skip_loss_z), ("grad norm", z_norm, self.skip_norm_z))
                             if 0 < limit < z), "")
        return not self.skipped

    def observe(self, loss: float, norm: float) -> None:
        """With the guard off, the history still grows, from values read anyway (no extra sync)."""
        if not self.on:
            self.detectors["loss"](loss)
            self.detectors["norm"](norm)

    def state_dict(self) -> dict[str, list[float]]:
        return {name: d.values for name, d in self.detectors.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        for name, detector in self.detectors.items():
            detector.values = [float(v) for v in state.get(name, [])]


# ----------------------------------------------------------------------------------------------------------------------
# StopFlags


class StopFlags:
    """SIGTERM, Ctrl-C and the wall-clock budget, checked once per step and agreed across ranks; a context manager
    that installs its handlers. A Ctrl-C after any stop signal quits at once (the rules: docs/resume.md)."""

    def __init__(self, max_minutes: float, interrupt: bool = True, master: bool = True,
                 device: torch.device | None = None, world: int = 1):
        self.term: str | None = None  # the first signal this rank received: "SIGTERM" or "SIGINT"
        self.reason = ""  # after should_stop said stop, why: SIGTERM if any rank had it, else Ctrl-C, else --max-time
        self.master, self.interrupt, self.device, self.world = master, interrupt, device, world
        self.max_minutes = max_minutes
        self.last = False  # set when no step is left to stop after: Ctrl-C then quits at once
        self.deadline = time.time() + 60 * max_minutes if max_minutes > 0 else math.inf
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> StopFlags:
        self._streams = sys.stdout, sys.stderr
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            self._saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
            signal.signal(signal.SIGTERM, self._on_signal)
            # not for --eval-only (no step to stop after), nor where SIGINT is ignored (nohup, a job started with &)
            if self.interrupt and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        # left installed, the handlers would swallow SIGTERM in the process that goes on (tests, a notebook)
        for sig, handler in self._saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        sys.stdout, sys.stderr = self._streams

    def _on_signal(self, signum: int, *_: Any) -> None:
        name = signal.Signals(signum).name
        if (self.term is not None and "SIGINT" in (name, self.term)) or (self.last and name == "SIGINT"):
            raise KeyboardInterrupt  # a second Ctrl-C, here or (as SIGTERM) through torchrun, or nothing to stop
        if self.term is None:
            # the same Ctrl-C kills a `| tee` of this run's output: from here on output without a reader is dropped
            sys.stdout, sys.stderr = (_PipeGuard(s) if s is not None else None for s in (sys.stdout, sys.stderr))
        if name == "SIGINT" and self.master:  # os.write, not print: a handler that prints can land inside a print
            with contextlib.suppress(OSError):
                os.write(2, b"\nCtrl-C: stopping after this step, with a checkpoint; Ctrl-C again quits now\n")
        self.term = self.term or name

    def should_stop(self) -> str | None:
        """"signal", "max_time" or None, the same on every rank: one rank's signal stops them all at this step."""
        flags = [self.term == "SIGTERM", self.term == "SIGINT", time.time() > self.deadline]
        if self.world > 1:  # one rank has nothing to agree with: no device round trip each step
            flags = (all_sum(torch.tensor(flags, dtype=torch.float32, device=self.device), self.world) > 0).tolist()
        self.reason = "SIGTERM" if flags[0] else "Ctrl-C" if flags[1] else f"--max-time {self.max_minutes} min"
        return "signal" if flags[0] or flags[1] else "max_time" if flags[2] else None


class _PipeGuard:
    """A text stream that, once its reader is gone (EPIPE), points its file descriptor at /dev/null and goes on, so
    that neither a later print nor the interpreter's flush at exit fails."""

    def __init__(self, stream: Any):
        self.stream = stream

    def _guarded(self, call: Callable[[], Any], default: Any = None) -> Any:
        try:
            return call()
        except BrokenPipeError:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), self.stream.fileno())
            return default

    def write(self, text: str) -> int:
        return self._guarded(lambda: self.stream.write(text), len(text))

    def flush(self) -> None:
        self._guarded(self.stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


# ----------------------------------------------------------------------------------------------------------------------
# Profiler


class Profiler:
    """--profile: a Chrome/Perfetto trace of --profile-steps steps from two steps in (after compile and warmup)."""

    def __init__(self, enabled: bool, start_step: int, steps: int, out_dir: Path, rank: int = 0):
        self.enabled, self.at, self.steps, self.out_dir, self.rank = enabled, start_step + 2, steps, out_dir, rank
        self.prof: torch.profiler.profile | None = None

    def step_begins(self, step: int) -> None:
        if self.enabled and step == self.at:
            self.prof = torch.profiler.profile(record_shapes=True)  # the CPU, and CUDA where there is one
            self.prof.start()

    def step_ends(self, step: int, finished: bool = False) -> None:
        """Write the trace after the last profiled step, or when the run finished before it."""
        if self.prof is None or not (finished or step == self.at + self.steps - 1):
            return
        self.prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)  # on another node the master's out_dir may not exist
        trace = self.out_dir / f"trace_rank{self.rank}.json"
        self.prof.export_chrome_trace(str(trace))
        if self.rank == 0:
            sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            print(self.prof.key_averages().table(sort_by=sort, row_limit=15))
            print(f"profile: trace written to {trace} (open in chrome://tracing or ui.perfetto.dev)")
        self.prof, self.enabled = None, False  # written: finish has nothing more to say

    def finish(self, step: int) -> None:
        """The run ended: keep what was recorded, or say that nothing was."""
        if self.enabled and self.prof is None and self.rank == 0 and step <= self.at:  # enabled: a training run
            print(f"profile: nothing recorded; the run ended before step {self.at}, where profiling starts")
        self.step_ends(step, finished=True)


# ----------------------------------------------------------------------------------------------------------------------
# Agreement across ranks: one fingerprint of what every rank must share, compared once


def command_of(args: Any) -> dict[str, str]:
    """The config as every node must share it: the fields not marked LOCAL (a path, or a rank's own setting: what
    a path names is compared as data, weights or examples instead), nor holding another class's flags."""
    hints = get_type_hints(type(args), include_extras=True)
    nested = {f.name for f in dataclasses.fields(args) if "flags_of" in f.metadata}
    return {key: repr(value) for key, value in dataclasses.asdict(args).items()  # repr: a NaN equals itself
            if LOCAL not in getattr(hints.get(key), "__metadata__", ()) and key not in nested}


def shards_of(loaders: list[Any]) -> list[tuple]:
    """(split, shard names, token counts, CRCs of their ends) of each loader: a shard missing on one node would index
    other windows, one of other tokens would train the replicas apart."""
    return [(s["split"], s["shards"], s["shard_tokens"], s["shard_crc32"])
            for s in (loader.state_dict() for loader in loaders)]


def weights_digest(model: nn.Module | Iterable[torch.Tensor]) -> str:
    """A digest of the parameters' bytes (or the tensors'): exact where a float sum is not."""
    digest = hashlib.sha1()
    for p in model.parameters() if isinstance(model, nn.Module) else model:
        digest.update(p.detach().contiguous().view(torch.uint8).cpu().numpy())
    return digest.hexdigest()[:16]


def agree_fingerprint(make: Callable[[], dict[str, Any]], rank: int, world: int, weights_source: str = "") -> None:
    """Compare this rank's make() -> {"command", "data", "weights", ...} with rank 0's, once: the first difference on
    any rank (a collective would hang, or replicas drift apart) stops every rank with one line. One process makes none
    (a 1.5B weights digest takes seconds)."""
    if world == 1:
        return
    fingerprint = make()
    first = [fingerprint]  # rank 0's on every rank, once broadcast
    dist.broadcast_object_list(first, src=0)
    mine = next((common.describe_difference(key, fingerprint[key], first[0].get(key), rank, weights_source)
                 for key in fingerprint if fingerprint[key] != first[0].get(key)), None)  # the first key that differs
    answers: list[str | None] = [None] * world
    dist.all_gather_object(answers, mine)
    if problem := next((a for a in answers if a), None):
        raise ValueError(problem)
