"""Native CPU kernels: small C files beside this module, compiled for the host on first use and kept
in the latentloop cache (`kernels/`), loaded with ctypes.

    lib = native_library("int8_linear")   # a ctypes.CDLL, or None (then the caller's torch path runs)
    y = rows_linear(x, weight)            # rows_linear.c's product, or None (see its doc)

Why C and ctypes rather than a torch C++ extension: a plain C file builds in well under a second with
the system's `cc` and needs neither ninja nor torch's headers; inductor, the compiled decode path's
backend, needs the same compiler on the CPU anyway. The build uses `-march=native` (AVX2 / FMA where
the CPU has them) and OpenMP; the library's name holds a hash of the source, the flags, the compiler's
version and the CPU's feature flags, so a cache shared between machines never loads a build for
another CPU. A build that fails is retried without OpenMP, then without -march=native; one that
never builds (no compiler) is remembered for the process and reported by `native_status`, and the
callers' torch paths run; `LATENTLOOP_NATIVE=0` turns the kernels off.

A library is mapped only when `cache_trust` vouches for it: the `kernels/` folder and the cache above
it are this user's and writable by nobody else (else no kernel is loaded, with one warning naming the
folder), and the file matches the sha256 recorded beside it when it was built (else it is built
again: a library cut short, an empty file or a foreign one under a kernel's name is never mapped).

`native_library(name, for_packages=True)` is a second build of the same file, for an ahead-of-time
compiled step (aot.py) to call: with `LATENTLOOP_AOTI` defined (the file's functions that take
libtorch's C tensor handles), linked with libtorch, and loaded with RTLD_GLOBAL so that a package's
library, loaded after it, finds those functions by name. Linux only (the library file's name and
the loader's global scope are what was tested).

OpenMP: torch's CPU wheel ships its own `libgomp.so.1`, loaded before this library, which the
dynamic loader then reuses (same soname): the kernels run on torch's thread pool, not a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from ..util import CACHE_ENV, default_cache_dir, warn_once
from .cache_trust import private_folder, publish_artifact, remove_artifact, untrusted_folder, unverified_file

NATIVE_ENV = "LATENTLOOP_NATIVE"  # "0" turns the native kernels off (the torch paths run instead)
LIBRARY_FLAGS = ("-O3", "-shared", "-fPIC")
# Tried in turn until one builds: the host's vector instructions and OpenMP; without OpenMP (Apple's
# clang has none: one thread, still vectorised); without -march=native (compilers that refuse it)
FLAG_CHOICES = (("-march=native", "-fopenmp"), ("-march=native",), ())
BUILD_TIMEOUT_S = 120  # one small C file: seconds at most, even on a busy machine
# Below this many multiply-adds a product runs on one thread: waking the others costs more than it saves.
PARALLEL_MIN_MACS = 1 << 16  # parallel.h has the same (the kernels' package functions count threads themselves)
ROWS_KERNEL = "rows_linear"
KERNELS_SUBDIR = "kernels"  # under the cache's root
# The rows kernel puts the rows in a vector's lanes (with AVX-512, up to 8 rows as pairs of k): with fewer
# lanes than an AVX2 register (a build without AVX2 + FMA, or not x86) it is a plain loop, slower than any BLAS.
ROWS_MIN_LANES = 8

_failures: dict[str, str] = {}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU (`CXX`, else c++, g++ or clang++), or None: without
    one, nothing compiles on the CPU (compiled decoding and training need inductor's C++ code). Asked
    at every decode's choice of path (`fast.fallback_reason`): the search of PATH is done once for
    each value of CXX and PATH."""
    return _find_cxx(os.environ.get("CXX"), os.environ.get("PATH"))


@functools.cache
def _find_cxx(chosen: str | None, path: str | None) -> str | None:
    if chosen:
        return shutil.which(chosen, path=path) or (chosen if os.path.isfile(chosen) else None)
    return shutil.which("c++", path=path) or shutil.which("g++", path=path) or shutil.which("clang++", path=path)


