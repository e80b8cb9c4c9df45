"""The post-training stages on a CUDA GPU as a user runs them (torchrun, NCCL, torch.compile, bf16): sft.py learns a
task's replies and scores them, prefs.py's reward model and DPO train, and rl.py's GRPO and PPO take steps; each
compiled run's first losses equal an eager run's within bf16's tolerance (the head runs on a data-dependent mask,
GPT.forward's `at`, inside the compiled graph). scripts/gpu_suite.sh runs them (STAGES=post-tests). Without CUDA the
same harness runs on CPU, eager and fp32, in this process, so that a GPU session does not spend its minutes on a
broken assertion."""

import math
from pathlib import Path

import pytest
import torch
from test_gpu_train import DEVICE, GPU, launch, records

import rl
import tasks
from common import iter_log
from model import GPT

pytestmark = pytest.mark.slow
COMPILE = [] if GPU else ["--compile=false"]  # compiled and bf16 by default on CUDA
TOL = 0.05 if GPU else 0.0  # loss, nats: bf16 and the compiled kernels' sums in another order


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tasks") / "addition"
    tasks.main(["--task=addition", f"--out-dir={out}", "--pairs", "--limit=512"])
    return out


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in records(out, "train")]


@pytest.fixture(scope="module")
def sft_run(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft")
    launch(["sft.py", "--model=tiny", "--seq-len=24", "--init-from=", f"--data={data}", f"--out-dir={out}",
            "--batch-size=32", "--total-batch-size=768", "--max-lr=3e-3", "--warmup-steps=5", "--max-steps=60",
            "--lr-schedule=linear", "--eval-every=30", "--eval-tokens=3072", "--ckpt-every=60", "--task=addition",
            "--task-every=60", "--task-limit=32", *COMPILE])
    return out


def test_sft_learns_the_replies_and_scores_the_task(sft_run, data, tmp_path):
    loss = losses(sft_run)
    assert len(loss) == 60 and all(map(math.isfinite, loss)) and loss[-1] < loss[0] - 3.0, loss
    assert [(r["step"], r["n"]) for r in records(sft_run, "task")] == [(0, 32), (60, 32)]
    assert next(iter_log(sft_run / "log.jsonl"))["config"]["compile"] is (None if GPU else False)
    # the warmup's steps take the same lr whatever --max-steps: an eager run's first 3 losses are the compiled one's
    launch(["sft.py", "--model=tiny", "--seq-len=24", "--init-from=", f"--data={data}", f"--out-dir={tmp_path}",
            "--batch-size=32", "--total-batch-size=768", "--max-lr=3e-3", "--warmup-steps=5", "--max-steps=3",
            "--lr-schedule=linear", "--eval-every=0", "--compile=false"])
    diff = max(abs(a - b) for a, b in zip(loss[:3], losses(tmp_path), strict=True))
    print(f"sft: compiled against eager, max |loss difference| over 3 steps = {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("objective", ["reward", "dpo"])
def test_reward_model_and_dpo_train_compiled_as_eager(objective, data, sft_run, tmp_path):
    runs = {}
    for name, compiled in (("compiled", COMPILE), ("eager", ["--compile=false"])):
        runs[name] = tmp_path / name
        launch(["prefs.py", f"--objective={objective}", f"--init-from={sft_run / 'ckpt_000060.pt'}", "--seq-len=24",
                f"--data={data.with_name('addition_pairs')}", f"--out-dir={runs[name]}", "--batch-size=16",
                "--total-batch-size=384", "--max-lr=1e-4", "--warmup-steps=2", "--max-steps=6", "--eval-every=0",
                "--ckpt-every=0", *compiled])
    compiled, eager = losses(runs["compiled"]), losses(runs["eager"])
    assert len(compiled) == 6 and all(map(math.isfinite, compiled))
    if objective == "dpo":
        assert compiled[0] == pytest.approx(math.log(2), abs=TOL + 1e-6)  # a policy equal to its reference
    diff = max(abs(a - b) for a, b in zip(compiled[:3], eager[:3], strict=True))
    print(f"{objective}: compiled against eager, max |loss difference| over 3 steps = {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_rl_takes_steps_and_its_masked_head_compiles_as_eager(algo, sft_run, tmp_path):
    launch(["rl.py", f"--algo={algo}", f"--init-from={sft_run / 'ckpt_000060.pt'}", "--task=addition",
            f"--out-dir={tmp_path}", "--prompts=8", "--samples=4", "--rollout-batch=8", "--max-new-tokens=8",
            "--max-steps=2", "--eval-every=0", "--eval-limit=16", "--pass-k=0", *COMPILE])
    steps = records(tmp_path, "train")
    # (a group whose replies all score alike has no advantage: GRPO's gradient may be 0)
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    assert all(0 <= r["reward"] <= 1 for r in steps) and records(tmp_path, "task")[-1]["n"] == 16
    # the policy's log-probs on a mask of sampled tokens (a data-dependent shape), compiled against eager
    model = GPT.from_checkpoint(sft_run / "ckpt_000060.pt", value_head=algo == "ppo").to(DEVICE)
    ids = torch.randint(0, 50257, (8, 24), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = (torch.rand(8, 23, generator=torch.Generator().manual_seed(1)) < 0.4).float().to(DEVICE)
    compiled = torch.compile(model) if GPU else model
    with torch.autocast(DEVICE, torch.bfloat16, enabled=GPU), torch.no_grad():
        want = rl.policy_forward(model, ids, mask, 0.7, algo == "ppo")
        got = rl.policy_forward(compiled, ids, mask, 0.7, algo == "ppo")
    for a, b in ((want[0], got[0]), (want[2], got[2])):
        if a is not None:
            print(f"rl {algo}: compiled against eager, max |difference| {(a - b).abs().max().item():.2e}")
            # log-probs near -10 are 0.0625 apart in bf16: 4.5e-2 was seen on an H200, so allow a rounding in scale
            torch.testing.assert_close(b, a, atol=TOL, rtol=2**-7 if GPU else 0)
