"""The claims table, generated from the compute ladder's records (issue 52), never typed by hand.

    python experiments/ladder_claims.py --out experiments/ladder-runs --write experiments/LADDER.md

Each paper's scaling claim is one row, tested as the paper states it, by the rules committed before
any result (experiments/logs/2026-12-05-ladder-rules.md, amended before any result past the smallest
size: experiments/logs/2026-12-05-ladder-rules-amended.md; two later amendments were written after
some results and say so: one curve method per cell, 2026-12-06-ladder-rules-one-curve-method.md, and
one per trend, 2026-12-07-ladder-rules-trend.md): the verdict per corpus and optimizer with the figures
at every size, and the trend over size. Below it, every variant's compute and data multiplier
over gpt at every size, and the plots. A row any of whose records ran under a config that differs
from what the same plan entry builds today, or under a plan entry that differs from today's plan
(`ladder.stale_fields`: a default, a size, a budget changed since), reads "stale", with the fields
that changed; so does a row whose records mix recipes (`recipe_mix`: the products' precision, the
attention's dtype at a size, the data's sha256).

The figures wait for the plan (`ladder_plan`: today's plan of the records' ladders, at their budget
scale): a multiplier is made at the largest budget the plan gives the variant, from every seed the
plan runs, and reads "incomplete: k of n runs" until all of them have records. "Every size" is every
planned size, and the Bonferroni level counts them all: a row reads "incomplete" until its planned
sizes are all in, unless one of them already decides "does not hold" (the rules' "at any size").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ladder  # noqa: E402
import ladder_fit  # noqa: E402
from ladder_fit import (  # noqa: E402
    LEVEL,
    REFERENCE,
    Estimate,
    Incomplete,
    Plan,
    Point,
    Undefined,
    load_records,
    plot_curves,
    points_of,
    select,
    size_trend,
)

from latentloop.util import write_text_atomic  # noqa: E402

RULES = "logs/2026-12-05-ladder-rules.md"
AMENDED_RULES = "logs/2026-12-05-ladder-rules-amended.md"
ONE_METHOD_RULES = "logs/2026-12-06-ladder-rules-one-curve-method.md"  # written after the xs results
TREND_RULES = "logs/2026-12-07-ladder-rules-trend.md"  # written after the xs and s results
MATCH_MARGIN = 1.01  # rule 4: "matches" = the ratio's upper end at most 1% above 1
PAPER_DATA_FACTOR = 1.5  # rule 1: the abstract's "about 1.5x more tokens"
COLUMNS = (("stdlib", "muon"), ("english", "muon"), ("stdlib", "adamw"), ("english", "adamw"))
DECIDED = {"holds": True, "matches": True, "does not hold": False}  # the verdicts that decide, by side


_CACHE: dict[tuple, Any] = {}  # one page's estimates: a row and the tables below ask for the same ones


def _cached(function: Callable, points: Sequence[Point], plan: Plan | None, *args: Any, **options: Any) -> Any:
    key = (function.__name__, id(points), id(plan), *args, *sorted(options.items()))
    if key not in _CACHE:
        _CACHE[key] = function(points, *args, plan=plan, **options)
    return _CACHE[key]


def _plan(points: Sequence[Point], plan: Plan | None) -> Plan:
    """The plan the figures wait for; without one, the runs the points come from (cached with them)."""
    if plan is not None:
        return plan
    key = ("plan", id(points))
    if key not in _CACHE:
        _CACHE[key] = Plan.from_points(points)
    return _CACHE[key]


def multiplier(points: Sequence[Point], plan: Plan | None, corpus: str, optimizer: str, size: str, variant: str,
               axis: str, method: str | None = None) -> Any:
    return _cached(ladder_fit.multiplier, points, _plan(points, plan), corpus, optimizer, size, variant, axis,
                   method=method)


def parameter_multiplier(points: Sequence[Point], plan: Plan | None, corpus: str, optimizer: str, size: str,
                         variant: str) -> Any:
    return _cached(ladder_fit.parameter_multiplier, points, _plan(points, plan), corpus, optimizer, size, variant)


def paired_ratio(points: Sequence[Point], plan: Plan | None, corpus: str, optimizer: str, size: str, variant: str,
                 baseline: str, budget: int) -> Any:
    return _cached(ladder_fit.paired_ratio, points, _plan(points, plan), corpus, optimizer, size, variant, baseline,
                   budget)


@dataclass
class Cell:
    verdict: str  # "holds", "does not hold", "undecided", "matches", "incomplete", "not run", "stale"
    text: str  # the figures behind it
    variants: tuple[str, ...]  # whose records the cell read (gpt's too)
    trend: str = ""
    label: str = ""  # beside the verdict in the claims table: which reading it is (the fourth amendment's)


def sizes_of(points: Sequence[Point], corpus: str, optimizer: str,
             plan: Plan | None = None) -> list[tuple[int, str, int]]:
    """(index, name, gpt's non-embedding params) of every size the plan runs gpt at in this column
    (0 params where neither a record nor the plan says), whether or not its runs have finished."""
    plan = _plan(points, plan)
    recorded = {p.size: p.params for p in select(points, variant=REFERENCE, corpus=corpus, optimizer=optimizer)}
    planned = {r.size: r.gpt_params for r in plan.select(variant=REFERENCE, corpus=corpus, optimizer=optimizer)}
    return [(index, name, recorded.get(name) or planned.get(name, 0))
            for index, name in plan.sizes(corpus=corpus, optimizer=optimizer)]


def against_level(tests: int) -> float:
    """The level at which one of `tests` intervals decides "does not hold" (Bonferroni: a verdict
    that any of them lies on the wrong side keeps its 5% error over all of them)."""
    return 1 - (1 - LEVEL) / max(1, tests)


def _started(e: Any) -> bool:
    """Whether any run behind a figure has finished."""
    return isinstance(e, (Estimate, Undefined)) or (isinstance(e, Incomplete) and (e.have > 0 or bool(e.waits_for)))


def aggregate(per_size: Sequence[tuple[str, Estimate | Incomplete | Undefined | None]],
              tests: int | None = None) -> str:
    """Rules 1-3, 6 (amended), over every planned size: "holds" if every size is decided above 1 at
    95% (so never while a planned size is incomplete); "does not hold" if any size is decided below 1
    at the Bonferroni level over the row's `tests` intervals (default: the planned sizes); "incomplete"
    while a planned size waits for runs and neither is reached; else "undecided" (a size without an
    interval, or `Undefined`, decides nothing)."""
    if not any(_started(e) for _, e in per_size):
        return "not run"
    present = [(s, e) for s, e in per_size if isinstance(e, Estimate)]
    level = against_level(tests or len(per_size))
    if any(decided(e, level) == "< 1" for _, e in present):
        return "does not hold"  # one planned size below 1 is enough, whatever the others will show
    if any(isinstance(e, Incomplete) for _, e in per_size):
        return "incomplete"
    if len(present) == len(per_size) and all(decided(e) == "> 1" for _, e in present):
        return "holds"
    return "undecided"


def decided(e: Estimate, level: float = LEVEL) -> str:
    """"> 1", "< 1" or "undecided" at `level` (no interval: undecided; an end that is a bound on
    the side of 1 decides nothing)."""
    interval = e.interval_at(level)
    if interval is None:
        return "undecided"
    if interval[0] > 1 and e.censored_ends[0] != "below":
        return "> 1"
    if interval[1] < 1 and e.censored_ends[1] != "above":
        return "< 1"
    return "undecided"


def _combine(verdicts: Sequence[str], decided_as: str = "holds") -> str:
    """One verdict from parts that must all be `decided_as` (holds / matches): "does not hold" if one
    part is, "incomplete" while a part waits for runs (or has none yet: "not run" beside parts that ran)."""
    if not verdicts or all(v == "not run" for v in verdicts):
        return "not run"
    if "does not hold" in verdicts:
        return "does not hold"
    if any(v in ("incomplete", "not run") for v in verdicts):
        return "incomplete"
    if all(v == decided_as for v in verdicts):
        return decided_as
    return "undecided"


def _figures(per_size: Sequence[tuple[str, Estimate | Incomplete | None]]) -> str:
    return "; ".join(f"{size} {'—' if e is None else e.text()}" for size, e in per_size)


def _trend_text(points: Sequence[Point], plan: Plan | None, corpus: str, optimizer: str, variant: str,
                axis: str) -> str:
    """The multiplier's trend over the planned sizes, every size read by one curve method (the third
    amendment); "provisional" until every planned size is in."""
    sizes = sizes_of(points, corpus, optimizer, plan)
    found, pairs = size_trend(lambda name, method: multiplier(points, plan, corpus, optimizer, name, variant, axis,
                                                              method), [(name, n) for _, name, n in sizes])
    if found is None:
        return ""
    interval = "" if found["interval"] is None else f" [{found['interval'][0]:.2f}, {found['interval'][1]:.2f}]"
    bounds = f"; bounds at {', '.join(found['bounds'])}" if found["bounds"] else ""
    done = sum(isinstance(e, Estimate) for _, e in pairs)
    provisional = f"provisional ({done} of {len(pairs)} planned sizes): " if done < len(pairs) else ""
    return f"{provisional}{found['verdict']} (slope {found['slope']:.2f}{interval}{bounds}; {found['method']})"


def multiplier_claim(variant: str, axis: str, extra: Callable[[list], str] | None = None,
                     beside: tuple[str, str] | None = None) -> Callable[..., Cell]:
    """Rules 1, 2, 6: one multiplier of one variant at its largest token budget at every planned size."""
    def evaluate(points: Sequence[Point], corpus: str, optimizer: str, plan: Plan | None = None) -> Cell:
        sizes = sizes_of(points, corpus, optimizer, plan)
        per_size = [(name, multiplier(points, plan, corpus, optimizer, name, variant, axis)) for _, name, _ in sizes]
        verdict = aggregate(per_size) if sizes else "not run"
        name = {"tokens": "D", "flops": "C"}[axis]
        text = f"{variant} {name}: {_figures(per_size)}"
        if extra is not None:
            text += extra(per_size)
        if beside is not None:
            other = [(s, multiplier(points, plan, corpus, optimizer, s, beside[0], beside[1])) for _, s, _ in sizes]
            text += f" (beside it: {beside[0]} {'D' if beside[1] == 'tokens' else 'C'}: {_figures(other)})"
        return Cell(verdict, text, (REFERENCE, variant) + ((beside[0],) if beside else ()),
                    _trend_text(points, plan, corpus, optimizer, variant, axis))
    return evaluate


def _reaches_paper_factor(per_size: list) -> str:
    """Whether the largest planned size's interval reaches the paper's 1.5x."""
    if not per_size:
        return ""
    size, e = per_size[-1]
    if isinstance(e, Incomplete):
        return f"; the largest size, {size}, is incomplete"
    if not isinstance(e, Estimate) or e.interval is None:
        return ""
    reach = "reaches" if e.interval[1] >= PAPER_DATA_FACTOR else "does not reach"
    return f"; at {size} the interval {reach} the paper's {PAPER_DATA_FACTOR}x"


# RecurrentGPT's rows read these forms (the fourth amendment: the paper's gate, +4, once complete)
DEFAULT_GATE_FORMS = {"flops": "rgpt-flops", "params": "rgpt-params", "heavy": "rgpt-flops-heavy"}
PAPER_GATE_FORMS = {"flops": "rgpt-paper-flops", "params": "rgpt-paper-params", "heavy": "rgpt-paper-flops-heavy"}


def rgpt_scaling(points: Sequence[Point], corpus: str, optimizer: str, plan: Plan | None = None,
                 forms: dict[str, str] = DEFAULT_GATE_FORMS) -> Cell:
    """Rule 3: both rgpt forms, C and P, at every planned size."""
    sizes = sizes_of(points, corpus, optimizer, plan)
    parts, verdicts = [], []
    tests = 4 * len(sizes)  # C and P of both forms at every planned size
    for variant in (forms["flops"], forms["params"]):
        c = [(s, multiplier(points, plan, corpus, optimizer, s, variant, "flops")) for _, s, _ in sizes]
        p = [(s, parameter_multiplier(points, plan, corpus, optimizer, s, variant)) for _, s, _ in sizes]
        verdicts += [aggregate(c, tests), aggregate(p, tests)]
        parts.append(f"{variant} C: {_figures(c)}; P: {_figures(p)}")
    verdict = _combine(verdicts) if sizes else "not run"
    trends = "; ".join(f"{v} C {text}" for v in (forms["flops"], forms["params"])
                       if (text := _trend_text(points, plan, corpus, optimizer, v, "flops")))
    return Cell(verdict, " / ".join(parts), (REFERENCE, forms["flops"], forms["params"]), trends)


def _ratio_text(found: dict[str, Any] | Incomplete | None) -> str:
    if found is None:
        return "—"
    if isinstance(found, Incomplete):
        return found.text()
    if "mean" not in found:
        return f"refused (FLOPs ratios {', '.join(f'{f:.3f}' for f in found['flops_ratios'])})"
    interval = found["interval"]
    body = f"{found['mean']:.4f}" + (f" [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else " (1 seed)")
    if found["pooled_from"]:
        body += f" (1 seed; seed scatter of {', '.join(found['pooled_from'])})"
    return body + f" (FLOPs {min(found['flops_ratios']):.3f}-{max(found['flops_ratios']):.3f}x)"


def _ratio_interval(found: dict[str, Any], level: float) -> tuple[float, float] | None:
    interval = found["stats"].interval(level)
    if interval is None or not found.get("in_logs"):
        return interval
    return math.exp(interval[0]), math.exp(interval[1])  # a one-seed size's: made in logs


def _planned_budgets(points: Sequence[Point], plan: Plan | None, corpus: str, optimizer: str, size: str) -> list[int]:
    """gpt's token budgets at `size` in the plan (the budgets every variant trains to)."""
    return sorted({b for r in _plan(points, plan).select(variant=REFERENCE, corpus=corpus, optimizer=optimizer,
                                                         size=size) for kind, b in r.branches if kind == "tokens"})


