"""The public Python API: `build`, `load`, `generate` (the same objects the CLI uses)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint import load_weights, read_run_config, resolve_checkpoint
from .config import RunConfig, model_config
from .data import load_tokenizer
from .engine import generate
from .errors import CheckpointError
from .models import build_model


def build(arch: str = "gpt", preset: str | None = None, **overrides) -> nn.Module:
    """A freshly initialised model; any config field can be overridden by keyword."""
    return build_model(model_config(arch, preset, **overrides))


def load_run(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, object, RunConfig, Path]:
    """Model (eval mode), tokenizer, run config and checkpoint folder from a run or checkpoint folder."""
    checkpoint = resolve_checkpoint(path)
    config = read_run_config(checkpoint)
    tokenizer_file = next((p for p in (checkpoint / "tokenizer.json", checkpoint.parent.parent / "tokenizer.json")
                           if p.is_file()), None)
    if tokenizer_file is None:
        raise CheckpointError(f"no tokenizer.json found for checkpoint {checkpoint}")
    tokenizer = load_tokenizer(str(tokenizer_file))
    model = build_model(config.model)
    load_weights(model, checkpoint)
    return model.to(device).eval(), tokenizer, config, checkpoint


def load(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, object]:
    """(model, tokenizer) from a run folder (its latest checkpoint) or a checkpoint folder."""
    model, tokenizer, _, _ = load_run(path, device)
    return model, tokenizer


__all__ = ["build", "generate", "load", "load_run"]
