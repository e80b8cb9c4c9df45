"""Train GPT-2: one process, or torchrun DDP / ZeRO-1 / FSDP2 on one or many nodes.

Usage:
    python train.py --preset tiny                                   # CPU, seconds (needs data/stdlib, see README)
    torchrun --standalone --nproc_per_node=8 train.py --preset gpt2-124m
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py --preset gpt2-124m
    python train.py --help                                          # every option, with its meaning
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from common import (
    checkpoints,
    get_tokenizer,
    iter_log,
    load_checkpoint,
    load_model,
    mfu,
    parse_config,
    provenance,
    run_and_exit,
)
from fineweb import SHUFFLES, DataError, TokenLoader
from model import GPT, MODEL_PRESETS, GPTConfig, checkpoint_config

COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead")
# SDPA kernel -> the global switch that allows it (torch.backends.cuda's switches also steer the CPU kernels)
SDPA_SWITCHES = {"flash": "enable_flash_sdp", "cudnn": "enable_cudnn_sdp", "efficient": "enable_mem_efficient_sdp",
                 "math": "enable_math_sdp"}


@dataclass
class TrainConfig:
    """Train a GPT-2 with this project's training loop. Flags override the chosen --preset."""

    # model
    model: str | None = None  # architecture preset: gpt2 (None), gpt2-medium, gpt2-large, gpt2-xl, d12..d48, tiny
    seq_len: int = 1024  # T: tokens per sequence; also the model's block_size
    n_layer: int | None = None  # override the preset's depth
    n_head: int | None = None  # override the preset's query heads
    n_embd: int | None = None  # override the preset's width
    n_kv_head: int | None = None  # GQA/MQA key-value heads (None = n_head)
    mlp: str | None = None  # gelu (GPT-2; None) or swiglu
    pos: str | None = None  # learned (GPT-2; None) or rope
    bias: bool | None = None  # biases in Linear/LayerNorm (GPT-2; None = true)
    dropout: float = 0.0  # dropout probability (0 for pretraining)
    fused_gelu: bool = False  # Triton fused bias+GELU kernel in the MLP (CUDA only)
    loss_chunk: int = 0  # >0: cross-entropy this many rows at a time, never all B*T fp32 logits at once (0 = off)
    fused_ce: bool = False  # lm_head + loss fused, a Triton kernel for the loss and its gradient (CUDA only)
    half_residual: bool = False  # the residual stream in bf16 under autocast, not fp32 (half the bytes; llm.c's)
    init_from: str = ""  # '' (random init), a train.py checkpoint, or HF GPT-2 (gpt2..gpt2-xl, a local dir)
    # data
    data: str = "data/edu_fineweb10B"  # directory or glob of token shards written by fineweb.py (or llm.c)
    preload: bool = False  # load the whole dataset onto the device once (small datasets only)
    shuffle: str = "windows"  # each epoch: windows (shard order and each shard's windows, llm.c) or shards (order only)
    # batch
    total_batch_size: int = 524288  # tokens per optimizer step, over all ranks and micro-steps
    batch_size: int = 64  # B: sequences per micro-step per rank (lower it to fit memory; see README table)
    # optimizer and schedule
    max_lr: float = 6e-4  # peak learning rate, reached after warmup
    min_lr_frac: float = 0.1  # the schedule decays to min_lr_frac * max_lr
    lr_schedule: str = "cosine"  # after warmup: cosine or linear decay, constant, wsd (stable, then decay)
    decay_frac: float = 0.2  # wsd: the fraction of max_steps spent decaying to the min
    warmup_steps: int = 715  # linear warmup steps
    max_steps: int = 19073  # optimizer steps (19073 * 524288 tokens ~ 10B)
    weight_decay: float = 0.1  # AdamW decoupled weight decay, 2-D tensors only
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 = off)
    skip_loss_z: float = 0.0  # skip the update when the loss's z-score in the last 128 exceeds this (0 = off)
    skip_norm_z: float = 0.0  # skip the update when the grad norm's z-score in the last 128 exceeds this (0 = off)
    label_smoothing: float = 0.0  # cross-entropy label smoothing
    # system
    device: str = "auto"  # auto (cuda if available, else cpu), cuda, cpu
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU), bf16, fp16 (with GradScaler), fp32
    compile: bool | None = None  # torch.compile the model (None = on for CUDA, off for CPU)
    compile_mode: str = "default"  # torch.compile mode: default, reduce-overhead, max-autotune(-no-cudagraphs)
    attention: str = "auto"  # SDPA kernel: auto (torch picks), flash, cudnn, efficient or math (only that one allowed)
    parallel: str = "ddp"  # ddp, zero1 (ZeroRedundancyOptimizer) or fsdp (FSDP2 fully_shard per block + root)
    # (NCCL's own default is 10: less than a gpt2-xl download on a slow link, or a 1.5B checkpoint on slow storage)
    dist_timeout: float = 30.0  # minutes a collective waits for a slow rank before the run fails (torchrun only)
    recompute: str = "none"  # activation recompute: none, mlp or block (trade compute for memory)
    seed: int = 1337  # seeds weights, dropout and the data shuffle
    peak_tflops: float | None = None  # override the per-GPU peak bf16 TFLOP/s used for MFU
    # evaluation
    eval_every: int = 250  # val loss every N steps (and at the last step); 0 = never
    # (the default is build-nanogpt's 20 val batches of 64 x 1024 on each of 8 GPUs; here they are the same tokens on
    # any number of ranks)
    eval_tokens: int = 10_485_760  # val tokens per evaluation, all ranks together (rounded up to whole B*T windows)
    hellaswag_every: int = 250  # HellaSwag every N steps (and at the last step); 0 = never
    hellaswag: str = "auto"  # HellaSwag val jsonl: a path, 'auto' (cached download) or 'off'
    hellaswag_limit: int | None = None  # evaluate only the first N HellaSwag examples
    sample_every: int = 250  # print samples every N steps; 0 = never
    sample_tokens: int = 32  # new tokens per sample
    sample_prompt: str = "Hello, I'm a language model,"  # prompt for the in-training samples
    # checkpoints and logs
    out_dir: str = "out/gpt2-124m"  # checkpoints, log.jsonl and profiler traces go here
    ckpt_every: int = 5000  # checkpoint every N steps (and at the end, on SIGTERM and Ctrl-C); 0 = only at the end
    keep_last: int = 3  # keep the newest K checkpoints (0 = all)
    keep_every: int = 0  # never delete a checkpoint whose step is a multiple of N (0 = none; llm.c's -nm)
    resume: str = ""  # '' (fresh run), 'auto' (latest valid checkpoint in out_dir) or a checkpoint path
    log_every: int = 1  # print a step line every N steps
    # run control
    overfit_batch: bool = False  # train on the first batch only (sanity check: the loss must go to ~0)
    eval_only: bool = False  # evaluate the starting weights once and exit: no training, checkpoint or log
    max_time: float = 0.0  # wall-clock budget in minutes; checkpoint and stop when reached (0 = none)
    profile: bool = False  # profile a few steps after warmup; writes a Chrome/Perfetto trace to out_dir
    profile_steps: int = 3  # steps to profile

    def __post_init__(self) -> None:
        choices = {"parallel": ("ddp", "zero1", "fsdp"), "recompute": ("none", "mlp", "block"),
                   "dtype": ("auto", "bf16", "fp16", "fp32"), "device": ("auto", "cuda", "cpu"),
                   "compile_mode": COMPILE_MODES, "attention": ("auto", *SDPA_SWITCHES),
                   "lr_schedule": ("cosine", "linear", "constant", "wsd"), "shuffle": SHUFFLES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")
        if self.model is not None and self.model not in MODEL_PRESETS:
            raise ValueError(f"--model must be one of {', '.join(MODEL_PRESETS)}; got {self.model!r}")
        at_least = {"seq_len": 1, "batch_size": 1, "total_batch_size": 1, "max_steps": 1, "eval_tokens": 1,
                    "log_every": 1, "sample_tokens": 1, "profile_steps": 1, "warmup_steps": 0, "eval_every": 0,
                    "hellaswag_every": 0, "sample_every": 0, "ckpt_every": 0, "keep_last": 0,
                    "keep_every": 0}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}; got {getattr(self, name)}")
        if self.hellaswag_limit is not None and self.hellaswag_limit < 1:
            raise ValueError(f"--hellaswag-limit must be >= 1 or none; got {self.hellaswag_limit}")
        if not (math.isfinite(self.max_lr) and self.max_lr > 0):
            raise ValueError(f"--max-lr must be a positive number; got {self.max_lr}")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            raise ValueError(f"--min-lr-frac must be in [0, 1]; got {self.min_lr_frac}")
        if not 0.0 < self.decay_frac <= 1.0:
            raise ValueError(f"--decay-frac must be in (0, 1]; got {self.decay_frac}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"--label-smoothing must be in [0, 1); got {self.label_smoothing}")
        if not (math.isfinite(self.dist_timeout) and self.dist_timeout > 0):
            raise ValueError(f"--dist-timeout must be a positive number of minutes; got {self.dist_timeout}")
        for name in ("weight_decay", "grad_clip", "max_time", "skip_loss_z", "skip_norm_z"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0; got {getattr(self, name)}")
        if self.keep_every and self.ckpt_every and self.keep_every % self.ckpt_every:
            raise ValueError(f"--keep-every {self.keep_every} must be a multiple of --ckpt-every {self.ckpt_every}, or "
                             "no checkpoint is ever written at the steps it keeps")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"--peak-tflops must be > 0 or none; got {self.peak_tflops}")


def _preset(**kw: Any) -> Callable[[], TrainConfig]:
    return lambda: TrainConfig(**kw)


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    # build-nanogpt / llm.c GPT-2 124M on fineweb-edu 10B: 19073 steps of 2**19 tokens
    "gpt2-124m": _preset(),
    "gpt2-350m": _preset(model="gpt2-medium", batch_size=32, max_lr=3e-4, out_dir="out/gpt2-350m"),
    "gpt2-774m": _preset(model="gpt2-large", batch_size=16, max_lr=2.5e-4, out_dir="out/gpt2-774m"),
    "gpt2-1558m": _preset(model="gpt2-xl", batch_size=8, max_lr=2e-4, out_dir="out/gpt2-1558m"),
    # a 10.7M-param model on Tiny Shakespeare (~300K tokens): minutes on one GPU
    "shakespeare": _preset(model="gpt2", n_layer=6, n_head=6, n_embd=384, seq_len=256, data="data/shakespeare",
                           preload=True,
                           total_batch_size=16384, batch_size=64, max_lr=1e-3, warmup_steps=100, max_steps=2000,
                           # the val shard's 32K tokens hold one window of B*T+1 = 16,385 (windows do not overlap)
                           dropout=0.2, eval_every=250, eval_tokens=16384, hellaswag="off", sample_every=500,
                           sample_tokens=128, ckpt_every=1000, out_dir="out/shakespeare", sample_prompt="ROMEO:"),
    # fine-tune OpenAI's GPT-2 124M on Tiny Shakespeare (as nanoGPT's finetune_shakespeare): 20 steps of 32K tokens,
    # about two epochs of its ~300K train tokens, at a small constant learning rate; minutes on one GPU
    "shakespeare-ft": _preset(init_from="gpt2", data="data/shakespeare", total_batch_size=32768, batch_size=8,
                              max_lr=3e-5, lr_schedule="constant", warmup_steps=0, max_steps=20, eval_every=5,
                              eval_tokens=24576, hellaswag="off", sample_every=10, sample_tokens=128, ckpt_every=0,
                              out_dir="out/shakespeare-ft", sample_prompt="ROMEO:"),
    # the offline demo: a small model on the Python standard library's source, minutes on 2 CPU cores. The loss in
    # chunks of 128 rows: 26 MB of logits at a time stay in malloc's heap, where 2048 rows' 412 MB were mapped and
    # unmapped every step (656 instead of 835 ms/step on 2 cores, docs/benchmarks.md)
    "demo": _preset(model="tiny", seq_len=128, data="data/stdlib", total_batch_size=2048, batch_size=16, loss_chunk=128,
                    max_lr=3e-3, warmup_steps=20, max_steps=250, eval_every=50, eval_tokens=8192, hellaswag="off",
                    sample_every=0, sample_tokens=64, ckpt_every=0, out_dir="out/demo", sample_prompt="def "),
    # seconds on CPU, for tests
    "tiny": _preset(model="tiny", seq_len=64, data="data/stdlib", total_batch_size=512, batch_size=4,
                    max_lr=1e-3, warmup_steps=2, max_steps=10, eval_every=5, eval_tokens=512, hellaswag="off",
                    sample_every=0, ckpt_every=0, out_dir="out/tiny", sample_prompt="def "),
}


