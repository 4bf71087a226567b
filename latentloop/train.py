"""Training as functions: `setup` -> `fit` (which calls `validate` and `save`), as litgpt's pretrain.

    state = setup(run_config, "runs/name")          # validates everything before writing anything
    summary = fit(state)                             # progress bar, JSONL metrics, checkpoints
    metrics = validate(state)                        # val loss / ppl / bpb

Stages (`train.stage`): `pretrain`; `sft` (from `init_from`, on `chat:` data: the tokenizer gains
the chat tokens, the embedding and head grow by `checkpoint.grow_vocab_rows`, batches carry a loss
mask of the assistant's tokens that every objective honours, validation is the masked loss on
held-out conversations); `extend` (from `init_from`, at a longer `sequence_len` with the RoPE base
scaled by `config.extended_rope_theta`; `stage_config` builds both from the base run's config).

The trainer knows models only through `forward` and objectives only through the `Objective`
interface, so each architecture brings its own training procedure.

Many processes (`torchrun --nproc_per_node N -m latentloop train ...`: ddp unless train.strategy says
otherwise):
every process runs these same functions on its own rank's batches (`TokenLoader` shards the global
order), so one step sees micro-batch x grad_accum x world_size sequences. Rank 0 alone prints,
logs and writes the run folder's shared files; the others follow. Every phase that can fail on
bad input ends with the processes agreeing on the outcome (`runtime.agree`), so an error on one
rank stops them all with its one line, printed once. The objectives' random draws (fbt's pass
count and prefix boundaries, rgpt's depth) are seeded by (seed, step) and so the same on every
rank; training noise (fbt's jitter, rgpt's noise) comes from each rank's own torch RNG stream.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .archs import build_model, build_objective
from .checkpoint import (
    LOCK_FILE,
    RunLock,
    begin_checkpoint,
    check_resumable,
    check_weights_finite,
    checkpoint_candidates,
    checkpoint_folder,
    checkpoint_tmp_folder,
    commit_checkpoint,
    fsync_dir,
    json_safe,
    list_checkpoints,
    load_weights,
    read_trainer_state,
    read_weights,
    recover_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
    set_aside_broken,
    write_checkpoint_files,
)
from .config import RunConfig, TrainConfig, apply_overrides, extended_rope_theta
from .data import TokenData, TokenLoader, load_tokenizer
from .data.chat import ChatData, ChatLoader, is_chat_source, masked_batches, prepare_chat
from .errors import CheckpointError, ConfigError, DataError, NonFiniteError, OutputError
from .eval import evaluate_loss
from .eval.loss import evaluate_batches
from .interop.upcycle import initialise_from
from .objectives import Objective
from .optim import build_optimizers, lr_multiplier, set_lr
from .parallel import (
    SHARDED_DIR,
    any_rank,
    full_weights,
    gather_objects,
    grad_norm,
    gradient_sync,
    load_full_optimizer_states,
    load_full_weights,
    load_sharded,
    mean_across_ranks,
    save_sharded,
    wrap_model,
)
from .runtime import (
    DistEnv,
    absolute_source,
    agree,
    autocast_for,
    in_turns,
    init_distributed,
    keep_freed_memory,
    on_main,
    precision_note,
    prepare_data,
    resolve_dtype,
    resolve_strategy,
    together,
)
from .util import first_line

# Config fields that setup fills in (from the tokenizer) or that only say where a cache lives.
SET_ON_SETUP = ("vocab_size", "bos_id", "cache_dir")


@dataclass
class TrainState:
    config: RunConfig
    run_dir: Path
    model: nn.Module
    tokenizer: Any
    data: TokenData | ChatData
    loader: TokenLoader  # a ChatLoader (batches with a loss mask) for sft
    objective: Objective
    optimizers: list[torch.optim.Optimizer]
    device: torch.device
    step: int = 0
    tokens_seen: int = 0
    flops_seen: float = 0.0
    elapsed: float = 0.0  # seconds of training, across resumes
    forward_model: nn.Module | None = None  # the compiled model when train.compile is on
    history: list[dict[str, Any]] = field(default_factory=list)
    lock: RunLock | None = None  # held (by rank 0) from setup to the end of fit: one writer per run folder
    guard: FiniteGuard | None = None  # fit's divergence check, consulted again before every save
    init_report: dict[str, Any] | None = None  # what --init-from loaded (see latentloop.interop.upcycle)
    dist: DistEnv = field(default_factory=DistEnv)  # this process's rank in the job (a single process by default)
    flops: FlopsMemo | None = None  # the objective's FLOPs per token, counted once per kind of forward

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, over every process: micro-batch x accumulation x world size."""
        train = self.config.train
        return train.batch_size * train.grad_accum * self.dist.world_size


