"""Several train.py runs in one torchrun launch (test_scale.py): tensor / pipeline parallel layouts, their resumes on
the same layout and on others. One process group serves them all; each run's log.jsonl lands in OUT/<name>.

    torchrun --nproc_per_node=2 tests/scale_script.py DATA OUT two
    torchrun --nproc_per_node=4 tests/scale_script.py DATA OUT four
"""

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402

# the tiny GPT-2 on a 512-token vocabulary (its fp32 gradient norm is exact enough to compare: docs/scale.md)
BASE = ["--preset", "tiny", "--vocab-size", "512", "--max-steps", "10", "--total-batch-size", "1024", "--eval-every",
        "5", "--eval-tokens", "2048", "--hellaswag", "off"]
LLAMA = ["--pos", "rope", "--mlp", "swiglu", "--n-kv-head", "2", "--norm", "rmsnorm", "--bias", "false"]
RUNS = {  # name -> flags; a resume names the run whose step-5 checkpoint it continues
    "two": {"tp2": ["--tp", "2", "--ckpt-every", "5"],
            "tp2_as_dp2": ["resume:tp2"],
            "pp2": ["--pp", "2", "--ckpt-every", "5"],
            "pp2_again": ["--pp", "2", "resume:pp2"],
            "pp2gpipe_llama": ["--pp", "2", "--pp-schedule", "gpipe", *LLAMA],
            "pp2interleaved_l4": ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--n-layer", "4"]},
    "four": {"dp2tp2": ["--tp", "2", "--parallel", "fsdp", "--ckpt-every", "5"],
             "dp2tp2_again": ["--tp", "2", "--parallel", "fsdp", "resume:dp2tp2"],
             "dp2tp2_as_dp4": ["--parallel", "fsdp", "resume:dp2tp2"],
             "pp2tp2sp_llama": ["--pp", "2", "--tp", "2", "--sequence-parallel", *LLAMA]},
}


def main(data: str, out: str, which: str) -> None:
    dist.init_process_group("gloo")  # ours: each train.run joins it and leaves it up for the next
    for name, flags in RUNS[which].items():
        flags = [f"--resume={out}/{f.removeprefix('resume:')}/ckpt_000005.pt" if f.startswith("resume:") else f
                 for f in flags]
        train.main([*BASE, "--data", data, "--out-dir", f"{out}/{name}", *flags])
    dist.destroy_process_group()


if __name__ == "__main__":
    train.run_and_exit(lambda: main(*sys.argv[1:]))  # no interpreter finalization after gloo collectives
