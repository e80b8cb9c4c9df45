"""Golden losses: the tiny preset's first 10 losses at a fixed seed, one process and 2 DDP ranks, against a committed
file. A refactor that changes any number in the run (init order, data order, schedule, reduction) fails here.

The bits depend on the machine's float32 kernels: ATen's vector path (AVX2, AVX512...) and the BLAS code MKL picks
for the CPU model, so two AVX-512 hosts can differ in the last bit. The file keys each recording by `kernels()`, the
bits of one training step of a small transformer in plain torch. Record on a new kind of machine, or after a torch
upgrade, once per path (ATEN_CPU_CAPABILITY=avx2, avx512, default):
    PYTHONPATH=. ATEN_CPU_CAPABILITY=avx2 python tests/test_golden.py --record
"""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train
from common import iter_log
from conftest import run_torchrun

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_losses.json"
ARGS = ["--preset", "tiny", "--eval-every=0", "--max-steps=10", "--hellaswag=off"]
TOLERANCE = 1e-4  # another torch or kernel path: 10 steps of float32 sums in another order stay this close


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def kernels() -> str:
    """This machine's float32 kernels, named by the bits of one AdamW step of a one-block transformer near the tiny
    preset's shapes, in plain torch on one thread: not this project's code, which the golden run is there to check."""
    threads, generator = torch.get_num_threads(), torch.Generator().manual_seed(0)
    V, B, T, C = 50257, 4, 64, 64
    shapes = {"wte": (V, C), "wpe": (T, C), "qkv": (3 * C, C), "proj": (C, C), "fc": (4 * C, C), "out": (C, 4 * C)}
    w = {k: (0.02 * torch.randn(shape, generator=generator)).requires_grad_() for k, shape in shapes.items()}
    tokens = torch.randint(V, (B, T + 1), generator=generator)
    torch.set_num_threads(1)
    try:
        x = w["wte"][tokens[:, :-1]] + w["wpe"]
        q, k, v = (F.layer_norm(x, (C,)) @ w["qkv"].T).view(B, T, 3, 4, C // 4).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C) @ w["proj"].T
        x = x + F.gelu(F.layer_norm(x, (C,)) @ w["fc"].T, approximate="tanh") @ w["out"].T
        F.cross_entropy((F.layer_norm(x, (C,)) @ w["wte"].T).view(-1, V), tokens[:, 1:].reshape(-1)).backward()
        torch.optim.AdamW(w.values(), lr=1e-3, weight_decay=0.1).step()
    finally:
        torch.set_num_threads(threads)
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in w.values())).hexdigest()[:16]


def recorded(name: str) -> list[str] | None:
    """The file's losses (float.hex) for this torch and these kernels, or None if it has none for them."""
    data = golden()
    if torch.__version__ != data["torch"]:
        return None
    return data["kernels"].get(kernels(), {}).get(name)


def check(name: str, losses: list[float]) -> None:
    """Bitwise where the file was recorded under this torch and these kernels; elsewhere within TOLERANCE of any."""
    assert len(losses) == 10
    if (bits := recorded(name)) is not None:
        assert [x.hex() for x in losses] == bits
    else:
        want = [float.fromhex(h) for h in next(iter(golden()["kernels"].values()))[name]]
        assert losses == pytest.approx(want, abs=TOLERANCE)


def single_process_losses(token_data: Path, out: Path) -> list[float]:
    """The run in this process on one thread, as torchrun's ranks run (OMP_NUM_THREADS=1): the thread count splits
    the sums too, and one thread gives the same bits on any number of cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train.main([*ARGS, "--data", str(token_data), "--out-dir", str(out)])["losses"]
    finally:
        torch.set_num_threads(threads)


def ddp_losses(token_data: Path, out: Path) -> list[float]:
    run_torchrun(["train.py", *ARGS, "--data", str(token_data), "--out-dir", str(out)], nproc=2)
    return [r["loss"] for r in iter_log(out / "log.jsonl") if r["type"] == "train"]


def test_golden_losses_single_process(token_data, tmp_path):
    losses = single_process_losses(token_data, tmp_path / "out")
    check("single", losses)
    assert losses[0] == pytest.approx(10.83, abs=0.05)  # about ln(50257) = 10.82 at init


@pytest.mark.slow
def test_golden_losses_two_ddp_ranks(token_data, tmp_path):
    losses = ddp_losses(token_data, tmp_path / "ddp")
    check("ddp2", losses)
    # 2 ranks x 1 micro-step see the same 8 sequences per step as 1 rank x 2 micro-steps: the same run, compared
    # with one process on this machine, so the claim holds on any kernel path
    assert losses == pytest.approx(single_process_losses(token_data, tmp_path / "single"), abs=1e-5)


def record() -> None:
    """Write this torch's and these kernels' losses into the file (other kernels of the same torch are kept)."""
    sys.path.insert(0, str(GOLDEN.parents[2]))
    from conftest import make_token_data

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = make_token_data(tmp / "tokens")
        runs = {"single": single_process_losses(data, tmp / "single"), "ddp2": ddp_losses(data, tmp / "ddp")}
    old = golden()
    known = old["kernels"] if old["torch"] == torch.__version__ else {}
    path, key = torch.backends.cpu.get_cpu_capability(), kernels()
    known[key] = {"path": path, **{k: [x.hex() for x in v] for k, v in runs.items()}}
    GOLDEN.write_text(json.dumps({"torch": torch.__version__, "threads": 1, "kernels": known}, indent=1) + "\n")
    print(f"recorded kernels {key} ({path}) for torch {torch.__version__} in {GOLDEN}")


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    record()
