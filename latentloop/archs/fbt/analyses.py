"""fbt's analyses (`latentloop analyze contraction | probe`), run on any stack that feeds its top state
back (rfbt's too): the model's `pass_states`, the one multi-pass loop.

- contraction: iterate the multi-pass map H_k = F(shift(H_{k-1})) far past training's 3 passes on
  validation data; the mean relative change ||H_k - H_{k-1}|| / ||H_k|| and the loss per pass show
  whether the learned map is contractive (the paper reports stability out to k = 1000 only with the
  3% deeper batches).
- passes_curve (`eval --passes-curve`, a curve the spec names): the K-pass fused forward's per-token
  losses for the marked K and at the sequential fixed point; `eval.loss.score_curve` sums them.
- probe: linear probes from layer-0 activations for a global-state label (the bracket nesting depth
  of code), under a standard prefill vs a recurrent (multi-pass) prefill; latent feedback should
  expose global state to the shallowest layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...models.criteria import RelativeChange
from ...objectives.base import token_cross_entropy
from ..registry import Analysis, AnalysisOption
from .model import MAX_PASSES

MARKED_PASSES = (1, 2, 3, 4, 8, 16)  # the K's `eval --passes-curve` reports, marked on the loss per pass
PROBE_CLASSES = 5  # nesting depth 0..3, and 4 for "4 or deeper"
PROBE_TRAIN_FRACTION = 0.7
PROBE_L2 = 1e-3
PROBE_ITERATIONS = 200
OPENERS, CLOSERS = "([{", ")]}"


# -- the passes curve -------------------------------------------------------------------------------


@torch.no_grad()
def passes_curve(model, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The paper's stability check (its loss-vs-passes figure) on one batch: per-token losses (B, T)
    of the K-pass fused forward for each marked K, and at "fixed_point" (K = T passes: the Jacobi
    iteration is exact there). One iteration serves every K: pass k's states are pass k's whatever
    the later passes do, and only one pass is held at a time."""
    wanted = {f"K={k}": k for k in MARKED_PASSES} | {"fixed_point": x.shape[1]}
    losses: dict[str, torch.Tensor] = {}
    states = model.pass_states(x, model.context(x, None, None))
    for k, (h, _) in zip(range(1, max(wanted.values()) + 1), states):
        for label in [label for label, want in wanted.items() if want == k]:
            losses[label] = token_cross_entropy(model.readout(h), y, reduction="none").view_as(y)  # (B, T)
    return {label: losses[label] for label in wanted}


CURVES = {"passes_curve": passes_curve}


# -- contraction ---------------------------------------------------------------------------------------


@torch.no_grad()
def contraction(model, x: torch.Tensor, y: torch.Tensor, context, passes: int = 1000) -> dict[str, Any]:
    changes, losses, h = [], [], None
    states = zip(range(passes), model.pass_states(x, model.context(x, None, None)))
    for _, (h_next, _) in context.progress(states, total=passes, desc="passes"):
        # pass 1 has no previous state to change from: None (null in JSON), not NaN (not JSON)
        changes.append(None if h is None else float(RelativeChange(0.0).value(h_next, h).mean()))
        losses.append(float(token_cross_entropy(model.readout(h_next), y)))
        h = h_next
    T = x.shape[1]  # the Jacobi iteration is exact after T passes: the sequential fixed point
    return {"passes": passes, "tokens": int(x.numel()), "relative_change": changes,
            "sequence_len": T, "loss_fixed_point": losses[T - 1] if passes >= T else None,
            "passes_curve": {f"K={k}": losses[k - 1] for k in MARKED_PASSES if k <= passes},
            "loss": losses, "final_relative_change": changes[-1], "loss_pass1": losses[0],
            "loss_best": min(losses), "loss_final": losses[-1],
            "stable": bool(math.isfinite(losses[-1]) and losses[-1] < losses[0] + 0.5)}


def _plot_contraction(plt, r):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.semilogy(range(2, len(r["relative_change"]) + 1), r["relative_change"][1:])  # pass 1's is None
    a.set_xscale("log")
    a.set(xlabel="pass k", ylabel="mean ||H_k - H_k-1|| / ||H_k||", title="contraction")
    b.plot(range(1, len(r["loss"]) + 1), r["loss"])
    curve = [k for k in MARKED_PASSES if k <= len(r["loss"])]
    b.scatter(curve, [r["loss"][k - 1] for k in curve], color="tab:red", zorder=3, label="K = 1, 2, 3, 4, 8, 16")
    if r.get("loss_fixed_point") is not None:
        b.axhline(r["loss_fixed_point"], color="gray", ls="--", label=f"fixed point (K = T = {r['sequence_len']})")
    b.set_xscale("log")
    b.set(xlabel="pass k", ylabel="loss (nats/token)", title="loss per pass (the paper's stability check)")
    b.legend()
    for axis in (a, b):
        axis.grid(alpha=0.3)
    return fig


def _contraction_line(r) -> str:
    change = r["final_relative_change"]
    change = "– (one pass)" if change is None else f"{change:.2e}"
    return (f"passes {r['passes']}: final relative change {change}, "
            f"loss pass 1 {r['loss_pass1']:.4f}, best {r['loss_best']:.4f}, final {r['loss_final']:.4f}")


