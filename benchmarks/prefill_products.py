"""A short prompt's products, latentloop's rows kernel against torch's (issue 26, the first token),
paired in one process:

1. every linear layer of a model in turn, as a prefill reads them (each weight cold: the layers
   before evicted it), for each row count: `native.rows_linear` (`models/rows_linear.c`) against
   torch's product for the same rows (`F.linear`, MKL in the x86 wheels; oneDNN's op beside them
   where `products.accelerated_linear` would pick it for more rows), and the int8 kernel against the converted
   product (`quant._converted_product`) on the same model quantised;
2. a one-token `generate` (the prompt's prefill and the first token) on the compiled path, with the
   kernel and with `products.accelerated_linear`'s torch products, alternating call by call: warm (the calls
   back to back), and cold (`FLUSH_MIB` written before each call, untimed, as a process meets its
   weights after other processes ran: `benchmarks.engines` runs each engine in its own).

Each round times every variant once, in turn; the table gives each one's median [range] and the
median of the per-round ratio against the kernel, with its quartiles.

    .venv/bin/python -m benchmarks.prefill_products [--shape small] [--rows 2,16,64] [--prompt-len 16]
        [--threads 1] [--repeats 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import benchmark_main, render_table, require_at_least_one, spread, start_run
from benchmarks.engines import SHAPES, build_export
from latentloop.inference.products import ROWS_KERNEL_MAX_ROWS, ROWS_KERNEL_MIN_ROWS

KERNEL = "rows kernel"
FLUSH_MIB = 64  # written before each cold call: twice this machine's 32 MiB L3, so no weight stays cached


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired(variants: dict[str, Callable[[], object]], repeats: int,
           before: Callable[[], object] | None = None) -> dict[str, Any]:
    """Every variant once per round, in turn (two rounds of warm-up first), `before` each call
    untimed: the seconds of each, and each one's time over the kernel's of the same round."""
    outputs = {name: fn() for name, fn in variants.items()}  # the first of the two warm-up rounds
    for name, output in outputs.items():
        if not _agree(output, outputs[KERNEL]):  # a faster product of other numbers is no speedup
            raise SystemExit(f"prefill_products: {name} does not give the {KERNEL}'s output (beyond float "
                             f"rounding, rtol {AGREE_RTOL:g}): its time would not be comparable")
    for fn in variants.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for _ in range(repeats):
        random.shuffle(order)  # the kernel always ran first: whatever the first call of a round pays was its
        for name, fn in order:
            if before is not None:
                before()
            seconds[name].append(timed(fn))
    over = {name: [a / b for a, b in zip(times, seconds[KERNEL])] for name, times in seconds.items()
            if name != KERNEL}
    return {"seconds": seconds, "over_kernel": over}


AGREE_RTOL = 1e-3  # products of one input in another summation order (int8: another rounding of its scales)


def _agree(a: object, b: object) -> bool:
    """Whether two variants' outputs agree: token lists exactly, tensors within float rounding."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=AGREE_RTOL,
                                                     atol=AGREE_RTOL * float(b.abs().max().clamp_min(1.0)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_agree(x, y) for x, y in zip(a, b))
    return a == b


def product_variants(model, rows: int) -> dict[str, dict[str, Callable[[], object]]]:
    """(float32 | int8) -> variant -> a call running every linear layer of `model` once, in order."""
    from latentloop.inference import native, torch_internals
    from latentloop.inference.quant import Int8Linear, _converted_product, quantize_int8

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
    weights = [(inputs[m.in_features], m.weight.detach()) for m in linears]
    layers = {"float32": {
        KERNEL: lambda: [native.rows_linear(x, w) for x, w in weights],
        "torch (F.linear)": lambda: [F.linear(x, w) for x, w in weights]}}
    if torch_internals.onednn_linear(*weights[0], None) is not None:
        layers["float32"]["oneDNN"] = lambda: [torch_internals.onednn_linear(x, w, None) for x, w in weights]
    quantised = [m for m in quantize_int8(copy.deepcopy(model)).modules() if isinstance(m, Int8Linear)]
    int8 = [(inputs[m.in_features], m.weight_int8, m.scale) for m in quantised]
    layers["int8"] = {KERNEL: lambda: [native.rows_linear(x, q, s) for x, q, s in int8],
                      "torch (converted weight)": lambda: [_converted_product(x, q, s) for x, q, s in int8]}
    return layers


