"""Models: the shared backbone and one thin file per variant.

`build_model(config)` picks the class registered for `config.arch`.
"""

from __future__ import annotations

from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .backbone import GPT, ModelOutput, norm
from .cache import KVCache

MODEL_CLASSES: dict[str, type[nn.Module]] = {"gpt": GPT}


def register_model(arch: str):
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        MODEL_CLASSES[arch] = cls
        return cls
    return wrap


def _register_variants() -> None:
    from .fbt import FBT
    from .lrt import LRT
    from .rgpt import RGPT

    MODEL_CLASSES.update(fbt=FBT, lrt=LRT, rgpt=RGPT)


_register_variants()


def build_model(config: ModelConfig) -> nn.Module:
    if config.arch not in MODEL_CLASSES:
        raise ConfigError(f"no model is registered for arch {config.arch!r}")
    return MODEL_CLASSES[config.arch](config)


__all__ = ["GPT", "KVCache", "ModelOutput", "build_model", "norm", "register_model", "MODEL_CLASSES"]
