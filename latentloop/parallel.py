"""Training over many processes, and the per-block options that go with it (used by `train`).

    forward_model = wrap_model(model, train_config, device)   # AC, compile, DDP or FSDP2
    with gradient_sync(forward_model, last_micro_batch): loss.backward()
    norm = grad_norm(model, clip)                               # also over FSDP2's sharded gradients

Strategies (`train.strategy`), each process on the GPU of its LOCAL_RANK (or the CPU, gloo):
- `ddp`: `DistributedDataParallel`, the model replicated, gradients all-reduced (averaged) during
  the backward of the last micro-batch of a step (`no_sync` before it);
- `fsdp2`: `torch.distributed.fsdp.fully_shard` on every block and then on the whole model (the
  embedding, head and the variants' extra matrices), so each process keeps 1/N of the parameters,
  gradients and optimizer states and all-gathers a block's parameters just before using them. On
  CUDA with bf16 (train.dtype auto or bfloat16) the mixed-precision policy computes in bf16 and
  reduces gradients in fp32; on the CPU (gloo) everything stays fp32.

Per block, before the strategy wraps the model:
- activation checkpointing (`train.activation_checkpointing`): a block's activations are
  recomputed in the backward (torch.utils.checkpoint, non-reentrant). lrt's interleaved and chunked
  passes write one key/value buffer that later passes read and extend, so recomputing attention in
  the backward would read the buffer as it is then, not as it was: there only the MLPs are
  recomputed.
- `torch.compile` (`train.compile`): every arch compiles its whole step as one graph, the model
  with its objective's loss (the trainer's `train.step.ModelAndLoss`, passed as `root`; wrapped in
  DDP when asked), once per kind of forward the objective draws (fbt's K, rgpt's depth: constants
  of their graphs, `dynamic=False`); under fsdp2 block by block, as torchtitan does, each block's
  graph shared by the blocks that read nothing of their own (gpt's; lrt's read their buffer slot).

Checkpoints of an fsdp2 run (`save_sharded` / `load_sharded`) go through
`torch.distributed.checkpoint`: every process writes its own shards of the model and optimizer
(`get_state_dict` / `set_state_dict`), so saving never gathers the model; a run resumed on another
number of processes is resharded on load. Rank 0 records every file's sha256 after a save, and a
load checks them first and reads DCP's pickled metadata and non-tensor entries through allow-lists
(`checkpoint.check_sharded` / `load_sharded_state`): a corrupt or planted file is one error line.
The single-file copy for `load` / `eval` / `generate` (`full_weights`) is gathered shard by shard
into rank 0's CPU memory, never onto a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .checkpoint import (
    SHARDED_DIR,
    check_sharded,
    dcp_cause,
    load_sharded_state,
    write_sharded_checksums,
)
from .config import TrainConfig
from .distributed import agree, current_dist, in_process_group
from .errors import CheckpointError, OutputError
from .precision import recompute_contexts
from .runtime import resolve_dtype, to_device_async
from .util import first_line

__all__ = ["SHARDED_DIR", "any_rank", "apply_activation_checkpointing", "compiles_whole_model", "full_weights",
           "gather_objects", "grad_norm", "gradient_sync", "load_full_optimizer_states", "load_full_weights",
           "load_sharded", "mean_across_ranks", "micro_batch_shares", "micro_batch_term_shares", "save_sharded",
           "wrap_model"]


def _checkpointed(module: nn.Module) -> None:
    """Recompute `module`'s forward in the backward. The instance's forward is replaced (not the
    module), so parameter names, and hence checkpoints, stay as they are. By a function, not a
    `functools.partial`: a module compiled on its own (`module.compile()`, block by block) whose
    forward is a partial was never compiled at all (dynamo skipped the frame: torch 2.13, 0 graphs
    for 4 blocks of gpt), and ran eagerly."""
    forward = module.forward

    def recomputed(*args, **kwargs):
        # eager: the recomputation, in the backward, emulates bf16 where the forward did (precision.py);
        # a compiled region takes no context_fn but two dispatch modes (and emulates nothing)
        contexts = {} if torch.compiler.is_compiling() else {"context_fn": recompute_contexts}
        return checkpoint(forward, *args, use_reentrant=False, **contexts, **kwargs)

    module.forward = recomputed


def apply_activation_checkpointing(model: nn.Module) -> None:
    for module in model.recomputable_modules():  # the arch says which (lrt's buffered passes: the MLPs only)
        _checkpointed(module)


def compiles_whole_model(model: nn.Module, strategy: str, scope: str = "auto") -> bool:
    """Whether `train.compile` compiles the whole forward or each block: as `scope` says
    (`train.compile_scope`), "auto" meaning where the arch declares `COMPILES_WHOLE`; never under
    fsdp2, whose units are the blocks."""
    if strategy == "fsdp2":
        return False
    return scope == "whole" or (scope == "auto" and type(model).COMPILES_WHOLE)


# Graphs one compiled block function may keep: its blocks (layer attributes such as the layer's index
# and lrt's injection flags are guarded) x the kinds of pass it runs in. lrt's interleaved training
# runs six kinds with its validation (training and evaluation of its full and subset passes), counted
# on the CPU: with 4 a block, six layers filled the limit and the rest fell back to eager for good
# (the same happened on an H200 under fsdp2). flex_attention's masks on a GPU may add kinds: twice
# the count seen.
GRAPHS_PER_BLOCK = 12


def _allow_recompiles(graphs: int) -> None:
    """Raise dynamo's per-function recompile limit (8 by default: past it, the function falls back
    to eager for good) to `graphs`, what the chosen compilation needs."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), graphs))


