"""sandbox.py and the HumanEval task it checks: right, wrong and fenced replies on a local copy in the hub's schema;
a program that loops, eats memory, leaves a process or a file behind; tasks.py --eval scoring it as ChatCORE's fifth."""

import contextlib
import itertools
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import chat_format as cf
import sandbox
import tasks
from common import get_tokenizer


def problem(name: str, prompt: str, solution: str, *asserts: str) -> dict:
    """A problem of our own in openai/openai_humaneval's schema: its tests are a check(candidate) of asserts."""
    return {"task_id": f"Mine/{name}", "prompt": prompt, "canonical_solution": solution, "entry_point": name,
            "test": "def check(candidate):\n" + "".join(f"    assert {a}\n" for a in asserts)}


PROBLEMS = [  # the prompts open with their imports, as HumanEval's do
    problem("hyp", 'import math\n\n\ndef hyp(a, b):\n    """The hypotenuse of legs a and b."""\n',
            "    return math.sqrt(a * a + b * b)\n", "candidate(3, 4) == 5", "candidate(5, 12) == 13"),
    problem("twice", 'def twice(s):\n    """s, twice."""\n', "    return s + s\n", "candidate('ab') == 'abab'"),
    problem("evens", 'from typing import List\n\n\ndef evens(xs: List[int]) -> List[int]:\n    """The even xs."""\n',
            "    return [x for x in xs if x % 2 == 0]\n", "candidate([1, 2, 3, 4]) == [2, 4]"),
]


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_humaneval_checks_a_reply_by_running_it_with_the_problems_tests(tmp_path):
    task = tasks.load_task(f"humaneval={write_rows(tmp_path / 'he.jsonl', PROBLEMS)}")
    hyp, twice, evens = task.examples("test")
    assert json.loads(hyp["answer"])["imports"] == "import math" and json.loads(twice["answer"])["imports"] == ""
    assert [task.check(p["messages"][-1]["content"], p["answer"]) for p in (hyp, twice, evens)] == [True, True, True]
    assert not task.check("def twice(s):\n    return s * 3\n", twice["answer"])  # a wrong function
    assert not task.check("def evens(xs):\n    return xs\n", evens["answer"])
    # a chat reply: the first fenced block is the code, the prompt's `import math` put before it
    fenced = "Here it is:\n```python\ndef hyp(a, b):\n    return math.hypot(a, b)\n```\nand ```python\nboom(\n```"
    assert task.check(fenced, hyp["answer"])
    assert not task.check("```python\ndef hyp(a, b):\n    return a + b\n```", hyp["answer"])
    assert task.check("```\ndef twice(s):\n    return 2 * s\n```", twice["answer"])
    # nanochat's block ends on a line of its own: one closed on the code's line is no block (run whole, it fails)
    assert not task.check("```\ndef twice(s):\n    return 2 * s```", twice["answer"])
    with pytest.raises(ValueError, match=r"^openai/openai_humaneval has splits test, not 'train'$"):
        tasks.HumanEval().examples("train")


def test_a_reply_that_ends_its_program_before_the_tests_fails(tmp_path):
    # each exited 0 before check() ran, so that a wrong function (or none) passed: a model replying exit(0) scored
    # 1.0 on every problem (nanochat's fails exit() and quit() only); the program must reach its last line
    twice = tasks.load_task(f"humaneval={write_rows(tmp_path / 'he.jsonl', PROBLEMS)}").examples("test")[1]["answer"]
    ends = ["exit(0)", "quit()", "import sys\nsys.exit()", "import os\nos._exit(0)", "import unittest\nunittest.main()"]
    assert [tasks.HumanEval().check(f"def twice(s):\n    return s\n{end}\n", twice) for end in ends] == [False] * 5
    assert tasks.HumanEval().check("def twice(s):\n    print(s, end='')\n    return s + s\n", twice)  # its output


