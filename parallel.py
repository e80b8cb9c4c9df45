"""One optimizer step and what it runs on: precision, the attention kernel, activation recompute, DDP / ZeRO-1 /
FSDP2 and torch.compile, applied from outside the model, and the optimizers (AdamW, Muon + AdamW, 8-bit AdamW); the
step's objectives and the log-probabilities and rewards the preference and RL objectives share.

Every stage builds through build_trainable and steps with train_step, which bench.py times; StepArgs holds the flags.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from common import LOCAL, all_sum, flag, import_torchao, tensor_bytes, torchao_missing
from parallelize import flag_checks, fully_shard_model, shard

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # --dtype's names
COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead")
# SDPA kernel -> the global switch that allows it (torch.backends.cuda's switches also steer the CPU kernels)
SDPA_SWITCHES = {"flash": "enable_flash_sdp", "cudnn": "enable_cudnn_sdp", "efficient": "enable_mem_efficient_sdp",
                 "math": "enable_math_sdp"}


@dataclass
class StepArgs:
    """How steps run: device, precision, compile, parallelism and the optimizer."""

    device: str = "auto"  # auto (cuda if available, else cpu), cuda, cpu
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU), bf16, fp16 (with GradScaler), fp32
    compile: bool | None = None  # torch.compile the model (None = on for CUDA, off for CPU)
    compile_mode: str = "default"  # torch.compile: default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs
    attention: str = "auto"  # SDPA kernel: auto (torch picks), flash, cudnn, efficient or math (only that one allowed)
    parallel: str = "ddp"  # ddp, zero1 (ZeroRedundancyOptimizer) or fsdp (FSDP2 fully_shard per block + root)
    recompute: str = "none"  # activation recompute: none, mlp or block (trade compute for memory)
    # (NCCL's own default is 10: less than a gpt2-xl download on a slow link, or a 1.5B checkpoint on slow storage)
    dist_timeout: Annotated[float, LOCAL] = 30.0  # minutes a collective waits for a slow rank (torchrun only)
    optimizer: str = "adamw"  # adamw, muon (Muon for the blocks' matrices, AdamW for the rest) or adamw8bit (torchao)
    max_lr: float = 6e-4  # peak learning rate (Muon's too: its update is scaled to AdamW's RMS)
    weight_decay: float = 0.1  # decoupled weight decay, 2-D tensors only (AdamW's and Muon's)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 = off)
    tp: int = 0  # tensor-parallel ranks: heads, MLP and vocabulary split over them (0 = off; 1 = that code, one rank)
    sequence_parallel: bool = False  # with --tp: the norms and residual stream split by sequence over the tp ranks
    pp: int = 0  # pipeline stages of contiguous blocks, micro-batches from gradient accumulation (0 = off)
    pp_schedule: str = "1f1b"  # pipeline schedule: 1f1b, gpipe or interleaved-1f1b (two stages per rank)

    def __post_init__(self) -> None:
        choices = {"parallel": ("ddp", "zero1", "fsdp"), "recompute": ("none", "mlp", "block"),
                   "dtype": ("auto", "bf16", "fp16", "fp32"), "device": ("auto", "cuda", "cpu"),
                   "compile_mode": COMPILE_MODES, "attention": ("auto", *SDPA_SWITCHES), "optimizer": tuple(OPTIMIZERS)}
        positive = (lambda v: 0 < v < math.inf, "a positive number")  # each rule written so that NaN fails it too
        finite, beta = (lambda v: 0 <= v < math.inf, "finite and >= 0"), (lambda v: 0 <= v < 1, "in [0, 1)")
        rules = {"max_lr": positive, "dist_timeout": positive, "weight_decay": finite, "eps": finite,
                 "grad_clip": finite, "beta1": beta, "beta2": beta}
        check_flags([*((getattr(self, name) in allowed, f"--{flag(name)} must be one of {', '.join(allowed)}; "
                        f"got {getattr(self, name)!r}") for name, allowed in choices.items()),
                     *((ok(getattr(self, name)), f"--{flag(name)} must be {rule}; got {getattr(self, name)}")
                       for name, (ok, rule) in rules.items()),
                     (not (self.dtype == "fp16" and self.parallel == "fsdp"),
                      "--dtype fp16 is not supported with --parallel fsdp; use bf16"), *flag_checks(self)])


def check_flags(checks: Iterable[tuple[bool, str]]) -> None:
    """The message of the first check that fails (ok, message), as a ValueError: a config's __post_init__."""
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def check_counts(cfg: Any, names: Iterable[str]) -> None:
    """The first of these fields (counts and sizes) below 1, as check_flags' one-line ValueError."""
    check_flags((getattr(cfg, name) >= 1, f"--{flag(name)} must be >= 1; got {getattr(cfg, name)}") for name in names)


