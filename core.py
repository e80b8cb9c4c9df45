"""DCLM's CORE score, as nanochat reports it: each in-context task's accuracy, centered by its random baseline, and
their mean. OpenAI's GPT-2 1.5B scores 0.2565 on the 22 tasks of DCLM's eval bundle.

A task is multiple_choice (right when the gold choice's tokens have the lowest mean loss), schema (right when the
shared continuation has the lowest mean loss after the gold context) or language_modeling (right when the greedy
continuation is the reference). As nanochat's base_eval and core_eval: a task's rows are shuffled with seed 1337 and
cut to --max-per-task, row i draws its few-shot examples from the others with seed 1234 + i, every prompt starts with
BOS (<|endoftext|>), and a prompt longer than the model's context keeps its last block_size tokens.

Usage:
    python core.py --init-from gpt2                      # downloads DCLM's eval bundle once, into data/eval_bundle
    python core.py --ckpt out/gpt2-124m/ckpt_019073.pt --max-per-task 500 --json out/gpt2-124m/core.json
    python core.py --ckpt out/demo/ckpt_000900.pt --bundle data/hellaswag_bundle --max-per-task 100
    torchrun --standalone --nproc_per_node=8 core.py --ckpt out/gpt2-124m/ckpt_019073.pt
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import random
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from chat_format import BOS
from common import (
    GPT2_VOCAB,
    all_sum,
    first_on_each_node,
    get_tokenizer,
    own_process_group,
    parse_config,
    run_and_exit,
    setup_distributed,
    user_errors,
)
from datarows import read_local, row_name
from fineweb import download
from generate import evaluating
from model import GPT

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's copy of DCLM's
KINDS = ("multiple_choice", "schema", "language_modeling")
TRAIN_ROWS = 500  # rows per task in train.py's --core-every evaluations, as nanochat's base_train scores them


def summed(right: int, n: int, device: torch.device, world: int) -> dict:
    counts = all_sum(torch.tensor([right, n], dtype=torch.float64, device=device), world)
    return {"acc": counts[0].item() / max(1, counts[1].item()), "n": int(counts[1].item())}


def centered(accuracy: float, baseline: float) -> float:
    """Accuracy rescaled so that chance (`baseline`, a fraction) scores 0, a perfect score 1: as CORE and ChatCORE."""
    return (accuracy - baseline) / (1.0 - baseline)


@dataclass
class CoreTask:
    """One in-context task of the bundle, its rows already shuffled and cut."""

    label: str
    kind: str  # multiple_choice, schema or language_modeling
    rows: list[dict]
    shots: int  # few-shot examples before each row
    delimiter: str  # between a row's context and its continuation
    baseline: float  # the random baseline's accuracy, in percent (eval_meta_data.csv)


# ----------------------------------------------------------------------------------------------------------------------
# The bundle: core.yaml, eval_meta_data.csv, eval_data/


def fetch_bundle(source: str, cache_dir: str | Path = "") -> Path:
    """The bundle's directory: `source` itself, or the directory holding core.yaml in the zip at URL `source`,
    unzipped into cache_dir once (the default URL's as data/eval_bundle) and kept there."""
    if "://" not in source:
        path = Path(source).expanduser()
        if not (path / "core.yaml").is_file():
            raise ValueError(f"--bundle {source} has no core.yaml: pass a directory laid out as DCLM's eval bundle "
                             "(core.yaml, eval_meta_data.csv, eval_data/), or a zip's URL")
        return path
    cache = Path(cache_dir or Path(__file__).resolve().parent / "data")  # data/ is git-ignored
    name = "eval_bundle" if source == BUNDLE_URL else f"eval_bundle-{hashlib.sha1(source.encode()).hexdigest()[:10]}"
    dest = cache / name
    if (dest / "core.yaml").is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{name}.") as tmp:
        zipped = Path(tmp) / "bundle.zip"
        offline = "offline, copy an unzipped eval_bundle over and pass --bundle DIR"
        download(source, zipped, "the eval bundle", offline, ConnectionError)
        try:  # a damaged member passes is_zipfile and fails here; a full disk too
            with zipfile.ZipFile(zipped) as z:
                z.extractall(Path(tmp) / "unzipped")
        except (zipfile.BadZipFile, OSError) as e:
            raise ConnectionError(f"could not unzip the eval bundle from {source} ({e}); {offline}") from None
        found = next((Path(tmp) / "unzipped").rglob("core.yaml"), None)
        if found is None:
            raise ValueError(f"the zip at {source} holds no core.yaml")
        with contextlib.suppress(OSError):  # another rank placed it first: theirs is kept
            os.replace(found.parent, dest)
    return fetch_bundle(str(dest))


def load_tasks(bundle: Path, max_per_task: int = 0) -> list[CoreTask]:
    """core.yaml's icl_tasks in its order, each with its rows (shuffled with seed 1337, the first max_per_task kept;
    0 keeps all) and its random baseline."""
    import yaml  # PyYAML comes with datasets

    config = yaml.safe_load((bundle / "core.yaml").read_text(encoding="utf-8"))
    with open(bundle / "eval_meta_data.csv", encoding="utf-8") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}
    tasks = []
    for n, entry in enumerate(config["icl_tasks"]):
        if missing := [k for k in ("label", "dataset_uri", "num_fewshot", "icl_task_type") if k not in entry]:
            raise ValueError(f"{bundle / 'core.yaml'}: icl_tasks item {n} has no {', '.join(missing)}")
        label, kind = entry["label"], entry["icl_task_type"]
        if kind not in KINDS or label not in baselines:
            raise ValueError(f"{bundle}: task {label} has icl_task_type {kind!r} (this scores {', '.join(KINDS)}) or "
                             "no row in eval_meta_data.csv")
        path, shots = bundle / "eval_data" / entry["dataset_uri"], entry["num_fewshot"]
        shots = shots[0] if isinstance(shots, list) else shots  # DCLM's is a list ([10]); nanochat scores the first
        rows = read_local(path)  # a line that is not JSON is one error naming the file and the line
        delimiter = entry.get("continuation_delimiter", " ")
        if (bad := next(((i, why) for i, row in enumerate(rows) if (why := row_problem(row, kind, delimiter))), None)):
            raise ValueError(f"{row_name(str(path), bad[0])}: {bad[1]} (a {kind} row of task {label})")
        random.Random(1337).shuffle(rows)
        rows = rows[:max_per_task or None]
        if len(rows) <= shots:  # each row's few-shot examples are drawn from the others
            raise ValueError(f"task {label} is {shots}-shot, but has {len(rows)} rows to score ({path}): it needs at "
                             f"least {shots + 1}; raise --max-per-task or add rows")
        tasks.append(CoreTask(label, kind, rows, shots, delimiter, baselines[label]))
    return tasks