NO_CXX = "no C++ compiler (c++, g++ or clang++; or set CXX), which inductor needs to compile on the CPU"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else the platform's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


# The build for packages: the C interface's functions compiled in, libtorch (which defines the
# `aoti_torch_*` functions they call) linked after the source.
PACKAGE_DEFINE = "-DLATENTLOOP_AOTI"


def _torch_link_flags() -> tuple[str, ...]:
    library_dir = Path(torch.__file__).resolve().parent / "lib"
    return (f"-L{library_dir}", f"-Wl,-rpath,{library_dir}", "-ltorch_cpu")


def _build(cc: str, source: Path, target: Path, flags: tuple[str, ...], libraries: tuple[str, ...] = ()) -> str | None:
    """Compile `source` into `target` atomically; None on success, else the compiler's complaint."""
    try:
        private_folder(target.parent)
        fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
        os.close(fd)
    except OSError as exc:
        return f"cannot write {target.parent}: {exc.strerror or exc}"
    try:
        done = subprocess.run([cc, *flags, str(source), *libraries, "-o", partial], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or [f"{cc} exited with {done.returncode}"])[-1]
        publish_artifact(Path(partial), target)  # its digest with it: a reader finding it finds its digest
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def kernels_dir() -> Path:
    """Where the kernel libraries are built and kept: the cache's `kernels/`."""
    return default_cache_dir() / KERNELS_SUBDIR


def _failure_key(name: str, for_packages: bool) -> str:
    return f"{name} for packages" if for_packages else name


@functools.cache
def native_library(name: str, for_packages: bool = False) -> ctypes.CDLL | None:
    """The kernel library `name` (`name`.c beside this module), built on first use; None when the
    kernels are off or it cannot be built (the reason: `native_status(name)`). `for_packages`: the
    build an ahead-of-time package calls (see the module doc)."""
    failure = _failure_key(name, for_packages)
    if os.environ.get(NATIVE_ENV, "1") == "0":
        _failures[failure] = f"turned off ({NATIVE_ENV}=0)"
        return None
    if for_packages and not sys.platform.startswith("linux"):
        _failures[failure] = f"a package calls the kernels on Linux only (this is {sys.platform})"
        return None
    cc = _compiler()
    if cc is None:
        _failures[failure] = "no C compiler (cc, gcc or clang; or set CC)"
        return None
    source = Path(__file__).with_name(f"{name}.c")
    if not source.is_file():  # a copy of the modules without their C files (an exported model's remote code)
        _failures[failure] = f"{source.name} is not beside {Path(__file__).name}"
        return None
    # the source and the headers beside it (a change to a header it includes builds it again)
    code = b"\0".join([source.read_bytes(), *(h.read_bytes() for h in sorted(source.parent.glob("*.h")))])
    host = [_compiler_version(cc).encode(), _cpu_signature().encode()]
    defines, libraries = ((PACKAGE_DEFINE,), _torch_link_flags()) if for_packages else ((), ())
    suffix = "-packages" if for_packages else ""
    folder = kernels_dir()
    try:  # made before it is judged: a folder someone else made first is then seen as theirs
        private_folder(folder)
    except OSError:
        pass  # a read-only cache: judged as it is, and a build into it says why it failed
    distrusted = untrusted_folder(folder)
    if distrusted is not None:  # someone else could have put a library there: none is loaded from it
        _failures[failure] = f"not loading kernels from {folder}: {distrusted}"
        warn_once(f"{_failures[failure]}; the slower torch path runs (set {CACHE_ENV} to a folder of your own)")
        return None
    reasons = []
    for choice in FLAG_CHOICES:
        flags = LIBRARY_FLAGS + defines + choice
        key = hashlib.sha256(b"\0".join([code, " ".join(flags + libraries).encode(), *host])).hexdigest()[:16]
        target = folder / f"{name}{suffix}-{key}.so"
        problem = None
        if target.exists() and unverified_file(target) is not None:  # damaged, foreign, or from before digests
            problem = remove_artifact(target)
        if problem is None and not target.is_file():
            problem = _build(cc, source, target, flags, libraries)
        if problem is None:  # a fresh build is checked as a kept one is, before it is ever mapped
            problem = unverified_file(target)
        if problem is None:
            try:
                return ctypes.CDLL(str(target), mode=os.RTLD_GLOBAL if for_packages else ctypes.DEFAULT_MODE)
            except OSError as exc:
                problem = str(exc)
        reasons.append(problem)
    _failures[failure] = f"{name}.c did not build with {cc}: {reasons[-1]}"
    if any(reason.startswith("cannot write") or "cannot be removed" in reason for reason in reasons):
        # a cache this process cannot write: said, where the kernels were switched off without a word
        warn_once(f"{_failures[failure]}; the slower torch path runs (set {CACHE_ENV} to a folder you can write)")
    return None


