"""Training as functions: `setup` -> `fit` (which calls `validate` and `save`), as litgpt's pretrain.

    state = setup(run_config, "runs/name")          # validates everything before writing anything
    summary = fit(state)                             # progress bar, JSONL metrics, checkpoints
    metrics = validate(state)                        # val loss / ppl / bpb

The trainer knows models only through `forward` and objectives only through the `Objective`
interface, so each architecture brings its own training procedure.
"""

from __future__ import annotations

import json
import os
import random
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
    check_resumable,
    list_checkpoints,
    load_weights,
    read_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
)
from .config import RunConfig
from .data import TokenData, TokenLoader, load_tokenizer
from .errors import CheckpointError
from .eval import evaluate_loss
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
    data: TokenData
    loader: TokenLoader
    objective: Objective
    optimizers: list[torch.optim.Optimizer]
    device: torch.device
    step: int = 0
    tokens_seen: int = 0
    flops_seen: float = 0.0
    elapsed: float = 0.0  # seconds of training, across resumes
    forward_model: nn.Module | None = None  # the compiled model when train.compile is on
    history: list[dict[str, Any]] = field(default_factory=list)
    init_report: dict[str, Any] | None = None  # what --init-from loaded (see latentloop.interop.upcycle)


def _check_run_folder(run_dir: Path, config: RunConfig, resume: bool) -> None:
    saved = run_dir / "config.json"
    if saved.is_file():
        if not resume:
            raise CheckpointError(f"{run_dir} already holds a run; pass --resume to continue it or choose another "
                                  f"output folder")
        try:
            previous = json.loads(saved.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"corrupt {saved}: {exc}") from None
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
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise CheckpointError(f"{run_dir} exists and is not empty; choose another output folder")


def setup(config: RunConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
          init_from: str | Path | None = None) -> TrainState:
    """Build tokenizer, data, model, objective and optimizers; nothing is written until all succeed."""
    run_dir = Path(run_dir)
    _check_run_folder(run_dir, config, resume)
    if resume and list_checkpoints(run_dir):
        check_resumable(resolve_checkpoint(run_dir))  # before any data is prepared
    tokenizer = load_tokenizer(str(run_dir / "tokenizer.json") if resume else config.data.tokenizer)
    config.model.vocab_size, config.model.bos_id = tokenizer.vocab_size, tokenizer.bos_id
    config.model.__post_init__()
    device = resolve_device(config.train.device)
    torch.manual_seed(config.train.seed)
    data = prepare_data(config, tokenizer, progress)
    loader = TokenLoader(data.train, config.train.batch_size, config.model.sequence_len, seed=config.train.seed)
    model = build_model(config.model)
    init_report = initialise_from(model, init_from) if init_from is not None else None
    model = model.to(device)
    objective = build_objective(config.model, config.train)
    optimizers = build_optimizers(model, config.train)
    state = TrainState(config, run_dir, model, tokenizer, data, loader, objective, optimizers, device,
                       init_report=init_report)
    state.forward_model = torch.compile(model) if config.train.compile else model

    run_dir.mkdir(parents=True, exist_ok=True)
    if resume and list_checkpoints(run_dir):
        _restore(state, resolve_checkpoint(run_dir))
    else:
        config.save_json(run_dir / "config.json")
        tokenizer.save(run_dir)
        (run_dir / "metrics.jsonl").write_text("")
    return state


def _restore(state: TrainState, checkpoint: Path) -> None:
    load_weights(state.model, checkpoint)
    meta, trainer = read_trainer_state(checkpoint)
    for opt, opt_state in zip(state.optimizers, trainer["optimizers"]):
        opt.load_state_dict(opt_state)
    torch.set_rng_state(trainer["rng"]["torch"])
    if torch.cuda.is_available() and trainer["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state_all(trainer["rng"]["cuda"])
    np.random.set_state(trainer["rng"]["numpy"])
    random.setstate(trainer["rng"]["python"])
    state.loader.load_state_dict(meta["loader"])
    state.step, state.tokens_seen = meta["step"], meta["tokens_seen"]
    state.flops_seen, state.elapsed = meta.get("flops_seen", 0.0), meta.get("elapsed", 0.0)
    # keep the metrics of the steps we resume from; drop rows logged after that checkpoint
    log = state.run_dir / "metrics.jsonl"
    rows = [line for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    kept = [r for r in rows if json.loads(r).get("step", 0) <= state.step]
    tmp = log.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(r + "\n" for r in kept))
    os.replace(tmp, log)


def save(state: TrainState) -> Path:
    trainer = {"optimizers": [opt.state_dict() for opt in state.optimizers],
               "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                       "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    meta = {"step": state.step, "tokens_seen": state.tokens_seen, "flops_seen": state.flops_seen,
            "elapsed": state.elapsed, "loader": state.loader.state_dict()}
    return save_checkpoint(state.run_dir, state.step, state.model, trainer, meta, state.config.train.keep_last)


def validate(state: TrainState, max_batches: int | None = None) -> dict[str, float]:
    cfg = state.config
    batches = cfg.train.eval_batches if max_batches is None else max_batches
    with autocast_for(state.device, cfg.train.dtype):
        return evaluate_loss(state.model, state.data.val, state.tokenizer.token_byte_lengths(),
                             cfg.train.batch_size, cfg.model.sequence_len, max_batches=batches or None)


def _log(state: TrainState, row: dict[str, Any]) -> None:
    state.history.append(row)
    with open(state.run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def fit(state: TrainState, progress: bool = True, max_seconds: float | None = None) -> dict[str, Any]:
    """Train until `train.steps` (or until `max_seconds` of training have passed in this call),
    evaluating and checkpointing on schedule; returns a summary."""
    cfg, model = state.config.train, state.model
    forward_model = state.forward_model if state.forward_model is not None else model
    tokens_per_step = cfg.batch_size * cfg.grad_accum * state.config.model.sequence_len
    model.train()
    bar = tqdm(total=cfg.steps, initial=state.step, disable=not progress, desc="train", dynamic_ncols=True)
    window_start, window_tokens = time.perf_counter(), 0
    train_loss = float("nan")
    deadline = time.perf_counter() + max_seconds if max_seconds is not None else float("inf")
    while state.step < cfg.steps and time.perf_counter() < deadline:
        step_start = time.perf_counter()
        multiplier = lr_multiplier(state.step, cfg)
        set_lr(state.optimizers, multiplier)
        loss_sum, extra = 0.0, {}
        for _ in range(cfg.grad_accum):
            x, y = state.loader.next_batch()
            x, y = x.to(state.device, non_blocking=True), y.to(state.device, non_blocking=True)
            with autocast_for(state.device, cfg.dtype):
                result = state.objective(forward_model, x, y, state.step)
            (result.loss / cfg.grad_accum).backward()
            loss_sum += result.reported_loss / cfg.grad_accum
            extra = result.metrics
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
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
    bar.close()
    final = validate(state)
    _log(state, {"step": state.step, **{f"val_{k}": v for k, v in final.items()}})
    checkpoint = save(state)
    return {"step": state.step, "train_loss": train_loss, "tokens": state.tokens_seen, "flops": state.flops_seen,
            "elapsed": state.elapsed, "params": state.model.num_params(), "checkpoint": str(checkpoint),
            **{f"val_{k}": v for k, v in final.items()}}

