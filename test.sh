#!/usr/bin/env bash
# Run the whole test suite on CPU: creates .venv on first use (torch pinned), then pytest.
# Usage: bash test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")"
. scripts/env.sh requirements-dev.txt
echo ">> python $(python -c 'import sys; print(sys.version.split()[0])'), torch $(python -c 'import torch; print(torch.__version__)')"
set +e
python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
