"""Checkpoints of a run: `save` (rank 0 writes; under fsdp2 every process its shards) and
`resume_run` (the newest checkpoint that loads: weights, optimizer states, RNG streams, the
loader's position and the counters, each phase agreed on by every process)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import (
    SHARDED_CHECKSUMS_KEY,
    begin_checkpoint,
    check_weights_finite,
    checkpoint_candidates,
    checkpoint_folder,
    checkpoint_tmp_folder,
    commit_checkpoint,
    fsync_dir,
    load_weights,
    own_or_run_file,
    read_failure,
    read_trainer_state,
    read_weights,
    recover_checkpoints,
    save_checkpoint,
    set_aside_broken,
    write_checkpoint_files,
)
from ..data import TokenData
from ..distributed import agree, on_main, together
from ..errors import CheckpointError, CheckpointUnreadable, DataError, OutputError
from ..parallel import (
    SHARDED_DIR,
    full_weights,
    gather_objects,
    load_full_optimizer_states,
    load_full_weights,
    load_sharded,
    save_sharded,
)
from ..runtime import absolute_source
from ..util import first_line, is_int, write_json_atomic
from .state import TrainState, note, rank_seed, warn


def _recover(run_dir: Path) -> list[str]:
    try:
        return recover_checkpoints(run_dir)
    except OSError as exc:  # renaming leftovers aside
        raise OutputError(f"cannot repair {run_dir / 'checkpoints'}: {exc.strerror or exc}") from None



def resume_run(state: TrainState) -> None:
    """Continue from the newest checkpoint that loads. An unloadable newer one (corrupt, cut short)
    is set aside with a warning; with none loadable the run is refused, never restarted from step 0.
    Every process tries the same checkpoints in the same order and agrees on each outcome."""
    for repaired in on_main(_recover, state.run_dir) or []:
        warn(repaired)
    candidates = checkpoint_candidates(state.run_dir)
    if not candidates:
        agree(CheckpointError(f"cannot resume: {state.run_dir} holds no checkpoint yet (a run saves one every "
                              f"save_every steps and at the end); start it again without --resume"))
    failed: list[tuple[Path, CheckpointError]] = []
    for checkpoint in reversed(candidates):
        try:
            saved = _restore(state, checkpoint)
        except CheckpointUnreadable as exc:  # this machine failed to read it, not the checkpoint: stop here
            raise CheckpointError(f"cannot resume: {first_line(exc)}; resume again once it reads") from None
        except CheckpointError as exc:  # the same on every rank: _restore agrees on each of its phases
            failed.append((checkpoint, exc))
            continue
        on_main(_after_restore, state, checkpoint, failed)
        if state.dist.is_main:
            notice = layout_change(saved, state.dist.world_size, state.config.train.strategy, state.global_batch)
            if notice is not None:
                note(notice)
        return
    newest, reason = failed[0]
    agree(CheckpointError(f"cannot resume: no checkpoint of {state.run_dir} loads (newest {newest.name}: {reason})"))


def layout_change(saved: dict, world_size: int, strategy: str, global_batch: int) -> str | None:
    """The notice of a resume on another number of processes or another strategy (None: neither
    changed), saying what became of the global batch: it said "now 4 sequences" where 4 it was."""
    before_strategy = saved.get("strategy")
    changed = []
    if saved["world_size"] != world_size:
        changed.append(f"saved by {saved['world_size']} process(es), resumed on {world_size}")
    if before_strategy is not None and before_strategy != strategy:
        changed.append(f"strategy {before_strategy} -> {strategy}")
    if not changed:
        return None
    before_batch = saved.get("global_batch")
    batch = (f"the global batch stays {global_batch} sequences" if before_batch == global_batch else
             f"the global batch is now {global_batch} sequences" if before_batch is None else
             f"the global batch goes from {before_batch} to {global_batch} sequences")
    return f"resuming a run {', '.join(changed)}: {batch}, and the run does not continue bit-exactly"


def _after_restore(state: TrainState, checkpoint: Path, failed: list[tuple[Path, CheckpointError]]) -> None:
    try:
        for broken, reason in failed:
            kept = set_aside_broken(broken)
            warn(f"{reason}; moved it to {kept.name} and resumed from {checkpoint.name}")
    except OSError as exc:
        raise OutputError(f"cannot repair {state.run_dir / 'checkpoints'}: {exc.strerror or exc}") from None
    _trim_metrics(state)


def _data_checksums(data: TokenData) -> dict[str, str] | None:
    return data.meta.get("sha256")


def _other_source(state: TrainState, checkpoint: Path) -> str | None:
    """The data.source `checkpoint` was trained on where it is another than this run's, else None.
    `check_run_folder` lets a resume name its data by another path (`MOVED_DATA`) because the
    checkpoint's shard checksums are then compared; a checkpoint from before they were recorded was
    resumed on any folder unchecked."""
    found = own_or_run_file(checkpoint, "config.json")
    try:
        saved = json.loads(found.read_text())["data"]["source"] if found is not None else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return None  # check_run_folder refused an unreadable run config; a checkpoint's own is checksummed
    if not isinstance(saved, str) or absolute_source(saved) == absolute_source(state.config.data.source):
        return None
    return saved


def _read_checkpoint(state: TrainState, checkpoint: Path) -> tuple[dict, dict, dict[str, torch.Tensor] | None]:
    """What every process reads of a checkpoint on its own: state.json, the trainer state and (for
    an unsharded checkpoint) the weights, checked against the model."""
    meta, trainer = read_trainer_state(checkpoint)
    saved_data, other_source = meta.get("data"), _other_source(state, checkpoint)
    if saved_data is not None and saved_data != _data_checksums(state.data):
        trained_on = "" if other_source is None else f", where it was trained on {other_source!r}"
        raise DataError(f"the token data of {state.run_dir} changed since checkpoint {checkpoint.name} (its shards' "
                        f"sha256 differ{trained_on}): resume with the data it was trained on (moved, under the same "
                        f"file names: documents go to train or val by their file's name), or start a new run")
    if saved_data is None and other_source is not None:
        raise DataError(f"cannot resume {state.run_dir} on data.source {state.config.data.source!r}: checkpoint "
                        f"{checkpoint.name} was trained on {other_source!r} and records no checksums of its token "
                        f"data to prove the two the same; resume with data.source {other_source!r}, or start a new "
                        f"run from its weights (--init-from)")
    if (checkpoint / SHARDED_DIR).is_dir():
        return meta, trainer, None
    if state.config.train.strategy != "fsdp2":
        return meta, trainer, {}  # loaded straight into the plain model below
    weights = read_weights(checkpoint)
    missing, unexpected = set(state.model.state_dict()) - set(weights), set(weights) - set(state.model.state_dict())
    if missing or unexpected:
        raise CheckpointError(f"weights {checkpoint / 'model.safetensors'} do not fit the model: missing "
                              f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    return meta, trainer, weights


def _load_states(state: TrainState, checkpoint: Path, trainer: dict, weights: dict | None) -> None:
    """Weights and optimizer states into this run's model (collective under fsdp2). The optimizers'
    settings (base lr, weight decay, betas, momentum: their param groups but the parameters) stay the
    ones this run's config built: loading a state brings back the saved run's, and a resume with a
    changed lr trained on at the old one while logging the new."""
    configured = [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
                  for opt in state.optimizers]
    try:
        _load_saved_states(state, checkpoint, trainer, weights)
    finally:  # also when a checkpoint fails part way: the one before it is tried with the configured settings
        for opt, groups in zip(state.optimizers, configured):
            for group, settings in zip(opt.param_groups, groups):
                group.update(settings)


def _load_saved_states(state: TrainState, checkpoint: Path, trainer: dict, weights: dict | None) -> None:
    try:
        if weights is None:  # a sharded checkpoint (torch.distributed.checkpoint), any strategy
            with_state = trainer.get("sharded", {}).get("optimizer_state_params", [])
            note = load_sharded(checkpoint / SHARDED_DIR, state.model, state.optimizers, with_state)
            if note is not None and state.dist.is_main:
                warn(note)
            return
        if len(trainer["optimizers"]) != len(state.optimizers):
            raise ValueError(f"{len(trainer['optimizers'])} optimizer states for {len(state.optimizers)} optimizers")
        if weights:  # an unsharded checkpoint into an fsdp2 run: every process keeps its shards
            load_full_weights(state.model, weights)
            load_full_optimizer_states(state.model, state.optimizers, trainer["optimizers"])
            return
        load_weights(state.model, checkpoint)
        for opt, opt_state in zip(state.optimizers, trainer["optimizers"]):
            opt.load_state_dict(opt_state)
    except (KeyError, TypeError, ValueError, RuntimeError, MemoryError) as exc:
        raise read_failure(exc, f"cannot resume from {checkpoint}: {first_line(exc)}") from None


def _restore_counters(state: TrainState, checkpoint: Path, meta: dict, trainer: dict) -> dict:
    """RNG states, loader position and counters; returns how the checkpoint was saved (its world
    size, strategy and global batch; the last two None where it does not say)."""
    env = state.dist
    try:
        saved_world = int(meta.get("world_size", 1))
        saved = {"world_size": saved_world, "strategy": meta.get("strategy"), "global_batch": meta.get("global_batch")}
        by_rank = trainer.get("rng_ranks") or [trainer["rng"]]
        if env.rank < len(by_rank):
            _set_rng_state(by_rank[env.rank])
        else:  # more processes than saved this run: a fresh stream of its own, past the ones used so far
            torch.manual_seed(rank_seed(state.config.train.seed, env.rank) ^ int(meta["step"]))
        state.loader.load_state_dict(meta["loader"])
        state.step, state.tokens_seen = int(meta["step"]), int(meta["tokens_seen"])
        state.flops_seen, state.elapsed = meta.get("flops_seen", 0.0), meta.get("elapsed", 0.0)
        state.init_from = meta.get("init_from") if isinstance(meta.get("init_from"), str) else None
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot resume from {checkpoint}: {first_line(exc)}") from None
    return saved


def _restore(state: TrainState, checkpoint: Path) -> dict:
    """Load everything of one checkpoint into `state`; a partly applied checkpoint that then fails
    is fully overwritten by the next one tried (weights, optimizer states, RNGs, loader all are).
    Each phase is agreed on by every process, so all raise the same error at the same point.
    Returns how it was saved (`_restore_counters`)."""
    meta, trainer, weights = together(_read_checkpoint, state, checkpoint)
    together(_load_states, state, checkpoint, trainer, weights)
    return together(_restore_counters, state, checkpoint, meta, trainer)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state().tolist(),
            "numpy": [v.tolist() if isinstance(v, np.ndarray) else v for v in np.random.get_state()],
            "python": [v if not isinstance(v, tuple) else list(v) for v in random.getstate()],
            "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None}


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(torch.as_tensor(rng["torch"], dtype=torch.uint8))
    if torch.cuda.is_available() and rng.get("cuda") is not None:
        # one state per device the saving process saw; here perhaps fewer (another CUDA_VISIBLE_DEVICES):
        # each visible device takes its own (set_rng_state_all raised IndexError past the last)
        for device, saved in enumerate(rng["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.as_tensor(saved, dtype=torch.uint8), device)
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))


def _trim_metrics(state: TrainState) -> None:
    """Keep the metrics up to the resumed step; rows logged after that checkpoint are logged again.
    A line cut short by a crash is dropped."""
    log = state.run_dir / "metrics.jsonl"
    kept = []
    for line in (log.read_bytes().splitlines() if log.exists() else []):
        try:
            # decoded strictly first: json.loads of bytes lets encoded surrogates through, which a
            # strict decode of the row to keep it would then fail on
            text = line.decode("utf-8")
            row = json.loads(text)
        except ValueError:  # cut short, not JSON, or not UTF-8 (UnicodeDecodeError): dropped, as a damaged row
            continue
        step = row.get("step", 0) if isinstance(row, dict) else None
        if is_int(step) and step <= state.step:
            kept.append(text)
    tmp = log.with_name(".metrics.jsonl.tmp")
    try:
        with open(tmp, "w") as f:
            f.write("".join(r + "\n" for r in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, log)
        fsync_dir(log.parent)
    except OSError as exc:
        raise OutputError(f"cannot rewrite {log}: {exc.strerror or exc}") from None


def _sync_metrics(state: TrainState) -> None:
    """The metrics up to this step reach the disk before the checkpoint after them, and so does a
    resume's changed config (`config_unsaved`), which the checkpoint copies."""
    if state.config_unsaved:
        try:
            write_json_atomic(state.run_dir / "config.json", state.config_as_saved())  # strategy as given
        except OSError as exc:
            raise OutputError(f"cannot write {state.run_dir / 'config.json'}: {exc.strerror or exc}") from None
        state.config_unsaved = False
    log = state.run_dir / "metrics.jsonl"
    try:
        with open(log, "a") as f:
            os.fsync(f.fileno())
    except OSError as exc:
        raise OutputError(f"cannot write {log}: {exc.strerror or exc}") from None


