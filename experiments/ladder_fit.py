"""The ladder's fits and multipliers (issue 52; the rules: experiments/logs/2026-12-05-ladder-rules.md).

For each corpus, optimizer and size, gpt's decayed points give its BPB against training FLOPs and
against tokens. `ReferenceCurve` fits them with a power law with an irreducible term,
BPB = E + A x^(-alpha), by least squares on log BPB, where that fit is stable (converged, 0 < alpha
<= 2, 0 <= E < the lowest BPB seen, root mean square residual of log BPB <= `STABLE_RMS`), and
otherwise interpolates the seed-mean log BPB piecewise-linearly in log x. Either is inverted to the
x gpt needs to reach a BPB; neither goes past a factor `EXTRAPOLATION` beyond gpt's measured x, and a
BPB outside that gives a bound.

A variant's multiplier at one of its points (x_v, BPB_v) is x_gpt(BPB_v) / x_v: the compute
multiplier with x = training FLOPs, the data multiplier with x = tokens. The parameter multiplier
inverts gpt's BPB at the variant's tokens across sizes (`parameter_multiplier`). Intervals are
percentile bootstraps (`BOOTSTRAP` resamples, seeded): the seeds drawn with replacement, paired
between gpt and the variant; where the power law is used, gpt's fit residuals drawn with replacement
and added to its fitted log BPB before refitting.

    points = load_points(Path("runs/ladder"))
    result = multiplier(points, corpus="stdlib", optimizer="muon", size="s", variant="fbt", axis="tokens")
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BOOTSTRAP = 1000
BOOTSTRAP_SEED = 52  # the number: every table regenerates the same intervals
LEVEL = 0.95
STABLE_RMS = 0.01  # a power law whose log-BPB residuals are larger than 1% is not trusted
MAX_ALPHA = 2.0
EXTRAPOLATION = 2.0  # at most this factor beyond gpt's measured range
E_GRID = 400  # irreducible terms tried between 0 and the lowest BPB seen
DECAYED = ("tokens", "flops", "reference")  # the points at a branch's end (the fits use only these)
REFERENCE = "gpt"


@dataclass(frozen=True)
class Point:
    spec: str
    corpus: str
    optimizer: str
    size: str
    size_index: int
    variant: str
    arch: str
    seed: int
    kind: str  # "stable" (the trunk before a decay), "tokens", "flops", "reference"
    label: str
    budget: int
    tokens: float
    flops: float
    bpb: float
    epochs: float
    params: int  # the variant's non-embedding parameters
    key: str  # the record's run key


def load_records(out: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted((out / "records").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("complete"):
            records.append(record)
    return records


def points_of(records: Iterable[dict[str, Any]]) -> list[Point]:
    """Every scored point of every record, at the record's primary scoring."""
    found = []
    for record in records:
        plan = record["plan"]
        for p in record["points"]:
            found.append(Point(plan["spec"], plan["corpus"], plan["optimizer"], plan["size"]["name"],
                               plan.get("size_index", 0), plan["variant"]["name"], plan["variant"]["arch"],
                               plan["seed"], p["kind"], p["label"], p["budget"], float(p["tokens"]), float(p["flops"]),
                               float(p["scores"][p["primary"]]["bpb"]), float(p["epochs"]),
                               int(record["params_non_embedding"]), record["key"]))
    return found


def load_points(out: Path) -> list[Point]:
    return points_of(load_records(out))


def select(points: Sequence[Point], decayed: bool = True, **where: Any) -> list[Point]:
    return [p for p in points if (not decayed or p.kind in DECAYED)
            and all(getattr(p, k) == v for k, v in where.items())]


# --------------------------------------------------------------------------------------------
# gpt's curve
# --------------------------------------------------------------------------------------------


