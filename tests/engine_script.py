"""A second training script on the engine alone (not stage.py's scaffolding): its own config (not train.py's), a
model, an objective, and an engine.Run built in a few lines, with resume, NaN recovery and DDP from the engine.

    python tests/engine_script.py --data DIR --out-dir OUT --max-steps 6 [--resume auto]
    torchrun --nproc_per_node=2 tests/engine_script.py ...
"""

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine  # noqa: E402
import trackers  # noqa: E402
from common import parse_config, provenance, run_and_exit, setup_distributed, token_bytes  # noqa: E402
from fineweb import TokenLoader  # noqa: E402
from model import GPT, MODEL_PRESETS  # noqa: E402
from parallel import build_trainable, train_step  # noqa: E402


@dataclass
class TinyConfig(engine.RunArgs):
    """A constant-lr language model on token shards: the smallest stage."""

    data: str = "data"  # token shards
    batch_size: int = 4  # sequences per step and rank
    seq_len: int = 32  # tokens per sequence


def main(argv: list[str]) -> dict:
    cfg = parse_config(TinyConfig, argv)
    ctx = engine.Context(*setup_distributed(cfg.device))
    torch.manual_seed(cfg.seed)
    raw = GPT(dataclasses.replace(MODEL_PRESETS["tiny"](), block_size=cfg.seq_len))
    loader, val = (TokenLoader(cfg.data, split, cfg.batch_size, cfg.seq_len, ctx.rank, ctx.world, cfg.seed, ctx.device)
                   for split in ("train", "val"))
    checkpointer = engine.Checkpointer(cfg, ctx.rank, ctx.world, provenance(ctx.device, ctx.world))
    found = checkpointer.find()
    built = build_trainable(raw, cfg, ctx.device, use_compile=False, verbose=False)
    parts = {"loader": loader, "tokens": engine.TokenCount()}
    start = checkpointer.restore(found[1], raw, built.optimizer, parts) if found else 0
    log = trackers.open_run_log(cfg, start if found else None, checkpointer.rewinding, ctx.rank, ctx.world)

    def step_fn(step: int) -> dict:
        loss, norm = train_step(built.model, built.optimizer, loader.next_batch, 1, built.autocast, cfg.grad_clip)
        if ctx.world > 1:
            torch.distributed.all_reduce(loss)
        return {"loss": loss.item() / ctx.world, "lr": cfg.max_lr, "grad_norm": norm.item(),
                "tokens": cfg.batch_size * cfg.seq_len * ctx.world}

    nbytes = token_bytes(raw.config.vocab_size, ctx.device)

    def val_eval(step: int) -> dict:
        return {"val_loss": engine.val_metrics(built.model, val, 2, built.autocast, ctx.world, nbytes)["loss"]}

    run = engine.Run(cfg=cfg, ctx=ctx, step_fn=step_fn, raw=raw, trainable=built, checkpointer=checkpointer,
                     log=log, evals=[engine.Eval("val", 3, val_eval)], parts=parts, start_step=start,
                     resumed=found is not None)
    with run.stop:
        result = engine.train(run)
    if ctx.world > 1:
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1:]), lambda result: 1 if result.get("stopped") == "nan" else 0)
