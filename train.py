"""Train GPT-2: one process, or torchrun DDP / ZeRO-1 / FSDP2 on one or many nodes.

Usage:
    python train.py --preset tiny                                   # CPU, seconds (needs data/stdlib, see README)
    torchrun --standalone --nproc_per_node=8 train.py --preset gpt2-124m
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py --preset gpt2-124m
    python train.py --help                                          # every option, with its meaning
"""

# Read top to bottom: config and presets, the training loop (one screen), setup (one Run), one optimizer step, then
# parallelism and precision. The run's machinery (checkpoints, evaluation, logging, stop signals) is components.py.
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from common import (
    checkpoints,
    describe_provenance,
    first_on_each_node,
    hold_lock,
    import_torchao,
    load_checkpoint,
    load_model,
    mfu,
    parse_config,
    provenance,
    run_and_exit,
    same_verdict,
    setup_distributed,
    shared_problem,
    tensor_bytes,
)
from components import (
    Checkpointer,
    Evaluator,
    Profiler,
    RunLog,
    SpikeGuard,
    StopFlags,
    commands_disagree,
    data_disagree,
    fmt_time,
    optimizer_kind,
    weights_disagree,
)
from fineweb import SHUFFLES, DataError, TokenLoader
from model import GPT, MODEL_PRESETS, GPTConfig, check_weights, checkpoint_config
from trackers import missing_package, open_trackers

OPTIMIZERS = ("adamw", "muon", "adamw8bit")
COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead")
# SDPA kernel -> the global switch that allows it (torch.backends.cuda's switches also steer the CPU kernels)
SDPA_SWITCHES = {"flash": "enable_flash_sdp", "cudnn": "enable_cudnn_sdp", "efficient": "enable_mem_efficient_sdp",
                 "math": "enable_math_sdp"}


@dataclass
class TrainConfig:
    """Train a GPT-2 with this project's training loop. Flags override the chosen --preset."""

    # model
    model: str | None = None  # architecture preset: gpt2 (None), gpt2-medium/-large/-xl, d12..d48, llama-124m, tiny
    seq_len: int = 1024  # T: tokens per sequence; also the model's block_size
    n_layer: int | None = None  # override the preset's depth
    n_head: int | None = None  # override the preset's query heads
    n_embd: int | None = None  # override the preset's width
    n_kv_head: int | None = None  # GQA/MQA key-value heads (None = n_head)
    mlp: str | None = None  # gelu (GPT-2; None) or swiglu
    pos: str | None = None  # learned (GPT-2; None) or rope
    norm: str | None = None  # layernorm (GPT-2; None) or rmsnorm (LLaMA's; it has no bias, even with --bias true)
    bias: bool | None = None  # biases in Linear/LayerNorm layers (None = the preset's: true for GPT-2)
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
    optimizer: str = "adamw"  # adamw, muon (Muon for the blocks' matrices, AdamW for the rest) or adamw8bit (torchao)
    max_lr: float = 6e-4  # peak learning rate, reached after warmup (Muon's too: its update is scaled to AdamW's RMS)
    min_lr_frac: float = 0.1  # the schedule decays to min_lr_frac * max_lr
    lr_schedule: str = "cosine"  # after warmup: cosine or linear decay, constant, wsd (stable, then decay)
    decay_frac: float = 0.2  # wsd: the fraction of max_steps spent decaying to the min
    warmup_steps: int = 715  # linear warmup steps
    max_steps: int = 19073  # optimizer steps (19073 * 524288 tokens ~ 10B)
    weight_decay: float = 0.1  # decoupled weight decay, 2-D tensors only (AdamW's and Muon's)
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
    tensorboard: bool = False  # also log the scalars as TensorBoard event files in out_dir (pip install tensorboard)
    wandb: str = ""  # also log them to this W&B project ('' = off; WANDB_MODE=offline works; pip install wandb)
    # run control
    overfit_batch: bool = False  # train on the first batch only (sanity check: the loss must go to ~0)
    eval_only: bool = False  # evaluate the starting weights once and exit: no training, checkpoint or log
    max_time: float = 0.0  # wall-clock budget in minutes; checkpoint and stop when reached (0 = none)
    profile: bool = False  # profile a few steps after warmup; writes a Chrome/Perfetto trace to out_dir
    profile_steps: int = 3  # steps to profile
    print_config: bool = False  # print the resolved config (the preset, then the flags) as JSON and exit

    def __post_init__(self) -> None:
        choices = {"parallel": ("ddp", "zero1", "fsdp"), "recompute": ("none", "mlp", "block"),
                   "dtype": ("auto", "bf16", "fp16", "fp32"), "device": ("auto", "cuda", "cpu"),
                   "compile_mode": COMPILE_MODES, "attention": ("auto", *SDPA_SWITCHES),
                   "lr_schedule": ("cosine", "linear", "constant", "wsd"), "shuffle": SHUFFLES,
                   "optimizer": OPTIMIZERS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")
        if self.model is not None and self.model not in MODEL_PRESETS:
            raise ValueError(f"--model must be one of {', '.join(MODEL_PRESETS)}; got {self.model!r}")
        if self.norm not in (None, "layernorm", "rmsnorm"):
            raise ValueError(f"--norm must be one of layernorm, rmsnorm; got {self.norm!r}")
        self._check_numbers()

    def _check_numbers(self) -> None:
        at_least = {"seq_len": 1, "batch_size": 1, "total_batch_size": 1, "max_steps": 1, "eval_tokens": 1,
                    "log_every": 1, "sample_tokens": 1, "profile_steps": 1, "warmup_steps": 0, "eval_every": 0,
                    "hellaswag_every": 0, "sample_every": 0, "ckpt_every": 0, "keep_last": 0,
                    "keep_every": 0}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}; got {getattr(self, name)}")
        if self.hellaswag_limit is not None and self.hellaswag_limit < 1:
            raise ValueError(f"--hellaswag-limit must be >= 1 or none; got {self.hellaswag_limit}")
        if self.keep_every and self.ckpt_every and self.keep_every % self.ckpt_every:
            raise ValueError(f"--keep-every {self.keep_every} must be a multiple of --ckpt-every {self.ckpt_every}, or "
                             "no checkpoint is ever written at the steps it keeps")
        self._check_floats()

    def _check_floats(self) -> None:
        """Each written so that NaN fails it too."""
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
        for name in ("weight_decay", "eps", "grad_clip", "max_time", "skip_loss_z", "skip_norm_z"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0; got {getattr(self, name)}")
        for name in ("dropout", "beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name} must be in [0, 1); got {getattr(self, name)}")
        if math.isinf(self.weight_decay) or math.isinf(self.eps):
            raise ValueError(f"--weight-decay and --eps must be finite; got {self.weight_decay} and {self.eps}")
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
    # gpt2-124m's recipe for its LLaMA-style twin: RoPE, SwiGLU, GQA, RMSNorm, no biases
    "llama-124m": _preset(model="llama-124m", out_dir="out/llama-124m"),
    # a 30M-param model (nanoGPT's 10.7M leaves the token embedding out) on Tiny Shakespeare (~300K tokens): minutes
    # on one GPU
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
    # the offline demo: a small model on the Python standard library's docstrings, minutes on 2 CPU cores; small
    # batches learn more per token here, and the chunked loss keeps the logits in malloc's heap (docs/benchmarks.md)
    "demo": _preset(model="tiny", seq_len=128, data="data/stdlib_docs", total_batch_size=512, batch_size=4,
                    loss_chunk=128, max_lr=3e-3, warmup_steps=40, max_steps=900, eval_every=150, eval_tokens=8192,
                    hellaswag="off", sample_every=0, sample_tokens=64, ckpt_every=0, out_dir="out/demo",
                    sample_prompt="Return the"),
    # seconds on CPU, for tests
    "tiny": _preset(model="tiny", seq_len=64, data="data/stdlib", total_batch_size=512, batch_size=4,
                    max_lr=1e-3, warmup_steps=2, max_steps=10, eval_every=5, eval_tokens=512, hellaswag="off",
                    sample_every=0, ckpt_every=0, out_dir="out/tiny", sample_prompt="def "),
}


