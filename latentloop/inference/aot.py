"""The CPU decode step compiled ahead of time: `torch.export` + AOTInductor, a shared library on disk.

`FastDecoder` on CPU runs its step through this module. Dynamo's compiled step is exact and fast
inside, but every call passes through dynamo's frame hook, its guards and AOT autograd's runtime
wrappers: at the engines benchmark's small shape (4 layers, d=256, batch 1, 1 thread) those cost
about as much as the step's kernels themselves (issue 26). An AOTInductor package's library is called
straight through its C interface (`_Library`, with ctypes, which releases the GIL while the step runs:
torch's `AOTIModelPackageLoader.run` holds it, so a server's HTTP thread stood still during every
step), and loading one takes milliseconds without importing `torch._dynamo` or `torch._inductor`, so
a second process decodes compiled from its first step. After a decode's first step, a step is one
foreign call of `aot_run.c` (`_PreparedRun`): the inputs' handles are made once and the outputs copied
into the last step's tensors, which the caller passes back as the next token; a new window of the same
cache (every 16 steps) swaps the window's handle only (`AotDecodeStep._slide`).

How a step becomes a package (`AotDecodeStep`, one per model and options):
- The cache's tensors (keys/values per slot, positions, write index, window marker, the
  architecture's state) are the exported function's inputs, flattened in a fixed order
  (`cache_fields`); the step writes into them in place (export records the input mutations and the
  package applies them). The window's length is the one dynamic dimension, as in dynamo's graph.
- The weights are not copied into the package (`package_constants_in_so=False`): after loading,
  the package is pointed at the model's own parameters and buffers (user-managed constants: not
  copied either, so a change made in place is read by the next step, and N batch sizes' packages do
  not hold N copies). So a package depends on the model's code, config, options and shapes, not its
  weights: another checkpoint of the same config reuses it, and nothing stale is ever read.
- The traced step is the same rewritten one as dynamo's (`_cpu_decode_backend`): one-row products
  and one-query attention as reductions, by swapping `F.linear` and SDPA while exporting
  (`EXPORT_SWAPS`). An int8 product stays the operator `latentloop::int8_linear`, which the package
  calls as the C function of `int8_linear.c`'s build for packages (`quant.package_kernel`, loaded
  into the process before any package); where that build is missing it is swapped for a reduction too.
- Packages live in `compile_cache_dir()/aot/`, named by a hash of everything they depend on
  (`package_key`): torch's version, this package's model code, the CPU's instruction set flags,
  the config, the options and each input's shape and dtype. A write is atomic (temp file, rename),
  and its sha256 is recorded beside it: a package is loaded only from a folder that is this user's
  alone (`fast.compile_cache_dir`) and only when it matches its digest (`cache_trust`), else it is
  compiled again.
- What the model reports (`ModelOutput.info`) is Python data fixed by the options; it is kept in
  the package's metadata.

What does not export falls back: `AotDecodeStep.prepare` raises `AotUnavailable` with the reason,
and `FastDecoder` keeps dynamo's compiled step for that decoder (a model off the CPU is refused
before trying). `LATENTLOOP_AOT=0` turns this module off (dynamo's step everywhere), e.g. to
compare the two.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
import zipfile
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..util import first_line
from . import native, quant, torch_internals
from .cache_trust import private_folder, publish_artifact, remove_artifact, unverified_file

AOT_ENV = "LATENTLOOP_AOT"  # "0": no ahead-of-time packages, dynamo's compiled step everywhere
AOT_SUBDIR = "aot"  # under compile_cache_dir()
PACKAGE_FORMAT = 1  # bump when the inputs' order or the metadata's meaning changes
INFO_KEY = "latentloop_info"  # the package metadata's entry holding the step's `info` (JSON)
# The model code a package is built from: any change to these files misses the cache.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # latentloop/
# The code a step runs: the models, every architecture's package and this one (its C files too)
MODEL_SOURCES = tuple(PACKAGE_ROOT / part for part in ("models", "archs", "inference"))


def aot_enabled() -> bool:
    return os.environ.get(AOT_ENV, "1") != "0"


class AotUnavailable(RuntimeError):
    """This step cannot be compiled ahead of time; the message says why (dynamo's step is used)."""


# --------------------------------------------------------------------------------------------
# The cache's tensors as a flat list of inputs
# --------------------------------------------------------------------------------------------


def cache_fields(cache) -> list[tuple[str, str, object]]:
    """The cache's tensor-valued attributes in a fixed order: (name, kind, keys) with kind "tensor",
    "list" (of tensors; keys = its length) or "dict" (str -> tensor; keys = sorted names). The
    exported step takes them as inputs in this order (`flatten`) and puts them back (`restore`)."""
    fields = []
    for name in sorted(vars(cache)):
        value = getattr(cache, name)
        if isinstance(value, Tensor):
            fields.append((name, "tensor", None))
        elif isinstance(value, list) and value and all(isinstance(t, Tensor) for t in value):
            fields.append((name, "list", len(value)))
        elif isinstance(value, dict) and value and all(isinstance(t, Tensor) for t in value.values()):
            fields.append((name, "dict", tuple(sorted(value))))
    return fields


def window_is_dynamic(window: Tensor, max_len: int) -> bool:
    """A window shorter than the buffer is the package's dynamic dimension; one as long as the buffer
    slices nothing, which export can only trace as a size of its own (as dynamo specialises it)."""
    return window.shape[0] < max_len


def flatten(cache, fields) -> list[Tensor]:
    flat: list[Tensor] = []
    for name, kind, keys in fields:
        value = getattr(cache, name)
        if kind == "tensor":
            flat.append(value)
        elif kind == "list":
            flat.extend(value)
        else:
            flat.extend(value[key] for key in keys)
    return flat


def restore(cache, fields, flat: list[Tensor]) -> None:
    """Set the cache's tensor attributes from `flat` (the inverse of `flatten`)."""
    at = 0
    for name, kind, keys in fields:
        if kind == "tensor":
            setattr(cache, name, flat[at])
            at += 1
        elif kind == "list":
            setattr(cache, name, list(flat[at:at + keys]))
            at += keys
        else:
            setattr(cache, name, dict(zip(keys, flat[at:at + len(keys)])))
            at += len(keys)


class _ExportedStep(nn.Module):
    """The decode step as a module export can trace: (token (B,), *cache tensors) -> (logits (B, V),
    greedy ids (B,)). The cache object is only the step's scaffolding: its tensors are the inputs."""

    def __init__(self, model, options: dict, step_fn):
        super().__init__()
        self.model = model
        self.options, self.step_fn = options, step_fn
        self.cache, self.fields = None, []  # set while one cache's step is exported
        self.info: dict = {}

    def forward(self, token: Tensor, flat: list[Tensor]) -> tuple[Tensor, ...]:
        restore(self.cache, self.fields, flat)
        logits, greedy, self.info, *extras = self.step_fn(self.model, token, self.cache, self.options)
        return (logits, greedy, *extras)


def _kernel_config() -> dict:
    """Inductor's settings for a package to call the kernels' C functions (int8 products; float32
    products of a batch's rows), those whose package build loads here."""
    shims = {}
    if quant.package_kernel() is not None:
        shims[torch.ops.latentloop.int8_linear.default] = [quant.PACKAGE_FUNCTION]
    if native.rows_package_kernel() is not None:
        shims[torch.ops.latentloop.rows_linear.default] = [native.ROWS_PACKAGE_FUNCTION]
    if native.attention_package_kernel() is not None:
        shims[torch.ops.latentloop.decode_attention.default] = [native.ATTENTION_PACKAGE_FUNCTION]
    return {"aot_inductor.custom_ops_to_c_shims": shims} if shims else {}


@contextlib.contextmanager
def _products_as_reductions():
    """The products swapped for fast.py's reductions (`EXPORT_SWAPS`: what dynamo's backend rewrites
    in its graph) while a step is traced; the int8 operator stays where the package can call its kernel."""
    from .fast import EXPORT_SWAPS

    swaps = [(module, name, reduction) for module, name, reduction in EXPORT_SWAPS
             if not (module is quant and quant.package_kernel() is not None)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    for module, name, reduction in swaps:
        setattr(module, name, reduction)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


# torch 2.13's own deprecation, raised by its own code: exporting and packaging deep-copy the program's
# tree specs, and copying a `LeafSpec` warns that `isinstance(treespec, LeafSpec)` is deprecated. Not
# the caller's doing nor theirs to mend, it landed in the middle of `latentloop generate`'s output.
TORCH_LEAF_SPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


@contextlib.contextmanager
def _without_torch_leaf_spec_warning():
    """torch's `LeafSpec` deprecation (`TORCH_LEAF_SPEC_WARNING`) silenced while this runs; every other
    warning as it was."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCH_LEAF_SPEC_WARNING, category=FutureWarning)
        yield


@contextlib.contextmanager
def _attributes_as_buffers(holder: nn.Module):
    """Plain tensor attributes of the model's modules (e.g. fbt's gate table, `token_gates`)
    registered as buffers while the step is exported: a package names a buffer by its path (the
    loader points it at the attribute again), but an attribute by a number of its own."""
    moved = []
    for module in holder.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                del module.__dict__[name]
                module.register_buffer(name, value, persistent=False)
                moved.append((module, name, value))
    try:
        yield
    finally:
        for module, name, value in moved:
            del module._buffers[name]
            module.__dict__[name] = value


# --------------------------------------------------------------------------------------------
# Packages on disk
# --------------------------------------------------------------------------------------------


def _source_digest() -> str:
    digest = hashlib.sha256()
    sources = (path for folder in MODEL_SOURCES for suffix in ("*.py", "*.c", "*.h") for path in folder.rglob(suffix))
    for path in sorted(sources):
        digest.update(path.relative_to(PACKAGE_ROOT).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()


def cpu_vendor() -> str:
    """The CPU's vendor (/proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD). It decides which
    product a step uses for a wide weight (`fast.REDUCTION_MAX_OUTPUTS`), so a package's key holds it."""
    return _cpuinfo("vendor_id")


def _cpu_flags() -> str:
    """The instruction set the package's kernels were vectorised for (inductor picks it at compile time)."""
    return _cpuinfo("flags")


def _cpuinfo(field: str) -> str:
    """A field of /proc/cpuinfo (its first processor's), or the platform's processor name where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


_DIGESTS: dict[str, str] = {}


def model_code_digest() -> str:
    """A hash of this package's model code (read once a process): what a compiled step is built from."""
    if "source" not in _DIGESTS:
        _DIGESTS["source"] = _source_digest()
    return _DIGESTS["source"]


def package_key(model, options: dict, cache, fields, tokens: int = 0) -> str:
    """A name for the package of this step: what it depends on, hashed (see the module docstring).
    `tokens`: the tokens per row of a several-token step (0: the one-token decode step)."""
    if "cpu" not in _DIGESTS:
        _DIGESTS["cpu"] = hashlib.sha256(f"{cpu_vendor()} {_cpu_flags()}".encode()).hexdigest()
    config = model.config
    config = asdict(config) if is_dataclass(config) else vars(config)
    flat = flatten(cache, fields)
    dynamic = cache.window if window_is_dynamic(cache.window, cache.max_len) else None
    inputs = [(list(t.shape) if t is not dynamic else [-1], str(t.dtype), list(t.stride()) if t is not dynamic else [])
              for t in flat]
    constants = [(name, list(t.shape), str(t.dtype)) for name, t in
                 [*model.named_parameters(), *model.named_buffers()]]
    blob = json.dumps({"format": PACKAGE_FORMAT, "torch": torch.__version__, "source": model_code_digest(),
                       "cpu": _DIGESTS["cpu"], "threads": torch.get_num_threads(),
                       "int8_kernel": quant.package_kernel(), "rows_kernel": native.rows_package_kernel(),
                       "attention_kernel": native.attention_package_kernel(),
                       "class": type(model).__qualname__, "cache": type(cache).__qualname__,
                       "config": config, "options": sorted((k, repr(v)) for k, v in options.items()),
                       "fields": fields, "inputs": inputs, "constants": constants,
                       **({"tokens": tokens} if tokens else {})},  # the decode step's keys as they were
                      sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


# What export writes on its input tensors to mark their dimensions (and deletes only when it succeeds)
_DYNAMO_MARKS = ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_dynamo_dynamic_range",
                 "_dynamo_static_indices", "_dynamo_unbacked_indices", "_dynamo_propagated_dynamic_indices",
                 "_has_dynamo_dim_marking")


def _reset_dynamic_marks(inputs: list[Tensor], window: Tensor) -> None:
    """The inputs as dynamo expects them after an export, failed or not: unmarked, but for the window's
    length, which `set_window` marks dynamic for dynamo's step (a failed export left it static, so the
    fallback's graph recompiled when the window grew)."""
    for tensor in inputs:
        for mark in _DYNAMO_MARKS:
            if hasattr(tensor, mark):
                delattr(tensor, mark)
    torch._dynamo.maybe_mark_dynamic(window, 0)


def _resolve(module: nn.Module, path: str) -> Tensor:
    value = module
    for part in path.split("."):
        value = getattr(value, part, None)
    if not isinstance(value, Tensor):
        raise AotUnavailable(f"the package's constant {path} is not a tensor of the model")
    return value


_VOIDP, _SIZE, _CHARP = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p


class _ConstantEntry(ctypes.Structure):  # AOTInductorConstantMapEntry: a constant's name and tensor
    _fields_ = [("name", _CHARP), ("handle", _VOIDP)]


# The entry points of a package's model library (AOTInductor's C interface, `aoti_runtime/interface.h`)
# and their argument types; each returns an AOTIRuntimeError, 0 on success.
_ENTRY_POINTS = {
    "AOTInductorModelContainerCreateWithDevice": (ctypes.POINTER(_VOIDP), _SIZE, _CHARP, _CHARP),
    "AOTInductorModelContainerDelete": (_VOIDP,),
    "AOTInductorModelContainerGetNumConstants": (_VOIDP, ctypes.POINTER(_SIZE)),
    "AOTInductorModelContainerGetConstantName": (_VOIDP, _SIZE, ctypes.POINTER(_CHARP)),
    "AOTInductorModelContainerGetConstantOriginalFQN": (_VOIDP, _SIZE, ctypes.POINTER(_CHARP)),
    "AOTInductorModelContainerGetConstantFromFolded": (_VOIDP, _SIZE, ctypes.POINTER(ctypes.c_bool)),
    "AOTInductorModelContainerGetNumOutputs": (_VOIDP, ctypes.POINTER(_SIZE)),
    "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs":
        (_VOIDP, ctypes.POINTER(_ConstantEntry), _SIZE, ctypes.c_bool, ctypes.c_bool),
    "AOTInductorModelContainerRun": (_VOIDP, _VOIDP, _SIZE, _VOIDP, _SIZE, _VOIDP, _VOIDP),
    "AOTInductorGetLastError": (ctypes.POINTER(_CHARP),),
}
# torch hands tensor handles (`at::Tensor*`) over as nameless capsules; the library takes raw pointers
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes, _capsule_pointer.restype = (ctypes.py_object, _CHARP), _VOIDP
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.argtypes, _new_capsule.restype = (_VOIDP, _CHARP, _VOIDP), ctypes.py_object


# Where a capsule keeps its pointer: right after the object's header (CPython's PyCapsule), read in
# place of a PyCapsule_GetPointer call per handle (14 handles: 2.5 us against 5.1 us, on a step of
# ~400 us at the engines' small shape). Checked against PyCapsule_GetPointer once; where it differs,
# every handle goes through the call.
_CAPSULE_POINTER_OFFSET = object.__basicsize__


def _capsule_pointer_reader():
    probe = _new_capsule(0x5A5A5A5A, None, None)
    if ctypes.c_void_p.from_address(id(probe) + _CAPSULE_POINTER_OFFSET).value == _capsule_pointer(probe, None):
        return lambda capsule: ctypes.c_void_p.from_address(id(capsule) + _CAPSULE_POINTER_OFFSET).value
    return lambda capsule: _capsule_pointer(capsule, None)


_read_pointer = _capsule_pointer_reader()


def _handles(tensors: list[Tensor]) -> list[int]:
    """New handles (`at::Tensor*`) of these tensors, as raw pointers (a handle is freed by whoever it
    is handed to, or by `_tensors`)."""
    return [_read_pointer(capsule) for capsule in torch_internals.tensor_handles(tensors)]


def _tensors(handles) -> list[Tensor]:
    """The tensors of these handles, which are freed (the tensors keep what they point at)."""
    return torch_internals.tensors_from_handles([_new_capsule(h, None, None) for h in handles])


_LIBRARY_SUFFIX = ".wrapper.so"  # the model library in a package's archive
# The other files a package of ours may hold. Anything else (e.g. the JSON of operators run through
# torch's proxy executor, which only torch's own loader provides) makes the package load refuse.
_KNOWN_SUFFIXES = (_LIBRARY_SUFFIX, ".wrapper.cpp", ".kernel.cpp", "_metadata.json", "archive_format",
                   "archive_version", "version", "byteorder", "serialization_id")


def _package_metadata(archive: zipfile.ZipFile, library: str) -> dict[str, str]:
    """The metadata AOTInductor keeps in a package (`aot_inductor.metadata` and the device it was built
    for): the JSON file inductor writes beside the model library, `X.wrapper_metadata.json` for
    `X.wrapper.so` (torch 2.13's `codecache`: the wrapper's path with `_metadata.json` for its suffix)."""
    name = library.removesuffix(".so") + "_metadata.json"
    try:
        metadata = json.loads(archive.read(name))
    except (KeyError, ValueError) as error:
        raise AotUnavailable(f"the package's metadata {name} is missing or not JSON: {error}") from None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AotUnavailable(f"the package's metadata {name} is not a mapping of strings")
    return metadata


class _Library:
    """A package's model library, called through ctypes. torch's loader (`AOTIModelPackageLoader`)
    holds the GIL while a step runs, so a server's HTTP thread (or any other Python thread) stood
    still for the whole step; a ctypes call releases it. The weights are the model's own tensors
    (user-managed constants: nothing copied, an in-place change is seen by the next step)."""

    def __init__(self, path: Path):
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if not n.endswith("/")]
            unknown = [n for n in names if not n.endswith(_KNOWN_SUFFIXES)]
            libraries = [n for n in names if n.endswith(_LIBRARY_SUFFIX)]
            if unknown or len(libraries) != 1:
                raise AotUnavailable(f"{path.name} is not a package this loader runs (one model library, no "
                                     f"operators for torch's proxy executor): {unknown or libraries}")
            self.metadata = _package_metadata(archive, libraries[0])
            private = tempfile.mkdtemp(prefix="latentloop-aot-")
            try:  # loaded from a private copy, removed once mapped (the process keeps its mapping)
                so_path = Path(private) / "model.so"
                so_path.write_bytes(archive.read(libraries[0]))
                self._lib = ctypes.CDLL(str(so_path))
            finally:
                shutil.rmtree(private, ignore_errors=True)
        for name, argtypes in _ENTRY_POINTS.items():
            function = getattr(self._lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int32
        self._handle = _VOIDP()
        self._call("AOTInductorModelContainerCreateWithDevice", ctypes.byref(self._handle), 1, b"cpu", None)
        count, outputs = _SIZE(), _SIZE()
        self._call("AOTInductorModelContainerGetNumConstants", self._handle, ctypes.byref(count))
        self._call("AOTInductorModelContainerGetNumOutputs", self._handle, ctypes.byref(outputs))
        self.outputs = outputs.value
        self.constants: list[tuple[bytes, str]] = []  # (the library's name, the model's path) of each
        for i in range(count.value):
            folded, name, fqn = ctypes.c_bool(), _CHARP(), _CHARP()
            self._call("AOTInductorModelContainerGetConstantFromFolded", self._handle, i, ctypes.byref(folded))
            if folded.value:  # computed inside the package from the others
                continue
            self._call("AOTInductorModelContainerGetConstantName", self._handle, i, ctypes.byref(name))
            self._call("AOTInductorModelContainerGetConstantOriginalFQN", self._handle, i, ctypes.byref(fqn))
            self.constants.append((name.value, fqn.value.decode()))

    def _call(self, name: str, *args) -> None:
        if getattr(self._lib, name)(*args) != 0:
            self._fail(name)

    def _fail(self, name: str) -> None:
        message = _CHARP()
        self._lib.AOTInductorGetLastError(ctypes.byref(message))
        raise RuntimeError(f"{name} failed: {(message.value or b'').decode(errors='replace') or 'no message'}")

    def bind(self, tensors: list[Tensor]) -> None:
        """The constants, in `self.constants`' order, pointed at these tensors (which the library
        keeps alive through handles of its own)."""
        handles = _handles(tensors)
        try:
            pairs = (_ConstantEntry * len(handles))(*((name, handle) for (name, _), handle
                                                      in zip(self.constants, handles)))
            self._call("AOTInductorModelContainerUpdateUserManagedConstantBufferPairs", self._handle, pairs,
                       len(handles), False, True)  # use_inactive, validate_full_update
        finally:  # the library made handles of its own: ours are freed
            _tensors(handles)

    def run(self, inputs: list[Tensor]) -> list[Tensor]:
        """One call of the step: the GIL is released while it runs (a ctypes call). Each call makes
        a handle of every input and a tensor of every output (`_PreparedRun` makes them once)."""
        handles = (_VOIDP * len(inputs))(*_handles(inputs))  # the library takes them over (and frees them)
        outputs = (_VOIDP * self.outputs)()
        # no stream (CPU), no proxy executor (refused at load)
        if self._lib.AOTInductorModelContainerRun(self._handle, handles, len(inputs), outputs, self.outputs,
                                                  None, None) != 0:
            self._fail("AOTInductorModelContainerRun")
        return _tensors(outputs)

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._lib.AOTInductorModelContainerDelete(handle)


RUNNER = "aot_run"  # aot_run.c: a prepared step in one foreign call
# aot_run.c's return codes but 0 (RUN_FAILED: the library's own last error says more)
_RUNNER_FAILURES = {1: "could not make a handle of an input", 2: None,
                    3: "an output differs from the tensor prepared for it (count, dtype or layout)",
                    4: "too many inputs or outputs"}


@functools.cache
def _runner():
    """aot_run.c's `latentloop_aot_run`, or None where it does not build (`_Library.run` serves then)."""
    library = native.native_library(RUNNER, for_packages=True)
    if library is None:
        return None
    function = library.latentloop_aot_run
    function.argtypes, function.restype = None, ctypes.c_int  # called with ctypes objects made once
    return function


class _PreparedRun:
    """`run()`: the library's step over the same input tensors every call, its outputs copied into the
    same output tensors (aot_run.c: the handles are made once, where `_Library.run` made 14 and two
    result tensors a call, 20-40 us of a ~350 us step at the engines' small shape). The GIL is released
    while it runs. The handles keep the tensors alive until this object goes."""

    def __init__(self, library: _Library, function, inputs: list[Tensor], outputs: list[Tensor]):
        self.library, self._function = library, function
        self._held = (_VOIDP * len(inputs))(*_handles(inputs))
        self._into = (_VOIDP * len(outputs))(*_handles(outputs))
        nbytes = (ctypes.c_int64 * len(outputs))(*(t.numel() * t.element_size() for t in outputs))
        self._arguments = (ctypes.cast(library._lib.AOTInductorModelContainerRun, _VOIDP), library._handle,
                           self._held, _SIZE(len(inputs)), self._into, nbytes, _SIZE(len(outputs)))

    def replace_input(self, index: int, tensor: Tensor) -> None:
        """Input `index` is `tensor` from now on (its handle made, the old one freed)."""
        (handle,) = _handles([tensor])
        old, self._held[index] = self._held[index], handle
        _tensors([old])

    def run(self) -> None:
        status = self._function(*self._arguments)
        if status:
            if _RUNNER_FAILURES.get(status) is None:
                self.library._fail("AOTInductorModelContainerRun")
            raise RuntimeError(f"{RUNNER}: {_RUNNER_FAILURES[status]}")

    def __del__(self, _finalizing=sys.is_finalizing) -> None:  # bound here: globals may be gone at exit
        if _finalizing():  # the process is ending: torch may be torn down already, and nothing needs freeing
            return
        for handles in (getattr(self, "_held", ()), getattr(self, "_into", ())):
            if len(handles):
                _tensors(list(handles))  # frees the handles (the tensors they made go at once)


class _Package:
    """A loaded package bound to the model's weights (and to the attributes it reads)."""

    def __init__(self, path: Path, holder: nn.Module):
        self.path = path
        try:
            self.library = _Library(path)
            self.info = json.loads(self.library.metadata.get(INFO_KEY, "{}"))
            self.bound: list | None = None
            self.checked = False  # bound to the holder's tensors since the decoder's last `forget`
            self.bind(holder)
        except AotUnavailable:
            raise
        except Exception as error:  # noqa: BLE001 - a broken file, or one this torch cannot load
            raise AotUnavailable(f"{path.name} does not load: {type(error).__name__}: {error}") from error

    def bind(self, holder: nn.Module) -> None:
        """Point the package at the model's tensors, again whenever one was replaced (a recomputed
        gate table is a new tensor; `model.to(...)` moves a parameter's data)."""
        self.checked = True
        tensors = [_resolve(holder, fqn) for _, fqn in self.library.constants]
        bound = [(id(t), t.data_ptr()) for t in tensors]
        if bound != self.bound:
            self.library.bind(tensors)
            self.bound = bound


class AotDecodeStep:
    """`step(model, token, cache, options) -> (logits, greedy, info)`, run from an AOTInductor package
    per shape of the cache; `prepare(cache)` finds, compiles or loads the package for the cache's
    current shape and must succeed before `__call__` (it raises `AotUnavailable` otherwise).

    `tokens` > 0: a step over that many tokens per row (token (B, tokens), greedy ids of the same
    shape: self-speculative decoding's verification). A step function may return tensors after the
    info (`step(...) -> (logits, greedy, info, *extras)`): each call leaves them in `extras`."""

    def __init__(self, model, options: dict, step_fn, tokens: int = 0):
        self.model, self.options, self.step_fn, self.tokens = model, options, step_fn, tokens
        self.extras: tuple[Tensor, ...] = ()  # the last call's outputs after the greedy ids
        self.packages: dict[tuple, _Package] = {}
        self.compiled_now = False  # the last `prepare` compiled (as opposed to loading from disk)
        self.load_seconds = 0.0  # what loading the last package took (all a later process pays for it)
        self.package_path: Path | None = None  # the last `prepare`'s package file
        self.unavailable: dict[tuple, str] = {}  # shape -> why it did not compile
        self._bound: _Bound | None = None  # what the steps run with until the cache or its window changes
        self.holder = _ExportedStep(model, options, step_fn)  # what packages resolve their constants from

    @staticmethod
    def refuses(model) -> str | None:
        if next(model.parameters()).device.type != "cpu":
            return "not on CPU"
        if not torch_internals.has_tensor_handles():  # the package's library is called with torch's handles
            return torch_internals.untested_reason()
        return None

    @staticmethod
    def _shape(flat: list[Tensor], window: Tensor, max_len: int) -> tuple:
        """What tells the packages of one decoder apart: torch's CPU threads and each input's shape;
        the window's length is dynamic below the buffer's length, and a package of its own at it
        (`window_is_dynamic`)."""
        dynamic = window_is_dynamic(window, max_len)
        return (torch.get_num_threads(),  # inductor's loops are parallelised for the threads at compile time
                *((t.shape if t is not window or not dynamic else None, t.dtype) for t in flat))

    def forget(self) -> None:
        """Before a decode (`FastDecoder.attach`): the cache's tensors may be new, and the model's
        (weights, tables `prepare_fast_decoding` recomputed): look both up again, each package's
        when it is next called (a decode uses one or two of them; looking up every constant of
        every package took a third of a millisecond a call at the small shape)."""
        self._bound = None
        for package in self.packages.values():
            package.checked = False

    def release(self, cache) -> None:
        """A decode over `cache` ended (its decoder is gone): let go of the cache and the handles to its
        tensors (`_bound`), unless another decode has bound its own since. Kept, they held a finished
        generation's keys and values (56 MiB at 4 layers, d 256, 4 rows of 1,800 tokens) until the
        model's next compiled decode."""
        bound = self._bound
        if bound is not None and bound.cache is cache:
            self._bound = None

    def prepare(self, cache) -> None:
        fields = cache_fields(cache)
        shape = self._shape(flatten(cache, fields), cache.window, cache.max_len)
        self.compiled_now = False
        if shape in self.packages:
            return
        reason = self.unavailable.get(shape) or self.refuses(self.model)
        if reason is not None:
            raise AotUnavailable(reason)
        from .fast import compile_cache_dir

        key = package_key(self.model, self.options, cache, fields, self.tokens)
        path = self.package_path = compile_cache_dir() / AOT_SUBDIR / f"{key}.pt2"
        if path.exists():
            try:
                if unverified_file(path) is not None:  # damaged, replaced, or from before digests
                    raise AotUnavailable("unverified")
                self._load(shape, path)
                return
            except AotUnavailable:  # a broken or foreign file: built again below
                problem = remove_artifact(path)
                if problem is not None:  # a read-only cache holds it: dynamo's step, not an OSError
                    self.unavailable[shape] = problem
                    raise AotUnavailable(problem) from None
        try:
            self._compile(cache, fields, path)
            problem = unverified_file(path)  # a fresh package is checked as a kept one is, before it is loaded
            if problem is not None:
                raise AotUnavailable(problem)
            self._load(shape, path)
        except AotUnavailable as error:  # not tried again for this shape in this process
            self.unavailable[shape] = str(error)
            raise
        self.compiled_now = True

    def _load(self, shape: tuple, path: Path) -> None:
        start = time.perf_counter()
        self.packages[shape] = _Package(path, self.holder)
        self.load_seconds = time.perf_counter() - start

    def _compile(self, cache, fields, path: Path) -> None:
        holder = self.holder
        saved = flatten(cache, fields)
        state = dict(getattr(cache, "state", {}) or {})
        python_state = {k: v for k, v in vars(cache).items() if isinstance(v, (int, float, bool))}
        token = torch.zeros((cache.batch_size, self.tokens) if self.tokens else cache.batch_size, dtype=torch.long,
                            device=cache.key_pos.device)
        dynamic = window_is_dynamic(cache.window, cache.max_len)
        window = torch.export.Dim("window", min=1, max=cache.max_len - 1) if dynamic else None
        flat_shapes = [({0: window} if t is cache.window and dynamic else None) for t in saved]
        holder.cache, holder.fields = cache, fields
        try:
            with _products_as_reductions(), _attributes_as_buffers(holder), _without_torch_leaf_spec_warning():
                program = torch.export.export(holder, (token, saved), dynamic_shapes=(None, flat_shapes),
                                              strict=False)
            info = dict(holder.info)
            from torch._inductor import aoti_compile_and_package

            private_folder(path.parent)
            fd, temp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
            os.close(fd)
            try:
                with _without_torch_leaf_spec_warning():
                    aoti_compile_and_package(program, package_path=temp, inductor_configs={
                        "aot_inductor.package_constants_in_so": False,
                        "aot_inductor.metadata": {INFO_KEY: json.dumps(info)}, **_kernel_config()})
                publish_artifact(Path(temp), path)  # with its digest, checked before the package is ever loaded
            finally:
                Path(temp).unlink(missing_ok=True)
        except AotUnavailable:
            raise
        except Exception as error:  # noqa: BLE001 - whatever export/inductor refuse: dynamo's step instead
            raise AotUnavailable(f"{type(error).__name__}: {first_line(error)}") from error
        finally:  # tracing rebound the cache's attributes to traced values: put the real ones back
            holder.cache, holder.fields = None, []
            restore(cache, fields, saved)
            _reset_dynamic_marks(saved, cache.window)
            if state:
                cache.state = state
            for name, value in python_state.items():
                setattr(cache, name, value)

    def __call__(self, model, token: Tensor, cache, options: dict) -> tuple[Tensor, Tensor, dict]:
        """A step. Its logits and greedy ids are tensors the next step writes again (with a prepared
        run), and the greedy ids are that step's input when passed back as its token: no copy."""
        bound = self._bound
        if bound is None or bound.cache is not cache or (bound.window is not cache.window
                                                         and not self._slide(bound, cache)):
            return self._bind(token, cache)
        if bound.prepared is None:
            logits, greedy, *extras = bound.package.library.run([token, *bound.flat])
            self.extras = tuple(extras)
            return logits, greedy, bound.package.info
        if token is not bound.greedy:  # e.g. sampled ids: into the token's tensor
            if token.shape != bound.greedy.shape or token.dtype != bound.greedy.dtype:
                raise ValueError(f"token {tuple(token.shape)} {token.dtype}: this step takes "
                                 f"{tuple(bound.greedy.shape)} {bound.greedy.dtype}")
            bound.greedy.copy_(token)
        bound.prepared.run()
        self.extras = bound.extras
        return bound.logits, bound.greedy, bound.package.info

    @staticmethod
    def _slide(bound: _Bound, cache) -> bool:
        """The same cache's next window (every 16 steps), where the same package runs it: the window
        still below the buffer's length (the package's dynamic dimension), the same threads, every
        other input the same tensor. Only the window's handle is made again, and the outputs stay the
        same tensors. A whole `_bind` took ~630 us against ~355 us for a prepared step at the engines'
        small shape (1 thread), 13 times in a 200-token decode. False: `_bind` instead."""
        if (bound.prepared is None or bound.window_index is None or bound.threads != torch.get_num_threads()
                or not window_is_dynamic(cache.window, cache.max_len)):
            return False
        if cache_fields(cache) != bound.fields:  # an attribute came or went: the package's inputs differ
            return False
        flat = flatten(cache, bound.fields)  # as long as `bound.flat`: the same fields
        if not all(new is old for i, (new, old) in enumerate(zip(flat, bound.flat)) if i != bound.window_index):
            return False
        bound.prepared.replace_input(1 + bound.window_index, cache.window)  # after the token's input
        bound.flat, bound.window = flat, cache.window
        return True

    def _bind(self, token: Tensor, cache) -> tuple[Tensor, Tensor, dict]:
        """The first step with this cache and window: its package found (and bound to the model's
        tensors when it was not yet since the last `forget`), run with handles made for this call, and
        its outputs kept as the tensors the next steps' prepared run writes (`_Bound`)."""
        self._bound = None  # the last bound's handles go first
        fields = cache_fields(cache)
        flat = flatten(cache, fields)
        shape = self._shape(flat, cache.window, cache.max_len)
        if shape not in self.packages:
            self.prepare(cache)  # loads it, or raises AotUnavailable
        package = self.packages[shape]
        if not package.checked:
            package.bind(self.holder)
        logits, greedy, *extras = package.library.run([token, *flat])
        function = _runner()
        prepared = None
        if function is not None and all(t.is_contiguous() for t in (logits, greedy, *extras)):
            prepared = _PreparedRun(package.library, function, [greedy, *flat], [logits, greedy, *extras])
        dynamic = window_is_dynamic(cache.window, cache.max_len)  # a full-length window: a package of its own
        window_index = next((i for i, t in enumerate(flat) if t is cache.window), None) if dynamic else None
        self._bound = _Bound(cache, cache.window, fields, flat, window_index, torch.get_num_threads(), package,
                             prepared, logits, greedy, tuple(extras))
        self.extras = tuple(extras)
        return logits, greedy, package.info


@dataclass(eq=False)  # compared by identity: its fields are tensors
class _Bound:
    """What an `AotDecodeStep` steps with until the cache or its window changes."""

    cache: object
    window: Tensor
    fields: list  # `cache_fields(cache)`
    flat: list[Tensor]  # the cache's tensors, the package's inputs after the token
    window_index: int | None  # the window's place in `flat`; None: not a dynamic window (no `_slide`)
    threads: int  # torch's CPU threads when bound (a package per thread count)
    package: _Package
    prepared: _PreparedRun | None  # None where aot_run.c does not build: `_Library.run` each step
    logits: Tensor  # (B, V): the last step's, written again by the next prepared run
    greedy: Tensor  # (B,): the last step's greedy ids, and the next step's token when passed back
    extras: tuple = ()  # the step function's further outputs (a verification's top states)