def row_problem(row: dict, kind: str, delimiter: str) -> str:
    """'' for a row of this kind that can be scored, else what is wrong with it."""
    keys = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
            "language_modeling": ("context", "continuation")}[kind]
    if missing := [k for k in keys if k not in row]:
        return f"no {', '.join(map(repr, missing))}"
    options = row.get("choices", row.get("context_options", []))
    if "gold" in row and not (type(row["gold"]) is int and 0 <= row["gold"] < len(options)):  # "1" would never match
        return f"'gold' is {row['gold']!r}, not an index into its {len(options)} options"
    if kind == "language_modeling" and not all(isinstance(row[k], str) for k in keys):  # .strip() would raise
        return f"'context' and 'continuation' must be strings, not {type(row['context']).__name__} and " \
            f"{type(row['continuation']).__name__}"
    if kind == "language_modeling":  # rendered as prompts() renders it; nanochat asserts this too
        text, encode = f"{row['context'].strip()}{delimiter}", get_tokenizer().encode_ordinary
        if (full := encode(text + row["continuation"]))[:len(ids := encode(text.strip()))] != ids or full == ids:
            return f"its continuation joins the context's last token (continuation_delimiter {delimiter!r}) or is " \
                "empty, so another span or none would be scored; start it with a space or a new line"
    return ""