# ----------------------------------------------------------------------------------------------------------------------
# The training loop


def train(run: Run) -> dict[str, Any]:
    """Evaluate once in a while, take one optimizer step, log, checkpoint or stop. `step` counts the optimizer steps
    done: the evaluations at max_steps score the final weights. Returns run.result(step)."""
    cfg, stop = run.cfg, run.stop
    step = run.start_step
    for step in range(run.start_step, run.last_step + 1):
        final = step == run.last_step
        stop.last = final  # no step left to stop after: a Ctrl-C during the final evaluations quits at once

        # evaluate once in a while; a signal that came meanwhile stops the run here, not a step later
        evaluated = run.evaluator.run(step, final, tokens=run.tokens_at(step))
        if final:
            break
        if evaluated and (stopping := stop.should_stop()):
            if step > run.start_step and not run.checkpointer.due(step):
                run.checkpoint(step)
            run.halt(stopping, f"at step {step}, before training it", resumable=step > run.start_step or run.resumed)
            break

        # one optimizer step
        run.profiler.step_begins(step, run.device)
        t0 = time.time()
        lr = get_lr(step, cfg)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        loss, norm = train_step(run.model, run.optimizer, run.next_batch, run.grad_accum, run.autocast,
                                cfg.grad_clip, cfg.label_smoothing, run.scaler, run.guard.for_step())
        loss_value, norm_value = run.read(loss, norm)  # waits for the GPU, so dt is the step's real time
        dt = time.time() - t0
        run.after_step(step)

        # log
        if run.diverged(step, loss_value, norm_value):
            break
        run.guard.observe(loss_value, norm_value)
        run.log.step(step, run.record(step, loss_value, lr, norm_value, dt), timed=step > run.start_step)

        # checkpoint or stop
        stopping = stop.should_stop()
        if run.checkpointer.due(step + 1) or stopping:
            run.checkpoint(step + 1)
        if stopping:
            run.halt(stopping, f"after step {step}")
            break
    return run.result(step)


