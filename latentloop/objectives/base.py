"""The objective interface and the baseline next-token objective."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig, TrainConfig


def token_cross_entropy(logits: Tensor, targets: Tensor, reduction: str = "mean", mask: Tensor | None = None
                        ) -> Tensor:
    """Cross-entropy of (B, T, V) logits against (B, T) targets, computed in float32. With a (B, T)
    bool `mask` (SFT: the assistant's tokens) the mean is over the targets it marks (0 when none)."""
    if mask is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    weights = mask.flatten().to(losses.dtype)
    if reduction == "none":
        return losses * weights
    return (losses * weights).sum() / weights.sum().clamp(min=1)


@dataclass
class LossResult:
    loss: Tensor  # scalar to back-propagate
    metrics: dict[str, float] = field(default_factory=dict)  # extra values for the log (e.g. passes used)
    next_token_loss: float | None = None  # the plain next-token loss, when `loss` is a composite objective

    @property
    def reported_loss(self) -> float:
        """What the trainer logs as "loss": comparable across architectures and objectives."""
        return float(self.loss.detach()) if self.next_token_loss is None else self.next_token_loss


class Objective:
    """Turns (model, batch, step) into a loss. Subclasses define a variant's training procedure."""

    name = "objective"

    def __init__(self, model_config: ModelConfig, train_config: TrainConfig):
        self.model_config = model_config
        self.train_config = train_config

    def __call__(self, model: nn.Module, x: Tensor, y: Tensor, step: int, loss_mask: Tensor | None = None
                 ) -> LossResult:
        """`loss_mask` (B, T) bool: the targets that count (SFT: the assistant's tokens); None = all."""
        raise NotImplementedError

    def forward_mix(self, step: int | None = None) -> list[tuple[float, dict]]:
        """The forwards one optimizer step runs, as (weight, forward keyword arguments); with
        `step` None, the average over the run (e.g. over the drawn pass counts)."""
        return [(1.0, {})]

    def flops_per_token(self, model: nn.Module, step: int | None = None) -> float:
        """Training FLOPs charged per token (forward + backward), counted structurally on the
        forwards of `forward_mix`; `step` None = the run's average."""
        return sum(weight * model.flops_per_token(**kwargs) for weight, kwargs in self.forward_mix(step))


class NextTokenObjective(Objective):
    """Plain next-token prediction: one forward, mean cross-entropy."""

    name = "next_token"

    def __call__(self, model: nn.Module, x: Tensor, y: Tensor, step: int, loss_mask: Tensor | None = None
                 ) -> LossResult:
        return LossResult(token_cross_entropy(model(x).logits, y, mask=loss_mask))
