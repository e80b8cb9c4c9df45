"""bench.py on CPU with tiny shapes: each suite's rows carry consistent numbers, skips carry reasons, main writes JSON.

These check what the bench computes (token counts, byte counts, rates that agree with their times, equal tokens),
never how fast anything is: speed is what bench.py reports, not what a test asserts.
"""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import bench
import parallel
import train
from bench import BenchConfig, Variant, bench_decode, bench_hellaswag, bench_kernel, bench_train, main
from common import GPT2_VOCAB, provenance
from model import GPT, MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(device="cpu", model="tiny", seq_len=32, batch_sizes=(2,), steps=2, warmup=1)


def plain_training_losses(cfg: BenchConfig, steps: int) -> list[float]:
    """The losses of `steps` optimizer steps of a plain training loop on what an eager train row trains: its weights
    (seeded), its tokens (its own seeded generator), and every step over all cfg.grad_accum micro-batches."""
    tcfg = bench.train_config(cfg, Variant("eager"))
    accum, B, T = cfg.grad_accum, tcfg.batch_size, tcfg.seq_len
    torch.manual_seed(cfg.seed)
    model = GPT(train.model_config(tcfg))
    optimizer = parallel.build_optimizer(model, tcfg, torch.device("cpu"), verbose=False)
    tokens = torch.randint(0, GPT2_VOCAB, (accum, B, T + 1), generator=torch.Generator().manual_seed(cfg.seed))
    losses = []
    for _ in range(steps):
        loss = sum(model(tokens[m, :, :-1], tokens[m, :, 1:])[1] / accum for m in range(accum))  # the mean
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_train_step_rates_agree_with_times():
    cfg = BenchConfig(**TINY, grad_accum=2)
    row = bench_train(cfg, Variant("eager"))
    assert row["tokens_per_step"] == 2 * 32 * 2  # B * T * grad_accum
    assert (row["batch_size"], row["seq_len"], row["grad_accum"], row["dtype"]) == (2, 32, 2, "float32")
    assert row["ms_min"] <= row["ms_per_step"] <= row["ms_max"] and row["ms_per_step"] > 0
    assert row["tok_per_s"] == pytest.approx(row["tokens_per_step"] / (row["ms_per_step"] / 1000), rel=1e-6)
    assert row["mfu"] is None  # no peak FLOP/s is known for a CPU
    assert row["params"] == GPT(MODEL_PRESETS["tiny"]()).num_params()
    # 3 AdamW steps from GPT-2's init barely move the loss from uniform over the vocabulary
    assert abs(row["loss"] - math.log(50304)) < 1.0
    assert row["peak_mem_bytes"] is None  # CUDA's max allocated; a CPU has no such counter
    parts = row["breakdown"]["parts_ms"]  # one profiled step of the model: its matmuls, loss, norms and AdamW
    assert all(parts[p] > 0 for p in ("matmul", "attention", "loss", "norm", "gelu", "optimizer", "embedding"))
    assert 0 < row["breakdown"]["busy_ms"] <= row["breakdown"]["wall_ms"] and row["breakdown"]["basis"] == "wall_ms"
    # the loss of the last timed step (warmup + steps = 3), not of the profiled one after the timing (CUDA-graph rows
    # skip it, so dloss would compare other steps), and of both micro-batches of each step
    losses = plain_training_losses(cfg, 4)
    assert row["loss"] == pytest.approx(losses[2], abs=1e-5) and abs(losses[3] - losses[2]) > 1e-3
    assert row["loss_early"] == row["loss"]  # DLOSS_STEP = 3 is the last timed step here
    # with more steps, dloss's loss stays that of step 3 while the final one moves on
    longer = bench_train(dataclasses.replace(cfg, steps=3, profile=False), Variant("eager"))
    assert longer["loss_early"] == pytest.approx(losses[2], abs=1e-5)
    assert longer["loss"] == pytest.approx(losses[3], abs=1e-5)


def test_rows_name_the_attention_kernel_that_ran():
    # the process-wide SDPA switches reach the CPU dispatcher too: forcing math leaves no fused kernel in the profile
    cfg = BenchConfig(**{**TINY, "steps": 1, "warmup": 0})
    assert bench_train(cfg, Variant("auto"))["attention"] == "flash"  # torch's CPU pick for fp32
    assert bench_train(cfg, Variant("math", {"attention": "math"}))["attention"] == "math"


def test_step_parts_sort_kernel_and_op_names():
    # CUDA kernels as cuBLAS, FlashAttention, cuDNN, xformers-style cutlass attention, NCCL, Inductor and torch name
    # them (the order of STEP_PARTS decides the ones that match two patterns), and the CPU's aten ops
    cases = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_kernel__5x_cublas":
            "matmul",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN": "matmul",
        "triton_tem_fused_addmm_0": "matmul",  # max-autotune's Triton matmul template
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel::Params)": "attention",
        "triton_red_fused__log_softmax__to_copy_nll_loss_forward_0": "loss",  # not copy: only aten's own copies are
        "triton_per_fused_add_native_layer_norm_1": "norm",
        "triton_poi_fused_gelu_view_3": "gelu",
        "_bias_gelu_bwd_kernel": "gelu",  # fused_gelu.py's
        "_cross_entropy_kernel": "loss",  # fused_ce.py's
        # the chunked loss's (H200 trace): before "embedding", which its scatter_add would put it in
        "triton_red_fused__to_copy_bitwise_not_exp_full_like_logsumexp_masked_fill_ne_scatter_add_slice_sub_22": "loss",
        "void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float>>": "optimizer",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "comm",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "Memset (Device)": "copy",
        "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda(TensorIteratorBase&)>": "copy",
        "triton_poi_fused_add_mul_0": "other",
        "triton_poi_fused__to_copy_3": "copy",  # a compiled bf16 weight cast, as eager's is
        "triton_poi_fused__scaled_dot_product_flash_attention_transpose_view_1": "other",  # feeds SDPA, is not it
        "void at::native::GammaBetaBackwardCUDAKernel<float, float>(long, long, float const*, float*, float*)": "norm",
        "void at::native::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>": "embedding",
        "aten::mm": "matmul", "aten::addmm": "matmul", "aten::bmm": "matmul",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention", "aten::_log_softmax": "loss",
        "aten::native_layer_norm_backward": "norm", "aten::gelu_backward": "gelu", "aten::_fused_adamw_": "optimizer",
        "aten::linalg_vector_norm": "optimizer", "aten::embedding_dense_backward": "embedding",
        "aten::copy_": "copy", "aten::fill_": "other",
        "Optimizer.step#SGD.step": "optimizer",  # the step's own range: its self time is the optimizer's
    }
    assert {name: bench.step_part(name) for name in cases} == cases


