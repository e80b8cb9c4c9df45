"""Token shards: the writer that turns a corpus into llm.c-format GPT-2 shards, and the loader that streams them.

A shard is llm.c's `.bin`: a 256 x int32 little-endian header (magic 20240520, version 1, token count, zeros), then
the tokens as uint16. PREFIX_val_000000.bin is validation, PREFIX_train_000001.bin, ... training: the loader tells
them apart by the `_val`/`_train` before the index.

The writer reads the source through `datasets` and writes each document as <|endoftext|> + its GPT-2 tokens, in
order: a .txt file is one document (or one per --txt-unit paragraph or line), stdlib one per .py file, stdlib-docs one
per docstring (each line's indentation and runs of spaces cut to single spaces). A .txt.gz, .jsonl.gz or .json.gz (C4's
shards) is read as its plain form. The val shard is the stream's first --val-tokens tokens, or 10% of a source too short
for a train token.

After each shard, PREFIX_done.json records the settings, a local source's files (paths, sizes, mtimes), the shard's
size and where the source stands after it (file, row, tokens of that row's document written). A rerun with the same
settings and files keeps the intact shards and reads on from there, earlier files unread: the shards come out
byte-identical to an uninterrupted run's. A finished run is not read again; other settings or files write all again.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import functools
import glob
import hashlib
import json
import multiprocessing
import os
import re
import signal
import sysconfig
import textwrap
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import EOT, GPT2_VOCAB, get_tokenizer, hold_lock, parse_config, user_errors

MAGIC, VERSION, HEADER_BYTES = 20240520, 1, 1024  # llm.c's token shard (20240326 is its model-weights file)
FINEWEB = "HuggingFaceFW/fineweb-edu"
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt.gz": "text",
                  ".jsonl.gz": "json", ".json.gz": "json"}  # suffix -> datasets builder, which decompresses a .gz
READS = "/".join(LOCAL_BUILDERS)
# left out of --source stdlib: tests, third-party packages, generated tables (codec maps, pydoc's topics)
STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings", "pydoc_data"}
SHUFFLES = ("windows", "shards")  # TokenLoader's train orders within an epoch (see its docstring)
NAMED_SOURCES = {FINEWEB: "fineweb", "shakespeare": "shakespeare", "stdlib": "stdlib", "stdlib-docs": "stdlib-docs"}
ENDS = 4096  # tokens at each end of a shard that a resume compares (8 KiB each): never the whole shard
NO_VAL = "skip the val loss (train.py --eval-every 0)"  # the way out of a val split too short or missing
CUT = re.compile(r"(?<=\S)[\r\n]")  # where tokenize may cut a long text (CRLF too): the pre-tokenizer splits there too
START = (0, 0, 0, 0, 0)  # a source position: part, row in it, row in the source, parts, tokens of its document written


class DataError(ValueError):
    """A user-fixable problem with the data (bad path, shard, source or flag); the message says how to fix it."""


# ----------------------------------------------------------------------------------------------------------------------
# Shard format


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write tokens as an llm.c `.bin` shard, atomically."""
    tokens = np.asarray(tokens)
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise DataError(f"{path}: token ids must fit in uint16 (0..65535), got {tokens.min()}..{tokens.max()}")
    header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
    header[:3] = MAGIC, VERSION, len(tokens)
    atomic_write(Path(path), header.tobytes(), np.ascontiguousarray(tokens, dtype="<u2"))


def atomic_write(path: Path, *chunks: bytes | np.ndarray) -> None:
    """Write a file via a synced .NAME.PID.tmp beside it and a rename: a crash never leaves a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.writelines(chunks)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def download(url: str, dest: Path, what: str, offline: str, error: type[Exception] = DataError) -> Path:
    """url's bytes into dest through atomic_write, so a cut download never leaves a file that looks complete. A failure
    is one line: what could not be downloaded, why, and `offline`: what to do without a network."""
    from tqdm import tqdm

    try:
        with urllib.request.urlopen(url, timeout=60) as response, \
                tqdm(unit="B", unit_scale=True, desc=f"downloading {dest.name}", delay=1) as bar:
            chunks = []
            while chunk := response.read(1 << 20):
                chunks.append(chunk)
                bar.update(len(chunk))
        atomic_write(dest, *chunks)
    except OSError as e:  # urllib's URLError among them
        raise error(f"could not download {what} from {url} ({e}); {offline}") from e  # train.py reports the cause
    return dest


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a shard's tokens (uint16, never loaded whole) after checking its header against its size."""
    if not (path := Path(path)).is_file():
        raise DataError(f"shard {path} does not exist")
    size = path.stat().st_size
    magic, version, n = [*np.fromfile(path, dtype="<i4", count=3).tolist(), 0, 0, 0][:3]  # < 12 bytes: zeros
    if (magic, version) != (MAGIC, VERSION):
        hint = " (an llm.c model file, not tokens)" if magic == 20240326 else ""
        raise DataError(f"{path}: not an llm.c token shard: magic number {magic}{hint} and version {version}, "
                        f"expected {MAGIC} and {VERSION}; write shards with fineweb.py")
    if size != HEADER_BYTES + 2 * n:
        raise DataError(f"{path}: header says {n:,} tokens ({HEADER_BYTES + 2 * n:,} bytes) but the file has "
                        f"{size:,} bytes: truncated or corrupt; delete it and rerun fineweb.py")
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))  # n = 0 too: it maps the header


