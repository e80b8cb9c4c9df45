"""fineweb.py: the llm.c shard format, the writer (sources, val rule, resume) and the loader (exactly-once windows
over ranks, reproducible shuffle, exact resume, preload), and a one-line error for every kind of bad input."""

import functools
import gzip
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import fineweb
from common import EOT, get_tokenizer
from fineweb import (
    DataError,
    FinewebConfig,
    TokenLoader,
    find_shards,
    main,
    read_shard,
    stdlib_files,
    write_dataset,
    write_shard,
)

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"
WORDS = ("the cat sat on a mat while GPT-2 read über naïve 日本 code def f(x): return x ** 2 \n and "
         "then 12345 tokens, <|endoftext|> as plain text, a tab\there").split(" ")


def make_docs(n: int, seed: int = 0) -> list[str]:
    """n documents of 20-120 words each: a few thousand tokens in all, so 1000-token shards split documents."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(20, 120))) for _ in range(n)]


@functools.cache
def encoder():
    return get_tokenizer()  # building the BPE tables takes a second or two: once per test session


def expected_tokens(docs: list[str]) -> np.ndarray:
    enc = encoder()
    return np.array([t for d in docs for t in [EOT, *enc.encode_ordinary(d)]], dtype=np.uint16)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    data = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)  # x.jsonl.gz: gzipped
    return path


def cfg_for(source: Path | str, out: Path, **kw) -> FinewebConfig:
    return FinewebConfig(**{"source": str(source), "out_dir": str(out), "prefix": "t", "shard_size": 1000,
                            "val_tokens": 700, "workers": 1, **kw})


def shard_files(out: Path) -> list[Path]:
    return sorted(out.glob("*.bin"), key=lambda p: p.name.rsplit("_", 1)[1])  # by index: val_000000 first


def concat(out: Path) -> np.ndarray:
    return np.concatenate([read_shard(p) for p in shard_files(out)])


def write_killed(cfg: FinewebConfig, monkeypatch, after: int) -> list[Path]:
    """write_dataset(cfg) as if the process were killed (KeyboardInterrupt) while it made shard `after` + 1: the
    paths of the `after` shards it wrote before that."""
    real, written = fineweb.write_shard, []

    def killed(path, tokens):
        if len(written) == after:
            raise KeyboardInterrupt
        written.append(path)
        real(path, tokens)

    monkeypatch.setattr(fineweb, "write_shard", killed)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(cfg)
    monkeypatch.setattr(fineweb, "write_shard", real)
    return written


def numbered_shards(d: Path, lengths: list[int], split: str = "train") -> Path:
    """Shards whose tokens name their place: shard s holds s*5000 + 0, 1, 2, ..."""
    d.mkdir(parents=True, exist_ok=True)
    for s, n in enumerate(lengths):
        write_shard(d / f"n_{split}_{s:06d}.bin", s * 5000 + np.arange(n))
    return d


def batches(loader: TokenLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


# ----------------------------------------------------------------------------------------------------------------------
# format


def test_bin_header_is_byte_exact_llmc_layout(tmp_path):
    tokens = np.array([EOT, 15496, 11, 0, 65535, 50256, 7], dtype=np.uint16)
    write_shard(tmp_path / "x_train_000001.bin", tokens)
    raw = (tmp_path / "x_train_000001.bin").read_bytes()
    assert len(raw) == 1024 + 2 * 7
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[:3].tolist() == [20240520, 1, 7]
    assert not header[3:].any()
    assert raw[1024:] == tokens.astype("<u2").tobytes()
    assert raw[1024:1026] == bytes([0x50, 0xC4])  # 50256 little-endian
    back = read_shard(tmp_path / "x_train_000001.bin")
    assert back.dtype == np.uint16 and back.tolist() == tokens.tolist()
    assert isinstance(back, np.memmap)  # mapped, not read into RAM
    assert list(tmp_path.iterdir()) == [tmp_path / "x_train_000001.bin"]  # no temporary file left


def test_write_shard_rejects_ids_beyond_uint16(tmp_path):
    with pytest.raises(DataError, match=r"fit in uint16.*65536"):
        write_shard(tmp_path / "x_train_000001.bin", np.array([1, 65536]))
    with pytest.raises(DataError, match="fit in uint16"):
        write_shard(tmp_path / "x_train_000001.bin", np.array([-1, 3]))
    assert list(tmp_path.iterdir()) == []


def test_find_shards_by_split_name_in_directory_or_glob(tmp_path):
    for name in ("fw_val_000000.bin", "fw_train_000001.bin", "fw_train_000002.bin", "tiny_shakespeare_val.bin",
                 "tiny_shakespeare_train.bin", "edufineweb_val_000000.bin", "interval_x.bin", "val_notes.bin",
                 "fw_train_000003.bin.7.tmp", ".fw_train_000004.bin.7.tmp", "fw_train_000005.npy", "notes.txt"):
        (tmp_path / name).touch()
    names = lambda files: [f.name for f in files]
    assert names(find_shards(tmp_path, "val")) == ["edufineweb_val_000000.bin", "fw_val_000000.bin",
                                                   "tiny_shakespeare_val.bin"]
    assert names(find_shards(tmp_path, "train")) == ["fw_train_000001.bin", "fw_train_000002.bin",
                                                     "tiny_shakespeare_train.bin"]
    assert names(find_shards(str(tmp_path / "fw_*"), "train")) == ["fw_train_000001.bin", "fw_train_000002.bin"]


@pytest.mark.parametrize("word", ["train", "val"])
def test_a_prefix_that_is_a_split_word_keeps_val_and_train_apart(tmp_path, word):
    """--source x/train.jsonl gives the prefix `train`: its val shard train_val_000000.bin is val only."""
    docs = make_docs(30)
    src = write_jsonl(tmp_path / f"{word}.jsonl", docs)
    cfg = FinewebConfig(source=str(src), out_dir=str(tmp_path / "out"), shard_size=1000, val_tokens=700, workers=1)
    assert cfg.prefix == word
    write_dataset(cfg)
    val, train = find_shards(tmp_path / "out", "val"), find_shards(tmp_path / "out", "train")
    assert [f.name for f in val] == [f"{word}_val_000000.bin"]
    n_train = -(-(len(expected_tokens(docs)) - 700) // 1000)
    assert [f.name for f in train] == [f"{word}_train_{i:06d}.bin" for i in range(1, n_train + 1)] and n_train > 2


# ----------------------------------------------------------------------------------------------------------------------
# writer


def test_write_then_read_back_equals_tokenizer_output_with_eots(tmp_path):
    docs = make_docs(60)
    result = write_dataset(cfg_for(write_jsonl(tmp_path / "docs.jsonl", docs), tmp_path / "out"))
    want = expected_tokens(docs)
    files = shard_files(tmp_path / "out")
    n_train = -(-(len(want) - 700) // 1000)
    assert [f.name for f in files] == ["t_val_000000.bin"] + [f"t_train_{i:06d}.bin" for i in range(1, n_train + 1)]
    sizes = [len(read_shard(f)) for f in files]
    assert sizes == [700] + [1000] * (n_train - 1) + [len(want) - 700 - 1000 * (n_train - 1)]
    assert np.array_equal(concat(tmp_path / "out"), want)
    assert int((want == EOT).sum()) == 60 and want[0] == EOT
    assert result["shards"] == n_train + 1 and result["val_tokens"] == 700
    assert result["train_tokens"] == len(want) - 700 and result["documents_tokenized"] == 60


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(80, seed=5))
    write_dataset(cfg_for(src, tmp_path / "one", workers=1))
    write_dataset(cfg_for(src, tmp_path / "two", workers=2))
    one, two = shard_files(tmp_path / "one"), shard_files(tmp_path / "two")
    assert [p.name for p in one] == [p.name for p in two] and len(one) > 3
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two, strict=True))


def test_a_long_text_is_tokenized_in_pieces_to_the_same_tokens(monkeypatch):
    """One 50 MB document peaked at ~1 GB: tiktoken's list of Python ints for the whole of it, ~40 bytes a token."""
    import tracemalloc

    words = [*"ab", "'s", "12", "!?", "caf\u00e9", ""]
    seps = [" ", "\n", "\n\n", " \n", "\n ", "  \n\n", "\t\n", "\u00a0\n", "\x1c\n", "\r\n", "\r", "\n\n\n", "\n\t"]
    text = "".join(w + s for w in words for s in seps) * 3
    real = fineweb.pieces
    for size in range(1, 40):  # pieces of 1 to 39 characters or a few more: cuts before nearly every newline
        monkeypatch.setattr(fineweb, "pieces", functools.partial(real, size=size))
        assert np.array_equal(fineweb.tokenize(["x", text]), expected_tokens(["x", text]))
    assert len(list(real("line\r\n" * 9, size=10))) == 5  # Windows line ends are cut too
    long = "\n".join(make_docs(3000))  # ~1 MB, 370k tokens, in pieces of ~10k characters
    monkeypatch.setattr(fineweb, "pieces", functools.partial(real, size=10_000))
    tracemalloc.start()
    try:
        tokens = fineweb.tokenize([long])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(tokens, expected_tokens([long])) and peak < 8 * len(tokens)  # the list took 42 a token


def test_chunks_come_back_in_document_order_when_more_are_in_flight_than_the_window():
    """token_stream keeps 4 chunks per worker in flight and must hand back the oldest first. The writer tests read
    too few chunks of 16 documents to fill that window; chunks of one document over 2 workers fill it many times."""
    docs = make_docs(30, seed=8)
    want = [expected_tokens([d]).tolist() for d in docs]  # first: forked workers inherit the tokenizer's tables
    with fineweb.tokenizer_pool(2) as pool:
        out = list(fineweb.token_stream([(d, i) for i, d in enumerate(docs)], pool, 2, chunk=1))
    assert [c.tolist() for c, _ in out] == want and [where for _, where in out] == [[i] for i in range(30)]


def test_max_tokens_stops_exactly_and_default_val_is_the_first_shard(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(60))
    result = write_dataset(cfg_for(src, tmp_path / "out", val_tokens=-1, max_tokens=2500))
    assert [len(read_shard(f)) for f in shard_files(tmp_path / "out")] == [1000, 1000, 500]
    assert np.array_equal(concat(tmp_path / "out"), expected_tokens(make_docs(60))[:2500])
    assert (result["val_tokens"], result["train_tokens"]) == (1000, 1500)
    assert result["documents_tokenized"] == int((expected_tokens(make_docs(60))[:2500] == EOT).sum()) == 23


def test_local_sources_jsonl_parquet_txt_give_the_same_tokens(tmp_path):
    import datasets

    docs = make_docs(12, seed=2)
    write_jsonl(tmp_path / "a.jsonl", docs)
    datasets.Dataset.from_dict({"body": docs, "n": list(range(12))}).to_parquet(str(tmp_path / "a.parquet"))
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, d in enumerate(docs):  # a .txt file is one document; sorted by name, so zero-padded
        (txt / f"doc{i:02d}.txt").write_text(d)
    want = expected_tokens(docs)
    for name, source, field in (("jsonl", tmp_path / "a.jsonl", "text"), ("parquet", tmp_path / "a.parquet", "body"),
                                ("txt", txt, "text"), ("glob", f"{txt}/*.txt", "text")):
        write_dataset(cfg_for(source, tmp_path / name, text_field=field, val_tokens=300))
        assert np.array_equal(concat(tmp_path / name), want), name


def test_a_directorys_files_of_other_types_are_named_not_skipped_in_silence(tmp_path, capsys):
    docs = make_docs(12, seed=2)
    write_jsonl((tmp_path / "src").mkdir() or tmp_path / "src" / "a.jsonl", docs[:8])
    write_jsonl(tmp_path / "src" / "b.jsonl.gz", docs[8:])  # gzipped, of the same builder: read
    for name in ("README.md", "x.csv.gz", "x.gz"):  # a .gz whose inner suffix no builder reads is not
        (tmp_path / "src" / name).write_bytes(gzip.compress(b"a,b\n") if name.endswith(".gz") else b"# card")
    (tmp_path / "src" / ".git").mkdir()  # hidden: a clone's own files are not the user's data
    (tmp_path / "src" / ".git" / "HEAD").write_text("ref")
    write_dataset(cfg_for(tmp_path / "src", tmp_path / "src" / "out", val_tokens=300))
    assert capsys.readouterr().out.startswith(f"note: --source {tmp_path / 'src'}: 3 file(s) left out, not "
                                              ".txt/.jsonl/.json/.parquet/.txt.gz/.jsonl.gz/.json.gz: README.md, "
                                              "x.csv.gz, x.gz\n")
    assert np.array_equal(concat(tmp_path / "src" / "out"), expected_tokens(docs))
    for files, found in ((["x.csv.gz", "x.gz"], "matches no .* files \\(found \\.csv\\.gz, \\.gz\\)$"),
                         (["a.txt", "b.jsonl.gz"], "mixes file types \\(\\.jsonl\\.gz, \\.txt\\); pass a glob")):
        (only := tmp_path / "-".join(files)).mkdir()
        for name in files:
            (only / name).write_bytes(gzip.compress(b"{}") if name.endswith(".gz") else b"text")
        with pytest.raises(DataError, match=f"^--source {re.escape(str(only))}/\\* {found}"):
            fineweb.local_files(f"{only}/*", tmp_path / "out")


