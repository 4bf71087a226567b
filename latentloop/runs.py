"""Run folders as a whole: a model, its tokenizer and config in, a loadable run out.

    model, tokenizer, config, checkpoint = load_run("runs/gpt", device)
    save_run(model, tokenizer, "runs/untrained")    # a loadable run folder from any model
    export_full_weights("runs/big")                 # model.safetensors from an fsdp2 checkpoint's shards

A run folder may come from anyone: `load_run` checks its config against the weights (read once:
checksum, NaN / inf, shapes) before a model of that config is allocated, and the tokenizer against
the config; on the CPU it gives the model the faster products (`inference.accelerate`). Loading is
one pass down the floors: this module -> checkpoint (files, checksums) -> config, then archs for the
model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

from .archs import build_model
from .checkpoint import (
    SHARDED_DIR,
    RunLock,
    add_checksum,
    check_full_weights,
    check_sharded,
    check_tokenizer_fits,
    check_weights_finite,
    find_tokenizer_file,
    fsync_dir,
    load_sharded_state,
    load_weights,
    prompting_as_its_model,
    read_run_config,
    read_weights,
    resolve_checkpoint,
    save_weights_checkpoint,
)
from .checkpoint import check_weights_fit as _check_weights_fit
from .checkpoint import expected_shapes as _expected_shapes
from .config import ModelConfig, RunConfig
from .data import load_tokenizer
from .errors import CheckpointError, ConfigError, OutputError
from .runtime import resolve_device
from .util import first_line, give_default_mode


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the weights a config describes, from a model built on the meta device
    (shapes only: nothing is allocated or initialised, however large the config)."""
    return _expected_shapes(config, build_model)


def check_weights_fit(config: ModelConfig, checkpoint: Path, found: dict[str, tuple[int, ...]] | None = None) -> None:
    """`checkpoint.check_weights_fit` with the registry's models: the checkpoint's weights (`found`:
    their shapes, else read from the safetensors header) have exactly the names and shapes the config
    describes, checked before a model of that config is allocated (`interop.export_hf` runs the same
    check)."""
    _check_weights_fit(config, checkpoint, build_model, found)


def load_run(path: str | Path, device: str | torch.device = "cpu",
             accelerate: bool = True) -> tuple[nn.Module, object, RunConfig, Path]:
    """Model (eval mode), tokenizer, run config and checkpoint folder from a run or checkpoint folder.
    A model on the CPU gets the faster products (`inference.accelerate`, a module swap) unless
    `accelerate=False`: every command that decodes or scores a run reads it through here.

    The config is checked against the weights' header and the tokenizer against the config before
    the model is built; the returned config's `data.cache_dir` is cleared (the default cache is used).
    """
    if not isinstance(device, torch.device):  # "gpu", or cuda on a machine without it: one line, before any reading
        device = resolve_device(str(device))
    checkpoint = resolve_checkpoint(path)
    check_full_weights(checkpoint)
    config = read_run_config(checkpoint)
    config.data.cache_dir = ""  # a folder on the machine that trained the run, not one to write into here
    tokenizer_file = find_tokenizer_file(checkpoint)
    tokenizer = prompting_as_its_model(load_tokenizer(str(tokenizer_file)), checkpoint)  # an old import's too
    check_tokenizer_fits(tokenizer, config.model, tokenizer_file)
    weights = read_weights(checkpoint)  # checked against its checksum and for NaN / inf: the file's size, once
    check_weights_fit(config.model, checkpoint, {name: tuple(t.shape) for name, t in weights.items()})
    model = build_model(config.model)
    load_weights(model, checkpoint, weights)
    model = model.to(device).eval()
    if accelerate and next(model.parameters()).device.type == "cpu":
        from .inference import accelerate as accelerate_products

        accelerate_products(model)
    return model, tokenizer, config, checkpoint


