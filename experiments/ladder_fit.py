"""The ladder's fits and multipliers (issue 52; the rules: experiments/logs/2026-12-05-ladder-rules.md, amended).

For each corpus, optimizer and size, gpt's decayed points give its BPB against training FLOPs and
against tokens. `ReferenceCurve` fits them with a power law with an irreducible term,
BPB = E + A x^(-alpha), by least squares on log BPB, where that fit is stable (converged, 0 < alpha
<= 2, 0 <= E < the lowest BPB seen, root mean square residual of log BPB <= `STABLE_RMS`), and
otherwise interpolates the seed-mean log BPB piecewise-linearly in log x; within one cell every
seed's curve is of one method (the power law only where it is stable for every seed: the second
amendment, experiments/logs/2026-12-06-ladder-rules-one-curve-method.md). Either is inverted to the
x gpt needs to reach a BPB; neither goes past a factor `EXTRAPOLATION` beyond gpt's measured x, and a
BPB outside that gives a bound.

A variant's multiplier at one of its points (x_v, BPB_v) is x_gpt(BPB_v) / x_v: the compute
multiplier with x = training FLOPs, the data multiplier with x = tokens. It is made per seed, paired
(gpt's curve from the seed's own points: the same data order and initialisation as the variant's),
and the estimate is the seeds' geometric mean with its t-interval; a one-seed size's interval takes
the per-seed scatter pooled over the seeded sizes (the amended rules:
experiments/logs/2026-12-05-ladder-rules-amended.md, which replaced a percentile bootstrap that
covered about 75% of the time at three seeds). The parameter multiplier inverts gpt's BPB at the
variant's tokens across sizes (`parameter_multiplier`). The trend over size is a weighted least
squares slope with the pooled scatter (`trend`).

    points = load_points(Path("experiments/ladder-runs"))
    result = multiplier(points, corpus="stdlib", optimizer="muon", size="s", variant="fbt", axis="tokens")
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from latentloop.eval.stats import t_quantile  # noqa: E402
from latentloop.util import pyplot, save_figure  # noqa: E402

LEVEL = 0.95
FLOPS_MATCH = 0.05  # isoFLOPs: training FLOPs within 5% (rules 4 and 5 refuse a pair further apart)
STABLE_RMS = 0.01  # a power law whose log-BPB residuals are larger than 1% is not trusted
MAX_ALPHA = 2.0
EXTRAPOLATION = 2.0  # at most this factor beyond gpt's measured range
TITLE_CHARS_PER_INCH = 10  # a plot title's characters per inch of figure at fontsize 9, with a margin
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
    """The finished runs' records under OUT/records; one that does not read is named on stderr and
    left out (it was skipped silently), an unfinished one left out."""
    records = []
    for path in sorted((out / "records").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"warning: {path} does not read as a record ({type(exc).__name__}): left out", file=sys.stderr)
            continue
        if isinstance(record, dict) and record.get("complete"):
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
# The plan: which runs a figure waits for
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedRun:
    """One run of a ladder's plan (a plan entry: a record's, or today's plan rebuilt)."""

    key: str
    spec: str
    corpus: str
    optimizer: str
    size: str
    size_index: int
    variant: str
    seed: int
    branches: frozenset[tuple[str, int]]  # (kind, budget) of every branch it ends
    gpt_params: int = 0  # gpt's non-embedding parameters at its size, where known


