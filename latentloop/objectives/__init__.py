"""Training objectives, kept outside the models.

A model returns logits and latents; an objective decides how to call it (passes, subsets, depth)
and how to turn the outputs into a loss. The trainer only knows the `Objective` interface, so a new
architecture brings its objective by registering it here, without editing the trainer.
"""

from __future__ import annotations

from ..config import ModelConfig, TrainConfig
from ..errors import ConfigError
from .base import LossResult, NextTokenObjective, Objective, token_cross_entropy

OBJECTIVES: dict[str, type[Objective]] = {"gpt": NextTokenObjective}


def register_objective(arch: str):
    def wrap(cls: type[Objective]) -> type[Objective]:
        OBJECTIVES[arch] = cls
        return cls
    return wrap


def _register_variants() -> None:
    from .fbt import MultiPassObjective
    from .lrt import LRTObjective
    from .rgpt import RecurrentDepthObjective

    OBJECTIVES.update(fbt=MultiPassObjective, lrt=LRTObjective, rgpt=RecurrentDepthObjective)


_register_variants()


def objective_for(model_config: ModelConfig, train_config: TrainConfig) -> Objective:
    if model_config.arch not in OBJECTIVES:
        raise ConfigError(f"no training objective is registered for arch {model_config.arch!r}")
    return OBJECTIVES[model_config.arch](model_config, train_config)


__all__ = ["LossResult", "NextTokenObjective", "Objective", "OBJECTIVES", "objective_for", "register_objective",
           "token_cross_entropy"]
