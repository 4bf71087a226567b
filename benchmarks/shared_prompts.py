"""Multiple-choice scoring with a question's context prefilled once for its choices, against every row
prefilled (`teacher_forced_logits(share_prompts=...)`, which CORE's scorer and the lm-eval adapter
call), paired in one process: CORE's rows of one task scored both ways, in random order each round.

Reported: the rows the prefills took each way, each way's seconds (median [range]) and the shared
way's time over the other's per round (median, quartiles, geometric mean [95% t-interval on the logs]). The two ways'
scores are checked to agree (the largest difference of a row's log-probability).

    .venv/bin/python -m benchmarks.shared_prompts [--task hellaswag_zeroshot] [--arch gpt] [--preset tiny]
        [--limit 100] [--rounds 5] [--threads 2] [--eval-dir ../shared/data/eval] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

import latentloop as ll
from benchmarks.common import (
    benchmark_main,
    describe_ratios,
    paired_ratios,
    render_table,
    require_rounds,
    require_threads,
    spread,
    start_run,
)
from latentloop.data.tokenizers import ByteTokenizer
from latentloop.eval import core

DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "eval"


def score(model, rows, share: bool) -> tuple[list, int]:
    """The task's rows scored with or without shared prompts, and the rows the prefills took."""
    prefilled = []
    prefill = model.prefill

    def counted(ids, *args, **kwargs):
        prefilled.append(ids.shape[0])
        return prefill(ids, *args, **kwargs)

    model.prefill = counted
    try:
        scores = core.score_continuations(model, rows, share_prompts=share)
    finally:
        del model.prefill  # the class's method again
    return scores, sum(prefilled)


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(args)
    if args.task not in core.CORE_TASKS:
        raise SystemExit(f"shared_prompts: unknown task {args.task!r}; one of {', '.join(core.CORE_TASKS)}")
    task = core.CORE_TASKS[args.task]
    path = core.find_task_file(args.eval_dir, task)
    if path is None:
        raise SystemExit(f"shared_prompts: no file of {args.task} in {args.eval_dir}")
    torch.manual_seed(0)
    model = ll.build(args.arch, preset=args.preset).eval()
    rows, _ = core.build_task_requests(task, core.shuffled(core.load_examples(path, task.kind)), ByteTokenizer(),
                                       args.limit)
    shared, shared_rows = score(model, rows, True)
    every, every_rows = score(model, rows, False)
    seconds: dict[str, list[float]] = {"shared": [], "every row": []}

    def timed(share: bool, name: str):
        def call():
            start = time.perf_counter()
            core.score_continuations(model, rows, share_prompts=share)
            seconds[name].append(time.perf_counter() - start)
        return call

    ratios = paired_ratios(timed(False, "every row"), timed(True, "shared"), args.rounds)
    return {"env": env, "task": args.task, "arch": args.arch, "preset": args.preset, "rows": len(rows),
            "prefilled_rows": {"shared": shared_rows, "every row": every_rows}, "seconds": seconds,
            "shared_over_every_row": ratios,
            "max_logprob_difference": max(abs(a.logprob - b.logprob) for a, b in zip(shared, every))}


def table(results: dict[str, Any]) -> str:
    lines = [render_table([("way", "rows prefilled", "seconds")] + [
        (name, f"{results['prefilled_rows'][name]:,} of {results['rows']:,}", spread(values, "{:.2f}"))
        for name, values in results["seconds"].items()])]
    lines.append(f"shared / every row: {describe_ratios(results['shared_over_every_row'])}")
    lines.append(f"largest difference of a row's log-probability: {results['max_logprob_difference']:.2e}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shared_prompts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="hellaswag_zeroshot", help="a CORE task (default: hellaswag_zeroshot)")
    parser.add_argument("--arch", default="gpt", choices=sorted(ll.archs.ARCHS))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--limit", type=int, default=100, help="examples of the task (default 100)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--eval-dir", type=Path, default=DEFAULT_EVAL_DIR, help="CORE's task files")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    require_rounds(parser, args)
    require_threads(parser, args)
    if args.limit < 1:
        parser.error(f"--limit must be at least 1, got {args.limit}")
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, table)


if __name__ == "__main__":
    sys.exit(main())
