"""Weight-only int8 decoding: every `nn.Linear` of a model with its weight stored as int8, one scale
per output channel (symmetric: w ~= q * scale, q in [-127, 127], scale = max |w| of the row / 127).

    quantize_int8(model)   # in place; the activations, norms, embedding (and a tied head) stay float

Decoding streams the weights once per token, so a quarter of the bytes is up to four times less
memory traffic for the linear layers. How each product runs:
- float32 on the CPU, at most `KERNEL_MAX_ROWS` rows (decoding), eager and in dynamo's compiled
  step: the native kernel (`int8_linear.c`, built by `models/native.py`; to torch.compile it is the
  opaque op `latentloop::int8_linear`): each weight read as one byte and widened in registers,
  float32 products and sums, the rows split over torch's threads. It replaced the eager conversion
  below for decoding, which was slower than the float layer (2.4 against 1.6 ms for 768 -> 3072 at
  one row); torch's `_weight_int8pack_mm` was slower still with float32 activations (12 ms).
- in the ahead-of-time compiled step (`aot.py`, the CPU default): a ctypes call cannot be held in a
  package, so the product is an inductor reduction over the int8 weights
  (`fast._int8_linear_by_reduction`), widened in registers too, fused with the step's other loops.
  `benchmarks.engines`, one run: 10.9 ms a token at 12 layers x 768, 2 threads (dynamo's step with
  the native kernel 18.5, the float package 20.3) and 0.58 ms at 4 x 256, 1 thread (dynamo's 0.96).
- float32 on the CPU, more rows up to `ROWS_KERNEL_MAX_ROWS` (a short prefill), eager:
  `native.rows_linear` (`rows_linear.c`): each weight tile widened once into the thread's buffer and
  used for every row. The conversion's time over the kernel's, paired rounds on the 2-core Zen 4
  with the machine quiet (`python -m benchmarks.prefill_products`, 4 x 256): 1.24x at 16 rows and
  0.97x at 64 with 1 thread, 2.23x and 1.24x with 2 threads. The bound of 128 rows comes from an
  earlier run on a busy machine (1.3x at 128 rows, 1 thread; 2.4-3.8x at 9 to 64 rows at 12 x 768,
  2 threads; 0.9x at 512), not re-measured quiet.
- anything else (a prefill of many rows, another dtype or device, no C compiler):
  `F.linear(x, q.to(x.dtype)) * scale`, the weight converted for the product.

What is not quantised: the token embedding, and so a tied head (it is the embedding's matrix, read
by `F.linear` in `GPT.head`), norms, biases, and parameters that are not `nn.Linear` weights.
A module whose `.weight` the model reads directly (fbt's gate table reads its gate's) gets a float
copy dequantised once, on first read.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .backbone import Linear
from .native import native_library, rows_linear, threads_for

INT8_MAX = 127  # symmetric: -128 is never used, so q and -q are both representable
# A row of zeros would get scale 0 and divide by zero when quantised: its scale is at least this
# (any positive value works: the row quantises to zeros either way).
MIN_SCALE = 1e-12
# Rows of activations the decode kernel takes: it reads each weight row once for all of them but
# sums one row at a time, so more rows are faster through the rows kernel, which widens each weight
# once for a vector of rows (at 8 rows the two were level: 0.98x, paired).
KERNEL_MAX_ROWS = 8
ROWS_KERNEL_MAX_ROWS = 128  # rows the rows kernel takes (past KERNEL_MAX_ROWS; see the module doc)
KERNEL = "int8_linear"


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native_library(KERNEL)
    if lib is not None:
        lib.latentloop_int8_linear.restype = None
        lib.latentloop_int8_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return lib


def _converted_product(x: Tensor, weight_int8: Tensor, scale: Tensor) -> Tensor:
    return F.linear(x, weight_int8.to(x.dtype)) * scale.to(x.dtype)


def int8_product(x: Tensor, weight_int8: Tensor, scale: Tensor) -> Tensor:
    """x (..., K) float32 @ (weight_int8 (N, K) * scale (N,)[:, None]).T -> (..., N), through the native
    kernel when it applies (see the module doc), else the converted product."""
    n, k = weight_int8.shape
    rows = x.numel() // k
    if (x.device.type != "cpu" or x.dtype != torch.float32 or scale.dtype != torch.float32
            or x.requires_grad):  # the kernels have no backward: torch's path
        return _converted_product(x, weight_int8, scale)
    flat = x.reshape(rows, k).contiguous()
    lib = _kernel() if rows <= KERNEL_MAX_ROWS else None
    if lib is not None:
        q, s = weight_int8.contiguous(), scale.contiguous()
        y = torch.empty(rows, n, dtype=torch.float32)
        lib.latentloop_int8_linear(flat.data_ptr(), q.data_ptr(), s.data_ptr(), y.data_ptr(), rows, n, k,
                                   threads_for(rows * n * k))
        return y.reshape(*x.shape[:-1], n)
    y = rows_linear(flat, weight_int8, scale) if KERNEL_MAX_ROWS < rows <= ROWS_KERNEL_MAX_ROWS else None
    if y is None:  # no kernel for these rows, or none built
        return _converted_product(x, weight_int8, scale)
    return y.reshape(*x.shape[:-1], n)


# The same function as an operator torch.compile keeps opaque (dynamo cannot trace ctypes). Eager
# callers call `int8_product` itself: the operator's dispatch costs tens of microseconds a call,
# more than a small layer's product.
int8_linear = torch.library.custom_op("latentloop::int8_linear", mutates_args=())(int8_product)


@int8_linear.register_fake
def _(x: Tensor, weight_int8: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight_int8.shape[0]))


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight (out, in) float -> (int8 (out, in), scale (out,) float32): per-row symmetric int8."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=MIN_SCALE)  # (out,)
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """An `nn.Linear` whose weight is int8 with a float scale per output channel (see the module doc)."""

    QUANTIZED = True  # what `CompileRecord` and `is_quantized` look for

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        dtype = linear.weight.dtype
        self.register_buffer("weight_int8", q)  # (out, in)
        self.register_buffer("scale", scale.to(dtype))  # (out,), the activations' dtype (the int8 kernel's rule)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._dequantised: Tensor | None = None

    @property
    def weight(self) -> Tensor:
        """The dequantised weight (out, in), made once: for code that reads `.weight` itself."""
        if self._dequantised is None:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor (readers check its version)
                self._dequantised = self.weight_int8.to(self.scale.dtype) * self.scale[:, None]
        return self._dequantised

    def forward(self, x: Tensor) -> Tensor:  # x (..., in) -> (..., out)
        if x.device.type == "cpu" and x.dtype == torch.float32:  # the native kernel or its fallback
            product = int8_linear if torch.compiler.is_compiling() else int8_product
            y = product(x, self.weight_int8, self.scale)
        else:
            y = _converted_product(x, self.weight_int8, self.scale)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` in `model` by an `Int8Linear` (in place; returns the model). For
    inference: the int8 weights take no gradients."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (nn.Linear, Linear):
                setattr(parent, name, Int8Linear(child))
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(getattr(m, "QUANTIZED", False) for m in model.modules())
