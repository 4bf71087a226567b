"""Intervals for the figures the tools print: written once, used by `eval`, `compare`, the task
evaluators and the experiment scripts. A leaf: numpy and the standard library only (no scipy).

- `bootstrap_ratio`: a percentile bootstrap over documents of a ratio of sums (BPB is nats over
  bytes, loss is nats over tokens: each resample draws documents with replacement and recomputes
  the ratio of their sums), with a fixed seed so the same scores give the same interval.
- `paired_comparison`: a run's per-seed values against the baseline's for the same seeds; the mean
  difference (or ratio) with its Student-t interval over seeds and whether it excludes no change.
- `wilson_interval`: the binomial interval of an accuracy (k correct of n), sound at 0 and n.
- `mean_sd`: mean and sample standard deviation over seeds.
- `seed_rows`, `verdict`, `format_comparison`: per run, mean ± sd over seeds and the paired
  comparison with a baseline run, in numbers and in words (what `compare` and the experiment
  scripts print).

The t and normal quantiles are computed here (`t_quantile`, `normal_quantile`): the t
distribution's CDF is the regularized incomplete beta function, evaluated by its continued
fraction and inverted by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

CONFIDENCE = 0.95  # the level of every interval the tools print
BOOTSTRAP_RESAMPLES = 1000  # enough for the 2.5% / 97.5% percentiles to settle to ~1e-3 relative
BOOTSTRAP_SEED = 0  # fixed: the same per-document sums always give the same interval
_RESAMPLE_CELLS = 4_000_000  # unit indices drawn per chunk of resamples (bounded memory: 32 MB of int64)

# The incomplete beta continued fraction: stop when a term changes the value by less than this;
# the term count bound is never reached for the t quantiles the tools ask for (df >= 1).
_BETA_TOLERANCE = 1e-15
_BETA_MAX_TERMS = 500
_TINY = 1e-300  # Lentz's guard against a zero denominator
_BISECTION_STEPS = 200  # halvings of the quantile bracket: far below float resolution well before this


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), valid for x < (a + 1) / (a + b + 2)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    value = d
    for m in range(1, _BETA_MAX_TERMS + 1):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),            # even step
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # odd step
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            value *= c * d
        if abs(c * d - 1.0) < _BETA_TOLERANCE:
            break
    return value


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    # the other side through the symmetry I_x(a, b) = 1 - I_(1-x)(b, a), where the fraction converges
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def _bisect(cdf, p: float, low: float, high: float) -> float:
    while cdf(high) < p:  # widen the bracket until it holds the quantile
        low, high = high, 2.0 * high
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        low, high = (middle, high) if cdf(middle) < p else (low, middle)
    return 0.5 * (low + high)


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (p in (0, 1))."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    return _bisect(lambda t: t_cdf(t, df), p, 0.0, 1.0)


def normal_quantile(p: float) -> float:
    """The p-quantile of the standard normal distribution (p in (0, 1))."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"normal_quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -normal_quantile(1.0 - p)
    return _bisect(lambda z: 0.5 * math.erfc(-z / math.sqrt(2.0)), p, 0.0, 1.0)


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        return float("nan"), float("nan")
    return float(array.mean()), float(array.std(ddof=1)) if array.size > 1 else 0.0


def t_interval(values: Sequence[float], level: float = CONFIDENCE) -> tuple[float, float] | None:
    """The Student-t interval of the mean of `values`; None for fewer than two values."""
    array = np.asarray(values, dtype=np.float64)
    if array.size < 2:
        return None
    mean, sd = mean_sd(array)
    half = t_quantile(0.5 + level / 2.0, array.size - 1) * sd / math.sqrt(array.size)
    return mean - half, mean + half


def paired_comparison(values: dict, baseline: dict, kind: str = "difference", level: float = CONFIDENCE) -> dict:
    """A run against the baseline, paired by seed: `values` and `baseline` map seed -> the metric.

    Over the seeds both have, each seed's difference (value - baseline) or ratio (value / baseline);
    returns {"kind", "seeds" (paired, in order), "mean", "sd", "low", "high", "excludes"}: the mean
    and sample sd of the per-seed differences (ratios), their t interval (None with one seed) and
    whether it excludes no change (0 for a difference, 1 for a ratio; None without an interval).
    kind "log_ratio": the ratios' geometric mean and the t interval of their logarithms, taken back
    (sd on the log scale): for speed ratios, where rounds at 0.5x and 2x should cancel and an
    interval must stay positive (the experiments' decision rules keep "ratio", as committed)."""
    if kind not in ("difference", "ratio", "log_ratio"):
        raise ValueError(f"kind must be 'difference', 'ratio' or 'log_ratio', got {kind!r}")
    seeds = [seed for seed in values if seed in baseline
             and _finite(values[seed]) and _finite(baseline[seed])]
    if kind == "log_ratio":
        # a value of 0 or below has no logarithm: no mean and no interval, and said (dropping the round
        # dropped the worst one: a repeat whose requests all failed read as 0 req/s)
        nonpositive = [s for s in seeds if values[s] <= 0 or baseline[s] <= 0]
        if nonpositive:
            return {"kind": kind, "seeds": seeds, "mean": math.nan, "sd": math.nan, "low": None, "high": None,
                    "excludes": None, "nonpositive": nonpositive}
        logs = [math.log(values[s] / baseline[s]) for s in seeds]
        log_mean, sd = mean_sd(logs)
        interval = t_interval(logs, level)
        mean = math.exp(log_mean) if logs else log_mean
        interval = None if interval is None else (math.exp(interval[0]), math.exp(interval[1]))
    else:
        if kind == "ratio" and any(baseline[s] == 0 for s in seeds):  # no ratio: no mean, no interval, said
            return {"kind": kind, "seeds": seeds, "mean": math.nan, "sd": math.nan, "low": None, "high": None,
                    "excludes": None, "zero_baseline": [s for s in seeds if baseline[s] == 0]}
        per_seed = [values[s] - baseline[s] if kind == "difference" else values[s] / baseline[s] for s in seeds]
        mean, sd = mean_sd(per_seed)
        interval = t_interval(per_seed, level)
    no_change = 0.0 if kind == "difference" else 1.0
    low, high = interval if interval is not None else (None, None)
    excludes = None if interval is None else bool(low > no_change or high < no_change)
    return {"kind": kind, "seeds": seeds, "mean": mean, "sd": sd, "low": low, "high": high, "excludes": excludes}


