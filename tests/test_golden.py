"""Golden losses: the tiny preset's first 10 losses at a fixed seed, one process and 2 DDP ranks, against a committed
file. A refactor that changes any number in the run (init order, data order, schedule, reduction) fails here.

Re-record after a torch upgrade, once per kernel path the machine has (ATEN_CPU_CAPABILITY=avx2, avx512, default):
    ATEN_CPU_CAPABILITY=avx2 python tests/test_golden.py --record
"""

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import train
from common import iter_log
from conftest import run_torchrun

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_losses.json"
ARGS = ["--preset", "tiny", "--eval-every=0", "--max-steps=10", "--hellaswag=off"]
TOLERANCE = 1e-4  # another torch or kernel path: 10 steps of float32 sums in another order stay this close


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def recorded(name: str) -> list[str] | None:
    """The file's losses (float.hex) for this torch and this CPU kernel path, or None if it has none for them."""
    # the kernel path (ATen's AVX2, AVX512, DEFAULT...) sets the vector width, so the order of float sums: last bits
    data = golden()
    if torch.__version__ != data["torch"]:
        return None
    return data["paths"].get(torch.backends.cpu.get_cpu_capability(), {}).get(name)


def check(name: str, losses: list[float]) -> None:
    """Bitwise where the file was recorded under this torch and kernel path; elsewhere within TOLERANCE of any path."""
    assert len(losses) == 10
    if (bits := recorded(name)) is not None:
        assert [x.hex() for x in losses] == bits
    else:
        want = [float.fromhex(h) for h in next(iter(golden()["paths"].values()))[name]]
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
    """Write this torch's and this kernel path's losses into the file (other paths of the same torch are kept)."""
    sys.path.insert(0, str(GOLDEN.parents[2]))
    from conftest import make_token_data

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = make_token_data(tmp / "tokens")
        runs = {"single": single_process_losses(data, tmp / "single"), "ddp2": ddp_losses(data, tmp / "ddp")}
    old = golden()
    paths = old["paths"] if old["torch"] == torch.__version__ else {}
    paths[torch.backends.cpu.get_cpu_capability()] = {k: [x.hex() for x in v] for k, v in runs.items()}
    GOLDEN.write_text(json.dumps({"torch": torch.__version__, "threads": 1, "paths": paths}, indent=1) + "\n")
    print(f"recorded {torch.backends.cpu.get_cpu_capability()} for torch {torch.__version__} in {GOLDEN}")


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    record()
