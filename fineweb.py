"""Token shards: the writer that turns a corpus into llm.c-format GPT-2 shards, and the loader that streams them.

A shard is llm.c's `.bin`: a 256 x int32 little-endian header (magic 20240520, version 1, token count, zeros), then
the tokens as uint16; build-nanogpt's uint16 `.npy` shards are read too. PREFIX_val_000000.bin is validation,
PREFIX_train_000001.bin, ... training: the loader tells them apart by the `_val`/`_train` before the index.

The writer reads the source through `datasets` and writes each document as <|endoftext|> + its GPT-2 tokens, in
order: a .txt file is one document (or one per --txt-unit paragraph or line), stdlib one per .py file, stdlib-docs
one per docstring. The val shard is the stream's first --val-tokens tokens: by default one --shard-size shard
(shakespeare, stdlib-docs: 32768; stdlib: 2**18), or the first 10% of a source too short to leave a train token.

After each shard, PREFIX_done.json records the settings, a local source's files (paths, sizes, mtimes), the shard's
size and where the source stands after it (file, row, tokens of that row's document written). A rerun with the same
settings and files keeps the intact shards and reads on from there, earlier files unread: the shards come out
byte-identical to an uninterrupted run's. A finished run is not read again; other settings or files write every shard
again. Bad input ends in one line naming the file or flag, with --out-dir left as it was.

Usage:
    python fineweb.py                                  # fineweb-edu sample-10BT -> data/edu_fineweb10B
    python fineweb.py --source shakespeare             # Tiny Shakespeare -> data/shakespeare
    python fineweb.py --source stdlib-docs             # this Python's stdlib docstrings -> data/stdlib_docs
    python fineweb.py --source notes.txt               # a small file: its first 10% val, the rest train
    python fineweb.py --source "corpus/*.jsonl" --out-dir data/mine --shard-size 10000000 --val-tokens 1000000
"""

from __future__ import annotations

import ast
import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import signal
import sys
import sysconfig
import time
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from itertools import count, islice, takewhile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import EOT, get_tokenizer, hold_lock, parse_config

MAGIC, VERSION, HEADER_BYTES = 20240520, 1, 1024  # llm.c's token shard (20240326 is its model-weights file)
FINEWEB = "HuggingFaceFW/fineweb-edu"
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"  # that file's
SHAKESPEARE_BYTES = 1_115_394
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # suffix -> datasets
# stdlib directories left out of --source stdlib: tests, third-party packages, and generated tables (codec maps,
# pydoc's topic dump) that are Python only in syntax
STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings", "pydoc_data"}
SHUFFLES = ("windows", "shards")  # TokenLoader's train orders within an epoch (see its docstring)
START = (0, 0, 0, 0, 0)  # a source position: part, row in it, row in the source, parts, tokens of its document written


class DataError(ValueError):
    """A user-fixable problem with the data (bad path, shard, source or flag); the message says how to fix it."""


