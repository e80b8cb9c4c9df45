"""Prune the blocks' matrices of a model, then recover its loss by training on the pretraining data, on the engine.

    magnitude   unstructured: the smallest |w|, over all the blocks' matrices (--scope global) or in each (layer)
    structured  whole attention heads (key-value groups under GQA) and MLP neurons, the same share in every block,
                cut out of the tensors (GPTConfig.head_size, mlp_hidden); --importance norm ranks a unit by its
                weights' L2 norm, taylor by |dL/dg| (g: a gate on its output, L: the loss on --calib-batches batches)
    2:4         the 2 smallest |w| of every 4 consecutive weights along each matrix's input dimension: 50% exactly

Through recovery the masks hold: pruned weights stay exactly 0 after every optimizer step (AdamW, Muon, 8-bit AdamW).
A checkpoint records the method, the sparsity and the masks ("pruning"); ckpt_000000.pt is the pruned model.

Usage:
    python prune.py --init-from out/demo/ckpt_000900.pt --method 2:4 --max-steps 150 --out-dir out/prune/2-4
    python prune.py --method 2:4 --out-dir out/prune/2-4 --max-steps 300 --resume auto   # recover further
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.nn as nn
from torch import Tensor

import engine
import stage
from chat_format import exported_chat, is_chat
from common import LOCAL, is_reward_model, load_checkpoint, provenance, run_and_exit, token_bytes
from engine import Context, Run
from fineweb import TokenLoader
from model import GPT, checkpoint_config
from parallel import check_counts, check_flags


@dataclasses.dataclass
class PruneConfig(engine.RunArgs):
    """Prune a checkpoint by magnitude, whole heads and neurons, or 2:4, then optionally recover; on the engine."""

    init_from: Annotated[str, LOCAL] = "out/demo/ckpt_000900.pt"  # the model to prune: a checkpoint, or an HF GPT-2
    method: str = "magnitude"  # magnitude, structured or 2:4
    sparsity: float = 0.5  # the share of the blocks' matrix weights to remove, in [0, 1) (2:4: 0.5 only)
    scope: str = "global"  # magnitude: one threshold over every matrix (global), or each matrix to --sparsity (layer)
    importance: str = "norm"  # structured: rank the units by weight norm, or taylor (the loss change; see above)
    calib_batches: int = 8  # --importance taylor: train batches whose mean loss scores the units
    data: Annotated[str, LOCAL] = "data/stdlib_docs"  # token shards: recovery trains on train, evaluates on val
    batch_size: int = 4  # B: sequences per micro-batch per rank
    seq_len: int = 0  # T: tokens per sequence (0: the model's context)
    grad_accum: int = 1  # micro-batches per optimizer step
    warmup_steps: int = 10  # linear warmup, then cosine decay to --min-lr-frac of --max-lr at --max-steps
    eval_every: int = 50  # val loss and the sparsity reached every N steps and at the end (0: at the end only)
    eval_tokens: int = 8192  # val tokens per evaluation (whole B*T windows, at most the split)
    # RunArgs's flags with pruning's defaults
    max_steps: int = 0  # recovery steps (0: prune, evaluate and save the pruned model)
    max_lr: float = 3e-4  # the recovery's peak learning rate
    ckpt_every: int = 0  # checkpoint every N steps (and at steps 0 and --max-steps); 0 = only those two
    out_dir: Annotated[str, LOCAL] = "out/prune"  # checkpoints and log.jsonl go here
    MIN_STEPS = 0  # not a flag: the least --max-steps RunArgs takes

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flags([
            (self.method in METHODS and self.scope in ("global", "layer") and self.importance in ("norm", "taylor"),
             f"--method must be one of {', '.join(METHODS)}, --scope global or layer, --importance norm or taylor; "
             f"got {self.method!r}, {self.scope!r}, {self.importance!r}"),
            (0 <= self.sparsity < 1 and (self.method != "2:4" or self.sparsity == 0.5),
             f"--sparsity must be in [0, 1), and 0.5 for --method 2:4 (2 of every 4 weights); got {self.sparsity}"),
            (self.seq_len >= 0, f"--seq-len must be >= 0 (0: the model's context); got {self.seq_len}"),
            (self.parallel != "fsdp", "--parallel fsdp shards each tensor, and the masks cover whole ones: use "
                                      "--parallel ddp or zero1")])
        check_counts(self, ("batch_size", "grad_accum", "calib_batches", "eval_tokens"))


# ----------------------------------------------------------------------------------------------------------------------
# The masks: what pruning removed, held through training


def matrices(model: nn.Module) -> dict[str, nn.Parameter]:
    """The blocks' 2-D weights, which pruning thins: attention and MLP matmuls, not embeddings, norms or biases."""
    return {name: p for name, p in model.named_parameters() if p.dim() == 2 and name.startswith("transformer.h.")}


