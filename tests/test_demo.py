"""demo.sh end to end with a few steps: shards, training, a checkpoint, samples and the plot, twice (idempotent)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_demo_runs_end_to_end_twice(tmp_path):
    env = {**os.environ, "VENV": sys.prefix, "DEMO_STEPS": "3", "DEMO_DIR": str(tmp_path), "OMP_NUM_THREADS": "2"}
    for run in range(2):
        proc = subprocess.run(["bash", "demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = proc.stdout
        assert f"demo outputs: shards in {tmp_path}/data/stdlib/" in out
        assert "plot: wrote" in out and (tmp_path / "out/demo/loss.png").stat().st_size > 10_000
        assert (tmp_path / "out/demo/ckpt_000003.pt").is_file()
        assert out.count("---------------") == 2  # two streamed samples
        if run == 1:  # the second run reuses the shards and the finished checkpoint
            assert "(2 already complete)" in out and "nothing to do" in out and "resumed from" in out
