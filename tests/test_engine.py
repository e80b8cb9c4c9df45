"""The engine serves a stage other than train.py: tests/engine_script.py (its own config, not TrainConfig) trains
through it, and a resume is bitwise."""

import os
import types

import engine_script  # tests/ is on sys.path (conftest.py lives there)
import pytest
import torch

import common
import engine
from model import GPTConfig


def test_a_second_stage_on_the_engine_resumes_bitwise(token_data, tmp_path):
    def run(out: str, *extra: str) -> dict:
        return engine_script.main(["--data", str(token_data), "--out-dir", str(tmp_path / out), "--device=cpu",
                                   "--max-lr=3e-3", "--ckpt-every=3", *extra])

    full = run("full", "--max-steps=6")
    first = run("split", "--max-steps=3")
    rest = run("split", "--max-steps=6", "--resume=auto")
    assert len(full["losses"]) == 6 and full["losses"][-1] < full["losses"][0] - 0.01  # it learns
    assert first["losses"] + rest["losses"] == full["losses"]  # bitwise: weights, AdamW, data position, RNG
    assert rest["val_loss"] == full["val_loss"] and rest["step"] == 6
    assert (tmp_path / "split" / "ckpt_000006.pt").is_file()


def test_attempt_puts_back_a_resumable_errors_draws_and_saves_the_steps_done_other_errors_go_through():
    saved = []
    run = types.SimpleNamespace(start_step=0, checkpoint=saved.append, checkpointer=types.SimpleNamespace(
        due=lambda step: step % 4 == 0, last="out/ckpt_000003.pt"))

    def draws_then(error: Exception):
        def fn():
            torch.rand(3)
            raise error
        return fn

    torch.manual_seed(0)
    before = torch.get_rng_state()
    with pytest.raises(ValueError) as e:
        engine.Run.attempt(run, 3, draws_then(common.ResumableError("boom")))
    assert str(e.value) == ("boom at step 3; out/ckpt_000003.pt holds the steps before it: fix that, then --resume "
                            "auto goes on from there")
    assert torch.equal(torch.get_rng_state(), before) and saved == [3]  # the draws put back, then saved
    with pytest.raises(ValueError, match="^boom at step 4;"):
        engine.Run.attempt(run, 4, draws_then(common.ResumableError("boom")))
    assert saved == [3]  # --ckpt-every 4 wrote ckpt_000004 after step 3: not a second time
    other = ValueError("not a user's code")  # not ResumableError: no claim that a resume goes on, nothing saved
    with pytest.raises(ValueError) as e:
        engine.Run.attempt(run, 5, draws_then(other))
    assert e.value is other and saved == [3]
    run.start_step = 6  # no step done since the run started: nothing to save
    first = common.ResumableError("boom")
    with pytest.raises(ValueError) as e:
        engine.Run.attempt(run, 6, draws_then(first))
    assert e.value is first and saved == [3]
    assert engine.Run.attempt(run, 7, lambda x: x + 1, 1) == 2


def test_the_rng_state_has_the_gpus_in_a_cuda_run_only(monkeypatch):
    # a --device cpu run on a GPU host has no CUDA context: reading the GPU's RNG would make one
    calls = []
    gpu = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *_: calls.append("get") or gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, *_: calls.append(("set", state)))
    rng = engine.rng_state()
    draw = torch.rand(3)
    engine.set_rng_state({"cpu": rng["cpu"], "cuda": gpu})  # a CUDA run's checkpoint resumed on the CPU
    assert rng["cuda"] is None and calls == [] and torch.equal(torch.rand(3), draw)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a CUDA run: both are saved and put back
    rng = engine.rng_state()
    engine.set_rng_state(rng)
    assert rng["cuda"] is gpu and calls == ["get", ("set", gpu)]


def test_a_steps_record_counts_its_tokens_and_reports_the_speed_and_mfu_per_device():
    # 4 ranks trained 494,500 tokens in all in 0.25 s: 1,978,000 tok/s together, 494,500 per device; at 1 GFLOP a
    # token that is 4.945e14 FLOP/s, half an H100's 989 TFLOP/s
    run = types.SimpleNamespace(tokens=engine.TokenCount(1000), ctx=engine.Context(world=4), flops_per_token=1e9,
                                device_name="NVIDIA H100 80GB HBM3", peak_flops=None)
    step = {"loss": 2.5, "tokens": 494_500}
    record = engine.Run.record(run, step, 0.25)
    assert record == {"tokens": 495_500, "loss": 2.5, "ms": 250.0, "tok_s": 1_978_000.0,
                      "mfu": pytest.approx(0.5, rel=1e-3)}
    assert list(record) == ["tokens", "loss", "ms", "tok_s", "mfu"] and step == {"loss": 2.5, "tokens": 494_500}
    # the running count goes on; tok/s is this step's tokens, not the count's; --peak-tflops wins over the table
    run.peak_flops = 1e12
    again = engine.Run.record(run, {"loss": 2.0, "tokens": 1000}, 0.5)
    assert (again["tokens"], again["tok_s"], again["mfu"]) == (496_500, 2000.0, pytest.approx(1e9 * 500 / 1e12))
    run.peak_flops, run.device_name = None, "cpu (2 cores)"  # no peak known: no MFU, not 0
    assert engine.Run.record(run, {"loss": 2.0, "tokens": 1000}, 0.5)["mfu"] is None
    run.flops_per_token, run.peak_flops = 0.0, 1e12  # a stage that reports no FLOP count
    assert engine.Run.record(run, {"loss": 2.0, "tokens": 1000}, 0.5)["mfu"] is None


