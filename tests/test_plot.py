"""plot.py: the PNG exists, is a real image, and is drawn from the log's records."""

import json

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
    assert (width, height) == (770, 495)  # 7 x 4.5 inches at 110 dpi: one panel, no HellaSwag records
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
    assert int.from_bytes(data2[16:20], "big") == 1430  # a second panel for HellaSwag
    assert data2 != data


def test_plot_errors(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        plot.main(["--log", str(tmp_path / "nope.jsonl")])
    with pytest.raises(SystemExit, match=f"is a directory; pass the log itself: --log {tmp_path / 'log.jsonl'}"):
        plot.main(["--log", str(tmp_path)])
    empty = tmp_path / "log.jsonl"
    empty.write_text(json.dumps({"type": "config", "step": 0}) + "\n")
    with pytest.raises(SystemExit, match="no train records"):
        plot.main(["--log", str(empty)])
    with pytest.raises(SystemExit, match="--x must be 'step' or 'tokens'"):
        plot.main(["--log", str(empty), "--x", "time"])
