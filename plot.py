"""Plot a train.py run from its log.jsonl: smoothed train loss, val loss and HellaSwag against steps or tokens.

Usage:
    python plot.py --log out/gpt2-124m/log.jsonl            # writes out/gpt2-124m/loss.png
    python plot.py --log out/demo/log.jsonl --x tokens --out demo.png
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from model import parse_config
from train import iter_log

# OpenAI's published completion-style HellaSwag acc_norm (10,042 val examples), as build-nanogpt plots them
GPT2_124M_HELLASWAG = 0.2955
GPT3_SMALL_HELLASWAG = 0.337


@dataclass
class PlotConfig:
    """Plot the curves of a train.py log.jsonl into a PNG."""

    log: str = "out/gpt2-124m/log.jsonl"  # the run's JSONL log
    out: str = ""  # PNG path ('' = loss.png next to the log)
    x: str = "step"  # x axis: step or tokens
    smooth: float = 0.9  # EMA factor for the train loss (0 = raw)

    def __post_init__(self) -> None:
        if self.x not in ("step", "tokens"):
            raise ValueError(f"--x must be 'step' or 'tokens'; got {self.x!r}")
        if not 0.0 <= self.smooth < 1.0:
            raise ValueError(f"--smooth must be in [0, 1); got {self.smooth}")


def load_curves(path: Path) -> tuple[dict, dict[str, list[dict]]]:
    """The last config record and, per record type, one record per step (a resumed run re-logs some steps:
    the later record wins)."""
    config: dict = {}
    by_type: dict[str, dict[int, dict]] = {}
    for record in iter_log(path):
        if record["type"] == "config":
            config = record
        else:
            by_type.setdefault(record["type"], {})[record["step"]] = record
    return config, {kind: [steps[s] for s in sorted(steps)] for kind, steps in by_type.items()}


def is_gpt2_124m(config: dict) -> bool:
    m = config.get("model_config", {})
    return (m.get("n_layer"), m.get("n_embd"), m.get("n_head")) == (12, 768, 12)


def plot(cfg: PlotConfig) -> Path:
    # a Figure of its own on the Agg canvas: no display needed, and no pyplot state or backend switch left behind
    # in a notebook that calls plot()
    from matplotlib.figure import Figure

    log = Path(cfg.log)
    if log.is_dir():  # a run's directory: its log is inside
        raise FileNotFoundError(f"--log {log} is a directory; pass the log itself: --log {log / 'log.jsonl'}")
    if not log.is_file():
        raise FileNotFoundError(f"--log {log} does not exist; train.py writes it as <out_dir>/log.jsonl")
    config, curves = load_curves(log)
    train = curves.get("train", [])
    if not train:
        raise ValueError(f"{log} has no train records yet; run train.py first")
    hellaswag = curves.get("hellaswag", [])
    fig = Figure(figsize=(13 if hellaswag else 7, 4.5))
    axes = fig.subplots(1, 2 if hellaswag else 1, squeeze=False)
    ax = axes[0][0]
    xs = [r[cfg.x] for r in train]
    ema, smoothed = None, []
    for r in train:
        ema = r["loss"] if ema is None else cfg.smooth * ema + (1 - cfg.smooth) * r["loss"]
        smoothed.append(ema)
    ax.plot(xs, [r["loss"] for r in train], color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(xs, smoothed, color="tab:blue", label=f"train loss (EMA {cfg.smooth})")
    val = curves.get("val", [])
    if val:
        ax.plot([r[cfg.x] for r in val], [r["val_loss"] for r in val], "o-", color="tab:orange", markersize=3,
                label=f"val loss (last {val[-1]['val_loss']:.3f})")
    ax.set_xlabel(cfg.x)
    ax.set_ylabel("loss")
    ax.set_title(f"{log.parent.name}: {len(train)} steps")
    ax.grid(alpha=0.3)
    ax.legend()
    if hellaswag:
        ax = axes[0][1]
        ax.plot([r[cfg.x] for r in hellaswag], [r["acc_norm"] for r in hellaswag], "o-", color="tab:green",
                markersize=3, label=f"acc_norm (last {hellaswag[-1]['acc_norm']:.4f})")
        if is_gpt2_124m(config):
            ax.axhline(GPT2_124M_HELLASWAG, color="red", linestyle="--", label="OpenAI GPT-2 124M (0.2955)")
            ax.axhline(GPT3_SMALL_HELLASWAG, color="gray", linestyle="--", label="OpenAI GPT-3 Small (0.337)")
        ax.set_xlabel(cfg.x)
        ax.set_ylabel("HellaSwag acc_norm")
        ax.grid(alpha=0.3)
        ax.legend()
    out = Path(cfg.out) if cfg.out else log.with_name("loss.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> Path:
    cfg = parse_config(PlotConfig, sys.argv[1:] if argv is None else argv, doc=__doc__)
    try:
        out = plot(cfg)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"plot: wrote {out}")
    return out


if __name__ == "__main__":
    main()