# ----------------------------------------------------------------------------------------------------------------------
# Setup: everything the loop needs, in one Run


@dataclass
class Run:
    """One training (or evaluation) run as the loop sees it: the model and optimizer, the batches, and the components
    that own checkpoints, evaluation, the log, the spike guard, stop signals and profiling."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    raw: GPT  # the unwrapped, uncompiled model: state dicts, evaluation, samples
    model: nn.Module  # what train steps call: compiled and/or wrapped
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    autocast: contextlib.AbstractContextManager
    next_batch: Callable[[], tuple] | None  # None only for --eval-only, which never trains
    train_loader: TokenLoader | None
    grad_accum: int
    start_step: int
    last_step: int  # max_steps, or start_step for --eval-only
    resumed: bool
    tokens_offset: int  # tokens before step 0 as this run counts them (a resume may change the batch)
    tokens_per_step: int
    flops_per_token: float
    device_name: str
    checkpointer: Checkpointer
    evaluator: Evaluator
    log: RunLog
    guard: SpikeGuard
    stop: StopFlags
    profiler: Profiler
    stopped: str | None = None  # "signal", "max_time" or "nan"
    t_start: float = dataclasses.field(default_factory=time.time)

    @property
    def master(self) -> bool:
        return self.rank == 0

    def tokens_at(self, step: int) -> int:
        """Tokens trained on before `step`, all ranks together."""
        return self.tokens_offset + step * self.tokens_per_step

    def read(self, loss: torch.Tensor, norm: torch.Tensor) -> tuple[float, float]:
        """The step's loss averaged over the ranks, and the (global) gradient norm, on the host."""
        if self.world > 1:
            dist.all_reduce(loss)
            loss /= self.world
        return loss.item(), norm.item()

    def record(self, step: int, loss: float, lr: float, norm: float, dt: float) -> dict[str, Any]:
        tok_s = self.tokens_per_step / dt
        peak = self.cfg.peak_tflops * 1e12 if self.cfg.peak_tflops else None
        util = mfu(self.flops_per_token, tok_s / self.world, self.device_name, peak)
        return {"tokens": self.tokens_at(step + 1), "loss": loss, "lr": lr, "grad_norm": norm, "ms": dt * 1000,
                "tok_s": tok_s, "mfu": util, **({"skipped": self.guard.skipped} if self.guard.skipped else {})}

    def after_step(self, step: int) -> None:
        if self.master and self.device.type == "cuda" and step == self.start_step:
            # the room --batch-size leaves: the first step has made everything a step holds (AdamW's moments too)
            total = torch.cuda.get_device_properties(self.device).total_memory
            print(f"memory: peak {torch.cuda.max_memory_allocated(self.device) / 2**30:.1f} GiB allocated, "
                  f"{torch.cuda.max_memory_reserved(self.device) / 2**30:.1f} GiB reserved by PyTorch, of "
                  f"{total / 2**30:.1f} GiB on {self.device_name} (rank 0, after the first step)")
        self.profiler.step_ends(step)

    def diverged(self, step: int, loss: float, norm: float) -> bool:
        """A NaN/inf loss, or gradient norm (already applied by clipping), ends the run without a checkpoint, and sets
        aside the one holding the weights that gave it. Under fp16 the GradScaler skips inf-gradient steps itself."""
        finite = math.isfinite(loss) and (self.scaler is not None or math.isfinite(norm))
        aside = self.checkpointer.judge(step, finite)
        if finite:
            return False
        if self.master:
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm}"
            why = (f" {aside.name} holds the weights that gave it: renamed {aside.name}.diverged, so --resume auto "
                   "takes the checkpoint before it.") if aside else ""
            print(f"error: {what} at step {step}; stopping without writing a checkpoint.{why} Lower --max-lr, raise "
                  "--warmup-steps, or resume from the last good checkpoint.", file=sys.stderr)
        self.stopped = "nan"
        return True

    def checkpoint(self, step: int) -> None:
        """Save the state after `step` steps, assembled from the components' state_dicts."""
        loader = self.train_loader.state_dict() if self.train_loader is not None else None
        parts = {"loader": loader, "scaler": self.scaler.state_dict() if self.scaler else None,
                 "outliers": self.guard.state_dict(), "tokens": self.tokens_at(step)}
        self.checkpointer.save(step, self.raw, self.optimizer, parts)

    def halt(self, stopping: str, when: str, resumable: bool = True) -> None:
        if self.master:
            print(f"stopping {when} ({self.stop.reason(stopping, self.cfg.max_time)}); "
                  + ("resume with --resume auto" if resumable else "nothing trained yet"))
        self.stopped = stopping

    def result(self, step: int) -> dict[str, Any]:
        """{"losses", "step", and when they happened "val_loss", "hellaswag", "checkpoint", "stopped"}."""
        self.profiler.finish(step, trained=not self.cfg.eval_only)
        took = fmt_time(time.time() - self.t_start)
        if self.master and self.cfg.eval_only:
            print(f"done: evaluated the weights at step {step} in {took}")
        elif self.master:
            print(f"done: {len(self.log.losses)} steps in {took}; outputs in {self.checkpointer.out_dir}")
        self.log.close()
        result: dict[str, Any] = {"losses": self.log.losses, **self.evaluator.latest}
        if self.checkpointer.last:
            result["checkpoint"] = self.checkpointer.last
        if self.stopped:
            result["stopped"] = self.stopped
        return {**result, "step": step}


