"""--tensorboard and --wandb: the same scalars as log.jsonl, read back from the event files and the offline W&B run."""

import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import trackers
import train
from common import iter_log

ROOT = Path(__file__).resolve().parents[1]
HELLASWAG = ROOT / "tests" / "data" / "hellaswag_tiny.jsonl"


def run_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--data", str(data), "--out-dir", str(out), "--max-steps=4", "--eval-every=2",
            "--ckpt-every=2", f"--hellaswag={HELLASWAG}", "--hellaswag-every=2", *extra]


def expected_scalars(log: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from log.jsonl, as trackers.scalars names them."""
    want: dict[str, dict[int, float]] = {}
    for record in iter_log(log):
        for tag, value in trackers.scalars(record).items():
            want.setdefault(tag, {})[record["step"]] = value
    return want


def wandb_history(run_file: Path, timeout: float = 60.0, rows_of: str = "history") -> list[dict]:
    """The history (or config) rows of an offline run's .wandb file: a LevelDB-style log of Record protos (32 KiB
    blocks, a 7-byte header per chunk), after W&B's own 7-byte file header. W&B's service process can still be writing
    the file when run.finish() has returned (a resumed run's rows were missing 2 times in 5 on 2 busy cores): it is read
    again until its exit record, W&B's last, is there."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout
    while True:
        data = run_file.read_bytes()
        assert data[:4] == b":W&B"
        rows, pos, chunks, ended = [], 7, b"", False
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4) and pos <= len(data):  # a FULL record, or the LAST chunk of one, written whole
                record = pb.Record()
                record.ParseFromString(chunks)
                chunks = b""
                ended = ended or record.WhichOneof("record_type") == "exit"
                if record.WhichOneof("record_type") == rows_of:
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                 for item in (record.history.item if rows_of == "history" else record.config.update)})
        if ended:
            return rows
        assert time.monotonic() < deadline, f"{run_file} has no exit record {timeout:.0f} s after run.finish()"
        time.sleep(0.1)


