"""bf16 training on a CPU without bf16 instructions: the trainer's step with latentloop's emulation
(`latentloop.precision`: float32 kernels on bf16-rounded values) against torch's own bf16 emulation
and against float32, at the compute ladder's sizes.

Each row is the trainer's step (`training_call`: the arch's objective, backward, grad clip, Muon) at a
ladder size (experiments/ladder.py: depth 8, T 128, the size's batch), built three times from one
seed: in float32, in bf16 with torch's own products (the emulation switched off: `autocast_for`
without it, and Muon built as on a CPU with bf16 instructions), and in bf16 emulated (what
`train.dtype=bfloat16` runs here). The emulated step is paired round by round with each of the
other two (`paired_ratios`, random order in each round): its time over theirs, geometric mean [95% t-interval on
the logs].

On a CPU with bf16 instructions torch's bf16 is native and nothing is emulated by default; the
comparison still runs (the emulation forced), and the header says so.

    .venv/bin/python -m benchmarks.cpu_bf16 [--sizes s,m] [--archs gpt,fbt,lrt,rgpt] [--threads 1]
        [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.common import (
    benchmark_main,
    describe_ratios,
    render_table,
    require_rounds,
    require_threads,
    start_run,
    timed_rounds,
    training_call,
)
from benchmarks.cpu_attention import BOS, LADDER, LADDER_SIZES, VOCAB, name_list
from latentloop import optim, precision, runtime
from latentloop.train import loop

WARMUP_ROUNDS = 2
DEFAULT_ARCHS = ["gpt", "fbt", "lrt", "rgpt"]


def _torch_bf16(device, dtype, emulate=True):
    """The trainer's autocast without the emulation: torch's own bf16 products."""
    return runtime.autocast_for(device, dtype, emulate=False)


@contextlib.contextmanager
def _emulation_forced():
    """The emulation as a CPU without bf16 instructions takes it (on one with them: forced)."""
    with mock.patch.object(runtime, "cpu_bf16_support", lambda: None), \
            mock.patch.object(optim, "cpu_bf16_support", lambda: None):
        yield


def training_steps(arch: str, size: str, args: argparse.Namespace) -> dict[str, Any]:
    """The emulated step's time over float32's and over torch's bf16's, paired rounds, at a ladder size."""
    ladder_size = LADDER_SIZES[size]
    shape = dict(n_layer=ladder_size.n_layer, n_embd=ladder_size.n_embd, n_head=ladder_size.n_head,
                 sequence_len=LADDER.seq_len, vocab_size=VOCAB, bos_id=BOS, tie_embeddings=True)
    torch.manual_seed(args.seed)
    data = torch.randint(0, VOCAB, (ladder_size.batch_size, LADDER.seq_len + 1))
    cpu = torch.device("cpu")

    def built(dtype: str) -> tuple:
        step_args = argparse.Namespace(seed=args.seed, grad_clip=1.0, optimizer="muon", dtype=dtype)
        return training_call(arch, shape, {}, step_args, cpu, data)

    fp32, info = built("float32")
    with mock.patch.object(optim, "cpu_bf16_support", lambda: "native"):  # Muon: torch's bf16 products
        torch_bf16, _ = built("bfloat16")
    with _emulation_forced():
        emulated_call, _ = built("bfloat16")

    def with_torch_bf16():
        with mock.patch.object(loop, "autocast_for", _torch_bf16):
            return torch_bf16()

    def emulated():
        with _emulation_forced():
            return emulated_call()

    ran = {"emulated": 0, "torch": 0}  # emulated linear layers each path ran in its warmup
    original = precision._Bf16Linear.apply
    for _ in range(WARMUP_ROUNDS):
        fp32()
        for name, call in (("torch", with_torch_bf16), ("emulated", emulated)):
            with mock.patch.object(precision._Bf16Linear, "apply",
                                   lambda *a, name=name: ran.__setitem__(name, ran[name] + 1) or original(*a)):
                call()
    if not ran["emulated"] or ran["torch"]:
        raise RuntimeError(f"the paths are not what they say: emulated linear layers {ran}")
    # the three in one set of rounds: each training step's schedule (rgpt's depth, fbt's passes) follows
    # its call count, so two separate pairings had float32 at steps 2-4 against the emulation at 5-7
    seconds = timed_rounds({"float32": fp32, "torch": with_torch_bf16, "emulated": emulated}, args.rounds)
    over_torch = [e / t for e, t in zip(seconds["emulated"], seconds["torch"])]
    over_fp32 = [e / f for e, f in zip(seconds["emulated"], seconds["float32"])]
    return {"arch": arch, "size": size, "params": info["params"], "over_torch_bf16": over_torch,
            "over_float32": over_fp32, "emulated_over_torch_bf16": describe_ratios(over_torch),
            "emulated_over_float32": describe_ratios(over_fp32)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(args)
    support = runtime.cpu_bf16_support()
    note = (f"this CPU has bf16 instructions ({support}): torch's bf16 is native here, and the emulation is forced"
            if support else "this CPU has no bf16 instructions: train.dtype=bfloat16 runs the emulation")
    print(note, flush=True)
    results: dict[str, Any] = {"env": env, "bf16_support": support, "rounds": args.rounds, "note": note,
                               "steps": []}
    for arch in args.archs:
        for size in args.sizes:
            row = training_steps(arch, size, args)
            results["steps"].append(row)
            print(f"{arch} {size}: emulated / torch's bf16 {row['emulated_over_torch_bf16']}; "
                  f"emulated / float32 {row['emulated_over_float32']}", flush=True)
    return results


def table(results: dict[str, Any]) -> str:
    rows = [["arch", "ladder size", "params", "step: emulated / torch's bf16", "step: emulated / float32"]]
    rows += [[r["arch"], r["size"], f"{r['params']:,}", r["emulated_over_torch_bf16"], r["emulated_over_float32"]]
             for r in results["steps"]]
    return results["note"] + "\n\n" + render_table(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from latentloop.archs import ARCHS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=name_list(list(LADDER_SIZES)), default=["s", "m"],
                        help="ladder sizes (comma-separated)")
    parser.add_argument("--archs", type=name_list(sorted(ARCHS)), default=DEFAULT_ARCHS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds per step and comparison (at least 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = parser.parse_args(argv)
    require_threads(parser, args)
    require_rounds(parser, args)
    if not args.sizes or not args.archs:
        parser.error("--sizes and --archs each need at least one name")
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, table)


if __name__ == "__main__":
    sys.exit(main())
