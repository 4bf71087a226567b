"""Where a training step's time goes: torch.profiler over a few steps (`train --profile STEPS`, and
`benchmarks/gpu_bench.py` for every architecture), written as a trace and a summary.

    profiler = open_profiler(state)      # fit does this when train.profile_steps > 0
    ... profiler.step() after each optimizer step ...
    profiler.close()

The trace: torch.profiler's Chrome trace through its TensorBoard handler, `<run>/profile/*.pt.trace.json`
(TensorBoard's profiler plugin reads the folder; Perfetto, ui.perfetto.dev, opens the file). The
summary, `<run>/profile/summary.json` (`summarize`): the profiled steps' time per step, and the
shares of the kernels' busy time in matmuls, attention, elementwise and norm kernels, the optimizer
and the rest, and the share of the window in which no kernel ran (the idle gaps between kernels,
where the host's Python, launches or a synchronisation kept the device waiting). On a GPU the
kernels are the device's; on the CPU, the top-level aten operators stand in for them.

The profiled steps skip the first `PROFILE_WAIT` steps (compilation happens there) and one
warm-up step (the profiler's own start-up).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the loop's state (the loop imports this module)
    from .state import TrainState

PROFILE_WAIT = 2  # steps before profiling: the first steps compile
PROFILE_WARMUP = 1  # the profiler's own warm-up step, not recorded
PROFILE_DIR = "profile"
SUMMARY_FILE = "summary.json"
OPTIMIZER_RANGE = "latentloop.optimizer"  # a record_function range around the optimizers' steps

# Kernel (or operator) names by category, tried in order: the first that matches names the category.
# Optimizer kernels are also those inside the OPTIMIZER_RANGE annotation.
CATEGORIES: tuple[tuple[str, re.Pattern], ...] = (
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|muon|orthogonal", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|flex|attn|cudnn.*(mha|fprop)", re.I)),
    ("matmul", re.compile(r"gemm|matmul|\bmm\b|aten::mm|addmm|bmm|linear|cutlass|xmma|nvjet|cublas|sm\d+_", re.I)),
    ("elementwise/norm", re.compile(r"elementwise|vectorized|reduce|norm|softmax|triton_|copy|cat|fill|relu|silu|"
                                    r"mul|add|sub|div|exp|log|where|cross_entropy|nll|index|embedding|rsqrt|pow|"
                                    r"sum|mean|clone|contiguous|to_copy|zero", re.I)),
)
OTHER = "other"


def categorize(name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return OTHER


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _kernels(prof: torch.profiler.profile) -> tuple[list[Any], list[tuple[float, float]], str]:
    """The events that did the work (device kernels on a GPU, else the top-level aten operators),
    the optimizer's ranges, and which kind they are."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    device = [e for e in events if e.device_type == DeviceType.CUDA and e.name != OPTIMIZER_RANGE
              and not getattr(e, "is_user_annotation", False)]
    optimizer = [(e.time_range.start, e.time_range.end) for e in events if e.name == OPTIMIZER_RANGE]
    if device:
        return device, optimizer, "cuda kernels"
    top = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return top, optimizer, "cpu operators (top level)"


def summarize(prof: torch.profiler.profile, steps: int) -> dict[str, Any]:
    """Per step: the window from the first kernel's start to the last one's end, the share of the
    kernels' busy time per category, and the idle share of the window (no kernel running)."""
    kernels, optimizer, kind = _kernels(prof)
    if not kernels:
        return {"steps": steps, "kernels": kind, "error": "the profiler recorded no kernels"}
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    window = max(end for _, end in spans) - min(start for start, _ in spans)
    busy_by: dict[str, float] = {}
    for event, (start, end) in zip(kernels, spans):
        inside = any(a <= start and end <= b for a, b in optimizer)
        category = "optimizer" if inside else categorize(event.name)
        busy_by[category] = busy_by.get(category, 0.0) + (end - start)
    busy_total = sum(busy_by.values()) or 1.0
    busy = _union_length(spans)
    top = sorted(busy_by.items(), key=lambda item: -item[1])
    names: dict[str, float] = {}
    for event, (start, end) in zip(kernels, spans):
        names[event.name] = names.get(event.name, 0.0) + (end - start)
    return {"steps": steps, "kernels": kind, "step_ms": window / 1000 / max(steps, 1),
            "share_of_kernel_time": {name: round(t / busy_total, 4) for name, t in top},
            "idle_share_of_window": round(max(0.0, 1 - busy / window), 4) if window > 0 else None,
            "kernel_count_per_step": len(kernels) / max(steps, 1),
            "top_kernels_ms_per_step": {name: round(t / 1000 / max(steps, 1), 3) for name, t in
                                        sorted(names.items(), key=lambda item: -item[1])[:12]}}


class StepProfiler:
    """torch.profiler over `steps` optimizer steps after `wait` steps: a trace and a summary in
    `folder` once they are recorded (or when closed early, whatever was recorded)."""

    def __init__(self, folder: Path, steps: int, device: torch.device, wait: int = PROFILE_WAIT):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.folder, self.steps = Path(folder), steps
        self.folder.mkdir(parents=True, exist_ok=True)
        self.summary: dict[str, Any] | None = None
        trace = tensorboard_trace_handler(str(self.folder))

        def ready(prof: profile) -> None:
            trace(prof)
            self.summary = summarize(prof, self.steps)
            (self.folder / SUMMARY_FILE).write_text(json.dumps(self.summary, indent=2) + "\n")

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profile = profile(activities=activities, on_trace_ready=ready,
                               schedule=schedule(wait=wait, warmup=PROFILE_WARMUP, active=steps, repeat=1))
        self.profile.start()
        self.closed = False

    def step(self) -> None:
        self.profile.step()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.profile.stop()


def open_profiler(state: TrainState) -> StepProfiler | None:
    """The run's profiler (rank 0 only), writing into `<run>/profile`; a run too short to reach the
    profiled steps is told so (it recorded nothing, without a word)."""
    if not state.dist.is_main:
        return None
    from .state import warn

    wanted, left = state.config.train.profile_steps, state.config.train.steps - state.step
    recorded = max(0, min(wanted, left - PROFILE_WAIT - PROFILE_WARMUP))
    if recorded < wanted:
        warn(f"--profile {wanted}: the profiler skips the first {PROFILE_WAIT + PROFILE_WARMUP} steps (they compile; "
             f"its own warm-up) and this run has {left} to go, so it records "
             + (f"only {recorded}" if recorded else "nothing") + f"; train {PROFILE_WAIT + PROFILE_WARMUP + wanted} "
             f"steps or more to record {wanted}")
    if not recorded:
        return None  # no empty profile/ folder either
    return StepProfiler(state.run_dir / PROFILE_DIR, wanted, state.device)
