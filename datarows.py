"""The rows of a dataset, read as written: a local .jsonl/.json/.parquet file (gzipped too), a glob of them, a
directory in the hub's layout, or a hub dataset; one file's every VAL_EVERY-th row held out as its val split; a bad
row's error naming it. SFT's conversations, preference pairs, tasks and CORE all read their data here."""

from __future__ import annotations

import contextlib
import functools
import glob
import gzip
import importlib.util
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from fineweb import DataError, expand, source_kind

VAL_EVERY = 20  # a single local file holds out every 20th row (rows 0, 20, ...) as its val split


def load_rows(source: str, split: str, config: str | None = None, fallback: str = "") -> Any:
    """The rows of a local file (all of it), a glob's files (sorted), `split`'s of a local directory in the hub's layout
    (data/train-00000-of-00001.parquet, say) or of a hub dataset (downloaded once), else `fallback`'s. Local JSON is
    read as written: `datasets` would infer a type per column and rewrite contents ("42" as 42, "\\"x\\"" as x)."""
    if files := expand(source, lambda path: local_split(path, split, fallback)):
        one = Path(source).expanduser().is_file()  # a file named on its own is read whatever its suffix
        rows = [row for f in (files if one else readable(source, split, files)) for row in read_local(f)]
    elif source_kind(source) == "local":
        raise DataError(f"no such file or directory: {source} (taken as a local path); check the path, or run the "
                        "command that writes it first (e.g. tasks.py)")
    else:  # a hub dataset
        from datasets import get_dataset_split_names, load_dataset

        wanted = " or ".join(dict.fromkeys(filter(None, (split, fallback))))  # test or test_sft
        try:
            split = fallback if fallback and split not in get_dataset_split_names(source, config) else split
            rows = load_dataset(source, config, split=split)
        except Exception as e:  # datasets' own errors (no such split, offline) as one line naming the source
            why = f"{e.__cause__ or e}".strip().splitlines()[0][:200]
            raise DataError(f"cannot read {source} (split {wanted}), taken as a hub dataset as no local path of that "
                            f"name exists: {why}"
                            + f"; {NO_SPLIT}" * ("Unknown split" in why and "train" not in split)) from None
    if len(rows) == 0:
        raise DataError(f"{source} (split {split}) holds no rows")
    return rows


# a split's files without `datasets` (the GPU image), the first layout that matches (train.jsonl, train-0.parquet,
# data/..., train/0.jsonl, HH's helpful-base/train.jsonl.gz); a digit after "train-": train_prefs-0 is another split
SPLIT_LAYOUTS = ("{s}.*", "{s}[-_][0-9]*", "data/{s}.*", "data/{s}[-_][0-9]*", "{s}/*", "*/{s}.*", "*/{s}/*")
READABLE = (".jsonl", ".json", ".parquet", ".gz")  # the files read_local reads (gzipped: .jsonl.gz, .json.gz)
NO_SPLIT = "a held-out split missing, --eval-every 0 skips the val loss"  # not for train's: it cannot help there
note = functools.cache(print)  # a note once per process: a glob's val reads its train's files again


def local_split(path: Path, split: str, fallback: str = "") -> list[Path]:
    """`split`'s files in a directory (else `fallback`'s: ultrachat_200k's copy has train_sft, no train), found by the
    patterns `datasets` uses (train*, *-test-*...; without it, or with fallback's found, SPLIT_LAYOUTS' first match)."""
    found = {s: next(filter(None, (globbed(path, pattern.format(s=s)) for pattern in SPLIT_LAYOUTS)), [])
             for s in filter(None, (split, fallback))}
    hint = " (`datasets` is not installed: pip install datasets for its other layouts)"
    # datasets' patterns take train_sft.jsonl for train too: with fallback's files found, SPLIT_LAYOUTS alone pick
    if not found.get(fallback) and importlib.util.find_spec("datasets") is not None:
        from datasets.data_files import DataFilesDict, get_data_patterns

        hint, base = "", glob.escape(str(path))  # a directory named runs[v2] is not a pattern
        with contextlib.suppress(FileNotFoundError):  # no file of any split
            found = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base)
            hint = f" (it has {', '.join(map(str, found))})"  # train_prefs, say
    if not (files := found.get(split) or found.get(fallback)):
        raise DataError(f"{path} has no {' or '.join(filter(None, (split, fallback)))} split: expected files named "
                        f"like {split}.jsonl or data/{split}-00000-of-00001.parquet{hint}"
                        + f"; {NO_SPLIT}" * ("train" not in split))
    return [Path(f) for f in files]  # load_rows leaves out those read_local cannot read (datasets': train_notes.txt)


def globbed(path: Path, pattern: str) -> list[Path]:
    """The data files read_local reads that match pattern under path, sorted; hidden files (an editor's) left out."""
    return sorted(f for f in path.glob(pattern) if f.is_file() and f.name[0] != "." and f.name.endswith(READABLE))