ARCHITECTURE = ("n_layer", "n_head", "n_embd", "n_kv_head", "mlp", "pos", "bias")  # None = the preset's


def run_options(cfg: TrainConfig) -> dict[str, Any]:
    """The GPTConfig fields a run sets whatever its weights came from: context length, dropout, fused kernels, loss."""
    return {"block_size": cfg.seq_len, "dropout": cfg.dropout, "fused_gelu": cfg.fused_gelu,
            "loss_chunk": cfg.loss_chunk, "fused_ce": cfg.fused_ce, "half_residual": cfg.half_residual}


def model_config(cfg: TrainConfig) -> GPTConfig:
    """The preset's architecture with this run's overrides (context length, shape, model options); an architecture
    field left at None keeps the preset's value (GPT-2's)."""
    base = MODEL_PRESETS[cfg.model or "gpt2"]()
    arch = {k: getattr(cfg, k) for k in ARCHITECTURE if getattr(cfg, k) is not None}
    return dataclasses.replace(base, **run_options(cfg), **arch)


def check_architecture(cfg: TrainConfig, src: GPTConfig, source: str) -> None:
    """Refuse a run whose architecture flags (set on the command line or by its preset; None means unset) say
    otherwise than the weights it starts from, which fix the architecture: they would be ignored without a word."""
    has = {k: getattr(src, "kv_heads" if k == "n_kv_head" else k) for k in ARCHITECTURE}
    wrong = [f"--{k.replace('_', '-')} {v} (it has {has[k]})" for k in ARCHITECTURE
             if (v := getattr(cfg, k)) is not None and v != has[k]]
    if cfg.model is not None:  # a named preset's shape, where no explicit --n-layer/--n-head/--n-embd replaces it
        preset = MODEL_PRESETS[cfg.model]()
        shape = [k for k in ("n_layer", "n_head", "n_embd") if getattr(cfg, k) is None and getattr(preset, k) != has[k]]
        if shape:
            wrong.append(f"--model {cfg.model} ({', '.join(f'{k} {getattr(preset, k)}' for k in shape)}; it has "
                         f"{', '.join(f'{k} {has[k]}' for k in shape)})")
    if wrong:
        raise ValueError(f"{source} fixes the architecture, but this run asks for {', '.join(wrong)}: drop those "
                         "flags (or use a preset that does not set them), or pass the shape flags the weights were "
                         "trained with")


def load_init(cfg: TrainConfig) -> GPT:
    """The --init-from weights as a GPT on the CPU, rebuilt with this run's context length (a learned position
    table is cut to its first seq_len rows, as nanoGPT's crop_block_size does) and run options (dropout, fused GELU,
    chunked loss). The architecture is the source's: an architecture flag this run sets (on the command line or
    through its preset; None means unset) to anything else is an error, since it would otherwise be ignored without
    a word."""
    path = Path(cfg.init_from).expanduser()
    if path.is_dir() and not (path / "config.json").exists() and (found := checkpoints(path)):
        raise ValueError(f"--init-from {cfg.init_from} is a run directory; pass one of its checkpoints, e.g. "
                         f"--init-from {found[-1]} (the latest)")
    # a checkpoint's tensors are mapped, not read: its AdamW moments (twice the weights) never enter memory
    try:
        source = GPT.from_checkpoint(load_checkpoint(path, mmap=True)) if path.is_file() else \
            load_model(None, cfg.init_from)
    except OSError as e:  # the hub is unreachable, or has no such model: one line, not an HTTP client's traceback
        raise ValueError(str(e).replace("\n", " ")) from None
    src = source.config
    check_architecture(cfg, src, f"--init-from {cfg.init_from}")
    if cfg.seq_len > src.block_size:
        raise ValueError(f"--seq-len {cfg.seq_len} is longer than --init-from {cfg.init_from}'s context of "
                         f"{src.block_size} tokens; pass --seq-len {src.block_size} or less")
    config = dataclasses.replace(src, **run_options(cfg))
    weights = source.state_dict()
    del source  # its tensors live on in `weights`: at most two copies of the model at once
    if "transformer.wpe.weight" in weights:
        weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:cfg.seq_len]
    model = GPT(config)
    model.load_state_dict(weights)
    return model


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from max_lr/warmup to max_lr, then the schedule down to min_lr_frac * max_lr at max_steps:
    cosine (GPT-2 / nanoGPT / llm.c's default) or linear over all the steps after warmup; constant stays at max_lr;
    wsd (warmup-stable-decay) holds max_lr, then decays linearly over the last decay_frac of the steps, so a run
    can be extended from a checkpoint taken before its decay."""
    min_lr = cfg.min_lr_frac * cfg.max_lr
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.max_lr
    if step >= cfg.max_steps:
        return min_lr
    if cfg.lr_schedule == "wsd":
        decay_start = max(cfg.warmup_steps, cfg.max_steps - round(cfg.decay_frac * cfg.max_steps))
        if step < decay_start:
            return cfg.max_lr
        return cfg.max_lr - (step - decay_start) / max(1, cfg.max_steps - decay_start) * (cfg.max_lr - min_lr)
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    if cfg.lr_schedule == "linear":
        return cfg.max_lr - progress * (cfg.max_lr - min_lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.max_lr - min_lr)


OUTLIER_WINDOW = 128  # steps of history behind a z-score, as in llm.c


class OutlierDetector:
    """z-score of a value as llm.c's -sl/-sg update skipping computes it: a loss or gradient norm far above its recent
    history is a spike whose update is better dropped than applied. Once OUTLIER_WINDOW values have been seen, each
    new one replaces the oldest and is scored against the window it is now part of (so z never exceeds
    sqrt(OUTLIER_WINDOW - 1), 11.3 for 128); before that every z-score is 0, so nothing is skipped early in a run.
    Every value enters the window, skipped or not, except a NaN or inf (the run stops on those anyway, and a resumed
    one must not inherit them)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def __call__(self, x: float) -> float:
        if not math.isfinite(x):
            return 0.0
        full = len(self.values) >= OUTLIER_WINDOW
        self.values = (self.values + [x])[-OUTLIER_WINDOW:]
        if not full:
            return 0.0
        mean = sum(self.values) / len(self.values)
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / len(self.values))
        return (x - mean) / std if std > 0 else 0.0


