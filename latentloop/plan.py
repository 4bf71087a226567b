"""Sizing a training run before it starts (`latentloop plan`): its FLOPs, its memory per device and
its wall-clock at a stated MFU, from the registry's model and objective, measured structurally.

- FLOPs: the trainer's own count. `fit` charges every optimizer step `objective.flops_per_token(memo,
  step) x tokens per step` (`latentloop.train`), with the model's structural `flops_per_token` behind
  the objective's `forward_mix` (fbt's drawn passes, rgpt's drawn depth, lrt's subsets); the plan
  takes the same sum over the run's steps, in the same order, so it equals the `flops` the run logs.
  Past `EXACT_STEPS` steps it charges the objective's run average per step instead (said so).
- Memory, per device (`latentloop.train.memory`, which `setup` also asks before a large run): the
  weights and gradients (fp32: autocast keeps the weights in fp32), the optimizer's states as the
  run's own optimizers allocate them (one step taken on a model that holds no data, on torch's
  meta device), the activations as the tensors the objective saves for
  the backward (counted, each storage once, during one forward of a micro-batch; with activation
  checkpointing, what stays: the recomputable modules' inputs, the rest of the graph, and the
  largest module's own activations while it is recomputed), and the KV cache of one sequence at
  the full context for decoding. The peak, over the kinds of step the run takes: the weights, the
  optimizer's states (from the second step on: they are made by the first) and the most activations
  and gradients the backward holds at once (`SavedTensors.held_with_gradients`: it makes each
  call's gradients as it frees that call's activations, beginning with the gradients of the largest
  saved tensor; `zero_grad(set_to_none=True)` drops them before the next forward; with gradient
  accumulation they are held whole from the second micro-batch on), or the optimizer's step over
  every gradient with what it makes while it runs (Muon's stacked gradients and Newton-Schulz
  products, counted on the meta device as its ops return them), whichever is larger. This is what
  the tensors hold, as a caching allocator's peak reports it; a CPU process's resident memory adds
  its allocator's slack (tests/test_plan.py).
- The probes run on the meta device (shapes only, no memory, no time), where bf16 autocast is
  emulated (`train.memory._MetaProbe`: the matrix products in bf16, as autocast runs them); an architecture
  whose forward needs data (a token router's `nonzero`) is probed on the CPU instead, one sequence
  at a time.
- Wall-clock: FLOPs / (devices x peak x MFU), the MFU measured by `benchmarks/gpu_bench.py` where it
  measured this architecture on this GPU (`measured_mfu.json`, which names its log), else assumed
  (`ASSUMED_MFU`), and said which.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from .archs import build_model, build_objective
from .config import PRESETS, RunConfig, model_config
from .errors import ConfigError
from .runtime import resolve_dtype
from .train.memory import check_micro_batch_fits, kind_steps, meta_model, step_memory
from .train.state import FlopsMemo
from .train.step import accumulation
from .util import memory_limit_bytes


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float | None  # dense bf16 FLOP/s, no sparsity (None: measured on this machine, the CPU)
    memory_bytes: float | None  # per device (None: this machine's memory)
    fp32_flops: float | None = None  # float32 FLOP/s without TF32 (the trainer never turns TF32 on)


# Vendors' data sheets: dense bf16 tensor-core peaks and float32 (non-tensor) peaks (SXM parts). Memory
# per GPU near what torch reports (`total_memory`, what the trainer's own check compares with), rounded
# down to the thousand MiB so that a plan never promises more than a card gives (torch reports some
# hundred MiB less than nvidia-smi's total: 81,559 / 143,771 / 81,920 MiB). The data sheets' "80 GB" /
# "141 GB" read as decimal gigabytes understated it by 5-7 GiB, and a step `train` accepts was planned
# as not fitting.
MIB = 2**20
ACCELERATORS: dict[str, Accelerator] = {
    "h200": Accelerator("NVIDIA H200", 989e12, 143_000 * MIB, 67e12),
    "h100": Accelerator("NVIDIA H100 SXM", 989e12, 81_000 * MIB, 67e12),
    "a100": Accelerator("NVIDIA A100 SXM 80GB", 312e12, 81_000 * MIB, 19.5e12),
    "cpu": Accelerator("this machine's CPU", None, None),
}
STRATEGIES = ("none", "ddp", "fsdp2")
# where gpu_bench measured nothing: what it measured for gpt at the gpt2 shape on an H200, compiled
# (measured_mfu.json: 0.2134); an eager or smaller run reaches less
ASSUMED_MFU = 0.21
ASSUMED_CPU_MFU = 0.5  # of the matrix-product rate measured on this CPU (`cpu_matmul_flops`)
EXACT_STEPS = 200_000  # up to this many steps the FLOPs are summed step by step, as the trainer does
MEASURED_MFU_FILE = "measured_mfu.json"
# A --params shape: width 64 per layer and heads of 64 channels (nanochat's aspect ratio, gpt2's head
# size), on the gpt2 preset's vocabulary and context.
PARAMS_BASE = "gpt2"
WIDTH_PER_LAYER = 64
HEAD_DIM = 64
MAX_LAYERS = 96


def measured_mfu(arch: str, gpu: str) -> tuple[float, str] | None:
    """(MFU, where it was measured) when gpu_bench measured `arch`'s own training on `gpu`."""
    try:
        table = json.loads(resources.files("latentloop").joinpath(MEASURED_MFU_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    entry = table.get(gpu)
    if not entry or arch not in entry.get("mfu", {}):
        return None
    return float(entry["mfu"][arch]), f"measured by benchmarks/gpu_bench.py ({entry['shape']}; {entry['source']})"


def cpu_matmul_flops(dtype: str, seconds: float = 0.3) -> float:
    """This CPU's rate of large matrix products in `dtype` (FLOP/s), timed for about `seconds`."""
    n = 1024
    a = torch.randn(n, n, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, dtype=getattr(torch, dtype))
    a @ b  # the first product loads the kernels
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        done += 1
    return done * 2 * n ** 3 / (time.perf_counter() - start)


def config_for_params(arch: str, params: int, **fields) -> Any:
    """The model config whose parameter count is nearest `params`, over depths 1..MAX_LAYERS at
    WIDTH_PER_LAYER channels per layer (the registry's model counts its own parameters)."""
    base = {k: v for k, v in PRESETS[PARAMS_BASE].items() if k not in ("n_layer", "n_embd", "n_head")}
    best = None
    for layers in range(1, MAX_LAYERS + 1):
        width = WIDTH_PER_LAYER * layers
        config = model_config(arch, None, **{**base, **fields, "n_layer": layers, "n_embd": width,
                                             "n_head": max(1, width // HEAD_DIM)})
        count = sum(p.numel() for p in meta_model(config).parameters())
        if best is None or abs(math.log(count / params)) < abs(math.log(best[1] / params)):
            best = (config, count)
        if count > params:
            break
    if not 0.5 < best[1] / params < 2:  # past the shapes this search spans: not the size asked for
        raise ConfigError(f"--params {params:,}: the nearest shape of 1-{MAX_LAYERS} layers x {WIDTH_PER_LAYER} "
                          f"channels a layer has {best[1]:,} parameters; give the shape with --preset or --set")
    return best[0]


@dataclass
class Plan:
    arch: str
    shape: dict[str, Any]
    params: int
    tokens: int
    steps: int
    tokens_per_step: int
    devices: int
    gpu: str
    strategy: str
    precision: str
    flops: float
    flops_method: str
    flops_per_token: float  # the run's average, training (forward + backward)
    memory: dict[str, float]  # bytes per device
    activation_checkpointing: bool
    capacity_bytes: float | None
    fits: bool | None
    mfu: float
    mfu_source: str
    peak_flops: float
    seconds: float
    probe: str  # where the memory was probed: meta or cpu

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_run(config: RunConfig, tokens: int, devices: int = 1, gpu: str = "h100", strategy: str | None = None,
             mfu: float | None = None) -> Plan:
    """Size `config`'s training for `tokens` tokens on `devices` x `gpu` (see the module docstring)."""
    if gpu not in ACCELERATORS:
        raise ConfigError(f"unknown --gpu {gpu!r}: choose from {', '.join(ACCELERATORS)}")
    strategy = strategy or ("ddp" if devices > 1 else "none")
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: choose from {', '.join(STRATEGIES)}")
    if strategy == "none" and devices > 1:
        raise ConfigError(f"strategy none trains on one device, not {devices}: choose ddp or fsdp2")
    if gpu == "cpu" and devices > 1:  # each process was given the whole machine's rate and memory
        raise ConfigError(f"--gpu cpu plans one process on this machine, not {devices}: its processes would share "
                          f"one machine's cores and memory")
    if tokens < 1:
        raise ConfigError(f"--tokens must be at least 1, got {tokens}")
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {mfu}")
    train = config.train
    T = config.model.sequence_len
    tokens_per_step = train.batch_size * accumulation(train, T, devices) * devices * T  # batch_tokens too
    steps = max(1, math.ceil(tokens / tokens_per_step))
    config.train.steps = steps  # objectives read the run's length (fbt's schedule, rgpt's draws)
    # every GPU planned for computes bf16 natively (Ampere and after): not the GPU this machine may hold
    precision = resolve_dtype(torch.device("cuda" if gpu != "cpu" else "cpu"), train.dtype, cuda_bf16=True)
    accelerator = ACCELERATORS[gpu]
    capacity = accelerator.memory_bytes if gpu != "cpu" else memory_limit_bytes()
    # what `train` refuses at once is refused before the probes too (their time grows with the batch)
    check_micro_batch_fits(config, torch.device("cpu"), capacity, f"{accelerator.name} has")
    objective = build_objective(config.model, config.train)

    # FLOPs: as `fit` sums them. The count is structural (shapes only), so the meta model gives the
    # trainer's numbers; a forward that needs data is counted on a model built on the CPU.
    model = meta_model(config.model)
    try:
        memo = FlopsMemo(model)
        objective.flops_per_token(memo)
    except (RuntimeError, NotImplementedError):
        model = build_model(config.model)
        memo = FlopsMemo(model)
        objective.flops_per_token(memo)
    if steps <= EXACT_STEPS:
        flops = 0.0
        for step in range(steps):
            flops += objective.flops_per_token(memo, step) * tokens_per_step
        method = "the trainer's count, step by step"
        forward_steps = list(range(steps))
    else:
        flops = objective.flops_per_token(memo) * tokens_per_step * steps
        method = f"the objective's run average x {steps:,} steps (over {EXACT_STEPS:,} steps)"
        forward_steps = kind_steps(steps)
    params = sum(p.numel() for p in model.parameters())

    # Memory per device (latentloop/train/memory.py), the peak compared with the device's below.
    memory, probe = step_memory(config, objective, forward_steps, devices, strategy, precision, on_cpu=gpu == "cpu")
    peak = memory["peak"]

    if gpu == "cpu":
        peak_flops = cpu_matmul_flops(precision)
        chosen = (mfu, "given (--mfu)") if mfu is not None else (
            ASSUMED_CPU_MFU, f"assumed, of this CPU's measured {precision} matrix-product rate")
    else:  # float32 products run without tensor cores (no TF32): the float32 peak
        peak_flops = accelerator.fp32_flops if precision == "float32" else accelerator.peak_flops
        chosen = (mfu, "given (--mfu)") if mfu is not None else (
            measured_mfu(config.model.arch, gpu) or (ASSUMED_MFU, "assumed: gpu_bench measured no run of this "
                                                                  "arch on this GPU"))
        if mfu is None and not train.compile:  # both figures come from compiled runs: said, not hidden
            chosen = (chosen[0], f"{chosen[1]}; of a compiled run, and this one is not (train.compile false): "
                                 f"an eager run reaches less, give --mfu for it")
    seconds = flops / (devices * peak_flops * chosen[0])
    shape = {k: getattr(config.model, k) for k in ("n_layer", "n_embd", "n_head", "n_kv_head", "sequence_len",
                                                    "vocab_size")}
    return Plan(arch=config.model.arch, shape=shape, params=params, tokens=steps * tokens_per_step, steps=steps,
                tokens_per_step=tokens_per_step, devices=devices, gpu=gpu, strategy=strategy, precision=precision,
                flops=flops, flops_method=method, flops_per_token=flops / (steps * tokens_per_step),
                memory=memory, activation_checkpointing=train.activation_checkpointing, capacity_bytes=capacity,
                fits=None if capacity is None else peak <= capacity, mfu=chosen[0], mfu_source=chosen[1],
                peak_flops=peak_flops, seconds=seconds, probe=probe)


__all__ = ["ACCELERATORS", "ASSUMED_MFU", "Plan", "config_for_params", "measured_mfu", "plan_run"]
