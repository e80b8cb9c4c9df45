# Sourced by demo.sh and test.sh: create (once) and activate the project's virtualenv, then install what the given
# requirements files list (once per file content: a stamp file in the venv remembers it).
# VENV picks its location (default .venv); TORCH_SPEC picks the torch build, pinned by default to torch==2.13.0 (the
# CPU wheel on the CI machines). On a GPU machine, TORCH_SPEC="torch>=2.5" keeps or installs your CUDA build.
set -euo pipefail
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
    echo ">> creating virtualenv $VENV"
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# torch first and pinned: left to the requirements' range, pip would pull the newest (multi-GB CUDA) build
python -c "import torch" 2>/dev/null || python -m pip install -q "$TORCH_SPEC"
for req in requirements.txt "$@"; do
    stamp="$VENV/.installed-$(basename "$req")-$(cksum < "$req" | cut -d' ' -f1)"
    if [ ! -f "$stamp" ]; then
        echo ">> pip install -r $req"
        python -m pip install -q -r "$req"
        touch "$stamp"
    fi
done