def rgpt_isoflops_match(points: Sequence[Point], corpus: str, optimizer: str, plan: Plan | None = None,
                        forms: dict[str, str] = DEFAULT_GATE_FORMS) -> Cell:
    """Rule 4 (amended): rgpt-flops / gpt at the largest FLOP-matched budget, per seed, t-interval;
    "matches" at every planned size at 95%, "does not hold" at one size at the Bonferroni level."""
    sizes = sizes_of(points, corpus, optimizer, plan)
    texts, verdicts = [], []
    level = against_level(len(sizes))
    for _, size, n in sizes:
        budgets = _planned_budgets(points, plan, corpus, optimizer, size)
        found = None if not budgets else paired_ratio(points, plan, corpus, optimizer, size, forms["flops"],
                                                      REFERENCE, budgets[-1])
        share = [p.params for p in select(points, variant=forms["flops"], corpus=corpus, optimizer=optimizer,
                                          size=size)]
        share_text = f", {share[0] / n:.0%} of gpt's parameters" if share and n else ""
        texts.append(f"{size} {_ratio_text(found)}{share_text}")
        if found is None:
            verdicts.append("not run")
        elif isinstance(found, Incomplete):
            verdicts.append("incomplete" if _started(found) else "not run")
        elif "mean" not in found:
            verdicts.append("refused")
        elif found["interval"] is None:
            verdicts.append("undecided")
        elif found["interval"][1] <= MATCH_MARGIN:
            verdicts.append("matches")
        elif _ratio_interval(found, level)[0] > MATCH_MARGIN:
            verdicts.append("does not hold")
        else:
            verdicts.append("undecided")
    verdict = _combine(verdicts, "matches") if sizes else "not run"
    trend_text = _trend_text(points, plan, corpus, optimizer, forms["flops"], "flops")
    return Cell(verdict, f"{forms['flops']} / gpt at matched training FLOPs: " + "; ".join(texts),
                (REFERENCE, forms["flops"]), f"C {trend_text}" if trend_text else "")


