"""The variants' training steps over gpt's, eager and compiled (issue 16): the trainer's optimizer
step (the arch's registered objective, backward, grad clip, the optimizer) with the model as the trainer
runs it, plain and under `train.compile`. Every arch runs three ways, all interleaved round by
round in one process: eager, its whole forward compiled, and each block compiled
(`train.compile_scope` whole / blocks). "Compiled over eager" and "whole over blocks" pair the
steps of the same round (before 2026-12-03 the eager rounds ran minutes before the compiled ones).

Shape: the baseline's (4 layers, d=256, 4 heads, vocab 256; T=256, batch 16, random tokens), with the
trainer's default optimizer and precision (`--optimizer`, `--dtype`: Muon, bf16 autocast where the CPU
has bf16 instructions; runs before 2026-12-03 used AdamW in float32).
fbt with K=2 passes every step (its recipe mixes K=2 and K=3; a fixed K keeps rounds comparable);
lrt with its default objective (interleaved, S=2); rgpt at equal depth (prelude 1, core 1, coda 1,
R=2: its objective draws the depth r in {1, 2} per step, and each step is charged for the depth it
ran). "Per FLOP" divides a round's time per token by the FLOPs per token the objective charged for
that step, over gpt's: the overhead at equal FLOPs. The issue sets no training targets for the
variants; this is the training half of "the variants' overhead ratios on the fast path".

    .venv/bin/python -m benchmarks.fast_training [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    add_allocator_flag,
    benchmark_main,
    render_table,
    require_at_least_one,
    require_threads,
    spread,
    start_run,
    training_comparison,
)
from benchmarks.fast_decode import RGPT_EQUAL_DEPTH, SHAPE
from latentloop.config import DTYPES, OPTIMIZERS, TrainConfig

FBT_PASSES = 2
FIXED_PASSES = dict(feedback_start=0.0, pass_mix=(0.0, 1.0))  # fbt's recipe at K=2 on every step
# mor at rgpt's depth: one prelude, one shared core block applied up to twice, one coda
MOR_EQUAL_DEPTH = dict(n_pre=1, n_rec=1, n_coda=1, recursions=2)
# name -> (arch, overrides, fixed fbt passes or None), as `training_comparison` takes them
VARIANTS = {"gpt": ("gpt", {}, None),
            f"fbt K={FBT_PASSES}": ("fbt", FIXED_PASSES, FBT_PASSES),
            "lrt": ("lrt", {}, None),
            "rgpt": ("rgpt", RGPT_EQUAL_DEPTH, None),
            f"rfbt K={FBT_PASSES}": ("rfbt", {**RGPT_EQUAL_DEPTH, **FIXED_PASSES}, FBT_PASSES),
            "mor": ("mor", MOR_EQUAL_DEPTH, None)}
BASE = "gpt"  # every row is also shown over gpt run the same way, so gpt always runs
SCOPES = ("whole", "blocks")  # train.compile_scope: every arch runs compiled both ways, beside eager


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(args)
    device = torch.device("cpu")
    chosen = selected(args.archs)
    shaped = {name: (arch, {**SHAPE, "sequence_len": args.train_seq_len}, overrides, passes)
              for name, (arch, overrides, passes) in VARIANTS.items() if name in chosen}
    results: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()}, "modes": {}}
    # every arch eager, and compiled both ways (train.compile_scope whole / blocks), in the same rounds
    compiled_names = {f"{name} [{scope}]": (name, scope) for name in shaped for scope in SCOPES}
    variants = {**shaped, **{key: shaped[name] for key, (name, _) in compiled_names.items()}}
    print(f"training: at least {args.train_warmup} warmup steps per arch and way, until each has run every kind "
          f"of forward its timed steps take (the compiles happen there), then {args.train_steps} interleaved "
          f"rounds of {len(variants)} steps ...", flush=True)
    raw = training_comparison(variants, args, device, scopes={key: scope for key, (_, scope) in compiled_names.items()},
                              compiled={key: key in compiled_names for key in variants})
    per_token = {name: [s / r["tokens_per_step"] for s in r["step_s_all"]] for name, r in raw.items()}
    per_flop = {name: [t / f for t, f in zip(per_token[name], r["flops_per_token_all"])]
                for name, r in raw.items()}
    # each row over gpt run the same way ("fbt K=2 [blocks]" over "gpt [blocks]")
    base = {name: f"gpt [{compiled_names[name][1]}]" if name in compiled_names else "gpt" for name in raw}
    for mode, names in (("eager", list(shaped)), ("compiled", list(compiled_names))):  # results by mode, as before
        results["modes"][mode] = {name: {
            "tok_s_all": [1 / t for t in per_token[name]],
            "over_gpt_all": [t / b for t, b in zip(per_token[name], per_token[base[name]])],
            "flops_over_gpt": statistics.median(raw[name]["flops_per_token_all"]) / statistics.median(
                raw[base[name]]["flops_per_token_all"]),
            "over_gpt_per_flop_all": [t / b for t, b in zip(per_flop[name], per_flop[base[name]])],
            "final_loss": raw[name]["final_loss"]} for name in names}
    eager, compiled = results["modes"]["eager"], results["modes"]["compiled"]
    for name in shaped:
        for scope in SCOPES:  # paired by round: the two ran in the same round
            entry = compiled[f"{name} [{scope}]"]
            entry["speedup_over_eager_all"] = [c / e for c, e in zip(entry["tok_s_all"], eager[name]["tok_s_all"])]
        whole, blocks = (compiled[f"{name} [{scope}]"]["tok_s_all"] for scope in SCOPES)
        compiled[f"{name} [{SCOPES[0]}]"]["whole_over_blocks_all"] = [w / b for w, b in zip(whole, blocks)]
    return results


def arch_names(archs: str | None) -> set[str] | None:
    """The arch names of `--archs` (comma-separated), or None for all."""
    return None if archs is None else {a.strip() for a in archs.split(",")}


def selected(archs: str | None) -> list[str]:
    """The VARIANTS rows whose arch is in the comma-separated `archs` (all when None), gpt always."""
    wanted = arch_names(archs)
    return [name for name, (arch, _, _) in VARIANTS.items() if wanted is None or arch in wanted or name == BASE]


def markdown_table(results: dict[str, Any]) -> str:
    args = results["args"]
    rows = [(f"Arch (T={args['train_seq_len']}, batch {args['train_batch']})", "mode", "tok/s",
             "over gpt (time per token)", "FLOPs over gpt", "over gpt per FLOP", "compiled over eager (tok/s)",
             "whole over blocks (paired rounds)")]
    for mode, entries in results["modes"].items():
        for name, entry in entries.items():
            speedup, whole = entry.get("speedup_over_eager_all"), entry.get("whole_over_blocks_all")
            rows.append((name, mode, spread(entry["tok_s_all"], "{:,.0f}"), spread(entry["over_gpt_all"], "{:.3f}x"),
                         f"{entry['flops_over_gpt']:.3f}x", spread(entry["over_gpt_per_flop_all"], "{:.3f}x"),
                         spread(speedup, "{:.2f}x") if speedup else "—", spread(whole, "{:.3f}x") if whole else "—"))
    return render_table(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train-seq-len", type=int, default=256)
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--train-warmup", type=int, default=3,
                   help="untimed steps of each arch and way first, at least (compiling happens here): each runs "
                        "more until every kind of forward its timed steps take has run (rgpt's two depths)")
    p.add_argument("--rounds", dest="train_steps", type=int, default=5,
                   help="interleaved rounds of one step per arch (median and range reported)")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=TrainConfig.optimizer,
                   help="train.optimizer (the trainer's default; adamw for the runs before Muon)")
    p.add_argument("--dtype", choices=DTYPES, default=TrainConfig.dtype,
                   help="train.dtype: auto is bf16 autocast where the CPU has bf16 instructions")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    known = dict.fromkeys(arch for arch, _, _ in VARIANTS.values())
    p.add_argument("--archs", default=None, help=f"comma-separated archs to run, from: {', '.join(known)} "
                                                 f"(default: all; gpt always runs, the rows' base)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    add_allocator_flag(p)
    args = p.parse_args(argv)
    require_at_least_one(p, args, ("train_seq_len", "train_batch", "train_steps"))
    require_threads(p, args)
    unknown = (arch_names(args.archs) or set()) - set(known)
    if unknown:
        p.error(f"--archs: unknown {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    if args.train_warmup < 1:
        p.error("--train-warmup must be >= 1: the first compiled step compiles")
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
