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

    def logs_after(self, step: int) -> bool:
        """Whether the trainer logs after optimizer step `step` (0-based): its metrics row is the
        only place the per-step gate readings go, and reading them syncs with the device."""
        done = step + 1
        return done % self.train_config.log_every == 0 or done == self.train_config.steps

    def __call__(self, model: nn.Module, x: Tensor, y: Tensor, step: int, loss_mask: Tensor | None = None
                 ) -> LossResult:
        steps = self.depth_for_step(step)
        no_grad = min(self.model_config.truncate_steps, steps - 1)
        record = self.logs_after(step)
        out = model(x, steps=steps, no_grad_steps=no_grad, record_gates=record)
        metrics: dict[str, float] = {"steps": steps}
        if record:  # effective openness ||h^(r) - h^(r-1)|| / ||o^(r)|| and the mean gate, per step r
            metrics |= {f"openness_r{r}": v for r, v in enumerate(out.openness, start=1)}
            metrics |= {f"gate_mean_r{r}": v for r, v in enumerate(out.gate_means, start=1)}
        return LossResult(token_cross_entropy(out.logits, y, mask=loss_mask), metrics)

    def forward_mix(self, step: int | None = None) -> list[tuple[float, dict]]:
        if step is not None:
            return [(1.0, {"steps": self.depth_for_step(step)})]
        R = self.model_config.recurrence_steps
        return [(1.0 / R, {"steps": r}) for r in range(1, R + 1)]  # r ~ Uniform{1..R}
