"""The objective interface and the baseline next-token objective."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig, TrainConfig

IGNORE_INDEX = -100  # F.cross_entropy's default: a target that counts for nothing
# Rows of logits the eager loss upcasts to float32 at a time (`_ChunkedCrossEntropy`): 8M elements,
# 32 MB of float32 per chunk, against 3.3 GB for the whole batch of gpt2 at 16 x 1024 tokens
CHUNK_ELEMENTS = 8 * 2**20
# The chunked loss takes over where the batch's float32 logits would pass this size. Below it the plain
# loss is faster (one fused log-softmax and its backward; the chunked one writes its gradient apart:
# 1.3-1.4x the time at 4096 x 8192 fp32 on 2 CPU threads, 1.15x in bf16) and the memory it would save
# is small.
CHUNKED_ABOVE_BYTES = 256 * 2**20


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The weighted cross-entropy sum of (N, V) logits over `denominator`, computed in float32 a chunk
    of rows at a time, its gradient with respect to the logits computed in the same pass and kept
    in the logits' dtype: the float32 logits and log-probabilities of the whole batch are never
    stored (plain autograd keeps both: 8 bytes per logit on top of a bf16 run's 2). The gradient is
    (softmax - one_hot) x weight / denominator, the plain path's to rounding (tests/test_objectives_loss.py)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, weights: Tensor, denominator: Tensor) -> Tensor:
        rows = max(1, CHUNK_ELEMENTS // logits.shape[1])
        grad = torch.empty_like(logits)
        total = logits.new_zeros((), dtype=torch.float32)
        scale = weights / denominator  # (N,): each row's share of the mean
        for start in range(0, logits.shape[0], rows):
            part = slice(start, start + rows)
            target = targets[part, None]
            log_probs = torch.log_softmax(logits[part].float(), dim=-1)  # a new tensor: the logits stay as they are
            total = total - (log_probs.gather(1, target).squeeze(1) * weights[part]).sum()
            probs = log_probs.exp_().scatter_add_(1, target, torch.full_like(target, -1, dtype=log_probs.dtype))
            grad[part] = probs.mul_(scale[part, None])
        ctx.save_for_backward(grad)
        return total / denominator

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor):
        grad, = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None


def _chunked_applies(logits: Tensor, reduction: str) -> bool:
    """The chunked loss is for eager training: a compiled graph fuses the upcast into the loss's own
    reductions (nothing stored either), and without gradients nothing is kept anyway."""
    return (reduction == "mean" and logits.requires_grad and torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and logits.numel() * 4 > CHUNKED_ABOVE_BYTES)


REDUCTIONS = ("mean", "sum", "none")


def trained_targets(y: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """(B, T) bool: the targets a loss is a mean over (`token_cross_entropy`), those not IGNORE_INDEX
    and, with a loss mask, marked by it: what the trainer's and the objectives' counts count."""
    counted = y != IGNORE_INDEX
    return counted if loss_mask is None else counted & loss_mask.bool()


def token_cross_entropy(logits: Tensor, targets: Tensor, reduction: str = "mean", mask: Tensor | None = None
                        ) -> Tensor:
    """Cross-entropy of (B, T, V) logits against (B, T) targets, computed in float32. The targets that
    count are those not IGNORE_INDEX and, with a (B, T) bool `mask` (SFT: the assistant's tokens),
    marked by it: "mean" is over them (0 when there are none: a micro-batch without one weighs 0 in
    the trainer, and 0 x NaN would still be NaN), "sum" sums them, "none" gives each position's loss
    (0 where it does not count). Eager training on large batches of logits takes the chunked path
    (`_ChunkedCrossEntropy`: the same loss and gradients to rounding, without the float32 logits of the
    whole batch)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    flat_targets = targets.flatten()  # (B*T,)
    counted = trained_targets(targets, mask).flatten()  # (B*T,) bool
    if _chunked_applies(logits, reduction):
        weights = counted.float()
        return _ChunkedCrossEntropy.apply(logits.flatten(0, 1), flat_targets.clamp(min=0), weights,
                                          weights.sum().clamp(min=1))
    if mask is None and reduction != "none":
        # torch's own sum: over its count, bit for bit its "mean" (which is NaN where nothing counts)
        total = F.cross_entropy(logits.flatten(0, 1).float(), flat_targets, reduction="sum")
    else:
        losses = F.cross_entropy(logits.flatten(0, 1).float(), flat_targets, reduction="none")  # (B*T,), 0 if ignored
        if mask is not None:
            losses = losses * mask.flatten().to(losses.dtype)
        if reduction == "none":
            return losses
        total = losses.sum()
    return total if reduction == "sum" else total / counted.sum().clamp(min=1)


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

    - `plan(step, x, loss_mask, draw)`: what the step draws on the host (pass counts, depths, prefix
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

    def plan(self, step: int, x: Tensor, loss_mask: Tensor | None = None, draw: int = 0) -> dict[str, Any]:
        """The host-side draws of optimizer step `step` (0-based), as `loss`'s keyword arguments.
        `draw`: which of the step's batches `x` is, over its micro-batches and processes (the global
        batch micro x processes + rank). What shapes the step's graph (a pass count, a depth) must
        not depend on it: every micro-batch and process runs the same graph."""
        return {}

    def loss(self, model: nn.Module, x: Tensor, y: Tensor, loss_mask: Tensor | None = None, **plan) -> LossResult:
        raise NotImplementedError

    def target_terms(self, y: Tensor, loss_mask: Tensor) -> list[int] | None:
        """For a masked loss that is a sum of means over different subsets of the targets (lrt's column
        subsets): each term's count of trained targets in this micro-batch, on the host. The trainer
        then gives `loss` `term_shares`, (terms,) on the device: each term's share of the step's
        trained targets of that term (`parallel.micro_batch_term_shares`), and `loss` returns its loss
        and float metrics already weighed by them (the trainer adds them up), so that a step of several
        micro-batches or processes gives one batch's loss and gradients. None (the default): a single
        mean over the batch's trained targets, which the trainer weighs by the micro-batch's share."""
        return None

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