# ----------------------------------------------------------------------------------------------------------------------
# Parallelism, applied from outside the model


def apply_recompute(model: GPT, mode: str) -> None:
    """Recompute activations in backward instead of storing them, per block or per MLP (names stay unchanged)."""
    if mode == "none":
        return
    for block in model.transformer.h:
        target = block if mode == "block" else block.mlp
        inner = target.forward
        target.forward = lambda *args, _f=inner: activation_checkpoint(_f, *args, use_reentrant=False)


def parallelize(model: nn.Module, cfg: TrainConfig, device: torch.device,
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """Wrap (DDP) or shard (FSDP2) the model under torchrun, at any world size (one rank included, as nanoGPT does:
    the same code path on 1 GPU as on 64); returns the module that train steps call. For FSDP2, model is the GPT
    itself; DDP may wrap its compiled form (see wrap_model)."""
    if cfg.parallel == "fsdp":
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch 2.5 keeps FSDP2 under _composable
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        # gather parameters in the compute dtype (half the all-gather traffic in bf16), reduce gradients in fp32
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dist.is_initialized():
            for block in model.transformer.h:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        return model
    if dist.is_initialized():
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def build_optimizer(model: GPT, cfg: TrainConfig, device: torch.device, verbose: bool) -> torch.optim.Optimizer:
    """Fused AdamW (on CUDA), inside ZeroRedundancyOptimizer for --parallel zero1 under torchrun."""
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.max_lr, (cfg.beta1, cfg.beta2), cfg.eps,
                                           device.type, verbose=verbose)
    if cfg.parallel == "zero1" and dist.is_initialized():
        from torch.distributed.optim import ZeroRedundancyOptimizer
        # the same AdamW and groups, with each rank keeping the optimizer state of only its shard of parameters
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
        d = optimizer.defaults
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=d["lr"], betas=d["betas"],
                                       eps=d["eps"], fused=d["fused"])
    return optimizer


