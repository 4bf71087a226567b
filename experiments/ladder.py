"""The compute ladder (issue 52): every registered architecture at several model sizes and token
budgets, each run's validation BPB on the whole held-out split, so that the papers' scaling claims
are decided by curves rather than by one point. The decision rules were committed before any result:
experiments/logs/2026-12-05-ladder-rules.md.

    python experiments/ladder.py --out experiments/ladder-runs --threads 1     # the CPU ladder (~19 h of one core)
    python experiments/ladder.py --out experiments/ladder-runs --threads 1 --shard 1/2 &   # or one shard per core
    python experiments/ladder.py --out experiments/ladder-runs --threads 1 --shard 2/2
    python experiments/ladder.py --out experiments/ladder-runs --plan-only     # the plan and its estimate only
    python experiments/ladder.py --out runs/ladder-gpu --device cuda   # 10M-125M, one 9-minute H200 run
    python experiments/ladder.py --out runs/ladder-smoke --smoke   # tiny sizes, a few steps, minutes
    python experiments/ladder_claims.py --out experiments/ladder-runs          # fits, multipliers, the claims table

What one invocation does:
1. Plans: every variant (`ladder_variants`: each arch of `latentloop.archs.ARCHS`, an arch whose
   depth recurs in its isoFLOPs and isoPARAMs forms through its config's `iso_fields`, plus the
   claims' baselines) x size x seed x corpus x optimizer; per run its token budgets (multiples of
   gpt's non-embedding parameters at that size; gpt one doubling further) and, for an isoFLOPs form
   whose training FLOPs per token differ from gpt's by more than 5%, the budgets that match gpt's
   training FLOPs (the trainer's structural count, summed step by step exactly as the trainer logs it).
2. Estimates: a short throughput probe per variant and size (`probe`: the training FLOP rate over
   `PROBE_STEPS` steps after `PROBE_WARMUP` unmeasured ones, and each scoring's tokens/s on
   `PROBE_EVAL_BATCHES` validation batches) turns the plan's FLOPs and scored tokens into time,
   printed before anything trains. `--device cuda` sizes its budgets from the GPU benchmark's
   measured throughput instead (`gpu_rate`) so that the whole ladder fits `--budget-s`.
3. Runs, smallest size first, resumably: a finished run's record is kept and skipped; a run stopped
   midway continues from its trunk's last branch point (`work/<run>/trunk.pt`).

One run = one trunk under warmup-stable-decay: it trains at the stable learning rate and, at each
budget's decay start, forks a branch that decays over that budget's last `decay_fraction` (the lr
schedule of a straight WSD run of that length: `optim.lr_multiplier` is a function of the step and
the run's length only, so a branch is that run exactly; tests/test_ladder.py checks it against the
trainer's own `fit`). Every branch end is scored on the whole split (the decayed points the fits
use), and so is the trunk at each decay start, on a spread share of the split (its stable-phase
curve, for the plots). An objective that changes with the run's length (fbt's paper schedule) cannot
branch: each of its budgets is a straight run.

Records (`records/<run>.json`) hold the plan entry, the git commit and the files modified beside it,
the requested and the resolved config (model, train, data), every scored point (step, tokens,
training FLOPs, epochs of the training split, BPB per scoring) and the seconds spent. The default
folder, experiments/ladder-runs/, is in the repository: its records, `failed.json` and probe are
committed as the ladder goes, so a fresh checkout resumes where the last one stopped (the trunk
states under `work/` and the probe, this machine's timings, are local and ignored: a run in progress
when a machine goes restarts; `--no-probe` resumes without probing again).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import fcntl
import functools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.cpu_comparison import _matched_heavy_tail_mean  # noqa: E402
from experiments.ladder_fit import FLOPS_MATCH  # noqa: E402 (isoFLOPs: within 5%, as the fits refuse pairs)
from latentloop.archs import ARCHS, build_model, build_objective  # noqa: E402
from latentloop.checkpoint import LOCK_FILE, RunLock  # noqa: E402
from latentloop.config import DataConfig, ModelConfig, RunConfig, TrainConfig, model_config  # noqa: E402
from latentloop.errors import CheckpointError, LatentloopError, NonFiniteError  # noqa: E402
from latentloop.eval.loss import score_run, text_batches  # noqa: E402
from latentloop.models.backbone import cpu_training_attention_in_fp32  # noqa: E402
from latentloop.optim import lr_multiplier, set_lr  # noqa: E402
from latentloop.precision import EMULATION  # noqa: E402
from latentloop.runtime import (  # noqa: E402
    cpu_bf16_support,
    cuda_bf16_support,
    emulates_bf16,
    precision_note,
    resolve_dtype,
)
from latentloop.train import FiniteGuard, FlopsMemo, setup, train_step  # noqa: E402
from latentloop.util import first_line, give_default_mode, write_json_atomic  # noqa: E402

# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

CORPORA = {"stdlib": "stdlib", "english": "text:" + str(REPO.parent / "shared" / "data" / "text" /
                                                       "tinystories_sample.txt")}
ISO_FORMS = ("flops", "params")
# the paper's isoFLOPs shape: one prelude block, a one-block core applied R = depth - 2 times, one coda block
PAPER_EDGE_BLOCKS = 2
DECAY_FRACTION = 0.2  # WSD: each budget decays over its last fifth (TrainConfig's default)
OPTIMIZERS = ("muon", "adamw")  # the default, and the ablation column
PAPER_GATE_BIAS = 4.0  # RecurrentGPT's gate bias at initialisation (g ~ 0.98); the project's default is 0


@dataclass(frozen=True)
class Variant:
    """One column of the ladder: an arch, in an iso form or as it is, with model settings of its own."""

    name: str
    arch: str
    iso: str | None = None  # "flops" / "params": reshaped from gpt's depth by the config's `iso_fields`
    settings: tuple[tuple[str, Any], ...] = ()  # model fields set before the reshaping
    matched_heavy_tail: bool = False  # depth_mean set so heavy-tailed sampling trains uniform's mean depth
    why: str = ""  # for a claim baseline: the claim that needs it


# Beside each arch's own forms, the baselines the papers' claims are tested against.
CLAIM_BASELINES = (
    Variant("fbt-paper", "fbt", settings=(("recipe", "paper"),),
            why="FBT's data-efficiency claim, on the paper's schedule (feedback introduced late)"),
    Variant("rgpt-flops-heavy", "rgpt", "flops", settings=(("depth_sampling", "heavy_tail"),), matched_heavy_tail=True,
            why="RecurrentGPT beats heavy-tailed depth sampling at isoFLOPs"),
    # the fourth amendment (logs/2026-12-07-ladder-rules-paper-gate.md): RecurrentGPT's claims on the
    # paper's gate initialisation, +4 (g ~ 0.98 at the start), where the project's default is 0
    Variant("rgpt-paper-flops", "rgpt", "flops", settings=(("gate_bias_init", PAPER_GATE_BIAS),),
            why="RecurrentGPT's claims, on the paper's gate initialisation"),
    Variant("rgpt-paper-params", "rgpt", "params", settings=(("gate_bias_init", PAPER_GATE_BIAS),),
            why="RecurrentGPT's claims, on the paper's gate initialisation"),
    Variant("rgpt-paper-flops-heavy", "rgpt", "flops",
            settings=(("gate_bias_init", PAPER_GATE_BIAS), ("depth_sampling", "heavy_tail")), matched_heavy_tail=True,
            why="RecurrentGPT beats heavy-tailed depth sampling at isoFLOPs, on the paper's gate initialisation"),
)
# Forms left out of the default plan, and why (`--variants` may still name them).
EXCLUDED = {"rfbt-params": "about 5x gpt's training FLOPs (fbt's passes on rgpt's deepest shape); no paper claims it"}


def all_variants() -> list[Variant]:
    """Every registered arch (in its iso forms when its depth recurs) and the claim baselines."""
    found = []
    for name, spec in ARCHS.items():
        if spec.config_class.iso_fields is ModelConfig.iso_fields:
            found.append(Variant(name, name))
        else:
            found += [Variant(f"{name}-{iso}", name, iso) for iso in ISO_FORMS]
    return found + [v for v in CLAIM_BASELINES if v.arch in ARCHS]


def ladder_variants(names: list[str] | None = None) -> list[Variant]:
    """The default columns (all but EXCLUDED), or the ones named; gpt, the reference, always."""
    every = {v.name: v for v in all_variants()}
    if names:
        unknown = [n for n in names if n not in every]
        if unknown:
            raise LatentloopError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(every)}")
        chosen = ["gpt"] + [n for n in names if n != "gpt"]
    else:
        chosen = [n for n in every if n not in EXCLUDED]
    return [every[n] for n in chosen]


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    batch_size: int  # sequences per step, the same for every variant at this size


@dataclass(frozen=True)
class LadderSpec:
    """The ladder's fixed plan: sizes, budgets, seeds, recipe. A run's key names everything that
    tells it apart, so a resumed ladder finds its finished runs whatever the machine measures."""

    name: str
    sizes: tuple[Size, ...]
    seq_len: int
    budget_ratios: tuple[float, ...]  # token budgets, in tokens per gpt non-embedding parameter
    reference_extension: tuple[float, ...]  # gpt's further budgets, same unit
    seeds: tuple[int, ...] = (0, 1, 2)  # at the `seeded_sizes` smallest sizes
    other_seeds: tuple[int, ...] = (0,)
    seeded_sizes: int = 2
    adamw_sizes: int = 2  # the AdamW column covers this many of the smallest sizes (with `seeds`)
    warmup_steps: int = 20
    eval_batch: int = 32  # sequences per validation forward (the figures do not depend on it)
    val_tokens: int | None = None  # smoke: score only this many validation tokens (None: the whole split)
    stable_eval_share: float = 0.25  # the trunk's stable-phase points: this share of the windows, spread
    corpora: tuple[str, ...] = ("stdlib", "english")


# Depth 8 everywhere: rgpt's isoFLOPs form (1 + 1 x 6 + 1) then keeps the paper's 3/8 of gpt's blocks.
# Budgets 0.5-4 tokens per parameter (gpt 8): the largest run (lrt at l) under an hour on the 2-core CPU.
# 128 sequences per validation forward: the scorings that step token by token (lrt's sequential,
# fbt's soft) ran 2.1x (xs) and 1.35x (m) faster than at 32, the parallel ones within 5%, BPB equal
# to 6 decimals (2026-12-05, logs/2026-12-05-cpu-attention.md)
CPU = LadderSpec("cpu", sizes=(Size("xs", 8, 32, 2, 4), Size("s", 8, 48, 3, 8), Size("m", 8, 72, 6, 16),
                               Size("l", 8, 112, 7, 16)),
                 seq_len=128, budget_ratios=(0.5, 1.0, 2.0, 4.0), reference_extension=(8.0,), eval_batch=128)
# 9.8M-127M non-embedding parameters; its budgets are scaled to fit --budget-s (see `fit_to_budget`)
CUDA = LadderSpec("cuda", sizes=(Size("10m", 8, 320, 5, 16), Size("25m", 8, 512, 8, 16), Size("57m", 8, 768, 12, 16),
                                 Size("127m", 8, 1152, 18, 16)),
                  seq_len=512, budget_ratios=(1.0, 2.0, 4.0, 8.0), reference_extension=(16.0,),
                  seeds=(0,), other_seeds=(0,), seeded_sizes=0)
SMOKE = LadderSpec("smoke", sizes=(Size("t1", 4, 16, 2, 4), Size("t2", 4, 24, 2, 4)), seq_len=32,
                   budget_ratios=(0.125, 0.25, 0.5), reference_extension=(1.0,), seeds=(0, 1), other_seeds=(0,),
                   seeded_sizes=2, adamw_sizes=1, warmup_steps=2, eval_batch=16, val_tokens=4096)
# the GPU ladder's recipe and variants at the smoke's sizes: `--device cuda --smoke` on the CPU
CUDA_SMOKE = dataclasses.replace(SMOKE, name="cuda-smoke", seeds=(0,), other_seeds=(0,), seeded_sizes=0)
SPECS = {spec.name: spec for spec in (CPU, CUDA, SMOKE, CUDA_SMOKE)}
GPU_BUDGET_S = 540  # the H200 run: 9 minutes
MIN_BRANCH_STEPS = 4  # a budget whose decay starts within the warmup is refused


@dataclass(frozen=True)
class Branch:
    """A budget of a run: its straight WSD length in steps and what it is matched on."""

    label: str  # "t1".. (token budgets), "f1".. (FLOP-matched to gpt's budget), "r1".. (gpt's extension)
    steps: int
    kind: str  # "tokens", "flops", "reference"
    budget: int  # the index of the token budget it stands for

    @property
    def decay_start(self) -> int:
        return self.steps - max(1, int(round(DECAY_FRACTION * self.steps)))  # optim.lr_multiplier's


@dataclass
class RunPlan:
    spec: str
    corpus: str
    optimizer: str
    size: Size
    variant: Variant
    seed: int
    branches: list[Branch]
    part: int | None = None  # a variant that cannot branch: one run per budget
    size_index: int = 0  # the size's place in the ladder, smallest first
    flops_per_token: float = 0.0  # the run's mean training FLOPs per token (structural)
    train_flops: float = 0.0  # planned training FLOPs, trunk and branches
    scored_points: int = 0  # whole-split evaluations it makes (primary scoring, at the branches' ends)
    stable_points: int = 0  # the trunk's stable-phase evaluations (a share of the split)
    budget_scale: float = 1.0  # every token budget x this (--budget-scale; the GPU ladder's fitted scale)

    @property
    def key(self) -> str:
        part = "" if self.part is None else f"/b{self.part}"
        return f"{self.spec}/{self.corpus}/{self.optimizer}/{self.size.name}/{self.variant.name}/s{self.seed}{part}"

    @property
    def file_name(self) -> str:
        return self.key.replace("/", "__")

    @property
    def total_steps(self) -> int:
        return max(b.steps for b in self.branches)

    def describe(self) -> dict[str, Any]:
        """The plan entry a record keeps (everything `run_config` rebuilds the run from)."""
        entry = {"key": self.key, "spec": self.spec, "corpus": self.corpus, "optimizer": self.optimizer,
                 "size": dataclasses.asdict(self.size), "size_index": self.size_index,
                 "variant": dataclasses.asdict(self.variant), "seed": self.seed,
                 "part": self.part, "branches": [dataclasses.asdict(b) for b in self.branches]}
        if self.budget_scale != 1.0:  # only then: the entries of the records made at scale 1 stay as they were
            entry["budget_scale"] = self.budget_scale
        return entry


def model_fields(variant: Variant, size: Size, seq_len: int) -> dict[str, Any]:
    """The variant's model fields at `size`: gpt's shape, reshaped by the arch's own `iso_fields`
    (isoFLOPs: the paper's one-block core R = depth - 2 times between a prelude and a coda block;
    isoPARAMs: gpt's blocks, the arch's default R), as `latentloop train --iso` reshapes."""
    base = dict(n_layer=size.n_layer, n_embd=size.n_embd, n_head=size.n_head, sequence_len=seq_len,
                tie_embeddings=True, **dict(variant.settings))
    if variant.iso is None:
        return base
    config = model_config(variant.arch, None, **base)
    shape = config.iso_fields(variant.iso)
    steps_field = next(k for k in shape if k not in ("n_pre", "n_rec", "n_coda"))  # the arch's R
    if variant.iso == "flops":
        core_steps = max(1, size.n_layer - PAPER_EDGE_BLOCKS)
        shape = model_config(variant.arch, None, **base, **{steps_field: core_steps}).iso_fields("flops")
    fields = {k: v for k, v in base.items() if k != "n_layer"} | shape
    if variant.matched_heavy_tail:
        fields["depth_mean"] = _matched_heavy_tail_mean(shape[steps_field])
    return fields


def run_config(run: RunPlan | dict, device: str = "cpu", spec: LadderSpec | None = None,
               dtype: str = "auto") -> RunConfig:
    """The run's config (its length: the longest branch), from a plan or a record's plan entry;
    `dtype`: the ladder's precision (`ladder_precision`), "auto" where it has none yet."""
    entry = run.describe() if isinstance(run, RunPlan) else run
    spec = spec or SPECS[entry["spec"]]
    size, variant = Size(**entry["size"]), _variant_from(entry["variant"])
    steps = max(b["steps"] for b in entry["branches"])
    train = TrainConfig(steps=steps, batch_size=size.batch_size, seed=entry["seed"], optimizer=entry["optimizer"],
                        schedule="wsd", decay_fraction=DECAY_FRACTION, warmup_steps=spec.warmup_steps, eval_every=0,
                        device=device, dtype=dtype)
    return RunConfig(model=model_config(variant.arch, None, **model_fields(variant, size, spec.seq_len)), train=train,
                     data=DataConfig(source=CORPORA[entry["corpus"]]))


