"""Structural FLOP counting: run a forward on a few probe tokens and count what it touches.

Matrix multiplications are counted by torch's `FlopCounterMode` (every `mm`/`addmm`: the linear
layers the forward actually runs, the tied head included, once per pass, step or subset that runs
them); attention is counted per attention-layer application as 2 · 2 · D per key, with the average
causal context of seq_len / 2 keys per query (QK^T and AV). The backward costs twice the forward,
so training FLOPs per token = 3 x forward (as nanochat's `estimate_flops`).

A new architecture needs no formula: whatever its forward runs is counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

PROBE_TOKENS = 16  # matmul FLOPs per token do not depend on the length; attention is added per seq_len
MATMUL_OPS = ("mm", "addmm")  # linear layers; batched matmuls (bmm) belong to attention, counted apart
BACKWARD_FACTOR = 3  # forward + backward (twice the forward)


def count_flops_per_token(model: nn.Module, run: Callable[[Tensor], Any], seq_len: int) -> float:
    """Training FLOPs per token of `run(idx)` on a (1, probe) batch; attention as for `seq_len`."""
    from .backbone import Attention  # the counter is imported by the backbone itself

    probe = min(seq_len, PROBE_TOKENS)
    idx = torch.zeros(1, probe, dtype=torch.long, device=model.wte.weight.device)
    rows = [0]

    def count_rows(module: nn.Module, args: tuple, output: Tensor) -> None:
        rows[0] += output.shape[0] * output.shape[1]  # (B, T, D): queries this application ran

    hooks = [m.register_forward_hook(count_rows) for m in model.modules() if isinstance(m, Attention)]
    was_training = model.training
    model.eval()  # no training noise; the FLOPs are the same
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            run(idx)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    counts = counter.get_flop_counts().get("Global", {})
    matmul = sum(v for op, v in counts.items() if str(op).removeprefix("aten.").split(".")[0] in MATMUL_OPS)
    c = model.config
    attention = rows[0] * 2 * 2 * c.n_head * c.head_dim * (seq_len / 2)
    return BACKWARD_FACTOR * (matmul + attention) / probe
