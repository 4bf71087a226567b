"""Where a batch-1 decode step's time goes (issue 26, "the small-shape gap"), all in one run:

1. the compiled step's own changes, interleaved A/B: attention over the filled window against the
   whole static buffer (`WINDOW_BUCKET` set past the buffer), and dynamo's guard check skipped
   after the first call against checked every call (`skip_guard_eval_unsafe`);
2. the compiled step op by op: inductor's kernels profiled (`cpp.enable_kernel_profile`: each
   generated C++ kernel records itself to torch's profiler), self time per kernel per step;
3. the eager step op by op (torch's profiler over `model.decode`), for comparison.

    .venv/bin/python -m benchmarks.decode_profile [--shape small] [--prompt-len 16] [--new-tokens 200]
        [--threads 1] [--repeats 5] [--top 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    add_decode_shape_arguments,
    benchmark_main,
    render_table,
    require_at_least_one,
    spread,
    start_run,
)

SHAPES = {"small": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=256, bos_id=1),
          "large": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=32000, bos_id=1)}


def decode_tokens(fast, model, prompt: torch.Tensor, new_tokens: int, skip_guards: bool = True) -> float:
    """Seconds per step of `new_tokens` greedy steps of `fast` (a FastDecoder) after a fresh prefill."""
    cache = fast.new_cache(1, prompt.shape[1] + new_tokens)
    token = model.prefill(prompt, cache).logits[:, -1].argmax(-1)
    fast.begin_decoding(cache)
    fast.skip_guards = skip_guards
    start = time.perf_counter()
    for _ in range(new_tokens):
        _, token, _ = fast.step(token)
    return (time.perf_counter() - start) / new_tokens


def profile_ops(fn, top: int, steps: int) -> list[tuple[str, float, int]]:
    """(op or kernel name, self CPU microseconds per step, calls per step) of the `top` heaviest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    rows = [(e.key, e.self_cpu_time_total / steps, e.count // steps) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])[:top]


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict[str, Any]:
    import latentloop
    from latentloop.inference import fast as fast_module

    env = start_run(args)
    torch.manual_seed(args.seed)
    model = latentloop.build("gpt", preset=None, sequence_len=args.prompt_len + args.new_tokens,
                             **SHAPES[args.shape]).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len))
    compiled = fast_module.FastDecoder(model)
    print("compiling ...", flush=True)
    decode_tokens(compiled, model, prompt, args.new_tokens)  # compile, and warm
    window_bucket = fast_module.WINDOW_BUCKET

    def whole_buffer() -> float:
        fast_module.WINDOW_BUCKET = 1 << 30  # the window is the whole buffer from the first step
        try:
            return decode_tokens(compiled, model, prompt, args.new_tokens)
        finally:
            fast_module.WINDOW_BUCKET = window_bucket

    variants = {"compiled (window, guards skipped)": lambda: decode_tokens(compiled, model, prompt, args.new_tokens),
                "compiled, attention over the whole buffer": whole_buffer,
                "compiled, guards checked every step": lambda: decode_tokens(compiled, model, prompt,
                                                                             args.new_tokens, skip_guards=False),
                "eager (static cache)": lambda: decode_tokens(fast_module.FastDecoder(model, compile=False), model,
                                                              prompt, args.new_tokens)}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(variants[name]() * 1e3)
    results: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()},
                               "ms_per_step": samples, "params": model.num_params()}

    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # recompile with each kernel recording itself
    fast_module.compiled_steps(model).clear()
    with inductor_config.patch({"cpp.enable_kernel_profile": True, "fx_graph_cache": False}):
        profiled = fast_module.FastDecoder(model)
        decode_tokens(profiled, model, prompt, args.new_tokens)
        results["compiled_ops"] = profile_ops(lambda: decode_tokens(profiled, model, prompt, args.new_tokens),
                                              args.top, args.new_tokens)
    eager = fast_module.FastDecoder(model, compile=False)
    results["eager_ops"] = profile_ops(lambda: decode_tokens(eager, model, prompt, args.new_tokens), args.top,
                                       args.new_tokens)
    return results


def markdown_table(results: dict[str, Any]) -> str:
    args = results["args"]
    base = statistics.median(results["ms_per_step"]["compiled (window, guards skipped)"])
    rows = [(f"Decode step ({args['shape']}, {results['params']:,} params, batch 1, prompt {args['prompt_len']} + "
             f"{args['new_tokens']})", "ms / step", "over the default compiled step")]
    for name, values in results["ms_per_step"].items():
        rows.append((name, spread(values, "{:.3f}"), f"{statistics.median(values) / base:.2f}x"))
    parts = [render_table(rows)]
    for label, key in (("compiled step: inductor kernels", "compiled_ops"), ("eager step: torch ops", "eager_ops")):
        op_rows = [(label, "self us / step", "calls / step")]
        op_rows += [(name[:70], f"{us:.1f}", str(calls)) for name, us, calls in results[key]]
        parts.append(render_table(op_rows))
    return "\n\n".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_decode_shape_arguments(p, SHAPES, "small")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median and range reported)")
    p.add_argument("--top", type=int, default=12, help="ops / kernels listed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    require_at_least_one(p, args, ("prompt_len", "new_tokens", "threads", "repeats", "top"))
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
