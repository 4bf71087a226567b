"""What every front-end needs around a model, without training or the CLI: the device, the
default folders, data preparation and loading a run.

    device = resolve_device("auto")
    model, tokenizer, config, checkpoint = load_run("runs/gpt", device)
    data = prepare_data(config, tokenizer)          # memory-mapped train / val tokens

`eval/`, `analysis` and the server import this module, never `train` or `api`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from .archs import build_model
from .checkpoint import find_tokenizer_file, load_weights, read_run_config, resolve_checkpoint
from .config import RunConfig
from .data import TokenData, load_tokenizer, parse_source, prepare_tokens
from .errors import ConfigError

CACHE_ENV = "LATENTLOOP_CACHE"  # root of every cache folder (tokens, eval bundle)
EVAL_DIR_ENV = "LATENTLOOP_EVAL_DIR"  # folder of the evaluation task files
EVAL_BUNDLE_DIR = "eval_bundle"  # below the cache root: the fetched official CORE bundle


def default_cache_dir() -> Path:
    """$LATENTLOOP_CACHE, else ~/.cache/latentloop."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "latentloop")


def default_eval_dir() -> Path:
    """Where the official evaluation bundle is fetched to (and looked for)."""
    return default_cache_dir() / EVAL_BUNDLE_DIR


def resolve_device(name: str) -> torch.device:
    """"auto" (cuda when available, else cpu), "cpu", "cuda[:N]" or "mps", checked to exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda[:N] or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps' requested but MPS is not available")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"unsupported device {name!r}: use auto, cpu, cuda[:N] or mps")
    return device


def autocast_for(device: torch.device, dtype: str):
    """bf16 autocast on CUDA (dtype "auto") or when asked; a no-op otherwise."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def prepare_data(config: RunConfig, tokenizer, progress: bool = True) -> TokenData:
    """The run's data source tokenized once into memory-mapped train / val shards."""
    data = config.data
    source = parse_source(data.source, val_fraction=data.val_fraction)
    cache_dir = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    return prepare_tokens(source, tokenizer, cache_dir, max_bytes=data.max_bytes or None, progress=progress)


def load_run(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, object, RunConfig, Path]:
    """Model (eval mode), tokenizer, run config and checkpoint folder from a run or checkpoint folder."""
    checkpoint = resolve_checkpoint(path)
    config = read_run_config(checkpoint)
    tokenizer = load_tokenizer(str(find_tokenizer_file(checkpoint)))
    model = build_model(config.model)
    load_weights(model, checkpoint)
    return model.to(device).eval(), tokenizer, config, checkpoint
