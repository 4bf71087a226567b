"""Timing primitives and formatting shared by the benchmarks (`python -m benchmarks.NAME`).

- the machine: `environment()`, `ContentionMeter` (CPU share used by other processes meanwhile);
- timing: `run_interleaved` (every measurement in rotating order, medians), `decode_generate` (the
  engine's generator, per-token latency), `decode_steps` (the model's own prefill/decode),
  `decode_comparison`, `training_call` / `training_comparison` (one full optimizer step of the
  trainer through the arch's objective), `make_train_step`;
- paired A/B in one process: `paired_ratios`, `describe_ratios`;
- formatting: `render_table`, `ms`, `ratio_vs`, `change`, ...
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import latentloop
from latentloop.archs import build_objective
from latentloop.config import PRESETS, TrainConfig
from latentloop.data.tokenizers import ByteTokenizer
from latentloop.engine import model_options
from latentloop.optim import build_optimizers
from latentloop.parallel import wrap_model
from latentloop.runtime import keep_freed_memory, resolve_dtype
from latentloop.train import FiniteGuard, FlopsMemo, train_step
from latentloop.util import write_json_atomic

GIT_TIMEOUT_S = 10  # asking git for the commit a result came from
BYTE_VOCAB = ByteTokenizer.vocab_size  # 259: bytes + BOS/EOS/PAD; prompts use bytes only (never BOS)
MiB = 2 ** 20


def add_decode_shape_arguments(parser: argparse.ArgumentParser, shapes: Sequence[str], default: str) -> None:
    """The model shape and the prompt / generation lengths of a batch-1 decode benchmark."""
    parser.add_argument("--shape", choices=list(shapes), default=default)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=200)


def require_at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> None:
    """parser.error for the first of the named integer arguments that is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"{flag_of(parser, name)} must be >= 1")


def flag_of(parser: argparse.ArgumentParser, dest: str) -> str:
    """The flag a user types for the argument stored as `dest` (fast_training's --rounds is stored
    as train_steps: its error named a --train-steps that does not exist)."""
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return f"--{dest.replace('_', '-')}"


