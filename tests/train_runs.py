"""Several train.py runs in one torchrun launch, one after another in one process group: on CI's two cores a launch's
start-up (three Pythons importing torch, the rendezvous) costs more than a tiny run. The tests write RUNS.json, a
list of train.py argument lists (conftest.run_train_runs). Or one run in the group train.py makes (NCCL on a GPU),
that says what it built too (tests/test_gpu_train.py).

    torchrun --nproc_per_node=2 tests/train_runs.py RUNS.json
    torchrun --nproc_per_node=1 tests/train_runs.py train.py --parallel=fsdp ...
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stage  # noqa: E402
import train  # noqa: E402


def built(build_trainable):
    """build_trainable that says (rank 0) what it wrapped the model in and which optimizer it made: the tests check
    that --parallel took effect, which the checkpoint's optimizer_kind (the flag, once a group is up) cannot tell."""
    def build(*args, **kwargs):
        done = build_trainable(*args, **kwargs)
        if dist.get_rank() == 0:
            model = getattr(done.model, "_orig_mod", done.model)  # torch.compile's wrapper: FSDP2 is compiled last
            print(f"train_runs: built {type(model).__name__} with {type(done.optimizer).__name__}", flush=True)
        return done
    return build


def main(runs: str) -> None:
    stage.build_trainable = built(stage.build_trainable)
    dist.init_process_group("gloo")  # ours: each train.run joins it and leaves it up for the next
    for argv in json.loads(Path(runs).read_text()):
        train.main(argv)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "train.py":
        stage.build_trainable = built(stage.build_trainable)
        train.run_and_exit(lambda: train.main(sys.argv[2:]), stage.exit_code)
    train.run_and_exit(lambda: main(*sys.argv[1:]))  # no interpreter finalization after gloo collectives
