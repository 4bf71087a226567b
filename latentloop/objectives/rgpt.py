"""RecurrentGPT's objective: a random depth per optimizer step, one cross-entropy at the end.

r ~ Uniform{1..R} is drawn from an RNG seeded by (seed, step), so every data-parallel rank and a
resumed run draw the same depth; no auxiliary losses. With `truncate_steps = n` the first n steps
run without gradient (truncated backprop through depth).
"""

from __future__ import annotations

import numpy as np
from torch import Tensor, nn

from .base import LossResult, Objective, token_cross_entropy


class RecurrentDepthObjective(Objective):
    name = "rgpt_random_depth"

    def depth_for_step(self, step: int) -> int:
        rng = np.random.default_rng([self.train_config.seed, step])
        return int(rng.integers(1, self.model_config.recurrence_steps + 1))

    def __call__(self, model: nn.Module, x: Tensor, y: Tensor, step: int, loss_mask: Tensor | None = None
                 ) -> LossResult:
        steps = self.depth_for_step(step)
        no_grad = min(self.model_config.truncate_steps, steps - 1)
        out = model(x, steps=steps, no_grad_steps=no_grad)
        return LossResult(token_cross_entropy(out.logits, y, mask=loss_mask), {"steps": steps})

    def forward_mix(self, step: int | None = None) -> list[tuple[float, dict]]:
        if step is not None:
            return [(1.0, {"steps": self.depth_for_step(step)})]
        R = self.model_config.recurrence_steps
        return [(1.0 / R, {"steps": r}) for r in range(1, R + 1)]  # r ~ Uniform{1..R}