def rgpt_beats_baselines(points: Sequence[Point], corpus: str, optimizer: str, plan: Plan | None = None,
                         forms: dict[str, str] = DEFAULT_GATE_FORMS) -> Cell:
    """Rule 5 (amended): in every planned size x FLOP-matched budget x baseline cell, rgpt-flops below
    the baseline at 95%; "does not hold" if a cell lies above 1 at the Bonferroni level over all the
    planned cells; "incomplete" while a cell waits for runs."""
    sizes = sizes_of(points, corpus, optimizer, plan)
    baselines = ("mor-flops", forms["heavy"])  # rule 5: MoR has no gate; the heavy tail shares rgpt's
    cells = []  # (size, baseline, the comparison: None where a side has no run planned)
    for _, size, _ in sizes:
        for baseline in baselines:
            for budget in _planned_budgets(points, plan, corpus, optimizer, size):
                cells.append((size, baseline, paired_ratio(points, plan, corpus, optimizer, size, forms["flops"],
                                                           baseline, budget)))
    level = against_level(len(cells))
    below = above = undecided = refused = waiting = 0
    texts: dict[tuple[str, str], list[str]] = {}
    for size, baseline, found in cells:
        texts.setdefault((size, baseline), []).append(_ratio_text(found))
        if found is None or isinstance(found, Incomplete):
            waiting += 1
        elif "mean" not in found:
            refused += 1
        elif found["interval"] is None:  # one seed and no seed scatter to borrow: decides nothing
            undecided += 1
        elif found["interval"][1] < 1:
            below += 1
        elif _ratio_interval(found, level)[0] > 1:
            above += 1
        else:
            undecided += 1
    total = len(cells)
    if not any(found is not None and (not isinstance(found, Incomplete) or _started(found)) for *_, found in cells):
        verdict = "not run"
    elif above:
        verdict = "does not hold"
    elif waiting:
        verdict = "incomplete"
    elif below == total:
        verdict = "holds"
    else:
        verdict = "undecided"
    summary = f"{total} comparisons (size x budget x baseline): {below} below 1, {above} above, {undecided} " \
              f"undecided, {refused} refused (FLOPs apart by more than 5%), {waiting} incomplete"
    details = "; ".join(f"{size} / {baseline}: {', '.join(cells)}" for (size, baseline), cells in texts.items())
    return Cell(verdict, summary + ". " + details, (REFERENCE, forms["flops"], *baselines))


