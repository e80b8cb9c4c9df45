# Sourced by demo.sh and test.sh: create (once) and activate the project's virtualenv.
# VENV picks its location (default .venv); TORCH_SPEC picks the torch build, pinned to the CPU wheel the
# CI machines carry by default. On a GPU machine that already has a CUDA torch, `VENV_SYSTEM_SITE=1` reuses it.
set -euo pipefail
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
    echo ">> creating virtualenv $VENV"
    if [ "${VENV_SYSTEM_SITE:-0}" = 1 ]; then python3 -m venv --system-site-packages "$VENV"; else python3 -m venv "$VENV"; fi
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.installed-$(cat "$@" requirements.txt 2>/dev/null | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
    # torch first and pinned: an unpinned torch would pull a different (multi-GB CUDA) build
    python -c "import torch" 2>/dev/null || python -m pip install -q "$TORCH_SPEC"
    for req in requirements.txt "$@"; do python -m pip install -q -r "$req"; done
    touch "$stamp"
fi
