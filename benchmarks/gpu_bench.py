"""The prepared GPU benchmark (`benchmarks/gpu.sh` runs it on one H200): where a training step's time
goes and how fast decoding runs, for every registered architecture, in one run; one JSON object on
stdout and in the output folder, beside a profiler trace per architecture.

    python -m benchmarks.gpu_bench --out-dir runs/gpu-bench            # CUDA: the gpt2 shape, bf16, compiled
    python -m benchmarks.gpu_bench --cpu --tiny --out-dir /tmp/b       # the same code paths at a tiny shape

What it measures (every case on its own, recorded even when it fails, skipped past `--budget-s`):
- Training, one case per registered architecture (its default config; `--all-cases` adds its spec's
  `train_cases`): the trainer's own step (`latentloop.train.train_step` through the model-and-loss
  module `wrap_model` compiles whole: forward, loss and backward one graph, AdamW fused and Muon
  batched) at the `gpt2` preset (124M, T=1024), batch 16, bf16 autocast, fixed random batches. One
  kind of forward per case: every step takes the objective's plan of one step (the most common kind
  among the first 64: fbt's K, rgpt's depth), so the graph compiles once, before the clock. Reported:
  compile seconds; tokens/s over the timed steps (synchronised at both ends), and each step's time
  (CUDA events between the steps, which do not wait for the device; the clock on the CPU): their
  median and range; MFU =
  the trainer's structural FLOPs per token (`objective.flops_per_token`) x tokens/s / the dense bf16
  peak (989 TFLOP/s on an H200); peak memory; the device memory the step leaves held (weights and
  optimizer states), hence an estimate of the largest micro-batch that fits (activations scale with
  the rows) and the `train.batch_tokens` it suggests; and a torch.profiler summary of a few more
  steps (`latentloop.train.profile.summarize`: shares of kernel time in matmuls, attention,
  elementwise/norm, the optimizer; the idle share of the window between kernels), its Chrome trace
  in `traces/train-<case>.json` (Perfetto, TensorBoard).
- Filling the device: gpt again at the largest micro-batch the estimate allows (a multiple of 8),
  timed as above: whether it fits, and its tokens/s and MFU.
- Decode, every registered architecture with its default options at batch 1 and 64: cached greedy
  `latentloop.stream` through the compiled step (`compile=True`: a static cache, CUDA graphs on
  CUDA) where the step allows, else eager; a warm-up generation of the same lengths first, so the
  compile (and every CUDA graph capture) happens before the clock; decode tokens/s from the first to
  the last new token, the prefill timed apart, in each of `DECODE_RUNS` timed runs: their median and
  range. `--all-cases` adds each spec's `decode_cases`.
- Hugging Face beside it: a Llama-shaped gpt (SwiGLU, no QK-norm, no embedding norm; the gpt2
  shape with the byte tokenizer's vocabulary) exported with `latentloop export --plain`, loaded by
  transformers, `generate` with a static cache (`cache_implementation="static"`, which transformers
  compiles on CUDA) after a warm-up, at batch 1 and 64; latentloop's compiled decode of the same
  weights beside it, and how many greedy tokens the two agree on.
- flex_attention: lrt's strided subset passes through block masks vs SDPA's dense mask, logits
  (and gradients on CUDA) max differences.
- A loop of generations (gpt, `LOOP_GENERATIONS` short ones in a row, as an eval's prompts): seconds
  per generation, the first against the last, the distinct cache addresses decoded through and the
  CUDA graphs recorded during the loop (one set of addresses and no new graph where a finished cache's
  tensors are lent to the next: `inference.fast.StaticBufferPool`).

On the CPU (`--cpu`) nothing compiles unless `--compile` (inductor's CPU compiles take minutes), no
MFU without `--peak-tflops`, and memory figures are None.

The JSON records the command, the module and every argument (`command`, `module`, `args`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import latentloop as ll
from benchmarks.common import invocation, require_threads
from latentloop.archs import ARCHS, build_objective, get_arch
from latentloop.config import RunConfig, TrainConfig
from latentloop.parallel import wrap_model
from latentloop.plan import ACCELERATORS
from latentloop.runtime import resolve_dtype
from latentloop.train import FiniteGuard, FlopsMemo, train_step
from latentloop.train.profile import summarize
from latentloop.train.step import ModelAndLoss, compiled_step_graphs
from latentloop.util import write_text_atomic

MFU_TARGET = 0.45  # issue 51: gpt at the gpt2 shape
OTHERS_SHARE_OF_GPT = 0.9  # issue 51: every other architecture at >= 0.9 x gpt's MFU
PLAN_PROBE_STEPS = 64  # the steps whose plans choose a case's one kind of forward
MEMORY_HEADROOM = 0.9  # the share of the device's memory the largest micro-batch may fill
FILL_MULTIPLE = 8  # the filled micro-batch is a multiple of this
DECODE_RUNS = 3  # timed decode runs per row after the warm-up: their median and range (one run is one sample)
# A Llama-shaped gpt: the options `latentloop export --plain` needs (interop.hf_export.plain_blockers)
LLAMA_SHAPED = {"mlp": "swiglu", "qk_norm": False, "embed_norm": False, "logit_softcap": 0.0}


def dense_bf16_peak(device_name: str) -> float | None:
    """The dense bf16 tensor-core peak (FLOP/s, no sparsity) of the GPU `torch.cuda.get_device_name`
    names, from `latentloop plan`'s table (H200, H100 SXM, A100 SXM); None for any other GPU, and for
    the parts whose peak is lower than the SXM's (PCIe, H100 NVL): give it with --peak-tflops."""
    name = device_name.lower()
    if "pcie" in name or "nvl" in name:
        return None
    return next((accelerator.peak_flops for key, accelerator in ACCELERATORS.items()
                 if key != "cpu" and key in name), None)


