"""Supervised fine-tuning into a chat model: conversations in chat_format.py's format, the loss on the assistant's
tokens only, packed whole into rows; val loss and a task's held-out accuracy as it trains.

Usage:
    python tasks.py --task addition && python sft.py --preset sft-demo   # the demo model taught addition, CPU minutes
    torchrun --standalone --nproc_per_node=8 sft.py --preset sft          # GPT-2 124M on smol-smoltalk
    python sft.py --preset sft-demo --data data/mine --task mytask.py:MyTask --out-dir out/sft-mine  # your data, task
"""

# Read top to bottom: config and presets, the data, the evaluations, then setup (one engine.Run) and main. The step is
# stage.lm_step: next-token loss where the targets are not -1 (ConversationLoader masks all but the assistant's).
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import stage
from chat_format import CHAT_VOCAB, ConversationLoader
from common import LOCAL, run_and_exit
from engine import Context, Run
from parallel import check_flags
from stage import StageArgs, TaskEvalArgs

SPLITS = ("train_sft", "test_sft")  # the train and val split of a dataset without train and test (ultrachat_200k)


@dataclass
class SFTConfig(TaskEvalArgs, StageArgs):
    """Fine-tune a model on conversations ({"messages": [...]} rows: JSONL, parquet or the hub) into a chat model.
    Flags override the chosen --preset; every GPTConfig field is a flag too."""

    # conversations: a file or glob of files (every 20th row is val, --eval-every 0 too), or a directory or hub name
    # (its train and test splits, else train_sft and test_sft: ultrachat_200k's)
    data: Annotated[str, LOCAL] = "HuggingFaceTB/smol-smoltalk"
    label_smoothing: float = 0.0  # cross-entropy label smoothing
    # with no --preset, GPT-2 124M's recipe (the `sft` preset's), not pretraining's 19,073 steps at lr 6e-4
    max_steps: int = 2000  # optimizer steps (about a third of smol-smoltalk)
    total_batch_size: int = 32768
    batch_size: int = 4
    max_lr: float = 3e-5
    lr_schedule: str = "linear"
    min_lr_frac: float = 0.0
    warmup_steps: int = 20
    eval_every: int = 200
    eval_tokens: int = 327680
    ckpt_every: int = 500
    out_dir: Annotated[str, LOCAL] = "out/sft"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flags([(0.0 <= self.label_smoothing < 1.0,
                      f"--label-smoothing must be in [0, 1); got {self.label_smoothing}"),
                     (not self.arch.get("value_head"), "sft.py trains no value head: drop --value-head true")])


PRESETS: dict[str, Callable[[], SFTConfig]] = {
    # OpenAI's GPT-2 124M on smol-smoltalk, about a third of an epoch
    "sft": functools.partial(SFTConfig, init_from="gpt2"),
    # the offline chat demo: the demo's model fine-tuned on tasks.py's addition problems, one to a 24-token row (packed
    # several to a row, the small model learned far slower), scored on held-out ones; minutes on 2 CPU cores
    "sft-demo": functools.partial(SFTConfig, init_from="out/demo/ckpt_000900.pt", data="data/addition", seq_len=24,
                                  total_batch_size=768, batch_size=32, max_lr=3e-3, lr_schedule="linear",
                                  min_lr_frac=0.0, warmup_steps=20, max_steps=2400, eval_every=400, eval_tokens=3072,
                                  ckpt_every=0, task="addition", task_every=400, task_limit=256,
                                  out_dir="out/sft-demo"),
}


def setup(cfg: SFTConfig, ctx: Context) -> Run:
    """The Run: packed conversations, the model (an HF GPT-2 padded for the chat tokens), val loss and the task."""
    # a split's packed conversations for `data`'s rank among its data-parallel world (stage.Setup's)
    loader = lambda split, data: ConversationLoader(cfg.data, split, cfg.batch_size, cfg.seq_len, data.rank, data.world,
                                                    cfg.seed, data.device, SPLITS)
    setup = stage.Setup(cfg, ctx, loader, chat=True, vocab=CHAT_VOCAB)
    setup.build()
    step_fn = stage.lm_step(setup.cfg, setup.built, setup.next_batch, setup.grad_accum, setup.guard, ctx,
                            label_smoothing=cfg.label_smoothing)
    return setup.run(step_fn, stage.val_evals(cfg, setup) + stage.task_evals(cfg, setup))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return stage.main(SFTConfig, argv, PRESETS, setup, __doc__)


if __name__ == "__main__":
    run_and_exit(main, stage.exit_code)