class Pruning:
    """A checkpointed part: the record of what was pruned ({"method", "sparsity", "masks": name -> keep mask, "dense":
    the matrix weights and widths before any pruning}), whose masks it holds on an optimizer."""

    def __init__(self, model: nn.Module, record: dict[str, Any]):
        self.model = model
        self.load_state_dict(record)

    def state_dict(self) -> dict[str, Any]:
        return self.record

    def load_state_dict(self, record: dict[str, Any]) -> None:
        self.record, params = dict(record), matrices(self.model)
        self.pruned = [(params[n], ~keep.to(params[n].device)) for n, keep in record["masks"].items()]

    @torch.no_grad()
    def hold(self) -> None:
        """Zero the pruned weights."""
        for p, pruned in self.pruned:
            p.masked_fill_(pruned, 0.0)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        # gradients masked as backward makes them (so clipping and the logged norm count only the weights kept, and
        # AdamW's moments stay 0), weights after each step (Muon's update is dense)
        for i, (p, _) in enumerate(self.pruned):
            p.register_hook(lambda g, i=i: g.masked_fill(self.pruned[i][1], 0.0))
        optimizer.register_step_post_hook(lambda *_: self.hold())

    def sparsity(self) -> float:
        """The share of the dense model's matrix weights that are zero now, or cut out."""
        nonzero = sum(int(p.count_nonzero()) for p in matrices(self.model).values())
        return 1.0 - nonzero / self.record["dense"]["weights"]


# ----------------------------------------------------------------------------------------------------------------------
# The three methods


def magnitude_masks(model: GPT, sparsity: float, scope: str) -> dict[str, Tensor]:
    """Keep masks, False at the smallest |w|: over all the matrices at once (global), or in each one (layer)."""
    mats = {name: p.detach().abs() for name, p in matrices(model).items()}
    masks = {}
    for names in [[name] for name in mats] if scope == "layer" else [list(mats)]:
        flat = torch.cat([mats[name].flatten() for name in names])
        keep = torch.ones_like(flat, dtype=torch.bool)
        keep[flat.topk(round(sparsity * flat.numel()), largest=False).indices] = False
        sizes = [mats[name].numel() for name in names]
        masks |= {name: k.view_as(mats[name]) for name, k in zip(names, keep.split(sizes), strict=True)}
    return masks


def two_four_masks(model: GPT) -> dict[str, Tensor]:
    masks = {}
    for name, p in matrices(model).items():
        if p.size(1) % 4:
            raise ValueError(f"--method 2:4 takes 4 weights at a time along a matrix's input dimension, and {name} is "
                             f"{tuple(p.shape)}: {p.size(1)} inputs; use --method magnitude or structured")
        groups = p.detach().abs().view(-1, 4)
        masks[name] = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(2).indices, True).view_as(p)
    return masks