def fit_power_law(x: np.ndarray, y: np.ndarray) -> dict[str, Any] | None:
    """BPB = E + A x^(-alpha), least squares on log BPB: the irreducible term E on a grid in
    [0, min y), (log A, alpha) by linear least squares on log(y - E) at each (all at once), the best
    by the log-BPB residual. None when fewer than 3 distinct x."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(np.unique(x)) < 3 or np.any(y <= 0) or np.any(x <= 0):
        return None
    lx, ly = np.log(x), np.log(y)
    e = np.linspace(0.0, y.min() * (1 - 1e-3), E_GRID)[:, None]  # (G, 1)
    z = np.log(y[None, :] - e)  # (G, n)
    centred = lx - lx.mean()
    slope = (z * centred).sum(axis=1, keepdims=True) / (centred ** 2).sum()
    intercept = z.mean(axis=1, keepdims=True) - slope * lx.mean()
    sse = ((ly - np.log(e + np.exp(intercept + slope * lx))) ** 2).sum(axis=1)
    i = int(np.argmin(sse))
    fit = {"E": float(e[i, 0]), "A": float(np.exp(intercept[i, 0])), "alpha": float(-slope[i, 0]),
           "sse": float(sse[i])}
    fit["rms"] = math.sqrt(fit["sse"] / len(x))
    fit["residuals"] = (ly - np.log(fit["E"] + fit["A"] * x ** -fit["alpha"])).tolist()
    return fit


def stable(fit: dict[str, float] | None, y: np.ndarray) -> bool:
    return (fit is not None and 0 < fit["alpha"] <= MAX_ALPHA and 0 <= fit["E"] < 0.995 * float(np.min(y))
            and fit["rms"] <= STABLE_RMS)


@dataclass
class ReferenceCurve:
    """gpt's BPB against x (tokens or FLOPs) at one corpus, optimizer and size."""

    method: str  # "power law" or "interpolation"
    x_range: tuple[float, float]
    fit: dict[str, Any] | None = None
    knots: tuple[np.ndarray, np.ndarray] | None = None  # interpolation: log x, log BPB (seed means, ascending x)

    @classmethod
    def build(cls, x: np.ndarray, y: np.ndarray, groups: np.ndarray, method: str | None = None) -> ReferenceCurve:
        """From every seed's points (`groups`: each point's budget, for the seed means); `method`
        forces one (the bootstrap keeps the full data's choice where it can)."""
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        fit = fit_power_law(x, y) if method in (None, "power law") else None
        x_range = (float(x.min()), float(x.max()))
        if stable(fit, y):
            return cls("power law", x_range, fit=fit)
        budgets = sorted(set(groups.tolist()))
        lx = np.array([np.mean(np.log(x[groups == b])) for b in budgets])
        ly = np.array([np.mean(np.log(y[groups == b])) for b in budgets])
        order = np.argsort(lx)
        return cls("interpolation", x_range, fit=fit, knots=(lx[order], ly[order]))

    def bpb_at(self, x: float) -> float | None:
        """gpt's BPB at x, None beyond the extrapolation limit."""
        low, high = self.x_range
        if not low / EXTRAPOLATION <= x <= high * EXTRAPOLATION:
            return None
        if self.method == "power law":
            return self.fit["E"] + self.fit["A"] * x ** -self.fit["alpha"]
        lx, ly = self.knots
        return float(np.exp(_extended_interp(math.log(x), lx, ly)))

    def x_for(self, bpb: float) -> tuple[float, str | None]:
        """The x at which gpt reaches `bpb`: (x, None), or (the limit, "above" / "below") when it lies
        beyond the extrapolation limit on that side."""
        low, high = self.x_range[0] / EXTRAPOLATION, self.x_range[1] * EXTRAPOLATION
        if self.method == "power law":
            e, a, alpha = self.fit["E"], self.fit["A"], self.fit["alpha"]
            if bpb <= e:
                return high, "above"
            x = (a / (bpb - e)) ** (1 / alpha)
        else:
            lx, ly = self.knots
            x = _invert_decreasing(math.log(bpb), lx, ly)
            if x is None:
                return (high, "above") if bpb < math.exp(ly.min()) else (low, "below")
            x = math.exp(x)
        if x > high:
            return high, "above"
        if x < low:
            return low, "below"
        return x, None


