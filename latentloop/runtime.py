"""What every front-end needs around a model, without training or the CLI: the device, the
default folders, data preparation and loading a run.

    device = resolve_device("auto")
    model, tokenizer, config, checkpoint = load_run("runs/gpt", device)
    save_run(model, tokenizer, "runs/untrained")    # a loadable run folder from any model
    data = prepare_data(config, tokenizer)          # memory-mapped train / val tokens
    data = eval_data(config, tokenizer, "text:x/")  # the same for a loaded run, whose config is not trusted

A run folder may come from anyone: `load_run` checks its config against the weights' header before
allocating anything, and the tokenizer against the config; a loaded run's `cache_dir` is ignored
and its data source used only when it is built in (see `eval_data`).

`eval/`, `analysis` and the server import this module, never `train` or `api`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from .archs import build_model
from .checkpoint import (
    find_tokenizer_file,
    load_weights,
    read_run_config,
    resolve_checkpoint,
    save_checkpoint,
    weight_shapes,
)
from .config import ModelConfig, RunConfig
from .data import TokenData, load_tokenizer, parse_source, prepare_tokens
from .errors import CheckpointError, ConfigError, OutputError

CACHE_ENV = "LATENTLOOP_CACHE"  # root of every cache folder (tokens, eval bundle)
EVAL_DIR_ENV = "LATENTLOOP_EVAL_DIR"  # folder of the evaluation task files
EVAL_BUNDLE_DIR = "eval_bundle"  # below the cache root: the fetched official CORE bundle
# Data sources that name no file: a run's config may pick these for evaluation by itself.
BUILTIN_SOURCES = ("stdlib", "task:")


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


def eval_data(config: RunConfig, tokenizer, data: str | None = None, progress: bool = False):
    """The tokens to evaluate a loaded run on: `data` when given, else the run's own source if it
    is built in (stdlib, task:NAME, chat:task:NAME). A run's config.json does not get to choose
    which files are read: a file or dataset source must be named by the user. The default cache
    folder is used. Conversations (`chat:`) come back as `ChatData` (rows with a loss mask)."""
    if data is None:
        data = config.data.source
        if not data.startswith(BUILTIN_SOURCES + ("chat:task:",)):
            raise ConfigError(f"this run was trained on {data!r}; name the data to evaluate on with --data "
                              f"(a run folder does not choose files to read)")
    if data.startswith("chat:"):
        from .data.chat import prepare_chat

        return prepare_chat(data, tokenizer, config.model.sequence_len, config.data.val_fraction)
    chosen = RunConfig(model=config.model, train=config.train,
                       data=dataclasses.replace(config.data, source=data, cache_dir=""))
    return prepare_data(chosen, tokenizer, progress)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the weights a config describes, from a model built on the meta device
    (shapes only: nothing is allocated, however large the config)."""
    with torch.device("meta"):
        model = build_model(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_weights_fit(config: ModelConfig, checkpoint: Path) -> None:
    """The checkpoint's weights (their safetensors header) have exactly the names and shapes the
    config describes, checked before a model of that config is allocated."""
    found, expected = weight_shapes(checkpoint), expected_shapes(config)
    file = checkpoint / "model.safetensors"
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"weights {file} do not fit the run's config.json: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise CheckpointError(f"weights {file} do not fit the run's config.json: {name} is {list(found[name])} "
                                  f"in the file but {list(shape)} by the config")


def check_tokenizer_fits(tokenizer, config: ModelConfig, tokenizer_file: Path) -> None:
    """A tokenizer with more ids than the model would index out of its embedding; one with fewer (or
    other special ids) would decode the model's ids as the wrong text."""
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"tokenizer {tokenizer_file} has {tokenizer.vocab_size} tokens but the model has "
                              f"vocab_size {config.vocab_size}: it is not the tokenizer this model was trained with")
    if tokenizer.bos_id != config.bos_id:
        raise CheckpointError(f"tokenizer {tokenizer_file} has BOS id {tokenizer.bos_id} but the model was trained "
                              f"with {config.bos_id}: it is not the tokenizer this model was trained with")


def load_run(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, object, RunConfig, Path]:
    """Model (eval mode), tokenizer, run config and checkpoint folder from a run or checkpoint folder.

    The config is checked against the weights' header and the tokenizer against the config before
    the model is built; the returned config's `data.cache_dir` is cleared (the default cache is used).
    """
    checkpoint = resolve_checkpoint(path)
    config = read_run_config(checkpoint)
    config.data.cache_dir = ""  # a folder on the machine that trained the run, not one to write into here
    tokenizer_file = find_tokenizer_file(checkpoint)
    tokenizer = load_tokenizer(str(tokenizer_file))
    check_tokenizer_fits(tokenizer, config.model, tokenizer_file)
    check_weights_fit(config.model, checkpoint)
    model = build_model(config.model)
    load_weights(model, checkpoint)
    return model.to(device).eval(), tokenizer, config, checkpoint


def output_folder(path: str | Path, what: str = "output folder") -> Path:
    """Create `path` (and its parents) and make sure a file can be written in it; any failure (a file
    in the way, no permission, a read-only disk) is one `OutputError` line, before work starts."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        if path.exists() and not path.is_dir():
            raise OutputError(f"{what} {path} is a file") from None
        raise OutputError(f"cannot write into {what} {path}: {exc.strerror or exc}") from None
    return path


def save_run(model: nn.Module, tokenizer, run_dir: str | Path, config: RunConfig | None = None) -> Path:
    """A run folder that `load_run` (and so `generate`, `eval`, `serve`) reads, from a model as it
    is, e.g. freshly initialised for tests and load tests: config, tokenizer and one checkpoint at
    step 0. It holds no optimizer or loader state, so training cannot resume from it."""
    run_dir = Path(run_dir)
    config = config or RunConfig(model=model.config)
    if config.model.vocab_size != tokenizer.vocab_size or config.model.bos_id != tokenizer.bos_id:
        raise ConfigError(f"the model's vocab_size/bos_id ({config.model.vocab_size}/{config.model.bos_id}) do not "
                          f"match the tokenizer's ({tokenizer.vocab_size}/{tokenizer.bos_id})")
    run_dir.mkdir(parents=True, exist_ok=True)
    config.save_json(run_dir / "config.json")
    tokenizer.save(run_dir)
    return save_checkpoint(run_dir, 0, model, trainer_state={}, state={"step": 0}, keep_last=1)