class FlopsMemo:
    """The model as `Objective.flops_per_token` sees it, with `flops_per_token` remembered per
    forward's arguments: counting runs a probe forward, which would otherwise run every step (and
    under fsdp2 or torch.compile costs a collective or a recompilation)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache: dict[str, float] = {}

    def flops_per_token(self, seq_len: int | None = None, **forward_options) -> float:
        key = repr((seq_len, sorted(forward_options.items())))
        if key not in self.cache:
            self.cache[key] = self.model.flops_per_token(seq_len, **forward_options)
        return self.cache[key]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _warn(message: str) -> None:
    print(f"latentloop: warning: {message}", file=sys.stderr)


def _note(message: str) -> None:
    print(f"latentloop: {message}", file=sys.stderr)


def rank_seed(seed: int, rank: int) -> int:
    """The torch seed of rank `rank`'s own stream (training noise), distinct for every rank."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] % (2**63))


def _check_output_path(run_dir: Path) -> None:
    """A run folder that could never be created (a file stands in its place or above it) is reported
    before any data is prepared."""
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputError(f"output folder {run_dir} is a file")
    for parent in run_dir.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"cannot create output folder {run_dir}: {parent} is a file")
            break


def _check_run_folder(run_dir: Path, config: RunConfig, resume: bool) -> None:
    saved = run_dir / "config.json"
    if saved.is_file():
        if not resume:
            raise CheckpointError(f"{run_dir} already holds a run; pass --resume to continue it or choose another "
                                  f"output folder")
        try:
            previous = json.loads(saved.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"corrupt {saved}: {exc}") from None
        if not isinstance(previous, dict) or not all(isinstance(previous.get(s, {}), dict) for s in ("model", "data")):
            raise CheckpointError(f"corrupt {saved}: not a run config with sections model/train/data")
        current = config.to_dict()
        for section in ("model", "data"):
            for key in sorted(set(previous.get(section, {})) | set(current[section])):
                old, new = previous.get(section, {}).get(key), current[section].get(key)
                if key in SET_ON_SETUP:  # resuming reloads the run's own tokenizer, which decides these
                    continue
                if json.loads(json.dumps(old)) != json.loads(json.dumps(new)):
                    raise CheckpointError(f"{run_dir} holds a different run: {section}.{key} is {old!r} there, "
                                          f"{new!r} here")
    elif resume:
        raise CheckpointError(f"cannot resume: {run_dir} holds no run (no config.json)")
    elif run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        raise CheckpointError(f"{run_dir} exists and is not empty; choose another output folder")