# ----------------------------------------------------------------------------------------------------------------------
# Prompts: rendered as text, then tokens and the span each one scores


def prompts(task: CoreTask, i: int) -> list[str]:
    """Row i's prompts: its few-shot examples (gold answers in), each followed by a blank line, then the row once per
    choice (multiple_choice), per context option (schema), or without and with its continuation (language_modeling)."""
    row, d = task.rows[i], task.delimiter
    others = [j for j in range(len(task.rows)) if j != i]
    shots = [task.rows[j] for j in random.Random(1234 + i).sample(others, task.shots)]
    if task.kind == "multiple_choice":
        head = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{row['query']}{d}{choice}" for choice in row["choices"]]
    if task.kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}\n\n" for s in shots)
        return [f"{head}{context}{d}{row['continuation']}" for context in row["context_options"]]
    head = "".join(f"{s['context'].strip()}{d}{s['continuation']}\n\n" for s in shots)
    context = f"{head}{row['context'].strip()}{d}"
    return [context.strip(), context + row["continuation"]]  # stripped: a trailing space would join the next token


def common_prefix(seqs: list[list[int]]) -> int:
    shortest = min(len(s) for s in seqs)
    return next((k for k in range(shortest) if len({s[k] for s in seqs}) > 1), shortest)


def spans(ids: list[list[int]], kind: str) -> tuple[list[list[int]], list[int], list[int]]:
    """(rows, starts, ends): the tokens scored in row r are rows[r][starts[r]:ends[r]]: the choices after their common
    prefix, the continuation the context options share, or what the prompt with the continuation adds."""
    ends = [len(t) for t in ids]
    if kind == "multiple_choice":
        return ids, [common_prefix(ids)] * len(ids), ends
    if kind == "schema":
        suffix = common_prefix([t[::-1] for t in ids])
        return ids, [e - suffix for e in ends], ends
    return ids[1:], [len(ids[0])], ends[1:]