@dataclass(frozen=True)
class Shape:
    preset: str
    batch: int  # training sequences per step
    steps: int  # timed training steps per case
    profile_steps: int  # profiled steps after them
    prompt: int  # decode prompt tokens
    new_tokens: int  # decoded tokens per row
    decode_batches: tuple[int, ...]
    extra: dict  # model config overrides


FULL = Shape("gpt2", batch=16, steps=10, profile_steps=3, prompt=128, new_tokens=128, decode_batches=(1, 64),
             extra={})
TINY = Shape("test", batch=4, steps=2, profile_steps=2, prompt=8, new_tokens=8, decode_batches=(1, 4),
             extra={"sequence_len": 64})


def _cases(field: str, all_cases: bool) -> list[tuple[str, str, dict]]:
    """(label, arch, overrides) of every registered architecture: its default, then, with
    `all_cases`, its spec's `train_cases` or `decode_cases` (config overrides, or decoding options)."""
    cases = [(name, name, {}) for name in ARCHS]
    if all_cases:
        cases += [(f"{name} {label}".strip(), name, dict(given)) for name, spec in ARCHS.items()
                  for label, given in getattr(spec, field).items() if given]
    return cases


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _gib(n: int | None) -> float | None:
    return None if n is None else n / 2**30


def _build(arch: str, shape: Shape, overrides: dict, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return ll.build(arch, shape.preset, **{**shape.extra, **overrides}).to(device)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")


def one_kind_step(objective) -> int:
    """The step whose plan every timed step takes: the first of the most common kind of forward
    among the first PLAN_PROBE_STEPS (fbt's short recipe: K=2; rgpt: a depth)."""
    kinds = [repr(objective.forward_mix(step)) for step in range(PLAN_PROBE_STEPS)]
    common = Counter(kinds).most_common(1)[0][0]
    return kinds.index(common)


def bench_training(name: str, arch: str, overrides: dict, shape: Shape, device: torch.device, compile_: bool,
                   peak_flops: float | None, out_dir: Path, batch: int | None = None) -> dict[str, Any]:
    """The trainer's step for one case: compile, timing, memory, the largest micro-batch, a profile."""
    _reset_memory(device)
    batch = batch or shape.batch
    model = _build(arch, shape, overrides, device)
    train = TrainConfig(steps=1000, batch_size=batch, warmup_steps=0, compile=compile_, device=device.type)
    objective = build_objective(model.config, train)
    step_index = one_kind_step(objective)
    flops = FlopsMemo(model)
    flops_per_token = objective.flops_per_token(flops, step_index)  # on the plain model, before compiling
    forward = wrap_model(model, train, device, root=ModelAndLoss(model, objective),
                         graphs=compiled_step_graphs(objective))
    optimizers = get_arch(arch).build_optimizers(model, train, resolve_dtype(device, train.dtype))
    T = model.config.sequence_len
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (batch, T), generator=generator).to(device)
    y = torch.randint(0, model.config.vocab_size, (batch, T), generator=generator).to(device)
    guard = FiniteGuard(device)

    def step():
        return train_step(model, forward, objective, lambda: (x, y), step_index, optimizers, train, device, guard)

    started = time.perf_counter()
    step()  # the compile
    _sync(device)
    compile_s = time.perf_counter() - started
    step()  # one more: the allocator's and the kernels' first runs
    _sync(device)
    _reset_memory(device)
    step_s, seconds, outcome = _timed_steps(step, shape.steps, device)
    guard.check()
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else None  # weights, optimizer states
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    tokens = shape.steps * batch * T
    achieved = flops_per_token * tokens / seconds
    result = {"case": name, "arch": arch, "params": model.num_params(), "micro_batch": batch,
              "tokens_per_step": batch * T, "plan": _plan_facts(objective.plan(step_index, x)), "compiled": compile_,
              "compile_s": compile_s, "tokens_per_s": tokens / seconds, "step_ms_mean": 1000 * seconds / shape.steps,
              **_spread_of("step_ms", [1000 * s for s in step_s]),
              "flops_per_token": flops_per_token, "achieved_tflops": achieved / 1e12,
              "mfu": achieved / peak_flops if peak_flops else None, "peak_memory_gib": _gib(peak),
              "held_memory_gib": _gib(held), "final_loss": outcome.loss}
    result.update(_largest_micro_batch(device, batch, T, held, peak))
    result["profile"] = _profile(step, shape.profile_steps, device, out_dir / "traces" / f"train-{_slug(name)}.json")
    return result