def _extended_interp(t: float, lx: np.ndarray, ly: np.ndarray) -> float:
    """Piecewise-linear through the knots, continued by the end segments' slopes."""
    if len(lx) == 1:
        return float(ly[0])
    if t <= lx[0]:
        return float(ly[0] + (ly[1] - ly[0]) / (lx[1] - lx[0]) * (t - lx[0]))
    if t >= lx[-1]:
        return float(ly[-1] + (ly[-1] - ly[-2]) / (lx[-1] - lx[-2]) * (t - lx[-1]))
    return float(np.interp(t, lx, ly))


def _invert_decreasing(target: float, lx: np.ndarray, ly: np.ndarray) -> float | None:
    """The first log x at which the piecewise-linear curve (extended by its end segments up to the
    extrapolation limit) comes down to `target`; None if it never does there."""
    limit = math.log(EXTRAPOLATION)
    xs = np.concatenate([[lx[0] - limit], lx, [lx[-1] + limit]])
    ys = np.array([_extended_interp(t, lx, ly) for t in xs])
    for i in range(len(xs) - 1):
        a, b = ys[i], ys[i + 1]
        if (a - target) * (b - target) <= 0 and a != b:
            return float(xs[i] + (target - a) / (b - a) * (xs[i + 1] - xs[i]))
        if a == target:
            return float(xs[i])
    return None


# --------------------------------------------------------------------------------------------
# Multipliers with bootstrap intervals
# --------------------------------------------------------------------------------------------


@dataclass
class Estimate:
    """A multiplier (or ratio): its point, its interval (None: no interval), and bounds when the
    point or an end lies past the extrapolation limit ("above": the true value is larger)."""

    value: float
    interval: tuple[float, float] | None
    censored: str | None = None  # the point's bound direction
    censored_ends: tuple[str | None, str | None] = (None, None)
    method: str = ""
    seeds: int = 0
    notes: list[str] = field(default_factory=list)
    samples: np.ndarray | None = None  # the bootstrap draws (the trend's input)

    def decided(self) -> str:
        """"> 1", "< 1" or "undecided" (no interval counts as undecided)."""
        if self.interval is None:
            return "undecided"
        if self.interval[0] > 1:
            return "> 1"
        if self.interval[1] < 1:
            return "< 1"
        return "undecided"

    def text(self, digits: int = 2) -> str:
        def fmt(v: float, bound: str | None) -> str:
            mark = {"above": ">", "below": "<"}.get(bound or "", "")
            return f"{mark}{v:.{digits}f}"

        base = fmt(self.value, self.censored)
        if self.interval is None:
            return base + (" (1 seed, no interval)" if self.seeds <= 1 else " (no interval)")
        low, high = fmt(self.interval[0], self.censored_ends[0]), fmt(self.interval[1], self.censored_ends[1])
        return f"{base} [{low}, {high}]"


def _seed_table(points: Sequence[Point], axis: str) -> dict[int, list[tuple[float, float, int]]]:
    """seed -> [(x, bpb, budget)] over a curve's decayed points."""
    table: dict[int, list[tuple[float, float, int]]] = {}
    for p in points:
        table.setdefault(p.seed, []).append((getattr(p, axis), p.bpb, p.budget))
    return table


def _curve_from(table: dict[int, list[tuple[float, float, int]]], seeds: Sequence[int], method: str | None,
                residuals: np.ndarray | None = None, rng: np.random.Generator | None = None,
                fitted: ReferenceCurve | None = None) -> ReferenceCurve:
    rows = [row for s in seeds for row in table[s]]
    x = np.array([r[0] for r in rows])
    y = np.array([r[1] for r in rows])
    groups = np.array([r[2] for r in rows])
    if residuals is not None and fitted is not None and fitted.method == "power law":
        f = fitted.fit
        y = (f["E"] + f["A"] * x ** -f["alpha"]) * np.exp(rng.choice(residuals, size=len(x)))
    return ReferenceCurve.build(x, y, groups, method)


