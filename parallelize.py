"""Tensor and pipeline parallelism for the GPT, applied from outside the model as torchtitan does, on one DeviceMesh
of pp x dp x tp ranks. --tp is Megatron's split through torch.distributed.tensor.parallel: attention by whole heads
(GQA's key-value heads too), the MLP column- then row-wise, the tied embedding and head by vocabulary with torch's
vocab-parallel loss; --sequence-parallel splits the norms by sequence. --pp gives each stage contiguous blocks under
torch.distributed.pipelining, the gradient accumulation's micro-steps as its micro-batches. FSDP2 shards over dp.
A checkpoint stays the GPT's full state on any layout (Sharded.full_state and local_state convert).

    shard(gpt, args, device, dtype)  this rank's Sharded part: train_step and val_loss call it as they call a GPT
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from common import same_verdict, shared_problem
from fused_ce import cross_entropy
from model import GPT, MLP, GPTConfig

# --pp-schedule -> torch.distributed.pipelining's schedule for training, for evaluation's single micro-batch, and the
# stages per rank (interleaved 1F1B gives rank r stages r and r + pp)
SCHEDULES = {"1f1b": ("Schedule1F1B", "ScheduleGPipe", 1), "gpipe": ("ScheduleGPipe", "ScheduleGPipe", 1),
             "interleaved-1f1b": ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", 2)}


def degrees(args: Any) -> tuple[int, int]:
    """(tensor-parallel, pipeline-parallel) ranks: --tp and --pp, where 0 (off) is 1."""
    return max(args.tp, 1), max(args.pp, 1)


def flag_checks(args: Any) -> list[tuple[bool, str]]:
    """(ok, message) of each rule on StepArgs' --tp/--pp; shard_problem checks what needs the model and the world."""
    alone = not (args.tp or args.pp)  # nothing sharded
    return [(args.tp >= 0 and args.pp >= 0, f"--tp and --pp must be >= 0 (0: off); got {args.tp} and {args.pp}"),
            (args.pp_schedule in SCHEDULES,
             f"--pp-schedule must be one of {', '.join(SCHEDULES)}; got {args.pp_schedule!r}"),
            (args.pp != 1 or args.pp_schedule != "interleaved-1f1b",  # torch's eval of two adjacent local stages fails
             "--pp-schedule interleaved-1f1b interleaves stages over the --pp ranks: use --pp 2 or more, or 1f1b"),
            (args.tp or not args.sequence_parallel,
             "--sequence-parallel splits the norms over the --tp ranks: pass --tp"),
            (args.pp or args.pp_schedule == "1f1b", f"--pp-schedule {args.pp_schedule} needs --pp stages: pass --pp"),
            (alone or args.parallel != "zero1", "--parallel zero1 keeps a whole model's optimizer state on a rank, not "
                                                "a shard's: use --parallel fsdp"),
            (alone or args.optimizer == "adamw", f"--optimizer {args.optimizer} needs whole matrices or its own state "
                                                 "format: use --optimizer adamw with --tp/--pp"),
            (alone or args.dtype != "fp16", "--dtype fp16's GradScaler does not run under --tp/--pp: use bf16"),
            (alone or args.compile is not True,
             "--compile true is not wired for --tp/--pp: drop it (shards run eager)")]


