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
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
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
    check_resumable,
    checkpoint_candidates,
    fsync_dir,
    json_safe,
    list_checkpoints,
    load_weights,
    read_trainer_state,
    recover_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
    set_aside_broken,
)
from .config import RunConfig, apply_overrides, extended_rope_theta
from .data import TokenData, TokenLoader, load_tokenizer
from .data.chat import ChatData, ChatLoader, is_chat_source, masked_batches, prepare_chat
from .errors import CheckpointError, ConfigError, DataError, NonFiniteError, OutputError
from .eval import evaluate_loss
from .eval.loss import evaluate_batches
from .interop.upcycle import initialise_from
from .objectives import Objective
from .optim import build_optimizers, lr_multiplier, set_lr
from .runtime import autocast_for, prepare_data, resolve_device

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
    lock: RunLock | None = None  # held from setup to the end of fit: one writer per run folder
    guard: FiniteGuard | None = None  # fit's divergence check, consulted again before every save
    init_report: dict[str, Any] | None = None  # what --init-from loaded (see latentloop.interop.upcycle)


def _warn(message: str) -> None:
    print(f"latentloop: warning: {message}", file=sys.stderr)


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
    """Build tokenizer, data, model, objective and optimizers; nothing is written until all succeed."""
    run_dir = Path(run_dir)
    _check_output_path(run_dir)
    _check_stage(config, resume, init_from)
    _check_run_folder(run_dir, config, resume)
    if resume and list_checkpoints(run_dir):
        check_resumable(resolve_checkpoint(run_dir))  # before any data is prepared
    tokenizer = load_tokenizer(str(run_dir / "tokenizer.json") if resume else config.data.tokenizer)
    sft = config.train.stage == "sft"
    if sft:
        tokenizer = tokenizer.with_chat_tokens()  # already there on resume: the same tokenizer back
    config.model.vocab_size, config.model.bos_id = tokenizer.vocab_size, tokenizer.bos_id
    config.model.__post_init__()
    device = resolve_device(config.train.device)
    torch.manual_seed(config.train.seed)
    if sft:
        data = prepare_chat(config.data.source, tokenizer, config.model.sequence_len, config.data.val_fraction)
        counts = data.meta["train"]
        if counts["dropped"] or counts["cut"]:  # a context too short for the data should not pass unnoticed
            _warn(f"{counts['dropped']} training conversations longer than a row of {config.model.sequence_len + 1} "
                  f"tokens were dropped (no assistant token fits) and {counts['cut']} cut; "
                  f"{counts['conversations']} are trained on")
        loader = ChatLoader(data.train, config.train.batch_size, seed=config.train.seed)
    else:
        data = prepare_data(config, tokenizer, progress)
        loader = TokenLoader(data.train, config.train.batch_size, config.model.sequence_len, seed=config.train.seed)
    model = build_model(config.model)
    init_report = initialise_from(model, init_from, grow_vocab=sft) if init_from is not None else None
    model = model.to(device)
    objective = build_objective(config.model, config.train)
    optimizers = build_optimizers(model, config.train)
    state = TrainState(config, run_dir, model, tokenizer, data, loader, objective, optimizers, device,
                       init_report=init_report)
    state.forward_model = torch.compile(model) if config.train.compile else model

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create output folder {run_dir}: {exc.strerror or exc}") from None
    state.lock = RunLock(run_dir).acquire()
    try:
        _check_run_folder(run_dir, config, resume)  # again, locked: another run may have started here meanwhile
        if resume:
            try:
                _resume(state)
            except OSError as exc:  # renaming leftovers or broken checkpoints aside
                raise OutputError(f"cannot repair {run_dir / 'checkpoints'}: {exc.strerror or exc}") from None
        else:
            config.save_json(run_dir / "config.json")
            try:
                tokenizer.save(run_dir)
                (run_dir / "metrics.jsonl").write_text("")
            except OSError as exc:
                raise OutputError(f"cannot write into {run_dir}: {exc.strerror or exc}") from None
    except BaseException:
        state.lock.release()
        raise
    return state


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
# fbt's base run already went through its plain single-pass phase: later stages mix passes from step 0.
STAGE_MODEL_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "fbt": {"sft": {"feedback_start": 0.0}, "extend": {"feedback_start": 0.0}},
}