@pytest.mark.parametrize("streaming", [True, False])
def test_gzipped_files_write_the_shards_and_record_of_their_plain_forms(tmp_path, monkeypatch, streaming):
    """C4's c4-train.00000-of-01024.json.gz, a folder of .jsonl.gz with a plain .jsonl among them (one builder), a
    book.txt.gz by paragraph: `datasets` decompresses them, and the shards and record are those of the plain files."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))  # not streamed: it writes a cache
    docs = make_docs(24, seed=4)
    book = "\n\n".join(docs).encode()  # by paragraph: a document each
    corpora = {"c4": {"c4-train.00000-of-01024.json": docs}, "book": {"book.txt": None},
               "parts": {"a.jsonl": docs[:8], "b.jsonl": docs[8:16], "c.jsonl": docs[16:]}}
    for corpus, files in corpora.items():
        seen = []
        for gz in ("", ".gz"):
            (src := tmp_path / f"{corpus}{gz}").mkdir()
            for name, part in files.items():
                path = src / (name + gz * (name != "a.jsonl"))  # a plain .jsonl among .jsonl.gz: one builder
                write_jsonl(path, part) if part else path.write_bytes(gzip.compress(book) if gz else book)
            result = write_dataset(cfg_for(src, out := tmp_path / f"out-{corpus}{gz}", txt_unit="paragraph",
                                           streaming=streaming))
            record = json.loads((out / "t_done.json").read_text())
            seen.append(([record[k] for k in ("shards", "resume", "done")], record["inputs"]["files"],
                         result["documents_tokenized"], {p.name: p.read_bytes() for p in shard_files(out)}))
        assert seen[0] == seen[1], corpus
        assert (seen[1][2], len(seen[1][3])) == (24, 4), corpus


def test_txt_unit_line_makes_one_document_per_nonempty_line(tmp_path):
    (tmp_path / "a.txt").write_text("first line\n\nsecond line\nthird\n")
    write_dataset(cfg_for(tmp_path / "a.txt", tmp_path / "out", txt_unit="line", val_tokens=3))
    assert np.array_equal(concat(tmp_path / "out"), expected_tokens(["first line", "second line", "third"]))


def test_a_txt_files_byte_order_mark_is_not_text(tmp_path):
    # Notepad's UTF-8 files begin with EF BB BF: each such document began with U+FEFF's tokens
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfHello there.\n")
    cfg = cfg_for(tmp_path / "a.txt", tmp_path / "out")
    assert [text for text, _ in fineweb.read_documents(cfg, [tmp_path / "a.txt"])] == ["Hello there.\n"]


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="needs ../shared/data/tinyshakespeare.txt")
def test_shakespeare_local_copy_whole_file_is_one_document(tmp_path):
    text = SHAKESPEARE.read_text()
    want = expected_tokens([text])
    result = main(["--source", "shakespeare", "--shakespeare-path", str(SHAKESPEARE), "--out-dir",
                   str(tmp_path), "--workers", "1", "--cache-dir", str(tmp_path / "cache")])
    files = shard_files(tmp_path)
    assert [f.name for f in files] == ["shakespeare_val_000000.bin", "shakespeare_train_000001.bin"]
    assert [len(read_shard(f)) for f in files] == [32768, len(want) - 32768]
    assert len(want) == 338026  # GPT-2 tokens of Tiny Shakespeare, + 1 EOT
    assert np.array_equal(concat(tmp_path), want)
    assert result["documents_tokenized"] == 1
    loader = TokenLoader(str(tmp_path), "val", 8, 256)
    assert loader.num_windows == 32767 // 2048 == 15
    assert not (tmp_path / "cache").exists()  # nothing downloaded


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="needs ../shared/data/tinyshakespeare.txt")
def test_shakespeare_downloads_once_into_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_urlopen(url, timeout):
        calls.append(url)
        return io.BytesIO(SHAKESPEARE.read_bytes()[:5000])

    monkeypatch.setattr(fineweb.urllib.request, "urlopen", fake_urlopen)
    cfg = cfg_for("shakespeare", tmp_path / "out", cache_dir=str(tmp_path / "cache"), val_tokens=100)
    write_dataset(cfg)
    write_dataset(cfg)
    assert calls == [fineweb.SHAKESPEARE_URL]
    cached = tmp_path / "cache" / "tinyshakespeare.txt"
    assert cached.read_bytes() == SHAKESPEARE.read_bytes()[:5000]
    assert np.array_equal(concat(tmp_path / "out"), expected_tokens([cached.read_text()]))


def test_shakespeare_download_failure_names_the_local_flag(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise fineweb.urllib.error.URLError("no network")

    monkeypatch.setattr(fineweb.urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match="could not download Tiny Shakespeare.*--shakespeare-path"):
        write_dataset(cfg_for("shakespeare", tmp_path / "out", cache_dir=str(tmp_path / "cache")))
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_shakespeare_path_that_is_not_a_file_says_so(tmp_path):
    folder = tmp_path / "shk"
    folder.mkdir()
    args = ["--source", "shakespeare", "--shakespeare-path", str(folder), "--out-dir", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache")]
    for path in (folder, tmp_path / "missing.txt"):
        with pytest.raises(SystemExit) as e:
            main([*args[:2], "--shakespeare-path", str(path), *args[4:]])
        assert e.value.code == (
            f"error: --shakespeare-path {path} is not a file; pass the path of a local copy of tinyshakespeare.txt, "
            "or leave it out to download it")
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_pool_closes_under_a_parent_that_catches_sigterm(tmp_path):
    # reaching --max-tokens closes the pool with tokenization in flight: Pool.terminate() stops those workers with
    # SIGTERM, which they must not inherit a handler for (train.py's, when both run in one process, hung for good)
    script = f"""
import signal
import fineweb
signal.signal(signal.SIGTERM, lambda *args: None)
fineweb.main(["--source", "stdlib", "--out-dir", {str(tmp_path)!r}, "--val-tokens", "1000", "--shard-size", "2000",
              "--max-tokens", "5000", "--workers", "2"])
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [len(read_shard(f)) for f in shard_files(tmp_path)] == [1000, 2000, 2000]


def test_a_dead_tokenizer_process_is_an_error_not_a_hang(tmp_path):
    # the OOM killer takes a worker mid-chunk: the writer must stop with the reason (a multiprocessing.Pool would
    # replace the worker and wait forever for its chunk), and a rerun must finish the shards
    write_jsonl(tmp_path / "docs.jsonl", [f"doc {i} {text}" for i, text in enumerate(make_docs(400))])
    args = ["--source", str(tmp_path / "docs.jsonl"), "--out-dir", str(tmp_path / "out"), "--val-tokens", "500",
            "--shard-size", "1000", "--workers", "2"]
    script = f"""
import multiprocessing, os, signal
import fineweb
multiprocessing.set_start_method("fork")  # so the workers see the patched tokenize (forkserver would re-import)
real = fineweb.tokenize
def dies_at_document_200(texts):
    if any(t.startswith("doc 200 ") for t in texts):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(texts)
fineweb.tokenize = dies_at_document_200
fineweb.main({args!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "error: a tokenizer process exited unexpectedly" in proc.stderr, proc.stderr[-2000:]
    written = len(shard_files(tmp_path / "out"))
    assert written >= 1
    result = main(args)
    assert result["skipped_shards"] >= 1 and len(shard_files(tmp_path / "out")) > written


def test_a_tokenizer_process_whose_writer_died_before_it_started_exits():
    # SIGKILLed before a worker ran its initializer, the writer sends no death signal (prctl came too late), and the
    # worker, holding the task pipe's write end itself, waited on it forever (one outlived CI's 30 s, under load)
    ran = subprocess.run([sys.executable, "-c", "import os, fineweb\nfineweb._pool_worker_init(os.getppid() + 1)\n"
                          "print('waits for tasks')"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout, ran.stderr) == (1, "", "")  # an exit, not an error
    ran = subprocess.run([sys.executable, "-c", "import os, fineweb\nfineweb._pool_worker_init(os.getppid())\n"
                          "print('waits for tasks')"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout) == (0, "waits for tasks\n")


def test_tokenizer_processes_end_with_a_writer_killed_outright(tmp_path):
    # SIGKILL (the OOM killer) runs no shutdown in the writer; its pool workers must not sleep on forever
    write_jsonl(tmp_path / "docs.jsonl", make_docs(50))
    args = ["--source", str(tmp_path / "docs.jsonl"), "--out-dir", str(tmp_path / "out"), "--workers", "2"]
    script = f"""
