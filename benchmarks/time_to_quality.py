"""Time to quality (issue 25): how long latentloop's default recipe takes to reach the validation
BPB that nanoGPT's `model.py` reaches in N steps, on this CPU, in the same run.

1. nanoGPT (`../shared/anchors/nanogpt_model.py`, unmodified) at the preset's shape (layers, width,
   heads, T; bias off, dropout 0), trained fp32 with AdamW by its own recipe (below) for N steps on
   the same batches of the same data (`stdlib`, byte tokenizer, batch 16): its validation BPB on the
   whole validation split is the target.
2. Each registered architecture (or `--archs`), built at the same preset, trained by latentloop's
   default recipe (`TrainConfig()`'s optimizer, lr, schedule, precision, with `steps` = N) and by
   each of `--recipes` (changes to it: adamw, bf16, fp32), through the trainer's own step
   (`latentloop.train.train_step`). Its weights are kept every `--check-every` steps; after the run
   the first kept state whose whole-split validation BPB is at or below the target is found by
   bisection (validation BPB falls with training here: the search assumes it), and its time is the
   summed wall-clock of the steps up to it. The BPB after all N steps is reported too (the quality
   of each recipe at equal steps). Evaluation time is excluded for both models.
3. The figure: nanoGPT's N-step training time over latentloop's time to the target, per repeat (the
   jobs back to back, the order rotating between repeats), median and range over `--repeats`, with
   the contention meter around every run (the share of the CPUs other processes used meanwhile).
   Training is deterministic (same seed, data and threads), so only the first repeat searches:
   later ones rerun each job up to the step it found, for the time, and check that the weights
   there are the first repeat's bit for bit (nanoGPT's too), evaluating again where they are not.

nanoGPT's recipe is the one its repository ships for a small character-level model trained on a
laptop CPU (`config/train_shakespeare_char.py`: AdamW lr 1e-3 with betas (0.9, 0.99), weight decay
0.1 on the matrices and embeddings (its `configure_optimizers`), 100 warmup steps, cosine to lr/10
at `lr_decay_iters` = max_iters, grad clip 1.0) with the warmup cut to a tenth of N for short runs.
Its `train.py` defaults (lr 6e-4, 2000 warmup steps, decay over 600,000) are for GPT-2 on GPUs:
after N = a few hundred steps it would still be warming up, and the ratio would mean nothing.

`--precision-check` instead trains every arch for N steps under each `train.dtype` (float32,
bfloat16) with everything else equal and reports both validation BPBs (whole split) and the step
time: the measurement that decides whether bf16 may be the CPU default (within 1% BPB). Each of
`--repeats` runs both dtypes back to back, the order alternating between repeats (float32 first in
the first); the step time leaves out each run's first `PRECISION_UNTIMED_STEPS` steps (allocations,
the optimizer's states, oneDNN's first kernels), and the speedup is float32's step time over
bf16's of the same repeat: median [min, max] over the repeats.

    .venv/bin/python -m benchmarks.time_to_quality [--preset tiny] [--steps 300] [--repeats 3] \
        [--archs gpt fbt] [--recipes default adamw bf16 fp32]
    .venv/bin/python -m benchmarks.time_to_quality --precision-check --preset small --steps 100
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import latentloop
from benchmarks.baseline import load_nanogpt
from benchmarks.common import (
    ContentionMeter,
    benchmark_main,
    render_table,
    require_at_least_one,
    require_threads,
    spread,
    start_run,
)
from latentloop.archs import ARCHS, build_objective
from latentloop.config import PRESETS, DataConfig, RunConfig, TrainConfig, model_config
from latentloop.data import TokenLoader, load_tokenizer
from latentloop.eval.loss import evaluate_loss
from latentloop.optim import build_optimizers, lr_multiplier, set_lr
from latentloop.runtime import cpu_bf16_support, prepare_data, resolve_dtype
from latentloop.train import FiniteGuard, train_step

DATA_SOURCE = "stdlib"
BATCH_SIZE = 16  # latentloop's default micro-batch (TrainConfig.batch_size), for both models
EVAL_BATCH = 32  # sequences per validation forward (only the speed of the evaluation depends on it)
# nanoGPT's config/train_shakespeare_char.py (see the docstring)
NANOGPT_LR, NANOGPT_MIN_LR = 1e-3, 1e-4
NANOGPT_BETAS = (0.9, 0.99)
NANOGPT_WEIGHT_DECAY = 0.1
NANOGPT_WARMUP = 100
NANOGPT_WARMUP_SHARE = 0.1  # short runs: warmup at most this share of the steps
NANOGPT_GRAD_CLIP = 1.0
PRECISIONS = ("float32", "bfloat16")
# The precision check's step time starts after this many steps of each run: the first step creates
# the optimizer's states and meets every kernel for the first time (at the test preset on 2 cores:
# 43 / 61 ms against ~30 for float32 / bf16 as a process's first runs, 38 / 27 as its second), and
# the second was still slow in some runs (40 ms)
PRECISION_UNTIMED_STEPS = 2
# latentloop recipes a run can compare: the default, and changes to it (TrainConfig fields)
RECIPES: dict[str, dict[str, Any]] = {"default": {}, "adamw": {"optimizer": "adamw"}, "bf16": {"dtype": "bfloat16"},
                                      "fp32": {"dtype": "float32"},
                                      "bf16+adamw": {"dtype": "bfloat16", "optimizer": "adamw"}}


def nanogpt_lr(step: int, steps: int) -> float:
    """nanoGPT's schedule (linear warmup, cosine from lr to min_lr at lr_decay_iters = steps)."""
    warmup = max(1, min(NANOGPT_WARMUP, int(steps * NANOGPT_WARMUP_SHARE)))
    if step < warmup:
        return NANOGPT_LR * (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return NANOGPT_MIN_LR + 0.5 * (1.0 + math.cos(math.pi * progress)) * (NANOGPT_LR - NANOGPT_MIN_LR)


class Bench:
    """The data, tokenizer and shape every run of one invocation shares."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tokenizer = load_tokenizer("byte")
        config = RunConfig(model=model_config("gpt", args.preset), data=DataConfig(source=args.data))
        config.model.vocab_size, config.model.bos_id = self.tokenizer.vocab_size, self.tokenizer.bos_id
        self.data = prepare_data(config, self.tokenizer, progress=False)
        self.shape = PRESETS[args.preset]
        self.seq_len = self.shape["sequence_len"]
        self.token_bytes = self.tokenizer.token_byte_lengths()
        val = self.data.val if args.val_tokens is None else self.data.val[:args.val_tokens]
        self.val = val

    def loader(self) -> TokenLoader:
        return TokenLoader(self.data.train, self.args.batch_size, self.seq_len, seed=self.args.seed)

    def val_bpb(self, model: torch.nn.Module, logits_fn=None) -> float:
        kwargs = {"logits_fn": logits_fn} if logits_fn is not None else {}
        return evaluate_loss(model, self.val, self.token_bytes, EVAL_BATCH, self.seq_len, **kwargs)["bpb"]


def nanogpt_logits(model: torch.nn.Module, x: torch.Tensor, written: torch.Tensor | None = None) -> torch.Tensor:
    """nanoGPT returns every position's logits only when given targets (its loss is then discarded).
    `written` (eval.loss's `LogitsFn`: which inputs a chat wrote) changes nothing for plain text."""
    x = x.contiguous()  # nanoGPT flattens the targets with .view
    return model(x, x)[0]


def train_nanogpt(bench: Bench, steps: int) -> dict[str, Any]:
    """nanoGPT trained for `steps` (fp32, its AdamW and schedule): its training time and the model."""
    nanogpt = load_nanogpt()
    torch.manual_seed(bench.args.seed)
    model = nanogpt.GPT(nanogpt.GPTConfig(block_size=bench.seq_len, vocab_size=bench.tokenizer.vocab_size,
                                          n_layer=bench.shape["n_layer"], n_head=bench.shape["n_head"],
                                          n_embd=bench.shape["n_embd"], dropout=0.0, bias=False)).train()
    optimizer = model.configure_optimizers(NANOGPT_WEIGHT_DECAY, NANOGPT_LR, NANOGPT_BETAS, "cpu")
    loader = bench.loader()
    meter, seconds = ContentionMeter().start(), 0.0
    for step in range(steps):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = nanogpt_lr(step, steps)
        x, y = loader.next_batch()
        _, loss = model(x, y.contiguous())  # nanoGPT flattens the targets with .view
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), NANOGPT_GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # nanoGPT's loop reads the loss to log it
        seconds += time.perf_counter() - start
    return {"train_s": seconds, "others_cpu_share": meter.stop(), "params": sum(p.numel() for p in model.parameters()),
            "model": model}


def train_latentloop(bench: Bench, arch: str, steps: int, check_every: int, stop_at: int | None = None,
                     **train: Any) -> tuple[list[tuple[int, float, dict]], dict[str, Any]]:
    """`arch` trained by the default recipe (`train` overrides it) for `steps` (the schedule's
    length; the run stops after `stop_at` when given) through the trainer's step; returns the kept
    states (step, seconds of training so far, weights) and the run's facts."""
    torch.manual_seed(bench.args.seed)
    model = latentloop.build(arch, preset=bench.args.preset, vocab_size=bench.tokenizer.vocab_size,
                             bos_id=bench.tokenizer.bos_id).train()
    cfg = TrainConfig(steps=steps, batch_size=bench.args.batch_size, seed=bench.args.seed, device="cpu", **train)
    objective = build_objective(model.config, cfg)
    loader, guard, device = bench.loader(), FiniteGuard(torch.device("cpu")), torch.device("cpu")
    optimizers = build_optimizers(model, cfg, resolve_dtype(device, cfg.dtype))
    kept: list[tuple[int, float, dict]] = []
    meter, step_seconds = ContentionMeter().start(), []
    last = steps if stop_at is None else stop_at
    for step in range(last):
        start = time.perf_counter()
        set_lr(optimizers, lr_multiplier(step, cfg))
        train_step(model, model, objective, loader.next_batch, step, optimizers, cfg, device, guard)
        step_seconds.append(time.perf_counter() - start)
        if (step + 1) % check_every == 0 or step + 1 == last:
            kept.append((step + 1, sum(step_seconds), copy.deepcopy(model.state_dict())))
    facts = {"train_s": sum(step_seconds), "step_s_all": step_seconds, "steps_run": last,
             "others_cpu_share": meter.stop(), "params": model.num_params(),
             "precision": resolve_dtype(device, cfg.dtype), "optimizer": cfg.optimizer}
    return kept, {"model": model, **facts}


def first_reaching(bench: Bench, model: torch.nn.Module, kept: list[tuple[int, float, dict]], target: float,
                   evaluated: dict[int, float] | None = None) -> tuple[int, float, float] | None:
    """(step, seconds, val BPB) of the first kept state at or below `target`, by bisection over the
    kept states (the last is evaluated first: None when even it misses). `evaluated` collects the
    val BPB of every state evaluated, by index."""
    evaluated = {} if evaluated is None else evaluated

    def bpb(i: int) -> float:
        if i not in evaluated:
            model.load_state_dict(kept[i][2])
            evaluated[i] = bench.val_bpb(model)
        return evaluated[i]

    if bpb(len(kept) - 1) > target:
        return None
    lo, hi = -1, len(kept) - 1  # kept[hi] reaches the target; kept[lo] (if any) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bpb(mid) <= target:
            hi = mid
        else:
            lo = mid
    return kept[hi][0], kept[hi][1], evaluated[hi]


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def time_to_quality(bench: Bench, archs: list[str]) -> dict[str, Any]:
    """Every job (nanoGPT, and each arch under each recipe) trained back to back per repeat, the
    order rotating between repeats. The first repeat finds each job's step k at the target (after
    nanoGPT's BPB is known) and its BPB after all N steps; training is deterministic (same seed,
    data and threads), so a later repeat reruns a job only up to k for its time, and checks that
    its weights there equal the first repeat's bit for bit (else they are evaluated again)."""
    args = bench.args
    jobs = ["nanogpt", *(f"{arch}/{recipe}" for arch in archs for recipe in args.recipes)]
    runs: dict[str, list[dict[str, Any]]] = {job: [] for job in jobs}
    first: dict[str, dict[str, Any]] = {}  # per job, what the first repeat found
    for repeat in range(args.repeats):
        shift = repeat % len(jobs)
        pending = {}
        for job in jobs[shift:] + jobs[:shift]:
            if job == "nanogpt":
                result = train_nanogpt(bench, args.steps)
                model = result.pop("model")
                weights = model.state_dict()
                if repeat == 0 or not _same_weights(weights, first["nanogpt"]["weights"]):
                    result["val_bpb"] = bench.val_bpb(model, nanogpt_logits)
                    result["evaluated"] = True
                else:
                    result["val_bpb"], result["evaluated"] = first["nanogpt"]["val_bpb"], False
                if repeat == 0:
                    first["nanogpt"] = {"weights": copy.deepcopy(weights), "val_bpb": result["val_bpb"]}
                runs["nanogpt"].append(result)
                print(f"repeat {repeat + 1}: nanoGPT {args.steps} steps in {result['train_s']:.1f} s, val BPB "
                      f"{result['val_bpb']:.4f} (others used {_share(result['others_cpu_share'])})", flush=True)
                continue
            arch, recipe = job.split("/")
            if repeat == 0:
                pending[job] = train_latentloop(bench, arch, args.steps, args.check_every, **RECIPES[recipe])
                print(f"repeat 1: {job} {args.steps} steps in {pending[job][1]['train_s']:.1f} s (others used "
                      f"{_share(pending[job][1]['others_cpu_share'])})", flush=True)
                continue
            found = first[job]
            if found["step"] is None:
                continue  # the first repeat never reached the target: nothing to time again
            kept, facts = train_latentloop(bench, arch, args.steps, found["step"], stop_at=found["step"],
                                           **RECIPES[recipe])
            model = facts.pop("model")
            row = {**facts, "target_bpb": found["target_bpb"], "step": found["step"], "time_s": kept[-1][1],
                   "final_bpb": found["final_bpb"]}
            if _same_weights(kept[-1][2], found["weights"]):
                row["val_bpb"], row["evaluated"] = found["val_bpb"], False
            else:
                row["val_bpb"], row["evaluated"] = bench.val_bpb(model), True
            pending[job] = row
        if repeat > 0:  # this repeat's nanoGPT time, wherever it fell in the order
            for job, row in pending.items():
                _record(runs[job], {**row, "nanogpt_s": runs["nanogpt"][-1]["train_s"]}, repeat, job)
        else:
            target = runs["nanogpt"][0]["val_bpb"]
            for job, (kept, facts) in pending.items():
                evaluated: dict[int, float] = {}
                reached = first_reaching(bench, facts.pop("model"), kept, target, evaluated)
                found = {"step": None, "target_bpb": target, "final_bpb": evaluated[len(kept) - 1]}
                row = {**facts, "target_bpb": target, "nanogpt_s": runs["nanogpt"][0]["train_s"],
                       "final_bpb": found["final_bpb"], "evaluated": True}
                if reached is not None:
                    step, seconds, bpb = reached
                    found.update(step=step, val_bpb=bpb, weights=next(w for s, _, w in kept if s == step))
                    row.update(step=step, time_s=seconds, val_bpb=bpb)
                first[job] = found
                _record(runs[job], row, repeat, job)
    for found in first.values():
        found.pop("weights", None)
    return runs


def _record(rows: list[dict[str, Any]], row: dict[str, Any], repeat: int, job: str) -> None:
    row["reached"] = "val_bpb" in row and row["val_bpb"] <= row["target_bpb"]
    if row["reached"]:
        row["speedup"] = row["nanogpt_s"] / row["time_s"]
        print(f"repeat {repeat + 1}: {job} reached {row['target_bpb']:.4f} at step {row['step']} after "
              f"{row['time_s']:.1f} s of training: {row['speedup']:.2f}x nanoGPT's time; BPB after all steps "
              f"{row['final_bpb']:.4f} (others used {_share(row['others_cpu_share'])})", flush=True)
    else:
        print(f"repeat {repeat + 1}: {job} did not reach {row['target_bpb']:.4f}; BPB after all steps "
              f"{row['final_bpb']:.4f}", flush=True)
    rows.append(row)


def precision_check(bench: Bench, archs: list[str]) -> dict[str, Any]:
    """Every arch for N steps under each dtype, `--repeats` times, the dtypes' order alternating
    between repeats: the final weights' whole-split val BPB (evaluated in fp32; a later repeat's
    weights equal to the first's are not evaluated again: training is deterministic) and the step
    time after the first PRECISION_UNTIMED_STEPS; float32's step time over bf16's per repeat."""
    args = bench.args
    untimed = min(PRECISION_UNTIMED_STEPS, args.steps - 1)  # at least one step timed, however it was called
    results: dict[str, dict[str, Any]] = {}
    for arch in archs:
        runs: dict[str, list[dict[str, Any]]] = {dtype: [] for dtype in PRECISIONS}
        first: dict[str, dict[str, Any]] = {}  # per dtype, the first repeat's weights and BPB
        for repeat in range(args.repeats):
            # alternating: neither dtype is always the process's first run after the other's
            for dtype in PRECISIONS if repeat % 2 == 0 else PRECISIONS[::-1]:
                kept, facts = train_latentloop(bench, arch, args.steps, args.steps, dtype=dtype)
                model, weights = facts.pop("model"), kept[-1][2]
                if dtype in first and _same_weights(weights, first[dtype]["weights"]):
                    facts["val_bpb"], facts["evaluated"] = first[dtype]["val_bpb"], False
                else:
                    facts["val_bpb"], facts["evaluated"] = bench.val_bpb(model), True
                first.setdefault(dtype, {"weights": weights, "val_bpb": facts["val_bpb"]})
                facts["timed_step_s"] = statistics.mean(facts["step_s_all"][untimed:])
                runs[dtype].append(facts)
                print(f"repeat {repeat + 1}: {arch} {dtype}: val BPB {facts['val_bpb']:.4f}, {facts['train_s']:.1f} s, "
                      f"{facts['timed_step_s'] * 1e3:.1f} ms a step after the first {untimed} "
                      f"(others used {_share(facts['others_cpu_share'])})", flush=True)
        ratios = [fp32["timed_step_s"] / bf16["timed_step_s"] for fp32, bf16 in zip(runs["float32"], runs["bfloat16"])]
        results[arch] = {**runs, "untimed_steps": untimed,
                         "bpb_change": runs["bfloat16"][0]["val_bpb"] / runs["float32"][0]["val_bpb"] - 1,
                         "speedup_all": ratios, "speedup": statistics.median(ratios),
                         "speedup_min": min(ratios), "speedup_max": max(ratios)}
    return results


def _share(value: float | None) -> str:
    return "?" if value is None else f"{value:.0%}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(args)
    env["cpu_bf16_support"] = cpu_bf16_support()
    archs = args.archs or list(ARCHS)
    bench = Bench(args)
    results: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()},
                               "val_tokens": int(len(bench.val)),
                               "recipe": TrainConfig().__dict__ | {"steps": args.steps}}
    if args.precision_check:
        results["precision"] = precision_check(bench, archs)
    else:
        if load_nanogpt() is None:
            raise SystemExit("time_to_quality: ../shared/anchors/nanogpt_model.py is absent; nothing to compare with")
        results["runs"] = time_to_quality(bench, archs)
    return results


