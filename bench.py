"""Benchmarks: the training step across variants (tokens/s, MFU, peak memory, optimizer state, where the time goes),
the Triton kernels in GB/s, batch-1 decoding against HF `generate`, ragged prompts decoded at once against one at a
time, INT8 decoding against fp32, HellaSwag examples/s, pruned models' forward and decoding. Train, kernel and forward
rows: the median of --steps timed runs after --warmup untimed ones; decode, int8 and prune's decoding: a first
generation (reported beside), then the median of 3; batched: the fastest of BATCHED_REPEATS runs.

Usage:
    python bench.py                                   # every suite; GPT-2 124M, T=1024, bf16 on CUDA; tiny on CPU
    python bench.py --suite train --variants eager,compile --steps 20 --warmup 10
    python bench.py --suite batched --batched-rows 64 --batched-tokens 48   # generate.generate's batching
    python bench.py --suite int8 --ckpt out/demo/ckpt_000900.pt   # tok/s and greedy agreement (pip install torchao)
    python bench.py --suite prune --ckpt out/demo/ckpt_000900.pt  # dense against each pruning method
    python bench.py --table-from out/bench.json       # the tables of an earlier run, or of one killed midway
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import gc
import itertools
import json
import math
import os
import random
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import common
import fused_ce
import hellaswag
import parallel
import train
from fineweb import atomic_write
from fused_gelu import bias_gelu_reference, fused_bias_gelu, triton_available
from generate import generate, sample
from model import GPT, MODEL_PRESETS, GPTConfig
from sample import SampleConfig, quantize_int8, weight_bytes

DECODE_INIT_STD = 0.1  # random decode/int8 weights: at GPT-2's 0.02 greedy decoding repeats one token
BATCHED_REPEATS = 3  # timed runs of each way, interleaved; the fastest counts (a shared CPU's load comes and goes)
DLOSS_STEP = 3  # dloss compares the train rows' losses at this step (two AdamW updates in), or at the last if sooner
# what --model auto, and --seq-len, --kernel-rows, --batch-sizes unset, mean on each device type
DEVICE_DEFAULTS = {"cuda": ("gpt2", 1024, 65536, (16, 32, 64)), "cpu": ("tiny", 64, 1024, (4,))}
Row = dict[str, Any]


@dataclasses.dataclass
class BenchConfig:
    """Benchmark the training step, the Triton kernels, decoding (batch 1 and batched), INT8 decoding and HellaSwag;
    print tables and JSON."""

    suite: str = "all"  # all, or a comma list run as given: kernel, decode, batched, int8, prune, hellaswag, train
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    out: str = "out/bench.json"  # JSON output, rewritten after every row: provenance, the resolved config, rows
    steps: int = 20  # timed repetitions per train or kernel row; the median is reported
    warmup: int = 10  # untimed repetitions before timing (compilation and autotuning happen here)
    dtype: str = "auto"  # train and kernel dtype: auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32
    peak_tflops: float | None = None  # override the device's peak bf16 TFLOP/s for MFU (common.py's table otherwise)
    seed: int = 1337  # seeds the weights and the random tokens
    threads: int = 0  # CPU threads for torch (0 = torch's default); pin it to make CPU numbers comparable
    table_from: str = ""  # print the tables of an earlier run's JSON and exit (a killed run keeps its finished rows)
    model: str = "auto"  # train and hellaswag model preset (model.py); auto = gpt2 (124M) on CUDA, tiny on CPU
    seq_len: int | None = None  # train T; None = 1024 on CUDA, 64 on CPU
    batch_sizes: tuple[int, ...] = ()  # micro-batch sweep; the largest is the others' B; () = 16,32,64 CUDA, 4 CPU
    grad_accum: int = 1  # micro-steps per timed optimizer step (parallel.train_step's gradient accumulation)
    variants: str = "all"  # train variants (comma list) or all; names in default_variants(), e.g. eager,compile
    profile: bool = True  # profile one extra step per train row: its attention kernel and where the time goes
    kernel_rows: int | None = None  # M of the (M, N) MLP activation; None = 65536 (B=64 x T=1024) on CUDA, 1024 on CPU
    kernel_cols: int = 3072  # N: GPT-2 124M's MLP width; the loss rows take M / 4 rows of GPT-2's 50304 logits
    kernel_impls: str = "eager,compile,triton"  # which kernel implementations to time (comma list)
    decode_model: str = "gpt2"  # preset of the random decode and int8 weights: gpt2 (124M) or tiny
    decode_tokens: tuple[int, ...] = (128, 512)  # new tokens per decode row (greedy, batch 1, a 16-token prompt)
    batched_rows: int = 64  # batched suite: random prompts of 8-24 tokens, decoded at once and one at a time
    batched_tokens: int = 48  # batched suite: greedy new tokens per prompt
    ckpt: str = ""  # int8 and prune weights: a checkpoint; '' = --init-from, or random --decode-model weights
    init_from: str = ""  # or an HF GPT-2 (gpt2 or a local directory). Random weights make the agreement meaningless
    int8_tokens: int = 128  # greedy tokens per int8 and prune row; the later rows count those equal to the first's
    prune_sparsity: float = 0.5  # prune rows: magnitude and structured prune this share (2:4 always 0.5)
    hellaswag_batch_sizes: tuple[int, ...] = (1, 16, 64)  # examples per forward pass (hellaswag.py's default is 16)
    hellaswag_examples: int = 256  # synthetic examples per timed evaluation

    def __post_init__(self) -> None:
        """Resolve the device's defaults (twice changes nothing); a bad flag fails here, before any row runs."""
        device = common.resolve_device(self.device)  # cuda:N becomes the current device, where Triton launches
        self.device = str(device)
        model, seq_len, rows, sizes = DEVICE_DEFAULTS[device.type]
        self.model, self.seq_len = self.model.replace("auto", model), self.seq_len or seq_len
        self.kernel_rows, self.batch_sizes = self.kernel_rows or rows, self.batch_sizes or sizes
        parallel.check_flags([
            (bool(self.suites()) and set(self.suites()) <= set(SUITES),
             f"--suite must be all or a comma list of {', '.join(SUITES)}; got {self.suite!r}"),
            (min(self.steps, self.grad_accum, self.int8_tokens, self.batched_rows, self.batched_tokens) >= 1,
             "--steps, --grad-accum, --int8-tokens, --batched-rows and --batched-tokens must be >= 1"),
            (0 <= self.prune_sparsity < 1, f"--prune-sparsity must be in [0, 1); got {self.prune_sparsity}"),
            (not (out := Path(self.out)).is_dir(),
             f"--out {self.out} is a directory; pass the JSON file to write, e.g. {out / 'bench.json'}"),
            (not (self.ckpt and self.init_from),
             "pass either --ckpt or --init-from (the int8 and prune suites' weights), not both")])
        # a misspelt --variants, or a field TrainConfig refuses, fails now; what only --tp/--pp refuse (fp16's
        # GradScaler) is their rows' reason, so that --dtype fp16 runs the rest of `all`: checked without them
        for variant in select_variants(self):
            alone = {k: v for k, v in variant.train.items() if k not in ("tp", "pp", "sequence_parallel",
                                                                         "pp_schedule")}
            train_config(self, variant._replace(train=alone))

    def suites(self) -> tuple[str, ...]:
        return tuple(picked(self.suite, SUITES))


