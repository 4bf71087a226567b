"""The fast inference path, applied to a built model from outside: the models compute with torch's own
ops and know nothing of this package.

- `products`: `accelerate(model)`, a module swap (as torchao's `quantize_`) that routes float32 CPU
  products without autograd through latentloop's rows kernel or oneDNN where they were measured faster.
- `quant`: `quantize_int8(model)`, weight-only int8 linears (a module swap too) with a native kernel.
- `fast`: `FastDecoder`, the static-shape cache and one compiled decode step per architecture; on the
  CPU that step is an ahead-of-time package (`aot`) called through its C interface.
- `native`: the C kernels (the `.c` files beside it), built on first use into the cache, loaded only
  from a folder that is the user's alone and only as built (`cache_trust`).
- `torch_internals`: the one module that calls torch's private interfaces, on tested versions only.

Every kernel is gated by what it was measured on (x86 with AVX2 / AVX-512: `native.measured_here`);
elsewhere, without a C compiler, or with `LATENTLOOP_NATIVE=0`, the same calls take torch's paths.
"""

from .products import accelerate, is_accelerated
from .quant import is_quantized, quantize_int8

__all__ = ["accelerate", "is_accelerated", "is_quantized", "quantize_int8"]
