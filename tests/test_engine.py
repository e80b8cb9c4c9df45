"""The engine serves a stage other than train.py: tests/engine_script.py (its own config, not TrainConfig) trains
through it, and a resume is bitwise."""

import engine_script  # tests/ is on sys.path (conftest.py lives there)


def test_a_second_stage_on_the_engine_resumes_bitwise(token_data, tmp_path):
    def run(out: str, *extra: str) -> dict:
        return engine_script.main(["--data", str(token_data), "--out-dir", str(tmp_path / out), "--device=cpu",
                                   "--max-lr=3e-3", "--ckpt-every=3", *extra])

    full = run("full", "--max-steps=6")
    first = run("split", "--max-steps=3")
    rest = run("split", "--max-steps=6", "--resume=auto")
    assert len(full["losses"]) == 6 and full["losses"][-1] < full["losses"][0] - 0.01  # it learns
    assert first["losses"] + rest["losses"] == full["losses"]  # bitwise: weights, AdamW, data position, RNG
    assert rest["val_loss"] == full["val_loss"] and rest["step"] == 6
    assert (tmp_path / "split" / "ckpt_000006.pt").is_file()