def setup(config: RunConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
          init_from: str | Path | None = None) -> TrainState:
    """Build tokenizer, data, model, objective and optimizers; nothing is written until all succeed.
    Under torchrun (train.strategy ddp or fsdp2) this process first joins the job's process group."""
    run_dir = Path(run_dir)
    config.train.strategy = resolve_strategy(config.train.strategy)  # auto -> what runs, and what the run records
    env, device = init_distributed(config.train.strategy, config.train.device)
    if device.type == "cpu" and config.train.keep_freed_memory:
        keep_freed_memory()
    together(_check_output_path, run_dir)
    together(_check_stage, config, resume, init_from)
    together(_check_run_folder, run_dir, config, resume)
    if resume and list_checkpoints(run_dir):
        together(lambda: check_resumable(resolve_checkpoint(run_dir)))  # before any data is prepared
    tokenizer = together(load_tokenizer, str(run_dir / "tokenizer.json") if resume else config.data.tokenizer)
    sft = config.train.stage == "sft"
    if sft:
        tokenizer = tokenizer.with_chat_tokens()  # already there on resume: the same tokenizer back
    config.model.vocab_size, config.model.bos_id = tokenizer.vocab_size, tokenizer.bos_id
    together(config.model.__post_init__)
    torch.manual_seed(config.train.seed)
    if sft:
        # rendered in memory on every rank (nothing cached to disk), the same rows everywhere
        data = together(prepare_chat, config.data.source, tokenizer, config.model.sequence_len,
                        config.data.val_fraction)
        counts = data.meta["train"]
        if (counts["dropped"] or counts["cut"]) and env.is_main:  # a context too short should not pass unnoticed
            _warn(f"{counts['dropped']} training conversations longer than a row of {config.model.sequence_len + 1} "
                  f"tokens were dropped (no assistant token fits) and {counts['cut']} cut; "
                  f"{counts['conversations']} are trained on")
        loader = ChatLoader(data.train, config.train.batch_size, seed=config.train.seed, rank=env.rank,
                            world_size=env.world_size)
    else:
        data = in_turns(prepare_data, config, tokenizer, progress and env.is_main)
        loader = together(TokenLoader, data.train, config.train.batch_size, config.model.sequence_len,
                          seed=config.train.seed, rank=env.rank, world_size=env.world_size)
    model = build_model(config.model)  # the same init on every rank (same seed)
    init_report = None
    if init_from is not None:
        init_report = together(initialise_from, model, init_from, grow_vocab=sft)
    model = model.to(device)
    objective = build_objective(config.model, config.train)
    flops = FlopsMemo(model)
    objective.flops_per_token(flops)  # every kind of forward the run takes, counted once on the plain model
    if env.rank > 0:  # training noise: each rank its own stream (rank 0 continues the single-process one)
        torch.manual_seed(rank_seed(config.train.seed, env.rank))
    forward_model = wrap_model(model, config.train, device)
    optimizers = build_optimizers(model, config.train)  # after fsdp2 sharded the parameters
    state = TrainState(config, run_dir, model, tokenizer, data, loader, objective, optimizers, device,
                       init_report=init_report, dist=env, flops=flops)
    state.forward_model = forward_model

    on_main(_claim_run_folder, state, resume)
    try:
        if resume:
            _resume(state)
    except BaseException:
        if state.lock is not None:
            state.lock.release()
        raise
    if progress and env.is_main:
        _note(precision_note(device, config.train.dtype))
    if env.world_size > 1 and env.is_main:
        train = config.train
        _note(f"{env.world_size} processes ({train.strategy}, {env.backend}): global batch = {train.batch_size} "
              f"x {train.grad_accum} accumulation x {env.world_size} processes = {state.global_batch} sequences "
              f"({state.global_batch * config.model.sequence_len:,} tokens) per step")
    return state


def _claim_run_folder(state: TrainState, resume: bool) -> None:
    """Rank 0: create and lock the run folder; a new run writes its config, tokenizer and an empty log."""
    run_dir, config = state.run_dir, state.config
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create output folder {run_dir}: {exc.strerror or exc}") from None
    state.lock = RunLock(run_dir).acquire()
    try:
        _check_run_folder(run_dir, config, resume)  # again, locked: another run may have started here meanwhile
        if not resume:
            config.save_json(run_dir / "config.json")
            try:
                state.tokenizer.save(run_dir)
                (run_dir / "metrics.jsonl").write_text("")
            except OSError as exc:
                raise OutputError(f"cannot write into {run_dir}: {exc.strerror or exc}") from None
    except BaseException:
        state.lock.release()
        raise


def _recover(run_dir: Path) -> list[str]:
    try:
        return recover_checkpoints(run_dir)
    except OSError as exc:  # renaming leftovers aside
        raise OutputError(f"cannot repair {run_dir / 'checkpoints'}: {exc.strerror or exc}") from None


def _check_stage(config: RunConfig, resume: bool, init_from: str | Path | None) -> None:
    stage, chat = config.train.stage, is_chat_source(config.data.source)
    if chat and stage != "sft":
        raise ConfigError(f"chat data ({config.data.source}) trains with stage sft (--stage sft --init-from RUN)")
    if stage == "sft" and not chat:
        raise ConfigError(f"stage sft trains on conversations: use --data chat:FILE or chat:task:NAME, got "
                          f"{config.data.source!r}")
    if stage in ("sft", "extend") and init_from is None and not resume:
        raise ConfigError(f"stage {stage} continues a trained run: give --init-from RUN")


