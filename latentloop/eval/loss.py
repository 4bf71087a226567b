"""Validation loss, perplexity and bits per byte.

BPB = (summed nats over the target tokens) / ln 2 / (UTF-8 bytes of those targets). Special tokens
(BOS/EOS/PAD, which stand for zero bytes) are excluded from both sums, so the number compares
across tokenizers. Loss and perplexity are per token, over all targets.

Intervals over documents: batches that also say which document each target belongs to
(`text_batches(..., bos_id=...)`: documents are delimited by BOS in the token stream, and a window
spanning two documents splits its targets between them; `row_documents` for packed conversations)
make `evaluate_batches` keep per-document sums, from which `score_run` reports a bootstrap 95%
interval of the loss and of BPB over documents (`eval.stats.bootstrap_ratio`: 1000 resamples, a
fixed seed), given at least MIN_INTERVAL_DOCUMENTS documents (fewer: no interval, and a line
saying why). The point figures are the same sums either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial

import numpy as np
import torch
from torch import Tensor, nn

from ..data import eval_batches
from ..data.loader import eval_window_ids
from ..engine import model_options, teacher_forced_logits, written_inputs
from ..objectives import token_cross_entropy
from ..runtime import to_device_async
from ..util import evaluating, progress
from .stats import BOOTSTRAP_RESAMPLES, CONFIDENCE, bootstrap_ratio

# (model, x (B, T), written (B, T) or None: the inputs the model wrote, a conversation's replies) -> (B, T, V)
LogitsFn = Callable[[nn.Module, Tensor, Tensor | None], Tensor]


def plain_logits(model: nn.Module, x: Tensor, written: Tensor | None = None) -> Tensor:
    """The plain forward (every input read alike: `written` changes nothing)."""
    return model(x).logits


@torch.no_grad()
def evaluate_loss(model: nn.Module, tokens: np.ndarray, token_bytes: np.ndarray, batch_size: int, seq_len: int,
                  max_batches: int | None = None, logits_fn: LogitsFn = plain_logits,
                  device: torch.device | str | None = None) -> dict[str, float]:
    return evaluate_batches(model, eval_batches(tokens, batch_size, seq_len, max_batches), token_bytes, logits_fn,
                            device)


# The per-document sums evaluate_batches keeps, one column each: nats over every counted target,
# nats over the targets that stand for bytes (BPB's numerator), counted targets, bytes.
DOCUMENT_SUMS = ("nats", "nats_bpb", "tokens", "bytes")


@torch.no_grad()
def evaluate_batches(model: nn.Module, batches: Iterable[tuple], token_bytes: np.ndarray,
                     logits_fn: LogitsFn = plain_logits, device: torch.device | str | None = None,
                     across_processes: bool = False) -> dict:
    """Loss / perplexity / BPB over batches (x, y), (x, y, loss_mask) or (x, y, loss_mask | None,
    documents): with a mask only the targets it marks are counted (SFT's assistant tokens); with
    `documents` ((B, T) int64, the document of each target) the result also holds "per_document":
    {"nats", "nats_bpb", "tokens", "bytes"}, float64 arrays of the sums per document (in document
    order; documents without a counted target left out), whose totals are the figures' own.

    The sums stay on the device in float64 and are read once, at the end (a read per batch would
    stall an accelerator's queue at every batch); MPS, which has no float64, hands each batch's sums
    to the host (float32 totals would miscount past 2^24 tokens). `across_processes`: each process
    was given its own share of the batches (`train.loop.process_share`), and the sums are added over
    the default process group before the figures."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    byte_table = torch.as_tensor(np.asarray(token_bytes), dtype=torch.long, device=device)
    on_host = device.type == "mps"  # MPS has no float64
    totals = torch.zeros(len(DOCUMENT_SUMS), dtype=torch.float64, device="cpu" if on_host else device)
    pieces: list[tuple[np.ndarray, np.ndarray]] = []  # per batch: (its documents, their sums (D, 4))
    keep_documents = False
    with evaluating(model):
        for x, y, *rest in batches:
            x, y = to_device_async(x, device), to_device_async(y, device)  # queued, not a stall per batch
            mask = None if not rest or rest[0] is None else to_device_async(rest[0], device)
            counted = mask.flatten() if mask is not None else torch.ones(y.numel(), dtype=torch.bool, device=device)
            # conversations: the replies are the model's own, read as a chat reads its history (fbt fuses them)
            written = None if mask is None else written_inputs(mask)
            losses = token_cross_entropy(logits_fn(model, x, written), y, reduction="none") * counted  # (B*T,)
            target_bytes = byte_table[y.flatten()] * counted
            byte_losses = losses * (target_bytes > 0)
            columns = (losses, byte_losses, counted, target_bytes)  # DOCUMENT_SUMS' order
            if on_host:
                totals += torch.stack([c.sum(dtype=torch.float32) for c in columns]).cpu().double()
            else:
                totals += torch.stack([c.sum(dtype=torch.float64) for c in columns])
            if len(rest) > 1:
                keep_documents = True
                sums = torch.stack([c.double() for c in columns], dim=1).cpu()  # (B*T, 4)
                documents, where = torch.unique(rest[1].flatten().cpu(), return_inverse=True)
                pieces.append((documents.numpy(), torch.zeros(len(documents), 4, dtype=torch.float64)
                               .index_add_(0, where, sums).numpy()))
    if across_processes:
        if keep_documents:
            raise ValueError("per-document sums are one process's: evaluate documents in one process")
        torch.distributed.all_reduce(totals)
    nats, nats_bpb, n_tokens, n_bytes = totals.tolist()
    n_tokens, n_bytes = round(n_tokens), round(n_bytes)
    if n_tokens == 0:
        result = {"loss": float("nan"), "ppl": float("nan"), "bpb": float("nan"), "tokens": 0}
    else:
        loss = nats / n_tokens
        result = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "bpb": nats_bpb / math.log(2) / max(n_bytes, 1),
                  "tokens": n_tokens}
    if keep_documents:
        result["per_document"] = _merge_documents(pieces)
    return result


def _merge_documents(pieces: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """One row of sums per document from the batches' rows (a document spans several windows)."""
    if not pieces:
        return {name: np.zeros(0) for name in DOCUMENT_SUMS}
    documents = np.concatenate([d for d, _ in pieces])
    sums = np.concatenate([s for _, s in pieces])
    _, where = np.unique(documents, return_inverse=True)
    merged = np.zeros((int(where.max()) + 1, len(DOCUMENT_SUMS)))
    np.add.at(merged, where.ravel(), sums)
    merged = merged[merged[:, DOCUMENT_SUMS.index("tokens")] > 0]  # a document none of whose targets counted
    return {name: merged[:, i] for i, name in enumerate(DOCUMENT_SUMS)}


# The fewest documents a bootstrap interval over documents is reported for. The percentile bootstrap
# of a ratio under-covers with few units: simulated (per-document loss N(2, 0.3), 200-2000 tokens
# each, 600-1000 trials), its nominal 95% interval covers 0.51 at 2 documents, 0.71 at 3, 0.85 at
# 5-8, 0.87-0.89 at 10, and 0.90-0.93 from 15 to 30; below this count it would overstate its level.
MIN_INTERVAL_DOCUMENTS = 20


def document_intervals(per_document: dict[str, np.ndarray], resamples: int = BOOTSTRAP_RESAMPLES) -> dict:
    """The bootstrap intervals over documents of the loss and BPB whose per-document sums these are:
    {"documents", "loss_ci", "bpb_ci", "interval"}. With fewer than MIN_INTERVAL_DOCUMENTS documents
    both intervals are None and "interval" says why ("3 documents: too few for an interval ...")."""
    documents = int(len(per_document["tokens"]))
    if documents < MIN_INTERVAL_DOCUMENTS:
        return {"documents": documents, "loss_ci": None, "bpb_ci": None,
                "interval": f"{documents} document{'s' if documents != 1 else ''}: too few for an interval "
                            f"(a {CONFIDENCE:.0%} bootstrap over documents needs at least {MIN_INTERVAL_DOCUMENTS})"}
    loss_ci = bootstrap_ratio(per_document["nats"], per_document["tokens"], resamples=resamples)
    bpb_ci = bootstrap_ratio(per_document["nats_bpb"] / math.log(2), per_document["bytes"], resamples=resamples)
    return {"documents": documents,
            "loss_ci": None if loss_ci is None else list(loss_ci), "bpb_ci": None if bpb_ci is None else list(bpb_ci),
            "interval": f"{CONFIDENCE:.0%} bootstrap over documents, {resamples} resamples"}


@torch.no_grad()
def position_edges(seq_len: int, buckets: int) -> list[int]:
    """`buckets` equal ranges of [0, seq_len) as their edges."""
    buckets = max(1, min(buckets, seq_len))
    return [round(i * seq_len / buckets) for i in range(buckets + 1)]


@torch.no_grad()
def loss_by_position(model: nn.Module, tokens: np.ndarray, batch_size: int, seq_len: int, buckets: int = 8,
                     max_batches: int | None = None, logits_fn: LogitsFn = plain_logits,
                     edges: list[int] | None = None, window: int | None = None) -> list[dict]:
    """Mean loss of the targets at each position bucket of the context: `buckets` equal ranges of
    [0, seq_len), or the ranges between `edges` (those within seq_len: another model's buckets,
    to compare the two). Whether a model uses a long context shows as loss that keeps falling with
    the position (more context, better predictions) instead of flattening or rising past the length
    it was trained at. `window` (>= seq_len): read the text in windows of that many tokens, another
    model's longer context, and score the first seq_len positions of each, so that the two models
    are scored on the same text at the same positions (with `max_batches` too, which would
    otherwise take the shorter model's windows over less of the text). Returns [{"start", "end",
    "loss", "tokens"}] per bucket."""
    if edges is None:
        edges = position_edges(seq_len, buckets)
    else:
        edges = [e for e in edges if e < seq_len] + [seq_len]
    sums = torch.zeros(seq_len, dtype=torch.float64)
    count = 0
    device = next(model.parameters()).device
    with evaluating(model):
        for x, y in eval_batches(tokens, batch_size, max(window or seq_len, seq_len), max_batches):
            x, y = x[:, :seq_len].to(device), y[:, :seq_len].to(device)  # (B, seq_len)
            losses = token_cross_entropy(logits_fn(model, x), y, reduction="none").view(y.shape)  # (B, T)
            sums += losses.double().sum(dim=0).cpu()
            count += y.shape[0]
    return [{"start": a, "end": b, "loss": float(sums[a:b].sum() / max(count * (b - a), 1)), "tokens": count * (b - a)}
            for a, b in zip(edges[:-1], edges[1:])]


def decoding_logits(options: dict | None = None) -> LogitsFn:
    """Logits as the architecture decodes under `options` (regime, passes, prefill, steps, ...):
    the engine's teacher-forced scoring path, checked once here."""
    options = dict(options or {})

    def logits_fn(m: nn.Module, x: Tensor, written: Tensor | None = None) -> Tensor:
        return teacher_forced_logits(m, x, written=written, **options)

    return logits_fn


def text_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None,
                 spread: bool = False, bos_id: int | None = None) -> Callable[[], Iterable[tuple]]:
    """`score_run`'s batches of a token stream: a new pass over the same validation batches per call
    (`spread`: windows spaced over the whole split, see `eval_batches`). With `bos_id` each batch is
    (x, y, None, documents): the document of each target, documents starting at each BOS of the
    stream (a BOS target opens its document; targets before the first BOS are document 0), so
    `score_run` reports intervals over documents."""
    if bos_id is None:
        return partial(eval_batches, tokens, batch_size, seq_len, max_batches, spread)
    return partial(_document_batches, tokens, batch_size, seq_len, max_batches, spread, bos_id)


def _document_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None, spread: bool,
                      bos_id: int) -> Iterable[tuple]:
    windows = eval_window_ids(tokens, batch_size, seq_len, max_batches, spread)
    starts = np.flatnonzero(np.asarray(tokens) == bos_id)  # stream positions where a document begins
    target_offsets = np.arange(1, seq_len + 1)  # window i's targets sit at i * seq_len + 1 ... i * seq_len + seq_len
    for first, (x, y) in zip(range(0, len(windows), batch_size),
                             eval_batches(tokens, batch_size, seq_len, max_batches, spread)):
        positions = windows[first:first + batch_size, None] * seq_len + target_offsets[None, :]  # (B, T)
        documents = np.searchsorted(starts, positions, side="right")  # BOS at or before each target
        yield x, y, None, torch.from_numpy(documents.astype(np.int64))