def _bf16_on_gpu(config: TrainConfig, device: torch.device) -> bool:
    """FSDP2 computes in bf16 where the run's autocast does (not "auto" on a GPU without native bf16)."""
    return device.type == "cuda" and resolve_dtype(device, config.dtype) == "bfloat16"


def wrap_model(model: nn.Module, config: TrainConfig, device: torch.device, root: nn.Module | None = None,
               graphs: int = 16) -> nn.Module:
    """Apply activation checkpointing, compilation and the strategy; returns the module to call.
    `model` stays the plain module (with fsdp2: sharded in place), whose state dict and parameters
    the optimizer, validation and checkpoints use.

    `root`: the module the strategy wraps and a whole compile traces, when it is not the model
    itself: the trainer's model-and-loss (`train.step.ModelAndLoss`), so that the loss is in the
    model's graph and DDP's buckets see one forward. `graphs`: how many graphs a whole compile may
    keep (one per kind of forward the objective runs: its pass counts, depths); each is compiled
    once (`dynamic=False`: a pass count or depth is a constant of its graph, never a symbol)."""
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    root = model if root is None else root
    whole = config.compile and compiles_whole_model(model, config.strategy, config.compile_scope)
    if config.compile and not whole:
        _allow_recompiles(GRAPHS_PER_BLOCK * len(model.blocks))
        for block in model.blocks:
            block.compile(backend=config.compile_backend)  # in place: the parameter names stay
    forward_model = root
    if config.strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if _bf16_on_gpu(config, device) else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif config.strategy == "ddp":
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # The buffers (RoPE tables) are computed alike everywhere: no need to send them every forward.
        no_buffer_sync = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})
        # Recurrent objectives leave some parameters unused in some steps (fbt's fusion at K = 1);
        # DDP must then look for them, or it waits forever for their gradients. Only an arch that
        # states otherwise (`STEP_USES_EVERY_PARAMETER`, the plain gpt) skips the search.
        forward_model = DistributedDataParallel(
            root, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True,
            find_unused_parameters=not type(model).STEP_USES_EVERY_PARAMETER, **no_buffer_sync)
    if whole:
        _allow_recompiles(graphs)
        forward_model = torch.compile(forward_model, backend=config.compile_backend, dynamic=False)
    return forward_model


def _ddp_module(forward_model: nn.Module) -> nn.Module | None:
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(forward_model, "_orig_mod", forward_model)  # a compiled DDP
    return inner if isinstance(inner, DistributedDataParallel) else None


