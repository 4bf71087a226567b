"""Validation loss, perplexity and bits per byte.

BPB = (summed nats over the target tokens) / ln 2 / (UTF-8 bytes of those targets). Special tokens
(BOS/EOS/PAD, which stand for zero bytes) are excluded from both sums, so the number compares
across tokenizers. Loss and perplexity are per token, over all targets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial

import numpy as np
import torch
from torch import Tensor, nn

from ..data import eval_batches
from ..engine import model_options, teacher_forced_logits
from ..objectives import token_cross_entropy

LogitsFn = Callable[[nn.Module, Tensor], Tensor]  # (model, x (B, T)) -> logits (B, T, V)

def plain_logits(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).logits


@torch.no_grad()
def evaluate_loss(model: nn.Module, tokens: np.ndarray, token_bytes: np.ndarray, batch_size: int, seq_len: int,
                  max_batches: int | None = None, logits_fn: LogitsFn = plain_logits,
                  device: torch.device | str | None = None) -> dict[str, float]:
    return evaluate_batches(model, eval_batches(tokens, batch_size, seq_len, max_batches), token_bytes, logits_fn,
                            device)


@torch.no_grad()
def evaluate_batches(model: nn.Module, batches: Iterable[tuple], token_bytes: np.ndarray,
                     logits_fn: LogitsFn = plain_logits, device: torch.device | str | None = None) -> dict[str, float]:
    """Loss / perplexity / BPB over batches (x, y) or (x, y, loss_mask): with a mask only the
    targets it marks are counted (SFT's assistant tokens)."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    byte_table = torch.as_tensor(np.asarray(token_bytes), dtype=torch.long, device=device)
    nats = nats_bpb = 0.0
    n_tokens = n_bytes = 0
    try:
        for x, y, *rest in batches:
            x, y = x.to(device), y.to(device)
            counted = rest[0].to(device).flatten() if rest else torch.ones(y.numel(), dtype=torch.bool, device=device)
            losses = token_cross_entropy(logits_fn(model, x), y, reduction="none") * counted  # (B*T,)
            target_bytes = byte_table[y.flatten()] * counted
            nats += float(losses.sum())
            n_tokens += int(counted.sum())
            nats_bpb += float((losses * (target_bytes > 0)).sum())
            n_bytes += int(target_bytes.sum())
    finally:
        model.train(was_training)
    if n_tokens == 0:
        return {"loss": float("nan"), "ppl": float("nan"), "bpb": float("nan"), "tokens": 0}
    loss = nats / n_tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "bpb": nats_bpb / math.log(2) / max(n_bytes, 1),
            "tokens": n_tokens}


@torch.no_grad()
def loss_by_position(model: nn.Module, tokens: np.ndarray, batch_size: int, seq_len: int, buckets: int = 8,
                     max_batches: int | None = None, logits_fn: LogitsFn = plain_logits) -> list[dict]:
    """Mean loss of the targets at each position bucket of the context: `buckets` equal ranges of
    [0, seq_len). Whether a model uses a long context shows as loss that keeps falling with the
    position (more context, better predictions) instead of flattening or rising past the length
    it was trained at. Returns [{"start", "end", "loss", "tokens"}] per bucket."""
    buckets = max(1, min(buckets, seq_len))
    edges = [round(i * seq_len / buckets) for i in range(buckets + 1)]
    sums = torch.zeros(seq_len, dtype=torch.float64)
    count = 0
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for x, y in eval_batches(tokens, batch_size, seq_len, max_batches):
            x, y = x.to(device), y.to(device)
            losses = token_cross_entropy(logits_fn(model, x), y, reduction="none").view(y.shape)  # (B, T)
            sums += losses.double().sum(dim=0).cpu()
            count += y.shape[0]
    finally:
        model.train(was_training)
    return [{"start": a, "end": b, "loss": float(sums[a:b].sum() / max(count * (b - a), 1)), "tokens": count * (b - a)}
            for a, b in zip(edges[:-1], edges[1:])]


