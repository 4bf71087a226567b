"""Faster CPU products for a built model, applied from outside as a module swap (as torchao's
`quantize_` does): the models compute every product with torch's own `nn.Linear` / `F.linear`.

    accelerate(model)   # in place (returns the model): each nn.Linear becomes an AcceleratedLinear,
                        # the same parameters and state-dict keys; the tied head's product likewise

An `AcceleratedLinear` hands a float32 product without autograd (a prefill, scoring, an eager decode
of several rows) to the kernel that was measured faster for its shape: latentloop's rows kernel
(`native.rows_linear`, 6 to 64 rows) or oneDNN (more rows by a large weight, any weight from 128
rows; `torch_internals.onednn_linear`), else torch's own product. Training (autograd), compiled code
(which keeps `F.linear` for inductor to lower), other dtypes and devices, and a mode that watches ops
(the FLOP counter) always get `F.linear`. The kernels sum in other orders than BLAS: results agree to
float32 rounding, not bit for bit.

`runtime.load_run` (and so `latentloop.load` and every command that decodes or scores a run) applies
it to a model it loads on the CPU; `latentloop.build` does not. An exported model never carries it:
`export` reads the checkpoint, whose weights a swap never changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import torch_internals
from .native import measured_here, rows_linear

# Where `accelerated_linear` hands a float32 product without autograd to another kernel than torch's BLAS (MKL
# in the x86 wheels). Measured with torch 2.13 on a 2-core AMD EPYC (Zen 4), a model's products in
# turn as a prefill reads them (`python -m benchmarks.prefill_products`), median of paired rounds:
# - 6 to 64 rows: `native.rows_linear` (rows_linear.c). MKL's time over the kernel's at 4 x 256:
#   1.31-1.8x (6 to 16 rows) and 1.13x (64) at 1 thread, 1.18-1.79x and 1.22x at 2 threads; at
#   12 x 768, 2 threads, 1.56x at 8 rows, where oneDNN took 1.12x. Fewer rows keep the libraries
#   (2 rows at 1 thread: MKL 0.65x the kernel's time; 4 rows level; at 12 x 768 oneDNN 0.83-0.93x at
#   2-4 rows); 128 rows at 12 x 768 were 0.88-0.94x oneDNN's, so longer prompts keep the libraries too;
# - more rows by a weight of 1.5M elements and more (768x2048, 2304x768, 32000x768): oneDNN, against
#   MKL 1.06-1.6x at 1 thread and 1.3-3.3x at 2 (8 to 256 rows); smaller weights were mixed
#   (0.68-1.3x), and so keep BLAS below `ONEDNN_ANY_WEIGHT_ROWS` rows, as does a single row (decoding);
# - from 128 rows every weight's product: oneDNN (2026-12-04, `--rows 128,256,512 --repeats 30`). At
#   4 x 256 (every weight under 1M elements) oneDNN took 0.84-0.88x MKL's time at 1 and at 2 threads
#   (128, 256 and 512 rows), and at 12 x 768, 2 threads, all-oneDNN products 0.67-0.71x all-MKL's
#   (128 and 512 rows). Such products are a padded batch's prefill: a server's joining requests.
ROWS_KERNEL_MIN_ROWS = 6
ROWS_KERNEL_MAX_ROWS = 64
ONEDNN_MIN_WEIGHT = 1 << 20  # elements of the weight
ONEDNN_MIN_ROWS = 8  # rows of the input (tokens x batch)
ONEDNN_ANY_WEIGHT_ROWS = 128  # from this many rows oneDNN takes every weight, small ones too
_FEWEST_ROWS = min(ROWS_KERNEL_MIN_ROWS, ONEDNN_MIN_ROWS)  # below this, every product is torch's own


def accelerated_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear`, through a faster kernel where one was measured faster (see `ROWS_KERNEL_MAX_ROWS`):
    on CPU, in float32, with no gradient to record, outside compiled code."""
    # compiled code is ruled out first: dynamo then traces none of the other tests (no guard on sizes)
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.shape[-1] == 0:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    # the row count first: a decode step's single rows leave after the fewest tests
    if (rows < _FEWEST_ROWS or not x.dtype == weight.dtype == torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            or torch.is_autocast_enabled("cpu")
            or type(weight) not in (Tensor, nn.Parameter)  # a subclass (FSDP's DTensor) has no plain storage
            or torch_internals.dispatch_mode_active()):  # a mode that watches ops (the FLOP counter) sees torch's
        return F.linear(x, weight, bias)
    if not measured_here():  # the rule was measured on x86 (AVX2 / AVX-512) only: torch's product elsewhere
        return F.linear(x, weight, bias)
    out = None
    if ROWS_KERNEL_MIN_ROWS <= rows <= ROWS_KERNEL_MAX_ROWS:
        out = rows_linear(x.reshape(rows, x.shape[-1]), weight)  # None where the kernel is not here
        if out is not None and bias is not None:
            out += bias
    if out is None and rows >= ONEDNN_MIN_ROWS and (weight.numel() >= ONEDNN_MIN_WEIGHT
                                                    or rows >= ONEDNN_ANY_WEIGHT_ROWS):
        out = torch_internals.onednn_linear(x.reshape(rows, x.shape[-1]), weight, bias)  # None: not here
    if out is None:
        return F.linear(x, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])  # (..., out)


class AcceleratedLinear(nn.Linear):
    """`nn.Linear` (the same parameters and state-dict keys) whose product is `accelerated_linear`'s."""

    def forward(self, x: Tensor) -> Tensor:
        return accelerated_linear(x, self.weight, self.bias)


def accelerate(model: nn.Module) -> nn.Module:
    """Give `model` the faster CPU products, in place (returns it): every plain `nn.Linear` becomes an
    `AcceleratedLinear` (its class swapped: nothing copied), and a model with a tied head computes
    that product as `accelerated_linear`. Applying it twice changes nothing."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = AcceleratedLinear
        if hasattr(type(module), "tied_head_product"):  # the backbone's (any variant's)
            module.tied_head_product = accelerated_linear
    return model


def is_accelerated(model: nn.Module) -> bool:
    return any(isinstance(m, AcceleratedLinear) for m in model.modules()) or any(
        getattr(m, "tied_head_product", None) is accelerated_linear for m in model.modules())
