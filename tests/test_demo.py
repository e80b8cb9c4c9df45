"""demo.sh end to end with a few steps: shards, training, a checkpoint, samples, the plot and the last val loss and
bits per byte, twice (idempotent), and the same pipeline on another corpus through --source."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, SHAKESPEARE


def run_demo(tmp_path, *args: str) -> str:
    env = {**os.environ, "VENV": sys.prefix, "DEMO_STEPS": "3", "DEMO_DIR": str(tmp_path), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(["bash", "demo.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_demo_runs_end_to_end_twice(tmp_path):
    for run in range(2):
        out = run_demo(tmp_path)
        demo = tmp_path / "out" / "demo"
        assert (f"demo outputs: shards in {tmp_path}/data/stdlib_docs/, checkpoint {demo}/ckpt_000003.pt, log "
                f"{demo}/log.jsonl, samples {demo}/samples.txt, plot {demo}/loss.png") in out
        assert "plot: wrote" in out and (demo / "loss.png").stat().st_size > 10_000
        assert out.count("---------------") == 4  # four streamed samples, also kept in samples.txt
        assert (demo / "samples.txt").read_text().count("Return") >= 4
        assert re.search(r"val loss \d+\.\d{4} nats a token, \d+\.\d{4} bits per byte \(step 3\)", out)
        assert re.search(r"corpus check: \d+% of \d+ sampled words occur in .*/data/stdlib_docs's train shards; "
                         r"\d+% of \d+ sampled lines are whitespace only", out)
        if run == 1:  # the second run reuses the shards and the finished checkpoint
            assert "(2 already complete)" in out and "nothing to do" in out and "resumed from" in out


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="needs ../shared/data/tinyshakespeare.txt")
def test_demo_takes_another_corpus_with_one_flag(tmp_path):
    # the local copy goes through fineweb.py's Tiny Shakespeare source: its val split (32,768 tokens) and names,
    # the same shards --source shakespeare downloads
    out = run_demo(tmp_path, "--shakespeare-path", str(SHAKESPEARE))
    demo = tmp_path / "out" / "demo_shakespeare"
    assert f"shards in {tmp_path}/data/shakespeare/" in out and "32,768 val + 305,258 train tokens" in out
    assert (demo / "ckpt_000003.pt").is_file() and (demo / "loss.png").is_file()
    assert (demo / "samples.txt").read_text().startswith("ROMEO:")


def test_demo_rejects_unknown_arguments():
    proc = subprocess.run(["bash", "demo.sh", "--steps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown argument --steps" in proc.stderr