@contextlib.contextmanager
def gradient_sync(forward_model: nn.Module, sync: bool) -> Iterator[None]:
    """Around one micro-batch's forward and backward. DDP reduces gradients across processes only
    on the last micro-batch of a step (`sync`); the ones before accumulate locally. FSDP2 reduces
    (scatters) them on every micro-batch, as torchtitan does: without it each process would hold
    every parameter's whole gradient until the last micro-batch, not its 1/N shard."""
    ddp = _ddp_module(forward_model)
    if ddp is not None and not sync:
        with ddp.no_sync():
            yield
        return
    yield


def _full(t: Tensor) -> Tensor:
    """A plain tensor from a DTensor (the norm of sharded gradients) or a tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grad_norm(model: nn.Module, clip: float) -> Tensor:
    """The total gradient norm over every process's shards, clipping to `clip` when it is > 0
    (otherwise measured only)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if clip > 0:
        return _full(torch.nn.utils.clip_grad_norm_(params, clip))
    if not params:
        return torch.zeros(())
    if any(hasattr(p.grad, "full_tensor") for p in params):
        return _full(torch.nn.utils.get_total_norm([p.grad for p in params]))
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.detach().float()) for p in params]))


def mean_across_ranks(value: Tensor) -> Tensor:
    """The mean of a tensor over the processes (each step's loss and the objective's metrics, in one
    reduction: every process logs and checks the same numbers), on the device: nothing is read back."""
    env = current_dist()
    if env.world_size == 1:
        return value
    # float64 where the reduction is gloo's on the host (as exact as the single process's sum)
    total = value.detach().to(torch.float64 if value.device.type != "cuda" else torch.float32).reshape(-1).clone()
    dist.all_reduce(total)
    return (total / env.world_size).reshape(value.shape)


def micro_batch_shares(target_counts: list[int], device: torch.device) -> list[float] | list[Tensor]:
    """Each micro-batch's share of a step's gradient when its loss is a mean over a varying number of
    targets (SFT's loss masks): its targets over the step's, counted over every micro-batch and
    process, times the processes (DDP and fsdp2 average their gradients), so that every trained token
    weighs alike whatever micro-batch or process it fell in, as in one batch of them all. The counts
    are the host's (the loader's masks); over several processes their sum is one reduction on the
    device, and the shares stay there (nothing is read back)."""
    world = current_dist().world_size
    if world == 1:
        total = max(1, sum(target_counts))
        return [count / total for count in target_counts]
    total = to_device_async(torch.tensor(sum(target_counts), dtype=torch.int64), device)  # no stall of the stream
    dist.all_reduce(total)
    per_target = world / total.clamp(min=1).to(torch.float32)
    return [count * per_target for count in target_counts]


def micro_batch_term_shares(term_counts: list[list[int]], device: torch.device) -> Tensor:
    """(micro-batches, terms): `micro_batch_shares` for a loss that is a sum of means over different
    subsets of a step's trained targets (an objective's `target_terms`: lrt's init pass over every
    column and its column subsets): each micro-batch's targets of each term over that term's in the
    whole step, over every process, times the processes. On the device (an input of the compiled
    step, never a number it specialises on); the totals are one reduction over the processes."""
    counts = to_device_async(torch.tensor(term_counts, dtype=torch.int64), device)  # (M, K); no stall of the stream
    totals = counts.sum(dim=0)
    world = current_dist().world_size
    if world > 1:
        dist.all_reduce(totals)
    return counts.to(torch.float32) * world / totals.clamp(min=1).to(torch.float32)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every process when `flag` is true on any (a stop decision all must share)."""
    if current_dist().world_size == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t)


def gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj`, by rank."""
    env = current_dist()
    if env.world_size == 1:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------------------------
