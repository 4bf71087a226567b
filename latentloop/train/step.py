"""The device's part of a training step: the model and its objective's loss as one module
(`ModelAndLoss`, what `train.compile` compiles as one graph and DDP wraps), one micro-batch through
it (`micro_batch_loss`), the token batch (`accumulation`) and the reading of device values at log
time (`host_values`).

A step holds nothing between the kernels: the objective's host decisions (pass counts, depths,
prefix masks) are drawn before the graph (`Objective.plan`), the graph computes the forwards and the
loss (`Objective.loss`; its backward is the compiled backward graph), and the losses and metrics
stay on the device until the trainer logs. Under `train.compile` a step compiles once per distinct
plan (fbt's K, rgpt's depth) and never again, through training and validation alternating
(tests/test_step_graphs.py counts dynamo's frames and graph breaks for every architecture).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from ..config import TrainConfig
from ..errors import ConfigError
from ..objectives import Objective


class ModelAndLoss(nn.Module):
    """The model and its objective's loss as one module: `forward(x, y, loss_mask, plan)` returns
    (loss to back-propagate, the loss to report (detached), the objective's metrics). Compiled whole
    (`train.compile`), the cross-entropy sits in the same graph as the model, so the fp32 logits of
    the whole batch are never stored (inductor fuses the upcast into the loss's reductions), and the
    step's Python, the objective's included, runs once, at tracing. The model is a submodule: its
    parameters are this module's, under the prefix `model.` (state dicts are taken from the model
    itself, never from this wrapper)."""

    def __init__(self, model: nn.Module, objective: Objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, x: Tensor, y: Tensor, loss_mask: Tensor | None, plan: dict[str, Any]
                ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        result = self.objective.loss(self.model, x, y, loss_mask, **plan)
        return result.loss, result.reported_loss, result.metrics


def _is_model_and_loss(module: nn.Module) -> bool:
    inner = getattr(module, "_orig_mod", module)  # compiled
    inner = getattr(inner, "module", inner)  # DDP
    return isinstance(inner, ModelAndLoss)


def _takes_draw(plan: Callable) -> bool:
    """Whether an objective's `plan` takes `draw` (added on 12-06): an objective of one's own written
    before it, `plan(step, x, loss_mask)`, keeps working, its draws the step's alone as they were.
    Read once per plan function, not per micro-batch (`_signature_takes_draw`)."""
    return _signature_takes_draw(getattr(plan, "__func__", plan))


@functools.lru_cache(maxsize=64)
def _signature_takes_draw(function: Callable) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == "draw" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)


def micro_batch_loss(forward_model: nn.Module, objective: Objective, x: Tensor, y: Tensor,
                     loss_mask: Tensor | None, step: int, draw: int = 0, term_shares: Tensor | None = None
                     ) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """One micro-batch's (loss, reported loss, metrics) at optimizer step `step`, the step's batch
    `draw` over its micro-batches and processes: the objective's plan drawn here, on the host, then
    the loss through `forward_model`, a `ModelAndLoss` (possibly compiled or wrapped by DDP) or a
    plain model (eager, or compiled by itself). `term_shares`: the loss terms' shares of the step's
    targets (`Objective.target_terms`), which the loss then weighs itself by."""
    drawn = (draw,) if _takes_draw(objective.plan) else ()
    plan = objective.plan(step, x, loss_mask, *drawn)
    if term_shares is not None:
        plan = {**plan, "term_shares": term_shares}
    if _is_model_and_loss(forward_model):
        return forward_model(x, y, loss_mask, plan)
    result = objective.loss(forward_model, x, y, loss_mask, **plan)
    return result.loss, result.reported_loss, result.metrics


def host_values(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics with every device value read back as a Python float (a sync: at log time only)."""
    return {k: float(v) if isinstance(v, Tensor) else v for k, v in metrics.items()}


def accumulation(train: TrainConfig, sequence_len: int, world_size: int) -> int:
    """Micro-batches per optimizer step: `train.grad_accum`, or, when `train.batch_tokens` sets the
    global batch in tokens, that many tokens over (micro-batch x sequence length x processes), as
    nanoGPT's and torchtitan's token batches: the micro-batch fills the device (the largest that fits:
    `benchmarks/gpu_bench.py` finds it), accumulation makes up the rest. It must divide exactly."""
    if not train.batch_tokens:
        return train.grad_accum
    per_micro = train.batch_size * sequence_len * world_size
    if train.grad_accum != 1:
        raise ConfigError(f"give train.batch_tokens or train.grad_accum, not both (batch_tokens="
                          f"{train.batch_tokens:,} sets the accumulation itself)")
    if train.batch_tokens % per_micro:
        raise ConfigError(f"train.batch_tokens={train.batch_tokens:,} is not a multiple of one micro-batch's "
                          f"tokens over the processes ({train.batch_size} x {sequence_len} x {world_size} = "
                          f"{per_micro:,}); try {max(1, round(train.batch_tokens / per_micro)) * per_micro:,}")
    return train.batch_tokens // per_micro


def compiled_step_graphs(objective: Objective) -> int:
    """How many graphs a compiled step may keep: one per kind of forward the objective runs (its
    `forward_mix` over the run: fbt's pass counts, rgpt's depths and their truncations, lrt's one),
    for training and for validation's eval mode, and a few shapes besides (a last short batch)."""
    return 2 * len(objective.forward_mix()) + 4