def rgpt_isoparams(points: Sequence[Point], corpus: str, optimizer: str, plan: Plan | None = None,
                   forms: dict[str, str] = DEFAULT_GATE_FORMS) -> Cell:
    """Rule 6: the data multiplier D of the isoPARAMs form."""
    return multiplier_claim(forms["params"], "tokens")(points, corpus, optimizer, plan)


def _paper_gate_runs(points: Sequence[Point], plan: Plan | None, corpus: str, optimizer: str) -> tuple[int, int]:
    """(finished, planned) runs of the paper-gate forms in a column: a row reads them only once all
    are in (a "does not hold" from one size is decided before the others finish)."""
    planned = {r.key for v in PAPER_GATE_FORMS.values()
               for r in _plan(points, plan).select(variant=v, corpus=corpus, optimizer=optimizer)}
    finished = planned & {p.key for p in points}
    return len(finished), len(planned)


# what a RecurrentGPT cell on the default gate says beside its verdict (the fourth amendment's label)
GATE_BIAS_0_LABEL = "gate bias 0 (the project's default); the paper's +4: not complete"


def on_the_papers_gate(evaluate: Callable[..., Cell]) -> Callable[..., Cell]:
    """The fourth amendment: a RecurrentGPT row read on the paper's gate initialisation (the
    rgpt-paper-* forms) once that reading is complete, the default gate's verdict beside it; until
    then the default gate's reading, saying so."""
    def cell(points: Sequence[Point], corpus: str, optimizer: str, plan: Plan | None = None) -> Cell:
        paper = evaluate(points, corpus, optimizer, plan, PAPER_GATE_FORMS)
        default = evaluate(points, corpus, optimizer, plan, DEFAULT_GATE_FORMS)
        finished, planned = _paper_gate_runs(points, plan, corpus, optimizer)
        if finished < planned or not planned:  # complete at every planned size, or not read (the amendment)
            default.text = (f"gate bias 0, the project's default (the paper's +4: {finished} of {planned} runs, "
                            f"{paper.verdict}). {default.text}")
            default.label = GATE_BIAS_0_LABEL  # the amendment's words: not the claim's verdict
            return default
        paper.text = f"the paper's gate bias, +4. {paper.text} (gate bias 0, the project's default: {default.verdict})"
        paper.label = f"the paper's gate bias, +4; gate bias 0: {default.verdict}"
        return paper
    return cell


# the fourth amendment (logs/2026-12-07-ladder-rules-paper-gate.md): until the paper-initialisation
# variants (rgpt-paper-*) are complete, RecurrentGPT's rows read the project's default gate, and say so
DEFAULT_GATE = ("; read on the paper's gate bias, +4 (rgpt-paper-flops, -params, -flops-heavy), once those runs "
                "are complete, on gate bias 0, the project's default, until then (fourth amendment; each cell "
                "says which)")


@dataclass(frozen=True)
class Claim:
    paper: str  # the claim, as the paper states it
    test: str  # what decides it here
    evaluate: Callable[..., Cell]  # (points, corpus, optimizer, plan=None) -> Cell