def shard_problem(args: Any, config: GPTConfig, world: int) -> str | None:
    """Why this model cannot be split as args say over `world` ranks, or None."""
    tp, pp = degrees(args)
    ranks, stages = tp * pp, pp * SCHEDULES[args.pp_schedule][2]
    with torch.device("meta"):
        hidden = MLP(config).c_proj.in_features
    unsharded = [way for way, on in {"--fused-gelu false": config.fused_gelu, "--fused-ce false": config.fused_ce,
                                     "--loss-chunk 0": config.loss_chunk}.items() if on]  # each with its off setting
    checks = [(world % ranks, f"--tp {tp} x --pp {pp} = {ranks} ranks must divide the world size {world}: launch "
                              f"torchrun with a multiple of {ranks} processes"),
              (config.n_head % tp or config.kv_heads % tp, f"--tp {tp} must divide the {config.n_head} heads and the "
                                                           f"{config.kv_heads} key-value heads: use a divisor of both"),
              (config.vocab_size % tp or hidden % tp,
               f"--tp {tp} must divide the vocabulary ({config.vocab_size} rows) and the MLP width ({hidden}); an HF "
               "GPT-2's 50,257 rows (29 x 1733) divide by no --tp: fine-tune it with --pp or --parallel fsdp"),
              (stages > config.n_layer, f"--pp {pp} with --pp-schedule {args.pp_schedule} makes {stages} stages of "
                                        f"the {config.n_layer} blocks: lower --pp"),
              (unsharded, f"--fused-gelu, --fused-ce and --loss-chunk do not shard: pass {', '.join(unsharded)} "
                          "with --tp/--pp (a preset or an --init-from checkpoint may set them)"),
              (tp > 1 and config.dropout > 0, "--dropout under --tp draws other masks on each tensor-parallel rank: "
                                              "use --dropout 0"),
              (config.value_head, "a value head does not shard: --tp/--pp train the language model only"),
              (world // ranks > 1 and args.parallel != "fsdp",
               f"--tp/--pp over {world // ranks} data-parallel ranks shard them with FSDP2: pass --parallel fsdp")]
    return next((why for bad, why in checks if bad), None)


