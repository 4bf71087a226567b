"""Training over many processes: the process group torchrun asks for, and the few collectives every
phase of a job agrees through, so that all processes fail together with the same one-line error.

    env, device = init_distributed("ddp", "auto")   # the process group torchrun asked for (gloo / nccl)
    agree(error_or_none)                            # every process learns whether any failed a phase
    value = together(fn, *args)                     # fn on every process; the first failure raised on all
    on_main(fn, *args)                              # fn on rank 0 only, its failure raised on all

`parallel.py` wraps models for this (DDP, FSDP2, activation checkpointing, compile); this module knows
no model.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from . import errors
from .errors import ConfigError, LatentloopError, RankFailure
from .runtime import resolve_device
from .util import first_line

# --------------------------------------------------------------------------------------------
# Process groups: torchrun starts one process per GPU (or several CPU processes) and sets RANK,
# LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; each process joins one group.
# --------------------------------------------------------------------------------------------

DIST_TIMEOUT_ENV = "LATENTLOOP_DIST_TIMEOUT"  # seconds a collective waits for the other processes
# torch's own default for NCCL groups: long enough for a first torch.compile or a large save on rank 0
DEFAULT_DIST_TIMEOUT_S = 1800.0
THREAD_JOIN_S = 30.0  # how long the exit waits for each non-daemon thread still running (`exit_without_finalizing`)
# How long the processes wait for each other in a phase one of them does alone or first (`agree`,
# `in_turns`, `on_main`): rank 0 tokenizing a large dataset, or hashing and writing a large
# checkpoint, may take far longer than any training collective should wait (a rank that dies ends
# the job through torchrun long before this).
PHASE_TIMEOUT_S = 7 * 24 * 3600.0


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


TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun (torch.distributed.run) in every process it starts


def a_peer_of_torchrun() -> bool:
    """Whether torchrun started this process and it is not rank 0: a process whose errors before
    the process group rank 0 says alike. RANK set by hand outside torchrun is no such process: its
    errors were silenced with nobody left to print them."""
    return bool(os.environ.get(TORCHRUN_ENV)) and os.environ.get("RANK", "0") not in ("", "0")


COLLECTIVE_FAILURE_WORDS = ("gloo", "nccl", "connection", "timed out", "broken pipe", "peer")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether an error came out of a collective whose other processes went away (torch.distributed's
    own errors; gloo's and NCCL's RuntimeErrors name their backend or the connection), not out of
    this process's own work."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(word in text for word in COLLECTIVE_FAILURE_WORDS)


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
        # torchrun's rendezvous (env://): every variable it reads is set (a shell's leftover MASTER_ADDR
        # and MASTER_PORT alone took this path and ended in torch's ValueError traceback)
        if all(os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
            try:
                dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
            except dist.DistError as exc:  # one line, not torch's traceback
                where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                # its address cannot be served (a port taken); a peer whose rank 0 never came times out as
                # a network error too, and is told as a group that did not form
                if isinstance(exc, dist.DistNetworkError) and "timed out" not in str(exc).lower():
                    raise ConfigError(f"the process group at {where} could not start: {first_line(exc)}") from None
                raise ConfigError(f"the process group at {where} did not form within {timeout.total_seconds():g} s "
                                  f"(${DIST_TIMEOUT_ENV}; the other processes never came): {first_line(exc)}") from None
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

    # Python's exit (threading._shutdown) first tells the thread pools to stop (concurrent.futures
    # registers that with threading, not atexit: inductor's compile workers wait on their queue for
    # good otherwise: every torchrun job with train.compile=true hung after its last checkpoint),
    # then joins the non-daemon threads. Both bounded here: a pool's stop waits for
    # its running tasks, and os._exit ends whatever is still running past THREAD_JOIN_S
    stopping = threading.Thread(target=_stop_thread_pools, name="latentloop-stop-pools", daemon=True)
    stopping.start()
    stopping.join(THREAD_JOIN_S)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(THREAD_JOIN_S)
    atexit._run_exitfuncs()  # e.g. the chat template workers' pool stops its processes
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader is gone: nothing more to say
            pass
    os._exit(code)


def _stop_thread_pools() -> None:
    """What Python's exit runs before it joins threads: the stop of every concurrent.futures pool."""
    import threading

    for stop_pool in reversed(getattr(threading, "_threading_atexits", [])):
        stop_pool()


def raised_alike(error: LatentloopError) -> LatentloopError:
    """`error`, marked as one every process raises alike: the command line prints it on rank 0 only."""
    error.shared = True
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
    dist.all_gather_object(reports, report, group=_phase_group())
    failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if not failed:
        return None
    first, (kind, message) = failed[0]
    if first == env.rank and isinstance(error, LatentloopError):
        return raised_alike(error)
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, LatentloopError)):
        cls = RankFailure
    return raised_alike(cls(message if first == 0 else f"rank {first}: {message}"))


# (the default group, its phase group): the reference keeps the default group's identity its own
_PHASE_GROUP: list[tuple[Any, Any]] = []


def _phase_group():
    """A gloo group of every process, waiting up to PHASE_TIMEOUT_S (the default group's collectives
    wait LATENTLOOP_DIST_TIMEOUT): with the default timeout, rank 0's first tokenization of a large
    dataset ended every other rank with a gloo timeout and a traceback. Made at the first phase,
    which every process reaches alike (a new group is a collective); on CPU, beside NCCL too."""
    world = dist.group.WORLD
    if not _PHASE_GROUP or _PHASE_GROUP[0][0] is not world:  # none yet, or made for a group left since
        _PHASE_GROUP[:] = [(world, dist.new_group(backend="gloo", timeout=timedelta(seconds=PHASE_TIMEOUT_S)))]
    return _PHASE_GROUP[0][1]


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
