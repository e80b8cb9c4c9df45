"""Runs one Python program in a child process and says whether it passed: how HumanEval's check (tasks.py) runs the
model's code. NOT a security boundary: the program runs as the user, may read, write and reach what the user can, and
can undo its limits (ctypes, a grandchild that calls setsid). It guards against mistakes, not malice: an endless loop,
a memory bomb, a stray file or process. The limits are setrlimit's: one the OS refuses (macOS: RLIMIT_AS) is left off.

    python -I          isolated: no PYTHON* variables, no user site-packages, no script directory on sys.path
    its own cwd        a temporary directory, removed afterwards; stdin empty; env: PATH, OMP_NUM_THREADS=1 (see limits)
    limits             address space (`memory`), CPU seconds, file size, no core dumps, no new processes or threads
                       (RLIMIT_NPROC 0, which numpy's OpenBLAS obeys at OMP_NUM_THREADS=1; root is exempt)
    a wall clock       at `timeout` the whole process group is killed (start_new_session): its children too
    its output         stdout and stderr through files (the file size limit bounds them), their last 10,000 chars

No fork of the caller (a training process with torch's threads): subprocess spawns and execs the interpreter.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, NamedTuple

PYTHON = os.path.abspath(sys.executable)  # as started: a relative path (PATH=.venv/bin) breaks under another cwd
DONE = "check() returned"  # a HumanEval program's last line prints it: one that exits 0 before has not passed
KEEP = 10_000  # characters of stdout and stderr kept: their ends, where a traceback's last line is
# set in the child before the program runs; never above a hard limit the user already has
PRELUDE = """import resource
for name, n in {limits!r}:
    try:  # one the OS lacks or refuses (macOS: RLIMIT_AS) is left off, rather than failing every program
        hard = resource.getrlimit(key := getattr(resource, name))[1]
        resource.setrlimit(key, (n, n) if hard == resource.RLIM_INFINITY else (min(n, hard),) * 2)
    except Exception:
        pass
del resource
exec(compile(open("main.py", encoding="utf-8").read(), "main.py", "exec"), {{"__name__": "__main__"}})
"""


class Ran(NamedTuple):
    passed: bool  # exit 0 within the time
    reason: str  # "passed", "timed out after 5s", "exit 1: AssertionError: ...", "killed by signal 9 (Killed)"
    stdout: str
    stderr: str


def tail(f: IO[bytes]) -> str:
    f.seek(max(0, f.seek(0, os.SEEK_END) - KEEP))
    return f.read().decode(errors="replace")


def run(program: str, timeout: float = 5.0, memory: int = 256 << 20) -> Ran:
    """Runs `program` (Python source) as the module docstring says: `timeout` wall seconds, `memory` bytes of address
    space. Ran(passed, reason, stdout, stderr), whatever the program does."""
    limits = [("RLIMIT_AS", memory), ("RLIMIT_CPU", int(timeout) + 1), ("RLIMIT_FSIZE", 16 << 20),
              ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", 0)]
    with tempfile.TemporaryDirectory(prefix="sandbox-", ignore_cleanup_errors=True) as cwd, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # a file it made read-only stays
        with open(os.path.join(cwd, "main.py"), "w", encoding="utf-8") as f:
            f.write(program)
        proc = subprocess.Popen([PYTHON, "-I", "-c", PRELUDE.format(limits=limits)], cwd=cwd, stdin=subprocess.DEVNULL,
                                env={"PATH": os.defpath, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=err,
                                start_new_session=True)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:  # Popen.wait(timeout) polls too, but raises
            time.sleep(0.005)
        timed_out = proc.returncode is None
        with contextlib.suppress(ProcessLookupError):  # the program's children, alive or not after it ends
            os.killpg(proc.pid, signal.SIGKILL)
        code, stdout, stderr = proc.wait(), tail(out), tail(err)
    last = stderr.strip().splitlines()[-1:]
    reason = f"timed out after {timeout:g}s" if timed_out else "passed" if code == 0 else \
        f"killed by signal {-code} ({signal.strsignal(-code)})" if code < 0 else f"exit {code}: {''.join(last)}"
    return Ran(code == 0 and not timed_out, reason, stdout, stderr)


def humaneval_answer(row: dict) -> str:
    """A HumanEval row's answer for tasks.py: JSON of what its program needs besides the reply, the import lines its
    prompt opens with (blank and comment lines passed over, as nanochat's), its tests and the function they check."""
    lines = itertools.takewhile(lambda s: not s or s.startswith(("import ", "from ", "#")),
                                map(str.strip, row["prompt"].splitlines()))
    imports = "\n".join(s for s in lines if s.startswith(("import ", "from ")))
    return json.dumps({"imports": imports, "test": row["test"], "entry_point": row["entry_point"]})


def humaneval_passed(reply: str, answer: str) -> bool:
    """Whether a reply is right, as nanochat checks it: a program of the prompt's imports, the reply's first ```python
    (or ```) block, else the whole reply, then the problem's tests called on its function, passes and prints DONE last
    (one that exits 0 before its tests, by exit() or unittest.main(), has not passed; nanochat's passes the latter)."""
    block, a = re.search(r"```(?:python)?\s*\n(.*?)\n```", reply, re.S), json.loads(answer)
    ran = run(f"{a['imports']}\n\n{block[1] if block else reply}\n\n{a['test']}\ncheck({a['entry_point']})\n"
              f"print({DONE!r})\n")
    return ran.passed and ran.stdout.endswith(f"{DONE}\n")
