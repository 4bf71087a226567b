"""Weight-only int8 decoding: every `nn.Linear` of a model with its weight stored as int8, one scale
per output channel (symmetric: w ~= q * scale, q in [-127, 127], scale = max |w| of the row / 127).

    quantize_int8(model)   # in place; the activations, norms, embedding (and a tied head) stay float

Decoding streams the weights once per token, so a quarter of the bytes is up to four times less
memory traffic for the linear layers. How each product runs:
- float32 on the CPU, at most `KERNEL_MAX_ROWS` rows (decoding), eager, in dynamo's compiled step
  and in the ahead-of-time one: the native kernel (`int8_linear.c`, built by `inference/native.py`).
  With AVX-512 VNNI its products are integer (`vpdpbusd`, 64 byte products an instruction): each
  row of activations is written as three base-254 digits (about float32's precision relative to
  the row's largest element, not int8's; the file's doc says how and where that is less), so it
  agrees with the float products to float32 rounding for activations of one scale. Without VNNI
  each weight is widened to float in registers (AVX2), float32 products and sums. To
  torch.compile it is the opaque op `latentloop::int8_linear`; an ahead-of-time package calls it
  as a C function (`PACKAGE_FUNCTION`, the library's build for packages, see `package_kernel`).
  It replaced an eager conversion that was slower than the float layer (2.4 against 1.6 ms for
  768 -> 3072 at one row); torch's `_weight_int8pack_mm` was slower still with float32 activations.
- in the ahead-of-time step where that build is missing (not Linux, no compiler): the product is an
  inductor reduction over the int8 weights (`fast._int8_linear_by_reduction`), widened in registers
  too, fused with the step's other loops; it spent about half of a 4 x 256 step in its latency-bound
  sums (one accumulator a row, `perf`), the reason the package calls the kernel now.
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
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .native import measured_here, native_library, rows_linear, threads_for

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
# What an ahead-of-time package calls for `latentloop::int8_linear`: AOTInductor names an operator's C
# function aoti_torch_<device>_<name> and declares it as given here (int8_linear.c defines it).
PACKAGE_FUNCTION = ("AOTITorchError aoti_torch_cpu_int8_linear(AtenTensorHandle x, AtenTensorHandle weight_int8, "
                    "AtenTensorHandle scale, AtenTensorHandle packed, AtenTensorHandle* out)")


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    if not measured_here():  # measured on x86 with AVX2 only: the converted product elsewhere
        return None
    lib = native_library(KERNEL)
    if lib is not None:
        lib.latentloop_int8_linear.restype = None
        lib.latentloop_int8_linear.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.latentloop_int8_linear_path.restype = ctypes.c_int
    return lib


VNNI_PATH = 2  # `latentloop_int8_linear_path()` of a build that sums a packed weight with VNNI
# The packed layout (int8_linear.c): blocks of this many output rows, this many k's per lane
LANE_ROWS, GROUP = 16, 4
WEIGHT_OFFSET = 128  # the packed weight is q + 128, unsigned: VNNI's unsigned operand


def packs_weights() -> bool:
    """Whether the kernel here sums a packed weight (AVX-512 VNNI): `Int8Linear` packs only then."""
    lib = _kernel()
    return lib is not None and lib.latentloop_int8_linear_path() == VNNI_PATH


def _packed_shape(n: int, k: int) -> tuple[int, int]:
    """(rows, cols) of an (n, k) weight padded for the packed layout (`latentloop_int8_packed_bytes`)."""
    return -(-n // LANE_ROWS) * LANE_ROWS, -(-k // GROUP) * GROUP


def pack_weight(weight_int8: Tensor) -> Tensor:
    """q (N, K) int8 -> the kernel's packed copy (N/16, K/4, 16, 4) uint8 of q + 128, N and K padded
    with zero weights (see int8_linear.c)."""
    rows, cols = _packed_shape(*weight_int8.shape)
    n, k = weight_int8.shape
    padded = F.pad(weight_int8.detach().cpu().to(torch.int16), (0, cols - k, 0, rows - n)) + WEIGHT_OFFSET
    return (padded.to(torch.uint8).view(rows // LANE_ROWS, LANE_ROWS, cols // GROUP, GROUP)
            .permute(0, 2, 1, 3).contiguous())


def package_kernel() -> str | None:
    """The kernel library's build for packages when it loads (its file name, for a package's key),
    else None: a package then sums the int8 products itself (see the module doc)."""
    lib = native_library(KERNEL, for_packages=True) if measured_here() else None
    return None if lib is None else Path(lib._name).name


def _converted_product(x: Tensor, weight_int8: Tensor, scale: Tensor) -> Tensor:
    return F.linear(x, weight_int8.to(x.dtype)) * scale.to(x.dtype)


def int8_product(x: Tensor, weight_int8: Tensor, scale: Tensor, packed: Tensor | None = None) -> Tensor:
    """x (..., K) float32 @ (weight_int8 (N, K) * scale (N,)[:, None]).T -> (..., N), through the native
    kernel when it applies (see the module doc), else the converted product. `packed`: the weight's
    `pack_weight` copy, which the VNNI kernel reads (ignored where it is empty or not the kernel's)."""
    n, k = weight_int8.shape
    rows = x.numel() // k
    if (x.device.type != "cpu" or x.dtype != torch.float32 or scale.dtype != torch.float32
            or x.requires_grad):  # the kernels have no backward: torch's path
        return _converted_product(x, weight_int8, scale)
    flat = x.reshape(rows, k).contiguous()
    lib = _kernel() if rows <= KERNEL_MAX_ROWS else None
    if lib is not None:
        q, s = weight_int8.contiguous(), scale.contiguous()
        rows_padded, cols_padded = _packed_shape(n, k)  # in Python: no ctypes call on the decode path
        ready = (packed is not None and packed.dtype == torch.uint8 and packed.is_contiguous()
                 and packed.numel() == rows_padded * cols_padded > 0)
        y = torch.empty(rows, n, dtype=torch.float32)
        lib.latentloop_int8_linear(flat.data_ptr(), q.data_ptr(), packed.data_ptr() if ready else None, s.data_ptr(),
                                   y.data_ptr(), rows, n, k, threads_for(rows * n * k))
        return y.reshape(*x.shape[:-1], n)
    y = rows_linear(flat, weight_int8, scale) if KERNEL_MAX_ROWS < rows <= ROWS_KERNEL_MAX_ROWS else None
    if y is None:  # no kernel for these rows, or none built
        return _converted_product(x, weight_int8, scale)
    return y.reshape(*x.shape[:-1], n)


# The same function as an operator torch.compile keeps opaque (dynamo cannot trace ctypes), and an
# ahead-of-time package calls as `PACKAGE_FUNCTION`; `packed` always a tensor there (empty when the
# weight is not packed). Eager callers call `int8_product` itself: the operator's dispatch costs
# tens of microseconds a call, more than a small layer's product.
@torch.library.custom_op("latentloop::int8_linear", mutates_args=())
def int8_linear(x: Tensor, weight_int8: Tensor, scale: Tensor, packed: Tensor) -> Tensor:
    return int8_product(x, weight_int8, scale, packed)


@int8_linear.register_fake
def _(x: Tensor, weight_int8: Tensor, scale: Tensor, packed: Tensor) -> Tensor:
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
        # The VNNI kernel's copy (`pack_weight`), made from the int8 weight whenever that is loaded;
        # empty where the kernel does not read one. Not saved: a checkpoint holds `weight_int8`.
        self.register_buffer("weight_packed", self._packed(q), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._dequantised: Tensor | None = None

    @property
    def weight(self) -> Tensor:
        """The dequantised weight (out, in), made once: for code that reads `.weight` itself."""
        if self._dequantised is None:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor (readers check its version)
                self._dequantised = self.weight_int8.to(self.scale.dtype) * self.scale[:, None]
        return self._dequantised

    @staticmethod
    def _packed(weight_int8: Tensor) -> Tensor:
        if weight_int8.device.type == "cpu" and packs_weights():
            return pack_weight(weight_int8)
        return torch.empty(0, dtype=torch.uint8, device=weight_int8.device)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.weight_packed = self._packed(self.weight_int8)  # a packed copy of the old weight would be read
        self._dequantised = None

    def forward(self, x: Tensor) -> Tensor:  # x (..., in) -> (..., out)
        if x.device.type == "cpu" and x.dtype == torch.float32:  # the native kernel or its fallback
            product = int8_linear if torch.compiler.is_compiling() else int8_product
            y = product(x, self.weight_int8, self.scale, self.weight_packed)
        else:
            y = _converted_product(x, self.weight_int8, self.scale)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` in `model` by an `Int8Linear` (in place; returns the model). For
    inference: the int8 weights take no gradients."""
    from .fast import forget_compiled

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):  # an AcceleratedLinear too
                setattr(parent, name, Int8Linear(child))
    forget_compiled(model)  # a compiled step of the float layers would keep running them
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(getattr(m, "QUANTIZED", False) for m in model.modules())