def test_scalars_are_named_by_record_type():
    assert trackers.scalars({"type": "train", "step": 3, "tokens": 2048, "loss": 10.5, "lr": 1e-3, "grad_norm": 0.5,
                             "ms": 12.0, "tok_s": 1000.0, "mfu": None}) == \
        {"train/loss": 10.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/tok_s": 1000.0}
    assert trackers.scalars({"type": "train", "step": 3, "loss": 10.5, "ms": 12.0, "tok_s": 1000.0, "mfu": 0.42}) == \
        {"train/loss": 10.5, "train/tok_s": 1000.0, "train/mfu": 0.42}  # on a GPU the table knows: MFU is charted
    assert trackers.scalars({"type": "val", "step": 4, "tokens": 0, "val_loss": 9.25, "val_bpb": 3.5}) == \
        {"val/loss": 9.25, "val/bpb": 3.5}
    assert trackers.scalars({"type": "hellaswag", "step": 4, "acc": 0.5, "acc_norm": 0.25, "n": 6,
                             "examples_per_sec": 3.0}) == {"hellaswag/acc": 0.5, "hellaswag/acc_norm": 0.25}
    assert trackers.scalars({"type": "sample", "step": 4, "texts": ["a"]}) == {}
    # rl.py's step and its held-out evaluation: what the issue asks TensorBoard and W&B to show
    rl_step = {"type": "train", "step": 5, "tokens": 512, "loss": 0.01, "grad_norm": 0.9, "clip_frac": 0.02,
               "reward": 0.25, "reward_std": 0.4, "kl": 0.03, "entropy": 0.5, "length": 3.5, "rollout_tok_s": 700.0,
               "update_tok_s": 1000.0, "lr": 3e-4, "ms": 9.0, "tok_s": 500.0, "mfu": None, "reward/exact": 0.5,
               "reward/short_2": 0.0}  # each --reward function's mean (tasks.checked's names)
    assert trackers.scalars(rl_step) == {f"train/{k}": float(v) for k, v in rl_step.items()
                                         if k not in ("type", "step", "tokens", "ms", "mfu")}
    assert trackers.scalars({"type": "task", "step": 5, "tokens": 512, "acc": 0.5, "n": 256, "pass@8": 0.75}) == \
        {"task/acc": 0.5, "task/pass@8": 0.75}
    assert trackers.scalars({"type": "val", "step": 4, "val_loss": 0.6, "val_accuracy": 0.7, "val_margin": 0.2}) == \
        {"val/loss": 0.6, "val/accuracy": 0.7, "val/margin": 0.2}
    # DPO's held-out rewards of each side and its sft term (TRL's eval rewards/chosen, rewards/rejected)
    dpo_val = {"val_loss": 0.9, "val_chosen_reward": -0.1, "val_rejected_reward": -0.3, "val_nll": 0.4}
    assert trackers.scalars({"type": "val", "step": 4, **dpo_val}) == {f"val/{k[4:]}": v for k, v in dpo_val.items()}
    # prune.py's: the sparsity its log.jsonl records at every evaluation
    assert trackers.scalars({"type": "val", "step": 4, "val_loss": 6.4, "val_bpb": 2.6, "sparsity": 0.5}) == \
        {"val/loss": 6.4, "val/bpb": 2.6, "val/sparsity": 0.5}
    # ChatCORE (sft.py/prefs.py --task A,B) and CORE: the mean and each task's accuracy
    assert trackers.scalars({"type": "chatcore", "step": 5, "results": {"mmlu": 0.5, "gsm8k": 0.25},
                             "centered_results": {"mmlu": 1 / 3, "gsm8k": 0.25}, "chatcore": 0.29}) == \
        {"chatcore/chatcore": 0.29, "chatcore/mmlu": 0.5, "chatcore/gsm8k": 0.25}
    assert trackers.scalars({"type": "core", "step": 5, "results": {"arc_easy": 0.4}, "core_metric": 0.2}) == \
        {"core/metric": 0.2, "core/arc_easy": 0.4}


def test_a_metric_a_stage_adds_to_its_record_reaches_the_trackers_with_no_list_to_extend():
    # a researcher's new figure on sft.py's task eval, and a new Eval's record type: log.jsonl has them, so the
    # trackers do (a list of known names dropped both without a word); counters and timings stay out
    assert trackers.scalars({"type": "task", "step": 5, "tokens": 512, "acc": 0.5, "n": 8, "reply_len": 10.0}) == \
        {"task/acc": 0.5, "task/reply_len": 10.0}
    assert trackers.scalars({"type": "probe", "step": 5, "tokens": 512, "probe_auc": 0.75, "n": 64}) == \
        {"probe/auc": 0.75}


def test_the_step_line_shows_the_records_figures_and_an_eta_from_the_median_of_the_last_20_timed_steps(tmp_path,
                                                                                                   capsys):
    log = trackers.RunLog(tmp_path / "log.jsonl", True, max_steps=10_000, log_every=1, trackers=[])
    record = {"loss": 2.5, "lr": 3e-4, "grad_norm": 0.75, "tok_s": 12345.6, "mfu": None}
    log.step(0, {**record, "ms": 90_000.0})  # the first step's compile: not in the ETA once there is another
    for step in range(1, 25):  # 1-4 slow (10 s), then 20 at 100-119 ms
        log.step(step, {**record, "ms": 10_000.0 if step < 5 else 95.0 + step})
    log.step(25, {**record, "loss": 1.25, "ms": 120.0, "mfu": 0.4567})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 26
    # step 0: its own 90 s x 9,999 steps left; step 1: 10 s (step 0's 90 s left out) x 9,998; step 25: the last 20
    # timed steps (101-120 ms) have the median-high 111 ms, x 9,974 steps left = 1,107 s
    assert [lines[i] for i in (0, 1, 25)] == [
        "step      0/10000 | loss 2.5000 | lr 3.00e-04 | norm 0.750 | 90000.0 ms | 12,346 tok/s | mfu n/a | eta "
        "249h58m",
        "step      1/10000 | loss 2.5000 | lr 3.00e-04 | norm 0.750 | 10000.0 ms | 12,346 tok/s | mfu n/a | eta "
        "27h46m",
        "step     25/10000 | loss 1.2500 | lr 3.00e-04 | norm 0.750 |   120.0 ms | 12,346 tok/s | mfu 45.7% | eta "
        "18m27s"]
    assert log.losses == [2.5] * 25 + [1.25]
    assert [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()] == list(range(26))
    # every --log-every steps, and the last step whatever --log-every
    log = trackers.RunLog(None, True, max_steps=10, log_every=4, trackers=[])
    for step in range(10):
        log.step(step, {**record, "ms": 100.0})
    assert [line.split("/")[0] for line in capsys.readouterr().out.splitlines()] == [
        f"step {step:6d}" for step in (0, 4, 8, 9)]
    assert (trackers.fmt_time(3599.9), trackers.fmt_time(3600), trackers.fmt_time(7322)) == ("59m59s", "1h00m", "2h02m")
    assert (trackers.fmt_time(0), trackers.fmt_time(65)) == ("0m00s", "1m05s")


def test_the_eta_takes_the_median_of_exactly_the_20_steps_before_and_at_this_one(capsys):
    # steps 1-20: one slow (200 ms), ten at 100 ms, nine at 200 ms. All 20 have the median-high 200 ms; the last 19
    # would give 100 ms. 1,000 steps left at step 20: 200 s
    log = trackers.RunLog(None, True, max_steps=1021, log_every=20, trackers=[])
    record = {"loss": 2.5, "lr": 3e-4, "grad_norm": 0.75, "tok_s": 1.0, "mfu": None}
    for step, ms in enumerate([5000.0, 200.0, *[100.0] * 10, *[200.0] * 9]):
        log.step(step, {**record, "ms": ms})
    assert capsys.readouterr().out.splitlines()[-1].endswith("| eta 3m20s")

def test_a_dead_rewinds_set_aside_records_come_back_to_the_trackers_from_their_first_step(tmp_path, monkeypatch):
    # a run logged steps 0-7 (ckpt 8); a rewind to ckpt 4 set 4-7 aside in log.jsonl.rewound, logged 4 and 5 anew and
    # died before its first checkpoint; the next run resumes ckpt 8, puts 4-7 back, and the trackers (whose event
    # files it hides from step 4 on) get all four again, step 4 too
    made = []

    class Tracker:
        def __init__(self, out_dir: Path, forget: int):
            self.forget, self.steps = forget, []
            made.append(self)

        def write(self, record: dict) -> None:
            self.steps.append(record["step"])

        def close(self) -> None:
            pass

    monkeypatch.setattr(trackers, "TensorBoard", Tracker)
    train = lambda step, loss: {"type": "train", "step": step, "loss": loss}
    cfg = eight_logged_steps(tmp_path, (4, 8))
    rewind = trackers.open_run_log(cfg, 4, True, 0, 1)  # sets 4-7 aside, logs 4 and 5 anew, dies
    rewind.write(train(4, 9.0))
    rewind.write(train(5, 9.0))
    cfg.tensorboard = True
    trackers.open_run_log(cfg, 8, False, 0, 1).close()
    assert [(t.forget, t.steps) for t in made] == [(4, [4, 5, 6, 7])]
    assert [(r["step"], r.get("loss")) for r in iter_log(tmp_path / "log.jsonl")] == [
        (0, None), *((step, 1.0) for step in range(8))]
    assert not (tmp_path / "log.jsonl.rewound").exists()
    # a side file of the code before the mark (unmarked, written after ckpt 8): its records come back all the same
    (old := tmp_path / "old").mkdir()
    before = eight_logged_steps(old, (8,))
    trackers.write_records(old / "log.jsonl", [*iter_log(old / "log.jsonl")][:5] + [train(4, 9.0), train(5, 9.0)])
    trackers.write_records(old / "log.jsonl.rewound", [train(s, 2.0) for s in range(4, 8)])
    trackers.open_run_log(before, 8, False, 0, 1).close()
    assert [(r["step"], r.get("loss")) for r in iter_log(old / "log.jsonl")] == [
        (0, None), *((step, 1.0) for step in range(4)), *((step, 2.0) for step in range(4, 8))]
    # not a dead one: a rewind that checkpointed (its ckpt 6 written after its side file), killed before it dropped the
    # file, owns the log: resuming its ckpt 6 keeps its own 4 and 5, and the steps it set aside are no one's
    live = tmp_path / "live"
    live.mkdir()
    trackers.write_records(live / "log.jsonl", [{"type": "config", "step": 0}, *(train(s, 1.0) for s in range(4)),
                                                train(4, 9.0), train(5, 9.0)])
    trackers.write_records(live / "log.jsonl.rewound", [train(s, 2.0) for s in range(4, 8)])
    for second, name in enumerate(("ckpt_000004.pt", "log.jsonl.rewound", "ckpt_000006.pt")):
        (live / name).touch()
        os.utime(live / name, ns=(second * 10**9, second * 10**9))
    trackers.open_run_log(SimpleNamespace(**{**vars(cfg), "out_dir": str(live)}), 6, False, 0, 1).close()
    assert [(r["step"], r.get("loss")) for r in iter_log(live / "log.jsonl")] == [
        (0, None), (0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 9.0), (5, 9.0)]
    assert (made[-1].forget, made[-1].steps) == (6, []) and not (live / "log.jsonl.rewound").exists()


def test_tensorboard_and_wandb_log_what_log_jsonl_logs_across_a_resume(token_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="--wandb is an optional extra (pip install wandb)")
    pytest.importorskip("tensorboard", reason="--tensorboard is an optional extra (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    (tmp_path / "wandb_dir").mkdir()
    out = tmp_path / "run"
    train.main(run_args(token_data, out, "--tensorboard", "--wandb", "tests"))
    # an interruption after step 3 that lost the last checkpoint: the resume re-logs steps 2-4, with other timings
    (out / "ckpt_000004.pt").unlink()
    train.main(run_args(token_data, out, "--tensorboard", "--wandb", "tests", "--resume", "auto"))
    want = expected_scalars(out / "log.jsonl")
    assert set(want) == {"train/loss", "train/lr", "train/grad_norm", "train/tok_s", "val/loss", "val/bpb",
                         "hellaswag/acc", "hellaswag/acc_norm"}  # no MFU on a CPU
    assert sorted(want["train/loss"]) == [0, 1, 2, 3] and sorted(want["hellaswag/acc_norm"]) == [0, 2, 4]

    # TensorBoard: one value per step (the resume purged the interrupted run's 2-4), in float32
    events = EventAccumulator(str(out))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(want)
    for tag, by_step in want.items():
        scalars = events.Scalars(tag)
        got = {e.step: e.value for e in scalars}
        assert len(scalars) == len(got), tag  # a dict keeps a step's last value: two of a step would pass it
        assert got == {step: float(np.float32(v)) for step, v in by_step.items()}, tag
    assert len(list(out.glob("events.out.tfevents.*"))) == 2

    # W&B: two offline runs with the run id kept in the out dir; the later row of a step is the resumed run's
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = sorted((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(run.name.endswith("-" + run_id) for run in runs)
    got: dict[str, dict[int, float]] = {}
    for run in runs:
        assert (run / f"run-{run_id}.wandb").is_file() and (run / "files").is_dir()
        for row in wandb_history(run / f"run-{run_id}.wandb"):
            for tag, value in row.items():
                if not tag.startswith("_"):
                    got.setdefault(tag, {})[row["_step"]] = value
    assert got == want  # exact: W&B keeps the float64
    # each run's config holds its config record's keys: its command and what its flags came to, not only the flags
    configs = [{k: v for row in wandb_history(run / f"run-{run_id}.wandb", rows_of="config") for k, v in row.items()}
               for run in runs]
    records = [r for r in iter_log(out / "log.jsonl") if r["type"] == "config"]
    assert sorted((c["argv"], c["resolved"]) for c in configs) == sorted((r["argv"], r["resolved"]) for r in records)
    assert [r["argv"][-2:] for r in records] == [["--wandb", "tests"], ["--resume", "auto"]]


@pytest.mark.parametrize("flag, package", [("--tensorboard", "tensorboard"), ("--wandb=proj", "wandb")])
def test_a_missing_tracker_package_is_one_line_before_anything_runs(token_data, tmp_path, capsys, monkeypatch, flag,
                                                                    package):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now raises ImportError
    with pytest.raises(SystemExit) as e:
        train.main(run_args(token_data, tmp_path / "run", flag))
    assert e.value.code == 1
    name = flag.split("=")[0]
    assert capsys.readouterr().err == f"error: {name} needs the {package} package: pip install {package}\n"
    assert not (tmp_path / "run").exists()


def test_wandb_that_cannot_start_is_one_line_before_training(token_data, tmp_path, capsys, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="--wandb is an optional extra (pip install wandb)")

    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    with pytest.raises(SystemExit) as e:
        train.main(run_args(token_data, tmp_path / "run", "--wandb=proj"))
    assert e.value.code == 1
    assert capsys.readouterr().err == ("error: --wandb proj: W&B did not start (No API key configured. Use `wandb "
                                       "login` to log in.); run `wandb login`, or set WANDB_MODE=offline to log "
                                       "without an account\n")
    assert not (tmp_path / "run" / "log.jsonl").exists()  # refused before the log, let alone a step


def test_a_failed_event_file_write_is_one_line_naming_it_without_the_threads_traceback(tmp_path, capfd, monkeypatch):
    # a full disk under --tensorboard: the writer thread's traceback came first, then the run's own
    pytest.importorskip("tensorboard", reason="--tensorboard is an optional extra (pip install tensorboard)")
    import threading
    import time

    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(type(args.exc_value)))  # a user's own hook
    log = trackers.RunLog(tmp_path / "log.jsonl", True, 10, 1, [trackers.TensorBoard(tmp_path, None)])
    record = {"type": "train", "step": 0, "loss": 1.0}
    log.write(record)
    log.trackers[0].writer.flush()
    (events,) = tmp_path.glob("events.out.tfevents.*")
    events.unlink()
    events.mkdir()  # the thread opens the file for each write: now it cannot
    with pytest.raises(ValueError) as error:
        for step in range(1, 200):
            log.write({**record, "step": step})
            time.sleep(0.01)  # the thread fails in its own time; the next write raises its error
    assert str(error.value) == f"cannot append to {events}: EISDIR (Is a directory); check the disk, then --resume auto"
    assert capfd.readouterr().err == ""
    with pytest.raises(ValueError, match=f"^cannot append to {events}: EISDIR"):
        log.close()
    thread = threading.Thread(target=lambda: 1 / 0)  # another thread's error still reaches the user's hook
    thread.start()
    thread.join()
    assert seen == [ZeroDivisionError]


def test_a_rewind_keeps_the_evaluations_of_its_step_that_it_does_not_make_again(tmp_path):
    # a run finished at step 3 (its final val there), extended to 6, then rewound to ckpt 3: the val at 3 is of the
    # checkpoint's own weights, but not due again under --eval-every 2, so the log puts the record back; the extended
    # run's final val at 6 is of weights the rewind drops: it goes with them
    val, train = {"type": "val", "step": 3, "val_loss": 4.5}, lambda step: {"type": "train", "step": step, "loss": 1.0}
    trackers.write_records(tmp_path / "log.jsonl", [{"type": "config", "step": 0}, *map(train, range(3)), val,
                                                    *map(train, range(3, 6)), {**val, "step": 6, "val_loss": 4.0}])
    cfg = SimpleNamespace(out_dir=str(tmp_path), eval_only=False, max_steps=6, log_every=1, tensorboard=False,
                          wandb="")
    log = trackers.open_run_log(cfg, 3, True, 0, 1)
    log.step(3, {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "ms": 1.0, "tok_s": 1.0, "mfu": None})
    log.checkpointed()
    log.close()
    assert [(r["type"], r["step"]) for r in iter_log(tmp_path / "log.jsonl")][1:] == [
        ("train", 0), ("train", 1), ("train", 2), ("val", 3), ("train", 3)]
    assert not (tmp_path / "log.jsonl.rewound").exists()


def test_a_resumed_runs_held_evaluations_stay_in_the_log_until_made_again(tmp_path, monkeypatch):
    # a run finished at step 3 (val and hellaswag there) is extended: a SIGKILL before its first step (no close) leaves
    # both in log.jsonl; then a val made again at 3 replaces its own, and the hellaswag not due again stays, once
    sent = []
    monkeypatch.setattr(trackers, "TensorBoard", lambda out_dir, forget: SimpleNamespace(
        write=lambda record: sent.append((record["type"], record["step"])), close=lambda: None))
    val, hellaswag = {"type": "val", "step": 3, "val_loss": 4.5}, {"type": "hellaswag", "step": 3, "acc": 0.25}
    records = [{"type": "config", "step": 0}, *({"type": "train", "step": s, "loss": 1.0} for s in range(3)), val,
               hellaswag]
    trackers.write_records(tmp_path / "log.jsonl", records)
    cfg = SimpleNamespace(out_dir=str(tmp_path), eval_only=False, max_steps=6, log_every=1, tensorboard=True,
                          wandb="")
    trackers.open_run_log(cfg, 3, False, 0, 1)  # killed here
    assert list(iter_log(tmp_path / "log.jsonl")) == records
    log = trackers.open_run_log(cfg, 3, False, 0, 1)
    log.write({**val, "val_loss": 4.0})  # due again at 3
    assert list(iter_log(tmp_path / "log.jsonl")) == [*records[:4], hellaswag, {**val, "val_loss": 4.0}]
    log.step(3, {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "ms": 1.0, "tok_s": 1.0, "mfu": None})
    log.close()
    assert [(r["type"], r["step"]) for r in iter_log(tmp_path / "log.jsonl")][4:] == [
        ("val", 3), ("hellaswag", 3), ("train", 3)]
    assert sent == [("val", 3), ("hellaswag", 3), ("train", 3)]  # the trackers get each once


def test_two_rewinds_that_die_before_a_checkpoint_lose_no_logged_step(tmp_path):
    # a run logged steps 0-7 (ckpts 2, 4, 8); a rewind to 4 sets 4-7 aside, logs 4 anew and dies; a rewind to 2 logs 2
    # anew and dies too; resuming ckpt 8 brings back the run's own 0-7, steps 2 and 3 too
    for step in (2, 4, 8):
        (tmp_path / f"ckpt_{step:06d}.pt").write_bytes(b"")
        os.utime(tmp_path / f"ckpt_{step:06d}.pt", ns=(0, 0))  # before the rewinds
    train = lambda step, loss=1.0: {"type": "train", "step": step, "loss": loss}
    trackers.write_records(tmp_path / "log.jsonl", [{"type": "config", "step": 0}, *map(train, range(8))])
    cfg = SimpleNamespace(out_dir=str(tmp_path), eval_only=False, max_steps=10, log_every=1, tensorboard=False,
                          wandb="")
    for step, rewinding in ((4, True), (2, True), (8, False)):
        log = trackers.open_run_log(cfg, step, rewinding, 0, 1)
        if rewinding:
            log.write(train(step, 9.0))  # then killed
    log.close()
    assert [(r["step"], r.get("loss")) for r in iter_log(tmp_path / "log.jsonl")] == [
        (0, None), *((step, 1.0) for step in range(8))]


def train_record(step, loss=1.0):
    return {"type": "train", "step": step, "loss": loss}


def eight_logged_steps(tmp_path, ckpts):
    """A log of steps 0-7 (loss 1.0), checkpoints at `ckpts` older than any side file, and the resumes' flags."""
    for step in ckpts:
        (tmp_path / f"ckpt_{step:06d}.pt").write_bytes(b"")
        os.utime(tmp_path / f"ckpt_{step:06d}.pt", ns=(0, 0))
    trackers.write_records(tmp_path / "log.jsonl", [{"type": "config", "step": 0}, *map(train_record, range(8))])
    return SimpleNamespace(out_dir=str(tmp_path), eval_only=False, max_steps=10, log_every=1, tensorboard=False,
                           wandb="")


def open_killed_at_the_log_rewrite(monkeypatch, cfg, step, rewinding):
    """open_run_log, SIGKILLed as it rewrites log.jsonl (after its side file is written or dropped)."""
    write_records = trackers.write_records

    def killed(path, records):
        if path.name == "log.jsonl":
            raise KeyboardInterrupt  # SIGKILL
        write_records(path, records)

    monkeypatch.setattr(trackers, "write_records", killed)
    with pytest.raises(KeyboardInterrupt):
        trackers.open_run_log(cfg, step, rewinding, 0, 1)
    monkeypatch.setattr(trackers, "write_records", write_records)


def test_a_rewinds_side_file_in_its_checkpoints_clock_tick_is_ordered_by_what_it_found(tmp_path):
    # a rewind to 4 sets 4-7 aside and dies; on a coarse clock (1 s on HFS+, 2 s on FAT) its side file had ckpt 8's
    # mtime, was taken for older, and resuming ckpt 8 dropped 4-7 with it (the log held the dead rewind's 4)
    cfg = eight_logged_steps(tmp_path, (4, 8))
    trackers.open_run_log(cfg, 4, True, 0, 1).write(train_record(4, 9.0))  # then killed
    tick = (tmp_path / "ckpt_000008.pt").stat().st_mtime_ns
    os.utime(tmp_path / "log.jsonl.rewound", ns=(tick, tick))
    trackers.open_run_log(cfg, 8, False, 0, 1).close()
    assert [(r["step"], r.get("loss")) for r in iter_log(tmp_path / "log.jsonl")] == [
        (0, None), *((step, 1.0) for step in range(8))]
    # a rewind that wrote its ckpt 6 in that tick, killed before it dropped the side file, owns the log
    trackers.open_run_log(cfg, 4, True, 0, 1).write(train_record(4, 9.0))
    (tmp_path / "ckpt_000006.pt").write_bytes(b"")
    for name in ("ckpt_000006.pt", "log.jsonl.rewound"):
        os.utime(tmp_path / name, ns=(10**9, 10**9))
    trackers.open_run_log(cfg, 6, False, 0, 1).close()
    assert [(r["step"], r.get("loss")) for r in iter_log(tmp_path / "log.jsonl")] == [
        (0, None), *((step, 1.0) for step in range(4)), (4, 9.0)]
    assert not (tmp_path / "log.jsonl.rewound").exists()


def test_a_dead_rewinds_records_come_back_in_a_run_directory_copied_with_its_file_times(tmp_path):
    # the mark held the newest checkpoint's inode: `cp -a` (or a restore) gave it another, the side file was dropped,
    # and the log kept the dead rewind's 4 with 5-7 lost; docs/resume.md: a copy with its file times keeps the order
    cfg = eight_logged_steps(tmp_path, (4, 8))
    trackers.open_run_log(cfg, 4, True, 0, 1).write(train_record(4, 9.0))  # then killed
    shutil.copy2(tmp_path / "ckpt_000008.pt", tmp_path / "copy.pt")
    os.replace(tmp_path / "copy.pt", tmp_path / "ckpt_000008.pt")  # the same name and times, another inode
    trackers.open_run_log(cfg, 8, False, 0, 1).close()
    assert [(r["step"], r.get("loss")) for r in iter_log(tmp_path / "log.jsonl")] == [
        (0, None), *((step, 1.0) for step in range(8))]


def test_a_resume_killed_as_it_takes_back_a_dead_rewinds_records_loses_none(tmp_path, monkeypatch):
    # a rewind to 4 sets 4-7 aside and dies; resuming ckpt 8 takes them back: killed between dropping
    # log.jsonl.rewound and rewriting log.jsonl, 4-7 must still be somewhere, so the next resume finds them
    cfg = eight_logged_steps(tmp_path, (4, 8))
    trackers.open_run_log(cfg, 4, True, 0, 1).write(train_record(4, 9.0))  # then killed
    open_killed_at_the_log_rewrite(monkeypatch, cfg, 8, False)
    trackers.open_run_log(cfg, 8, False, 0, 1).close()
    assert [(r["step"], r.get("loss")) for r in iter_log(tmp_path / "log.jsonl")] == [
        (0, None), *((step, 1.0) for step in range(8))]


def test_a_second_rewind_killed_before_it_cuts_the_log_loses_no_logged_step(tmp_path, monkeypatch):
    # a rewind to 2 sets 2-7 aside, logs 2 and 3 anew and dies; a rewind to 4 sets aside again, killed before it
    # rewrites log.jsonl: the run's own 2 and 3 must still be somewhere for the resume of ckpt 8
    cfg = eight_logged_steps(tmp_path, (2, 4, 8))
    log = trackers.open_run_log(cfg, 2, True, 0, 1)
    log.write(train_record(2, 9.0))
    log.write(train_record(3, 9.0))  # then killed
    open_killed_at_the_log_rewrite(monkeypatch, cfg, 4, True)
    trackers.open_run_log(cfg, 8, False, 0, 1).close()
    assert [(r["step"], r.get("loss")) for r in iter_log(tmp_path / "log.jsonl")] == [
        (0, None), *((step, 1.0) for step in range(8))]


def test_a_symlinked_log_jsonl_stays_a_link_to_the_log(tmp_path):
    # log.jsonl kept elsewhere (another disk) through a link: the rewrites go to the file it names, not over the link
    (tmp_path / "logs").mkdir()
    target, link = tmp_path / "logs" / "run.jsonl", tmp_path / "log.jsonl"
    trackers.write_records(target, [{"type": "config", "step": 0}, {"type": "train", "step": 0}])
    link.symlink_to(target)
    cfg = SimpleNamespace(out_dir=str(tmp_path), eval_only=False, max_steps=6, log_every=1, tensorboard=False,
                          wandb="")
    log = trackers.open_run_log(cfg, 1, False, 0, 1)
    log.write({"type": "train", "step": 1})
    log.close()
    assert link.is_symlink() and [r["step"] for r in iter_log(target)] == [0, 0, 1]