def block_scores(block: nn.Module, cfg: Any, importance: str) -> tuple[Tensor, Tensor]:
    """(each key-value group's score, each MLP neuron's) in one block; taylor reads the gradients already there."""
    groups, hidden = cfg.kv_heads, block.mlp.c_proj.in_features
    rows = lambda w, n: w.reshape(n, -1).sum(1)  # per unit: the sum over its rows, or its columns
    cols = lambda w, n: w.t().reshape(n, -1).sum(1)
    attn_out, mlp_out = block.attn.c_proj.weight, block.mlp.c_proj.weight
    if importance == "taylor":  # sum(w * dL/dw) over a unit's output columns is dL/dg exactly
        return cols(attn_out * attn_out.grad, groups).abs(), cols(mlp_out * mlp_out.grad, hidden).abs()
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, groups * cfg.head_dim
    q, k, v = block.attn.c_attn.weight.pow(2).split([q_dim, kv_dim, kv_dim])
    fc = block.mlp.c_fc.weight.pow(2).view(-1, hidden, block.mlp.c_fc.in_features).sum(0)  # SwiGLU: gate + up
    heads = rows(q, groups) + rows(k, groups) + rows(v, groups) + cols(attn_out.pow(2), groups)
    return heads.sqrt(), (rows(fc, hidden) + cols(mlp_out.pow(2), hidden)).sqrt()