def expand(pattern: str, in_dir: Callable[[Path], Iterable[Path]]) -> list[Path] | None:
    """The paths a glob matches, a directory's (in_dir), or the file itself; None where nothing is."""
    path = Path(pattern).expanduser()
    if path.exists():  # a name with [ or ? in it too
        return list(in_dir(path)) if path.is_dir() else [path]
    if any(c in pattern for c in "*?["):
        return [Path(f) for f in sorted(glob.glob(str(path), recursive=True))]
    return None


def find_shards(pattern: str | os.PathLike, split: str) -> list[Path]:
    """The `split` shards in a directory or matched by a glob, sorted by path."""
    pattern = str(pattern)
    # the split is the word before the index and suffix, anchored at the end: train_val_000000.bin is val only
    marker = re.compile(rf"(?:.*_)?{split}(?:_\d+)?\.bin")
    if (files := expand(pattern, Path.iterdir)) is None:
        # the presets' own corpora have sources of their own (fineweb.py's default is fineweb-edu)
        name = Path(pattern).expanduser().name
        source = {"stdlib": "stdlib", "stdlib_docs": "stdlib-docs", "shakespeare": "shakespeare"}.get(name)
        raise DataError(f"data directory {pattern} does not exist; write shards there with `python fineweb.py "
                        + (f"--source {source} --out-dir {pattern}`" if source else
                           f"--out-dir {pattern}` (fineweb-edu; --source picks another corpus)")
                        + " or point --data at a directory or glob of shards")
    files = sorted(f for f in files if marker.fullmatch(f.name) and f.is_file())
    if not files:
        raise DataError(f"no {split} shards in {pattern} (looked for names ending in _{split}.bin or "
                        f"_{split}_NNNNNN.bin); write them with `python fineweb.py` or point --data at the right "
                        "directory or glob" + (f", or {NO_VAL}" if split == "val" else ""))
    return files


# ----------------------------------------------------------------------------------------------------------------------
# Loader


