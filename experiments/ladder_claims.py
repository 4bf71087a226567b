"""The claims table, generated from the compute ladder's records (issue 52), never typed by hand.

    python experiments/ladder_claims.py --out experiments/ladder-runs --write experiments/LADDER.md

Each paper's scaling claim is one row, tested as the paper states it, by the rules committed before
any result (experiments/logs/2026-12-05-ladder-rules.md, amended before any result past the smallest
size: experiments/logs/2026-12-05-ladder-rules-amended.md): the verdict per corpus and optimizer with
the figures at every size, and the trend over size. Below it, every variant's compute and data multiplier
over gpt at every size, and the plots. A row any of whose records ran under a config that differs
from what the same plan entry builds today, or under a plan entry that differs from today's plan
(`ladder.stale_fields`: a default, a size, a budget changed since), reads "stale", with the fields
that changed.
"""

from __future__ import annotations

import argparse
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
    Point,
    load_records,
    plot_curves,
    points_of,
    select,
    trend,
)

RULES = "logs/2026-12-05-ladder-rules.md"
AMENDED_RULES = "logs/2026-12-05-ladder-rules-amended.md"
MATCH_MARGIN = 1.01  # rule 4: "matches" = the ratio's upper end at most 1% above 1
PAPER_DATA_FACTOR = 1.5  # rule 1: the abstract's "about 1.5x more tokens"
COLUMNS = (("stdlib", "muon"), ("english", "muon"), ("stdlib", "adamw"), ("english", "adamw"))
DECIDED = {"holds": True, "matches": True, "does not hold": False}  # the verdicts that decide, by side


_CACHE: dict[tuple, Any] = {}  # one page's estimates: a row and the tables below ask for the same ones


def _cached(function: Callable, points: Sequence[Point], *args: Any) -> Any:
    key = (function.__name__, id(points), *args)
    if key not in _CACHE:
        _CACHE[key] = function(points, *args)
    return _CACHE[key]


def multiplier(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str, axis: str) -> Any:
    return _cached(ladder_fit.multiplier, points, corpus, optimizer, size, variant, axis)


def parameter_multiplier(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str) -> Any:
    return _cached(ladder_fit.parameter_multiplier, points, corpus, optimizer, size, variant)


def paired_ratio(points: Sequence[Point], corpus: str, optimizer: str, size: str, variant: str, baseline: str,
                 budget: int) -> Any:
    return _cached(ladder_fit.paired_ratio, points, corpus, optimizer, size, variant, baseline, budget)


@dataclass
class Cell:
    verdict: str  # "holds", "does not hold", "undecided", "matches", "not run", "stale"
    text: str  # the figures behind it
    variants: tuple[str, ...]  # whose records the cell read (gpt's too)
    trend: str = ""


def sizes_of(points: Sequence[Point], corpus: str, optimizer: str) -> list[tuple[int, str, int]]:
    """(index, name, gpt's non-embedding params) of every size gpt ran at in this column."""
    found = {(p.size_index, p.size, p.params) for p in select(points, variant=REFERENCE, corpus=corpus,
                                                              optimizer=optimizer)}
    return sorted(found)


def against_level(tests: int) -> float:
    """The level at which one of `tests` intervals decides "does not hold" (Bonferroni: a verdict
    that any of them lies on the wrong side keeps its 5% error over all of them)."""
    return 1 - (1 - LEVEL) / max(1, tests)


def aggregate(per_size: Sequence[tuple[str, Estimate | None]], tests: int | None = None) -> str:
    """Rules 1-3, 6 (amended): "holds" if every size is decided above 1 at 95%; "does not hold" if
    any size is decided below 1 at the Bonferroni level over the row's `tests` intervals (default:
    these sizes); else "undecided" (a size without an interval decides nothing)."""
    present = [(s, e) for s, e in per_size if e is not None]
    if not present:
        return "not run"
    level = against_level(tests or len(per_size))
    if any(decided(e, level) == "< 1" for _, e in present):
        return "does not hold"
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


def _figures(per_size: Sequence[tuple[str, Estimate | None]]) -> str:
    return "; ".join(f"{size} {'—' if e is None else e.text()}" for size, e in per_size)