def setup(cfg: TrainConfig, rank: int, local_rank: int, world: int, device: torch.device) -> Run:
    """Build the Run. Each check that one rank could fail alone is shared first, so every rank stops with the
    reason instead of leaving the others waiting in a collective."""
    cfg, grad_accum, use_compile = check_run(cfg, rank, world, device)
    master, prov = rank == 0, provenance(device, world)
    torch.manual_seed(cfg.seed + rank)  # ranks see different data, so different dropout masks are right
    if device.type == "cuda":
        torch.cuda.manual_seed(cfg.seed + rank)
    train_loader, val_loader = open_loaders(cfg, rank, world, device)
    checkpointer = Checkpointer(cfg, rank, world, prov)
    found = checkpointer.find()  # first: a resumed fine-tune needs no --init-from source
    raw = build_model(cfg, found, rank, local_rank, world).to(device)
    for loader in (train_loader, val_loader):
        if loader is not None:
            loader.check_vocab(raw.config.vocab_size)
    torch.manual_seed(cfg.seed + rank)
    if master:  # the full config and provenance are log.jsonl's first record
        print(f"model: {describe_model(cfg, raw.config)}\nprovenance: {describe_provenance(prov)}")
    if device.type == "cuda" and cfg.attention == "efficient" and raw.config.kv_heads != raw.config.n_head:
        raise ValueError("--attention efficient has no grouped-query (--n-kv-head) kernel; use --attention flash, "
                         "cudnn or auto")
    built = build_trainable(raw, cfg, device, use_compile, verbose=master)
    guard = SpikeGuard(cfg.skip_loss_z, cfg.skip_norm_z, world)
    start_step = resume(found, checkpointer, raw, built, train_loader, guard, world) if found is not None else 0
    tokens_per_step = grad_accum * cfg.batch_size * cfg.seq_len * world
    # the checkpoint's token count carries over, so the log's token axis stays right when the batch changes
    tokens_offset = int(found[1].get("tokens", start_step * tokens_per_step)) - start_step * tokens_per_step \
        if found is not None else 0
    if master:
        print_header(cfg, raw, built, start_step, grad_accum, world, use_compile, device)
    checkpointer.remove_partial_writes()
    # an evaluation-only run leaves out_dir alone: its log.jsonl may be a training run's
    logs = master and not cfg.eval_only
    resume_step = start_step if found is not None else None
    trackers = same_verdict(lambda: open_trackers(cfg.tensorboard, cfg.wandb, Path(cfg.out_dir), resume_step)
                            if logs else None, world)
    log = RunLog(Path(cfg.out_dir) / "log.jsonl" if logs else None, resume_step, master, cfg.max_steps, cfg.log_every,
                 trackers)
    log.write({"type": "config", "step": start_step, "config": dataclasses.asdict(cfg),
               "model_config": dataclasses.asdict(raw.config), "provenance": prov})
    evaluator = Evaluator(cfg, raw, built.model, val_loader, built.autocast, log, rank, world, local_rank)
    return Run(cfg, rank, world, device, raw, built.model, built.optimizer, built.scaler, built.autocast,
               batches(cfg, train_loader), train_loader, grad_accum, start_step,
               start_step if cfg.eval_only else cfg.max_steps, found is not None, tokens_offset, tokens_per_step,
               raw.flops_per_token(cfg.seq_len), prov["device"], checkpointer, evaluator, log, guard,
               StopFlags(cfg.max_time, interrupt=not cfg.eval_only, master=master, device=device, world=world),
               Profiler(cfg.profile and not cfg.eval_only, start_step, cfg.profile_steps, Path(cfg.out_dir), rank))


@contextlib.contextmanager
def hold_out_dir(cfg: TrainConfig, rank: int, world: int) -> Iterator[None]:
    """Hold --out-dir for the run: rank 0, its one writer, locks it, so a second run there stops at once instead of
    pruning this one's checkpoints, and a directory it cannot write is refused before anything runs. --eval-only
    writes nothing there and takes no lock. A problem on any rank stops every rank with it, before anything is
    created (a logging package asked for but missing, too: only rank 0 logs)."""
    out_dir, lock = Path(cfg.out_dir), None
    problem = missing_package(cfg.tensorboard, cfg.wandb) if rank == 0 else None
    if not problem and out_dir.exists() and not out_dir.is_dir():
        problem = f"--out-dir {out_dir} is a file, not a directory"
    elif not problem and rank == 0 and not cfg.eval_only:
        try:
            lock = hold_lock(out_dir / ".train.lock", f"another train.py is writing to --out-dir {out_dir}; let it "
                             "finish, or pass another --out-dir (an --eval-only run may share it)",
                             "make sure no other train.py writes there")
        except ValueError as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot write to --out-dir {out_dir} ({e.strerror}); pass a directory you can write to"
    try:
        if problem := shared_problem(problem, world):
            raise ValueError(problem)
        yield
    finally:
        if lock is not None:
            lock.close()