class TokenLoader:
    """Shuffled, exactly-once, resumable (x, y) batches of one split for one rank: windows of B*T+1 tokens at stride
    B*T, train shards (and with shuffle="windows" their windows) in a seeded order per epoch, val in order. Rank r's
    s-th batch is window s * world_size + r of one stream: any rank's `step` resumes all (docs/fineweb.md)."""

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
        self._crcs = [shard_crc(f, len(s)) for f, s in zip(self.files, self._shards, strict=True)]  # resume compares
        self._windows = self._windows_per_shard(B)
        self.num_windows = int(self._windows.sum())  # windows per epoch over all ranks
        if self.num_windows == 0:
            big = int(lengths.argmax())
            more = f"a longer val shard (fineweb.py --val-tokens), or {NO_VAL}" if split == "val" else \
                "longer shards (fineweb.py --shard-size)"  # a window never spans two shards
            raise DataError(f"no {split} shard has B*T+1 = {B * T + 1:,} tokens (B={B}, T={T}); the largest, "
                            f"{self.files[big]}, has {lengths[big]:,}; lower --batch-size/--seq-len or write {more}")
        # (a val split may have fewer: components.val_loss scores each window once, on whichever rank it falls to)
        if split == "train" and self.num_windows < world_size:
            raise DataError(f"world size {world_size} is too large for the {split} data: it has only "
                            f"{self.num_windows} windows of B*T+1 = {B * T + 1:,} tokens, fewer than one per rank; "
                            "use fewer ranks, a smaller --batch-size/--seq-len, or more data")
        self._starts = np.cumsum(lengths) - lengths  # where each shard begins in the preloaded split
        self._preloaded = torch.from_numpy(np.concatenate(self._shards).astype(np.int64)).to(self.device) \
            if preload else None  # one device tensor of the whole split: the very same windows
        self.vocab_size: int | None = None  # set by check_vocab: token ids must be below it
        self.resume_skipped = 0  # tokens the last load_state_dict skipped in the shard being read (see _regrid)
        self.reset()

    def _windows_per_shard(self, B: int) -> np.ndarray:  # of B*T+1 tokens at stride B*T: neighbours share one
        return np.maximum(self._lengths - 1, 0) // (B * self.T)

    @property
    def epoch(self) -> int:  # of this rank's next window (ranks differ by one in a step that straddles epochs)
        return (self.step * self.world_size + self.rank) // self.num_windows

    def reset(self) -> None:  # back to epoch 0's first batch (for val: the same batches on every call)
        self.step = 0  # batches each rank has served since reset: the whole position

    def shard_order(self, epoch: int) -> np.ndarray:
        """Indices into self.files in the order epoch `epoch` reads them."""
        return np.arange(len(self.files)) if self.split == "val" else permutation((self.seed, epoch), len(self.files))

    def _locate(self, g: int) -> tuple[int, int]:  # (shard index, first token) of global window g of the stream
        epoch, w = divmod(g, self.num_windows)
        order = self.shard_order(epoch)
        counts = self._windows[order]
        cum = np.cumsum(counts)
        i = int(np.searchsorted(cum, w, side="right"))
        shard, k = int(order[i]), w - int(cum[i] - counts[i])  # the shard's k-th window served this epoch
        if self.shuffle == "windows":  # a stream of its own per (epoch, shard), apart from the shard order's
            k = int(permutation((self.seed, epoch, shard + 1), int(self._windows[shard]))[k])
        return shard, k * self.B * self.T

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ids >= vocab_size in every batch from now on (a preloaded split: all of it, now), naming the shard."""
        self.vocab_size = vocab_size
        if self._preloaded is not None and (top := int(self._preloaded.max())) >= vocab_size:  # (B*T+1 tokens at least)
            at = int(np.searchsorted(self._starts, int(torch.argmax(self._preloaded)), side="right")) - 1
            self._bad_token(self.files[at], top)

    def _bad_token(self, path: Path, token: int) -> None:
        why = "the shard was written with another tokenizer, or is corrupt; rewrite it with fineweb.py"
        if token < GPT2_VOCAB and self.vocab_size < GPT2_VOCAB:  # a GPT-2 id: the model is too small, not the shard
            why = (f"--vocab-size {self.vocab_size} is below GPT-2's {GPT2_VOCAB:,} tokens, which the shards use; "
                   f"leave --vocab-size out (50304) or pass at least {GPT2_VOCAB}")
        raise DataError(f"{path} holds token id {token}, but the model has only {self.vocab_size} embedding rows: "
                        + why)

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
            cuda = self.device.type == "cuda"  # pinned there, so the copy is asynchronous and overlaps the last step
            buf = (buf.pin_memory() if cuda else buf).to(self.device, non_blocking=cuda)
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)

    def state_dict(self) -> dict[str, Any]:
        """The exact position plus what it is relative to; plain ints, strs and lists (safe for weights_only)."""
        return {"split": self.split, "B": self.B, "T": self.T, "world_size": self.world_size, "seed": self.seed,
                "shuffle": self.shuffle, "shards": [f.name for f in self.files],
                "shard_tokens": self._lengths.tolist(), "shard_crc32": self._crcs, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (same shards, T and seed), mapped onto another world size, B or shuffle if need be."""
        mine = self.state_dict()
        for key, what in (("split", "split"), ("T", "--seq-len"), ("seed", "--seed"),
                          ("shards", "shard files"), ("shard_tokens", "shard sizes")):
            if (theirs := state.get(key)) != mine[key]:
                why = f"{key}={theirs!r} in the checkpoint but {mine[key]!r} here" if key in ("split", "T", "seed") \
                    else f"other shard files ({len(theirs or [])} in the checkpoint, {len(mine[key])} here; " \
                    f"{min(set(theirs or []) ^ set(mine[key]))} is in one only)" if key == "shards" \
                    else "shards of other sizes (the same names, rewritten since)"
                raise DataError(f"cannot resume the {self.split} loader: {why}; resume with the same {what} or start a "
                                "fresh run")
        check_contents(state, mine, f"the {self.split} loader")
        # the stream does not depend on the world size: the new ranks start at the first multiple of theirs at or
        # after the step * world windows served, none twice (docs/fineweb.md)
        old_b, old_shuffle, served = state["B"], state.get("shuffle", "shards"), state["step"] * state["world_size"]
        self.resume_skipped = 0
        if (old_b, old_shuffle) != (self.B, self.shuffle):
            served = self._regrid(served, old_b, old_shuffle)
        self.step = -(-served // self.world_size)

    def resume_note(self, saved: dict[str, Any]) -> str | None:
        """Where the data goes on when the checkpoint read other windows (--batch-size or --shuffle changed)."""
        old_b, old_shuffle = saved["B"], saved.get("shuffle", "shards")  # states from before --shuffle: in order
        if (old_b, old_shuffle) == (self.B, self.shuffle):
            return None
        n = self.resume_skipped  # tokens of the shard being read that the checkpoint's run had not served
        skip = f" at the next shard, skipping this one's {n:,} unserved tokens" if n else ""
        return (f"the checkpoint read {old_b}-sequence windows with --shuffle {old_shuffle}, this run reads {self.B}-"
                f"sequence windows with --shuffle {self.shuffle}: the data goes on{skip}, none served twice")

    def _regrid(self, served: int, old_b: int, old_shuffle: str) -> int:
        """The first new window after `served` old ones of old_b * T tokens, none twice (docs/fineweb.md)."""
        old = self._windows_per_shard(old_b)
        epoch, w = divmod(served, int(old.sum()))
        order = self.shard_order(epoch)
        cum_old = np.cumsum(old[order])
        i = int(np.searchsorted(cum_old, w, side="left"))  # the shard holding the last window served (0 if none)
        shard = order[i]
        done = w - int(cum_old[i] - old[shard])  # old windows served from it
        new_before = int(np.sum(self._windows[order[:i]]))  # new windows in the shards before it
        if done and "windows" in (old_shuffle, self.shuffle):  # on at the next shard: the rest of this one is skipped
            within, self.resume_skipped = int(self._windows[shard]), (int(old[shard]) - done) * old_b * self.T
        else:  # neither shuffles (or none of it served): on inside the shard being read
            within = min(-(-done * old_b // self.B), int(self._windows[shard]))
        return epoch * self.num_windows + new_before + within


def crc32(arrays: Iterable[np.ndarray]) -> int:
    """The CRC-32 of the arrays' bytes end to end."""
    return functools.reduce(lambda crc, a: zlib.crc32(np.ascontiguousarray(a), crc), arrays, 0)


def shard_crc(path: Path, n: int) -> int:
    """The CRC-32 of a shard's first and last ENDS of its n tokens, in two small reads: a memory map's page fault
    reads ahead megabytes (10 ms a cold 200 MB shard here, against 0.3 ms)."""
    return crc32(np.fromfile(path, "<u2", min(n, ENDS), offset=HEADER_BYTES + 2 * k) for k in (0, max(n - ENDS, 0)))


def check_contents(state: dict[str, Any], mine: dict[str, Any], what: str) -> None:
    """Refuse a loader state (of the same shard names and sizes) whose shards' shard_crc32 differ from these: other
    tokens would be read at the same position. A state from before the key resumes unchecked."""
    theirs = state.get("shard_crc32", mine["shard_crc32"])
    if other := [name for name, a, b in zip(mine["shards"], theirs, mine["shard_crc32"], strict=True) if a != b]:
        raise DataError(f"cannot resume {what}: {other[0]} holds other tokens than the checkpoint's under the same "
                        "name and size; resume with the checkpoint's --data or start a fresh run")


@functools.lru_cache(maxsize=8)  # drawn once per epoch (and shard), not at each batch (chat_format's loaders too)
def permutation(seed: tuple[int, ...], n: int) -> np.ndarray:
    order = np.random.default_rng(seed).permutation(n)
    order.setflags(write=False)  # one cached array serves every loader: a write would reorder them all
    return order


# ----------------------------------------------------------------------------------------------------------------------
# Writer


@dataclass
class FinewebConfig:
    """Tokenize a corpus with GPT-2 BPE into llm.c-format token shards: the first is val, the rest train."""

    # hub dataset, shakespeare, stdlib, stdlib-docs, or a local file/dir/glob of .txt/.jsonl/.json/.parquet, .gz too
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
    shakespeare_path: str = ""  # a local copy of Tiny Shakespeare to read instead of the download

    def __post_init__(self) -> None:
        if self.txt_unit not in ("document", "paragraph", "line"):
            raise ValueError(f"--txt-unit must be document, paragraph or line, got {self.txt_unit!r}")
        if not 1 <= self.shard_size < 2**31:  # the header stores an int32 count
            raise ValueError(f"--shard-size must be in [1, 2**31), got {self.shard_size}")
        if not (self.val_tokens == -1 or 1 <= self.val_tokens < 2**31):
            raise ValueError(f"--val-tokens must be -1 (a default per source) or in [1, 2**31), got {self.val_tokens}")
        if self.workers < 0 or self.max_tokens < 0:
            raise ValueError("--workers and --max-tokens must be >= 0 (0 = all cores / the whole source)")
        if 0 < self.max_tokens <= self.val_tokens:  # never for -1: a short run's default val shard is its first 10%
            raise ValueError(f"--max-tokens {self.max_tokens} leaves no train tokens after the val shard's "
                             f"--val-tokens {self.val_tokens}; raise --max-tokens or lower --val-tokens")
        if source_kind(self.source) == "fineweb":
            prefix, out_dir, name = "edufineweb", "data/edu_fineweb10B", "sample-10BT"
        else:  # corpus/*.jsonl -> corpus, books.txt -> books, org/x -> x
            plain = Path(re.split(r"/[^/]*[*?\[]", self.source)[0]).name.split(".")[0]  # the path before any glob
            prefix = re.sub(r"[^A-Za-z0-9]+", "_", plain).strip("_") or "data"
            out_dir, name = f"data/{prefix}", ""
        self.prefix, self.out_dir, self.name = self.prefix or prefix, self.out_dir or out_dir, self.name or name

    @property
    def val_target(self) -> int:  # a full val shard's tokens (a shorter source's: see ShardWriter.finish)
        defaults = {"shakespeare": 32_768, "stdlib": 2**18, "stdlib-docs": 32_768}  # ~10%, ~6%, ~7%
        return self.val_tokens if self.val_tokens != -1 else defaults.get(source_kind(self.source), self.shard_size)


def source_kind(source: str) -> str:
    """fineweb, shakespeare, stdlib, stdlib-docs, local or hub."""
    path = Path(source).expanduser()
    # data/x when ./data exists is a path, not the hub's owner/name
    local = any(c in source for c in "*?[") or path.exists() or bool(set(path.suffixes) & LOCAL_BUILDERS.keys()) or \
        source[:1] in "./~" or len(path.parts) > 1 and path.parents[-2].is_dir()
    return NAMED_SOURCES.get(source) or ("local" if local else "hub")


def local_files(source: str, out_dir: str | os.PathLike) -> list[Path]:
    """A local source's files, sorted, of one `datasets` builder, without the records in out_dir (its default)."""
    out, src = Path(out_dir).expanduser().resolve(), Path(source).expanduser()
    if (files := expand(source, lambda d: (f for f in d.rglob("*") if suffix(f) in LOCAL_BUILDERS))) is None:
        raise DataError(f"--source {source} does not exist; pass a file, directory or glob of {READS}, or a hub "
                        "dataset name")
    # a directory's files that no builder reads are named, not skipped in silence (its hidden ones and out's aside)
    other = sorted(str(f.relative_to(src)) for f in src.rglob("*") if f.is_file() and suffix(f) not in LOCAL_BUILDERS
                   and f.parent.resolve() != out and not any(p.startswith(".") for p in f.relative_to(src).parts))
    if other:
        print(f"note: --source {source}: {len(other)} file(s) left out, not {READS}: "
              f"{', '.join(other[:3])}{', ...' if len(other) > 3 else ''}")
    records = ("_done.json", "_parts.json")  # parts: an older writer's
    files = sorted(f for f in files if f.is_file() and not (f.parent.resolve() == out and f.name.endswith(records)))
    suffixes = {suffix(f) for f in files}
    if not files or not suffixes <= set(LOCAL_BUILDERS):
        found = f" (found {', '.join(sorted(suffixes))})" if suffixes else ""
        raise DataError(f"--source {source} matches no {READS} files{found}")
    if len({LOCAL_BUILDERS[s] for s in suffixes}) > 1:
        raise DataError(f"--source {source} mixes file types ({', '.join(sorted(suffixes))}); pass a glob that "
                        "matches one type, e.g. 'dir/*.jsonl'")
    if all(f.stat().st_size == 0 for f in files):  # datasets' json builder fails on these with a bare StopIteration
        raise DataError(f"--source {source} is empty: its {len(files)} file(s) hold no bytes")
    return files


def suffix(file: Path) -> str:
    """The suffix that picks a file's builder: .jsonl, or .jsonl.gz for a gzipped one (.gz alone: none)."""
    return "".join(file.suffixes[-2:]) if file.suffix == ".gz" else file.suffix


def stdlib_files() -> list[Path]:
    """This Python's standard-library .py files (no tests, site-packages or generated tables), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_docstrings(cfg: FinewebConfig) -> Path:
    """stdlib_files()' distinct docstrings as JSON lines, cached: prose a small model learns in minutes, unlike code.
    Each line's runs of whitespace are one space, its indentation gone: runs of bare-space tokens are what a small
    model's top-k samples string into lines of spaces."""
    path = Path(cfg.cache_dir).expanduser() / f"stdlib_docstrings_flat_py{sysconfig.get_python_version()}.jsonl"
    with contextlib.suppress(OSError):  # not there yet
        try:
            [json.loads(line) for line in path.read_text().splitlines()]
            return path
        except ValueError:  # cut short (a full disk, an older writer's partial copy) or damaged
            print(f"note: {path} is damaged; writing it again")
    docs: dict[str, None] = {}  # ordered and deduplicated
    for file in stdlib_files():
        with contextlib.suppress(SyntaxError, ValueError):  # a file of another Python's syntax
            for node in ast.walk(ast.parse(file.read_bytes())):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (ast.get_docstring(node) or "").splitlines()
                    docs.setdefault("\n".join(" ".join(line.split()) for line in lines))
    atomic_write(path, "".join(json.dumps({"text": doc}) + "\n" for doc in docs if doc).encode())
    return path


def source_files(cfg: FinewebConfig) -> list[Path] | None:
    """The files a non-hub source reads, in order (None for a hub dataset); downloads Tiny Shakespeare once."""
    kind = source_kind(cfg.source)
    shakespeare = Path(cfg.shakespeare_path or Path(cfg.cache_dir, "tinyshakespeare.txt")).expanduser()
    if kind == "shakespeare" and not shakespeare.is_file():
        if cfg.shakespeare_path:
            raise DataError(f"--shakespeare-path {cfg.shakespeare_path} is not a file; pass the path of a local copy "
                            "of tinyshakespeare.txt, or leave it out to download it")
        download(SHAKESPEARE_URL, shakespeare, "Tiny Shakespeare", "pass --shakespeare-path with a local copy")
    files = {"stdlib": stdlib_files, "stdlib-docs": lambda: [stdlib_docstrings(cfg)],
             "shakespeare": lambda: [shakespeare], "local": lambda: local_files(cfg.source, cfg.out_dir)}
    return files.get(kind, lambda: None)()  # a hub dataset: None


def read_documents(cfg: FinewebConfig, files: list[Path] | None,
                   start: Iterable[int] = START) -> Iterator[tuple[str, tuple[int, int, int, int]]]:
    """The source's non-empty texts from `start` on, each with its position (part, row in it, row in the source, parts).
    Streamed, each file is a part: a resume skips the earlier files unread. A read error is one line with its cause."""
    import datasets  # lazily: the loader above must import on machines without `datasets`
    import pyarrow

    # what reading data raises (bad bytes or gzip, bad JSON, a schema mismatch, a network drop); anything else: a bug
    reading = (OSError, EOFError, zlib.error, ValueError, pyarrow.ArrowException, datasets.exceptions.DatasetsError)
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # it logs a read error before raising it: one line here
    where = f"--source {cfg.source}" + ("" if files else f" (--name {cfg.name or 'none'}, --split {cfg.split})")
    if files and len(files) == 1 and files[0] != Path(cfg.source).expanduser():  # a directory's one file: name it
        where = f"{files[0]} of {where}"
    (part, row, first, n), kind, parts = list(start)[:4], source_kind(cfg.source), []
    try:
        if files is None:
            pin = {"revision": cfg.revision} if cfg.revision else {}
            ds = datasets.load_dataset(cfg.source, name=cfg.name or None, split=cfg.split, streaming=cfg.streaming,
                                       **pin)
        else:
            builder = "text" if kind in ("stdlib", "shakespeare") else LOCAL_BUILDERS[suffix(files[0])]
            options = {"sample_by": "document" if kind == "stdlib" else cfg.txt_unit,  # a BOM (Notepad's) is no text
                       "encoding": "utf-8-sig"} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                       streaming=cfg.streaming, **options)
        shards = getattr(ds, "num_shards", 1)  # streamed: a part per file; else one
        names = files if files and len(files) == shards else [f"file {i + 1} of {shards}" for i in range(shards)]
        parts = [(ds, where)] if shards == 1 else [(ds.shard(shards, i, contiguous=True), f"{name} of {where}")
                                                   for i, name in enumerate(names)]
        part, g = (part, first - row) if n == len(parts) else (0, 0)
        for p, (data, where) in enumerate(parts[part:], part):
            for r, item in enumerate(data):
                if cfg.text_field not in item:
                    raise DataError(f"--text-field {cfg.text_field!r} is not in {where}; its columns are "
                                    f"{', '.join(item)}; pass one of them with --text-field")
                if not isinstance(text := item[cfg.text_field], str):  # tiktoken's TypeError is no line
                    raise DataError(f"--text-field {cfg.text_field!r} of row {r + 1} of {where} holds " + (
                        f"{text!r:.40} (a {type(text).__name__}), not a string; pass the column of text" if text is not
                        None else "no text (null, or missing in that row); fill or remove such rows"))
                if text and g >= first:  # an empty text would be a lone EOT
                    yield text, (p, r, g, len(parts))
                g += 1
    except reading as e:  # one line: where, the root cause, and what to do
        if files and len(files) > 1 and not (cfg.streaming and parts):  # not streamed, the files were one part; the
            # load reads the first file's first rows (json's schema): read again streamed, to name the file and row
            for _ in read_documents(replace(cfg, streaming=True), files[:1] if cfg.streaming else files):
                pass
        if isinstance(e, DataError):
            raise
        cause: BaseException = e  # datasets wraps a builder's error (raise ... from e), or re-raises it in an except
        while (inner := cause.__cause__ or (cause.__context__ if isinstance(cause, datasets.exceptions.DatasetsError)
                                            else None)) is not None:
            cause = inner
        fix = "check the names and the network, and rerun (complete shards are kept)" if files is None else \
            "fix that file or leave it out of --source"
        raise DataError(f"could not read {where}: {textwrap.shorten(f'{type(cause).__name__}: {cause}', 300)}; "
                        f"{fix}") from None


def _pool_worker_init(writer: int) -> None:
    """SIGTERM's default back (a handler could keep the pool open); on Linux, SIGTERM when its parent dies outright:
    the writer, whose pid is `writer` (0 under forkserver, whose workers are the server's children)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no prctl, not Linux
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if writer and os.getppid() != writer:  # it died before that: no signal comes, and the task pipe never closes
        os._exit(1)


def tokenize(texts: list[str]) -> np.ndarray:
    """EOT + GPT-2 tokens of each text, as uint16: EOT opens each document and nothing else (text is just text)."""
    enc = get_tokenizer()  # cached per process: each pool worker builds its own once
    # piece by piece: tiktoken's list takes ~36 bytes a token (a 50 MB text's, 500 MB), the uint16 array 2
    ids = ([EOT] * (i == 0) + enc.encode_ordinary(piece) for text in texts for i, piece in enumerate(pieces(text)))
    return np.fromiter(chain.from_iterable(ids), dtype=np.uint16)


def pieces(text: str, size: int = 1 << 20) -> Iterator[str]:
    """text in pieces of `size` characters or a few more, each cut before a \n or \r that follows a non-space: GPT-2's
    pre-tokenizer splits there too, whatever follows, so the pieces' tokens are the text's."""
    start = 0
    while len(text) - start > size and (cut := CUT.search(text, start + size)):
        yield text[start:cut.start()]
        start = cut.start()
    yield text[start:]


@contextlib.contextmanager
def tokenizer_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """Tokenizer processes (None for one: the caller's). A dead one is a DataError, where a Pool would wait for it."""
    if workers <= 1:
        yield None
        return
    forked = multiprocessing.get_start_method() != "forkserver"  # fork and spawn: the writer's children
    pool = ProcessPoolExecutor(workers, initializer=_pool_worker_init, initargs=(os.getpid() if forked else 0,))
    try:
        pool.submit(int).result()  # fork every worker now, before `datasets` starts threads (fork + threads deadlock)
        yield pool
    except BrokenProcessPool as e:  # raised by a chunk's result(), and by submit() once the pool knows
        raise DataError("a tokenizer process exited unexpectedly (killed, e.g. out of memory); the shards written "
                        "so far are complete: run the same command again to continue after them") from e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # chunks still queued are dropped, running ones finish


def token_stream(docs: Iterable[tuple[str, Any]], pool: ProcessPoolExecutor | None, workers: int,
                 chunk: int = 16) -> Iterator[tuple[np.ndarray, list[Any]]]:
    """(tokens, positions) of `docs` (text, position) in order, 4 chunks per worker in flight (Executor.map would
    queue the whole streamed source); without a pool, one chunk, tokenized here when its turn comes."""
    defer, window = (lambda *call: pool.submit(*call).result, 4 * workers) if pool else (functools.partial, 1)
    pending, it = [], iter(docs)
    while batch := list(islice(it, chunk)):
        texts = [text for text, _ in batch]
        pending.append((defer(tokenize, texts), [position for _, position in batch]))
        while len(pending) >= window:
            job, positions = pending.pop(0)
            yield job(), positions
    for job, positions in pending:
        yield job(), positions


def shard_path(cfg: FinewebConfig, index: int) -> Path:
    return Path(cfg.out_dir).expanduser() / f"{cfg.prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def record_path(cfg: FinewebConfig) -> Path:
    return Path(cfg.out_dir).expanduser() / f"{cfg.prefix}_done.json"


def record_key(cfg: FinewebConfig, files: list[Path] | None) -> dict[str, Any]:
    """What the shards are made of: the settings that shape them and a local source's files (path, size, mtime)."""
    keys = ("source", "name", "split", "text_field", "txt_unit", "prefix", "shard_size", "val_tokens", "max_tokens")
    settings = {k: getattr(cfg, k) for k in keys} | ({"revision": cfg.revision} if cfg.revision else {})
    stats = [(os.fsencode(f.resolve()), f.stat()) for f in files or []]  # none for a hub dataset: --revision pins it
    digest = hashlib.sha256(b"".join(p + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode() for p, st in stats))
    inputs = {"files": len(stats), "bytes": sum(st.st_size for _, st in stats), "sha256": digest.hexdigest()}
    return {"settings": settings, "inputs": inputs if files else None}


def resume_point(cfg: FinewebConfig, key: dict[str, Any], record: dict[str, Any]) -> tuple[int, Any]:
    """How many recorded shards to keep (intact, from shard 0) and the source position after them (None: finished)."""
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


class ShardWriter(contextlib.ExitStack):
    """Cuts the token stream into shards after `kept` ones (val, then --shard-size train shards), each recorded with the
    source position after it; holds the lock on --out-dir from its first change there until close()."""

    def __init__(self, cfg: FinewebConfig, key: dict[str, Any], record: dict[str, Any] | None = None, kept: int = 0,
                 point: Iterable[int] = START):
        super().__init__()  # what close() lets go: the lock, once taken
        names = [shard_path(cfg, i).name for i in range(kept)]
        self.record = {**key, "done": False, **{k: {n: (record or {}).get(k, {}).get(n) for n in names}
                                                for k in ("shards", "resume")}}
        self.cfg, self.kept, self._lock = cfg, kept, None
        self.written = self.total = sum(self.record["shards"].values())  # tokens in the kept shards, in all
        self.index, self.fill, self.docs = kept, 0, 0  # shard being filled, its tokens, documents this run writes
        self.val, self.limit = cfg.val_target, cfg.max_tokens or float("inf")
        self.point = list(point)  # the last buffered token's document, and its tokens buffered or written
        self.drop = self.point[4]  # the first document's tokens that are on disk already
        self.buf = np.empty(self.val if kept == 0 else cfg.shard_size, dtype=np.uint16)

    def write_all(self, stream: Iterable[tuple[np.ndarray, list[Any]]]) -> None:
        """Take every (tokens, positions of their documents) of `stream` up to --max-tokens, and read no further (the
        bar is delayed: a source that cannot be read ends in its one line of error alone)."""
        from tqdm import tqdm

        with tqdm(total=self.cfg.max_tokens or None, initial=self.total, unit="tok", unit_scale=True, delay=1) as bar:
            for arr, positions in stream:
                self.add(arr, positions)
                bar.update(self.total - bar.n)
                if self.total >= self.limit:
                    break

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
        """At the first change to --out-dir: take the lock, delete killed runs' temporaries and shards from here on."""
        if self._lock is None:
            cfg, out = self.cfg, Path(self.cfg.out_dir).expanduser()
            self._lock = self.enter_context(_lock_out_dir(cfg))
            for old in [*out.glob(f".{cfg.prefix}_*.tmp"), *out.glob(f"{cfg.prefix}_*.bin")]:
                index = re.fullmatch(rf"{re.escape(cfg.prefix)}_(?:val|train)_(\d+)\.bin", old.name)
                if old.suffix == ".tmp" or (index and int(index[1]) >= self.index):
                    old.unlink()

    def _save(self) -> None:
        atomic_write(record_path(self.cfg), json.dumps(self.record).encode())


def _lock_out_dir(cfg: FinewebConfig) -> Any:
    """This prefix's lock in --out-dir: a second writer stops with a line, not deleting the first one's files."""
    return hold_lock(Path(cfg.out_dir).expanduser() / f".{cfg.prefix}.lock", f"another fineweb.py is writing "
                     f"{cfg.prefix} shards to {cfg.out_dir}; let it finish (then rerun this to check it), or pass "
                     "another --out-dir",
                     f"make sure no other fineweb.py writes {cfg.prefix} shards there", DataError)


def write_dataset(cfg: FinewebConfig) -> dict[str, Any]:
    """Tokenize cfg.source into shards in cfg.out_dir, resuming after an interruption; prints and returns totals."""
    out = Path(cfg.out_dir).expanduser()
    files = source_files(cfg)
    key = record_key(cfg, files)  # before reading: a file edited during the run makes the next run write again
    if (out / f".{cfg.prefix}.lock").is_file():  # held by another writer: stop now, not after a whole shard
        _lock_out_dir(cfg).close()
    record = json.loads(record_path(cfg).read_text()) if record_path(cfg).is_file() else {}  # written atomically
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
    cfg = parse_config(FinewebConfig, argv, doc=__doc__)
    with user_errors(DataError, OSError):  # OSError: the output cannot be written (permissions, a full disk)
        return write_dataset(cfg)


if __name__ == "__main__":
    main()