def optimizer_kind(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> str:
    """What a checkpoint's optimizer state is: ZeRO-1's own format, or the parameter-keyed one of everything else."""
    if hasattr(optimizer, "consolidate_state_dict"):
        return "zero1"
    return cfg.parallel if dist.is_initialized() else "single"


def uses_cuda_graphs(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the compile mode replays CUDA graphs here: only on CUDA, where compile=None means on, and only in
    these two modes."""
    return device.type == "cuda" and cfg.compile is not False and cfg.compile_mode in ("reduce-overhead",
                                                                                        "max-autotune")


def cuda_graph_conflict(cfg: TrainConfig, grad_accum: int, device: torch.device) -> str | None:
    """Why this compile mode cannot run with this gradient accumulation, or None. The CUDA-graph modes keep a
    compiled backward's outputs in the graph's memory pool, so a parameter's .grad, which autograd takes from the
    first micro-step's output, is overwritten by the next replay before the accumulation adds into it
    (pytorch/pytorch#169545: an error, or silently wrong gradients)."""
    if uses_cuda_graphs(cfg, device) and grad_accum > 1:
        return (f"--compile-mode {cfg.compile_mode} uses CUDA graphs, which break gradient accumulation "
                f"({grad_accum} micro-steps here); use --compile-mode max-autotune-no-cudagraphs, or raise "
                "--batch-size or the number of GPUs until one micro-step makes the whole batch")
    return None


def attention_conflict(cfg: TrainConfig, device: torch.device) -> str | None:
    """Why the SDPA kernel --attention allows alone has no kernel for this device and dtype, or None."""
    if device.type == "cpu" and cfg.attention in ("efficient", "cudnn"):
        return f"--attention {cfg.attention} has no CPU kernel; use --attention flash, math or auto"
    if device.type == "cuda" and cfg.attention in ("flash", "cudnn") and cfg.dtype == "fp32":
        return f"--attention {cfg.attention} has no fp32 kernel on CUDA; use --dtype bf16 or --attention auto"
    return None


def sdpa_switches() -> dict[str, bool]:
    """The process-wide SDPA switches as they are now, for set_sdpa_switches to put back."""
    return {switch: getattr(torch.backends.cuda, switch.removeprefix("enable_") + "_enabled")()
            for switch in SDPA_SWITCHES.values()}


def set_sdpa_switches(state: dict[str, bool]) -> None:
    for switch, on in state.items():
        getattr(torch.backends.cuda, switch)(on)
    tag_compile_caches([kernel for kernel, switch in SDPA_SWITCHES.items() if state.get(switch)])


def select_attention(name: str) -> None:
    """Allow only the named SDPA kernel, or every kernel for 'auto' (torch's default). These are process-wide
    switches, and a compiled graph keeps the kernel chosen when it was traced: set them before compiling."""
    set_sdpa_switches({switch: name in ("auto", kernel) for kernel, switch in SDPA_SWITCHES.items()})


def tag_compile_caches(kernels: list[str]) -> None:
    """Put the SDPA kernels allowed into torch.compile's cache key. Its on-disk caches do not key on the switches, so
    a graph cached under one choice came back under another: on an H200, `--attention flash` ran cuDNN's kernel from
    the graph an `auto` run had cached (bench.py's attn column), and on a CPU a `math` run got the `auto` run's flash
    kernel. The tag follows any TORCH_COMPILE_CACHE_KEY_TAG of the user's; all kernels allowed adds nothing."""
    choice = "" if set(kernels) == set(SDPA_SWITCHES) else "sdpa=" + "+".join(kernels)
    if hasattr(torch.compiler.config, "cache_key_tag"):
        torch.compiler.config.cache_key_tag = os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", "") + choice
    else:  # a torch without the tag: no graph cache for a forced kernel, so nothing stale comes back
        from torch._inductor import config as inductor_config

        inductor_config.fx_graph_cache = not choice


def compile_model(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """torch.compile with the configured mode; 'reduce-overhead' adds CUDA graphs, the max-autotune modes search
    Triton matmul configs (minutes of compilation for GPT-2)."""
    return torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)


def wrap_model(raw: GPT, cfg: TrainConfig, device: torch.device, dtype: torch.dtype, use_compile: bool) -> nn.Module:
    """parallelize and compile_model in the order each needs. DDP wraps the compiled model (nanoGPT's order):
    compiling the DDP wrapper instead makes Dynamo break the graph in DDP's own forward, 3 breaks a step, each a
    return to Python. Dynamo still splits the compiled graph at DDP's gradient buckets, so the all-reduce overlaps
    backward either way. FSDP2 is compiled after fully_shard, which must see the plain blocks."""
    if cfg.parallel == "fsdp":
        model = parallelize(raw, cfg, device, dtype)
        return compile_model(model, cfg) if use_compile else model
    return parallelize(compile_model(raw, cfg) if use_compile else raw, cfg, device, dtype)


@dataclass
class Trainable:
    """What one training step needs: the (wrapped, compiled) model, its optimizer and the precision."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    dtype: torch.dtype
    autocast: contextlib.AbstractContextManager


def build_trainable(raw: GPT, cfg: TrainConfig, device: torch.device, use_compile: bool,
                    verbose: bool) -> Trainable:
    """raw (on its device) made ready to train: recompute, precision, attention kernel, parallel wrapper and compile,
    then the optimizer. train.py and bench.py both build through here, so bench times what a run trains."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls (outside autocast) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    apply_recompute(raw, cfg.recompute)
    dtype, autocast = precision(cfg, device)
    select_attention(cfg.attention)
    model = wrap_model(raw, cfg, device, dtype, use_compile)
    # after parallelize: FSDP2 replaces the parameters with sharded ones, and the optimizer must hold those
    optimizer = build_optimizer(raw, cfg, device, verbose)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    return Trainable(model, optimizer, scaler, dtype, autocast)


def sync_gradients(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on non-final micro-steps of gradient accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync") and not enabled:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------------------
# One optimizer step (bench.py times this same function)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, next_batch: Callable[[], tuple], grad_accum: int,
               autocast: contextlib.AbstractContextManager, grad_clip: float, label_smoothing: float = 0.0,
               scaler: torch.amp.GradScaler | None = None,
               update: Callable[[torch.Tensor, torch.Tensor], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward grad_accum micro-batches, clip, step. Returns (mean loss, grad norm) as 0-d tensors.
    `update(loss, norm)`, when given, decides before the optimizer step whether to take it (False drops this
    step's gradients); it must return the same answer on every rank."""
    loss_accum = torch.zeros((), device=next(model.parameters()).device)
    for micro in range(grad_accum):
        x, y = next_batch()
        with sync_gradients(model, micro == grad_accum - 1), autocast:
            # no logits out of the model: B*T*V, 6.6 GB in bf16 at B=64, T=1024, would live through backward, and a
            # compiled model would also get a zero gradient of that size for them (GPT.forward's docstring)
            loss = model(x, y, label_smoothing=label_smoothing, return_logits=False)[1]
        loss = loss / grad_accum  # gradients of the mean over all micro-batches, not the sum
        loss_accum += loss.detach()
        (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
        norm = norm.full_tensor()
    if update is not None and not update(loss_accum, norm):
        if scaler:
            scaler.update()  # the scale still reacts to this step's inf checks
    elif scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_accum, norm


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints


def _state_dicts(raw: GPT, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> tuple[dict | None, dict | None]:
    """Full (unsharded, unwrapped) model and optimizer state; collective under ZeRO-1/FSDP, so every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(raw, options=opts)
    if "lm_head.weight" in model_sd and raw.lm_head.weight is raw.transformer.wte.weight:
        # the offload copies each name to the CPU on its own, so the tied matrix would be saved twice (+154 MB for
        # GPT-2 124M under FSDP, or from a GPU); one tensor under both names is stored once
        model_sd["transformer.wte.weight"] = model_sd["lm_head.weight"]
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: gather every rank's shard on rank 0
        optimizer.consolidate_state_dict(to=0)
        if torch.cuda.is_initialized():  # (not is_available: a --device cpu run on a GPU host has no CUDA context)
            # the gathered state reaches the CPU by non_blocking copies that nothing waits for: torch.save could
            # otherwise write Adam moments the GPU has not finished copying
            torch.cuda.synchronize()
        optim_sd = optimizer.state_dict() if dist.get_rank() == 0 else None
    else:  # keyed by parameter name, so DDP, FSDP and single-process checkpoints are interchangeable
        optim_sd = get_optimizer_state_dict(raw, optimizer, options=opts)
    return model_sd, optim_sd


def save_checkpoint(path: Path, raw: GPT, optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                    loader: TokenLoader, scaler: torch.amp.GradScaler | None, rank: int, world_size: int,
                    prov: dict, outliers: dict[str, list[float]], tokens: int,
                    unreadable: Collection[Path] = ()) -> None:
    """Write the checkpoint (rank 0; every rank takes part in gathering it), then prune to the newest --keep-last.
    Checkpoints in `unreadable` (found so by this run's resume) are neither counted nor deleted: a corrupt file must
    not take the place of a good one."""
    model_sd, optim_sd = _state_dicts(raw, optimizer, cfg)
    # is_initialized, not is_available: get_rng_state would create a CUDA context for a --device cpu run on a GPU host
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}
    rngs = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(rngs, rng)  # dropout masks differ per rank, so every rank's RNG is saved
    else:
        rngs = [rng]
    if rank != 0:
        return
    ckpt = {
        "model": model_sd, "optimizer": optim_sd, "optimizer_kind": optimizer_kind(optimizer, cfg),
        "step": step, "loader": loader.state_dict(), "rng": rngs, "scaler": scaler.state_dict() if scaler else None,
        "model_config": dataclasses.asdict(raw.config), "train_config": dataclasses.asdict(cfg),
        "provenance": prov, "world_size": world_size, "outliers": outliers,
        "tokens": tokens,  # trained on, all ranks together
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a kill mid-write leaves the previous checkpoint untouched
    readable = [p for p in checkpoints(path.parent) if p not in unreadable]
    for stale in readable[:-cfg.keep_last] if cfg.keep_last > 0 else []:
        if not (cfg.keep_every and int(stale.stem.removeprefix("ckpt_")) % cfg.keep_every == 0):  # a milestone
            stale.unlink()


def find_checkpoint(out_dir: Path, unreadable: list[Path] | None = None) -> tuple[Path, dict] | None:
    """The newest checkpoint in out_dir that loads; corrupt or partial ones are reported, skipped and appended to
    `unreadable`."""
    for path in reversed(checkpoints(out_dir)):
        try:
            return path, load_checkpoint(path, mmap=True)
        except (ValueError, OSError) as e:
            print(f"warning: skipping unreadable checkpoint {path}: {e} (left in place; --keep-last does not count "
                  "it)", file=sys.stderr)
            if unreadable is not None:
                unreadable.append(path)
    return None


def restore(ckpt: dict, raw: GPT, optimizer: torch.optim.Optimizer, cfg: TrainConfig, loader: TokenLoader | None,
            scaler: torch.amp.GradScaler | None, rank: int, world_size: int) -> int:
    """Load a checkpoint into the run: the weights, and unless --eval-only (which needs no more, so it scores any
    checkpoint) the optimizer, the loader's position, the GradScaler and the RNG. Returns its step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(raw, ckpt["model"], options=opts)
    if cfg.eval_only:
        return int(ckpt["step"])
    kind = optimizer_kind(optimizer, cfg)
    if (ckpt["optimizer_kind"] == "zero1") != (kind == "zero1"):
        saved = ckpt["optimizer_kind"]
        how = "under torchrun with --parallel zero1" if saved == "zero1" else "without --parallel zero1"
        raise ValueError(f"the checkpoint's optimizer state was saved by parallel={saved} and this "
                         f"run's optimizer is {kind}: ZeRO-1 keeps its own format, so resume it {how}")
    if kind == "zero1":
        optimizer.load_state_dict(ckpt["optimizer"])
        if optimizer.optim.defaults.get("fused"):
            # ZeRO's load_state_dict moves Adam's 0-d `step` tensors to the CPU, and the fused CUDA kernel then fails
            # on mixed devices (pytorch/pytorch#124133): put them back beside their parameters
            for p, state in optimizer.optim.state.items():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(p.device, torch.float32)
        # the wrapper's own load_state_dict also put a second device copy of this rank's Adam moments in its
        # `state`, which ZeRO never reads again (its inner optimizer's state is the live one): 1.5 GB per GPU for
        # GPT-2 1.5B on 8 ranks. state_dict() rebuilds the full state from the inner optimizers, not from it.
        optimizer.state.clear()
    else:
        set_optimizer_state_dict(raw, optimizer, ckpt["optimizer"], options=opts)
    if loader is not None:
        loader.load_state_dict(ckpt["loader"])
        old_b, old_shuffle = ckpt["loader"]["B"], TokenLoader.state_shuffle(ckpt["loader"])
        if rank == 0 and (old_b != loader.B or old_shuffle != loader.shuffle):
            if loader.continues_in_shard(old_shuffle):
                where = "where it was, cut into windows of the new size"
            elif loader.resume_skipped:
                where = (f"at the next shard, skipping the {loader.resume_skipped:,} tokens the checkpoint's run had "
                         "not yet served from the shard being read (it read that shard's windows in another order)")
            else:
                where = "where it was, at a shard's start (the checkpoint fell between shards: nothing skipped)"
            print(f"note: the checkpoint read {old_b}-sequence windows with --shuffle {old_shuffle}, this run reads "
                  f"{loader.B}-sequence windows with --shuffle {loader.shuffle}: the data goes on {where}, none "
                  "served twice" + (", and the optimizer step keeps --total-batch-size tokens"
                                    if old_b != loader.B else ""))
    if scaler and ckpt["scaler"]:
        scaler.load_state_dict(ckpt["scaler"])
    if len(ckpt["rng"]) == world_size:
        rng = ckpt["rng"][rank]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_initialized():  # a CUDA run (see save_checkpoint)
            torch.cuda.set_rng_state(rng["cuda"])
    elif rank == 0:
        print(f"note: the checkpoint came from world size {len(ckpt['rng'])}, this run has {world_size}: the data "
              "stream goes on where it was (less than one step's windows skipped, none repeated) and the RNG streams "
              "restart, so this is not the run an unchanged world size would give")
    return int(ckpt["step"])


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def val_loss(model: nn.Module, loader: TokenLoader, windows: int, autocast: contextlib.AbstractContextManager,
             world_size: int) -> float:
    """Mean loss over the split's first `windows` windows (identical every call), all ranks together. Rank r scores
    windows r, r + world_size, ...: the same windows, so the same number, for any number of ranks. Every rank runs
    the same number of forwards (they are collective under FSDP); one whose last turn falls past `windows` scores a
    window it then leaves out."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=loader.device)
    for turn in range(-(-windows // world_size)):
        x, y = loader.next_batch()
        with autocast:
            _, loss = model(x, y)
        if turn * world_size + loader.rank < windows:
            total += loss.float()
    if world_size > 1:
        dist.all_reduce(total)  # SUM: gloo has no AVG
    model.train()
    return total.item() / windows


def sample_text(raw: GPT, enc: Any, cfg: TrainConfig, device: torch.device, step: int,
                autocast: contextlib.AbstractContextManager) -> list[str]:
    """A few samples from the uncompiled module (which shares the trained weights), in the training precision; own
    generator, so the training RNG and therefore exact resume are untouched."""
    idx = torch.tensor([enc.encode(cfg.sample_prompt)] * 2, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + step)
    with autocast:
        out = raw.generate(idx, cfg.sample_tokens, temperature=1.0, top_k=50, generator=gen)
    return [enc.decode([t for t in row if t < enc.n_vocab]) for row in out.tolist()]


# ----------------------------------------------------------------------------------------------------------------------
# Setup helpers


def setup_distributed(cfg: TrainConfig) -> tuple[int, int, int, torch.device]:
    """rank, local_rank, world_size and device from torchrun's environment (or a single process). The default
    process group is created here, unless the caller (a script that launched us under torchrun) already has one."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available; use --device cpu")
    if dist.is_initialized():  # the caller's group (mp.spawn, a notebook, a launcher of its own): its ranks
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        if use_cuda:
            torch.cuda.set_device(local_rank)
    elif "RANK" in os.environ:
        rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
        if use_cuda:
            torch.cuda.set_device(local_rank)
        # one rank works alone while the others wait in a collective: local rank 0's --init-from download, rank 0's
        # checkpoint write
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(minutes=cfg.dist_timeout))
    else:
        rank, local_rank, world = 0, 0, 1
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    return rank, local_rank, world, device


def precision(cfg: TrainConfig, device: torch.device) -> tuple[torch.dtype, contextlib.AbstractContextManager]:
    name = cfg.dtype if cfg.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    if dtype == torch.float32:
        return dtype, contextlib.nullcontext()
    return dtype, torch.autocast(device_type=device.type, dtype=dtype)


class StopFlags:
    """SIGTERM (cloud preemption), Ctrl-C and the wall-clock budget: checked once per step, agreed across ranks.

    The first Ctrl-C (SIGINT) stops the run as SIGTERM does, with a checkpoint, so that stopping a run by hand does
    not lose the steps since its last one; a Ctrl-C after any stop signal quits at once, as Python's own handler
    would. Under torchrun the agent takes the terminal's Ctrl-C and sends the workers SIGINT, then SIGKILL 30 s
    later; a second Ctrl-C makes it send them SIGTERM, which after a SIGINT quits at once too. A SIGTERM after a
    SIGTERM does not: a preempted node's workers may get one from the scheduler and one from torchrun."""

    def __init__(self, max_minutes: float, interrupt: bool = True, master: bool = True):
        self.term: str | None = None  # the first signal this rank received: "SIGTERM" or "SIGINT"
        self.signal = "SIGTERM"  # after should_stop said "signal": SIGTERM if any rank had it, else SIGINT
        self.master = master
        self.last = False  # set when no step is left to stop after: Ctrl-C then quits at once
        self.deadline = time.time() + 60 * max_minutes if max_minutes > 0 else None
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            signal.signal(signal.SIGTERM, self._on_signal)  # main() puts the caller's handlers back when it returns
            # not for --eval-only, which has no step to stop after, nor where SIGINT is ignored (a job started with
            # & by a script, or under nohup): it must stay ignored
            if interrupt and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, *_: Any) -> None:
        name = signal.Signals(signum).name
        if (self.term is not None and "SIGINT" in (name, self.term)) or (self.last and name == "SIGINT"):
            raise KeyboardInterrupt  # a second Ctrl-C, here or (as SIGTERM) through torchrun, or nothing to stop
        if self.term is None:
            # the same Ctrl-C kills a `| tee` reading this run's output: a print to the dead pipe would end the run
            # before its checkpoint, so from here on output that has no reader is dropped
            sys.stdout, sys.stderr = (_PipeGuard(s) if s is not None else None for s in (sys.stdout, sys.stderr))
        if name == "SIGINT" and self.master:  # os.write, not print: a handler that prints can land inside a print
            with contextlib.suppress(OSError):
                os.write(2, b"\nCtrl-C: stopping after this step, with a checkpoint; Ctrl-C again quits now\n")
        self.term = self.term or name

    def should_stop(self, device: torch.device, world_size: int) -> str | None:
        """"signal", "max_time" or None, the same on every rank: one rank's signal stops them all at this step."""
        flags = [self.term == "SIGTERM", self.term == "SIGINT",
                 self.deadline is not None and time.time() > self.deadline]
        if world_size > 1:
            agreed = torch.tensor(flags, dtype=torch.float32, device=device)
            dist.all_reduce(agreed)
            flags = (agreed > 0).tolist()
        self.signal = "SIGTERM" if flags[0] else "SIGINT"
        return "signal" if flags[0] or flags[1] else "max_time" if flags[2] else None


class _PipeGuard:
    """A text stream that, once its reader is gone (EPIPE), points its file descriptor at /dev/null and goes on,
    so that neither a later print nor the interpreter's flush at exit fails."""

    def __init__(self, stream: Any):
        self.stream = stream

    def _guarded(self, call: Callable[[], Any], default: Any = None) -> Any:
        try:
            return call()
        except BrokenPipeError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
            return default

    def write(self, text: str) -> int:
        return self._guarded(lambda: self.stream.write(text), len(text))

    def flush(self) -> None:
        self._guarded(self.stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def open_log(path: Path, resume_step: int | None) -> Any:
    """The run's JSONL log, line-buffered. A fresh run starts it anew; a resumed one keeps the records before the
    step it resumes at and drops those after it, which an interrupted run logged past its last checkpoint and the
    resumed run is about to log again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if resume_step is None or not path.is_file():
        return open(path, "w", buffering=1)
    kept = [json.dumps(record) + "\n" for record in iter_log(path)
            if record["type"] == "config" or record["step"] < resume_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return open(path, "a", buffering=1)


# ----------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line: parse argv (sys.argv[1:] by default) into a TrainConfig and run() it. A user error (bad
    flag, data, checkpoint) is one line on stderr and SystemExit(1)."""
    try:
        cfg = parse_config(TrainConfig, sys.argv[1:] if argv is None else argv, PRESETS, __doc__)
    except SystemExit as e:
        if e.code and not isinstance(e.code, int) and "RANK" in os.environ and not dist.is_initialized():
            _stop_the_other_ranks(str(e.code).removeprefix("error: "))
        raise
    try:
        return run(cfg)
    except (DataError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except torch.cuda.OutOfMemoryError as e:  # the usual first failure on a new GPU: say what to change
        print(f"error: out of GPU memory at --batch-size {cfg.batch_size}: lower it (gradient accumulation keeps "
              "--total-batch-size), or add --loss-chunk 4096 or --recompute mlp; the README's 'Micro-batch by GPU "
              f"memory' has starting points\n(torch: {str(e).splitlines()[0] if str(e) else 'no message'})",
              file=sys.stderr)
        raise SystemExit(1) from None


def _stop_the_other_ranks(problem: str) -> None:
    """Under torchrun, a rank whose command line does not parse (a flag mistyped on one node) would exit before the
    rendezvous, and the other ranks would wait for it there until the timeout (10-30 minutes). It joins the process
    group anyway, only to hand its reason to their first collective (_train's shared_problem), so that every rank
    stops at once with it. Its own flags unread, it joins as the default config's device would."""
    _, _, world, _ = setup_distributed(TrainConfig())
    try:
        shared_problem(problem, world)
    finally:
        dist.destroy_process_group()


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or, with eval_only, evaluate) as cfg says; the entry point from Python, where errors stay exceptions
    (DataError, ValueError, FileNotFoundError for the user's). Under torchrun it joins the default process group (or
    creates it, and then destroys it at the end). Returns {"losses": [per step], "step": the last, and when they
    happened "val_loss", "hellaswag" (its metrics), "checkpoint" (the last path written), "stopped" ("signal",
    "max_time" or "nan")}: the same on every rank but for "checkpoint", which rank 0 writes."""
    owns_group = not dist.is_initialized()
    rank, local_rank, world, device = setup_distributed(cfg)
    master = rank == 0
    handlers, attention = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}, sdpa_switches()
    streams = sys.stdout, sys.stderr  # StopFlags guards them after a signal
    try:
        result = _train(cfg, rank, local_rank, world, device, master)
        if dist.is_initialized():
            # leave together, so no rank tears its process group down while another is still in a collective
            # (only on success: after an error it could hang). The abort seen at exit on gloo is another matter:
            # see common.exit_now
            dist.barrier()
        return result
    finally:
        # StopFlags' handlers must not outlive the run in a process that goes on (tests, a notebook): they would
        # swallow SIGTERM there and in every process forked later, e.g. a multiprocessing.Pool, whose terminate()
        # then waits forever for workers that ignore it, and a notebook's Ctrl-C
        for sig, handler in handlers.items():
            if handler is not None and threading.current_thread() is threading.main_thread():
                signal.signal(sig, handler)
        set_sdpa_switches(attention)  # likewise --attention's choice, or a later SDPA call could find no kernel
        sys.stdout, sys.stderr = streams
        if owns_group and dist.is_initialized():  # a group the caller made is the caller's to destroy
            dist.destroy_process_group()


def _train(cfg: TrainConfig, rank: int, local_rank: int, world: int, device: torch.device,
           master: bool) -> dict[str, Any]:
    out_dir = Path(cfg.out_dir)
    # before anything a rank could refuse on its own: a node whose command differs (or whose out-dir is a file) stops
    # every rank with the reason, where its exit would leave the others a lost peer, or a hang under NCCL
    problem = f"--out-dir {out_dir} is a file, not a directory" if out_dir.exists() and not out_dir.is_dir() else None
    if (problem := shared_problem(problem, world)) or (problem := commands_disagree(cfg, rank, world)):
        raise ValueError(problem)
    prov = provenance(device, world)
    B, T = cfg.batch_size, cfg.seq_len
    if cfg.eval_only:  # nothing trains, so no total batch to fill
        cfg = dataclasses.replace(cfg, total_batch_size=B * T * world)
    if cfg.total_batch_size % (B * T * world):
        # e.g. more ranks than a preset was sized for (the demo's on 2 CPU ranks): name a micro-batch that fits
        fits = next((b for b in range(B - 1, 0, -1) if cfg.total_batch_size % (b * T * world) == 0), None)
        fix = f"--batch-size {fits}" if fits else "another --batch-size"
        raise ValueError(f"--total-batch-size {cfg.total_batch_size} is not divisible by batch_size * seq_len * "
                         f"world_size = {B} * {T} * {world} = {B * T * world}; pass {fix} or another "
                         "--total-batch-size")
    grad_accum = cfg.total_batch_size // (B * T * world)
    if cfg.dtype == "fp16" and cfg.parallel == "fsdp":
        raise ValueError("--dtype fp16 is not supported with --parallel fsdp; use bf16")
    if why := attention_conflict(cfg, device):
        raise ValueError(why)
    # by default on CUDA, except for a one-off evaluation, where compiling would take longer than it saves
    use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda" and not cfg.eval_only
    if use_compile and (why := cuda_graph_conflict(cfg, grad_accum, device)):
        raise ValueError(why)

    torch.manual_seed(cfg.seed + rank)  # ranks see different data, so different dropout masks are right
    if device.type == "cuda":
        torch.cuda.manual_seed(cfg.seed + rank)
    # an evaluation needs only the val split: a directory holding just a val shard will do. A node without the data
    # stops every rank with its reason; nodes with different data (or commands) would train on, silently wrong
    train_loader = val_loader = problem = None
    try:
        train_loader = TokenLoader(cfg.data, "train", B, T, rank, world, cfg.seed, device, cfg.preload, cfg.shuffle) \
            if not cfg.eval_only else None
        val_loader = TokenLoader(cfg.data, "val", B, T, rank, world, cfg.seed, device, cfg.preload) \
            if cfg.eval_every > 0 or cfg.eval_only else None
    except (DataError, OSError) as e:
        problem = str(e)
    if (problem := shared_problem(problem, world)) or (problem := data_disagree((train_loader, val_loader), rank,
                                                                                world)):
        raise DataError(problem)

    # the checkpoint to resume: looked for first, since a resumed fine-tune needs no --init-from source. Every rank
    # must resume the same step, or stop, before anything collective: FSDP's restore, the barriers around --init-from
    # and the loop would otherwise pair up wrong across ranks and hang instead of failing. So each rank's finding
    # (or its reason to refuse) is shared first, and all stop together with a reason.
    found, problem, unreadable = None, None, []
    try:
        found = find_resume(cfg, out_dir, master, unreadable)
    except (ValueError, OSError) as e:  # OSError: a --resume PATH this node cannot read
        problem = str(e)
    problem = shared_problem(problem, world)
    if not problem and world > 1:
        # the step, and the loss history the checkpoint keeps for the z-scores, which tells two runs' checkpoints of
        # the same step apart (each node's own out-dir, say): restored on their own ranks after DDP's initial
        # broadcast, they would leave the replicas different for the rest of the run
        mine = None if found is None else (int(found[1]["step"]), found[1].get("outliers", {}).get("loss"))
        seen: list[tuple | None] = [None] * world
        dist.all_gather_object(seen, mine)
        if any(other != seen[0] for other in seen):
            steps = [other[0] if other else None for other in seen]
            which = "different checkpoints" if len(set(steps)) == 1 else f"different steps {steps} (None: none found)"
            problem = (f"ranks resumed {which}: every node must see the same checkpoints in --out-dir {out_dir} "
                       "(put it on a shared filesystem, or copy the checkpoint to each node and pass --resume PATH)")
    if problem:
        raise ValueError(problem)
    if found is not None:  # the checkpoint's architecture, as nanoGPT's resume takes it; restore() loads the weights
        src = checkpoint_config(found[1], f"--resume {found[0]}")
        check_architecture(cfg, src, f"--resume {found[0]}")
        if cfg.seq_len != src.block_size:
            raise ValueError(f"--seq-len {cfg.seq_len} is not the context of --resume {found[0]}, "
                             f"{src.block_size} tokens; pass --seq-len {src.block_size}")
        if int(found[1]["step"]) > cfg.max_steps and not cfg.eval_only:
            raise ValueError(f"--resume {found[0]} is at step {found[1]['step']}, past --max-steps {cfg.max_steps}; "
                             "raise --max-steps to train further, or score it with --eval-only")
        raw = GPT(dataclasses.replace(src, **run_options(cfg)))
    elif cfg.init_from:
        # a hub download once per node: local rank 0 first, then the others read the cached copy. Its failure
        # reaches every rank as the reason (a rank that merely lost its peer would report a gloo or NCCL error)
        raw, problem = None, None
        if world == 1 or local_rank == 0:
            try:
                raw = load_init(cfg)
            except (ValueError, OSError) as e:
                problem = str(e)
        if problem := shared_problem(problem, world):
            raise ValueError(problem)
        if raw is None:  # the other ranks of the node, from the cache; their failure is shared the same way
            try:
                raw = load_init(cfg)
            except (ValueError, OSError) as e:
                problem = str(e)
        if problem := shared_problem(problem, world):  # on every rank: it is a collective
            raise ValueError(problem)
        if world > 1:  # (a digest of a 1.5B model's bytes takes seconds: only where there is something to compare)
            # each node loads its own copy; FSDP shards what each rank loaded, and nothing broadcasts rank 0's
            # weights. A digest of the bytes is exact, where a float sum's last digits depend on the order it adds in
            digest = hashlib.sha1()
            for p in raw.parameters():
                digest.update(p.detach().contiguous().view(torch.uint8).numpy())
            fingerprint = [digest.hexdigest()[:16], raw.num_params()]
            if problem := agree(fingerprint, rank, world, lambda mine, first: None if mine == first else (
                    f"rank {rank} loaded other weights from --init-from {cfg.init_from} than rank 0 (digest "
                    f"{mine[0]}, rank 0: {first[0]}): every node must start from the same model")):
                raise ValueError(problem)
    else:
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        raw = GPT(model_config(cfg))
    raw = raw.to(device)
    mcfg = raw.config
    for loader in (train_loader, val_loader):
        if loader is not None:
            loader.check_vocab(mcfg.vocab_size)
    torch.manual_seed(cfg.seed + rank)
    if master:
        print(json.dumps({"provenance": prov, "config": dataclasses.asdict(cfg), "model": dataclasses.asdict(mcfg)},
                         indent=None))
    if device.type == "cuda" and cfg.attention == "efficient" and mcfg.kv_heads != mcfg.n_head:
        # enable_gqa has flash and cuDNN kernels only; forcing the memory-efficient one leaves no kernel at all
        raise ValueError("--attention efficient has no grouped-query (--n-kv-head) kernel; use --attention flash, "
                         "cudnn or auto")
    built = build_trainable(raw, cfg, device, use_compile, verbose=master)
    model, optimizer, scaler, dtype, autocast = built.model, built.optimizer, built.scaler, built.dtype, built.autocast

    detectors = {"loss": OutlierDetector(), "norm": OutlierDetector()}
    start_step = 0
    if found is not None:
        problem = None
        try:
            start_step = restore(found[1], raw, optimizer, cfg, train_loader, scaler, rank, world)
        except (DataError, ValueError) as e:
            problem = str(e)
        if problem := shared_problem(problem, world):
            raise ValueError(problem)
        for name, detector in detectors.items():  # the z-scores' history, so a resumed run skips the same steps
            detector.values = [float(v) for v in found[1].get("outliers", {}).get(name, [])]
        if master:
            print(f"resumed from {found[0]} at step {start_step}")
        del found[1]["model"], found[1]["optimizer"]  # copied into the model and optimizer: free the CPU copy

    tokens_per_step = grad_accum * B * T * world
    # tokens trained on before step s: the checkpoint's count carries over, so the log's token axis stays right when
    # a resume changes --total-batch-size (an older checkpoint without the count assumes this run's batch)
    tokens_offset = int(found[1].get("tokens", start_step * tokens_per_step)) - start_step * tokens_per_step \
        if found is not None else 0
    tokens_at = lambda s: tokens_offset + s * tokens_per_step
    flops_per_token = raw.flops_per_token(T)
    device_name = prov["device"]
    if master and cfg.eval_only:
        print(f"{raw.num_params():,} params | evaluating at step {start_step} | {B} x {T} x {world} ranks | {dtype}")
    elif master:
        print(f"{raw.num_params():,} params | {tokens_per_step:,} tokens/step = {B} x {T} x {world} ranks x "
              f"{grad_accum} accum | {cfg.max_steps} steps | compile {use_compile} | "
              f"{optimizer_kind(optimizer, cfg)} | {dtype}")  # single: no torchrun, so no DDP, ZeRO-1 or FSDP
        for flag, on in (("--fused-gelu", mcfg.fused_gelu), ("--fused-ce", mcfg.fused_ce)):
            if on and device.type != "cuda":
                print(f"note: {flag} runs the PyTorch reference on {device.type}: the Triton kernel is CUDA only")
        if mcfg.half_residual and dtype == torch.float32:
            print("note: --half-residual does nothing in fp32: the residual stream is 16-bit only under autocast "
                  "(--dtype bf16)")
        if cfg.compile_mode != "default" and not use_compile:
            print(f"note: --compile-mode {cfg.compile_mode} does nothing: the model is not compiled (compile is off "
                  f"on {device.type} unless --compile true)")
    if master and not cfg.eval_only:  # an evaluation may sit beside a live run, whose .tmp is a checkpoint in flight
        for stale in out_dir.glob("ckpt_*.pt.tmp"):  # left by a run killed mid-write: never a valid checkpoint
            stale.unlink()
    # an evaluation-only run leaves out_dir alone: its log.jsonl may be a training run's
    log = open_log(out_dir / "log.jsonl", start_step if found is not None else None) \
        if master and not cfg.eval_only else None

    def write(record: dict) -> None:
        if log:
            log.write(json.dumps(record) + "\n")

    write({"type": "config", "step": start_step, "config": dataclasses.asdict(cfg),
           "model_config": dataclasses.asdict(mcfg), "provenance": prov})

    eval_windows = 0  # val windows of B*T tokens per evaluation, all ranks together
    if val_loader is not None:
        eval_windows = -(-cfg.eval_tokens // (B * T))  # rounded up: at least --eval-tokens are scored
        if eval_windows > val_loader.num_windows:  # more would score some windows twice, weighting them double
            eval_windows = val_loader.num_windows
            if master:
                print(f"val: the val split holds {eval_windows * B * T:,} tokens in windows of B*T = {B * T:,}, so "
                      f"each evaluation scores those instead of --eval-tokens {cfg.eval_tokens:,}")
        elif eval_windows * B * T != cfg.eval_tokens and master:
            print(f"val: each evaluation scores {eval_windows * B * T:,} tokens ({eval_windows} x B*T = {B * T:,}): "
                  f"--eval-tokens {cfg.eval_tokens:,} rounded up to whole windows")
    hellaswag_examples = _load_hellaswag(cfg, rank, local_rank, world, master)
    enc = get_tokenizer() if (cfg.sample_every > 0 or hellaswag_examples) else None
    next_batch: Callable[[], tuple] | None = None  # None only for --eval-only, which never trains
    if cfg.overfit_batch and train_loader is not None:  # always the run's first batch, also after a resume
        position = train_loader.state_dict()
        train_loader.reset()
        fixed = train_loader.next_batch()
        train_loader.load_state_dict(position)
        next_batch = lambda: fixed
    elif train_loader is not None:
        next_batch = train_loader.next_batch
    skipped = ""  # why this step's update was dropped, or ""

    def update(loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """llm.c's spike guard: no update from a step whose loss or gradient norm is an outlier. Every rank must
        decide the same, or DDP would drift apart and ZeRO-1 hang: both figures are averaged over the ranks in one
        all-reduce (the norm is global already, so that changes nothing but the last bits), which hands every rank
        the same numbers, and so the same history and verdict."""
        nonlocal skipped
        stats = torch.stack([loss.detach().float(), norm.detach().float()])
        if world > 1:
            dist.all_reduce(stats)
            stats /= world
        mean_loss, mean_norm = stats.tolist()
        z_loss, z_norm = detectors["loss"](mean_loss), detectors["norm"](mean_norm)
        if cfg.skip_loss_z > 0 and z_loss > cfg.skip_loss_z:
            skipped = f"loss z-score {z_loss:.1f} > {cfg.skip_loss_z}"
        elif cfg.skip_norm_z > 0 and z_norm > cfg.skip_norm_z:
            skipped = f"grad norm z-score {z_norm:.1f} > {cfg.skip_norm_z}"
        return not skipped

    # the guard reads the loss and norm on the host before the optimizer step: one sync more, so only when asked
    guard = update if cfg.skip_loss_z > 0 or cfg.skip_norm_z > 0 else None
    stop = StopFlags(cfg.max_time, interrupt=not cfg.eval_only, master=master)
    recent_ms: list[float] = []
    losses: list[float] = []
    result: dict[str, Any] = {"losses": losses}

    def checkpoint(at: int) -> None:
        path = out_dir / f"ckpt_{at:06d}.pt"
        if path in unreadable:  # written anew, and readable now
            unreadable.remove(path)
        save_checkpoint(path, raw, optimizer, at, cfg, train_loader, scaler, rank, world, prov,
                        {name: d.values for name, d in detectors.items()}, tokens_at(at), unreadable)
        if master:
            print(f"saved {path}")
        result["checkpoint"] = str(path)

    def halt(stopping: str, when: str, resumable: bool = True) -> None:
        if master:
            why = {"SIGTERM": "SIGTERM", "SIGINT": "Ctrl-C"}[stop.signal] if stopping == "signal" \
                else f"--max-time {cfg.max_time} min"
            print(f"stopping {when} ({why}); " + ("resume with --resume auto" if resumable else "nothing trained yet"))
        result["stopped"] = stopping

    profiler = None
    profile_at = start_step + 2  # after the first steps' compilation and allocator warmup
    t_start = time.time()
    step = start_step
    # step counts optimizer steps done; the evaluations at `step` see the weights after `step` steps, so the one at
    # max_steps (after the loop's last update) scores the final model
    for step in range(start_step, cfg.max_steps + 1 if not cfg.eval_only else start_step + 1):
        final = step == cfg.max_steps or cfg.eval_only
        stop.last = final  # no step is left to stop after: a Ctrl-C during the final evaluations quits at once
        evaluated = False  # whether this step ran an evaluation, after which a signal is checked for at once
        if val_loader is not None and (final or step % cfg.eval_every == 0):
            evaluated = True
            vl = val_loss(model, val_loader, eval_windows, autocast, world)
            result["val_loss"] = vl
            write({"type": "val", "step": step, "tokens": tokens_at(step), "val_loss": vl})
            if master:
                print(f"step {step:6d} | val loss {vl:.4f}")
        if hellaswag_examples and (final or step % cfg.hellaswag_every == 0):
            evaluated = True
            import hellaswag
            # the uncompiled module (the same weights; its own collectives under FSDP): HellaSwag's batches come in
            # many lengths, and through the compiled model they would make torch.compile recompile the training
            # forward with a dynamic sequence length. Eager costs little here: no backward, short sequences
            hs = hellaswag.evaluate(raw, hellaswag_examples, device, rank, world, limit=cfg.hellaswag_limit,
                                    enc=enc, progress=True)
            result["hellaswag"] = hs
            write({"type": "hellaswag", "step": step, "tokens": tokens_at(step), **hs})
            if master:
                print(f"step {step:6d} | hellaswag acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")
        if cfg.sample_every > 0 and (final or step % cfg.sample_every == 0) and (step > 0 or cfg.eval_only):
            evaluated = True
            if master or cfg.parallel == "fsdp":  # FSDP forwards are collective: every rank must run them
                texts = sample_text(raw, enc, cfg, device, step, autocast)
                if master:
                    for text in texts:
                        print(f"sample: {text!r}")
                    write({"type": "sample", "step": step, "texts": texts})
        if final:
            break
        if evaluated and (stopping := stop.should_stop(device, world)):
            # a signal (or the budget) that came during the evaluations stops the run here, not a step later:
            # torchrun SIGKILLs its workers 30 s after passing a signal on. The weights and the loader are where
            # the last step left them, so this is the checkpoint its end would have written, unless it did
            if step > start_step and not (cfg.ckpt_every > 0 and step % cfg.ckpt_every == 0):
                checkpoint(step)
            halt(stopping, f"at step {step}, before training it", resumable=step > start_step or found is not None)
            break

        if cfg.profile and step == profile_at:
            profiler = _start_profiler(device)
        t0 = time.time()
        lr = get_lr(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        skipped = ""
        loss, norm = train_step(model, optimizer, next_batch, grad_accum, autocast, cfg.grad_clip,
                                cfg.label_smoothing, scaler, guard)
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        loss_value = loss.item()  # also waits for the GPU, so the timing below is the real step time
        norm_value = norm.item()
        dt = time.time() - t0
        if master and device.type == "cuda" and step == start_step:
            # how much room --batch-size leaves: the first step has made everything a step holds (AdamW creates its
            # moments at its first update), and the peak includes the evaluations before it
            total = torch.cuda.get_device_properties(device).total_memory
            print(f"memory: peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated, "
                  f"{torch.cuda.max_memory_reserved(device) / 2**30:.1f} GiB reserved by PyTorch, of "
                  f"{total / 2**30:.1f} GiB on {device_name} (rank 0, after the first step)")
        if profiler is not None and step == profile_at + cfg.profile_steps - 1:
            _stop_profiler(profiler, out_dir, rank, master)
            profiler = None
        # an inf/nan gradient norm has already been applied (clipping scales every gradient by it), so the weights
        # are gone even when this step's loss, computed before the update, is finite; under fp16 the GradScaler
        # skips such steps itself
        if not math.isfinite(loss_value) or (scaler is None and not math.isfinite(norm_value)):
            if master:
                what = f"loss is {loss_value}" if not math.isfinite(loss_value) else f"gradient norm is {norm_value}"
                print(f"error: {what} at step {step}; stopping without writing a checkpoint. Lower --max-lr, raise "
                      "--warmup-steps, or resume from the last good checkpoint.", file=sys.stderr)
            result["stopped"] = "nan"
            break
        losses.append(loss_value)
        if guard is None:  # the guard is off, but its history is kept (from values read anyway, so no extra sync)
            # and checkpointed, so a run resumed with --skip-loss-z/--skip-norm-z has it from its first step
            detectors["loss"](loss_value)
            detectors["norm"](norm_value)
        if step > start_step:  # the first step includes compilation and warmup
            recent_ms = (recent_ms + [dt * 1000])[-20:]
        tok_s = tokens_per_step / dt
        util = mfu(flops_per_token, tok_s / world, device_name, cfg.peak_tflops * 1e12 if cfg.peak_tflops else None)
        write({"type": "train", "step": step, "tokens": tokens_at(step + 1), "loss": loss_value, "lr": lr,
               "grad_norm": norm_value, "ms": dt * 1000, "tok_s": tok_s, "mfu": util,
               **({"skipped": skipped} if skipped else {})})
        if master and skipped:
            print(f"step {step:6d} | update skipped: {skipped}")
        if master and (step % cfg.log_every == 0 or step == cfg.max_steps - 1):
            ms = sorted(recent_ms)[len(recent_ms) // 2] if recent_ms else dt * 1000
            eta = ms * (cfg.max_steps - step - 1) / 1000
            print(f"step {step:6d}/{cfg.max_steps} | loss {loss_value:.4f} | lr {lr:.2e} | norm {norm_value:.3f} | "
                  f"{dt * 1000:7.1f} ms | {tok_s:,.0f} tok/s | mfu {f'{util:.1%}' if util else 'n/a'} | "
                  f"eta {_fmt_time(eta)}", flush=True)

        stopping = stop.should_stop(device, world)
        if (cfg.ckpt_every > 0 and (step + 1) % cfg.ckpt_every == 0) or step + 1 == cfg.max_steps or stopping:
            checkpoint(step + 1)
        if stopping:
            halt(stopping, f"after step {step}")
            break
    if profiler is not None:  # the run ended inside the profiled window: keep what was recorded
        _stop_profiler(profiler, out_dir, rank, master)
    elif cfg.profile and master and step <= profile_at and not cfg.eval_only:
        print(f"profile: nothing recorded; the run ended before step {profile_at}, where profiling starts")
    if master and cfg.eval_only:
        print(f"done: evaluated the weights at step {step} in {_fmt_time(time.time() - t_start)}")
    elif master:
        print(f"done: {len(losses)} steps in {_fmt_time(time.time() - t_start)}; outputs in {out_dir}")
    if log:
        log.close()
    result["step"] = step
    return result


def shared_problem(problem: str | None, world: int) -> str | None:
    """This rank's reason to stop, else the first other rank's (named by its rank), else None: the same verdict on
    every rank, so all stop together and each says why, rather than one exiting while the others wait for it in a
    collective and then report only a lost peer. Collective when world > 1: every rank must call it."""
    if world == 1:
        return problem
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, problem)
    return problem or next((f"rank {r}: {p}" for r, p in enumerate(problems) if p), None)


def agree(mine: Any, rank: int, world: int, describe: Callable[[Any, Any], str | None]) -> str | None:
    """Rank 0's `mine` is sent to every rank, where describe(mine, rank 0's) says how this rank's differs (None: it
    does not); the first rank's difference comes back, the same on every rank, or None. Collective: one broadcast of
    rank 0's object (not world copies of everyone's) and a gather of the short answers."""
    if world == 1:
        return None
    box = [mine if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    answers: list[str | None] = [None] * world
    dist.all_gather_object(answers, describe(mine, box[0]))
    return next((a for a in answers if a), None)


# paths may differ from node to node (each mounts the data and out-dir where it will), so only whether they are set
# is compared (what the data hold is compared on its own); these others only change a rank's own files or figures
PER_NODE_FIELDS = ("data", "out_dir", "hellaswag", "init_from", "resume")
RANK_LOCAL_FIELDS = ("max_time", "peak_tflops", "keep_last", "keep_every", "preload", "dist_timeout")


def commands_disagree(cfg: TrainConfig, rank: int, world: int) -> str | None:
    """Why the ranks were started with commands that cannot train together, or None. Each node parses its own
    command line, and a flag that differs on one node would hang a collective (another --max-steps, --hellaswag off
    on one node only) or train the replicas apart (another --max-lr) without an error. Collective."""
    mine = {k: repr(v) for k, v in dataclasses.asdict(cfg).items()  # repr: a NaN equals itself
            if k not in PER_NODE_FIELDS + RANK_LOCAL_FIELDS}
    hellaswag = "off" if cfg.hellaswag_every <= 0 and not cfg.eval_only else cfg.hellaswag  # never run: off
    mine["hellaswag"] = repr(hellaswag if hellaswag in ("off", "auto") else "PATH")
    mine["init_from"] = repr("NAME" if cfg.init_from else "")

    def describe(mine: dict, first: dict) -> str | None:
        diff = ", ".join(f"--{k.replace('_', '-')} {mine[k]} (rank 0: {v})" for k, v in first.items() if mine[k] != v)
        return f"rank {rank} was started with {diff}: every node must run the same command" if diff else None

    return agree(mine, rank, world, describe)


def data_disagree(loaders: tuple[TokenLoader | None, ...], rank: int, world: int) -> str | None:
    """Why the ranks' shards differ, or None: each node reads its own copy of the data, and with a shard missing on
    one node its ranks index other windows, some served twice, silently. Names and token counts are compared."""
    mine = [(state["split"], state["shards"], state["shard_tokens"])
            for state in (loader.state_dict() for loader in loaders if loader is not None)]

    def describe(mine: list, first: list) -> str | None:
        for (split, names, sizes), (_, names0, sizes0) in zip(mine, first, strict=True):
            if (names, sizes) != (names0, sizes0):
                files, files0 = list(zip(names, sizes, strict=True)), list(zip(names0, sizes0, strict=True))
                i = next(i for i in range(max(len(files), len(files0)))
                         if i >= min(len(files), len(files0)) or files[i] != files0[i])
                there = f"{names[i]} ({sizes[i]:,} tokens)" if i < len(names) else "nothing"
                here = f"{names0[i]} ({sizes0[i]:,} tokens)" if i < len(names0) else "nothing"
                return (f"rank {rank}'s {split} shards differ from rank 0's ({len(names)} files against "
                        f"{len(names0)}; file {i + 1} is {there} there, {here} on rank 0): every node must hold the "
                        "same --data")
        return None

    return agree(mine, rank, world, describe)


def find_resume(cfg: TrainConfig, out_dir: Path, master: bool,
                unreadable: list[Path] | None = None) -> tuple[Path, dict] | None:
    """The checkpoint this run continues (path, loaded dict), None for a fresh start, or a ValueError where starting
    would bury another run: a fresh run in a directory with checkpoints would truncate its log and prune them, and
    --resume auto that can read none of them would do the same."""
    existing = checkpoints(out_dir) if out_dir.is_dir() else []
    if not cfg.resume:
        if existing and not cfg.eval_only:  # an evaluation writes nothing there
            raise ValueError(f"--out-dir {out_dir} holds another run's checkpoints ({existing[-1].name} the last "
                             "written): continue that run with --resume auto, or start this one in a new --out-dir "
                             "(or delete them first)")
        return None
    if cfg.resume != "auto":
        return Path(cfg.resume), load_checkpoint(cfg.resume, mmap=True)
    found = find_checkpoint(out_dir, unreadable)
    if found is None and existing:
        raise ValueError(f"none of the {len(existing)} checkpoints in {out_dir} can be read (see the warnings above): "
                         "resume one with --resume PATH, or move them away to start afresh")
    if found is None and cfg.eval_only:  # it would score a random model as if it were the run's
        raise ValueError(f"--eval-only --resume auto: no checkpoint in {out_dir} to evaluate")
    if found is None:
        if master:
            print(f"resume: no checkpoint in {out_dir}; starting "
                  + (f"from --init-from {cfg.init_from}" if cfg.init_from else "from scratch"))
        return None
    # passed over for an older write with a later step; not those written after it, which could not be read
    written_before = existing[:existing.index(found[0])]
    later = [p for p in written_before if int(p.stem.removeprefix("ckpt_")) > int(found[1]["step"])]
    if later and master:
        print(f"note: resuming {found[0].name}, the checkpoint written last; {later[-1].name} has a later step but "
              "was written earlier (a rewind leaves such files; files copied without their times lose the order: "
              "then pass --resume PATH)")
    return found


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def _load_hellaswag(cfg: TrainConfig, rank: int, local_rank: int, world: int, master: bool) -> list[dict] | None:
    """HellaSwag examples on every rank, or None on every rank (evaluate is collective, so all or none)."""
    if cfg.hellaswag == "off" or (cfg.hellaswag_every <= 0 and not cfg.eval_only):
        return None
    import hellaswag

    path = Path(cfg.hellaswag) if cfg.hellaswag != "auto" else hellaswag.default_cache_dir() / "hellaswag_val.jsonl"
    reason = ""
    if cfg.hellaswag == "auto" and local_rank == 0:  # one download per node, the other ranks wait
        try:
            hellaswag.download()
        except Exception as e:  # offline, a truncated response, an unwritable cache...: skipped on every rank, as
            # long as this rank reaches the barrier below with its reason (any exception here would leave it hanging)
            reason = f"could not download it: {e.__cause__ or e}"
    if world > 1:
        dist.barrier()
    examples = None
    try:
        examples = hellaswag.load_examples(path)
    except (OSError, ValueError) as e:  # load_examples' own hint names hellaswag.py's flags, not train.py's
        reason = reason or (f"{path} is not a file" if not path.is_file() else str(e).splitlines()[0][:200])
    if not examples:
        reason = reason or f"{path} holds no examples"
    # all or none, and the reason of the rank that lacks them, which is not always rank 0
    reason = shared_problem(reason if not examples else None, world)
    if not reason and world > 1:  # the same examples everywhere: evaluate's batch count (FSDP forwards are
        # collectives) and its score
        digest = hashlib.sha1(json.dumps(examples, sort_keys=True).encode()).hexdigest()
        reason = agree([len(examples), digest], rank, world, lambda mine, first: None if mine == first else (
            f"rank {rank} has {mine[0]} examples in {path}, rank 0 {first[0]}"
            + (", other ones" if mine[0] == first[0] else "")))
    if reason:
        if master:
            print(f"hellaswag: skipped ({reason}); pass --hellaswag PATH to a local hellaswag_val.jsonl to enable it, "
                  "or --hellaswag off to silence this")
        return None
    return examples


def _start_profiler(device: torch.device) -> torch.profiler.profile:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts, record_shapes=True)
    prof.start()
    return prof


def _stop_profiler(prof: torch.profiler.profile, out_dir: Path, rank: int, master: bool) -> None:
    prof.stop()
    out_dir.mkdir(parents=True, exist_ok=True)  # on another node the master's out_dir may not exist
    trace = out_dir / f"trace_rank{rank}.json"
    prof.export_chrome_trace(str(trace))
    if master:
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=15))
        print(f"profile: trace written to {trace} (open in chrome://tracing or ui.perfetto.dev)")


if __name__ == "__main__":
    # a diverged run must not look like success to a scheduler
    run_and_exit(main, lambda result: 1 if result.get("stopped") == "nan" else 0)
