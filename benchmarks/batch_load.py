"""A loaded server's continuous batch, in-process (issue 54): `serve.batch.SlotBatch`, the scheduler's
batch on the compiled path, given `serve_load --against`'s request mix (BOS and bytes of a stdlib
source, short and long prompts alternating, `--new-tokens` greedy tokens each, no stop token) with
`--rows` requests in flight: a new one joins for each that finishes, until `--requests` have finished.
No HTTP and no load generator, so what it times is the scheduler's own work, split into the decode
steps (`_decode_running`) and the joiners' prefill and placement (`_join_waiting`); the rest of each
step is the sampling. Every `--repeats` run warms the batch sizes first (`SlotBatch.warm`: compiled,
or loaded from the on-disk caches), then times the load; the table gives median [min-max] over runs.

To compare two versions of the code, run it from each checkout (`PYTHONPATH=...`) back to back, as a
change's log says; through HTTP and beside llama.cpp's server, `serve_load.py --against llama.cpp`.

    .venv/bin/python -m benchmarks.batch_load RUN [--rows 32] [--requests 160] [--short 32] [--long 352]
        [--new-tokens 128] [--threads 1] [--kv-dtype float32|float16] [--decode compiled|eager]
        [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import benchmark_main, render_table, require_at_least_one, require_threads, start_run
from benchmarks.serve_load import AGAINST_NEW_TOKENS, LONG_PROMPT, SHORT_PROMPT, prompt_source, request_mix

ROWS = 32  # requests in flight, as serve_load's concurrency 32 keeps
REQUESTS = 160  # as many as one of serve_load's cells finishes on the project's CPU
KV_DTYPES = {"float32": None, "float16": torch.float16}  # None: the model's own (float32), the default


def run_load(model, mix: list[list[int]], rows: int, requests: int, new_tokens: int, compile: bool,
             kv_dtype: torch.dtype | None) -> dict[str, float]:
    """One load through a fresh `SlotBatch`: seconds in all, in the decode steps and in the joins."""
    from latentloop.serve.batch import Member, Sampling, SlotBatch

    batch = SlotBatch(model, {}, compile=compile, kv_dtype=kv_dtype)
    batch.warm(rows)
    seconds = {"decode": 0.0, "join": 0.0}
    steps = 0

    def timed(name: str, method):
        def call() -> None:
            start = time.perf_counter()
            method()
            seconds[name] += time.perf_counter() - start
        return call

    # the batch's own methods, timed where `step` calls them (instance attributes shadow the class's)
    batch._decode_running = timed("decode", batch._decode_running)
    batch._join_waiting = timed("join", batch._join_waiting)
    sent = finished = 0

    def request() -> Member:
        nonlocal sent
        sent += 1
        return Member(list(mix[(sent - 1) % len(mix)]), new_tokens, Sampling(ignore_eos=True))

    batch.add([request() for _ in range(min(rows, requests))])
    start = time.perf_counter()
    while finished < requests:
        outputs = batch.step()
        if not outputs and not batch.waiting:
            raise RuntimeError(f"batch_load: the batch emptied with {finished} of {requests} requests finished")
        steps += 1
        done = sum(step.member.done for step in outputs)
        finished += done
        joining = min(done, requests - sent)
        if joining:
            batch.add([request() for _ in range(joining)])
    wall = time.perf_counter() - start
    return {"wall_s": wall, "decode_s": seconds["decode"], "join_s": seconds["join"], "steps": steps,
            "requests_per_s": requests / wall, "decode_ms_per_step": 1e3 * seconds["decode"] / steps}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import latentloop as ll

    env = start_run(args)
    model, tokenizer = ll.load(args.run)
    context = int(model.config.sequence_len)
    if args.long + args.new_tokens > context:
        raise SystemExit(f"batch_load: a long prompt ({args.long}) + --new-tokens ({args.new_tokens}) is more than "
                         f"the model's context ({context}); lower --long")
    mix = request_mix(tokenizer.bos_id, prompt_source(), args.short, args.long)
    loads = []
    for repeat in range(args.repeats):
        loads.append(run_load(model, mix, args.rows, args.requests, args.new_tokens, args.decode == "compiled",
                              KV_DTYPES[args.kv_dtype]))
        print(f"run {repeat}: " + ", ".join(f"{k} {v:.3f}" for k, v in loads[-1].items()), flush=True)
    return {"env": env, "run": str(args.run), "rows": args.rows, "requests": args.requests, "short": args.short,
            "long": args.long, "new_tokens": args.new_tokens, "decode": args.decode, "kv_dtype": args.kv_dtype,
            "loads": loads}


def table(results: dict[str, Any]) -> str:
    def spread(key: str, digits: int) -> str:
        values = [load[key] for load in results["loads"]]
        return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"

    share = [[f"{100 * load[key] / load['wall_s']:.0f}%" for load in results["loads"]]
             for key in ("decode_s", "join_s")]
    return render_table([
        ["rows", "requests", "requests/s", "decode ms a step", "wall s", "decode share", "join share"],
        [results["rows"], results["requests"], spread("requests_per_s", 2), spread("decode_ms_per_step", 2),
         spread("wall_s", 1), " ".join(share[0]), " ".join(share[1])]])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (`latentloop train --out`)")
    parser.add_argument("--rows", type=int, default=ROWS, help="requests in flight")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests to finish in each run")
    parser.add_argument("--short", type=int, default=SHORT_PROMPT, help="a short prompt's tokens, BOS included")
    parser.add_argument("--long", type=int, default=LONG_PROMPT, help="a long prompt's tokens, BOS included")
    parser.add_argument("--new-tokens", type=int, default=AGAINST_NEW_TOKENS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-dtype", default="float32", choices=sorted(KV_DTYPES))
    parser.add_argument("--decode", default="compiled", choices=["compiled", "eager"],
                        help="the compiled path's step (a server's `--decode compiled`), or the same step eagerly")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = parser.parse_args(argv)
    require_threads(parser, args)
    require_at_least_one(parser, args, ("rows", "requests", "short", "long", "new_tokens", "repeats"))
    if args.short > args.long:
        parser.error(f"--short ({args.short}) must not be longer than --long ({args.long})")
    if not (args.run / "config.json").is_file():
        parser.error(f"{args.run} is not a run folder (no config.json)")
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, table)


if __name__ == "__main__":
    sys.exit(main())
