"""plot.py: the PNG exists, is a real image, and is drawn from the log's records."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import plot
import train


def test_plot_png_comes_from_the_log(token_data, tmp_path, capsys):
    train.main(["--preset", "tiny", "--data", str(token_data), "--out-dir", str(tmp_path), "--max-steps=6",
                "--eval-every=2"])
    log = tmp_path / "log.jsonl"
    config, curves = plot.load_curves(log)
    assert config["model_config"]["n_layer"] == 2
    assert [r["step"] for r in curves["train"]] == list(range(6))
    assert [r["step"] for r in curves["val"]] == [0, 2, 4, 6]
    png = plot.main(["--log", str(log)])
    assert png == tmp_path / "loss.png" and f"plot: wrote {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (2090, 495)  # 19 x 4.5 inches at 110 dpi: loss, bpb and lr panels, no HellaSwag
    assert all(r["val_bpb"] > 0 for r in curves["val"])
    # a different log gives a different picture; a resumed run's re-logged step replaces the earlier record
    with open(log, "a") as f:
        f.write(json.dumps({"type": "train", "step": 5, "tokens": 3072, "loss": 1.0, "lr": 0.0, "grad_norm": 0.0,
                            "ms": 1.0, "tok_s": 1.0, "mfu": None}) + "\n")
        f.write(json.dumps({"type": "hellaswag", "step": 5, "tokens": 3072, "acc": 0.25, "acc_norm": 0.3, "n": 8,
                            "examples_per_sec": 1.0}) + "\n")
    _, curves = plot.load_curves(log)
    assert len(curves["train"]) == 6 and curves["train"][-1]["loss"] == 1.0
    two = plot.main(["--log", str(log), "--out", str(tmp_path / "two.png"), "--x", "tokens"])
    data2 = two.read_bytes()
    assert int.from_bytes(data2[16:20], "big") == 2750  # a fourth panel for HellaSwag
    assert data2 != data


def test_plot_errors(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        plot.main(["--log", str(tmp_path / "nope.jsonl")])
    with pytest.raises(SystemExit, match=f"is a directory; pass the log itself: --log {tmp_path / 'log.jsonl'}"):
        plot.main(["--log", str(tmp_path)])
    empty = tmp_path / "log.jsonl"
    empty.write_text(json.dumps({"type": "config", "step": 0}) + "\n")
    with pytest.raises(SystemExit, match=r"has no train records: its run trained no step yet \(or had --max-steps 0, "
                                         r"as prune.py's default\); nothing to draw$"):  # not 'run train.py first'
        plot.main(["--log", str(empty)])
    with pytest.raises(SystemExit, match="--x must be 'step' or 'tokens'"):
        plot.main(["--log", str(empty), "--x", "time"])
    ckpt = tmp_path / "ckpt_000250.pt"  # a checkpoint passed for the log: a zip, whose byte 64 here is 0x80
    ckpt.write_bytes(b"PK\x03\x04" + bytes(60) + b"\x80 binary")
    with pytest.raises(SystemExit, match=rf"error: {ckpt} is not a train.py log.jsonl: it is not text \(invalid "
                                         r"start byte at byte 64\); pass the log.jsonl in the run's --out-dir"):
        plot.main(["--log", str(ckpt)])
    # commas alone named no log: matplotlib's "Number of columns must be a positive integer, not 0" came out
    with pytest.raises(SystemExit, match=r"^error: --log , does not exist; train.py writes it as <out_dir>/log.jsonl$"):
        plot.main(["--log=,"])


def test_without_log_the_newest_run_is_plotted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        plot.main([])
    assert str(e.value) == "error: no out/*/log.jsonl here; pass --log PATH (the log.jsonl in a run's --out-dir)"
    for i, run in enumerate(("b", "c", "a")):  # written in this order: the newest is not the last name
        log = tmp_path / "out" / run / "log.jsonl"
        log.parent.mkdir(parents=True)
        log.write_text(json.dumps({"type": "train", "step": 0, "tokens": 1, "loss": 5.0 + i}) + "\n")
        os.utime(log, (1e9 + i, 1e9 + i))
    assert plot.main([]) == Path("out/a/loss.png") and (tmp_path / "out/a/loss.png").is_file()
    assert capsys.readouterr().out == "plot: wrote out/a/loss.png\n"


def test_plot_draws_the_series_of_the_log(tmp_path, monkeypatch):
    """What is drawn, read back from the figure (a spy on savefig that runs the real one): the raw train loss and
    its EMA (an independent recurrence), the val loss at its own x, acc_norm on a second panel with OpenAI's two
    reference lines for a 124M config, all against tokens with --x tokens. The last config record counts, a re-logged
    step's later record wins, and a torn last line (a run writing it right now) is left out."""
    from matplotlib.figure import Figure

    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self) or savefig(self, *a, **kw))
    small = {"n_layer": 2, "n_embd": 32, "n_head": 4}
    records = [{"type": "config", "step": 0, "model_config": small},
               {"type": "config", "step": 0, "model_config": {"n_layer": 12, "n_embd": 768, "n_head": 12}}]
    losses = [5.0, 4.0, 9.0, 3.0]
    records += [{"type": "train", "step": s, "tokens": 100 * (s + 1), "loss": x, "lr": 1e-3 * (s + 1)}
                for s, x in enumerate(losses)]
    records += [{"type": "train", "step": 2, "tokens": 300, "loss": 4.5, "lr": 3e-3}]  # a resumed run re-logs step 2
    records += [{"type": "val", "step": s, "tokens": 100 * s, "val_loss": v} for s, v in ((0, 6.0), (2, 4.25))]
    records += [{"type": "hellaswag", "step": s, "tokens": 100 * s, "acc": a, "acc_norm": n}
                for s, a, n in ((0, 0.25, 0.26), (2, 0.24, 0.28))]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"type": "train", "step": 4, "tok')
    plot.main(["--log", str(log), "--x", "tokens", "--smooth", "0.75"])
    (fig,) = figures
    loss_ax, lr_ax, hs_ax = fig.axes
    raw, smoothed, val = loss_ax.get_lines()
    losses[2] = 4.5
    ema = [losses[0]]
    for x in losses[1:]:
        ema.append(0.75 * ema[-1] + 0.25 * x)
    assert list(raw.get_xdata()) == list(smoothed.get_xdata()) == [100, 200, 300, 400]
    assert list(raw.get_ydata()) == losses
    assert list(smoothed.get_ydata()) == pytest.approx(ema, rel=1e-12)
    assert (list(val.get_xdata()), list(val.get_ydata())) == ([0, 200], [6.0, 4.25])
    # 4 steps have no first tenth to leave out: the y-range holds the EMA and val losses with 5% to spare
    assert ema[-1] > 4.25 and loss_ax.get_ylim() == pytest.approx((4.25 - 0.05 * 1.75, 6.0 + 0.05 * 1.75))
    (lr,) = lr_ax.get_lines()
    assert (list(lr.get_xdata()), list(lr.get_ydata())) == ([100, 200, 300, 400], [1e-3, 2e-3, 3e-3, 4e-3])
    acc_norm, gpt2, gpt3 = hs_ax.get_lines()
    assert (list(acc_norm.get_xdata()), list(acc_norm.get_ydata())) == ([0, 200], [0.26, 0.28])
    assert (list(gpt2.get_ydata()), list(gpt3.get_ydata())) == ([0.2955] * 2, [0.337] * 2)
    assert loss_ax.get_xlabel() == lr_ax.get_xlabel() == hs_ax.get_xlabel() == "tokens"
    figures.clear()
    log.write_text("".join(json.dumps(r) + "\n" for r in [*records[1:], records[0]]))  # the small model's config last
    plot.main(["--log", str(log), "--out", str(tmp_path / "small.png")])
    (fig,) = figures
    assert len(fig.axes[2].get_lines()) == 1  # no reference lines for another model
    assert list(fig.axes[0].get_lines()[0].get_xdata()) == [0, 1, 2, 3]  # steps


