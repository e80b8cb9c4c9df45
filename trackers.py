"""TensorBoard and W&B for RunLog: each record it writes to log.jsonl becomes scalars named by its type (train/loss,
val/loss, hellaswag/acc_norm...) at the record's step. Both packages are optional and imported only when asked for.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

# the log.jsonl fields each record type sends; a field named after its type drops the prefix (val_loss -> val/loss).
# train: pretraining's, then the preference objectives' (accuracy, margin) and rl.py's; a task's pass@k as well
SCALARS = {"train": ("loss", "lr", "grad_norm", "tok_s", "mfu", "accuracy", "margin", "reward", "reward_std", "kl",
                     "clip_frac", "entropy", "length", "value_loss", "rollout_tok_s", "update_tok_s"),
           "val": ("val_loss", "val_accuracy", "val_margin"), "hellaswag": ("acc", "acc_norm"), "task": ("acc",)}


def scalars(record: dict) -> dict[str, float]:
    """The record's scalars by tag: {"train/loss": 10.9, "train/lr": 6e-05, ...}; a None (no MFU on CPU) is left out."""
    kind = record["type"]
    keys = [*SCALARS.get(kind, ()), *(key for key in record if kind == "task" and key.startswith("pass@"))]
    return {f"{kind}/{key.removeprefix(kind + '_')}": float(record[key]) for key in keys if record.get(key) is not None}


def missing_package(tensorboard: bool, wandb_project: str) -> str | None:
    """Why --tensorboard or --wandb cannot run here (its package is not installed), or None."""
    for flag, package, wanted in (("--tensorboard", "tensorboard", tensorboard), ("--wandb", "wandb", wandb_project)):
        if wanted:
            try:
                importlib.import_module(package)
            except ImportError:
                return f"{flag} needs the {package} package: pip install {package}"
    return None


class TensorBoard:
    """Event files in the run's out dir. A run hides the steps from `forget` on that earlier event files hold, as
    log.jsonl drops them: an interrupted run's past its checkpoint, or all of a dead attempt's (a fresh start)."""

    def __init__(self, out_dir: Path, forget: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir), purge_step=forget)

    def write(self, record: dict) -> None:
        if record["type"] == "config":
            self.writer.add_text("config", f"```\n{json.dumps(record, indent=1)}\n```", record["step"])
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run (offline too, WANDB_MODE=offline) whose id is kept in out_dir/wandb_run_id, so a resumed run logs on
    into the same W&B run. Its files go into the out dir unless WANDB_DIR says where."""

    def __init__(self, project: str, out_dir: Path, resume_step: int | None):
        import wandb

        id_file = out_dir / "wandb_run_id"
        resuming = resume_step is not None and id_file.is_file()
        run_id = id_file.read_text().strip() if resuming else secrets.token_hex(4)
        out_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        try:
            self.run = wandb.init(project=project, id=run_id, resume="allow", name=out_dir.name,
                                  dir=None if os.environ.get("WANDB_DIR") else str(out_dir))
        except Exception as e:  # no API key, no network...: one line, before training, on every rank (setup)
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"--wandb {project}: W&B did not start ({why}); run `wandb login`, or set "
                             "WANDB_MODE=offline to log without an account") from None

    def write(self, record: dict) -> None:
        if record["type"] == "config":
            config = {key: record[key] for key in ("config", "model_config", "provenance") if key in record}
            self.run.config.update(config, allow_val_change=True)
        elif values := scalars(record):
            # online, W&B ignores a step it already has: the interrupted run's, with the same loss (exact resume)
            self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_trackers(tensorboard: bool, wandb_project: str, out_dir: Path, resume_step: int | None,
                  forget: int | None = None) -> list[Any]:
    """The trackers asked for, each with write(record) and close(); `forget` as prepare_log returns it."""
    return [*([TensorBoard(out_dir, forget)] if tensorboard else []),
            *([WandB(wandb_project, out_dir, resume_step)] if wandb_project else [])]
