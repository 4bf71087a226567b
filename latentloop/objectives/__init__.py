"""Training objectives, kept outside the models.

A model returns logits and latents; an objective decides how to call it (passes, subsets, depth)
and how to turn the outputs into a loss. The trainer only knows the `Objective` interface; each
architecture names its objective in its spec (`latentloop.archs`).
"""

from .base import IGNORE_INDEX, LossResult, NextTokenObjective, Objective, token_cross_entropy, trained_targets

__all__ = ["IGNORE_INDEX", "LossResult", "NextTokenObjective", "Objective", "token_cross_entropy",
           "trained_targets"]