# What each stage changes in the base run's config unless the user says otherwise (why, each):
STAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    # A short run on few tokens: a fifth of pretraining's peak lr (nanochat's SFT uses a small lr too)
    # decaying to zero, no warm start from a stable phase.
    "sft": {"train.lr": 6e-4, "train.warmup_steps": 10, "train.min_lr_ratio": 0.0, "train.schedule": "cosine",
            "train.eval_every": 50},
    # Continued pretraining at the new length: a third of the peak lr with a short re-warmup (the
    # optimizer state starts afresh), cosine to 10%.
    "extend": {"train.lr": 1e-3, "train.warmup_steps": 20, "train.min_lr_ratio": 0.1, "train.schedule": "cosine"},
}


def stage_config(stage: str, init_from: str | Path, overrides: list[str] = (), data: str | None = None,
                 flags: dict[str, Any] | None = None) -> RunConfig:
    """The config of an sft / extend run from its base run: the base's model (shape, arch, its
    tokenizer), the stage's defaults (`STAGE_DEFAULTS`, then the arch's `stage_defaults`), then `flags`
    ({"section.key": value}) and `overrides` ("key=value"). For extend, a `sequence_len` above the
    base's scales `rope_theta` by `extended_rope_theta` unless the overrides set rope_theta themselves."""
    from .checkpoint import find_tokenizer_file, read_run_config

    checkpoint = resolve_checkpoint(init_from)
    base = read_run_config(checkpoint)
    tokenizer_file = find_tokenizer_file(checkpoint)
    raw = base.to_dict()
    raw["train"] = {"stage": stage, "seed": base.train.seed, "batch_size": base.train.batch_size,
                    "device": base.train.device, "dtype": base.train.dtype}
    raw["data"] = {"source": base.data.source, "tokenizer": str(tokenizer_file), "val_fraction": base.data.val_fraction,
                   "max_bytes": base.data.max_bytes}
    for key, value in {**STAGE_DEFAULTS[stage], **{f"model.{k}": v for k, v in
                                                  base.model.stage_defaults.get(stage, {}).items()},
                       **{k: v for k, v in (flags or {}).items() if v is not None}}.items():
        section, name = key.split(".")
        raw[section][name] = value
    if data is not None:
        raw["data"]["source"] = data
    raw = apply_overrides(raw, list(overrides))
    config = RunConfig.from_dict(raw)
    if stage == "extend":
        if config.model.sequence_len <= base.model.sequence_len:
            raise ConfigError(f"stage extend needs a sequence_len above the base run's {base.model.sequence_len} "
                              f"(--set sequence_len=N), got {config.model.sequence_len}")
        if not any(item.split("=", 1)[0].strip().endswith("rope_theta") for item in overrides):
            config.model.rope_theta = extended_rope_theta(base.model.rope_theta, base.model.head_dim,
                                                          base.model.sequence_len, config.model.sequence_len)
    return config


def _resume(state: TrainState) -> None:
    """Continue from the newest checkpoint that loads. An unloadable newer one (corrupt, cut short)
    is set aside with a warning; with none loadable the run is refused, never restarted from step 0.
    Every process tries the same checkpoints in the same order and agrees on each outcome."""
    for note in on_main(_recover, state.run_dir) or []:
        _warn(note)
    candidates = checkpoint_candidates(state.run_dir)
    if not candidates:
        agree(CheckpointError(f"cannot resume: {state.run_dir} holds no checkpoint yet (a run saves one every "
                              f"save_every steps and at the end); start it again in a new folder"))
    failed: list[tuple[Path, CheckpointError]] = []
    for checkpoint in reversed(candidates):
        try:
            saved_world = _restore(state, checkpoint)
        except CheckpointError as exc:  # the same on every rank: _restore agrees on each of its phases
            failed.append((checkpoint, exc))
            continue
        on_main(_after_restore, state, checkpoint, failed)
        if saved_world != state.dist.world_size and state.dist.is_main:
            _note(f"resuming a run saved by {saved_world} process(es) on {state.dist.world_size}: the global batch "
                  f"is now {state.global_batch} sequences, and the run does not continue bit-exactly")
        return
    newest, reason = failed[0]
    agree(CheckpointError(f"cannot resume: no checkpoint of {state.run_dir} loads (newest {newest.name}: {reason})"))


