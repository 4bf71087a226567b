"""bf16 on the CPU: whether this CPU has bf16 instructions, and a faster emulation where it has none.

- `cpu_bf16_support`: the CPU's bf16 instructions (`CPU_BF16_FLAGS`), or None.
- `emulated_bf16_autocast`: bf16 autocast whose linear layers compute as a CPU with bf16 instructions
  would (each product's inputs and output rounded to bf16, the sums in float32) with float32
  kernels: a torch function mode of this thread's, so nothing is registered for the process.
  Without bf16 instructions torch's own bf16 product (oneDNN's emulation) took 3.3x float32's time
  for the ladder's m shapes (1 thread), and an m training step 1.4-1.5x the emulated one
  (`python -m benchmarks.cpu_bf16`).
- `bf16_product`: the same rule for one product of two bf16 tensors (Muon's Newton-Schulz iteration).

Only the order of the float32 sums can differ from a CPU with the instructions (the inputs are
rounded alike, a product of two bf16 numbers is exact in float32, and the output is rounded once),
as it differs between any two kernels: tests/test_precision.py bounds the difference. Imports
nothing of ours: the runtime's autocast and the optimizer both use it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

# The CPU features that give bf16 matrix products their own instructions (Linux /proc/cpuinfo flag
# names): without one of them torch emulates bf16 and a bf16 step is slower than an fp32 one.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")

# What a run or a probe that emulated bf16 records (benchmarks and the ladder): torch's own emulation,
# before 2026-12-07, took 1.4-1.5x this one's time, so a probe made under it is measured again
EMULATION = "float32 kernels on bf16-rounded values (latentloop.precision, 2026-12-07)"

# Set to "0" to treat this CPU as one without bf16 instructions: `train.dtype=auto` then trains in
# fp32 (the test suite sets it, so that its exactness and resume checks run in fp32 everywhere).
CPU_BF16_ENV = "LATENTLOOP_CPU_BF16"


def cpu_bf16_support() -> str | None:
    """The first of `CPU_BF16_FLAGS` this CPU has, or None (also off Linux, where the flags cannot
    be read, and when `CPU_BF16_ENV` is "0"; torch's own view is
    `torch.backends.cpu.get_cpu_capability()`, which names the vector width only)."""
    if os.environ.get(CPU_BF16_ENV) == "0":
        return None
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    return next((flag for flag in CPU_BF16_FLAGS if flag in flags), None)


def bf16_product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for bf16 tensors as bf16 instructions compute it: float32 sums of exact products, the
    result rounded to bf16 once."""
    return torch.matmul(a.float(), b.float()).to(torch.bfloat16)


class _Bf16Linear(torch.autograd.Function):
    """F.linear of bf16 tensors computed in float32, its output and gradients rounded to bf16: what
    autocast's bf16 linear gives, with the same tensors kept for the backward (the bf16 input where
    the weight needs a gradient, the bf16 weight where the input does: a step's memory is unchanged)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.has_bias = bias is not None
        with torch.autocast("cpu", enabled=False):
            if bias is None or _fuses_bias(x):  # one rounding of x W^T + b, as addmm
                return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
            # at::linear's matmul, then add_ of the bias: two roundings
            return F.linear(x.float(), weight.float()).to(torch.bfloat16).add_(bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):  # a backward run under autocast: float32 still
            grad32 = grad.float()  # (..., out)
            rows = grad32.reshape(-1, grad32.size(-1))  # (N, out)
            grad_x = (grad32 @ weight.float()).to(torch.bfloat16) if ctx.needs_input_grad[0] else None
            grad_weight = ((rows.mT @ x.float().reshape(-1, x.size(-1))).to(torch.bfloat16)
                           if ctx.needs_input_grad[1] else None)
            grad_bias = rows.sum(0).to(torch.bfloat16) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear of bf16 tensors as the emulation runs it (`_Bf16Linear`): also on the meta device,
    where the memory plan runs it to count the float32 copies it makes."""
    return _Bf16Linear.apply(x, weight, bias)


def _fuses_bias(x: Tensor) -> bool:
    """Whether torch's CPU `at::linear` adds the bias inside the product (addmm: one rounding) for
    this input: a 2-D one, or a contiguous one of more dimensions (flattened to 2-D)."""
    return x.dim() == 2 or (x.dim() > 2 and x.is_contiguous())


_local = threading.local()  # this thread's cache of cast weights while it is inside a region


def _cast(t: Tensor | None) -> Tensor | None:
    """`t` in bf16 as autocast casts it: floating tensors other than float64 only; a float32 weight (a
    leaf that requires grad) cast once per region while autograd records (a cast made
    under no_grad has no gradient path, and is not kept), so its uses share one cast and their
    gradients meet in bf16, as under autocast's cache."""
    if t is None or not t.is_floating_point() or t.dtype in (torch.bfloat16, torch.float64):
        return t
    cache = getattr(_local, "cache", None)
    if (cache is None or t.dtype != torch.float32 or not (t.is_leaf and t.requires_grad)
            or not torch.is_grad_enabled()  # off under no_grad and inference_mode alike
            or not torch.is_autocast_cache_enabled()):
        return t.to(torch.bfloat16)
    hit = cache.get(id(t))
    if hit is None or hit[0] is not t:
        hit = cache[id(t)] = (t, t.to(torch.bfloat16))
    return hit[1]


def _emulated_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear under CPU bf16 autocast, emulated (`_Bf16Linear`); what the emulation does not cover
    (an input already float64, a weight that is not a matrix) goes to autocast as is. Forward-mode AD
    is not covered either: `_Bf16Linear` has no jvp, and torch says so."""
    x, w, b = _cast(input), _cast(weight), _cast(bias)
    if w.dim() != 2 or any(t is not None and t.dtype != torch.bfloat16 for t in (x, w, b)):
        return F.linear(input, weight, bias)
    return bf16_linear(x, w, b)


class _EmulatedLinearMode(TorchFunctionMode):
    """Sends this thread's F.linear calls to `_emulated_linear` while CPU autocast is on in bf16
    (a region that turns autocast off, as `attend`'s float32 attention does, gets float32)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, Tensor) and x.device.type == "cpu":
                return _emulated_linear(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulated_linear_mode() -> Iterator[None]:
    """This thread's F.linear emulated under CPU bf16 autocast (the mode alone: the caller's autocast
    stays as it is; activation checkpointing's recomputation enters this, see `recompute_contexts`)."""
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        _local.cache = {}
    _local.depth = depth + 1
    try:
        with _EmulatedLinearMode():
            yield
    finally:
        _local.depth = depth
        if depth == 0:  # the weights may change before the next region (an optimizer step): cast afresh
            _local.cache = None


@contextlib.contextmanager
def emulated_bf16_autocast() -> Iterator[None]:
    """CPU bf16 autocast whose linear layers run as `_Bf16Linear` (the other products, attention
    included, as autocast runs them). Only this thread's calls: a torch function mode, nothing
    registered for the process."""
    with torch.autocast("cpu", dtype=torch.bfloat16), emulated_linear_mode():
        yield


def emulating() -> bool:
    """Whether this thread is inside an emulated region now."""
    return getattr(_local, "depth", 0) > 0


def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`torch.utils.checkpoint`'s `context_fn`: the forward as it is, and the recomputation in the
    backward (after the region has closed) emulated where the forward was, so that it saves the
    same tensors (checkpoint restores the autocast state itself)."""
    return contextlib.nullcontext(), (emulated_linear_mode() if emulating() else contextlib.nullcontext())
