# Sourced by demo.sh and test.sh: create (once) and activate the project's virtualenv, then install what the given
# requirements files list (once per file content: a stamp file in the venv remembers it).
# VENV picks its location (default .venv); TORCH_SPEC picks the torch build, pinned by default to torch==2.13.0 (the
# CPU wheel on the CI machines; on PyPI for Linux it is a CUDA build). TORCH_SPEC="torch>=2.5" takes pip's newest.
set -euo pipefail
VENV="${VENV:-.venv}"
torch_spec_given="${TORCH_SPEC:-}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
    echo ">> creating virtualenv $VENV"
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# torch first and pinned: left to the requirements' range, pip would pull the newest (multi-GB CUDA) build
# its version from the package's metadata: importing torch to ask took 3.5 s of every demo.sh and test.sh
if installed="$(python -c "from importlib.metadata import version; print(version('torch'))" 2>/dev/null)"; then
    # a TORCH_SPEC the installed torch does not meet is not acted on: say so (pip's own packaging judges the spec)
    if [ -n "$torch_spec_given" ] && ! python -c 'import sys; from pip._vendor.packaging.requirements import \
Requirement; sys.exit(not Requirement(sys.argv[1]).specifier.contains(sys.argv[2].split("+")[0], prereleases=True))' \
            "$TORCH_SPEC" "$installed" 2>/dev/null; then
        echo ">> note: $VENV already has torch $installed, kept; TORCH_SPEC=$TORCH_SPEC only applies to a new venv" \
            "(VENV=path makes one)"
    fi
else
    python -m pip install -q "$TORCH_SPEC"
fi
for req in requirements.txt "$@"; do
    stamp="$VENV/.installed-$(basename "$req")-$(cksum < "$req" | cut -d' ' -f1)"
    if [ ! -f "$stamp" ]; then
        echo ">> pip install -r $req"
        python -m pip install -q -r "$req"
        touch "$stamp"
    fi
done