def readable(source: Path | str, split: str, files: list[Path]) -> list[Path]:
    """Its files read_local reads, sorted (datasets lists them by pattern; row_name counts in order); the rest noted."""
    other = [f.name for f in files if f.is_file() and not f.name.endswith(READABLE)]
    if other and os.environ.get("RANK", "0") == "0":  # one note, not one a rank
        note(f"note: {source} (split {split}): {len(other)} file(s) left out, not .jsonl/.json/.parquet/.gz: "
             f"{', '.join(other[:3])}{', ...' if len(other) > 3 else ''}")
    if not (data := sorted(f for f in files if f.is_file() and f.name.endswith(READABLE))):  # a glob of directories
        raise DataError(f"{source} (split {split}) matched no .jsonl/.json/.parquet/.gz files")
    return data


ROW_KEYS = {"messages", "conversations", "prompt", "chosen"}  # keys of the rows sft.py and prefs.py read


def read_local(path: Path) -> list[dict]:
    """A .jsonl/.json(.gz) file's rows as written (an array, or objects one after another, as datasets reads them)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = (data := data.removeprefix(b"\xef\xbb\xbf")).decode("utf-8")  # a byte order mark, as datasets reads
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"{path} line {line}: not UTF-8 (byte 0x{data[e.start]:02x}); save the file as UTF-8") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a .gz cut short, damaged, or not gzip at all
        raise DataError(f"{path}: not a whole gzip file ({e})") from None
    rows, at, decoder = [], 0, json.JSONDecoder()
    while (at := json.decoder.WHITESPACE.match(text, at).end()) < len(text):  # values one after another, as datasets
        try:
            parsed, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:  # a line cut short runs on into the next: name the line it began on too
            begun = text.count("\n", 0, at) + 1
            where = f"; in the value from line {begun}" if begun < e.lineno else ""
            raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg}{where})") from None
        rows += parsed if isinstance(parsed, list) else [parsed]
    if (bad := next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)) is not None:
        raise DataError(f"{row_name(str(path), bad)}: expected a JSON object, got {type(rows[bad]).__name__}")
    # one object whose every field holds many values, not a row's: json.dump(dataset[:]), pandas' to_json
    if len(rows) == 1 and rows[0] and all(
        isinstance(v, dict) or (isinstance(v, list) and v and not isinstance(v[0], dict)) for v in rows[0].values()):
        raise DataError(f"{path}: one object of columns ({', '.join(rows[0])}), not rows; expected a list of objects, "
                        "or one object per line")
    held = [k for k, v in (rows[0] if len(rows) == 1 else {}).items()  # {"data": [rows]}: the stages' rows inside
            if isinstance(v, list) and v and all(isinstance(r, dict) and ROW_KEYS & r.keys() for r in v)]
    if held:
        raise DataError(f"{path}: one object whose {held[0]!r} holds {len(rows[0][held[0]])} objects, read as one row; "
                        f"if those are the rows, save that list alone (datasets reads them with field={held[0]!r})")
    return rows


def one_file(source: str) -> bool:
    """A local file or glob, read as one file: its every VAL_EVERY-th row is val, not a split of its own."""
    return source_kind(source) == "local" and not Path(source).expanduser().is_dir()


def val_note(source: str, split: str) -> str:
    """The load note on a file's train split: val rows stay out (--eval-only scores them; a resume needs the same)."""
    return f"; every {VAL_EVERY}th row from row 0 is held out as val, with --eval-every 0 too" \
        if split == "train" and one_file(source) else ""


def split_rows(source: str, split: str, family: tuple[str, str] = ("", "")) -> Iterable[tuple[int, Any]]:
    """(row index, row) of the train or val split: a file's or glob's every VAL_EVERY-th row is val, a directory's or
    hub dataset's val its test split (train its train), else the stage's family's (UltraFeedback's test_prefs)."""
    k = 0 if (single := one_file(source)) or split == "train" else 1
    rows = load_rows(source, ("train", "test")[k], fallback=family[k])
    return ((i, row) for i, row in enumerate(rows) if not single or (i % VAL_EVERY == 0) == (split == "val"))


@contextlib.contextmanager
def row_errors(source: str, index: int) -> Iterator[None]:
    """A ValueError about one row (a bad conversation or pair) as a DataError that names the row."""
    try:
        yield
    except ValueError as e:
        raise DataError(f"{row_name(source, index)}: {e}") from None


def row_name(source: str, index: int) -> str:
    """A row in an error, by its index from 0: a local file's lines would count blank ones, a directory's or glob's
    rows are counted over its files in sorted order. A hub dataset's or a task's row: its index alone."""
    how = "not a line number" if Path(source).expanduser().is_file() else "over its files in sorted order"
    return f"{source} row {index}" + f" (0-based, {how})" * (source_kind(source) == "local")