def native_status(name: str, for_packages: bool = False) -> str:
    """'native' when the kernel library `name` loads, else why not (one line)."""
    if native_library(name, for_packages) is not None:
        return "native"
    return _failures.get(_failure_key(name, for_packages), "unavailable")


# What the kernels were measured on: x86 with AVX2 and FMA (AVX-512 used where present). On anything
# else (an ARM CPU, an x86 one without AVX2) a kernel would run its scalar loop, never measured
# against torch's products: there every caller takes torch's path.
MEASURED_ARCHITECTURES = ("x86_64", "amd64")
MEASURED_FLAGS = ("avx2", "fma")


@functools.cache
def measured_here() -> bool:
    """Whether this CPU is one the native kernels were measured on (see `MEASURED_FLAGS`); the callers
    (products, int8 decoding, the compiled step's rows products) take torch's path where it is not."""
    if platform.machine().lower() not in MEASURED_ARCHITECTURES:
        return False
    flags = set(_cpu_signature().split())
    return all(flag in flags for flag in MEASURED_FLAGS)


def threads_for(macs: int) -> int:
    """Threads for a product of `macs` multiply-adds: torch's, or one for a small product."""
    return torch.get_num_threads() if macs >= PARALLEL_MIN_MACS else 1


def _vector_library(name: str, lanes_function: str) -> ctypes.CDLL | None:
    """The kernel library `name` where this CPU is one the kernels were measured on and its build
    holds at least ROWS_MIN_LANES floats a vector (its C function `lanes_function` says how many), on
    x86; else None, the reason kept for `native_status`-like reports (`_failures[name]`)."""
    if not measured_here():
        _failures[name] = (f"this CPU ({platform.machine()}) is not one the kernels were measured on "
                           f"(x86 with {' and '.join(MEASURED_FLAGS).upper()})")
        return None
    lib = native_library(name)
    if lib is None:
        return None
    lanes_of = getattr(lib, lanes_function)
    lanes_of.restype = ctypes.c_int
    lanes_of.argtypes = []
    lanes = lanes_of()
    if lanes < ROWS_MIN_LANES or platform.machine().lower() not in ("x86_64", "amd64"):
        _failures[name] = (f"{name}.c built with {lanes} lane(s) on {platform.machine()}: it is used with at "
                           f"least {ROWS_MIN_LANES} (AVX2 + FMA or AVX-512), on x86, where it was measured")
        return None
    return lib


@functools.cache
def _rows_library() -> ctypes.CDLL | None:
    lib = _vector_library(ROWS_KERNEL, "latentloop_rows_linear_lanes")
    if lib is None:
        return None
    for function, pointers in ((lib.latentloop_rows_linear_f32, 3), (lib.latentloop_rows_linear_i8, 4)):
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return lib


def rows_linear_status() -> str:
    """'native' when `rows_linear` runs its kernel, else why not (one line)."""
    return "native" if _rows_library() is not None else _failures.get(ROWS_KERNEL, "unavailable")