def save(state: TrainState) -> Path:
    """Checkpoint the run; refused (`NonFiniteError`) when training has diverged since the last check.
    Every process calls it: rank 0 writes the files, and under fsdp2 every process its shards."""
    if state.guard is not None:
        state.guard.check()
    env, train = state.dist, state.config.train
    rng = _rng_state()
    rng_ranks = gather_objects(rng) if env.world_size > 1 else None
    meta = {"step": state.step, "tokens_seen": state.tokens_seen, "flops_seen": state.flops_seen,
            "elapsed": state.elapsed, "loader": state.loader.state_dict(), "data": _data_checksums(state.data),
            "data_source": absolute_source(state.config.data.source),  # eval finds the file from any folder
            "init_from": state.init_from,  # the base run (eval --by-position draws its curve beside this one)
            "world_size": env.world_size, "strategy": train.strategy, "global_batch": state.global_batch}
    if train.strategy == "fsdp2":
        return _save_sharded(state, rng, rng_ranks, meta)

    def write() -> Path:
        trainer = {"optimizers": [opt.state_dict() for opt in state.optimizers], "rng": rng}
        if rng_ranks is not None:
            trainer["rng_ranks"] = rng_ranks
        _sync_metrics(state)
        return save_checkpoint(state.run_dir, state.step, state.model, trainer, meta, train.keep_last)

    on_main(write)
    return checkpoint_folder(state.run_dir, state.step)