def _percentile_interval(samples: np.ndarray, bounds: np.ndarray) -> tuple[tuple[float, float], tuple]:
    low, high = np.quantile(samples, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    lower_bound = "below" if np.mean(bounds == -1) > (1 - LEVEL) / 2 else None
    upper_bound = "above" if np.mean(bounds == 1) > (1 - LEVEL) / 2 else None
    return (float(low), float(high)), (lower_bound, upper_bound)


def multiplier(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str, axis: str,
               budget: int | None = None, kind: str = "tokens", spec: str | None = None) -> Estimate | None:
    """The variant's compute (axis="flops") or data (axis="tokens") multiplier over gpt at one of
    its points (`kind` budget `budget`; default its largest): x_gpt(BPB_v) / x_v, bootstrapped."""
    where = dict(corpus=corpus, optimizer=optimizer, size=size) | ({"spec": spec} if spec else {})
    reference = select(points, variant=REFERENCE, **where)
    mine = [p for p in select(points, variant=variant, **where) if p.kind == kind]
    if not reference or not mine:
        return None
    budget = max(p.budget for p in mine) if budget is None else budget
    mine = [p for p in mine if p.budget == budget]
    table = _seed_table(reference, axis)
    seeds = sorted(set(table) & {p.seed for p in mine})
    if not seeds:
        return None
    by_seed = {p.seed: p for p in mine}
    full = _curve_from(table, seeds, None)
    residuals = np.array(full.fit["residuals"]) if full.method == "power law" else None

    def value(curve: ReferenceCurve, drawn: Sequence[int]) -> tuple[float, int]:
        bpb = float(np.mean([by_seed[s].bpb for s in drawn]))
        x_v = float(np.mean([getattr(by_seed[s], axis) for s in drawn]))
        x, bound = curve.x_for(bpb)
        return x / x_v, {"above": 1, "below": -1}.get(bound or "", 0)

    point, point_bound = value(full, seeds)
    estimate = Estimate(point, None, {1: "above", -1: "below"}.get(point_bound), method=full.method, seeds=len(seeds))
    if len(seeds) == 1 and residuals is None:
        return estimate
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    samples, bounds = np.empty(BOOTSTRAP), np.zeros(BOOTSTRAP, dtype=int)
    for b in range(BOOTSTRAP):
        drawn = list(rng.choice(seeds, size=len(seeds), replace=True))
        curve = _curve_from(table, drawn, full.method, residuals, rng, full)
        samples[b], bounds[b] = value(curve, drawn)
    estimate.interval, estimate.censored_ends = _percentile_interval(samples, bounds)
    estimate.samples = samples
    return estimate


def parameter_multiplier(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str,
                         spec: str | None = None) -> Estimate | None:
    """N_gpt(BPB_v; T_v) / N_v at the variant's largest token budget: gpt's BPB at the variant's
    tokens at each size (its tokens curve), then log N against log BPB across the sizes, inverted.
    Bootstrapped: each size's gpt seeds drawn independently, the variant's seeds paired with its
    own size's gpt seeds."""
    where = dict(corpus=corpus, optimizer=optimizer) | ({"spec": spec} if spec else {})
    mine = [p for p in select(points, variant=variant, size=size, **where) if p.kind == "tokens"]
    if not mine:
        return None
    budget = max(p.budget for p in mine)
    mine = {p.seed: p for p in mine if p.budget == budget}
    references = {}
    for p in select(points, variant=REFERENCE, **where):
        references.setdefault((p.size_index, p.size), []).append(p)
    if len(references) < 2 or not any(s == size for _, s in references):
        return None
    tables = {key: _seed_table(pts, "tokens") for key, pts in references.items()}
    params = {key: pts[0].params for key, pts in references.items()}
    own = next(key for key in tables if key[1] == size)
    paired = sorted(set(mine) & set(tables[own]))
    if not paired:
        return None

    def value(draws: dict[tuple, list[int]], drawn_own: list[int]) -> tuple[float, int]:
        bpb = float(np.mean([mine[s].bpb for s in drawn_own]))
        tokens = float(np.mean([mine[s].tokens for s in drawn_own]))
        n_v = mine[drawn_own[0]].params
        curve_points = []
        for key in sorted(tables):
            curve = _curve_from(tables[key], draws[key], None)
            at = curve.bpb_at(tokens)
            if at is not None:
                curve_points.append((math.log(params[key]), math.log(at)))
        if len(curve_points) < 2:
            return float("nan"), 0
        lx = np.array([c[0] for c in curve_points])
        ly = np.array([c[1] for c in curve_points])
        curve = ReferenceCurve("interpolation", (math.exp(lx.min()), math.exp(lx.max())), knots=(lx, ly))
        n, bound = curve.x_for(bpb)
        return n / n_v, {"above": 1, "below": -1}.get(bound or "", 0)

    point, bound = value({key: sorted(t) for key, t in tables.items()} | {own: paired}, paired)
    if math.isnan(point):
        return None
    estimate = Estimate(point, None, {1: "above", -1: "below"}.get(bound), method="interpolation across sizes",
                        seeds=len(paired))
    if all(len(t) == 1 for t in tables.values()):
        return estimate
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    samples, bounds = np.empty(BOOTSTRAP), np.zeros(BOOTSTRAP, dtype=int)
    for b in range(BOOTSTRAP):
        drawn_own = list(rng.choice(paired, size=len(paired), replace=True))
        draws = {key: list(rng.choice(sorted(t), size=len(t), replace=True)) for key, t in tables.items()}
        draws[own] = drawn_own
        samples[b], bounds[b] = value(draws, drawn_own)
    keep = ~np.isnan(samples)
    estimate.interval, estimate.censored_ends = _percentile_interval(samples[keep], bounds[keep])
    estimate.samples = samples[keep]
    return estimate


def paired_ratio(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str, baseline: str,
                 budget: int, spec: str | None = None) -> dict[str, Any] | None:
    """Per-seed BPB ratio variant / baseline at the points matched to gpt's training FLOPs at
    `budget` (a FLOP-matched branch, or the token budget where a variant needs none), with the
    FLOPs ratio of every pair; mean [95% t-interval over seeds]. Pairs whose FLOPs differ by more
    than 5% are refused (listed under "refused")."""
    from latentloop.eval.stats import mean_sd, t_interval

    where = dict(corpus=corpus, optimizer=optimizer, size=size) | ({"spec": spec} if spec else {})

    def matched(name: str) -> dict[int, Point]:
        pts = select(points, variant=name, **where)
        by_kind = {p.seed: p for p in pts if p.kind == "flops" and p.budget == budget}
        tokens = {p.seed: p for p in pts if p.kind == "tokens" and p.budget == budget}
        return by_kind or tokens

    a, b = matched(variant), matched(baseline)
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    ratios, flops_ratios, refused = [], [], []
    for s in seeds:
        f = a[s].flops / b[s].flops
        if abs(f - 1) > 0.05:
            refused.append(s)
            continue
        ratios.append(a[s].bpb / b[s].bpb)
        flops_ratios.append(f)
    if not ratios:
        return {"refused": refused, "flops_ratios": [a[s].flops / b[s].flops for s in seeds]}
    mean, _ = mean_sd(ratios)
    return {"mean": mean, "interval": t_interval(ratios), "ratios": ratios, "flops_ratios": flops_ratios,
            "refused": refused, "seeds": len(ratios)}


def trend(estimates: Sequence[tuple[int, Estimate]]) -> dict[str, Any] | None:
    """The slope of log multiplier against log N over the sizes ((params, estimate) pairs), its
    interval from the sizes' bootstrap draws (independent; a size without draws enters as its
    point), and "grows" / "shrinks" / "no trend resolved"."""
    usable = [(n, e) for n, e in estimates if e is not None and e.value > 0]
    if len(usable) < 2:
        return None
    lx = np.log([n for n, _ in usable])

    def slope(values: Sequence[float]) -> float:
        return float(np.polyfit(lx, np.log(values), 1)[0])

    point = slope([e.value for _, e in usable])
    # each size's draws in an order of its own: the sizes' bootstraps used the same seeded stream
    shuffled = [None if e.samples is None or not len(e.samples) else
                np.random.default_rng(BOOTSTRAP_SEED + i).permutation(e.samples) for i, (_, e) in enumerate(usable)]
    draws = []
    for b in range(BOOTSTRAP):
        row = [e.value if draws_i is None else draws_i[b % len(draws_i)] for (_, e), draws_i in zip(usable, shuffled)]
        if all(v > 0 for v in row):
            draws.append(slope(row))
    if not draws or all(e.samples is None for _, e in usable):
        return {"slope": point, "interval": None, "verdict": "no trend resolved (no intervals)"}
    low, high = np.quantile(draws, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    verdict = "grows" if low > 0 else "shrinks" if high < 0 else "no trend resolved"
    return {"slope": point, "interval": (float(low), float(high)), "verdict": verdict}


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def plot_curves(points: Sequence[Point], corpus: str, optimizer: str, path: Path, spec: str | None = None) -> bool:
    """BPB against training FLOPs (top row) and tokens (bottom row), one column per size, one line
    per variant (the seed mean of its decayed points), a band from the lowest to the highest seed,
    and the trunk's stable-phase points dotted. False without matplotlib or points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter, ScalarFormatter
    except ImportError:
        return False
    where = dict(corpus=corpus, optimizer=optimizer) | ({"spec": spec} if spec else {})
    mine = select(points, decayed=False, **where)
    if not mine:
        return False
    sizes = sorted({(p.size_index, p.size) for p in mine})
    variants = list(dict.fromkeys(p.variant for p in mine))
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.2 * len(sizes), 7.5), squeeze=False)
    for column, (_, size) in enumerate(sizes):
        for row, axis in enumerate(("flops", "tokens")):
            ax = axes[row][column]
            for i, name in enumerate(variants):
                color = f"C{i % 10}"
                pts = [p for p in mine if p.size == size and p.variant == name]
                decayed = [p for p in pts if p.kind in DECAYED]
                if not decayed:
                    continue
                budgets = sorted({(p.kind, p.budget) for p in decayed}, key=lambda kb: np.mean(
                    [getattr(p, axis) for p in decayed if (p.kind, p.budget) == kb]))
                xs, mean, low, high = [], [], [], []
                for kb in budgets:
                    group = [p for p in decayed if (p.kind, p.budget) == kb]
                    xs.append(np.mean([getattr(p, axis) for p in group]))
                    values = [p.bpb for p in group]
                    mean.append(np.mean(values))
                    low.append(min(values))
                    high.append(max(values))
                ax.plot(xs, mean, marker="o", markersize=3, color=color, label=name)
                ax.fill_between(xs, low, high, color=color, alpha=0.15)
                stable_pts = [p for p in pts if p.kind == "stable"]
                if stable_pts:
                    ax.plot([getattr(p, axis) for p in stable_pts], [p.bpb for p in stable_pts], linestyle="none",
                            marker=".", color=color, alpha=0.4)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())  # BPB as plain numbers on the log axis
            ax.yaxis.set_minor_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())  # the decades only: the minor labels collide
            ax.grid(alpha=0.3, which="both")
            ax.set_xlabel("training FLOPs" if axis == "flops" else "tokens")
            if column == 0:
                ax.set_ylabel("validation BPB (whole split)")
            if row == 0:
                ax.set_title(f"size {size}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{corpus}, {optimizer}: decayed WSD endpoints (lines: seed mean, bands: seed range; "
                 f"dots: the trunk before each decay)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