def check_run(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> tuple[TrainConfig, int, bool]:
    """Refuse what cannot run: (cfg, gradient accumulation steps, whether to compile). A node whose command differs
    stops every rank with the reason, first."""
    if problem := commands_disagree(cfg, rank, world):
        raise ValueError(problem)
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
    if cfg.optimizer != "adamw" and (why := shared_problem(optimizer_conflict(cfg), world)):  # a node may lack torchao
        raise ValueError(why)
    # by default on CUDA, except for a one-off evaluation, where compiling would take longer than it saves
    use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda" and not cfg.eval_only
    if use_compile and (why := cuda_graph_conflict(cfg, grad_accum, device)):
        raise ValueError(why)
    return cfg, grad_accum, use_compile


def open_loaders(cfg: TrainConfig, rank: int, world: int,
                 device: torch.device) -> tuple[TokenLoader | None, TokenLoader | None]:
    """The train and val loaders (an evaluation needs only val). A node without the data, or with other data, stops
    every rank with its reason: nodes with different data would train on, silently wrong."""
    B, T = cfg.batch_size, cfg.seq_len

    def load() -> tuple[TokenLoader | None, TokenLoader | None]:
        train_loader = TokenLoader(cfg.data, "train", B, T, rank, world, cfg.seed, device, cfg.preload, cfg.shuffle) \
            if not cfg.eval_only else None
        val_loader = TokenLoader(cfg.data, "val", B, T, rank, world, cfg.seed, device, cfg.preload) \
            if cfg.eval_every > 0 or cfg.eval_only else None
        return train_loader, val_loader

    loaders = same_verdict(load, world, DataError, (DataError, OSError))
    if problem := data_disagree(loaders, rank, world):
        raise DataError(problem)
    return loaders


def build_model(cfg: TrainConfig, found: tuple[Path, dict] | None, rank: int, local_rank: int, world: int) -> GPT:
    """The model on the CPU: the resumed checkpoint's architecture (restore() loads its weights), --init-from's
    weights, or a fresh init, identical on every rank."""
    if found is not None:
        src = checkpoint_config(found[1], f"--resume {found[0]}")
        check_architecture(cfg, src, f"--resume {found[0]}")
        if cfg.seq_len != src.block_size:
            raise ValueError(f"--seq-len {cfg.seq_len} is not the context of --resume {found[0]}, "
                             f"{src.block_size} tokens; pass --seq-len {src.block_size}")
        if int(found[1]["step"]) > cfg.max_steps and not cfg.eval_only:
            raise ValueError(f"--resume {found[0]} is at step {found[1]['step']}, past --max-steps {cfg.max_steps}; "
                             "raise --max-steps to train further, or score it with --eval-only")
        saved = found[1].get("train_config", {}).get("optimizer", "adamw")
        if saved != cfg.optimizer and not cfg.eval_only:
            raise ValueError(f"--resume {found[0]} holds --optimizer {saved}'s state, and this run asks for "
                             f"--optimizer {cfg.optimizer}: pass --optimizer {saved}, or start a new run (in a new "
                             f"--out-dir) from its weights with --init-from {found[0]}")
        model = GPT(dataclasses.replace(src, **run_options(cfg)))
        check_weights(model, found[1]["model"], f"checkpoint {found[0]}")  # restore() would print every tensor
        return model
    if cfg.init_from:
        raw = first_on_each_node(lambda: load_init(cfg), local_rank, world)
        if problem := weights_disagree(raw, f"--init-from {cfg.init_from}", rank, world):
            raise ValueError(problem)
        return raw
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    return GPT(model_config(cfg))


def resume(found: tuple[Path, dict], checkpointer: Checkpointer, raw: GPT, built: Trainable,
           loader: TokenLoader | None, guard: SpikeGuard, world: int) -> int:
    """Restore the checkpoint found into the built run on every rank (or stop all of them); returns its step."""
    path, ckpt = found
    step = same_verdict(lambda: checkpointer.restore(ckpt, raw, built.optimizer, loader, built.scaler), world,
                        ValueError, (DataError, ValueError))
    guard.load_state_dict(ckpt.get("outliers", {}))  # the z-scores' history, so a resumed run skips the same steps
    if checkpointer.master:
        print(f"resumed from {path} at step {step}")
        if note := schedule_change(ckpt.get("train_config", {}).get("max_steps"), checkpointer.cfg, step):
            print(note)
    del ckpt["model"], ckpt["optimizer"]  # copied into the model and optimizer: free the CPU copy
    return step


def schedule_change(saved_steps: int | None, cfg: TrainConfig, step: int) -> str | None:
    """A note when the resumed run had another --max-steps: from `step` on, the lr schedule is then not that run's.
    None where it is the same (a constant schedule, or --eval-only, which trains nothing)."""
    if saved_steps is None or saved_steps == cfg.max_steps or cfg.eval_only:
        return None
    old = dataclasses.replace(cfg, max_steps=int(saved_steps))
    differs = next((s for s in range(step, max(old.max_steps, cfg.max_steps) + 1) if get_lr(s, old) != get_lr(s, cfg)),
                   None)
    if differs is None:
        return None
    if cfg.lr_schedule == "wsd":
        change = (f"the wsd decay now runs from step {wsd_decay_start(cfg)} to {cfg.max_steps}, not from "
                  f"{wsd_decay_start(old)} to {old.max_steps}")
    else:
        change = f"the {cfg.lr_schedule} decay now ends at step {cfg.max_steps}, not {old.max_steps}"
    same = f"is that run's before step {differs} and differs from there on" if differs > step else \
        "differs from that run's from here on"
    return (f"note: the checkpoint's run had --max-steps {old.max_steps}, this run has {cfg.max_steps}: {change}, so "
            f"the learning rate {same} (at step {differs}: {get_lr(differs, cfg):.3g} here, "
            f"{get_lr(differs, old):.3g} in that run)")


def batches(cfg: TrainConfig, loader: TokenLoader | None) -> Callable[[], tuple] | None:
    """The train batches; with --overfit-batch always the run's first batch, also after a resume."""
    if loader is None or not cfg.overfit_batch:
        return loader.next_batch if loader is not None else None
    position = loader.state_dict()
    loader.reset()
    fixed = loader.next_batch()
    loader.load_state_dict(position)
    return lambda: fixed


def describe_model(cfg: TrainConfig, mcfg: GPTConfig) -> str:
    """The model in one line: `tiny: 2 layers, 4 heads, width 64, context 64, gelu MLP, learned positions`."""
    name = f"--init-from {cfg.init_from}" if cfg.init_from else cfg.model
    heads = f"{mcfg.n_head} heads" + (f" ({mcfg.kv_heads} key-value)" if mcfg.kv_heads != mcfg.n_head else "")
    shape = f"{mcfg.n_layer} layers, {heads}, width {mcfg.n_embd}, context {mcfg.block_size}, {mcfg.mlp} MLP, " \
        f"{mcfg.pos} positions" + (", RMSNorm" if mcfg.norm == "rmsnorm" else "")
    return f"{name}: {shape}" if name else shape


def print_header(cfg: TrainConfig, raw: GPT, built: Trainable, start_step: int, grad_accum: int, world: int,
                 use_compile: bool, device: torch.device) -> None:
    B, T, mcfg = cfg.batch_size, cfg.seq_len, raw.config
    if cfg.eval_only:
        print(f"{raw.num_params():,} params | evaluating at step {start_step} | {B} x {T} x {world} ranks | "
              f"{built.dtype}")
        return
    print(f"{raw.num_params():,} params | {grad_accum * B * T * world:,} tokens/step = {B} x {T} x {world} ranks x "
          f"{grad_accum} accum | {cfg.max_steps} steps | compile {use_compile} | "
          f"{optimizer_kind(built.optimizer, cfg.parallel)} | {built.dtype}")  # single: no torchrun
    for flag, on in (("--fused-gelu", mcfg.fused_gelu), ("--fused-ce", mcfg.fused_ce)):
        if on and device.type != "cuda":
            print(f"note: {flag} runs the PyTorch reference on {device.type}: the Triton kernel is CUDA only")
    if mcfg.half_residual and built.dtype == torch.float32:
        print("note: --half-residual does nothing in fp32: the residual stream is 16-bit only under autocast "
              "(--dtype bf16)")
    if cfg.compile_mode != "default" and not use_compile:
        print(f"note: --compile-mode {cfg.compile_mode} does nothing: the model is not compiled (compile is off "
              f"on {device.type} unless --compile true)")


ARCHITECTURE = ("n_layer", "n_head", "n_embd", "n_kv_head", "mlp", "pos", "norm", "bias")  # None = the preset's


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
    if cfg.model is not None:  # a named preset's shape and the options it sets (llama-124m's), where no flag does
        preset, plain = MODEL_PRESETS[cfg.model](), GPTConfig()
        named = [k for k in ARCHITECTURE if getattr(cfg, k) is None and getattr(preset, k) != has[k]
                 and (k in ("n_layer", "n_head", "n_embd") or getattr(preset, k) != getattr(plain, k))]
        if named:
            wrong.append(f"--model {cfg.model} ({', '.join(f'{k} {getattr(preset, k)}' for k in named)}; it has "
                         f"{', '.join(f'{k} {has[k]}' for k in named)})")
    if wrong:
        raise ValueError(f"{source} fixes the architecture, but this run asks for {', '.join(wrong)}: drop those "
                         "flags (or use a preset that does not set them), or pass the shape flags the weights were "
                         "trained with")


def load_init(cfg: TrainConfig) -> GPT:
    """The --init-from weights as a GPT on the CPU, with this run's context length (the learned position table
    cropped, as nanoGPT's crop_block_size) and run options. The architecture is the source's (check_architecture)."""
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


# ----------------------------------------------------------------------------------------------------------------------
# One optimizer step (bench.py times this same function) and its learning rate


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
        decay_start = wsd_decay_start(cfg)
        if step < decay_start:
            return cfg.max_lr
        return cfg.max_lr - (step - decay_start) / max(1, cfg.max_steps - decay_start) * (cfg.max_lr - min_lr)
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    if cfg.lr_schedule == "linear":
        return cfg.max_lr - progress * (cfg.max_lr - min_lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.max_lr - min_lr)


def wsd_decay_start(cfg: TrainConfig) -> int:
    """The step where wsd's linear decay to the min begins: decay_frac of max_steps before the end."""
    return max(cfg.warmup_steps, cfg.max_steps - round(cfg.decay_frac * cfg.max_steps))


# ----------------------------------------------------------------------------------------------------------------------
# Optimizers: AdamW (the default), Muon for the blocks' matrices with AdamW for the rest, torchao's 8-bit AdamW


def build_optimizer(model: GPT, cfg: TrainConfig, device: torch.device, verbose: bool) -> torch.optim.Optimizer:
    """--optimizer over the model's parameters, inside ZeroRedundancyOptimizer for --parallel zero1 under torchrun.
    Every group's lr is --max-lr's schedule (the loop sets it), Muon's included (see MuonAdamW)."""
    adamw = model.configure_optimizers(cfg.weight_decay, cfg.max_lr, (cfg.beta1, cfg.beta2), cfg.eps, device.type,
                                       verbose=verbose and cfg.optimizer != "muon")
    zero1 = cfg.parallel == "zero1" and dist.is_initialized()
    if cfg.optimizer == "adamw" and not zero1:
        return adamw  # fused AdamW on CUDA: every parameter updated in one launch
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in adamw.param_groups]
    options = {"lr": cfg.max_lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "fused": device.type == "cuda"}
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW
    if cfg.optimizer == "muon":
        groups, optimizer_class = muon_groups(model, cfg.weight_decay, verbose), MuonAdamW
    elif cfg.optimizer == "adamw8bit":
        import_torchao("--optimizer adamw8bit")
        from torchao.optim import AdamW8bit

        optimizer_class = AdamW8bit
        del options["fused"]  # it compiles its own step
        if verbose:
            print("optimizer: torchao's AdamW8bit: 8-bit moments (blocks of 256) for tensors of 4096+ elements")
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        # the same optimizer and groups, with each rank keeping the state of only its share of the parameters
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, **options)
    else:
        optimizer = optimizer_class(groups, **options)
    if cfg.optimizer == "adamw8bit":
        (optimizer.optim if zero1 else optimizer).register_step_pre_hook(lr_as_tensor)
    return optimizer