def test_a_steps_time_is_the_step_alone(monkeypatch):
    # on a clock that the evaluation moves 5 s, the profiler's hook 1 s, the step 0.25 s and the memory probe after it
    # 2 s: each logged step took 0.25 s
    now = [0.0]
    tick = lambda s: now.__setitem__(0, now[0] + s)
    monkeypatch.setattr(engine.time, "time", lambda: now[0])
    logged = []
    run = types.SimpleNamespace(
        stop=types.SimpleNamespace(should_stop=lambda: None), start_step=0, last_step=2,
        attempt=lambda step, fn, *args: fn(*args), evaluate=lambda step, final: tick(5.0),
        profiler=types.SimpleNamespace(step_begins=lambda step: tick(1.0)), step_fn=lambda step: tick(0.25) or {},
        after_step=lambda step: tick(2.0), diverged=lambda step, record: False,
        record=lambda record, dt: {"dt": dt}, log=types.SimpleNamespace(step=lambda step, r: logged.append(r["dt"])),
        checkpointer=types.SimpleNamespace(due=lambda step: False), result=lambda step: step)
    assert engine.train(run) == 2 and logged == [0.25, 0.25]


def test_describe_difference_names_what_differs_for_each_key():
    # agree_fingerprint's one line per key: the command's flags, the first data shard, the weights' digests, any other
    # (the two-process tests reach the weights only in a slow run, and check no digest)
    say = lambda key, mine, first: common.describe_difference(key, mine, first, 1, "--init-from a.pt")
    assert say("command", {"max_lr": "0.003", "seed": "1"}, {"max_lr": "0.001", "seed": "1"}) == (
        "rank 1 was started with --max-lr 0.003 (rank 0: 0.001): every node must run the same command")
    assert say("weights", "d1", "d0") == ("rank 1 loaded other weights from --init-from a.pt than rank 0 (digest d1, "
                                          "rank 0: d0): every node must start from the same model")
    assert say("model", GPTConfig(loss_chunk=128, fused_ce=True), GPTConfig()) == (
        "rank 1 built its model from --init-from a.pt with loss_chunk 128 (rank 0: 0), fused_ce True (rank 0: False): "
        "every node must build the same model (its checkpoint's options, where no flag sets them)")
    ab = ["a.bin", "b.bin"]  # (split, names, token counts, CRCs)
    assert say("data", [("train", ab, [5, 6], [1, 2])], [("train", ab, [5, 7], [1, 2])]) == (
        "rank 1's train shard b.bin holds 6 tokens, rank 0's 7: every node must hold the same --data")
    assert say("data", [("val", ab, [5, 6], [1, 2])], [("val", ab, [5, 6], [3, 4])]) == (
        "rank 1's val shard a.bin holds other tokens than rank 0's, as many: every node must hold the same --data")
    assert say("--task data", "x", "y") == ("rank 1's --task data differs from rank 0's: every node must hold the "
                                            "same --task data")


def test_checkpoints_of_one_mtime_are_in_step_order_past_a_million_steps(tmp_path):
    # a coarse clock (1 s on HFS+, 2 s on FAT) gives checkpoints one mtime: then the step decides, as a number
    steps = (7, 999_999, 1_000_000)
    for step in steps:
        (tmp_path / f"ckpt_{step:06d}.pt").write_bytes(b"")
        os.utime(tmp_path / f"ckpt_{step:06d}.pt", ns=(10**18, 10**18))
    (tmp_path / "ckpt_best.pt").write_bytes(b"")
    assert [p.name for p in common.checkpoints(tmp_path)] == ["ckpt_000007.pt", "ckpt_999999.pt", "ckpt_1000000.pt"]
    os.utime(tmp_path / "ckpt_000007.pt", ns=(2 * 10**18, 2 * 10**18))  # written last: a rewind's
    assert common.checkpoints(tmp_path)[-1].name == "ckpt_000007.pt"