def save_run(model: nn.Module, tokenizer, run_dir: str | Path, config: RunConfig | None = None) -> Path:
    """A run folder that `load_run` (and so `generate`, `eval`, `serve`) reads, from a model as it
    is, e.g. freshly initialised for tests and load tests: config, tokenizer and one checkpoint at
    step 0. It holds no optimizer or loader state, so training cannot resume from it. A folder that
    already holds a run is refused (`OutputError`): writing into it would replace its config and
    leave its checkpoints beside a step 0 they would outrank."""
    run_dir = Path(run_dir)
    config = config or RunConfig(model=model.config)
    if config.model.vocab_size != tokenizer.vocab_size or config.model.bos_id != tokenizer.bos_id:
        raise ConfigError(f"the model's vocab_size/bos_id ({config.model.vocab_size}/{config.model.bos_id}) do not "
                          f"match the tokenizer's ({tokenizer.vocab_size}/{tokenizer.bos_id})")
    if (run_dir / "config.json").exists() or (run_dir / "checkpoints").exists():
        raise OutputError(f"{run_dir} holds a run already: save into a new folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    config.save_json(run_dir / "config.json")
    tokenizer.save(run_dir)
    return save_weights_checkpoint(run_dir, 0, model, {"step": 0})  # weights only: resuming says so


def export_full_weights(path: str | Path, force: bool = False) -> Path:
    """Write `model.safetensors` into a checkpoint that holds sharded weights only (`dcp/`, an fsdp2
    run's), in this one process: the model is built on the CPU and the shards are read into it
    (torch.distributed.checkpoint, without a process group). Needs one full fp32 copy of the
    weights in CPU memory; no GPU. The file is written atomically. The shards are checked against
    their checksums and DCP's pickles read through allow-lists first (`checkpoint.check_sharded`):
    a corrupt or planted file is one `CheckpointError` line, and nothing of it runs.

    The run's lock (`RunLock`, RUN/.lock) is held from the choice of the checkpoint to the last write:
    a training resumed meanwhile would save into the run and rotate out (`keep_last`) the checkpoint
    being read and written. A run that trains now is refused in one line, with nothing written."""
    run_dir = _run_folder_of(Path(path))
    lock = RunLock(run_dir).acquire() if run_dir is not None else None
    try:
        return _export_full_weights(path, force)
    finally:
        if lock is not None:
            lock.release()


def _run_folder_of(path: Path) -> Path | None:
    """The run folder whose lock guards `path` (a run folder, or a checkpoint in its checkpoints/), or
    None for a checkpoint folder that stands alone (no training writes there)."""
    if (path / "checkpoints").is_dir():
        return path
    if path.parent.name == "checkpoints" and path.parent.parent.is_dir():
        return path.parent.parent
    return None


def _export_full_weights(path: str | Path, force: bool) -> Path:
    """`export_full_weights` with the run's lock held."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    checkpoint = resolve_checkpoint(path)
    target, sharded = checkpoint / "model.safetensors", checkpoint / SHARDED_DIR
    if not sharded.is_dir():
        raise CheckpointError(f"{checkpoint} holds no sharded weights ({SHARDED_DIR}/): it needs no export")
    if target.exists() and not force:
        raise OutputError(f"{target} exists already (pass --force to write it again)")
    config = read_run_config(checkpoint)
    metadata, note = check_sharded(sharded)
    if note is not None:
        print(f"latentloop: warning: {note}", file=sys.stderr)
    model = build_model(config.model)
    weights = model.state_dict()
    load_sharded_state({"model": weights}, sharded, metadata, no_dist=True)  # one line on missing / foreign shards
    weights = {name: t.detach().contiguous() for name, t in weights.items()}
    step = int(checkpoint.name.rsplit("_", 1)[-1]) if checkpoint.name.rsplit("_", 1)[-1].isdigit() else 0
    check_weights_finite(weights, step)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        save_file(weights, str(tmp), metadata={"step": str(step)})
        give_default_mode(tmp)  # safetensors writes 0600, whatever the umask
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_dir(checkpoint)
        add_checksum(checkpoint, target.name)
    except (OSError, SafetensorError) as exc:  # safetensors reports its own I/O failures as SafetensorError
        tmp.unlink(missing_ok=True)
        if not checkpoint.is_dir():  # removed by another process (the lock keeps trainings out, not `rm`)
            raise CheckpointError(f"{checkpoint} was removed while it was being exported (nothing was written): "
                                  f"export again") from None
        raise OutputError(f"cannot write {target}: {getattr(exc, 'strerror', None) or first_line(exc)}") from None
    return target