def test_profile_step_buckets_ops_by_name_and_counts_each_op_once():
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x, target = torch.randn(32, 64), torch.randint(0, 64, (32,))
    optimizer = torch.optim.AdamW([w], lr=0.1, foreach=True)  # its step range and aten::_foreach_* ops

    def step() -> None:
        h = torch.nn.functional.layer_norm(torch.nn.functional.gelu(x @ w), (64,))
        torch.nn.functional.cross_entropy(h, target).backward()
        optimizer.step()
        optimizer.zero_grad()

    attention, breakdown = bench.profile_step(step, torch.device("cpu"))
    parts = breakdown["parts_ms"]
    assert attention == "math"  # no SDPA ran
    assert list(parts) == [p for p, _ in bench.STEP_PARTS] + ["other"]
    assert sum(parts.values()) == pytest.approx(breakdown["busy_ms"], rel=1e-9)  # every op's self time, once
    assert breakdown["busy_ms"] <= breakdown["wall_ms"]
    assert all(parts[p] > 0 for p in ("matmul", "gelu", "norm", "loss", "optimizer"))
    assert parts["attention"] == parts["comm"] == parts["embedding"] == 0.0
    top = breakdown["top"]
    assert 10 < len(top) <= bench.TOP_KERNELS and [t["ms"] for t in top] == sorted((t["ms"] for t in top), reverse=True)
    matmul = next(t for t in top if t["name"] == "aten::mm")  # forward x @ w, backward dW = x.T @ dy (x needs none)
    assert (matmul["part"], matmul["calls"]) == ("matmul", 2)