def row_documents(batches: Iterable[tuple], bos_id: int, starts: np.ndarray | None = None) -> Iterable[tuple]:
    """Batches (x, y, loss_mask) of packed rows, whose documents (conversations) never span two rows,
    as (x, y, loss_mask, documents) for `evaluate_batches`. `starts`: where each conversation starts in
    the rows (`PackedRows.starts`: (N, seq_len + 1) bool), in the order `batches` gives the rows
    (`masked_batches`); without them a document starts at each BOS target, which a conversation of a
    tokenizer that puts none before it (an imported Qwen2's ChatML) does not have."""
    next_id, first_row = 0, 0
    for x, y, mask in batches:
        if starts is None:
            opens = y == bos_id
        else:  # target t is token t + 1 of its row; a conversation starting at token 0 is the row's document 0
            opens = torch.from_numpy(np.asarray(starts[first_row:first_row + y.shape[0], 1:], dtype=bool))
            if opens.shape != y.shape:
                raise ValueError(f"row_documents: starts for rows {first_row}.. have shape {tuple(opens.shape)}, "
                                 f"the targets {tuple(y.shape)}")
            first_row += y.shape[0]
        local = torch.cumsum(opens.long(), dim=1)  # (B, T): the row's document of each target
        width = int(local.max()) + 1
        yield x, y, mask, next_id + torch.arange(y.shape[0])[:, None] * width + local
        next_id += y.shape[0] * width


