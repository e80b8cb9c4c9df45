"""Faults a user meets, on real resources: a full disk and a file-size limit while checkpointing and logging, a
resume that changes the optimizer's settings, a rewind that dies, a TensorBoard run that dies, a rank that stops.
After each fault, the checkpoints and log.jsonl hold every step once, as an uninterrupted run's do."""

import contextlib
import re
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import engine
import train
from common import check_crcs, iter_log, load_checkpoint, resolve_device
from conftest import ROOT
from model import checkpoint_config


def tiny(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--data", str(data), "--out-dir", str(out), "--eval-every=0", *extra]


def small(data: Path, out: Path, *extra: str) -> list[str]:
    """tiny for conftest's tokens_512."""
    return tiny(data, out, "--vocab-size=512", *extra)


def logged(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in iter_log(out / "log.jsonl") if r["type"] == "train"]


def dies_at(step: int, get_lr):
    """get_lr, but the process dies (as by SIGKILL, without a checkpoint) when it reaches `step`."""
    def lr(at: int, cfg):
        if at == step:
            raise KeyboardInterrupt
        return get_lr(at, cfg)
    return lr


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """RLIMIT_FSIZE for this process (Python ignores SIGXFSZ, so a write past it fails with EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextlib.contextmanager
def small_tmpfs(where: Path, megabytes: int) -> Iterator[Path]:
    """A real filesystem of `megabytes` (needs root: skipped without)."""
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(where)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.parametrize("fault", ["file-size limit", "full disk"])
def test_a_failed_checkpoint_write_is_one_line_leaves_no_partial_file_and_loses_no_step(tokens_512, tmp_path, fault,
                                                                                          capsys):
    straight = train.main(small(tokens_512, tmp_path / "straight", "--ckpt-every=2", "--max-steps=4"))["losses"]
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(small_tmpfs(tmp_path / "fs", 3)) if fault == "full disk" else tmp_path / "out"
        train.main(small(tokens_512, out, "--ckpt-every=2", "--max-steps=2"))
        size = (out / "ckpt_000002.pt").stat().st_size  # ~1.7 MB at vocabulary 512: a second one does not fit in 3 MB
        if fault == "file-size limit":
            stack.enter_context(file_size_limit(size // 2))
        kept = (out / "ckpt_000002.pt").read_bytes()
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train.main(small(tokens_512, out, "--ckpt-every=2", "--max-steps=4", "--resume=auto"))
        what, fix = ("EFBIG (File too large)", "raise the file-size limit (ulimit -f) or write elsewhere") \
            if fault == "file-size limit" else ("ENOSPC (No space left on device)", "free space there (or lower "
                                                                                     "--keep-last)")
        assert e.value.code == 1 and capsys.readouterr().err == (
            f"error: cannot write checkpoint {out / 'ckpt_000004.pt'}: {what}; the partial file is removed and the "
            f"earlier checkpoints are intact; {fix}, then --resume auto\n")
        assert sorted(p.name for p in out.iterdir() if p.name.startswith("ckpt")) == ["ckpt_000002.pt"]
        assert (out / "ckpt_000002.pt").read_bytes() == kept
        stack.close()  # the limit lifted, or the disk gone: the run goes on from a copy
        if fault == "full disk":
            out = tmp_path / "copied"
            out.mkdir()
            (out / "ckpt_000002.pt").write_bytes(kept)
            (out / "log.jsonl").write_text((tmp_path / "straight" / "log.jsonl").read_text())
    train.main(small(tokens_512, out, "--ckpt-every=2", "--max-steps=4", "--resume=auto"))
    assert logged(out) == list(enumerate(straight))  # every step once, bitwise the uninterrupted run's


def test_a_full_log_is_one_line(tokens_512, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(small(tokens_512, out, "--max-steps=2", "--ckpt-every=2"))
    capsys.readouterr()
    with file_size_limit((out / "log.jsonl").stat().st_size + 300), pytest.raises(SystemExit) as e:
        train.main(small(tokens_512, out, "--max-steps=8", "--resume=auto"))
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith(f"error: cannot append to {out / 'log.jsonl'}: EFBIG (File too large); "
                                                "raise the file-size limit") and err.count("\n") == 1


def test_optimizer_settings_given_on_resume_apply_and_the_record_says_so(tokens_512, tmp_path, capsys):
    straight = train.main(small(tokens_512, tmp_path / "straight", "--max-steps=4"))["losses"]
    out = tmp_path / "out"
    train.main(small(tokens_512, out, "--max-steps=2", "--ckpt-every=2"))
    capsys.readouterr()
    changed = ["--weight-decay=0.5", "--beta1=0.8", "--beta2=0.99", "--eps=1e-6", "--grad-clip=0.5"]
    train.main(small(tokens_512, out, "--max-steps=4", "--ckpt-every=2", "--resume=auto", *changed))
    assert "note: --beta1/--beta2, --eps, --weight-decay, --grad-clip differ from the checkpoint's run: this run's " \
        "values apply from step 2" in capsys.readouterr().out
    ckpt = load_checkpoint(out / "ckpt_000004.pt")
    groups = [(g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in ckpt["optimizer"]["param_groups"]]
    assert groups == [(0.5, (0.8, 0.99), 1e-6), (0.0, (0.8, 0.99), 1e-6)]  # what ran is what the record says
    config = ckpt["train_config"]
    assert (config["weight_decay"], config["beta1"], config["beta2"], config["eps"]) == (0.5, 0.8, 0.99, 1e-6)
    losses = [loss for _, loss in logged(out)]
    # steps 0-2 trained on the checkpoint's settings; step 2's update used the new ones, so step 3's loss moved
    assert losses[:3] == straight[:3] and losses[3] != straight[3]


def test_a_rewind_that_dies_before_its_first_checkpoint_loses_no_logged_step(tokens_512, tmp_path):
    out, args = tmp_path / "out", ["--ckpt-every=4", "--keep-last=0"]
    train.main(small(tokens_512, out, "--max-steps=8", *args))
    whole = logged(out)
    assert [step for step, _ in whole] == list(range(8))
    # a rewind to step 4 (ckpt_000008 is newer) that dies at step 5, before its first checkpoint (at step 8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "get_lr", dies_at(5, engine.get_lr))
        with pytest.raises(KeyboardInterrupt):
            train.main(small(tokens_512, out, "--max-steps=8", *args, f"--resume={out / 'ckpt_000004.pt'}"))
    assert [step for step, _ in logged(out)] == [0, 1, 2, 3, 4]  # the rewind's view, its dropped steps kept aside
    assert (out / "log.jsonl.rewound").is_file()
    # resume auto continues the untouched ckpt_000008: steps 5-7 are back, once each, with their values
    train.main(small(tokens_512, out, "--max-steps=10", *args, "--resume=auto"))
    assert logged(out)[:8] == whole and [step for step, _ in logged(out)] == list(range(10))
    assert not (out / "log.jsonl.rewound").exists()


def test_a_rewind_that_checkpoints_owns_the_log(tokens_512, tmp_path):
    out, args = tmp_path / "out", ["--ckpt-every=2", "--keep-last=0"]
    train.main(small(tokens_512, out, "--max-steps=6", *args))
    train.main(small(tokens_512, out, "--max-steps=6", *args, f"--resume={out / 'ckpt_000002.pt'}", "--max-lr=2e-3"))
    steps = [step for step, _ in logged(out)]
    assert steps == list(range(6)) and not (out / "log.jsonl.rewound").exists()
    again = train.main(small(tokens_512, out, "--max-steps=6", *args, "--resume=auto", "--max-lr=2e-3",
                             "--eval-only"))
    assert again["step"] == 6  # resume auto takes the rewind's own ckpt_000006


def test_tensorboard_forgets_a_dead_attempt(tokens_512, tmp_path):
    pytest.importorskip("tensorboard", reason="--tensorboard is an optional extra (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as patch:  # a first attempt killed before its first checkpoint
        patch.setattr(engine, "get_lr", dies_at(3, engine.get_lr))
        with pytest.raises(KeyboardInterrupt):
            train.main(small(tokens_512, out, "--max-steps=4", "--tensorboard", "--max-lr=5e-3"))
    train.main(small(tokens_512, out, "--max-steps=4", "--tensorboard"))  # started afresh, with another lr
    events = EventAccumulator(str(out))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert got == [(step, pytest.approx(loss, abs=1e-6)) for step, loss in logged(out)]  # one value a step


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "mps", "cpu:0 ", "", "cuda:00", "cuda:\u0661", "cuda:" + "9" * 20])
def test_a_device_name_outside_auto_cpu_cuda_is_one_line(name):
    with pytest.raises(ValueError, match=rf"^--device must be auto, cpu, cuda or cuda:N, got {re.escape(repr(name))}$"):
        resolve_device(name)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_a_cuda_device_without_a_gpu_names_the_device_passed(name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device cuda:1 was told of --device cuda
    with pytest.raises(ValueError, match=rf"^--device {name}, but this machine has no CUDA GPU; use --device cpu$"):
        resolve_device(name)


def test_a_cuda_device_past_the_last_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU: set_device(1) was CUDA's traceback
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"^--device cuda:1, but this machine has 1 CUDA GPU\(s\); pass "
                       r"--device cuda:N with N below 1$"):
        resolve_device("cuda:1")



@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_cpu_run_does_not_fault_its_logits_in_again_every_step(token_data, tmp_path):
    # the tiny model's logits and their gradient are 51 MB each, past glibc's mmap threshold: 3 steps against 13 (a
    # run's faults and RSS vary by about 3,300 pages and 13 MB from run to run, whatever its steps)
    code = ("import resource, sys, train\n"
            "train.main(sys.argv[1:])\n"
            "use = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print(use.ru_minflt, use.ru_maxrss)")
    use = {n: list(map(int, subprocess.run([sys.executable, "-c", code, *tiny(token_data, tmp_path / str(n)),
                                            f"--max-steps={n}"], cwd=ROOT, capture_output=True,
                                           text=True, check=True).stdout.split()[-2:])) for n in (3, 13)}
    faults, kb = ((use[13][i] - use[3][i]) / 10 for i in (0, 1))
    print(f"per step: {faults:.0f} page faults, max RSS +{kb:.0f} KB")
    # per step: glibc's defaults fault about 118,000 pages in each; kept, the heap settles within ~100 steps (the
    # RSS of a 300-step run is that of a 60-step one), and a leak of the 51 MB logits would add 50,000 KB; kept, 1,200
    # to 3,200 a step on idle machines, 6,300 on a busy one, and one buffer faulted in again adds 12,500
    assert faults < 10_000 and kb < 20_000, use


HOLES = """
import ctypes, common
common.keep_large_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
blocks = [libc.malloc(64 << 20) for _ in range(4)]
for block in blocks:
    ctypes.memset(block, 1, 64 << 20)
libc.malloc(4000)  # a small block above them: the heap's top stays in use
start = rss()
for block in blocks:
    libc.free(ctypes.c_void_p(block))
freed = rss()
common.trim_heap()
print(freed - start, rss() - start)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_the_kept_heap_hands_its_free_pages_back_when_trimmed():
    # 256 MB freed below a live block: kept in the heap (keep_large_blocks), then returned by trim_heap. Blocks of
    # varying sizes between small live ones leave such holes, and would grow a CPU run's heap without a ceiling
    out = subprocess.run([sys.executable, "-c", HOLES], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    kept, trimmed = map(int, out.split())
    assert kept > -16 and trimmed < -240, out


def test_a_cpu_run_trims_its_heap_every_trim_every_steps(tokens_512, tmp_path, monkeypatch):
    trims = []
    monkeypatch.setattr(engine, "TRIM_EVERY", 3)
    monkeypatch.setattr(engine, "trim_heap", lambda: trims.append(1))
    train.main(small(tokens_512, tmp_path, "--max-steps=7"))
    assert len(trims) == 2  # after steps 2 and 5 (0-based): 3 and 6 steps done


@pytest.mark.parametrize("saved, named", [(None, "NoneType"), ({1: 2}, "1"), ({1: 2, "zz": 3}, "1, zz"),
                                          ({"n_layer": 2, "qk_norm": True}, "qk_norm")])
def test_a_checkpoint_of_another_model_config_is_one_line(saved, named):
    # each case's own fields, every one of them (an alternation of all four let "1" stand for "1, zz")
    with pytest.raises(ValueError, match=r"^ckpt\.pt: its model_config does not match this GPTConfig \(no field "
                                         rf"{named}\); it was written by another") as e:
        checkpoint_config({"model_config": saved}, "ckpt.pt")
    assert "\n" not in str(e.value)
    assert checkpoint_config({"model_config": {"n_layer": 3}}, "ckpt.pt", n_head=2).n_layer == 3


def test_a_checkpoint_is_crc_checked_once_until_it_is_written_again(tmp_path, monkeypatch):
    # GPT.load maps a checkpoint to refuse a reward model, then loads it: each load read every byte for the CRCs
    import os
    import zipfile

    import torch

    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.arange(4.0)}}, path)
    opened = []
    real = zipfile.ZipFile.open
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda self, *a, **k: opened.append(1) or real(self, *a, **k))
    check_crcs(path)
    first = len(opened)
    check_crcs(path)
    assert first > 0 and len(opened) == first  # the second load read no member for its CRC
    data = bytearray(path.read_bytes())  # rotted in place, its mtime put back: the ctime still moves
    at = data.index(bytes(torch.arange(4.0).numpy().tobytes()))
    data[at] ^= 0xFF
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(zipfile.BadZipFile):
        check_crcs(path)


