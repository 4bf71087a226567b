"""bf16 on the CPU: whether this CPU has bf16 instructions, and a faster emulation where it has none.

- `cpu_bf16_support`: the CPU's bf16 instructions (`CPU_BF16_FLAGS`), or None.
- `emulated_bf16_autocast`: bf16 autocast whose linear layers compute as a CPU with bf16 instructions
  would (each product's inputs and output rounded to bf16, the sums in float32) with float32
  kernels. Without bf16 instructions torch's own bf16 product (oneDNN's emulation) took 3.3x
  float32's time for the ladder's m shapes (1 thread), and a training step 1.4-1.6x.
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
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

# The CPU features that give bf16 matrix products their own instructions (Linux /proc/cpuinfo flag
# names): without one of them torch emulates bf16 and a bf16 step is slower than an fp32 one.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")

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
    autocast's bf16 linear gives, with the same tensors kept for the backward (the bf16 input and
    weight, so a step's memory is unchanged)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):  # a backward called under autocast: float32 products still
            grad32 = grad.float()  # (..., out)
            rows = grad32.reshape(-1, grad32.size(-1))  # (N, out)
            grad_x = (grad32 @ weight.float()).to(torch.bfloat16) if ctx.needs_input_grad[0] else None
            grad_weight = ((rows.mT @ x.float().reshape(-1, x.size(-1))).to(torch.bfloat16)
                           if ctx.needs_input_grad[1] else None)
            grad_bias = (rows.sum(0).to(torch.bfloat16) if ctx.has_bias and ctx.needs_input_grad[2] else None)
        return grad_x, grad_weight, grad_bias


_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_registration_lock = threading.Lock()
_registration: list = [None, 0]  # the torch.library registration while any thread emulates, and how many do
_local = threading.local()  # this thread's depth of emulation and its cache of cast weights


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """`t` in autocast's lower precision, as autocast casts: floating tensors other than float64 only;
    a weight (a leaf that requires grad) cast once per emulated region, so its uses share one cast
    and their gradients meet in bf16 as under autocast's cache."""
    if t is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    cache = getattr(_local, "cache", None)
    if cache is None or not (t.is_leaf and t.requires_grad and torch.is_autocast_cache_enabled()):
        return t.to(dtype)
    hit = cache.get(id(t))
    if hit is None or hit[0] is not t:
        hit = cache[id(t)] = (t, t.to(dtype))
    return hit[1]


def _autocast_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """aten::linear under CPU autocast while an emulated region is open (in any thread)."""
    low = torch.get_autocast_dtype("cpu")
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
        x, w, b = _cast(input, low), _cast(weight, low), _cast(bias, low)
        if low != torch.bfloat16:  # another autocast dtype inside the region: autocast's own rule
            return F.linear(x, w, b)
        return _Bf16Linear.apply(x, w, b)


@contextlib.contextmanager
def emulated_bf16_autocast() -> Iterator[None]:
    """CPU bf16 autocast whose linear layers run as `_Bf16Linear` (the other products, attention
    included, as autocast runs them). While any thread is inside, every thread's CPU autocast
    linear takes this path (the dispatcher's table is the process's); a thread outside caches no
    cast weights."""
    with _registration_lock:
        if _registration[1] == 0:
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():  # "overriding a previously registered kernel": meant, and undone below
                warnings.simplefilter("ignore")
                library.impl("linear", _autocast_linear, "AutocastCPU")
            _registration[0] = library
        _registration[1] += 1
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        _local.cache = {}
    _local.depth = depth + 1
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    finally:
        _local.depth = depth
        if depth == 0:
            _local.cache = None
        with _registration_lock:
            _registration[1] -= 1
            if _registration[1] == 0:
                _registration[0]._destroy()  # autocast's own linear kernel is the dispatcher's again
                _registration[0] = None
