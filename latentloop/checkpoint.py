"""Run folders and checkpoints.

    RUN/config.json            the run's full config (model, train, data)
    RUN/tokenizer.json         the tokenizer the run was trained with
    RUN/metrics.jsonl          one strict-JSON object per logged step / evaluation
    RUN/.lock                  locked (flock) by the one process training into RUN
    RUN/checkpoints/step_00000100/
        model.safetensors      weights
        config.json, tokenizer.json   copies, so a checkpoint folder loads on its own
        trainer.safetensors    every tensor of the optimizer states (not in imported checkpoints)
        trainer.json           everything else of the optimizer states, and the RNG states (every rank's)
        state.json             step, tokens seen, loader state, checksums of the token data, world size
        checksums.json         the sha256 of every other file of the folder (not of dcp/, which has its own),
                               written before the folder is renamed into place and checked as each file is read
        dcp/                   an fsdp2 run's shards of weights and optimizer states, written by every
                               process (torch.distributed.checkpoint); model.safetensors is then the
                               copy gathered on rank 0 (train.full_weights) or `latentloop export-dcp`'s
            checksums.json     the sha256 of every other file of dcp/, checked before DCP reads any

No file of a checkpoint is unpickled freely: loading one never runs code, whoever wrote it. A
checkpoint of an older version (`trainer.pt`) is read with `torch.load(weights_only=True)` or
refused. DCP's own files are pickles (`dcp/.metadata`, and its non-tensor entries); they are read
only through `load_sharded_state`, which admits nothing but DCP's metadata classes and plain data
(see "Sharded checkpoints" below).

Every file of a checkpoint is checked against `checksums.json` when it is read (`verify_file`): a
flipped bit, a copy cut short or a hand edit is one `CheckpointError` naming the file, never a
silently different model or a silently different resume. A checkpoint saved before checksums loads
with one warning. The checksums catch damage, not an attacker who rewrites them too; weights that
hold NaN or inf are refused on load whatever the checksums say.

A checkpoint is written into `.tmp-step_N/`, every file and the folder fsynced, and renamed into
place, so an interrupted save never leaves a half-written checkpoint. Re-saving a step first renames
the old folder to `.old-step_N/`, deleted only once the new one is in place; `recover_checkpoints`
puts such a copy back after a crash. Rotation (only the last `keep_last` are kept, and never the one
just written is removed) renames a folder to `.del-step_N/` before deleting it, so a half-deleted
folder never looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import ModelConfig, RunConfig
from .errors import CheckpointError, CheckpointUnreadable, ConfigError, LatentloopError, NonFiniteError, OutputError
from .util import first_line, fsync_dir, fsync_file, give_default_mode, json_safe, read_json_object, write_json_atomic  # noqa: F401 (re-exported)

CHECKPOINT_PREFIX = "step_"
TMP_PREFIX = ".tmp-"  # a checkpoint being written
ASIDE_PREFIX = ".old-"  # the previous copy of a step being re-saved
DELETE_PREFIX = ".del-"  # a rotated-out checkpoint being deleted
BROKEN_PREFIX = ".bad-"  # a checkpoint that could not be loaded when resuming, kept for inspection
LOCK_FILE = ".lock"
# A checkpoint of an fsdp2 run keeps the model and optimizer shards of every process in this folder
# (torch.distributed.checkpoint); model.safetensors beside it is the gathered copy, when written.
SHARDED_DIR = "dcp"

TRAINER_TENSORS = "trainer.safetensors"
TRAINER_JSON = "trainer.json"
LEGACY_TRAINER = "trainer.pt"
# Bump when the layout of trainer.json changes.
TRAINER_FORMAT = 1

# Markers of the JSON encoding of nested state (see `flatten_state`); a dict key may not start with
# "__", so these can never be confused with real keys.
_TENSOR, _TUPLE, _ITEMS, _FLOAT = "__tensor__", "__tuple__", "__items__", "__float__"


# --------------------------------------------------------------------------------------------
# Durable files
# --------------------------------------------------------------------------------------------


def _write_json_file(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")


# --------------------------------------------------------------------------------------------
# Nested state (optimizer state dicts, RNG states) as safetensors + JSON
# --------------------------------------------------------------------------------------------


def flatten_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split nested state into a JSON-able structure and a flat {key: tensor} dict.

    Each tensor is replaced by {"__tensor__": key}, its key being its path in the structure
    (`optimizers.0.state.3.exp_avg`), so the keys are stable and readable. Tuples, dicts with
    non-string keys (an optimizer's per-parameter state is keyed by int) and non-finite floats get
    markers of their own, so that `unflatten_state` rebuilds exactly the same types and values.
    """
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            if key in tensors:
                raise ValueError(f"two tensors of the state have the key {key!r}")
            # a copy of its own: safetensors refuses tensors that share memory
            tensors[key] = value.detach().to("cpu", copy=True).contiguous()
            return {_TENSOR: key}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {_FLOAT: repr(value)}
        if isinstance(value, tuple):
            return {_TUPLE: [encode(v, f"{key}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{key}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: encode(v, f"{key}.{k}") for k, v in value.items()}
            return {_ITEMS: [[encode(k, f"{key}.key{i}"), encode(v, f"{key}.{k}")]
                             for i, (k, v) in enumerate(value.items())]}
        raise TypeError(f"cannot store a {type(value).__name__} (at {key}) in a checkpoint")

    return encode(state, "state"), tensors


def unflatten_state(encoded: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `flatten_state`; a reference to a missing tensor raises KeyError."""
    if isinstance(encoded, list):
        return [unflatten_state(v, tensors) for v in encoded]
    if not isinstance(encoded, dict):
        return encoded
    if _TENSOR in encoded:
        return tensors[encoded[_TENSOR]]
    if _FLOAT in encoded:
        return float(encoded[_FLOAT])
    if _TUPLE in encoded:
        return tuple(unflatten_state(v, tensors) for v in encoded[_TUPLE])
    if _ITEMS in encoded:
        return {unflatten_state(k, tensors): unflatten_state(v, tensors) for k, v in encoded[_ITEMS]}
    return {k: unflatten_state(v, tensors) for k, v in encoded.items()}


# --------------------------------------------------------------------------------------------
# Listing, saving, recovering
# --------------------------------------------------------------------------------------------


def _step_of(name: str, prefix: str) -> int | None:
    digits = name[len(prefix):]
    return int(digits) if name.startswith(prefix) and digits.isdigit() else None


def step_in_name(checkpoint: Path) -> int | None:
    """The step a checkpoint folder's name carries (`step_00000020` -> 20), None for another name."""
    return _step_of(Path(checkpoint).name, CHECKPOINT_PREFIX)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The finished checkpoint folders of a run, oldest first: by step, not by name (the names pad
    steps to 8 digits, so step_100000000 sorted before step_99999900 and rotation kept the oldest)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    steps = {p: _step_of(p.name, CHECKPOINT_PREFIX) for p in folder.iterdir() if p.is_dir()}
    return sorted((p for p, step in steps.items() if step is not None), key=lambda p: (steps[p], p.name))


def checkpoint_candidates(run_dir: Path) -> list[Path]:
    """Checkpoints to load, oldest first: the finished folders, plus the copy set aside by a re-save
    that was interrupted before the new folder was in place (until `recover_checkpoints` renames it
    back)."""
    found = {_step_of(p.name, CHECKPOINT_PREFIX): p for p in list_checkpoints(run_dir)}
    folder = Path(run_dir) / "checkpoints"
    if folder.is_dir():
        for p in folder.iterdir():
            step = _step_of(p.name, ASIDE_PREFIX + CHECKPOINT_PREFIX)
            if step is not None and p.is_dir() and step not in found:
                found[step] = p
    return [found[step] for step in sorted(found)]


def _remove(path: Path) -> None:
    """Rename out of the listing first, then delete: an interrupted delete leaves a `.del-` folder."""
    doomed = path.with_name(DELETE_PREFIX + path.name)
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def recover_checkpoints(run_dir: Path) -> list[str]:
    """Undo what an interrupted save left behind (call with the run's lock held); returns notes.

    An `.old-step_N` copy whose `step_N` is missing is renamed back (the re-save was cut before
    the new folder was in place); one whose `step_N` exists is stale. `.tmp-` and `.del-`
    folders are leftovers of an unfinished write or delete.
    """
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    notes = []
    for path in sorted(folder.iterdir()):
        aside_step = _step_of(path.name, ASIDE_PREFIX + CHECKPOINT_PREFIX)
        if aside_step is not None:
            final = folder / path.name[len(ASIDE_PREFIX):]
            if final.exists():
                _remove(path)
            else:
                os.replace(path, final)
                fsync_dir(folder)
                notes.append(f"recovered checkpoint {final.name} from the copy an interrupted save set aside")
        elif path.name.startswith((TMP_PREFIX, DELETE_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)
    return notes


def set_aside_broken(checkpoint: Path) -> Path:
    """Rename a checkpoint that cannot be loaded to `.bad-step_N`: kept for inspection, but no longer
    taken for the latest."""
    target = checkpoint.with_name(BROKEN_PREFIX + checkpoint.name.removeprefix(ASIDE_PREFIX))
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    os.replace(checkpoint, target)
    return target


def _first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def checkpoint_folder(run_dir: Path, step: int) -> Path:
    """The final folder of step `step`'s checkpoint (it may not exist yet)."""
    return Path(run_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_tmp_folder(run_dir: Path, step: int) -> Path:
    """Where step `step`'s checkpoint is written before it is renamed into place."""
    final = checkpoint_folder(run_dir, step)
    return final.with_name(TMP_PREFIX + final.name)


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """A fresh, empty `.tmp-step_N/` folder to write a checkpoint into (see `commit_checkpoint`)."""
    final, tmp = checkpoint_folder(run_dir, step), checkpoint_tmp_folder(run_dir, step)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as exc:
        raise OutputError(f"cannot write checkpoint {final}: {exc.strerror or exc}") from None
    return tmp


def check_weights_finite(weights: dict[str, torch.Tensor], step: int) -> None:
    """Weights holding NaN or inf are refused with `NonFiniteError` before anything is written, so
    a good checkpoint is never replaced or rotated out by a diverged one."""
    bad = _first_non_finite(weights)
    if bad is not None:
        raise NonFiniteError(f"not saving step {step}: weight {bad} holds NaN or inf (training diverged); "
                             f"the last good checkpoint is kept")


def write_checkpoint_files(tmp: Path, run_dir: Path, step: int, weights: dict[str, torch.Tensor] | None,
                           trainer_state: dict[str, Any] | None, state: dict[str, Any]) -> None:
    """Weights (when given: a sharded checkpoint may hold its weights in `dcp/` only), trainer state
    (None: weights only, an imported model), state.json and copies of the run's config and
    tokenizer, into the folder `begin_checkpoint` made."""
    try:
        # safetensors writes 0600 whatever the umask, and copy2 keeps the mode of a run's file written
        # before config.json got the umask's: each as a plain open() would make it, for colleagues
        if weights is not None:
            save_file(weights, str(tmp / "model.safetensors"), metadata={"step": str(step)})
            give_default_mode(tmp / "model.safetensors")
        if trainer_state is not None:
            meta, tensors = flatten_state(trainer_state)
            save_file(tensors, str(tmp / TRAINER_TENSORS))
            give_default_mode(tmp / TRAINER_TENSORS)
            _write_json_file(tmp / TRAINER_JSON, {"format": TRAINER_FORMAT, "state": meta})
        _write_json_file(tmp / "state.json", state)
        for name in ("config.json", "tokenizer.json"):
            if (Path(run_dir) / name).exists():
                shutil.copy2(Path(run_dir) / name, tmp / name)
                give_default_mode(tmp / name)
        write_checksums(tmp)  # last: it covers every file above
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
        shutil.rmtree(tmp, ignore_errors=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
        if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "os error 28" in reason:
            reason += (f" ({_checkpoint_size_text(tmp, weights, trainer_state)}; a run keeps train.keep_last "
                       f"checkpoints and writes the next one before it removes the oldest: free that much, or "
                       f"lower train.keep_last, then --resume)")
        raise OutputError(f"cannot write checkpoint {checkpoint_folder(run_dir, step)}: {reason}") from None


def _checkpoint_size_text(tmp: Path, weights: dict[str, torch.Tensor] | None,
                          trainer_state: dict[str, Any] | None) -> str:
    """About what a checkpoint takes on disk: the last complete one beside `tmp`, else the tensors
    being written ("a checkpoint takes about 1,234 MiB")."""
    done = sorted(p for p in tmp.parent.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())
    if done:
        size = sum(f.stat().st_size for f in done[-1].rglob("*") if f.is_file())
    else:
        tensors = [*(weights or {}).values(), *(flatten_state(trainer_state)[1].values() if trainer_state else ())]
        size = sum(t.numel() * t.element_size() for t in tensors)
    return f"a checkpoint takes about {max(1, round(size / 2**20)):,} MiB"


def commit_checkpoint(run_dir: Path, step: int, keep_last: int) -> Path:
    """fsync everything under `.tmp-step_N/` and rename it into place (the module docstring says
    how a re-saved step is kept safe), then rotate out all but the last `keep_last`."""
    final = checkpoint_folder(run_dir, step)
    folder = final.parent
    tmp, aside = final.with_name(TMP_PREFIX + final.name), final.with_name(ASIDE_PREFIX + final.name)
    moved_aside = False
    try:
        for path in sorted(tmp.rglob("*"), key=lambda p: -len(p.parts)):  # files and subfolders, deepest first
            fsync_file(path) if path.is_file() else fsync_dir(path)
        fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. resuming a finished run): keep the old copy until replaced
            if aside.exists():  # stale: left by an earlier re-save whose new folder did get into place
                shutil.rmtree(aside)
            os.replace(final, aside)
            moved_aside = True
            fsync_dir(folder)
        os.replace(tmp, final)
        fsync_dir(folder)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if moved_aside and aside.exists() and not final.exists():
            os.replace(aside, final)
        raise OutputError(f"cannot write checkpoint {final}: {exc.strerror or exc}") from None
    try:
        if moved_aside:
            shutil.rmtree(aside, ignore_errors=True)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            # the rotation goes by step, so a step saved below the run's newest (a run saved over
            # another) sorts as the oldest: the checkpoint just written is never the one removed
            if old != final:
                _remove(old)
    except OSError as exc:
        raise OutputError(f"saved {final}, but cannot remove older checkpoints: {exc.strerror or exc}") from None
    return final


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any] | None,
                    state: dict[str, Any], keep_last: int, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `checkpoints/step_N` durably (see the module docstring); weights holding NaN or inf are
    refused with `NonFiniteError` before anything is written, so a good checkpoint is never
    replaced or rotated out by a diverged one. `weights` (default: the model's state dict) lets a
    wrapped model hand in its plain weights. `trainer_state` None: weights only (an imported
    model), which loads and seeds `--init-from` but cannot be resumed."""
    if weights is None:
        weights = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    check_weights_finite(weights, step)
    tmp = begin_checkpoint(run_dir, step)
    write_checkpoint_files(tmp, run_dir, step, weights, trainer_state, state)
    return commit_checkpoint(run_dir, step, keep_last)


def save_weights_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, state: dict[str, Any]) -> Path:
    """A checkpoint without optimizer or RNG state (an imported model): it loads, evaluates and
    seeds `train --init-from`, but cannot be resumed."""
    return save_checkpoint(run_dir, step, model, None, state, keep_last=1)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder (its latest checkpoint) or a checkpoint folder -> the checkpoint folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no run or checkpoint at {path}")
    if path.is_dir():
        _refuse_hugging_face_folder(path)
    if (path / "model.safetensors").is_file() or (path / SHARDED_DIR).is_dir():
        return path
    checkpoints = checkpoint_candidates(path) if path.is_dir() else []
    if not checkpoints:
        raise CheckpointError(f"{path} holds no checkpoint (expected {path}/checkpoints/{CHECKPOINT_PREFIX}*/)")
    return checkpoints[-1]


def own_or_run_file(checkpoint: Path, name: str) -> Path | None:
    """The checkpoint's own copy of `name` (checked against its checksums), else its run folder's.
    A checkpoint whose checksums record the name never falls back: its copy deleted, the run folder's
    unchecked one (an edited config) was loaded without a word."""
    own, manifest = checkpoint / name, checkpoint / CHECKSUMS
    if own.is_file() or (manifest.is_file() and name in _recorded_checksums(manifest)):
        verify_file(checkpoint, name)  # "is missing" when recorded and gone
        return own
    run_copy = checkpoint.parent.parent / name
    return run_copy if run_copy.is_file() else None


REMOTE_MODEL_TYPE = "latentloop"  # the model_type of `latentloop export`'s remote-code folders


def _refuse_hugging_face_folder(folder: Path) -> None:
    """A Hugging Face model folder given where a run belongs: one line saying to import it (its
    config.json's every key was named an unknown config section)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # not readable as one: the checkpoint's own checks name what is wrong
    if not isinstance(config, dict) or "model_type" not in config or "model" in config:
        return
    if config["model_type"] == REMOTE_MODEL_TYPE:  # import-hf refuses these: it would be a dead end
        raise CheckpointError(f"{folder} is a latentloop export (Hugging Face remote code), not a run: load it "
                              f"with transformers (trust_remote_code=True), or use the run it was exported from")
    raise CheckpointError(f"{folder} holds a Hugging Face model, not a latentloop run: import it first "
                          f"(latentloop import-hf {folder} --out RUN), then use RUN")


def find_tokenizer_file(checkpoint: Path) -> Path:
    """The tokenizer.json of a checkpoint (`own_or_run_file`)."""
    found = own_or_run_file(checkpoint, "tokenizer.json")
    if found is None:
        raise CheckpointError(f"no tokenizer.json found for checkpoint {checkpoint}")
    return found


def read_run_config(checkpoint: Path) -> RunConfig:
    """The run config of a checkpoint (`own_or_run_file`)."""
    found = own_or_run_file(checkpoint, "config.json")
    if found is None:
        raise CheckpointError(f"no config.json found for checkpoint {checkpoint}")
    try:
        return RunConfig.from_dict(json.loads(found.read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"corrupt config {found}: {exc}") from None
    except ConfigError as exc:
        raise CheckpointError(f"config {found} is invalid: {exc}") from None


def read_failure(exc: BaseException, message: str) -> CheckpointError:
    """The error for a checkpoint file that could not be read: `CheckpointUnreadable` where this
    machine failed (an I/O error other than a missing file, memory), else `CheckpointError` (the file
    is missing or malformed: the checkpoint is broken)."""
    missing = (FileNotFoundError, IsADirectoryError, NotADirectoryError)
    if (isinstance(exc, OSError) and not isinstance(exc, missing)) or isinstance(exc, MemoryError) or (
            isinstance(exc, RuntimeError) and "out of memory" in str(exc)):
        return CheckpointUnreadable(f"{message} (this machine could not read it; nothing was set aside)")
    return CheckpointError(message)


def weight_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the weights, read from the safetensors header without loading any tensor (nor
    checking the file against its checksum: `read_weights` does)."""
    file = checkpoint / "model.safetensors"
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot read weights {file}: {first_line(exc)}") from None


def read_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint; unreadable or non-finite weights are a `CheckpointError`."""
    file = checkpoint / "model.safetensors"
    verify_file(checkpoint, file.name)
    try:
        weights = load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, ValueError, MemoryError) as exc:
        raise read_failure(exc, f"cannot read weights {file}: {first_line(exc)}") from None
    integral = next((name for name, tensor in weights.items() if not tensor.is_floating_point()), None)
    if integral is not None:  # loaded into float parameters as their values, a garbage model ran without a word
        raise CheckpointError(f"weights {file} hold {weights[integral].dtype} tensor {integral}: a model's weights "
                              f"are floating point")
    bad = _first_non_finite(weights)
    if bad is not None:
        raise CheckpointError(f"weights {file} hold NaN or inf (tensor {bad}): the run diverged before this save")
    return weights


def load_weights(model: torch.nn.Module, checkpoint: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """The checkpoint's weights (or `weights`, read from it already) into `model`, every name and shape
    fitting."""
    file = checkpoint / "model.safetensors"
    weights = read_weights(checkpoint) if weights is None else weights
    missing, unexpected = set(model.state_dict()) - set(weights), set(weights) - set(model.state_dict())
    if missing or unexpected:
        raise CheckpointError(f"weights {file} do not fit the model: missing {sorted(missing)[:3]}, "
                              f"unexpected {sorted(unexpected)[:3]}")
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"weights {file} do not fit the model: {str(exc).splitlines()[-1].strip()}") from None


# --------------------------------------------------------------------------------------------
# A run folder's files fitting each other, checked before a model is allocated (`runs.load_run`,
# `interop.export_hf`): here, below both, since the interop package may not import `runs`
# --------------------------------------------------------------------------------------------

# torch.nn.init's random initialisers: on the meta device they run as Python decompositions whose
# first call imports torch._dynamo (1.5-3.5 s of a core before a command that loads a run can go on;
# rope_frequencies avoids the same for its arithmetic), and a shape needs none of them
RANDOM_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_", "xavier_normal_",
                "xavier_uniform_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def random_inits_skipped() -> Iterator[None]:
    """torch.nn.init's random initialisers leave their tensor as it is inside the block (the model
    files call them through `nn.init`, as torch's own layers do)."""
    saved = {name: getattr(torch.nn.init, name) for name in RANDOM_INITS}
    try:
        for name in RANDOM_INITS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, initialiser in saved.items():
            setattr(torch.nn.init, name, initialiser)


def expected_shapes(config: ModelConfig, build: Callable[[ModelConfig], torch.nn.Module]
                    ) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the weights a config describes, from the model `build` (the registry's
    `archs.build_model`: this module sits below the registry, so its callers hand it in) makes on the
    meta device (shapes only: nothing is allocated or initialised, however large the config)."""
    with torch.device("meta"), random_inits_skipped():
        model = build(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_full_weights(checkpoint: Path) -> None:
    """A checkpoint with sharded weights only (an fsdp2 run saved with train.full_weights=false) has
    no model.safetensors to load or export: one line saying how to write it."""
    if not (checkpoint / "model.safetensors").is_file() and (checkpoint / SHARDED_DIR).is_dir():
        raise CheckpointError(f"checkpoint {checkpoint} holds sharded weights only (an fsdp2 run saved with "
                              f"train.full_weights=false): write model.safetensors with `latentloop export-dcp "
                              f"{checkpoint}`")


def check_weights_fit(config: ModelConfig, checkpoint: Path, build: Callable[[ModelConfig], torch.nn.Module],
                      found: dict[str, tuple[int, ...]] | None = None) -> None:
    """The checkpoint's weights (`found`: their shapes, else read from the safetensors header) have
    exactly the names and shapes the config describes (`expected_shapes`, with `build`), checked
    before a model of that config is allocated: an edited config is one line, not an allocation
    failure."""
    found = weight_shapes(checkpoint) if found is None else found
    expected = expected_shapes(config, build)
    file = checkpoint / "model.safetensors"
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"weights {file} do not fit the run's config.json: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise CheckpointError(f"weights {file} do not fit the run's config.json: {name} is {list(found[name])} "
                                  f"in the file but {list(shape)} by the config")


def check_tokenizer_fits(tokenizer: Any, config: ModelConfig, tokenizer_file: Path) -> None:
    """A tokenizer with more ids than the model would index out of its embedding; one with fewer (or
    other special ids) would decode the model's ids as the wrong text."""
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"tokenizer {tokenizer_file} has {tokenizer.vocab_size} tokens but the model has "
                              f"vocab_size {config.vocab_size}: it is not the tokenizer this model was trained with")
    if tokenizer.bos_id != config.bos_id:
        raise CheckpointError(f"tokenizer {tokenizer_file} has BOS id {tokenizer.bos_id} but the model was trained "
                              f"with {config.bos_id}: it is not the tokenizer this model was trained with")


def imported_from(checkpoint: Path) -> str | None:
    """Where `latentloop import-hf` read this checkpoint's model from (its state.json's `imported_from`),
    or None: a checkpoint latentloop trained, or one whose state.json does not read."""
    source = read_json_object(checkpoint / "state.json").get("imported_from")
    return source if isinstance(source, str) else None


def prompting_as_its_model(tokenizer: Any, checkpoint: Path) -> Any:
    """`tokenizer` prompting as the checkpoint's model reads prompts. A tokenizer file written before
    it recorded whether prompts start with BOS (`adds_bos`, kept since 2026-12-06) reads as BOS-first,
    which transformers does not do for Qwen2 or SmolLM2: with an imported checkpoint it prompts as
    `import-hf` reads it now (the file's post-processor). Any other tokenizer is returned as it is."""
    if not getattr(tokenizer, "adds_bos_recorded", True) and imported_from(checkpoint) is not None:
        return tokenizer.prompting_as_imported()
    return tokenizer


# The head: a linear map onto the vocabulary, one row per token id (absent when tied to the embedding).
HEAD = "lm_head.weight"


def token_row_tensors(model: torch.nn.Module) -> set[str]:
    """The names of `model`'s tensors with one row per token id: every embedding of the vocabulary
    (`wte`, lrt's per-layer value embeddings) and the head. Found by module, not by row count: a
    weight whose rows happen to equal the vocabulary size is no token's."""
    vocab = model.config.vocab_size
    names = {f"{name}.weight" for name, module in model.named_modules()
             if isinstance(module, torch.nn.Embedding) and module.num_embeddings == vocab}
    return names | ({HEAD} if HEAD in model.state_dict() else set())


def grow_vocab_rows(weights: dict[str, torch.Tensor], own: dict[str, torch.Tensor], token_tensors: set[str],
                    new_ids: Sequence[int] = ()) -> list[str]:
    """Pad the tensors of `weights` named in `token_tensors` (one row per token id:
    `token_row_tensors`) in place to the rows of `own`. The old rows keep their ids; each new row is
    the mean of the old rows (a new token starts as the average token: its embedding has the typical
    direction and norm, and as a head row it gets an average logit instead of a random one).
    `new_ids`: ids the run adds that fall on rows the checkpoint already has (a vocabulary padded past
    its tokenizer, whose padding rows were never trained): they get that mean too, taken over the
    rows below the first of them. Returns the names grown."""
    grown = []
    for name in sorted(token_tensors):
        old, new = weights.get(name), own.get(name)
        if old is None or new is None or old.ndim != 2 or old.shape[1] != new.shape[1] or old.shape[0] > new.shape[0]:
            continue
        inside = sorted(i for i in new_ids if i < old.shape[0])
        if not inside and old.shape[0] == new.shape[0]:
            continue
        mean = old[: inside[0] if inside else old.shape[0]].mean(dim=0, keepdim=True)
        if inside:
            old = old.clone()
            old[inside] = mean.to(old.dtype)
        weights[name] = torch.cat([old, mean.to(old.dtype).expand(new.shape[0] - old.shape[0], -1)], dim=0)
        grown.append(name)
    return grown


def load_matching_weights(model: torch.nn.Module, checkpoint: Path, grow_vocab: bool = False,
                          new_ids: Sequence[int] = ()) -> list[str]:
    """Start from another run's weights (e.g. an `fbt` from a tied `gpt`): every tensor of the
    checkpoint must fit; parameters the checkpoint lacks keep their fresh init. Returns their names.
    `grow_vocab`: a model with more token ids than the checkpoint (SFT's chat tokens) gets its
    vocabulary tensors grown by `grow_vocab_rows` (`new_ids`: the ids added)."""
    weights = read_weights(checkpoint)
    if grow_vocab:
        grow_vocab_rows(weights, model.state_dict(), token_row_tensors(model), new_ids)
    return load_fitting_tensors(model, weights, f"--init-from {checkpoint}")


def load_fitting_tensors(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> list[str]:
    """Load `weights` into `model`, every tensor of which must fit (name and shape; else one line
    naming `source`); returns the model's parameters they do not cover (left at their init)."""
    own = model.state_dict()
    for name, tensor in weights.items():
        if name not in own or own[name].shape != tensor.shape:
            raise CheckpointError(f"{source}: tensor {name} {tuple(tensor.shape)} does not fit this model")
    model.load_state_dict(weights, strict=False)
    return sorted(set(own) - set(weights))


def check_resumable(checkpoint: Path) -> None:
    """A weights-only checkpoint (an imported model) has no optimizer state to resume. One whose
    checksums name a trainer state that is gone is damaged, not weights-only: `verify_checkpoint`
    says so, and a resume falls back to the checkpoint before it."""
    if (checkpoint / "model.safetensors").is_file() and not (checkpoint / TRAINER_JSON).is_file() \
            and not (checkpoint / LEGACY_TRAINER).is_file() and not _lists_trainer(checkpoint):
        raise CheckpointError(f"cannot resume from {checkpoint}: it holds weights only (an imported or saved model, "
                              f"no optimizer state); start a new run from it with --init-from")


def _lists_trainer(checkpoint: Path) -> bool:
    """Whether the checkpoint's checksums.json names a trainer state (an unreadable one: no)."""
    manifest = checkpoint / CHECKSUMS
    try:
        return manifest.is_file() and bool({TRAINER_JSON, LEGACY_TRAINER} & set(_recorded_checksums(manifest)))
    except CheckpointError:
        return False


def _read_legacy_trainer(checkpoint: Path) -> dict[str, Any]:
    """A `trainer.pt` of an older version, unpickled with weights_only=True (which refuses anything
    but tensors and plain containers, so it cannot run code); those held numpy RNG states, which it
    refuses too, so in practice such a checkpoint cannot be resumed."""
    try:
        return torch.load(checkpoint / LEGACY_TRAINER, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError, ...: whatever it is, nothing ran
        raise CheckpointError(f"cannot resume from {checkpoint}: its {LEGACY_TRAINER} is an older pickle format "
                              f"that cannot be loaded safely ({type(exc).__name__}: it holds more than tensors); "
                              f"start a new run, e.g. with --init-from {checkpoint}") from None


def read_trainer_state(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state.json, trainer state {"optimizers": [...], "rng": {...}}) of a checkpoint."""
    check_resumable(checkpoint)
    verify_checkpoint(checkpoint)  # every file, those a resume does not read too (a run continues from it)
    try:
        meta = json.loads((checkpoint / "state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise read_failure(exc, f"cannot resume from {checkpoint}: state.json: {first_line(exc)}") from None
    if not (checkpoint / TRAINER_JSON).is_file() and (checkpoint / LEGACY_TRAINER).is_file():
        trainer = _read_legacy_trainer(checkpoint)
    else:
        try:
            encoded = json.loads((checkpoint / TRAINER_JSON).read_text())
            tensors = load_file(str(checkpoint / TRAINER_TENSORS))
            if encoded.get("format") != TRAINER_FORMAT:
                raise ValueError(f"unknown {TRAINER_JSON} format {encoded.get('format')!r}")
            trainer = unflatten_state(encoded["state"], tensors)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, SafetensorError, KeyError, TypeError,
                AttributeError, ValueError, MemoryError) as exc:
            raise read_failure(exc, f"cannot resume from {checkpoint}: trainer state: {first_line(exc)}") from None
    if not isinstance(meta, dict) or not isinstance(trainer, dict) or not {"optimizers", "rng"} <= set(trainer):
        raise CheckpointError(f"cannot resume from {checkpoint}: its trainer state is incomplete")
    check_saved_step(checkpoint, meta)
    return meta, trainer


def check_saved_step(checkpoint: Path, meta: dict[str, Any]) -> None:
    """state.json's `step` is the step in the checkpoint folder's name (a hand-edited -1 or 999999
    would restart the schedule, the loader and the counters somewhere else)."""
    step, named = meta.get("step"), _step_of(checkpoint.name.removeprefix(ASIDE_PREFIX), CHECKPOINT_PREFIX)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or (named is not None and step != named):
        raise CheckpointError(f"cannot resume from {checkpoint}: its state.json says step {step!r}, but the "
                              f"checkpoint is of step {named if named is not None else 'unknown'}")


# --------------------------------------------------------------------------------------------
# Sharded checkpoints (dcp/): checksums, and DCP's pickles read without running code
# --------------------------------------------------------------------------------------------

# torch.distributed.checkpoint (DCP) writes shard files (`__R_N.distcp`: tensors saved with
# torch.save, and each non-tensor entry, e.g. an optimizer's param_groups, as a pickle of its own)
# and, on rank 0, `.metadata`: a pickled index of which entry lives in which file at which offset.
# DCP's own reader unpickles `.metadata` with no restriction, and its default planner the non-tensor
# entries with `torch.load` outside its weights-only mode: a planted file would run code. We read
# both through allow-lists instead (`load_sharded_state`); tensors DCP already loads in weights-only
# mode.
DCP_METADATA = ".metadata"
# Beside a checkpoint's files, and beside dcp/'s: the sha256 of every other file of that folder
CHECKSUMS = "checksums.json"
CHECKSUMS_FORMAT = 1  # bump when the layout of checksums.json changes
DCP_CHECKSUMS, DCP_CHECKSUMS_FORMAT = CHECKSUMS, CHECKSUMS_FORMAT  # dcp/'s manifest is the same kind
# trainer.json's "sharded" entry says the dcp/ manifest was written: a checkpoint without it is older
SHARDED_CHECKSUMS_KEY = "checksums"
HASH_BLOCK_BYTES = 1 << 20  # read size when hashing a shard: bounded memory, whatever its size

# The globals DCP's `.metadata` refers to, listed from the metadata our own fsdp2 runs write (one
# and two processes): its dataclasses, torch.Size, the dtypes (admitted by type in
# `_MetadataUnpickler`) and the helpers layouts and memory formats pickle through.
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),  # a torch.layout pickles as _get_layout("torch.strided")
}
# storage_meta.checkpoint_id, the folder it was saved to, is a path (informational: DCP reads from
# the folder it is given). It is rebuilt as a pure path, which cannot touch the file system (and a
# WindowsPath could not even be built here). Python 3.13 moved the classes to pathlib._local.
PATH_MODULES = ("pathlib", "pathlib._local")
PURE_PATHS = {"PosixPath": PurePosixPath, "PurePosixPath": PurePosixPath, "WindowsPath": PureWindowsPath,
              "PureWindowsPath": PureWindowsPath}


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle refers to a global outside the allow-list (its name is the message)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds nothing but what DCP's metadata is made of: any other global (os.system, a class with
    a malicious __reduce__, ...) is refused before it is looked up, so unpickling runs no code of
    the file's choosing. Persistent ids are refused by pickle itself (no persistent_load)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in PATH_MODULES and name in PURE_PATHS:
            return PURE_PATHS[name]
        raise _RefusedGlobal(f"{module}.{name}")


def _plain_file_name(name: Any) -> bool:
    """A file directly in the folder: no path separator, not `.` or `..`."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name and os.sep not in name
            and (os.altsep is None or os.altsep not in name))


def read_sharded_metadata(folder: Path) -> Any:
    """DCP's index of a sharded checkpoint (`folder/.metadata`, a `Metadata`), unpickled through
    `_MetadataUnpickler`: a planted pickle is refused before it builds anything. Every shard file
    it names must be a file of `folder` (no path leads out of it). Any problem is one
    `CheckpointError` line naming the file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    folder = Path(folder)
    path = folder / DCP_METADATA
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {folder} is not a complete sharded checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _RefusedGlobal as exc:
        raise CheckpointError(f"{path} holds a pickled object that is not checkpoint metadata ({exc}): "
                              f"refusing to load it") from None
    except Exception as exc:  # a garbled pickle's bytes decide what it raises (EOFError, UnpicklingError, ...)
        raise CheckpointError(f"{path} is unreadable (cut short or corrupt): {first_line(exc)}") from None
    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)):
        raise CheckpointError(f"{path} holds a pickled {type(metadata).__name__}, not checkpoint metadata: "
                              f"refusing to load it")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _plain_file_name(name):
            raise CheckpointError(f"{path} names a shard outside {folder} ({name!r}): refusing to load it")
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name} is missing (its shards are listed in {path})")
    return metadata


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(folder: Path) -> None:
    """Record the sha256 of every file of a checkpoint folder (not its subfolders: `dcp/` keeps its
    own) in `checksums.json`, before the folder is renamed into place."""
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != CHECKSUMS}
    _write_json_file(folder / CHECKSUMS, {"format": CHECKSUMS_FORMAT, "sha256": files})


def add_checksum(folder: Path, name: str) -> None:
    """Record the sha256 of a file written into a finished checkpoint (`export-dcp`'s weights)."""
    manifest = folder / CHECKSUMS
    if not manifest.is_file():
        return  # a checkpoint from before checksums stays without them
    files = {**_recorded_checksums(manifest), name: sha256_file(folder / name)}
    write_json_atomic(manifest, {"format": CHECKSUMS_FORMAT, "sha256": files})


_unchecked_warned: set[str] = set()  # checkpoints without checksums, warned of once a process


def verify_file(checkpoint: Path, name: str) -> None:
    """`checkpoint/name` against the sha256 `checksums.json` recorded when it was saved: a file that
    differs is a `CheckpointError` naming it. A checkpoint without checksums (saved by an older
    version) is read unchecked, with one warning per process."""
    manifest = checkpoint / CHECKSUMS
    if not manifest.is_file():
        key = str(checkpoint)
        if key not in _unchecked_warned:
            _unchecked_warned.add(key)
            print(f"latentloop: warning: checkpoint {checkpoint} has no {CHECKSUMS} (saved by an older version): "
                  f"its files are loaded without a check", file=sys.stderr)
        return
    recorded = _recorded_checksums(manifest)
    # the full weights of a sharded checkpoint are written by export-dcp, then recorded: a crash between the
    # two (or a damaged copy) is mended by writing them again from the shards
    again = (f" (export-dcp cut short? `latentloop export-dcp {checkpoint} --force` writes them again from its "
             f"shards)" if name == "model.safetensors" and (checkpoint / SHARDED_DIR).is_dir() else "")
    if name not in recorded:
        raise CheckpointError(f"{checkpoint / name} is not among the files {manifest} recorded when the "
                              f"checkpoint was saved{again}")
    path = checkpoint / name
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {manifest} recorded it when the checkpoint was saved")
    try:
        found = sha256_file(path)
    except OSError as exc:
        raise read_failure(exc, f"cannot read {path}: {exc.strerror or exc}") from None
    if found != recorded[name]:
        raise CheckpointError(f"{path} is corrupt: its sha256 differs from the one recorded when it was saved "
                              f"(a damaged copy or an edit); restore it from a good copy{again}")


def verify_checkpoint(checkpoint: Path) -> None:
    """Every file `checksums.json` names, checked as `verify_file` checks one."""
    manifest = checkpoint / CHECKSUMS
    for name in sorted(_recorded_checksums(manifest)) if manifest.is_file() else ["model.safetensors"]:
        verify_file(checkpoint, name)


def write_sharded_checksums(folder: Path) -> None:
    """Record the sha256 of every file of a sharded checkpoint folder in its `checksums.json`.

    Called on rank 0 once `dcp.save` has returned there: DCP's last collective of a save comes after
    every process has written (and fsynced) its shard files and rank 0 its `.metadata`, so the
    folder is complete, and no process writes to it any more. Rank 0 hashes every process's files
    (one read of the checkpoint, just written, so mostly from the page cache), which keeps the
    manifest one file written by one process. It goes into the checkpoint's `.tmp-` folder like
    every other file, so `commit_checkpoint` fsyncs it and renames it into place with the rest."""
    folder = Path(folder)
    try:
        write_checksums(folder)
    except OSError as exc:
        raise OutputError(f"cannot write {folder / DCP_CHECKSUMS}: {exc.strerror or exc}") from None


def _recorded_checksums(manifest: Path, required: tuple[str, ...] = ()) -> dict[str, str]:
    """The {file name: sha256} a `checksums.json` holds (one that lacks any of `required` is refused)."""
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest} is unreadable: {first_line(exc)}") from None
    files = recorded.get("sha256") if isinstance(recorded, dict) else None
    if not isinstance(recorded, dict) or recorded.get("format") != DCP_CHECKSUMS_FORMAT:
        found = recorded.get("format") if isinstance(recorded, dict) else None
        raise CheckpointError(f"{manifest} has an unknown format ({found!r}; this version writes "
                              f"{DCP_CHECKSUMS_FORMAT})")
    if not isinstance(files, dict) or not set(required) <= set(files) \
            or not all(isinstance(v, str) and _plain_file_name(k) for k, v in files.items()):
        raise CheckpointError(f"{manifest} does not hold a sha256 for each file of its folder")
    return files


def verify_sharded_checksums(folder: Path, rank: int = 0, world: int = 1) -> bool:
    """Check a sharded checkpoint's files against its `checksums.json` before DCP reads any: a
    missing file, or one whose sha256 differs (a flipped bit, a copy cut short), is a
    `CheckpointError` naming it. The processes of a job share the work (rank R hashes every
    world-th file from the R-th on; each must then agree with the others on the outcome), and every
    process checks `.metadata`, which it reads itself.

    The checksums catch damage, not an attacker, who could rewrite them too: what keeps a planted
    file from running code is `read_sharded_metadata` and `load_sharded_state`. Returns False for
    a checkpoint saved before checksums were recorded: nothing is checked, and it loads as it is
    (`check_sharded` says so in a warning)."""
    folder = Path(folder)
    manifest = folder / DCP_CHECKSUMS
    if not manifest.is_file():
        if _dcp_checksums_written(folder):  # this version wrote one: lost, not older (the shards go unchecked)
            raise CheckpointError(f"{manifest} is missing, though {folder.parent / TRAINER_JSON} records that it was "
                                  f"written: the shards cannot be checked; restore it, or resume from an earlier "
                                  f"checkpoint")
        return False
    files = _recorded_checksums(manifest, required=(DCP_METADATA,))
    for name in sorted(set(sorted(files)[rank::world]) | {DCP_METADATA}):
        path = folder / name
        try:
            found = sha256_file(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (listed in {manifest})") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
        if found != files[name]:
            raise CheckpointError(f"{path} is corrupt: its sha256 differs from the one recorded when it was saved "
                                  f"(in {manifest})")
    return True


def _dcp_checksums_written(folder: Path) -> bool:
    """Whether the checkpoint's trainer.json (itself in the checkpoint's checked manifest) records
    that `folder`'s checksums.json was written (`SHARDED_CHECKSUMS_KEY`, since 2026-12-06): a
    missing one is then damage, not a checkpoint of a version before checksums."""
    try:
        trainer = json.loads((folder.parent / TRAINER_JSON).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False  # unreadable: its own check says so where it is read
    state = trainer.get("state") if isinstance(trainer, dict) else None
    sharded = state.get("sharded") if isinstance(state, dict) else None
    return isinstance(sharded, dict) and sharded.get(SHARDED_CHECKSUMS_KEY) is True


def check_sharded(folder: Path, rank: int = 0, world: int = 1) -> tuple[Any, str | None]:
    """What each process does before loading a sharded checkpoint: its share of
    `verify_sharded_checksums`, then `read_sharded_metadata`. Returns (DCP's metadata, for
    `load_sharded_state`; a warning to print once, or None)."""
    checked = verify_sharded_checksums(folder, rank, world)
    metadata = read_sharded_metadata(folder)
    note = None if checked else (f"{folder} has no {DCP_CHECKSUMS} (saved by an older version): its shards are "
                                 f"loaded without a checksum check")
    return metadata, note


def dcp_cause(exc: BaseException) -> Exception:
    """The error behind an error of `dcp.save` / `dcp.load`: DCP's CheckpointException (a
    BaseException, raised alike on every process) holds each failed rank's error, and this is the
    lowest failed rank's. One that is no Exception (a KeyboardInterrupt DCP caught on its way out)
    is raised again as it is."""
    cause: BaseException = exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = failures[min(failures)]
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    if not isinstance(cause, Exception):
        raise cause from None
    return cause


def _refused_global(exc: BaseException) -> str | None:
    """The global torch's weights-only unpickler refused ("... unsupported GLOBAL posix.system
    whose module ..."), or None when it failed otherwise (bytes that are no pickle)."""
    words = str(exc).split()
    for before, word in zip(words, words[1:]):
        if before == "GLOBAL":
            return word
    return None


def _first_sentence(exc: BaseException) -> str:
    """The start of an error's first line (torch's zip reader appends advice to its reason)."""
    return first_line(exc).split(". ")[0].rstrip(".")


@functools.cache
def _sharded_io() -> tuple[type, type]:
    """Our DCP reader and planner classes, built on first use (importing DCP takes most of a second,
    which no command that reads no sharded checkpoint should pay)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class PlainDataPlanner(DefaultLoadPlanner):
        """DCP's default load planner, except for the non-tensor entries (an optimizer's param_groups:
        floats, bools, tuples, names): decoded with `torch.load(weights_only=True)`, where DCP's
        default lifts that restriction, so an entry holding anything but plain data is refused."""

        def __init__(self, folder: Path):
            super().__init__()
            self.folder = Path(folder)

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as exc:  # UnpicklingError for a refused global; others for bytes that are no pickle
                shard = self.folder / self.metadata.storage_data[read_item.storage_index].relative_path
                refused = _refused_global(exc)
                if refused is None:
                    raise CheckpointError(f"{shard} is corrupt: its entry {fqn} cannot be read "
                                          f"({_first_sentence(exc)})") from None
                raise CheckpointError(f"{shard} holds a pickled object that is not plain data ({refused}, in entry "
                                      f"{fqn}): refusing to load it") from None
            if self.flatten_state_dict:  # placed as DefaultLoadPlanner.load_bytes places it
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    class CheckedReader(FileSystemReader):
        """DCP's file reader, except that its metadata is the one `read_sharded_metadata` read (never
        `pickle.load`), and that it reads only for a `PlainDataPlanner`."""

        def __init__(self, folder: Path, metadata: Any = None):
            super().__init__(folder)
            self.metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # DCP asks again with rank=R for per-rank metadata only when this fails; ours never
            # writes any, so both questions get the one `.metadata`
            metadata = self.metadata if self.metadata is not None else read_sharded_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            if not isinstance(planner, PlainDataPlanner):
                raise TypeError("CheckedReader reads for a PlainDataPlanner only (DCP's default planner unpickles "
                                "non-tensor entries freely)")
            return super().read_data(plan, planner)

    return CheckedReader, PlainDataPlanner


def load_sharded_state(state_dict: dict[str, Any], folder: Path, metadata: Any, no_dist: bool) -> None:
    """`torch.distributed.checkpoint.load` of `state_dict` (in place) from the sharded checkpoint
    `folder`, through our reader and planner only (see `_sharded_io`), with the metadata
    `check_sharded` read. Collective unless `no_dist`. Any failure, on any process, is one
    `CheckpointError` line, the same on every process (the lowest failed rank's): DCP raises its
    CheckpointException, a BaseException, which would otherwise escape `except Exception`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _sharded_io()
    folder = Path(folder)
    try:
        with warnings.catch_warnings():  # without a process group DCP warns that it reads in one process: we mean it
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state_dict, storage_reader=reader(folder, metadata), planner=planner(folder), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:
        cause = dcp_cause(exc)
        if isinstance(cause, LatentloopError):
            raise CheckpointError(str(cause)) from None
        raise CheckpointError(f"cannot load the sharded checkpoint {folder}: {_first_sentence(cause)}") from None


# --------------------------------------------------------------------------------------------
# The run lock
# --------------------------------------------------------------------------------------------


class RunLock:
    """An exclusive, non-blocking `flock` on RUN/.lock, held while a process trains into RUN.

    The kernel drops it when the process dies, however it dies, so a crashed run never leaves a
    stale lock. The file itself stays (deleting it would race with a process about to lock it).
    On platforms without `fcntl` runs are not guarded.
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> RunLock:
        if self._file is not None:
            return self
        try:
            import fcntl
        except ImportError:
            return self
        try:
            file = open(self.path, "a")  # held open for the life of the lock
        except OSError as exc:
            raise OutputError(f"cannot create {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            file.close()
            if isinstance(exc, BlockingIOError):
                raise CheckpointError(f"{self.path.parent} is in use: another training writes to it "
                                      f"(it holds {self.path}); wait for it to finish") from None
            raise CheckpointError(f"cannot lock {self.path}: {exc.strerror or exc}") from None
        self._file = file
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the last descriptor drops the flock
            self._file = None