def test_plot_overlays_several_runs(tmp_path, monkeypatch):
    """Comma-separated logs: each run's curves in a colour of its own, labelled with its run, on shared axes; the
    OpenAI reference lines only where every run is GPT-2 124M; the PNG goes to compare.png beside the first log, not
    into the working directory."""
    from matplotlib.figure import Figure

    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self) or savefig(self, *a, **kw))
    gpt2 = {"n_layer": 12, "n_embd": 768, "n_head": 12}

    def write_run(path, losses, val, hellaswag, model):
        path.parent.mkdir(parents=True)
        records = [{"type": "config", "step": 0, "model_config": model}]
        records += [{"type": "train", "step": s, "tokens": 10 * s, "loss": x} for s, x in enumerate(losses)]
        records += [{"type": "val", "step": s, "tokens": 10 * s, "val_loss": v} for s, v in val]
        records += [{"type": "hellaswag", "step": s, "tokens": 10 * s, "acc": n, "acc_norm": n} for s, n in hellaswag]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    a = write_run(tmp_path / "lr6e-4" / "log.jsonl", [5.0, 4.0, 3.0], [(0, 6.0), (2, 3.5)], [(2, 0.27)], gpt2)
    b = write_run(tmp_path / "lr1e-3" / "log.jsonl", [5.0, 3.0], [(1, 3.25)], [], gpt2)
    monkeypatch.chdir(tmp_path)
    assert plot.main(["--log", f"{a},{b}", "--smooth", "0"]) == a.with_name("compare.png")
    assert a.with_name("compare.png").stat().st_size > 10_000 and not (tmp_path / "compare.png").exists()
    (fig,) = figures
    loss_ax, hs_ax = fig.axes
    assert loss_ax.get_title() == "2 runs"
    lines = loss_ax.get_lines()  # per run: raw, EMA, val
    assert [line.get_label() for line in lines[1::3] + lines[2::3]] == [
        "lr6e-4: train loss (EMA 0.0)", "lr1e-3: train loss (EMA 0.0)", "lr6e-4: val loss (last 3.500)",
        "lr1e-3: val loss (last 3.250)"]
    assert [list(line.get_ydata()) for line in lines] == [[5.0, 4.0, 3.0]] * 2 + [[6.0, 3.5]] + [[5.0, 3.0]] * 2 + \
        [[3.25]]
    assert [line.get_color() for line in lines] == ["C0"] * 3 + ["C1"] * 3
    acc_norm, *references = hs_ax.get_lines()  # the run without HellaSwag records draws none
    assert acc_norm.get_label() == "lr6e-4: acc_norm (last 0.2700)" and len(references) == 2
    # a run of another model: no reference lines; runs in directories of the same name are told apart by their path
    figures.clear()
    c = write_run(tmp_path / "other" / "lr6e-4" / "log.jsonl", [4.0], [], [(0, 0.25)], {"n_layer": 2})
    plot.main(["--log", f"{a},{c}", "--out", str(tmp_path / "two.png")])
    (fig,) = figures
    assert [line.get_label() for line in fig.axes[1].get_lines()] == [
        f"{a.parent}: acc_norm (last 0.2700)", f"{c.parent}: acc_norm (last 0.2500)"]
    with pytest.raises(SystemExit, match=f"--log {tmp_path / 'nope.jsonl'} does not exist"):
        plot.main(["--log", f"{a},{tmp_path / 'nope.jsonl'}"])


