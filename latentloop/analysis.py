"""`latentloop analyze ...`: looking inside trained runs.

- contraction (fbt): iterate the multi-pass map H_k = F(shift(H_{k-1})) far past training's 3 passes
  on validation data; the mean relative change ||H_k - H_{k-1}|| / ||H_k|| and the loss per pass
  show whether the learned map is contractive (the paper reports stability out to k = 1000 only
  with the 3% deeper batches).
- probe (fbt): linear probes from layer-0 activations for a global-state label (by default the
  bracket nesting depth of code), under a standard prefill vs a recurrent (multi-pass) prefill;
  latent feedback should expose global state to the shallowest layer.
- depth (rgpt): the early-exit curve (validation loss at r = 1..R), the mean gate per step, and how
  the depth an adaptive exit would pick correlates with each token's loss.

Each writes `RUN/analysis/<name>.json` and, with matplotlib, `<name>.png`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .data import eval_batches
from .errors import ConfigError, OutputError
from .eval.loss import PASSES_CURVE
from .models.criteria import KLDivergence, RelativeChange
from .objectives import token_cross_entropy
from .runtime import load_run, output_folder, prepare_data
from .util import progress

PROBE_CLASSES = 5  # nesting depth 0..3, and 4 for "4 or deeper"
PROBE_TRAIN_FRACTION = 0.7
PROBE_L2 = 1e-3
PROBE_ITERATIONS = 200
OPENERS, CLOSERS = "([{", ")]}"


def _val_batch(run: str | Path, batches: int, batch_size: int):

    model, tokenizer, config, checkpoint = load_run(run)
    data = prepare_data(config, tokenizer, progress=False)
    pairs = list(eval_batches(data.val, batch_size, config.model.sequence_len, batches))
    x = torch.cat([p[0] for p in pairs])
    y = torch.cat([p[1] for p in pairs])
    return model, tokenizer, config, checkpoint, x, y


def _require_analysis(config, what: str) -> None:
    """The run's arch offers `what` (its model's ANALYSES), or one line naming the archs that do."""
    from .archs import get_arch, offering

    if what not in get_arch(config.model.arch).analyses:
        raise ConfigError(f"analyze {what} needs a run of {' or '.join(offering(what))}; "
                          f"this one is {config.model.arch}")


def _save(checkpoint: Path, out: Path | None, name: str, result: dict[str, Any], plot) -> Path:
    folder = output_folder(Path(out) if out else checkpoint.parent.parent / "analysis", "analysis folder")
    try:
        (folder / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    except OSError as exc:
        raise OutputError(f"cannot write {folder / f'{name}.json'}: {exc.strerror or exc}") from None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return folder
    fig = plot(plt, result)
    fig.tight_layout()
    try:
        fig.savefig(folder / f"{name}.png", dpi=120)
    except OSError as exc:
        raise OutputError(f"cannot write {folder / f'{name}.png'}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return folder


# --------------------------------------------------------------------------------------------
# contraction
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def contraction(run: str | Path, passes: int = 1000, batches: int = 1, batch_size: int = 4,
                out: Path | None = None, show_progress: bool = False) -> dict[str, Any]:
    model, _, config, checkpoint, x, y = _val_batch(run, batches, batch_size)
    _require_analysis(config, "contraction")
    changes, losses, h = [], [], None
    states = zip(range(passes), model.pass_states(x, model.context(x, None, None)))
    for _, (h_next, _) in progress(states, total=passes, desc="passes", enabled=show_progress):
        changes.append(float("nan") if h is None else float(RelativeChange(0.0).value(h_next, h).mean()))
        losses.append(float(token_cross_entropy(model.readout(h_next), y)))
        h = h_next
    T = x.shape[1]  # the Jacobi iteration is exact after T passes: the sequential fixed point
    result = {"run": str(run), "passes": passes, "tokens": int(x.numel()), "relative_change": changes,
              "sequence_len": T, "loss_fixed_point": losses[T - 1] if passes >= T else None,
              "passes_curve": {f"K={k}": losses[k - 1] for k in PASSES_CURVE if k <= passes},
              "loss": losses, "final_relative_change": changes[-1], "loss_pass1": losses[0],
              "loss_best": min(losses), "loss_final": losses[-1], "stable": bool(math.isfinite(losses[-1])
                                                                                 and losses[-1] < losses[0] + 0.5)}

    def plot(plt, r):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.semilogy(range(2, len(r["relative_change"]) + 1), r["relative_change"][1:])
        a.set_xscale("log")
        a.set(xlabel="pass k", ylabel="mean ||H_k - H_k-1|| / ||H_k||", title="contraction")
        b.plot(range(1, len(r["loss"]) + 1), r["loss"])
        curve = [k for k in PASSES_CURVE if k <= len(r["loss"])]
        b.scatter(curve, [r["loss"][k - 1] for k in curve], color="tab:red", zorder=3, label="K = 1, 2, 3, 4, 8, 16")
        if r.get("loss_fixed_point") is not None:
            b.axhline(r["loss_fixed_point"], color="gray", ls="--", label=f"fixed point (K = T = {r['sequence_len']})")
        b.set_xscale("log")
        b.set(xlabel="pass k", ylabel="loss (nats/token)", title="loss per pass (the paper's stability check)")
        b.legend()
        for axis in (a, b):
            axis.grid(alpha=0.3)
        return fig

    result["folder"] = str(_save(checkpoint, out, "contraction", result, plot))
    return result


# --------------------------------------------------------------------------------------------
# probe
# --------------------------------------------------------------------------------------------


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


def fit_linear_probe(features: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> dict[str, float]:
    """Multinomial logistic regression on a random split; returns train/test accuracy."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=generator)
    cut = int(PROBE_TRAIN_FRACTION * len(labels))
    train, test = order[:cut], order[cut:]
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
def probe(run: str | Path, passes: int = 4, batches: int = 4, batch_size: int = 8,
          out: Path | None = None) -> dict[str, Any]:
    model, tokenizer, config, checkpoint, x, _ = _val_batch(run, batches, batch_size)
    _require_analysis(config, "probe")
    labels = bracket_depth_labels(tokenizer, x).flatten()
    captured: dict[str, torch.Tensor] = {}
    hook = model.blocks[0].register_forward_hook(
        lambda module, inputs, output: captured.update(block0_in=inputs[0], block0_out=output))
    try:
        results: dict[str, Any] = {}
        for name, k in (("standard", 1), ("recurrent", passes)):
            model(x, passes=k)  # the hook keeps the last pass's layer-0 activations
            for where in ("block0_in", "block0_out"):
                features = captured[where].reshape(-1, captured[where].shape[-1]).float()
                results[f"{name}/{where}"] = fit_linear_probe(features, labels)
    finally:
        hook.remove()
    result = {"run": str(run), "label": "bracket nesting depth (0..4+)", "recurrent_passes": passes,
              "positions": int(labels.numel()), "label_distribution": torch.bincount(
                  labels, minlength=PROBE_CLASSES).tolist(), "probes": results}

    def plot(plt, r):
        fig, ax = plt.subplots(figsize=(6, 4))
        names = list(r["probes"])
        ax.bar(range(len(names)), [r["probes"][n]["test_accuracy"] for n in names])
        ax.axhline(next(iter(r["probes"].values()))["majority_baseline"], color="gray", ls="--", label="majority")
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set(ylabel="test accuracy", title="linear probe: nesting depth from layer 0")
        ax.legend()
        return fig

    result["folder"] = str(_save(checkpoint, out, "probe", result, plot))
    return result


