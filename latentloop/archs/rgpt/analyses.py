"""rgpt's analysis (`latentloop analyze depth`): the early-exit curve (validation loss at r = 1..R),
the mean gate and effective openness per step, and how the depth an adaptive exit would pick
correlates with each token's loss; for a run trained on a built-in task, its accuracy per depth."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...models.criteria import KLDivergence
from ...objectives.base import token_cross_entropy
from ..registry import Analysis, AnalysisOption
from .model import MAX_STEPS


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n of `values`, tied values sharing the mean of the ranks they span (as scipy's
    rankdata does): exit depths are a few integers, so most values are tied."""
    values = np.asarray(values).ravel()
    order = np.argsort(values, kind="stable")
    _, first, counts = np.unique(values[order], return_index=True, return_counts=True)
    mean_rank = first + (counts + 1) / 2.0  # ranks first+1 .. first+count, averaged
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, counts)
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation with average ranks for ties; NaN when either side is constant (no
    ranking to correlate; the analysis driver writes it as null)."""
    ranks_a, ranks_b = average_ranks(a), average_ranks(b)
    if ranks_a.std() == 0 or ranks_b.std() == 0:
        return float("nan")
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1])


@torch.no_grad()
def depth(model, x: torch.Tensor, y: torch.Tensor, context, max_steps: int | None = None,
          exit_threshold: float = 0.01, min_steps: int = 1, task_limit: int = 50) -> dict[str, Any]:
    """Also the task accuracy per depth when the run was trained on a built-in task (`task:NAME`), on
    `task_limit` examples of its (harder) test split."""
    trained = context.config.model.recurrence_steps
    R = max_steps or trained
    if min_steps > R:  # as the decoder refuses it: no position could exit, the exit figures would mean nothing
        raise ConfigError(f"--min-steps {min_steps} is past the depth evaluated ({R} steps: --max-steps, or the "
                          f"trained depth): no position could exit")
    out_all = model(x, steps=R, return_steps=True)
    losses = [float(token_cross_entropy(logits, y)) for logits in out_all.step_logits]
    token_loss = token_cross_entropy(out_all.step_logits[-1], y, reduction="none").numpy()
    logps = [F.log_softmax(lg.float(), dim=-1) for lg in out_all.step_logits]
    exit_depth = torch.full(y.shape, R, dtype=torch.long)
    decided = torch.zeros(y.shape, dtype=torch.bool)
    criterion = KLDivergence(exit_threshold)  # the decoder's own exit rule, per position
    for r in range(2, R + 1):
        stop = ~decided & criterion.settled(logps[r - 1], logps[r - 2]) & (r >= min_steps)
        exit_depth[stop] = r
        decided |= stop
    exit_flat = exit_depth.flatten().numpy()
    result = {"trained_steps": trained, "steps": list(range(1, R + 1)), "loss": losses,
              "loss_at_half_depth": losses[max(0, R // 2 - 1)],
              "gate_mean_per_step": [float(v) for v in out_all.gate_means],
              "openness_per_step": [float(v) for v in out_all.openness],
              "exit_threshold": exit_threshold, "mean_exit_depth": float(exit_flat.mean()),
              "exit_depth_histogram": np.bincount(exit_flat, minlength=R + 1)[1:].tolist(),
              "spearman_exit_depth_vs_token_loss": spearman(exit_flat, token_loss)}
    if context.task is not None:  # a run trained on a built-in task: its accuracy at each depth
        result["task"] = context.task
        scores = [context.task_accuracy({"steps": r}, task_limit)
                  for r in context.progress(result["steps"], desc="task accuracy per depth")]
        # each depth's accuracy with its interval and how many items (and distinct prompts) it rests on
        result["task_accuracy"] = [score["accuracy"] for score in scores]
        result["task_accuracy_ci"] = [score["accuracy_ci"] for score in scores]
        result["task_n"] = [score["n"] for score in scores]
        result["task_distinct"] = [score["distinct"] for score in scores]
    return result


def _plot(plt, r):
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
    a.plot(r["steps"], r["loss"], marker="o", label="val loss")
    a.axvline(r["trained_steps"], color="gray", ls="--", label="trained R")
    a.set(xlabel="recurrence steps r", ylabel="val loss (nats/token)", title="early-exit curve")
    if "task_accuracy" in r:
        twin = a.twinx()
        intervals = r.get("task_accuracy_ci") or [None] * len(r["steps"])
        # (clamped: the interval counts distinct prompts, the accuracy every item, so they may not nest)
        below = [max(0.0, acc - ci[0]) if ci else 0.0 for acc, ci in zip(r["task_accuracy"], intervals)]
        above = [max(0.0, ci[1] - acc) if ci else 0.0 for acc, ci in zip(r["task_accuracy"], intervals)]
        twin.errorbar(r["steps"], r["task_accuracy"], yerr=[below, above], marker="s", color="tab:red",
                      capsize=3, label="task accuracy (95% Wilson)")
        twin.set_ylabel("task accuracy")
    a.legend()
    b.plot(r["steps"], r["gate_mean_per_step"], marker="o", label="mean gate g (1 = copy)")
    b.plot(r["steps"], r["openness_per_step"], marker="s", label="effective openness ||Δh|| / ||o||")
    b.set(xlabel="step", ylabel="value", title="gate and openness per step")
    b.legend()
    c.bar(r["steps"], r["exit_depth_histogram"])
    rho = r["spearman_exit_depth_vs_token_loss"]
    # undefined where every token exits at one depth (NaN, null in the JSON): said so, not "nan"
    shown = "n/a" if rho is None or math.isnan(rho) else f"{rho:.2f}"
    c.set(xlabel="adaptive exit depth", ylabel="tokens", title=f"exit depth (Spearman vs loss {shown})")
    from matplotlib.ticker import MaxNLocator

    for axis in (a, b, c):
        axis.grid(alpha=0.3)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and depths are whole numbers
    return fig


def _line(r) -> str:
    line = ", ".join(f"r={step}: {loss:.4f}" for step, loss in zip(r["steps"], r["loss"]))
    return line + (f"; mean exit depth {r['mean_exit_depth']:.2f}, Spearman(exit depth, loss) "
                   f"{r['spearman_exit_depth_vs_token_loss']:.3f}")


DEPTH = Analysis(
    help="early-exit curve, gate per step, exit depth vs token loss", run=depth, summary=_line, plot=_plot,
    batches=2, batch_size=8,
    options=(AnalysisOption("max_steps", int, None, "evaluate r = 1..this (default: trained R)", minimum=1,
                            maximum=MAX_STEPS),
             AnalysisOption("exit_threshold", float, 0.01, "KL threshold of the adaptive exit", minimum=0.0),
             AnalysisOption("min_steps", int, 1, "steps before any exit", minimum=1, maximum=MAX_STEPS),
             AnalysisOption("task_limit", int, 50, "for runs trained on task:NAME, test examples scored at each "
                                                   "depth", minimum=1)))

ANALYSES = {"depth": DEPTH}