def test_plot_overlays_runs_whose_names_hold_commas(tmp_path):
    # a sweep's runs named as the docstring suggests (lr=6e-4,bs=8): one such log plotted, but two compared gave
    # "error: --log .../lr=6e-4 does not exist", the comma inside a name taken for the one between logs
    logs = [tmp_path / f"lr={lr},bs=8" / "log.jsonl" for lr in ("6e-4", "1e-3")]
    for i, log in enumerate(logs):
        log.parent.mkdir()
        log.write_text(json.dumps({"type": "train", "step": 0, "tokens": 8, "loss": 5.0 + i}) + "\n")
    assert plot.log_paths(f"{logs[0]},{logs[1]}") == logs
    assert plot.main(["--log", f"{logs[0]},{logs[1]}"]) == logs[0].with_name("compare.png")
    with pytest.raises(SystemExit, match=f"--log {tmp_path / 'nope.jsonl'} does not exist"):  # the missing one named
        plot.main(["--log", f"{tmp_path / 'nope.jsonl'},{logs[0]}"])
    (tmp_path / "lr=6e-4").mkdir()  # another run's directory, named as the first piece: not taken for the log
    assert plot.log_paths(f"{logs[0]},{tmp_path}") == [logs[0], tmp_path]  # a directory: read_run says so
    (tmp_path / "log").write_text("")
    (tmp_path / "log,old").write_text("")  # a file whose name a file's name and a comma begin: itself, as given
    assert plot.log_paths(f"{tmp_path / 'log'},old") == [tmp_path / "log,old"]


