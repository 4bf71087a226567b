"""What every front-end needs around a model, without training or the CLI: the device and the
process group, the default folders, data preparation and loading (or exporting) a run.

    device = resolve_device("auto")
    env, device = init_distributed("ddp", "auto")   # the process group torchrun asked for (gloo / nccl)
    agree(error_or_none)                            # every process learns whether any failed a phase
    model, tokenizer, config, checkpoint = load_run("runs/gpt", device)
    save_run(model, tokenizer, "runs/untrained")    # a loadable run folder from any model
    data = prepare_data(config, tokenizer)          # memory-mapped train / val tokens
    data = eval_data(config, tokenizer, "text:x/")  # the same for a loaded run, whose config is not trusted
    export_full_weights("runs/big")                 # model.safetensors from an fsdp2 checkpoint's shards
    keep_freed_memory()                             # CPU: freed tensor memory stays in the process (glibc)

A run folder may come from anyone: `load_run` checks its config against the weights' header before
allocating anything, and the tokenizer against the config; a loaded run's `cache_dir` is ignored
and its data source used only when it is built in (see `eval_data`).

`eval/`, `analysis` and the server import this module, never `train` or `api`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from . import errors
from .archs import build_model
from .checkpoint import (
    SHARDED_DIR,
    add_checksum,
    check_sharded,
    check_weights_finite,
    find_tokenizer_file,
    fsync_dir,
    load_sharded_state,
    load_weights,
    read_run_config,
    read_weights,
    resolve_checkpoint,
    save_checkpoint,
    weight_shapes,
)
from .config import ModelConfig, RunConfig
from .data import TokenData, load_tokenizer, parse_source, prepare_tokens
from .errors import CheckpointError, ConfigError, LatentloopError, OutputError, RankFailure
from .util import default_cache_dir, first_line

EVAL_DIR_ENV = "LATENTLOOP_EVAL_DIR"  # folder of the evaluation task files
EVAL_BUNDLE_DIR = "eval_bundle"  # below the cache root: the fetched official CORE bundle
# Data sources that name no file: a run's config may pick these for evaluation by itself.
BUILTIN_SOURCES = ("stdlib", "task:")


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
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps' requested but MPS is not available")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"unsupported device {name!r}: use auto, cpu, cuda[:N] or mps")
    return device


# --------------------------------------------------------------------------------------------
# Process groups: torchrun starts one process per GPU (or several CPU processes) and sets RANK,
# LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; each process joins one group.
# --------------------------------------------------------------------------------------------

DIST_TIMEOUT_ENV = "LATENTLOOP_DIST_TIMEOUT"  # seconds a collective waits for the other processes
# torch's own default for NCCL groups: long enough for a first torch.compile or a large save on rank 0
DEFAULT_DIST_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in a training job; the defaults are a plain single process."""

    rank: int = 0
    local_rank: int = 0  # the process's index on its node: which GPU it takes
    world_size: int = 1
    backend: str | None = None  # "nccl" or "gloo" while a process group is up; None without one

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, logs and writes the run folder's shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def launch_env() -> tuple[int, int, int]:
    """(rank, local rank, world size) as torchrun sets them; (0, 0, 1) when it did not start us."""
    values = []
    for name, default in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)):
        text = os.environ.get(name)
        try:
            values.append(default if text is None or text == "" else int(text))
        except ValueError:
            raise ConfigError(f"environment variable {name}={text!r} is not an integer (torchrun sets it)") from None
    rank, local_rank, world_size = values
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ConfigError(f"inconsistent launch: RANK={rank}, LOCAL_RANK={local_rank}, WORLD_SIZE={world_size}")
    return rank, local_rank, world_size


def in_process_group() -> bool:
    """Whether this process has joined a process group (and not left it)."""
    return dist.is_available() and dist.is_initialized()


def current_dist() -> DistEnv:
    """This process's place in the process group that is up (a single process without one)."""
    if in_process_group():
        local_rank = int(os.environ.get("LOCAL_RANK") or 0)
        return DistEnv(dist.get_rank(), local_rank, dist.get_world_size(), dist.get_backend())
    return DistEnv()


