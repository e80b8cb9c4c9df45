"""Plot a run from its log.jsonl: smoothed train loss, val loss and bits per byte, lr, HellaSwag and CORE against steps
or tokens; an RL run's reward (rl.py), a task's held-out accuracy and pass@k (rl.py, sft.py --task) and the val pairs
ranked right (prefs.py) where the log has them.

Usage:
    python plot.py                                          # the newest out/*/log.jsonl -> out/<run>/loss.png
    python plot.py --log out/gpt2-124m/log.jsonl            # writes out/gpt2-124m/loss.png
    python plot.py --log out/demo/log.jsonl --x tokens --out demo.png
    python plot.py --log out/lr6e-4/log.jsonl,out/lr1e-3/log.jsonl --x tokens   # overlaid -> out/lr6e-4/compare.png
    python plot.py --log out/sweep/*/log.jsonl --log out/base/log.jsonl  # words after --log, a repeated --log: all
    python plot.py --log out/rl/log.jsonl,out/rl-ppo/log.jsonl   # reward and accuracy curves of two RL runs
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import iter_log, parse_config, user_errors

# OpenAI's published completion-style HellaSwag acc_norm (10,042 val examples), as build-nanogpt plots them
HELLASWAG_REFERENCES = (("OpenAI GPT-2 124M", 0.2955, "red"), ("OpenAI GPT-3 Small", 0.337, "gray"))
# a panel for each curve some run has: the record type that holds it, a field of its records, and the y axis's label
PANELS = {"loss": ("train", "loss", "loss"), "bpb": ("val", "val_bpb", "val bits per byte"),
          "lr": ("train", "lr", "learning rate"), "pairs": ("val", "val_accuracy", "val pairs ranked right"),
          "reward": ("train", "reward", "reward (mean, +-1 std shaded)"),
          "hellaswag": ("hellaswag", "acc_norm", "HellaSwag acc_norm"), "task": ("task", "acc", "held-out accuracy"),
          "core": ("core", "core_metric", "CORE"), "chatcore": ("chatcore", "chatcore", "ChatCORE")}


@dataclass
class PlotConfig:
    """Plot the curves of a train.py or rl.py log.jsonl (or of several runs, overlaid) into a PNG."""

    log: str = ""  # a JSONL log ('' = the newest out/*/log.jsonl, alone); several (commas, words, --log again) overlaid
    out: str = ""  # PNG path ('' = loss.png next to the log; compare.png next to the first log for several)
    x: str = "step"  # x axis: step or tokens
    smooth: float = 0.9  # EMA factor for the train loss (0 = raw)

    def __post_init__(self) -> None:
        if self.x not in ("step", "tokens"):
            raise ValueError(f"--x must be 'step' or 'tokens'; got {self.x!r}")
        if not 0.0 <= self.smooth < 1.0:
            raise ValueError(f"--smooth must be in [0, 1); got {self.smooth}")


def load_curves(path: Path) -> tuple[dict, dict[str, list[dict]]]:
    """The latest start's config record and, per record type, one record per step (a resumed run's later one wins)."""
    by_type: dict[str, dict[int, dict]] = {}
    for record in iter_log(path):
        by_type.setdefault(record["type"], {})[record["step"]] = record
    curves = {kind: [steps[s] for s in sorted(steps)] for kind, steps in by_type.items()}
    return curves.pop("config", [{}])[-1], curves


def run_names(logs: list[Path]) -> list[str]:
    """A label per run: its directory's name, or more of its path where two runs' directories share a name."""
    names = [log.parent.name or str(log) for log in logs]
    return [str(log.parent) if names.count(name) > 1 else name for log, name in zip(logs, names, strict=True)]


def plot(cfg: PlotConfig, more: tuple[str, ...] = ()) -> Path:  # more: the words after --log's value (main)
    # a Figure of its own on the Agg canvas: no display needed, and no pyplot state left in a notebook that calls plot()
    from matplotlib.figure import Figure

    if more and not all((cfg.log, *more)):  # '' is the newest run: maybe one of the others, maybe not; name it
        raise ValueError("an empty --log (the newest out/*/log.jsonl) stands alone; name each log to overlay it")
    logs = [log for arg in (cfg.log, *more) for log in log_paths(arg)]
    runs = [read_run(log) for log in logs]  # (config, curves) per run, in the order of logs
    single = len(runs) == 1
    names = [name for name, (kind, key, _) in PANELS.items()
             if any(key in r for _, curves in runs for r in curves.get(kind, []))]
    fig = Figure(figsize=(6 * len(names) + 1, 4.5))
    panel = dict(zip(names, fig.subplots(1, len(names), squeeze=False)[0], strict=True))
    drawn = [draw_run(cfg, curves, name, i, single, panel)
             for i, ((_, curves), name) in enumerate(zip(runs, run_names(logs), strict=True))]
    loss_ax = panel["loss"]
    loss_ax.set_ylim(*loss_range(drawn))
    loss_ax.set_title(f"{logs[0].parent.name}: {len(runs[0][1]['train'])} steps" if single else f"{len(runs)} runs")
    shapes = [[c.get("model_config", {}).get(k) for k in ("n_layer", "n_embd", "n_head")] for c, _ in runs]
    if "hellaswag" in panel and all(shape == [12, 768, 12] for shape in shapes):  # OpenAI's are for GPT-2 124M's only
        for label, score, color in HELLASWAG_REFERENCES:
            panel["hellaswag"].axhline(score, color=color, linestyle="--", label=f"{label} ({score})")
    for name, ax in panel.items():
        ax.set_ylabel(PANELS[name][2])
        ax.set_xlabel(cfg.x)
        ax.grid(alpha=0.3)
        ax.legend()
    out = Path(cfg.out or logs[0].with_name("loss.png" if single else "compare.png"))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def log_paths(arg: str) -> list[Path]:
    if not arg:  # the run written to last
        newest = max(Path("out").glob("*/log.jsonl"), key=lambda p: p.stat().st_mtime, default=None)
        if newest is None:
            raise FileNotFoundError("no out/*/log.jsonl here; pass --log PATH (the log.jsonl in a run's --out-dir)")
        return [newest]
    if Path(arg).is_file():  # one log as given, commas and all, though a prefix of it be a file too
        return [Path(arg)]
    logs, part = [], ""
    for piece in arg.split(","):  # a comma may be a run name's (lr=6e-4,bs=8): pieces join until a file exists
        part = f"{part},{piece}" if part else piece
        if Path(part).is_file():
            logs, part = [*logs, Path(part)], ""
    return logs + [Path(rest) for rest in part.split(",") if rest] or [Path(arg)]  # what never existed, apart


def read_run(log: Path) -> tuple[dict, dict[str, list[dict]]]:
    if log.is_dir():  # a run's directory: its log is inside
        raise FileNotFoundError(f"--log {log} is a directory; pass the log itself: --log {log / 'log.jsonl'}")
    if not log.is_file():
        raise FileNotFoundError(f"--log {log} does not exist; train.py writes it as <out_dir>/log.jsonl")
    config, curves = load_curves(log)
    if not curves.get("train"):
        raise ValueError(f"{log} has no train records: its run trained no step yet (or had --max-steps 0, as "
                         "prune.py's default); nothing to draw")
    return config, curves


def ema(values: list[float], smooth: float) -> list[float]:
    return list(itertools.accumulate(values, lambda mean, v: smooth * mean + (1 - smooth) * v))


def draw_run(cfg: PlotConfig, curves: dict[str, list[dict]], name: str, i: int, single: bool,
             panel: dict[str, Any]) -> tuple[list[float], list[float]]:
    """One run's curves on the panels (each has a panel when any run has its records): one run, a colour per curve;
    several, a colour per run, raw loss fainter, val dashed, and each label names its run. Returns its loss values,
    and those past its first tenth (loss_range)."""
    if single:
        colors, alpha, val_style, prefix = ("tab:blue", "tab:orange", "tab:green", "tab:purple"), 0.25, "o-", ""
    else:
        colors, alpha, val_style, prefix = (f"C{i}",) * 4, 0.12, "o--", f"{name}: "
    train, loss_ax = curves["train"], panel["loss"]
    xs = [r[cfg.x] for r in train]
    smoothed = ema([r["loss"] for r in train], cfg.smooth)
    loss_ax.plot(xs, [r["loss"] for r in train], color=colors[0], alpha=alpha, linewidth=0.8)
    loss_ax.plot(xs, smoothed, color=colors[0], label=f"{prefix}train loss (EMA {cfg.smooth})")
    for curve, kind, key, label, style, color, digits in (
            ("loss", "val", "val_loss", "val loss", val_style, 1, 3),
            ("bpb", "val", "val_bpb", "val bpb", val_style, 1, 3),
            ("pairs", "val", "val_accuracy", "pairs ranked right", val_style, 1, 3),  # prefs.py's
            ("hellaswag", "hellaswag", "acc_norm", "acc_norm", "o-", 2, 4),
            ("core", "core", "core_metric", "CORE", "o-", 2, 4),
            ("chatcore", "chatcore", "chatcore", "ChatCORE", "o-", 2, 4)):
        if scored := [r for r in curves.get(kind, []) if key in r]:
            panel[curve].plot([r[cfg.x] for r in scored], [r[key] for r in scored], style, color=colors[color],
                             markersize=3, label=f"{prefix}{label} (last {scored[-1][key]:.{digits}f})")
    if lrs := [r for r in train if "lr" in r]:
        panel["lr"].plot([r[cfg.x] for r in lrs], [r["lr"] for r in lrs], color=colors[3], label=f"{prefix}lr")
        panel["lr"].ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    draw_rl(cfg, curves, prefix, colors, panel)
    points = [*zip(xs, smoothed, strict=True), *((r[cfg.x], r["val_loss"]) for r in curves.get("val", []))]
    start = xs[len(xs) // 10] if len(xs) >= 10 else float("-inf")  # a short run keeps its start in view
    return [y for _, y in points], [y for x, y in points if x >= start]


def draw_rl(cfg: PlotConfig, curves: dict[str, list[dict]], prefix: str, colors: tuple, panel: dict[str, Any]) -> None:
    """The reward per step (its EMA, the raw mean's +-1 std across replies shaded) and the held-out task accuracy,
    greedy (solid) and pass@k (dashed)."""
    if steps := [r for r in curves["train"] if "reward" in r]:
        xs, mean = [r[cfg.x] for r in steps], [r["reward"] for r in steps]
        std = [r.get("reward_std", 0.0) for r in steps]
        panel["reward"].fill_between(xs, [m - s for m, s in zip(mean, std, strict=True)],
                                     [m + s for m, s in zip(mean, std, strict=True)], color=colors[0], alpha=0.12)
        panel["reward"].plot(xs, ema(mean, cfg.smooth), color=colors[0],
                             label=f"{prefix}reward (EMA {cfg.smooth}; last {mean[-1]:.3f})")
    if scored := curves.get("task", []):
        xs = [r[cfg.x] for r in scored]
        for key in ["acc", *sorted({k for r in scored for k in r if k.startswith("pass@")})]:
            ys = [(x, r[key]) for x, r in zip(xs, scored, strict=True) if key in r]
            style, label = {"acc": ("o-", "greedy accuracy")}.get(key, ("o--", key))
            panel["task"].plot(*zip(*ys, strict=True), style, color=colors[2], markersize=3,
                               label=f"{prefix}{label} (last {ys[-1][1]:.3f})")


def loss_range(drawn: list[tuple[list[float], list[float]]]) -> tuple[float, float]:
    """The loss panel's y-range: down to the lowest value, up to the highest past each run's first tenth, so the
    first drop (from ln(vocab) = 10.8) leaves the top and the rest of the curve fills the panel."""
    low = min(y for every, _ in drawn for y in every)
    high = max(y for every, later in drawn for y in (later or every))
    pad = 0.05 * (high - low) or 0.5
    return low - pad, high + pad


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    # each --log's value and the words after it up to the next option are logs (a shell glob's: --log out/*/log.jsonl),
    # a repeated --log's too, as argparse's append: the house parser would refuse the words, one word a flag (-h too)
    spans = [(i, next((j for j in range(i + 1, len(argv)) if argv[j].startswith("-")), len(argv)))
             for i, word in enumerate(argv) if word == "--log" or word.startswith("--log=")]
    words = [[argv[i][6:]] * (argv[i] != "--log") + argv[i + 1:end] for i, end in spans]
    rest, logs = [word for k, word in enumerate(argv) if not any(i <= k < end for i, end in spans)], sum(words, [])
    given = ["--log"] if [] in words else [f"--log={log}" for log in logs[:1]]  # no value: the parser's line says so
    cfg = parse_config(PlotConfig, rest + given, doc=__doc__)
    with user_errors(FileNotFoundError, ValueError):
        out = plot(cfg, tuple(logs[1:]))
    print(f"plot: wrote {out}")
    return out


if __name__ == "__main__":
    main()