import os, signal
import fineweb
def killed(docs, pool, workers, chunk=16):  # once the workers exist, before any token
    print(*pool._processes, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
fineweb.token_stream = killed
fineweb.main({args!r})
"""
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:  # not pipes: workers that
        # outlive the writer would hold them open, and the test would wait on them instead of checking
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=out, stderr=err, timeout=120)
    assert proc.returncode == -9, (tmp_path / "stderr").read_text()[-2000:]
    workers = [int(pid) for pid in (tmp_path / "stdout").read_text().split()]
    assert len(workers) == 2

    def alive(pid: int) -> bool:
        try:  # a zombie has ended; only its exit status waits for a reaper
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.time() + 30
    while any(map(alive, workers)) and time.time() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:  # a failed test must not leave them behind either
        os.kill(pid, signal.SIGKILL)
    assert not left


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_tokenizer_pool_works_under_other_start_methods(method):
    # Python 3.14 makes forkserver Linux's default (macOS uses spawn): a worker is then not the writer's child, and the
    # parent-death check must not take that for a dead writer
    script = f"""
import multiprocessing
import fineweb
if __name__ == "__main__":
    multiprocessing.set_start_method({method!r})
    with fineweb.tokenizer_pool(2) as pool:
        print(len(pool.submit(fineweb.tokenize, ["hello world"] * 3).result()))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["9"], proc.stderr[-2000:]  # 3 x (EOT + 2 tokens)


def test_stdlib_source_is_sorted_python_files_one_document_each(tmp_path):
    files = stdlib_files()
    root = Path(fineweb.sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 300 and rel == sorted(rel) and all(f.suffix == ".py" for f in files)
    assert "os.py" in rel and "json/decoder.py" in rel
    assert not any(set(r.split("/")[:-1]) & {"test", "tests", "idle_test", "site-packages", "encodings"} for r in rel)
    result = write_dataset(cfg_for("stdlib", tmp_path, val_tokens=1000, shard_size=2000, max_tokens=5000))
    assert [len(read_shard(f)) for f in shard_files(tmp_path)] == [1000, 2000, 2000]
    texts, n = [], 0
    for f in files:  # the first files, enough to cover 5000 tokens
        texts.append(f.read_text())
        n += len(expected_tokens(texts[-1:]))
        if n >= 5000:
            break
    assert np.array_equal(concat(tmp_path), expected_tokens(texts)[:5000])
    assert result["train_tokens"] == 4000


def test_stdlib_docs_source_is_the_distinct_docstrings_one_document_each(tmp_path):
    import ast

    cfg = cfg_for("stdlib-docs", tmp_path / "out", cache_dir=str(tmp_path / "cache"), val_tokens=1000,
                  shard_size=2000, max_tokens=5000)
    result = write_dataset(cfg)
    cached = fineweb.stdlib_docstrings(cfg)
    docs = [json.loads(line)["text"] for line in cached.read_text().splitlines()]
    first = ast.get_docstring(ast.parse(stdlib_files()[0].read_bytes()))  # __future__.py's module docstring
    assert docs[0] == "\n".join(" ".join(line.split()) for line in first.splitlines()) != first  # it has indentation
    assert len(docs) == len(set(docs)) > 3000 and "" not in docs
    assert not [line for doc in docs for line in doc.splitlines() if line != line.strip() or "  " in line]
    assert result["train_tokens"] == 4000 and [len(read_shard(f)) for f in shard_files(tmp_path / "out")] == [
        1000, 2000, 2000]
    assert np.array_equal(concat(tmp_path / "out"), expected_tokens(docs[:400])[:5000])
    stamp = cached.stat().st_mtime_ns  # written once: a second run reuses it, so its fingerprint stays the same
    assert fineweb.stdlib_docstrings(cfg) == cached and cached.stat().st_mtime_ns == stamp
    default = FinewebConfig(source="stdlib-docs")
    assert (default.out_dir, default.prefix, default.val_target) == ("data/stdlib_docs", "stdlib_docs", 32768)


def test_default_job_is_fineweb_edu_sample_10bt_through_datasets(tmp_path, monkeypatch):
    import datasets

    docs = make_docs(40)
    calls = []

    def fake_load_dataset(path, **kw):
        calls.append((path, kw))
        return [{"text": d, "id": i} for i, d in enumerate(docs)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = FinewebConfig()
    assert (cfg.out_dir, cfg.prefix, cfg.name, cfg.val_tokens, cfg.val_target) == ("data/edu_fineweb10B", "edufineweb",
                                                                                   "sample-10BT", -1, 100_000_000)
    main(["--out-dir", str(tmp_path), "--shard-size", "1000", "--workers", "1"])
    assert calls == [("HuggingFaceFW/fineweb-edu", {"name": "sample-10BT", "split": "train", "streaming": True})]
    assert [f.name for f in shard_files(tmp_path)][:2] == ["edufineweb_val_000000.bin", "edufineweb_train_000001.bin"]
    assert len(read_shard(tmp_path / "edufineweb_val_000000.bin")) == 1000  # first shard is val
    assert np.array_equal(concat(tmp_path), expected_tokens(docs))
    # a pinned hub revision reaches load_dataset, and a finished run of the latest revision is not taken for it
    main(["--out-dir", str(tmp_path), "--shard-size", "1000", "--workers", "1", "--revision", "abc123"])
    assert calls[-1] == ("HuggingFaceFW/fineweb-edu", {"name": "sample-10BT", "split": "train", "streaming": True,
                                                        "revision": "abc123"})


def test_config_defaults_per_source():
    assert (FinewebConfig(source="corpus/*.jsonl").prefix, FinewebConfig(source="corpus/*.jsonl").out_dir) == \
        ("corpus", "data/corpus")
    hub = FinewebConfig(source="someone/my-data")
    assert (hub.prefix, hub.name, hub.val_target) == ("my_data", "", 100_000_000)
    assert (FinewebConfig(source="stdlib").out_dir, FinewebConfig(source="stdlib").val_target) == ("data/stdlib", 2**18)
    assert FinewebConfig(source="shakespeare").val_target == 32768
    assert FinewebConfig(source="shakespeare", val_tokens=5).val_target == 5
    assert FinewebConfig(source="a.txt", shard_size=1000).val_target == 1000


def test_source_kind_tells_local_paths_from_hub_names(tmp_path):
    """A source that does not exist yet is still local when it looks like a path (./, /, ~, a data file's suffix, a
    glob): sent to the hub instead, a typo would end in a confusing download error. A bare org/name is the hub."""
    (tmp_path / "corpus").mkdir()
    kinds = {"shakespeare": "shakespeare", "stdlib": "stdlib", "stdlib-docs": "stdlib-docs",
             "HuggingFaceFW/fineweb-edu": "fineweb",
             "someone/my-data": "hub", "wikitext": "hub", str(tmp_path / "corpus"): "local", "./missing": "local",
             "../corpus": "local", "/no/such/dir": "local", "~/no-such-corpus": "local", "books.txt": "local",
             "data/part.parquet": "local", "a.json": "local", "missing/*.jsonl": "local", "shards/[ab]": "local"}
    assert {source: fineweb.source_kind(source) for source in kinds} == kinds


def test_flags_the_user_set_are_kept_and_reach_load_dataset(tmp_path, monkeypatch):
    """--name and --prefix given by the user are not replaced by the per-source defaults; a hub dataset's --split is
    passed on, and its empty --name is no config (None, not '')."""
    import datasets

    assert FinewebConfig(name="sample-100BT").name == "sample-100BT"
    assert FinewebConfig(source="a.jsonl", prefix="mine").prefix == "mine"
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda path, **kw: calls.append((path, kw)) or [{"text": "a b"}])
    main(["--source", "someone/my-data", "--split", "validation", "--out-dir", str(tmp_path), "--workers", "1",
          "--val-tokens", "1"])
    assert calls == [("someone/my-data", {"name": None, "split": "validation", "streaming": True})]


@pytest.mark.parametrize("kw, message", [
    (dict(txt_unit="lines"), "--txt-unit must be document, paragraph or line, got 'lines'"),
    (dict(shard_size=2**31), r"--shard-size must be in \[1, 2\*\*31\), got 2147483648"),
    (dict(val_tokens=0), r"--val-tokens must be -1 \(a default per source\) or in \[1, 2\*\*31\), got 0"),
    (dict(val_tokens=2**31), r"--val-tokens must be -1 .*got 2147483648"),
    (dict(workers=-1), "--workers and --max-tokens must be >= 0"),
    (dict(max_tokens=-1), "--workers and --max-tokens must be >= 0"),
], ids=["txt_unit", "shard_size", "val_tokens_0", "val_tokens_2**31", "workers", "max_tokens"])
def test_config_refuses_values_out_of_range(kw, message):
    """Each bound of the config, checked before anything is read (an int32 header count, a known --txt-unit)."""
    with pytest.raises(ValueError, match=f"^{message}"):
        FinewebConfig(source="a.txt", **kw)
    FinewebConfig(source="a.txt", **{k: {"txt_unit": "line", "shard_size": 2**31 - 1, "val_tokens": 2**31 - 1,
                                          "workers": 0, "max_tokens": 0}[k] for k in kw})  # the edge is accepted


def test_max_tokens_below_val_tokens_names_max_tokens():
    with pytest.raises(ValueError) as err:
        FinewebConfig(source="a.jsonl", val_tokens=700, max_tokens=500)
    assert str(err.value) == ("--max-tokens 500 leaves no train tokens after the val shard's --val-tokens 700; raise "
                              "--max-tokens or lower --val-tokens")
    with pytest.raises(SystemExit, match=r"^error: --max-tokens 700 leaves no train tokens after the val shard's "
                                         r"--val-tokens 700; raise --max-tokens or lower --val-tokens$"):
        main(["--source", "a.jsonl", "--val-tokens", "700", "--max-tokens", "700"])


def test_short_source_without_val_tokens_gives_its_first_10_percent_to_val(tmp_path, monkeypatch):
    docs = make_docs(6, seed=4)
    want = expected_tokens(docs)
    assert 600 < len(want) < 1000  # ends before a default (--shard-size) val shard is full
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    real = fineweb.write_shard

    def killed_after_val(path, tokens):
        if "train" in path.name:
            raise KeyboardInterrupt
        real(path, tokens)

    monkeypatch.setattr(fineweb, "write_shard", killed_after_val)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(cfg_for(src, tmp_path / "out", val_tokens=-1))
    assert [len(read_shard(f)) for f in shard_files(tmp_path / "out")] == [len(want) // 10]
    monkeypatch.setattr(fineweb, "write_shard", real)
    result = write_dataset(cfg_for(src, tmp_path / "out", val_tokens=-1))  # not kept: a val shard that is not full
    assert (result["skipped_shards"], result["val_tokens"], result["train_tokens"]) == \
        (0, len(want) // 10, len(want) - len(want) // 10)
    assert [f.name for f in shard_files(tmp_path / "out")] == ["t_val_000000.bin", "t_train_000001.bin"]
    assert [len(read_shard(f)) for f in shard_files(tmp_path / "out")] == [len(want) // 10, len(want) - len(want) // 10]
    assert np.array_equal(concat(tmp_path / "out"), want)
    assert write_dataset(cfg_for(src, tmp_path / "out", val_tokens=-1))["tokenized"] == 0  # recognized as finished
    limited = write_dataset(cfg_for(src, tmp_path / "lim", val_tokens=-1, max_tokens=500))  # the 10% of what is read
    assert [len(read_shard(f)) for f in shard_files(tmp_path / "lim")] == [50, 450] and limited["val_tokens"] == 50
    assert np.array_equal(concat(tmp_path / "lim"), want[:500])


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="needs ../shared/data/tinyshakespeare.txt")
def test_shakespeare_as_a_local_file_needs_no_val_tokens(tmp_path, capsys):
    argv = ["--source", str(SHAKESPEARE), "--out-dir", str(tmp_path), "--workers", "1"]
    main(argv)
    files = shard_files(tmp_path)
    assert [f.name for f in files] == ["tinyshakespeare_val_000000.bin", "tinyshakespeare_train_000001.bin"]
    assert [len(read_shard(f)) for f in files] == [33802, 338026 - 33802]
    assert main(argv)["tokenized"] == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"{tmp_path}: 2 shards (2 already complete), 33,802 val + 304,224 train tokens; nothing to do (to write "
        "them again, delete them or pass another --out-dir)")


# ----------------------------------------------------------------------------------------------------------------------
# writer resume


@pytest.fixture
def reference(tmp_path):
    """An uninterrupted run over 70 documents into 1000-token shards: the bytes every resumed run must match."""
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(70, seed=9))
    write_dataset(cfg_for(src, tmp_path / "ref"))
    return src, {p.name: p.read_bytes() for p in shard_files(tmp_path / "ref")}


def test_killed_writer_resumes_without_duplicating_or_losing_tokens(tmp_path, monkeypatch, reference, capsys):
    src, ref = reference
    write_killed(cfg_for(src, tmp_path / "out", workers=2), monkeypatch, after=3)  # while tokenizing the fourth
    assert len(list((tmp_path / "out").glob("*.bin"))) == 3
    assert read_shard(tmp_path / "out" / "t_train_000002.bin")[-1] != EOT  # cut inside a document
    capsys.readouterr()
    result = write_dataset(cfg_for(src, tmp_path / "out"))
    assert result["skipped_shards"] == 3 and len(ref) > 6
    assert {p.name: p.read_bytes() for p in shard_files(tmp_path / "out")} == ref
    # only the documents this run wrote tokens of: the one cut at the end of train shard 2, and those after it
    kept_docs = sum(int((np.frombuffer(ref[n][1024:], "<u2") == EOT).sum()) for n in list(ref)[:3])
    assert result["documents_tokenized"] == 70 - kept_docs + 1 < 70
    assert result["tokenized"] == sum(len(v) - 1024 for v in ref.values()) // 2 - 700 - 2000
    assert f"tokenized {result['tokenized']:,} tokens of {70 - kept_docs + 1} documents in" in capsys.readouterr().out


def rerun_with_earlier_files_garbled(cfg: FinewebConfig, files: list[Path], docs_per_file: list[int],
                                     written: list[Path], spared: int = 0) -> tuple[dict, int]:
    """write_dataset(cfg) after a run killed once it wrote `written`, with every source file before the one holding
    the document its last shard ends in overwritten by garbage of the same size and mtime (which the inputs'
    fingerprint cannot tell): a rerun that read one would fail or write other tokens. The files are restored after.
    Returns the rerun's result and the number of files before that one (the first `spared` of them kept as they are)."""
    cut = sum(int((read_shard(p) == EOT).sum()) for p in written) - 1  # that document's index
    first = next(i for i in range(len(files)) if sum(docs_per_file[:i + 1]) > cut)
    saved = [(f, f.read_bytes(), f.stat()) for f in files[spared:first]]
    for f, data, st in saved:
        f.write_bytes(b"x" * len(data))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        return write_dataset(cfg), first
    finally:
        for f, data, st in saved:
            f.write_bytes(data)
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_killed_writer_resumes_at_the_file_of_its_first_missing_document(tmp_path, monkeypatch):
    # 8 files streamed a file at a time, one empty and one of empty texts: a rerun must not read the files before the
    # one its first missing token's document is in, and must write what an uninterrupted run writes, also with 2
    # workers (reading runs ahead of writing) and after switching to --streaming false (one part: the recorded row in
    # the source tells where to go on)
    src = tmp_path / "src"
    src.mkdir()
    docs, sizes = make_docs(60, seed=3), [10, 0, 10, 10, 10, 10, 10, 0]
    files = [src / f"part{i}.jsonl" for i in range(len(sizes))]
    for i, f in enumerate(files[:-1]):
        write_jsonl(f, docs[sum(sizes[:i]):sum(sizes[:i + 1])])
    write_jsonl(files[-1], ["", ""])  # texts, but no documents
    write_dataset(cfg_for(f"{src}/*.jsonl", tmp_path / "ref"))
    expected = {p.name: p.read_bytes() for p in shard_files(tmp_path / "ref")}
    garbled = []
    for workers, kill_after in [(1, k) for k in range(3, len(expected) - 1)] + [(2, 3)]:
        out = tmp_path / f"out{workers}_{kill_after}"
        written = write_killed(cfg_for(f"{src}/*.jsonl", out), monkeypatch, after=kill_after)
        result, skipped = rerun_with_earlier_files_garbled(cfg_for(f"{src}/*.jsonl", out, workers=workers), files,
                                                          sizes, written)
        garbled.append(skipped)
        assert result["skipped_shards"] == kill_after
        assert {p.name: p.read_bytes() for p in shard_files(out)} == expected
    assert max(garbled) >= 5  # the later kills skip five files or more, the empty one among them
    write_killed(cfg_for(f"{src}/*.jsonl", tmp_path / "plain"), monkeypatch, after=5)
    result = write_dataset(cfg_for(f"{src}/*.jsonl", tmp_path / "plain", streaming=False))
    assert result["skipped_shards"] == 5
    assert {p.name: p.read_bytes() for p in shard_files(tmp_path / "plain")} == expected


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_resume_skips_every_file_before_the_document_it_goes_on_in(tmp_path, monkeypatch, suffix):
    """One document per file, and shards of a few documents each: whatever the cut, the rerun starts reading at the
    file of the document the kept shards end in, and writes what an uninterrupted run writes, gzipped or not."""
    src = tmp_path / "src"
    src.mkdir()
    files = [write_jsonl(src / f"doc{i:02d}{suffix}", [d]) for i, d in enumerate(make_docs(20, seed=12))]
    settings = {"shard_size": 300, "val_tokens": 200}
    write_dataset(cfg_for(f"{src}/*{suffix}", tmp_path / "ref", **settings))
    expected = {p.name: p.read_bytes() for p in shard_files(tmp_path / "ref")}
    for kill_after in (3, len(expected) - 2):
        out = tmp_path / f"out{kill_after}"
        written = write_killed(cfg_for(f"{src}/*{suffix}", out, **settings), monkeypatch, after=kill_after)
        # `datasets`' json builder reads the first file's first chunk for its schema: plain garbage passes, not gzip's
        result, skipped = rerun_with_earlier_files_garbled(cfg_for(f"{src}/*{suffix}", out, **settings), files,
                                                          [1] * 20, written, spared=suffix.endswith(".gz"))
        assert result["skipped_shards"] == kill_after and skipped >= 3
        assert {p.name: p.read_bytes() for p in shard_files(out)} == expected


def test_rerun_rewrites_missing_corrupt_and_stale_files(tmp_path, reference):
    src, ref = reference
    out = tmp_path / "out"
    out.mkdir()
    for name, data in ref.items():
        (out / name).write_bytes(data)
    (out / "t_done.json").write_bytes((tmp_path / "ref" / "t_done.json").read_bytes())  # its record, as the run left
    last = list(ref)[-1]  # shard_files order: by index
    (out / last).unlink()  # the final shard never got written
    (out / "t_train_000004.bin").write_bytes(ref["t_train_000004.bin"][:1500])  # truncated by a crash
    (out / ".t_train_000005.bin.999.tmp").write_bytes(b"partial")  # a killed write
    (out / "t_train_000099.bin").write_bytes(ref["t_train_000001.bin"])  # from a longer earlier run
    result = write_dataset(cfg_for(src, out))
    assert result["skipped_shards"] == 4
    assert sorted(p.name for p in out.iterdir()) == sorted([*ref, "t_done.json", ".t.lock"])
    assert {p.name: p.read_bytes() for p in shard_files(out)} == ref
    again = write_dataset(cfg_for(src, out))  # finished with these settings: the source is not read again
    assert again["skipped_shards"] == len(ref) and again["tokenized"] == 0
    assert {p.name: p.read_bytes() for p in shard_files(out)} == ref
    other = write_dataset(cfg_for(src, out, val_tokens=600))  # other settings: the finished record does not apply
    assert other["skipped_shards"] == 0 and other["tokenized"] == sum(len(v) - 1024 for v in ref.values()) // 2


def test_a_finished_directory_that_lost_or_damaged_a_shard_is_repaired(tmp_path, reference):
    """The completion record vouches for the shards' sizes, checked on every rerun: a finished directory whose shard
    was deleted or truncated since is written again where needed, not reported as having nothing to do."""
    src, ref = reference
    out = tmp_path / "out"
    write_dataset(cfg_for(src, out))
    (out / "t_train_000003.bin").unlink()
    (out / "t_train_000005.bin").write_bytes(ref["t_train_000005.bin"][:1500])
    result = write_dataset(cfg_for(src, out))
    assert result["skipped_shards"] == 3 and result["tokenized"] > 0
    assert {p.name: p.read_bytes() for p in shard_files(out)} == ref


def test_a_changed_local_source_is_written_again(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    docs = make_docs(40, seed=3)
    write_jsonl(src / "a.jsonl", docs[:20])
    cfg = cfg_for(src, tmp_path / "out")
    write_dataset(cfg)
    assert write_dataset(cfg)["tokenized"] == 0  # unchanged: nothing to do
    # a finished run's shards are not resumed from when the inputs changed: an edit inside a document already on
    # disk would go unnoticed, so every change is written from the start
    write_jsonl(src / "b.jsonl", docs[20:30])  # a file added
    added = write_dataset(cfg)
    assert (added["skipped_shards"], added["tokenized"]) == (0, len(expected_tokens(docs[:30])))
    assert np.array_equal(concat(tmp_path / "out"), expected_tokens(docs[:30]))
    edited_docs = ["A" + docs[0][1:], *docs[1:]]  # the same documents, the first one's first letter changed
    write_jsonl(src / "a.jsonl", edited_docs[:20])
    edited = write_dataset(cfg)
    assert (edited["skipped_shards"], edited["tokenized"]) == (0, len(expected_tokens(edited_docs[:30])))
    assert np.array_equal(concat(tmp_path / "out"), expected_tokens(edited_docs[:30]))
    st = (src / "a.jsonl").stat()
    os.utime(src / "a.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched only: read again, same bytes
    before = {p.name: p.read_bytes() for p in shard_files(tmp_path / "out")}
    assert write_dataset(cfg)["tokenized"] == len(expected_tokens(edited_docs[:30]))
    assert {p.name: p.read_bytes() for p in shard_files(tmp_path / "out")} == before
    assert write_dataset(cfg)["tokenized"] == 0
    record = json.loads((tmp_path / "out" / "t_done.json").read_text())
    assert record["inputs"]["files"] == 2 and record["inputs"]["bytes"] == sum(
        f.stat().st_size for f in src.iterdir())


def test_interrupted_rewrite_of_a_changed_source_keeps_no_shard_of_the_old_one(tmp_path, monkeypatch):
    docs = make_docs(70, seed=9)
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out"
    write_dataset(cfg_for(src, out))
    assert len(shard_files(out)) > 6
    edited = ["A" + docs[0][1:], *docs[1:]]  # the old shards after the first stay full-size and valid
    write_jsonl(src, edited)
    written = [p.name for p in write_killed(cfg_for(src, out), monkeypatch, after=2)]
    assert written == ["t_val_000000.bin", "t_train_000001.bin"]
    assert [p.name for p in shard_files(out)] == written  # the old run's train shards 2, 3, ... are gone
    assert write_dataset(cfg_for(src, out))["skipped_shards"] == 2
    assert np.array_equal(concat(out), expected_tokens(edited))


def test_input_edited_between_an_interrupted_run_and_its_rerun_is_written_anew(tmp_path, monkeypatch, capsys):
    # the resume compares only the last two documents the kept shards hold; an edit before them (here in the val
    # shard) must be caught by the input files' fingerprint, or the old val shard would stay beside new train shards
    docs = make_docs(70, seed=9)
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    write_killed(cfg_for(src, tmp_path / "out"), monkeypatch, after=3)
    edited = ["EDITED " + docs[0], *docs[1:]]
    write_jsonl(src, edited)
    capsys.readouterr()
    result = write_dataset(cfg_for(src, tmp_path / "out"))
    assert result["skipped_shards"] == 0
    assert "its shards were written from other input files or settings; writing them again" in capsys.readouterr().out
    assert np.array_equal(concat(tmp_path / "out"), expected_tokens(edited))


def test_changed_input_is_written_anew_even_when_a_shard_went_missing(tmp_path, reference):
    # the done record is stale once a shard is gone; it must still tell that the inputs changed, or the rerun
    # would keep the old shards before the missing one and a new done record would vouch for them
    src, _ = reference
    out = tmp_path / "out"
    write_dataset(cfg_for(src, out))
    docs = [json.loads(line)["text"] for line in src.read_text().splitlines()]
    edited = ["EDITED " + docs[0], *docs[1:]]  # in the val shard
    write_jsonl(src, edited)
    shard_files(out)[-1].unlink()
    assert write_dataset(cfg_for(src, out))["skipped_shards"] == 0
    assert np.array_equal(concat(out), expected_tokens(edited))


def test_a_rewrite_killed_in_its_first_shard_leaves_no_shard_of_the_old_input(tmp_path, reference, monkeypatch):
    # a finished run, its input edited, and the rewrite killed while it writes shard 0: the old shard 0 must not
    # survive beside no record, where the rerun's resume would take it for its own
    src, _ = reference
    out = tmp_path / "out"
    write_dataset(cfg_for(src, out))
    docs = [json.loads(line)["text"] for line in src.read_text().splitlines()]
    edited = ["EDITED " + docs[0], *docs[1:]]
    write_jsonl(src, edited)

    def killed(path, tokens):
        raise KeyboardInterrupt  # mid-write: the temporary file is all it made

    monkeypatch.setattr(fineweb, "write_shard", killed)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(cfg_for(src, out))
    assert shard_files(out) == []
    monkeypatch.undo()
    assert write_dataset(cfg_for(src, out))["skipped_shards"] == 0
    assert np.array_equal(concat(out), expected_tokens(edited))


def test_a_second_writer_into_the_same_place_stops_with_a_line(tmp_path, reference, monkeypatch):
    # two writers into one --out-dir would delete each other's files mid-write; the second stops at its first write
    src, ref = reference
    out = tmp_path / "out"
    first = fineweb._lock_out_dir(cfg_for(src, out))  # as another process's run, between its first write and its end
    try:
        with pytest.raises(DataError, match=f"another fineweb.py is writing t shards to {out}; let it finish"):
            write_dataset(cfg_for(src, out))
        assert shard_files(out) == []
        write_dataset(cfg_for(src, tmp_path / "other"))  # another place is free
    finally:
        first.close()
    write_dataset(cfg_for(src, out))  # and this one once the other run has ended
    assert {p.name: p.read_bytes() for p in shard_files(out)} == ref


def test_a_filesystem_without_locks_gets_a_warning_not_an_error(tmp_path, reference, monkeypatch, capsys):
    import errno
    import fcntl

    failure = [errno.ENOSYS, "Function not implemented"]  # Lustre mounted without -o flock

    def no_flock(f, how):
        raise OSError(*failure)

    src, _ = reference
    monkeypatch.setattr(fcntl, "flock", no_flock)  # (datasets' own file locks would wait on it: the lock alone here)
    with fineweb._lock_out_dir(cfg_for(src, tmp_path / "out")) as held:
        assert not held.closed  # the run goes on, unlocked
    assert "cannot be locked (Function not implemented)" in capsys.readouterr().err
    failure[:] = [errno.EIO, "I/O error"]
    with pytest.raises(OSError, match="I/O error"):  # any other failure is not taken for a missing feature
        fineweb._lock_out_dir(cfg_for(src, tmp_path / "out"))


def test_another_corpus_in_the_same_directory_is_pointed_out(tmp_path, reference, capsys):
    src, _ = reference
    write_dataset(cfg_for(src, tmp_path))
    assert "also holds" not in capsys.readouterr().out
    write_dataset(cfg_for(src, tmp_path, prefix="u"))  # the loader would read t_ and u_ shards together
    assert (f"note: {tmp_path} also holds 9 train shard(s) of another corpus (t_train_000001.bin, ...), and train.py "
            f"--data {tmp_path} would read them too: give each corpus its own --out-dir") in capsys.readouterr().out


@pytest.mark.parametrize("inside", ["", "tok"])
def test_out_dir_inside_a_source_directory_is_not_read_as_input(tmp_path, inside):
    # `--source data/corpus` writes to data/corpus by default: its records there must not become input on a rerun
    src = tmp_path / "corpus"
    src.mkdir()
    docs = make_docs(40)
    write_jsonl(src / "a.jsonl", docs)
    out = src / inside
    first = write_dataset(cfg_for(src, out))
    again = write_dataset(cfg_for(src, out))
    assert again["tokenized"] == 0 and again["shards"] == first["shards"]  # nothing to do: the same inputs
    assert np.array_equal(concat(out), expected_tokens(docs))


def test_failed_rerun_leaves_a_finished_directory_as_it_was(tmp_path, reference):
    src, ref = reference
    out = tmp_path / "out"
    write_dataset(cfg_for(src, out))
    (out / ".t_train_000009.bin.1.tmp").write_bytes(b"a killed run's")  # only a run that writes removes it
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"t_done.json", ".t.lock"} <= set(before) and len(before) == len(ref) + 3
    with pytest.raises(SystemExit, match="^error: --text-field 'body' is not in --source"):
        main(["--source", str(src), "--out-dir", str(out), "--prefix", "t", "--shard-size", "1000", "--val-tokens",
              "700", "--workers", "1", "--text-field", "body"])  # a wrong flag: fails while reading the source
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    again = write_dataset(cfg_for(src, out))  # the finished run is still recognized
    assert again["skipped_shards"] == len(ref) and again["tokenized"] == 0


def test_resume_where_documents_are_longer_than_a_shard(tmp_path, monkeypatch):
    """Shards of 60 tokens and documents of up to ~200: a kept shard may begin one document or none, so the tokens
    the resume checks (from the second-to-last document start on) span several shards. A kill after every shard."""
    docs = make_docs(8, seed=11)
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    settings = {"shard_size": 60, "val_tokens": 50}
    write_dataset(cfg_for(src, tmp_path / "ref", **settings))
    ref = {p.name: p.read_bytes() for p in shard_files(tmp_path / "ref")}
    starts = [int((read_shard(tmp_path / "ref" / name) == EOT).sum()) for name in ref]
    assert {0, 1} <= set(starts[1:-1])  # both kinds of shard, not only shards that begin two documents or more
    for kill_after in range(2, len(ref)):
        out = tmp_path / f"out{kill_after}"
        write_killed(cfg_for(src, out, **settings), monkeypatch, after=kill_after)
        result = write_dataset(cfg_for(src, out, **settings))
        assert result["skipped_shards"] == kill_after, kill_after
        assert {p.name: p.read_bytes() for p in shard_files(out)} == ref, kill_after


@pytest.mark.parametrize("change", [{"shard_size": 500}, {"max_tokens": 2500}, {"txt_unit": "paragraph"},
                                    {"max_tokens": 1700}])
def test_a_finished_run_is_written_again_when_a_setting_changes(tmp_path, change):
    """The completion record holds every setting that shapes the shards: a rerun with another one must write what a
    fresh run with it writes, not take the finished run for its own and keep the old shards."""
    docs = make_docs(40, seed=6)
    src = tmp_path / "a.txt"
    src.write_text("\n\n".join(docs))  # paragraphs; one document by default (--txt-unit document)
    out = tmp_path / "out"
    write_dataset(cfg_for(src, out))
    before = {p.name: p.read_bytes() for p in shard_files(out)}
    again = write_dataset(cfg_for(src, out, **change))
    fresh = write_dataset(cfg_for(src, tmp_path / "fresh", **change))
    after = {p.name: p.read_bytes() for p in shard_files(out)}
    assert after == {p.name: p.read_bytes() for p in shard_files(tmp_path / "fresh")} != before
    assert again["tokenized"] == fresh["tokenized"] > 0


def test_shards_without_a_record_are_written_again(tmp_path, reference):
    """Shards whose record is gone (or an older writer's interrupted run's): nothing vouches for what they were made
    from, so a rerun writes every shard again, whether they hold this source (same bytes) or other data (replaced, not
    mixed with the new)."""
    src, ref = reference
    out = tmp_path / "out"
    out.mkdir()
    for name in list(ref)[:3]:  # val and the first two train shards
        (out / name).write_bytes(ref[name])
    result = write_dataset(cfg_for(src, out))
    assert result["skipped_shards"] == 0 and {p.name: p.read_bytes() for p in shard_files(out)} == ref
    (out / "t_done.json").unlink()
    other = write_jsonl(tmp_path / "other.jsonl", make_docs(70, seed=10))
    assert write_dataset(cfg_for(other, out))["skipped_shards"] == 0
    assert np.array_equal(concat(out), expected_tokens(make_docs(70, seed=10)))


# ----------------------------------------------------------------------------------------------------------------------
# shard writer (ShardWriter on its own: buffer, resume points, lock, record)


def doc_tokens(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    """One uint16 array per document: EOT, then length - 1 tokens that are never EOT."""
    rng = np.random.default_rng(seed)
    return [np.array([EOT, *rng.integers(0, EOT, n - 1)], dtype=np.uint16) for n in lengths]


def chunks(docs: list[np.ndarray], first_row: int = 0) -> list[tuple[np.ndarray, list[tuple[int, ...]]]]:
    """token_stream's items for one document a chunk: its tokens, and its position (part 0 of 1, row = its index)."""
    return [(d, [(0, first_row + i, first_row + i, 1)]) for i, d in enumerate(docs)]


def shard_writer(cfg: FinewebConfig, record: dict | None = None, kept: int = 0,
                 point: tuple = fineweb.START) -> fineweb.ShardWriter:
    return fineweb.ShardWriter(cfg, fineweb.record_key(cfg, None), record, kept, point)  # closed by its `with`


def test_shard_writer_cuts_a_stream_into_a_val_shard_then_train_shards(tmp_path):
    out, cfg = tmp_path / "out", cfg_for(tmp_path / "src.jsonl", tmp_path / "out")  # val 700, shards of 1000
    docs = doc_tokens([300] * 10)
    with shard_writer(cfg) as writer:
        writer.write_all(chunks(docs[:9]))  # 2700 tokens: val and train 1 full, 1000 buffered
        assert [p.name for p in shard_files(out)] == ["t_val_000000.bin", "t_train_000001.bin"]
        record = json.loads((out / "t_done.json").read_text())  # saved with each full shard
        assert record["shards"] == {"t_val_000000.bin": 700, "t_train_000001.bin": 1000} and not record["done"]
        writer.write_all(chunks(docs[9:], first_row=9))
        writer.finish()
        with pytest.raises(DataError, match="another fineweb.py is writing t shards"):
            fineweb._lock_out_dir(cfg)  # held to the end of the `with`
    fineweb._lock_out_dir(cfg).close()  # and free after it
    assert [len(read_shard(p)) for p in shard_files(out)] == [700, 1000, 1000, 300]
    assert np.array_equal(concat(out), np.concatenate(docs))
    assert (writer.index, writer.total, writer.docs, writer.val) == (4, 3000, 10, 700)
    record = json.loads((out / "t_done.json").read_text())
    assert record["done"] and record["inputs"] is None and record["settings"]["shard_size"] == 1000
    assert record["shards"] == {"t_val_000000.bin": 700, "t_train_000001.bin": 1000, "t_train_000002.bin": 1000,
                                "t_train_000003.bin": 300}
    # after each shard: the row of the document its last token is in, and that document's tokens written so far
    assert record["resume"] == {"t_val_000000.bin": [0, 2, 2, 1, 100], "t_train_000001.bin": [0, 5, 5, 1, 200],
                                "t_train_000002.bin": [0, 8, 8, 1, 300], "t_train_000003.bin": [0, 9, 9, 1, 300]}
    result = writer.report(2.0, 3)
    assert {k: result[k] for k in ("shards", "skipped_shards", "val_tokens", "train_tokens", "tokenized",
                                   "documents_tokenized", "tokens_per_sec", "workers")} == {
        "shards": 4, "skipped_shards": 0, "val_tokens": 700, "train_tokens": 2300, "tokenized": 3000,
        "documents_tokenized": 10, "tokens_per_sec": 1500.0, "workers": 3}


def test_shard_writer_writes_a_full_buffer_only_when_more_tokens_come(tmp_path):
    out, cfg = tmp_path / "out", cfg_for(tmp_path / "src.jsonl", tmp_path / "out")
    with shard_writer(cfg) as writer:
        writer.write_all(chunks(doc_tokens([700, 1000])))  # val and train 1 exactly full
        assert [p.name for p in shard_files(out)] == ["t_val_000000.bin"]
        assert (writer.index, writer.fill) == (1, 1000)
        writer.finish()
    assert [len(read_shard(p)) for p in shard_files(out)] == [700, 1000]


def test_shard_writer_stops_reading_at_max_tokens(tmp_path):
    out, cfg = tmp_path / "out", cfg_for(tmp_path / "src.jsonl", tmp_path / "out", max_tokens=1500)
    pulled = []

    def stream():
        for item in chunks(doc_tokens([400] * 10)):
            pulled.append(len(item[0]))
            yield item

    with shard_writer(cfg) as writer:
        writer.write_all(stream())
        writer.finish()
    assert len(pulled) == 4  # 1600 tokens read, and no further
    assert [len(read_shard(p)) for p in shard_files(out)] == [700, 800]
    assert (writer.total, writer.docs) == (1500, 4)


def test_shard_writer_gives_a_short_stream_its_first_10_percent_as_val(tmp_path):
    out = tmp_path / "out"
    cfg = cfg_for(tmp_path / "src.jsonl", out, val_tokens=-1)  # a local source: a full val shard is 1000 tokens
    docs = doc_tokens([200, 195])
    with shard_writer(cfg) as writer:
        writer.write_all(chunks(docs))
        assert shard_files(out) == []  # nothing written before the stream ends
        writer.finish()
    assert [len(read_shard(p)) for p in shard_files(out)] == [39, 356]  # 395 // 10 val, the rest train shard 1
    assert np.array_equal(concat(out), np.concatenate(docs))
    record = json.loads((out / "t_done.json").read_text())
    assert record["shards"] == {"t_val_000000.bin": 39, "t_train_000001.bin": 356}
    assert record["resume"]["t_val_000000.bin"] is None  # a rerun never resumes after a val shard that is not full
    assert (writer.val, writer.report(1.0, 1)["train_tokens"]) == (39, 356)
    asked = cfg_for(tmp_path / "src.jsonl", tmp_path / "asked")  # --val-tokens 700 asked for, 395 there
    message = r"has only 395 tokens, all of them for the val shard \(--val-tokens 700\).*e.g. --val-tokens 39"
    with shard_writer(asked) as writer, pytest.raises(DataError, match=message):
        writer.write_all(chunks(docs))
        writer.finish()
    assert not (tmp_path / "asked").exists()  # refused before anything was written
    with shard_writer(asked) as writer, pytest.raises(DataError, match="has no text"):
        writer.finish()


def test_shard_writer_goes_on_after_kept_shards_and_clears_a_longer_run(tmp_path):
    out, cfg = tmp_path / "out", cfg_for(tmp_path / "src.jsonl", tmp_path / "out")
    out.mkdir()
    for i, n in ((0, 700), (1, 1000), (5, 1000)):  # shard 5: left by an earlier, longer run
        write_shard(fineweb.shard_path(cfg, i), np.full(n, 7))
    (out / ".t_train_000002.bin.99.tmp").write_bytes(b"x")  # a killed run's temporary
    record = {"shards": {"t_val_000000.bin": 700, "t_train_000001.bin": 1000, "t_train_000005.bin": 1000},
              "resume": {"t_val_000000.bin": [0, 2, 2, 1, 5], "t_train_000001.bin": [0, 7, 7, 1, 3]}}
    # row 7's document has 3 tokens on disk: the stream goes on with it, whole, then 3 documents a chunk
    first = (np.array([EOT, 9, 9, 1, 2, 3, EOT, 4, EOT, 5, 6, EOT, 7], np.uint16), [(0, r, r, 1) for r in range(7, 11)])
    tail = np.array([EOT, 4, EOT, 5, 6, EOT, 7, 8, 8, 8], dtype=np.uint16)
    rest = [(tail, [(0, r, r, 1) for r in range(11 + 3 * k, 14 + 3 * k)]) for k in range(59)]
    with shard_writer(cfg, record, kept=2, point=(0, 7, 7, 1, 3)) as writer:
        writer.write_all([first, *rest])  # 10 + 590 tokens after the 3 dropped
        writer.finish()
    assert [p.name for p in shard_files(out)] == ["t_val_000000.bin", "t_train_000001.bin", "t_train_000002.bin"]
    assert read_shard(out / "t_train_000002.bin")[:10].tolist() == [1, 2, 3, EOT, 4, EOT, 5, 6, EOT, 7]
    assert len(read_shard(out / "t_train_000002.bin")) == 600
    assert not list(out.glob(".*.tmp"))
    assert (writer.index, writer.total, writer.docs) == (3, 2300, 1 + 3 * 60)
    saved = json.loads((out / "t_done.json").read_text())
    assert saved["shards"] == {"t_val_000000.bin": 700, "t_train_000001.bin": 1000, "t_train_000002.bin": 600}
    assert saved["resume"] == {**record["resume"], "t_train_000002.bin": [0, 11 + 3 * 58 + 2, 11 + 3 * 58 + 2, 1, 5]}
    result = writer.report(1.0, 1)
    assert [result[k] for k in ("shards", "skipped_shards", "tokenized", "train_tokens")] == [3, 2, 600, 1600]


# ----------------------------------------------------------------------------------------------------------------------
# loader

LENGTHS = [1000, 1537, 777, 2001, 70]  # windows of 33 tokens at stride 32: 31 + 48 + 24 + 62 + 2 = 167, a prime
B, T = 2, 16


def epoch_windows(seed: int, epoch: int, lengths: list[int] = LENGTHS, shuffle: str = "windows",
                  b: int = B) -> list[int]:
    """First tokens of one train epoch's windows of b*T+1 tokens in serving order: shards permuted, and each shard's
    windows permuted (shuffle="windows") or in order ("shards")."""
    order = np.random.default_rng((seed, epoch)).permutation(len(lengths))

    def within(s: int) -> list[int]:
        n = (lengths[s] - 1) // (b * T)
        return np.random.default_rng((seed, epoch, s + 1)).permutation(n).tolist() if shuffle == "windows" \
            else list(range(n))

    return [s * 5000 + b * T * j for s in order for j in within(s)]


@pytest.mark.parametrize("shuffle", ["windows", "shards"])
@pytest.mark.parametrize(("world", "straddles"), [(1, 0), (2, 2), (3, 3)])
def test_every_window_is_served_exactly_once_per_epoch_over_ranks(tmp_path, world, straddles, shuffle):
    data = numbered_shards(tmp_path, LENGTHS)
    loaders = [TokenLoader(str(data), "train", B, T, r, world, seed=7, shuffle=shuffle) for r in range(world)]
    assert loaders[0].num_windows == 167
    steps = -(-4 * 167 // world)  # lockstep steps until four whole epochs are served over all ranks
    served: dict[int, list[int]] = {}  # epoch -> first token of each window served in it, in global order
    mixed = 0  # steps whose ranks are not all in the same epoch
    for step in range(steps):
        epochs = [ld.epoch for ld in loaders]
        mixed += len(set(epochs)) > 1
        for ld, epoch in zip(loaders, epochs, strict=True):
            assert ld.step == step
            x, y = ld.next_batch()
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, T)
            assert torch.equal(x.flatten(), x[0, 0] + torch.arange(B * T))  # one window of consecutive tokens
            assert torch.equal(y.flatten(), x.flatten() + 1)  # y is x shifted by one token
            served.setdefault(epoch, []).append(int(x[0, 0]))
    for epoch in range(4):  # every window once, in the epoch's order: no overlap, no gap, nothing dropped
        assert served[epoch] == epoch_windows(7, epoch, shuffle=shuffle), epoch
        assert sorted(served[epoch]) == sorted(epoch_windows(7, 0, shuffle="shards"))
    assert served.get(4, []) == epoch_windows(7, 4, shuffle=shuffle)[:steps * world - 4 * 167]  # the fifth has begun
    # a step straddles epochs wherever world does not divide the boundary g = 167 e: e = 1, 3 for 2 ranks; 1, 2, 4 for 3
    assert mixed == straddles


def test_shuffle_is_reproducible_per_seed_and_new_each_epoch(tmp_path):
    data = numbered_shards(tmp_path, LENGTHS)
    shard_seq = lambda seed, n: [int(x[0, 0]) // 5000 for x, _ in batches(TokenLoader(str(data), "train", B, T,
                                                                                       seed=seed), n)]
    a, b, c = shard_seq(0, 334), shard_seq(0, 334), shard_seq(1, 334)  # two epochs each
    assert a == b
    assert a != c
    runs = lambda seq: [s for i, s in enumerate(seq) if i == 0 or seq[i - 1] != s]
    assert runs(a[:167]) == np.random.default_rng((0, 0)).permutation(5).tolist() == [2, 4, 3, 0, 1]
    assert runs(a[167:]) == np.random.default_rng((0, 1)).permutation(5).tolist() != runs(a[:167])
    assert runs(c[:167]) == np.random.default_rng((1, 0)).permutation(5).tolist() != runs(a[:167])


def test_windows_of_one_shard_come_in_a_new_order_every_epoch(tmp_path):
    # the case the window shuffle is for: a small corpus in one train shard, read for many epochs. Its 31 windows
    # (of 33 tokens at stride 32) come in a new order every epoch, each once; with shuffle="shards" (one shard to
    # shuffle) they came in the same order every time
    data = numbered_shards(tmp_path, [1000])
    firsts = lambda loader: [int(x[0, 0]) for x, _ in batches(loader, 3 * 31)]
    served = firsts(TokenLoader(str(data), "train", B, T, seed=5))
    epochs = [served[e * 31:(e + 1) * 31] for e in range(3)]
    assert all(sorted(e) == list(range(0, 31 * 32, 32)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != sorted(epochs[0])
    assert epochs[1] == [32 * j for j in np.random.default_rng((5, 1, 1)).permutation(31)]
    assert served == firsts(TokenLoader(str(data), "train", B, T, seed=5))  # reproducible from the seed
    assert firsts(TokenLoader(str(data), "train", B, T, seed=5, shuffle="shards")) == list(range(0, 31 * 32, 32)) * 3
    with pytest.raises(ValueError, match="shuffle must be 'windows' or 'shards', got 'rows'"):
        TokenLoader(str(data), "train", B, T, shuffle="rows")


def test_val_is_in_file_order_and_identical_after_reset(tmp_path):
    data = numbered_shards(tmp_path, [500, 333], split="val")
    val = [TokenLoader(str(data), "val", B, T, rank=r, world_size=2, seed=123) for r in (0, 1)]
    assert val[1].num_windows == 15 + 10
    first = batches(val[1], 12)  # num_windows // world_size: the val batches train.py evaluates
    assert [int(x[0, 0]) for x, _ in first] == [32 * (2 * i + 1) for i in range(7)] + \
        [5000 + 32 * (2 * i) for i in range(5)]  # rank 1 takes windows 1, 3, 5, ... in shard order
    assert int(batches(val[0], 13)[-1][0][0, 0]) == 5000 + 32 * 9  # rank 0's 13th: window 24, the epoch's last
    assert int(val[1].next_batch()[0][0, 0]) == 0 and val[1].epoch == 1  # then epoch 1, in the same order
    val[1].reset()
    assert val[1].step == 0 and val[1].epoch == 0
    again = batches(val[1], 12)
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(first, again, strict=True))


def test_val_ignores_the_seed_and_reads_its_shards_in_file_order_every_epoch(tmp_path):
    """Five val shards (seed 0 would shuffle train shards to 2, 4, 3, 0, 1): val is the same fixed stream for every
    seed and epoch, so val losses of runs with different seeds compare."""
    data = numbered_shards(tmp_path, LENGTHS, split="val")
    file_order = [s * 5000 + B * T * j for s in range(5) for j in range((LENGTHS[s] - 1) // (B * T))]
    for seed in (0, 1, 7):
        loader = TokenLoader(str(data), "val", B, T, seed=seed)
        assert [int(x[0, 0]) for x, _ in batches(loader, 2 * 167)] == file_order * 2, seed


@pytest.mark.parametrize(("world", "split_at", "epochs"), [
    (1, 167, [1]),  # exactly at an epoch boundary
    (3, 5, [0, 0, 0]),  # mid-epoch
    (3, 55, [0, 0, 1]),  # the step that straddles the boundary: ranks 0, 1 end epoch 0, rank 2 starts epoch 1
    (3, 56, [1, 1, 1]),  # just past it
    (3, 150, [2, 2, 2]),  # in a later epoch
])
def test_resume_gives_the_batches_an_uninterrupted_run_would(tmp_path, world, split_at, epochs):
    data = numbered_shards(tmp_path, LENGTHS)
    for rank in range(world):
        straight = batches(TokenLoader(str(data), "train", B, T, rank, world, seed=3), 250)
        first = TokenLoader(str(data), "train", B, T, rank, world, seed=3)
        batches(first, split_at)
        buf = io.BytesIO()
        torch.save({"loader": first.state_dict()}, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)["loader"]
        assert state["step"] == split_at and "epoch" not in state
        resumed = TokenLoader(str(data), "train", B, T, rank, world, seed=3)
        resumed.load_state_dict(state)
        assert (resumed.step, resumed.epoch) == (split_at, epochs[rank])
        rest = batches(resumed, 250 - split_at)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(straight[split_at:], rest, strict=True))


def test_resume_state_that_does_not_match_is_refused(tmp_path):
    data = numbered_shards(tmp_path, LENGTHS)
    state = TokenLoader(str(data), "train", B, T, 0, 2, seed=3).state_dict()
    with pytest.raises(DataError, match=r"T=16 in the checkpoint but 8 here; resume with the same --seq-len"):
        TokenLoader(str(data), "train", B, 8, 0, 2, seed=3).load_state_dict(state)
    with pytest.raises(DataError, match="seed=3 in the checkpoint but 4 here"):
        TokenLoader(str(data), "train", B, T, 0, 2, seed=4).load_state_dict(state)
    (tmp_path / "n_train_000004.bin").unlink()
    with pytest.raises(DataError, match=r"cannot resume the train loader: other shard files \(5 in the checkpoint, 4 "
                                        r"here; n_train_000004.bin is in one only\); resume with the same shard files "
                                        "or start a fresh run"):
        TokenLoader(str(data), "train", B, T, 0, 2, seed=3).load_state_dict(state)
    (tmp_path / "n_train_000003.bin").rename(tmp_path / "m_train_000003.bin")  # as many files, another name
    with pytest.raises(DataError, match=r"other shard files \(4 in the checkpoint, 4 here; m_train_000003.bin is in "
                                        r"one only\)"):
        TokenLoader(str(data), "train", B, T, 0, 2, seed=3).load_state_dict({**state, "shards": state["shards"][:4]})
    numbered_shards(tmp_path / "again", LENGTHS)  # the same names, one rewritten after the checkpoint
    rewritten = TokenLoader(str(tmp_path / "again"), "train", B, T, 0, 2, seed=3)
    write_shard(tmp_path / "again" / "n_train_000004.bin", np.arange(500))
    with pytest.raises(DataError, match=r"cannot resume the train loader: shards of other sizes \(the same names, "
                                        r"rewritten since\); resume with the same shard sizes"):
        TokenLoader(str(tmp_path / "again"), "train", B, T, 0, 2, seed=3).load_state_dict(rewritten.state_dict())


def other_datasets(tmp_path: Path) -> tuple[Path, Path]:
    """Two datasets the writer made from other documents under the same settings: shards of the same names and sizes
    (two sources given one --prefix and --max-tokens): 7 train shards of 1000 tokens after a 1000-token val shard."""
    for seed in (0, 1):
        write_dataset(cfg_for(write_jsonl(tmp_path / f"docs{seed}.jsonl", make_docs(100, seed)), tmp_path / f"d{seed}",
                              val_tokens=-1, max_tokens=8000))
    return tmp_path / "d0", tmp_path / "d1"


def test_resume_on_other_shards_of_the_same_names_and_sizes_is_refused(tmp_path):
    """A checkpoint's position means the tokens it was read in: the shards' ends are compared as well as their names
    and sizes. A state saved before that comparison (no shard_crc32) resumes unchecked."""
    first, other = other_datasets(tmp_path)
    loader = TokenLoader(str(first), "train", B, T, 0, 2, seed=3)
    batches(loader, 5)
    state = loader.state_dict()
    assert [p.name for p in find_shards(str(other), "train")] == state["shards"] == \
        [f"t_train_{i:06d}.bin" for i in range(1, 8)] and state["shard_tokens"] == [1000] * 7
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    for f in find_shards(str(first), "train"):  # the same tokens in another directory: they resume
        (elsewhere / f.name).write_bytes(f.read_bytes())
    again = TokenLoader(str(elsewhere), "train", B, T, 1, 2, seed=3)
    again.load_state_dict(state)
    assert again.step == 5
    resumed = TokenLoader(str(other), "train", B, T, 0, 2, seed=3)
    with pytest.raises(DataError) as e:
        resumed.load_state_dict(state)
    assert str(e.value) == (
        "cannot resume the train loader: t_train_000001.bin holds other tokens than the checkpoint's under the same "
        "name and size; resume with the checkpoint's --data or start a fresh run")
    old = {k: v for k, v in state.items() if k != "shard_crc32"}  # a checkpoint from before the comparison
    resumed.load_state_dict(old)
    assert resumed.step == 5


def test_a_shards_crc_covers_its_first_and_last_ends_tokens_only(tmp_path):
    # the resume tests' shards are shorter than ENDS, so either read alone covered them whole (a CRC of one end passed)
    tokens = np.arange(3 * fineweb.ENDS, dtype=np.uint16)
    crcs = []
    for at in (None, 0, fineweb.ENDS - 1, fineweb.ENDS, 2 * fineweb.ENDS - 1, 2 * fineweb.ENDS, len(tokens) - 1):
        changed = tokens.copy()
        if at is not None:
            changed[at] = 7
        write_shard(tmp_path / "s.bin", changed)
        crcs.append(fineweb.shard_crc(tmp_path / "s.bin", len(changed)))
    unchanged = crcs[0]
    assert unchanged == zlib.crc32(np.concatenate([tokens[:4096], tokens[-4096:]]).tobytes())
    assert [crc != unchanged for crc in crcs[1:]] == [True, True, False, False, True, True]  # the middle is not read


def test_a_run_resumed_with_data_pointing_at_other_shards_of_the_same_names_and_sizes_stops(tmp_path, capsys):
    import train
    from conftest import one_line_error

    first, other = other_datasets(tmp_path)
    run = ["--preset=tiny", "--eval-every=0", "--out-dir", str(tmp_path / "run")]
    train.main([*run, "--data", str(first), "--max-steps=2"])
    assert one_line_error(capsys, train.main, [*run, "--data", str(other), "--max-steps=4", "--resume=auto"]) == (
        "error: cannot resume the train loader: t_train_000001.bin holds other tokens than the checkpoint's under the "
        "same name and size; resume with the checkpoint's --data or start a fresh run")


@pytest.mark.parametrize(("old_world", "new_world", "split_at", "skipped"), [
    (3, 2, 40, 0),  # 120 windows served, a multiple of 2: the new ranks start at window 120
    (2, 3, 41, 2),  # 82 served: the new ranks start at 84 (the first multiple of 3), so windows 82, 83 are skipped
    (4, 1, 50, 0),  # 200 served: past the end of epoch 0 (167 windows), so into epoch 1
])
def test_resume_on_another_world_size_goes_on_with_the_same_stream(tmp_path, old_world, new_world, split_at,
                                                                   skipped):
    # the stream of global windows depends on the shards, B, T and the seed, not on the ranks: after a resume on a
    # different number of ranks, those windows not yet served are served, minus fewer than one step's worth
    data = numbered_shards(tmp_path, LENGTHS)
    stream = epoch_windows(3, 0) + epoch_windows(3, 1) + epoch_windows(3, 2)
    old = [TokenLoader(str(data), "train", B, T, r, old_world, seed=3) for r in range(old_world)]
    served = [int(x[0, 0]) for _ in range(split_at) for loader in old for x, _ in [loader.next_batch()]]
    assert served == stream[:split_at * old_world]
    new = [TokenLoader(str(data), "train", B, T, r, new_world, seed=3) for r in range(new_world)]
    for loader in new:
        loader.load_state_dict(old[0].state_dict())
    start = split_at * old_world + skipped
    assert new[0].step * new_world == start
    after = [int(x[0, 0]) for _ in range(30) for loader in new for x, _ in [loader.next_batch()]]
    assert after == stream[start:start + 30 * new_world]


@pytest.mark.parametrize(("old_b", "new_b", "old_world", "new_world", "split_at"), [
    # epoch 0 reads shards 4, 2, 1, 3, 0, which hold 2, 24, 48, 62, 31 windows at B=2; 1, 16, 32, 41, 20 at B=3;
    # and 4, 48, 96, 125, 62 at B=1
    (2, 3, 2, 3, 40),  # larger windows on more ranks: 80 of 167 windows served, 110 per epoch on the new grid
    (2, 3, 1, 1, 40),  # 14 of shard 1's windows of 32 tokens served: its 10th of 48 tokens (448 = 14 * 32 / 48 up)
    (2, 3, 1, 1, 136),  # shard 3 read to its end (1984 tokens), past its last window of 48: on to shard 0
    (3, 1, 2, 1, 45),  # shard 3 read to its end at B=3 (1968 tokens): its 2 windows of 16 beyond are still served
    (2, 4, 1, 2, 150),  # 150 of 167 windows served; the new grid has 83 per epoch
    (4, 2, 3, 2, 60),  # 180 windows served of the 83 per epoch at B=4: the cut is in epoch 2
    (3, 2, 2, 1, 55),  # 110 served, exactly one epoch at B=3: the new ranks start epoch 1's first window
])
@pytest.mark.parametrize("shuffle", ["shards", "windows"])
def test_resume_with_another_batch_size_goes_on_where_the_old_windows_stopped(tmp_path, old_b, new_b, old_world,
                                                                              new_world, split_at, shuffle):
    # a run moved to a GPU with less memory resumes with a smaller --batch-size: the shards are cut into other
    # windows. With each shard's windows in order, the new ranks must start at the first new window after which no
    # window holds a token the old ranks served in that epoch (so none is served twice and as few as possible are
    # skipped); with them shuffled, the old windows served from the shard being read are scattered over it, and the
    # new ranks start at the next shard. Either is rounded up to a whole step of the new ranks
    data = numbered_shards(tmp_path, LENGTHS)
    old = [TokenLoader(str(data), "train", old_b, T, r, old_world, seed=3, shuffle=shuffle) for r in range(old_world)]
    served: dict[int, set[int]] = {}  # epoch -> the x tokens the old ranks served in it
    for _ in range(split_at):
        for loader in old:
            epoch = loader.epoch
            served.setdefault(epoch, set()).update(loader.next_batch()[0].flatten().tolist())
    cut = split_at * old_world // old[0].num_windows  # the epoch the next old window would be in
    new = [TokenLoader(str(data), "train", new_b, T, r, new_world, seed=3, shuffle=shuffle) for r in range(new_world)]
    for loader in new:
        loader.load_state_dict(old[0].state_dict())

    def windows(epoch: int) -> list[range]:  # the new grid's windows' x tokens, in serving order (brute force)
        return [range(first, first + new_b * T) for first in epoch_windows(3, epoch, shuffle=shuffle, b=new_b)]

    grid = windows(cut)
    if shuffle == "shards":
        first = next(k for k in range(len(grid) + 1)
                     if not any(served.get(cut, set()).intersection(w) for w in grid[k:]))
    else:  # the first new window of the shard after the last one the old ranks read from
        order = np.random.default_rng((3, cut)).permutation(len(LENGTHS)).tolist()
        read = max((order.index(t // 5000) for t in served.get(cut, set())), default=-1)
        first = sum((LENGTHS[s] - 1) // (new_b * T) for s in order[:read + 1])
        if read >= 0:  # the note's count: the old windows of the shard being read less the tokens served from it
            s = order[read]
            assert new[0].resume_skipped == (LENGTHS[s] - 1) // (old_b * T) * old_b * T - sum(
                t // 5000 == s for t in served[cut])
    start = -(-(cut * len(grid) + first) // new_world) * new_world
    assert new[0].step * new_world == start and new[0].num_windows == len(grid)
    stream = grid + windows(cut + 1)
    after = [int(x[0, 0]) for _ in range(20) for loader in new for x, _ in [loader.next_batch()]]
    assert after == [w.start for w in stream[start - cut * len(grid):][:20 * new_world]]
    if cut == split_at * old_world / old[0].num_windows:  # the old ranks stopped at an epoch's end: nothing skipped
        assert start == cut * len(grid)
    assert not served.get(cut, set()).intersection(t for w in stream[start - cut * len(grid):len(grid)] for t in w)


def test_resume_across_a_change_of_shuffle_goes_on_at_the_next_shard(tmp_path):
    # a checkpoint from before the windows were shuffled (its state has no "shuffle": they were read in order), or
    # one resumed with another --shuffle: the windows served from the shard being read cannot be told from those
    # not, in the new order, so the run goes on at the next shard's first window and serves none twice
    data = numbered_shards(tmp_path, LENGTHS)
    old = TokenLoader(str(data), "train", B, T, seed=3, shuffle="shards")
    served = {int(t) for x, _ in batches(old, 40) for t in x.flatten()}  # epoch 0 reads shards 4, 2, 1, 3, 0
    state = old.state_dict()
    del state["shuffle"]
    new = TokenLoader(str(data), "train", B, T, seed=3)
    new.load_state_dict(state)
    assert new.step == 2 + 24 + 48  # shards 4 and 2 whole, shard 1 begun: on at shard 3
    assert new.resume_skipped == (48 - 14) * B * T  # shard 1's windows the old loader had not served, in tokens
    assert new.resume_note(state) == ("the checkpoint read 2-sequence windows with --shuffle shards, this run reads "
                                      "2-sequence windows with --shuffle windows: the data goes on at the next shard, "
                                      "skipping this one's 1,088 unserved tokens, none served twice")
    rest = {int(t) for x, _ in batches(new, 62 + 31) for t in x.flatten()}
    assert not served & rest and {t // 5000 for t in rest} == {3, 0}
    new.load_state_dict({**state, "step": 0})  # a state from the start, loaded next: it skips nothing, whatever the
    assert (new.step, new.resume_skipped) == (0, 0)  # last load skipped
    # a cut between shards (4 and 2 read whole, shard 1 not begun) skips nothing: on at shard 1's first window
    state["step"] = 2 + 24
    new.load_state_dict(state)
    assert (new.step, new.resume_skipped) == (2 + 24, 0)
    assert new.resume_note(state).endswith("--shuffle windows: the data goes on, none served twice")  # no skip
    assert {t // 5000 for x, _ in batches(new, 48) for t in x.flatten().tolist()} == {1}


def test_resume_with_another_batch_size_counts_old_windows_of_b_t_plus_one_tokens_in_the_epochs_order(tmp_path):
    # shard 0's 1024 tokens hold 31 windows of 2 x 16 + 1 tokens, not 32 (the 32nd would need token 1024 as its last
    # target): counted as 32, the old loader's full epoch 0 would look one window short of its end, and the new one
    # would serve shard 0's tail again. Epoch 0 reads shards 1, 0 and epoch 1 reads 0, 1: a cut in epoch 1 must be
    # found in epoch 1's order. At B=1 the shards hold 63 and 62 windows of 16 + 1 tokens, 125 an epoch
    data = numbered_shards(tmp_path, [1024, 1000])
    old = TokenLoader(str(data), "train", 2, T, 0, 1, seed=3, shuffle="shards")
    assert old.num_windows == 62
    for served, step, first in ((62, 125, 0),  # all of epoch 0: epoch 1 from its first window, shard 0's token 0
                                # epoch 1: shard 0 whole, then shard 1's 9 windows, to its x token 287: window 18 of
                                # 16 tokens is the first not served, after epoch 0's 125 and shard 0's 63
                                (62 + 40, 125 + 63 + 18, 5000 + 18 * 16)):
        old.step = served
        new = TokenLoader(str(data), "train", 1, T, 0, 1, seed=3, shuffle="shards")
        new.load_state_dict(old.state_dict())
        assert new.num_windows == 125 and new.step == step
        assert int(new.next_batch()[0][0, 0]) == first


def test_ids_beyond_the_vocabulary_are_a_data_error_that_names_the_shard(tmp_path):
    data = numbered_shards(tmp_path, LENGTHS)  # ids up to 4 * 5000 + 69 = 20069, all in shard 4
    stream = epoch_windows(3, 0) + epoch_windows(3, 1) + epoch_windows(3, 2)
    for preload in (False, True):
        loader = TokenLoader(str(data), "train", B, T, 0, 1, seed=3, preload=preload)
        loader.check_vocab(50304)
        batches(loader, 200)  # more than an epoch: every id is below 50304
        if preload:  # the whole split is checked at once: its largest id
            # GPT-2 ids in a model smaller than GPT-2's vocabulary: the flag is the mistake, not the shard
            with pytest.raises(DataError, match=r"n_train_000004.bin holds token id 20069, but the model has only "
                                                r"20000 embedding rows: --vocab-size 20000 is below GPT-2's 50,257 "
                                                r"tokens, which the shards use; leave --vocab-size out \(50304\) or "
                                                r"pass at least 50257$"):
                loader.check_vocab(20000)
        else:  # each batch as it is read: the first window of shard 4 after step 200 ends with id 20000 + 32
            loader.check_vocab(20000)
            with pytest.raises(DataError, match=r"n_train_000004.bin holds token id 20032, but the model has only "
                                                r"20000 embedding rows"):
                batches(loader, 200)
            bad = next(g for g in range(200, len(stream)) if stream[g] // 5000 == 4)
            assert loader.step == bad + 1


def test_an_id_equal_to_the_vocab_size_is_out_of_range_and_named_in_its_shard(tmp_path):
    """Ids must be below vocab_size: the id vocab_size itself is the first that has no embedding row. It is the first
    token of shard 1 here, where the preloaded split's shard offsets meet, so the error must name shard 1."""
    write_shard(tmp_path / "v_train_000000.bin", np.arange(200) % 50)
    write_shard(tmp_path / "v_train_000001.bin", np.r_[1000, np.arange(199) % 50])
    for preload in (False, True):
        fits = TokenLoader(str(tmp_path), "train", B, T, preload=preload)
        fits.check_vocab(1001)
        batches(fits, 2 * fits.num_windows)  # two epochs: every window, the id 1000 among them
        loader = TokenLoader(str(tmp_path), "train", B, T, preload=preload)
        with pytest.raises(DataError, match=r"v_train_000001.bin holds token id 1000, but the model has only 1000 "
                                            r"embedding rows"):
            loader.check_vocab(1000)
            batches(loader, loader.num_windows)
    write_shard(tmp_path / "v_train_000001.bin", np.r_[60000, np.arange(199) % 50])  # no GPT-2 id: the shard's
    with pytest.raises(DataError, match=r"v_train_000001.bin holds token id 60000, but the model has only 50304 "
                                        r"embedding rows: the shard was written with another tokenizer, or is corrupt"):
        TokenLoader(str(tmp_path), "train", B, T, preload=True).check_vocab(50304)


def test_preload_serves_exactly_the_same_batches(tmp_path):
    data = numbered_shards(tmp_path, LENGTHS)
    for rank in (0, 1):
        lazy = TokenLoader(str(data), "train", B, T, rank, 2, seed=5)
        pre = TokenLoader(str(data), "train", B, T, rank, 2, seed=5, preload=True)
        assert pre._preloaded is not None and pre._preloaded.numel() == sum(LENGTHS)
        for (x1, y1), (x2, y2) in zip(batches(lazy, 250), batches(pre, 250), strict=True):  # three epochs
            assert torch.equal(x1, x2) and torch.equal(y1, y2) and x2.dtype == torch.int64
            x2.add_(1)  # a caller's in-place edit must not reach the preloaded data (checked by the next epochs)
        pre.load_state_dict(lazy.state_dict())
        assert torch.equal(pre.next_batch()[0], lazy.next_batch()[0])


def test_loader_reads_what_the_writer_wrote(tmp_path):
    docs = make_docs(60)
    write_dataset(cfg_for(write_jsonl(tmp_path / "docs.jsonl", docs), tmp_path / "out"))
    want = expected_tokens(docs)
    val = TokenLoader(str(tmp_path / "out"), "val", 3, 16)
    x, y = val.next_batch()
    assert x.flatten().tolist() == want[:48].tolist() and y.flatten().tolist() == want[1:49].tolist()
    train = TokenLoader(str(tmp_path / "out" / "t_train_*.bin"), "train", 3, 16)
    assert train.num_windows == sum((len(read_shard(f)) - 1) // 48 for f in train.files)


# ----------------------------------------------------------------------------------------------------------------------
# bad input: one clear error naming the file or flag, nothing written


def test_missing_directory_and_pattern_without_shards(tmp_path):
    with pytest.raises(DataError, match=r"data directory .*nope does not exist; write shards there with `python "
                                        r"fineweb.py --out-dir .*nope` \(fineweb-edu; --source picks another"):
        TokenLoader(str(tmp_path / "nope"), "train", 2, 8)
    # the demo and tiny presets' data/stdlib: the hint names the corpus, not fineweb.py's default (fineweb-edu)
    with pytest.raises(DataError, match=r"write shards there with `python fineweb.py --source stdlib --out-dir "
                                        r".*stdlib` or point"):
        TokenLoader(str(tmp_path / "data" / "stdlib"), "train", 2, 8)
    with pytest.raises(DataError, match=r"`python fineweb.py --source stdlib-docs --out-dir .*stdlib_docs` or point"):
        TokenLoader(str(tmp_path / "data" / "stdlib_docs"), "train", 2, 8)
    numbered_shards(tmp_path, [100], split="val")
    with pytest.raises(DataError, match=r"no train shards in .* \(looked for names ending in _train.bin or "
                                        r"_train_NNNNNN.bin\)"):
        TokenLoader(str(tmp_path), "train", 2, 8)
    with pytest.raises(DataError, match=r"no val shards in .*other_.*directory or glob, or skip the val loss "
                                        r"\(train.py --eval-every 0\)$"):
        TokenLoader(str(tmp_path / "other_*.bin"), "val", 2, 8)


def test_bad_magic_version_and_size_are_named(tmp_path):
    good = tmp_path / "g_train_000001.bin"
    write_shard(good, np.arange(100))
    raw = bytearray(good.read_bytes())
    cases = {
        "magic": (np.array([20240326], "<i4").tobytes() + raw[4:], r"not an llm.c token shard: magic number 20240326 "
                  r"\(an llm.c model file, not tokens\) and version 1, expected 20240520 and 1"),
        "version": (raw[:4] + np.array([2], "<i4").tobytes() + raw[8:], "number 20240520 and version 2, expected"),
        "truncated": (raw[:-10], r"header says 100 tokens \(1,224 bytes\) but the file has 1,214 bytes"),
        "longer": (raw + b"\0\0", "header says 100 tokens .* but the file has 1,226 bytes: truncated or corrupt"),
        "no tokens": (raw[:600], "header says 100 tokens .* but the file has 600 bytes: truncated or corrupt"),
        "no header": (raw[:5], "not an llm.c token shard: magic number 20240520 and version 0"),
        "empty": (b"", "not an llm.c token shard: magic number 0 and version 0"),
    }
    for name, (data, msg) in cases.items():
        bad = tmp_path / name / "b_train_000001.bin"
        bad.parent.mkdir()
        bad.write_bytes(bytes(data))
        with pytest.raises(DataError, match=msg) as err:
            TokenLoader(str(bad.parent), "train", 2, 8)
        assert str(bad) in str(err.value) and "\n" not in str(err.value)


def test_only_shard_shorter_than_one_window(tmp_path):
    numbered_shards(tmp_path, [16, 9])
    with pytest.raises(DataError, match=r"no train shard has B\*T\+1 = 17 tokens .*n_train_000000.bin, has 16; lower "
                                        r"--batch-size/--seq-len or write longer shards \(fineweb.py --shard-size\)$"):
        TokenLoader(str(tmp_path), "train", 2, 8)
    assert TokenLoader(str(tmp_path), "train", 3, 5).num_windows == 1  # 16 tokens: one window of 3*5+1
    numbered_shards(tmp_path, [16], split="val")  # a short val split: a longer one, or train.py without val loss
    with pytest.raises(DataError, match=r"n_val_000000.bin, has 16; lower --batch-size/--seq-len or write a longer "
                                        r"val shard \(fineweb.py --val-tokens\), or skip the val loss \(train.py "
                                        r"--eval-every 0\)$"):
        TokenLoader(str(tmp_path), "val", 2, 8)


def test_world_size_too_large_for_the_data(tmp_path):
    numbered_shards(tmp_path, [50, 40])  # 3 + 2 windows of 2*8+1 tokens
    last = TokenLoader(str(tmp_path), "train", 2, 8, 4, 5)  # one window per rank: each step is a whole epoch
    epochs = []
    for _ in range(3):
        last.next_batch()
        epochs.append(last.epoch)
    assert last.num_windows == 5 and epochs == [1, 2, 3]
    with pytest.raises(DataError, match="world size 6 is too large for the train data: it has only 5 windows"):
        TokenLoader(str(tmp_path), "train", 2, 8, 0, 6)
    # a val split may have fewer windows than ranks: components.val_loss scores each once and leaves the extras out. The
    # sixth rank's first window is the next pass's first
    numbered_shards(tmp_path, [9, 9, 50, 40], split="val")
    val = [TokenLoader(str(tmp_path), "val", 2, 8, r, 6) for r in (0, 5)]
    assert val[0].num_windows == 5 and torch.equal(val[1].next_batch()[0], val[0].next_batch()[0])


def test_empty_source_and_missing_text_field_write_nothing(tmp_path):
    (tmp_path / "empty.jsonl").touch()
    with pytest.raises(DataError, match=r"--source .*empty.jsonl is empty: its 1 file\(s\) hold no bytes"):
        write_dataset(cfg_for(tmp_path / "empty.jsonl", tmp_path / "out"))
    write_jsonl(tmp_path / "blank.jsonl", ["", "", ""])
    with pytest.raises(DataError, match="blank.jsonl has no text: no non-empty documents in --text-field 'text'"):
        write_dataset(cfg_for(tmp_path / "blank.jsonl", tmp_path / "out"))
    write_jsonl(tmp_path / "docs.jsonl", make_docs(30), field="content")
    with pytest.raises(DataError, match="--text-field 'text' is not in --source .*; its columns are content, id"):
        write_dataset(cfg_for(tmp_path / "docs.jsonl", tmp_path / "out"))
    with pytest.raises(DataError, match=r"--text-field 'id' of row 1 of --source .*docs.jsonl holds 0 \(a int\), "
                                        "not a string; pass the column of text"):
        write_dataset(cfg_for(tmp_path / "docs.jsonl", tmp_path / "out", text_field="id"))
    # a null text, or a row without the field, is refused where it is, never dropped: build-nanogpt's and nanochat's
    # tokenizers fail on None too, and a row keyed otherwise ({"body": ...}) would be text lost without a word
    (tmp_path / "holes.jsonl").write_text('{"text": "a"}\n{"text": null}\n{"body": "b"}\n')
    import datasets
    datasets.Dataset.from_dict({"text": ["a", "b", None]}).to_parquet(str(tmp_path / "holes.parquet"))
    for name, row in (("holes.jsonl", 2), ("holes.parquet", 3)):
        with pytest.raises(DataError, match=rf"^--text-field 'text' of row {row} of --source \S*{name} holds no text "
                                            r"\(null, or missing in that row\); fill or remove such rows$"):
            write_dataset(cfg_for(tmp_path / name, tmp_path / "out"))
    n = len(expected_tokens(make_docs(30)))
    with pytest.raises(DataError, match=rf"has only {n:,} tokens, all of them for the val shard \(--val-tokens "
                                        rf"1000000\); lower --val-tokens to leave some for training, e.g. "
                                        rf"--val-tokens {n // 10}, or leave it out to use the first 10%"):
        write_dataset(cfg_for(tmp_path / "docs.jsonl", tmp_path / "out", text_field="content", val_tokens=10**6))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("a")
    (tmp_path / "mixed" / "b.jsonl").write_text("{}")
    with pytest.raises(DataError, match=r"mixes file types \(.jsonl, .txt\)"):
        write_dataset(cfg_for(tmp_path / "mixed", tmp_path / "out"))
    with pytest.raises(DataError, match="matches no .txt/.jsonl/.json/.parquet/.txt.gz/.jsonl.gz/.json.gz files"):
        write_dataset(cfg_for(f"{tmp_path}/*.csv", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_hub_failure_is_one_clear_line(tmp_path, monkeypatch):
    import datasets

    def unreachable(path, **kw):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataError) as err:
        write_dataset(FinewebConfig(source="org/x", out_dir=str(tmp_path / "out")))
    assert str(err.value) == ("could not read --source org/x (--name none, --split train): ConnectionError: Couldn't "
                              "reach 'org/x' on the Hub (LocalEntryNotFoundError); check the names and the network, "
                              "and rerun (complete shards are kept)")
    assert not (tmp_path / "out").exists()


def bad_sources(d: Path) -> dict[str, tuple[Path, str]]:
    """Sources that `datasets` fails to read, each with the one line the CLI must print (a regex)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = json.dumps({"text": "hello there"})
    (d / "mixed").mkdir()
    (d / "mixed" / "a.jsonl").write_text(good + "\n")
    (d / "mixed" / "b.jsonl").write_text(json.dumps({"body": "no text field here"}) + "\n")
    (d / "broken.jsonl").write_text(good + "\n{not json\n")
    (d / "latin1").mkdir()
    (d / "latin1" / "a.txt").write_text("fine")
    (d / "latin1" / "b.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), d / "empty.parquet")
    (d / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    (d / "gz").mkdir()  # C4's layout: a shard cut short by a download, one not gzipped at all
    (d / "gz" / "c4-train.00000-of-01024.json.gz").write_bytes(gzip.compress((good + "\n").encode() * 500)[:60])
    write_jsonl(d / "gz" / "c4-train.00001-of-01024.json.gz", ["fine"])
    (d / "one").mkdir()  # a directory's one file: named as well
    (d / "one" / "plain.txt.gz").write_text("hello there")
    e = re.escape(str(d))
    return {
        "text field in one file only": (d / "mixed", rf"could not read {e}/mixed/b\.jsonl of --source {e}/mixed: "
                                        r"CastError: Couldn't cast .* because column names don't match; fix that "
                                        r"file or leave it out of --source"),
        "malformed jsonl line": (d / "broken.jsonl", rf"could not read --source {e}/broken\.jsonl: ArrowInvalid: JSON "
                                 r"parse error: .* in row 1; fix that file or leave it out of --source"),
        "non-UTF-8 txt": (d / "latin1", rf"could not read {e}/latin1/b\.txt of --source {e}/latin1: "
                          r"UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9 in position 3: .*; fix that file "
                          r"or leave it out of --source"),
        "0-row parquet": (d / "empty.parquet", rf"could not read --source {e}/empty\.parquet: ArrowInvalid: .*; "
                          "fix that file or leave it out of --source"),
        "corrupt parquet": (d / "corrupt.parquet", rf"could not read --source {e}/corrupt\.parquet: ArrowInvalid: "
                            r"Parquet magic bytes not found in footer.*; fix that file or leave it out of --source"),
        "truncated gz": (d / "gz", rf"could not read {e}/gz/c4-train\.00000-of-01024\.json\.gz of --source {e}/gz: "
                         r"EOFError: Compressed file ended before the end-of-stream marker was reached; fix that file "
                         r"or leave it out of --source"),
        "not gzip": (d / "one", rf"could not read {e}/one/plain\.txt\.gz of --source {e}/one: BadGzipFile: Not a "
                     r"gzipped file \(b'he'\); fix that file or leave it out of --source"),
    }


@pytest.mark.parametrize("case", ["text field in one file only", "malformed jsonl line", "non-UTF-8 txt",
                                  "0-row parquet", "corrupt parquet", "truncated gz", "not gzip"])
def test_unreadable_source_is_one_line_naming_the_file(tmp_path, capsys, case):
    source, line = bad_sources(tmp_path)[case]
    with pytest.raises(SystemExit) as err:
        main(["--source", str(source), "--out-dir", str(tmp_path / "out"), "--workers", "1", "--val-tokens", "10"])
    assert re.fullmatch(f"error: {line}", err.value.code), err.value.code
    assert capsys.readouterr().err == ""  # nothing from datasets' own logging either
    assert not (tmp_path / "out").exists()


def test_bad_row_is_named_by_its_file_streamed_or_not(tmp_path, monkeypatch):
    # not streamed, the files are one part: the message named the whole source and the row in all of them
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))  # not streamed: it writes a cache
    (src := tmp_path / "src").mkdir()
    write_jsonl(src / "a.jsonl", make_docs(3))
    (src / "b.jsonl").write_text('{"text": "fine"}\n{"text": null}\n{"text": "fine"}\n')
    e = re.escape(str(src))
    for field, line in (("text", rf"^--text-field 'text' of row 2 of {e}/b\.jsonl of --source {e} holds no text "),
                        ("body", rf"^--text-field 'body' is not in {e}/a\.jsonl of --source {e}; its columns are")):
        for streaming in (True, False):
            with pytest.raises(DataError, match=line):
                write_dataset(cfg_for(src, tmp_path / "out", text_field=field, streaming=streaming))
    # a file whose texts are all null: not streamed, Arrow types its column null and cannot cast the next file's
    (src / "a.jsonl").write_text('{"text": null}\n')
    for streaming in (True, False):
        with pytest.raises(DataError, match=rf"^--text-field 'text' of row 1 of {e}/a\.jsonl of --source {e} holds no"):
            write_dataset(cfg_for(src, tmp_path / "out", streaming=streaming))


def test_unreadable_source_without_streaming_names_source_and_root_cause(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))  # not streamed: it writes a cache
    # not DatasetGenerationError's, and the file named as a streamed read names it
    for case in ("non-UTF-8 txt", "truncated gz"):
        (d := tmp_path / case.split()[0]).mkdir()
        source, line = bad_sources(d)[case]
        with pytest.raises(DataError, match=f"^{line}$"):
            write_dataset(cfg_for(source, tmp_path / "out", streaming=False, val_tokens=10))


def test_programming_errors_outside_reading_are_not_turned_into_data_errors(tmp_path, monkeypatch):
    def broken(texts):
        raise TypeError("a bug in the tokenizer step")

    monkeypatch.setattr(fineweb, "tokenize", broken)
    with pytest.raises(TypeError, match="a bug in the tokenizer step"):
        write_dataset(cfg_for(write_jsonl(tmp_path / "docs.jsonl", make_docs(5)), tmp_path / "out"))


def test_out_dir_that_is_a_file_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "taken").write_text("not a directory")
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(5))
    for out, why in ((tmp_path / "taken", "[Errno 17] File exists"), (tmp_path / "taken" / "sub", "[Errno 20] Not a "
                                                                      "directory")):
        with pytest.raises(SystemExit) as err:
            main(["--source", str(src), "--out-dir", str(out), "--workers", "1"])
        assert err.value.code == f"error: {why}: '{out}'" and capsys.readouterr().err == ""  # the line alone
    assert (tmp_path / "taken").read_text() == "not a directory"


def test_cli_errors_exit_1_with_one_line(tmp_path):
    with pytest.raises(SystemExit) as err:
        main(["--source", str(tmp_path / "docs.jsonl"), "--out-dir", str(tmp_path / "out")])
    assert err.value.code == (f"error: --source {tmp_path / 'docs.jsonl'} does not exist; pass a file, directory or "
                              "glob of .txt/.jsonl/.json/.parquet/.txt.gz/.jsonl.gz/.json.gz, or a hub dataset name")
    with pytest.raises(SystemExit, match=r"^error: --shard-size must be in \[1, 2\*\*31\), got 0$"):
        main(["--shard-size", "0"])
    with pytest.raises(SystemExit, match="unknown option --shard-sise; did you mean --shard-size"):
        main(["--shard-sise", "10"])
    write_jsonl(tmp_path / "docs.jsonl", make_docs(5), field="body")
    proc = subprocess.run([sys.executable, "fineweb.py", "--source", str(tmp_path / "docs.jsonl"), "--out-dir",
                           str(tmp_path / "out"), "--workers", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: --text-field 'text' is not in --source {tmp_path / 'docs.jsonl'}; its columns are body, id; pass "
        "one of them with --text-field"]
    assert not (tmp_path / "out").exists()


def test_a_damaged_stdlib_docs_cache_is_written_again(tmp_path, capsys, monkeypatch):
    """A stdlib-docs cache cut short (a full disk, an older writer killed mid-write) ended the run in `ArrowInvalid:
    JSON parse error ...; fix that file`, naming neither the file nor the fix: it is written again, with a note."""
    some = fineweb.stdlib_files()[:60]  # enough docstrings for 5,000 tokens; parsing the whole stdlib took 9 s
    monkeypatch.setattr(fineweb, "stdlib_files", lambda: some)
    cfg = cfg_for("stdlib-docs", tmp_path / "out", cache_dir=str(tmp_path / "cache"), val_tokens=1000,
                  shard_size=2000, max_tokens=5000)
    cached = fineweb.stdlib_docstrings(cfg)
    whole = cached.read_bytes()
    cached.write_bytes(whole[:whole.index(b"\n", len(whole) // 2) - 5])  # cut inside a line
    write_dataset(cfg)
    assert f"note: {cached} is damaged; writing it again" in capsys.readouterr().out
    assert cached.read_bytes() == whole
    docs = [json.loads(line)["text"] for line in whole.decode().splitlines()]
    assert np.array_equal(concat(tmp_path / "out"), expected_tokens(docs[:400])[:5000])


def test_a_finished_run_of_the_previous_writer_is_not_written_again(tmp_path, reference):
    """Its PREFIX_done.json held the settings, the inputs and the shard sizes but no resume points: still a finished
    run (a 10B-token directory is not written again), and one whose shard went missing is written anew."""
    src, ref = reference
    out = tmp_path / "out"
    write_dataset(cfg_for(src, out))
    record = json.loads((out / "t_done.json").read_text())
    (out / "t_done.json").write_text(json.dumps({k: record[k] for k in ("settings", "inputs", "shards")}))
    again = write_dataset(cfg_for(src, out))
    assert (again["tokenized"], again["skipped_shards"]) == (0, len(ref))
    (out / "t_done.json").write_text(json.dumps({k: record[k] for k in ("settings", "inputs", "shards")}))
    (out / "t_train_000003.bin").unlink()
    assert write_dataset(cfg_for(src, out))["skipped_shards"] == 0
    assert {p.name: p.read_bytes() for p in shard_files(out)} == ref