# --------------------------------------------------------------------------------------------
# depth (rgpt)
# --------------------------------------------------------------------------------------------


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ranks_a, ranks_b = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if ranks_a.std() == 0 or ranks_b.std() == 0:
        return float("nan")
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1])


@torch.no_grad()
def depth(run: str | Path, max_steps: int | None = None, batches: int = 2, batch_size: int = 8,
          exit_threshold: float = 0.01, min_steps: int = 1, task_limit: int = 50,
          out: Path | None = None, show_progress: bool = False) -> dict[str, Any]:
    """Also the task accuracy per depth when the run was trained on a built-in task (`task:NAME`),
    on `task_limit` examples of its (harder) test split."""
    model, tokenizer, config, checkpoint, x, y = _val_batch(run, batches, batch_size)
    _require_analysis(config, "depth")
    trained = config.model.recurrence_steps
    R = max_steps or trained
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
    result = {"run": str(run), "trained_steps": trained, "steps": list(range(1, R + 1)), "loss": losses,
              "loss_at_half_depth": losses[max(0, R // 2 - 1)],
              "gate_mean_per_step": [float(v) for v in out_all.gate_means],
              "openness_per_step": [float(v) for v in out_all.openness],
              "exit_threshold": exit_threshold, "mean_exit_depth": float(exit_flat.mean()),
              "exit_depth_histogram": np.bincount(exit_flat, minlength=R + 1)[1:].tolist(),
              "spearman_exit_depth_vs_token_loss": spearman(exit_flat, token_loss)}
    if config.data.source.startswith("task:"):
        from .eval.generation import run_generation_tasks

        task = config.data.source
        result["task"] = task
        result["task_accuracy"] = [run_generation_tasks(model, tokenizer, [task], options={"steps": r},
                                                        limit=task_limit, progress=False)[task]["accuracy"]
                                   for r in progress(result["steps"], desc="task accuracy per depth",
                                                     enabled=show_progress)]

    def plot(plt, r):
        fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
        a.plot(r["steps"], r["loss"], marker="o", label="val loss")
        a.axvline(r["trained_steps"], color="gray", ls="--", label="trained R")
        a.set(xlabel="recurrence steps r", ylabel="val loss", title="early-exit curve")
        if "task_accuracy" in r:
            twin = a.twinx()
            twin.plot(r["steps"], r["task_accuracy"], marker="s", color="tab:red", label="task accuracy")
            twin.set_ylabel("task accuracy")
        a.legend()
        b.plot(r["steps"], r["gate_mean_per_step"], marker="o", label="mean gate g (1 = copy)")
        b.plot(r["steps"], r["openness_per_step"], marker="s", label="effective openness ||Δh|| / ||o||")
        b.set(xlabel="step", ylabel="value", title="gate and openness per step")
        b.legend()
        c.bar(r["steps"], r["exit_depth_histogram"])
        c.set(xlabel="adaptive exit depth", ylabel="tokens",
              title=f"exit depth (Spearman vs loss {r['spearman_exit_depth_vs_token_loss']:.2f})")
        for axis in (a, b, c):
            axis.grid(alpha=0.3)
        return fig

    result["folder"] = str(_save(checkpoint, out, "depth", result, plot))
    return result