def test_profile_step_cuda_branch_counts_kernels_once_and_skips_gpu_annotations(monkeypatch):
    # the events a CUDA profile yields (torch's own FunctionEvent), from a fake profiler: no GPU here. Busy is the
    # union of the kernels' intervals; an annotation on the GPU's timeline and the host's launch calls are no kernels
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, device_type=device,
                             is_user_annotation=annotation)

    events = [event("aten::_scaled_dot_product_flash_attention", 0, 50, DeviceType.CPU),
              event("cudaLaunchKernel", 1, 2, DeviceType.CPU),
              event("Optimizer.step#AdamW.step", 0, 100, annotation=True),
              event("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN", 10, 40),
              event("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", 40, 60),
              event("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 30, 70),
              event("Memset (Device)", 80, 81)]

    class FakeProfile:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(bench, "sync", lambda device: None)
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    attention, breakdown = bench.profile_step(lambda: None, torch.device("cuda"))
    assert attention == "flash" and breakdown["source"] == "cuda kernels" and breakdown["basis"] == "ms_per_step"
    assert os.environ["TEARDOWN_CUPTI"] == "1"  # asked for before the profile
    parts = breakdown["parts_ms"]
    assert (parts["matmul"], parts["attention"], parts["comm"], parts["copy"]) == \
        pytest.approx((0.030, 0.020, 0.040, 0.001))
    assert parts["optimizer"] == parts["other"] == 0.0
    # the union of the kernels' intervals, [10, 70] and [80, 81]: nested, overlapping and touching ones count once
    assert breakdown["busy_ms"] == pytest.approx(0.061)  # while the buckets add up to 0.091
    assert [(t["name"][:9], t["calls"]) for t in breakdown["top"]] == [
        ("ncclDevKe", 1), ("nvjet_tst", 1), ("void pyto", 1), ("Memset (D", 1)]  # by time, longest first


def test_the_cuda_breakdown_table_divides_by_the_timed_step_and_names_idle():
    row = {"suite": "train", "name": "compile", "status": "ok", "loop": False, "ms_per_step": 100.0,
           "batch_size": 64, "seq_len": 1024, "grad_accum": 1, "dtype": "bfloat16", "tokens_per_step": 65536,
           "tok_per_s": 655360.0, "mfu": 0.5, "peak_mem_bytes": 3 * 2**29, "mem_metric": "cuda max_memory_allocated",
           "warmup_s": 60.0, "loss": 10.0, "attention": "flash",
           "breakdown": {"source": "cuda kernels", "basis": "ms_per_step", "busy_ms": 90.0, "wall_ms": 300.0,
                         "parts_ms": {**dict.fromkeys([p for p, _ in bench.STEP_PARTS] + ["other"], 0.0),
                                      "matmul": 60.0, "attention": 30.0},
                         "top": [{"name": "nvjet_tst", "part": "matmul", "ms": 60.0, "calls": 97}]}}
    prov = {"device": "NVIDIA H100", "torch": "2.11", "triton": "3.6", "cuda": "13.0", "python": "3.12",
            "git_sha": "abc", "git_dirty": False, "world_size": 1}
    table = bench.format_table({"provenance": prov, "config": {"model": "gpt2", "seq_len": 1024, "steps": 20,
                                                               "warmup": 10}, "train": [row]})
    lines = table.split("where the step's time goes")[1].splitlines()
    header, cells = lines[1].replace("step ms", "step_ms").split(), lines[2].split()
    assert header[-2] == "idle" and lines[0].endswith("% of ms/step")
    by_column = dict(zip(header, cells, strict=True))
    assert [by_column[c] for c in ("step_ms", "busy", "matmul", "attention", "idle")] == \
        ["100.0", "90%", "60%", "30%", "10%"]
    # the train table's own line: MFU as a percentage, peak memory in GiB (2**30 bytes, not 1e9)
    (line,) = [line for line in table.split("where the step's time goes")[0].splitlines() if line.startswith("compile")]
    assert "  655,360  " in line and "  100.0  " in line and "  50.0%  " in line and "  1.50  " in line


def test_a_table_pads_its_columns_and_blanks_a_skipped_rows_measurements():
    # render() draws every table: each column as wide as its widest cell (at least 5), the first left-aligned, the
    # rest right-aligned, two spaces apart; None prints n/a
    columns = [("name", "name"), ("ms", "ms:.2f"), ("MFU", "mfu:.1%"), ("same", lambda r: str(r["same"]).lower())]
    rows = [{"name": "a", "ms": 1.234, "mfu": None, "same": True, "status": "ok"},
            {"name": "bb", "status": "skipped", "reason": "no CUDA"},
            {"name": "c", "ms": 10.0, "mfu": 0.5, "same": False, "status": "ok"}]
    assert bench.render("t", columns, rows) == [
        "",
        "t",
        "name      ms    MFU   same  status",
        "a       1.23    n/a   true  ok",
        "bb                          skipped: no CUDA",
        "c      10.00  50.0%  false  ok"]
    prov = {"device": "cpu", "torch": "2", "triton": None, "cuda": None, "python": "3", "git_sha": "0123456789abcdef",
            "git_dirty": True}
    assert bench.format_table({"provenance": prov, "config": {}, "train": [], "errors": {"decode": "x"}}) == \
        "bench.py: git 0123456789ab+dirty, python 3, torch 2, cpu, 1 rank\n\ndecode: failed: x"


def test_profile_false_runs_no_profiler(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("profiled")

    monkeypatch.setattr(bench, "profile_step", boom)
    row = bench_train(BenchConfig(**TINY, profile=False), Variant("eager"))
    assert (row["attention"], row["breakdown"]) == ("n/a (--profile false)", None)


def test_a_profiler_with_nothing_to_time_or_that_fails_costs_the_row_nothing(monkeypatch):
    assert bench.profile_step(lambda: None, torch.device("cpu")) == ("math", None)  # no op ran: no breakdown

    def broken(step, device):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(bench, "profile_step", broken)
    row = bench_train(BenchConfig(**TINY), Variant("eager"))
    assert row["tok_per_s"] > 0 and row["breakdown"] is None
    assert row["attention"] == "n/a (profiler: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED)"


def test_loss_delta_compares_rows_that_trained_the_same_tokens():
    cfg = BenchConfig(**TINY, grad_accum=2)
    rows = []
    for variant in (Variant("eager"), Variant("math", {"attention": "math"}), Variant("b1", {"batch_size": 1}),
                    Variant("recompute-b1", {"batch_size": 1, "recompute": "mlp"})):
        row = {"suite": "train", "name": variant.name, "status": "ok", **bench_train(cfg, variant)}
        row["loss_delta"] = bench.loss_delta(row, rows)
        rows.append(row)
    deltas = [r["loss_delta"] for r in rows]
    assert deltas[0] == 0.0 and deltas[2] == 0.0  # each micro-batch size is its own reference
    assert abs(deltas[1]) < 1e-5 and abs(deltas[3]) < 1e-5  # another kernel, recomputation: the same training
    assert rows[2]["loss"] != rows[0]["loss"]  # while other tokens give another loss's tokens


def test_loss_delta_takes_the_first_ok_row_of_the_same_batch_and_accumulation():
    """dloss's reference is the first earlier row that ran (a failed row has no measurements) with the same
    micro-batch and accumulation; the delta is this row's loss at DLOSS_STEP minus its."""
    def row(loss, b=4, accum=1):
        return {"status": "ok", "batch_size": b, "grad_accum": accum, "loss_early": loss, "loss": loss + 1}

    earlier = [{"status": "failed", "reason": "out of memory"}, row(2.0, accum=2), row(3.0, b=2), row(5.0), row(6.0)]
    assert bench.loss_delta(row(5.25), earlier) == 0.25  # the row with 5.0: the first of b=4, accum=1 that ran
    assert bench.loss_delta(row(1.5, accum=2), earlier) == -0.5
    assert bench.loss_delta(row(3.0, b=2), earlier) == 0.0
    assert bench.loss_delta(row(7.0, b=8), earlier) == 0.0  # no reference: this row is the first of its kind


def test_step_time_is_the_median_and_mfu_uses_the_peak_override(monkeypatch):
    # the steps run as usual, but the clock reads 30, 10 and 80 ms: the row's numbers follow from those exactly
    real = bench.time_ms

    def clock(fn, device, steps, warmup=0):
        return real(fn, device, steps, warmup)[0], [30.0, 10.0, 80.0]

    monkeypatch.setattr(bench, "time_ms", clock)
    row = bench_train(BenchConfig(**{**TINY, "steps": 3}, peak_tflops=1.0), Variant("eager"))
    assert (row["ms_per_step"], row["ms_min"], row["ms_max"]) == (30.0, 10.0, 80.0)  # the median, not the mean (40)
    assert row["tok_per_s"] == pytest.approx(2 * 32 / 0.030, rel=1e-12)
    flops = GPT(MODEL_PRESETS["tiny"]()).flops_per_token(32)  # block_size does not change the parameter count
    assert row["mfu"] == pytest.approx(flops * row["tok_per_s"] / 1e12, rel=1e-6)


def test_variants_are_selected_by_name_and_skips_carry_reasons():
    names = [v.name for v in bench.default_variants((16, 32, 64))]
    assert names[:9] == ["eager", "compile", "compile+fused", "compile+fused-ce", "compile+fused+fused-ce",
                         "compile+half-residual", "compile+all", "compile-b16", "compile-b32"]
    assert "compile-b64" not in names  # 64 is the largest: the other rows already run at B=64
    assert {"compile+flash-attn", "compile+cudnn-attn", "compile-max-autotune"} <= set(names)
    cudnn = bench.train_config(BenchConfig(**TINY), next(v for v in bench.default_variants((4,))
                                                         if v.name == "compile+cudnn-attn"))
    assert (cudnn.compile, cudnn.attention, cudnn.compile_mode) == (True, "cudnn", "default")
    assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="unknown nope.*eager"):
        BenchConfig(**TINY, variants="eager,nope")
    rows = list(bench.run_train(BenchConfig(**TINY, variants="eager+fused,compile+fused-ce")))
    assert [(r["name"], r["status"]) for r in rows] == [("eager+fused", "skipped"), ("compile+fused-ce", "skipped")]
    assert all(r["reason"].startswith("the fused kernels need CUDA and triton") for r in rows)
    fused_ce = bench.train_config(BenchConfig(**TINY), next(v for v in bench.default_variants((4,))
                                                            if v.name == "compile+fused-ce-chunked"))
    assert (fused_ce.compile, fused_ce.arch["fused_ce"], fused_ce.arch["loss_chunk"]) == (True, True, 16384)
    rows = list(bench.run_train(BenchConfig(**TINY, variants="compile+cudnn-attn")))  # what train.py refuses: a skip
    assert [(r["name"], r["status"], r["reason"]) for r in rows] == [
        ("compile+cudnn-attn", "skipped", "--attention cudnn has no CPU kernel; use --attention flash, math or auto")]


def test_failing_row_is_reported_not_raised():
    def boom() -> dict:
        raise RuntimeError("CUDA error: an illegal memory access\nmore detail")

    row = bench.guarded({"name": "x"}, boom)
    assert row == {"name": "x", "status": "failed", "reason": "RuntimeError: CUDA error: an illegal memory access"}


def test_kernel_rows_count_bytes_and_skip_triton_without_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    M, N = 64, 96
    rows = bench_kernel(BenchConfig(device="cpu", kernel_rows=M, kernel_cols=N, kernel_impls="eager,triton", steps=2,
                                    warmup=1))
    by = {(r["name"], r["pass"]): r for r in rows}
    assert len(by) == len(rows) and set(by) == {("copy", "d2d copy"), ("eager", "fwd"), ("eager", "bwd"),
                                                ("triton", "fwd"), ("triton", "bwd"), ("ce eager", "fwd+bwd"),
                                                ("ce triton", "fwd+bwd")}
    assert by["copy", "d2d copy"]["bytes"] == 2 * M * N * 4 and by["copy", "d2d copy"]["pct_copy"] == 100.0
    assert by["eager", "fwd"]["bytes"] == 4 * (2 * M * N + N)  # x and b in, y out (fp32)
    assert by["eager", "bwd"]["bytes"] == 4 * (3 * M * N + 2 * N)  # dy, x, b in, dx, db out
    copy = by["copy", "d2d copy"]["gb_per_s"]
    for key in (("eager", "fwd"), ("eager", "bwd")):
        r = by[key]
        assert r["status"] == "ok" and r["gb_per_s"] > 0
        assert r["gb_per_s"] == pytest.approx(r["bytes"] / (r["ms"] / 1000) / 1e9, rel=1e-9)
        assert r["pct_copy"] == pytest.approx(100 * r["gb_per_s"] / copy, rel=1e-9)
    for p in ("fwd", "bwd"):
        assert by["triton", p]["status"] == "skipped" and by["triton", p]["reason"].startswith("no CUDA")
    # the loss on GPT-2's padded vocabulary, M / 4 rows: the logits read and their gradient written, fp32 here
    ce = by["ce eager", "fwd+bwd"]
    assert (ce["status"], ce["rows"], ce["cols"], ce["bytes"]) == ("ok", M // 4, 50304, 2 * (M // 4) * 50304 * 4)
    assert ce["gb_per_s"] == pytest.approx(ce["bytes"] / (ce["ms"] / 1000) / 1e9, rel=1e-9)
    assert by["ce triton", "fwd+bwd"]["status"] == "skipped"
    table = bench.format_table({"provenance": provenance(torch.device("cpu")), "config": {"steps": 2}, "kernel": rows})
    assert "kernel: cross-entropy loss and logits' gradient on (16, 50304) float32 logits" in table
    assert "kernel: bias+GELU on (64, 96) float32" in table


def test_time_ms_times_the_warmup_in_seconds_and_each_step_in_ms(monkeypatch):
    # on the CPU: a clock that each call of fn moves on by its own duration
    now, durations = [0.0], iter([0.1, 0.2, 0.003, 0.005, 0.004])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    fn = lambda: now.__setitem__(0, now[0] + next(durations))
    warmup_s, ms = bench.time_ms(fn, torch.device("cpu"), steps=3, warmup=2)
    assert warmup_s == pytest.approx(0.3) and ms == pytest.approx([3.0, 5.0, 4.0])


def test_kernel_rows_time_the_median_call(monkeypatch):
    # a clock that reads 4, 1 and 10 ms for every timed kernel: each row's ms is the median 4 (not the fastest 1,
    # nor the mean 5)
    monkeypatch.setattr(bench, "time_ms", lambda fn, device, steps, warmup=0: (0.0, [4.0, 1.0, 10.0]))
    M, N = 8, 16
    rows = bench_kernel(BenchConfig(device="cpu", kernel_rows=M, kernel_cols=N, kernel_impls="eager", steps=3))
    assert [r["ms"] for r in rows] == [4.0] * 4  # the copy, GELU fwd and bwd, the loss
    assert [r["gb_per_s"] for r in rows] == [b / 4e6 for b in (2 * M * N * 4, 4 * (2 * M * N + N),
                                                               4 * (3 * M * N + 2 * N), 2 * (M // 4) * 50304 * 4)]


def test_the_breakdowns_idle_share_is_never_negative():
    # the profiled step's kernels can add up to more than the timed median step: no GPU time was idle, not -20%
    parts = {**dict.fromkeys([p for p, _ in bench.STEP_PARTS] + ["other"], 0.0), "matmul": 120.0}
    row = {"name": "eager", "status": "ok", "ms_per_step": 100.0,
           "breakdown": {"source": "cuda kernels", "basis": "ms_per_step", "busy_ms": 120.0, "wall_ms": 300.0,
                         "parts_ms": parts}}
    lines = bench.breakdown([row])
    cells = dict(zip(lines[2].replace("step ms", "step_ms").split(), lines[3].split(), strict=True))
    assert (cells["busy"], cells["matmul"], cells["idle"]) == ("120%", "120%", "0%")


def test_kernel_bytes_count_the_element_size_of_the_dtype():
    """bf16 moves 2 bytes an element: the byte counts (and so GB/s) are half those of fp32, not fp32's."""
    M, N = 16, 64
    rows = bench_kernel(BenchConfig(device="cpu", dtype="bf16", kernel_rows=M, kernel_cols=N, kernel_impls="eager",
                                    steps=1, warmup=0))
    by = {r["pass"]: r for r in rows if r.get("op") != "cross-entropy"}
    assert by["fwd"]["dtype"] == "bfloat16" and by["fwd"]["status"] == "ok"
    assert (by["d2d copy"]["bytes"], by["fwd"]["bytes"], by["bwd"]["bytes"]) == \
        (2 * 2 * M * N, 2 * (2 * M * N + N), 2 * (3 * M * N + 2 * N))


@pytest.mark.skipif(not bench.triton_available(), reason="triton is not installed")
def test_kernel_cli_times_triton_under_the_interpreter(tmp_path):
    out = tmp_path / "kernel.json"
    cmd = [sys.executable, "bench.py", "--suite", "kernel", "--device", "cpu", "--kernel-impls", "triton",
           "--kernel-rows", "8", "--kernel-cols", "64", "--steps", "1", "--warmup", "0", "--out", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in json.loads(out.read_text())["kernel"] if r["name"] == "triton"]
    assert [(r["pass"], r["status"]) for r in rows] == [("fwd", "ok"), ("bwd", "ok")]
    assert all(r["gb_per_s"] == pytest.approx(r["bytes"] / r["ms"] / 1e6) for r in rows)
    (ce,) = [r for r in json.loads(out.read_text())["kernel"] if r["name"] == "ce triton"]
    assert (ce["status"], ce["rows"], ce["cols"], ce["bytes"]) == ("ok", 2, 50304, 2 * 2 * 50304 * 4)


def test_generation_reports_the_first_run_and_the_median_of_the_3_after(monkeypatch):
    # 4 runs of 8 tokens on a clock that reads 100, 50, 40 and 10 ms: 80 tok/s first, then 160, 200 and 800, whose
    # median is 200 (their mean 387; the median of all 4, 180)
    def clock(fn, device, steps, warmup=0):
        for _ in range(steps):
            fn()
        return 0.0, [100.0, 50.0, 40.0, 10.0]

    monkeypatch.setattr(bench, "time_ms", clock)
    calls = []
    generate = lambda n: calls.append(n) or torch.tensor([[9, 9, 1, 2, 3, 4, 5, 6, 7, 8]])  # the prompt, then n new
    rows = [{"new_tokens": 4, "tokens": [0] * 4}, {"new_tokens": 8, "tokens": [1, 2, 3, 0, 5, 6, 7, 8]}]
    row = bench.generation(generate, 8, torch.device("cpu"), rows)
    assert calls == [8] * 4
    assert row == {"tok_per_s": 200.0, "ms_per_token": 5.0, "first_tok_per_s": 80.0, "tokens": [1, 2, 3, 4, 5, 6, 7, 8],
                   "distinct_tokens": 8, "same_frac": 7 / 8, "same_prefix": 3}
    assert bench.generation(generate, 8, torch.device("cpu"), [])["same_frac"] is None  # the first row of its n


def test_decode_cache_no_cache_and_hf_give_the_same_tokens():
    pytest.importorskip("transformers")
    rows = bench_decode(BenchConfig(device="cpu", decode_model="tiny", decode_tokens=(8, 20)))
    assert [(r["name"].split(" (")[0], r["new_tokens"]) for r in rows] == [
        ("ours kv-cache", 8), ("ours no-cache", 8), ("hf generate", 8),
        ("ours kv-cache", 20), ("ours no-cache", 20), ("hf generate", 20)]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["same_frac"] == (None if r["name"] == "ours kv-cache" else 1.0)
        assert r["same_prefix"] == (None if r["name"] == "ours kv-cache" else r["new_tokens"])
        assert r["tok_per_s"] * r["ms_per_token"] == pytest.approx(1000) and r["first_tok_per_s"] > 0
    assert rows[3]["distinct_tokens"] > 2  # the random model does not repeat one token, so equality means something


def test_batched_rows_compare_all_prompts_at_once_with_one_at_a_time(tmp_path):
    result = main(["--device", "cpu", "--suite", "batched", "--batched-rows", "3", "--batched-tokens", "2",
                   "--out", str(tmp_path / "b.json")])
    rows = result["batched"]
    assert [(r["name"], r["status"], r["prompts"], r["new_tokens"], r["repeats"]) for r in rows] == [
        ("3 at once", "ok", 3, 2, 3), ("one at a time", "ok", 3, 2, 3)]
    assert math.isfinite(rows[0]["tok_per_s"]) and rows[1]["tok_per_s"] > 0 and rows[1]["speedup"] == 1.0
    assert rows[0]["speedup"] == pytest.approx(rows[0]["tok_per_s"] / rows[1]["tok_per_s"])
    table = result["table"].split("batched: ")[1].splitlines()
    assert table[0].endswith("fp32, greedy, 3 prompts of 8-24 tokens x 2 new; the fastest of 3 runs")
    assert table[2].split()[:4] == ["3", "at", "once", f"{rows[0]['tok_per_s']:,.0f}"]
    assert table[3].split()[-2:] == ["1.0x", "ok"]


def test_batched_rates_count_the_tokens_made_and_take_the_fastest_repeat(monkeypatch):
    # 2 prompts whose replies stop after 3 of the 4 new tokens; a clock each generate call moves on by its duration:
    # the untimed first call, then per repeat one call for both prompts and one call each
    now, durations = [0.0], iter([1.0, 0.3, 0.2, 0.2, 0.1, 0.3, 0.3, 0.2, 0.1, 0.1])

    def fake_generate(model, prompts, n, temperature):
        now[0] += next(durations)
        return [types.SimpleNamespace(tokens=[7] * (n - 1)) for _ in prompts]

    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(bench, "generate", fake_generate)
    rows = bench.bench_batched(BenchConfig(device="cpu", batched_rows=2, batched_tokens=4))
    # 6 tokens in 0.3, 0.1, 0.2 s at once (fastest 60/s); in 0.4, 0.6, 0.2 s one at a time (fastest 30/s)
    assert [(r["name"], r["tok_per_s"], r["speedup"]) for r in rows] == [
        ("2 at once", pytest.approx(60.0), pytest.approx(2.0)), ("one at a time", pytest.approx(30.0), 1.0)]


def test_hellaswag_rows_count_every_synthetic_example():
    rows = bench_hellaswag(BenchConfig(device="cpu", hellaswag_batch_sizes=(1, 4), hellaswag_examples=6))
    assert [(r["batch_size"], r["status"], r["examples"], r["model"]) for r in rows] == [(1, "ok", 6, "tiny"),
                                                                                          (4, "ok", 6, "tiny")]
    assert all(r["examples_per_sec"] > 0 for r in rows)


def test_decode_without_transformers_skips_the_hf_rows(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    rows = bench_decode(BenchConfig(device="cpu", decode_model="tiny", decode_tokens=(4,)))
    assert [(r["name"], r["status"]) for r in rows] == [("ours kv-cache", "ok"), ("ours no-cache", "ok"),
                                                        ("hf generate", "skipped")]
    assert rows[1]["same_frac"] == 1.0 and rows[2]["reason"] == "transformers is not installed"


def test_main_writes_json_with_provenance_config_and_table(tmp_path, capsys):
    out = tmp_path / "sub" / "bench.json"
    result = main(["--suite", "train", "--device", "cpu", "--model", "tiny", "--seq-len", "32", "--batch-sizes", "2",
                   "--steps", "1", "--warmup", "0", "--variants", "eager,eager+fused", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["table"] == result["table"]
    assert {"git_sha", "torch", "python", "device", "torch_threads"} <= set(saved["provenance"])
    assert saved["config"]["model"] == "tiny" and saved["config"]["batch_sizes"] == [2]  # resolved, as run
    assert [(r["name"], r["status"]) for r in saved["train"]] == [("eager", "ok"), ("eager+fused", "skipped")]
    assert saved["train"][0]["loss_delta"] == 0.0 and "dloss" in result["table"]  # the first row is the reference
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(result["table"].rstrip())  # the table comes last
    assert "eager+fused" in result["table"] and "skipped: the fused kernels need CUDA and triton" in result["table"]
    breakdown = result["table"].split("where the step's time goes")[1]  # the ok row, as % of its ms/step
    row = saved["train"][0]
    # on CPU as % of the profiled step's own wall time, which holds every op's self time
    assert 0 < row["breakdown"]["busy_ms"] <= row["breakdown"]["wall_ms"]
    assert f"{100 * row['breakdown']['parts_ms']['matmul'] / row['breakdown']['wall_ms']:.0f}%" in \
        breakdown.splitlines()[2]
    mm = next(t for t in row["breakdown"]["top"] if t["name"] == "aten::mm")  # the JSON keeps the costliest ops
    assert mm["part"] == "matmul" and mm["calls"] > 0 and mm["ms"] <= row["breakdown"]["parts_ms"]["matmul"]


def test_prune_rows_time_the_median_forward(monkeypatch):
    import prune

    def clock(fn, device, steps, warmup=0):  # forwards read 4, 1 and 10 ms (the median is 4); decoding runs once
        if steps == 3:
            return 0.0, [4.0, 1.0, 10.0]
        fn()
        return 0.0, [100.0] * steps

    monkeypatch.setattr(bench, "time_ms", clock)
    monkeypatch.setattr(prune, "prune", lambda model, *args: (model,))  # the timing, not the pruning
    rows = bench.bench_prune(BenchConfig(**{**TINY, "steps": 3}, decode_model="tiny", int8_tokens=1))
    assert {(r["status"], r["forward_ms"]) for r in rows if r["name"] != "2:4 semi-structured"} == {("ok", 4.0)}


def test_the_int8_table_counts_weight_mb_in_1e6_bytes():
    row = {"suite": "int8", "name": "fp32", "weights": "w", "params": 1, "prompt": 1, "new_tokens": 2,
           "weight_bytes": 500_000_000, "status": "ok"}
    table = bench.format_table({"provenance": provenance(torch.device("cpu")), "config": {}, "int8": [row]})
    assert table.splitlines()[-1].split()[-2:] == ["500.0", "ok"]  # MB, not MiB (476.8)


def test_prune_rows_time_the_hf_model_init_from_names(tmp_path):
    import export

    model = GPT(dataclasses.replace(MODEL_PRESETS["tiny"](), block_size=16))
    export.export_hf(model, tmp_path / "hf")
    rows = bench.bench_prune(BenchConfig(**{**TINY, "steps": 1, "warmup": 0}, init_from=str(tmp_path / "hf"),
                                         int8_tokens=2))
    assert {r["weights"] for r in rows} == {str(tmp_path / "hf")} and rows[0]["T"] == 16  # not random GPT-2 weights
    assert rows[0]["params"] == sum(p.numel() for p in GPT.load(None, str(tmp_path / "hf")).parameters())


def test_table_from_prints_the_rows_of_a_run_cut_short(tmp_path, capsys):
    # a GPU call killed at its time limit prints no table; its JSON, rewritten after every row, has the rows so far
    out = tmp_path / "bench.json"
    main(["--suite", "train", "--device", "cpu", "--model", "tiny", "--seq-len", "32", "--batch-sizes", "2",
          "--steps", "1", "--warmup", "0", "--variants", "eager,eager+fused", "--profile", "false", "--out", str(out)])
    cut = json.loads(out.read_text())
    del cut["table"], cut["train"][1]  # as the JSON stood after the first row
    out.write_text(json.dumps(cut))
    capsys.readouterr()
    result = main(["--table-from", str(out)])
    printed = capsys.readouterr().out
    assert printed == result["table"] + "\n" and "eager" in printed and "eager+fused" not in printed
    assert f"{cut['train'][0]['tok_per_s']:,.0f}" in printed
    (tmp_path / "log.txt").write_text("not json")
    with pytest.raises(SystemExit, match=r"--table-from .*log.txt is not a bench.py JSON file"):
        main(["--table-from", str(tmp_path / "log.txt")])
    (tmp_path / "other.json").write_text('{"config": {}}')  # JSON, but no bench.py run's (no provenance)
    with pytest.raises(SystemExit, match=r"--table-from .*other.json is not a bench.py JSON file \(KeyError"):
        main(["--table-from", str(tmp_path / "other.json")])


def test_a_tables_title_names_what_its_rows_measured_over_the_flags():
    # --dtype auto resolved to float32 on the CPU: the row's dtype, not the flag's, heads the kernel table
    row = {"suite": "kernel", "rows": 8, "cols": 16, "dtype": "float32", "name": "copy", "pass": "d2d copy", "ms": 1.0,
           "bytes": 1024, "gb_per_s": 1.0, "pct_copy": 100.0, "status": "ok"}
    table = bench.format_table({"provenance": provenance(torch.device("cpu")),
                                "config": {"dtype": "auto", "steps": 2, "seq_len": 1024}, "kernel": [row]})
    assert "kernel: bias+GELU on (8, 16) float32; GB/s of fwd 2MN+N, bwd 3MN+2N elements; median of 2" in table


def test_cpu_defaults_are_the_small_ones_and_resolving_twice_changes_nothing():
    """Left to auto, a CPU run gets the tiny shapes: GPT-2 124M at T=1024 or 64K-row kernels would take hours there."""
    cfg = BenchConfig(device="cpu")
    assert (cfg.model, cfg.seq_len, cfg.batch_sizes, cfg.kernel_rows) == ("tiny", 64, (4,), 1024)
    assert dataclasses.replace(cfg) == cfg


@pytest.mark.parametrize("argv, message", [
    (["--suite", "bogus"], "--suite must be all or a comma list of kernel"),
    (["--variants", "eagr"], "--variants: unknown eagr"),
    (["--steps", "0"], "--steps, --grad-accum, --int8-tokens, --batched-rows and --batched-tokens must be >= 1"),
    (["--batched-rows", "0"], "--batched-rows and --batched-tokens must be >= 1"),  # was the batched row's failure
    (["--batched-tokens", "0"], "--batched-rows and --batched-tokens must be >= 1"),
    (["--model", "gpt5"], "--model must be one of"),  # TrainConfig's own check, before any row
    (["--suite", "train", "--variants", "tp1,pp2", "--model", "gpt5"], "--model must be one of"),  # tp/pp rows alone
    (["--suite", "prune", "--decode-model", "tiny", "--prune-sparsity", "1.5"],  # not each row failing alone
     r"--prune-sparsity must be in \[0, 1\); got 1.5"),
    (["--suite", "prune", "--ckpt", "no/such.pt"], "error: --ckpt no/such.pt: no such file"),  # not a suite's error
])
def test_bad_flags_exit_with_a_message(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["--device", "cpu", *argv])


def test_dtype_fp16_that_help_lists_runs_and_the_tensor_parallel_rows_say_why_not():
    # `bench.py --dtype fp16` (any suite, even kernel) was refused: "--dtype fp16's GradScaler does not run under
    # --tp/--pp", flags never given, from the tp/pp rows that `--variants all` holds
    cfg = BenchConfig(**TINY, dtype="fp16", suite="kernel")
    assert (cfg.dtype, cfg.variants) == ("fp16", "all")
    [row] = bench.run_train(BenchConfig(**TINY, dtype="fp16", variants="tp1"))
    assert (row["status"], row["reason"]) == ("failed", "ValueError: --dtype fp16's GradScaler does not run under "
                                                        "--tp/--pp: use bf16")


def test_an_out_path_that_cannot_be_written_fails_before_any_row(tmp_path, capsys):
    with pytest.raises(SystemExit, match=f"--out {tmp_path} is a directory; pass the JSON file to write, e.g. "
                       f"{tmp_path / 'bench.json'}"):  # one line, not the traceback of the first write's rename
        main(["--device", "cpu", "--suite", "hellaswag", "--out", str(tmp_path)])
    assert "hellaswag" not in capsys.readouterr().out  # no row ran


def test_ddp_variant_wraps_the_model_as_torchrun_would_and_leaves_no_process_group():
    cfg = BenchConfig(**TINY, grad_accum=2)
    plain = bench_train(cfg, Variant("eager"))
    wrapped = bench_train(cfg, Variant("eager+ddp", ddp=True))  # gloo, one rank
    assert (plain["module"], wrapped["module"]) == ("GPT", "DistributedDataParallel")
    assert wrapped["loss"] == pytest.approx(plain["loss"], abs=1e-6)  # one rank's all-reduce changes no gradient
    assert not torch.distributed.is_initialized()
    variant = {v.name: v for v in bench.default_variants((4,))}["compile+ddp"]
    assert variant.ddp and variant.train == {"compile": True}


def test_suite_list_runs_in_the_order_given(tmp_path):
    # the GPU suite puts train before kernel: the row order in the JSON is the run order
    result = main(["--device", "cpu", "--suite", "hellaswag,kernel", "--kernel-impls", "eager",
                   "--hellaswag-batch-sizes", "2", "--hellaswag-examples", "4", "--steps", "2", "--warmup", "0",
                   "--out", str(tmp_path / "b.json")])
    assert [k for k in result if k in bench.SUITES] == ["hellaswag", "kernel"]
    saved = json.loads((tmp_path / "b.json").read_text())
    assert [k for k in saved if k in bench.SUITES] == ["hellaswag", "kernel"]
    assert [r["status"] for r in result["hellaswag"]] == ["ok"]
    assert {r["name"] for r in result["kernel"]} == {"copy", "eager", "ce eager"}


def test_a_device_that_fails_ends_the_run_with_the_table_of_the_rows_before(monkeypatch, tmp_path):
    # an illegal memory access (max-autotune's autotuning on an H200) is sticky: from then on every CUDA call fails,
    # the cleanup after each row among them. Here the cleanup fails from the second row on, as it would.
    calls, error = [], "RuntimeError: CUDA error: an illegal memory access was encountered"
    monkeypatch.setattr(bench, "device_lost", lambda: calls.append(1) or (error if len(calls) >= 2 else ""))
    cfg = BenchConfig(**{**TINY, "steps": 1, "warmup": 0, "profile": False, "variants": "eager,eager+fused,compile"})
    rows = list(bench.run_train(cfg))
    assert [(r["name"], r["status"]) for r in rows] == [("eager", "ok"), ("eager+fused", "skipped")]
    assert len(calls) == 2  # compile never started: nothing touches the device after it failed
    # main: the suite after it does not run, and the table and the JSON still come out
    calls[:] = ["already failed once"]
    result = main(["--suite", "train,kernel", "--variants", "eager,compile", "--device", "cpu", "--model", "tiny",
                   "--seq-len", "32", "--batch-sizes", "2", "--steps", "1", "--warmup", "0", "--profile", "false",
                   "--out", str(tmp_path / "b.json")])
    assert [r["name"] for r in result["train"]] == ["eager"] and "kernel" not in result
    assert result["errors"] == {"train": f"the device failed: {error}; later suites not run"}
    assert "eager" in result["table"] and f"train: failed: the device failed: {error}" in result["table"]
    assert json.loads((tmp_path / "b.json").read_text())["errors"] == result["errors"]


def test_gpu_suite_variants_are_bench_variants():
    # scripts/gpu_suite.sh's default row list runs on a GPU lent for minutes: a name bench.py does not know would
    # fail select_variants there, costing the whole bench stage
    script = (ROOT / "scripts" / "gpu_suite.sh").read_text()
    listed = re.search(r'BENCH_VARIANTS="\$\{BENCH_VARIANTS:-(.*?)\}"', script, re.S).group(1).replace("\\\n", "")
    names = listed.split(",")
    known = [v.name for v in bench.default_variants((16, 32, 64))]  # the GPU's default batch sizes
    assert set(names) <= set(known), set(names) - set(known)
    assert len(names) == len(set(names)) and names[:3] == ["eager", "compile", "compile+fused"]
    assert set(known) - set(names) == set(), "a bench variant the GPU suite never runs"


def test_tensor_and_pipeline_rows_train_the_eager_rows_model_and_name_torchrun_for_two_ranks():
    cfg = BenchConfig(**TINY, grad_accum=2)
    plain, known = bench_train(cfg, Variant("eager")), {v.name: v for v in bench.default_variants((2,))}
    for name in ("tp1", "pp1"):  # the DTensor / pipeline code on a one-rank mesh: the same fp32 steps
        row = bench_train(cfg, known[name])
        assert (row["module"], row["ranks"]) == ("Sharded", 1)
        assert row["loss"] == pytest.approx(plain["loss"], abs=1e-5)
    with pytest.raises(bench.Skipped, match="runs on 2 ranks, this run has 1: torchrun --nproc_per_node=2 bench.py "
                                           "--variants tp2"):
        bench_train(cfg, known["tp2"])
    assert not torch.distributed.is_initialized()
