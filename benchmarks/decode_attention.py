"""A decode step's attention over a long float32 (or float16) cache: the attention kernel (`inference/attention.c`,
what an ahead-of-time package calls) against inductor's reductions (`fast._attention_by_reduction`,
compiled with the decode step's C++ wrapper), paired in one process (issue 54: at 12 layers x d 768
after 2,048 tokens the compiled step's attention streamed the cache slower than llama.cpp's).

Each call runs one attention per layer, each layer its own keys and values (a window of a longer
buffer, as the static cache's), so the cache streams from memory as a decode step's does. The kernel
is called through ctypes, which adds a few microseconds a layer that a package does not pay: at
short windows the ratio overstates its cost. Prints each window's milliseconds, the GB/s each streams and
the kernel's time over the reductions' per round (geometric mean [95% t-interval on the logs]); a
ratio below 1 is the kernel ahead. `--cache-dtype float16`: the cache a `kv_dtype=float16` decoder
stores, which the kernel reads as stored and the reductions widen as they read it. `--rows N`: a
continuous batch's N rows, whose filled lengths spread evenly up to the window (the longest row's):
each shorter row's window ends in masked slots, which the kernel skips and the reductions read. The
kernel's GB/s are over the bytes of the keys and values the rows attend to (`attended_mb`), the
reductions' over the whole window's, which they read (`window_mb`).

    .venv/bin/python -m benchmarks.decode_attention [--shape large] [--windows 128,512,2048,4096]
        [--threads 1] [--rounds 15] [--cache-dtype float32] [--rows 1] [--json out.json]
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
    benchmark_main,
    describe_ratios,
    paired_ratios,
    render_table,
    require_rounds,
    require_threads,
    start_run,
)
from benchmarks.engines import SHAPES

EMPTY_SLOTS = 64  # the buffer's slots past the window (the static cache's buffer is longer than its window)
MASKED_TAIL = 5  # the window's last slots hold no key yet (the window is the filled length rounded up)


CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def layer_caches(shape: dict[str, int], window: int, dtype: torch.dtype = torch.float32,
                 rows: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's keys and values, (rows, H, window + EMPTY_SLOTS, hd) in `dtype`, random."""
    heads, layers, head_dim = shape["n_head"], shape["n_layer"], shape["n_embd"] // shape["n_head"]
    size = (rows, heads, window + EMPTY_SLOTS, head_dim)
    return ([torch.randn(size).to(dtype) for _ in range(layers)],
            [torch.randn(size).to(dtype) for _ in range(layers)])


