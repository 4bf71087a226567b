"""What every front-end needs around a model, without training or the CLI: the device and the
precision, the default folders, and data preparation.

    device = resolve_device("auto")
    data = prepare_data(config, tokenizer)          # memory-mapped train / val tokens
    data = eval_data(config, tokenizer, "text:x/")  # the same for a loaded run, whose config is not trusted
    keep_freed_memory()                             # CPU: freed tensor memory stays in the process (glibc)

A loaded run's `cache_dir` is ignored and its data source used only when it is built in (see
`eval_data`). The process group lives in `distributed.py`, run folders in `runs.py`.

`eval/`, `analysis` and the server import this module, never `train` or `api`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import sys
import tempfile
from pathlib import Path

import torch

from .config import RunConfig
from .data import TokenData, parse_source, prepare_tokens
from .data.chat import CHAT_PREFIX, split_chat_file
from .data.sources import MixSource
from .errors import ConfigError, OutputError
from .precision import CPU_BF16_ENV, cpu_bf16_support, emulated_bf16_autocast  # noqa: F401 (CPU_BF16_ENV: runtime's name)
from .util import default_cache_dir, nearest_existing, read_json_object

EVAL_DIR_ENV = "LATENTLOOP_EVAL_DIR"  # folder of the evaluation task files
EVAL_BUNDLE_DIR = "eval_bundle"  # below the cache root: the fetched official CORE bundle
# Data sources that name no file: a run's config may pick these for evaluation by itself.
BUILTIN_SOURCES = ("stdlib", "task:")


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto the device without waiting: from pinned host memory a copy to a GPU is
    queued behind the kernels, where one from pageable memory (`t.to(device)`, `torch.tensor(...,
    device=)`) waits for them all, a stall of the stream each time (as nanoGPT copies its batches)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)


def default_eval_dir() -> Path:
    """Where the official evaluation bundle is fetched to (and looked for)."""
    return default_cache_dir() / EVAL_BUNDLE_DIR


# glibc's malloc hands large freed blocks back to the OS (munmap, heap trimming), so the next step's
# activation of the same size is fresh memory that page-faults on first touch. Measured on the
# project's 2-core machine: a lone RoPE over a (16, 256, 8, 64) fp32 q-and-k 4.6 -> 1.4 ms, an eager
# training step of the baseline benchmark's gpt 653 -> 629 ms (nanoGPT's unchanged, 603 -> 600).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD_BYTES = 32 * 2**20  # the largest glibc accepts on 64-bit: smaller blocks come from the heap
TRIM_THRESHOLD_BYTES = 2**30  # free memory the heap keeps before returning any of it to the OS


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory in the process (see the constants above): for the
    rest of the process, blocks up to 32 MiB come from the heap and up to 1 GiB of free heap is kept.
    True when both took effect; False off glibc (macOS, musl, Windows), where nothing changes."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    kept_in_heap = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    kept_after_free = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return kept_in_heap and kept_after_free


def resolve_device(name: str) -> torch.device:
    """"auto" (cuda when available, else cpu), "cpu", "cuda[:N]" or "mps", checked to exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda[:N] or mps") from None
    if device.type == "cpu" and device.index:  # torch takes cpu:5 and runs on the one CPU device
        raise ConfigError(f"device {name!r}: there is one CPU device, cpu (or cpu:0); its threads are "
                          "OMP_NUM_THREADS, or --threads where a command has it")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps' requested but MPS is not available")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"unsupported device {name!r}: use auto, cpu, cuda[:N] or mps")
    return device


_THIS_MACHINE = object()  # resolve_dtype's default: the bf16 support of the CPU (or GPU) this runs on


# The first NVIDIA compute capability with bf16 tensor cores (Ampere). Before it torch's autocast still
# takes bf16, emulated and slower than fp32, and inductor leaves graphs with bf16 inputs uncompiled.
CUDA_BF16_CAPABILITY = (8, 0)


