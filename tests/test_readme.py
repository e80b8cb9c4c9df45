"""README (and the docs/ pages it links): every command of ours that it documents parses, with flags that exist;
the quickstart matches .ci/run; its training presets and its multi-node torchrun form run (briefly)."""

import contextlib
import functools
import io
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest

import bench
import chat
import common
import core
import engine
import export
import fineweb
import hellaswag
import plot
import prefs
import prune
import rl
import sample
import sft
import stage
import tasks
import train
from conftest import ROOT, SHAKESPEARE

SCRIPTS = {
    "train.py": (train.TrainConfig, train.PRESETS),
    "fineweb.py": (fineweb.FinewebConfig, None),
    "hellaswag.py": (hellaswag.HellaSwagConfig, None),
    "sample.py": (sample.SampleConfig, None),
    "export.py": (export.ExportConfig, None),
    "plot.py": (plot.PlotConfig, None),
    "bench.py": (bench.BenchConfig, None),
    "chat.py": (chat.ChatConfig, None),
    "tasks.py": (tasks.TasksConfig, None),
    "rl.py": (rl.RLConfig, None),
    "sft.py": (sft.SFTConfig, sft.PRESETS),
    "prefs.py": (prefs.PrefsConfig, prefs.PRESETS),
    "prune.py": (prune.PruneConfig, None),
    "core.py": (core.CoreConfig, None),
}


def readme_commands(doc: str = "README.md") -> list[tuple[str, list[str]]]:
    """(script, args) for each `python X.py ...` / `torchrun ... X.py ...` of ours in `doc`: in its bash blocks and in
    its inline code, which may wrap a line. A value in capitals (`--seed S`, `$VARIANTS`) or `...` stands for one: it
    goes with its flag."""
    text = (ROOT / doc).read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    return commands_in(lines)


def commands_in(lines: list[str]) -> list[tuple[str, list[str]]]:
    commands = []
    for part in (p for line in lines for p in re.split(r"&&|\||;", line.split("#")[0].split(" [--")[0])):
        first, ours = part.split()[:1], [w for w in part.split() if w in SCRIPTS]  # [--a 1 | --b 2]: optional
        if first in (["python"], ["torchrun"]) and ours:
            words, args = shlex.split(part), []
            for word in words[words.index(ours[0]) + 1:]:
                if not re.fullmatch(r"\$?[A-Z][A-Z0-9_]*|\.\.\.", word):
                    args.append(word)
                elif args and args[-1].startswith("--"):
                    args.pop()
            commands.append((ours[0], args))
    return commands