def stage_config(stage: str, init_from: str | Path, overrides: list[str] = (), data: str | None = None,
                 flags: dict[str, Any] | None = None) -> RunConfig:
    """The config of an sft / extend run from its base run: the base's model (shape, arch, its
    tokenizer), the stage's defaults (`STAGE_DEFAULTS`), then `flags` ({"section.key": value}) and
    `overrides` ("key=value"). For extend, a `sequence_len` above the base's scales `rope_theta` by
    `extended_rope_theta` unless the overrides set rope_theta themselves."""
    from .checkpoint import read_run_config

    checkpoint = resolve_checkpoint(init_from)
    base = read_run_config(checkpoint)
    tokenizer_file = next((p for p in (checkpoint / "tokenizer.json", checkpoint.parent.parent / "tokenizer.json")
                           if p.is_file()), None)
    if tokenizer_file is None:
        raise CheckpointError(f"no tokenizer.json found for --init-from {init_from}")
    raw = base.to_dict()
    raw["train"] = {"stage": stage, "seed": base.train.seed, "batch_size": base.train.batch_size,
                    "device": base.train.device, "dtype": base.train.dtype}
    raw["data"] = {"source": base.data.source, "tokenizer": str(tokenizer_file), "val_fraction": base.data.val_fraction,
                   "max_bytes": base.data.max_bytes}
    for key, value in {**STAGE_DEFAULTS[stage], **{f"model.{k}": v for k, v in
                                                  STAGE_MODEL_DEFAULTS.get(base.model.arch, {}).get(stage, {}).items()},
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
    is set aside with a warning; with none loadable the run is refused, never restarted from step 0."""
    for note in recover_checkpoints(state.run_dir):
        _warn(note)
    candidates = checkpoint_candidates(state.run_dir)
    if not candidates:
        raise CheckpointError(f"cannot resume: {state.run_dir} holds no checkpoint yet (a run saves one every "
                              f"save_every steps and at the end); start it again in a new folder")
    failed: list[tuple[Path, CheckpointError]] = []
    for checkpoint in reversed(candidates):
        try:
            _restore(state, checkpoint)
        except CheckpointError as exc:
            failed.append((checkpoint, exc))
            continue
        for broken, reason in failed:
            kept = set_aside_broken(broken)
            _warn(f"{reason}; moved it to {kept.name} and resumed from {checkpoint.name}")
        _trim_metrics(state)
        return
    newest, reason = failed[0]
    raise CheckpointError(f"cannot resume: no checkpoint of {state.run_dir} loads (newest {newest.name}: {reason})")


def _data_checksums(data: TokenData) -> dict[str, str] | None:
    return data.meta.get("sha256")


def _restore(state: TrainState, checkpoint: Path) -> None:
    """Load everything of one checkpoint into `state`; a partly applied checkpoint that then fails
    is fully overwritten by the next one tried (weights, optimizer states, RNGs, loader all are)."""
    meta, trainer = read_trainer_state(checkpoint)
    saved_data = meta.get("data")
    if saved_data is not None and saved_data != _data_checksums(state.data):
        raise DataError(f"the token data of {state.run_dir} changed since checkpoint {checkpoint.name} (its shards' "
                        f"sha256 differ): resume with the data it was trained on, or start a new run")
    load_weights(state.model, checkpoint)
    try:
        if len(trainer["optimizers"]) != len(state.optimizers):
            raise ValueError(f"{len(trainer['optimizers'])} optimizer states for {len(state.optimizers)} optimizers")
        for opt, opt_state in zip(state.optimizers, trainer["optimizers"]):
            opt.load_state_dict(opt_state)
        rng = trainer["rng"]
        torch.set_rng_state(torch.as_tensor(rng["torch"], dtype=torch.uint8))
        if torch.cuda.is_available() and rng.get("cuda") is not None:
            torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in rng["cuda"]])
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
        state.loader.load_state_dict(meta["loader"])
        state.step, state.tokens_seen = int(meta["step"]), int(meta["tokens_seen"])
        state.flops_seen, state.elapsed = meta.get("flops_seen", 0.0), meta.get("elapsed", 0.0)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot resume from {checkpoint}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
                              ) from None


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


def save(state: TrainState) -> Path:
    """Checkpoint the run; refused (`NonFiniteError`) when training has diverged since the last check."""
    if state.guard is not None:
        state.guard.check()
    rng = {"torch": torch.get_rng_state().tolist(),
           "numpy": [v.tolist() if isinstance(v, np.ndarray) else v for v in np.random.get_state()],
           "python": [v if not isinstance(v, tuple) else list(v) for v in random.getstate()],
           "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None}
    trainer = {"optimizers": [opt.state_dict() for opt in state.optimizers], "rng": rng}
    meta = {"step": state.step, "tokens_seen": state.tokens_seen, "flops_seen": state.flops_seen,
            "elapsed": state.elapsed, "loader": state.loader.state_dict(), "data": _data_checksums(state.data)}
    log = state.run_dir / "metrics.jsonl"
    try:
        with open(log, "a") as f:  # the metrics up to this step reach the disk before the checkpoint after them
            os.fsync(f.fileno())
    except OSError as exc:
        raise OutputError(f"cannot write {log}: {exc.strerror or exc}") from None
    return save_checkpoint(state.run_dir, state.step, state.model, trainer, meta, state.config.train.keep_last)


def validate(state: TrainState, max_batches: int | None = None) -> dict[str, float]:
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
    """Append a row to metrics.jsonl as strict JSON: a NaN or infinity is written as null."""
    state.history.append(row)
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


def _grad_norm(model: nn.Module, clip: float) -> torch.Tensor:
    """The total gradient norm, clipping to `clip` when it is > 0 (without clipping: measured only)."""
    if clip > 0:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))


def fit(state: TrainState, progress: bool = True, max_seconds: float | None = None) -> dict[str, Any]:
    """Train until `train.steps` (or until `max_seconds` of training have passed in this call),
    evaluating and checkpointing on schedule; returns a summary. Holds the run folder's lock
    throughout; a NaN or infinite loss or gradient stops the run with `NonFiniteError`."""
    if state.lock is None:
        state.lock = RunLock(state.run_dir)
    state.lock.acquire()  # a no-op when setup's lock is still held
    try:
        return _fit(state, progress, max_seconds)
    finally:
        state.lock.release()


def _fit(state: TrainState, progress: bool, max_seconds: float | None) -> dict[str, Any]:
    cfg, model = state.config.train, state.model
    guard = state.guard = FiniteGuard(state.device)
    forward_model = state.forward_model if state.forward_model is not None else model
    tokens_per_step = cfg.batch_size * cfg.grad_accum * state.config.model.sequence_len
    model.train()
    bar = tqdm(total=cfg.steps, initial=state.step, disable=not progress, desc="train", dynamic_ncols=True)
    window_start, window_tokens = time.perf_counter(), 0
    train_loss = float("nan")
    deadline = time.perf_counter() + max_seconds if max_seconds is not None else float("inf")
    try:
        while state.step < cfg.steps and time.perf_counter() < deadline:
            step_start = time.perf_counter()
            multiplier = lr_multiplier(state.step, cfg)
            set_lr(state.optimizers, multiplier)
            loss_sum, extra = 0.0, {}
            for _ in range(cfg.grad_accum):
                x, y, *rest = state.loader.next_batch()  # sft batches also carry the loss mask
                x, y = x.to(state.device, non_blocking=True), y.to(state.device, non_blocking=True)
                masked = {"loss_mask": rest[0].to(state.device, non_blocking=True)} if rest else {}
                with autocast_for(state.device, cfg.dtype):
                    result = state.objective(forward_model, x, y, state.step, **masked)
                (result.loss / cfg.grad_accum).backward()
                loss_sum += result.reported_loss / cfg.grad_accum
                extra = result.metrics
            guard.observe_loss(loss_sum, state.step + 1)
            guard.observe_grad_norm(_grad_norm(model, cfg.grad_clip), state.step + 1)
            for opt in state.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            state.flops_seen += state.objective.flops_per_token(model, state.step) * tokens_per_step
            state.step += 1
            state.tokens_seen += tokens_per_step
            state.elapsed += time.perf_counter() - step_start
            window_tokens += tokens_per_step
            train_loss = loss_sum
            if state.step % cfg.log_every == 0 or state.step == cfg.steps or time.perf_counter() >= deadline:
                guard.check()
                now = time.perf_counter()
                tok_per_s = window_tokens / max(now - window_start, 1e-9)
                window_start, window_tokens = now, 0
                lr = cfg.lr * multiplier
                _log(state, {"step": state.step, "loss": train_loss, "lr": lr, "tokens": state.tokens_seen,
                             "flops": state.flops_seen, "tok_per_s": tok_per_s, "elapsed": state.elapsed, **extra})
                bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_per_s:,.0f}")
            bar.update(1)
            if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < cfg.steps:
                _log(state, {"step": state.step, **{f"val_{k}": v for k, v in validate(state).items()}})
                model.train()
            if cfg.save_every and state.step % cfg.save_every == 0 and state.step < cfg.steps:
                save(state)
    finally:  # also when the run stops (diverged, interrupted): the error starts a line of its own
        bar.close()
    final = validate(state)
    _log(state, {"step": state.step, **{f"val_{k}": v for k, v in final.items()}})
    checkpoint = save(state)
    return {"step": state.step, "train_loss": train_loss, "tokens": state.tokens_seen, "flops": state.flops_seen,
            "elapsed": state.elapsed, "params": state.model.num_params(), "checkpoint": str(checkpoint),
            **{f"val_{k}": v for k, v in final.items()}}