def verdict(comparison: dict, lower: str = "lower", higher: str = "higher") -> str:
    """A paired comparison in words: `lower` / `higher` when its interval excludes no change on that
    side, "undecided" when it holds no change, "one seed" without an interval."""
    if comparison.get("nonpositive"):
        return "undecided (a value of 0 or below)"
    if comparison.get("zero_baseline"):
        return "undecided (a baseline of 0: no ratio)"
    if comparison["excludes"] is None:
        return "one seed" if comparison["seeds"] else "no paired seeds"
    if not comparison["excludes"]:
        return "undecided"
    no_change = 0.0 if comparison["kind"] == "difference" else 1.0
    return lower if comparison["high"] < no_change else higher


def format_comparison(comparison: dict, digits: int = 4) -> str:
    """'mean [low, high]' of a paired comparison (the mean alone without an interval)."""
    if not comparison["seeds"]:
        return "–"
    mean = f"{comparison['mean']:.{digits}f}"
    if comparison["low"] is None:
        return mean
    return f"{mean} [{comparison['low']:.{digits}f}, {comparison['high']:.{digits}f}]"


def seed_rows(values: dict[str, dict], baseline: str | None = None, kind: str = "ratio") -> list[dict]:
    """Per run (name -> {seed: value}): its mean and sd over seeds and, when `baseline` names one of
    the runs, its paired comparison with it (`paired_comparison`, by seed) and the verdict. The
    statistics the experiment scripts and `compare` print, computed in one place."""
    rows = []
    for name, by_seed in values.items():
        finite = [v for v in by_seed.values() if _finite(v)]
        mean, sd = mean_sd(finite)
        row = {"name": name, "seeds": len(finite), "mean": mean, "sd": sd}
        if baseline is not None and baseline in values and name != baseline:
            row["paired"] = paired_comparison(by_seed, values[baseline], kind)
            row["verdict"] = verdict(row["paired"])
        rows.append(row)
    return rows


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def wilson_interval(successes: int, n: int, level: float = CONFIDENCE) -> tuple[float, float] | None:
    """Wilson's score interval of a binomial proportion successes / n; None when n == 0."""
    if n <= 0:
        return None
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within 0..n, got {successes} of {n}")
    z = normal_quantile(0.5 + level / 2.0)
    p = successes / n
    shrink = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / shrink
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / shrink
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_ratio(numerators: Sequence[float], denominators: Sequence[float], level: float = CONFIDENCE,
                    resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """Percentile bootstrap interval of sum(numerators) / sum(denominators) over units (documents):
    each resample draws as many units as there are, with replacement. None for fewer than two units, or
    a unit that is not finite (the ratio is then NaN or infinite itself)."""
    top = np.asarray(numerators, dtype=np.float64)
    bottom = np.asarray(denominators, dtype=np.float64)
    if top.shape != bottom.shape or top.ndim != 1:
        raise ValueError(f"numerators and denominators must be 1-D and of one length, got {top.shape}, {bottom.shape}")
    units = top.size
    if units < 2 or not (np.isfinite(top).all() and np.isfinite(bottom).all()):
        # a NaN or infinite unit makes the ratio itself NaN or infinite: an interval from the resamples
        # that happened to miss it would sit beside that point as if it were about it
        return None
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples, dtype=np.float64)
    chunk = max(1, _RESAMPLE_CELLS // units)
    for first in range(0, resamples, chunk):
        rows = min(chunk, resamples - first)
        drawn = rng.integers(0, units, size=(rows, units))  # (rows, units): the units of each resample
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios[first:first + rows] = top[drawn].sum(axis=1) / bottom[drawn].sum(axis=1)
    ratios = ratios[np.isfinite(ratios)]  # a resample of only zero-denominator units has no ratio
    if ratios.size == 0:
        return None
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


__all__ = ["BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "CONFIDENCE", "bootstrap_ratio", "format_comparison", "mean_sd",
           "normal_quantile", "paired_comparison", "regularized_beta", "seed_rows", "t_cdf",
           "t_interval", "t_quantile", "verdict", "wilson_interval"]
