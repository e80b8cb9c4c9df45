"""Shared fixtures: small token shards on disk, and a runner for train.py under torchrun (gloo, CPU)."""

import contextlib
import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # a worker per core (test.sh): a second thread each would wait for the other worker

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first: two xdist workers then share the long ones, and no long test starts last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# train.py's tiny preset as flags, for the stages without it (sft.py, prefs.py)
TINY = ["--model=tiny", "--seq-len=64", "--total-batch-size=512", "--batch-size=4", "--max-lr=1e-3", "--warmup-steps=2",
        "--max-steps=10", "--eval-every=5", "--eval-tokens=512", "--ckpt-every=0"]


def one_line_error(capsys: pytest.CaptureFixture, main, argv: list[str]) -> str:
    """A stage's one-line error, whichever way it came: a flag's (SystemExit's text) or the run's (stderr, exit 1);
    nothing else on stderr either way (a traceback printed before SystemExit's text would pass otherwise)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    lines = [e.value.code, *err] if isinstance(e.value.code, str) else err
    errors = [line for line in lines if not line.startswith("warning: ")]  # a repeated flag's warning comes first
    assert e.value.code not in (0, None) and len(errors) == 1, lines
    return errors[0]


@pytest.fixture
def sigint_handled():
    """Python's own Ctrl-C handler for the test: a suite started in the background (nohup, `bash test.sh &`) inherits
    SIGINT ignored, and a test that raises SIGINT must not depend on how the suite was started."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def token_data(tmp_path_factory) -> Path:
    return make_token_data(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="session")
def tokens_512(tmp_path_factory) -> Path:
    """token_data with ids below 512, for runs given --vocab-size 512 whose assertions hold at any vocabulary (files,
    steps, notes, bitwise resumes): their steps then go to the blocks, not a 50,257-row lm_head (~7x faster)."""
    return make_token_data(tmp_path_factory.mktemp("tokens_512"), vocab=512)


