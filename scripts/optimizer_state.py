"""The optimizer state each --optimizer keeps for a model, measured: train.py builds the model and the optimizer, takes
one step (which creates the state) on a small random batch on the CPU, and parallel.optimizer_state_bytes sums the real
storage of every state tensor (an 8-bit moment's codes, scales and code table). Prints a markdown table.

Usage (from the repo root):
    python scripts/optimizer_state.py                       # GPT-2 124M (model preset gpt2, context 1024)
    python scripts/optimizer_state.py --model tiny --optimizers adamw,adamw8bit
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import parallel  # noqa: E402
import train  # noqa: E402
from common import parse_config  # noqa: E402
from model import GPT, MODEL_PRESETS  # noqa: E402


@dataclass
class StateConfig:
    """Measure the optimizer state of each --optimizer for one model preset on the CPU."""

    model: str = "gpt2"  # model preset (model.py), built with its own context length
    optimizers: str = "adamw,muon,adamw8bit"  # comma list of train.py --optimizer values
    tokens: int = 64  # T of the one (1, T) batch the step trains on


def measure(cfg: StateConfig, optimizer: str) -> tuple[int, int]:
    """(state bytes, parameters) after one step of this optimizer."""
    tcfg = train.TrainConfig(model=cfg.model, optimizer=optimizer, device="cpu")
    tcfg = dataclasses.replace(tcfg, seq_len=MODEL_PRESETS[cfg.model]().block_size)  # all of GPT-2's 1024 positions
    torch.manual_seed(0)
    raw = GPT(train.model_config(tcfg))
    built = parallel.build_trainable(raw, tcfg, torch.device("cpu"), use_compile=False, verbose=False)
    tokens = torch.randint(0, 50257, (1, 1, cfg.tokens + 1))
    parallel.train_step(built.model, built.optimizer, lambda: (tokens[0, :, :-1], tokens[0, :, 1:]), 1,
                     contextlib.nullcontext(), 1.0)
    return parallel.optimizer_state_bytes(built.optimizer), sum(p.numel() for p in raw.parameters())


def main(argv: list[str] | None = None) -> str:
    cfg = parse_config(StateConfig, sys.argv[1:] if argv is None else argv, doc=__doc__)
    rows = {name: measure(cfg, name) for name in cfg.optimizers.split(",")}
    base = rows.get("adamw", next(iter(rows.values())))[0]
    versions = f"torch {torch.__version__}"
    if "torchao" in sys.modules:
        versions += f", torchao {sys.modules['torchao'].__version__}"
    lines = [f"model {cfg.model}, {versions}, one step on a (1, {cfg.tokens}) batch on the CPU", "",
             "| --optimizer | state bytes | MiB | bytes per parameter | of adamw's |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {size:,} | {size / 2**20:,.1f} | {size / params:.3f} | {size / base:.1%} |"
              for name, (size, params) in rows.items()]
    print("\n".join(lines))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