# ----------------------------------------------------------------------------------------------------------------------
# One optimizer step (bench.py times this same function)


def lm_loss(model: nn.Module, batch: tuple, label_smoothing: float = 0.0) -> torch.Tensor:
    """The language-model objective: mean cross-entropy over the targets that are not -1."""
    x, y = batch
    # no logits out of the model: B*T*V floats would live through backward (GPT.forward's docstring)
    return model(x, y, label_smoothing=label_smoothing, return_logits=False)[1]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, next_batch: Callable[[], tuple], grad_accum: int,
               autocast: contextlib.AbstractContextManager, grad_clip: float, label_smoothing: float = 0.0,
               scaler: torch.amp.GradScaler | None = None,
               update: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
               objective: Callable[[nn.Module, tuple], torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward grad_accum micro-batches, clip, step. Returns (mean loss, grad norm) as 0-d tensors.
    `objective(model, batch)` is the loss (lm_loss by default). `update(loss, norm)`, when given, decides before the
    optimizer step whether to take it (False drops this step's gradients); the same answer on every rank."""
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=False)  # without fp16: each method passes through
    if hasattr(model, "forward_backward"):  # --tp/--pp shards (parallelize.Sharded) run their own micro-steps
        loss_accum, norm = model.forward_backward(next_batch, grad_accum, autocast, grad_clip)
    else:
        # the next-token loss: the mean over the step's targets on every rank, as TRL's (SFT's masks make micro-batches
        # unequal; a mean of their means weighs a token by its micro-batch's size); pairs weigh alike
        batches = [next_batch() for _ in range(grad_accum)]
        world = dist.get_world_size() if dist.is_initialized() else 1
        counts = torch.stack([(batch[1] != -1).sum() for batch in batches]).float() if objective is None else None
        divisors = all_sum(counts.sum(), world) / (world * counts) if objective is None else [grad_accum] * grad_accum
        loss_accum = torch.zeros((), device=next(model.parameters()).device)
        for micro, batch in enumerate(batches):
            with sync_gradients(model, micro == grad_accum - 1), autocast:
                loss = objective(model, batch) if objective else lm_loss(model, batch, label_smoothing)
            loss = loss / divisors[micro]  # pretraining's: grad_accum, exactly (a mean over all micro-batches)
            loss_accum += loss.detach()
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2 returns a DTensor
    if update is None or update(loss_accum, norm):
        scaler.step(optimizer)
    scaler.update()  # after a skipped step too: the scale still reacts to its inf checks
    optimizer.zero_grad(set_to_none=True)
    return loss_accum, norm


class Objective:
    """train_step's objective(model, batch) -> loss, from metrics_fn(model, batch) -> {"loss", ...}; `last` keeps the
    last micro-batch's metrics, detached, and summary(world) the ones named in `summarised` as floats for the log
    record: their mean over the step's micro-batches on every rank, as the step's loss is."""

    def __init__(self, metrics_fn: Callable[[nn.Module, Any], dict[str, torch.Tensor]], summarised: tuple = ()):
        self.metrics_fn, self.summarised, self.last, self.seen = metrics_fn, summarised, {}, []

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        out = self.metrics_fn(model, batch)
        self.last = {k: v.detach() for k, v in out.items()}
        self.seen += [torch.stack([self.last[k].float() for k in self.summarised])] if self.summarised else []
        return out["loss"]

    def summary(self, world: int = 1) -> dict[str, float]:
        mean, self.seen = all_sum(torch.stack(self.seen).mean(0), world) / world, []
        return dict(zip(self.summarised, mean.tolist(), strict=True))


def sync_gradients(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on non-final micro-steps of gradient accumulation: FSDP2's switch, DDP's context."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    return model.no_sync() if hasattr(model, "no_sync") and not enabled else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------------------
# What the preference and RL objectives share: log-probabilities of chosen tokens, a reward model's score


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities of targets (...) under logits (..., V)."""
    return -F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)


def spread(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(M,) values at the M True positions of a (N, T) bool mask, in order -> (N, T), 0 elsewhere."""
    return x.new_zeros(mask.shape).masked_scatter(mask, x)


def sequence_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) log-probability of each row's masked tokens (its reply), summed; the head runs on those positions only."""
    scored = mask[:, 1:].bool()
    return spread(logprobs_of(model(ids[:, :-1], at=scored)[0], ids[:, 1:][scored]), scored).sum(-1)


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """(N,) each row's last True position."""
    return mask.size(1) - 1 - mask.flip(1).int().argmax(1)


def rewards(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, logprob: bool = False) -> torch.Tensor:
    """(N,) a reward model's score of each row's reply (mask): its value head at the reply's last token; with `logprob`
    plus the model's mean log-probability of the reply's tokens, so that the zero-initialised head starts from what
    the language model knows and corrects it: a head alone must first learn to check the reply from one position."""
    last = last_index(mask)[:, None]
    if not logprob:
        return model(ids, values=True, return_logits=False)[1].gather(1, last).squeeze(1)
    scored = mask[:, 1:].bool()
    before = F.pad(scored, (0, 1))  # the positions whose logits score a reply token
    at = before.scatter(1, last, True)  # and the last one, whose value is read: the head runs on these only
    logits, values = model(ids, values=True, at=at)
    logp = logprobs_of(logits[before[at]], ids[:, 1:][scored])
    return spread(values, at).gather(1, last).squeeze(1) + spread(logp, scored).sum(-1) / scored.sum(-1).clamp(min=1)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of the starting weights without gradients, in eval mode: DPO's reference, RL's KL anchor."""
    return copy.deepcopy(model).eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------------------------------
# Building: precision, attention, recompute, parallel wrapper and compile, then the optimizer


@dataclass
class Trainable:
    """What one training step needs: the (wrapped, compiled) model, its optimizer and the precision."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    dtype: torch.dtype
    autocast: contextlib.AbstractContextManager
    shards: nn.Module | None = None  # --tp/--pp: this rank's part (parallelize.Sharded), for state dicts and evals
    compiled: bool = False
    attention: str = "auto"  # the SDPA kernel torch picks for the training forward (sdpa_kernel)

    def resolved(self) -> dict[str, Any]:
        """What --dtype, --compile and --attention came to (auto, None): the console's header and log.jsonl say this."""
        return {"dtype": next(k for k, v in DTYPES.items() if v == self.dtype), "compile": self.compiled,
                "attention": self.attention}


def build_trainable(raw: nn.Module, args: StepArgs, device: torch.device, use_compile: bool,
                    verbose: bool) -> Trainable:
    """raw (on its device) made ready: recompute, precision, attention kernel, parallel wrapper, compile, optimizer."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls (outside autocast) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    apply_recompute(raw, args.recompute)
    dtype, autocast = precision(args.dtype, device)
    select_attention(args.attention)
    shards = shard(raw, args, device, dtype) if args.tp or args.pp else None
    model = shards or wrap_model(raw, args, device, dtype, use_compile)
    # after wrap_model: FSDP2 replaces the parameters with sharded ones, and the optimizer must hold those
    optimizer = build_optimizer(shards or raw, args, device, verbose)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    training = not getattr(args, "eval_only", False)  # --eval-only's forward: eval mode, no dropout (another kernel)
    return Trainable(model, optimizer, scaler, dtype, autocast, shards, use_compile and shards is None,
                     sdpa_kernel(raw.config, dtype, device, training))


def precision(dtype: str, device: torch.device) -> tuple[torch.dtype, contextlib.AbstractContextManager]:
    torch_dtype = {**DTYPES, "auto": torch.bfloat16 if device.type == "cuda" else torch.float32}[dtype]
    return torch_dtype, torch.autocast(device.type, torch_dtype, enabled=torch_dtype != torch.float32)


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Recompute activations in backward instead of storing them, per block or per MLP (names stay unchanged)."""
    if mode == "none":
        return
    for block in model.transformer.h:
        target = block if mode == "block" else block.mlp
        inner = target.forward
        target.forward = lambda *args, _f=inner: activation_checkpoint(_f, *args, use_reentrant=False)


def wrap_model(raw: nn.Module, args: StepArgs, device: torch.device, dtype: torch.dtype,
               use_compile: bool) -> nn.Module:
    """DDP or FSDP2 under torchrun, at any world size (one rank included, as nanoGPT does), and compile, in the order
    each needs: DDP wraps the compiled model (nanoGPT's order; the other way breaks Dynamo's graph in DDP's forward),
    FSDP2 is compiled after fully_shard, which needs plain blocks. Returns the module that train steps call."""
    if args.parallel == "fsdp" and dist.is_initialized():
        fully_shard_model(raw, raw.transformer.h, dtype)
    model = torch.compile(raw, mode=args.compile_mode) if use_compile else raw
    if args.parallel != "fsdp" and dist.is_initialized():
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def uses_cuda_graphs(args: StepArgs, device: torch.device) -> bool:
    """Whether the compile mode replays CUDA graphs here: on CUDA (compile=None means on), in these two modes."""
    return device.type == "cuda" and args.compile is not False and args.compile_mode in ("reduce-overhead",
                                                                                          "max-autotune")


def cuda_graph_conflict(args: StepArgs, grad_accum: int, device: torch.device) -> str | None:
    """Why this compile mode cannot run with this gradient accumulation, or None: a CUDA graph's replay overwrites
    the .grad the accumulation adds into (docs/notes.md, "CUDA graphs and accumulation")."""
    if uses_cuda_graphs(args, device) and grad_accum > 1:
        return (f"--compile-mode {args.compile_mode} uses CUDA graphs, which break gradient accumulation "
                f"({grad_accum} micro-steps here); use --compile-mode max-autotune-no-cudagraphs, or raise "
                "--batch-size or the number of GPUs until one micro-step makes the whole batch")
    return None


def attention_conflict(args: StepArgs, device: torch.device, model: Any) -> str | None:
    """Why the SDPA kernel --attention allows alone has no kernel for this device, dtype and model (its GPTConfig's
    grouped-query heads, its dropout in training), or None."""
    if device.type == "cpu" and args.attention in ("efficient", "cudnn"):
        return f"--attention {args.attention} has no CPU kernel; use --attention flash, math or auto"
    if device.type == "cuda" and args.attention in ("flash", "cudnn") and args.dtype == "fp32":
        return f"--attention {args.attention} has no fp32 kernel on CUDA; use --dtype bf16 or --attention auto"
    if device.type == "cuda" and args.attention == "efficient" and model.kv_heads != model.n_head:
        return "--attention efficient has no grouped-query (--n-kv-head) kernel; use --attention flash, cudnn or auto"
    if device.type == "cpu" and args.attention == "flash" and model.dropout > 0 and not getattr(args, "eval_only", 0):
        return (f"--attention flash has no CPU kernel with dropout ({model.dropout}); use --attention auto or math, "
                "or --dropout 0")
    return None


def sdpa_switches() -> dict[str, bool]:
    """The process-wide SDPA switches as they are now, for set_sdpa_switches to put back."""
    return {switch: getattr(torch.backends.cuda, switch.removeprefix("enable_") + "_enabled")()
            for switch in SDPA_SWITCHES.values()}


def set_sdpa_switches(state: dict[str, bool]) -> None:
    """Set the SDPA switches, and put the kernels allowed into torch.compile's cache key, which does not key on the
    switches (a cached graph kept another run's kernel: docs/notes.md)."""
    for switch, on in state.items():
        getattr(torch.backends.cuda, switch)(on)
    kernels = [kernel for kernel, switch in SDPA_SWITCHES.items() if state.get(switch)]
    choice = "" if set(kernels) == set(SDPA_SWITCHES) else "sdpa=" + "+".join(kernels)
    if hasattr(torch.compiler.config, "cache_key_tag"):  # appended to the user's own tag
        torch.compiler.config.cache_key_tag = os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", "") + choice
    else:  # a torch without the tag: no graph cache for a forced kernel, so nothing stale comes back
        from torch._inductor import config as inductor_config

        inductor_config.fx_graph_cache = not choice


def sdpa_kernel(config: Any, dtype: torch.dtype, device: torch.device, training: bool = True) -> str:
    """The SDPA kernel torch's dispatcher picks, under the switches set now, for the model's causal forward in training
    (or eval) mode (one sequence of its context; dropout and grouped-query heads count): what --attention came to."""
    # requires_grad: CUDA's dispatcher refuses flash for a trained q of some head sizes on some cards (sm86/89)
    q = torch.zeros(1, config.n_head, config.block_size, config.head_dim, dtype=dtype, device=device,
                    requires_grad=training)
    kv = q[:, :config.kv_heads]
    choice = torch._fused_sdp_choice(q, kv, kv, dropout_p=config.dropout if training else 0.0, is_causal=True,
                                     enable_gqa=config.kv_heads != config.n_head)
    return SDPBackend(choice).name.lower().removesuffix("_attention")  # FLASH_ATTENTION: flash


def select_attention(name: str) -> None:
    """Allow only the named SDPA kernel, or every kernel for 'auto' (torch's default). These are process-wide
    switches, and a compiled graph keeps the kernel chosen when it was traced: set them before compiling."""
    set_sdpa_switches({switch: name in ("auto", kernel) for kernel, switch in SDPA_SWITCHES.items()})


# ----------------------------------------------------------------------------------------------------------------------
# Optimizers: AdamW (the default), Muon for the blocks' matrices with AdamW for the rest, torchao's 8-bit AdamW.
# A new one is a builder (groups, class, options) and an entry in OPTIMIZERS; its own flags are StepArgs fields.


def adamw_groups(model: nn.Module, args: StepArgs, options: dict, verbose: bool) -> tuple[list, type, dict]:
    """AdamW over configure_optimizers' groups: weight decay on the 2-D tensors only."""
    adamw = model.configure_optimizers(args.weight_decay, options["lr"], verbose=verbose)  # only its groups are kept
    return [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in adamw.param_groups], \
        torch.optim.AdamW, options


def adamw8bit_groups(model: nn.Module, args: StepArgs, options: dict, verbose: bool) -> tuple[list, type, dict]:
    import_torchao("--optimizer adamw8bit")
    from torchao.optim import AdamW8bit

    groups = adamw_groups(model, args, options, verbose)[0]
    if verbose:
        print("optimizer: torchao's AdamW8bit: 8-bit moments (blocks of 256) for tensors of 4096+ elements")
    return groups, AdamW8bit, {k: v for k, v in options.items() if k != "fused"}  # it compiles its own step


def muon_groups(model: nn.Module, args: StepArgs, options: dict, verbose: bool) -> tuple[list, type, dict]:
    """Muon's group, the blocks' 2-D matrices (attention and MLP weights), then AdamW's two: the other 2-D tensors
    (token and position embeddings, the tied lm_head) with weight decay, biases and norms without."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # the tied lm_head once, as wte
    matrices = {name for name, p in named if p.dim() == 2 and name.startswith("transformer.h.")}
    hidden = [p for name, p in named if name in matrices]
    decay = [p for name, p in named if name not in matrices and p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    if verbose:
        def count(ps: list[nn.Parameter], what: str) -> str:
            return f"{len(ps)} {what} ({sum(p.numel() for p in ps):,} params)"
        print(f"optimizer: Muon for {count(hidden, 'block matrices')}; AdamW for {count(decay, 'embedding tensors')} "
              f"with weight decay, {count(rest, 'bias and norm tensors')} without")
    return [{"params": hidden, "weight_decay": args.weight_decay, "muon": True},
            {"params": decay, "weight_decay": args.weight_decay, "muon": False},
            {"params": rest, "weight_decay": 0.0, "muon": False}], MuonAdamW, options


def muon_problem(parallel: str) -> str | None:
    if not hasattr(torch.optim, "Muon"):
        return f"--optimizer muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}"
    if parallel == "fsdp":
        return ("--optimizer muon orthogonalizes whole matrices, which --parallel fsdp shards across ranks; use "
                "--parallel zero1 (each matrix whole on one rank) or ddp")
    return None


def adamw8bit_problem(parallel: str) -> str | None:
    if parallel == "fsdp":
        return ("--optimizer adamw8bit does not support --parallel fsdp here (8-bit states of sharded tensors do not "
                "go through the full-state checkpoint); use --parallel zero1, which shards the 8-bit state too, or ddp")
    return torchao_missing("--optimizer adamw8bit")


# name -> (builder of (param groups, optimizer class, its options), why it cannot run with --parallel X or None)
OPTIMIZERS: dict[str, tuple[Callable, Callable[[str], str | None]]] = {
    "adamw": (adamw_groups, lambda parallel: None),
    "muon": (muon_groups, muon_problem),
    "adamw8bit": (adamw8bit_groups, adamw8bit_problem),
}


def build_optimizer(model: nn.Module, args: StepArgs, device: torch.device, verbose: bool) -> torch.optim.Optimizer:
    """args.optimizer over the model's parameters, inside ZeroRedundancyOptimizer for --parallel zero1 under torchrun.
    Every group's lr is --max-lr's schedule (the loop sets it), Muon's included (see MuonAdamW)."""
    options = {"lr": args.max_lr, "betas": (args.beta1, args.beta2), "eps": args.eps, "fused": device.type == "cuda"}
    groups, optimizer_class, options = OPTIMIZERS[args.optimizer][0](model, args, options, verbose)
    if args.parallel == "zero1" and dist.is_initialized():
        from torch.distributed.optim import ZeroRedundancyOptimizer
        # the same optimizer and groups, with each rank keeping the state of only its share of the parameters
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, **options)
    else:
        optimizer = optimizer_class(groups, **options)
    if args.optimizer == "adamw8bit":
        getattr(optimizer, "optim", optimizer).register_step_pre_hook(lr_as_tensor)
    return optimizer