def require_threads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error unless `--threads`, where given, is >= 1: `torch.set_num_threads(0)` raises a
    RuntimeError only once the benchmark starts, as a traceback."""
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")


def require_rounds(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str = "rounds") -> None:
    """parser.error unless the paired rounds `name` are >= 2: `describe_ratios` (quartiles, the
    interval's spread) needs two ratios, and would fail only after all the work."""
    if getattr(args, name) < 2:
        parser.error(f"--{name.replace('_', '-')} must be >= 2 (the ratios' quartiles and interval need two rounds), "
                     f"got {getattr(args, name)}")


def render_table(rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table whose first row is the header; columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def announce_environment(env: dict[str, Any]) -> None:
    """Print the one-line environment summary, and a warning when the CPUs were busy before the start."""
    busy = env["cpu_busy_before"]
    print(f"torch {env['torch']}, {env['threads']} threads ({env['interop_threads']} inter-op), "
          f"{env['cpu_count']} CPUs ({'?' if busy is None else f'{busy:.0%}'} busy before start), "
          f"{env['platform']}", flush=True)
    if busy is not None and busy > 0.2:
        print(f"warning: the CPUs were {busy:.0%} busy just before the run: other processes compete for the "
              f"{env['cpu_count']} cores and the numbers will be low (noisy neighbours can slow torch's "
              "OpenMP threads several-fold)", flush=True)


def write_results(results: dict[str, Any], others: float | None, json_path) -> None:
    """Warn if other processes were busy, and write the results as JSON when asked."""
    warn_contention(others)
    if json_path is not None:
        write_json_atomic(json_path, results)  # never half-written, even when the run is killed meanwhile
        print(f"wrote {json_path}")


def warn_contention(others: float | None) -> None:
    """Warn when other processes used a noticeable share of the CPUs during the run."""
    if others is not None and others > 0.1:
        print("warning: other processes competed for the CPUs during the run; these numbers understate the "
              "speed, rerun on an idle machine")


def make_train_step(model: torch.nn.Module, forward_model: torch.nn.Module, objective: Callable, x: torch.Tensor,
                    y: torch.Tensor, optimizers: Sequence[torch.optim.Optimizer], train_cfg: TrainConfig,
                    device: torch.device | None = None) -> Callable[[int], float]:
    """One full optimizer step as `latentloop.train.fit` takes it, through the same function
    (`latentloop.train.train_step`: accumulation, autocast, the non-finite guard, the grad-norm clip,
    every optimizer's step), on the fixed batch (x, y) instead of the loader's. `forward_model` is
    the model as the trainer runs it (compiled under `train.compile`), `model` the plain one whose
    gradients are clipped. Returns the loss as a float, which synchronises, as the trainer's does."""
    device = device if device is not None else x.device
    guard = FiniteGuard(device)

    def step(i: int) -> float:
        return train_step(model, forward_model, objective, lambda: (x, y), i, list(optimizers), train_cfg, device,
                          guard).loss

    return step


# --------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def _proc_stat_busy() -> tuple[float, float] | None:
    """(busy CPU-seconds of the whole machine, now) from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values) - idle) / os.sysconf("SC_CLK_TCK"), time.perf_counter()


def _descendants_cpu_seconds() -> float:
    """CPU seconds of this process's live descendants (inductor's compile workers, torchrun's
    ranks), from /proc; 0 off Linux. Children already waited for are in RUSAGE_CHILDREN."""
    parent_of, ticks = {}, {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
            parent_of[int(entry)] = int(fields[1])
            # utime + stime, and the same of its children it has waited for: a live helper that
            # reaps its own workers (torchrun, inductor's pool) keeps their time in its count
            ticks[int(entry)] = sum(int(value) for value in fields[11:15])
        except (OSError, IndexError, ValueError):  # gone meanwhile, or a format this does not know
            continue
    ours, total = {os.getpid()}, 0
    for pid in sorted(parent_of):  # a child's pid may be lower than its parent's: walk up each chain
        chain, node = [], pid
        while node in parent_of and node not in ours and node > 1:
            chain.append(node)
            node = parent_of[node]
        if node in ours:
            ours.update(chain)
            total += sum(ticks[p] for p in chain if p != os.getpid())
    return total / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and everything it started (compile workers included), so that
    the meter does not count our own helpers as competition."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage) + _descendants_cpu_seconds()


class ContentionMeter:
    """Share of the machine's cores used by *other* processes between `start()` and `stop()`."""

    def __init__(self) -> None:
        self._machine: tuple[float, float] | None = None
        self._own = 0.0

    def start(self) -> ContentionMeter:
        self._machine, self._own = _proc_stat_busy(), _own_cpu_seconds()
        return self

    def stop(self) -> float | None:
        end = _proc_stat_busy()
        if self._machine is None or end is None:
            return None
        wall = end[1] - self._machine[1]
        others = (end[0] - self._machine[0]) - (_own_cpu_seconds() - self._own)
        return max(0.0, others / (max(wall, 1e-9) * (os.cpu_count() or 1)))


def cpu_busy_fraction(interval: float = 0.5) -> float | None:
    """Share of the cores busy over `interval` seconds just before we start any work."""
    meter = ContentionMeter().start()
    time.sleep(interval)
    return meter.stop()


def environment() -> dict[str, Any]:
    return {"cpu_busy_before": cpu_busy_fraction(), "load_avg_1min_at_start": load_average(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "platform": platform.platform()}


# --------------------------------------------------------------------------------------------
# Timing primitives
# --------------------------------------------------------------------------------------------


def make_sync(device: torch.device) -> Callable[[], None]:
    """Waits for `device`'s queued work (a timer reads the clock after it): that GPU's, not the current one."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def run_interleaved(calls: dict[str, Callable[[], dict[str, float]]], warmup: int | dict[str, int],
                    repeats: int) -> dict[str, Any]:
    """Call every measurement `warmup` times (or `warmup[name]` times, each its own), then `repeats`
    rounds of all of them in rotating order.

    Each call returns named figures (seconds); the result holds, per call and figure, the median
    (`figure`) and every sample (`figure_all`)."""
    names = list(calls)
    for name in names:
        for _ in range(warmup[name] if isinstance(warmup, dict) else warmup):
            calls[name]()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            for key, value in calls[name]().items():
                samples[name].setdefault(key, []).append(value)
    return {name: {**{key: statistics.median(v) for key, v in figures.items()},
                   **{f"{key}_all": v for key, v in figures.items()}} for name, figures in samples.items()}


def decode_generate(model: nn.Module, prompt: list[int], new_tokens: int, options: dict[str, Any],
                    sync: Callable[[], None]) -> dict[str, float]:
    """One greedy pass of the engine's generator (`latentloop.stream`, as `generate` runs it); seconds
    per decoded token (prefill excluded) and the prefill."""
    stamps: list[float] = []
    start = time.perf_counter()
    for _ in latentloop.stream(model, prompt, new_tokens, temperature=0.0, **options):
        sync()
        stamps.append(time.perf_counter())
    if len(stamps) != new_tokens:
        raise RuntimeError(f"the engine produced {len(stamps)} tokens, expected {new_tokens}")
    return {"token_s": (stamps[-1] - stamps[0]) / (new_tokens - 1), "prefill_s": stamps[0] - start}


@torch.no_grad()
def decode_steps(model: nn.Module, prompt: Tensor, tokens: list[Tensor], options: dict[str, Any],
                 sync: Callable[[], None]) -> dict[str, float]:
    """The model's own decode step: prefill a fresh cache, then one `decode` per token (the options
    completed and checked once, as the engine does)."""
    options = model_options(model, options)
    P = prompt.shape[1]
    cache = model.new_cache(1, P + len(tokens), **options)
    model.prefill(prompt, cache, **options)
    sync()
    start = time.perf_counter()
    for token in tokens:
        model.decode(token, cache, **options)
    sync()
    return {"token_s": (time.perf_counter() - start) / len(tokens)}


def decode_comparison(entries: dict[str, tuple[nn.Module, dict[str, Any]]], args: argparse.Namespace,
                      device: torch.device, warmup: int | None = None) -> dict[str, dict[str, Any]]:
    """Decode latency of several (model, generation options) at batch 1, measured interleaved."""
    sync = make_sync(device)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, 256, (1, args.prompt_len), generator=gen)
    tokens = torch.randint(0, 256, (1, args.new_tokens), generator=gen).to(device)
    token_views = [tokens[:, t:t + 1] for t in range(args.new_tokens)]
    calls: dict[str, Callable[[], dict[str, float]]] = {}
    for name, (model, options) in entries.items():
        model.eval()
        calls[f"{name}/generate"] = partial(decode_generate, model, prompt[0].tolist(), args.new_tokens, options, sync)
        calls[f"{name}/step"] = partial(decode_steps, model, prompt.to(device), token_views, options, sync)
    raw = run_interleaved(calls, args.warmup if warmup is None else warmup, args.repeats)
    results = {}
    for name in entries:
        g, s = raw[f"{name}/generate"], raw[f"{name}/step"]
        results[name] = {"generate_s_per_token": g["token_s"], "step_s_per_token": s["token_s"],
                         "engine_overhead_s_per_token": g["token_s"] - s["token_s"], "prefill_s": g["prefill_s"],
                         "generate_s_per_token_all": g["token_s_all"], "step_s_per_token_all": s["token_s_all"]}
    return results


# The most untimed steps `covering_warmup` adds before it gives up: far more than any objective here
# needs (rgpt draws its depth from 1..R per step: a few steps show every depth)
MAX_WARMUP_STEPS = 1000


def covering_warmup(kind_of_step: Callable[[int], str], warmup: int, timed: int) -> int:
    """The fewest untimed steps, at least `warmup`, after which none of the `timed` steps that follow
    takes a kind of forward (`kind_of_step(i)`: rgpt's depth, fbt's passes) that no untimed step
    took: each kind compiles on its first step (a graph of its own under `train.compile`), and a
    compile must not land in a timed step. Steps are numbered from 0, warm-up first, as the
    trainer's step counter runs."""
    seen = {kind_of_step(i) for i in range(warmup)}
    while True:
        fresh = next((i for i in range(warmup, warmup + timed) if kind_of_step(i) not in seen), None)
        if fresh is None:
            return warmup
        if fresh + 1 > MAX_WARMUP_STEPS:
            raise RuntimeError(f"no warm-up of at most {MAX_WARMUP_STEPS} steps takes every kind of forward of the "
                               f"{timed} timed steps after it")
        seen.update(kind_of_step(i) for i in range(warmup, fresh + 1))
        warmup = fresh + 1


def training_call(arch: str, shape: dict[str, Any], overrides: dict[str, Any], args: argparse.Namespace,
                  device: torch.device, data: Tensor, passes: int | None = None,
                  compile: bool = False, compile_scope: str = "auto", warmup: int | None = None,
                  timed: int = 0) -> tuple[Callable, dict[str, Any]]:
    """A fresh model, optimizer and objective; returns a call that times one optimizer step. With
    `compile`, the objective calls the model as the trainer wraps it for `train.compile` (and
    `train.compile_scope`). AdamW in float32 unless `args` names `optimizer` / `dtype`. With
    `warmup`, the info's `warmup_steps` is how many untimed calls to make first so that the `timed`
    calls after them take only kinds of forward already run (`covering_warmup`)."""
    torch.manual_seed(args.seed)
    model = latentloop.build(arch, preset=None, **shape, **overrides).to(device)
    model.train()
    train_cfg = TrainConfig(batch_size=data.shape[0], optimizer=getattr(args, "optimizer", "adamw"),
                            grad_clip=args.grad_clip, dtype=getattr(args, "dtype", "float32"), device=device.type,
                            compile=compile, compile_scope=compile_scope)
    objective = build_objective(model.config, train_cfg)
    if passes is not None and any(objective.passes_for_step(i) != passes for i in range(64)):
        raise RuntimeError(f"the fbt objective did not fix K={passes}")
    x, y = data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
    # counted once per kind of forward (rgpt's depth changes from step to step), before compiling, as
    # train.setup counts: the probe forward must not be the first call of blocks compiled in place
    flops = FlopsMemo(model)
    objective.flops_per_token(flops)
    forward_model = wrap_model(model, train_cfg, device)
    optimizers = build_optimizers(model, train_cfg, resolve_dtype(device, train_cfg.dtype))
    step = make_train_step(model, forward_model, objective, x, y, optimizers, train_cfg, device)
    counter = itertools.count()
    sync = make_sync(device)

    def call() -> dict[str, float]:
        i = next(counter)
        start = time.perf_counter()
        loss = step(i)
        sync()
        return {"step_s": time.perf_counter() - start, "loss": loss,
                "flops_per_token": objective.flops_per_token(flops, step=i)}  # what this step was charged

    info = {"arch": arch, "params": model.num_params(), "tokens_per_step": x.numel(),
            "charged_flops_per_token": objective.flops_per_token(flops, step=0)}
    if warmup is not None:
        info["warmup_steps"] = covering_warmup(lambda i: repr(objective.forward_mix(i)), warmup, timed)
    return call, info


def training_comparison(variants: dict[str, tuple[str, dict, dict, int | None]], args: argparse.Namespace,
                        device: torch.device, compile: bool = False,
                        scopes: dict[str, str] | None = None,
                        compiled: dict[str, bool] | None = None) -> dict[str, dict[str, Any]]:
    """Each variant's optimizer step, interleaved round by round; `scopes`: a variant's
    `train.compile_scope` (default "auto"); `compiled`: whether a variant runs under `train.compile`
    (default `compile`), so eager and compiled steps can share the rounds. Each variant is warmed up
    for at least `args.train_warmup` steps, and for as many more as it takes for every kind of
    forward its timed steps run to have run untimed first (`covering_warmup`: rgpt's second depth)."""
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, 256, (args.train_batch, args.train_seq_len + 1), generator=gen)
    calls, infos = {}, {}
    for name, (arch, shape, overrides, passes) in variants.items():
        calls[name], infos[name] = training_call(arch, shape, overrides, args, device, data, passes,
                                                 (compiled or {}).get(name, compile),
                                                 (scopes or {}).get(name, "auto"), args.train_warmup,
                                                 args.train_steps)
    raw = run_interleaved(calls, {name: info["warmup_steps"] for name, info in infos.items()}, args.train_steps)
    return {name: {**infos[name], "step_s": raw[name]["step_s"], "step_s_all": raw[name]["step_s_all"],
                   "flops_per_token_all": raw[name]["flops_per_token_all"],
                   "tok_s": infos[name]["tokens_per_step"] / raw[name]["step_s"],
                   "final_loss": raw[name]["loss_all"][-1]} for name in variants}


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def timed_rounds(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each call's seconds in each of `rounds` rounds, every call once a round in random order. Calls
    whose work depends on how often they ran (a training step's schedule: rgpt's depth, fbt's passes)
    are at the same count in every round, so each round compares the same work."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        order = list(calls.items())
        random.shuffle(order)
        for name, call in order:
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def paired_ratios(before: Callable[[], object], after: Callable[[], object], rounds: int) -> list[float]:
    """`after`'s seconds over `before`'s, one ratio a round, the two called in random order each round:
    a change against the code without it in one process, so the machine's drift cancels in each ratio."""
    seconds = timed_rounds({"before": before, "after": after}, rounds)
    return [a / b for a, b in zip(seconds["after"], seconds["before"])]


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """The geometric mean of `paired_ratios` and its 95% Student-t interval, both taken on the ratios'
    logarithms (at least two ratios): the interval of a ratio stays positive, and rounds at 0.5x and
    2x cancel, where the arithmetic mean of [0.5, 2.0] read 1.25 [-8.28, 10.78]. Student's t: the
    normal's 1.96 is too narrow at the few rounds these benchmarks run (t is 2.31 at 9 rounds, 4.30 at 3)."""
    from latentloop.eval.stats import paired_comparison

    # each round's ratio against 1: the same estimate `paired_comparison` gives engines and serve_load
    comparison = paired_comparison(dict(enumerate(ratios)), dict.fromkeys(range(len(ratios)), 1.0), kind="log_ratio")
    if comparison.get("nonpositive"):
        raise ValueError(f"paired ratios are positive, got {min(ratios)}")
    if comparison["low"] is None:
        raise ValueError(f"an interval needs at least two ratios, got {len(ratios)}")
    return comparison["mean"], comparison["low"], comparison["high"]


def describe_ratios(ratios: Sequence[float]) -> str:
    """median, quartiles, geometric mean [95% t-interval on the logs] and the rounds below 1 of `paired_ratios`."""
    first, _, third = statistics.quantiles(ratios, n=4)
    mean, low, high = ratio_interval(ratios)
    return (f"median {statistics.median(ratios):.3f}, quartiles {first:.3f} {third:.3f}, geometric mean {mean:.3f} "
            f"[{low:.3f}, {high:.3f}], below 1 in {sum(r < 1 for r in ratios)}/{len(ratios)} rounds")


def spread(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    """median [min–max] of a measurement's rounds."""
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def add_allocator_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as it is; by default the benchmark keeps freed memory in "
                             "the process as `latentloop train` does on CPU (runtime.keep_freed_memory), which "
                             "then applies to every model measured in this process, references included")


def apply_allocator_flag(args: argparse.Namespace) -> dict[str, Any]:
    """What the run used, for its JSON: `keep_freed_memory` unless `--default-malloc`."""
    kept = False if args.default_malloc else keep_freed_memory()
    print(f"malloc: {'freed memory kept in the process' if kept else 'glibc default'}", flush=True)
    return {"keep_freed_memory": kept}


def _jsonable(value: Any) -> Any:
    """`value` as JSON holds it: paths and other objects as their text, tuples as lists."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def invocation(args: argparse.Namespace, module: str) -> dict[str, Any]:
    """What a result file records of the run that wrote it, so it can be reproduced: the process's
    command line, the benchmark's module and every argument as parsed (defaults included)."""
    if module == "__main__":  # `python -m benchmarks.NAME`: the module's own name is in its spec
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None else sys.argv[0]
    return {"command": list(sys.argv), "module": module, "args": _jsonable(vars(args)), "commit": source_commit()}


def source_commit() -> str | None:
    """The repository's commit (with "+changes" when its tracked files differ from it), or None
    outside a git checkout: which code a result file's numbers came from."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
        return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def start_run(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's start: `--threads` applied, the machine described and announced, and (for the
    benchmarks with `add_allocator_flag`) the allocator set; returns the description for the JSON."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    env = environment()
    announce_environment(env)
    if hasattr(args, "default_malloc"):
        env["malloc"] = apply_allocator_flag(args)
    return env


def benchmark_main(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]],
                   table: Callable[[dict[str, Any]], str]) -> int:
    """Run a benchmark under the contention meter, print its table, its wall time and how busy the
    machine was, write the JSON (`args.json`)."""
    start = time.perf_counter()
    meter = ContentionMeter().start()
    results = run(args)
    others = meter.stop()
    results["wall_s"] = time.perf_counter() - start
    # the command, module and arguments: a benchmark's own "args" (paths as text) are those same arguments
    results.update(invocation(args, getattr(run, "__module__", "?")))
    results.setdefault("env", {}).update(others_cpu_share_during_run=others, load_avg_1min_at_end=load_average())
    print()
    print(table(results))
    print()
    print(f"total {results['wall_s']:.0f} s; other processes used {'?' if others is None else f'{others:.0%}'} "
          "of the CPUs during the run")
    write_results(results, others, args.json)
    return 0


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def ratio_vs(value: float, target: float | None = None) -> str:
    """`value`x, with a mark against an upper-bound target."""
    text = f"{value:.3f}x"
    if target is not None:
        text += " ✅" if value <= target else " ❌"
    return text


def change(value: float) -> str:
    return f"{value:.2f}x ({value - 1:+.0%})"


def shape_label(cfg: Any) -> str:
    return f"d={cfg.n_embd}, {cfg.n_layer} layers, {cfg.n_head} heads"


def tiny_shape(seq_len: int = 0) -> dict[str, Any]:
    """The `tiny` preset with the byte vocabulary, its context stretched to `seq_len` if longer."""
    preset = PRESETS["tiny"]
    return {**preset, "vocab_size": BYTE_VOCAB, "sequence_len": max(preset["sequence_len"], seq_len)}


def build(arch: str, device: torch.device, seed: int, **kwargs: Any) -> nn.Module:
    torch.manual_seed(seed)
    return latentloop.build(arch, preset=None, **kwargs).to(device)


def weight_macs_per_token(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """Multiply-adds of the weight matrices one decoded token goes through (attention over the cache
    not counted): every parameter except the embedding lookup, plus the head (tied or not). `skip`:
    modules the measured path does not run (e.g. fbt's fusion under `standard`)."""
    n = model.num_params() - sum(p.numel() for m in skip for p in m.parameters())
    return n if model.lm_head is None else n - model.wte.weight.numel()


def param_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