# Checkpoints of sharded runs
# --------------------------------------------------------------------------------------------


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def full_weights(model: nn.Module) -> dict[str, Tensor]:
    """The whole model's weights, gathered shard by shard into rank 0's CPU memory (collective: every
    process calls it; the others get an empty dict). Peak memory: one full fp32 copy on rank 0's
    CPU, none on any GPU."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))
    return {name: t.detach().contiguous() for name, t in weights.items()}


def save_sharded(folder: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[str]:
    """Every process writes its shards of the model and optimizer states into `folder`
    (torch.distributed.checkpoint; collective), then rank 0 records every file's sha256 in
    `folder/checksums.json` (`write_sharded_checksums`). Returns the names of the parameters that
    have optimizer state (one never updated has none), so that a resume can leave the others without."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # torch's get_state_dict first fills an optimizer that has no state with a step of zero gradients
    # (AdamW: step 1 and zero moments for every parameter). Recorded as real, a resume from a checkpoint
    # written before any step (a deadline already past) took them, and its first step's bias correction
    # was the second's. The file keeps them (torch's loader cannot split an optimizer state without any
    # among several optimizers); the names returned, and the live optimizers, are those with real state.
    names = _param_names(model)
    with_state = {names[p] for opt in optimizers for p, state in opt.state.items() if state}
    model_state, optim_state = get_state_dict(model, optimizers)
    for opt in optimizers:
        for p in [p for p in opt.state if names.get(p) not in with_state]:
            del opt.state[p]
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    except (Exception, CheckpointException) as exc:  # CheckpointException: a BaseException, raised on every rank
        cause = dcp_cause(exc)
        raise OutputError(f"cannot write the sharded checkpoint {folder}: {first_line(cause)}") from None
    if current_dist().is_main:  # dcp.save has returned: every process's files are complete
        write_sharded_checksums(folder)
    return sorted(with_state)


def load_sharded(folder: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                 with_state: list[str]) -> str | None:
    """Load a `save_sharded` folder into this run's (possibly differently sharded) model and
    optimizers (collective). Parameters that had no optimizer state when it was saved get none.

    Before DCP reads anything, the processes check the files against their checksums (each its
    share) and read DCP's metadata without unpickling it freely (`checkpoint.check_sharded`), and
    all agree on the outcome; DCP then reads only through `checkpoint.load_sharded_state`. Returns
    a warning for rank 0 to print (a checkpoint saved before checksums were recorded), or None."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    env = current_dist()
    try:
        metadata, note = check_sharded(folder, env.rank, env.world_size)
    except CheckpointError as exc:
        agree(exc)  # every process raises (the lowest failed rank's error), none goes on into DCP's collectives
        raise  # agree raised already; kept for the type checker
    agree(None)
    model_state, optim_state = get_state_dict(model, optimizers)  # fills empty optimizer states first
    keep = set(with_state)
    if keep:  # else every state in the file is one get_state_dict filled when it saved: read, then dropped below
        optim_state["state"] = {name: s for name, s in optim_state.get("state", {}).items() if name in keep}
    wanted = {"model": model_state, "optim": optim_state}
    load_sharded_state(wanted, folder, metadata, no_dist=not in_process_group())
    # not strict: parameters never updated when it was saved have no optimizer state in the file (dcp.load
    # has already checked that every weight and every state asked for was there)
    set_state_dict(model, optimizers, model_state_dict=wanted["model"], optim_state_dict=wanted["optim"],
                   options=_options(strict=False))
    names = _param_names(model)
    for opt in optimizers:  # and they get none here either, as in the run that saved it
        for group in opt.param_groups:
            for p in group["params"]:
                if names.get(p) not in keep:
                    opt.state.pop(p, None)
    return note


def _param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: name for name, p in model.named_parameters()}


def load_full_optimizer_states(model: nn.Module, optimizers: list[torch.optim.Optimizer],
                               saved: list[dict[str, Any]]) -> None:
    """Optimizer states of an unsharded checkpoint (keyed by parameter index, as
    `Optimizer.state_dict` writes them) into this run's sharded optimizers: renamed by parameter,
    then sharded by `set_optimizer_state_dict`. The optimizers are built in the same parameter
    order as the ones that saved them."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = _param_names(model)
    for opt, state in zip(optimizers, saved):
        order = [names[p] for group in opt.param_groups for p in group["params"]]
        by_name = {"state": {order[int(i)]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]}
                                    for g in state["param_groups"]]}
        # not strict: a parameter never updated when it was saved (fbt's fusion before its first
        # multi-pass step) has no state in the file, and gets none here either
        set_optimizer_state_dict(model, opt, by_name, options=_options(full_state_dict=True, strict=False))
        for p in [p for group in opt.param_groups for p in group["params"]]:
            if names[p] not in by_name["state"]:
                opt.state.pop(p, None)


def load_full_weights(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Whole weights into a sharded model: each process keeps its shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, weights, options=_options(full_state_dict=True))