def _after_restore(state: TrainState, checkpoint: Path, failed: list[tuple[Path, CheckpointError]]) -> None:
    try:
        for broken, reason in failed:
            kept = set_aside_broken(broken)
            _warn(f"{reason}; moved it to {kept.name} and resumed from {checkpoint.name}")
    except OSError as exc:
        raise OutputError(f"cannot repair {state.run_dir / 'checkpoints'}: {exc.strerror or exc}") from None
    _trim_metrics(state)


def _data_checksums(data: TokenData) -> dict[str, str] | None:
    return data.meta.get("sha256")


def _read_checkpoint(state: TrainState, checkpoint: Path) -> tuple[dict, dict, dict[str, torch.Tensor] | None]:
    """What every process reads of a checkpoint on its own: state.json, the trainer state and (for
    an unsharded checkpoint) the weights, checked against the model."""
    meta, trainer = read_trainer_state(checkpoint)
    saved_data = meta.get("data")
    if saved_data is not None and saved_data != _data_checksums(state.data):
        raise DataError(f"the token data of {state.run_dir} changed since checkpoint {checkpoint.name} (its shards' "
                        f"sha256 differ): resume with the data it was trained on, or start a new run")
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
    """Weights and optimizer states into this run's model (collective under fsdp2)."""
    try:
        if weights is None:  # a sharded checkpoint (torch.distributed.checkpoint), any strategy
            with_state = trainer.get("sharded", {}).get("optimizer_state_params", [])
            note = load_sharded(checkpoint / SHARDED_DIR, state.model, state.optimizers, with_state)
            if note is not None and state.dist.is_main:
                _warn(note)
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
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot resume from {checkpoint}: {first_line(exc)}") from None


def _restore_counters(state: TrainState, checkpoint: Path, meta: dict, trainer: dict) -> int:
    """RNG states, loader position and counters; returns the world size the checkpoint was saved by."""
    env = state.dist
    try:
        saved_world = int(meta.get("world_size", 1))
        by_rank = trainer.get("rng_ranks") or [trainer["rng"]]
        if env.rank < len(by_rank):
            _set_rng_state(by_rank[env.rank])
        else:  # more processes than saved this run: a fresh stream of its own, past the ones used so far
            torch.manual_seed(rank_seed(state.config.train.seed, env.rank) ^ int(meta["step"]))
        state.loader.load_state_dict(meta["loader"])
        state.step, state.tokens_seen = int(meta["step"]), int(meta["tokens_seen"])
        state.flops_seen, state.elapsed = meta.get("flops_seen", 0.0), meta.get("elapsed", 0.0)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot resume from {checkpoint}: {first_line(exc)}") from None
    return saved_world


def _restore(state: TrainState, checkpoint: Path) -> int:
    """Load everything of one checkpoint into `state`; a partly applied checkpoint that then fails
    is fully overwritten by the next one tried (weights, optimizer states, RNGs, loader all are).
    Each phase is agreed on by every process, so all raise the same error at the same point.
    Returns the world size that saved it."""
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
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in rng["cuda"]])
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))


def _trim_metrics(state: TrainState) -> None:
    """Keep the metrics up to the resumed step; rows logged after that checkpoint are logged again.
    A line cut short by a crash is dropped."""
    log = state.run_dir / "metrics.jsonl"
    kept = []
    for line in (log.read_text().splitlines() if log.exists() else []):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step", 0) <= state.step:
            kept.append(line)
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
    """The metrics up to this step reach the disk before the checkpoint after them."""
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
    trainer = {"optimizers": [], "rng": rng, "sharded": {"optimizer_state_params": with_state}}
    if rng_ranks is not None:
        trainer["rng_ranks"] = rng_ranks

    def finish() -> Path:
        write_checkpoint_files(tmp, run_dir, step, weights, trainer, meta)
        return commit_checkpoint(run_dir, step, train.keep_last)

    on_main(finish)
    return checkpoint_folder(run_dir, step)


def validate(state: TrainState, max_batches: int | None = None) -> dict[str, float]:
    """Validation loss / perplexity / bits per byte. Every process of a job evaluates the same
    batches (under fsdp2 each forward is collective); rank 0 logs them."""
    cfg = state.config
    batches = cfg.train.eval_batches if max_batches is None else max_batches
    if isinstance(state.data, ChatData):  # the loss on the assistant's tokens of held-out conversations
        with autocast_for(state.device, cfg.train.dtype):
            return evaluate_batches(state.model, masked_batches(state.data.val, cfg.train.batch_size, batches or None),
                                    state.tokenizer.token_byte_lengths())
    with autocast_for(state.device, cfg.train.dtype):
        return evaluate_loss(state.model, state.data.val, state.tokenizer.token_byte_lengths(),
                             cfg.train.batch_size, cfg.model.sequence_len, max_batches=batches or None)


