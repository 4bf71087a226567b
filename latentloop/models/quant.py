"""Weight-only int8 decoding: every `nn.Linear` of a model with its weight stored as int8, one scale
per output channel (symmetric: w ~= q * scale, q in [-127, 127], scale = max |w| of the row / 127).

    quantize_int8(model)   # in place; the activations, norms, embedding (and a tied head) stay float

Decoding streams the weights once per token, so a quarter of the bytes is up to four times less
memory traffic for the linear layers. How each product runs:
- compiled (the fast decode path, `models/fast.py`): `F.linear(x, q.to(x.dtype)) * scale`. On CPU the
  decode backend turns the product into a reduction, and inductor fuses the int8 -> float
  conversion into its loop: each weight is read as one byte, never materialised as float.
- eager: the same expression, the weight converted for the product (1.5x the float layer's time:
  2.4 vs 1.6 ms for 768 -> 3072 at one row, one thread). torch's weight-only int8 kernel
  (`torch._weight_int8pack_mm`) was slower still with float32 activations (12 ms; 0.87 ms with
  bfloat16 activations, which would round every layer's input): eager int8 saves memory, the
  compiled step saves time.

What is not quantised: the token embedding, and so a tied head (it is the embedding's matrix, read
by `F.linear` in `GPT.head`), norms, biases, and parameters that are not `nn.Linear` weights.
A module whose `.weight` the model reads directly (fbt's gate table reads its gate's) gets a float
copy dequantised once, on first read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INT8_MAX = 127  # symmetric: -128 is never used, so q and -q are both representable
# A row of zeros would get scale 0 and divide by zero when quantised: its scale is at least this
# (any positive value works: the row quantises to zeros either way).
MIN_SCALE = 1e-12


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
        # compiled: one fused loop that reads int8 (see the module doc); eager: a converted copy per call
        y = F.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` in `model` by an `Int8Linear` (in place; returns the model). For
    inference: the int8 weights take no gradients."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(getattr(m, "QUANTIZED", False) for m in model.modules())