class Plan:
    """The runs a ladder plans, by key. A figure is made only from whole sets of them: the largest
    budget is the plan's, not the largest among the records so far (fbt-paper trains a straight run
    per budget, and a missing one would silently move "the largest"), "every size" is every
    planned size, and a figure whose planned runs have not all finished is `Incomplete`."""

    def __init__(self, runs: Iterable[PlannedRun], failed: Iterable[str] = ()):
        self.runs = list({(run.key, run.spec, run.corpus, run.optimizer, run.size, run.variant, run.seed): run
                          for run in runs}.values())
        # runs that failed (failed.json) and have no record: a cell waiting for one says so, or it
        # would read "incomplete" for good without a word of why
        self.failed = frozenset(failed)

    @classmethod
    def from_entries(cls, entries: Iterable[dict[str, Any]], gpt_params: dict[tuple[str, str], int] | None = None,
                     ) -> Plan:
        """From plan entries (`RunPlan.describe()`, as records keep them); `gpt_params`: (spec, size)
        -> gpt's non-embedding parameters."""
        found = []
        for entry in entries:
            size = entry["size"]["name"]
            found.append(PlannedRun(entry["key"], entry["spec"], entry["corpus"], entry["optimizer"], size,
                                    entry.get("size_index", 0), entry["variant"]["name"], entry["seed"],
                                    frozenset((b["kind"], b["budget"]) for b in entry["branches"]),
                                    (gpt_params or {}).get((entry["spec"], size), 0)))
        return cls(found)

    @classmethod
    def from_points(cls, points: Sequence[Point]) -> Plan:
        """The runs the points come from, as if they were the whole plan (no plan at hand)."""
        runs: dict[tuple, list[Point]] = {}
        for p in points:
            runs.setdefault((p.key, p.spec, p.corpus, p.optimizer, p.size, p.variant, p.seed), []).append(p)
        params = {(p.spec, p.size): p.params for p in points if p.variant == REFERENCE}
        return cls(PlannedRun(pts[0].key, pts[0].spec, pts[0].corpus, pts[0].optimizer, pts[0].size,
                              pts[0].size_index, pts[0].variant, pts[0].seed,
                              frozenset((p.kind, p.budget) for p in pts if p.kind in DECAYED),
                              params.get((pts[0].spec, pts[0].size), 0))
                   for pts in runs.values())

    def select(self, **where: Any) -> list[PlannedRun]:
        return [r for r in self.runs if all(getattr(r, k) == v for k, v in where.items())]

    def restricted(self, keep: Any) -> Plan:
        return Plan((r for r in self.runs if keep(r)), self.failed)

    def sizes(self, **where: Any) -> list[tuple[int, str]]:
        """(index, name) of every size gpt is planned at, smallest first."""
        return sorted({(r.size_index, r.size) for r in self.select(variant=REFERENCE, **where)})

    def largest_budget(self, variant: str, kind: str = "tokens", **where: Any) -> int | None:
        budgets = [b for r in self.select(variant=variant, **where) for k, b in r.branches if k == kind]
        return max(budgets) if budgets else None

    def incomplete(self, points: Sequence[Point], required: Sequence[PlannedRun], size: str = "",
                   seeds: int = 0) -> Incomplete | None:
        """`Incomplete` where some of the `required` runs have no record among the points."""
        have = {p.key for p in points}
        keys = {r.key for r in required}
        done = len(keys & have)
        failed = len((keys - have) & self.failed)
        return None if done == len(keys) else Incomplete(done, len(keys), size, seeds=seeds, failed=failed)


@dataclass(frozen=True)
class Incomplete:
    """A figure that waits for runs of the plan: `have` of the `planned` runs behind it have records
    (or, `waits_for`, for another size's figure: a one-seed size's interval takes the seeded sizes'
    scatter). It decides nothing, and is shown as such, until they have all finished."""

    have: int
    planned: int
    size: str = ""
    seeds: int = 0  # the planned seeds of the comparison
    waits_for: str = ""
    failed: int = 0  # of the missing runs, those that failed (failed.json): retried with --retry-failed

    def text(self, digits: int = 2) -> str:
        if self.waits_for:
            return f"incomplete: waits for {self.waits_for}"
        failed = f", {self.failed} of them failed (failed.json)" if self.failed else ""
        return f"incomplete: {self.have} of {self.planned} runs{failed}"


