"""Muon against AdamW: train.py's own runs of a small GPT on Tiny Shakespeare, 2 seeds each, then the val loss at
equal steps and at equal training time, printed as markdown tables for docs/benchmarks.md.

Usage (from the repo root; the times mean something only on otherwise idle cores):
    python fineweb.py --source ../shared/data/tinyshakespeare.txt --out-dir data/tinyshakespeare
    python scripts/compare_optimizers.py --data data/tinyshakespeare          # 4 runs, 2-3 minutes each
    python scripts/compare_optimizers.py --data data/tinyshakespeare --steps 6 --eval-every 3 --out out/smoke

Each run is `python train.py ...` in a subprocess, its output in OUT/NAME.txt and its log in OUT/NAME/log.jsonl. A run
whose log already reaches --steps is not run again (--fresh reruns it), so a rerun prints the tables at once. Training
time is the sum of log.jsonl's per-step `ms` (evaluation excluded); the val loss at a time between two evaluations is
interpolated linearly.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import iter_log, parse_config  # noqa: E402


@dataclass
class CompareConfig:
    """Train the same small GPT with each optimizer and seed; print val loss at equal steps and equal time."""

    data: str = "data/tinyshakespeare"  # token shards of Tiny Shakespeare (fineweb.py --source ...tinyshakespeare.txt)
    out: str = "out/compare_optimizers"  # one directory and one console log per run
    optimizers: str = "adamw,muon"  # comma list of train.py --optimizer values
    seeds: str = "1337,1338"  # comma list of train.py --seed values (init and data order)
    steps: int = 120  # optimizer steps per run
    max_lr: float = 3e-3  # peak lr, the same for every optimizer (Muon's through match_rms_adamw)
    eval_every: int = 15  # val loss every N steps (and at the last)
    eval_tokens: int = 8192  # val tokens per evaluation (the same windows every time)
    fresh: bool = False  # rerun runs whose log is already complete

    def __post_init__(self) -> None:
        if self.steps < 1 or self.eval_every < 1:
            raise ValueError(f"--steps and --eval-every must be >= 1; got {self.steps} and {self.eval_every}")


def train_args(cfg: CompareConfig, optimizer: str, seed: int, out_dir: Path) -> list[str]:
    """train.py's flags for one run: 4 layers of width 128, T=128, 1,024 tokens a step, on the CPU."""
    return ["--model", "tiny", "--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--seq-len", "128",
            "--batch-size", "8", "--total-batch-size", "1024", "--loss-chunk", "128", "--device", "cpu",
            "--max-steps", str(cfg.steps), "--warmup-steps", str(max(1, cfg.steps // 10)), "--max-lr", str(cfg.max_lr),
            "--eval-every", str(cfg.eval_every), "--eval-tokens", str(cfg.eval_tokens), "--hellaswag", "off",
            "--sample-every", "0", "--ckpt-every", "0", "--keep-last", "1", "--seed", str(seed),
            "--optimizer", optimizer, "--data", cfg.data, "--out-dir", str(out_dir)]


def complete(log: Path, steps: int) -> bool:
    return log.is_file() and any(r["type"] == "val" and r["step"] == steps for r in iter_log(log))


def run_all(cfg: CompareConfig) -> dict[tuple[str, int], Path]:
    """Every (optimizer, seed) run's log.jsonl, running the missing ones: seed by seed, the optimizers alternating,
    so a drift in the machine's speed touches each optimizer alike."""
    out, logs = Path(cfg.out), {}
    out.mkdir(parents=True, exist_ok=True)
    for seed in [int(s) for s in cfg.seeds.split(",")]:
        for optimizer in cfg.optimizers.split(","):
            name = f"{optimizer}_s{seed}"
            run_dir, logs[optimizer, seed] = out / name, out / name / "log.jsonl"
            if complete(logs[optimizer, seed], cfg.steps) and not cfg.fresh:
                continue
            shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted or stale run starts over
            print(f"{name}: running (load average {os.getloadavg()[0]:.2f})", flush=True)
            t0 = time.time()
            with open(out / f"{name}.txt", "w") as console:
                done = subprocess.run([sys.executable, "train.py", *train_args(cfg, optimizer, seed, run_dir)],
                                      cwd=ROOT, stdout=console, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise SystemExit(f"error: {name} failed (exit {done.returncode}); see {out / f'{name}.txt'}")
            print(f"{name}: {time.time() - t0:.0f} s", flush=True)
    return logs


def curve(log: Path) -> tuple[list[tuple[int, float, float]], list[float]]:
    """[(step, training seconds before it, val loss)] at each evaluation, and every step's ms."""
    records = list(iter_log(log))
    ms = {r["step"]: r["ms"] for r in records if r["type"] == "train"}
    vals = [(r["step"], sum(v for s, v in ms.items() if s < r["step"]) / 1000, r["val_loss"])
            for r in records if r["type"] == "val"]
    return vals, list(ms.values())


def at_time(vals: list[tuple[int, float, float]], t: float) -> float:
    """The val loss at t training seconds, linear between the evaluations around it."""
    for (_, t0, v0), (_, t1, v1) in zip(vals, vals[1:], strict=False):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return vals[-1][2]


def tables(cfg: CompareConfig, logs: dict[tuple[str, int], Path]) -> str:
    """The markdown: per optimizer, step time and the val loss at the end and at the fastest run's total time; then
    the val curve at equal steps."""
    curves = {key: curve(log) for key, log in logs.items()}
    optimizers, seeds = cfg.optimizers.split(","), sorted({seed for _, seed in logs})
    t_equal = min(vals[-1][1] for vals, _ in curves.values())  # every run trained at least this long

    def cells(values: list[float]) -> str:
        return " | ".join(f"{v:.4f}" for v in values) + f" | {statistics.mean(values):.4f}"

    seed_cols = " | ".join(f"seed {s}" for s in seeds)
    lines = [f"| optimizer | median ms/step | train s | val at step {cfg.steps}: {seed_cols} | mean | "
             f"val at {t_equal:.0f} s: {seed_cols} | mean |", "|---" * (5 + 2 * len(seeds)) + "|"]
    for opt in optimizers:
        runs = [curves[opt, s] for s in seeds]
        ms = statistics.median(m for _, step_ms in runs for m in step_ms)
        train_s = statistics.mean(vals[-1][1] for vals, _ in runs)
        lines.append(f"| {opt} | {ms:.0f} | {train_s:.0f} | {cells([vals[-1][2] for vals, _ in runs])} | "
                     f"{cells([at_time(vals, t_equal) for vals, _ in runs])} |")
    lines += ["", "| step | " + " | ".join(f"{opt} (mean of {len(seeds)})" for opt in optimizers) + " | difference |",
              "|---" * (len(optimizers) + 2) + "|"]
    for i, (step, _, _) in enumerate(curves[optimizers[0], seeds[0]][0]):
        means = [statistics.mean(curves[opt, s][0][i][2] for s in seeds) for opt in optimizers]
        lines.append(f"| {step} | " + " | ".join(f"{m:.4f}" for m in means) + f" | {means[-1] - means[0]:+.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    cfg = parse_config(CompareConfig, sys.argv[1:] if argv is None else argv, doc=__doc__)
    logs = run_all(cfg)
    prov = next(iter_log(next(iter(logs.values()))))["provenance"]  # the config record opens every log
    text = (f"{prov['device']}, torch {prov['torch']}, git {str(prov['git_sha'])[:10]}, load average now "
            f"{os.getloadavg()[0]:.2f}; {cfg.steps} steps, max lr {cfg.max_lr:g}\n\n" + tables(cfg, logs))
    print(text)
    return text


if __name__ == "__main__":
    main()
