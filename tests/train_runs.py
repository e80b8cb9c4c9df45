"""Several train.py runs in one torchrun launch, one after another in one process group: on CI's two cores a launch's
start-up (three Pythons importing torch, the rendezvous) costs more than a tiny run. The tests write RUNS.json, a
list of train.py argument lists (conftest.run_train_runs).

    torchrun --nproc_per_node=2 tests/train_runs.py RUNS.json
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402


def main(runs: str) -> None:
    dist.init_process_group("gloo")  # ours: each train.run joins it and leaves it up for the next
    for argv in json.loads(Path(runs).read_text()):
        train.main(argv)
    dist.destroy_process_group()


if __name__ == "__main__":
    train.run_and_exit(lambda: main(*sys.argv[1:]))  # no interpreter finalization after gloo collectives