@dataclass(frozen=True)
class Undefined:
    """A figure its own definition does not give: P where gpt's BPB at the variant's tokens does not fall
    with gpt's size (the sizes train at batch 4, 8 and 16 sequences, so at equal tokens a larger gpt
    takes fewer steps and may end worse): no parameter count is "the one gpt needs", and inverting the
    curve read a bound on the wrong side. It decides nothing, and says why."""

    size: str
    reason: str

    def text(self, digits: int = 2) -> str:
        return f"undefined ({self.reason})"


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
    return (fit is not None and 0 < fit["alpha"] <= MAX_ALPHA and 0 <= fit["E"] < float(np.min(y))
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
        """From the points (`groups`: each point's budget, for the means of several seeds' points);
        `method` forces one."""
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
# Multipliers per seed, paired, and their intervals over seeds
# --------------------------------------------------------------------------------------------

BOUND_SIGNS = {"above": 1, "below": -1}


@dataclass(frozen=True)
class SeedMean:
    """A mean over seeds (of log multipliers, or of BPB ratios) and its standard error: from the
    seeds' own scatter with two or more (t at n - 1 degrees of freedom), or at a one-seed size from
    the per-seed scatter pooled over the seeded sizes (t at the pooled degrees of freedom). `se`
    None: one seed and nothing to pool, so no interval."""

    center: float
    se: float | None = None
    df: int | None = None
    pooled: bool = False

    def interval(self, level: float = LEVEL) -> tuple[float, float] | None:
        if self.se is None:
            return None
        half = t_quantile(0.5 + level / 2, self.df) * self.se
        return self.center - half, self.center + half


def seed_mean(values: Sequence[float], pooled: tuple[float, int] | None = None) -> SeedMean:
    """The mean of per-seed `values`; with one value, `pooled` (the seed scatter, its degrees of
    freedom) gives its standard error."""
    center = float(np.mean(values))
    if len(values) >= 2:
        return SeedMean(center, float(np.std(values, ddof=1)) / math.sqrt(len(values)), len(values) - 1)
    if pooled is not None:
        return SeedMean(center, pooled[0], pooled[1], pooled=True)
    return SeedMean(center)


def pooled_scatter(groups: Iterable[Sequence[float]]) -> tuple[float, int] | None:
    """The per-seed standard deviation pooled over the groups of two or more values (each about its
    own mean) and its degrees of freedom; None without such a group."""
    squares, df = 0.0, 0
    for values in groups:
        if len(values) >= 2:
            array = np.asarray(values, dtype=np.float64)
            squares += float(np.sum((array - array.mean()) ** 2))
            df += len(array) - 1
    return (math.sqrt(squares / df), df) if df else None


@dataclass
class SeedValues:
    """One size's per-seed values of a multiplier (log) or a ratio, before the interval."""

    values: dict[int, float]  # seed -> log multiplier (or ratio)
    bounds: dict[int, int] = field(default_factory=dict)  # seed -> 1 ("above"), -1 ("below"), 0
    methods: tuple[str, ...] = ()  # gpt's curve per seed
    epochs: float = 0.0  # the most epochs any point behind them read
    extrapolated: set[int] = field(default_factory=set)  # seeds read off gpt's curve past its measured range


@dataclass
class Estimate:
    """A multiplier: the geometric mean of its per-seed values, its 95% interval (None: no
    interval) and bounds where a seed's value lies past the extrapolation limit ("above": the true
    value is larger). `mean` keeps the log-scale mean and standard error (an interval at another
    level: `interval_at`), `logs` the per-seed log values (the trend pools their scatter)."""

    value: float
    interval: tuple[float, float] | None
    censored: str | None = None  # the point's bound direction
    censored_ends: tuple[str | None, str | None] = (None, None)
    method: str = ""
    seeds: int = 0
    mean: SeedMean | None = None
    logs: tuple[float, ...] = ()
    pooled_from: tuple[str, ...] = ()  # a one-seed size: the sizes whose seed scatter gave its interval
    epochs: float = 0.0
    size: str = ""
    extrapolated: int = 0  # seeds whose value reads gpt's curve past its measured range (within EXTRAPOLATION)

    def interval_at(self, level: float) -> tuple[float, float] | None:
        found = None if self.mean is None else self.mean.interval(level)
        return None if found is None else (math.exp(found[0]), math.exp(found[1]))

    def text(self, digits: int = 2) -> str:
        def fmt(v: float, bound: str | None) -> str:
            mark = {"above": ">", "below": "<"}.get(bound or "", "")
            return f"{mark}{v:.{digits}f}"

        base = fmt(self.value, self.censored)
        repeated = f" (data repeated: up to {self.epochs:.1f} epochs)" if self.epochs > 1 else ""
        if self.extrapolated:
            repeated += f" (extrapolated past gpt's measured range for {self.extrapolated} of {self.seeds} seeds)"
        if self.interval is None:
            return base + (" (1 seed, no interval)" if self.seeds <= 1 else " (no interval)") + repeated
        low, high = fmt(self.interval[0], self.censored_ends[0]), fmt(self.interval[1], self.censored_ends[1])
        pooled = f" (1 seed; seed scatter of {', '.join(self.pooled_from)})" if self.pooled_from else ""
        return f"{base} [{low}, {high}]{pooled}{repeated}"


def _seed_table(points: Sequence[Point], axis: str) -> dict[int, list[tuple[float, float, int]]]:
    """seed -> [(x, bpb, budget)] over a curve's decayed points."""
    table: dict[int, list[tuple[float, float, int]]] = {}
    for p in points:
        table.setdefault(p.seed, []).append((getattr(p, axis), p.bpb, p.budget))
    return table


def _curve_from(table: dict[int, list[tuple[float, float, int]]], seeds: Sequence[int],
                method: str | None = None) -> ReferenceCurve:
    rows = [row for s in seeds for row in table[s]]
    return ReferenceCurve.build(np.array([r[0] for r in rows]), np.array([r[1] for r in rows]),
                                np.array([r[2] for r in rows]), method)


def _curves_of_one_method(table: dict[int, list[tuple[float, float, int]]], groups: Sequence[tuple[int, ...]],
                          method: str | None = None) -> dict[tuple[int, ...], ReferenceCurve]:
    """gpt's curve from each group of seeds' points, all by one method (the second amendment, 12-06):
    the power law where it is stable for every group, else the interpolation for every group, so that
    a method chosen seed by seed never reads as seed scatter. `method` "interpolation": that one,
    whatever the power law would do (a trend over sizes, the third amendment)."""
    curves = {group: _curve_from(table, group, method) for group in dict.fromkeys(groups)}
    if len({curve.method for curve in curves.values()}) > 1:
        curves = {group: _curve_from(table, group, "interpolation") for group in curves}
    return curves


def reference_fits(points: Sequence[Point], corpus: str, optimizer: str, size: str, axis: str,
                   spec: str | None = None) -> dict[int, dict[str, Any]]:
    """gpt's power law per seed at one size (BPB against `axis`, its decayed points): seed -> the fit
    (E, A, alpha, rms: the root mean square residual of log BPB) and whether it is `stable`, the
    residuals behind each cell's choice of method. A seed whose points take no fit is left out."""
    table = _seed_table(select(points, variant=REFERENCE, size=size, **_column(corpus, optimizer, spec)), axis)
    fits = {}
    for seed, rows in sorted(table.items()):
        y = np.array([r[1] for r in rows])
        fit = fit_power_law(np.array([r[0] for r in rows]), y)
        if fit is not None:
            fits[seed] = {**{k: fit[k] for k in ("E", "A", "alpha", "rms")}, "stable": stable(fit, y)}
    return fits


def _estimate(found: SeedValues, pooled: tuple[float, int] | None, pooled_from: tuple[str, ...],
              size: str) -> Estimate:
    """The geometric mean of per-seed multipliers, its t-interval; a bound where any seed is one."""
    seeds = sorted(found.values)
    logs = [found.values[s] for s in seeds]
    mean = seed_mean(logs, pooled)
    signs = set(found.bounds.values())
    censored = "above" if 1 in signs else "below" if -1 in signs else None
    interval = mean.interval()
    methods = sorted(set(found.methods))
    return Estimate(math.exp(mean.center), None if interval is None else (math.exp(interval[0]), math.exp(interval[1])),
                    censored, ("below" if -1 in signs else None, "above" if 1 in signs else None),
                    method=" / ".join(methods), seeds=len(seeds), mean=mean, logs=tuple(logs),
                    pooled_from=pooled_from if mean.pooled else (), epochs=found.epochs, size=size,
                    extrapolated=len(found.extrapolated & set(found.values)))


def _pooled_over_sizes(points: Sequence[Point], plan: Plan, where: dict[str, Any], size: str,
                       values_at: Any) -> tuple[tuple[float, int] | None, tuple[str, ...], tuple[str, ...]]:
    """The seed scatter of the same comparison pooled over the column's other planned sizes with two
    or more seeds (`values_at(size)`: their `SeedValues`, or `Incomplete`), those sizes' names, and
    the seeded sizes whose comparison is still incomplete (the scatter then waits for them)."""
    groups, names, waiting = [], [], []
    for _, other in plan.sizes(**where):
        found = None if other == size else values_at(other)
        if isinstance(found, Incomplete):
            if found.seeds >= 2:
                waiting.append(other)
        elif isinstance(found, SeedValues) and len(found.values) >= 2:
            groups.append(list(found.values.values()))
            names.append(other)
    return pooled_scatter(groups), tuple(names), tuple(waiting)


def _column(corpus: str, optimizer: str, spec: str | None) -> dict[str, Any]:
    return dict(corpus=corpus, optimizer=optimizer) | ({"spec": spec} if spec else {})


def _estimate_at(points: Sequence[Point], plan: Plan, column: dict[str, Any], size: str,
                 values_at: Any) -> Estimate | Incomplete | None:
    """The estimate at `size` from `values_at(size)`'s per-seed values; with one seed, its interval
    from the same comparison's seed scatter at the column's other sizes (incomplete while a seeded
    size's comparison is)."""
    found = values_at(size)
    if found is None or isinstance(found, (Incomplete, Undefined)):
        return found
    if len(found.values) >= 2:
        return _estimate(found, None, (), size)
    pooled, names, waiting = _pooled_over_sizes(points, plan, column, size, values_at)
    if waiting:
        return Incomplete(0, 0, size, seeds=len(found.values), waits_for=f"the seed scatter of {', '.join(waiting)}")
    return _estimate(found, pooled, names, size)


def multiplier_values(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str, axis: str,
                      budget: int | None = None, kind: str = "tokens", spec: str | None = None,
                      plan: Plan | None = None, method: str | None = None) -> SeedValues | Incomplete | None:
    """Per seed the variant shares with gpt: log(x_gpt,s(BPB_v,s) / x_v,s), gpt's curve from seed s's
    own points (paired: the same data order and initialisation). The budget (default: the variant's
    largest `kind` budget in the plan) and the seeds are the plan's: `Incomplete` until every planned
    run behind them (the variant's runs that end there, gpt's runs of those seeds) has its record;
    None where the plan has no such run."""
    plan = plan or Plan.from_points(points)
    where = _column(corpus, optimizer, spec) | {"size": size}
    budget = plan.largest_budget(variant, kind, **where) if budget is None else budget
    if budget is None:
        return None
    required = [r for r in plan.select(variant=variant, **where) if (kind, budget) in r.branches]
    if not required:
        return None
    seeds = {r.seed for r in required}
    required += [r for r in plan.select(variant=REFERENCE, **where) if r.seed in seeds]
    missing = plan.incomplete(points, required, size, seeds=len(seeds))
    if missing is not None:
        return missing
    reference = select(points, variant=REFERENCE, **where)
    mine = [p for p in select(points, variant=variant, **where) if p.kind == kind]
    by_seed = {p.seed: p for p in mine if p.budget == budget}
    table = _seed_table(reference, axis)
    seeds = sorted(set(table) & set(by_seed))
    if not seeds:
        return None
    found = SeedValues({}, epochs=max([p.epochs for p in reference] + [by_seed[s].epochs for s in seeds]))
    methods = []
    curves = _curves_of_one_method(table, [(s,) for s in seeds], method)
    for s in seeds:
        curve = curves[(s,)]
        x, bound = curve.x_for(by_seed[s].bpb)
        if bound is None and not curve.x_range[0] <= x <= curve.x_range[1]:
            found.extrapolated.add(s)
        found.values[s] = math.log(x / getattr(by_seed[s], axis))
        found.bounds[s] = BOUND_SIGNS.get(bound or "", 0)
        methods.append(curve.method)
    found.methods = tuple(methods)
    return found


def multiplier(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str, axis: str,
               budget: int | None = None, kind: str = "tokens", spec: str | None = None,
               plan: Plan | None = None, method: str | None = None) -> Estimate | Incomplete | None:
    """The variant's compute (axis="flops") or data (axis="tokens") multiplier over gpt at one of
    its points (`kind` budget `budget`; default its largest in the plan): x_gpt(BPB_v) / x_v per seed,
    their geometric mean and t-interval (a one-seed size: the seed scatter of the seeded sizes).
    `plan` (default: the runs the points come from) says which runs the figure waits for; `method`
    "interpolation" reads gpt's curves by it alone (`size_trend`)."""
    plan = plan or Plan.from_points(points)

    def values_at(name: str) -> SeedValues | Incomplete | None:
        return multiplier_values(points, corpus, optimizer, name, variant, axis, budget, kind, spec, plan, method)

    return _estimate_at(points, plan, _column(corpus, optimizer, spec), size, values_at)


def parameter_values(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str,
                     spec: str | None = None, plan: Plan | None = None) -> SeedValues | Incomplete | Undefined | None:
    """Per seed: log(N_gpt(BPB_v; T_v) / N_v) at the variant's largest token budget in the plan: gpt's
    BPB at the variant's tokens at each size (from seed s's points where that size has seed s, else
    from all its seeds), then log N against log BPB across the sizes, inverted. `Incomplete` until
    the variant's planned runs of that budget and every planned gpt run of the column have records;
    `Undefined` where a seed's gpt BPB does not fall with size there (nothing to invert)."""
    plan = plan or Plan.from_points(points)
    where = _column(corpus, optimizer, spec)
    budget = plan.largest_budget(variant, "tokens", size=size, **where)
    if budget is None:
        return None
    required = [r for r in plan.select(variant=variant, size=size, **where) if ("tokens", budget) in r.branches]
    if not required or len(plan.sizes(**where)) < 2:
        return None
    seeds = len({r.seed for r in required})
    missing = plan.incomplete(points, required + plan.select(variant=REFERENCE, **where), size, seeds=seeds)
    if missing is not None:
        return missing
    mine = [p for p in select(points, variant=variant, size=size, **where) if p.kind == "tokens"]
    mine = {p.seed: p for p in mine if p.budget == budget}
    references: dict[tuple[int, str], list[Point]] = {}
    for p in select(points, variant=REFERENCE, **where):
        references.setdefault((p.size_index, p.size), []).append(p)
    if len(references) < 2 or not any(s == size for _, s in references) or not mine:
        return None
    tables = {key: _seed_table(pts, "tokens") for key, pts in references.items()}
    params = {key: pts[0].params for key, pts in references.items()}
    own = next(key for key in tables if key[1] == size)
    found = SeedValues({}, epochs=max(p.epochs for pts in references.values() for p in pts))
    seeds = sorted(set(mine) & set(tables[own]))

    def group(key: tuple[int, str], s: int) -> tuple[int, ...]:  # seed s's curve at a size, else all seeds'
        return (s,) if s in tables[key] else tuple(sorted(tables[key]))

    curves = {key: _curves_of_one_method(tables[key], [group(key, s) for s in seeds]) for key in tables}
    for s in seeds:
        curve_points = []
        for key in sorted(tables):
            curve = curves[key][group(key, s)]
            at = curve.bpb_at(mine[s].tokens)
            if at is not None and not curve.x_range[0] <= mine[s].tokens <= curve.x_range[1]:
                found.extrapolated.add(s)  # this size's gpt read at tokens it did not train to
            if at is not None:
                curve_points.append((math.log(params[key]), math.log(at)))
        if len(curve_points) < 2:
            continue
        curve_points.sort()
        lx = np.array([c[0] for c in curve_points])
        ly = np.array([c[1] for c in curve_points])
        if np.any(np.diff(ly) >= 0):
            bpbs = ", ".join(f"{math.exp(y):.3f}" for y in ly)
            return Undefined(size, f"seed {s}: gpt's BPB at {mine[s].tokens:,.0f} tokens does not fall with its size "
                                   f"({bpbs}, smallest first)")
        across = ReferenceCurve("interpolation", (math.exp(lx.min()), math.exp(lx.max())), knots=(lx, ly))
        n, bound = across.x_for(mine[s].bpb)
        if bound is None and not across.x_range[0] <= n <= across.x_range[1]:
            found.extrapolated.add(s)
        found.values[s] = math.log(n / mine[s].params)
        found.bounds[s] = BOUND_SIGNS.get(bound or "", 0)
        found.epochs = max(found.epochs, mine[s].epochs)
    found.methods = ("interpolation across sizes",)
    return found if found.values else None


def parameter_multiplier(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str,
                         spec: str | None = None, plan: Plan | None = None) -> Estimate | Incomplete | None:
    """N_gpt(BPB_v; T_v) / N_v at the variant's largest token budget, per seed (`parameter_values`),
    their geometric mean and t-interval (a one-seed size: the seed scatter of the seeded sizes)."""
    plan = plan or Plan.from_points(points)

    def values_at(name: str) -> SeedValues | Incomplete | None:
        return parameter_values(points, corpus, optimizer, name, variant, spec, plan)

    return _estimate_at(points, plan, _column(corpus, optimizer, spec), size, values_at)


def _matched_kind(plan: Plan, where: dict[str, Any], name: str, budget: int) -> str:
    """The branch that stands for `name` at gpt's training FLOPs of `budget`: its FLOP-matched branch
    where the plan has one, else its token budget (within 5% of gpt's FLOPs: it needs none)."""
    return "flops" if any(("flops", budget) in r.branches for r in plan.select(variant=name, **where)) else "tokens"


def _ratio_values(points: Sequence[Point], plan: Plan, where: dict[str, Any], variant: str, baseline: str,
                  budget: int) -> tuple[SeedValues, list[int], list[float]] | Incomplete | None:
    kinds = {name: _matched_kind(plan, where, name, budget) for name in (variant, baseline)}
    required = {name: [r for r in plan.select(variant=name, **where) if (kinds[name], budget) in r.branches]
                for name in (variant, baseline)}
    if not required[variant] or not required[baseline]:
        return None
    seeds = len({r.seed for r in required[variant]} & {r.seed for r in required[baseline]})
    missing = plan.incomplete(points, required[variant] + required[baseline], where.get("size", ""), seeds=seeds)
    if missing is not None:
        return missing
    a, b = ({p.seed: p for p in select(points, variant=name, **where) if p.kind == kinds[name] and p.budget == budget}
            for name in (variant, baseline))
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    found, refused, flops_ratios = SeedValues({}), [], []
    for s in seeds:
        f = a[s].flops / b[s].flops
        flops_ratios.append(f)
        if abs(f - 1) > FLOPS_MATCH:
            refused.append(s)
            continue
        found.values[s] = a[s].bpb / b[s].bpb
    return found, refused, flops_ratios


def paired_ratio(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str, baseline: str,
                 budget: int, spec: str | None = None, plan: Plan | None = None) -> dict[str, Any] | Incomplete | None:
    """Per-seed BPB ratio variant / baseline at the points matched to gpt's training FLOPs at
    `budget` (a FLOP-matched branch, or the token budget where a variant needs none), with the
    FLOPs ratio of every pair; mean [95% t-interval over seeds] (a one-seed size: the seed scatter
    of the same comparison pooled over the seeded sizes). Pairs whose FLOPs differ by more than 5%
    are refused (listed under "refused"). `Incomplete` until every planned run behind it has its
    record (and, at a one-seed size, the seeded sizes' same comparison)."""
    plan = plan or Plan.from_points(points)
    column = _column(corpus, optimizer, spec)
    made = _ratio_values(points, plan, column | {"size": size}, variant, baseline, budget)
    if made is None or isinstance(made, Incomplete):
        return made
    found, refused, flops_ratios = made
    if not found.values:
        return {"refused": refused, "flops_ratios": flops_ratios}
    ratios = [found.values[s] for s in sorted(found.values)]
    kept = [f for f in flops_ratios if abs(f - 1) <= FLOPS_MATCH]
    if len(ratios) == 1:
        # the amended rules: the seed scatter of the per-seed *log* ratio, pooled over the seeded sizes'
        # same comparison, around this seed's log ratio (a one-seed size's interval is made in logs)
        def values_at(name: str) -> SeedValues | Incomplete | None:
            other = _ratio_values(points, plan, column | {"size": name}, variant, baseline, budget)
            if other is None or isinstance(other, Incomplete):
                return other
            return SeedValues({s: math.log(r) for s, r in other[0].values.items()})

        pooled, names, waiting = _pooled_over_sizes(points, plan, column, size, values_at)
        if waiting:
            return Incomplete(0, 0, size, seeds=1, waits_for=f"the seed scatter of {', '.join(waiting)}")
        mean = seed_mean([math.log(ratios[0])], pooled)
        interval = mean.interval()
        return {"mean": ratios[0], "interval": None if interval is None else (math.exp(interval[0]),
                                                                              math.exp(interval[1])),
                "stats": mean, "in_logs": True, "ratios": ratios, "flops_ratios": kept, "refused": refused,
                "seeds": 1, "pooled_from": names if mean.pooled else ()}
    mean = seed_mean(ratios, None)
    return {"mean": mean.center, "interval": mean.interval(), "stats": mean, "ratios": ratios,
            "flops_ratios": kept, "refused": refused, "seeds": len(ratios), "pooled_from": ()}


def size_trend(estimate_at: Callable[[str, str | None], Estimate | Incomplete | None],
               sizes: Sequence[tuple[str, int]]) -> tuple[dict[str, Any] | None, list[tuple[int, Any]]]:
    """A multiplier's `trend` over `sizes` ((name, params) pairs), every size read by one curve method
    (the third amendment, 12-07): each size's own where every size uses the power law, else the
    interpolation at every size (a change of method between sizes would read as a trend).
    `estimate_at(size, method)`: the multiplier at a size (method None: the cell's own). Returns the
    trend (with its "method") and the (params, estimate) pairs it was fitted on."""
    pairs = [(n, estimate_at(name, None)) for name, n in sizes]
    methods = {e.method for _, e in pairs if isinstance(e, Estimate)}
    if len(methods) > 1:
        pairs = [(n, estimate_at(name, "interpolation")) for name, n in sizes]
        methods = {"interpolation"}
    found = trend(pairs)
    if found is not None:
        found["method"] = " / ".join(sorted(methods))
    return found, pairs


def trend(estimates: Sequence[tuple[int, Estimate]]) -> dict[str, Any] | None:
    """The slope of log multiplier against log N over the sizes ((params, estimate) pairs) by
    weighted least squares, a size's weight its seeds / sigma^2 (sigma: the per-seed scatter of log M
    pooled over the sizes with two or more seeds), and its t-interval at the pooled degrees of
    freedom: "grows" / "shrinks" / "no trend resolved". Sizes whose estimate is a bound are named."""
    usable = [(n, e) for n, e in estimates if isinstance(e, Estimate) and e.value > 0 and e.seeds > 0]
    if len(usable) < 2:
        return None
    x = np.log([n for n, _ in usable])
    y = np.log([e.value for _, e in usable])
    w = np.array([e.seeds for _, e in usable], dtype=np.float64)
    xw = float(np.sum(w * x) / w.sum())
    spread_x = float(np.sum(w * (x - xw) ** 2))
    slope = float(np.sum(w * (x - xw) * (y - np.sum(w * y) / w.sum())) / spread_x)
    bounds = [e.size for _, e in usable if e.censored]
    pooled = pooled_scatter(e.logs for _, e in usable)
    if pooled is None:
        return {"slope": slope, "interval": None, "verdict": "no trend resolved (no seed scatter)", "bounds": bounds}
    sigma, df = pooled
    half = t_quantile(0.5 + LEVEL / 2, df) * sigma / math.sqrt(spread_x)
    low, high = slope - half, slope + half
    verdict = "grows" if low > 0 else "shrinks" if high < 0 else "no trend resolved"
    return {"slope": slope, "interval": (low, high), "verdict": verdict, "bounds": bounds}


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def plot_curves(points: Sequence[Point], corpus: str, optimizer: str, path: Path, spec: str | None = None) -> bool:
    """BPB against training FLOPs (top row) and tokens (bottom row), one column per size, one line
    per variant (the seed mean of its decayed points), a band from the lowest to the highest seed,
    and the trunk's stable-phase points dotted. False without matplotlib or points."""
    plt = pyplot(f"the ladder's figure {path.name}")
    if plt is None:
        return False
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    where = _column(corpus, optimizer, spec)
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
    # wrapped to the figure's width: one line was cut off at both ends in a one-size figure (4.2 inches),
    # and so was the second of two
    title = (f"{corpus}, {optimizer}: decayed WSD endpoints (lines: seed mean, bands: seed range; dots: the "
             f"trunk before each decay)")
    fig.suptitle(textwrap.fill(title, int(TITLE_CHARS_PER_INCH * 4.2 * len(sizes))), fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    return True
