"""Convergence / exit criteria as small objects (as Huginn's per-iteration exit evaluators).

A criterion compares an iterate with the previous one and says, per row, whether the iteration
has settled. The same objects serve rgpt's adaptive exit (per decoded token), fbt's
`passes="auto"` prefill and the contraction analysis.

    criterion = RelativeChange(threshold=1e-3)
    criterion.value(h_new, h_old)          # (...,) the measured change
    criterion.settled(h_new, h_old)        # (...,) bool: value < threshold

`compares` says what the iteration must hand it ("state" or "logprobs").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

NORM_FLOOR = 1e-12  # keeps the relative change finite for an all-zero state


@dataclass(frozen=True)
class RelativeChange:
    """||new - old|| / ||new|| over the last dimension (states)."""

    threshold: float
    compares = "state"  # what an iteration hands it: successive states

    def value(self, new: Tensor, old: Tensor) -> Tensor:
        return (new - old).norm(dim=-1) / new.norm(dim=-1).clamp_min(NORM_FLOOR)

    def settled(self, new: Tensor, old: Tensor) -> Tensor:
        return self.value(new, old) < self.threshold


@dataclass(frozen=True)
class KLDivergence:
    """KL(p_new || p_old) over the last dimension, from log-probabilities."""

    threshold: float
    compares = "logprobs"  # successive next-token log-distributions

    def value(self, new_logp: Tensor, old_logp: Tensor) -> Tensor:
        return (new_logp.exp() * (new_logp - old_logp)).sum(dim=-1)

    def settled(self, new_logp: Tensor, old_logp: Tensor) -> Tensor:
        return self.value(new_logp, old_logp) < self.threshold
