"""The one module that reaches into torch's private interfaces, each only on a torch version it was
tested with; on any other version each answers "not here" and its caller takes a public path.

    if torch_internals.tested():                      # torch 2.13: what this module was run against
        handles = torch_internals.tensor_handles(ts)  # else AotUnavailable: dynamo's compiled step runs

Why each private call is kept (no public interface offers it on the pinned torch):
- `tensor_handles` / `tensors_from_handles` (`torch._C._aoti`): turn tensors into the `at::Tensor*`
  handles AOTInductor's C interface takes, and back. The public loader (`aoti_load_package`) makes
  them itself, but holds the GIL for the whole step and makes every handle anew each call; the
  ahead-of-time decode step (`aot.py`) calls the package's library straight through ctypes instead
  (a step is one foreign call, the GIL released), which needs the handles.
- `onednn_linear` (`torch.ops.mkldnn._linear_pointwise`): oneDNN's product, which `F.linear` never
  picks on CPU (it calls MKL); measured faster from 8 rows by a large weight and from 128 rows by any
  (`products.py`). Where it is not here, `F.linear`.
- `force_stride_order` (`prims.inductor_force_stride_order`, registered by a private module of
  inductor): makes inductor store a tensor once rather than recompute it in a consumer's loop (the
  decode step's reductions, `fast._stored`). Where it is not here, the same values, computed where
  inductor chooses.
- `compile_fx` (`torch._inductor.compile_fx`): inductor as a backend with config patches, for the
  CPU decode step's rewritten graph. Where it is not here, the caller compiles with the stock
  inductor backend (the same numbers, without the step's rewrite).
- `dispatch_mode_active` (`torch.utils._python_dispatch`): whether a mode that watches ops (the FLOP
  counter) is on, in which case a product must go through torch's op for the mode to see it.

The version check is by (major, minor): `TESTED_VERSIONS`. `LATENTLOOP_TORCH_INTERNALS=0` turns them all
off (to run the public paths on a tested torch, e.g. in tests); `=1` turns them on for an untested
torch (at the user's risk: a changed signature fails loudly, a changed ABI may not).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

try:  # a private module of torch's: read once here, not on every product
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:
    _get_current_dispatch_mode = None
# the base class of a Python dispatch mode (sees every op below autograd, meta tensors included):
# public in use (torch's FlopCounterMode is one) though its module is private
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402, F401 - re-exported

TESTED_VERSIONS = ((2, 13),)  # (major, minor) of torch this module was run against
INTERNALS_ENV = "LATENTLOOP_TORCH_INTERNALS"  # "0": never; "1": also on an untested torch


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def tested() -> bool:
    """Whether the private calls below may run on this torch (see the module docstring)."""
    switch = os.environ.get(INTERNALS_ENV, "")
    if switch == "0":
        return False
    return switch == "1" or torch_version() in TESTED_VERSIONS


def untested_reason() -> str:
    """One line: why the private calls are off here."""
    if os.environ.get(INTERNALS_ENV, "") == "0":
        return f"torch's internals are turned off ({INTERNALS_ENV}=0)"
    tried = ", ".join(f"{a}.{b}" for a, b in TESTED_VERSIONS)
    return (f"torch {torch.__version__} is not a version latentloop's use of torch internals was tested with "
            f"({tried}; {INTERNALS_ENV}=1 tries anyway)")


# -- AOTInductor's tensor handles ----------------------------------------------------------------


def tensor_handles(tensors: list[Tensor]) -> list:
    """New `at::Tensor*` handles of these tensors, as PyCapsules (whoever the handles are handed to frees
    them, or `tensors_from_handles`)."""
    return torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(tensors)


def tensors_from_handles(capsules: list) -> list[Tensor]:
    """The tensors of these handles (PyCapsules), which are freed; the tensors keep what they point at."""
    return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(capsules)


def has_tensor_handles() -> bool:
    aoti = getattr(torch._C, "_aoti", None)
    return tested() and all(hasattr(aoti, name) for name in ("unsafe_alloc_void_ptrs_from_tensors",
                                                              "alloc_tensors_by_stealing_from_void_ptrs"))


# -- products and compiled code ------------------------------------------------------------------


@functools.cache
def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """x (rows, in) @ weight (out, in).T (+ bias) through oneDNN, or None where it is not here."""
    if not (tested() and _onednn_available()):
        return None
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def force_stride_order(tensor: Tensor) -> Tensor:
    """`tensor` (contiguous) as a buffer inductor stores (see the module docstring); the tensor itself
    where that is not here."""
    if not tested():
        return tensor
    try:  # registers the prim (imported already when compiling)
        from torch._inductor import inductor_prims  # noqa: F401
    except ImportError:
        return tensor
    return torch.ops.prims.inductor_force_stride_order(tensor, tensor.stride())


def compile_fx(gm, example_inputs, config_patches: dict):
    """Inductor's compile of a dynamo graph with `config_patches`: the body of a custom backend (the
    caller checks `tested()` first, and uses `backend="inductor"` where it is not)."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx(gm, example_inputs, config_patches=config_patches)


def dispatch_mode_active() -> bool:
    """Whether a Python dispatch mode (e.g. torch's FLOP counter) watches the ops now; True where that
    cannot be told (a product then goes through torch's op, which such a mode sees)."""
    return _get_current_dispatch_mode is None or _get_current_dispatch_mode() is not None