def test_a_checkpoint_with_one_compressed_member_is_not_mapped(tmp_path):
    # only the weights' member deflated, the rest stored: one compressed member is enough to load without mmap
    import zipfile

    weights = {"w": torch.linspace(-1, 1, 4096)}
    torch.save({"model": weights, "model_config": {}}, tmp_path / "saved.pt")
    with zipfile.ZipFile(tmp_path / "saved.pt") as src, zipfile.ZipFile(tmp_path / "mixed.pt", "w") as dst:
        for info in src.infolist():
            packed = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info), compress_type=packed)
    assert not check_crcs(tmp_path / "mixed.pt")
    assert torch.equal(load_checkpoint(tmp_path / "mixed.pt", mmap=True)["model"]["w"], weights["w"])


def test_a_member_rotted_past_its_first_16_mib_fails_its_crc(tmp_path):
    # the CRC is checked at a member's end: every chunk of a large tensor is read, not the first 16 MiB alone
    import zipfile

    path = tmp_path / "big.pt"
    torch.save({"model": {"w": torch.zeros(4_400_000)}}, path)  # 17.6 MB of zeros in one member
    data = bytearray(path.read_bytes())
    data[data.index(bytes(64)) + 17_000_000] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(zipfile.BadZipFile):
        check_crcs(path)


def test_a_checkpoint_repacked_with_compression_loads_its_weights_mapped_or_not(tmp_path):
    # torch.save stores members uncompressed; mmap=True maps a deflated member's bytes as the tensor (garbage weights)
    import zipfile

    weights = {"w": torch.linspace(-1, 1, 4096)}
    torch.save({"model": weights, "model_config": {}}, tmp_path / "saved.pt")
    with zipfile.ZipFile(tmp_path / "saved.pt") as src, zipfile.ZipFile(tmp_path / "zipped.pt", "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    for mmap in (False, True):
        assert torch.equal(load_checkpoint(tmp_path / "zipped.pt", mmap=mmap)["model"]["w"], weights["w"]), mmap
