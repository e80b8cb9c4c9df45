"""Plot a train.py run from its log.jsonl: smoothed train loss, val loss and HellaSwag against steps or tokens.

Usage:
    python plot.py --log out/gpt2-124m/log.jsonl            # writes out/gpt2-124m/loss.png
    python plot.py --log out/demo/log.jsonl --x tokens --out demo.png
    python plot.py --log out/lr6e-4/log.jsonl,out/lr1e-3/log.jsonl --x tokens   # runs overlaid -> compare.png
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from common import iter_log, parse_config

# OpenAI's published completion-style HellaSwag acc_norm (10,042 val examples), as build-nanogpt plots them
GPT2_124M_HELLASWAG = 0.2955
GPT3_SMALL_HELLASWAG = 0.337


@dataclass
class PlotConfig:
    """Plot the curves of a train.py log.jsonl (or of several runs, overlaid) into a PNG."""

    log: str = "out/gpt2-124m/log.jsonl"  # the run's JSONL log; several, comma-separated, are overlaid (a colour each)
    out: str = ""  # PNG path ('' = loss.png next to the log; compare.png here for several)
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


def run_names(logs: list[Path]) -> list[str]:
    """A label per run: its directory's name, or more of its path where two runs' directories share a name."""
    names = [log.parent.name or str(log) for log in logs]
    return [str(log.parent) if names.count(name) > 1 else name for log, name in zip(logs, names, strict=True)]


def plot(cfg: PlotConfig) -> Path:
    # a Figure of its own on the Agg canvas: no display needed, and no pyplot state or backend switch left behind
    # in a notebook that calls plot()
    from matplotlib.figure import Figure

    # a path that exists as given is one log, commas and all (run names such as lr=6e-4,bs=8)
    logs = [Path(cfg.log)] if Path(cfg.log).is_file() else [Path(part) for part in cfg.log.split(",") if part]
    if not logs:
        raise ValueError("--log is empty; pass a run's log.jsonl (or several, comma-separated)")
    runs = []  # (config, curves) per run, in the order of logs
    for log in logs:
        if log.is_dir():  # a run's directory: its log is inside
            raise FileNotFoundError(f"--log {log} is a directory; pass the log itself: --log {log / 'log.jsonl'}")
        if not log.is_file():
            raise FileNotFoundError(f"--log {log} does not exist; train.py writes it as <out_dir>/log.jsonl")
        config, curves = load_curves(log)
        if not curves.get("train"):
            raise ValueError(f"{log} has no train records yet; run train.py first")
        runs.append((config, curves))
    single = len(runs) == 1
    hellaswag = any(curves.get("hellaswag") for _, curves in runs)
    fig = Figure(figsize=(13 if hellaswag else 7, 4.5))
    axes = fig.subplots(1, 2 if hellaswag else 1, squeeze=False)
    loss_ax = axes[0][0]
    hs_ax = axes[0][1] if hellaswag else None
    for i, ((_, curves), name) in enumerate(zip(runs, run_names(logs), strict=True)):
        # one run: a colour per curve; several: a colour per run, val dashed, and each label names its run
        colors = ("tab:blue", "tab:orange", "tab:green") if single else (f"C{i}",) * 3
        prefix = "" if single else f"{name}: "
        train = curves["train"]
        xs = [r[cfg.x] for r in train]
        ema, smoothed = None, []
        for r in train:
            ema = r["loss"] if ema is None else cfg.smooth * ema + (1 - cfg.smooth) * r["loss"]
            smoothed.append(ema)
        loss_ax.plot(xs, [r["loss"] for r in train], color=colors[0], alpha=0.25 if single else 0.12, linewidth=0.8)
        loss_ax.plot(xs, smoothed, color=colors[0], label=f"{prefix}train loss (EMA {cfg.smooth})")
        if val := curves.get("val", []):
            loss_ax.plot([r[cfg.x] for r in val], [r["val_loss"] for r in val], "o-" if single else "o--",
                         color=colors[1], markersize=3, label=f"{prefix}val loss (last {val[-1]['val_loss']:.3f})")
        if hs_ax is not None and (hs := curves.get("hellaswag", [])):
            hs_ax.plot([r[cfg.x] for r in hs], [r["acc_norm"] for r in hs], "o-", color=colors[2], markersize=3,
                       label=f"{prefix}acc_norm (last {hs[-1]['acc_norm']:.4f})")
    loss_ax.set_xlabel(cfg.x)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(f"{logs[0].parent.name}: {len(runs[0][1]['train'])} steps" if single else f"{len(runs)} runs")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend()
    if hs_ax is not None:
        if all(is_gpt2_124m(config) for config, _ in runs):  # OpenAI's figures are for the 124M model only
            hs_ax.axhline(GPT2_124M_HELLASWAG, color="red", linestyle="--", label="OpenAI GPT-2 124M (0.2955)")
            hs_ax.axhline(GPT3_SMALL_HELLASWAG, color="gray", linestyle="--", label="OpenAI GPT-3 Small (0.337)")
        hs_ax.set_xlabel(cfg.x)
        hs_ax.set_ylabel("HellaSwag acc_norm")
        hs_ax.grid(alpha=0.3)
        hs_ax.legend()
    out = Path(cfg.out) if cfg.out else logs[0].with_name("loss.png") if single else Path("compare.png")
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
