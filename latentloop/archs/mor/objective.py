"""The Mixture-of-Recursions objective: the next-token loss plus the router's auxiliary loss.

    L = CE + λ · L_router,    λ = `router_aux_weight`

- expert choice: L_router is the binary cross-entropy of each recursion's router scores against the
  top-k selection (summed over recursions), which teaches the scores the causal threshold decoding
  uses (`archs/mor/model.py`); the forward takes the top-k training route.
- token choice: L_router is the load-balancing loss N_r Σ_j f_j P_j.

SFT (a `loss_mask` is given): packed rows end in padding (`data/chat.py`), which the objective is
not told apart from the loss mask; the forward gets the row's real tokens as its `pad_mask`
(`real_inputs`), so that padding is no top-k candidate, counts for no k_r and carries no router
loss, and a real token's logits do not change with the padding after it. Pretraining (no mask)
runs the forward it always ran. A step of several SFT micro-batches weighs each loss term by its own
tokens (`target_terms`): the next-token loss by the trained targets, each router term by the tokens it
is a mean over (`MoRConfig.router_loss_counts`), so that expert choice's step gives one batch's loss
and gradients. Token choice's balance loss is a product of two means (N_r Σ_j f_j P_j), which no
weighing of micro-batches makes the whole batch's: it is weighed by its real tokens, as MoE
trainers weigh theirs.

No random draws: the routing is a function of the batch, the same on every rank. The trainer logs
the next-token loss (comparable across architectures), the router loss and, on log steps, the share
of tokens each recursion kept. FLOPs: the forward the step runs (expert choice: the top-k route,
which runs the core on the kept tokens only; token choice: every token through every recursion,
the ones not routed there masked).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...objectives.base import LossResult, Objective, token_cross_entropy, trained_targets


def real_inputs(loss_mask: Tensor) -> Tensor:
    """The inputs (B, T) of a packed SFT row that are not its closing padding: every input up to the one
    whose target is the row's last trained token, and that token itself as an input. Packing places
    whole conversations and pads the rest of the row with untrained targets (`pack_conversations`);
    no pad id reaches the objective, so the padding is read off the loss mask. (A row whose last
    conversation ends in untrained tokens counts that tail as padding too: no loss reads it, and it
    would compete with the trained tokens for the top-k.) Tensor code only (a compiled step's graph)."""
    trained_from_here = loss_mask.flip(1).long().cumsum(dim=1).flip(1) > 0  # (B, T): a trained target at or after t
    return torch.cat([trained_from_here[:, :1], trained_from_here[:, :-1]], dim=1)


class RoutedRecursionObjective(Objective):
    name = "mor_next_token_with_router_loss"

    def forward_options(self) -> dict:
        """Expert choice trains by its top-k route; token choice computes every recursion (masked)."""
        return {"route": "topk"} if self.model_config.routing == "expert" else {"every_recursion": True}

    def target_terms(self, y: Tensor, loss_mask: Tensor) -> list[int] | None:
        """The trained targets, then each router term's tokens (`MoRConfig.router_loss_counts`, summed
        over the rows): the router loss is a mean over a row's real inputs, not its targets, so that a
        micro-batch weighed by its targets weighed its router loss wrongly."""
        rows = [self.model_config.router_loss_counts(count) for count in real_inputs(loss_mask).sum(dim=1).tolist()]
        return [int(trained_targets(y, loss_mask).sum()), *(sum(column) for column in zip(*rows))]

    def loss(self, model: nn.Module, x: Tensor, y: Tensor, loss_mask: Tensor | None = None,
             term_shares: Tensor | None = None, **plan) -> LossResult:
        """`term_shares` (1 + router terms,): the trainer's weighing of each term over the step's
        micro-batches (`target_terms`); the loss and the metrics come back weighed by them."""
        real = None if loss_mask is None else real_inputs(loss_mask)
        out = model(x, pad_mask=real, **self.forward_options())
        next_token = token_cross_entropy(out.logits, y, mask=loss_mask)
        router, active = out.aux_terms, out.active_share(real)
        if term_shares is not None:
            shares = term_shares.unbind()
            next_token = next_token * shares[0]
            router = [term * share for term, share in zip(router, shares[1:])]
            active = [value * shares[1] for value in active]  # means over the real tokens, as the first term
        router_loss = sum(router[1:], router[0]) if router else None
        loss = next_token if router_loss is None else next_token + self.model_config.router_aux_weight * router_loss
        # on the device: the trainer reads them on the steps it logs
        metrics: dict[str, Tensor] = {} if router_loss is None else {"router_loss": router_loss.detach()}
        metrics |= {f"active_r{r}": share for r, share in enumerate(active, start=1)}
        return LossResult(loss, metrics, next_token_loss=next_token.detach())

    def forward_mix(self, step: int | None = None) -> list[tuple[float, dict]]:
        return [(1.0, self.forward_options())]
