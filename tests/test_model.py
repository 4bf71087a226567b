"""Backbone: shapes, cache exactness, padding exactness, init scale."""

import pytest
import torch

import latentloop as ll

TOL = 1e-5  # fp32 max abs logit difference between two paths that compute the same function


def _model(**overrides):
    torch.manual_seed(0)
    return ll.build("gpt", preset="test", **overrides).eval()


def test_forward_returns_logits_and_top_states():
    model = _model()
    idx = torch.randint(0, 259, (3, 17))
    out = model(idx)
    assert out.logits.shape == (3, 17, 259)
    assert out.hidden.shape == (3, 17, 64)


@pytest.mark.parametrize("overrides", [{}, {"n_kv_head": 2}, {"mlp": "swiglu"}, {"tie_embeddings": True},
                                       {"logit_softcap": 15.0}])
def test_cached_logits_equal_full_forward(overrides):
    model = _model(**overrides)
    idx = torch.randint(0, 259, (2, 30))
    full = model(idx).logits
    cache = model.new_cache(2, 40)
    pieces = [model.prefill(idx[:, :11], cache).logits]
    pieces += [model.decode(idx[:, t:t + 1], cache).logits for t in range(11, 20)]  # one-token steps
    pieces.append(model.decode(idx[:, 20:], cache).logits)  # a second chunk
    assert cache.length == 30
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=TOL)


def test_left_padded_rows_match_each_row_alone():
    model = _model(n_kv_head=2)
    lengths = [12, 5, 9]
    rows = [torch.randint(0, 256, (n,)) for n in lengths]
    P = max(lengths)
    idx = torch.zeros(3, P, dtype=torch.long)
    mask = torch.zeros(3, P, dtype=torch.bool)
    for r, row in enumerate(rows):
        idx[r, P - len(row):], mask[r, P - len(row):] = row, True
    padded = model(idx, pad_mask=mask).logits
    cache = model.new_cache(3, P + 4)
    cached = model.prefill(idx, cache, mask).logits
    step = model.decode(torch.tensor([[1], [2], [3]]), cache).logits[:, 0]
    for r, row in enumerate(rows):
        alone = model(row[None]).logits[0]
        torch.testing.assert_close(padded[r, P - len(row):], alone, rtol=0, atol=TOL)
        torch.testing.assert_close(cached[r, P - len(row):], alone, rtol=0, atol=TOL)
        extended = model(torch.cat([row, torch.tensor([r + 1])])[None]).logits[0, -1]
        torch.testing.assert_close(step[r], extended, rtol=0, atol=TOL)


def test_position_beyond_context_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("depth", [2, 8, 24, 48])
def test_top_state_rms_stays_bounded_with_depth(depth):
    """Depth-scaled output projections keep the residual stream O(1) at init (fbt feeds it back)."""
    torch.manual_seed(depth)
    model = ll.build("gpt", preset="test", n_layer=depth, n_embd=128, n_head=4).eval()
    with torch.no_grad():
        hidden = model(torch.randint(0, 256, (4, 64))).hidden
    rms = hidden.pow(2).mean().sqrt().item()
    assert 0.8 < rms < 2.0, f"top-state RMS {rms:.3f} at depth {depth}"


def test_flops_per_token_matches_hand_count():
    model = ll.build("gpt", preset=None, n_layer=1, n_embd=8, n_head=2, vocab_size=10, bos_id=0, sequence_len=4,
                     mlp_ratio=4.0, tie_embeddings=False)
    # weights used in matmuls: q,k,v,o 4*8*8=256, mlp 2*8*32=512, head 10*8=80 -> 848 multiply-adds
    # attention: QK^T and AV over an average causal context of 2 -> 2 * 8 * 2 = 32 multiply-adds
    forward = 2 * (848 + 32)
    assert model.flops_per_token(4) == 3 * forward