CLAIMS = (
    Claim("FBT: matches or approaches a standard transformer trained on about 1.5x (summary: 1.5-2x) more tokens",
          "data multiplier D of fbt-paper (the paper's late-feedback schedule) at its largest budget, every size "
          "(rule 1); latentloop's default fbt beside it",
          multiplier_claim("fbt-paper", "tokens", _reaches_paper_factor, beside=("fbt", "tokens"))),
    Claim("LRT: lower BPB at baseline-equivalent training compute (interleaved training's 2x counted)",
          "compute multiplier C of lrt (rule 2; data multiplier beside it)",
          multiplier_claim("lrt", "flops", beside=("lrt", "tokens"))),
    Claim("RGPT: better loss-vs-parameters and loss-vs-training-FLOPs scaling",
          "C and parameter multiplier P of rgpt-flops and rgpt-params, all above 1 (rule 3)" + DEFAULT_GATE,
          on_the_papers_gate(rgpt_scaling)),
    Claim("RGPT: at isoFLOPs matches the dense model with 36-37% of the parameters",
          "rgpt-flops / gpt BPB at matched training FLOPs (within 5%), upper end <= 1.01 (rule 4); its shape keeps 3 "
          "of gpt's 8 blocks (37.5%), and with the recurrence's input projection and gate about 43% of gpt's "
          "non-embedding parameters" + DEFAULT_GATE,
          on_the_papers_gate(rgpt_isoflops_match)),
    Claim("RGPT: beats Mixture-of-Recursions and heavy-tailed depth sampling at isoFLOPs, in every budget-scale cell",
          "rgpt-flops / mor-flops and / rgpt-flops-heavy at every FLOP-matched budget and size (rule 5)" + DEFAULT_GATE,
          on_the_papers_gate(rgpt_beats_baselines)),
    Claim("RGPT: at isoPARAMs deeper recursion improves validation loss consistently (2.76 vs 2.84)",
          "data multiplier D of rgpt-params (rule 6)" + DEFAULT_GATE, on_the_papers_gate(rgpt_isoparams)),
)


def stale_by_variant(records: Sequence[dict[str, Any]],
                     planned: dict[str, dict[str, Any]] | None = None) -> dict[tuple[str, str, str], list[str]]:
    """(corpus, optimizer, variant) -> the changed fields of any of its records ([] when none):
    config defaults, and (given `planned`, today's plan entries by key) the plan entry itself."""
    found: dict[tuple[str, str, str], list[str]] = {}
    for record in records:
        plan = record["plan"]
        key = (plan["corpus"], plan["optimizer"], plan["variant"]["name"])
        changed = ladder.stale_fields(record, planned)
        found.setdefault(key, [])
        found[key] += [c for c in changed if c not in found[key]]
    return found


Recipes = dict[tuple[str, str, str], list[dict[str, Any]]]


def recipes_by_variant(records: Sequence[dict[str, Any]]) -> Recipes:
    """(corpus, optimizer, variant) -> each record's recipe beyond its config: its size, the products'
    precision, the attention's dtype (records made before the CPU attention rule of 2026-12-05 lack
    it: their attention ran in `precision`) and the data's sha256 (None: not recorded)."""
    found: Recipes = {}
    for record in records:
        plan = record["plan"]
        precision = record.get("precision")
        data = record.get("data_sha256")
        found.setdefault((plan["corpus"], plan["optimizer"], plan["variant"]["name"]), []).append(
            {"size": plan["size"]["name"], "precision": precision,
             "attention": record.get("attention_dtype", precision),
             "data": None if data is None else json.dumps(data, sort_keys=True)})
    return found


def recipe_mix(recipes: Recipes, corpus: str, optimizer: str, variants: Sequence[str]) -> list[str]:
    """How the records a cell reads (its variants', in this column) differ in recipe, [] when they
    share one: the products' precision, the attention's dtype at one size (the CPU rule picks it by
    the shape, which every variant of a size shares), the data they read (its sha256)."""
    rows = [row for variant in dict.fromkeys(variants) for row in recipes.get((corpus, optimizer, variant), [])]

    def counted(values: list[Any]) -> dict[Any, int]:
        found: dict[Any, int] = {}
        for value in values:
            if value is not None:
                found[value] = found.get(value, 0) + 1
        return found

    def listed(counts: dict[Any, int]) -> str:
        return ", ".join(f"{value} ({n} runs)" for value, n in counts.items())

    mixed = []
    precision = counted([row["precision"] for row in rows])
    if len(precision) > 1:
        mixed.append(f"products' precision {listed(precision)}")
    for size in dict.fromkeys(row["size"] for row in rows):
        attention = counted([row["attention"] for row in rows if row["size"] == size])
        if len(attention) > 1:
            mixed.append(f"attention dtype at {size} {listed(attention)}")
    data = counted([row["data"] for row in rows])
    if len(data) > 1:
        mixed.append(f"{len(data)} different copies of the data (sha256: "
                     f"{', '.join(f'{n} runs on one' for n in data.values())})")
    return mixed


def column_cell(claim: Claim, points: Sequence[Point], corpus: str, optimizer: str,
                stale: dict[tuple[str, str, str], list[str]], plan: Plan | None = None,
                recipes: Recipes | None = None) -> Cell:
    """One claim in one column; "stale" (it decides nothing) where one of the records it reads ran
    under other defaults than today's, or where its records mix recipes."""
    cell = claim.evaluate(points, corpus, optimizer, plan)
    changed = [c for v in cell.variants for c in stale.get((corpus, optimizer, v), [])]
    mixed = recipe_mix(recipes or {}, corpus, optimizer, cell.variants)
    if (changed or mixed) and cell.verdict != "not run":
        notes = ([f"its runs mix recipes ({'; '.join(mixed)})"] if mixed else []) + (
            [f"ran under other defaults ({'; '.join(dict.fromkeys(changed))})"] if changed else [])
        cell.text = ". ".join(notes) + ". " + cell.text
        cell.verdict = "stale"
    return cell


