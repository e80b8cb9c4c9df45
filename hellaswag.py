"""HellaSwag, completion style: render, score, evaluate(model, ..., rank, world_size) -> metrics; CLI below.

Each example is a context and 4 candidate endings. The model scores each ending by the cross-entropy of its
tokens given the context; `acc` picks the lowest summed loss, `acc_norm` the lowest mean loss per token. This is
the "completion style" of build-nanogpt / llm.c (GPT-2 124M: acc 0.2859, acc_norm 0.2955 on the 10,042
validation examples), not the Eleuther harness's multiple-choice style, whose numbers are higher.

Usage:
    python hellaswag.py --init-from gpt2                      # OpenAI GPT-2 124M via HF
    python hellaswag.py --ckpt out/run/ckpt_019000.pt --limit 1000
    python hellaswag.py --init-from gpt2 --data hellaswag_val.jsonl   # offline: a local copy of the data
    torchrun --standalone --nproc_per_node=8 hellaswag.py --ckpt out/run/ckpt_019000.pt
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from common import (
    EOT,
    GPT2_VOCAB,
    describe_provenance,
    first_on_each_node,
    get_tokenizer,
    own_process_group,
    parse_config,
    provenance,
    run_and_exit,
    setup_distributed,
    user_errors,
)
from fineweb import download as fetch
from generate import evaluating
from model import GPT
from parallel import check_flags

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
SEQ_MULTIPLE = 32  # batches are padded to a multiple of this length, so a compiled model sees few distinct shapes


class HellaSwagError(ValueError):
    """A HellaSwag file or line that is malformed; the message starts with `path:line:`."""


# ----------------------------------------------------------------------------------------------------------------------
# Data


def default_cache_dir() -> Path:
    return Path(__file__).resolve().parent / "data" / "hellaswag"  # data/ is git-ignored


def download(cache_dir: str | Path | None = None, url: str = HELLASWAG_URL) -> Path:
    """The cached validation jsonl, downloaded first if missing (atomically: a cut download leaves no file)."""
    dest = Path(cache_dir or default_cache_dir()) / "hellaswag_val.jsonl"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    return fetch(url, dest, "HellaSwag", f"on an offline machine copy hellaswag_val.jsonl over and pass --data PATH "
                 f"(or place it at {dest})", ConnectionError)


def prepare_example(ex: Any, where: str = "") -> dict:
    """A parsed example, checked (a HellaSwagError, starting with `where`, says what is wrong) and completed: `ctx`
    from `ctx_a + " " + ctx_b` when it is missing, as HellaSwag builds it, and the label an int."""
    if not isinstance(ex, dict):
        raise HellaSwagError(f"{where}expected a JSON object, got {type(ex).__name__}")
    if "ctx" not in ex and not ("ctx_a" in ex and "ctx_b" in ex):
        raise HellaSwagError(f"{where}missing key 'ctx' (or 'ctx_a' and 'ctx_b')")
    if "endings" not in ex:
        raise HellaSwagError(f"{where}missing key 'endings'")
    endings = ex["endings"]
    if not isinstance(endings, list) or len(endings) != 4 or not all(isinstance(e, str) for e in endings):
        got = f"{len(endings)} items" if isinstance(endings, list) else type(endings).__name__
        raise HellaSwagError(f"{where}'endings' must be a list of 4 strings, got {got}")
    if "label" not in ex:
        raise HellaSwagError(f"{where}missing key 'label' (the test split has no labels; use the validation file)")
    # the HF dataset (Rowan/hellaswag) stores the label as a string; str() also takes numpy ints, and refuses True
    if str(ex["label"]) not in ("0", "1", "2", "3"):
        raise HellaSwagError(f"{where}'label' must be an integer 0..3, got {ex['label']!r}")
    ctx = ex["ctx"] if "ctx" in ex else " ".join(s for s in (ex["ctx_a"], ex["ctx_b"]) if s)
    if not ctx.strip():  # an ending is scored as the continuation of the context: it needs one
        raise HellaSwagError(where + "empty context ('ctx', or 'ctx_a' and 'ctx_b', hold no text)")
    return {**ex, "ctx": ctx, "label": int(ex["label"])}


def load_examples(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read and validate HellaSwag jsonl lines (the first `limit` examples if given), completed by prepare_example.
    Blank lines are skipped, and so is a UTF-8 byte order mark at the start (editors on Windows write one); a .gz
    file is read gzipped."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"HellaSwag file {path} is a directory; pass the validation jsonl itself with --data "
                                f"PATH (e.g. {path / 'hellaswag_val.jsonl'})")
    if not path.is_file():
        raise FileNotFoundError(f"HellaSwag file {path} does not exist; pass the validation jsonl with --data PATH, "
                                "or leave --data out to download it")
    examples: list[dict] = []
    # -sig: a byte order mark at the start is not JSON's; .gz: gzipped, as the shared subset and DCLM's copies ship
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8-sig") as f:
        numbered = ((lineno, line) for lineno, line in enumerate(f, start=1) if line.strip())  # blank lines skipped
        for lineno, line in itertools.islice(numbered, limit):
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as e:
                raise HellaSwagError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            examples.append(prepare_example(ex, f"{path}:{lineno}: "))
    if not examples:
        raise HellaSwagError(f"{path}: no examples")
    return examples


# ----------------------------------------------------------------------------------------------------------------------
# Rendering and scoring


@dataclass
class Rendered:
    """One example as tokens: the context once, then the 4 candidate endings."""

    ctx: list[int]  # context tokens, shared by the 4 candidates
    endings: list[list[int]]  # each ending's tokens, encoded with a leading space so it continues the context
    label: int  # index of the correct ending


def render_example(example: dict, enc: Any) -> Rendered:
    """Tokenize an example (from load_examples): candidate i is `ctx + endings[i]`, encoded as ordinary text (an
    `<|endoftext|>` in the text is those 13 characters, not the document separator, which `encode` would refuse)."""
    return Rendered(ctx=enc.encode_ordinary(example["ctx"]),
                    endings=[enc.encode_ordinary(" " + e) for e in example["endings"]], label=example["label"])


def make_batch(batch: list[Rendered], rows: int, block_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and ending masks, (rows, T) each: 4 rows per example, then dummy rows (mask 0) up to a fixed `rows`, T the
    longest candidate rounded up to 32 (few shapes for a compiled model), right-padded out of the causal view. A
    candidate longer than block_size keeps its last block_size tokens."""
    keep = -(block_size or 0)  # no block_size: [0:] keeps all
    seqs = [((r.ctx + end)[keep:], ([0] * len(r.ctx) + [1] * len(end))[keep:]) for r in batch for end in r.endings]
    longest = max((len(s) for s, _ in seqs), default=1)  # an empty batch still makes one (all-dummy) forward
    T = min(SEQ_MULTIPLE * math.ceil(longest / SEQ_MULTIPLE), block_size or math.inf)
    seqs += [([], [])] * (rows - len(seqs))  # the dummy rows
    pad = lambda seq, fill: seq + [fill] * (T - len(seq))  # right-padded to T
    return torch.tensor([pad(s, EOT) for s, _ in seqs]), torch.tensor([pad(m, 0) for _, m in seqs])


