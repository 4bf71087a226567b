"""gpt: the nanochat-style baseline decoder. Its model is the shared backbone itself
(`latentloop.models.backbone.GPT`, config `latentloop.config.ModelConfig`), trained on the next-token loss."""

from ...config import ModelConfig
from ...models.backbone import GPT
from ...objectives.base import NextTokenObjective
from ..registry import ArchSpec, register

SPEC = register(ArchSpec("gpt", "nanochat-style decoder (the baseline)", ModelConfig, GPT, NextTokenObjective))