def markdown_table(results: dict[str, Any]) -> str:
    args = results["args"]
    if "precision" in results:
        rows = [(f"Arch ({args['preset']}, {args['steps']} steps)", "val BPB fp32", "val BPB bf16", "bf16 vs fp32",
                 f"bf16 step-time speedup over {args['repeats']} repeats: median [min–max]")]
        for arch, r in results["precision"].items():
            rows.append((arch, spread([e["val_bpb"] for e in r["float32"]], "{:.4f}"),
                         spread([e["val_bpb"] for e in r["bfloat16"]], "{:.4f}"), f"{r['bpb_change']:+.2%}",
                         spread(r["speedup_all"], "{:.2f}x")))
        return render_table(rows)
    runs = results["runs"]
    nano = runs["nanogpt"]
    rows = [(f"{args['preset']}: target = nanoGPT's val BPB after {args['steps']} steps", "recipe",
             f"val BPB after {args['steps']} steps", "steps to target", "s to target", "nanoGPT s",
             "speedup (nanoGPT s / s to target)", "others' CPU")]
    rows.append(("nanoGPT", "AdamW, fp32", spread([r["val_bpb"] for r in nano], "{:.4f}"), str(args["steps"]),
                 spread([r["train_s"] for r in nano], "{:.1f}"), spread([r["train_s"] for r in nano], "{:.1f}"),
                 "1x", spread([r["others_cpu_share"] or 0.0 for r in nano], "{:.0%}")))
    for job, entries in runs.items():
        if job == "nanogpt":
            continue
        arch, recipe = job.split("/")
        final = f"{entries[0]['final_bpb']:.4f}" if entries else "—"
        reached = [e for e in entries if e["reached"]]
        if not reached:
            rows.append((arch, recipe, final, f"not within {args['steps']}", "—", "—", "—", "—"))
            continue
        missing = f" ({len(entries) - len(reached)} of {len(entries)} missed)" if len(reached) < len(entries) else ""
        rows.append((arch, recipe, final, spread([e["step"] for e in reached], "{:.0f}"),
                     spread([e["time_s"] for e in reached], "{:.1f}"),
                     spread([e["nanogpt_s"] for e in reached], "{:.1f}"),
                     spread([e["speedup"] for e in reached], "{:.2f}x") + missing,
                     spread([e["others_cpu_share"] or 0.0 for e in reached], "{:.0%}")))
    return render_table(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--data", default=DATA_SOURCE, help="the data source both models train and validate on")
    p.add_argument("--steps", type=int, default=300, help="N: nanoGPT's steps, and latentloop's schedule length")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="sequences per step, both models")
    p.add_argument("--check-every", type=int, default=10, help="latentloop's weights are kept every this many steps")
    p.add_argument("--archs", nargs="*", default=None, choices=list(ARCHS), help="default: every registered arch")
    p.add_argument("--recipes", nargs="+", default=["default"], choices=list(RECIPES),
                   help="latentloop recipes to time: the default and changes to it (see RECIPES)")
    p.add_argument("--val-tokens", type=int, default=None,
                   help="validate on the first this many tokens only (smoke tests); default: the whole split")
    p.add_argument("--precision-check", action="store_true",
                   help="compare float32 and bfloat16 training at N steps instead (no nanoGPT)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    require_at_least_one(p, args, ("steps", "repeats", "check_every", "batch_size"))
    require_threads(p, args)
    if args.precision_check and args.steps <= PRECISION_UNTIMED_STEPS:
        p.error(f"--precision-check needs --steps > {PRECISION_UNTIMED_STEPS}: the step time leaves out the first "
                f"{PRECISION_UNTIMED_STEPS}")
    if args.val_tokens is not None and args.val_tokens < PRESETS[args.preset]["sequence_len"] + 1:
        p.error("--val-tokens must hold at least one sequence (sequence_len + 1 tokens)")
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