def picked(text: str, every: Iterable[str]) -> list[str]:
    """`all` (every name, in order) or the names of a comma list, as given: the caller checks them."""
    return list(every) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]


class Skipped(Exception):
    """A row that cannot run on this machine (no CUDA, no triton); reported with its reason, as an ImportError is."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, steps: int, warmup: int = 0) -> tuple[float, list[float]]:
    """Seconds of `warmup` untimed calls of fn, then ms of each of `steps` calls (on CUDA the GPU's: between events)."""
    t0, times = time.perf_counter(), []
    for _ in range(warmup):
        fn()
    sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":  # events around each call: the host waits for nothing in the loop
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        sync(device)
        return warmup_s, [start.elapsed_time(end) for start, end in events]
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return warmup_s, times


def reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def guarded(row: Row, fn: Callable[[], Row]) -> Row:
    """row + fn()'s metrics with status ok, or row with status skipped/failed and the reason."""
    try:
        return {**row, **fn(), "status": "ok"}
    except (Skipped, ImportError) as e:  # ImportError: an optional package (torchao) is not installed
        return {**row, "status": "skipped", "reason": str(e)}
    except Exception as e:  # one failing row (OOM, a compiler error) must not end the run
        return {**row, "status": "failed", "reason": reason(e)}


def device_lost() -> str:
    """Free what a row left, or say why that failed: a CUDA error (an illegal memory access) is sticky; '' if none."""
    try:
        torch.compiler.reset()
        gc.collect()
        torch.cuda.empty_cache()  # a no-op where CUDA never started
        return ""
    except Exception as e:
        return reason(e)


# ----------------------------------------------------------------------------------------------------------------------
# Training step: built by train.py's own builder, timed in its own train_step


class Variant(NamedTuple):
    name: str  # row label and what --variants selects
    train: dict[str, Any] = {}  # TrainConfig fields it changes from the eager base
    ddp: bool = False  # in a one-rank process group, so the model is DDP-wrapped as under torchrun


def default_variants(batch_sizes: tuple[int, ...]) -> list[Variant]:
    """Most important first, at the largest batch size unless set; a new optimization is one more line here."""
    c = {"compile": True}
    fused = {**c, "fused_gelu": True}
    overrides = {
        "eager": {}, "compile": c, "compile+fused": fused, "compile+fused-ce": {**c, "fused_ce": True},
        "compile+fused+fused-ce": {**fused, "fused_ce": True}, "compile+half-residual": {**c, "half_residual": True},
        "compile+all": {**fused, "fused_ce": True, "half_residual": True},
        **{f"compile-b{b}": {**c, "batch_size": b} for b in batch_sizes if b != max(batch_sizes)},
        "compile+flash-attn": {**c, "attention": "flash"}, "compile+cudnn-attn": {**c, "attention": "cudnn"},
        "compile+chunked-ce": {**c, "loss_chunk": 4096},
        "compile+fused-ce-chunked": {**c, "fused_ce": True, "loss_chunk": 16384},
        "compile-max-autotune": {**c, "compile_mode": "max-autotune-no-cudagraphs"}, "compile+ddp": c,
        "compile-reduce-overhead": {**c, "compile_mode": "reduce-overhead"}, "eager+fused": {"fused_gelu": True},
        "compile-fp32": {**c, "dtype": "fp32"}, "compile+recompute": {**c, "recompute": "mlp"},
        "compile+muon": {**c, "optimizer": "muon"}, "compile+adamw8bit": {**c, "optimizer": "adamw8bit"},
        # tensor / pipeline parallel: tp1 and pp1 run that code on one rank; the others under torchrun
        # --nproc_per_node=2, where the one-rank variants are skipped
        "tp1": {"tp": 1}, "pp1": {"pp": 1}, "tp2": {"tp": 2}, "tp2+sp": {"tp": 2, "sequence_parallel": True},
        "pp2": {"pp": 2}, "pp2-gpipe": {"pp": 2, "pp_schedule": "gpipe"}}
    return [Variant(name, fields, ddp=name.endswith("+ddp")) for name, fields in overrides.items()]


def select_variants(cfg: BenchConfig) -> list[Variant]:
    known = {v.name: v for v in default_variants(cfg.batch_sizes)}
    names = picked(cfg.variants, known)
    if not names or set(names) - set(known):
        raise ValueError(f"--variants: unknown {', '.join(sorted(set(names) - set(known))) or '(empty)'}; choose from "
                         f"all or {', '.join(known)}")
    return [known[n] for n in names]


def train_config(cfg: BenchConfig, variant: Variant) -> train.TrainConfig:
    """The TrainConfig a real run of this variant would use (one rank, total batch = B * T * grad_accum)."""
    model = {f.name for f in dataclasses.fields(GPTConfig)}  # the model's options go through TrainConfig.arch
    tcfg = dataclasses.replace(train.TrainConfig(model=cfg.model, seq_len=cfg.seq_len, batch_size=max(cfg.batch_sizes),
                                                 dtype=cfg.dtype, compile=False, device=cfg.device.split(":")[0],
                                                 hellaswag="off", sample_every=0),
                               **{k: v for k, v in variant.train.items() if k not in model},
                               arch={k: v for k, v in variant.train.items() if k in model})
    return dataclasses.replace(tcfg, total_batch_size=tcfg.batch_size * tcfg.seq_len * cfg.grad_accum)


def bench_train(cfg: BenchConfig, variant: Variant) -> Row:
    """Time parallel.train_step on random tokens on the device, built as train.py builds its run; profile one more."""
    device, tcfg, accum = torch.device(cfg.device), train_config(cfg, variant), cfg.grad_accum
    if any(map(tcfg.arch.get, ("fused_gelu", "fused_ce"))) and not (device.type == "cuda" and triton_available()):
        raise Skipped("the fused kernels need CUDA and triton (elsewhere train.py runs the PyTorch reference)")
    if (ranks := max(tcfg.tp, 1) * max(tcfg.pp, 1)) != (world := dist.get_world_size() if dist.is_initialized() else 1):
        raise Skipped(f"runs on {ranks} ranks, this run has {world}: " + (
            f"torchrun --nproc_per_node={ranks} bench.py --variants {variant.name}" if ranks > 1 else "no torchrun"))
    if why := ((tcfg.compile and parallel.cuda_graph_conflict(tcfg, accum, device))
               or parallel.attention_conflict(tcfg, device, train.model_config(tcfg))
               or parallel.optimizer_conflict(tcfg)):
        raise Skipped(why)
    B, T, gen = tcfg.batch_size, tcfg.seq_len, torch.Generator(device=device).manual_seed(cfg.seed)
    tokens = torch.randint(0, common.GPT2_VOCAB, (accum, B, T + 1), generator=gen, device=device)
    micro = itertools.cycle([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with contextlib.ExitStack() as stack:
        if (variant.ddp or tcfg.tp or tcfg.pp) and not dist.is_initialized():  # as torchrun --nproc_per_node=1
            dist.init_process_group(dist.Backend.default_device_backend_map[device.type], store=dist.HashStore(),
                                    rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        torch.manual_seed(cfg.seed)
        raw = GPT(train.model_config(tcfg)).to(device)
        built, losses = parallel.build_trainable(raw, tcfg, device, bool(tcfg.compile), verbose=False), []
        step = lambda: losses.append(parallel.train_step(  # no .item(): it would make the host wait for the GPU
            built.model, built.optimizer, lambda: next(micro), accum, built.autocast, tcfg.grad_clip,
            tcfg.label_smoothing, built.scaler)[0])
        warmup_s, ms = time_ms(step, device, cfg.steps, cfg.warmup)
        probe = {"attention": "n/a (graph)" if cfg.profile else "n/a (--profile false)", "breakdown": None}
        if cfg.profile and not parallel.uses_cuda_graphs(tcfg, device):  # a graph replay runs no aten ops to name
            try:  # after the timing: CUPTI may slow what follows
                probe = dict(zip(probe, profile_step(step, device), strict=True))
            except Exception as e:  # a diagnostic: a profiler that fails (CUPTI) must not cost the row its timing
                probe["attention"] = f"n/a (profiler: {reason(e)[:60]})"
    median, peak = statistics.median(ms), cfg.peak_tflops * 1e12 if cfg.peak_tflops else None
    tok_s = B * T * accum / (median / 1000)
    return {"batch_size": B, "seq_len": T, "grad_accum": accum, "dtype": str(built.dtype).removeprefix("torch."),
            "tokens_per_step": B * T * accum, "ms_per_step": median, "ms_min": min(ms), "ms_max": max(ms),
            "tok_per_s": tok_s, "warmup_s": warmup_s,
            "mfu": common.mfu(raw.flops_per_token(T), tok_s / ranks, common.device_name(device), peak), "ranks": ranks,
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "optim_state_bytes": parallel.optimizer_state_bytes(built.optimizer),
            # the last timed step's loss (CUDA-graph rows run no steps after it), and dloss's
            "loss": losses[cfg.warmup + cfg.steps - 1].item(),
            "loss_early": losses[min(DLOSS_STEP, cfg.warmup + cfg.steps) - 1].item(),
            **probe, "params": raw.num_params(), "module": type(built.model).__name__}  # GPT, OptimizedModule, DDP


def loss_delta(row: Row, earlier: list[Row]) -> float:
    """Loss at DLOSS_STEP minus the first earlier ok row's that trained the same weights on the same tokens."""
    ref = next((r for r in earlier if r.get("status") == "ok"
                and (r["batch_size"], r["grad_accum"]) == (row["batch_size"], row["grad_accum"])), row)
    return row["loss_early"] - ref["loss_early"]


def run_train(cfg: BenchConfig) -> Iterator[Row]:
    """bench_train for each selected variant, a row each (ok, skipped or failed) as it ends: a row can take minutes."""
    rows: list[Row] = []
    for variant in select_variants(cfg):
        row = guarded({"suite": "train", "name": variant.name, "model": cfg.model, "overrides": variant.train},
                      lambda v=variant: bench_train(cfg, v))
        if row["status"] == "ok":
            row["loss_delta"] = loss_delta(row, rows)
        rows.append(row)
        yield row
        if device_lost():
            return  # a sticky CUDA error: nothing more can run here (main says why)


# Where a step's time goes, by kernel (or CPU op) name: the first pattern that matches wins, so an Inductor kernel
# named after the ops it fused lands in the first of them listed here; no match is "other".
STEP_PARTS = (
    ("comm", r"nccl|gloo|c10d|allreduce|all_reduce|reduce_scatter|allgather|all_gather|wait_tensor"),
    ("copy", r"^memcpy|^memset|copy_kernel|^triton_[a-z]+_fused__to_copy_\d+$"  # casts alone, eager or compiled
             r"|^aten::(copy_|_to_copy|clone|contiguous)$"),
    # not Inductor's kernels named after the SDPA op they feed (layouts, c_attn's bias gradient): the kernels proper
    ("attention", r"^(?!triton_).*(flash|fmha|sdpa|attention)|^aten::_scaled_dot_product"),
    ("matmul", r"^triton_tem|^(?!triton).*(gemm|nvjet|cutlass|xmma|wgmma|s16816|cublas|splitk)"
               r"|^aten::(b|add|baddb)?mm$"),
    ("optimizer", r"adam|multi_tensor|foreach|vector_norm|optimizer\.step"),  # the step, and the clipping's norm
    ("loss", r"softmax|nll_loss|cross_entropy|logsumexp"),
    ("norm", r"layer_?norm|gammabetabackward"),  # eager LayerNorm's weight/bias gradient kernel
    ("gelu", r"gelu"),
    ("embedding", r"embedding|index_?select|index_put|indexing_backward|scatter|gather"),
)
TOP_KERNELS = 60  # kernels (or CPU ops) by total time that a row's breakdown keeps in the JSON


def step_part(name: str) -> str:
    return next((part for part, pattern in STEP_PARTS if re.search(pattern, name.lower())), "other")


def profile_step(step: Callable[[], Any], device: torch.device) -> tuple[str, Row | None]:
    """The SDPA kernels one step ran and where its time went: CUDA kernel times, or CPU ops' self times."""
    cuda, kind = device.type == "cuda", torch.autograd.DeviceType
    # tear CUPTI down when the profile ends, or older Kineto slows every later launch (pytorch#144455)
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    with torch.profiler.profile() as prof:  # the CPU's ops, and CUDA's kernels where there is a GPU
        t0 = time.perf_counter()
        step()
        sync(device)
        wall_ms = (time.perf_counter() - t0) * 1000
    events = prof.events()
    sdpa = {e.name for e in events if e.name.startswith("aten::_scaled_dot_product")}
    attention = ",".join(k for k in ("flash", "cudnn", "efficient") if any(f"_{k}" in n for n in sdpa)) or "math"
    if cuda:  # record_function ranges also appear on the GPU's timeline (annotations), spanning counted kernels
        kernels = [e for e in events if e.device_type == kind.CUDA and not getattr(e, "is_user_annotation", False)
                   and "annotation" not in str(getattr(e, "activity_type", ""))]
        timed, busy_us, end = [(e.name, e.time_range.elapsed_us()) for e in kernels], 0.0, -math.inf
        for a, b in sorted((e.time_range.start, e.time_range.end) for e in kernels):  # busy: when any kernel ran
            busy_us, end = busy_us + max(b - max(a, end), 0.0), max(b, end)
        source, basis = "cuda kernels", "ms_per_step"
    else:  # CPU ops slow down under the profiler, kernels hardly: the basis is the profiled step's wall time
        timed = [(e.name, e.self_cpu_time_total) for e in events if e.device_type == kind.CPU and not e.is_async]
        busy_us, source, basis = sum(us for _, us in timed), "cpu aten ops (self time)", "wall_ms"
    ms, calls = collections.Counter(), collections.Counter(name for name, _ in timed)
    parts = dict.fromkeys([*(p for p, _ in STEP_PARTS), "other"], 0.0)
    for name, us in timed:
        ms[name] += us / 1000
        parts[step_part(name)] += us / 1000
    top = [{"name": n[:160], "part": step_part(n), "ms": t, "calls": calls[n]} for n, t in ms.most_common(TOP_KERNELS)]
    return attention, {"source": source, "busy_ms": busy_us / 1000, "top": top, "basis": basis, "parts_ms": parts,
                       "wall_ms": wall_ms} if timed else None


def bench_kernel(cfg: BenchConfig) -> list[Row]:
    """GB/s of bias+GELU and of the loss with its gradient per implementation, counting what a fused kernel moves."""
    device, gen = torch.device(cfg.device), torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    dtype = parallel.precision(cfg.dtype, device)[0]
    M, N, V, R = cfg.kernel_rows, cfg.kernel_cols, MODEL_PRESETS["gpt2"]().vocab_size, max(1, cfg.kernel_rows // 4)
    x, b, dy, logits = ((std * torch.randn(*s, generator=gen, device=device)).to(dtype)  # a trained model's scales
                        for s, std in (((M, N), 3.0), ((N,), 1.0), ((M, N), 1.0), ((R, V), 3.0)))
    targets, elem = torch.randint(0, common.GPT2_VOCAB, (R,), generator=gen, device=device), x.element_size()
    interpreted, src, dst, copy = os.environ.get("TRITON_INTERPRET") == "1", x.clone(), x.clone(), math.nan

    def gbs(name: str, make: Callable[[], Callable[[], Any]], nbytes: int) -> Row:
        if name == "triton" and not (triton_available() and (device.type == "cuda" or interpreted)):
            raise Skipped("no CUDA or no triton (TRITON_INTERPRET=1 runs Triton's interpreter: a correctness aid)")
        ms = statistics.median(time_ms(make(), device, cfg.steps, cfg.warmup)[1])
        return {"ms": ms, "bytes": nbytes, "gb_per_s": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / copy}

    def gelu(name: str, which: str) -> Callable[[], Any]:  # bwd repeats one forward's backward
        fn = {"eager": lambda x, b: F.gelu(x + b, approximate="tanh"), "triton": fused_bias_gelu,
              "compile": torch.compile(bias_gelu_reference)}[name]
        xg, bg = x.clone().requires_grad_(which == "bwd"), b.clone().requires_grad_(which == "bwd")
        y = fn(xg, bg)
        return lambda: torch.autograd.grad(y, (xg, bg), dy, retain_graph=True) if which == "bwd" else fn(xg, bg)

    def ce(name: str) -> Callable[[], Any]:  # the model's plain path: the loss of the fp32 logits, its gradient cast
        loss = lambda z: F.cross_entropy(z.float(), targets, ignore_index=-1)
        fn, z = torch.compile(loss) if name == "compile" else loss, logits.clone().requires_grad_()
        return (lambda: fused_ce.cross_entropy_rows(logits, targets, real_vocab=common.GPT2_VOCAB)) if \
            name == "triton" else lambda: torch.autograd.grad(fn(z), z)

    row = {"suite": "kernel", "rows": M, "cols": N, "dtype": str(dtype).removeprefix("torch.")}
    rows = [{**row, "name": "copy", "pass": "d2d copy", **gbs("copy", lambda: lambda: dst.copy_(src), 2 * M * N * elem),
             "status": "ok"}]
    copy, rows[0]["pct_copy"] = rows[0]["gb_per_s"], 100.0
    for name in cfg.kernel_impls.split(","):
        for which, n in (("fwd", 2 * M * N + N), ("bwd", 3 * M * N + 2 * N)):
            rows.append(guarded({**row, "name": name, "pass": which},
                                lambda name=name, which=which, n=n: gbs(name, lambda: gelu(name, which), n * elem)))
        ce_row = {**row, "op": "cross-entropy", "rows": R, "cols": V, "name": f"ce {name}", "pass": "fwd+bwd"}
        rows.append(guarded(ce_row, lambda name=name: gbs(name, lambda: ce(name), 2 * R * V * elem)))
    return rows


def random_gpt(preset: str, seed: int) -> GPT:
    torch.manual_seed(seed)
    model = GPT(dataclasses.replace(MODEL_PRESETS[preset](), block_size=1024, vocab_size=common.GPT2_VOCAB))
    with torch.no_grad():
        for p in [p for p in model.parameters() if p.dim() == 2]:
            p.mul_(DECODE_INIT_STD / 0.02)  # GPT-2's init (std 0.02), at DECODE_INIT_STD
    return model.eval()


def generation(generate: Callable[[int], torch.Tensor], n: int, device: torch.device, rows: list[Row]) -> Row:
    """n greedy tokens, four times: "first" is what a fresh process pays (per-shape setup; cuDNN's attention planned
    each cache length until generate.last_logits turned it off), tok/s the median of the 3 runs after (one run of
    0.5 s once read 45% low); same: the fraction equal to the first n-token row's, prefix: up to a diff"""
    runs: list[list[int]] = []
    ref = next((r.get("tokens") for r in rows if r["new_tokens"] == n), None)
    rates = [n / ms * 1000 for ms in time_ms(lambda: runs.append(generate(n)[0, -n:].tolist()), device, 4)[1]]
    first, again = rates[0], statistics.median(rates[1:])
    tokens = runs[-1]
    same = ref and [a == b for a, b in zip(tokens, ref, strict=True)]
    return {"tok_per_s": again, "ms_per_token": 1000 / again, "first_tok_per_s": first, "tokens": tokens,
            "distinct_tokens": len(set(tokens)), "same_frac": same and sum(same) / n,
            "same_prefix": same and (same + [False]).index(False)}


def bench_decode(cfg: BenchConfig) -> list[Row]:
    """Greedy batch-1 fp32 tokens/s of ours with the KV cache, ours without, and HF `generate` on the same weights."""
    device, ours, hf, hf_name = torch.device(cfg.device), random_gpt(cfg.decode_model, cfg.seed), None, "hf generate"
    with contextlib.suppress(ImportError), tempfile.TemporaryDirectory() as tmp:
        import transformers

        import export  # ours' weights as an HF GPT-2, by export.py's path

        transformers.logging.set_verbosity_error()  # generation-flag notices would bury the table
        transformers.utils.logging.disable_progress_bar()
        hf_name = f"hf generate ({transformers.__version__})"
        hf = transformers.GPT2LMHeadModel.from_pretrained(export.export_hf(ours, tmp)).eval().to(device)
        hf.generation_config.eos_token_id = None  # never stop early, and min_new_tokens then masks no token
    ours.to(device)
    prompt = torch.randint(0, common.GPT2_VOCAB, (1, 16), generator=torch.Generator().manual_seed(cfg.seed)).to(device)

    def hf_generate(k: int) -> torch.Tensor:
        if hf is None:
            raise Skipped("transformers is not installed")
        return hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=k,
                           min_new_tokens=k, pad_token_id=common.EOT)

    impls = {"ours kv-cache": lambda k: sample(ours, prompt, k, temperature=0.0, use_cache=True),
             "ours no-cache": lambda k: sample(ours, prompt, k, temperature=0.0, use_cache=False),
             hf_name: hf_generate}
    base, rows = {"suite": "decode", "model": cfg.decode_model, "params": ours.num_params(), "prompt": 16}, []
    for n, name in itertools.product(cfg.decode_tokens, impls):
        rows.append(guarded({**base, "name": name, "new_tokens": n},  # the same as ours kv-cache's?
                            lambda name=name, n=n: generation(impls[name], n, device, rows)))
    return rows


def bench_batched(cfg: BenchConfig) -> list[Row]:
    """Greedy tokens/s of --batched-rows ragged prompts decoded at once by generate.generate (left-padded into one KV
    cache) and one at a time: the tiny model at context 128, GPT-2's init, fp32."""
    torch.manual_seed(cfg.seed)
    model = GPT(dataclasses.replace(MODEL_PRESETS["tiny"](), block_size=128)).to(cfg.device)
    lengths = torch.randint(8, 25, (cfg.batched_rows,)).tolist()
    prompts = [torch.randint(0, common.GPT2_VOCAB, (n,)).tolist() for n in lengths]
    ways = {f"{len(prompts)} at once": [prompts], "one at a time": [[p] for p in prompts]}
    generate(model, prompts[:2], 4, temperature=0.0)  # untimed: first-call allocation and kernel selection
    rates = dict.fromkeys(ways, 0.0)
    for _, (name, batches) in itertools.product(range(BATCHED_REPEATS), ways.items()):
        t0 = time.perf_counter()  # generate waits for every token (.tolist()): no sync needed
        n = sum(len(r.tokens) for b in batches for r in generate(model, b, cfg.batched_tokens, temperature=0.0))
        rates[name] = max(rates[name], n / (time.perf_counter() - t0))
    return [{"suite": "batched", "name": name, "params": model.num_params(), "prompts": len(prompts),
             "new_tokens": cfg.batched_tokens, "repeats": BATCHED_REPEATS, "tok_per_s": rate,
             "speedup": rate / rates["one at a time"], "status": "ok"} for name, rate in rates.items()]


def bench_int8(cfg: BenchConfig) -> list[Row]:
    """Greedy batch-1 tokens/s and weight bytes of one model in fp32, bf16, then quantized as sample.py's int8 does."""
    device, prompt_text = torch.device(cfg.device), SampleConfig.prompt
    if cfg.ckpt:
        ckpt = common.load_checkpoint(cfg.ckpt)
        prompt_text = (ckpt.get("train_config") or {}).get("sample_prompt") or prompt_text  # what its run sampled
        model, weights = GPT.from_checkpoint(ckpt), f"checkpoint {cfg.ckpt}, step {ckpt.get('step')}"
    elif cfg.init_from:
        model, weights = GPT.load(None, cfg.init_from), f"HF {cfg.init_from}"
    else:
        model = random_gpt(cfg.decode_model, cfg.seed)
        weights = f"random {cfg.decode_model}, std {DECODE_INIT_STD} (untrained: the agreement means little)"
    model.to(device).eval()
    prompt = torch.tensor([common.get_tokenizer().encode(prompt_text, allowed_special="all") or [common.EOT]],
                          device=device)
    base, rows = {"suite": "int8", "weights": weights, "params": model.num_params(), "prompt_text": prompt_text,
                  "prompt": prompt.size(1)}, []

    def measure(change: Callable[[GPT], Any]) -> Row:
        change(model)  # each stage converts the model the one before left
        return {**generation(lambda k: sample(model, prompt, k, temperature=0.0), cfg.int8_tokens, device, rows),
                "weight_bytes": weight_bytes(model)}

    stages = [("fp32", lambda m: None), ("bf16", lambda m: m.to(torch.bfloat16)), ("int8 weight-only", quantize_int8)]
    for name, change in stages if device.type == "cuda" else stages[::2]:  # bf16 is sample.py's dtype on CUDA
        rows.append(guarded({**base, "name": name, "new_tokens": cfg.int8_tokens}, lambda c=change: measure(c)))
    return rows


def bench_prune(cfg: BenchConfig) -> list[Row]:
    """Forward ms (B x T) and greedy batch-1 decoding of one model, dense (pruned at 0%) and by each prune.py method;
    2:4 also as torch's semi-structured sparse tensors (cuSPARSELt/CUTLASS: CUDA only, bf16), not only dense kernels."""
    import prune

    device = torch.device(cfg.device)
    dtype = parallel.precision("auto", device)[0]  # bf16 on CUDA, as the semi-structured kernels need
    source = GPT.from_checkpoint(cfg.ckpt) if cfg.ckpt else GPT.load(None, cfg.init_from) if cfg.init_from else \
        random_gpt(cfg.decode_model, cfg.seed)
    T = min(cfg.seq_len, source.config.block_size)
    x = torch.randint(0, common.GPT2_VOCAB, (max(cfg.batch_sizes), T), generator=torch.Generator().manual_seed(0))
    prompt = x[:1, :16].to(device)

    def semi_structured(model: GPT) -> None:
        if device.type != "cuda":
            raise Skipped("to_sparse_semi_structured is CUDA only (scripts/gpu_suite.sh runs this row)")
        from torch.sparse import to_sparse_semi_structured

        for name, p in prune.matrices(model).items():
            model.get_submodule(name.removesuffix(".weight")).weight = torch.nn.Parameter(
                to_sparse_semi_structured(p.detach()), requires_grad=False)

    def measure(method: str, sparsity: float, convert: Callable[[GPT], None]) -> Row:
        model = prune.prune(copy.deepcopy(source), None, prune.PruneConfig(method=method, sparsity=sparsity), None)[0]
        params = [(p.numel(), int(p.count_nonzero())) for p in model.parameters()]
        model = model.to(device, dtype).eval()
        convert(model)
        with torch.no_grad():
            ms = statistics.median(time_ms(lambda: model(x.to(device)), device, cfg.steps, cfg.warmup)[1])
        return {**generation(lambda k: sample(model, prompt, k, temperature=0.0), cfg.int8_tokens, device, rows),
                "forward_ms": ms, "params": sum(n for n, _ in params), "nonzero": sum(z for _, z in params)}

    base = {"suite": "prune", "weights": cfg.ckpt or cfg.init_from or f"random {cfg.decode_model}",
            "dtype": str(dtype), "B": x.size(0), "T": T, "new_tokens": cfg.int8_tokens}
    dense, rows = (lambda model: None), []
    for name, method, sparsity, convert in (
            ("dense", "magnitude", 0.0, dense), ("magnitude", "magnitude", cfg.prune_sparsity, dense),
            ("structured", "structured", cfg.prune_sparsity, dense), ("2:4 dense kernels", "2:4", 0.5, dense),
            ("2:4 semi-structured", "2:4", 0.5, semi_structured)):
        rows.append(guarded({**base, "name": name}, lambda m=method, s=sparsity, c=convert: measure(m, s, c)))
    return rows


WORDS = ("the a man woman dog he she they is was then slowly again takes puts holds walks runs jumps turns looks uses "
         "cuts pours paints rides plays ball water rope bike horse table knife car road door hair red small old new "
         "next into from with over under after while and but").split()


def bench_hellaswag(cfg: BenchConfig) -> list[Row]:
    """hellaswag.evaluate's examples/s, tokenization included, on a random model and synthetic examples."""
    rng, enc = random.Random(cfg.seed), common.get_tokenizer()
    sentence = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) + "."
    examples = [{"ctx": sentence(10, 60).capitalize(), "endings": [sentence(5, 25) for _ in range(4)],
                 "label": rng.randrange(4)} for _ in range(cfg.hellaswag_examples)]
    model = random_gpt(cfg.model, cfg.seed).to(cfg.device)

    def measure(bs: int) -> Row:
        hellaswag.evaluate(model, examples, cfg.device, limit=bs, batch_size=bs, enc=enc)  # untimed: first-call costs
        result = hellaswag.evaluate(model, examples, cfg.device, batch_size=bs, enc=enc)
        return {"examples": result["n"], "examples_per_sec": result["examples_per_sec"]}

    return [guarded({"suite": "hellaswag", "name": "evaluate", "model": cfg.model, "params": model.num_params(),
                     "batch_size": bs}, lambda bs=bs: measure(bs)) for bs in cfg.hellaswag_batch_sizes]


# --suite all's order: the short suites first
SUITES = {"kernel": bench_kernel, "decode": bench_decode, "batched": bench_batched, "int8": bench_int8,
          "prune": bench_prune, "hellaswag": bench_hellaswag, "train": run_train}

# ----------------------------------------------------------------------------------------------------------------------
# Output: one printer for every table; main


GBS = [("impl", lambda r: f"{r['name']} {r.get('tile', '')}".strip()), ("pass", "pass"), ("ms", "ms:.3f"),
       ("GB/s", "gb_per_s:.1f"), ("% copy", "pct_copy:.0f")]
TOKENS = [("new", "new_tokens"), ("first tok/s", "first_tok_per_s:.1f"), ("tok/s", "tok_per_s:.1f"),
          ("ms/tok", "ms_per_token:.2f"),
          ("distinct", "distinct_tokens"), ("same", "same_frac:.2f"), ("prefix", "same_prefix")]
# (title, formatted with the config and the first row; its rows; its columns: header, "key:format" or cell(row))
TABLES: list[tuple[str, Callable[[dict], list[Row]], list[tuple[str, Any]]]] = [
    ("kernel: bias+GELU on ({rows}, {cols}) {dtype}; GB/s of fwd 2MN+N, bwd 3MN+2N elements; median of {steps}",
     lambda res: [r for r in res.get("kernel") or [] if r.get("op") != "cross-entropy" and r["name"] != "matmul"], GBS),
    ("kernel: cross-entropy loss and logits' gradient on ({rows}, {cols}) {dtype} logits; GB/s of 2NV elements",
     lambda res: [r for r in res.get("kernel") or [] if r.get("op") == "cross-entropy"], GBS),
    ("decode: random {model} ({mparams:.1f}M) fp32, greedy, batch 1, prompt {prompt} tokens; same as the first row",
     lambda res: res.get("decode") or [], [("impl", "name"), *TOKENS]),
    ("batched: random tiny ({mparams:.1f}M, context 128) fp32, greedy, {prompts} prompts of 8-24 tokens x {new_tokens} "
     "new; the fastest of {repeats} runs", lambda res: res.get("batched") or [],
     [("decoding", "name"), ("tok/s", "tok_per_s:,.0f"), ("speedup", lambda r: f"{r['speedup']:.1f}x")]),
    ("int8: {mparams:.1f}M params, {weights}; greedy, batch 1, prompt {prompt} tokens; same as fp32",
     lambda res: res.get("int8") or [],
     [("dtype", "name"), *TOKENS, ("weight MB", lambda r: f"{r['weight_bytes'] / 1e6:.1f}")]),
    ("prune: {weights}, {dtype}; forward on {B} x {T} tokens, median of {steps}; greedy decoding, batch 1",
     lambda res: res.get("prune") or [],
     [("model", "name"), ("params", "params:,"), ("nonzero", "nonzero:,"), ("fwd ms", "forward_ms:.2f"), *TOKENS]),
    ("hellaswag: evaluate() on {hellaswag_examples} synthetic examples, random {model} ({mparams:.1f}M)",
     lambda res: res.get("hellaswag") or [], [("batch", "batch_size"), ("examples/s", "examples_per_sec:.1f")]),
    ("train: {model}, T={seq_len}, median of {steps} steps after {warmup}; peak mem: CUDA's max allocated (GiB)",
     lambda res: res.get("train") or [],
     [("variant", "name"), ("B", "batch_size"), ("accum", "grad_accum"), ("dtype", "dtype"),
      ("tok/s", "tok_per_s:,.0f"), ("ms/step", "ms_per_step:.1f"), ("MFU", "mfu:.1%"),
      ("peak mem", lambda r: f"{r['peak_mem_bytes'] / 2**30:.2f}" if r["peak_mem_bytes"] else "n/a"),
      ("opt MiB", lambda r: f"{r['optim_state_bytes'] / 2**20:.0f}"), ("warmup", "warmup_s:.0f"),
      ("loss", "loss:.3f"), ("dloss", "loss_delta:+.4f"), ("attn", "attention")]),
]


def render(title: str, columns: list[tuple[str, Any]], rows: list[Row]) -> list[str]:
    """The title, the header and a line per row with its status; a cell a skipped or failed row lacks is blank."""

    def cell(row: Row, how: Any) -> str:
        with contextlib.suppress(KeyError):
            if callable(how):
                return how(row)
            key, _, spec = how.partition(":")
            return "n/a" if row[key] is None else format(row[key], spec)
        return ""

    table = [[h for h, _ in columns]] + [[cell(r, how) for _, how in columns] for r in rows]
    widths = [max(5, *(len(line[i]) for line in table)) for i in range(len(columns))]
    status = ["status"] + [r.get("status", "?") + (f": {r['reason']}" if r.get("reason") else "") for r in rows]
    return ["", title, *("  ".join([line[0].ljust(widths[0]), *map(str.rjust, line[1:], widths[1:]), s])
                         for line, s in zip(table, status, strict=True))]


def breakdown(rows: list[Row]) -> list[str]:
    """Where each train row's step went: % of ms/step on CUDA, of the profiled wall time on CPU (slower ops)."""
    if not (rows := [r for r in rows if r.get("status") == "ok" and r.get("breakdown")]):
        return []
    first = rows[0]["breakdown"]
    if first["basis"] == "ms_per_step":  # CUDA: kernel time against the timed step; the rest is the GPU idle
        step_ms, of, gap = lambda r: r["ms_per_step"], "ms/step", "idle"
    else:
        step_ms, of, gap = lambda r: r["breakdown"]["wall_ms"], "the profiled step's wall time", "rest"
    pct = lambda ms: lambda r: f"{100 * ms(r) / step_ms(r):.0f}%"
    return render(f"where the step's time goes: {first['source']} by name (bench.STEP_PARTS) as % of {of}",
                  [("variant", "name"), ("step ms", lambda r: f"{step_ms(r):.1f}"),
                   ("busy", pct(lambda r: r["breakdown"]["busy_ms"])),
                   *[(p, pct(lambda r, p=p: r["breakdown"]["parts_ms"][p])) for p in first["parts_ms"]],
                   (gap, pct(lambda r: max(step_ms(r) - r["breakdown"]["busy_ms"], 0.0)))], rows)


def format_table(result: dict[str, Any]) -> str:
    out = ["bench.py: " + common.describe_provenance(result["provenance"])]
    for title, select, columns in TABLES:
        if rows := select(result):
            fields = {**result["config"], **rows[0], "mparams": rows[0].get("params", 0) / 1e6}
            out += render(title.format_map(fields), columns, rows)
    out += breakdown(result.get("train") or [])
    return "\n".join(out + [f"\n{name}: failed: {err}" for name, err in (result.get("errors") or {}).items()])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Each suite's rows, written to --out after every row (a run killed by a time limit keeps what it measured)."""
    cfg = common.parse_config(BenchConfig, argv, doc=__doc__)
    if cfg.table_from:
        try:
            result = json.loads(Path(cfg.table_from).read_text())
            print(table := format_table(result))
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"error: --table-from {cfg.table_from} is not a bench.py JSON file ({e!r})") from None
        return {**result, "table": table}
    if cfg.ckpt and {"int8", "prune"} & set(cfg.suites()) and not Path(cfg.ckpt).is_file():  # before other suites
        raise SystemExit(f"error: --ckpt {cfg.ckpt}: no such file; pass a checkpoint that train.py wrote")
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    rank, _, world, _ = common.setup_distributed(cfg.device)  # under torchrun: the tp/pp rows; rank 0 reports
    master = rank == 0
    result = {"provenance": common.provenance(cfg.device, world), "config": dataclasses.asdict(cfg), "errors": {}}

    def save(row: Row | None = None) -> None:
        if not master:
            return
        if row:
            result.setdefault(row["suite"], []).append(row)
            print(f"{row['suite']} {row['name']} {row.get('pass', '')}: {row['status']} {row.get('reason', '')}")
        atomic_write(Path(cfg.out), (json.dumps(result, indent=1, default=str) + "\n").encode())

    save()
    attention = parallel.sdpa_switches()  # the train rows each pick a kernel; the caller gets its own choice back
    for suite in cfg.suites():
        try:
            for row in SUITES[suite](cfg):
                save(row)
        except Exception as e:  # a suite that breaks (e.g. a missing optional package) must not lose the others
            result["errors"][suite] = reason(e)
        if why := device_lost():  # nothing more can run; the tables of what did are wanted
            result["errors"][suite] = f"the device failed: {why}; later suites not run"
            break
    parallel.set_sdpa_switches(attention)
    result["table"] = format_table(result)
    save()
    if master:
        print("\n" + result["table"], flush=True)
    return result


if __name__ == "__main__":
    common.run_and_exit(main)  # the ddp rows ran gloo/NCCL collectives: no interpreter finalization after them
