"""The latent recurrent transformer's training procedures (selected by `recurrence` in its config).

- interleaved (default): loss (L_init + Σ_i L_i) / (S + 1), each term the mean over its own
  positions (the init pass over all of them, subset i over {t : t mod S = i}); no stop-gradient.
  The logged loss is the merged estimate's next-token loss, the subsets' token-weighted mean (they
  partition the positions), as lrt is scored; the composite also averages in the zero-memory pass.
- multi_refine: the mean of the K passes' losses; the logged loss is the last pass's.
- sequential, chunked: one loss over all positions.

FLOPs are charged honestly: interleaved runs every token through the stack twice (init pass +
one refinement), multi_refine K times, and the naive sequential reference re-runs every prefix.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...objectives.base import LossResult, Objective, token_cross_entropy, trained_targets


class LRTObjective(Objective):
    name = "lrt_recurrence"

    def target_terms(self, y: Tensor, loss_mask: Tensor) -> list[int] | None:
        """Interleaved: each term's trained targets (the init pass's over every column, subset i's over
        its own), so that micro-batches weigh each term's tokens as one batch's mean does; the other
        procedures' terms all cover every column (one share per micro-batch serves)."""
        if self.model_config.recurrence != "interleaved":
            return None
        subsets = min(self.model_config.subsets, loss_mask.shape[1])
        trained = trained_targets(y, loss_mask)  # (B, T)
        return [int(trained.sum())] + [int(trained[:, i::self.model_config.subsets].sum()) for i in range(subsets)]

    def loss(self, model: nn.Module, x: Tensor, y: Tensor, loss_mask: Tensor | None = None,
             term_shares: Tensor | None = None, **plan) -> LossResult:
        """`term_shares` (terms,): the trainer's weighing of each term over the step's micro-batches
        (`target_terms`); the loss and the metrics come back weighed by them."""
        recurrence = self.model_config.recurrence
        out = model(x, recurrence=recurrence)
        next_token = None  # the loss of what lrt predicts (its scoring's), where `loss` is a composite
        if recurrence == "interleaved":  # each term over its own columns, masked by theirs
            losses = [token_cross_entropy(logits, y[:, columns], mask=None if loss_mask is None else
                                          loss_mask[:, columns])
                      for logits, columns in zip(out.pass_logits, out.pass_columns)]
            if len(losses) > 1:  # the subsets' means weighed by their trained targets: the merged estimate's
                trained = trained_targets(y, loss_mask)  # (B, T)
                counts = torch.stack([trained[:, columns].sum() for columns in out.pass_columns[1:]]).float()
                # their targets are the init pass's (the subsets partition the columns): its share weighs it
                next_token = (torch.stack(losses[1:]) * counts).sum() / counts.sum().clamp(min=1) \
                    * (1.0 if term_shares is None else term_shares[0])
        elif recurrence == "multi_refine":
            losses = [token_cross_entropy(logits, y, mask=loss_mask) for logits in out.pass_logits]
            next_token = losses[-1]
        else:
            losses = [token_cross_entropy(out.logits, y, mask=loss_mask)]
        if term_shares is not None:
            losses = [term * share for term, share in zip(losses, term_shares.unbind())]
        loss = sum(losses) / len(losses)
        return LossResult(loss, {"loss_init": losses[0].detach(), "loss_final": losses[-1].detach()}
                          if len(losses) > 1 else {}, None if next_token is None else next_token.detach())

    def forward_mix(self, step: int | None = None) -> list[tuple[float, dict]]:
        recurrence = self.model_config.recurrence
        if recurrence == "sequential":
            # the naive reference re-runs every prefix: (T + 1) / 2 one-pass forwards per token on
            # average (probing the real prefixes would cost O(T^2) forwards)
            return [((self.model_config.sequence_len + 1) / 2, {"recurrence": "chunked"})]
        return [(1.0, {"recurrence": recurrence})]
