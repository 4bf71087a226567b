"""The objective interface and the baseline next-token objective."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    """What one objective call returns. Nothing here is read on the host: the metrics' tensors stay
    on the device (0-d), and the trainer reads them, and the reported loss, only on the steps it
    logs (a read waits for the device; inside a compiled step it would also break the graph)."""

    loss: Tensor  # scalar to back-propagate
    metrics: dict[str, Tensor | int | float] = field(default_factory=dict)  # extra values for the log
    next_token_loss: Tensor | None = None  # the plain next-token loss (detached), when `loss` is a composite

    @property
    def reported_loss(self) -> Tensor:
        """What the trainer logs as "loss" (a detached 0-d tensor): comparable across architectures
        and objectives."""
        return (self.loss if self.next_token_loss is None else self.next_token_loss).detach()


class Objective:
    """Turns (model, batch, step) into a loss. Subclasses define a variant's training procedure in
    two parts, so that a compiled training step holds no host decision:

    - `plan(step, x, loss_mask)`: what the step draws on the host (pass counts, depths, prefix
      masks), as keyword arguments of `loss`: Python numbers, which a compiled step specialises on
      (one graph per distinct plan, compiled once), and tensors, which are its inputs;
    - `loss(model, x, y, loss_mask, **plan)`: the forwards and the loss, tensor code only (no
      `.item()`, no branch on a tensor's value), which `torch.compile` traces as one graph.

    Calling the objective runs both."""

    name = "objective"

    def __init__(self, model_config: ModelConfig, train_config: TrainConfig):
        self.model_config = model_config
        self.train_config = train_config

    def __call__(self, model: nn.Module, x: Tensor, y: Tensor, step: int, loss_mask: Tensor | None = None
                 ) -> LossResult:
        """`loss_mask` (B, T) bool: the targets that count (SFT: the assistant's tokens); None = all."""
        return self.loss(model, x, y, loss_mask, **self.plan(step, x, loss_mask))

    def plan(self, step: int, x: Tensor, loss_mask: Tensor | None = None) -> dict[str, Any]:
        """The host-side draws of optimizer step `step` (0-based), as `loss`'s keyword arguments."""
        return {}

    def loss(self, model: nn.Module, x: Tensor, y: Tensor, loss_mask: Tensor | None = None, **plan) -> LossResult:
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

    def loss(self, model: nn.Module, x: Tensor, y: Tensor, loss_mask: Tensor | None = None, **plan) -> LossResult:
        return LossResult(token_cross_entropy(model(x).logits, y, mask=loss_mask))