def _trend_text(points: Sequence[Point], corpus: str, optimizer: str, variant: str, axis: str) -> str:
    sizes = sizes_of(points, corpus, optimizer)
    pairs = [(n, multiplier(points, corpus, optimizer, name, variant, axis)) for _, name, n in sizes]
    found = trend(pairs)
    if found is None:
        return ""
    interval = "" if found["interval"] is None else f" [{found['interval'][0]:.2f}, {found['interval'][1]:.2f}]"
    bounds = f"; bounds at {', '.join(found['bounds'])}" if found["bounds"] else ""
    return f"{found['verdict']} (slope {found['slope']:.2f}{interval}{bounds})"


def multiplier_claim(variant: str, axis: str, extra: Callable[[list], str] | None = None,
                     beside: tuple[str, str] | None = None) -> Callable[[Sequence[Point], str, str], Cell]:
    """Rules 1, 2, 6: one multiplier of one variant at its largest token budget at every size."""
    def evaluate(points: Sequence[Point], corpus: str, optimizer: str) -> Cell:
        sizes = sizes_of(points, corpus, optimizer)
        per_size = [(name, multiplier(points, corpus, optimizer, name, variant, axis)) for _, name, _ in sizes]
        verdict = aggregate(per_size) if sizes else "not run"
        name = {"tokens": "D", "flops": "C"}[axis]
        text = f"{variant} {name}: {_figures(per_size)}"
        if extra is not None:
            text += extra(per_size)
        if beside is not None:
            other = [(s, multiplier(points, corpus, optimizer, s, beside[0], beside[1])) for _, s, _ in sizes]
            text += f" (beside it: {beside[0]} {'D' if beside[1] == 'tokens' else 'C'}: {_figures(other)})"
        return Cell(verdict, text, (REFERENCE, variant) + ((beside[0],) if beside else ()),
                    _trend_text(points, corpus, optimizer, variant, axis))
    return evaluate


def _reaches_paper_factor(per_size: list) -> str:
    present = [(s, e) for s, e in per_size if e is not None and e.interval is not None]
    if not present:
        return ""
    size, e = present[-1]  # the largest size with an interval
    reach = "reaches" if e.interval[1] >= PAPER_DATA_FACTOR else "does not reach"
    return f"; at {size} the interval {reach} the paper's {PAPER_DATA_FACTOR}x"


def rgpt_scaling(points: Sequence[Point], corpus: str, optimizer: str) -> Cell:
    """Rule 3: both rgpt forms, C and P, at every size."""
    sizes = sizes_of(points, corpus, optimizer)
    parts, verdicts = [], []
    tests = 4 * len(sizes)  # C and P of both forms at every size
    for variant in ("rgpt-flops", "rgpt-params"):
        c = [(s, multiplier(points, corpus, optimizer, s, variant, "flops")) for _, s, _ in sizes]
        p = [(s, parameter_multiplier(points, corpus, optimizer, s, variant)) for _, s, _ in sizes]
        verdicts += [aggregate(c, tests), aggregate(p, tests)]
        parts.append(f"{variant} C: {_figures(c)}; P: {_figures(p)}")
    if not sizes or all(v == "not run" for v in verdicts):
        verdict = "not run"
    elif "does not hold" in verdicts:
        verdict = "does not hold"
    elif all(v == "holds" for v in verdicts):
        verdict = "holds"
    else:
        verdict = "undecided"
    trends = "; ".join(f"{v} C {text}" for v in ("rgpt-flops", "rgpt-params")
                       if (text := _trend_text(points, corpus, optimizer, v, "flops")))
    return Cell(verdict, " / ".join(parts), (REFERENCE, "rgpt-flops", "rgpt-params"), trends)