def _variant_from(raw: dict) -> Variant:
    return Variant(**{**raw, "settings": tuple(tuple(pair) for pair in raw["settings"])})


@functools.cache
def gpt_params(size: Size, seq_len: int) -> int:
    """gpt's non-embedding parameters at `size` (what the budgets are multiples of)."""
    return build_model(model_config("gpt", None, **model_fields(Variant("gpt", "gpt"), size, seq_len))) \
        .num_params(exclude_embedding=True)


class FlopsTable:
    """Each (variant, size, seed)'s training FLOPs, step by step, as the trainer sums them
    (`objective.flops_per_token(model, step)` x tokens per step): counted once per kind of forward."""

    def __init__(self, spec: LadderSpec):
        self.spec = spec
        self.memos: dict[tuple[str, str], tuple[Any, FlopsMemo]] = {}
        self.cumulative: dict[tuple[str, str, int, int], np.ndarray] = {}

    def _objective(self, variant: Variant, size: Size, seed: int, steps: int):
        key = (variant.name, size.name)
        if key not in self.memos:
            config = model_config(variant.arch, None, **model_fields(variant, size, self.spec.seq_len))
            self.memos[key] = (config, FlopsMemo(build_model(config)))
        config, memo = self.memos[key]
        train = TrainConfig(steps=steps, batch_size=size.batch_size, seed=seed, schedule="wsd",
                            warmup_steps=self.spec.warmup_steps)
        return build_objective(config, train), memo

    def per_step(self, variant: Variant, size: Size, seed: int, steps: int, run_steps: int | None = None) -> np.ndarray:
        """FLOPs of steps 0..steps-1 of a run `run_steps` long (default `steps`)."""
        key = (variant.name, size.name, seed, run_steps or steps)
        table = self.cumulative.get(key)
        if table is None or len(table) < steps:
            objective, memo = self._objective(variant, size, seed, run_steps or steps)
            tokens = size.batch_size * self.spec.seq_len
            table = np.array([objective.flops_per_token(memo, s) * tokens for s in range(steps)])
            self.cumulative[key] = table
        return table[:steps]

    def mean_per_token(self, variant: Variant, size: Size, seed: int, steps: int) -> float:
        return float(self.per_step(variant, size, seed, steps).mean()) / (size.batch_size * self.spec.seq_len)


