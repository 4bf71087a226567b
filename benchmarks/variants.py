"""Speed and size benchmark of the variants (`fbt`, `lrt`, `rgpt`) against the `gpt` backbone, CPU first.

The figures for the closing notes of issues 3 (fbt), 4 (lrt) and 5 (rgpt):

1. fbt: decode latency per token at batch 1, regime `soft` over `standard` with the same weights, at
   d=256 (4 layers, 4 heads) and d=1024 (4 layers, 8 heads), byte vocab (target <= 1.03x); training
   step time with K=2 and K=3 passes over K=1 at the tiny preset, T=256, batch 16 (targets <= 2.05x
   and <= 3.1x).
2. lrt: decode latency per token at batch 1 over `gpt` of the same shape (target <= 1.05x); training
   step time of `interleaved` S=2 over `gpt` at the tiny preset (target <= 2.1x); parameter overhead of
   `shared` and `layerwise` at the tiny preset and at the nanochat d20 shape (models built on the
   `meta` device, so nothing is allocated; checked against a closed-form count).
3. rgpt: decode latency per token against an isoFLOPs dense `gpt` (the same effective depth, split by
   `rgpt_shape_from_dense`) in eager mode, and compiled with `--compile`; parameters and FLOPs per
   token; peak memory of a decode; KV-cache bytes per cache mode (`cache.memory_bytes()`).

How it measures:
- Decode latency per token: `latentloop.generate(model, prompt, N, temperature=0, **options)` with a
  `stream` callback that timestamps every new token; latency = (last - first stamp) / (N - 1), i.e.
  the decode loop (engine + model) without the prefill, which is reported on its own. The model step
  alone: `model.generate_step(token, cache=cache, **options)` N times after a prefill into a fresh
  cache, wall time / N. The difference of the two is the engine's overhead per token (sampling,
  `.tolist()`, bookkeeping). For scale, the tables also give the weight multiply-adds per token (the
  ratio a compute-bound machine would approach; at 4 layers fbt's two D×D fusion matrices are ~4% of
  them, not the paper's <1% at full depth).
- Training step: forward + backward + grad-norm clip + AdamW step, the trainer's step through the
  arch's registered objective (fp32, random tokens, no data loading). fbt gets K by a config with
  `feedback_start=0` and the whole pass mix on K, so its real objective (prefix mix-in included) runs.
- The variants compared in one table are measured interleaved (round robin, the order rotating every
  repeat), so that a change of machine load hits all of them alike; each figure is the median over
  the repeats, after warmup calls of each.
- Peak memory of rgpt vs dense, on CPU: the peak RSS of a fresh subprocess per model that builds it
  and decodes a `--mem-prompt-len` prompt plus N tokens, counted over the RSS the same process had just
  before building (torch's own footprint left out). The peak is /proc's VmHWM, reset before building;
  `getrusage`'s ru_maxrss would carry the parent's RSS across fork + exec (used only off Linux). Next
  to it, the exact bytes of parameters + buffers + the KV cache of that decode. On CUDA:
  `torch.cuda.max_memory_allocated`.

    .venv/bin/python -m benchmarks.variants                      # ~4 min on 2 idle cores
    .venv/bin/python -m benchmarks.variants --quick              # smaller, under a minute idle
    .venv/bin/python -m benchmarks.rgpt --compile --device cuda --json out.json   # one section

One module per variant (`benchmarks.fbt`, `benchmarks.lrt`, `benchmarks.rgpt`); the timing
primitives are in `benchmarks.common`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import fbt, lrt, rgpt
from benchmarks.common import (
    ContentionMeter,
    announce_environment,
    environment,
    invocation,
    load_average,
    require_at_least_one,
    require_threads,
    write_results,
)
from benchmarks.fbt import DECODE_SHAPES

SECTIONS = ("fbt", "lrt", "rgpt")

# Sizes: the default run, and --quick; an explicit flag wins over both.
DEFAULTS = dict(dims="256,1024", prompt_len=16, new_tokens=64, repeats=5, warmup=1, train_seq_len=256,
                train_batch=16, train_warmup=2, train_steps=6, rgpt_dense_layers=14, rgpt_steps=4, rgpt_dim=256,
                rgpt_heads=4, mem_prompt_len=512, cache_context=1024)
QUICK = dict(dims="256", new_tokens=24, repeats=3, train_seq_len=128, train_batch=8, train_warmup=1, train_steps=3,
             rgpt_dense_layers=8, rgpt_steps=3, mem_prompt_len=128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Defaults: " + ", ".join(f"{k}={v}" for k, v in DEFAULTS.items())
                                + ".\n--quick: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
                                + " (explicit flags win).")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of fbt,lrt,rgpt")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (see below)")
    p.add_argument("--dims", help="fbt/lrt decode shapes: 256 (4 layers, 4 heads) and/or 1024 (4 layers, 8 heads)")
    p.add_argument("--prompt-len", type=int, help="decode prompt length")
    p.add_argument("--new-tokens", type=int, help="new tokens per decode measurement (>= 2)")
    p.add_argument("--repeats", type=int, help="timed decode calls per measurement (median)")
    p.add_argument("--warmup", type=int, help="untimed decode calls per measurement first")
    p.add_argument("--train-seq-len", type=int, help="training sequence length T")
    p.add_argument("--train-batch", type=int, help="training batch size")
    p.add_argument("--train-warmup", type=int, help="untimed training steps per variant first")
    p.add_argument("--train-steps", type=int, help="timed training steps per variant (median)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="grad-norm clip in the step, as the trainer")
    p.add_argument("--rgpt-dense-layers", type=int, help="depth of the dense gpt that rgpt matches in FLOPs")
    p.add_argument("--rgpt-steps", type=int, help="rgpt's trained recurrence R")
    p.add_argument("--rgpt-dim", type=int, help="n_embd of the rgpt comparison")
    p.add_argument("--rgpt-heads", type=int, help="n_head of the rgpt comparison")
    p.add_argument("--mem-prompt-len", type=int, help="prompt length of the peak-memory decode")
    p.add_argument("--cache-context", type=int, help="context of the KV-cache-per-mode table")
    p.add_argument("--no-peak-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--compile", action="store_true",
                   help="also time rgpt/dense decode with torch.compile'd blocks (meant for GPU; slow on CPU)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]; all figures are fp32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    p.add_argument("--_rss-child", dest="rss_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick and name in QUICK else value)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not args.sections or any(s not in SECTIONS for s in args.sections):
        p.error(f"--sections must be a comma-separated subset of {','.join(SECTIONS)}")
    try:
        args.dims = [int(d) for d in str(args.dims).split(",") if d.strip()]
    except ValueError:
        p.error("--dims must be comma-separated integers")
    if not args.dims or any(d not in DECODE_SHAPES for d in args.dims):
        p.error(f"--dims must be a comma-separated subset of {','.join(map(str, DECODE_SHAPES))}")
    require_at_least_one(p, args, ("prompt_len", "repeats", "train_seq_len", "train_batch", "train_steps",
                                   "rgpt_dense_layers", "rgpt_steps", "rgpt_dim", "rgpt_heads", "mem_prompt_len",
                                   "cache_context"))
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (latency is measured between the first and last token)")
    if args.warmup < 0 or args.train_warmup < 0:
        p.error("--warmup and --train-warmup must be >= 0")
    if args.compile and args.warmup < 1:  # the compiled decode's first call compiles: never a timed one
        p.error("--compile needs --warmup >= 1: the first call compiles, and it must not be timed")
    if args.rgpt_dim % args.rgpt_heads:
        p.error("--rgpt-dim must be divisible by --rgpt-heads")
    require_threads(p, args)
    return args


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    env = environment()
    announce_environment(env)
    print(f"device {device}; sections {', '.join(args.sections)}{'; --quick' if args.quick else ''}", flush=True)
    results: dict[str, Any] = {"env": env, "device": str(device),
                               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                        if k != "rss_child"}}
    tables: list[str] = []
    benches = {"fbt": fbt.bench_fbt, "lrt": lrt.bench_lrt, "rgpt": rgpt.bench_rgpt}
    for section in args.sections:
        start, meter = time.perf_counter(), ContentionMeter().start()
        section_results, section_tables = benches[section](args, device)
        others = meter.stop()
        section_results["wall_s"] = time.perf_counter() - start
        section_results["others_cpu_share"] = others
        results[section] = section_results
        share = "?" if others is None else f"{others:.0%}"
        tables += section_tables
        tables.append(f"_{section}: {section_results['wall_s']:.0f} s; other processes used {share} of the CPUs "
                      "meanwhile._")
    return results, tables


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rss_child is not None:  # internal: one peak-memory measurement in a fresh process
        print(json.dumps(rgpt.rss_child(json.loads(args.rss_child))))
        return 0
    start = time.perf_counter()
    meter = ContentionMeter().start()
    results, tables = run(args)
    results["wall_s"] = time.perf_counter() - start
    results["env"]["others_cpu_share_during_run"] = others = meter.stop()
    results["env"]["load_avg_1min_at_end"] = load_average()
    results.update(invocation(args, "benchmarks.variants"))  # the command and arguments, as benchmark_main records
    print()
    print("\n\n".join(tables))
    print()
    print(f"total {results['wall_s']:.0f} s; other processes used {'?' if others is None else f'{others:.0%}'} "
          "of the CPUs during the run")
    write_results(results, others, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
