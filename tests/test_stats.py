"""The interval arithmetic every tool prints (`latentloop.eval.stats`), against published table values
and, where scipy is installed, against scipy; and the per-document sums `score_run` builds its
intervals from (documents split at BOS, totals equal to the point figures)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from latentloop.eval import stats
from latentloop.eval.loss import evaluate_batches, row_documents, text_batches

# Student t and normal quantiles from printed tables (two-sided 95%: the 0.975 quantile).
T_975 = {1: 12.706204736174705, 2: 4.302652729911275, 4: 2.7764451051977987, 30: 2.0422724563012373}
Z_975 = 1.959963984540054


@pytest.mark.parametrize("df", sorted(T_975))
def test_t_quantile_matches_the_table(df):
    assert stats.t_quantile(0.975, df) == pytest.approx(T_975[df], rel=1e-9)
    assert stats.t_quantile(0.025, df) == pytest.approx(-T_975[df], rel=1e-9)
    assert stats.t_cdf(T_975[df], df) == pytest.approx(0.975, abs=1e-9)


def test_quantiles_agree_with_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for p in (0.6, 0.9, 0.95, 0.99, 0.999):
        assert stats.normal_quantile(p) == pytest.approx(scipy_stats.norm.ppf(p), rel=1e-9)
        for df in (1, 2.5, 3, 7, 50, 500):
            assert stats.t_quantile(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-8)
    for a, b, x in ((0.5, 0.5, 0.3), (2.0, 5.0, 0.9), (10.0, 0.5, 0.01), (1.5, 40.0, 0.2)):
        assert stats.regularized_beta(a, b, x) == pytest.approx(scipy_stats.beta.cdf(x, a, b), rel=1e-9)


def test_normal_quantile_and_bad_arguments():
    assert stats.normal_quantile(0.975) == pytest.approx(Z_975, rel=1e-12)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError):
            stats.normal_quantile(bad)
        with pytest.raises(ValueError):
            stats.t_quantile(bad, 3)


def test_t_interval_and_mean_sd():
    values = [1.0, 2.0, 4.0]
    mean, sd = stats.mean_sd(values)
    assert (mean, sd) == pytest.approx((7 / 3, math.sqrt(7 / 3)))
    low, high = stats.t_interval(values)
    half = T_975[2] * sd / math.sqrt(3)
    assert (low, high) == pytest.approx((mean - half, mean + half))
    assert stats.t_interval([1.0]) is None and stats.mean_sd([5.0]) == (5.0, 0.0)


def test_paired_comparison_pairs_by_seed_and_says_whether_it_excludes_no_change():
    base = {0: 2.0, 1: 2.1, 2: 1.9}
    better = {0: 1.90, 1: 2.01, 2: 1.79, 3: 0.5}  # seed 3 has no baseline: left out
    result = stats.paired_comparison(better, base)
    assert result["seeds"] == [0, 1, 2] and result["mean"] == pytest.approx(-0.1)
    assert result["high"] < 0 and result["excludes"] is True
    noisy = stats.paired_comparison({0: 1.9, 1: 2.2, 2: 1.9}, base)
    assert noisy["low"] < 0 < noisy["high"] and noisy["excludes"] is False
    ratio = stats.paired_comparison({0: 4.0, 1: 4.2, 2: 3.8}, base, kind="ratio")
    assert ratio["mean"] == pytest.approx(2.0) and ratio["sd"] == pytest.approx(0.0, abs=1e-12)
    single = stats.paired_comparison({0: 1.0}, base)
    assert single["low"] is None and single["excludes"] is None
    with pytest.raises(ValueError):
        stats.paired_comparison(better, base, kind="odds")


def test_wilson_interval():
    assert stats.wilson_interval(0, 0) is None
    low, high = stats.wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.27753279986288625, rel=1e-9)  # (z²/n) / (1 + z²/n)
    low, high = stats.wilson_interval(5, 10)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-4)  # the published table's values
    with pytest.raises(ValueError):
        stats.wilson_interval(11, 10)


def test_bootstrap_ratio_is_of_the_sums_and_covers_the_truth():
    # equal units: every resample has the same ratio, so the interval collapses onto it
    assert stats.bootstrap_ratio([2.0] * 5, [4.0] * 5) == pytest.approx((0.5, 0.5))
    assert stats.bootstrap_ratio([1.0], [2.0]) is None
    # a ratio of sums, not a mean of ratios: one long unit dominates
    low, high = stats.bootstrap_ratio([1.0, 100.0], [1.0, 1000.0])
    assert low <= 101 / 1001 <= high and low >= 0.1 - 1e-12
    # the same numbers give the same interval (fixed seed); a 95% interval covers ~95% of the time
    rng = np.random.default_rng(1)
    covered = 0
    for trial in range(200):
        sizes = rng.integers(50, 500, size=40).astype(float)
        nats = sizes * rng.normal(2.0, 0.3, size=40)
        interval = stats.bootstrap_ratio(nats, sizes, resamples=400, seed=trial)
        covered += interval[0] <= 2.0 <= interval[1]
        if trial == 0:
            assert interval == stats.bootstrap_ratio(nats, sizes, resamples=400, seed=0)
    assert 0.88 <= covered / 200 <= 0.99


class _Uniform(torch.nn.Module):
    """Scores every target by a fixed table: the loss of a target is -log p(target), known exactly."""

    def __init__(self, vocab: int):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.linspace(-1, 1, vocab))

    def forward(self, x):
        return self.logits.expand(*x.shape, -1)


def test_documents_split_at_bos_and_their_sums_are_the_figures():
    bos, vocab, seq_len = 9, 10, 4
    stream = np.array([bos, 1, 2, 3, bos, 4, 5, bos, 6, 7, 8, 1, 2, bos, 3], dtype=np.int64)
    token_bytes = np.ones(vocab, dtype=np.int64)
    token_bytes[bos] = 0
    model = _Uniform(vocab)
    with_documents = list(text_batches(stream, 2, seq_len, bos_id=bos)())
    plain = evaluate_batches(model, text_batches(stream, 2, seq_len)(), token_bytes, lambda m, x, written: m(x))
    result = evaluate_batches(model, with_documents, token_bytes, lambda m, x, written: m(x))
    per = result.pop("per_document")
    assert result == plain  # documents change nothing in the point figures
    # windows: targets at stream positions 1-4, 5-8, 9-12: documents open at each BOS target
    x, y, mask, documents = with_documents[0]
    assert mask is None and documents.tolist() == [[1, 1, 1, 2], [2, 2, 3, 3]]
    assert with_documents[1][3].tolist() == [[3, 3, 3, 3]]
    assert per["tokens"].tolist() == [3, 3, 6] and per["bytes"].tolist() == [3, 2, 5]  # a BOS has no bytes
    log_probs = torch.log_softmax(model.logits.detach().double(), -1)
    targets = stream[1:13]
    assert per["nats"].sum() == pytest.approx(float(-log_probs[targets].sum()), rel=1e-6)
    assert per["nats"].sum() / per["tokens"].sum() == pytest.approx(result["loss"], rel=1e-6)
    assert per["nats_bpb"].sum() / math.log(2) / per["bytes"].sum() == pytest.approx(result["bpb"], rel=1e-6)


def test_row_documents_number_each_conversation_of_each_row():
    bos = 0
    y = torch.tensor([[0, 5, 5, 0, 5], [5, 0, 5, 5, 5]])
    (_, _, _, documents), = row_documents([(y, y, torch.ones_like(y, dtype=torch.bool))], bos)
    rows = documents.tolist()
    assert rows[0][0] == rows[0][1] == rows[0][2] != rows[0][3] == rows[0][4]
    assert rows[1][0] != rows[1][1] == rows[1][4]
    assert not set(rows[0]) & set(rows[1])  # rows never share a document


def test_a_log_ratio_comparison_is_the_geometric_mean_with_its_interval_on_the_logs():
    """kind="log_ratio" (the benchmarks' speed ratios): rounds at 0.5x and 2x cancel, and the interval
    stays positive (the arithmetic mean of [0.5, 2] read 1.25 [-8.28, 10.78]); "ratio" is unchanged."""
    import math

    from latentloop.eval.stats import paired_comparison, t_interval, verdict

    logged = paired_comparison({0: 0.5, 1: 2.0}, {0: 1.0, 1: 1.0}, kind="log_ratio")
    assert logged["mean"] == pytest.approx(1.0) and 0 < logged["low"] < 1 < logged["high"]
    assert verdict(logged, "faster", "slower") == "undecided"
    values, base = {0: 0.9, 1: 0.8, 2: 0.85}, {0: 1.0, 1: 1.0, 2: 1.0}
    logged = paired_comparison(values, base, kind="log_ratio")
    logs = [math.log(v) for v in values.values()]
    assert (math.log(logged["low"]), math.log(logged["high"])) == pytest.approx(t_interval(logs))
    assert verdict(logged, "faster", "slower") == "faster"
    assert paired_comparison({0: 0.5, 1: 2.0}, {0: 1.0, 1: 1.0}, kind="ratio")["mean"] == pytest.approx(1.25)


def test_a_log_ratio_with_a_value_of_zero_decides_nothing_and_says_why():
    """A repeat with 0 req/s (every request failed) has no logarithm: it was dropped, which removed
    the worst repeat and turned "undecided" into "ahead"."""
    from latentloop.eval.stats import paired_comparison, verdict

    values, base = {0: 0.0, 1: 2.0, 2: 2.1, 3: 1.9}, dict.fromkeys(range(4), 1.0)
    logged = paired_comparison(values, base, kind="log_ratio")
    assert logged["nonpositive"] == [0] and logged["low"] is None and logged["seeds"] == [0, 1, 2, 3]
    assert verdict(logged, "lower", "higher") == "undecided (a value of 0 or below)"


def test_a_ratio_over_a_baseline_of_zero_decides_nothing_and_says_why():
    """A seed whose baseline is 0 has no ratio: `seed_rows` with kind "ratio" (the experiments'
    comparisons, e.g. experiments/cpu_comparison.py) raised ZeroDivisionError there; a ratio over
    negative baselines is still a ratio."""
    from latentloop.eval.stats import paired_comparison, seed_rows, verdict

    rows = seed_rows({"base": {1: 0.0, 2: 1.0}, "new": {1: 1.0, 2: 1.0}}, "base")
    paired = rows[1]["paired"]
    assert paired["zero_baseline"] == [1] and paired["low"] is None and math.isnan(paired["mean"])
    assert rows[1]["verdict"] == verdict(paired) == "undecided (a baseline of 0: no ratio)"
    assert paired_comparison({1: -2.0, 2: -3.0}, {1: -1.0, 2: -1.5}, kind="ratio")["mean"] == pytest.approx(2.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_bootstrap_over_a_document_that_is_not_finite_gives_no_interval(bad):
    """One NaN or infinite document makes the loss itself NaN or infinite; the resamples that missed it
    gave a finite interval printed beside that point."""
    from latentloop.eval import stats

    losses, tokens = [2.0 + 0.1 * (i % 5) for i in range(30)], [10.0] * 30
    assert stats.bootstrap_ratio(losses, tokens) is not None
    assert stats.bootstrap_ratio(losses[:-1] + [bad], tokens) is None
    assert stats.bootstrap_ratio(losses, tokens[:-1] + [bad]) is None
