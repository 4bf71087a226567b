"""The variants on the fast decode path (issue 16): batch-1 greedy decode latency per token through
the engine with `compile=True` (`latentloop.inference.fast`), fbt soft, lrt and rgpt over gpt, all
measured interleaved in one run; the eager path of each alongside, and compiled over eager.

Shape: the baseline's (4 layers, d=256, 4 heads, vocab 256, fp32). rgpt at equal depth: prelude 1,
core 1 applied R=2 times, coda 1, i.e. four block applications per token as gpt's four layers
(plus its gate and projection). The FLOPs of one decode step (every matmul and the attention, by
torch's FlopCounterMode, at the prompt's context) are counted for each; "per FLOP" divides the
time ratio over gpt by the FLOP ratio over gpt: the overhead at equal FLOPs.

    .venv/bin/python -m benchmarks.fast_decode [--new-tokens 128] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    benchmark_main,
    decode_generate,
    make_sync,
    render_table,
    require_at_least_one,
    require_threads,
    run_interleaved,
    spread,
    start_run,
)

SHAPE = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=256, bos_id=1)  # the baseline's
RGPT_EQUAL_DEPTH = dict(n_pre=1, n_rec=1, n_coda=1, recurrence_steps=2)  # 1 + 1 x 2 + 1 = 4 block applications
TARGETS = {"fbt soft": 1.03, "lrt": 1.05, "rgpt": 1.05}  # compiled decode over compiled gpt (issue 16)
VARIANTS = {"gpt": ("gpt", {}, {}), "fbt soft": ("fbt", {}, {"regime": "soft"}), "lrt": ("lrt", {}, {}),
            "rgpt": ("rgpt", RGPT_EQUAL_DEPTH, {"cache_mode": "full"})}


def build(arch: str, overrides: dict, context: int, seed: int) -> torch.nn.Module:
    import latentloop

    torch.manual_seed(seed)
    return latentloop.build(arch, preset=None, sequence_len=context, **SHAPE, **overrides).eval()


@torch.no_grad()  # not inference mode: FlopCounterMode's module tracker hooks autograd
def decode_step_flops(model: torch.nn.Module, options: dict, prompt: list[int]) -> float:
    """FLOPs of one eager decode step after `prompt` (matmuls and attention, FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    from latentloop.engine import model_options

    options = model_options(model, options)
    idx = torch.tensor([prompt])
    cache = model.new_cache(1, len(prompt) + 1, **options)
    out = model.prefill(idx, cache, **options)
    if hasattr(model, "token_gates"):  # fbt's per-token gate table: built once per weights, not per step
        model.token_gates()
    with FlopCounterMode(display=False) as counter:
        model.decode(out.logits[:, -1:].argmax(-1), cache, **options)
    return float(counter.get_total_flops())


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(args)
    context = args.prompt_len + args.new_tokens
    sync = make_sync(torch.device("cpu"))
    prompt = torch.randint(0, SHAPE["vocab_size"], (args.prompt_len,),
                           generator=torch.Generator().manual_seed(args.seed)).tolist()
    models, flops, calls = {}, {}, {}
    for name, (arch, overrides, options) in VARIANTS.items():
        models[name] = build(arch, overrides, context, args.seed)
        flops[name] = decode_step_flops(models[name], options, prompt)
        calls[f"{name}/compiled"] = partial(decode_generate, models[name], prompt, args.new_tokens,
                                            {**options, "compile": True}, sync)
        if not args.no_eager:
            calls[f"{name}/eager"] = partial(decode_generate, models[name], prompt, args.new_tokens, options, sync)
    print(f"compiling and warming up {len(VARIANTS)} decode steps ...", flush=True)
    start = time.perf_counter()
    raw = run_interleaved(calls, args.warmup, args.repeats)
    print(f"measured in {time.perf_counter() - start:.0f} s", flush=True)
    results: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()}, "variants": {}}
    base = raw["gpt/compiled"]["token_s_all"]
    for name in VARIANTS:
        entry = {"flops_over_gpt": flops[name] / flops["gpt"]}
        for mode in ("compiled", "eager"):
            key = f"{name}/{mode}"
            if key not in raw:
                continue
            times = raw[key]["token_s_all"]
            entry[mode] = {"ms_per_token_all": [t * 1e3 for t in times], "ms_per_token": raw[key]["token_s"] * 1e3}
            entry[mode]["over_gpt_all"] = [t / b for t, b in zip(times, raw[f"gpt/{mode}"]["token_s_all"])]
        entry["compiled"]["over_gpt_per_flop_all"] = [r / entry["flops_over_gpt"]
                                                      for r in entry["compiled"]["over_gpt_all"]]
        if "eager" in entry:
            entry["compiled_speedup_all"] = [e / c for e, c in zip(raw[f"{name}/eager"]["token_s_all"],
                                                                   raw[f"{name}/compiled"]["token_s_all"])]
        results["variants"][name] = entry
    results["gpt_compiled_ms_all"] = [t * 1e3 for t in base]
    return results


def markdown_table(results: dict[str, Any]) -> str:
    rows = [("Arch (batch 1, greedy)", "compiled ms/token", "over gpt, compiled", "FLOPs over gpt",
             "over gpt per FLOP (equal FLOPs)", "target", "eager ms/token", "over gpt, eager",
             "compiled speedup")]
    for name, entry in results["variants"].items():
        compiled, eager = entry["compiled"], entry.get("eager")
        target = TARGETS.get(name)
        per_flop = spread(compiled["over_gpt_per_flop_all"], "{:.3f}x")
        if target is not None:
            per_flop += " ✅" if statistics.median(compiled["over_gpt_per_flop_all"]) <= target else " ❌"
        rows.append((name, spread(compiled["ms_per_token_all"], "{:.3f}"), spread(compiled["over_gpt_all"], "{:.3f}x"),
                     f"{entry['flops_over_gpt']:.3f}x", per_flop, f"≤ {target}x" if target else "—",
                     spread(eager["ms_per_token_all"], "{:.3f}") if eager else "—",
                     spread(eager["over_gpt_all"], "{:.3f}x") if eager else "—",
                     spread(entry["compiled_speedup_all"], "{:.2f}x") if eager else "—"))
    return render_table(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per decode call (per-token time "
                   "excludes the prefill)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median and range reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls of each first (the compile happens here)")
    p.add_argument("--no-eager", action="store_true", help="skip the eager rows")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    require_at_least_one(p, args, ("prompt_len", "repeats"))
    require_threads(p, args)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (per-token time is measured between tokens)")
    if args.warmup < 1:
        p.error("--warmup must be >= 1: the first compiled call compiles")
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