def crop(ids: list[list[int]], starts: list[int], ends: list[int],
         block_size: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Rows longer than the context keep their last block_size tokens, and their spans move with them."""
    cut = [max(0, len(t) - block_size) for t in ids]
    return ([t[c:] for t, c in zip(ids, cut, strict=True)], [max(1, s - c) for s, c in zip(starts, cut, strict=True)],
            [e - c for e, c in zip(ends, cut, strict=True)])


# ----------------------------------------------------------------------------------------------------------------------
# Scoring


@torch.no_grad()
def is_right(model: GPT, enc: Any, task: CoreTask, i: int, device: torch.device,
             autocast: contextlib.AbstractContextManager) -> bool:
    """Row i of the task, scored: its prompts in one forward, padded on the right with BOS (out of causal view)."""
    ids, starts, ends = crop(*spans([[BOS, *enc.encode_ordinary(p)] for p in prompts(task, i)], task.kind),
                             model.config.block_size)
    width = max(len(t) for t in ids)
    tokens = torch.tensor([t + [BOS] * (width - len(t)) for t in ids], device=device)
    with autocast:
        logits, _ = model(tokens)
    logits = logits[..., :GPT2_VOCAB].float()  # the padded vocab rows are no tokens
    if task.kind == "language_modeling":  # logits at t predict the token at t + 1
        return torch.equal(logits[0, starts[0] - 1:ends[0] - 1].argmax(-1), tokens[0, starts[0]:ends[0]])
    losses = [F.cross_entropy(logits[r, s - 1:e - 1], tokens[r, s:e], reduction="none").mean().item()
              for r, (s, e) in enumerate(zip(starts, ends, strict=True))]
    return losses.index(min(losses)) == task.rows[i]["gold"]


def accuracy(model: GPT, enc: Any, task: CoreTask, rank: int, world: int, device: torch.device,
             autocast: contextlib.AbstractContextManager) -> float:
    """The task's accuracy, rank r scoring rows r, r + world, ...; every rank runs as many forwards (an FSDP forward
    is collective): a turn past the rows is a forward of one token."""
    right = 0
    for turn in range(-(-len(task.rows) // world)):
        i = turn * world + rank
        if i < len(task.rows):
            right += is_right(model, enc, task, i, device, autocast)
        else:
            with torch.no_grad(), autocast:
                model(torch.tensor([[BOS]], device=device))
    return summed(right, len(task.rows[rank::world]), device, world)["acc"]


def evaluate(model: GPT, tasks: list[CoreTask], rank: int = 0, world: int = 1,
             autocast: contextlib.AbstractContextManager | None = None,
             say: Callable[[str], None] = print) -> dict[str, Any]:
    """{"results": {label: accuracy}, "centered_results": {label: centered accuracy}, "core_metric": their mean},
    called on every rank; eval mode while it runs. `say` gets a line per task (rank 0's)."""
    device, enc = next(model.parameters()).device, get_tokenizer()
    autocast = autocast or torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    results, centered_results = {}, {}
    with evaluating(model):
        for task in tasks:
            t0 = time.perf_counter()
            results[task.label] = accuracy(model, enc, task, rank, world, device, autocast)
            centered_results[task.label] = centered(results[task.label], 0.01 * task.baseline)
            if rank == 0:
                say(f"core: {task.label} ({task.shots}-shot {task.kind}, {len(task.rows)} rows): accuracy "
                    f"{results[task.label]:.4f} | centered {centered_results[task.label]:.4f} | "
                    f"{time.perf_counter() - t0:.1f} s")
    core = sum(centered_results.values()) / len(centered_results)
    return {"results": results, "centered_results": centered_results, "core_metric": core}


# ----------------------------------------------------------------------------------------------------------------------
# CLI


@dataclass
class CoreConfig:
    """DCLM's CORE score of this project's checkpoint or an HF GPT-2 (runs under torchrun too)."""

    ckpt: str | None = None  # checkpoint of this project (.pt written by train.py)
    init_from: str | None = None  # or HF GPT-2: gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a local HF directory
    bundle: str = BUNDLE_URL  # DCLM's eval bundle: a directory, or a zip's URL (downloaded once into cache_dir)
    cache_dir: str = ""  # where a downloaded bundle is kept ('' = data/ next to this script)
    max_per_task: int = 0  # score each task's first N rows after the shuffle (0 = all), nanochat's subsample
    json: str = ""  # also write {"results", "centered_results", "core_metric"} to this file
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N

    def __post_init__(self) -> None:
        if self.max_per_task < 0:
            raise ValueError(f"--max-per-task must be >= 0 (0 = all rows), got {self.max_per_task}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(CoreConfig, argv, doc=__doc__)
    with own_process_group():
        with user_errors(OSError, ValueError, KeyError, RuntimeError):
            rank, local_rank, world, device = setup_distributed(cfg.device)
            # one download per node; a failure anywhere stops every rank with its message
            bundle = first_on_each_node(lambda: fetch_bundle(cfg.bundle, cfg.cache_dir), local_rank, world)
            tasks = load_tasks(bundle, cfg.max_per_task)
            model = GPT.load(cfg.ckpt, cfg.init_from).to(device)
            if cfg.json:  # its folder made now: a path that cannot be, fails before the evaluation, not after it
                Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
        result = evaluate(model, tasks, rank, world, say=lambda line: print(line, flush=True))
        if rank == 0:
            print(f"core: CORE {result['core_metric']:.4f} over {len(tasks)} tasks of {bundle}")
            if cfg.json:
                Path(cfg.json).write_text(json.dumps(result, indent=1) + "\n")
        return result


if __name__ == "__main__":
    run_and_exit(main)  # under torchrun: no interpreter finalization after the collectives