def _save_sharded(state: TrainState, rng: dict, rng_ranks: list | None, meta: dict) -> Path:
    """An fsdp2 checkpoint: every process writes its shards into `dcp/` (nothing is gathered);
    with `train.full_weights` rank 0 also writes model.safetensors from the weights gathered into
    its CPU memory, so that `load`, `eval` and `generate` read the checkpoint as any other."""
    run_dir, step, train = state.run_dir, state.step, state.config.train
    together(check_weights_finite, {name: getattr(t, "to_local", lambda t=t: t)()
                                    for name, t in state.model.state_dict().items()}, step)
    weights = full_weights(state.model) if train.full_weights else None

    def begin() -> Path:
        _sync_metrics(state)
        return begin_checkpoint(run_dir, step)

    on_main(begin)
    tmp = checkpoint_tmp_folder(run_dir, step)
    with_state = together(save_sharded, tmp / SHARDED_DIR, state.model, state.optimizers)
    # the dcp/ manifest is recorded as written, so that a lost one is refused rather than taken for an older version
    trainer = {"optimizers": [], "rng": rng, "sharded": {"optimizer_state_params": with_state,
                                                         SHARDED_CHECKSUMS_KEY: True}}
    if rng_ranks is not None:
        trainer["rng_ranks"] = rng_ranks

    def finish() -> Path:
        write_checkpoint_files(tmp, run_dir, step, weights, trainer, meta)
        return commit_checkpoint(run_dir, step, train.keep_last)

    on_main(finish)
    return checkpoint_folder(run_dir, step)


