"""README: every command of ours that it documents parses, with flags that exist; the quickstart matches .ci/run."""

import re
import shlex

import pytest

import bench
import fineweb
import hellaswag
import model
import plot
import sample
import train
from conftest import ROOT

SCRIPTS = {
    "train.py": (train.TrainConfig, train.PRESETS),
    "fineweb.py": (fineweb.FinewebConfig, None),
    "hellaswag.py": (hellaswag.HellaSwagConfig, None),
    "sample.py": (sample.SampleConfig, None),
    "model.py": (model.ModelCLIConfig, None),
    "plot.py": (plot.PlotConfig, None),
    "bench.py": (bench.BenchConfig, None),
}


def readme_commands() -> list[tuple[str, list[str]]]:
    """(script, args) for each `python X.py ...` / `torchrun ... X.py ...` line in the README's code blocks."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].split("|")[-1].strip()
            words = shlex.split(line)
            scripts = [i for i, w in enumerate(words) if w in SCRIPTS]
            if scripts and words[0] in ("python", "torchrun"):
                i = scripts[0]
                commands.append((words[i], words[i + 1:]))
    return commands


def test_readme_documents_every_script():
    documented = {script for script, _ in readme_commands()}
    assert documented >= {"train.py", "fineweb.py", "hellaswag.py", "sample.py", "model.py"}


@pytest.mark.parametrize("script, args", readme_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_readme_command_flags_exist(script, args):
    cls, presets = SCRIPTS[script]
    model.parse_config(cls, args, presets)  # raises SystemExit naming the flag if one does not exist


def test_quickstart_is_what_ci_runs():
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart")[1].split("```bash\n")[1].split("```")[0]
    assert [line.split("#")[0].strip() for line in quickstart.strip().splitlines()] == ["bash demo.sh", "bash test.sh"]
    assert "exec bash test.sh" in (ROOT / ".ci" / "run").read_text()