def branchable(variant: Variant, size: Size, spec: LadderSpec, seed: int, steps: list[int]) -> bool:
    """Whether every step of a shorter run trains as the same step of the longest: the objective's
    forwards (pass counts, depths) must not depend on the run's length (fbt's paper schedule does)."""
    config = model_config(variant.arch, None, **model_fields(variant, size, spec.seq_len))
    longest = build_objective(config, TrainConfig(steps=max(steps), seed=seed, warmup_steps=spec.warmup_steps))
    for length in steps:
        shorter = build_objective(config, TrainConfig(steps=length, seed=seed, warmup_steps=spec.warmup_steps))
        if any(shorter.forward_mix(s) != longest.forward_mix(s) for s in range(length)):
            return False
    return True


def plan_ladder(spec: LadderSpec, variants: list[Variant], corpora: tuple[str, ...], budget_scale: float = 1.0,
                flops: FlopsTable | None = None) -> list[RunPlan]:
    """Every run of the ladder, smallest size first (an interrupted ladder holds whole sizes)."""
    flops = flops or FlopsTable(spec)
    reference = next(v for v in variants if v.name == "gpt")
    runs = []
    for index, size in enumerate(spec.sizes):
        tokens_per_step = size.batch_size * spec.seq_len
        n = gpt_params(size, spec.seq_len)
        budget_steps = [max(1, round(ratio * budget_scale * n / tokens_per_step)) for ratio in spec.budget_ratios]
        extension = [max(1, round(ratio * budget_scale * n / tokens_per_step)) for ratio in spec.reference_extension]
        for steps in budget_steps:
            if Branch("", steps, "tokens", 0).decay_start <= spec.warmup_steps + MIN_BRANCH_STEPS:
                raise LatentloopError(f"size {size.name}: a budget of {steps} steps decays before its warmup "
                                      f"({spec.warmup_steps} steps) is over: raise --budget-scale")
        seeds = spec.seeds if index < spec.seeded_sizes else spec.other_seeds
        optimizers = ["muon"] + (["adamw"] if index < spec.adamw_sizes else [])
        for optimizer in optimizers:
            for seed in (spec.seeds if optimizer == "adamw" else seeds):
                reference_steps = budget_steps + extension
                gpt_cumulative = np.cumsum(flops.per_step(reference, size, seed, max(reference_steps)))
                for corpus in corpora:
                    for variant in variants:
                        for run in _variant_runs(spec, corpus, optimizer, size, variant, seed, budget_steps,
                                                 extension, gpt_cumulative, flops):
                            run.size_index = index
                            run.budget_scale = budget_scale
                            runs.append(run)
    return runs


def _variant_runs(spec: LadderSpec, corpus: str, optimizer: str, size: Size, variant: Variant, seed: int,
                  budget_steps: list[int], extension: list[int], gpt_cumulative: np.ndarray,
                  flops: FlopsTable) -> list[RunPlan]:
    branches = [Branch(f"t{i + 1}", s, "tokens", i) for i, s in enumerate(budget_steps)]
    if variant.name == "gpt":
        branches += [Branch(f"r{i + 1}", s, "reference", len(budget_steps) + i) for i, s in enumerate(extension)]
    if not branchable(variant, size, spec, seed, [b.steps for b in branches]):
        runs = [RunPlan(spec.name, corpus, optimizer, size, variant, seed, [b], part=b.budget) for b in branches]
        for run in runs:
            per_step = flops.per_step(variant, size, seed, run.total_steps)
            _account(run, per_step)
        return runs
    ratio = flops.mean_per_token(variant, size, seed, max(budget_steps)) / flops.mean_per_token(
        Variant("gpt", "gpt"), size, seed, max(budget_steps))
    if variant.iso == "flops" and abs(ratio - 1) > FLOPS_MATCH:  # within it, its token budgets are FLOP-matched
        guess = int(math.ceil(max(budget_steps) / ratio * 1.3)) + 8
        per_step = flops.per_step(variant, size, seed, guess)
        cumulative = np.cumsum(per_step)
        for i, steps in enumerate(budget_steps):
            target = gpt_cumulative[steps - 1]
            while cumulative[-1] < target:  # longer than guessed: count further
                guess *= 2
                cumulative = np.cumsum(flops.per_step(variant, size, seed, guess))
            matched = int(np.searchsorted(cumulative, target)) + 1  # steps whose FLOPs first reach gpt's
            if matched > 1 and abs(cumulative[matched - 2] - target) < abs(cumulative[matched - 1] - target):
                matched -= 1
            if matched not in {b.steps for b in branches}:
                if Branch("", matched, "flops", i).decay_start <= spec.warmup_steps + MIN_BRANCH_STEPS:
                    raise LatentloopError(f"size {size.name}: {variant.name}'s FLOP-matched budget of {matched} "
                                          f"steps decays before its warmup ({spec.warmup_steps} steps) is over: "
                                          f"raise --budget-scale")
                branches.append(Branch(f"f{i + 1}", matched, "flops", i))
    branches.sort(key=lambda b: b.steps)
    run = RunPlan(spec.name, corpus, optimizer, size, variant, seed, branches)
    _account(run, flops.per_step(variant, size, seed, run.total_steps))
    return [run]


def _account(run: RunPlan, per_step: np.ndarray) -> None:
    """The run's planned training FLOPs: the trunk to the last decay start, then every branch's decay."""
    cumulative = np.concatenate([[0.0], np.cumsum(per_step)])
    last = max(b.decay_start for b in run.branches)
    run.train_flops = float(cumulative[last] + sum(cumulative[b.steps] - cumulative[b.decay_start]
                                                    for b in run.branches))
    run.flops_per_token = float(per_step.mean()) / (run.size.batch_size * SPECS[run.spec].seq_len)
    run.scored_points = len(run.branches)
    run.stable_points = len({b.decay_start for b in run.branches})


# --------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------


@functools.cache
def git_stamp() -> dict[str, Any]:
    """The commit the code ran at, and the tracked files modified beside it (another session's
    uncommitted work runs too). Read once, when the process starts (`_main`): a commit made while
    a long ladder runs is not the code it loaded."""
    def git(*args: str) -> str:
        # trailing newlines only: a porcelain line starts with its status, " M" for a file modified in the
        # work tree, and `strip()` took that space off the first line (".gitignore" read "gitignore")
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        return done.stdout.rstrip("\n")

    try:
        sha = git("rev-parse", "HEAD")
        dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "modified": []}
    return {"commit": sha or "unknown", "modified": dirty}


SET_BY_MACHINE = {("data", "source"), ("data", "cache_dir"), ("train", "device"), ("model", "vocab_size"),
                  ("model", "bos_id"),  # where a run's data lives and what setup fills in: not defaults
                  ("train", "dtype")}  # "auto" or the ladder's pinned precision: the record's `precision` is compared


# Config fields added after the ladder's first records, each with the value that runs as the code
# before it did: a record without the field ran as that value runs (e.g. attention_window 0, no
# imported sliding window). Any other value, or any other field absent then, is a change.
ADDED_AS_BEFORE = {("model", "attention_window"): 0}
PRECISIONS = ("bfloat16", "float32")  # a record's `precision`: what its products ran in
BF16_EMULATION = "bf16_emulation"  # a record's and a probe's key: how bf16 was emulated (`_emulation`)
BF16_SUPPORT = "cpu_bf16_support"  # a record's key: the bf16 instructions of the CPU that ran it (None: none)
CUDA_BF16_SUPPORT = "cuda_bf16_support"  # a GPU run's record: whether its GPU has native bf16


def comparable_config(config: dict[str, Any]) -> dict[str, Any]:
    """A run config without the fields that say where it ran rather than how it trained."""
    return {section: {k: v for k, v in values.items() if (section, k) not in SET_BY_MACHINE}
            for section, values in config.items()}


def plan_entry(run: RunPlan) -> dict[str, Any]:
    """The run's plan entry as a record stores it (JSON: tuples become lists)."""
    return json.loads(json.dumps(run.describe()))


UNBUILDABLE = "unbuildable"  # in a `planned_entries` entry: today's plan of that spec does not build (why)