def test_plot_overlays_the_logs_a_shell_glob_gives_as_words(tmp_path, monkeypatch):
    # `--log out/sweep/*/log.jsonl` expands to several words: "error: unexpected argument '.../b/log.jsonl'; options
    # look like --key=value"; each word is a log as given (a comma in its name too), and the options after them apply
    from matplotlib.figure import Figure

    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self) or savefig(self, *a, **kw))
    logs = [tmp_path / name / "log.jsonl" for name in ("a", "lr=6e-4,bs=8", "c")]
    for i, log in enumerate(logs):
        log.parent.mkdir()
        log.write_text(json.dumps({"type": "train", "step": 0, "tokens": 8, "loss": 5.0 + i}) + "\n")
    assert plot.main(["--log", *map(str, logs), "--smooth", "0"]) == logs[0].with_name("compare.png")
    (fig,) = figures
    assert fig.axes[0].get_title() == "3 runs"
    assert [line.get_label() for line in fig.axes[0].get_lines()[1::2]] == [
        "a: train loss (EMA 0.0)", "lr=6e-4,bs=8: train loss (EMA 0.0)", "c: train loss (EMA 0.0)"]
    out = tmp_path / "two.png"
    assert plot.main(["--x", "tokens", f"--log={logs[2]}", f"{logs[0]},{logs[1]}", "--out", str(out)]) == out
    assert [line.get_label() for line in figures[1].axes[0].get_lines()[1::2]] == [
        "c: train loss (EMA 0.9)", "a: train loss (EMA 0.9)", "lr=6e-4,bs=8: train loss (EMA 0.9)"]
    assert list(figures[1].axes[0].get_lines()[0].get_xdata()) == [8]  # --x tokens, given before --log
    with pytest.raises(SystemExit, match=f"--log {tmp_path / 'nope.jsonl'} does not exist"):
        plot.main(["--log", str(logs[0]), str(tmp_path / "nope.jsonl")])


def test_a_repeated_log_adds_its_logs_and_an_empty_one_stands_alone(tmp_path, monkeypatch):
    # `--log a b --log c` drew b and c (the parser kept the last --log's value), `--log= a b` the newest run plus a, b
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self))
    monkeypatch.chdir(tmp_path)
    logs = [tmp_path / "out" / name / "log.jsonl" for name in ("a", "b", "c")]
    for i, log in enumerate(logs):
        log.parent.mkdir(parents=True)
        log.write_text(json.dumps({"type": "train", "step": 0, "tokens": 8, "loss": 5.0 + i}) + "\n")
        os.utime(log, (i, i))  # c is the newest
    plot.main(["--log", str(logs[0]), str(logs[1]), "--smooth=0", f"--log={logs[2]}"])
    assert [line.get_label() for line in figures[0].axes[0].get_lines()[1::2]] == [
        "a: train loss (EMA 0.0)", "b: train loss (EMA 0.0)", "c: train loss (EMA 0.0)"]
    plot.main(["--log="])  # alone: the newest run's
    assert figures[1].axes[0].get_title() == "c: 1 steps"
    for argv in (["--log=", str(logs[0])], ["--log", str(logs[0]), "--log="]):
        with pytest.raises(SystemExit, match=r"^error: an empty --log \(the newest out/\*/log.jsonl\) stands alone; "
                           "name each log to overlay it$"):
            plot.main(argv)
    with pytest.raises(SystemExit, match="^error: --log needs a value, e.g. --log=VALUE$"):
        plot.main(["--log", str(logs[0]), "--log", "--smooth=0"])


