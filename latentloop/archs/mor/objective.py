"""The Mixture-of-Recursions objective: the next-token loss plus the router's auxiliary loss.

    L = CE + λ · L_router,    λ = `router_aux_weight`

- expert choice: L_router is the binary cross-entropy of each recursion's router scores against the
  top-k selection (summed over recursions), which teaches the scores the causal threshold decoding
  uses (`models/mor.py`); the forward takes the top-k training route.
- token choice: L_router is the load-balancing loss N_r Σ_j f_j P_j.

No random draws: the routing is a function of the batch, the same on every rank. The trainer logs
the next-token loss (comparable across architectures), the router loss and, on log steps, the share
of tokens each recursion kept. FLOPs: the forward the step runs (expert choice: the top-k route,
which runs the core on the kept tokens only; token choice: every token through every recursion,
the ones not routed there masked).
"""

from __future__ import annotations

from torch import Tensor, nn

from ...objectives.base import LossResult, Objective, token_cross_entropy


class RoutedRecursionObjective(Objective):
    name = "mor_next_token_with_router_loss"

    def forward_options(self) -> dict:
        """Expert choice trains by its top-k route; token choice computes every recursion (masked)."""
        return {"route": "topk"} if self.model_config.routing == "expert" else {"every_recursion": True}

    def loss(self, model: nn.Module, x: Tensor, y: Tensor, loss_mask: Tensor | None = None, **plan) -> LossResult:
        out = model(x, **self.forward_options())
        next_token = token_cross_entropy(out.logits, y, mask=loss_mask)
        loss = next_token if out.aux_loss is None else next_token + self.model_config.router_aux_weight * out.aux_loss
        # on the device: the trainer reads them on the steps it logs
        metrics: dict[str, Tensor] = {} if out.aux_loss is None else {"router_loss": out.aux_loss.detach()}
        metrics |= {f"active_r{r}": share for r, share in enumerate(out.active_share(), start=1)}
        return LossResult(loss, metrics, next_token_loss=next_token.detach())

    def forward_mix(self, step: int | None = None) -> list[tuple[float, dict]]:
        return [(1.0, self.forward_options())]