def shrink(model: GPT, keep: list[tuple[Tensor, Tensor]]) -> GPT:
    """A smaller GPT holding only the kept (key-value groups, neurons) of each block, in their order."""
    cfg, sd = model.config, model.state_dict()
    hs, groups, rep = cfg.head_dim, cfg.kv_heads, cfg.n_head // cfg.kv_heads
    span = lambda units, width: (units[:, None] * width + torch.arange(width, device=units.device)).flatten()
    fc, hidden = model.transformer.h[0].mlp.c_fc.out_features, model.transformer.h[0].mlp.c_proj.in_features
    q_dim = cfg.n_head * hs
    for i, (kept, neurons) in enumerate(keep):
        q_rows, kv_rows, at = span(span(kept, rep), hs), span(kept, hs), f"transformer.h.{i}."
        rows = {"attn.c_attn": torch.cat([q_rows, q_dim + kv_rows, q_dim + groups * hs + kv_rows]),
                "mlp.c_fc": torch.cat([neurons + hidden * half for half in range(fc // hidden)])}  # SwiGLU: 2 halves
        sd.update({key: sd[key][index] for name, index in rows.items()
                   for key in (f"{at}{name}.weight", f"{at}{name}.bias") if key in sd})
        for name, index in {"attn.c_proj": q_rows, "mlp.c_proj": neurons}.items():  # their input columns
            sd[f"{at}{name}.weight"] = sd[f"{at}{name}.weight"][:, index]
    kept = len(keep[0][0])
    small = GPT(dataclasses.replace(cfg, n_head=kept * rep, n_kv_head=kept, head_size=hs, mlp_hidden=len(keep[0][1])))
    small.load_state_dict(sd)
    return small.to(model.lm_head.weight.device)


def structured(model: GPT, cfg: PruneConfig, dense: dict[str, int], calib: TokenLoader) -> tuple[GPT, dict]:
    """Keep round((1 - sparsity) * n) of each block's dense key-value groups and MLP neurons, those scored highest;
    no masks: the smaller tensors are the pruning."""
    if cfg.importance == "taylor":  # the gradient of the mean loss over --calib-batches batches (dropout off)
        model.eval()
        for _ in range(cfg.calib_batches):
            (model(*calib.next_batch())[1] / cfg.calib_batches).backward()
        model.train()
    with torch.no_grad():
        scores = [block_scores(block, model.config, cfg.importance) for block in model.transformer.h]
    model.zero_grad(set_to_none=True)
    n_groups, n_neurons = (max(1, round((1 - cfg.sparsity) * dense[k])) for k in ("groups", "hidden"))
    keep = [(g.topk(n_groups).indices.sort().values, n.topk(n_neurons).indices.sort().values) for g, n in scores]
    return shrink(model, keep), {}


# each (model, cfg, dense, calib) -> (the pruned model, its masks)
METHODS = {"magnitude": lambda model, cfg, *_: (model, magnitude_masks(model, cfg.sparsity, cfg.scope)),
           "structured": structured, "2:4": lambda model, *_: (model, two_four_masks(model))}


def prune(model: GPT, record: dict | None, cfg: PruneConfig, calib: TokenLoader) -> tuple[GPT, dict[str, Any]]:
    """The pruned model and its record; a record given (a checkpoint pruned before, by this method) is pruned further,
    --sparsity counting from the dense model, and its masks kept."""
    old = record or {}
    dense = old.get("dense") or {"weights": sum(p.numel() for p in matrices(model).values()),
                                 "groups": model.config.kv_heads,
                                 "hidden": model.transformer.h[0].mlp.c_proj.in_features}
    model, masks = METHODS[cfg.method](model, cfg, dense, calib)
    masks = {name: (keep & old.get("masks", {}).get(name, keep).to(keep.device)).cpu() for name, keep in masks.items()}
    how = {"magnitude": {"scope": cfg.scope}, "structured": {"importance": cfg.importance}}.get(cfg.method, {})
    record = {"method": cfg.method, "sparsity": cfg.sparsity, **how, "masks": masks, "dense": dense}
    Pruning(model, record).hold()
    return model, record


# ----------------------------------------------------------------------------------------------------------------------
# Recovery on the engine (its step is pretraining's, stage.lm_step): setup


def start_model(cfg: PruneConfig, found: tuple[Path, dict] | None) -> tuple[GPT, dict | None, str, bool]:
    """The model, its pruning record (None: unpruned), its source and whether it speaks chat (export.py then keeps the
    chat tokens): the resumed checkpoint's shape, or --init-from's weights; refused if this run cannot extend it."""
    source = f"--resume {found[0]}" if found else f"--init-from {cfg.init_from}"
    if found:
        stage.check_resume(found, cfg)
        ckpt, model = found[1], GPT(checkpoint_config(found[1], source))
    elif not (path := stage.check_not_run_dir(cfg.init_from)).is_file():  # HF GPT-2: a chat model's if export.py says
        ckpt, model = {"chat": exported_chat(cfg.init_from)}, GPT.load(None, cfg.init_from)
    else:
        ckpt = load_checkpoint(path, mmap=True)
        if is_reward_model(ckpt):  # rl.py and export.py would read it as a policy
            raise ValueError(f"{source} is a reward model: recovery trains a language model's loss, not its "
                             "score, and its checkpoint would be read as a language model (by rl.py, export.py); "
                             "prune a policy")
        # a PPO policy's critic dropped: recovery trains no value head (DDP stops on a parameter without a gradient)
        model = GPT.from_checkpoint(ckpt, value_head=False)
    record, context = ckpt.get("pruning"), model.config.block_size
    old = record or {"method": cfg.method, "sparsity": cfg.sparsity}  # unpruned: nothing to mix or undo
    check_flags([(bool(record) or not found,
                  f"{source} holds no pruned model: pass it as --init-from, with another --out-dir"),
                 (old["method"] == cfg.method,
                  f"{source} was pruned by --method {old['method']}, which --method {cfg.method} cannot extend: pass "
                  f"--method {old['method']}, or start from the unpruned checkpoint"),
                 (old.get("scope", cfg.scope) == cfg.scope or cfg.method != "magnitude",  # the other's zeros stay
                  f"{source} was pruned with --scope {old.get('scope')}: pass --scope {old.get('scope')} (its zeros "
                  f"stay, so under --scope {cfg.scope} some matrices would end past --sparsity {cfg.sparsity})"),
                 (cfg.sparsity == old["sparsity"] or cfg.sparsity > old["sparsity"] and not found,
                  f"{source} is pruned to --sparsity {old['sparsity']}: pass --sparsity {old['sparsity']} (more "
                  "prunes it further, in a new run from it)"),
                 (cfg.seq_len <= context,  # before anything is written: the first evaluation would fail
                  f"--seq-len {cfg.seq_len} is longer than {source}'s context of {context} tokens; pass --seq-len "
                  f"{context} or less (0: the model's)")])
    return model, record, source, is_chat(ckpt)


def setup(cfg: PruneConfig, ctx: Context) -> Run:
    """Prune (or find the checkpoint to resume), then the Run: the masks held on the optimizer, val loss evaluated."""
    rank, world, device = ctx.rank, ctx.world, ctx.device
    checkpointer = engine.Checkpointer(cfg, rank, world, provenance(device, world))
    found = checkpointer.find()
    cfg = engine.resumed_start(cfg, found, ctx)  # without --init-from: its run's, not the default (header, notes)
    raw, record, source, checkpointer.chat = start_model(cfg, found)
    cfg = checkpointer.args = dataclasses.replace(cfg, seq_len=cfg.seq_len or raw.config.block_size)  # as saved
    B, T = cfg.batch_size, cfg.seq_len
    train_loader, val_loader = (TokenLoader(cfg.data, split, B, T, rank, world, cfg.seed, device)
                                for split in ("train", "val"))
    raw = raw.to(device)
    if not found:  # the same on every rank, as are the weights and the calibration batches (rank 0's)
        raw, record = prune(raw, record, cfg, TokenLoader(cfg.data, "train", B, T, 0, 1, cfg.seed + 1, device))
    engine.agree_fingerprint(lambda: {"command": engine.command_of(cfg), "model": raw.config, "weights": None if found
                                      else engine.weights_digest(raw)}, rank, world, source)  # a resume's: find's
    torch.manual_seed(cfg.seed + rank)
    pruning = Pruning(raw, record)
    guard = engine.SpikeGuard(world=world)
    parts = {"loader": train_loader, "outliers": guard, "pruning": pruning}
    built, start = stage.build_and_resume(raw, parts, cfg, ctx, checkpointer, found)
    pruning.attach(built.optimizer)
    if not found and not cfg.eval_only:
        checkpointer.save(0, raw, built.optimizer, parts)  # the pruned model, before any recovery
    log = engine.open_log(cfg, raw, built, ctx, checkpointer, found, start)
    params, nonzero = (sum(f(p) for p in raw.parameters()) for f in (Tensor.numel, lambda p: int(p.count_nonzero())))
    log.say(f"{cfg.method}: {pruning.sparsity():.1%} of the blocks' {record['dense']['weights']:,} matrix weights "
            f"pruned, {source}; {params:,} parameters, {nonzero:,} nonzero")
    windows = min(-(-cfg.eval_tokens // (B * T)), val_loader.num_windows)
    nbytes = token_bytes(raw.config.vocab_size, device)

    def val(step: int) -> dict[str, Any]:
        vl = engine.val_metrics(built.model, val_loader, windows, built.autocast, world, nbytes)
        log.say(f"step {step:6d} | val loss {vl['loss']:.4f} | bpb {vl['bpb']:.4f} | sparsity {pruning.sparsity():.4f}")
        return {"val_loss": vl["loss"], "val_bpb": vl["bpb"], "sparsity": pruning.sparsity()}

    return Run(cfg=cfg, ctx=ctx, step_fn=stage.lm_step(cfg, built, train_loader.next_batch, cfg.grad_accum, guard, ctx),
               raw=raw, trainable=built, checkpointer=checkpointer, log=log,
               evals=[engine.Eval("val", cfg.eval_every, val)], parts=parts, start_step=start,
               resumed=found is not None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line (or a list of flags): parse, prune, recover. A user error is one line and exit code 1."""
    return stage.main(PruneConfig, argv, {}, setup, __doc__)


if __name__ == "__main__":
    run_and_exit(main, stage.exit_code)