def rows_linear(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor | None:
    """x (rows, K) float32 @ weight (N, K).T -> (rows, N), through `rows_linear.c`: weight float32, or
    int8 with `scale` (N,) float32 (y = x @ (weight * scale[:, None]).T). None where the kernel is not
    here (the caller's torch path runs); the caller checks device (CPU), dtypes and autograd."""
    lib = _rows_library()
    if lib is None:
        return None
    if weight.dtype != (torch.float32 if scale is None else torch.int8):
        raise TypeError(f"rows_linear takes a float32 weight, or an int8 one with a scale; got {weight.dtype}")
    rows, k = x.shape
    n = weight.shape[0]
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    threads = threads_for(rows * n * k)
    if scale is None:
        failed = lib.latentloop_rows_linear_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, n, k, threads)
    else:
        scale = scale.contiguous()
        failed = lib.latentloop_rows_linear_i8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(),
                                               rows, n, k, threads)
    return None if failed else y


# What an ahead-of-time package calls for `latentloop::rows_linear`: AOTInductor names an operator's C
# function aoti_torch_<device>_<name> and declares it as given here (rows_linear.c defines it).
ROWS_PACKAGE_FUNCTION = ("AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle weight, "
                         "AtenTensorHandle* out)")


def rows_package_kernel() -> str | None:
    """The rows kernel's build for packages (its file name, for a package's key) where the kernel is
    used here at all (`rows_linear_status`), else None: a package then runs torch's product."""
    if _rows_library() is None:
        return None
    lib = native_library(ROWS_KERNEL, for_packages=True)
    return None if lib is None else Path(lib._name).name


# `rows_linear` as an operator torch.compile keeps opaque (dynamo cannot trace ctypes) and an
# ahead-of-time package calls as `ROWS_PACKAGE_FUNCTION`: a compiled step's products of a batch's rows
# (fast._linear_by_reduction). Eager callers call `rows_linear` itself (`products.accelerated_linear`): the
# operator's dispatch costs more than a small product.
@torch.library.custom_op("latentloop::rows_linear", mutates_args=())
def rows_linear_op(x: Tensor, weight: Tensor) -> Tensor:
    y = rows_linear(x.reshape(-1, x.shape[-1]), weight)
    if y is None:  # no kernel here: torch's own product (`F.linear` may be swapped while a step is exported)
        return torch.ops.aten.linear.default(x, weight)
    return y.view(*x.shape[:-1], weight.shape[0])


@rows_linear_op.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


ATTENTION_KERNEL = "attention"
CACHE_DTYPES = (torch.float32, torch.float16)  # a cache's keys and values the attention kernel reads


@functools.cache
def _attention_library() -> ctypes.CDLL | None:
    lib = _vector_library(ATTENTION_KERNEL, "latentloop_attention_lanes")  # a plain loop: never measured
    if lib is None:
        return None
    strides = ctypes.POINTER(ctypes.c_int64)
    for function in (lib.latentloop_decode_attention_f32, lib.latentloop_decode_attention_f16):
        function.restype = ctypes.c_int
        function.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [strides] * 4
                             + [ctypes.c_float, ctypes.c_int])
    return lib


def decode_attention_status() -> str:
    """'native' when `decode_attention` runs its kernel, else why not (one line)."""
    return "native" if _attention_library() is not None else _failures.get(ATTENTION_KERNEL, "unavailable")


def decode_attention_fits(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None) -> bool:
    """Whether `decode_attention` takes these: one query per row, a float32 q and k, v both float32
    or both float16 (B, H | Hkv, ., hd) with Hkv dividing H, and a bool mask (B | 1, H | 1, 1, L)."""
    if not (query.dim() == key.dim() == value.dim() == 4 and attn_mask is not None and attn_mask.dim() == 4):
        return False
    B, H, T, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    return (T == 1 and query.dtype == torch.float32 and key.dtype == value.dtype in CACHE_DTYPES
            and attn_mask.dtype == torch.bool
            and Hkv >= 1 and H % Hkv == 0 and tuple(key.shape) == (B, Hkv, L, D)
            and tuple(value.shape[:3]) == (B, Hkv, L) and attn_mask.shape[0] in (1, B)
            and attn_mask.shape[1] in (1, H) and attn_mask.shape[2] == 1 and attn_mask.shape[3] == L)


