"""rgpt against an isoFLOPs dense gpt (the same effective depth, split by `rgpt_shape_from_dense`):
decode latency per token in eager mode (and compiled with `--compile`), parameters and FLOPs per
token, peak memory of a decode (a fresh subprocess per model on CPU; `max_memory_allocated` on
CUDA) and KV-cache bytes per cache mode.

    python -m benchmarks.rgpt [--quick] [--compile] [--json out.json]    (the options of benchmarks.variants)
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import latentloop
from benchmarks.common import (
    BYTE_VOCAB,
    MiB,
    build,
    change,
    decode_comparison,
    decode_generate,
    decode_steps,
    make_sync,
    ms,
    param_bytes,
    render_table,
)
from latentloop.archs.rgpt.model import CACHE_MODES, rgpt_shape_from_dense

PAPER_RGPT = {"decode_eager": "+23% (GPU eager)", "decode_compiled": "+10% (GPU compiled)",
              "params": "−63%", "memory": "−59%"}
REPO_ROOT = Path(__file__).resolve().parents[1]  # the peak-memory child runs `python -m benchmarks.variants` here


def compile_blocks(model: nn.Module) -> nn.Module:
    """A copy whose transformer blocks are `torch.compile`d with dynamic shapes (the cache grows every step).

    The caches it makes run `update` eagerly (a graph break around it): the update slices with Python
    ints that change every step, and under dynamic shapes `RecurrentKVCache.update`'s `slot not in
    self.core_range` raises inside dynamo (InternalTorchDynamoError, torch 2.13). Each block thus
    compiles as two graphs, before and after the cache update."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 64))  # prefill/decode x slots: never fall back to eager
    model = copy.deepcopy(model)
    for block in model.blocks:
        block.compile(dynamic=True)
    make_cache = model.new_cache

    def new_cache(*args: Any, **kwargs: Any):
        cache = make_cache(*args, **kwargs)
        cache.update = torch.compiler.disable(cache.update)
        return cache

    model.new_cache = new_cache  # an instance attribute of this copy only
    return model


def dynamo_summary() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return {"frames": dict(counters["frames"]), "unique_graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values())}


def proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: build one model and decode it; report the peak RSS over the RSS before building.

    The peak is VmHWM, the high-water mark of this process's own address space. getrusage's ru_maxrss
    is not used on Linux: across fork + exec it keeps the parent's RSS at the fork (here the parent holds
    every model of the run), so it would report the parent's size, not this model's."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    a = torch.randn(256, 256)
    float((a @ a).sum())  # start torch's thread pool and allocator before the baseline reading
    base = proc_status_bytes("VmRSS")
    was_reset = reset_peak_rss()
    model = build(spec["arch"], torch.device("cpu"), spec["seed"], **spec["kwargs"]).eval()
    gen = torch.Generator().manual_seed(spec["seed"])
    prompt = torch.randint(0, 256, (spec["prompt_len"],), generator=gen).tolist()
    latentloop.generate(model, prompt, spec["new_tokens"], temperature=0.0, **spec["options"])
    peak, method = proc_status_bytes("VmHWM"), "VmHWM" + (" (reset before building)" if was_reset else "")
    if peak is None:  # not Linux: ru_maxrss is bytes on macOS, KiB elsewhere (and may include the parent's)
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak, method = (ru if sys.platform == "darwin" else ru * 1024), "ru_maxrss"
    return {"base_rss": base, "peak_rss": peak, "peak_over_base": None if base is None else peak - base,
            "peak_method": method}


def measure_peak_memory(spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        model = build(spec["arch"], device, spec["seed"], **spec["kwargs"]).eval()
        prompt = list(range(spec["prompt_len"]))
        latentloop.generate(model, prompt, spec["new_tokens"], temperature=0.0, **spec["options"])
        peak = torch.cuda.max_memory_allocated(device)
        del model
        return {"method": "torch.cuda.max_memory_allocated", "base": base, "peak": peak, "peak_over_base": peak - base}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.variants", "--_rss-child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"memory subprocess failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"method": "subprocess peak RSS over its RSS before building", **out}


def bench_rgpt(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], list[str]]:
    L, R = args.rgpt_dense_layers, args.rgpt_steps
    context = max(args.prompt_len, args.mem_prompt_len) + args.new_tokens
    shared = dict(n_embd=args.rgpt_dim, n_head=args.rgpt_heads, vocab_size=BYTE_VOCAB, sequence_len=context)
    split = rgpt_shape_from_dense(L, "flops", R)
    specs = {"dense": ("gpt", dict(n_layer=L, **shared)), "rgpt": ("rgpt", dict(**split, **shared))}
    dense, rgpt = (build(arch, device, args.seed, **kwargs) for arch, kwargs in specs.values())
    c = rgpt.config
    rgpt_label = f"rgpt {c.n_pre} + {c.n_rec}×{c.recurrence_steps} + {c.n_coda}"
    dense_label = f"gpt, {L} layers"
    results: dict[str, Any] = {"dense_kwargs": specs["dense"][1], "rgpt_kwargs": specs["rgpt"][1],
                               "effective_depth": c.effective_depth, "dense_depth": L}
    tables = []

    # parameters and FLOPs
    flops_T = args.train_seq_len
    sizes = {"dense": (dense.num_params(), dense.flops_per_token(flops_T)),
             "rgpt": (rgpt.num_params(), rgpt.flops_per_token(flops_T))}
    results["params"] = {k: v[0] for k, v in sizes.items()}
    results["flops_per_token"] = {k: v[1] for k, v in sizes.items()}
    rows = [("Model", "Effective depth", "Params", "Params over dense", f"FLOPs/token (fwd+bwd, T={flops_T})",
             "FLOPs over dense", "Paper (params)")]
    for name, label, depth in (("dense", dense_label, L), ("rgpt", rgpt_label, c.effective_depth)):
        p, f = sizes[name]
        rows.append((label, depth, f"{p:,}", change(p / sizes["dense"][0]), f"{f / 1e6:.1f}M",
                     change(f / sizes["dense"][1]), PAPER_RGPT["params"] if name == "rgpt" else "—"))
    tables.append(f"### rgpt vs isoFLOPs dense `gpt`: parameters and compute (d={args.rgpt_dim}, "
                  f"{args.rgpt_heads} heads, vocab {BYTE_VOCAB})\n\n" + render_table(rows))

    # decode latency, eager (and compiled)
    print(f"rgpt decode: {dense_label} vs {rgpt_label} (cache modes {', '.join(CACHE_MODES)}), "
          f"{args.new_tokens} new tokens ...", flush=True)
    entries = {"dense": (dense, {}), **{f"rgpt {m}": (rgpt, {"cache_mode": m}) for m in CACHE_MODES}}
    decode = decode_comparison(entries, args, device)
    if args.compile:
        print("rgpt decode, compiled blocks (warmup includes compilation) ...", flush=True)
        compiled = {"dense compiled": (compile_blocks(dense), {}),
                    "rgpt full compiled": (compile_blocks(rgpt), {"cache_mode": "full"})}
        compile_s = {}
        for name, (model, options) in compiled.items():
            start = time.perf_counter()
            for _ in range(2):  # compile the prefill and the decode graphs, and settle recompilations
                decode_generate(model, list(range(args.prompt_len)), args.new_tokens, options, make_sync(device))
                decode_steps(model.eval(), torch.arange(args.prompt_len, device=device)[None],
                             [torch.zeros(1, 1, dtype=torch.long, device=device)] * args.new_tokens, options,
                             make_sync(device))
            compile_s[name] = time.perf_counter() - start
        results["compile_warmup_s"] = compile_s
        results["dynamo"] = dynamo = dynamo_summary()
        print(f"compiled in {sum(compile_s.values()):.0f} s: {dynamo['unique_graphs']} graphs, "
              f"{dynamo['graph_breaks']} graph breaks, frames {dynamo['frames']}", flush=True)
        if dynamo["frames"].get("ok", 0) != dynamo["frames"].get("total", 0):
            print("warning: some frames failed to compile and run eagerly", flush=True)
        decode.update(decode_comparison(compiled, args, device, warmup=0))
    results["decode"] = decode
    base = decode["dense"]
    rows = [("Model", "`generate` (ms/tok)", "`generate_step` (ms/tok)", "engine overhead (ms/tok)",
             f"prefill {args.prompt_len} tok (ms)", "over dense (generate)", "over dense (step)", "Paper")]
    for name, d in decode.items():
        ref = decode["dense compiled"] if name.endswith("compiled") else base
        label = dense_label if name.startswith("dense") else f"{rgpt_label}, cache `{name.split()[1]}`"
        label += ", compiled" if name.endswith("compiled") else ", eager"
        paper = "—"
        if name == "rgpt full":
            paper = PAPER_RGPT["decode_eager"]
        elif name == "rgpt full compiled":
            paper = PAPER_RGPT["decode_compiled"]
        d["over_dense"] = {"generate": d["generate_s_per_token"] / ref["generate_s_per_token"],
                           "step": d["step_s_per_token"] / ref["step_s_per_token"]}
        rows.append((label, ms(d["generate_s_per_token"]), ms(d["step_s_per_token"]),
                     ms(d["engine_overhead_s_per_token"]), ms(d["prefill_s"]), change(d["over_dense"]["generate"]),
                     change(d["over_dense"]["step"]), paper))
    note = (" (`--compile`: every block `torch.compile(dynamic=True)`, the cache update eager in between; "
            "meant for GPU)") if args.compile else ""
    tables.append(f"### rgpt vs isoFLOPs dense `gpt`: decode latency per token, batch 1, {device.type}{note}\n\n"
                  + render_table(rows))

    # memory: exact bytes and measured peak of one decode
    mem_context = args.mem_prompt_len + args.new_tokens
    memory: dict[str, Any] = {}
    mem_entries = {"dense": ("dense", {}), **{f"rgpt {m}": ("rgpt", {"cache_mode": m}) for m in CACHE_MODES}}
    for name, (which, options) in mem_entries.items():
        model = dense if which == "dense" else rgpt
        cache = model.new_cache(1, mem_context, **options)
        memory[name] = {"param_buffer_bytes": param_bytes(model), "cache_bytes": cache.memory_bytes()}
        memory[name]["exact_bytes"] = memory[name]["param_buffer_bytes"] + memory[name]["cache_bytes"]
        del cache
    if not args.no_peak_memory:
        print(f"rgpt memory: peak of a decode ({args.mem_prompt_len}-token prompt + {args.new_tokens} new), "
              "one subprocess per model ..." if device.type == "cpu" else "rgpt memory: CUDA peak ...", flush=True)
        for name, (which, options) in mem_entries.items():
            arch, kwargs = specs[which]
            spec = {"arch": arch, "kwargs": kwargs, "options": options, "prompt_len": args.mem_prompt_len,
                    "new_tokens": args.new_tokens, "seed": args.seed, "threads": args.threads}
            memory[name]["peak"] = measure_peak_memory(spec, device)
    results["memory"] = {"context": mem_context, **memory}
    ref = memory["dense"]
    peak_col = "peak RSS over base (MiB)" if device.type == "cpu" else "CUDA peak over base (MiB)"
    rows = [("Model", "params + buffers (MiB)", f"KV cache, {mem_context} tok (MiB)", "exact total (MiB)",
             "exact over dense", peak_col, "peak over dense", "Paper (memory)")]
    for name, m in memory.items():
        label = dense_label if name == "dense" else f"{rgpt_label}, cache `{name.split()[1]}`"
        peak = m.get("peak", {}).get("peak_over_base")
        ref_peak = ref.get("peak", {}).get("peak_over_base")
        rows.append((label, f"{m['param_buffer_bytes'] / MiB:.2f}", f"{m['cache_bytes'] / MiB:.2f}",
                     f"{m['exact_bytes'] / MiB:.2f}", change(m["exact_bytes"] / ref["exact_bytes"]),
                     "—" if peak is None else f"{peak / MiB:.1f}",
                     "—" if peak is None or not ref_peak else change(peak / ref_peak),
                     PAPER_RGPT["memory"] if name == "rgpt full" else "—"))
    how = ("exact = parameter + buffer bytes + `cache.memory_bytes()`; peak = peak RSS (VmHWM) of a subprocess "
           "that builds the model and decodes, over its RSS just before building" if device.type == "cpu" else
           "exact = parameter + buffer bytes + `cache.memory_bytes()`; peak = torch.cuda.max_memory_allocated")
    tables.append(f"### rgpt vs isoFLOPs dense `gpt`: memory of a batch-1 decode ({how})\n\n" + render_table(rows))

    # KV cache per mode at a given context
    C = args.cache_context
    kv: dict[str, Any] = {}
    dense_cache = dense.new_cache(1, C)
    kv["dense"] = {"slots": dense_cache.k.shape[0], "bytes": dense_cache.memory_bytes()}
    del dense_cache
    for mode in CACHE_MODES:
        cache = rgpt.new_cache(1, C, cache_mode=mode)
        kv[f"rgpt {mode}"] = {"slots": cache.k.shape[0], "bytes": cache.memory_bytes()}
        del cache
    results["kv_cache"] = {"context": C, "batch_size": 1, **kv}
    rows = [("Cache", "attention slots", "bytes", "MiB", "over dense", "over rgpt `full`")]
    for name, k in kv.items():
        label = f"{dense_label}" if name == "dense" else f"{rgpt_label}, mode `{name.split()[1]}`"
        rows.append((label, k["slots"], f"{k['bytes']:,}", f"{k['bytes'] / MiB:.2f}",
                     change(k["bytes"] / kv["dense"]["bytes"]),
                     "—" if name == "dense" else change(k["bytes"] / kv["rgpt full"]["bytes"])))
    tables.append(f"### rgpt: KV-cache memory per mode, batch 1, context {C} (`cache.memory_bytes()`, fp32)\n\n"
                  + render_table(rows))
    return results, tables


def main(argv: list[str] | None = None) -> int:
    from benchmarks.variants import main as run_sections

    return run_sections(["--sections", "rgpt", *(argv or [])])


if __name__ == "__main__":
    raise SystemExit(main())