CONTRACTION = Analysis(
    help="iterate the multi-pass map; relative change and loss per pass", run=contraction,
    summary=_contraction_line, plot=_plot_contraction, batches=1, batch_size=4,
    options=(AnalysisOption("passes", int, 1000, "passes to iterate", minimum=1, maximum=MAX_PASSES),))


# -- probe -----------------------------------------------------------------------------------------------


def bracket_depth_labels(tokenizer, x: torch.Tensor) -> torch.Tensor:
    """Nesting depth of ( [ { after each token of each row (clipped to PROBE_CLASSES - 1)."""
    deltas = {}
    labels = torch.zeros_like(x)
    for row in range(x.shape[0]):
        depth = 0
        for col, token in enumerate(x[row].tolist()):
            if token not in deltas:
                text = tokenizer.decode([token])
                deltas[token] = sum(text.count(c) for c in OPENERS) - sum(text.count(c) for c in CLOSERS)
            depth = 0 if token == tokenizer.bos_id else max(0, depth + deltas[token])
            labels[row, col] = min(depth, PROBE_CLASSES - 1)
    return labels


def fit_linear_probe(features: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, seed: int = 0
                     ) -> dict[str, float]:
    """Multinomial logistic regression fit on some rows, scored on the others (`rows`: each position's
    row); returns train/test accuracy. Split by row, not position: nesting depth holds over runs of
    adjacent tokens, so positions split at random put each test position's neighbours, with its label,
    in the fit (features constant over 8 positions and blind to the text scored 0.997)."""
    generator = torch.Generator().manual_seed(seed)
    kinds = rows.unique()
    if len(kinds) < 2:
        raise ConfigError("a probe needs at least two rows: one to fit on, one to score")
    shuffled = kinds[torch.randperm(len(kinds), generator=generator)]
    cut = min(max(1, int(PROBE_TRAIN_FRACTION * len(kinds))), len(kinds) - 1)
    in_fit = torch.isin(rows, shuffled[:cut])
    train, test = in_fit.nonzero().squeeze(1), (~in_fit).nonzero().squeeze(1)
    mean, std = features[train].mean(0), features[train].std(0).clamp_min(1e-6)
    z = (features - mean) / std
    weight = torch.zeros(z.shape[1], PROBE_CLASSES, requires_grad=True)
    bias = torch.zeros(PROBE_CLASSES, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=PROBE_ITERATIONS, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(z[train] @ weight + bias, labels[train]) + PROBE_L2 * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        predictions = (z @ weight + bias).argmax(-1)
    majority = float((labels[test] == labels[train].mode().values).float().mean())
    return {"train_accuracy": float((predictions[train] == labels[train]).float().mean()),
            "test_accuracy": float((predictions[test] == labels[test]).float().mean()),
            "majority_baseline": majority}


@torch.no_grad()
def probe(model, x: torch.Tensor, y: torch.Tensor, context, passes: int = 4) -> dict[str, Any]:
    labels = bracket_depth_labels(context.tokenizer, x).flatten()
    rows = torch.arange(x.shape[0]).repeat_interleave(x.shape[1])  # (B * T,): each position's row
    captured: dict[str, torch.Tensor] = {}
    hook = model.blocks[0].register_forward_hook(
        lambda module, inputs, output: captured.update(block0_in=inputs[0], block0_out=output))
    try:
        results: dict[str, Any] = {}
        for name, k in (("standard", 1), ("recurrent", passes)):
            model(x, passes=k)  # the hook keeps the last pass's layer-0 activations
            for where in ("block0_in", "block0_out"):
                features = captured[where].reshape(-1, captured[where].shape[-1]).float()
                results[f"{name}/{where}"] = fit_linear_probe(features, labels, rows)
    finally:
        hook.remove()
    return {"label": "bracket nesting depth (0..4+)", "recurrent_passes": passes,
            "positions": int(labels.numel()),
            "label_distribution": torch.bincount(labels, minlength=PROBE_CLASSES).tolist(), "probes": results}


def _plot_probe(plt, r):
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(r["probes"])
    ax.bar(range(len(names)), [r["probes"][n]["test_accuracy"] for n in names])
    ax.axhline(next(iter(r["probes"].values()))["majority_baseline"], color="gray", ls="--", label="majority")
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set(ylabel="test accuracy", title="linear probe: nesting depth from layer 0")
    ax.legend()
    return fig


def _probe_line(r) -> str:
    line = "; ".join(f"{name} {p['test_accuracy']:.3f}" for name, p in r["probes"].items())
    return (f"{r['label']} from layer 0, held-out probe accuracy: {line} "
            f"(majority {next(iter(r['probes'].values()))['majority_baseline']:.3f})")


PROBE = Analysis(
    help="linear probes of nesting depth from layer 0, standard vs recurrent", run=probe, summary=_probe_line,
    plot=_plot_probe, batches=4, batch_size=8,
    options=(AnalysisOption("passes", int, 4, "passes of the recurrent prefill", minimum=1, maximum=MAX_PASSES),))

ANALYSES = {"contraction": CONTRACTION, "probe": PROBE}
