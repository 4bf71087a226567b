"""Experiment tracking (`train --log tensorboard,wandb`): the rows metrics.jsonl gets, read back from
TensorBoard's event files and from what W&B was handed; W&B offline with no network or key; a missing
package is one line before anything is written."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from latentloop.cli import main
from latentloop.train import trackers

STEPS = 4


def _train(corpus: Path, out: Path, *extra: str) -> int:
    return main(["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus}", "--steps", str(STEPS),
                 "--batch-size", "2", "--set", "sequence_len=32", "--set", "log_every=1", "--set", "eval_every=2",
                 "--set", "eval_batches=1", "--out", str(out), "--no-progress", *extra])


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_scalars_are_grouped_and_finite_numbers_only():
    step, values = trackers.scalars({"step": 3, "loss": 2.5, "val_bpb": 1.25, "passes": 2, "flag": True,
                                     "bad": float("nan"), "note": "text"})
    assert step == 3 and values == {"train/loss": 2.5, "val/bpb": 1.25, "train/passes": 2.0}


def test_tensorboard_gets_every_logged_row(tiny_corpus, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert _train(tiny_corpus, run, "--log", "tensorboard") == 0
    events = EventAccumulator(str(run / trackers.TENSORBOARD_DIR))
    events.Reload()
    rows = _rows(run)
    for key, name in (("loss", "train/loss"), ("val_loss", "val/loss"), ("val_bpb", "val/bpb"), ("lr", "train/lr")):
        logged = [(row["step"], row[key]) for row in rows if key in row]
        shown = [(event.step, event.value) for event in events.Scalars(name)]
        assert [s for s, _ in shown] == [s for s, _ in logged] and logged, name
        assert [v for _, v in shown] == pytest.approx([v for _, v in logged], rel=1e-6), name  # stored as float32


def test_a_run_resumed_behind_its_last_logged_step_shows_each_step_once_in_tensorboard(tiny_corpus, tmp_path):
    """A crash after step 4 was logged but before its checkpoint: the resumed run (from step 2)
    logs 3 and 4 again. TensorBoard showed both copies (a line doubling back); the earlier file's
    steps past the checkpoint are now hidden, so it shows what metrics.jsonl keeps."""
    pytest.importorskip("tensorboard")
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert _train(tiny_corpus, run, "--log", "tensorboard", "--set", "save_every=2") == 0
    newest = sorted((run / "checkpoints").iterdir())[-1]
    shutil.rmtree(newest)  # the crash: step 4's rows are in the logs, its checkpoint never written
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--log", "tensorboard"]) == 0
    events = EventAccumulator(str(run / trackers.TENSORBOARD_DIR))
    events.Reload()
    shown = [event.step for event in events.Scalars("train/loss")]
    assert shown == [row["step"] for row in _rows(run) if "loss" in row] == list(range(1, STEPS + 1))


class _FakeRun:
    def __init__(self, calls: dict):
        self.calls = calls

    def log(self, values, step):
        self.calls["log"].append((step, values))

    def finish(self):
        self.calls["finished"] = True


def test_wandb_is_handed_the_run_config_and_every_row_offline_by_default(tiny_corpus, tmp_path, monkeypatch):
    """What the tracker gives W&B, recorded by a stand-in module: the run config, an offline mode
    without a key, the same rows as metrics.jsonl; a resumed run continues the same W&B run id."""
    calls: dict = {"init": [], "log": []}

    def init(**kwargs):
        calls["init"].append(kwargs)
        return _FakeRun(calls)

    fake = types.SimpleNamespace(init=init)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(trackers, "check_trackers", lambda names: None)  # the stand-in has no package spec
    monkeypatch.setattr("latentloop.train.start.check_trackers", lambda names: None)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "run"
    assert _train(tiny_corpus, run, "--log", "wandb") == 0
    (kwargs,) = calls["init"]
    run_id = (run / trackers.WANDB_DIR / trackers.WANDB_ID_FILE).read_text().strip()
    assert kwargs["mode"] == "offline" and kwargs["id"] == run_id and kwargs["dir"] == str(run) and len(run_id) == 8
    assert json.loads(json.dumps(kwargs["config"])) == json.loads((run / "config.json").read_text())
    expected = [trackers.scalars(row) for row in _rows(run)]
    assert calls["log"] == expected and calls["finished"]
    # resumed for more steps: the same W&B run, the new rows only
    calls["log"].clear()
    assert main(["train", "--out", str(run), "--resume", "--steps", str(STEPS + 2), "--no-progress",
                 "--log", "wandb"]) == 0
    assert calls["init"][1]["id"] == run_id and calls["init"][1]["resume"] == "allow"
    assert [step for step, _ in calls["log"]] == [row["step"] for row in _rows(run) if row["step"] > STEPS]


def test_wandb_offline_run_needs_no_network(tiny_corpus, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert _train(tiny_corpus, run, "--log", "wandb") == 0
    run_id = (run / trackers.WANDB_DIR / trackers.WANDB_ID_FILE).read_text().strip()
    (folder,) = (run / trackers.WANDB_DIR).glob(f"offline-run-*-{run_id}")  # wandb makes RUN/wandb/offline-run-*
    assert (folder / f"run-{run_id}.wandb").stat().st_size > 0


def test_a_missing_tracker_package_is_one_line_before_anything_is_written(tiny_corpus, tmp_path, monkeypatch,
                                                                            capsys):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    run = tmp_path / "run"
    assert _train(tiny_corpus, run, "--log", "tensorboard") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["latentloop: error: --log tensorboard needs the tensorboard package: pip install "
                   "'latentloop[tensorboard]'"]
    assert not run.exists()
    with pytest.raises(SystemExit) as usage:  # argparse's own exit, one line (cli._Parser)
        _train(tiny_corpus, run, "--log", "mlflow")
    assert usage.value.code == 2 and "expected some of tensorboard, wandb" in capsys.readouterr().err