def first_token_variants(model, prompt: list[int],
                         kernel_calls: list[int] | None = None) -> dict[str, Callable[[], object]]:
    """A one-token compiled `generate`, through the kernel and through torch's products; every
    product the kernel variant hands the kernel is counted in `kernel_calls[0]`."""
    import latentloop
    from latentloop.inference import accelerate, native, products

    accelerate(model)  # the products a loaded run's prefill takes
    kernel_calls = [0] if kernel_calls is None else kernel_calls

    def counted(*args):
        kernel_calls[0] += 1
        return native.rows_linear(*args)

    def call(rows_linear) -> Callable[[], object]:
        def run() -> object:
            products.rows_linear = rows_linear
            try:
                return latentloop.generate(model, prompt, 1, temperature=0.0, compile=True)
            finally:
                products.rows_linear = native.rows_linear

        return run

    return {KERNEL: call(counted), "torch's products": call(lambda *args: None)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from latentloop.inference.native import rows_linear_status

    env = start_run(args)
    status = rows_linear_status()
    results: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()},
                               "kernel": status, "products": {}, "first_token": None, "first_token_cold": None}
    if status != "native":
        print(f"no rows kernel here: {status}", file=sys.stderr)
        return results
    with tempfile.TemporaryDirectory() as tmp:
        model, _, _ = build_export(SHAPES[args.shape], args.prompt_len + 1, args.seed, Path(tmp))
    with torch.inference_mode():
        for rows in args.rows:
            print(f"{rows} rows ...", file=sys.stderr, flush=True)
            for dtype, variants in product_variants(model, rows).items():
                results["products"][f"{dtype}, {rows} rows"] = paired(variants, args.repeats)
    prompt = [1 + i % 250 for i in range(args.prompt_len)]
    print(f"one-token generate, {args.prompt_len}-token prompt ...", file=sys.stderr, flush=True)
    kernel_calls = [0]
    results["first_token"] = paired(first_token_variants(model, prompt, kernel_calls), args.repeats)
    if kernel_calls[0] == 0:  # torch's products on both sides would be labelled the kernel's
        raise SystemExit(f"prefill_products: the one-token generate never called the rows kernel at a "
                         f"{args.prompt_len}-token prompt (products.accelerated_linear chose torch's products)")
    flush = torch.ones(FLUSH_MIB << 18)  # float32: 4 bytes each
    results["first_token_cold"] = paired(first_token_variants(model, prompt), args.repeats,
                                         before=lambda: flush.add_(1.0))
    return results


def markdown_table(results: dict[str, Any]) -> str:
    args = results["args"]
    if results["first_token"] is None:
        return f"no rows kernel here: {results['kernel']}"
    rows = [(f"{args['shape']} shape, {args['threads']} thread(s): what", "variant", "ms: median [range]",
             "time over the kernel's, same round: median [quartiles]")]
    entries = {**{f"the model's products, {name}": e for name, e in results["products"].items()},
               f"one-token generate, {args['prompt_len']}-token prompt, warm": results["first_token"],
               f"the same, cold ({FLUSH_MIB} MiB written before each call)": results["first_token_cold"]}
    for what, entry in entries.items():
        for variant, seconds in entry["seconds"].items():
            over = entry["over_kernel"].get(variant)
            quartiles = statistics.quantiles(over, n=4) if over and len(over) > 1 else None
            rows.append((what, variant, spread([s * 1e3 for s in seconds], "{:.3f}"),
                         "—" if over is None else f"{statistics.median(over):.2f}"
                         + ("" if quartiles is None else f" [{quartiles[0]:.2f}, {quartiles[2]:.2f}]")))
            what = ""
    return render_table(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="small")
    p.add_argument("--rows", default="2,16,64", help="comma-separated row counts of the products")
    p.add_argument("--prompt-len", type=int, default=16,
                   help=f"the one-token generate's prompt: its prefill's rows, within the rows the kernel takes "
                        f"({ROWS_KERNEL_MIN_ROWS}-{ROWS_KERNEL_MAX_ROWS})")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=100, help="paired rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes comma-separated integers, got {args.rows!r}")
    if min(args.rows) < 1:
        p.error("--rows must all be >= 1")
    require_at_least_one(p, args, ("prompt_len", "threads", "repeats"))
    if not ROWS_KERNEL_MIN_ROWS <= args.prompt_len <= ROWS_KERNEL_MAX_ROWS:
        # outside them `accelerated_linear` takes torch's products: the "rows kernel" row would time those
        p.error(f"--prompt-len must be within the rows kernel's {ROWS_KERNEL_MIN_ROWS}-{ROWS_KERNEL_MAX_ROWS} rows "
                f"(products.ROWS_KERNEL_MIN_ROWS / MAX_ROWS), got {args.prompt_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