def make_token_data(out: Path, vocab: int = 50257) -> Path:
    """A val shard and two train shards of random ids below `vocab` (GPT-2's by default): enough windows for tiny
    runs on 1-3 ranks."""
    from fineweb import write_shard

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_shard(out / "rand_val_000000.bin", rng.integers(0, vocab, 8_000, dtype=np.uint16))
    for i in (1, 2):
        write_shard(out / f"rand_train_{i:06d}.bin", rng.integers(0, vocab, 20_000, dtype=np.uint16))
    return out


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random HF GPT2LMHeadModel saved with save_pretrained (no download): vocab 50257, context 64.

    HF initializes biases to 0 and LayerNorms to 1 and 0, as GPT does: a loader that dropped or swapped them
    would still match. Every parameter gets noise, so each one has to be mapped to the right place.
    """
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf_tiny")
    config = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():  # wte and lm_head are tied: one parameter, perturbed once
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def bigram_model(successor: dict[int, int], block_size: int = 64):
    """A 1-layer GPT whose weights make it a bigram table: after a token of `successor` it predicts that token's
    successor with a logit of ~113, against at most 0 for any other; a token without a row of its own gives uniform
    logits, and a successor without one predicts itself. The MLP moves each one-hot embedding to its successor's, for
    the tied lm_head to read; attention and positions are zero."""
    from model import GPT, GPTConfig

    axis = {token: k for k, token in enumerate(dict.fromkeys([*successor, *successor.values()]))}
    model = GPT(GPTConfig(block_size=block_size, n_layer=1, n_head=1, n_embd=128))
    lit = 5.0 * 127 ** 0.5 - 20.0  # a unit's input for its own token (ln_2 puts one-hots of 128 at sqrt(127))
    out = torch.nn.functional.gelu(torch.tensor(lit), approximate="tanh").item()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.ln_f.weight.fill_(10.0)
        model.transformer.h[0].ln_2.weight.fill_(1.0)
        for token, k in axis.items():
            model.transformer.wte.weight[token, k] = 1.0
        mlp = model.transformer.h[0].mlp
        for unit, (token, nxt) in enumerate(successor.items()):
            mlp.c_fc.weight[unit, axis[token]], mlp.c_fc.bias[unit] = 5.0, -20.0  # exactly 0 for any other token
            mlp.c_proj.weight[axis[nxt], unit], mlp.c_proj.weight[axis[token], unit] = 1 / out, -1 / out
    return model


def sdpa_named_and_run(attention: str, config, device: torch.device, dtype: torch.dtype) -> tuple[str, set[str]]:
    """(the SDPA kernel parallel.sdpa_kernel names for a training forward under --attention, the aten attention ops
    a training step of that model then runs forward), the switches restored after."""
    import parallel as par
    from model import GPT

    switches = par.sdpa_switches()
    par.select_attention(attention)
    try:
        named = par.sdpa_kernel(config, dtype, device)
        model = GPT(config).to(device).train()
        x = torch.randint(0, config.vocab_size, (2, config.block_size), device=device)
        with torch.profiler.profile() as prof, torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
            model(x, x)[1].backward()
    finally:
        par.set_sdpa_switches(switches)
    return named, {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")
                   and "backward" not in e.name}


def children(pid: int) -> list[int]:
    """The processes whose parent is pid, from /proc (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def run_torchrun(args: list[str], nproc: int, timeout: int = 300, env: dict[str, str] | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """Run train.py (or another script) under torchrun; fails the test with its output on a timeout, and on an error
    unless check is False.

    On a timeout the launcher gets SIGTERM, which it passes on to its workers (they run in sessions of their own, so
    killing the launcher alone would leave them alive, holding a GPU), then SIGKILL if it is still there 30 s later.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        workers = children(proc.pid)  # before the launcher goes: its workers live in sessions of their own
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *workers]:  # a worker that catches SIGTERM (train.py does) would hold the pipes
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    assert done.returncode == 0 or not check, f"{' '.join(cmd)}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return done


def graph_breaks(stderr: str) -> list[str]:
    """The graph breaks torch.compile logged to a run's stderr under TORCH_LOGS=graph_breaks, a line each."""
    return [line for line in stderr.splitlines() if "Graph break" in line]


def run_train_runs(runs: list[list[str]], nproc: int, spec: Path, timeout: int = 300,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run several train.py argument lists one after another in one torchrun launch (tests/train_runs.py); spec is
    where their JSON list is written."""
    spec.write_text(json.dumps([[str(a) for a in argv] for argv in runs]))
    return run_torchrun(["tests/train_runs.py", str(spec)], nproc=nproc, timeout=timeout, env=env)


def run_nodes(args_per_node: list[list[str]], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Run one rank per "node" at once on this machine, node i running args_per_node[i] (a script and its flags) with
    the variables a `torchrun --nnodes=N --node_rank=i --nproc_per_node=1` worker gets: a multi-node job, each node
    with its own command line. No launcher: its agent adds nothing these checks see, and two cost ~3 s of CPU a
    call (run_torchrun covers the launcher). Returns each rank's result; a timeout fails with every node's output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = len(args_per_node)
    procs = [subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                              "RANK": str(i), "GROUP_RANK": str(i), "WORLD_SIZE": str(n),
                                              "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for i, args in enumerate(args_per_node)]
    results, deadline = [], time.monotonic() + timeout
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        outputs = [proc.communicate(timeout=30) for proc in procs]
        pytest.fail(f"nodes timed out after {timeout} s:\n" + "\n".join(
            f"node {i} stdout:\n{out[-2000:]}\nnode {i} stderr:\n{err[-2000:]}"
            for i, (out, err) in enumerate(outputs)))
    return results


def check_kernels(argv: list[str]) -> None:
    """scripts/check_kernels.py's main in this process."""
    runpy.run_path(str(ROOT / "scripts" / "check_kernels.py"))["main"](argv)


def compile_for_hopper(kernel, signature: dict[str, str], constexprs: dict[str, object], num_warps: int):
    """Compile a @triton.jit kernel ahead of time to an sm_90 (H100/H200) cubin, here, with no GPU: Triton's own
    front end, its LLVM passes and the ptxas it ships. The interpreter runs a kernel's Python, not its compilation,
    so a kernel can pass every interpreted test and still fail to compile on the GPU (a loop-carried value that
    changes type, an op the backend lacks); this finds those here. Skips when triton is missing, was imported with
    TRITON_INTERPRET=1 (the kernel is then no JITFunction), or has no CUDA backend or ptxas."""
    triton = pytest.importorskip("triton")
    if not isinstance(kernel, triton.runtime.JITFunction):
        pytest.skip("the kernel was built by Triton's interpreter (TRITON_INTERPRET=1)")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"triton {triton.__version__} has no ahead-of-time compile API: {e}")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as e:
        if "ptxas" in str(e).lower() and "not found" in str(e).lower():
            pytest.skip(f"triton's CUDA backend has no ptxas here: {e}")
        raise


def run_interpreted(test_file: str, timeout: int = 600) -> None:
    """Run test_file's TestInterpreted class in a fresh interpreter with TRITON_INTERPRET=1, and fail unless some of
    its tests ran and all passed.

    Triton reads the variable when each `@triton.jit` runs, its own library (tl.zeros, tl.sum) included, and those
    run when triton is imported: by model.py or the test file, before any test could set it. Setting it for the whole
    suite instead would turn the CUDA tests, inductor's kernels and torchrun children into interpreted code too.
    """
    cmd = [sys.executable, "-m", "pytest", f"{test_file}::TestInterpreted", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=timeout)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-3000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0 and "skipped" not in summary, summary