def test_help_after_the_logs_a_shell_glob_gives_is_help(tmp_path, capsys):
    # `--log out/sweep/*/log.jsonl -h` printed help before the glob's words were logs; then -h was read as a log:
    # "error: --log -h does not exist"
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"type": "train", "step": 0, "tokens": 8, "loss": 5.0}) + "\n")
    for argv in (["--log", str(log), "-h"], ["--log", str(log), str(log), "-h"]):
        with pytest.raises(SystemExit) as e:
            plot.main(argv)
        assert e.value.code == 0 and capsys.readouterr().out.startswith(plot.__doc__.strip())


def test_the_loss_panel_shows_the_curve_after_its_first_drop(tmp_path, monkeypatch):
    """ln(vocab) at step 0 would squash 90 steps of a slow decline into a few pixels: the y-range's top is the
    highest loss past the run's first tenth (train EMA and val), its bottom the lowest, with 5% to spare."""
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self))
    losses = [10.0] + [4.0 - 0.01 * s for s in range(1, 100)]
    records = [{"type": "train", "step": s, "tokens": 64 * s, "loss": x, "lr": 1e-3} for s, x in enumerate(losses)]
    records += [{"type": "val", "step": s, "tokens": 64 * s, "val_loss": v} for s, v in ((0, 10.5), (50, 3.6),
                                                                                        (99, 3.1))]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot.main(["--log", str(log), "--smooth", "0"])
    (fig,) = figures
    low, high = 4.0 - 0.01 * 99, 4.0 - 0.01 * 10  # step 99's loss; step 10's, the first after the first tenth
    assert fig.axes[0].get_ylim() == pytest.approx((low - 0.05 * (high - low), high + 0.05 * (high - low)))
    assert plot.loss_range([([10.0, 4.0, 3.0], [4.0, 3.0])]) == pytest.approx((2.95, 4.05))  # 10.0 leaves the top
    assert plot.loss_range([([10.0, 4.0], [4.0]), ([9.0, 2.0], [])]) == pytest.approx((1.65, 9.35))  # no tail: all
    assert plot.loss_range([([2.5], [2.5])]) == (2.0, 3.0)  # one value: half a nat either side


def test_a_ten_step_run_leaves_its_first_step_out_of_the_loss_panels_top():
    from matplotlib.figure import Figure

    panel = dict(zip(("loss", "lr"), Figure().subplots(1, 2), strict=True))
    train = [{"step": s, "loss": 10.0 - s, "lr": 1e-3} for s in range(10)]  # ten steps: a tenth is one step
    every, later = plot.draw_run(plot.PlotConfig(smooth=0.0), {"train": train}, "run", 0, True, panel)
    assert every == [10.0 - s for s in range(10)] and later == every[1:]


def test_plot_imports_no_torch():
    # plot.py reads a JSONL file: importing it must not pull in torch (nor the Triton kernels through train.py)
    heavy = ("torch", "triton", "numpy", "train", "model")
    script = f"import sys, plot; print(sorted(m for m in {heavy} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, "[]"), proc.stderr