def residuals_table(points: Sequence[Point], corpus: str, optimizer: str, plan: Plan | None = None) -> list[str]:
    """gpt's power law per seed at every size of a column: the rms of its log-BPB residuals (`*`: not
    stable, so the cells at that size read the interpolation). Against tokens; against FLOPs it is
    the same fit (gpt's training FLOPs are a fixed multiple of its tokens)."""
    rows = []
    for _, size, _ in sizes_of(points, corpus, optimizer, plan):
        fits = ladder_fit.reference_fits(points, corpus, optimizer, size, "tokens")
        if fits:
            rows.append(f"| {size} | " + ", ".join(f"s{seed} {fit['rms']:.4f}{'' if fit['stable'] else '*'}"
                                                  for seed, fit in fits.items()) + " |")
    if not rows:
        return []
    return ["", f"**{corpus}, {optimizer}**", "", "| size | rms of log BPB per seed |", "|---|---|"] + rows


def epochs_marks(points: Sequence[Point]) -> list[str]:
    repeated = sorted({(p.corpus, p.size, p.variant, p.label, round(p.epochs, 2)) for p in points
                       if p.kind != "stable" and p.epochs > 1})
    if not repeated:
        return []
    by_corpus: dict[str, list[str]] = {}
    for corpus, size, variant, label, epochs in repeated:
        by_corpus.setdefault(corpus, []).append(f"{size} {variant} {label} ({epochs:.2f})")
    return ["", "Budgets past one epoch of the training split (they repeat data; epochs in brackets):"] + [
        f"- {corpus}: {', '.join(items)}" for corpus, items in by_corpus.items()]


def gate_bias_note(records: Sequence[dict[str, Any]]) -> str:
    """The initial gate bias the recurrent forms trained with, from their records: the project's
    default, and the paper's for the rgpt-paper-* forms RecurrentGPT's rows read (fourth amendment)."""
    biases: dict[str, set[float]] = {}
    for record in records:
        value = record.get("config_resolved", {}).get("model", {}).get("gate_bias_init")
        if value is not None:
            biases.setdefault(record["plan"]["variant"]["name"], set()).add(float(value))
    if not biases:
        return ""
    forms = "; ".join(f"{name} {', '.join(f'{b:g}' for b in sorted(values))}"
                      for name, values in sorted(biases.items()))
    from latentloop.archs.rgpt.model import RGPTConfig

    return (f" Initial gate bias of the recurrent forms: {forms} (latentloop's default is "
            f"{RGPTConfig().gate_bias_init:g}; the RecurrentGPT paper initialises it at +{ladder.PAPER_GATE_BIAS:g}: "
            f"the rgpt-paper-* forms train with the paper's, and RecurrentGPT's rows read them once complete, "
            f"the fourth amendment).")


def corpus_lines(records: Sequence[dict[str, Any]], planned: dict[str, dict[str, Any]]) -> list[str]:
    """Per corpus: its training and validation tokens (as the records read them) and, per size, the
    largest token budget the plan trains on and how many epochs of the training split that reads
    (TinyStories and WikiText-2 are small: where it passes 1 the budget repeats data)."""
    corpora: dict[str, tuple[int, int]] = {}
    for record in records:
        if record.get("train_tokens_available") and record.get("val_tokens"):
            corpora.setdefault(record["plan"]["corpus"], (int(record["train_tokens_available"]),
                                                          int(record["val_tokens"])))
    lines = []
    for corpus, (train_tokens, val_tokens) in sorted(corpora.items()):
        largest: dict[str, int] = {}
        for entry in planned.values():
            if entry.get("corpus") != corpus or ladder.UNBUILDABLE in entry:
                continue
            tokens = max(b["steps"] for b in entry["branches"]) * entry["size"]["batch_size"] \
                * ladder.SPECS[entry["spec"]].seq_len
            largest[entry["size"]["name"]] = max(largest.get(entry["size"]["name"], 0), tokens)
        budgets = ", ".join(f"{size} {tokens / 1e6:,.2f}M ({tokens / train_tokens:.2f} epochs)"
                            for size, tokens in largest.items())
        lines.append(f"- {corpus}: {train_tokens:,} training tokens, {val_tokens:,} validation tokens (every "
                     f"BPB is over the whole validation split); the largest planned budget per size: {budgets}"
                     + ("; budgets past 1 epoch repeat data (listed under the multipliers)"
                        if any(t > train_tokens for t in largest.values()) else ""))
    return ["", "The corpora (byte tokens):"] + lines if lines else []


