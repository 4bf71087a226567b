"""Experiment tracking beside `metrics.jsonl`: TensorBoard and Weights & Biases (`train.trackers`,
`latentloop train --log tensorboard,wandb`).

Every row the trainer logs (`loop._log`: training rows every `log_every` steps, validation rows)
goes to each tracker too, on rank 0 only; `metrics.jsonl` stays the run's own record. A row's keys
become scalar names grouped as trackers show them: `loss` -> `train/loss`, `val_bpb` -> `val/bpb`,
any other key `k` -> `train/k` (fbt's passes, rgpt's gates, MoR's router loss).

- tensorboard: `torch.utils.tensorboard.SummaryWriter` writing into RUN/tensorboard (`tensorboard
  --logdir runs/`); a resumed run appends a new event file there, which hides the earlier files'
  steps past the resumed checkpoint (`purge_step`): they are trained and logged again, as
  metrics.jsonl keeps them only up to that checkpoint.
- wandb: a run in RUN/wandb, offline unless `WANDB_MODE` says otherwise or an API key is set
  (`WANDB_API_KEY`): training never needs the network, and `wandb sync RUN/wandb/offline-run-*`
  uploads later. The run's config is the run config; a resumed run continues the same W&B run (its
  id is kept in RUN/wandb/run_id). W&B takes no step below one it has: rows logged again after a
  resume behind the last logged step keep their first values there (the same ones, when the resume
  changed no setting: resuming is bit-identical).

A tracker whose package is missing is refused at setup, in one line, before anything is written.
"""

from __future__ import annotations

import importlib.util
import math
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from ..config import TRACKERS
from ..errors import ConfigError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # tracker -> the package it needs (and its extra)
assert set(PACKAGES) == set(TRACKERS)
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
WANDB_ID_FILE = "run_id"
WANDB_ID_LENGTH = 8  # W&B's own run ids: 8 lowercase letters and digits
WANDB_PROJECT_ENV = "WANDB_PROJECT"
DEFAULT_WANDB_PROJECT = "latentloop"


class Tracker(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(step, {grouped name: value}) of a metrics row: its finite numbers only."""
    step = int(row.get("step", 0))
    values = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        name = f"val/{key[len('val_'):]}" if key.startswith("val_") else f"train/{key}"
        values[name] = float(value)
    return step, values


def check_trackers(names: tuple[str, ...]) -> None:
    """Each named tracker's package is installed (before the run folder is touched)."""
    for name in names:
        package = PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"--log {name} needs the {package} package: pip install 'latentloop[{package}]'")


class TensorBoardTracker:
    def __init__(self, run_dir: Path, resumed_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # a run resumed at step S logs S+1 onward again: an earlier event file's rows from there on
        # (written before a crash) would show twice, a second line doubling back over the first
        purge = resumed_step + 1 if resumed_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge)

    def log(self, row: dict[str, Any]) -> None:
        step, values = scalars(row)
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import wandb

        folder = run_dir / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / WANDB_ID_FILE  # a resumed run (or another fit call) continues the same W&B run
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:WANDB_ID_LENGTH]
        id_file.write_text(run_id + "\n")
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get(WANDB_PROJECT_ENV, DEFAULT_WANDB_PROJECT), name=run_dir.name,
                              id=run_id, resume="allow", dir=str(run_dir), mode=mode, config=config)

    def log(self, row: dict[str, Any]) -> None:
        step, values = scalars(row)
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(names: tuple[str, ...], run_dir: Path, config: dict[str, Any], step: int = 0) -> list[Tracker]:
    """The trackers `names` asks for, opened on the run folder at the run's current `step` (rank 0
    calls this); `config`: the run config as its config.json holds it (W&B's run config)."""
    check_trackers(names)
    return [TensorBoardTracker(run_dir, step) if name == "tensorboard" else WandbTracker(run_dir, config)
            for name in names]


__all__ = ["PACKAGES", "TensorBoardTracker", "Tracker", "WandbTracker", "check_trackers", "open_trackers", "scalars"]