def _log(state: TrainState, row: dict[str, Any]) -> None:
    """Append a row to metrics.jsonl as strict JSON: a NaN or infinity is written as null. Only
    rank 0 writes (every process keeps the rows in `state.history`)."""
    state.history.append(row)
    if not state.dist.is_main:
        return
    try:
        with open(state.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
    except OSError as exc:
        raise OutputError(f"cannot write {state.run_dir / 'metrics.jsonl'}: {exc.strerror or exc}") from None


NO_STEP = -1  # the guard's "no non-finite step seen yet"


class FiniteGuard:
    """Stops a diverged run: remembers the first step whose gradient norm was NaN or infinite.

    On an accelerator the flag stays on the device (reading it every step would stall the queue
    of kernels) and is read at log intervals and before each save; on the CPU it is read every
    step, before the optimizer touches the weights. The loss is a host float already and is
    checked at once everywhere.
    """

    def __init__(self, device: torch.device):
        self.deferred = device.type != "cpu"
        self.first_bad = torch.full((), NO_STEP, dtype=torch.long, device=device) if self.deferred else None

    @staticmethod
    def fail(step: int, what: str, value: float | str) -> NonFiniteError:
        return NonFiniteError(f"training diverged at step {step}: the {what} is {value}; stopped without saving "
                              f"it (the last checkpoint is kept); try a lower learning rate")

    def observe_loss(self, loss: float, step: int) -> None:
        if not math.isfinite(loss):
            raise self.fail(step, "loss", loss)

    def observe_grad_norm(self, norm: torch.Tensor, step: int) -> None:
        if not self.deferred:
            if not math.isfinite(float(norm)):
                raise self.fail(step, "gradient norm", float(norm))
            return
        newly_bad = ~torch.isfinite(norm) & (self.first_bad == NO_STEP)
        self.first_bad = torch.where(newly_bad, torch.full_like(self.first_bad, step), self.first_bad)

    def check(self) -> None:
        if self.deferred and int(self.first_bad) != NO_STEP:
            raise self.fail(int(self.first_bad), "gradient norm", "not finite")


@dataclass
class StepOutcome:
    loss: float  # the reported loss, averaged over the micro-batches and the processes
    metrics: dict[str, Any]  # what the objective reports of its last micro-batch (fbt's passes, rgpt's depth)


def train_step(model: nn.Module, forward_model: nn.Module, objective: Objective,
               next_batch: Callable[[], tuple[torch.Tensor, ...]], step: int,
               optimizers: list[torch.optim.Optimizer], train: TrainConfig, device: torch.device,
               guard: FiniteGuard) -> StepOutcome:
    """One optimizer step, the one `fit` and the benchmarks take: `train.grad_accum` micro-batches
    (each `next_batch()` -> x, y[, loss mask]) through the objective under the run's autocast, each
    loss backward scaled by 1 / grad_accum (gradients are reduced across processes on the last one
    only), the loss averaged over processes and checked, the gradient norm clipped and checked (a
    non-finite one raises before the optimizer touches the weights, on the CPU), then every
    optimizer's step. The learning rate is the caller's (`set_lr`). `step` is 0-based: the
    objective's draws are seeded by it, and `guard` reports a failure as step + 1."""
    loss_sum, metrics = 0.0, {}
    for micro in range(train.grad_accum):
        with gradient_sync(model, forward_model, sync=micro == train.grad_accum - 1):
            x, y, *rest = next_batch()  # sft batches also carry the loss mask
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            masked = {"loss_mask": rest[0].to(device, non_blocking=True)} if rest else {}
            with autocast_for(device, train.dtype):
                result = objective(forward_model, x, y, step, **masked)
            (result.loss / train.grad_accum).backward()
        loss_sum += result.reported_loss / train.grad_accum
        metrics = result.metrics
    loss_sum = mean_across_ranks(loss_sum, device)
    guard.observe_loss(loss_sum, step + 1)
    guard.observe_grad_norm(grad_norm(model, train.grad_clip), step + 1)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return StepOutcome(loss_sum, metrics)


def fit(state: TrainState, progress: bool = True, max_seconds: float | None = None) -> dict[str, Any]:
    """Train until `train.steps` (or until `max_seconds` of training have passed in this call),
    evaluating and checkpointing on schedule; returns a summary. Holds the run folder's lock
    throughout (rank 0); a NaN or infinite loss or gradient stops the run with `NonFiniteError`
    (on every process at the same step: the loss is averaged over them and the gradients are
    shared)."""
    if state.dist.is_main:
        if state.lock is None:
            state.lock = RunLock(state.run_dir)
        state.lock.acquire()  # a no-op when setup's lock is still held
    try:
        return _fit(state, progress and state.dist.is_main, max_seconds)
    except NonFiniteError as exc:
        if state.dist.world_size > 1:
            exc.shared = True  # every process stops at the same step with the same line: rank 0 prints it
        raise
    finally:
        if state.lock is not None:
            state.lock.release()


def _fit(state: TrainState, progress: bool, max_seconds: float | None) -> dict[str, Any]:
    cfg, model = state.config.train, state.model
    guard = state.guard = FiniteGuard(state.device)
    forward_model = state.forward_model if state.forward_model is not None else model
    flops_model = state.flops if state.flops is not None else FlopsMemo(model)
    tokens_per_step = state.global_batch * state.config.model.sequence_len
    model.train()
    bar = tqdm(total=cfg.steps, initial=state.step, disable=not progress, desc="train", dynamic_ncols=True)
    window_start, window_tokens = time.perf_counter(), 0
    train_loss = float("nan")
    deadline = time.perf_counter() + max_seconds if max_seconds is not None else float("inf")

    def out_of_time() -> bool:  # one decision for every process, else some would wait for the others
        return max_seconds is not None and any_rank(time.perf_counter() >= deadline, state.device)

    try:
        while state.step < cfg.steps and not out_of_time():
            step_start = time.perf_counter()
            multiplier = lr_multiplier(state.step, cfg)
            set_lr(state.optimizers, multiplier)
            outcome = train_step(model, forward_model, state.objective, state.loader.next_batch, state.step,
                                 state.optimizers, cfg, state.device, guard)
            loss_sum, extra = outcome.loss, outcome.metrics
            state.flops_seen += state.objective.flops_per_token(flops_model, state.step) * tokens_per_step
            state.step += 1
            state.tokens_seen += tokens_per_step
            state.elapsed += time.perf_counter() - step_start
            window_tokens += tokens_per_step
            train_loss = loss_sum
            stopping = out_of_time()
            if state.step % cfg.log_every == 0 or state.step == cfg.steps or stopping:
                guard.check()
                now = time.perf_counter()
                tok_per_s = window_tokens / max(now - window_start, 1e-9)
                window_start, window_tokens = now, 0
                lr = cfg.lr * multiplier
                spread = ({"world_size": state.dist.world_size, "global_batch": state.global_batch}
                          if state.dist.world_size > 1 else {})
                _log(state, {"step": state.step, "loss": train_loss, "lr": lr, "tokens": state.tokens_seen,
                             "flops": state.flops_seen, "tok_per_s": tok_per_s, "elapsed": state.elapsed, **spread,
                             **extra})
                bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_per_s:,.0f}")
            bar.update(1)
            if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < cfg.steps:
                _log(state, {"step": state.step, **{f"val_{k}": v for k, v in validate(state).items()}})
                model.train()
            if cfg.save_every and state.step % cfg.save_every == 0 and state.step < cfg.steps:
                save(state)
            if stopping:
                break
    finally:  # also when the run stops (diverged, interrupted): the error starts a line of its own
        bar.close()
    final = validate(state)
    _log(state, {"step": state.step, **{f"val_{k}": v for k, v in final.items()}})
    checkpoint = save(state)
    return {"step": state.step, "train_loss": train_loss, "tokens": state.tokens_seen, "flops": state.flops_seen,
            "elapsed": state.elapsed, "params": state.model.num_params(), "checkpoint": str(checkpoint),
            "world_size": state.dist.world_size, "strategy": cfg.strategy, "global_batch": state.global_batch,
            "precision": resolve_dtype(state.device, cfg.dtype),
            **{f"val_{k}": v for k, v in final.items()}}