def multipliers_table(points: Sequence[Point], corpus: str, optimizer: str,
                      stale: dict[tuple[str, str, str], list[str]] | None = None, plan: Plan | None = None,
                      recipes: Recipes | None = None) -> list[str]:
    if not select(points, corpus=corpus, optimizer=optimizer):
        return []
    sizes = sizes_of(points, corpus, optimizer, plan)
    if not sizes:
        return []
    stale = stale or {}
    # in the ladder's own order (the registry's, then the claim baselines): the order the records were
    # read in moved rows between regenerations as sizes filled
    order = {variant.name: index for index, variant in enumerate(ladder.all_variants())}
    variants = sorted((v for v in dict.fromkeys(p.variant for p in select(points, corpus=corpus, optimizer=optimizer))
                       if v != REFERENCE), key=lambda name: (order.get(name, len(order)), name))
    header = "| variant | " + " | ".join(f"{name} ({n:,} params)" for _, name, n in sizes) + " | trend of C / D |"
    lines = ["", f"**{corpus}, {optimizer}**: compute multiplier C / data multiplier D at the variant's largest "
             "token budget, [95% t-interval over seeds]; the method of gpt's curve after each", "", header,
             "|---|" + "---|" * len(sizes) + "---|"]
    for variant in variants:
        changed = stale.get((corpus, optimizer, variant), []) + stale.get((corpus, optimizer, REFERENCE), [])
        changed += [f"mixed: {m}" for m in recipe_mix(recipes or {}, corpus, optimizer, (REFERENCE, variant))]
        mark = f" (stale: {'; '.join(dict.fromkeys(changed))})" if changed else ""
        cells = []
        for _, name, _ in sizes:
            c = multiplier(points, plan, corpus, optimizer, name, variant, "flops")
            d = multiplier(points, plan, corpus, optimizer, name, variant, "tokens")
            if c is None and d is None:
                cells.append("—")
                continue
            method = f" ({c.method})" if isinstance(c, Estimate) else ""
            cells.append(f"C {c.text() if c else '—'}{method}; D {d.text() if d else '—'}")
        c_trend, d_trend = ("" if mark else _trend_text(points, plan, corpus, optimizer, variant, axis)
                            for axis in ("flops", "tokens"))  # a stale row prints no trend
        trends = f"{c_trend or '—'} / {d_trend or '—'}"
        lines.append(f"| {variant}{mark} | " + " | ".join(cells) + f" | {trends} |")
    return lines


def precision_line(records: Sequence[dict[str, Any]]) -> str:
    """How many runs trained in which precision: the products' dtype and the attention's (records
    made before the CPU rule of 2026-12-05 lack `attention_dtype`: their attention ran in `precision`)."""
    counts: dict[tuple[str, str], int] = {}
    for record in records:
        precision = record.get("precision", "unknown")
        key = (precision, record.get("attention_dtype", precision))
        counts[key] = counts.get(key, 0) + 1
    parts = [f"{n} with {products} products and {attention} attention"
             for (products, attention), n in sorted(counts.items())]
    mixed = " — mixed: the runs do not share one recipe" if len(counts) > 1 else ""
    # bf16 on a CPU without its instructions: the same precision, emulated (the record keeps the CPU's support)
    emulated = sum(1 for r in records if r.get("precision") == "bfloat16" and str(r.get("device", "")) == "cpu"
                   and ladder.BF16_SUPPORT in r and not r[ladder.BF16_SUPPORT])
    note = (f" {emulated} of the bfloat16 runs emulated it on a CPU without bf16 instructions (the same "
            f"rounding of each product's inputs and output, slower)." if emulated else "")
    return f"Training precision: {'; '.join(parts)}{mixed}.{note}"


def ladder_plan(records: Sequence[dict[str, Any]], planned: dict[str, dict[str, Any]]) -> Plan:
    """The runs the page waits for: today's plan of the records' ladders (`ladder.planned_entries`, at
    their budget scale), and the records' own plan entries where today's plan lacks their key."""
    entries = [entry for entry in planned.values() if ladder.UNBUILDABLE not in entry]
    known = {entry["key"] for entry in entries}
    entries += [r["plan"] for r in records if r["plan"]["key"] not in known]
    params = {}
    # gpt's parameters at every planned size (the table's header): counted, not read off a record, whose
    # size may be another column's (stdlib's m record of gpt left English's m at "0 params")
    for entry in entries:
        where = (entry["spec"], entry["size"]["name"])
        if where not in params and entry["spec"] in ladder.SPECS:
            params[where] = ladder.gpt_params(ladder.Size(**entry["size"]), ladder.SPECS[entry["spec"]].seq_len)
    return Plan.from_entries(entries, params)


