"""The pruning table of docs/benchmarks.md: prune.py's runs from one model, then each run's pruned (step 0) and
recovered (step --steps) checkpoints scored on the whole val split: loss and bits per byte, parameters, nonzero ones.

Usage (from the repo root, after the demo: python train.py --preset demo):
    python scripts/prune_table.py                                   # 11 runs of 150 recovery steps, then the table
    python scripts/prune_table.py --runs magnitude:0.5 --steps 4 --out out/smoke

bpb = the summed target nats / ln 2 / the summed UTF-8 bytes of the target tokens (the GPT-2 tokenizer's bytes of each).
A run whose last checkpoint exists is not run again, so a rerun prints the table at once.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import prune  # noqa: E402
from common import get_tokenizer, load_checkpoint, parse_config  # noqa: E402
from fineweb import TokenLoader  # noqa: E402
from model import GPT  # noqa: E402

RUNS = ("magnitude:0,magnitude:0.25,magnitude:0.5,magnitude:0.75,structured-taylor:0.25,structured-taylor:0.5,"
        "structured-taylor:0.75,structured-norm:0.25,structured-norm:0.5,structured-norm:0.75,2:4:0.5")


@dataclass
class TableConfig:
    """Prune one checkpoint by each method and sparsity, recover each for --steps, score them all on the val split."""

    ckpt: str = "out/demo/ckpt_000900.pt"  # the dense model
    data: str = "data/stdlib_docs"  # its token shards: recovery trains on train, the table scores val
    out: str = "out/prune_table"  # one prune.py --out-dir per run
    runs: str = RUNS  # comma list of METHOD[-IMPORTANCE]:SPARSITY
    steps: int = 150  # recovery steps of each run (the fixed budget)
    max_lr: float = 3e-4  # recovery's peak learning rate (warmup 10 steps, cosine to a tenth)


@torch.no_grad()
def score(model: GPT, data: str) -> tuple[float, float]:
    """(mean loss per token, bits per byte) over every window of the val split, 4 x the model's context each."""
    enc, loader = get_tokenizer(), TokenLoader(data, "val", 4, model.config.block_size)
    sizes = torch.tensor([len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)])
    nats = nbytes = tokens = 0.0
    model.eval()
    for _ in range(loader.num_windows):
        x, y = loader.next_batch()
        nats += F.cross_entropy(model(x)[0].flatten(0, 1).float(), y.flatten(), reduction="sum").item()
        nbytes, tokens = nbytes + sizes[y].sum().item(), tokens + y.numel()
    return nats / tokens, nats / math.log(2) / nbytes


def row(name: str, path: Path | str, data: str) -> str:
    ckpt = load_checkpoint(path)
    model = GPT.from_checkpoint(ckpt)
    loss, bpb = score(model, data)
    params = sum(p.numel() for p in model.parameters())
    nonzero = sum(int(p.count_nonzero()) for p in model.parameters())
    matrices = sum(int(p.count_nonzero()) for p in prune.matrices(model).values())
    dense = (ckpt.get("pruning") or {}).get("dense", {}).get("weights", matrices)
    return (f"| {name} | step {ckpt['step']} | {loss:.4f} | {bpb:.4f} | {params:,} | {nonzero:,} | "
            f"{1 - matrices / dense:.1%} |")


def main() -> None:
    cfg = parse_config(TableConfig, sys.argv[1:], doc=__doc__)
    lines = ["| run | checkpoint | val loss | bpb | params | nonzero | blocks pruned |",
             "|---|---|---|---|---|---|---|", row("dense", cfg.ckpt, cfg.data)]
    for spec in cfg.runs.split(","):
        method, sparsity = spec.rsplit(":", 1)
        method, _, importance = method.partition("-")
        out = Path(cfg.out) / spec.replace(":", "_")
        if not (out / f"ckpt_{cfg.steps:06d}.pt").exists():
            prune.main(["--init-from", cfg.ckpt, "--data", cfg.data, "--out-dir", str(out), "--method", method,
                        "--sparsity", sparsity, "--importance", importance or "norm", "--max-steps", str(cfg.steps),
                        "--max-lr", str(cfg.max_lr), "--eval-every", "0", "--log-every", "50"]
                       + ["--resume", "auto"] * (out / "ckpt_000000.pt").exists())
        lines += [row(spec, out / f"ckpt_{step:06d}.pt", cfg.data) for step in (0, cfg.steps)]
        print("\n".join(lines[-2:]), flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