def _ratio_text(found: dict[str, Any] | None) -> str:
    if found is None:
        return "—"
    if "mean" not in found:
        return f"refused (FLOPs ratios {', '.join(f'{f:.3f}' for f in found['flops_ratios'])})"
    interval = found["interval"]
    body = f"{found['mean']:.4f}" + (f" [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else " (1 seed)")
    if found["pooled_from"]:
        body += f" (1 seed; seed scatter of {', '.join(found['pooled_from'])})"
    return body + f" (FLOPs {min(found['flops_ratios']):.3f}-{max(found['flops_ratios']):.3f}x)"


def _ratio_interval(found: dict[str, Any], level: float) -> tuple[float, float] | None:
    return found["stats"].interval(level)


def _largest_flops_budget(points: Sequence[Point], corpus: str, optimizer: str, size: str) -> int | None:
    budgets = [p.budget for p in select(points, variant=REFERENCE, corpus=corpus, optimizer=optimizer, size=size)
               if p.kind == "tokens"]
    return max(budgets) if budgets else None


def rgpt_isoflops_match(points: Sequence[Point], corpus: str, optimizer: str) -> Cell:
    """Rule 4 (amended): rgpt-flops / gpt at the largest FLOP-matched budget, per seed, t-interval;
    "matches" at every size at 95%, "does not hold" at one size at the Bonferroni level."""
    sizes = sizes_of(points, corpus, optimizer)
    texts, verdicts = [], []
    level = against_level(len(sizes))
    for _, size, n in sizes:
        budget = _largest_flops_budget(points, corpus, optimizer, size)
        found = None if budget is None else paired_ratio(points, corpus, optimizer, size, "rgpt-flops", REFERENCE,
                                                          budget)
        share = [p.params for p in select(points, variant="rgpt-flops", corpus=corpus, optimizer=optimizer, size=size)]
        share_text = f", {share[0] / n:.0%} of gpt's parameters" if share else ""
        texts.append(f"{size} {_ratio_text(found)}{share_text}")
        if found is None or "mean" not in found:
            verdicts.append("not run" if found is None else "refused")
        elif found["interval"] is None:
            verdicts.append("undecided")
        elif found["interval"][1] <= MATCH_MARGIN:
            verdicts.append("matches")
        elif _ratio_interval(found, level)[0] > MATCH_MARGIN:
            verdicts.append("does not hold")
        else:
            verdicts.append("undecided")
    if not sizes or all(v == "not run" for v in verdicts):
        verdict = "not run"
    elif "does not hold" in verdicts:
        verdict = "does not hold"
    elif all(v == "matches" for v in verdicts):
        verdict = "matches"
    else:
        verdict = "undecided"
    trend_text = _trend_text(points, corpus, optimizer, "rgpt-flops", "flops")
    return Cell(verdict, "rgpt-flops / gpt at matched training FLOPs: " + "; ".join(texts),
                (REFERENCE, "rgpt-flops"), f"C {trend_text}" if trend_text else "")


def rgpt_beats_baselines(points: Sequence[Point], corpus: str, optimizer: str) -> Cell:
    """Rule 5 (amended): in every size x FLOP-matched budget cell, rgpt-flops below both baselines
    at 95%; "does not hold" if a cell lies above 1 at the Bonferroni level over all the cells."""
    sizes = sizes_of(points, corpus, optimizer)
    found_cells = []  # (size, baseline, the comparison)
    for _, size, _ in sizes:
        budgets = sorted({p.budget for p in select(points, variant=REFERENCE, corpus=corpus, optimizer=optimizer,
                                                   size=size) if p.kind == "tokens"})
        for baseline in ("mor-flops", "rgpt-flops-heavy"):
            for budget in budgets:
                found = paired_ratio(points, corpus, optimizer, size, "rgpt-flops", baseline, budget)
                if found is not None:
                    found_cells.append((size, baseline, found))
    level = against_level(len(found_cells))
    below = above = undecided = refused = 0
    texts: dict[tuple[str, str], list[str]] = {}
    for size, baseline, found in found_cells:
        texts.setdefault((size, baseline), []).append(_ratio_text(found))
        if "mean" not in found:
            refused += 1
        elif found["interval"] is None:  # one seed and no seed scatter to borrow: decides nothing
            undecided += 1
        elif found["interval"][1] < 1:
            below += 1
        elif _ratio_interval(found, level)[0] > 1:
            above += 1
        else:
            undecided += 1
    total = below + above + undecided + refused
    if total == 0:
        verdict = "not run"
    elif above:
        verdict = "does not hold"
    elif below == total:
        verdict = "holds"
    else:
        verdict = "undecided"
    summary = f"{total} comparisons (size x budget x baseline): {below} below 1, {above} above, {undecided} " \
              f"undecided, {refused} refused (FLOPs apart by more than 5%)"
    details = "; ".join(f"{size} / {baseline}: {', '.join(cells)}" for (size, baseline), cells in texts.items())
    return Cell(verdict, summary + ". " + details, (REFERENCE, "rgpt-flops", "mor-flops", "rgpt-flops-heavy"))


@dataclass(frozen=True)
class Claim:
    paper: str  # the claim, as the paper states it
    test: str  # what decides it here
    evaluate: Callable[[Sequence[Point], str, str], Cell]


CLAIMS = (
    Claim("FBT: matches or approaches a standard transformer trained on about 1.5x (summary: 1.5-2x) more tokens",
          "data multiplier D of fbt-paper (the paper's late-feedback schedule) at its largest budget, every size "
          "(rule 1); latentloop's default fbt beside it",
          multiplier_claim("fbt-paper", "tokens", _reaches_paper_factor, beside=("fbt", "tokens"))),
    Claim("LRT: lower BPB at baseline-equivalent training compute (interleaved training's 2x counted)",
          "compute multiplier C of lrt (rule 2; data multiplier beside it)",
          multiplier_claim("lrt", "flops", beside=("lrt", "tokens"))),
    Claim("RGPT: better loss-vs-parameters and loss-vs-training-FLOPs scaling",
          "C and parameter multiplier P of rgpt-flops and rgpt-params, all above 1 (rule 3)", rgpt_scaling),
    Claim("RGPT: at isoFLOPs matches the dense model with 36-37% of the parameters",
          "rgpt-flops / gpt BPB at matched training FLOPs (within 5%), upper end <= 1.01 (rule 4); its shape keeps 3 "
          "of gpt's 8 blocks (37.5%), and with the recurrence's input projection and gate about 43% of gpt's "
          "non-embedding parameters",
          rgpt_isoflops_match),
    Claim("RGPT: beats Mixture-of-Recursions and heavy-tailed depth sampling at isoFLOPs, in every budget-scale cell",
          "rgpt-flops / mor-flops and / rgpt-flops-heavy at every FLOP-matched budget and size (rule 5)",
          rgpt_beats_baselines),
    Claim("RGPT: at isoPARAMs deeper recursion improves validation loss consistently (2.76 vs 2.84)",
          "data multiplier D of rgpt-params (rule 6)", multiplier_claim("rgpt-params", "tokens")),
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


def column_cell(claim: Claim, points: Sequence[Point], corpus: str, optimizer: str,
                stale: dict[tuple[str, str, str], list[str]]) -> Cell:
    cell = claim.evaluate(points, corpus, optimizer)
    changed = [c for v in cell.variants for c in stale.get((corpus, optimizer, v), [])]
    if changed and cell.verdict != "not run":
        cell.text = f"ran under other defaults ({'; '.join(dict.fromkeys(changed))}). " + cell.text
        cell.verdict = "stale"
    return cell


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


def multipliers_table(points: Sequence[Point], corpus: str, optimizer: str,
                      stale: dict[tuple[str, str, str], list[str]] | None = None) -> list[str]:
    sizes = sizes_of(points, corpus, optimizer)
    if not sizes:
        return []
    stale = stale or {}
    variants = [v for v in dict.fromkeys(p.variant for p in select(points, corpus=corpus, optimizer=optimizer))
                if v != REFERENCE]
    header = "| variant | " + " | ".join(f"{name} ({n:,} params)" for _, name, n in sizes) + " | trend of C / D |"
    lines = ["", f"**{corpus}, {optimizer}**: compute multiplier C / data multiplier D at the variant's largest "
             "token budget, [95% t-interval over seeds]; the method of gpt's curve after each", "", header,
             "|---|" + "---|" * len(sizes) + "---|"]
    for variant in variants:
        changed = stale.get((corpus, optimizer, variant), []) + stale.get((corpus, optimizer, REFERENCE), [])
        mark = f" (stale: {'; '.join(dict.fromkeys(changed))})" if changed else ""
        cells = []
        for _, name, _ in sizes:
            c = multiplier(points, corpus, optimizer, name, variant, "flops")
            d = multiplier(points, corpus, optimizer, name, variant, "tokens")
            if c is None and d is None:
                cells.append("—")
                continue
            cells.append(f"C {c.text() if c else '—'} ({c.method if c else ''}); D {d.text() if d else '—'}")
        c_trend, d_trend = (_trend_text(points, corpus, optimizer, variant, axis) for axis in ("flops", "tokens"))
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
    return f"Training precision: {'; '.join(parts)}{mixed}."


def generate(records: Sequence[dict[str, Any]], figures: Path | None = None, figures_link: str = "",
             failed: dict[str, dict[str, Any]] | None = None) -> str:
    """The page: the claims (one row each), the multipliers, the plots; `failed` (`ladder.read_failures`):
    the runs that failed, named under the header (they have no record)."""
    _CACHE.clear()
    points = points_of(records)
    stale = stale_by_variant(records, ladder.planned_entries(records))
    commits = sorted({r.get("commit", "unknown")[:10] for r in records})
    lines = ["# The compute ladder: the papers' scaling claims",
             "",
             "Generated by `python experiments/ladder_claims.py` from the ladder's records "
             f"({len(records)} runs; commits {', '.join(commits) or 'none'}); never edited by hand. The "
             f"rules were committed before any result: [ladder rules]({RULES}), and amended before any result "
             f"past the smallest size ([amended]({AMENDED_RULES}): every figure below follows the amendment). "
             "A multiplier is made per seed against gpt's curve from the same seed's points, and `x [a, b]` is "
             "the seeds' geometric mean and its 95% t-interval; at a one-seed size the interval takes the "
             "per-seed scatter pooled over the seeded sizes (named beside it). `>`/`<`: a seed's value lies "
             "more than 2x past gpt's measured range, so the figure is a bound. \"Does not hold\" needs an "
             "interval on the wrong side at the Bonferroni level over the row's intervals. C = FLOPs gpt needs "
             "to reach the variant's BPB / the variant's FLOPs, D = the same for tokens, P = gpt's "
             "non-embedding parameters needed at the variant's tokens / the variant's."]
    if records:
        lines += ["", precision_line(records)]
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
    at_adamw_sizes = {corpus: [p for p in points if p.optimizer != "muon" or p.size in
                               {q.size for q in points if q.optimizer == "adamw" and q.corpus == corpus}]
                      for corpus, _ in COLUMNS}
    for claim in CLAIMS:
        cells = {column: column_cell(claim, points, *column, stale) for column in COLUMNS}
        rendered = []
        for (corpus, optimizer), cell in cells.items():
            text = f"**{cell.verdict}**"
            if optimizer == "adamw" and cell.verdict in DECIDED:
                muon = claim.evaluate(at_adamw_sizes[corpus], corpus, "muon").verdict
                if muon in DECIDED and DECIDED[muon] != DECIDED[cell.verdict]:
                    text += f" (depends on the optimizer: Muon over the same sizes {muon})"
            if cell.trend and optimizer == "muon" and cell.verdict != "not run":
                text += f"; trend: {cell.trend}"
            rendered.append(text)
        lines.append(f"| {claim.paper} | {claim.test} | " + " | ".join(rendered) + " |")
        details += ["", f"- **{claim.paper}**"] + [f"  - {c}, {o}: {cell.text}" for (c, o), cell in cells.items()
                                                     if cell.verdict != "not run"]
    if points:
        lines += ["", "### The figures behind each verdict"] + details
        lines += ["", "## Every variant's multipliers over gpt"]
        for corpus, optimizer in COLUMNS:
            lines += multipliers_table(points, corpus, optimizer, stale)
        lines += epochs_marks(points)
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
    p.add_argument("--out", type=Path, default=Path("experiments/ladder-runs"), help="the ladder's folder (its records/)")
    p.add_argument("--write", type=Path, default=None,
                   help="the page to write (default: OUT/ladder.md); its plots go to figures/ladder beside "
                        "experiments/ when the page is in experiments/, else to OUT/figures")
    args = p.parse_args(argv)
    records = load_records(args.out)
    page = args.write or args.out / "ladder.md"
    if page.resolve().parent == HERE:
        figures, link = HERE / "figures" / "ladder", "figures/ladder/"
    else:
        figures, link = page.parent / "figures", "figures/"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(generate(records, figures, link, ladder.read_failures(args.out)))
    print(f"wrote {page} from {len(records)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
