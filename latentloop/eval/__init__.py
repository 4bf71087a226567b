"""Evaluation: loss / perplexity / bits per byte (`loss`), CORE in-context learning (`core`),
generation tasks (`generation`, run in the `sandbox` where code executes), the suite that
dispatches task names and saves results (`suite`), run comparison (`compare`) and the
lm-evaluation-harness adapter (`lm_eval_adapter`, optional)."""

from .compare import compare_runs
from .core import run_core
from .loss import evaluate_loss, score_run, text_batches
from .suite import run_tasks

__all__ = ["compare_runs", "evaluate_loss", "run_core", "run_tasks", "score_run", "text_batches"]