def test_a_program_that_loops_forever_or_eats_memory_fails_and_says_why():
    start = time.monotonic()
    ran = sandbox.run("while True:\n    pass\n", timeout=0.5)
    assert (ran.passed, ran.reason) == (False, "timed out after 0.5s") and time.monotonic() - start < 30
    bomb = sandbox.run("x = bytearray(1 << 30)\nprint('allocated')\n")  # 1 GiB of address space, over the 256 MiB
    assert (bomb.passed, bomb.reason, bomb.stdout) == (False, "exit 1: MemoryError", "")
    # the limit is address space: 1 GiB mapped, not touched (a bytearray's zeroing outran the 5 s under CI's load)
    reserve = "import mmap\nmmap.mmap(-1, 1 << 30)\n"
    assert (sandbox.run(reserve).passed, sandbox.run(reserve, memory=2 << 30).passed) == (False, True)
    # a limit the OS refuses (here one too large for setrlimit, as macOS refuses RLIMIT_AS) is left off: not every
    # program failed with its error, so that HumanEval scored 0 without a word
    assert sandbox.run("print('ran')\n", memory=1 << 70)[:3] == (True, "passed", "ran\n")
    failed = sandbox.run("import sys\nprint('out')\nsys.exit('bad input')\n")
    assert (failed.passed, failed.reason, failed.stdout) == (False, "exit 1: bad input", "out\n")


def alive(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    return False


def test_a_timed_out_program_leaves_no_child_process_behind():
    program = ("import subprocess, time\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\n"
               "time.sleep(60)\n")
    ran = sandbox.run(program, timeout=1.0)
    if os.geteuid() != 0:  # RLIMIT_NPROC: no process started at all (root is exempt)
        assert ran.reason.startswith("exit 1: BlockingIOError: [Errno 11]"), ran
        return
    assert ran.reason == "timed out after 1s"
    pid, deadline = int(ran.stdout), time.monotonic() + 10  # SIGKILL is delivered, not awaited: a generous bound
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(pid)


def test_a_program_runs_isolated_in_a_directory_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SECRET_TOKEN", "x")
    program = ("import os, sys\nopen('stray.txt', 'w').write('x')\nprint(os.getcwd(), os.environ.get('SECRET_TOKEN'), "
               "sys.flags.isolated, file=sys.stderr)\nprint('y' * 20000 + 'END')\n")
    ran = sandbox.run(program)
    cwd, token, isolated = ran.stderr.split()
    assert ran.passed and (token, isolated) == ("None", "1") and Path(cwd).name.startswith("sandbox-")
    assert list(tmp_path.iterdir()) == [] and not Path(cwd).exists()  # its file went with its directory
    assert len(ran.stdout) == sandbox.KEEP and ran.stdout.endswith("yEND\n")  # the output's end kept


def test_numpy_imports_in_a_program_without_threads():
    # a user's program may start no thread (RLIMIT_NPROC 0; root is exempt): numpy's OpenBLAS, failing to start a
    # thread per core, killed `import numpy` with SIGINT; OMP_NUM_THREADS=1, as nanochat's, starts none
    assert sandbox.run("import os, numpy\nprint(len(os.listdir('/proc/self/task')))\n")[:3] == (True, "passed", "1\n")


def test_tasks_py_scores_humaneval_as_chatcores_fifth_task_from_a_local_copy(tmp_path, capsys):
    from conftest import bigram_model

    enc = get_tokenizer()  # a model that replies "def f(): return 4" to anything, token by token
    chain = [cf.ASSISTANT_START, *enc.encode_ordinary("def f(): return 4"), cf.ASSISTANT_END]
    model, ckpt = bigram_model(dict(itertools.pairwise(chain))), tmp_path / "chat.pt"
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0}, ckpt)
    rows = [problem(name, f"def {name}():\n", "    return 4\n", f"candidate() == {want}")
            for name, want in [("f", 4), ("f", 5), ("g", 4)]]  # right; a wrong value; no g in the reply
    spec = f"humaneval={write_rows(tmp_path / 'he.jsonl', rows)}"
    result = tasks.main(["--eval", str(ckpt), "--tasks", spec, "--max-new-tokens", "12", "--device", "cpu"])
    assert result["results"] == result["centered_results"] == {"humaneval": pytest.approx(1 / 3)}  # chance: 0
    out = capsys.readouterr().out
    assert "humaneval: accuracy 0.3333, centered 0.3333 (3 problems)\nChatCORE 0.3333 over humaneval\n" in out
    assert tasks.TasksConfig().tasks == "arc-easy,arc-challenge,mmlu,gsm8k,humaneval"  # nanochat's five by default
