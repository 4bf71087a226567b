"""Attention in a CPU bf16-autocast training step: float32 against bf16, cell by cell, and the rule
`models.backbone.attend` applies (float32 at head dim <= 16, at <= 128 keys, or at head dim <= 32 and <= 512
keys: where torch's bf16 flash backward was the slower one), then whole training steps with the rule
against bf16 everywhere.

1. Attention alone: one forward and backward of SDPA over (B, H, T, hd) with B x T = `--tokens` and
   H x hd = `--width`, float32 inputs against bf16 ones, paired round by round in random order
   (`paired_ratios`): float32's time over bf16's, geometric mean [95% t-interval on the logs]. The "rule" column is what
   `cpu_training_attention_in_fp32` picks there; "faster" says which the interval puts ahead.
2. Training steps: the trainer's step (`training_call`: the arch's objective, backward, grad clip,
   Muon) under bf16 autocast at the ladder's sizes (experiments/ladder.py: depth 8, T 128), with the
   rule on against the rule switched off (`fp32_attention_wins` patched to False: what every step ran
   before 2026-12-05), paired the same way: the rule's step time over bf16's.

Needs a CPU with bf16 instructions (`runtime.cpu_bf16_support`); elsewhere bf16 is emulated and the
question does not arise (`train.dtype=auto` trains in float32 there).

    .venv/bin/python -m benchmarks.cpu_attention [--cells 128x16,128x64,512x32] [--sizes xs,s,m,l]
        [--archs gpt,lrt] [--threads 1] [--rounds 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.common import (
    benchmark_main,
    describe_ratios,
    paired_ratios,
    ratio_interval,
    render_table,
    require_at_least_one,
    require_rounds,
    require_threads,
    start_run,
    training_call,
)
from experiments.ladder import CPU as LADDER
from latentloop.models import backbone
from latentloop.runtime import cpu_bf16_support

DEFAULT_CELLS = "128x16,128x64,128x128,256x32,256x64,512x16,512x32,512x48,1024x32,2048x16,2048x64"
LADDER_SIZES = {size.name: size for size in LADDER.sizes}
VOCAB, BOS = 259, 256  # the ladder's byte tokenizer (256 bytes and its special tokens)
WARMUP_ROUNDS = 2


def attention_cell(tokens: int, head_dim: int, batch_tokens: int, width: int, rounds: int) -> dict[str, Any]:
    """float32 over bf16 for one forward + backward at (keys, head dim), paired rounds."""
    batch, heads = max(1, batch_tokens // tokens), max(1, width // head_dim)
    shape = (batch, heads, tokens, head_dim)
    inputs = {dtype: [torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3)]
              for dtype in (torch.float32, torch.bfloat16)}
    grads = {dtype: torch.randn(shape, dtype=dtype) for dtype in inputs}

    def step(dtype: torch.dtype):
        def call():
            q, k, v = inputs[dtype]
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grads[dtype])
        return call

    for _ in range(WARMUP_ROUNDS):
        step(torch.float32)(), step(torch.bfloat16)()
    ratios = paired_ratios(step(torch.bfloat16), step(torch.float32), rounds)
    _, low, high = ratio_interval(ratios)
    faster = "float32" if high < 1 else "bf16" if low > 1 else "tie"
    rule = "float32" if backbone.cpu_training_attention_in_fp32(head_dim, tokens) else "bf16"
    return {"shape": list(shape), "ratios": ratios, "ratio": describe_ratios(ratios), "faster": faster, "rule": rule}


def training_steps(arch: str, size: str, args: argparse.Namespace) -> dict[str, Any]:
    """The rule's training step time over bf16-everywhere's, paired rounds, at a ladder size."""
    ladder_size = LADDER_SIZES[size]
    head_dim = ladder_size.n_embd // ladder_size.n_head
    shape = dict(n_layer=ladder_size.n_layer, n_embd=ladder_size.n_embd, n_head=ladder_size.n_head,
                 sequence_len=LADDER.seq_len, vocab_size=VOCAB, bos_id=BOS, tie_embeddings=True)
    torch.manual_seed(args.seed)
    data = torch.randint(0, VOCAB, (ladder_size.batch_size, LADDER.seq_len + 1))
    step_args = argparse.Namespace(seed=args.seed, grad_clip=1.0, optimizer="muon", dtype="bfloat16")
    ruled, info = training_call(arch, shape, {}, step_args, torch.device("cpu"), data)
    everywhere, _ = training_call(arch, shape, {}, step_args, torch.device("cpu"), data)

    def bf16_everywhere():
        with mock.patch.object(backbone, "fp32_attention_wins", lambda q, k, v: False):
            return everywhere()

    for _ in range(WARMUP_ROUNDS):
        ruled(), bf16_everywhere()
    ratios = paired_ratios(bf16_everywhere, ruled, args.rounds)
    return {"arch": arch, "size": size, "params": info["params"], "ratios": ratios, "ratio": describe_ratios(ratios),
            "attention": "float32" if backbone.cpu_training_attention_in_fp32(head_dim, LADDER.seq_len) else "bf16"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(args)
    support = cpu_bf16_support()
    if support is None:
        raise SystemExit("this CPU has no bf16 instructions: bf16 is emulated here and train.dtype=auto trains "
                         "in float32, so there is nothing to compare")
    results: dict[str, Any] = {"env": env, "bf16_support": support, "rounds": args.rounds, "cells": {}, "steps": []}
    for tokens, head_dim in args.cells:
        cell = attention_cell(tokens, head_dim, args.tokens, args.width, args.rounds)
        results["cells"][f"{tokens}x{head_dim}"] = cell
        print(f"T {tokens} hd {head_dim}: float32 / bf16 {cell['ratio']}; rule {cell['rule']}", flush=True)
    for arch in args.archs:
        for size in args.sizes:
            row = training_steps(arch, size, args)
            results["steps"].append(row)
            print(f"{arch} {size}: rule / bf16 everywhere {row['ratio']}", flush=True)
    return results


def table(results: dict[str, Any]) -> str:
    rows = [["keys x head dim", "(B, H, T, hd)", "float32 / bf16 (fwd + bwd)", "faster", "the rule picks"]]
    for cell_name, cell in results["cells"].items():
        rows.append([cell_name, tuple(cell["shape"]), cell["ratio"], cell["faster"], cell["rule"]])
    text = render_table(rows)
    if results["steps"]:
        steps = [["arch", "ladder size", "params", "attention under the rule", "step: rule / bf16 everywhere"]]
        steps += [[r["arch"], r["size"], f"{r['params']:,}", r["attention"], r["ratio"]] for r in results["steps"]]
        text += "\n\n" + render_table(steps)
    return text


def cell_list(text: str) -> list[tuple[int, int]]:
    """--cells: comma-separated TOKENSxHEAD_DIM pairs."""
    try:
        cells = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cells takes comma-separated TOKENSxHEAD_DIM pairs, got {text!r}") from None
    if any(len(cell) != 2 or min(cell) < 1 for cell in cells):
        raise argparse.ArgumentTypeError(f"--cells takes comma-separated TOKENSxHEAD_DIM pairs of positive "
                                         f"integers, got {text!r}")
    return cells


def name_list(choices: list[str]):
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r}: choose from {', '.join(choices)}")
        return names
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from latentloop.archs import ARCHS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=cell_list, default=cell_list(DEFAULT_CELLS))
    parser.add_argument("--tokens", type=int, default=2048, help="B x T of each attention cell")
    parser.add_argument("--width", type=int, default=256, help="H x hd of each attention cell")
    parser.add_argument("--sizes", type=name_list(list(LADDER_SIZES)), default=list(LADDER_SIZES),
                        help="ladder sizes for the training steps ('' for none)")
    parser.add_argument("--archs", type=name_list(sorted(ARCHS)), default=["gpt"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds per cell and step (at least 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = parser.parse_args(argv)
    require_threads(parser, args)
    require_rounds(parser, args)
    # `attention_cell` would clamp a batch or head count of 0 to 1 and time a shape not asked for
    require_at_least_one(parser, args, ("tokens", "width"))
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, table)


if __name__ == "__main__":
    sys.exit(main())