def optimizer_conflict(args: StepArgs) -> str | None:
    """Why --optimizer cannot run with this torch, these packages or --parallel, or None."""
    return OPTIMIZERS[args.optimizer][1](args.parallel)


def set_hyperparameters(optimizer: torch.optim.Optimizer, args: StepArgs) -> list[str]:
    """Give every param group this run's weight decay, betas and eps, and its optimizer's other options (a builder's
    momentum): a resumed optimizer state brings its run's; returns the flags here whose value changed, to say so."""
    changed = set()
    for group in optimizer.param_groups:
        decays = any(p.dim() >= 2 for p in group["params"])  # the rule every builder here follows
        # Muon keeps its own momentum and eps; fused and capturable are this run's already: engine's restore set them
        # with the step tensors they need (engine.use_built_kernel)
        want = {} if group.get("muon") else {k: v for k, v in optimizer.defaults.items() if k not in (
            "lr", "fused", "capturable")} | {"betas": (args.beta1, args.beta2), "eps": args.eps}
        want["weight_decay"] = args.weight_decay if decays else 0.0
        for key, value in want.items():
            have = tuple(group[key]) if isinstance(group.get(key), list) else group.get(key)  # a DTensor load's list
            if key in group and have != value:
                changed.add({"weight_decay": "--weight-decay", "betas": "--beta1/--beta2", "eps": "--eps"}.get(key))
                group[key] = value
    return sorted(changed - {None})


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the groups marked "muon", AdamW for the others, as one optimizer. The two inner ones hold
    this one's group dicts and state, so the loop's lr, GradScaler, ZeRO-1 and the checkpoint see one ordinary
    optimizer. Muon's lr is scaled by 0.2 * sqrt(max(rows, cols)) per matrix (torch's "match_rms_adamw"): its update
    RMS is then about AdamW's, so both parts share --max-lr, its schedule and --weight-decay."""

    def __init__(self, params: list[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, fused: bool = False, momentum: float = 0.95):
        for group in params:  # ZeRO-1 gives every group AdamW's defaults: Muon's take its own (its eps is another one)
            if group["muon"]:
                for key in set(group) - {"params", "weight_decay", "muon", "lr"}:
                    del group[key]
        self.muon = torch.optim.Muon([g for g in params if g["muon"]], lr=lr, momentum=momentum, nesterov=True,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([g for g in params if not g["muon"]], lr=lr, betas=betas, eps=eps, fused=fused)
        super().__init__(params, {})
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this one's groups (in order) and state."""
        self.muon.param_groups = [g for g in self.param_groups if g["muon"]]
        self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self.muon.state = self.adamw.state = self.state

    def step(self, closure: None = None) -> None:  # no closure: nothing here re-evaluates the loss
        self.muon.step()
        self.adamw.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: share them again
        self._share()


def lr_as_tensor(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A step pre-hook for torchao's 8-bit AdamW, which compiles its step for lr as a tensor (a float would be baked
    into the graph, and each new value recompile it); the loop sets a float."""
    for group in optimizer.param_groups:
        group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of this rank's optimizer state, an 8-bit state's codes, scales and code table included."""
    local = getattr(optimizer, "optim", optimizer)  # ZeRO-1's own share
    return sum(tensor_bytes(v) for state in local.state.values() for v in state.values() if torch.is_tensor(v))
