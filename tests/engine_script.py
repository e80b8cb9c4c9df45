"""A second training script on the engine, as a new stage would write one: its own config (not train.py's), a
model, an objective, and the engine's parts built in a few lines, with resume, NaN recovery and DDP from the engine.

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
from common import parse_config, provenance, run_and_exit, setup_distributed  # noqa: E402
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
    rank, _, world, device = setup_distributed(cfg.device)
    torch.manual_seed(cfg.seed)
    raw = GPT(dataclasses.replace(MODEL_PRESETS["tiny"](), block_size=cfg.seq_len))
    loader = TokenLoader(cfg.data, "train", cfg.batch_size, cfg.seq_len, rank, world, cfg.seed, device)
    val = TokenLoader(cfg.data, "val", cfg.batch_size, cfg.seq_len, rank, world, cfg.seed, device)
    checkpointer = engine.Checkpointer(cfg, rank, world, provenance(device, world))
    found = checkpointer.find()
    built = build_trainable(raw, cfg, device, use_compile=False, verbose=False)
    parts = {"loader": loader, "tokens": engine.TokenCount()}
    start = checkpointer.restore(found[1], raw, built.optimizer, parts) if found else 0
    path = Path(cfg.out_dir) / "log.jsonl" if rank == 0 else None
    if path:  # the log holds the steps before `start`: a rewind's dropped ones kept aside until its first checkpoint
        engine.prepare_log(path, start if found else None, checkpointer.rewinding)[2]()
    log = engine.RunLog(path, rank == 0, cfg.max_steps)

    def step_fn(step: int) -> dict:
        loss, norm = train_step(built.model, built.optimizer, loader.next_batch, 1, built.autocast, cfg.grad_clip)
        if world > 1:
            torch.distributed.all_reduce(loss)
        return {"loss": loss.item() / world, "lr": cfg.max_lr, "grad_norm": norm.item(),
                "tokens": cfg.batch_size * cfg.seq_len * world}

    def val_eval(step: int) -> dict:
        return {"val_loss": engine.val_loss(built.model, val, 2, built.autocast, world)}

    run = engine.Run(step_fn=step_fn, raw=raw, trainable=built, checkpointer=checkpointer, log=log,
                     evaluator=engine.Evaluator([engine.Eval("val", 3, val_eval)], log, parts["tokens"]),
                     stop=engine.StopFlags(cfg.max_time, master=rank == 0, device=device, world=world),
                     profiler=engine.Profiler(False, start, 1, Path(cfg.out_dir)), parts=parts,
                     tokens=parts["tokens"], start_step=start, last_step=cfg.max_steps, resumed=found is not None,
                     rank=rank, world=world, device=device)
    with run.stop:
        result = engine.train(run)
    if world > 1:
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1:]), lambda result: 1 if result.get("stopped") == "nan" else 0)
