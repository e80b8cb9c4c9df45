#!/usr/bin/env bash
# Run the whole test suite on CPU: creates the virtualenv on first use (torch pinned), then pytest.
# Usage: bash test.sh [pytest args]      VENV=path picks the virtualenv (default .venv); REPORT=path the JUnit report;
# WORKERS=N the pytest-xdist workers (default 2, one per CI core: most tests keep one core busy; 0 runs them in order)
set -euo pipefail
cd "$(dirname "$0")"
. scripts/env.sh requirements-dev.txt
report="${REPORT:-out/tests/junit.xml}"
mkdir -p "$(dirname "$report")"
echo ">> python $(python -c 'import sys; print(sys.version.split()[0])'), torch $(python -c 'import torch; print(torch.__version__)'), venv $VENV"
set +e
python -m pytest -q -n "${WORKERS:-2}" --dist worksteal --junitxml="$report" "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi
echo "test outputs: JUnit report $report (exit $rc); virtualenv $VENV"
exit "$rc"