# ----------------------------------------------------------------------------------------------------------------------
# Shard format


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write tokens as an llm.c `.bin` shard, atomically: a temporary file in the same directory, then rename."""
    path, tokens = Path(path), np.asarray(tokens)
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise DataError(f"{path}: token ids must fit in uint16 (0..65535), got {tokens.min()}..{tokens.max()}")
    header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
    header[:3] = MAGIC, VERSION, len(tokens)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # dot-prefixed and .tmp: no glob of shards matches it
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(np.ascontiguousarray(tokens, dtype="<u2").data)
            f.flush()
            os.fsync(f.fileno())  # the rename must never expose a file whose bytes are not on disk yet
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a shard's tokens (uint16, never loaded whole) after checking its header against its size."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"shard {path} does not exist")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, EOFError, OSError) as e:  # EOFError: an empty (0-byte) file
            raise DataError(f"{path} is not a readable .npy file ({type(e).__name__}: {e}); delete or rewrite it "
                            "with fineweb.py") from None
        if arr.dtype != np.uint16 or arr.ndim != 1:
            raise DataError(f"{path}: expected a 1-D uint16 token array (build-nanogpt format), got {arr.dtype} "
                            f"with shape {arr.shape}; rewrite it with fineweb.py")
        return arr
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path} is truncated: {size} bytes, less than the {HEADER_BYTES}-byte header; "
                        "delete it and rerun fineweb.py")
    magic, version, n = (int(v) for v in np.fromfile(path, dtype="<i4", count=3))
    if magic != MAGIC:
        hint = " (that is an llm.c model file, not tokens)" if magic == 20240326 else ""
        raise DataError(f"{path}: bad magic number {magic}{hint}, expected {MAGIC} (llm.c token shard); "
                        "write shards with fineweb.py")
    if version != VERSION:
        raise DataError(f"{path}: unsupported shard version {version}, expected {VERSION}; rewrite it with fineweb.py")
    if size != HEADER_BYTES + 2 * n:
        raise DataError(f"{path}: header says {n:,} tokens ({HEADER_BYTES + 2 * n:,} bytes) but the file has "
                        f"{size:,} bytes: truncated or corrupt; delete it and rerun fineweb.py")
    # mmap cannot map zero bytes
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,)) if n else np.zeros(0, np.uint16)


def find_shards(pattern: str | os.PathLike, split: str) -> list[Path]:
    """The `split` shards (.bin or .npy) in a directory or matched by a glob, sorted by path."""
    pattern = str(pattern)
    # the split is the last word before the index and suffix (PREFIX_val_000000.bin, llm.c's PREFIX_val.bin),
    # anchored at the end: a prefix that is a split word (train_val_000000.bin) is never taken for the other split
    marker = re.compile(rf"(?:.*_)?{split}(?:_\d+)?\.(?:bin|npy)")
    base = Path(pattern).expanduser()
    if any(c in pattern for c in "*?["):
        files = [Path(f) for f in glob.glob(str(base), recursive=True)]
    elif base.exists():
        files = list(base.iterdir()) if base.is_dir() else [base]
    else:
        # the presets' own corpora have a source of their own: fineweb.py's default source is fineweb-edu
        source = {"stdlib": "--source stdlib ", "stdlib_docs": "--source stdlib-docs ",
                  "shakespeare": "--source shakespeare "}.get(base.name, "")
        raise DataError(f"data directory {pattern} does not exist; write shards there with "
                        f"`python fineweb.py {source}--out-dir {pattern}`"
                        f"{'' if source else ' (fineweb-edu; --source picks another corpus)'} or point --data at a "
                        "directory or glob of shards")
    files = sorted(f for f in files if marker.fullmatch(f.name) and f.is_file())
    if not files:
        raise DataError(f"no {split} shards in {pattern} (looked for names ending in _{split}.bin or "
                        f"_{split}_NNNNNN.bin, or .npy); write them with `python fineweb.py` or point --data at the "
                        "right directory or glob")
    return files


# ----------------------------------------------------------------------------------------------------------------------
# Loader


class TokenLoader:
    """Shuffled, exactly-once, resumable batches of (x, y) from one split's shards, for one rank.

    Shards are cut into windows of B*T+1 tokens at stride B*T (a shorter tail is skipped). Train epochs read the
    shards, and with shuffle="windows" each shard's windows, in seeded orders; val reads all in order. Rank r's s-th
    batch is window s * world_size + r of one stream over all epochs, so the position is one `step`, the same on every
    rank: `state_dict()` from any rank resumes all of them. The full rules: docs/fineweb.md.
    """

    def __init__(self, pattern: str, split: str, B: int, T: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, device: str | torch.device = "cpu", preload: bool = False, shuffle: str = "windows"):
        if shuffle not in SHUFFLES:
            raise ValueError(f"shuffle must be 'windows' or 'shards', got {shuffle!r}")
        self.split, self.B, self.T, self.rank, self.world_size, self.seed = split, B, T, rank, world_size, seed
        self.shuffle = shuffle if split == "train" else "none"  # val: file order, windows in order
        self.device = torch.device(device)
        self.files = find_shards(pattern, split)
        self._shards = [read_shard(f) for f in self.files]  # memory maps, not loaded
        self._lengths = lengths = np.array([len(s) for s in self._shards], dtype=np.int64)
        self._windows = self._windows_per_shard(B)
        self.num_windows = int(self._windows.sum())  # windows per epoch over all ranks
        if self.num_windows == 0:
            big = int(lengths.argmax())
            raise DataError(f"no {split} shard has B*T+1 = {B * T + 1:,} tokens (B={B}, T={T}); the largest, "
                            f"{self.files[big]}, has {lengths[big]:,}; lower --batch-size/--seq-len or write more data")
        # (a val split may have fewer: components.val_loss scores each window once, on whichever rank it falls to)
        if split == "train" and self.num_windows < world_size:
            raise DataError(f"world size {world_size} is too large for the {split} data: it has only "
                            f"{self.num_windows} windows of B*T+1 = {B * T + 1:,} tokens, fewer than one per rank; "
                            "use fewer ranks, a smaller --batch-size/--seq-len, or more data")
        self._preloaded: torch.Tensor | None = None
        if preload:  # one device tensor of the whole split; offsets let it serve the very same windows
            self._starts = np.cumsum(lengths) - lengths
            self._preloaded = torch.from_numpy(np.concatenate(self._shards).astype(np.int64)).to(self.device)
        self.vocab_size: int | None = None  # set by check_vocab: token ids must be below it
        self.resume_skipped = 0  # tokens the last load_state_dict skipped in the shard being read (see _regrid)
        self.reset()

    def _windows_per_shard(self, B: int) -> np.ndarray:
        """Windows of B*T+1 tokens at stride B*T in each shard (the last token of one is the first of the next)."""
        return np.maximum(self._lengths - 1, 0) // (B * self.T)

    @property
    def tokens_per_epoch(self) -> int:
        """x tokens in one epoch, all ranks together: every window once."""
        return self.num_windows * self.B * self.T

    @property
    def epoch(self) -> int:
        """The epoch of this rank's next window (ranks may differ by one during the step that straddles epochs)."""
        return (self.step * self.world_size + self.rank) // self.num_windows

    def reset(self) -> None:
        """Back to the first batch of epoch 0 (for val: the same batches on every call)."""
        self.step = 0  # batches each rank has served since reset: the whole position

    def shard_order(self, epoch: int) -> np.ndarray:
        """Indices into self.files in the order epoch `epoch` reads them."""
        if self.split == "val":
            return np.arange(len(self.files))
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.files))

    def _locate(self, g: int) -> tuple[int, int]:
        """(shard index, first token) of global window g of the stream."""
        epoch, w = divmod(g, self.num_windows)
        order = self.shard_order(epoch)
        cum = np.cumsum(self._windows[order])
        i = int(np.searchsorted(cum, w, side="right"))
        shard, k = int(order[i]), w - (int(cum[i - 1]) if i else 0)  # the shard's k-th window served this epoch
        if self.shuffle == "windows":  # a stream of its own per (epoch, shard), apart from the shard order's
            k = int(np.random.default_rng((self.seed, epoch, shard + 1)).permutation(int(self._windows[shard]))[k])
        return shard, k * self.B * self.T

    def check_vocab(self, vocab_size: int) -> None:
        """Make every batch from now on check that its ids are below vocab_size, the model's embedding rows: on
        CUDA a larger id fails as an assert that names nothing. A preloaded split is checked once, here, all of it."""
        self.vocab_size = vocab_size
        if self._preloaded is not None and self._preloaded.numel():
            top = int(self._preloaded.max())
            if top >= vocab_size:
                at = int(np.searchsorted(self._starts, int(torch.argmax(self._preloaded)), side="right")) - 1
                self._bad_token(self.files[at], top)

    def _bad_token(self, path: Path, token: int) -> None:
        raise DataError(f"{path} holds token id {token}, but the model has only {self.vocab_size} embedding rows: "
                        "the shard was written with another tokenizer, or is corrupt; rewrite it with fineweb.py")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y), each int64 (B, T) on the loader's device."""
        shard, start = self._locate(self.step * self.world_size + self.rank)
        self.step += 1
        n = self.B * self.T + 1
        if self._preloaded is not None:
            first = int(self._starts[shard]) + start
            buf = self._preloaded[first:first + n].clone()  # a copy: an in-place edit of x must not alter the data
        else:
            window = self._shards[shard][start:start + n]
            if self.vocab_size is not None and (top := int(window.max())) >= self.vocab_size:
                self._bad_token(self.files[shard], top)
            buf = torch.from_numpy(window.astype(np.int64))  # (B*T+1,)
            if self.device.type == "cuda":  # pinned, so the copy is asynchronous and overlaps the previous step
                buf = buf.pin_memory().to(self.device, non_blocking=True)
            elif self.device.type != "cpu":
                buf = buf.to(self.device)
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)

    def state_dict(self) -> dict[str, Any]:
        """The exact position plus what it is relative to; plain ints, strs and lists (safe for weights_only)."""
        return {"split": self.split, "B": self.B, "T": self.T, "world_size": self.world_size, "seed": self.seed,
                "shuffle": self.shuffle, "shards": [f.name for f in self.files],
                "shard_tokens": self._lengths.tolist(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; it must come from a loader over the same shards, T and seed. The world size and B
        may differ: the position is mapped onto the new ranks and, for another B, onto the new grid of windows."""
        if "epoch" in state:  # (epoch, step within it) from the loader that dropped each epoch's last windows
            raise DataError(f"cannot resume the {self.split} loader: its state (epoch={state['epoch']!r}, "
                            f"step={state.get('step')!r}) was written by an older loader that dropped windows at each "
                            "epoch's end, and has no equivalent position here; start a fresh run")
        mine = self.state_dict()
        for key, what in (("split", "split"), ("T", "--seq-len"), ("seed", "--seed"),
                          ("shards", "shard files"), ("shard_tokens", "shard sizes")):
            if state.get(key) != mine[key]:
                raise DataError(f"cannot resume the {self.split} loader: {_mismatch(key, state.get(key), mine[key])}; "
                                f"resume with the same {what} or start a fresh run")
        for key, name, unit, low in (("B", "batch size B", "sequences", 1), ("step", "position step", "batches", 0),
                                     ("world_size", "world_size", "ranks", 1)):
            if not isinstance(value := state.get(key), int) or isinstance(value, bool) or value < low:
                raise DataError(f"cannot resume the {self.split} loader: its {name}={value!r} is not a count of "
                                f"{unit} >= {low}; the checkpoint is corrupt, start a fresh run")
        # the stream does not depend on the world size: the new ranks start at the first multiple of theirs at or
        # after the step * world windows served, none twice (docs/fineweb.md)
        old_b, old_shuffle, served = state["B"], self.state_shuffle(state), state["step"] * state["world_size"]
        self.resume_skipped = 0
        if (old_b, old_shuffle) != (self.B, self.shuffle):
            served = self._regrid(served, old_b, old_shuffle)
        self.step = -(-served // self.world_size)

    @staticmethod
    def state_shuffle(state: dict[str, Any]) -> str:
        """The order in which `state`'s loader read each shard's windows; states from before they were shuffled
        have no "shuffle" and read them in order."""
        return state.get("shuffle", "shards")

    def continues_in_shard(self, old_shuffle: str) -> bool:
        """Whether a resume from another B or shuffle mode goes on inside the shard being read (see _regrid): only
        where neither side shuffles the windows within a shard."""
        return "windows" not in (old_shuffle, self.shuffle)

    def _regrid(self, served: int, old_b: int, old_shuffle: str = "shards") -> int:
        """The global window of this loader's grid at which to go on after `served` windows of old_b * T tokens: the
        first new window at or after the old cut, in the same shard order, so none is served twice. Where either side
        shuffles windows within a shard, it is the next shard's first; resume_skipped counts the tokens that skips.
        Details: docs/fineweb.md."""
        old = self._windows_per_shard(old_b)
        if not old.sum():
            raise DataError(f"cannot resume the {self.split} loader: its batch size B={old_b} leaves no window of "
                            f"B*T+1 tokens in any shard, so it served none; the checkpoint is corrupt, start a fresh "
                            "run")
        epoch, w = divmod(served, int(old.sum()))
        order = self.shard_order(epoch)
        cum_old, cum_new = np.cumsum(old[order]), np.cumsum(self._windows[order])
        i = int(np.searchsorted(cum_old, w, side="left"))  # the shard holding the last window served (0 if none)
        done = w - (int(cum_old[i - 1]) if i else 0)  # old windows served from shard order[i]
        if self.continues_in_shard(old_shuffle):
            within = min(-(-done * old_b // self.B), int(self._windows[order[i]]))
        else:
            within = int(self._windows[order[i]]) if done else 0
            self.resume_skipped = (int(old[order[i]]) - done) * old_b * self.T if done else 0
        return epoch * self.num_windows + (int(cum_new[i - 1]) if i else 0) + within


def _mismatch(key: str, theirs: Any, mine: Any) -> str:
    """How a checkpoint's loader state differs from this loader's in `key`."""
    if key == "shards":  # the first name that differs says more than the counts, which may agree
        n = max(len(theirs or []), len(mine))
        there, here = ([*names, *["none"] * (n - len(names))] for names in (theirs or [], mine))
        i = next(i for i in range(n) if there[i] != here[i])
        return (f"other shard files ({len(theirs or [])} in the checkpoint, {len(mine)} here; file {i + 1} is "
                f"{there[i]} there, {here[i]} here)")
    if key == "shard_tokens":
        return "shards of other sizes (the same names, rewritten since)"
    return f"{key}={theirs!r} in the checkpoint but {mine!r} here"


# ----------------------------------------------------------------------------------------------------------------------
# Writer: config and sources


@dataclass
class FinewebConfig:
    """Tokenize a corpus with GPT-2 BPE into llm.c-format token shards: the first is val, the rest train."""

    # hub dataset, shakespeare, stdlib, stdlib-docs, or a local file/dir/glob of .txt/.jsonl/.json/.parquet
    source: str = FINEWEB
    name: str = ""  # hub dataset config ('' = sample-10BT for fineweb-edu, none otherwise)
    split: str = "train"  # hub dataset split to read
    revision: str = ""  # hub dataset commit to read ('' = the latest): pin it to reproduce shards exactly
    text_field: str = "text"  # column that holds each document's text
    txt_unit: str = "document"  # a .txt source yields one document per: document (whole file), paragraph or line
    out_dir: str = ""  # output directory ('' = data/edu_fineweb10B for fineweb-edu, else data/<source name>)
    prefix: str = ""  # shard names are PREFIX_val_000000.bin, PREFIX_train_000001.bin ('' = from the source)
    shard_size: int = 100_000_000  # tokens per train shard
    val_tokens: int = -1  # val shard = first N tokens (-1: shard-size; shakespeare, stdlib-docs 32768; stdlib 2**18)
    workers: int = 0  # tokenizer processes (0 = every available core)
    max_tokens: int = 0  # stop after this many tokens in all, val included (0 = the whole source)
    streaming: bool = True  # stream the source rather than download all of it into the HF cache first
    cache_dir: str = "~/.cache/gpt2-project"  # where --source shakespeare is downloaded to (and stdlib-docs written)
    shakespeare_path: str = ""  # a local Tiny Shakespeare instead of the download (the very file fills --cache-dir too)

    def __post_init__(self) -> None:
        if self.txt_unit not in ("document", "paragraph", "line"):
            raise ValueError(f"--txt-unit must be document, paragraph or line, got {self.txt_unit!r}")
        if not 1 <= self.shard_size < 2**31:  # the header stores an int32 count
            raise ValueError(f"--shard-size must be in [1, 2**31), got {self.shard_size}")
        if not (self.val_tokens == -1 or 1 <= self.val_tokens < 2**31):
            raise ValueError(f"--val-tokens must be -1 (a default per source) or in [1, 2**31), got {self.val_tokens}")
        if self.workers < 0 or self.max_tokens < 0:
            raise ValueError("--workers and --max-tokens must be >= 0 (0 = all cores / the whole source)")
        if self.max_tokens and self.val_tokens != -1 and self.max_tokens <= self.val_tokens:
            raise ValueError(f"--max-tokens {self.max_tokens} leaves no train tokens after the val shard's "
                             f"--val-tokens {self.val_tokens}; raise --max-tokens or lower --val-tokens")
        kind = source_kind(self.source)
        plain = Path(*takewhile(lambda part: not any(c in part for c in "*?["), Path(self.source).parts))
        # corpus/*.jsonl -> corpus, books.txt -> books, org/name -> name, stdlib-docs -> stdlib_docs
        stem = "edufineweb" if kind == "fineweb" else re.sub(r"[^A-Za-z0-9]+", "_", plain.name.split(".")[0]).strip("_")
        stem = stem or "data"
        self.prefix = self.prefix or stem
        self.out_dir = self.out_dir or ("data/edu_fineweb10B" if kind == "fineweb" else f"data/{stem}")
        if kind == "fineweb" and not self.name:
            self.name = "sample-10BT"

    @property
    def val_target(self) -> int:
        """The size of a full val shard: --val-tokens, or its default for the source (-1). A source that ends before
        a default-sized val shard leaves a train token gets the 10% rule instead (see ShardWriter.finish)."""
        defaults = {"shakespeare": 32_768, "stdlib": 2**18, "stdlib-docs": 32_768}  # ~10%, ~6%, ~7%
        return self.val_tokens if self.val_tokens != -1 else defaults.get(source_kind(self.source), self.shard_size)


def source_kind(source: str) -> str:
    """fineweb, shakespeare, stdlib, stdlib-docs, local or hub."""
    if source in ("shakespeare", "stdlib", "stdlib-docs"):
        return source
    path = Path(source).expanduser()
    if source == FINEWEB:
        return "fineweb"
    if any(c in source for c in "*?[") or path.exists() or path.suffix in LOCAL_BUILDERS or source[:1] in "./~":
        return "local"
    return "hub"


def local_files(source: str, out_dir: str | os.PathLike) -> list[Path]:
    """The files of a local source, sorted, all of one type (one `datasets` builder: text, json or parquet). The
    writer's records in out_dir are never input: `--source data/corpus` writes to data/corpus by default."""
    path, out = Path(source).expanduser(), Path(out_dir).expanduser().resolve()
    if any(c in source for c in "*?["):
        files = [Path(f) for f in glob.glob(str(path), recursive=True)]
    elif path.exists():
        files = [f for f in path.rglob("*") if f.suffix in LOCAL_BUILDERS] if path.is_dir() else [path]
    else:
        raise DataError(f"--source {source} does not exist; pass a file, directory or glob of "
                        ".txt/.jsonl/.json/.parquet, or a hub dataset name")
    files = sorted(f for f in files if f.is_file() and not (f.parent.resolve() == out and f.name.endswith("_done.json")
                                                             or f.name.endswith("_parts.json")))
    suffixes = {f.suffix for f in files}
    if not files or not suffixes <= set(LOCAL_BUILDERS):
        found = f" (found {', '.join(sorted(suffixes))})" if suffixes else ""
        raise DataError(f"--source {source} matches no .txt/.jsonl/.json/.parquet files{found}")
    if len({LOCAL_BUILDERS[s] for s in suffixes}) > 1:
        raise DataError(f"--source {source} mixes file types ({', '.join(sorted(suffixes))}); pass a glob that "
                        "matches one type, e.g. 'dir/*.jsonl'")
    if all(f.stat().st_size == 0 for f in files):
        raise DataError(f"--source {source} is empty: its {len(files)} file(s) hold no bytes")
    return files


def stdlib_files() -> list[Path]:
    """This Python's standard-library .py files (no tests, site-packages or generated tables), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_docstrings(cfg: FinewebConfig) -> Path:
    """The distinct docstrings of stdlib_files(), one JSON line each, written once into --cache-dir: English prose
    about Python, which a small model learns to write in minutes (code's indentation costs a token per space)."""
    path = Path(cfg.cache_dir).expanduser() / f"stdlib_docstrings_py{sys.version_info[0]}.{sys.version_info[1]}.jsonl"
    with contextlib.suppress(OSError):
        try:
            [json.loads(line) for line in path.read_text().splitlines()]
            return path
        except ValueError:  # cut short (a full disk, an older writer's partial copy), or damaged
            print(f"note: {path} is damaged; writing it again")
    docs: dict[str, None] = {}  # ordered and deduplicated
    for file in stdlib_files():
        with contextlib.suppress(SyntaxError, ValueError):  # a file of another Python's syntax
            for node in ast.walk(ast.parse(file.read_bytes())):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    docs.setdefault(ast.get_docstring(node) or "")
    docs.pop("", None)
    _cache(path, "".join(json.dumps({"text": doc}) + "\n" for doc in docs).encode())
    return path


def _cache(path: Path, data: bytes) -> None:
    """Write path atomically (a temporary file, then a rename), so a kill mid-write never leaves a partial copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def shakespeare_file(cfg: FinewebConfig) -> Path:
    """Tiny Shakespeare: --shakespeare-path if given, else the cached download (fetched once). A local copy that is
    the very file (its sha256) also fills an empty cache, so a later run without the flag works offline."""
    path = Path(cfg.cache_dir).expanduser() / "tinyshakespeare.txt"
    if local := cfg.shakespeare_path and Path(cfg.shakespeare_path).expanduser():
        if local.is_dir():
            inside = local / "tinyshakespeare.txt"
            raise DataError(f"--shakespeare-path {cfg.shakespeare_path} is a directory; pass the file itself"
                            + (f": --shakespeare-path {inside}" if inside.is_file() else
                               ", a local copy of tinyshakespeare.txt"))
        if not local.is_file():
            raise DataError(f"--shakespeare-path {cfg.shakespeare_path} does not exist; pass the path of a local "
                            "copy of tinyshakespeare.txt, or leave it empty to download it")
        if not path.is_file() and local.stat().st_size == SHAKESPEARE_BYTES \
                and hashlib.sha256(data := local.read_bytes()).hexdigest() == SHAKESPEARE_SHA256:
            with contextlib.suppress(OSError):  # a cache that cannot be written is no reason to stop
                _cache(path, data)
        return local
    if not path.is_file():
        try:
            with urllib.request.urlopen(SHAKESPEARE_URL, timeout=60) as r:
                _cache(path, r.read())
        except OSError as e:  # urllib's URLError among them
            raise DataError(f"could not download Tiny Shakespeare from {SHAKESPEARE_URL} ({e}); pass "
                            "--shakespeare-path with a local copy") from None
    return path


def source_files(cfg: FinewebConfig) -> list[Path] | None:
    """The files a non-hub source reads, in order (None for a hub dataset); fetches Tiny Shakespeare once."""
    kind = source_kind(cfg.source)
    files = {"stdlib": stdlib_files, "stdlib-docs": lambda: [stdlib_docstrings(cfg)],
             "shakespeare": lambda: [shakespeare_file(cfg)], "local": lambda: local_files(cfg.source, cfg.out_dir)}
    return files[kind]() if kind in files else None


# ----------------------------------------------------------------------------------------------------------------------
# Writer: reading and tokenizing


def _open_source(cfg: FinewebConfig, files: list[Path] | None) -> list[tuple[Any, str, Path | None]]:
    """The source as parts (rows, where they are, their file if known), in order. Streamed, a source of several
    files (local, or a hub dataset's) comes a file a part: a resume skips whole files unread."""
    import datasets

    source, kind = f"--source {cfg.source}", source_kind(cfg.source)
    if files is None:
        pin = {"revision": cfg.revision} if cfg.revision else {}
        ds = datasets.load_dataset(cfg.source, name=cfg.name or None, split=cfg.split, streaming=cfg.streaming, **pin)
        n = ds.num_shards if isinstance(ds, datasets.IterableDataset) else 1
        return [(ds.shard(n, i, contiguous=True), f"file {i + 1} of {n} of {source}", None) for i in range(n)] \
            if n > 1 else [(ds, source, None)]
    builder = "text" if kind in ("stdlib", "shakespeare") else LOCAL_BUILDERS[files[0].suffix]
    options = {"sample_by": "document" if kind == "stdlib" else cfg.txt_unit} if builder == "text" else {}
    ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=cfg.streaming,
                               **options)
    if len(files) > 1 and isinstance(ds, datasets.IterableDataset) and ds.num_shards == len(files):
        return [(ds.shard(len(files), i, contiguous=True), f"{f} of {source}", f) for i, f in enumerate(files)]
    return [(ds, source, files[0] if len(files) == 1 else None)]


def _read_error(cfg: FinewebConfig, where: str, file: Path | None, err: Exception) -> DataError:
    """One line for an error raised while `datasets` read the source: where, the root cause, and what to do."""
    import datasets
    import pyarrow.parquet as pq

    cause: BaseException = err
    # datasets wraps a builder's error (raise DatasetGenerationError from e) and may re-raise inside an except, so
    # the useful message is at the end of __cause__, or in the __context__ of a wrapper that has none
    while (inner := cause.__cause__ or (cause.__context__ if isinstance(cause, datasets.exceptions.DatasetsError)
                                        else None)) is not None:
        cause = inner
    message = " ".join(f"{type(cause).__name__}: {cause}".split())  # its messages can span several lines
    message = message if len(message) <= 300 else message[:297] + "..."
    fix = "fix that file or leave it out of --source"
    if isinstance(cause, UnicodeDecodeError):
        fix = "convert it to UTF-8 (e.g. iconv -t UTF-8) or leave it out of --source"
    elif isinstance(cause, datasets.table.CastError):
        fix = (f"its columns differ from the first file's; give every file the same columns, --text-field "
               f"{cfg.text_field!r} among them, or pass a glob that leaves the odd ones out")
    elif file is not None and file.suffix == ".parquet":
        with contextlib.suppress(OSError, ValueError):  # corrupt: no row count to tell
            fix = "the file has no rows; delete it or leave it out of --source" \
                if pq.read_metadata(file).num_rows == 0 else fix
    elif source_kind(cfg.source) in ("fineweb", "hub"):
        fix = "check the network and rerun (complete shards are kept)"
    return DataError(f"could not read {where}: {message}; {fix}")


def read_documents(cfg: FinewebConfig, files: list[Path] | None,
                   start: Iterable[int] = START) -> Iterator[tuple[str, tuple[int, int, int, int]]]:
    """The source's non-empty texts from position `start` on, each with its position (part, row in it, row in the
    source, parts). Reading opens start's part where the source has as many parts as when it was taken, else the
    first. A read error becomes one DataError line naming the file (streaming) or --source, and the root cause."""
    import datasets  # lazily: the loader above must import on machines without `datasets`
    import pyarrow

    # what reading data raises (bad bytes, bad JSON, a schema mismatch, a network drop); anything else is a bug
    reading = (OSError, ValueError, pyarrow.ArrowException, datasets.exceptions.DatasetsError)
    logging.getLogger("datasets").setLevel(logging.CRITICAL)  # it logs a read error before raising it: one line here
    try:
        parts = _open_source(cfg, files)
    except reading as e:
        if files is None:
            raise DataError(f"could not load hub dataset --source {cfg.source} (--name {cfg.name or 'none'}, --split "
                            f"{cfg.split}): {type(e).__name__}: {e}; check the names and the network, or pass a "
                            "local file, directory or glob") from None
        raise _read_error(cfg, f"--source {cfg.source}", None, e) from None
    part, row, first, n = list(start)[:4]
    part, g = (part, first - row) if n == len(parts) else (0, 0)
    for p, (data, where, file) in enumerate(parts[part:], part):
        rows = iter(data)
        for r in count():
            try:
                item = next(rows)
            except StopIteration:
                break
            except reading as e:
                raise _read_error(cfg, where, file, e) from None
            if cfg.text_field not in item:
                raise DataError(f"--text-field {cfg.text_field!r} is not in {where}; its columns are "
                                f"{', '.join(item)}; pass one of them with --text-field")
            if (text := item[cfg.text_field]) and not isinstance(text, str):
                raise DataError(f"--text-field {cfg.text_field!r} of {where} holds {type(text).__name__}, not text; "
                                "pass a text column with --text-field")
            if text and g >= first:  # an empty text would be a lone EOT
                yield text, (p, r, g, len(parts))
            g += 1


def _pool_worker_init(parent: int | None) -> None:
    """Restore SIGTERM's default (an inherited handler could keep the pool from closing) and, on Linux, ask for
    SIGTERM when the parent dies, so a writer killed outright leaves no worker behind (docs/fineweb.md). `parent`:
    the writer's pid when it forked the worker itself, else None."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if parent is not None and os.getppid() != parent:  # the writer died before the request was in place
            os._exit(1)


def tokenize(texts: list[str]) -> np.ndarray:
    """`<|endoftext|>` + GPT-2 tokens for each text, concatenated, as uint16 (each document starts with EOT)."""
    enc = get_tokenizer()  # cached per process: each pool worker builds its own once
    # special-token text in the data is just text: EOT only ever opens a document
    return np.array([t for text in texts for t in (EOT, *enc.encode_ordinary(text))], dtype=np.uint16)


@contextlib.contextmanager
def tokenizer_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """Processes that tokenize (None for one worker: the caller's own process does). An executor, not a Pool: when a
    worker dies, a Pool replaces it and its chunk never comes back; the executor fails every pending chunk instead."""
    if workers <= 1:
        yield None
        return
    import multiprocessing

    forked = multiprocessing.get_start_method() == "fork"
    pool = ProcessPoolExecutor(workers, initializer=_pool_worker_init, initargs=(os.getpid() if forked else None,))
    try:
        pool.submit(int).result()  # fork every worker now, before `datasets` starts threads (fork + threads deadlock)
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # chunks still queued are dropped, running ones finish


def token_stream(docs: Iterable[tuple[str, Any]], pool: ProcessPoolExecutor | None, workers: int,
                 chunk: int = 16) -> Iterator[tuple[np.ndarray, list[Any]]]:
    """(tokens, positions) of `docs` (text, position), `chunk` documents at a time, tokenized in order by the pool's
    processes (or here), 4 chunks per worker in flight: Executor.map would queue the whole streamed source."""
    pending: deque[tuple[Any, list[Any]]] = deque()
    it = iter(docs)
    try:
        while batch := list(islice(it, chunk)):
            texts = [text for text, _ in batch]
            pending.append((pool.submit(tokenize, texts).result if pool else partial(tokenize, texts),
                            [position for _, position in batch]))
            while len(pending) >= (4 * workers if pool else 1):
                job, positions = pending.popleft()
                yield job(), positions
        for job, positions in pending:
            yield job(), positions
    except BrokenProcessPool as e:  # raised by result(), and by submit() once the pool knows
        raise DataError("a tokenizer process exited unexpectedly (killed, e.g. out of memory, or it could not "
                        "start); the shards written so far are complete: run the same command again to continue "
                        "after them") from e


# ----------------------------------------------------------------------------------------------------------------------
# Writer: shards and their record


def shard_path(cfg: FinewebConfig, index: int) -> Path:
    return Path(cfg.out_dir).expanduser() / f"{cfg.prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def record_key(cfg: FinewebConfig, files: list[Path] | None) -> dict[str, Any]:
    """What the shards are made of: the settings that shape them, and a local source's files by absolute path, size
    and mtime (hashed), so a rerun after a file was added, removed or edited writes again."""
    keys = ("source", "name", "split", "text_field", "txt_unit", "prefix", "shard_size", "val_tokens", "max_tokens")
    settings = {k: getattr(cfg, k) for k in keys} | ({"revision": cfg.revision} if cfg.revision else {})
    if files is None:  # a hub dataset: --revision pins it
        return {"settings": settings, "inputs": None}
    stats = [(os.fsencode(f.resolve()), f.stat()) for f in files]
    digest = hashlib.sha256(b"".join(p + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode() for p, st in stats))
    return {"settings": settings,
            "inputs": {"files": len(files), "bytes": sum(st.st_size for _, st in stats), "sha256": digest.hexdigest()}}


def resume_point(cfg: FinewebConfig, key: dict[str, Any], record: dict[str, Any]) -> tuple[int, Any]:
    """How many recorded shards a run keeps (those intact, from shard 0 on) and the source position after them, or
    None where they are a whole finished run. Shards of other settings or inputs, or with no record, are not kept."""
    if {k: record.get(k) for k in key} != key:
        if record:
            print(f"{cfg.out_dir}: its shards were written from other input files or settings; writing them again")
        return 0, START
    sizes, kept = list(record["shards"].values()), 0
    with contextlib.suppress(DataError):  # a shard missing, cut short or damaged ends the kept ones
        while kept < len(sizes) and len(read_shard(shard_path(cfg, kept))) == sizes[kept]:
            kept += 1
    if kept == len(sizes) and record.get("done", True):  # (records without resume points were written when done)
        return kept, None
    point = record.get("resume", {}).get(shard_path(cfg, kept - 1).name) if kept else START
    return (kept, point) if point else (0, START)


class ShardWriter:
    """Cuts the token stream into shards after the `kept` ones on disk (the val shard, then --shard-size train shards)
    and records each with the source position after it. It holds the lock on --out-dir from its first change there
    to the end of its `with`."""

    def __init__(self, cfg: FinewebConfig, key: dict[str, Any], record: dict[str, Any] | None = None, kept: int = 0,
                 point: Iterable[int] = START):
        names = [shard_path(cfg, i).name for i in range(kept)]
        self.record = {**key, "done": False, **{k: {n: (record or {}).get(k, {}).get(n) for n in names}
                                                for k in ("shards", "resume")}}
        self.cfg, self.kept, self._lock, self.bar = cfg, kept, None, None
        self.written = self.total = sum(self.record["shards"].values())  # tokens in the kept shards, in all
        self.index, self.fill, self.docs = kept, 0, 0  # shard being filled, its tokens, documents this run writes
        self.val, self.limit = cfg.val_target, cfg.max_tokens or float("inf")
        self.point = list(point)  # the last buffered token's document, and its tokens buffered or written
        self.drop = self.point[4]  # the first document's tokens that are on disk already
        self.buf = np.empty(self.val if kept == 0 else cfg.shard_size, dtype=np.uint16)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.close()

    def write_all(self, stream: Iterable[tuple[np.ndarray, list[Any]]]) -> None:
        """Take every (tokens, positions of their documents) of `stream` up to --max-tokens, and read no further."""
        from tqdm import tqdm

        try:
            for arr, positions in stream:
                if self.bar is None:  # opened at the first tokens: a source that cannot be read prints one line
                    self.bar = tqdm(total=self.cfg.max_tokens or None, initial=self.total, unit="tok", unit_scale=True)
                self.add(arr, positions)
                if self.total >= self.limit:
                    break
        finally:
            if self.bar is not None:
                self.bar.close()

    def add(self, arr: np.ndarray, positions: list[Any]) -> None:
        """Buffer arr's tokens, writing the full buffer as its shard first when more tokens come."""
        eots = np.flatnonzero(arr == EOT)  # where the documents of `positions` start
        pos = min(self.drop, len(arr))
        self.drop -= pos
        while pos < len(arr) and self.total < self.limit:
            if self.fill == len(self.buf):  # written once more tokens come, so a val shard is never left on its own
                self._write(self.buf, self.point)
                self.buf, self.fill = np.empty(self.cfg.shard_size, dtype=np.uint16), 0
            take = int(min(len(arr) - pos, len(self.buf) - self.fill, self.limit - self.total))
            i, j = np.searchsorted(eots, (pos, pos + take))
            self.docs += int(j - i) + int(self.total == self.written and arr[pos] != EOT)  # + the rest of a kept one
            start, had = (positions[j - 1], int(eots[j - 1]) - pos) if j > i else (self.point[:4], -self.point[4])
            self.point = [*start, take - had]  # a new list: the record holds the old one
            self.buf[self.fill:self.fill + take] = arr[pos:pos + take]
            pos, self.fill, self.total = pos + take, self.fill + take, self.total + take
            self.bar.update(take)

    def finish(self) -> None:
        """Write what is buffered and record the run as finished."""
        cfg, total = self.cfg, self.total
        if total == 0:
            raise DataError(f"--source {cfg.source} has no text: no non-empty documents in --text-field "
                            f"{cfg.text_field!r}")
        if self.index == 0:  # the source (or --max-tokens) ended before a single train token
            if cfg.val_tokens != -1:  # asked for: --max-tokens > --val-tokens is checked, so the source is short
                raise DataError(f"--source {cfg.source} has only {total:,} tokens, all of them for the val shard "
                                f"(--val-tokens {cfg.val_tokens}); lower --val-tokens to leave some for training, e.g. "
                                f"--val-tokens {max(total // 10, 1)}, or leave it out to use the first 10%")
            self.val = max(total // 10, 1)  # a document is EOT + at least one token: total >= 2
            self._write(self.buf[:self.val], None)  # no resume point: a rerun writes a short val shard again
            self.buf, self.fill = self.buf[self.val:total], total - self.val
        if self.fill:
            self._write(self.buf[:self.fill], self.point)
        self._own()  # where the kept shards were the whole stream, a longer run's after them go too
        self.record["done"] = True
        self._save()

    def report(self, seconds: float, workers: int) -> dict[str, Any]:
        """Print the run's totals and return them (workers 0: a finished run, nothing done)."""
        val, tokenized = next(iter(self.record["shards"].values())), self.total - self.written
        result = {"shards": self.index, "skipped_shards": self.kept, "val_tokens": val,
                  "train_tokens": self.total - val, "tokenized": tokenized, "documents_tokenized": self.docs,
                  "seconds": seconds, "tokens_per_sec": tokenized / max(seconds, 1e-9), "workers": workers}
        done = (f"tokenized {tokenized:,} tokens of {self.docs:,} documents in {seconds:.1f}s = "
                f"{result['tokens_per_sec']:,.0f} tokens/s on {workers} workers" if workers else
                "nothing to do (to write them again, delete them or pass another --out-dir)")
        print(f"{Path(self.cfg.out_dir).expanduser()}: {self.index} shards ({self.kept} already complete), {val:,} val "
              f"+ {self.total - val:,} train tokens; {done}")
        return result

    def _write(self, tokens: np.ndarray, point: list[int] | None) -> None:
        self._own()
        path = shard_path(self.cfg, self.index)
        write_shard(path, tokens)
        self.record["shards"][path.name], self.record["resume"][path.name] = len(tokens), point
        self._save()
        self.index += 1

    def _own(self) -> None:
        """At this run's first change to --out-dir: take the lock and clear the way, deleting killed runs' temporaries
        and the shards from this one on (an earlier run's, which a resume must not take for this run's)."""
        if self._lock is None:
            cfg, out = self.cfg, Path(self.cfg.out_dir).expanduser()
            self._lock = _lock_out_dir(cfg)
            for old in [*out.glob(f".{cfg.prefix}_*.tmp"), *out.glob(f"{cfg.prefix}_*.bin")]:
                index = re.fullmatch(rf"{re.escape(cfg.prefix)}_(?:val|train)_(\d+)\.bin", old.name)
                if old.suffix == ".tmp" or (index and int(index[1]) >= self.index):
                    old.unlink()

    def _save(self) -> None:
        path = Path(self.cfg.out_dir).expanduser() / f"{self.cfg.prefix}_done.json"
        path.with_name(f".{path.name}.tmp").write_text(json.dumps(self.record))
        os.replace(path.with_name(f".{path.name}.tmp"), path)


def _lock_out_dir(cfg: FinewebConfig) -> Any:
    """An exclusive lock on this prefix's shards in --out-dir, held from a run's first change there to its end, so a
    second writer of the same shards stops with a line instead of deleting the first one's files mid-write."""
    folder = Path(cfg.out_dir).expanduser()
    return hold_lock(folder / f".{cfg.prefix}.lock", f"another fineweb.py is writing {cfg.prefix} shards to {folder}; "
                     "let it finish (then rerun this to check it), or pass another --out-dir",
                     f"make sure no other fineweb.py writes {cfg.prefix} shards there", DataError)


def write_dataset(cfg: FinewebConfig) -> dict[str, Any]:
    """Tokenize cfg.source into shards in cfg.out_dir, resuming after an interruption; prints and returns totals."""
    out = Path(cfg.out_dir).expanduser()
    if not (there := next(p for p in (out, *out.parents) if p.exists())).is_dir():  # before reading the source
        raise DataError(f"--out-dir {cfg.out_dir}: {there} is a file, not a directory; pass a directory (it is "
                        "created if missing)")
    files = source_files(cfg)
    key = record_key(cfg, files)  # before reading: a file edited during the run makes the next run write again
    if (out / f".{cfg.prefix}.lock").is_file():  # held by another writer: stop now, not after a whole shard
        _lock_out_dir(cfg).close()
    try:
        record = json.loads((out / f"{cfg.prefix}_done.json").read_text())
    except (OSError, ValueError):
        record = {}
    kept, point = resume_point(cfg, key, record)
    if point is None:
        return ShardWriter(cfg, key, record, kept).report(0.0, 0)
    workers = cfg.workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    with ShardWriter(cfg, key, record, kept, point) as writer:
        t0 = time.time()
        with tokenizer_pool(workers) as pool:
            writer.write_all(token_stream(read_documents(cfg, files, point), pool, workers))
        writer.finish()
        result = writer.report(time.time() - t0, workers)
    mine = re.compile(rf"{re.escape(cfg.prefix)}_train_\d+\.bin")  # train.py --data OUT reads every train shard
    if others := [f.name for f in find_shards(out, "train") if not mine.fullmatch(f.name)]:
        print(f"note: {out} also holds {len(others)} train shard(s) of another corpus ({others[0]}, ...), and "
              f"train.py --data {out} would read them too: give each corpus its own --out-dir")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(FinewebConfig, sys.argv[1:] if argv is None else argv, doc=__doc__)
    try:
        return write_dataset(cfg)
    except (DataError, OSError) as e:  # OSError: the output cannot be written (permissions, a full disk)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