def generate(records: Sequence[dict[str, Any]], figures: Path | None = None, figures_link: str = "",
             failed: dict[str, dict[str, Any]] | None = None) -> str:
    """The page: the claims (one row each), the multipliers, the plots; `failed` (`ladder.read_failures`):
    the runs that failed, named under the header (they have no record)."""
    _CACHE.clear()
    points = points_of(records)
    planned = ladder.planned_entries(records)
    stale = stale_by_variant(records, planned)
    recipes = recipes_by_variant(records)
    recorded = {r.get("key") for r in records if r.get("complete")}
    failed = {key: why for key, why in (failed or {}).items() if key not in recorded}  # retried since, and finished
    plan = ladder_plan(records, planned)
    plan.failed = frozenset(failed)  # a cell waiting for a failed run says so
    commits = sorted({r.get("commit", "unknown")[:10] for r in records})
    lines = ["# The compute ladder: the papers' scaling claims",
             "",
             "Generated by `python experiments/ladder_claims.py` from the ladder's records "
             f"({len(records)} runs; commits {', '.join(commits) or 'none'}); never edited by hand. The "
             f"rules were committed before any result: [ladder rules]({RULES}), and amended before any result "
             f"past the smallest size ([amended]({AMENDED_RULES})). Two later amendments were written after "
             f"some results, and say so: one curve method per cell ([second]({ONE_METHOD_RULES}), after the "
             f"smallest size's) and one per trend, a trend provisional until every size is in ([third]({TREND_RULES}), "
             "after the two smallest sizes'). Every figure below follows all three amendments. "
             "A multiplier is made per seed against gpt's curve from the same seed's points, and `x [a, b]` is "
             "the seeds' geometric mean and its 95% t-interval; at a one-seed size the interval takes the "
             "per-seed scatter pooled over the seeded sizes (named beside it). `>`/`<`: a seed's value lies "
             "more than 2x past gpt's measured range, so the figure is a bound. \"Does not hold\" needs an "
             "interval on the wrong side at the Bonferroni level over the row's intervals (every planned size "
             "counts). A figure waits for every run of the plan behind it (\"incomplete: k of n runs\"), and a "
             "verdict for every planned size: \"holds\" needs them all, and the row reads \"incomplete\" until "
             "one planned size decides \"does not hold\" or they have all finished. "
             "C = FLOPs gpt needs "
             "to reach the variant's BPB / the variant's FLOPs, D = the same for tokens, P = gpt's "
             "non-embedding parameters needed at the variant's tokens / the variant's."]
    if records:
        lines += ["", precision_line(records) + gate_bias_note(records)]
        lines += corpus_lines(records, planned)
    else:
        lines += ["", "No ladder run has finished yet: every verdict reads \"not run\". The command: "
                  "`python experiments/ladder.py --out experiments/ladder-runs`, then this script."]
    if failed:
        lines += ["", f"{len(failed)} runs failed and are in no row (`failed.json`; `ladder.py --retry-failed` runs "
                  "them again): " + "; ".join(f"{key}: {why.get('error', '?')}" for key, why in failed.items())]
    lines += ["", "## Claims, one row each, as the papers state them", "",
              "| the paper's claim | tested as | " + " | ".join(f"{c}, {o}" for c, o in COLUMNS) + " |",
              "|---|---|" + "---|" * len(COLUMNS)]
    details = []
    # Muon's points at the sizes the AdamW column covers: its verdict there is what AdamW's is compared with
    # (kept alive for the page: the estimates' cache keys on the list's identity)
    adamw_sizes = {corpus: {r.size for r in plan.select(corpus=corpus, optimizer="adamw")} for corpus, _ in COLUMNS}
    at_adamw_sizes = {corpus: ([p for p in points if p.optimizer != "muon" or p.size in adamw_sizes[corpus]],
                               plan.restricted(lambda r, c=corpus: r.optimizer != "muon" or r.size in adamw_sizes[c]))
                      for corpus, _ in COLUMNS}
    for claim in CLAIMS:
        cells = {column: column_cell(claim, points, *column, stale, plan, recipes) for column in COLUMNS}
        rendered = []
        for (corpus, optimizer), cell in cells.items():
            text = f"**{cell.verdict}**" + (f" ({cell.label})" if cell.label and cell.verdict != "not run" else "")
            if optimizer == "adamw" and cell.verdict in DECIDED:
                muon_cell = column_cell(claim, at_adamw_sizes[corpus][0], corpus, "muon", stale,
                                        at_adamw_sizes[corpus][1], recipes)  # a stale Muon cell decides nothing
                muon = muon_cell.verdict
                # only where both read the same variants: a RecurrentGPT row reads the paper's gate in a
                # column whose runs of it are complete and the default's in one whose are not
                if muon in DECIDED and DECIDED[muon] != DECIDED[cell.verdict] and muon_cell.variants == cell.variants:
                    text += f" (depends on the optimizer: Muon over the same sizes {muon})"
            if cell.trend and optimizer == "muon" and cell.verdict not in ("not run", "stale"):
                text += f"; trend: {cell.trend}"
            rendered.append(text)
        lines.append(f"| {claim.paper} | {claim.test} | " + " | ".join(rendered) + " |")
        details += ["", f"- **{claim.paper}**"] + [f"  - {c}, {o}: {cell.text}" for (c, o), cell in cells.items()
                                                     if cell.verdict != "not run"]
    if points:
        lines += ["", "### The figures behind each verdict"] + details
        lines += ["", "## Every variant's multipliers over gpt"]
        for corpus, optimizer in COLUMNS:
            lines += multipliers_table(points, corpus, optimizer, stale, plan, recipes)
        lines += epochs_marks(points)
        lines += ["", "## gpt's curves: the fit residuals", "",
                  "gpt's power law BPB = E + A x^-alpha per seed and size, fitted on log BPB against tokens (the "
                  "same fit against FLOPs): the root mean square of its residuals. `*`: not stable by the rules "
                  f"(alpha in (0, {ladder_fit.MAX_ALPHA}], 0 <= E < the lowest BPB, rms <= {ladder_fit.STABLE_RMS}), "
                  "so the cells at that size read the interpolation."]
        for corpus, optimizer in COLUMNS:
            lines += residuals_table(points, corpus, optimizer, plan)
        if figures is not None:
            shown = []
            for corpus, optimizer in COLUMNS:
                name = f"{corpus}-{optimizer}.png"
                if plot_curves(points, corpus, optimizer, figures / name):
                    shown.append(f"![{corpus}, {optimizer}]({figures_link}{name})")
            if shown:
                lines += ["", "## Loss against training FLOPs and against tokens", ""] + shown
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("experiments/ladder-runs"),
                   help="the ladder's folder (its records/)")
    p.add_argument("--write", type=Path, default=None,
                   help="the page to write (default: OUT/ladder.md); its plots go to figures/ladder beside "
                        "experiments/ when the page is in experiments/, else to OUT/figures")
    args = p.parse_args(argv)
    if not any((args.out / "records").glob("*.json")):  # a mistyped --out wrote a page of "not run" over the real one
        print(f"ladder_claims: error: no records in {args.out / 'records'}: --out names the ladder's folder "
              f"(experiments/ladder-runs)", file=sys.stderr)
        return 2
    records = load_records(args.out)
    page = args.write or args.out / "ladder.md"
    if page.resolve().parent == HERE:
        figures, link = HERE / "figures" / "ladder", "figures/ladder/"
    else:
        figures, link = page.parent / "figures", "figures/"
    write_text_atomic(page, generate(records, figures, link, ladder.read_failures(args.out)))
    print(f"wrote {page} from {len(records)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