def _timed_steps(step, steps: int, device: torch.device) -> tuple[list[float], float, Any]:
    """(seconds of each step, seconds of all of them, the last step's outcome) for `steps` calls of
    `step`. The whole is synchronised at both ends only; each step is timed by CUDA events recorded
    between the steps (which, unlike a synchronise, leave the device's queue full), or by the clock
    on the CPU, where a step is done when it returns."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if device.type == "cuda" else None
    stamps = [time.perf_counter()]
    if events:
        events[0].record()
    for i in range(steps):
        outcome = step()
        if events:
            events[i + 1].record()
        else:
            stamps.append(time.perf_counter())
    _sync(device)
    seconds = time.perf_counter() - stamps[0]
    if events:
        return [events[i].elapsed_time(events[i + 1]) / 1000 for i in range(steps)], seconds, outcome
    return [b - a for a, b in zip(stamps, stamps[1:])], seconds, outcome


def _spread_of(name: str, values: list[float]) -> dict[str, Any]:
    """`name`'s median, min, max and every sample (None where a sample is missing)."""
    present = [v for v in values if v is not None]
    if not present:
        return {f"{name}_median": None, f"{name}_min": None, f"{name}_max": None, f"{name}_all": values}
    return {f"{name}_median": statistics.median(present), f"{name}_min": min(present), f"{name}_max": max(present),
            f"{name}_all": values}


def _plan_facts(plan: dict) -> dict:
    """The plan's host numbers (K, depth), not its tensors."""
    return {k: v for k, v in plan.items() if isinstance(v, (int, float, str)) or
            (isinstance(v, dict) and all(isinstance(u, (int, float, str)) for u in v.values()))}


