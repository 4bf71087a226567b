"""The rfbt objective: fbt's scheduled multi-pass loss at a depth rgpt's sampling draws per step.

    L = L_1 + λ/(K-1) Σ_{k=2..K} L_k,     every pass run at depth r

- K, the prefixes and the SFT fuse mask: fbt's (`archs/fbt/objective.py`), drawn from (seed, step).
- r: rgpt's (`archs/rgpt/objective.py`, `depth_sampling` uniform or heavy_tail), drawn from (seed, step)
  with a generator of its own (independent of K), so every data-parallel rank and a resumed run
  draw the same (K, r); one depth for all K passes of a step, as a decoded token's depth is fixed
  across the tokens it feeds.
- Truncated backprop through depth (`backprop_steps`, `truncate_steps`): rgpt's rule, in every pass.
- FLOPs: every (K, r) forward a step runs, weighted by the product of the two draws' shares (the
  draws are independent), counted structurally.
"""

from __future__ import annotations

from ..fbt.objective import MultiPassObjective
from ..rgpt.objective import RecurrentDepthObjective


class RecurrentMultiPassObjective(MultiPassObjective, RecurrentDepthObjective):
    name = "rfbt_multipass_random_depth"
    # the depth's generator, (seed, step, 1): apart from the pass count's (seed, step). A step's second
    # micro-batch draws its prefix from the same (seed, step, 1) (`_rng(step, draw=1)`), so the two share
    # a stream there: that micro-batch's prefix seed is a function of the step's depth draw (through
    # torch's seeding). Kept: another stream would change every rfbt run's depths, the ladder's among them
    DEPTH_STREAM = 1

    def forward_options(self, step: int) -> dict:
        """The depth of optimizer step `step` and how many of its first core steps run without gradient."""
        depth = self.depth_for_step(step)
        return {"steps": depth, "no_grad_steps": self.no_grad_steps(depth)}

    def forward_mix(self, step: int | None = None) -> list[tuple[float, dict]]:
        passes = MultiPassObjective.forward_mix(self, step)
        depths = RecurrentDepthObjective.forward_mix(self, step)
        return [(w_pass * w_depth, {**by_pass, **by_depth})
                for w_pass, by_pass in passes for w_depth, by_depth in depths]