def score_batch(model: Any, tokens: torch.Tensor, mask: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean cross-entropy of each row's masked tokens, (rows,) each, in fp32 (0 for dummy rows). Only the
    scored positions are upcast to fp32: the full (rows, T, V) logits in fp32 would be several GB for GPT-2."""
    rows, T = tokens.shape
    scored = mask[:, 1:].bool()  # (rows, T-1): target t+1 is an ending token
    r, t = scored.nonzero(as_tuple=True)  # computed on the CPU tensors: no device sync
    flat = (r * T + t).to(device, non_blocking=True)  # index into logits viewed as (rows*T, V)
    tokens = tokens.to(device, non_blocking=True)
    logits, _ = model(tokens)  # (rows, T, V)
    logits = logits.reshape(rows * T, -1)[flat, :GPT2_VOCAB].float()  # (M, V): padded vocab ids are not tokens
    targets = tokens.view(-1)[flat + 1]  # (M,)
    ce = F.cross_entropy(logits, targets, reduction="none")  # (M,)
    sums = torch.zeros(rows, device=device).index_add_(0, r.to(device), ce)
    counts = scored.sum(1).clamp(min=1).to(device)
    return sums, sums / counts


def _config(model: Any) -> Any:
    """The GPTConfig under torch.compile and DDP wrappers (in either order), or None for another kind of model."""
    while isinstance(model, DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod
    return getattr(model, "config", None)


def evaluate(model: Any, examples: list[dict], device: torch.device | str, rank: int = 0, world_size: int = 1,
             limit: int | None = None, batch_size: int = 16, enc: Any = None, progress: bool = False) -> dict:
    """Completion-style HellaSwag {"acc", "acc_norm", "n", "examples_per_sec"} of `model` (a GPT, or train.py's
    compiled, DDP or FSDP module), called on every rank: ranks take strided shares and all-reduce the counts. Runs
    under no_grad in eval mode (restored after), bf16 autocast on CUDA; `progress` shows a tqdm bar on rank 0's
    terminal (redirected to a file, as runs' logs are, the bar's redraws would be lines among the step lines)."""
    device = torch.device(device)
    # examples made in Python, not by load_examples, are checked here
    examples = [prepare_example(ex, f"example {i}: ") for i, ex in enumerate(examples[:limit])]
    enc = enc or get_tokenizer()
    config = _config(model)  # None (not a GPT): no vocabulary check, candidates not cropped
    block_size = getattr(config, "block_size", None)
    if getattr(config, "vocab_size", enc.n_vocab) < enc.n_vocab:
        raise ValueError(f"the model has {config.vocab_size} embedding rows, fewer than the tokenizer's {enc.n_vocab} "
                         "ids that HellaSwag's text is encoded with")
    t0 = time.perf_counter()
    rendered = [render_example(ex, enc) for ex in examples[rank::world_size]]
    # longest first: less padding per batch, and an out-of-memory batch size fails at once, not at the end
    rendered.sort(key=lambda r: -max(len(r.ctx) + len(e) for e in r.endings))
    # every rank runs as many forwards as the rank with the most examples (the others finish with all-dummy
    # batches): forwards of FSDP and of DDP with buffers are collectives, which hang if one rank skips them
    n_batches = math.ceil(math.ceil(len(examples) / world_size) / batch_size)
    counts = torch.tensor([0, 0, len(rendered)], device=device)  # this rank's acc and acc_norm hits, and examples
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with evaluating(model), torch.no_grad(), autocast:
        for b in tqdm(range(n_batches), desc="hellaswag", unit="batch", disable=True if not progress or rank else None):
            batch = rendered[b * batch_size:(b + 1) * batch_size]  # short or empty at the end
            tokens, mask = make_batch(batch, 4 * batch_size, block_size)
            sums, means = score_batch(model, tokens, mask, device)
            labels = torch.tensor([r.label for r in batch], dtype=torch.long, device=device)
            for j, losses in enumerate((sums, means)):  # acc by the summed loss, acc_norm by the mean per token
                counts[j] += (losses[:4 * len(batch)].view(-1, 4).argmin(1) == labels).sum()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank is when the result is ready
    acc, acc_norm, n = counts.tolist()
    return {"acc": acc / n, "acc_norm": acc_norm / n, "n": n, "examples_per_sec": n / elapsed.item()}


# ----------------------------------------------------------------------------------------------------------------------
# CLI


@dataclass
class HellaSwagConfig:
    """Completion-style HellaSwag accuracy of this project's checkpoint or an HF GPT-2 (runs under torchrun too)."""

    ckpt: str | None = None  # checkpoint of this project (.pt written by any stage)
    init_from: str | None = None  # or HF GPT-2: gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a local HF directory
    data: str | None = None  # local hellaswag_val.jsonl (offline machines); None downloads it into cache_dir
    cache_dir: str | None = None  # where the download goes; None is data/hellaswag next to this script
    limit: int | None = None  # evaluate only the first N examples (quick checks)
    batch_size: int = 16  # examples per forward pass (x4 rows); lower it if the GPU runs out of memory
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    compile: bool = False  # torch.compile the model first (pays off on the full set on a GPU)

    def __post_init__(self) -> None:
        check_flags([(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
                     (self.limit is None or self.limit >= 1, f"--limit must be >= 1 or none, got {self.limit}")])


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(HellaSwagConfig, argv, doc=__doc__)
    with own_process_group():
        with user_errors(OSError, ValueError, RuntimeError):  # torchrun: every rank scores its share; python: one
            rank, local_rank, world_size, device = setup_distributed(cfg.device)
            # one download per node; its failure (an offline machine) stops every rank with its message
            path = Path(cfg.data) if cfg.data is not None else \
                first_on_each_node(lambda: download(cfg.cache_dir), local_rank, world_size)
            examples = load_examples(path, cfg.limit)
            model = GPT.load(cfg.ckpt, cfg.init_from).to(device)
        if rank == 0:
            print(f"hellaswag: {cfg.ckpt or cfg.init_from}, {model.num_params():,} params, {len(examples)} examples; "
                  f"{describe_provenance(provenance(device, world_size))}", file=sys.stderr)
        net = torch.compile(model) if cfg.compile else model
        result = evaluate(net, examples, device, rank, world_size, batch_size=cfg.batch_size, progress=True)
        if rank == 0:
            print(f"hellaswag: acc {result['acc']:.4f} acc_norm {result['acc_norm']:.4f} n {result['n']} "
                  f"({result['examples_per_sec']:.1f} examples/s)", flush=True)
        return result


if __name__ == "__main__":
    run_and_exit(main)  # under torchrun: no interpreter finalization after the collectives