def distributed_device(name: str, local_rank: int, world_size: int) -> torch.device:
    """The device of one process of a distributed job: the GPU of its LOCAL_RANK, or the CPU."""
    device = resolve_device(name)
    if device.type == "mps":
        raise ConfigError("strategies ddp and fsdp2 need cuda or cpu: mps has no distributed backend")
    if device.type == "cuda":
        if device.index is not None and world_size > 1:
            raise ConfigError(f"device {name!r} names one GPU, but each of the {world_size} processes takes the GPU "
                              f"of its LOCAL_RANK: use device cuda or auto")
        if local_rank >= torch.cuda.device_count():
            error = ConfigError(f"LOCAL_RANK {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                                f"start at most that many processes per node (--nproc_per_node)")
            error.rank_specific = True  # only this process fails: it prints the line, not rank 0
            raise error
        device = torch.device("cuda", device.index if device.index is not None else local_rank)
    return device


def dist_timeout() -> timedelta:
    text = os.environ.get(DIST_TIMEOUT_ENV)
    try:
        seconds = DEFAULT_DIST_TIMEOUT_S if not text else float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{DIST_TIMEOUT_ENV}={text!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


def resolve_strategy(strategy: str) -> str:
    """`train.strategy` as this launch runs it: `auto` is ddp when torchrun started more than one
    process (WORLD_SIZE > 1), else none; any other value stands as given."""
    if strategy != "auto":
        return strategy
    return "ddp" if launch_env()[2] > 1 else "none"


def init_distributed(strategy: str, device_name: str) -> tuple[DistEnv, torch.device]:
    """Join the process group of a `ddp` / `fsdp2` job (gloo on CPU, nccl on CUDA, each process on
    the GPU of its LOCAL_RANK) and return (DistEnv, device). Strategy `auto` is resolved first
    (`resolve_strategy`); `none` joins nothing and refuses a multi-process launch; a `ddp` / `fsdp2`
    run started without torchrun is a group of one, so that it takes the same code path. A group
    that is already up (made by the caller) is used as it is."""
    rank, local_rank, world_size = launch_env()
    strategy = resolve_strategy(strategy)
    if strategy == "none":
        if world_size > 1:
            raise ConfigError(f"started as {world_size} processes (torchrun) but train.strategy is none: set "
                              f"--set train.strategy=ddp or fsdp2 (or auto, the default: ddp under torchrun)")
        return DistEnv(), resolve_device(device_name)
    if not dist.is_available():
        raise ConfigError(f"strategy {strategy} needs torch.distributed, which this torch build lacks")
    device = distributed_device(device_name, local_rank, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = dist_timeout()
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:  # torchrun's rendezvous (env://)
            dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        elif world_size == 1:  # no launcher: a group of one, in this process's memory
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            raise ConfigError(f"WORLD_SIZE={world_size} but MASTER_ADDR / MASTER_PORT are not set: start the job "
                              f"with torchrun")
    return current_dist(), device


def destroy_distributed() -> bool:
    """Leave the process group (if one is up); the end of a distributed command, after success
    only. Every process leaves together (a barrier first): a peer that tears its connections down
    while rank 0 still writes its last files can take rank 0 down with it. Returns whether a group
    was left: a process that runs its own command line then ends with `exit_without_finalizing`,
    because leaving the group does not stop its threads (see there)."""
    if in_process_group():
        dist.barrier()
        dist.destroy_process_group()
        return True
    return False


def exit_without_finalizing(code: int) -> NoReturn:
    """End this process with `code` the way Python's own exit does, minus the interpreter's
    teardown: non-daemon threads are joined, atexit handlers run and stdout / stderr are flushed,
    then `os._exit`.

    Why: after an fsdp2 run, `destroy_process_group` does not end the gloo group's C++ threads
    (two `pt_gloo_runloop` workers and `gloo_tcp_loop`, still running under torch 2.13 after the
    group was destroyed and everything collectable collected): FSDP2's device mesh, referenced by
    DTensor specs that C++ holds, keeps the group alive, and gloo has no shutdown of its own. The
    threads thus live on into the interpreter's finalization, where a C++ thread that touches a
    Python object (dropping the last reference to a collective's tensor takes the GIL, which a
    finalizing interpreter answers by ending the thread with pthread_exit, whose unwinding through
    a noexcept frame calls std::terminate), or a thread object destroyed while its thread still
    runs, aborts the process: SIGABRT, "terminate called without an active exception", after all
    the work was done, so torchrun reports a failed job (seen on rank 0 in 2-3 of 25 fsdp2 runs;
    not reproduced in 20 runs here, so which of these fired is not known). Skipping the teardown
    removes the phase in which any of them can happen: the kernel ends every thread at once.
    Nothing of ours is left to that phase: checkpoints and logs are written, fsynced and closed
    before this, and this flushes the rest."""
    import atexit
    import threading

    for thread in threading.enumerate():  # what Python's exit waits for first (its threading._shutdown)
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # e.g. the chat template workers' pool stops its processes
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader is gone: nothing more to say
            pass
    os._exit(code)


def _shared(error: LatentloopError) -> LatentloopError:
    error.shared = True  # every process raises it: the command line prints it on rank 0 only
    return error


def shared_error(error: BaseException | None) -> LatentloopError | None:
    """Every process of the group says whether its part of a phase failed (`error`, or None); the
    answer is the same everywhere: None when none failed, else an error of the lowest failed rank's
    class and message (on that rank its own error), marked `shared`. A failure on rank R > 0 reads
    "rank R: ..." on the others. Without a group, or in a group of one, `error` itself."""
    env = current_dist()
    if env.world_size == 1:
        return error
    report = None if error is None else (type(error).__name__, first_line(error))
    reports: list[tuple[str, str] | None] = [None] * env.world_size
    dist.all_gather_object(reports, report)
    failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if not failed:
        return None
    first, (kind, message) = failed[0]
    if first == env.rank and isinstance(error, LatentloopError):
        return _shared(error)
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, LatentloopError)):
        cls = RankFailure
    return _shared(cls(message if first == 0 else f"rank {first}: {message}"))


def agree(error: BaseException | None) -> None:
    """`shared_error`, raised: when any process failed a phase, every process raises, so that all
    stop together instead of some waiting forever for the others."""
    shared = shared_error(error)
    if shared is not None:
        if shared is error:
            raise error
        raise shared from error


_T = TypeVar("_T")


def together(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`fn(*args, **kwargs)` on this process, then `agree` on whether it failed anywhere (a user
    error: `LatentloopError`; a bug keeps its traceback and ends its process)."""
    try:
        result = fn(*args, **kwargs)
    except LatentloopError as exc:
        agree(exc)
        raise  # agree raised already; kept for the type checker
    agree(None)
    return result


def on_main(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T | None:
    """`fn` on rank 0 only (writing the run folder's shared files), agreed on by all; None elsewhere."""
    if current_dist().is_main:
        return together(fn, *args, **kwargs)
    agree(None)
    return None


def in_turns(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`fn` first on rank 0, then on the first process of every other node, then on the rest, each
    turn agreed on by all: work that fills a cache on disk (tokenizing the data) is then done once
    per shared file system, and the later turns find it done."""
    env = current_dist()
    if env.world_size == 1:
        return fn(*args, **kwargs)
    turns = (env.rank == 0, env.rank != 0 and env.local_rank == 0, env.rank != 0 and env.local_rank != 0)
    result = None
    for mine in turns:
        if mine:
            result = together(fn, *args, **kwargs)
        else:
            agree(None)
    return result


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


def resolve_dtype(device: torch.device, dtype: str) -> str:
    """The autocast dtype a run takes: "bfloat16" or "float32". "auto" is bf16 on CUDA and on a CPU
    with bf16 instructions (`cpu_bf16_support`), fp32 elsewhere: there bf16 is emulated and slower
    than fp32. On the CPU, bf16 reached fp32's validation BPB within 1% at equal steps for every
    arch on the `tiny` and `small` presets (`python -m benchmarks.time_to_quality --precision-check`;
    experiments/RESULTS.md), the condition for making it the default."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda" or (device.type == "cpu" and cpu_bf16_support()):
        return "bfloat16"
    return "float32"


def precision_note(device: torch.device, dtype: str) -> str:
    """One line for the run log: the dtype the products run in and, on the CPU, its bf16 support."""
    resolved = resolve_dtype(device, dtype)
    line = ("bf16 autocast for the matrix products (fp32 weights, optimizer state, norms, softmax and loss)"
            if resolved == "bfloat16" else "fp32 throughout")
    if device.type == "cpu":
        support = cpu_bf16_support()
        line += (f"; CPU bf16 support: {support}" if support else
                 "; this CPU has no bf16 instructions (amx_bf16 / avx512_bf16)"
                 + (": bf16 is emulated and slower than fp32" if resolved == "bfloat16" else ""))
        line += f", torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    return f"precision ({dtype}): {line}"


def autocast_for(device: torch.device, dtype: str):
    """bf16 autocast when `resolve_dtype` says so (the products in bf16; torch's autocast keeps
    reductions, norms and the loss's softmax in fp32, and the weights stay fp32); a no-op otherwise."""
    if resolve_dtype(device, dtype) == "bfloat16":
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
    `eval` finds the same file from any folder); other sources as they are."""
    if not spec.startswith("text:"):
        return spec
    return "text:" + os.path.abspath(os.path.expanduser(spec[len("text:"):]))


def _recorded_text_source(config: RunConfig, checkpoint: Path | None) -> tuple[str, dict | None]:
    """The `text:` source a run was trained on, as this machine can read it: the absolute path the
    checkpoint's state.json records (`data_source`), else the config's own (relative paths from
    here), and the token checksums training recorded. A source whose files are not here is a
    ConfigError naming it."""
    source, recorded = config.data.source, {}
    if checkpoint is not None and (checkpoint / "state.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            recorded = json.loads((checkpoint / "state.json").read_text())
    if not isinstance(recorded, dict):
        recorded = {}
    spec = recorded.get("data_source") if isinstance(recorded.get("data_source"), str) else source
    path = spec[len("text:"):]
    if not (Path(path).expanduser().exists() or glob.glob(os.path.expanduser(path))):
        raise ConfigError(f"this run was trained on {spec!r}, which is not on this machine; name the data to "
                          f"evaluate on with --data")
    checksums = recorded.get("data")
    return spec, checksums if isinstance(checksums, dict) else None


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

        return prepare_chat(data, tokenizer, config.model.sequence_len, config.data.val_fraction)
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


# torch.nn.init's random initialisers: on the meta device they run as Python decompositions whose
# first call imports torch._dynamo (1.5-3.5 s of a core before a command that loads a run can go on;
# rope_frequencies avoids the same for its arithmetic), and a shape needs none of them
RANDOM_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_", "xavier_normal_",
                "xavier_uniform_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def _random_inits_skipped():
    """torch.nn.init's random initialisers leave their tensor as it is inside the block (the model
    files call them through `nn.init`, as torch's own layers do)."""
    saved = {name: getattr(nn.init, name) for name in RANDOM_INITS}
    try:
        for name in RANDOM_INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, initialiser in saved.items():
            setattr(nn.init, name, initialiser)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the weights a config describes, from a model built on the meta device
    (shapes only: nothing is allocated or initialised, however large the config)."""
    with torch.device("meta"), _random_inits_skipped():
        model = build_model(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_weights_fit(config: ModelConfig, checkpoint: Path, found: dict[str, tuple[int, ...]] | None = None) -> None:
    """The checkpoint's weights (`found`: their shapes, else read from the safetensors header) have
    exactly the names and shapes the config describes, checked before a model of that config is
    allocated."""
    found = weight_shapes(checkpoint) if found is None else found
    expected = expected_shapes(config)
    file = checkpoint / "model.safetensors"
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"weights {file} do not fit the run's config.json: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise CheckpointError(f"weights {file} do not fit the run's config.json: {name} is {list(found[name])} "
                                  f"in the file but {list(shape)} by the config")


def check_tokenizer_fits(tokenizer, config: ModelConfig, tokenizer_file: Path) -> None:
    """A tokenizer with more ids than the model would index out of its embedding; one with fewer (or
    other special ids) would decode the model's ids as the wrong text."""
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"tokenizer {tokenizer_file} has {tokenizer.vocab_size} tokens but the model has "
                              f"vocab_size {config.vocab_size}: it is not the tokenizer this model was trained with")
    if tokenizer.bos_id != config.bos_id:
        raise CheckpointError(f"tokenizer {tokenizer_file} has BOS id {tokenizer.bos_id} but the model was trained "
                              f"with {config.bos_id}: it is not the tokenizer this model was trained with")


def load_run(path: str | Path, device: str | torch.device = "cpu",
             accelerate: bool = True) -> tuple[nn.Module, object, RunConfig, Path]:
    """Model (eval mode), tokenizer, run config and checkpoint folder from a run or checkpoint folder.
    A model on the CPU gets the faster products (`inference.accelerate`, a module swap) unless
    `accelerate=False`: every command that decodes or scores a run reads it through here.

    The config is checked against the weights' header and the tokenizer against the config before
    the model is built; the returned config's `data.cache_dir` is cleared (the default cache is used).
    """
    checkpoint = resolve_checkpoint(path)
    if not (checkpoint / "model.safetensors").is_file() and (checkpoint / SHARDED_DIR).is_dir():
        raise CheckpointError(f"checkpoint {checkpoint} holds sharded weights only (an fsdp2 run saved with "
                              f"train.full_weights=false): write model.safetensors with `latentloop export-dcp "
                              f"{checkpoint}`")
    config = read_run_config(checkpoint)
    config.data.cache_dir = ""  # a folder on the machine that trained the run, not one to write into here
    tokenizer_file = find_tokenizer_file(checkpoint)
    tokenizer = load_tokenizer(str(tokenizer_file))
    check_tokenizer_fits(tokenizer, config.model, tokenizer_file)
    weights = read_weights(checkpoint)  # checked against its checksum and for NaN / inf: the file's size, once
    check_weights_fit(config.model, checkpoint, {name: tuple(t.shape) for name, t in weights.items()})
    model = build_model(config.model)
    load_weights(model, checkpoint, weights)
    model = model.to(device).eval()
    if accelerate and next(model.parameters()).device.type == "cpu":
        from .inference import accelerate as accelerate_products

        accelerate_products(model)
    return model, tokenizer, config, checkpoint


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


def save_run(model: nn.Module, tokenizer, run_dir: str | Path, config: RunConfig | None = None) -> Path:
    """A run folder that `load_run` (and so `generate`, `eval`, `serve`) reads, from a model as it
    is, e.g. freshly initialised for tests and load tests: config, tokenizer and one checkpoint at
    step 0. It holds no optimizer or loader state, so training cannot resume from it."""
    run_dir = Path(run_dir)
    config = config or RunConfig(model=model.config)
    if config.model.vocab_size != tokenizer.vocab_size or config.model.bos_id != tokenizer.bos_id:
        raise ConfigError(f"the model's vocab_size/bos_id ({config.model.vocab_size}/{config.model.bos_id}) do not "
                          f"match the tokenizer's ({tokenizer.vocab_size}/{tokenizer.bos_id})")
    run_dir.mkdir(parents=True, exist_ok=True)
    config.save_json(run_dir / "config.json")
    tokenizer.save(run_dir)
    return save_checkpoint(run_dir, 0, model, trainer_state={}, state={"step": 0}, keep_last=1)


def export_full_weights(path: str | Path, force: bool = False) -> Path:
    """Write `model.safetensors` into a checkpoint that holds sharded weights only (`dcp/`, an fsdp2
    run's), in this one process: the model is built on the CPU and the shards are read into it
    (torch.distributed.checkpoint, without a process group). Needs one full fp32 copy of the
    weights in CPU memory; no GPU. The file is written atomically. The shards are checked against
    their checksums and DCP's pickles read through allow-lists first (`checkpoint.check_sharded`):
    a corrupt or planted file is one `CheckpointError` line, and nothing of it runs."""
    from safetensors.torch import save_file

    checkpoint = resolve_checkpoint(path)
    target, sharded = checkpoint / "model.safetensors", checkpoint / SHARDED_DIR
    if not sharded.is_dir():
        raise CheckpointError(f"{checkpoint} holds no sharded weights ({SHARDED_DIR}/): it needs no export")
    if target.exists() and not force:
        raise OutputError(f"{target} exists already (pass --force to write it again)")
    config = read_run_config(checkpoint)
    metadata, note = check_sharded(sharded)
    if note is not None:
        print(f"latentloop: warning: {note}", file=sys.stderr)
    model = build_model(config.model)
    weights = model.state_dict()
    load_sharded_state({"model": weights}, sharded, metadata, no_dist=True)  # one line on missing / foreign shards
    weights = {name: t.detach().contiguous() for name, t in weights.items()}
    step = int(checkpoint.name.rsplit("_", 1)[-1]) if checkpoint.name.rsplit("_", 1)[-1].isdigit() else 0
    check_weights_finite(weights, step)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        save_file(weights, str(tmp), metadata={"step": str(step)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_dir(checkpoint)
        add_checksum(checkpoint, target.name)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None
    return target