def decoding_logits(options: dict | None = None) -> LogitsFn:
    """Logits as the architecture decodes under `options` (regime, passes, prefill, steps, ...):
    the engine's teacher-forced scoring path, checked once here."""
    options = dict(options or {})

    def logits_fn(m: nn.Module, x: Tensor) -> Tensor:
        return teacher_forced_logits(m, x, **options)

    return logits_fn


def text_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None,
                 spread: bool = False) -> Callable[[], Iterable[tuple]]:
    """`score_run`'s batches of a token stream: a new pass over the same validation batches per call
    (`spread`: windows spaced over the whole split, see `eval_batches`)."""
    return partial(eval_batches, tokens, batch_size, seq_len, max_batches, spread)


def score_run(model: nn.Module, batches: Callable[[], Iterable[tuple]], token_bytes: np.ndarray,
              choices: dict[str, dict] | None = None) -> dict[str, dict[str, float]]:
    """Loss / perplexity / BPB of `model` under each way of scoring it, {label: scores}, in the order
    of `choices` ({label: architecture options}; None: the model's own `scoring_modes`, e.g. fbt's
    regimes, lrt's prefills, rgpt's depths), each through the engine's teacher-forced path.
    `batches()` starts a new pass over the same batches ((x, y), or (x, y, loss_mask) for
    conversations) for each choice. Every choice is checked before the first batch. The one scoring
    of a run that `eval`, the demo and the CPU comparison share."""
    if choices is None:
        choices = model.scoring_modes(model.config)
    for options in choices.values():
        model_options(model, options)  # a bad option fails before any batch
    return {label: evaluate_batches(model, batches(), token_bytes, decoding_logits(options))
            for label, options in choices.items()}


# The paper's stability check (its loss-vs-passes figure): the K-pass fused forward's loss for
# these K, and at the sequential fixed point (K = T passes: the Jacobi iteration is exact there).
PASSES_CURVE = (1, 2, 3, 4, 8, 16)


@torch.no_grad()
def passes_curve(model: nn.Module, tokens: np.ndarray, token_bytes: np.ndarray, batch_size: int, seq_len: int,
                 max_batches: int | None = None, passes: tuple[int, ...] = PASSES_CURVE,
                 device: torch.device | str | None = None) -> dict[str, dict[str, float]]:
    """fbt: loss/BPB of `model(x, passes=K)` (the fused forward over the whole text) for each K in
    `passes` and at "fixed_point" (K = the batch's length T, exact). One iteration per batch serves
    every K: the states of pass k are pass k's whatever the later passes do."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    byte_table = torch.as_tensor(np.asarray(token_bytes), dtype=torch.long, device=device)
    sums: dict[str, list[float]] = {}
    try:
        for x, y in eval_batches(tokens, batch_size, seq_len, max_batches):
            x, y = x.to(device), y.to(device)
            T = x.shape[1]
            wanted = {f"K={k}": k for k in passes} | {"fixed_point": T}
            target_bytes = byte_table[y.flatten()]
            states = model.pass_states(x, model.context(x, None, None))  # one pass in memory at a time
            for k, (h, _) in zip(range(1, max(wanted.values()) + 1), states):
                for label in [label for label, want in wanted.items() if want == k]:
                    losses = token_cross_entropy(model.readout(h), y, reduction="none")
                    row = sums.setdefault(label, [0.0, 0.0, 0, 0])
                    row[0] += float(losses.sum())
                    row[1] += float((losses * (target_bytes > 0)).sum())
                    row[2] += y.numel()
                    row[3] += int(target_bytes.sum())
    finally:
        model.train(was_training)
    return {label: {"loss": nats / max(n, 1), "bpb": nats_bpb / math.log(2) / max(nb, 1), "tokens": n}
            for label, (nats, nats_bpb, n, nb) in sums.items()}
