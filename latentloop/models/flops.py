"""Structural FLOP counting: run a forward on a few probe tokens and count what it touches.

Matrix multiplications are counted by torch's `FlopCounterMode` (every `mm`/`addmm`: the linear
layers the forward actually runs, the tied head included, once per pass, step or subset that runs
them); attention is counted per attention-layer application as 2 · 2 · D per (query, key) pair, with the
average causal context of half the keys it attends over per query, scaled from the probe to
seq_len (QK^T and AV): seq_len / 2 keys for a whole-sequence pass. The backward costs twice the forward,
so training FLOPs per token = 3 x forward (as nanochat's `estimate_flops`).

A new architecture needs no formula: whatever its forward runs is counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ..util import evaluating
from . import flex

PROBE_TOKENS = 16  # matmul FLOPs per token do not depend on the length; attention is added per seq_len
MATMUL_OPS = ("mm", "addmm")  # linear layers; batched matmuls (bmm) belong to attention, counted apart
BACKWARD_FACTOR = 3  # forward + backward (twice the forward)


def _eager_stance() -> contextlib.AbstractContextManager:
    """Compiled code runs its eager Python inside (torch >= 2.6; before it, nothing to do: the
    package's lower bound is 2.4)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def count_flops_per_token(model: nn.Module, run: Callable[[Tensor], Any], seq_len: int,
                          probe: int | None = None) -> float:
    """Training FLOPs per token of `run(idx)` on a (1, probe) batch (default PROBE_TOKENS); attention
    as for `seq_len`. An architecture whose work per token depends on the length (a share of the
    tokens rounded up, as Mixture-of-Recursions' top-k keeps) probes at the whole `seq_len`."""
    from .backbone import Attention  # the counter is imported by the backbone itself

    probe = min(seq_len, probe or PROBE_TOKENS)
    idx = torch.zeros(1, probe, dtype=torch.long, device=model.wte.weight.device)
    pairs = [0.0]

    def count_pairs(module: nn.Module, args: tuple) -> None:
        """(query, key) pairs of one application: its queries x the keys a query sees on average,
        half the keys it attends over (causal), those scaled from the probe to seq_len. The keys
        are the mask's columns where the plan has one (a subset of queries against the whole
        sequence, as lrt's interleaved passes), else the queries themselves (a causal pass)."""
        x, ctx = args[0], args[1]
        mask = ctx.plan.mask
        if mask is not None:
            keys = mask.shape[-1]
        else:  # a flex BlockMask covers the whole buffer of probe columns (strided subsets on GPU)
            keys = probe if ctx.plan.block_mask is not None else x.shape[1]
        pairs[0] += x.shape[0] * x.shape[1] * (keys * seq_len / probe) / 2

    hooks = [m.register_forward_pre_hook(count_pairs) for m in model.modules() if isinstance(m, Attention)]
    try:
        # force_eager: blocks compiled in place (`train.compile` block by block) run their eager code
        # here. Reached by dynamo under the counter (a dispatch mode), a block's code is marked "skip"
        # for good, and every later step runs it eagerly (tests/test_compiled_training.py).
        # flex.suspended: flex_attention raises under the counter; the dense mask has the same shapes
        with (flex.suspended(), _eager_stance(), evaluating(model), torch.no_grad(),
              FlopCounterMode(display=False) as counter):  # no training noise
            run(idx)
    finally:
        for hook in hooks:
            hook.remove()
    counts = counter.get_flop_counts().get("Global", {})
    matmul = sum(v for op, v in counts.items() if str(op).removeprefix("aten.").split(".")[0] in MATMUL_OPS)
    c = model.config
    attention = pairs[0] * 2 * 2 * c.n_head * c.head_dim
    return BACKWARD_FACTOR * (matmul + attention) / probe
