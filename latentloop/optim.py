"""Optimizers and learning-rate schedules.

- AdamW for everything (default), with weight decay on matrices only; fused (one kernel over all
  parameters) on CPU and CUDA.
- Muon (as in nanochat / modded-nanoGPT) for the 2-D weights inside the blocks: SGD momentum whose
  update is orthogonalised by a few Newton-Schulz iterations, in bf16 where the run's products are
  (`newton_schulz_dtype`); AdamW keeps the embedding, the head and any vectors or scalars.
- Schedules return a multiplier of the base lr: linear warmup, then cosine decay, or
  warmup-stable-decay (constant, then a linear decay over the last fraction of steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .config import TrainConfig
from .errors import ConfigError
from .precision import bf16_product, cpu_bf16_support
from .util import warn_once

# Coefficients of the quintic Newton-Schulz iteration that drives singular values towards 1
# quickly (Keller Jordan's Muon); exactness is not needed, only speed and stability in bf16.
NEWTON_SCHULZ_COEFFS = (3.4445, -4.7750, 2.0315)
MUON_MOMENTUM = 0.95
# Parameter names a refused `muon_exclude` pattern shows, as examples of what it can match
EXAMPLE_PARAMETER_NAMES = 4
# Devices with a fused AdamW kernel: one multi-tensor update per step instead of the per-parameter
# Python loop that torch's AdamW otherwise runs on CPU (foreach is its default on CUDA only)
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def orthogonalize(G: Tensor, steps: int = 5, dtype: torch.dtype | None = None, emulate_bf16: bool = False) -> Tensor:
    """Approximately replace G = U S V^T by U V^T, the products in `dtype` (None: as
    `newton_schulz_dtype` sets it for a float32 run, bf16 on CUDA and float32 elsewhere). G: one
    matrix (m, n), or a stack of matrices of one shape (N, m, n), each orthogonalised on its own
    (batched products: one kernel per product for the whole stack). `emulate_bf16`: bf16 products
    through float32 kernels (`precision.bf16_product`: the same rounding), for a CPU without bf16
    instructions, where torch's own bf16 product is slower (65 against 38 ms a step for the ladder's m
    gpt's 32 matrices, 1 thread)."""
    a, b, c = NEWTON_SCHULZ_COEFFS
    X = G.to(dtype or newton_schulz_dtype(G.device, "float32"))
    product = bf16_product if emulate_bf16 and X.dtype == torch.bfloat16 else torch.matmul
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)  # the Frobenius norm of each matrix
    for _ in range(steps):
        A = product(X, X.mT)
        X = a * X + product(b * A + product(c * A, A), X)  # (c A) A: torch.matmul's order, rounding included
    return (X.mT if transposed else X).to(G.dtype)


