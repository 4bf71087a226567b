"""Helpers shared by the benchmark scripts (`bench_baseline.py`, `bench_variants.py`).

Only what the scripts would otherwise duplicate lives here: the Markdown table renderer, the
CPU-contention notices, and one full optimizer step of the trainer (objective, backward, clip,
step). The CPU-busy measurement itself (`ContentionMeter`, `environment`) stays in
`bench_baseline.py`, which the other scripts import.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch


def render_table(rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table whose first row is the header; columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def announce_environment(env: dict[str, Any]) -> None:
    """Print the one-line environment summary, and a warning when the CPUs were busy before the start."""
    busy = env["cpu_busy_before"]
    print(f"torch {env['torch']}, {env['threads']} threads ({env['interop_threads']} inter-op), "
          f"{env['cpu_count']} CPUs ({'?' if busy is None else f'{busy:.0%}'} busy before start), "
          f"{env['platform']}", flush=True)
    if busy is not None and busy > 0.2:
        print(f"warning: the CPUs were {busy:.0%} busy just before the run: other processes compete for the "
              f"{env['cpu_count']} cores and the numbers will be low (noisy neighbours can slow torch's "
              "OpenMP threads several-fold)", flush=True)


def write_results(results: dict[str, Any], others: float | None, json_path) -> None:
    """Warn if other processes were busy, and write the results as JSON when asked."""
    warn_contention(others)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {json_path}")


def warn_contention(others: float | None) -> None:
    """Warn when other processes used a noticeable share of the CPUs during the run."""
    if others is not None and others > 0.1:
        print("warning: other processes competed for the CPUs during the run; these numbers understate the "
              "speed, rerun on an idle machine")


def make_train_step(model: torch.nn.Module, objective: Callable, x: torch.Tensor, y: torch.Tensor,
                    optimizers: Sequence[torch.optim.Optimizer], grad_clip: float) -> Callable[[int], float]:
    """One full optimizer step as `latentloop.train.fit` takes it (without data loading): the objective's
    loss, backward, grad-norm clip, every optimizer's step and zero_grad. Returns the loss as a float,
    which synchronises, as the trainer's loss logging does."""

    def step(i: int) -> float:
        result = objective(model, x, y, i)
        result.loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(result.loss.detach())

    return step
