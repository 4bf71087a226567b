"""RecurrentGPT's objective: a random depth per optimizer step, one cross-entropy at the end.

The depth r of an optimizer step follows `depth_sampling` (model.DEPTH_SAMPLINGS):
- uniform (the RecurrentGPT paper): r ~ Uniform{1..R};
- heavy_tail (Huginn's log-normal Poisson, the baseline the paper compares against):
  tau ~ N(log r̄ - σ²/2, σ), r = Poisson(e^tau) + 1, capped at MAX_RECURRENCE_STEPS (the tail is
  unbounded; the cap bounds one step's forward).
Either is drawn from an RNG seeded by (seed, step) alone, so every data-parallel rank and a resumed
run draw the same depth; no auxiliary losses.

Truncated backprop through depth: with `truncate_steps = n` the first n steps run without gradient;
with `backprop_steps = k` only the last k do (the first r - k run without). At least the last step
always keeps its gradient.

FLOPs are charged by the depth actually run: the forward of all r steps, the backward (twice a
forward, models/flops.py) of the prelude, the r - n steps with gradient, the coda and the head. The
no-grad steps' backward never runs and is not charged. As a forward's count is affine in its depth,
that is (1/3) x count(r) + (2/3) x count(r - n) in training FLOPs (`forward_mix`).
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cached_property

import numpy as np
from torch import Tensor, nn

from ...models.flops import BACKWARD_FACTOR
from ...objectives.base import LossResult, Objective, token_cross_entropy
from .model import MAX_RECURRENCE_STEPS, RGPTConfig

# A log-normal rate above this many times the cap is clamped to it before the Poisson draw: numpy
# refuses rates near 1e19 (σ is unbounded), and a Poisson of 4 x the cap falls below the cap with
# probability < e^-400 (a Chernoff bound), so the capped depth is the cap either way.
RATE_CEILING = 4 * MAX_RECURRENCE_STEPS
RUN_DEPTH_DRAWS = 200_000  # draws a run's depth shares are counted from (every step's, in a run this short)


def draw_depth(config: RGPTConfig, seed: int, step: int, stream: int = 0) -> int:
    """The depth of optimizer step `step`: a pure function of (config, seed, step). `stream` > 0
    draws from a generator of its own, independent of other draws seeded by (seed, step) (an
    objective that also draws its pass count from them)."""
    rng = np.random.default_rng([seed, step] if stream == 0 else [seed, step, stream])
    if config.depth_sampling == "uniform":
        return int(rng.integers(1, config.recurrence_steps + 1))
    sigma = config.depth_sigma
    tau = rng.normal(math.log(config.heavy_tail_mean) - sigma ** 2 / 2, sigma)  # E[e^tau] = r̄
    rate = math.exp(min(tau, math.log(RATE_CEILING)))
    return min(int(rng.poisson(rate)) + 1, MAX_RECURRENCE_STEPS)


class RecurrentDepthObjective(Objective):
    name = "rgpt_random_depth"
    DEPTH_STREAM = 0  # see draw_depth

    def depth_for_step(self, step: int) -> int:
        return draw_depth(self.model_config, self.train_config.seed, step, self.DEPTH_STREAM)

    def no_grad_steps(self, steps: int) -> int:
        """How many of the first steps of an r-step forward run without gradient."""
        k = self.model_config.backprop_steps
        if k is not None:
            return max(steps - k, 0)
        return min(self.model_config.truncate_steps, steps - 1)

    def plan(self, step: int, x: Tensor, loss_mask: Tensor | None = None, draw: int = 0) -> dict:
        steps = self.depth_for_step(step)
        return {"steps": steps, "no_grad_steps": self.no_grad_steps(steps)}

    def loss(self, model: nn.Module, x: Tensor, y: Tensor, loss_mask: Tensor | None = None, steps: int = 1,
             no_grad_steps: int = 0) -> LossResult:
        # every step records each recurrence step's effective openness ||h^(r) - h^(r-1)|| / ||o^(r)||
        # and mean gate (two reductions, kept on the device): one graph per depth whether the trainer
        # logs the step or not; it reads them on the steps it logs
        out = model(x, steps=steps, no_grad_steps=no_grad_steps, record_gates=True)
        metrics: dict[str, Tensor | int] = {"steps": steps}
        metrics |= {f"openness_r{r}": v for r, v in enumerate(out.openness, start=1)}
        metrics |= {f"gate_mean_r{r}": v for r, v in enumerate(out.gate_means, start=1)}
        return LossResult(token_cross_entropy(out.logits, y, mask=loss_mask), metrics)

    def depth_mix(self, steps: int) -> list[tuple[float, dict]]:
        """The training FLOPs of an r-step forward as counted forwards (see the module docstring)."""
        with_grad = steps - self.no_grad_steps(steps)
        if with_grad == steps:
            return [(1.0, {"steps": steps})]
        forward_share = 1 / BACKWARD_FACTOR  # a count is BACKWARD_FACTOR x its forward
        return [(forward_share, {"steps": steps}), (1 - forward_share, {"steps": with_grad})]

    @cached_property
    def _run_depth_shares(self) -> dict[int, float]:
        """heavy_tail: the share of the run's steps that draw each depth (the tail has no closed-form
        average once capped; ~15 µs a draw). Every step's draw up to RUN_DEPTH_DRAWS steps, else the
        draws of that many steps spread evenly over the run (each step's draw is independent of
        its place): `plan` of 10^9 steps took hours."""
        steps = self.train_config.steps
        stride = max(1, steps // RUN_DEPTH_DRAWS)
        counts = Counter(self.depth_for_step(step) for step in range(0, steps, stride))
        drawn = sum(counts.values())
        return {r: n / drawn for r, n in sorted(counts.items())}

    def forward_mix(self, step: int | None = None) -> list[tuple[float, dict]]:
        if step is not None:
            return self.depth_mix(self.depth_for_step(step))
        if self.model_config.depth_sampling == "uniform":
            R = self.model_config.recurrence_steps
            depths = {r: 1.0 / R for r in range(1, R + 1)}  # r ~ Uniform{1..R}
        else:  # the run's own draws: every depth its steps run, each by its share of the steps
            depths = self._run_depth_shares
        return [(share * weight, kwargs) for r, share in depths.items() for weight, kwargs in self.depth_mix(r)]