def _whole(t: Tensor) -> Tensor:
    """The whole matrix of a tensor that FSDP2 shards (a DTensor: gathered from every process), or
    the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _like(whole: Tensor, param: Tensor) -> Tensor:
    """`whole` laid out as `param` is: this process's shard of it when `param` is a DTensor (every
    process holds the same whole matrix, so each keeps its own part, with no communication)."""
    if not hasattr(param, "device_mesh"):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights. The matrices of one shape are updated together: their momentum buffers
    by foreach ops, their Newton-Schulz iterations as one batched iteration over the stack (one
    kernel per product for all of them, not one per matrix; `compiled`: the iteration compiled,
    once per shape), and the update applied by foreach ops.

    Under DDP every process holds the whole, already all-reduced gradient and takes the same step.
    Under FSDP2 the parameter, its gradient and the momentum buffer are DTensors sharded by rows,
    each matrix on its own: the momentum is kept sharded (updated shard by shard), the Nesterov
    combination is gathered whole on every process (one all-gather per matrix), orthogonalised
    there (the same computation on every process: simple, at the cost of repeating the
    Newton-Schulz products on each), and each process applies its own rows of the update. The
    result equals one process's Muon on the whole matrices (tests/test_distributed.py)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = MUON_MOMENTUM, weight_decay: float = 0.0,
                 ns_steps: int = 5, ns_dtype: torch.dtype | None = None, compiled: str | None = None):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))
        self.ns_dtype = ns_dtype  # the Newton-Schulz products' dtype (`orthogonalize`'s default when None)
        # bf16 products on a CPU without bf16 instructions: emulated through float32 kernels, eager only
        # (inductor drops the round trips of a compiled emulation: nearly float32's iteration). A compiled
        # iteration differs from the eager one anyway: inductor keeps its fused element-wise terms in
        # float32 (as every compiled Muon's), about as far from eager bf16 as float32 is
        self.ns_emulate_bf16 = (ns_dtype == torch.bfloat16 and compiled is None and not cpu_bf16_support()
                                and any(p.device.type == "cpu" for group in self.param_groups for p in group["params"]))
        # the iteration through torch.compile with this backend (train.compile), else eager
        self._orthogonalize = (orthogonalize if compiled is None else
                               torch.compile(orthogonalize, backend=compiled, dynamic=False, fullgraph=True))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            sharded = [p for p in params if hasattr(p, "device_mesh")]
            stacks: dict[tuple, list[Tensor]] = {}
            for p in params:
                if not hasattr(p, "device_mesh"):
                    stacks.setdefault((tuple(p.shape), p.dtype, p.device), []).append(p)
            for same in stacks.values():
                self._step_stack(same, group)
            for p in sharded:
                self._step_sharded(p, group)

    def _buffers(self, params: list[Tensor]) -> list[Tensor]:
        for p in params:  # made once (setdefault's default was a fresh zeros_like, a memset, every step)
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        return [self.state[p]["momentum_buffer"] for p in params]

    def _step_stack(self, params: list[Tensor], group: dict) -> None:
        """Matrices of one shape: one batched Newton-Schulz iteration for all of them."""
        grads, buffers = [p.grad for p in params], self._buffers(params)
        torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
        nesterov = torch.stack(grads).lerp_(torch.stack(buffers), group["momentum"])  # (N, m, n)
        update = self._orthogonalize(nesterov, group["ns_steps"], self.ns_dtype, self.ns_emulate_bf16)
        rows, columns = params[0].shape
        aspect = max(1.0, rows / columns) ** 0.5  # keeps the update's RMS comparable across shapes
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        torch._foreach_add_(params, list(update.unbind(0)), alpha=-group["lr"] * aspect)

    def _step_sharded(self, p: Tensor, group: dict) -> None:
        """One FSDP2-sharded matrix: gathered whole for the iteration, its own rows applied."""
        buf = self._buffers([p])[0]
        buf.lerp_(p.grad, 1 - group["momentum"])
        nesterov = _whole(p.grad.lerp(buf, group["momentum"]))
        update = _like(orthogonalize(nesterov, group["ns_steps"], self.ns_dtype, self.ns_emulate_bf16), p)
        aspect = max(1.0, p.size(0) / p.size(1)) ** 0.5
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"] * aspect)


def newton_schulz_dtype(device: torch.device, products_dtype: str) -> torch.dtype:
    """Muon's Newton-Schulz products in bf16 where the run's own products are (`products_dtype`: the
    run's autocast dtype, `runtime.resolve_dtype`'s answer): always on CUDA (Keller Jordan's Muon),
    and on a CPU run under bf16 autocast (a CPU with bf16 instructions), where rgpt's 15 matrices took
    83-91 ms against 149-179 ms in float32 (2 threads; 18% of its training step was Muon's), and in an
    explicit bf16 run on a CPU without them (the products emulated, `Muon.ns_emulate_bf16`). A float32
    run keeps float32 throughout."""
    return torch.bfloat16 if device.type == "cuda" or products_dtype == "bfloat16" else torch.float32


def check_muon_exclude(model: nn.Module, patterns: Sequence[str], adamw_ids: set[int], muon: bool = True) -> None:
    """Every `train.muon_exclude` pattern (a part of parameter names; the default is none, so each
    one is the user's) must match some parameter of the model: a typo would otherwise leave its
    matrices on Muon without a word. One `ConfigError` names the patterns and a few real names,
    the matrices a pattern could move first (not those in `adamw_ids`: AdamW's anyway). With Muon
    (`muon`), a pattern that matches only AdamW's parameters moves nothing: a warning (a refusal would
    stop the resume of a run that ran with it, and `muon_exclude` is fixed on resume)."""
    named = list(model.named_parameters())
    movable = [name for name, p in named if p.dim() >= 2 and id(p) not in adamw_ids]
    unmatched = [pattern for pattern in patterns if not any(pattern in name for name, _ in named)]
    named.sort(key=lambda item: item[1].dim() < 2 or id(item[1]) in adamw_ids)  # stable: model order kept
    examples = ", ".join(name for name, _ in named[:EXAMPLE_PARAMETER_NAMES])
    if unmatched:
        raise ConfigError(f"train.muon_exclude: {', '.join(map(repr, unmatched))} "
                          f"{'matches' if len(unmatched) == 1 else 'match'} no parameter of this "
                          f"{type(model).__name__} (its parameter names include {examples})")
    idle = [pattern for pattern in patterns if not any(pattern in name for name in movable)]
    if muon and idle:
        warn_once(f"train.muon_exclude: {', '.join(map(repr, idle))} {'matches' if len(idle) == 1 else 'match'} "
                  f"only parameters AdamW trains anyway, and moves no matrix off Muon (its matrices include "
                  f"{examples})")


def build_optimizers(model: nn.Module, config: TrainConfig, products_dtype: str = "float32",
                     own_groups: Sequence[dict] = ()) -> list[torch.optim.Optimizer]:
    """One or two optimizers; each param group remembers its base lr as `initial_lr`. `products_dtype`:
    the dtype the run's products take (`runtime.resolve_dtype`), which Muon's iteration follows.
    `own_groups`: torch-style groups (`params`, and `lr` / `weight_decay` where they differ from the
    run's) of parameters an architecture trains with settings of their own (its spec's `param_groups`,
    e.g. lrt's residual scalars): AdamW's, never Muon's, taken out of the groups below."""
    # lookup tables (the token embedding, lrt's per-layer value embeddings) and the head: AdamW, never Muon
    embed_ids = {id(p) for name, p in model.named_parameters()
                 if name.startswith(("wte", "lm_head")) or ".value_embed." in name}
    # matrices the config keeps off Muon (`muon_exclude`): AdamW, with the embeddings' group
    check_muon_exclude(model, config.muon_exclude, embed_ids, muon=config.optimizer == "muon")
    embed_ids |= {id(p) for name, p in model.named_parameters() if any(part in name for part in config.muon_exclude)}
    own_ids = {id(p) for group in own_groups for p in group["params"]}
    matrices, vectors, embeddings = [], [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in own_ids:
            continue
        if id(p) in embed_ids:
            embeddings.append(p)
        elif p.dim() >= 2:
            matrices.append(p)
        else:
            vectors.append(p)
    adam_kwargs = dict(lr=config.lr, betas=config.betas, eps=1e-8)
    own = [{"weight_decay": 0.0, **{k: v for k, v in group.items() if v is not None}, "params": list(group["params"])}
           for group in own_groups]  # scheduled like the rest
    params = matrices + vectors + embeddings + [p for group in own for p in group["params"]]
    if params and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params):
        adam_kwargs["fused"] = True
    if config.optimizer == "muon":
        if not matrices:  # torch's own error for an empty Muon was a traceback
            raise ConfigError(f"train.muon_exclude: {', '.join(map(repr, config.muon_exclude))} leaves Muon no "
                              f"matrix of this {type(model).__name__}: train with AdamW alone "
                              f"(train.optimizer=adamw)")
        groups = [dict(params=embeddings, weight_decay=0.0), dict(params=vectors, weight_decay=0.0)] + own
        optimizers = [torch.optim.AdamW([g for g in groups if g["params"]], **adam_kwargs),
                      Muon(matrices, lr=config.muon_lr, weight_decay=config.weight_decay,
                           ns_dtype=newton_schulz_dtype(matrices[0].device, products_dtype),
                           compiled=config.compile_backend if config.compile else None)]
    else:
        groups = [dict(params=matrices + embeddings, weight_decay=config.weight_decay),
                  dict(params=vectors, weight_decay=0.0)] + own
        optimizers = [torch.optim.AdamW([g for g in groups if g["params"]], **adam_kwargs)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def lr_multiplier(step: int, config: TrainConfig) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based)."""
    total, warmup, floor = config.steps, config.warmup_steps, config.min_lr_ratio
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if config.schedule == "wsd":
        # the decay starts after the warmup at the earliest: a warmup past the decay's start jumped from
        # the peak to half of it at the warmup's end (a run under 25 steps at the defaults)
        decay_start = max(warmup, total - max(1, int(round(config.decay_fraction * total))))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start + 1) / max(1, total - decay_start)
        return 1.0 - (1.0 - floor) * min(1.0, progress)
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