def _largest_micro_batch(device: torch.device, batch: int, T: int, held: int | None, peak: int | None) -> dict:
    """The activations scale with the rows: (peak - held) / batch bytes a row; the largest micro-batch
    is what fills MEMORY_HEADROOM of the device beside what the step holds anyway (an estimate:
    `bench_fill` times it)."""
    if device.type != "cuda" or held is None or peak is None or peak <= held:
        return {"largest_micro_batch_estimate": None}
    total = torch.cuda.get_device_properties(device).total_memory
    per_row = (peak - held) / batch
    rows = int((MEMORY_HEADROOM * total - held) // per_row)
    rows = max(FILL_MULTIPLE, rows - rows % FILL_MULTIPLE)
    return {"activation_gib_per_row": _gib(per_row), "largest_micro_batch_estimate": rows,
            "batch_tokens_at_largest": rows * T}


def _profile(step, steps: int, device: torch.device, trace: Path) -> dict[str, Any]:
    """A torch.profiler summary of `steps` more steps (compiled already), and their Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return {**summarize(prof, steps), "trace": str(trace)}


def bench_fill(report: dict, shape: Shape, device: torch.device, compile_: bool, peak_flops: float | None,
               out_dir: Path) -> dict[str, Any]:
    """gpt at the largest micro-batch its training row estimated: does it fit, how fast is it."""
    gpt = next((r for r in report["training"] if r.get("case") == "gpt" and "tokens_per_s" in r), None)
    rows = None if gpt is None else gpt.get("largest_micro_batch_estimate")
    if rows is None:
        return {"case": "gpt filled", "skipped": "no estimate (the CPU, or gpt's row failed)"}
    try:
        result = bench_training("gpt filled", "gpt", {}, shape, device, compile_, peak_flops, out_dir, batch=rows)
    except torch.cuda.OutOfMemoryError as exc:  # the estimate was too large: say so, by how much
        return {"case": "gpt filled", "micro_batch": rows, "fits": False, "error": f"out of memory: {exc}"[:300]}
    return {**result, "fits": True}


def bench_decode(name: str, arch: str, options: dict, shape: Shape, device: torch.device, compile_: bool
                 ) -> list[dict[str, Any]]:
    """Cached greedy decode tokens/s at every batch size of the shape, after a warm-up of the same
    lengths (bf16 weights on CUDA), through the compiled step where it allows."""
    from latentloop.inference.fast import fallback_reason

    _reset_memory(device)
    model = _build(arch, shape, {}, device).eval()
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    reason = fallback_reason(model, options) if compile_ else "not asked (--no-compile)"
    compiled = compile_ and reason is None
    rows = []
    generator = torch.Generator().manual_seed(2)
    for batch in shape.decode_batches:
        prompts = torch.randint(0, min(model.config.vocab_size, 256), (batch, shape.prompt), generator=generator)
        prompts = prompts.tolist()
        started = time.perf_counter()
        # the same lengths as the timed run: every compile and CUDA graph capture happens here
        ll.generate(model, prompts, shape.new_tokens, temperature=0.0, compile=compiled, **options)
        _sync(device)
        warmup_s = time.perf_counter() - started
        timed = [_timed_stream(model, prompts, shape.new_tokens, compiled, options) for _ in range(DECODE_RUNS)]
        rows.append({"case": name, "arch": arch, "options": options, "batch": batch, "prompt": shape.prompt,
                     "compiled_step": compiled, "eager_because": None if compiled else reason,
                     "warmup_s": warmup_s, "new_tokens": timed[0]["new_tokens"], "timed_runs": DECODE_RUNS,
                     **_spread_of("decode_tokens_per_s", [t["decode_tokens_per_s"] for t in timed]),
                     **_spread_of("prefill_s", [t["prefill_s"] for t in timed]),
                     "peak_memory_gib": _gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda"
                     else None})
    return rows


def _timed_stream(model, prompts, new_tokens: int, compiled: bool, options: dict) -> dict[str, Any]:
    stamps = []
    start = time.perf_counter()
    for _ in ll.stream(model, prompts, new_tokens, temperature=0.0, compile=compiled, **options):
        stamps.append(time.perf_counter())  # the engine has read the token back: the step is done
    decode_s = stamps[-1] - stamps[0]
    return {"new_tokens": len(stamps), "prefill_s": stamps[0] - start,
            "decode_tokens_per_s": len(prompts) * (len(stamps) - 1) / decode_s if decode_s > 0 else None}


def bench_hf(shape: Shape, device: torch.device, compile_: bool, out_dir: Path) -> list[dict[str, Any]]:
    """Hugging Face `generate` with a static cache on the exported Llama-shaped gpt, beside
    latentloop's decode of the same weights, at every decode batch size."""
    import shutil

    import transformers

    from latentloop.data import load_tokenizer
    from latentloop.interop import export_hf
    from latentloop.runs import save_run

    tokenizer = load_tokenizer("byte")
    model = _build("gpt", shape, {**LLAMA_SHAPED, "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id},
                   torch.device("cpu")).eval()
    run, exported = out_dir / "hf-run", out_dir / "hf"
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(exported, ignore_errors=True)
    save_run(model, tokenizer, run, RunConfig(model=model.config))
    export_hf(run, exported, plain=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=dtype).to(device).eval()
    ours = model.to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(4)
    rows = []
    for batch in shape.decode_batches:
        ids = torch.randint(0, 256, (batch, shape.prompt), generator=generator)
        started = time.perf_counter()
        _hf_generate(hf, ids, shape.new_tokens, tokenizer.bos_id, device)  # warm-up: transformers compiles here
        warmup_s = time.perf_counter() - started
        _, prefill_s = _hf_generate(hf, ids, 1, tokenizer.bos_id, device)
        hf_ids, total_s = _hf_generate(hf, ids, shape.new_tokens, tokenizer.bos_id, device)
        decode_s = max(total_s - prefill_s, 1e-9)  # the prefill and first token, timed apart
        ours_row = bench_decode_model(ours, ids.tolist(), shape.new_tokens, device, compile_)
        agree = (torch.tensor(ours_row.pop("ids"))[:, :hf_ids.shape[1]] == hf_ids).float().mean().item()
        rows.append({"case": "hf generate, static cache", "batch": batch, "prompt": shape.prompt,
                     "transformers": transformers.__version__, "warmup_s": warmup_s, "prefill_s": prefill_s,
                     "decode_tokens_per_s": batch * (shape.new_tokens - 1) / decode_s,
                     "latentloop_same_weights": ours_row, "greedy_tokens_agree": agree})
    return rows


def _hf_generate(hf, ids: torch.Tensor, new: int, pad_id: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """transformers' greedy generate with a static cache (which it compiles on CUDA): the new ids
    and the seconds, synchronised."""
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, cache_implementation="static", pad_token_id=pad_id)
    _sync(device)
    return out[:, ids.shape[1]:].cpu(), time.perf_counter() - start


def bench_decode_model(model, prompts: list[list[int]], new_tokens: int, device: torch.device, compile_: bool
                       ) -> dict[str, Any]:
    """latentloop's decode of a built model: warm-up, then a timed stream (and its token ids)."""
    from latentloop.inference.fast import fallback_reason

    compiled = compile_ and fallback_reason(model, {}) is None
    ll.generate(model, prompts, new_tokens, temperature=0.0, compile=compiled)
    _sync(device)
    ids = ll.generate(model, prompts, new_tokens, temperature=0.0, compile=compiled)
    timed = _timed_stream(model, prompts, new_tokens, compiled, {})
    return {"compiled_step": compiled, **timed, "ids": ids}  # the new ids of each row


def check_flex(shape: Shape, device: torch.device) -> dict[str, Any]:
    """lrt interleaved S=2 through flex_attention block masks vs the dense mask: max differences of
    the subset passes' logits (and of the gradients on CUDA), and the time of each path."""
    from latentloop.models import flex

    model = _build("lrt", shape, {"recurrence": "interleaved", "subsets": 2}, device)
    T = model.config.sequence_len
    x = torch.randint(0, min(model.config.vocab_size, 256), (2, T), generator=torch.Generator().manual_seed(3))
    x = x.to(device)
    backward = device.type == "cuda"  # torch 2.13's flex_attention wrapper refuses gradients on the CPU

    def run() -> tuple[list[torch.Tensor], dict[str, torch.Tensor], float]:
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = model(x)
            if backward:
                torch.stack([lg.float().logsumexp(-1).mean() for lg in out.pass_logits]).sum().backward()
        _sync(device)
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return [lg.detach().float() for lg in out.pass_logits], grads, time.perf_counter() - start

    forced, original = flex.FORCE, flex.available
    flex._masks.clear()
    try:
        flex.FORCE = False
        flex.available = lambda device: False  # dense: the flex path off even on CUDA
        run()
        dense, dense_grads, dense_s = run()
        flex.available = original
        flex.FORCE = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex on the CPU warns that it is unfused
            run()  # compiles flex_attention on CUDA
            sparse, sparse_grads, sparse_s = run()
    finally:
        flex.FORCE, flex.available = forced, original
    return {"case": "flex_attention vs dense mask (lrt subsets)", "flex_masks_built": len(flex._masks),
            "subset_logits_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(dense, sparse)),
            "grad_max_abs_diff": max((float((dense_grads[n] - sparse_grads[n]).abs().max()) for n in dense_grads),
                                     default=None),
            "backward_checked": backward, "dense_s": dense_s, "flex_s": sparse_s, "sequence_len": T}


LOOP_GENERATIONS = 40  # short generations in a row (an eval's prompts): per-generation time, first vs last


def _cuda_graph_recordings(device: torch.device) -> int | None:
    """CUDA graphs recorded so far on this thread's tree for `device` (torch's internals: None where
    they are not as read for torch 2.13, or off CUDA)."""
    if device.type != "cuda":
        return None
    try:
        from torch._inductor import cudagraph_trees

        index = torch.cuda.current_device() if device.index is None else device.index
        manager = cudagraph_trees.get_container(index).tree_manager

        def nodes(by_function) -> int:  # every recorded graph is kept: a root, or a child of one
            return sum(1 + nodes(node.children) for graphs in by_function.values() for node in graphs)

        return 0 if manager is None else nodes(manager.roots)
    except Exception:  # noqa: BLE001 - an internal moved: the count is a diagnostic, not a result
        return None


def check_generation_loop(shape: Shape, device: torch.device, compile_: bool) -> dict[str, Any]:
    """gpt's compiled decode over LOOP_GENERATIONS short generations in a row, as an eval calls it:
    seconds per generation, the first ones against the last (where each generation recorded its CUDA
    graphs again, the last would be the slower), the distinct addresses its caches decoded through
    (one where a finished cache's tensors are lent to the next: `StaticBufferPool`), and the CUDA
    graphs recorded over the loop."""
    from latentloop.inference.fast import fallback_reason, static_buffers

    model = _build("gpt", shape, {}, device).eval()
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    compiled = compile_ and fallback_reason(model, {}) is None
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    new_tokens = min(16, shape.new_tokens)
    ll.generate(model, prompt, new_tokens, temperature=0.0, compile=compiled)  # compiles, records
    recorded_before = _cuda_graph_recordings(device)
    addresses, seconds = set(), []
    for _ in range(LOOP_GENERATIONS):
        _sync(device)
        start = time.perf_counter()
        ll.generate(model, prompt, new_tokens, temperature=0.0, compile=compiled)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        addresses |= {buffers.k_slots[0].data_ptr() for buffers in static_buffers(model)._sets.values()}
    recorded_after = _cuda_graph_recordings(device)
    edge = max(1, LOOP_GENERATIONS // 8)
    return {"case": "a loop of generations (gpt)", "compiled_step": compiled, "generations": LOOP_GENERATIONS,
            "new_tokens": new_tokens, "first_s_median": statistics.median(seconds[:edge]),
            "last_s_median": statistics.median(seconds[-edge:]), "cache_addresses_lent": len(addresses),
            "cuda_graphs_recorded_during_loop": None if recorded_before is None or recorded_after is None
            else recorded_after - recorded_before}


def _guarded(results: list, budget_end: float, what: str, fn, *args) -> None:
    """Run one case, recording its result, its error or that the time budget skipped it."""
    if time.perf_counter() > budget_end:
        results.append({"case": what, "skipped": "time budget"})
        print(f"gpu_bench: {what} skipped (time budget)", file=sys.stderr, flush=True)
        return
    started = time.perf_counter()
    try:
        out = fn(*args)
        results.extend(out if isinstance(out, list) else [out])
    except Exception as exc:  # recorded, so that the other cases still run and print
        results.append({"case": what, "error": f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                        "traceback": traceback.format_exc(limit=6)})
    print(f"gpu_bench: {what} done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def _verdicts(report: dict) -> None:
    """Issue 51's criteria on this run's rows: gpt's MFU against its target, every other
    architecture's against 0.9 x gpt's."""
    rows = {r["case"]: r for r in report["training"] if r.get("mfu") is not None}
    gpt = rows.get("gpt")
    report["gpt_mfu_meets_target"] = None if gpt is None else gpt["mfu"] >= MFU_TARGET
    report["mfu_share_of_gpt"] = None if gpt is None else {
        name: row["mfu"] / gpt["mfu"] for name, row in rows.items() if name != "gpt"}
    report["others_meet_share_of_gpt"] = None if gpt is None else all(
        share >= OTHERS_SHARE_OF_GPT for share in report["mfu_share_of_gpt"].values())


def run(args: argparse.Namespace, save: Callable[[dict], None] = lambda report: None) -> dict[str, Any]:
    """Every case within the budget; `save(report)` after each, so that a run killed at gpu.sh's
    time limit keeps the cases it finished."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device (use --cpu --tiny for the CPU fallback)")
    shape = TINY if args.tiny else FULL
    compile_ = args.compile if args.compile is not None else device.type == "cuda"  # inductor on a CPU: minutes
    if args.peak_tflops is not None:  # parse_args takes only a positive one
        peak = args.peak_tflops * 1e12
    else:
        peak = dense_bf16_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        if device.type == "cuda" and peak is None:
            print(f"gpu_bench: no bf16 peak known for {torch.cuda.get_device_name(device)}: no MFU without "
                  f"--peak-tflops", file=sys.stderr)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget_end = time.perf_counter() + args.budget_s
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "shape": asdict(shape), "compiled": compile_, "peak_flops": peak,
        "mfu_target": MFU_TARGET, "training": [], "fill": [], "decode": [], "hf": [], "checks": []}

    def wanted(arch: str) -> bool:
        return not args.only or arch in args.only

    def guarded(results: list, what: str, fn, *fn_args) -> None:
        _guarded(results, budget_end, what, fn, *fn_args)
        save(report)

    for name, arch, overrides in _cases("train_cases", False):
        if wanted(arch):
            guarded(report["training"], f"train {name}", bench_training, name, arch, overrides, shape,
                     device, compile_, peak, out_dir)
    if wanted("gpt"):
        guarded(report["hf"], "hf generate beside latentloop", bench_hf, shape, device, compile_,
                 out_dir)
    for name, arch, options in _cases("decode_cases", args.all_cases):
        if wanted(arch):
            guarded(report["decode"], f"decode {name}", bench_decode, name, arch, options, shape,
                     device, compile_)
    if wanted("lrt"):
        guarded(report["checks"], "flex_attention vs dense mask", check_flex, shape, device)
    if wanted("gpt"):
        guarded(report["checks"], "a loop of generations", check_generation_loop, shape, device,
                 compile_)
    if wanted("gpt"):
        guarded(report["fill"], "train gpt filled", bench_fill, report, shape, device, compile_, peak,
                 out_dir)
    if args.all_cases:
        for name, arch, overrides in _cases("train_cases", True)[len(ARCHS):]:
            if wanted(arch):
                guarded(report["training"], f"train {name}", bench_training, name, arch, overrides,
                         shape, device, compile_, peak, out_dir)
    _verdicts(report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (the fallback; no MFU unless --peak-tflops)")
    p.add_argument("--tiny", action="store_true", help="the tiny shape (test preset, T=64): seconds, not minutes")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="compile the training step and the decode step (default: on CUDA only)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager training and decode")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak for MFU (default on CUDA: the GPU's from `latentloop plan`'s table)")
    p.add_argument("--only", nargs="+", default=None, metavar="ARCH", help="only these archs (" + " ".join(ARCHS) + ")")
    p.add_argument("--all-cases", action="store_true",
                   help="also each spec's train_cases and decode_cases (fbt K=1/2/3, lrt's prefills, ...)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip cases that would start after this many seconds (default 420: gpu.sh's 8 minutes "
                        "less the distributed smoke runs)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out-dir", default="runs/gpu-bench",
                   help="where gpu_bench.json, the traces (traces/) and the exported model (hf/) go")
    args = p.parse_args(argv)
    unknown = [arch for arch in args.only or () if arch not in ARCHS]
    if unknown:  # else nothing runs and the run still exits 0
        p.error(f"--only: unknown arch {unknown[0]!r}; choose from {', '.join(ARCHS)}")
    require_threads(p, args)  # 0 fell back to torch's default silently
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        p.error(f"--peak-tflops must be a positive number, got {args.peak_tflops}")  # 0 fell back to the H200's
    if not args.budget_s > 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    return args


def _jsonable(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else str(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    meta = invocation(args, "benchmarks.gpu_bench")  # what reproduces the run
    path = Path(args.out_dir) / "gpu_bench.json"

    def save(partial: dict) -> None:  # the cases so far, marked partial: what a killed run leaves
        write_text_atomic(path, json.dumps({**partial, **meta, "partial": True}, indent=2, default=_jsonable) + "\n")

    report = {**run(args, save), **meta, "partial": False}
    text = json.dumps(report, indent=2, default=_jsonable)
    print(text)
    write_text_atomic(path, text + "\n")
    failed = [r for section in ("training", "fill", "decode", "hf", "checks") for r in report[section] if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