def filled_lengths(window: int, rows: int) -> list[int]:
    """Each row's filled slots: the longest row's window ends in MASKED_TAIL empty slots (the filled
    length rounded up); the others' lengths step evenly down from it, as a continuous batch's rows
    that joined at different times."""
    longest = window - MASKED_TAIL
    return [max(1, longest * (row + 1) // rows) for row in range(rows)]


def measure_window(shape: dict[str, int], window: int, rounds: int,
                   dtype: torch.dtype = torch.float32, rows: int = 1) -> dict[str, Any]:
    """One window's paired rounds: the kernel's and the reductions' milliseconds (medians) and ratios."""
    from latentloop.inference import fast, native, torch_internals

    keys, values = layer_caches(shape, window, dtype, rows)
    heads, head_dim = shape["n_head"], shape["n_embd"] // shape["n_head"]
    query = torch.randn(rows, heads, 1, head_dim)
    filled = filled_lengths(window, rows)
    # (rows, 1, 1, W): the static cache's mask, each row's filled slots visible, no future keys
    mask = (torch.arange(window)[None, :] < torch.tensor(filled)[:, None])[:, None, None, :]

    def by_kernel():
        return [native.decode_attention(query, k[:, :, :window], v[:, :, :window], mask, head_dim ** -0.5)
                for k, v in zip(keys, values)]

    def by_reductions(query):  # a float16 cache widened as it is read, as the decode step's window is
        return torch.stack([fast._attention_by_reduction(query, k[:, :, :window].float(), v[:, :, :window].float(),
                                                         mask) for k, v in zip(keys, values)])

    compiled = torch.compile(by_reductions, fullgraph=True, backend=lambda gm, inputs: torch_internals.compile_fx(
        gm, inputs, {"cpp_wrapper": True}))
    expected = torch.nn.functional.scaled_dot_product_attention(query, keys[0][:, :, :window].float(),
                                                                values[0][:, :, :window].float(), attn_mask=mask)
    torch.testing.assert_close(by_kernel()[0], expected, rtol=1e-5, atol=1e-5)  # float32 rounding
    torch.testing.assert_close(compiled(query)[0], expected, rtol=1e-5, atol=1e-5)
    seconds: dict[str, list[float]] = {"kernel": [], "reductions": []}

    def kernel_call():
        start = time.perf_counter()
        by_kernel()
        seconds["kernel"].append(time.perf_counter() - start)

    def reductions_call():
        start = time.perf_counter()
        compiled(query)
        seconds["reductions"].append(time.perf_counter() - start)

    for _ in range(3):  # warm-up, not kept
        kernel_call(), reductions_call()
    for times in seconds.values():
        times.clear()
    ratios = paired_ratios(reductions_call, kernel_call, rounds)
    slot_bytes = 2 * shape["n_layer"] * heads * head_dim * keys[0].element_size()  # a slot's keys and values
    return {"kernel_ms": statistics.median(seconds["kernel"]) * 1e3,
            "reductions_ms": statistics.median(seconds["reductions"]) * 1e3,
            "attended_mb": slot_bytes * sum(filled) / 1e6, "window_mb": slot_bytes * rows * window / 1e6,
            "ratios": ratios, "ratio": describe_ratios(ratios)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from latentloop.inference import native

    env = start_run(args)
    if native.decode_attention_status() != "native":
        raise SystemExit(f"no attention kernel here: {native.decode_attention_status()}")
    results: dict[str, Any] = {"env": env, "shape": args.shape, "rounds": args.rounds,
                               "cache_dtype": args.cache_dtype, "rows": args.rows, "windows": {}}
    for window in args.windows:
        results["windows"][window] = measure_window(SHAPES[args.shape], window, args.rounds,
                                                    CACHE_DTYPES[args.cache_dtype], args.rows)
        print(f"window {window}: {results['windows'][window]['ratio']}", flush=True)
    return results


def table(results: dict[str, Any]) -> str:
    rows = [["window", "attended MB", "kernel ms (GB/s attended)", "reductions ms (GB/s of the window)",
             "kernel / reductions"]]
    for window, row in results["windows"].items():
        rates = [f"{row[name]:.2f} ({row[mb] / row[name]:.1f})"  # MB / ms = GB/s
                 for name, mb in (("kernel_ms", "attended_mb"), ("reductions_ms", "window_mb"))]
        rows.append([window, f"{row['attended_mb']:.0f}", *rates, row["ratio"]])
    return render_table(rows)


def window_list(text: str) -> list[int]:
    """--windows: comma-separated key counts, each past the MASKED_TAIL slots the benchmark leaves empty."""
    try:
        windows = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--windows takes comma-separated integers, got {text!r}") from None
    if min(windows) <= MASKED_TAIL:
        raise argparse.ArgumentTypeError(f"each window must be > {MASKED_TAIL} keys, got {text!r}")
    return windows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="large", choices=sorted(SHAPES))
    parser.add_argument("--windows", type=window_list, default=[128, 512, 2048, 4096])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15, help="paired rounds per window (at least 2)")
    parser.add_argument("--cache-dtype", default="float32", choices=sorted(CACHE_DTYPES),
                        help="the cache's keys and values (float16: a kv_dtype=float16 decoder's)")
    parser.add_argument("--rows", type=int, default=1,
                        help="a batch of this many rows, their filled lengths spread evenly up to the window")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error(f"--rows must be at least 1, got {args.rows}")
    require_threads(parser, args)
    require_rounds(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, table)


if __name__ == "__main__":
    sys.exit(main())