def test_plot_draws_an_rl_runs_reward_and_the_task_accuracy(tmp_path, monkeypatch):
    """rl.py's log: a reward panel (the EMA of the per-step mean, the raw mean +-1 std shaded) and an accuracy panel
    (greedy solid, pass@k dashed, each at its own steps); an SFT log with --task gets the accuracy panel alone."""
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self))
    rewards, stds = [0.25, 0.5, 0.75], [0.1, 0.2, 0.0]
    records = [{"type": "train", "step": s, "tokens": 10 * s, "loss": 0.1, "lr": 3e-4, "reward": r, "reward_std": d}
               for s, (r, d) in enumerate(zip(rewards, stds, strict=True))]
    records += [{"type": "task", "step": 0, "tokens": 0, "acc": 0.5, "n": 8, "pass@8": 0.75},
                {"type": "task", "step": 2, "tokens": 20, "acc": 0.625, "n": 8}]
    log = tmp_path / "rl" / "log.jsonl"
    log.parent.mkdir()
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot.main(["--log", str(log), "--smooth", "0.5"])
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "learning rate", "reward (mean, +-1 std shaded)",
                                                    "held-out accuracy"]
    reward_ax, task_ax = fig.axes[2:]
    (line,) = reward_ax.get_lines()
    assert list(line.get_ydata()) == [0.25, 0.375, 0.5625] and line.get_label() == "reward (EMA 0.5; last 0.750)"
    band = reward_ax.collections[0].get_paths()[0].vertices
    assert {tuple(v) for v in band} >= {(0, 0.15), (0, 0.35), (1, 0.3), (1, 0.7), (2, 0.75)}
    greedy, passed = task_ax.get_lines()
    assert (list(greedy.get_xdata()), list(greedy.get_ydata())) == ([0, 2], [0.5, 0.625])
    assert (list(passed.get_xdata()), list(passed.get_ydata()), passed.get_linestyle()) == ([0], [0.75], "--")
    assert passed.get_label() == "pass@8 (last 0.750)"
    assert fig.axes[0].get_title() == "rl: 3 steps"
    figures.clear()
    plot.main(["--log", str(log), "--x", "tokens"])  # every panel against tokens, the RL ones too
    reward_ax, task_ax = figures[0].axes[2:]
    assert [list(line.get_xdata()) for line in reward_ax.get_lines() + task_ax.get_lines()] == \
        [[0, 10, 20], [0, 20], [0]]
    figures.clear()
    sft = [{"type": "train", "step": s, "tokens": s, "loss": 1.0, "lr": 1e-3} for s in range(3)]
    log.write_text("".join(json.dumps(r) + "\n" for r in [*sft, records[3]]))
    plot.main(["--log", str(log)])
    assert [ax.get_ylabel() for ax in figures[0].axes] == ["loss", "learning rate", "held-out accuracy"]


def test_plot_draws_chatcore_and_core_on_panels_of_their_own(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self))
    records = [{"type": "train", "step": s, "tokens": s, "loss": 1.0} for s in range(3)]
    records += [{"type": "chatcore", "step": s, "chatcore": c, "results": {"mmlu": 0.5}}
                for s, c in ((0, 0.1), (2, 0.3))]
    records += [{"type": "core", "step": 2, "core_metric": 0.05, "results": {"arc_easy": 0.4}}]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot.main(["--log", str(log)])
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "CORE", "ChatCORE"]
    (core,), (chatcore,) = fig.axes[1].get_lines(), fig.axes[2].get_lines()
    assert (list(chatcore.get_xdata()), list(chatcore.get_ydata())) == ([0, 2], [0.1, 0.3])
    assert chatcore.get_label() == "ChatCORE (last 0.3000)" and core.get_label() == "CORE (last 0.0500)"


def test_plot_draws_the_pairs_ranked_right_of_two_preference_runs(tmp_path, monkeypatch):
    # prefs.py's val records hold val_accuracy, the share of held-out pairs ranked right (a reward model's or DPO's
    # headline): comparing two DPO runs drew their losses and lrs only
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self))
    logs = []
    for name, accs in (("dpo-b0.1", (0.5, 0.75)), ("dpo-b0.5", (0.5, 0.625))):
        records = [{"type": "train", "step": s, "tokens": s, "loss": 0.7, "lr": 1e-4} for s in range(3)]
        records += [{"type": "val", "step": s, "tokens": s, "val_loss": 0.69, "val_accuracy": a, "val_margin": 0.0}
                    for s, a in zip((0, 2), accs, strict=True)]
        (tmp_path / name).mkdir()
        logs.append(tmp_path / name / "log.jsonl")
        logs[-1].write_text("".join(json.dumps(r) + "\n" for r in records))
    plot.main(["--log", f"{logs[0]},{logs[1]}"])
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "learning rate", "val pairs ranked right"]
    lines = fig.axes[2].get_lines()
    assert [(line.get_label(), list(line.get_ydata())) for line in lines] == [
        ("dpo-b0.1: pairs ranked right (last 0.750)", [0.5, 0.75]),
        ("dpo-b0.5: pairs ranked right (last 0.625)", [0.5, 0.625])]