def data_rank(args: Any, rank: int, world: int) -> tuple[int, int]:
    """(this rank's data-parallel rank, their number): a tensor and pipeline group reads one batch."""
    tp, pp = degrees(args)
    dp = max(world // (tp * pp), 1)  # 0 only for a world shard_problem refuses
    return rank // tp % dp, dp


def local(t: Any) -> Any:
    """This rank's plain tensor of t."""
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's (not imported here unless a run shards)


# ----------------------------------------------------------------------------------------------------------------------
# The fused matrices' rows reordered so that each tensor-parallel rank's contiguous share holds whole heads


def fused_parts(name: str, config: GPTConfig, rows: int) -> list[int] | None:
    """The row counts of the pieces a fused matrix (or its bias, or their optimizer moments) stacks, or None."""
    q, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim  # q: n_embd unless pruned
    parts = {"attn.c_attn": [q, kv, kv], "mlp.c_fc": [rows // 2] * 2 * (config.mlp == "swiglu")}
    return next((p for k, p in parts.items() if name.endswith((f"{k}.weight", f"{k}.bias")) and p), None)


def reorder(name: str, t: Any, config: GPTConfig, tp: int, inverse: bool = False) -> Any:
    """t's rows as tp ranks hold them, [q0 k0 v0 | q1 k1 v1] for tp = 2 (inverse: back to [q | k | v])."""
    if not (torch.is_tensor(t) and t.dim() and tp > 1 and (parts := fused_parts(name, config, len(t)))):
        return t
    starts = itertools.accumulate([0, *parts[:-1]])
    order = torch.cat([torch.arange(s, s + n).view(tp, -1) for s, n in zip(starts, parts, strict=True)], 1).flatten()
    return t[order.argsort() if inverse else order]


# ----------------------------------------------------------------------------------------------------------------------
# A pipeline stage: the GPT's own modules for blocks [lo, hi), under the GPT's names


class Stage(nn.Module):
    """Blocks lo..hi-1 of a GPT, with its embedding when lo is 0 and its final norm and head when hi is the last.
    forward: token ids (first stage) or hidden states in; hidden states, or logits (last stage), out."""

    def __init__(self, gpt: GPT, lo: int, hi: int):
        super().__init__()
        t, self.config = gpt.transformer, gpt.config
        self.first, self.last = lo == 0, hi == gpt.config.n_layer
        keep = {"wte": self.first, "wpe": self.first, "drop": self.first, "ln_f": self.last}
        known = {"", "transformer", "lm_head", "value_head", "rope_cos", "rope_sin",
                 *(f"transformer.{k}" for k in [*keep, "h"])}  # as forward
        # each module's, parameter's and buffer's owner: transformer.X or the GPT's own X
        owners = [".".join(n.split(".")[:1 + n.startswith("transformer.")]) for n, _ in
                  [*gpt.named_modules(), *gpt.named_parameters(), *gpt.named_buffers()]]
        if unknown := [n for n in owners if n not in known]:  # left out, it would train a model without it
            raise ValueError(f"--tp/--pp run the model as parallelize.Stage, which carries GPT's wte, wpe, drop, "
                             f"blocks, ln_f and lm_head only: add {unknown[0]} to Stage's __init__ and forward")
        self.transformer = nn.ModuleDict({k: m for k, m in t.items() if keep.get(k)})
        self.transformer["h"] = nn.ModuleDict({str(i): t.h[i] for i in range(lo, hi)})
        self.lm_head = gpt.lm_head if self.last else None
        self.register_buffer("rope_cos", getattr(gpt, "rope_cos", None), persistent=False)
        self.register_buffer("rope_sin", getattr(gpt, "rope_sin", None), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        t, T = self.transformer, x.size(1)
        if self.first:
            x = t.drop(t.wte(x) + (t.wpe(torch.arange(T, device=x.device)) if "wpe" in t else 0))
            if self.config.half_residual and torch.is_autocast_enabled(x.device.type):  # as GPT.forward's stream
                x = x.to(torch.get_autocast_dtype(x.device.type))
        rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.rope_cos is not None else None
        for block in t.h.values():
            x = block(x, rope)
        return self.lm_head(t.ln_f(x)) if self.last else x


def tensor_parallel(stage: Stage, mesh: DeviceMesh, sp: bool) -> None:
    """Megatron's plan on the stage's modules, every other parameter replicated. Between blocks the residual stream
    is a DTensor (replicated, or split by sequence); in a block's attention and MLP each rank computes its heads'
    plain part; stages exchange plain, whole tensors."""
    # DTensor's modules, here and in Sharded's methods: 0.8 s of imports that a run without --tp/--pp never needs
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor import parallel as tp
    seq, whole = Shard(1) if sp else Replicate(), Replicate()
    blocks = list(stage.transformer.h)
    block = {"attn.c_attn": tp.ColwiseParallel(), "mlp.c_fc": tp.ColwiseParallel(),
             "attn.c_proj": tp.RowwiseParallel(output_layouts=seq, use_local_output=False),
             "mlp.c_proj": tp.RowwiseParallel(output_layouts=seq, use_local_output=False)}
    block |= {"ln_1": tp.SequenceParallel(), "ln_2": tp.SequenceParallel(),
              "attn": tp.PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(whole, None, None)),
              "mlp": tp.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,))} if sp else {}
    plan = {f"transformer.h.{i}.{name}": style for i in blocks for name, style in block.items()}
    plan |= {"transformer.wte": tp.RowwiseParallel(input_layouts=whole, output_layouts=whole),  # by vocabulary
             "transformer.wpe": tp.PrepareModuleInputOutput(input_layouts=whole, desired_input_layouts=whole,
                                                            output_layouts=whole, desired_output_layouts=whole),
             "transformer.drop": tp.PrepareModuleInput(input_layouts=whole, desired_input_layouts=seq,
                                                       use_local_output=False),
             f"transformer.h.{blocks[0]}": tp.PrepareModuleInput(input_layouts=(whole, None),
                                                                 desired_input_layouts=(seq, None),
                                                                 use_local_output=False),
             "lm_head": tp.ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if not stage.last:  # sent on as a plain tensor, whole
        plan[f"transformer.h.{blocks[-1]}"] = tp.PrepareModuleOutput(output_layouts=seq, desired_output_layouts=whole)
    plan |= {"transformer.ln_f": tp.SequenceParallel()} if sp else {}
    # inside attention and the MLP a rank computes on its plain share of heads: a parameter no style splits would meet
    # it as a DTensor (a block's own parameters see the DTensor residual stream, so replication is right there)
    split = [name for name in block if "." in name]
    for name, _ in stage.named_parameters():
        inner = name.split(".", 3)[3:]  # a block's parameter's name in the block
        if inner and inner[0].startswith(("attn.", "mlp.")) and inner[0].rpartition(".")[0] not in split:
            raise ValueError(f"--tp cannot split {name}: inside attention and the MLP a rank holds only its heads and "
                             f"hidden units, and the plan in parallelize.py's tensor_parallel lists {', '.join(split)} "
                             "there; add its module to that plan (docs/scale.md), or use --pp or --parallel fsdp")
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.copy_(reorder(name, p, stage.config, mesh.size()))
    modules = dict(stage.named_modules())
    tp.parallelize_module(stage, mesh, {name: style for name, style in plan.items() if name in modules})
    if stage.first and stage.last:
        stage.transformer.wte.weight = stage.lm_head.weight  # tied again: each plan made its own DTensor
    for module in stage.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                module.register_parameter(name, nn.Parameter(DTensor.from_local(p.detach(), mesh, [Replicate()],
                                                                                 run_check=False)))


def fully_shard_model(model: nn.Module, blocks: Iterable[nn.Module], dtype: torch.dtype, **options: Any) -> None:
    """FSDP2 on each block, then on the model's other parameters: gathered in the compute dtype (half the all-gather
    traffic in bf16), gradients reduced in fp32."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.5 keeps FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mp_policy=mp, **options)
    fully_shard(model, mp_policy=mp, **options)


def shard(gpt: GPT, args: Any, device: torch.device, dtype: torch.dtype) -> Sharded:
    """This rank's part of gpt (every rank built it whole, from the same seed) on the mesh args.tp and args.pp make."""
    if not dist.is_initialized():  # one process (--tp 1 / --pp 1): a group of its own, which stage.run ends
        dist.init_process_group(dist.Backend.default_device_backend_map[device.type], store=dist.HashStore(), rank=0,
                                world_size=1)
    # the same verdict on every rank: a node's own --init-from may set a run option (--loss-chunk) the others lack
    if why := shared_problem(shard_problem(args, gpt.config, world := dist.get_world_size()), world):
        raise ValueError(why)
    tp, pp = degrees(args)
    mesh = init_device_mesh(device.type, (pp, world // (tp * pp), tp), mesh_dim_names=("pp", "dp", "tp"))
    chunks = SCHEDULES[args.pp_schedule][2]
    n = pp * chunks
    stage_ids = [mesh["pp"].get_local_rank() + k * pp for k in range(chunks)]
    bounds = [round(i * gpt.config.n_layer / n) for i in range(n + 1)]
    stages = [Stage(gpt, bounds[i], bounds[i + 1]) for i in stage_ids]
    for stage in stages:
        if args.tp:  # 1 too: the same DTensor code on one rank; a refusal stops every rank together, each saying why
            same_verdict(lambda s=stage: tensor_parallel(s, mesh["tp"], args.sequence_parallel), world)
        # FSDP2 over the dp ranks, gathered once a step, not once a micro-batch (the schedule keeps them through its
        # backwards), as torchtitan does under pipelining
        if args.parallel == "fsdp":
            fully_shard_model(stage, stage.transformer.h.values(), dtype, mesh=mesh["dp"], reshard_after_forward=False)
    return Sharded(gpt.config, stages, stage_ids, n, mesh, args.pp_schedule, device)


# ----------------------------------------------------------------------------------------------------------------------
# This rank's part of the model, called as a GPT is


class Sharded(nn.Module):
    """This rank's stages of the model on its mesh, run by torch's pipeline schedules (one stage alone too).
    model(x, y) is the mean loss on every rank, as a GPT's; forward_backward is train_step's micro-steps and clip;
    full_state / local_state convert checkpoints."""

    configure_optimizers = GPT.configure_optimizers  # weight decay on the 2-D tensors, as the GPT's

    def __init__(self, config: GPTConfig, stages: list[Stage], stage_ids: list[int], n_stages: int, mesh: DeviceMesh,
                 schedule: str, device: torch.device):
        super().__init__()
        self.config, self.stages, self.mesh, self.device = config, nn.ModuleList(stages), mesh, device
        self.stage_ids, self.n_stages, self.schedule_name = stage_ids, n_stages, schedule
        self.pp, self.tp, self.pp_group = mesh["pp"].size(), mesh["tp"].size(), mesh.get_group("pp")
        self.holds_first, self.schedules = stages[0].first, {}
        self.tie_group = None  # the first and last stages' ranks, whose copies of the tied matrix add their gradients
        if self.pp > 1:
            ranks = mesh.mesh.flatten(1).t()  # (dp * tp, pp) global ranks
            self.tie_group, _ = dist.new_subgroups_by_enumeration([[int(r[0]), int(r[-1])] for r in ranks])
        with torch.device("meta"):  # the whole model's accounting, as a GPT's (a plain attribute: no submodule)
            whole = GPT(config)
        self.num_params, self.flops_per_token = whole.num_params, whole.flops_per_token

    def schedule(self, micro_batches: int, train: bool) -> Any:
        """The pipeline schedule over this rank's stages for this many micro-batches (training's, or evaluation's)."""
        from torch.distributed.pipelining import PipelineStage, schedules

        key = (micro_batches, train)
        if key not in self.schedules:
            if train and micro_batches < self.pp and self.schedule_name != "gpipe":
                raise ValueError(f"--pp-schedule {self.schedule_name} needs at least --pp {self.pp} micro-batches "
                                 f"per step; the gradient accumulation makes {micro_batches}: lower --batch-size "
                                 "(bench.py: raise --grad-accum)")
            pipes = [PipelineStage(s, i, self.n_stages, self.device, group=self.pp_group)
                     for s, i in zip(self.stages, self.stage_ids, strict=True)]
            kind = getattr(schedules, SCHEDULES[self.schedule_name][not train])
            # the mean cross-entropy of (B, T, V) logits, vocab-parallel when they are split by vocabulary (a DTensor)
            loss = lambda logits, targets: local(cross_entropy(logits.flatten(0, 1), targets.flatten()))
            self.schedules[key] = kind(pipes if len(pipes) > 1 else pipes[0], n_microbatches=micro_batches,
                                       loss_fn=loss)
        return self.schedules[key]

    def forward(self, idx: Tensor, targets: Tensor, **_: Any) -> tuple[None, Tensor]:
        """(None, the mean loss of idx's next tokens on every rank), as GPT(idx, targets)'s loss."""
        return None, self.pipeline([idx], [targets], train=False)

    def forward_backward(self, next_batch: Callable[[], tuple], grad_accum: int, autocast: Any,
                         grad_clip: float) -> tuple[Tensor, Tensor]:
        """grad_accum micro-batches forward and backward under the schedule, then the gradients clipped to grad_clip:
        (mean loss, gradient norm), the same on every rank."""
        xs, ys = zip(*(next_batch() for _ in range(grad_accum)), strict=True)
        return self.pipeline(xs, ys, True, autocast), self.clip(grad_clip or float("inf"))  # 0: no clipping

    def pipeline(self, xs: Sequence[Tensor], ys: Sequence[Tensor], train: bool, autocast: Any = None) -> Tensor:
        """The micro-batches through the schedule, forward (and backward in training): the mean of the last stage's
        losses, on every pipeline rank."""
        from torch.distributed.tensor.parallel import loss_parallel

        losses: list[Tensor] = []
        with loss_parallel(), autocast or contextlib.nullcontext():
            schedule = self.schedule(len(xs), train)
            (schedule.step if train else schedule.eval)(torch.cat(xs), target=torch.cat(ys), losses=losses)
        loss = sum((part.detach() / len(xs) for part in losses), torch.zeros((), device=self.device))
        dist.broadcast(loss, group=self.pp_group, group_src=self.pp - 1)
        return loss

    def clip(self, max_norm: float) -> Tensor:
        """Clip the gradients to max_norm over every rank's; returns the norm before. The tied matrix counts once."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.parameters() if p.grad is not None]
        for p in params:  # an embedding's gradient may come back unreduced (Partial): in its weight's layout
            if isinstance(p, DTensor):
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if self.tie_group is not None:
            tied = self.stages[0].transformer.wte.weight if self.holds_first else self.stages[-1].lm_head.weight
            dist.all_reduce(local(tied.grad), group=self.tie_group)  # both copies take the sum, as one matrix would
            params = [p for p in params if self.holds_first or p is not tied]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).square()
        dist.all_reduce(norm, group=self.pp_group)  # the stages' squares add up
        norm = norm.sqrt()
        torch.nn.utils.clip_grads_with_norm_(self.parameters(), max_norm, norm)
        return norm

    # ------------------------------------------------------------------------------------------------------------------
    # Checkpoints: the GPT's full state, whatever the layout

    def names(self) -> dict[str, str]:
        """The GPT's name -> this module's, for every parameter this rank holds (a tied one under both names)."""
        return {name.split(".", 2)[2]: name for name, _ in self.named_parameters(remove_duplicate=False)}

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict | None]:
        """The GPT's full model and optimizer state on rank 0 (None elsewhere), as one process would save them."""
        from torch.distributed.checkpoint import state_dict as dcp

        # not offloaded: that would keep rank 0's stage alone
        model_sd, optim_sd = dcp.get_state_dict(self, optimizer, options=dcp.StateDictOptions(full_state_dict=True))
        back = {mine: name for name, mine in self.names().items()}
        plain = lambda name, t: reorder(name, t, self.config, self.tp, inverse=True).cpu()  # the GPT's row order
        mine = ({back[k]: plain(back[k], v) for k, v in model_sd.items()},
                {"state": {back[k]: {n: plain(back[k], v) for n, v in s.items()} for k, s in optim_sd["state"].items()},
                 "param_groups": [g | {"params": [back[k] for k in g["params"]]} for g in optim_sd["param_groups"]]})
        replica = self.mesh["dp"].get_local_rank() + self.mesh["tp"].get_local_rank()  # 0: the first of a stage
        parts: list[Any] = [None] * dist.get_world_size()
        dist.gather_object(mine if replica == 0 else None, parts if dist.get_rank() == 0 else None, dst=0)
        return merge([p for p in parts if p is not None]) if dist.get_rank() == 0 else (None, None)

    def local_state(self, ckpt: dict) -> dict:
        """ckpt with its full model and optimizer state renamed, and fused rows reordered, for this rank's part."""
        names, state, groups = self.names(), dict(ckpt["optimizer"]["state"]), ckpt["optimizer"]["param_groups"]
        if "lm_head.weight" in names and "transformer.wte.weight" not in names:  # the tied matrix, saved as wte
            state["lm_head.weight"] = state["transformer.wte.weight"]
            groups = [g | {"params": g["params"] + ["lm_head.weight"] * ("transformer.wte.weight" in g["params"])}
                      for g in groups]
        mine = lambda name, t: reorder(name, t, self.config, self.tp)  # this rank's row order
        optim = {"state": {names[k]: {n: mine(k, v) for n, v in s.items()} for k, s in state.items() if k in names},
                 "param_groups": [g | {"params": [names[k] for k in g["params"] if k in names]} for g in groups]}
        return {**ckpt, "model": {ours: mine(k, ckpt["model"][k]) for k, ours in names.items()}, "optimizer": optim}


def merge(parts: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """One full state from the pipeline stages' (first stage first), the tied matrix once, as one process saves it."""
    model = {k: v for model_sd, _ in parts for k, v in model_sd.items()}
    model["transformer.wte.weight"] = model["lm_head.weight"]
    state = {k: v for _, optim_sd in parts for k, v in optim_sd["state"].items() if k != "lm_head.weight"}
    groups = zip(*(optim_sd["param_groups"] for _, optim_sd in parts), strict=True)  # a group as each stage holds it
    return model, {"state": state, "param_groups": [
        same[0] | {"params": [k for g in same for k in g["params"] if k != "lm_head.weight"]} for same in groups]}
