"""What a run trains: `TrainState` (model, data, objective, optimizers, counters), the FLOPs
memo, each rank's seed and the trainer's stderr lines."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..checkpoint import RunLock
from ..config import RunConfig
from ..data import TokenData, TokenLoader
from ..data.chat import ChatData
from ..distributed import DistEnv
from ..objectives import Objective
from .step import accumulation

if TYPE_CHECKING:  # the loop's guard (the loop imports this module)
    from .loop import FiniteGuard

# Config fields that setup fills in (from the tokenizer) or that only say where a cache lives.
SET_ON_SETUP = ("vocab_size", "bos_id", "cache_dir")


# train settings that belong to one launch, not to the run: never saved, nor a change on resume
ONE_OFF_TRAIN_FIELDS = ("profile_steps",)


def config_as_given(config: RunConfig, strategy: str) -> dict:
    """The run config as config.json keeps it: train.strategy as the user gave it, not what it
    resolved to in this launch. Why: auto resolved in one process is none, and a run that recorded
    none was refused when resumed under torchrun, though the user never chose none; what ran is in
    every checkpoint's state.json and in the log. Without the one-off settings of a launch
    (`ONE_OFF_TRAIN_FIELDS`): a `--profile` given to one resume was kept, and every later resume
    profiled again."""
    raw = config.to_dict()
    raw["train"]["strategy"] = strategy
    for name in ONE_OFF_TRAIN_FIELDS:
        raw["train"].pop(name, None)
    return raw



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
    init_from: str | None = None  # the run it started from (absolute), kept in every checkpoint's state.json
    dist: DistEnv = field(default_factory=DistEnv)  # this process's rank in the job (a single process by default)
    flops: FlopsMemo | None = None  # the objective's FLOPs per token, counted once per kind of forward
    trackers: list = field(default_factory=list)  # rank 0, while fit runs: TensorBoard / W&B (train.trackers)
    # a resume's changed train settings, written into the run's config.json by the next save (written at
    # once, a resume that died before its first checkpoint left them for a later plain --resume, unsaid)
    config_unsaved: bool = False
    given_strategy: str | None = None  # train.strategy as the user gave it (auto, say): what config.json keeps

    def config_as_saved(self) -> dict:
        """The run config as the run's config.json keeps it (`config_as_given`)."""
        return config_as_given(self.config, self.given_strategy or self.config.train.strategy)

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step (`train.grad_accum`, or what `train.batch_tokens` makes it)."""
        return accumulation(self.config.train, self.config.model.sequence_len, self.dist.world_size)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, over every process: micro-batch x accumulation x world size."""
        return self.config.train.batch_size * self.accumulation * self.dist.world_size


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


def warn(message: str) -> None:
    print(f"latentloop: warning: {message}", file=sys.stderr)


def note(message: str) -> None:
    print(f"latentloop: {message}", file=sys.stderr)


def rank_seed(seed: int, rank: int) -> int:
    """The torch seed of rank `rank`'s own stream (training noise), distinct for every rank."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] % (2**63))