def planned_entries(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Today's plan entry of every run the records' ladders plan (their spec, budget scale, corpora
    and variants), by key: what `stale_fields` compares a record's own entry with, and the runs the
    claims table waits for. Each ladder is rebuilt at the budget scale its records ran at (the
    plan entry's `budget_scale`, 1 where absent): the GPU ladder's fitted scale, or `--budget-scale`.
    Where today's plan of a spec does not build, each of its records' keys maps to {UNBUILDABLE: why}."""
    wanted: dict[tuple[str, float], tuple[set[str], set[str], list[str]]] = {}
    for record in records:
        plan = record.get("plan", {})
        if plan.get("spec") in SPECS:
            scale = float(plan.get("budget_scale", 1.0))
            corpora, variants, keys = wanted.setdefault((plan["spec"], scale), (set(), set(), []))
            corpora.add(plan["corpus"])
            variants.add(plan["variant"]["name"])
            keys.append(plan["key"])
    entries: dict[str, dict[str, Any]] = {}
    for (name, scale), (corpora, variants, keys) in wanted.items():
        known = [v for v in variants if v in {variant.name for variant in all_variants()}]
        try:
            entries |= {run.key: plan_entry(run) for run in plan_ladder(SPECS[name], ladder_variants(sorted(known)),
                                                                          tuple(sorted(corpora)), scale)}
        except LatentloopError as exc:
            entries |= {key: {UNBUILDABLE: first_line(exc)} for key in keys}
    return entries


def stale_fields(record: dict[str, Any], planned: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """What differs between the run as it ran and as today's code would run it, [] when nothing:
    the config fields (the record's plan entry rebuilt with today's defaults), the precision it
    trained in (`train.dtype` auto as today's rule resolves it on the machine that ran it, whose bf16
    support the record keeps: a rule the requested config does not show), the dtype its
    training attention ran in (`attention_dtype`; records made before the CPU attention rule of
    2026-12-05 lack it and attended in their `precision`) against the dtype today's rule picks for
    its precision, device and shape, and, given `planned` (`planned_entries`), the plan entry itself
    (sizes, budgets, a variant's settings)."""
    try:
        config = run_config(record["plan"])
        today = comparable_config(json.loads(json.dumps(config.to_dict())))
        then = comparable_config(record["config_requested"])
    except (LatentloopError, TypeError, KeyError, ValueError, AttributeError) as exc:
        return [f"the plan entry no longer builds ({first_line(exc)})"]
    changed = []
    ran = json.loads(json.dumps(record["plan"]))  # as a record on disk holds it
    entry = (planned or {}).get(ran.get("key", ""))
    if entry is not None and UNBUILDABLE in entry:
        changed.append(f"plan: today's plan of this ladder does not build ({entry[UNBUILDABLE]})")
    elif entry is not None:
        changed += [f"plan.{key}: {ran.get(key, '<absent>')!r} then, {entry.get(key, '<absent>')!r} now"
                    for key in sorted(set(entry) | set(ran)) if ran.get(key, "<absent>") != entry.get(key, "<absent>")]
    for section in sorted(set(today) | set(then)):
        for key in sorted(set(today.get(section, {})) | set(then.get(section, {}))):
            old, new = then.get(section, {}).get(key, "<absent>"), today.get(section, {}).get(key, "<absent>")
            added_as_before = (section, key) in ADDED_AS_BEFORE and new == ADDED_AS_BEFORE[section, key]
            if old != new and not (old == "<absent>" and added_as_before):
                changed.append(f"{section}.{key}: {old!r} then, {new!r} now")
    precision, device = record.get("precision"), record.get("device")
    if precision is not None and device is not None:
        support = CUDA_BF16_SUPPORT if torch.device(device).type == "cuda" else BF16_SUPPORT
        if support in record:
            # what today's resolution gives the same request on the machine that ran it, never on this
            # one (a record made before the machine's bf16 support was kept says nothing of it: not compared)
            # the run's own request: "auto", or the precision the ladder was pinned to (`ladder_precision`)
            requested = record["config_requested"].get("train", {}).get("dtype", "auto")
            now_precision = resolve_dtype(torch.device(device), requested, record.get(BF16_SUPPORT),
                                          record.get(CUDA_BF16_SUPPORT))
            if precision != now_precision:
                changed.append(f"precision: {precision!r} then, {now_precision!r} now")
        # what today's rule picks for the run's own precision
        then_attention = record.get("attention_dtype", precision)
        now_attention = attention_dtype(torch.device(device).type, precision, config.model)
        if then_attention != now_attention:
            changed.append(f"attention_dtype: {then_attention!r} then, {now_attention!r} now")
    return changed


# --------------------------------------------------------------------------------------------
# One run: a trunk and its branches
# --------------------------------------------------------------------------------------------


def primary_scoring(config: ModelConfig) -> str:
    """The scoring the fits use: the weights as a plain model for fbt's family (`standard`: the
    paper reports no soft BPB), lrt's exact `sequential` memory (as it decodes), else the arch's
    last scoring mode (rgpt's full depth, MoR's every recursion, gpt's `plain`)."""
    modes = list(get_scoring_modes(config))
    for preferred in ("standard", "sequential"):
        if preferred in modes:
            return preferred
    return modes[-1]


def get_scoring_modes(config: ModelConfig) -> dict[str, dict]:
    return ARCHS[config.arch].scoring_modes(config)


def _snapshot(state) -> dict[str, Any]:
    """Everything the next steps depend on: weights, optimizer states, the loader's position, the
    RNG streams (training noise) and the counters."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {"model": {k: v.detach().clone() for k, v in state.model.state_dict().items()},
            "optimizers": [copy.deepcopy(opt.state_dict()) for opt in state.optimizers],
            "loader": state.loader.state_dict(), "rng": rng, "step": state.step, "tokens": state.tokens_seen,
            "flops": state.flops_seen}


def _restore(state, snap: dict[str, Any]) -> None:
    state.model.load_state_dict(snap["model"])
    for opt, saved in zip(state.optimizers, snap["optimizers"]):
        opt.load_state_dict(copy.deepcopy(saved))
    state.loader.load_state_dict(snap["loader"])
    torch.set_rng_state(snap["rng"]["cpu"])
    if "cuda" in snap["rng"] and torch.cuda.is_available():  # the devices there are of those saved
        for index, rng in enumerate(snap["rng"]["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, index)
    state.step, state.tokens_seen, state.flops_seen = snap["step"], snap["tokens"], snap["flops"]


def train_until(state, train: TrainConfig, stop: int, guard: FiniteGuard, flops_model) -> float:
    """Optimizer steps from `state.step` to `stop` at `train`'s schedule (a WSD run `train.steps`
    long), the FLOPs summed as the trainer sums them; returns the seconds spent."""
    tokens_per_step = state.global_batch * state.config.model.sequence_len
    start = time.perf_counter()
    state.model.train()
    while state.step < stop:
        set_lr(state.optimizers, lr_multiplier(state.step, train))
        outcome = train_step(state.model, state.forward_model, state.objective, state.loader.next_batch, state.step,
                             state.optimizers, train, state.device, guard)
        state.flops_seen += state.objective.flops_per_token(flops_model, state.step) * tokens_per_step
        state.step += 1
        state.tokens_seen += tokens_per_step
        state.last_loss = outcome.loss if state.step % train.log_every == 0 or state.step == stop else None
    guard.check()
    return time.perf_counter() - start


def stable_batches(val: np.ndarray, spec: LadderSpec) -> int:
    """How many validation batches a stable-phase point scores: `stable_eval_share` of the split's."""
    windows = (len(val) - 1) // spec.seq_len
    return max(1, round(spec.stable_eval_share * math.ceil(windows / spec.eval_batch)))


def score(state, labels: dict[str, dict], val: np.ndarray, eval_batch: int,
          max_batches: int | None = None) -> tuple[dict, float]:
    """BPB of the model under each scoring on the whole `val` (fp32; `max_batches`: that many batches
    of windows spread evenly over it), the training RNG untouched."""
    rng = torch.get_rng_state()
    start = time.perf_counter()
    batches = text_batches(val, eval_batch, state.config.model.sequence_len, max_batches, spread=True,
                           bos_id=state.tokenizer.bos_id)
    scores = score_run(state.model, batches, state.tokenizer.token_byte_lengths(), labels)
    torch.set_rng_state(rng)
    state.model.train()
    return {label: {k: s[k] for k in ("loss", "bpb", "bpb_ci", "tokens") if k in s} for label, s in scores.items()}, \
        time.perf_counter() - start


class RunBusy(LatentloopError):
    """Another process trains this run (it holds the run's lock)."""


class RunFailed(LatentloopError):
    """The run cannot finish here (its training diverged): recorded in `out/failed.json`."""


def execute(run: RunPlan, out: Path, device: str, spec: LadderSpec, progress: bool = True,
            rerun_stale: bool = False, dtype: str = "auto") -> dict[str, Any] | None:
    """Train one run in `dtype` (`run_precision`), resuming its trunk where it stopped, and write its
    record; returns the record,
    or None when another process finished it meanwhile. Raises `RunBusy` when another process
    trains it now, `RunFailed` when its training diverges."""
    record_path = out / "records" / f"{run.file_name}.json"
    work = out / "work" / run.file_name
    work.mkdir(parents=True, exist_ok=True)
    try:  # the run's own lock, in its work folder (the trunk's folder below is made afresh)
        lock = RunLock(work).acquire()
    except CheckpointError:
        raise RunBusy(f"{run.key}: another process trains it ({work / LOCK_FILE})") from None
    try:
        if finished(out, run, rerun_stale):  # finished by another process between our check and the lock
            return None
        config = run_config(run, device, spec, dtype)
        requested = json.loads(json.dumps(config.to_dict()))
        trunk_dir = work / "trunk"
        if trunk_dir.exists():  # setup's folder (config, tokenizer): the trunk's own state is trunk.pt
            shutil.rmtree(trunk_dir)
        state = setup(config, trunk_dir, progress=False)
        try:
            return _execute(run, state, work, record_path, requested, spec, progress)
        except NonFiniteError as exc:
            raise RunFailed(f"{run.key}: {first_line(exc)}") from None
        finally:
            if state.lock is not None:
                state.lock.release()
    finally:
        lock.release()


SAVE_EVERY_S = 300.0  # a trunk's progress is saved this often (and at every decay start): a kill loses less
SAVE_CHECK_STEPS = 25  # steps between looks at the clock


def _made_by(run: RunPlan, requested: dict[str, Any], precision: str) -> dict[str, Any]:
    """What a saved trunk must have been made under to be resumed: the plan entry, the config and the
    precision its products ran in (`train.dtype=auto` resolves by the machine: a trunk carried to a
    machine without native bf16 would go on in float32 under the same config). The config's
    `train.dtype`, "auto" or the ladder's pinned precision (`run_precision`), is left out: the
    precision says what it resolved to."""
    return {"plan": plan_entry(run), "config": _without_dtype(requested), "precision": precision}


def _without_dtype(config: dict[str, Any]) -> dict[str, Any]:
    """A requested config without its `train.dtype` (a trunk's stamp: `_made_by`)."""
    return {**config, "train": {k: v for k, v in config.get("train", {}).items() if k != "dtype"}}


def _load_progress(path: Path, made_by: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The saved trunk to resume, or None (none, unreadable, or made under another plan entry,
    config or precision: it starts again, and says why). A trunk saved before trunks were stamped
    (no `made_by`) is taken as made under today's plan, and one stamped before the precision was
    (2026-12-06) as made in today's precision: the shards that made them ran on one machine."""
    if not path.exists():
        return None
    try:
        saved = torch.load(path, weights_only=False, map_location="cpu")  # one saved on a GPU reads anywhere
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file of any kind: start the run again
        print(f"  {key}: its saved trunk {path} is unreadable ({first_line(exc)}): starting again", flush=True)
        return None
    stamp = {"precision": made_by["precision"], **saved.get("made_by", made_by)}
    # a trunk stamped before `_made_by` left `train.dtype` out (2026-12-07) holds it in its config
    stamp["config"] = _without_dtype(stamp["config"])
    if stamp != made_by:
        print(f"  {key}: its saved trunk was made under another plan entry, config or precision: starting again",
              flush=True)
        return None
    return saved


def _execute(run, state, work: Path, record_path: Path, requested: dict, spec: LadderSpec, progress: bool) -> dict:
    train_cfg = state.config.train
    flops_model = state.flops if state.flops is not None else FlopsMemo(state.model)
    guard = FiniteGuard(state.device)
    val = state.data.val if spec.val_tokens is None else state.data.val[:spec.val_tokens]
    modes = get_scoring_modes(state.config.model)
    primary = primary_scoring(state.config.model)
    progress_file = work / "trunk.pt"
    precision = resolve_dtype(state.device, train_cfg.dtype)
    made_by = _made_by(run, requested, precision)
    done: dict[str, Any] = {"points": [], "branches": [], "seconds": {"train": 0.0, "eval": 0.0}, "commits": []}
    saved = _load_progress(progress_file, made_by, run.key)
    if saved is not None:
        _restore(state, saved["snapshot"])
        done = saved["done"]
    commit = git_stamp()["commit"]
    done["commits"] = [*done.get("commits", []), *([] if commit in done.get("commits", []) else [commit])]
    train_tokens = len(state.data.train)

    def save() -> None:
        _atomic_save(progress_file, {"snapshot": _snapshot(state), "done": done, "made_by": made_by})

    def trunk_to(stop: int) -> float:
        """The trunk's stable phase up to `stop`, saved every `SAVE_EVERY_S` on the way."""
        spent, saved_at = 0.0, time.perf_counter()
        while state.step < stop:
            spent += train_until(state, train_cfg, min(stop, state.step + SAVE_CHECK_STEPS), guard, flops_model)
            if state.step < stop and time.perf_counter() - saved_at >= SAVE_EVERY_S:
                save()
                saved_at = time.perf_counter()
        return spent

    def point(kind: str, label: str, budget: int, labels: dict[str, dict], max_batches: int | None = None) -> None:
        scores, seconds = score(state, labels, val, spec.eval_batch, max_batches)
        done["seconds"]["eval"] += seconds
        done["points"].append({"kind": kind, "label": label, "budget": budget, "step": state.step,
                               "tokens": state.tokens_seen, "flops": state.flops_seen,
                               "epochs": state.tokens_seen / train_tokens,
                               "train_loss": getattr(state, "last_loss", None),
                               "primary": primary, "scores": scores})
        if progress:
            print(f"  {run.key} {label} step {state.step}: BPB {scores[primary]['bpb']:.4f} "
                  f"({state.tokens_seen:,} tokens, {state.flops_seen:.3g} FLOPs)", flush=True)

    final = max(run.branches, key=lambda b: b.steps)  # its end is scored every way, and nothing follows it
    for decay_start in sorted({b.decay_start for b in run.branches}):
        if decay_start in {p["step"] for p in done["points"] if p["kind"] == "stable"}:
            continue  # resumed past it
        done["seconds"]["train"] += trunk_to(decay_start)
        point("stable", f"stable@{decay_start}", -1, {primary: modes[primary]}, stable_batches(val, spec))
        for branch in [b for b in run.branches if b.decay_start == decay_start]:
            last = branch is final
            snap = None if last else _snapshot(state)
            done["seconds"]["train"] += train_until(state, dataclasses.replace(train_cfg, steps=branch.steps),
                                                    branch.steps, guard, flops_model)
            point(branch.kind, branch.label, branch.budget, modes if last else {primary: modes[primary]})
            done["branches"].append(branch.label)
            if snap is not None:
                _restore(state, snap)
        save()
    record = {"key": run.key, "plan": run.describe(), **git_stamp(), "commits": done["commits"],
              "config_requested": requested,
              "config_resolved": json.loads(json.dumps(state.config.to_dict())),
              "precision": precision,
              BF16_SUPPORT: cpu_bf16_support(),  # the machine's, for today's rule on it (`stale_fields`)
              BF16_EMULATION: _emulation(state.device, state.config.train.dtype),
              **({CUDA_BF16_SUPPORT: cuda_bf16_support(state.device)} if state.device.type == "cuda" else {}),
              "attention_dtype": training_attention_dtype(state.device, state.config),
              "evaluation": {"dtype": "float32", "batch": spec.eval_batch, "stable_share": spec.stable_eval_share},
              "params": state.model.num_params(),
              "params_non_embedding": state.model.num_params(exclude_embedding=True),
              "train_tokens_available": train_tokens, "val_tokens": int(len(val)),
              "data_sha256": state.data.meta.get("sha256"), "points": done["points"],
              "seconds": done["seconds"], "device": str(state.device), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "cpu": cpu_model(), "complete": True,
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _atomic_write_json(record_path, record)
    # the work folder goes, its lock file with it: a process that takes a lock on it (or on a new one)
    # from now on finds the record first (`execute` checks after locking)
    shutil.rmtree(work, ignore_errors=True)
    return record


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def training_attention_dtype(device: torch.device, config: RunConfig) -> str:
    """The dtype the run's training attention ran in: the products' (`precision`), except where a
    CPU bf16 step attends in float32 (`backbone.cpu_training_attention_in_fp32`, from 2026-12-05 on:
    records without this field attended in their `precision`)."""
    return attention_dtype(device.type, resolve_dtype(device, config.train.dtype), config.model)


def attention_dtype(device_type: str, precision: str, model: ModelConfig) -> str:
    """The dtype a training attention runs in on `device_type` under the products' `precision`."""
    in_fp32 = cpu_training_attention_in_fp32(model.head_dim, model.sequence_len)
    return "float32" if device_type == "cpu" and precision == "bfloat16" and in_fp32 else precision


def _temp_beside(path: Path) -> Path:
    """A temporary file of this writer's own beside `path` (the same folder: `os.replace` is then a
    rename), as `write_json_atomic` makes for JSON: two processes writing one file never share a
    temporary name, so neither reads the other's half-written file nor loses its own to a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    give_default_mode(tmp)  # mkstemp's 0600 would lock colleagues out of the records kept in git
    return Path(tmp)


def _atomic_save(path: Path, obj: Any) -> None:
    tmp = _temp_beside(path)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_write_json(path: Path, obj: Any) -> None:
    write_json_atomic(path, obj, indent=RECORD_INDENT)


RECORD_INDENT = 1  # the records' JSON (and failed.json, the probe): as the committed ones are written
FAILED_FILE = "failed.json"  # run key -> why it failed (a diverged training), with the commit and the time
FAILED_LOCK = Path("work") / "failed.json.lock"  # under `out`: one writer of failed.json at a time (ignored by git)


@contextlib.contextmanager
def _failures_locked(out: Path) -> Iterator[None]:
    """Hold the lock on `out`'s failures (`fcntl.flock`, released when the process dies)."""
    lock_path = out / FAILED_LOCK
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def update_failures(out: Path, key: str, failure: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Record `key`'s failure (`failure`), or drop it (None: the run has finished since), in
    `out/failed.json`: read again and merged under the lock just before the write, so that shards
    sharing `out` keep each other's entries. Returns the failures as written."""
    with _failures_locked(out):
        _set_aside_unreadable_failures(out)
        failures = read_failures(out)
        if failure is None and key not in failures:
            return failures
        if failure is None:
            del failures[key]
        else:
            failures[key] = failure
        _atomic_write_json(out / FAILED_FILE, failures)
        return failures


def _set_aside_unreadable_failures(out: Path) -> None:
    """A failed.json that does not parse (a merge left conflict markers in it, the file being in
    git) is renamed aside, not written over: rewritten from {} it lost every other run's entry."""
    path = out / FAILED_FILE
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        found = None
    if not isinstance(found, dict):
        aside = path.with_name(f"{FAILED_FILE}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}")
        path.replace(aside)
        print(f"ladder: {path} did not parse; kept as {aside.name}, its entries to merge by hand", flush=True)


def read_failures(out: Path) -> dict[str, dict[str, Any]]:
    """The runs that failed under `out` (`FAILED_FILE`), {} when none or unreadable."""
    try:
        found = json.loads((out / FAILED_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def ladder_precision(out: Path, device_type: str) -> str | None:
    """The precision the ladder's records on this device type trained in, which every later run of
    it trains in too, whatever `train.dtype=auto` resolves to on the machine that runs it: None for
    a ladder without records there. A page column reads "stale" where its records mix precisions
    (12-06: a machine without bf16 instructions added 45 float32 runs to 263 bfloat16 ones). On such
    a machine bf16 is emulated: the same precision (bf16 inputs and outputs of each product, float32
    sums), slower. Records in several precisions are refused, naming them."""
    seen: dict[str, int] = {}
    for path in sorted((out / "records").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or str(record.get("device", "")).split(":")[0] != device_type:
            continue
        precision = record.get("precision")
        if precision not in PRECISIONS:
            raise LatentloopError(f"{path}: its precision is {precision!r}, not one of {', '.join(PRECISIONS)}: "
                                  f"mend or move the record")
        seen[precision] = seen.get(precision, 0) + 1
    if len(seen) > 1:
        theirs = ", ".join(f"{count} in {precision}" for precision, count in sorted(seen.items()))
        raise LatentloopError(f"the ladder's {device_type} records trained in several precisions ({theirs}), so no "
                              f"precision is the ladder's: move one precision's records out of {out / 'records'}")
    return next(iter(seen), None)


PRECISION_FILE = "precision.json"  # in --out, beside the records: {device type: the ladder's precision}


def run_precision(out: Path, device: str, asked: str | None, keep: bool = True) -> str:
    """The `train.dtype` this invocation's runs request: the ladder's precision, from its records
    (`ladder_precision`) or, before its first record, from `out/precision.json`; for a new ladder,
    `asked` (`--precision`), else what `train.dtype=auto` resolves to on this machine, kept in that
    file (`keep`), so shards started on two machines before the first record cannot mix. `asked`
    against the ladder's own precision is refused: the page would read its columns stale."""
    kind = torch.device(device).type
    path = out / PRECISION_FILE
    try:
        kept = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as exc:
        raise LatentloopError(f"{path} is unreadable ({first_line(exc)}): mend or remove it") from None
    if not isinstance(kept, dict) or kept.get(kind, PRECISIONS[0]) not in PRECISIONS:
        raise LatentloopError(f"{path}: expected {{device type: one of {', '.join(PRECISIONS)}}}, got {kept!r}"[:300])
    pinned = ladder_precision(out, kind) or kept.get(kind)
    if pinned is not None and asked not in (None, pinned):
        raise LatentloopError(f"--precision {asked}: the ladder's {kind} runs train in {pinned} (its records, or "
                              f"{path}); a run in {asked} would read stale")
    chosen = pinned or asked or resolve_dtype(torch.device(device), "auto")
    if keep and kept.get(kind) != chosen:
        _atomic_write_json(path, {**kept, kind: chosen})
    return chosen


def finished(out: Path, run: RunPlan, rerun_stale: bool = False) -> bool:
    """Whether the run has a complete record made to today's plan entry (a record of another plan
    under the same key, e.g. before its budgets changed, is run again and replaced); with
    `rerun_stale` (`--rerun-stale`), also made under today's defaults (`stale_fields`): a stale
    record is run again and replaced, where by default it is kept and its rows read "stale"."""
    path = out / "records" / f"{run.file_name}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(record, dict) and bool(record.get("complete")) and record.get("plan") == plan_entry(run)):
        return False
    return not (rerun_stale and stale_fields(record))


# --------------------------------------------------------------------------------------------
# The estimate: a throughput probe per variant and size, or the GPU benchmark's figures
# --------------------------------------------------------------------------------------------

PROBE_WARMUP = 2  # unmeasured steps (allocations, the FLOP count's probe forward)
PROBE_STEPS = 4  # measured steps per repeat: the training FLOP rate
PROBE_EVAL_BATCHES = 2  # measured validation batches per scoring and repeat: its tokens/s
# Each rate is the median of this many measurements, each scoring's after one unmeasured batch: a
# single measurement with no warm-up read one scoring at 58 tokens/s where the run scored ~1,400x
# faster (its first call's one-off work), and put the whole ladder at 166 h (12-06 audit)
PROBE_REPEATS = 3


def probe(variant: Variant, size: Size, spec: LadderSpec, device: str, dtype: str = "auto") -> dict[str, Any]:
    """The training FLOP rate (structural FLOPs of `PROBE_STEPS` steps over their seconds, after
    `PROBE_WARMUP` unmeasured ones; Muon: AdamW is assumed as fast) and each scoring's tokens/s
    (after one unmeasured batch), each the median of `PROBE_REPEATS` measurements."""
    steps = PROBE_WARMUP + PROBE_STEPS * PROBE_REPEATS
    entry = {"spec": spec.name, "corpus": "stdlib", "optimizer": "muon", "size": dataclasses.asdict(size),
             "variant": dataclasses.asdict(variant), "seed": 0, "part": None,
             "branches": [dataclasses.asdict(Branch("p", steps + 8, "tokens", 0))]}
    config = run_config(entry, device, spec, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        state = setup(config, Path(tmp) / "probe", progress=False)
        try:
            guard, memo = FiniteGuard(state.device), state.flops or FlopsMemo(state.model)
            train_until(state, config.train, PROBE_WARMUP, guard, memo)
            rates = []
            for repeat in range(PROBE_REPEATS):
                before = state.flops_seen
                seconds = train_until(state, config.train, PROBE_WARMUP + PROBE_STEPS * (repeat + 1), guard, memo)
                rates.append((state.flops_seen - before) / max(seconds, 1e-9))
            batch_tokens = spec.eval_batch * spec.seq_len
            warmup, val = state.data.val[:batch_tokens + 1], state.data.val[:PROBE_EVAL_BATCHES * batch_tokens + 1]
            eval_rates = {}
            for label, options in get_scoring_modes(config.model).items():
                score(state, {label: options}, warmup, spec.eval_batch)  # its one-off work, unmeasured
                measured = []
                for _ in range(PROBE_REPEATS):
                    scores, eval_seconds = score(state, {label: options}, val, spec.eval_batch)
                    measured.append(scores[label]["tokens"] / max(eval_seconds, 1e-9))
                eval_rates[label] = float(np.median(measured))
        finally:
            if state.lock is not None:
                state.lock.release()
    return {"train_flops_per_s": float(np.median(rates)), "eval_tokens_per_s": eval_rates,
            "primary": primary_scoring(config.model), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "repeats": PROBE_REPEATS, "precision": resolve_dtype(torch.device(device), dtype),
            BF16_EMULATION: _emulation(torch.device(device), dtype)}


def _emulation(device: torch.device, dtype: str) -> str | None:
    """How bf16 was emulated on a CPU without bf16 instructions (`precision.EMULATION`), or None where
    nothing was (float32, or native bf16)."""
    return EMULATION if emulates_bf16(device, dtype) else None


def probe_all(runs: list[RunPlan], spec: LadderSpec, device: str, out: Path, fresh: bool = False,
              dtype: str = "auto") -> tuple[dict[str, dict], int]:
    """Probe each (variant, size) of the plan once; kept in `out/probe-<device>.json` for a resumed
    ladder (`fresh`: measure again). Returns the probes and how many were measured in this call. A
    probe made before `PROBE_REPEATS` (one measurement, no scoring warm-up), in another `dtype` (an
    emulated bf16 step takes longer), or under another bf16 emulation (torch's own, before
    `precision.EMULATION`, took 1.4-1.5x the time) is measured again."""
    path = out / f"probe-{spec.name}-{device}.json"
    # a probe made before probes kept their precision (2026-12-07) ran in `auto`'s, on this machine
    precision, here = resolve_dtype(torch.device(device), dtype), resolve_dtype(torch.device(device), "auto")
    probes = {} if fresh or not path.exists() else json.loads(path.read_text())
    pairs = {(r.variant.name, r.size.name): (r.variant, r.size) for r in runs}
    measured = 0
    for variant, size in pairs.values():
        name = f"{variant.name}@{size.name}"
        emulation = _emulation(torch.device(device), dtype)
        if (probes.get(name, {}).get("repeats") != PROBE_REPEATS or probes[name].get("precision", here) != precision
                or probes[name].get(BF16_EMULATION) != emulation):
            probes[name] = probe(variant, size, spec, device, dtype)
            measured += 1
            _atomic_write_json(path, probes)
    return probes, measured


def val_tokens(corpus: str, spec: LadderSpec) -> int:
    """The validation tokens each scoring reads (the byte tokenizer: the split's bytes)."""
    from latentloop.data import load_tokenizer
    from latentloop.runtime import prepare_data

    data = prepare_data(RunConfig(data=DataConfig(source=CORPORA[corpus])), load_tokenizer("byte"), progress=False)
    return len(data.val) if spec.val_tokens is None else min(spec.val_tokens, len(data.val))


def estimate_seconds(run: RunPlan, probes: dict[str, dict], val_sizes: dict[str, int]) -> dict[str, float]:
    """A run's time: its training FLOPs at the probed rate, and its scored tokens at the probed
    tokens/s (the primary scoring at every point, every scoring once more at the end)."""
    measured = probes[f"{run.variant.name}@{run.size.name}"]
    train = run.train_flops / measured["train_flops_per_s"]
    rates = measured["eval_tokens_per_s"]
    tokens = val_sizes[run.corpus]
    scored = run.scored_points + run.stable_points * SPECS[run.spec].stable_eval_share
    evaluation = scored * tokens / rates[measured["primary"]] + sum(
        tokens / rate for label, rate in rates.items() if label != measured["primary"])
    return {"train": train, "eval": evaluation}


# The H200 estimate when no GPU is at hand: the GPU benchmark's measured training throughput.
GPU_BENCH_REPORT = REPO / "experiments" / "logs" / "2026-12-04-gpu-h200-report.json"
ASSUMED_GPU_FLOPS = 200e12  # where no report is found: about gpt's compiled 124M step on an H200 (211 TFLOP/s)
# Assumptions on top of the benchmark (its shape: the gpt2 preset, compiled, 16 x 1024 tokens a step):
EAGER_SHARE = 0.5  # the ladder trains eager (a compile per variant and size would eat the 9 minutes)
SMALL_SHAPE_EXPONENT = 0.5  # a smaller model uses the GPU less: rate x (params / 124M) ** 0.5, at most 1
GPU_BENCH_PARAMS = 124e6
GPU_EVAL_SPEEDUP = 3.0  # a scored token costs a forward: about a third of a training token's FLOPs


def gpu_rate(report_path: Path | None) -> tuple[dict[str, float], str]:
    """Achieved training FLOP/s per arch from a gpu_bench JSON (the report the GPU run wrote, or
    its `gpu_bench` section), and where the figure came from."""
    path = report_path or GPU_BENCH_REPORT
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}, f"no GPU benchmark report at {path}: assumed {ASSUMED_GPU_FLOPS / 1e12:.0f} TFLOP/s for every arch"
    report = report.get("gpu_bench", report)
    rates: dict[str, list[float]] = {}
    for case in report.get("training", []):
        if "achieved_tflops" in case and "arch" in case:
            rates.setdefault(case["arch"], []).append(case["achieved_tflops"] * 1e12)
    return ({arch: float(np.mean(values)) for arch, values in rates.items()},
            f"{path} ({report.get('device', '?')}, {report.get('shape', {}).get('preset', '?')} preset, "
            f"{'compiled' if report.get('compiled') else 'eager'})")


def gpu_seconds(run: RunPlan, rates: dict[str, float], val_sizes: dict[str, int], params: dict[str, int]) -> float:
    rate = rates.get(run.variant.arch) or rates.get("gpt") or ASSUMED_GPU_FLOPS
    rate *= EAGER_SHARE * min(1.0, params[run.size.name] / GPU_BENCH_PARAMS) ** SMALL_SHAPE_EXPONENT
    scored = run.scored_points + run.stable_points * SPECS[run.spec].stable_eval_share
    eval_flops = scored * val_sizes[run.corpus] * run.flops_per_token / GPU_EVAL_SPEEDUP
    return (run.train_flops + eval_flops) / rate


# Bisection steps of `fit_to_budget` on the log of the budget scale. Each plans the whole ladder,
# which counts every run's FLOPs step by step (minutes of one core for the default variants: 20 + 14
# steps took over 12 min under cProfile here, 9 + 8 about 4 min plain: a 9-minute GPU window cannot pay
# for it, so `--budget-scale` skips it). 9 steps over [1e-5, 1] place
# the floor within 2.3%; 8 over [floor, 1], the fitted scale within 3.7% where that range spans 1e4.
FLOOR_SEARCH_STEPS = 9
FIT_SEARCH_STEPS = 8


def fit_to_budget(spec: LadderSpec, variants: list[Variant], corpora: tuple[str, ...], budget_s: float,
                  rates: dict[str, float], val_sizes: dict[str, int]) -> tuple[float, list[RunPlan], bool]:
    """The largest budget scale (tokens per parameter = ratio x scale) whose whole ladder fits
    `budget_s` at the GPU rates, by bisection on the log scale; where even the shortest budgets that
    still branch after the warmup do not fit, those (and False: the budget then stops the ladder
    partway, smallest sizes first)."""
    params = {size.name: gpt_params(size, spec.seq_len) for size in spec.sizes}
    flops = FlopsTable(spec)

    def total(scale: float) -> tuple[float, list[RunPlan]]:
        runs = plan_ladder(spec, variants, corpora, scale, flops)
        return sum(gpu_seconds(r, rates, val_sizes, params) for r in runs), runs

    low, high = 1e-5, 1.0  # the smallest scale whose budgets (FLOP-matched ones too) branch after the warmup
    for _ in range(FLOOR_SEARCH_STEPS):
        mid = math.sqrt(low * high)
        try:
            plan_ladder(spec, variants, corpora[:1], mid, flops)
            high = mid
        except LatentloopError:
            low = mid
    seconds, runs = total(high)
    if seconds > budget_s:
        return high, runs, False
    low, best = high, (high, runs)
    high = 1.0
    for _ in range(FIT_SEARCH_STEPS):
        mid = math.sqrt(low * high)
        seconds, runs = total(mid)
        if seconds <= budget_s:
            low, best = mid, (mid, runs)
        else:
            high = mid
    return best[0], best[1], True


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def describe_plan(runs: list[RunPlan], spec: LadderSpec) -> list[str]:
    lines = [f"ladder {spec.name}: {len(runs)} runs; T = {spec.seq_len}; WSD, decay over the last "
             f"{DECAY_FRACTION:.0%} of each budget; warmup {spec.warmup_steps} steps"]
    for size in spec.sizes:
        mine = [r for r in runs if r.size == size]
        if not mine:
            continue
        gpt = next((r for r in mine if r.variant.name == "gpt"), mine[0])
        tokens = [b.steps * size.batch_size * spec.seq_len for b in gpt.branches]
        n = gpt_params(size, spec.seq_len)
        lines.append(f"  size {size.name}: depth {size.n_layer}, width {size.n_embd}, {n:,} non-embedding params, "
                     f"batch {size.batch_size}; budgets {', '.join(f'{t:,}' for t in tokens)} tokens "
                     f"({', '.join(f'{t / n:.3g}' for t in tokens)} per param); seeds "
                     f"{sorted({r.seed for r in mine if r.optimizer == 'muon'})}; optimizers "
                     f"{sorted({r.optimizer for r in mine})}")
    first = [r for r in runs if r.size == runs[0].size]
    ratios = {}
    for r in first:
        ratios.setdefault(r.variant.name, []).append(r.flops_per_token / _gpt_fpt(runs, r))
    lines.append("  variants (training FLOPs per token / gpt's): " + ", ".join(
        f"{name} {np.mean(values):.2f}x" + (" (straight runs: its schedule depends on the run's length)" if any(
            r.part is not None for r in first if r.variant.name == name) else "")
        for name, values in ratios.items()))
    lines.append(f"  corpora: {', '.join(dict.fromkeys(r.corpus for r in runs))}; planned training FLOPs "
                 f"{sum(r.train_flops for r in runs):.3g}")
    return lines


def _gpt_fpt(runs: list[RunPlan], run: RunPlan) -> float:
    return next(r.flops_per_token for r in runs if r.variant.name == "gpt" and r.size == run.size)


def epochs_note(runs: list[RunPlan], spec: LadderSpec) -> list[str]:
    """Which budgets repeat a corpus's training split, and how often."""
    from latentloop.data import load_tokenizer
    from latentloop.runtime import prepare_data

    lines = []
    for corpus in dict.fromkeys(r.corpus for r in runs):
        data = prepare_data(RunConfig(data=DataConfig(source=CORPORA[corpus])), load_tokenizer("byte"), progress=False)
        most = max(b.steps * r.size.batch_size * spec.seq_len for r in runs if r.corpus == corpus for b in r.branches)
        lines.append(f"  {corpus}: {len(data.train):,} training tokens, {len(data.val):,} validation tokens; the "
                     f"longest budget reads {most / len(data.train):.2f} epochs"
                     + (" (budgets past 1 epoch repeat data: the table marks them)" if most > len(data.train) else ""))
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("experiments/ladder-runs"),
                   help="records and failures (kept in git), trunk states (work/) and the probe (ignored)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: the CPU ladder; cuda: 10M-125M sized to fit --budget-s on an H200")
    p.add_argument("--train-device", default=None,
                   help="where to train (default: --device); --device cuda --train-device cpu runs the GPU "
                        "ladder's plan on the CPU (with --smoke: its smoke test)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps, part of the validation split")
    p.add_argument("--corpora", nargs="+", default=None, choices=list(CORPORA),
                   help="default: stdlib and english (english where ../shared/data holds it)")
    p.add_argument("--variants", nargs="+", default=None, help="default: every variant but " + ", ".join(EXCLUDED))
    p.add_argument("--budget-scale", type=float, default=None,
                   help="multiply every token budget (default 1; --device cuda: fitted to --budget-s)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"stop starting runs after this many seconds (--device cuda: {GPU_BUDGET_S}, and the "
                        f"budgets are sized to fit it)")
    p.add_argument("--gpu-bench", type=Path, default=None,
                   help=f"gpu_bench JSON for --device cuda's sizing (default: {GPU_BENCH_REPORT.relative_to(REPO)})")
    p.add_argument("--plan-only", action="store_true", help="print the plan and its estimate, train nothing")
    p.add_argument("--no-probe", action="store_true", help="skip the throughput probe (no CPU-time estimate)")
    p.add_argument("--reprobe", action="store_true", help="measure the probe again instead of reusing out/probe-*.json")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--quiet", action="store_true", help="no line per scored point")
    p.add_argument("--rerun-stale", action="store_true",
                   help="run again the runs whose records were made under other defaults than today's (stale)")
    p.add_argument("--precision", choices=["bfloat16", "float32"], default=None,
                   help="the precision of a new ladder (default: train.dtype=auto on this machine); a ladder "
                        "with records trains in theirs, emulating bf16 on a CPU without bf16 instructions")
    p.add_argument("--retry-failed", action="store_true",
                   help="run again the runs that failed before (listed in OUT/failed.json); default: leave them out")
    p.add_argument("--shard", type=shard, default=None, metavar="K/N",
                   help="run only the K-th of N interleaved parts of the plan (every N-th run from the K-th), "
                        "so N processes with the same --out, one per core, share the ladder without overlap")
    args = p.parse_args(argv)
    if args.budget_scale is not None and not args.budget_scale > 0:
        p.error("--budget-scale must be > 0")
    if args.budget_s is not None and not args.budget_s > 0:
        p.error("--budget-s must be > 0")
    return args


def shard(text: str) -> tuple[int, int]:
    """`K/N` (1 <= K <= N) -> (K, N)."""
    part, slash, count = text.partition("/")
    try:
        k, n = int(part), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K/N (e.g. 1/2)") from None
    if not slash or not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"{text!r}: K/N needs 1 <= K <= N")
    return k, n


def shard_runs(runs: list[RunPlan], part: tuple[int, int] | None) -> list[RunPlan]:
    """The runs of one shard: every N-th run of the whole plan from the K-th. By the run's place in
    the plan, not among the unfinished runs: shards started at different times never overlap."""
    if part is None:
        return runs
    k, n = part
    return runs[k - 1::n]


def ladder_spec(args: argparse.Namespace) -> LadderSpec:
    if not args.smoke:
        return CUDA if args.device == "cuda" else CPU
    return CUDA_SMOKE if args.device == "cuda" else SMOKE


def default_corpora() -> tuple[str, ...]:
    english = Path(CORPORA["english"][len("text:"):])
    return ("stdlib", "english") if english.is_file() else ("stdlib",)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _main(args)
    except LatentloopError as exc:
        print(f"ladder: error: {first_line(exc)}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    started = time.perf_counter()  # --budget-s is the command's: planning, data and probes count
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = ladder_spec(args)
    corpora = tuple(args.corpora or default_corpora())
    missing = [c for c in corpora if CORPORA[c].startswith("text:") and not Path(CORPORA[c][len("text:"):]).exists()]
    if missing:
        raise LatentloopError(f"corpus {missing[0]!r} needs {CORPORA[missing[0]][len('text:'):]}, which is not here")
    git_stamp()  # the code this process loaded, before a later commit could move HEAD
    variants = ladder_variants(args.variants)
    train_device = args.train_device or args.device
    no_cuda = train_device.startswith("cuda") and not torch.cuda.is_available()
    if no_cuda and not args.plan_only:
        raise LatentloopError(f"--device {train_device}: torch sees no CUDA device here; --plan-only prints the GPU "
                              f"ladder's plan and H200 estimate without one, and --train-device cpu --smoke runs it "
                              f"at smoke scale on the CPU")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    val_sizes = {corpus: val_tokens(corpus, spec) for corpus in corpora}
    budget_s = args.budget_s
    gpu_estimates: dict[str, float] = {}
    if args.device == "cuda":  # the whole GPU ladder sized to the budget (the smoke trains its own tiny plan)
        rates, source = gpu_rate(args.gpu_bench)
        budget_s = budget_s or GPU_BUDGET_S
        if args.budget_scale is None:
            # fitted to the whole budget, not to what is left of it: the scale names every run's budgets
            # (so its records), and one that moved with the seconds spent before would not find them again
            scale, full, _ = fit_to_budget(CUDA, variants, corpora, budget_s, rates, val_sizes)
        else:
            scale, full = args.budget_scale, plan_ladder(CUDA, variants, corpora, args.budget_scale)
        params = {size.name: gpt_params(size, CUDA.seq_len) for size in CUDA.sizes}
        seconds = [gpu_seconds(r, rates, val_sizes, params) for r in full]
        h200 = sum(seconds)
        print(f"H200 estimate: {h200:.0f} s for the GPU ladder ({len(full)} runs, budgets x {scale:.4g}: "
              f"{CUDA.budget_ratios[0] * scale:.3g}-{CUDA.budget_ratios[-1] * scale:.3g} tokens per parameter); "
              f"rates from {source}, x {EAGER_SHARE} (eager) x (params / 124M) ** {SMALL_SHAPE_EXPONENT} below "
              f"124M; a scored token = 1/{GPU_EVAL_SPEEDUP:.0f} of a training token's FLOPs"
              + ("" if args.budget_scale is not None else
                 f"; --budget-scale {scale:.6g} gives this plan without the search (minutes of one core: plan "
                 f"with --plan-only before the GPU's window opens)"), flush=True)
        if h200 > budget_s:
            fitting = int(np.searchsorted(np.cumsum(seconds), budget_s, side="right"))
            sizes = sorted({r.size.name for r in full[:fitting]}, key=[s.name for s in CUDA.sizes].index)
            print(f"H200: does not fit {budget_s:.0f} s even at the shortest budgets that branch after the warmup; "
                  f"the budget stops it after about {fitting} of {len(full)} runs (sizes started: "
                  f"{', '.join(sizes) or 'none'}); name fewer --variants or --corpora for a whole ladder", flush=True)
        runs = plan_ladder(spec, variants, corpora, 1.0) if args.smoke else full
        gpu_estimates = {r.key: s for r, s in zip(full, seconds)}  # where no probe measured a run
    else:
        runs = plan_ladder(spec, variants, corpora, args.budget_scale or 1.0)
    for line in describe_plan(runs, spec) + epochs_note(runs, spec):
        print(line, flush=True)
    done = {r.key for r in runs if finished(out, r, args.rerun_stale)}  # each record read once
    failed_path = out / FAILED_FILE
    failures = read_failures(out)
    mine = shard_runs(runs, args.shard)
    todo = [r for r in mine if r.key not in done and (args.retry_failed or r.key not in failures)]
    left_failed = [r.key for r in mine if r.key in failures and r.key not in done and not args.retry_failed]
    if left_failed:
        print(f"{len(left_failed)} runs failed before and are left out ({failed_path}; --retry-failed runs them "
              f"again): {', '.join(left_failed)}", flush=True)
    dtype = "auto"
    if no_cuda:  # --plan-only: the plan and the H200 estimate stand; the precision is the GPU's to choose
        print(f"no CUDA device here: the plan above, without a precision check or probes on {train_device}",
              flush=True)
        return 0
    if todo:  # a finished ladder, or one only planned, is read whatever its records' precisions
        new_ladder = not (out / PRECISION_FILE).exists() and not any((out / "records").glob("*.json"))
        try:
            dtype = run_precision(out, train_device, args.precision, keep=not args.plan_only)
        except LatentloopError as exc:
            if not args.plan_only:
                raise
            print(f"warning: {first_line(exc)}; the estimate is this machine's train.dtype=auto", flush=True)
        source = ("the ladder's own: its records, or " + PRECISION_FILE if not new_ladder else
                  "--precision" if args.precision else "train.dtype=auto on this machine")
        print(f"{precision_note(torch.device(train_device), dtype)} ({source})", flush=True)
    shard_note = ("" if args.shard is None else
                  f"; shard {args.shard[0]}/{args.shard[1]}: {len(mine)} runs, {len(todo)} left")
    print(f"{len(done)} of {len(runs)} runs finished already (kept, skipped){shard_note}", flush=True)
    estimates = dict(gpu_estimates)
    if not args.no_probe and todo:
        from benchmarks.common import ContentionMeter

        meter = ContentionMeter().start()
        probes, measured = probe_all(runs, spec, train_device, out, fresh=args.reprobe, dtype=dtype)
        others = meter.stop()
        for run in runs:
            estimates[run.key] = sum(estimate_seconds(run, probes, val_sizes).values())
        remaining = sum(estimates[r.key] for r in todo)
        print(f"estimated {train_device.upper()} time: {sum(estimates.values()) / 3600:.2f} h for the whole ladder, "
              f"{remaining / 3600:.2f} h for the {len(todo)} runs left{'' if args.shard is None else ' in this shard'} "
              f"(each run's structural training FLOPs at "
              f"the FLOP rate probed over {PROBE_STEPS} steps of its variant and size after {PROBE_WARMUP} "
              f"unmeasured ones, plus its scored tokens at the scoring's probed tokens/s on "
              f"{PROBE_EVAL_BATCHES} batches, each the median of {PROBE_REPEATS}; "
              + (f"other processes used {'?' if others is None else f'{others:.0%}'} of the CPUs during the "
                 f"{measured} probes measured now" if measured else
                 f"every probe reused from {out / f'probe-{spec.name}-{train_device}.json'}: --reprobe measures "
                 f"them again") + ")", flush=True)
    if args.plan_only:
        return 0
    for i, run in enumerate(todo):
        spent = time.perf_counter() - started
        if budget_s is not None and spent + estimates.get(run.key, 0.0) > budget_s:
            print(f"budget: {spent:.0f} s of {budget_s:.0f} s spent; {len(todo) - i} runs not started "
                  f"(the next would need about {estimates.get(run.key, 0.0):.0f} s)", flush=True)
            break
        print(f"[{i + 1}/{len(todo)}] {run.key}: {len(run.branches)} budgets, {run.total_steps} steps at most",
              flush=True)
        try:
            execute(run, out, train_device, spec, progress=not args.quiet, rerun_stale=args.rerun_stale, dtype=dtype)
        except RunBusy as exc:
            print(f"skipped: {exc}", flush=True)
        except RunFailed as exc:  # one run's failure does not stop the others
            update_failures(out, run.key, {"error": str(exc), "commit": git_stamp()["commit"],
                                           "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            print(f"failed: {exc} (in {failed_path}; --retry-failed runs it again)", flush=True)
        else:  # finished here (or by another process meanwhile): a failure from before no longer stands
            if run.key in read_failures(out):
                update_failures(out, run.key, None)
    print(f"done: {sum(finished(out, r, args.rerun_stale) for r in runs)} of {len(runs)} runs finished; "
          f"{time.perf_counter() - started:.0f} s this invocation", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
