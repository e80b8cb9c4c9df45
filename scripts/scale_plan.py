"""The arithmetic of docs/scale.md: per-GPU bytes, pipeline bubble, FLOPs and days for gpt2-xl, a 13B and GPT-3
175B at the layouts that page recommends, from model.py's own accounting (num_params, flops_per_token) and the
activation bytes per layer this script measures on the CPU. No GPU involved; every figure is arithmetic.

    python scripts/scale_plan.py            # the tables in docs/scale.md
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import GPT, Block, GPTConfig  # noqa: E402

H100_BF16 = 989e12  # FLOP/s, dense bf16, SXM
TOKENS, GPUS, GB = 300e9, 1024, 1e9


@dataclasses.dataclass
class Plan:
    name: str
    config: GPTConfig
    pp: int
    tp: int
    dp: int
    micro: int  # sequences per micro-batch
    accum: int  # micro-batches per step and pipeline (gradient accumulation)
    sp: bool  # --sequence-parallel
    recompute: bool  # --recompute block


PLANS = [
    Plan("gpt2-xl", GPTConfig(block_size=1024, n_layer=48, n_head=25, n_embd=1600), 1, 1, 1024, 1, 1, False, False),
    Plan("13B", GPTConfig(block_size=2048, n_layer=40, n_head=40, n_embd=5120), 1, 8, 128, 2, 4, True, False),
    Plan("GPT-3 175B", GPTConfig(block_size=2048, n_layer=96, n_head=96, n_embd=12288), 16, 8, 8, 1, 192, True,
         False),
]


def activation_bytes_per_token(width: int = 512) -> float:
    """Bytes one block saves for backward per token, over its width: bf16 autocast, SDPA, this model's own block."""
    config = GPTConfig(block_size=256, n_layer=1, n_head=width // 64, n_embd=width, vocab_size=512)

    def saved(batch: int) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        x = torch.randn(batch, 256, width, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            Block(config, 0)(x)
        return sum(storages.values())

    return (saved(4) - saved(2)) / (2 * 256) / width  # the weights' casts cancel: per token alone


def memory(plan: Plan, per_token: float) -> dict[str, float]:
    """GB on the heaviest GPU: the first pipeline stage (the embedding and the most micro-batches in flight)."""
    c = plan.config
    with torch.device("meta"):
        block = sum(p.numel() for p in Block(c, 0).parameters())
    stage = (c.n_layer // plan.pp * block + c.vocab_size * c.n_embd + c.block_size * c.n_embd) / plan.tp
    sharded = 16 * stage / plan.dp  # fp32 weights 4, gradients 4, AdamW's two moments 8: FSDP2 over dp
    # --tp/--pp shards hold their bf16 weights gathered for the step and their gradients between micro-steps, which
    # FSDP2 accumulates unsharded in its reduce dtype, fp32 (FSDPParam.to_accumulated_grad_if_needed); plain FSDP2
    # gathers a block or two at a time
    held = (2 + 4) * stage if plan.tp * plan.pp > 1 else 2 * 2 * block
    tokens, t = plan.micro * c.block_size, plan.tp
    # bytes a block saves per token and width: measured (GELU, bf16); under TP the norms' and matmuls' inputs stay
    # whole (12 of them), the rest splits; sequence parallel splits the norms' 8 too
    replicated = 4 if plan.sp else 12
    layer = tokens * c.n_embd * (replicated + (per_token - replicated) / t) if t > 1 else tokens * c.n_embd * per_token
    kept = tokens * c.n_embd * 4 / (t if plan.sp else 1)  # --recompute block keeps the fp32 block input alone
    acts = c.n_layer * (kept if plan.recompute else layer) + (layer if plan.recompute else 0)  # 1F1B: L layers' worth
    logits = tokens * c.vocab_size / t * 10  # bf16 logits, their fp32 copy and gradient (last stage; same order)
    return {"states": sharded / GB, "held": held / GB, "acts": acts / GB, "acts_recompute":
            (c.n_layer * kept + layer) / GB, "acts_full": c.n_layer * layer / GB, "logits": logits / GB,
            "total": (sharded + held + acts + logits) / GB}


def timing(plan: Plan) -> dict[str, float]:
    """FLOPs per token (model.py), the 1F1B bubble, and days for 300B tokens on 1,024 H100s at two MFUs."""
    with torch.device("meta"):
        gpt = GPT(plan.config)
    flops = gpt.flops_per_token(plan.config.block_size)
    bubble = (plan.pp - 1) / (plan.accum + plan.pp - 1)
    days = {mfu: TOKENS * flops / (GPUS * H100_BF16 * mfu) / 86400 for mfu in (0.30, 0.45)}
    batch = plan.micro * plan.accum * plan.dp * plan.config.block_size
    return {"params": gpt.num_params(non_embedding=False), "flops": flops, "bubble": bubble, "days30": days[0.30],
            "days45": days[0.45], "batch": batch, "steps": TOKENS / batch}


def main() -> None:
    per_token = activation_bytes_per_token()
    print(f"activations: {per_token:.1f} bytes per token per width per block (bf16, measured on the CPU)\n")
    for plan in PLANS:
        assert plan.pp * plan.tp * plan.dp == GPUS, plan.name
        m, t = memory(plan, per_token), timing(plan)
        print(f"{plan.name}: {t['params'] / 1e9:.2f}B params, {t['flops'] / 1e9:.1f} GFLOP/token; pp {plan.pp} x tp "
              f"{plan.tp} x dp {plan.dp}, micro-batch {plan.micro} x {plan.config.block_size}, {plan.accum} "
              f"micro-batches, {t['batch'] / 1e6:.2f}M tokens/step, {t['steps']:,.0f} steps")
        print(f"  per GPU: states {m['states']:.2f} GB + held {m['held']:.2f} + activations {m['acts']:.2f} (all "
              f"stored {m['acts_full']:.2f}, --recompute block {m['acts_recompute']:.2f}) + logits {m['logits']:.2f}"
              f" = {m['total']:.1f} GB")
        print(f"  bubble {t['bubble']:.1%}; days for 300B tokens: {t['days30']:.1f} at 30% MFU, {t['days45']:.1f} at "
              f"45%\n")


if __name__ == "__main__":
    main()
