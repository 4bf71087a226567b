"""Run folders and checkpoints.

    RUN/config.json            the run's full config (model, train, data)
    RUN/tokenizer.json         the tokenizer the run was trained with
    RUN/metrics.jsonl          one JSON object per logged step / evaluation
    RUN/checkpoints/step_00000100/
        model.safetensors      weights
        config.json, tokenizer.json   copies, so a checkpoint folder loads on its own
        trainer.pt             optimizer states and RNG states (not in imported checkpoints)
        state.json             step, tokens seen, loader state

A checkpoint is written into a hidden temporary folder and renamed into place, so an interrupted
save never leaves a half-written checkpoint; only the last `keep_last` are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import RunConfig
from .errors import CheckpointError, ConfigError

CHECKPOINT_PREFIX = "step_"


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON through a temporary file in the same folder, then rename: never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX))


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any] | None,
                    state: dict[str, Any], keep_last: int) -> Path:
    """Weights, config/tokenizer copies, trainer state (optimizers, RNG; None: none) and
    state.json into checkpoints/step_N, atomically; the oldest beyond `keep_last` are removed."""
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = folder / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"step": str(step)})
    if trainer_state is not None:
        torch.save(trainer_state, tmp / "trainer.pt")
    for name in ("config.json", "tokenizer.json"):
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, tmp / name)
    (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    if final.exists():  # re-saving the same step (e.g. resume with no new steps): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_weights_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, state: dict[str, Any]) -> Path:
    """A checkpoint without optimizer or RNG state (an imported model): it loads, evaluates and
    seeds `train --init-from`, but cannot be resumed."""
    return save_checkpoint(run_dir, step, model, None, state, keep_last=1)


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder (its latest checkpoint) or a checkpoint folder -> the checkpoint folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no run or checkpoint at {path}")
    if (path / "model.safetensors").is_file():
        return path
    checkpoints = list_checkpoints(path)
    if not checkpoints:
        raise CheckpointError(f"{path} holds no checkpoint (expected {path}/checkpoints/{CHECKPOINT_PREFIX}*/)")
    return checkpoints[-1]


def find_tokenizer_file(checkpoint: Path) -> Path:
    """The tokenizer.json of a checkpoint: its own copy, else its run folder's."""
    for candidate in (checkpoint / "tokenizer.json", checkpoint.parent.parent / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"no tokenizer.json found for checkpoint {checkpoint}")


def read_run_config(checkpoint: Path) -> RunConfig:
    for candidate in (checkpoint / "config.json", checkpoint.parent.parent / "config.json"):
        if candidate.is_file():
            try:
                return RunConfig.from_dict(json.loads(candidate.read_text()))
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"corrupt config {candidate}: {exc}") from None
            except ConfigError as exc:
                raise CheckpointError(f"config {candidate} is invalid: {exc}") from None
    raise CheckpointError(f"no config.json found for checkpoint {checkpoint}")


def read_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    file = checkpoint / "model.safetensors"
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot read weights {file}: {str(exc).splitlines()[0]}") from None


def load_weights(model: torch.nn.Module, checkpoint: Path) -> None:
    file = checkpoint / "model.safetensors"
    weights = read_weights(checkpoint)
    missing, unexpected = set(model.state_dict()) - set(weights), set(weights) - set(model.state_dict())
    if missing or unexpected:
        raise CheckpointError(f"weights {file} do not fit the model: missing {sorted(missing)[:3]}, "
                              f"unexpected {sorted(unexpected)[:3]}")
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"weights {file} do not fit the model: {str(exc).splitlines()[-1].strip()}") from None


def load_matching_weights(model: torch.nn.Module, checkpoint: Path) -> list[str]:
    """Start from another run's weights (e.g. an `fbt` from a tied `gpt`): every tensor of the
    checkpoint must fit; parameters the checkpoint lacks keep their fresh init. Returns their names."""
    weights = read_weights(checkpoint)
    own = model.state_dict()
    for name, tensor in weights.items():
        if name not in own or own[name].shape != tensor.shape:
            raise CheckpointError(f"--init-from {checkpoint}: tensor {name} {tuple(tensor.shape)} does not fit "
                                  f"this model")
    model.load_state_dict(weights, strict=False)
    return sorted(set(own) - set(weights))


def check_resumable(checkpoint: Path) -> None:
    """A weights-only checkpoint (an imported model) has no optimizer state to resume."""
    if (checkpoint / "model.safetensors").is_file() and not (checkpoint / "trainer.pt").is_file():
        raise CheckpointError(f"cannot resume from {checkpoint}: it holds weights only (an imported model); "
                              f"start a new run from it with --init-from")


def read_trainer_state(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    check_resumable(checkpoint)
    try:
        state = json.loads((checkpoint / "state.json").read_text())
        trainer = torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=False)
    except (OSError, json.JSONDecodeError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"cannot resume from {checkpoint}: {str(exc).splitlines()[0]}") from None
    return state, trainer