def muon_groups(model: GPT, weight_decay: float, verbose: bool) -> list[dict[str, Any]]:
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
    return [{"params": hidden, "weight_decay": weight_decay, "muon": True},
            {"params": decay, "weight_decay": weight_decay, "muon": False},
            {"params": rest, "weight_decay": 0.0, "muon": False}]


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the groups marked "muon", AdamW for the others, as one optimizer. The two inner ones hold
    the very group dicts and the state dict of this one, so the loop's lr, GradScaler, ZeRO-1 and the checkpoint see
    one ordinary optimizer, and state_dict() is Optimizer's own.

    Muon's lr is scaled by 0.2 * sqrt(max(rows, cols)) per matrix (torch's adjust_lr_fn="match_rms_adamw", from
    Moonshot's "Muon is Scalable for LLM Training", 2025): its update RMS is then about 0.2 x lr, as AdamW's
    typically is, so both parts share --max-lr, its schedule and --weight-decay. Momentum 0.95 with Nesterov and 5
    Newton-Schulz steps are torch's defaults, Keller Jordan's. Fused matrices (qkv, SwiGLU's gate and up) are
    orthogonalized whole."""

    def __init__(self, params: list[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, fused: bool = False, momentum: float = 0.95):
        groups = list(params)
        for group in groups:  # ZeRO-1 gives every group AdamW's defaults: Muon's take its own (its eps is another one)
            if group["muon"]:
                for key in set(group) - {"params", "weight_decay", "muon", "lr"}:
                    del group[key]
        self.muon = torch.optim.Muon([g for g in groups if g["muon"]], lr=lr, momentum=momentum, nesterov=True,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([g for g in groups if not g["muon"]], lr=lr, betas=betas, eps=eps, fused=fused)
        super().__init__(groups, {})
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this one's groups (in order) and state."""
        self.muon.param_groups = [g for g in self.param_groups if g["muon"]]
        self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: share them again
        self._share()


def lr_as_tensor(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A step pre-hook for torchao's 8-bit AdamW, which compiles its step for lr as a tensor (a float would be baked
    into the graph, and each new value recompile it); the loop sets a float."""
    for group in optimizer.param_groups:
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)


def optimizer_conflict(cfg: TrainConfig) -> str | None:
    """Why --optimizer cannot run with this torch, these packages or --parallel, or None."""
    if cfg.optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        return f"--optimizer muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}"
    if cfg.optimizer == "muon" and cfg.parallel == "fsdp":
        return ("--optimizer muon orthogonalizes whole matrices, which --parallel fsdp shards across ranks; use "
                "--parallel zero1 (each matrix whole on one rank) or ddp")
    if cfg.optimizer == "adamw8bit" and cfg.parallel == "fsdp":
        return ("--optimizer adamw8bit does not support --parallel fsdp here (8-bit states of sharded tensors do not "
                "go through the full-state checkpoint); use --parallel zero1, which shards the 8-bit state too, or ddp")
    if cfg.optimizer == "adamw8bit":
        try:
            import_torchao("--optimizer adamw8bit")
        except ImportError as e:
            return str(e)
    return None


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of every tensor in the optimizer's state (this rank's), an 8-bit state's codes, scales and code
    table (tensor subclasses' inner tensors) included."""
    local = getattr(optimizer, "optim", optimizer)  # ZeRO-1's own share
    return sum(tensor_bytes(v) for state in local.state.values() for v in state.values() if torch.is_tensor(v))


# ----------------------------------------------------------------------------------------------------------------------
# Parallelism, precision and compile, applied from outside the model


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


def uses_cuda_graphs(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the compile mode replays CUDA graphs here: only on CUDA, where compile=None means on, and only in
    these two modes."""
    return device.type == "cuda" and cfg.compile is not False and cfg.compile_mode in ("reduce-overhead",
                                                                                        "max-autotune")


def cuda_graph_conflict(cfg: TrainConfig, grad_accum: int, device: torch.device) -> str | None:
    """Why this compile mode cannot run with this gradient accumulation, or None: a CUDA graph's replay overwrites
    the .grad the accumulation adds into (docs/notes.md, "CUDA graphs and accumulation")."""
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
    """Put the SDPA kernels allowed into torch.compile's cache key, which does not key on the switches (a cached
    graph kept another run's kernel: docs/notes.md). Appended to the user's TORCH_COMPILE_CACHE_KEY_TAG."""
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
    """parallelize and compile_model in the order each needs: DDP wraps the compiled model (nanoGPT's order; the
    other way breaks Dynamo's graph in DDP's forward), FSDP2 is compiled after fully_shard, which needs plain blocks."""
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


def precision(cfg: TrainConfig, device: torch.device) -> tuple[torch.dtype, contextlib.AbstractContextManager]:
    name = cfg.dtype if cfg.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    if dtype == torch.float32:
        return dtype, contextlib.nullcontext()
    return dtype, torch.autocast(device_type=device.type, dtype=dtype)


def sync_gradients(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on non-final micro-steps of gradient accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync") and not enabled:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------------------
# Entry points


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line: parse argv (sys.argv[1:] by default) into a TrainConfig and run() it. A user error (bad
    flag, data, checkpoint) is one line on stderr and SystemExit(1)."""
    try:
        cfg = parse_config(TrainConfig, sys.argv[1:] if argv is None else argv, PRESETS, __doc__)
    except SystemExit as e:
        if e.code and not isinstance(e.code, int) and "RANK" in os.environ and not dist.is_initialized():
            _stop_the_other_ranks(str(e.code).removeprefix("error: "))
        raise
    if cfg.print_config:
        print(json.dumps(dataclasses.asdict(dataclasses.replace(cfg, print_config=False)), indent=1))
        return {}
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
    _, _, world, _ = setup_distributed(TrainConfig().device, TrainConfig().dist_timeout)
    try:
        shared_problem(problem, world)
    finally:
        dist.destroy_process_group()


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or, with eval_only, evaluate) as cfg says; the entry point from Python, where errors stay exceptions
    (DataError, ValueError, FileNotFoundError for the user's). Under torchrun it joins the default process group (or
    creates it, and then destroys it at the end). Returns train()'s result, the same on every rank."""
    owns_group = not dist.is_initialized()
    rank, local_rank, world, device = setup_distributed(cfg.device, cfg.dist_timeout)
    attention = sdpa_switches()
    try:
        with hold_out_dir(cfg, rank, world):
            state = setup(cfg, rank, local_rank, world, device)
            with state.stop:  # its signal handlers live as long as the loop, and put the caller's back
                result = train(state)
                if dist.is_initialized():
                    dist.barrier()  # leave together: no rank tears its group down while another is in a collective
        return result
    finally:
        set_sdpa_switches(attention)  # --attention's choice must not outlive the run either
        if owns_group and dist.is_initialized():  # a group the caller made is the caller's to destroy
            dist.destroy_process_group()


if __name__ == "__main__":
    # a diverged run must not look like success to a scheduler
    run_and_exit(main, lambda result: 1 if result.get("stopped") == "nan" else 0)
