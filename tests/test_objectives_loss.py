"""The eager training loss without the float32 logits of the whole batch (`objectives.base`'s chunked
cross-entropy, issue 51): the plain loss's value and gradients to rounding, masked or not, with
ignored targets, across chunk boundaries; in bf16 it keeps half the bytes of the plain path's
stored float32 log-probabilities."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from latentloop.objectives import base
from latentloop.objectives.base import IGNORE_INDEX, token_cross_entropy

B, T, V = 3, 7, 50
# fp32: the same terms summed in another grouping (chunk by chunk), so equal to rounding: a loss near
# 10 to a few ulps (relative), each gradient entry (below 1 / the targets counted) absolutely
LOSS_RTOL, GRAD_TOL = 1e-6, 1e-7


def _plain(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean float32 cross-entropy over the targets that count (not ignored and, with a mask, marked
    by it), written out on those positions alone (0 when there are none)."""
    counted = targets != IGNORE_INDEX
    if mask is not None:
        counted = counted & mask
    total = F.cross_entropy(logits[counted].float(), targets[counted], reduction="sum")
    return total / counted.sum().clamp(min=1)


def _loss_and_grad(fn, logits, targets, mask):
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf, targets, mask)
    loss.backward()
    assert torch.equal(leaf.detach(), logits)  # the loss leaves the logits as they were
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 4, 100])  # one row per chunk, chunks that split the batch, one chunk
def test_the_chunked_loss_is_the_plain_loss_and_gradient(monkeypatch, masked, chunk_rows):
    monkeypatch.setattr(base, "CHUNK_ELEMENTS", chunk_rows * V)
    monkeypatch.setattr(base, "CHUNKED_ABOVE_BYTES", 0)  # these small logits chunked too
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=generator) * 3
    targets = torch.randint(0, V, (B, T), generator=generator)
    targets[0, 2] = targets[2, 5] = IGNORE_INDEX  # targets that count for nothing
    mask = torch.rand(B, T, generator=generator) > 0.4 if masked else None

    def chunked(leaf, t, m):
        assert base._chunked_applies(leaf, "mean")
        return token_cross_entropy(leaf, t, mask=m)

    loss, grad = _loss_and_grad(chunked, logits, targets, mask)
    plain_loss, plain_grad = _loss_and_grad(_plain, logits, targets, mask)
    torch.testing.assert_close(loss, plain_loss, rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(grad, plain_grad, rtol=0, atol=GRAD_TOL)
    assert grad[0, 2].abs().max() == 0  # an ignored target's logits get no gradient


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_each_reduction_counts_only_the_targets_that_count(monkeypatch, chunked, masked):
    """"mean" is over the targets neither ignored nor masked out (a masked-in ignored target is not in
    the denominator), 0 where none counts (not NaN: a micro-batch's weight of 0 does not cancel a NaN);
    "sum" sums them; "none" is 0 where a target does not count; another reduction is refused."""
    monkeypatch.setattr(base, "CHUNKED_ABOVE_BYTES", 0 if chunked else 2**62)
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(B, T, V, generator=generator) * 3).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=generator)
    targets[0, 2] = targets[2, 5] = IGNORE_INDEX
    mask = torch.ones(B, T, dtype=torch.bool) if masked else None
    if masked:
        mask[1, 3] = False
    assert base._chunked_applies(logits, "mean") == chunked
    torch.testing.assert_close(token_cross_entropy(logits, targets, mask=mask), _plain(logits, targets, mask),
                               rtol=LOSS_RTOL, atol=0)
    if not chunked and not masked:  # a pretraining step's loss: torch's own mean, bit for bit, as before
        large = torch.randn(16, 256, 259, generator=generator) * 3  # summed in another order, it differs in ulps
        large_targets = torch.randint(0, 259, (16, 256), generator=generator)
        assert torch.equal(token_cross_entropy(large, large_targets),
                           F.cross_entropy(large.flatten(0, 1), large_targets.flatten()))
    counted = (targets != IGNORE_INDEX) & (mask if masked else True)
    each = token_cross_entropy(logits, targets, reduction="none", mask=mask)
    assert each.shape == (B * T,) and torch.equal(each == 0, ~counted.flatten())
    torch.testing.assert_close(token_cross_entropy(logits, targets, reduction="sum", mask=mask),
                               _plain(logits, targets, mask) * counted.sum(), rtol=1e-6, atol=0)
    nothing = torch.full_like(targets, IGNORE_INDEX)
    loss = token_cross_entropy(logits, nothing, mask=mask)
    assert loss.item() == 0
    loss.backward()
    assert logits.grad.abs().max() == 0
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, none, got 'avg'"):
        token_cross_entropy(logits, targets, reduction="avg")


def test_in_bf16_the_chunked_loss_keeps_half_the_bytes_and_the_same_gradient(monkeypatch):
    monkeypatch.setattr(base, "CHUNKED_ABOVE_BYTES", 0)
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(B, T, V, generator=generator) * 3).bfloat16()
    targets = torch.randint(0, V, (B, T), generator=generator)
    kept: dict[str, int] = {}

    def saved_bytes(name, fn):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = _loss_and_grad(fn, logits, targets, None)
        kept[name] = total[0]
        return result

    loss, grad = saved_bytes("chunked", lambda leaf, t, m: token_cross_entropy(leaf, t, mask=m))
    plain_loss, plain_grad = saved_bytes("plain", _plain)
    assert grad.dtype == plain_grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, plain_loss, rtol=LOSS_RTOL, atol=0)
    # both round the same float32 gradient to bf16: equal but for a last bit here and there
    torch.testing.assert_close(grad.float(), plain_grad.float(), rtol=2 ** -7, atol=1e-6)
    assert kept["chunked"] <= B * T * V * 2 < B * T * V * 4 <= kept["plain"], kept


def test_evaluation_compiled_graphs_and_small_batches_take_the_plain_loss(monkeypatch):
    logits = torch.randn(2, 3, V, requires_grad=True)
    assert not base._chunked_applies(logits, "mean")  # 1.2 KB of float32 logits: the plain loss is faster
    monkeypatch.setattr(base, "CHUNKED_ABOVE_BYTES", logits.numel() * 4 - 1)
    assert base._chunked_applies(logits, "mean")
    assert not base._chunked_applies(logits, "none") and not base._chunked_applies(logits.detach(), "mean")
    with torch.no_grad():
        assert not base._chunked_applies(logits, "mean")
    seen = []
    compiled = torch.compile(lambda x: seen.append(base._chunked_applies(x, "mean")) or x.sum(), backend="eager")
    compiled(logits)
    assert seen == [False]  # inside a graph: the plain loss, whose upcast inductor fuses