def _broadcast_strides(tensor: Tensor, dims: tuple[int, ...]):
    """`tensor`'s strides at `dims` as the kernel takes them: 0 where the size is 1 (broadcast)."""
    return (ctypes.c_int64 * len(dims))(*(tensor.stride(d) if tensor.shape[d] != 1 else 0 for d in dims))


def decode_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor, scale: float) -> Tensor | None:
    """SDPA of one query per row over a decode step's cache, through `attention.c`: query (B, H, 1, D)
    float32, key (B, Hkv, L, D) and value (B, Hkv, L, Dv) both float32 or both float16 (each element
    widened to float32 as it is read; the result is float32) on the CPU, each with a contiguous last
    dimension (the others may be strided: a window of a longer buffer), attn_mask bool (B | 1, H | 1,
    1, L) (True = may attend) -> (B, H, 1, Dv); a row whose keys are all masked gets zeros, as SDPA
    gives. None where the kernel is not here (the caller's path runs). The caller checks the shapes
    (`decode_attention_fits`)."""
    lib = _attention_library()
    if lib is None:
        return None
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    B, H, _, D = query.shape
    Hkv, L, Dv = key.shape[1], key.shape[2], value.shape[3]
    out = torch.empty(B, H, 1, Dv, dtype=torch.float32)
    kernel = lib.latentloop_decode_attention_f16 if key.dtype == torch.float16 else lib.latentloop_decode_attention_f32
    failed = kernel(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), attn_mask.data_ptr(), out.data_ptr(), B, H, Hkv, L, D, Dv,
        _broadcast_strides(query, (0, 1)), _broadcast_strides(key, (0, 1, 2)), _broadcast_strides(value, (0, 1, 2)),
        _broadcast_strides(attn_mask, (0, 1, 3)), scale, threads_for(B * H * L * (D + Dv)))
    return None if failed else out


# What an ahead-of-time package calls for `latentloop::decode_attention` (see `ROWS_PACKAGE_FUNCTION`)
ATTENTION_PACKAGE_FUNCTION = ("AOTITorchError aoti_torch_cpu_decode_attention(AtenTensorHandle q, AtenTensorHandle k, "
                              "AtenTensorHandle v, AtenTensorHandle mask, double scale, AtenTensorHandle* out)")


def attention_package_kernel() -> str | None:
    """The attention kernel's build for packages (its file name, for a package's key) where the kernel
    is used here at all (`decode_attention_status`), else None: a package then runs the attention as
    inductor's reductions."""
    if _attention_library() is None:
        return None
    lib = native_library(ATTENTION_KERNEL, for_packages=True)
    return None if lib is None else Path(lib._name).name


# `decode_attention` as an operator an ahead-of-time package calls as `ATTENTION_PACKAGE_FUNCTION`
# (fast._attention_for_package): its eager body is what the operator computes while the step is traced
# and where a package is not built.
@torch.library.custom_op("latentloop::decode_attention", mutates_args=())
def decode_attention_op(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor, scale: float) -> Tensor:
    out = decode_attention(query, key, value, attn_mask, scale)
    if out is None:  # no kernel here: torch's own attention, over the cache widened to the query's dtype
        return torch.ops.aten.scaled_dot_product_attention.default(
            query, key.to(query.dtype), value.to(query.dtype), attn_mask=attn_mask, scale=scale,
            enable_gqa=key.shape[1] != query.shape[1])
    return out


@decode_attention_op.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor, scale: float) -> Tensor:
    return query.new_empty((*query.shape[:3], value.shape[-1]))
