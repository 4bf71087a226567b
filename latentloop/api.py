"""The public Python API: `build`, `load`, `generate` (the same objects the CLI uses)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .archs import build_model
from .config import model_config
from .engine import generate, quantize_int8, stream, teacher_forced_logits
from .runs import load_run


def build(arch: str = "gpt", preset: str | None = None, **overrides) -> nn.Module:
    """A freshly initialised model; any config field can be overridden by keyword."""
    return build_model(model_config(arch, preset, **overrides))


def load(path: str | Path, device: str | torch.device = "cpu", accelerate: bool = True) -> tuple[nn.Module, object]:
    """(model, tokenizer) from a run folder (its latest checkpoint) or a checkpoint folder. On the CPU
    the model gets latentloop's faster products (`latentloop.inference.accelerate`) unless
    `accelerate=False`."""
    model, tokenizer, _, _ = load_run(path, device, accelerate=accelerate)
    return model, tokenizer


__all__ = ["build", "generate", "load", "load_run", "quantize_int8", "stream", "teacher_forced_logits"]