def score_run(model: nn.Module, batches: Callable[[], Iterable[tuple]], token_bytes: np.ndarray,
              choices: dict[str, dict] | None = None) -> dict[str, dict[str, float]]:
    """Loss / perplexity / BPB of `model` under each way of scoring it, {label: scores}, in the order
    of `choices` ({label: architecture options}; None: the model's own `scoring_modes`, e.g. fbt's
    regimes, lrt's prefills, rgpt's depths), each through the engine's teacher-forced path.
    `batches()` starts a new pass over the same batches ((x, y), or (x, y, loss_mask) for
    conversations) for each choice. Every choice is checked before the first batch. The one scoring
    of a run that `eval`, the demo and the CPU comparison share. Batches that name each target's
    document (`text_batches(..., bos_id=...)`, `row_documents`) add {"documents", "loss_ci",
    "bpb_ci", "interval"}: bootstrap intervals over documents (`document_intervals`)."""
    if choices is None:
        choices = model.scoring_modes(model.config)
    for options in choices.values():
        model_options(model, options)  # a bad option fails before any batch
    scores = {}
    for label, options in choices.items():
        result = evaluate_batches(model, batches(), token_bytes, decoding_logits(options))
        if "per_document" in result:
            result.update(document_intervals(result.pop("per_document")))
        scores[label] = result
    return scores