def parse_error(script: str, args: list[str]) -> str:
    """The one line parse_config refuses this command with, or '' (--help's exit too)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            common.parse_config(SCRIPTS[script][0], args, SCRIPTS[script][1])
    except SystemExit as e:
        return str(e.code or "")
    return ""


def test_readme_documents_every_script():
    documented = {script for script, _ in readme_commands()}
    assert documented >= {"train.py", "fineweb.py", "hellaswag.py", "sample.py", "export.py"}


# the README's details moved to docs/ pages it links: their commands are checked the same way
DOCS = ("README.md", "docs/guide.md", "docs/resume.md", "docs/scale.md", "docs/fineweb.md")


@pytest.mark.parametrize("script, args", [c for doc in DOCS for c in readme_commands(doc)],
                         ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_readme_command_flags_exist(script, args):
    assert parse_error(script, args) == ""  # else parse_config's line naming the flag or value it refuses


@pytest.mark.parametrize("script", SCRIPTS)
def test_usage_in_help_parses(script):
    # a module docstring heads the script's --help: its usage lines are the first commands a user copies
    doc = sys.modules[script.removesuffix(".py")].__doc__
    commands = commands_in(doc.replace("\\\n", " ").splitlines())
    assert {" ".join([s, *a]): parse_error(s, a) for s, a in commands if parse_error(s, a)} == {}


def test_benchmark_commands_parse_or_say_what_they_are_now():
    # docs/benchmarks.md keeps each command as the code of its day ran it, and says what one that no longer parses is
    # now (`train.py --preset sft-demo` after sft.py split from it), for a reader who reruns one
    now = re.findall(r"`([^`]+)`\s+is now\s+`([^`]+)`", (ROOT / "docs" / "benchmarks.md").read_text())
    failing = {}
    for script, args in readme_commands("docs/benchmarks.md"):
        line = functools.reduce(lambda line, pair: line.replace(*pair), now, shlex.join([script, *args]))
        script, *args = shlex.split(line)
        failing[shlex.join([script, *args])] = parse_error(script, args)
    assert {line: error for line, error in failing.items() if error} == {}


def torchrun_commands() -> list[tuple[str, list[str], int]]:
    """(script, args, world size) of each documented `torchrun --nproc_per_node=N [--nnodes=M] X.py ...` of a stage."""
    out = []
    for doc in DOCS:
        for line in (ROOT / doc).read_text().replace("\\\n", " ").splitlines():
            if (m := re.match(r"torchrun (.*?)(train|sft|prefs|rl)\.py ([^#|]*)", line.strip())) and "=N " not in line:
                nodes = re.search(r"--nnodes[= ](\d+)", m.group(1))
                procs = re.search(r"--nproc_per_node[= ](\d+)", m.group(1))
                out.append((f"{m.group(2)}.py", shlex.split(m.group(3)), int(procs[1]) * int(nodes[1] if nodes else 1)))
    return out


@pytest.mark.parametrize("script, args, world", torchrun_commands(), ids=lambda v: str(v))
def test_documented_torchrun_commands_fit_their_ranks(script, args, world):
    # sft.py --preset sft's 32,768-token batch was 8 rows of 1,024 x 8 ranks = 65,536: refused on the README's 8 GPUs
    cls, presets = SCRIPTS[script]
    cfg = common.parse_config(cls, args, presets)
    dp = world // max(cfg.tp, 1) // max(cfg.pp, 1)
    stage.check_run(cfg, engine.Context(), stage.model_config(cfg), dp)  # dp ranks; the world only for agreeing


def test_quickstart_is_what_ci_runs():
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart")[1].split("```bash\n")[1].split("```")[0]
    assert [line.split("#")[0].strip() for line in quickstart.strip().splitlines()] == ["bash demo.sh", "bash test.sh"]
    assert re.search(r"^bash test\.sh$", (ROOT / ".ci" / "run").read_text(), re.M)  # the README's command, as is


# ----------------------------------------------------------------------------------------------------------------------
# the README's training commands, run for real at a size this machine takes: its presets, and torchrun's rendezvous


SMALL = ["--eval-every=1", "--eval-tokens=64", "--hellaswag=off", "--sample-every=0", "--compile=false"]


@pytest.mark.slow
def test_readme_gpt2_preset_takes_a_step(token_data, tmp_path):
    gpt2 = train.main(["--preset", "gpt2-124m", "--data", str(token_data), "--out-dir", str(tmp_path / "gpt2"),
                       "--batch-size=1", "--seq-len=64", "--total-batch-size=64", "--max-steps=1", *SMALL])
    assert abs(gpt2["losses"][0] - 10.82) < 0.5  # about ln(50257) = 10.82: GPT-2 124M at init, random tokens
    assert train.model_config(train.PRESETS["gpt2-124m"]()).n_embd == 768


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"needs the local Tiny Shakespeare at {SHAKESPEARE}")
def test_readme_shakespeare_preset_takes_steps(tmp_path):
    # the shakespeare preset (its model, context, preloaded data) on the local copy's shards, with 512-token steps
    # instead of 16K: a CPU takes ~30 s for those
    data = tmp_path / "shakespeare"
    fineweb.main(["--source", str(SHAKESPEARE), "--out-dir", str(data)])
    run = train.main(["--preset", "shakespeare", "--data", str(data), "--out-dir", str(tmp_path / "out"),
                      "--max-steps=2", "--batch-size=2", "--total-batch-size=512", *SMALL])
    assert len(run["losses"]) == 2 and run["val_loss"] > 5.0


@pytest.mark.slow
def test_readme_multinode_rendezvous_form_runs(token_data, tmp_path):
    # the README's multi-node command with one node: the same c10d rendezvous flags, on this machine
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(2):  # a free port can be taken by another process before torchrun binds it: one more try then
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--rdzv-id=gpt2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "train.py", "--preset", "tiny", "--data",
               str(token_data), "--out-dir", str(tmp_path), "--max-steps=2", "--eval-every=0"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if "address already in use" not in proc.stderr.lower():
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks" in proc.stdout and (tmp_path / "ckpt_000002.pt").is_file()
