"""Evaluation: loss / perplexity / bits per byte (`loss`), and the task suites built on top."""

from .loss import evaluate_loss, evaluate_run

__all__ = ["evaluate_loss", "evaluate_run"]