def cuda_bf16_support(device: torch.device) -> bool:
    """Whether the GPU computes bf16 natively (ROCm's do; NVIDIA's from Ampere on)."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= CUDA_BF16_CAPABILITY


def resolve_dtype(device: torch.device, dtype: str, cpu_bf16: str | None | object = _THIS_MACHINE,
                  cuda_bf16: bool | object = _THIS_MACHINE) -> str:
    """The autocast dtype a run takes: "bfloat16" or "float32". "auto" is bf16 on a GPU with native
    bf16 (`cuda_bf16_support`; `cuda_bf16`: another GPU's, e.g. a recorded run's) and on a CPU with bf16
    instructions (`cpu_bf16_support`; `cpu_bf16`: another CPU's), fp32 elsewhere: there bf16 is
    emulated and slower than fp32 (no fp16 path with a loss scaler is offered). On the CPU, bf16 reached fp32's
    validation BPB within 1% at equal steps for every arch on the `tiny` and `small` presets
    (`python -m benchmarks.time_to_quality --precision-check`; experiments/RESULTS.md), the condition
    for making it the default."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        native = cuda_bf16_support(device) if cuda_bf16 is _THIS_MACHINE else cuda_bf16
        return "bfloat16" if native else "float32"
    support = cpu_bf16_support() if cpu_bf16 is _THIS_MACHINE else cpu_bf16
    return "bfloat16" if device.type == "cpu" and support else "float32"


def precision_note(device: torch.device, dtype: str, emulate: bool = True) -> str:
    """One line for the run log: the dtype the products run in and, on the CPU, its bf16 support
    (`emulate`: as `autocast_for` takes it; a compiled step runs torch's autocast)."""
    resolved = resolve_dtype(device, dtype)
    line = ("bf16 autocast for the matrix products (fp32 weights, optimizer state, norms, softmax and loss)"
            if resolved == "bfloat16" else "fp32 throughout")
    if device.type == "cpu":
        support = cpu_bf16_support()
        how = ("(float32 kernels on bf16-rounded values, latentloop.precision)" if emulate
               else "by torch (a compiled step)")
        line += (f"; CPU bf16 support: {support}" if support else
                 "; this CPU has no bf16 instructions (amx_bf16 / avx512_bf16)"
                 + (f": bf16 is emulated {how} and slower than fp32" if resolved == "bfloat16" else ""))
        line += f", torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    elif device.type == "cuda" and not cuda_bf16_support(device):
        major, minor = torch.cuda.get_device_capability(device)
        line += (f"; this GPU (compute capability {major}.{minor}) has no native bf16"
                 + (": bf16 is emulated and slower than fp32" if resolved == "bfloat16" else ""))
    return f"precision ({dtype}): {line}"


def emulates_bf16(device: torch.device, dtype: str) -> bool:
    """Whether a run in `dtype` on `device` takes bf16 on a CPU without bf16 instructions, where
    `autocast_for` emulates it (`precision.emulated_bf16_autocast`)."""
    return device.type == "cpu" and resolve_dtype(device, dtype) == "bfloat16" and not cpu_bf16_support()


def autocast_for(device: torch.device, dtype: str, emulate: bool = True):
    """bf16 autocast when `resolve_dtype` says so (the products in bf16; torch's autocast keeps
    reductions, norms and the loss's softmax in fp32, and the weights stay fp32); a no-op otherwise.
    On a CPU without bf16 instructions the linear layers take `precision.emulated_bf16_autocast`'s
    float32 kernels (`emulate`; the same rounding as bf16 instructions, faster than torch's emulation);
    a compiled model is left to torch's autocast (`emulate=False`), whose graphs inductor compiles."""
    if resolve_dtype(device, dtype) == "bfloat16":
        if emulate and emulates_bf16(device, dtype):
            return emulated_bf16_autocast()
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def prepare_data(config: RunConfig, tokenizer, progress: bool = True) -> TokenData:
    """The run's data source tokenized once into memory-mapped train / val shards."""
    data = config.data
    source = parse_source(data.source, val_fraction=data.val_fraction)
    cache_dir = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    return prepare_tokens(source, tokenizer, cache_dir, max_bytes=data.max_bytes or None, progress=progress)


def absolute_source(spec: str) -> str:
    """A `text:` source with its path made absolute (what a run records beside its config, so that
    `eval` finds the same file from any folder), and so each `text:` part of a `mix:` and a `chat:`
    file (whose relative paths were recorded as typed: a resume from another folder read other
    files, or found none); other sources as they are. A blank path stays as it is: made absolute it
    would be the current folder, and `train --data text:` trained on every text file below it instead
    of `parse_source` refusing the empty path."""
    if spec.startswith("mix:"):
        parts = spec[len("mix:"):].split(MixSource.SEPARATOR)
        return "mix:" + MixSource.SEPARATOR.join(absolute_source(part.strip()) for part in parts)
    if spec.startswith(CHAT_PREFIX) and not spec[len(CHAT_PREFIX):].startswith("task:"):
        # an SFT run's chat file, as a text: file (a relative one resumed only from its starting folder)
        path, mapping = split_chat_file(spec[len(CHAT_PREFIX):])
        if not path.strip():
            return spec
        return CHAT_PREFIX + os.path.abspath(os.path.expanduser(path)) + ("" if mapping is None else ":" + mapping)
    if not spec.startswith("text:"):
        return spec
    path = spec[len("text:"):]
    if not path.strip():
        return spec
    return "text:" + os.path.abspath(os.path.expanduser(path))


def _recorded_source(config: RunConfig, checkpoint: Path | None) -> tuple[str, dict | None]:
    """The source a run was trained on and the token checksums training recorded: the absolute path the
    checkpoint's state.json records (`data_source`), else the config's own, and state.json's `data`."""
    recorded = {} if checkpoint is None else read_json_object(checkpoint / "state.json")
    spec = recorded.get("data_source") if isinstance(recorded.get("data_source"), str) else config.data.source
    checksums = recorded.get("data")
    return spec, checksums if isinstance(checksums, dict) else None


def _recorded_text_source(config: RunConfig, checkpoint: Path | None) -> tuple[str, dict | None]:
    """The `text:` source a run was trained on, as this machine can read it (`_recorded_source`: relative
    paths from here where the checkpoint records none), and its checksums. A source whose files are
    not here is a ConfigError naming it."""
    spec, checksums = _recorded_source(config, checkpoint)
    path = spec[len("text:"):]
    if not (Path(path).expanduser().exists() or glob.glob(os.path.expanduser(path))):
        raise ConfigError(f"this run was trained on {spec!r}, which is not on this machine; name the data to "
                          f"evaluate on with --data")
    return spec, checksums


def _check_own_chat_split(config: RunConfig, checkpoint: Path | None, data: str, prepared) -> None:
    """A warning when `data` is the chat file the run trained on and its validation split is not the one
    training set aside (its sha256 in the checkpoint's state.json): the file changed since, or its
    conversations were split by an older rule (a file's line before 12-07, its messages since), so the
    split evaluated may hold conversations the run trained on."""
    trained_on, checksums = _recorded_source(config, checkpoint)
    if absolute_source(data) != absolute_source(trained_on) or checksums is None or "val" not in checksums:
        return
    if prepared.meta.get("sha256", {}).get("val") != checksums["val"]:
        print(f"latentloop: warning: the validation split of {data} is not the one this run set aside when it "
              f"trained (the file changed since, or it was split by an older rule): conversations it trained on "
              f"may be among those scored", file=sys.stderr)


def eval_data(config: RunConfig, tokenizer, data: str | None = None, progress: bool = False,
              checkpoint: Path | None = None):
    """The tokens to evaluate a loaded run on: `data` when given, else the run's own source: a
    built-in one (stdlib, task:NAME, chat:task:NAME), or the `text:` file or folder it was trained
    on when that is on this machine and still holds the tokens training recorded (the checksums
    in `checkpoint`'s state.json; a note on stderr says which file is read). Other sources must be
    named by the user. The default cache folder is used. Conversations (`chat:`) come back as
    `ChatData` (rows with a loss mask)."""
    chosen_by_run, checksums = False, None
    if data is None:
        data = config.data.source
        if data.startswith("text:"):
            data, checksums = _recorded_text_source(config, checkpoint)
            chosen_by_run = True
        elif not data.startswith(BUILTIN_SOURCES + ("chat:task:",)):
            raise ConfigError(f"this run was trained on {data!r}; name the data to evaluate on with --data "
                              f"(a run folder does not choose files to read)")
    if data.startswith("chat:"):
        from .data.chat import prepare_chat

        prepared = prepare_chat(data, tokenizer, config.model.sequence_len, config.data.val_fraction)
        _check_own_chat_split(config, checkpoint, data, prepared)
        return prepared
    chosen = RunConfig(model=config.model, train=config.train,
                       data=dataclasses.replace(config.data, source=data, cache_dir=""))
    prepared = prepare_data(chosen, tokenizer, progress)
    if chosen_by_run:
        # the run chose this file: read it only when it is what training read (a run folder from
        # elsewhere does not get to point eval at other files)
        if checksums is None or prepared.meta.get("sha256") != checksums:
            raise ConfigError(f"{data[len('text:'):]} is not the data this run was trained on (its tokens differ "
                              f"from the checksums the run recorded); name the data to evaluate on with --data")
        print(f"evaluating on {data} (the data this run was trained on, as recorded)", file=sys.stderr)
    return prepared


def check_output_folder(path: str | Path, what: str = "output folder") -> None:
    """What `output_folder` would refuse, found without creating anything: a file at `path` or at
    one of its parents, or a folder this process may not write in (the nearest that exists). For a
    command that reads its inputs before it makes its output folder (a refusal leaves none behind)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file")
    nearest = nearest_existing(path)
    if not nearest.is_dir():
        raise OutputError(f"cannot create {what} {path}: {nearest} is a file")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write into {what} {path}: {nearest} is not writable")


def output_folder(path: str | Path, what: str = "output folder") -> Path:
    """Create `path` (and its parents) and make sure a file can be written in it; any failure (a file
    in the way, no permission, a read-only disk) is one `OutputError` line, before work starts."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        if path.exists() and not path.is_dir():
            raise OutputError(f"{what} {path} is a file") from None
        raise OutputError(f"cannot write into {what} {path}: {exc.strerror or exc}") from None
    return path