@torch.no_grad()
def score_curve(model: nn.Module, curve: Callable[[nn.Module, Tensor, Tensor], dict[str, Tensor]],
                tokens: np.ndarray, token_bytes: np.ndarray, batch_size: int, seq_len: int,
                max_batches: int | None = None, device: torch.device | str | None = None,
                show_progress: bool = False) -> dict[str, dict[str, float]]:
    """An eval curve an architecture offers (`ArchSpec.curves`, e.g. fbt's `passes_curve`) over
    the text: `curve(model, x, y)` gives each point's per-token losses (B, T) on a batch, and this
    sums them over the batches into each point's loss (per token) and BPB (over the targets that
    stand for bytes), in the curve's order. `show_progress`: a bar on stderr (fbt's curve runs T
    fused passes a batch: an hour over a whole split on a laptop CPU)."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    byte_table = torch.as_tensor(np.asarray(token_bytes), dtype=torch.long, device=device)
    sums: dict[str, list[float]] = {}
    batches = eval_batches(tokens, batch_size, seq_len, max_batches)
    total = math.ceil(len(eval_window_ids(tokens, batch_size, seq_len, max_batches)) / batch_size)
    try:
        for x, y in progress(batches, total=total, desc="eval curve batches", enabled=show_progress):
            x, y = x.to(device), y.to(device)
            target_bytes = byte_table[y.flatten()].view_as(y)  # (B, T)
            for label, losses in curve(model, x, y).items():
                row = sums.setdefault(label, [0.0, 0.0, 0, 0])
                row[0] += float(losses.sum())
                row[1] += float((losses * (target_bytes > 0)).sum())
                row[2] += y.numel()
                row[3] += int(target_bytes.sum())
    finally:
        model.train(was_training)
    return {label: {"loss": nats / max(n, 1), "bpb": nats_bpb / math.log(2) / max(nb, 1), "tokens": n}
            for label, (nats, nats_bpb, n, nb) in sums.items()}
