"""Backbone: shapes, cache exactness, padding exactness, init scale."""

import pytest
import torch

import latentloop as ll
from latentloop.models import backbone, native

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


# --- products through the rows kernel and oneDNN (backbone.linear) ------------------------------

needs_onednn = pytest.mark.skipif(not backbone._ONEDNN,
                                  reason="oneDNN's linear op is not in this torch build, or not an x86 CPU")
needs_rows_kernel = pytest.mark.skipif(native.rows_linear_status() != "native",
                                       reason=f"no rows kernel here: {native.rows_linear_status()}")


def _ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


# (rows, out, in): one vector of rows, a partial one, several; outputs that are and are not whole
# tiles of the kernel (12); widths of one, odd and long
ROWS_SHAPES = [(1, 12, 16), (2, 7, 1), (5, 13, 37), (16, 24, 256), (17, 100, 33), (64, 25, 683), (70, 12, 8)]


@needs_rows_kernel
@pytest.mark.parametrize("rows,out,width", ROWS_SHAPES)
def test_the_rows_kernel_equals_blas(rows, out, width, monkeypatch):
    """rows_linear.c's float32 product equals F.linear's to float32 rounding (sums in another order),
    and is the same bit for bit on one thread and two (each output is one thread's sum)."""
    torch.manual_seed(rows * out + width)
    x, weight = torch.randn(rows, width), torch.randn(out, width)
    expected = torch.nn.functional.linear(x.double(), weight.double())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.rows_linear(x, weight)
        torch.set_num_threads(2)
        monkeypatch.setattr(native, "PARALLEL_MIN_MACS", 0)  # every shape split over the threads
        split = native.rows_linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    assert torch.equal(split, one)
    strided = torch.randn(width, out).T  # a transposed view: made contiguous first, same product
    torch.testing.assert_close(native.rows_linear(x, strided).double(), torch.nn.functional.linear(
        x.double(), strided.double()), rtol=1e-5, atol=1e-5 * float(expected.abs().max() + 1))
    with pytest.raises(TypeError, match="float32 weight"):
        native.rows_linear(x, weight.double())


@needs_rows_kernel
def test_linear_picks_the_rows_kernel_by_rows_and_keeps_torch_for_autograd(monkeypatch):
    """`linear`'s rule: ROWS_KERNEL_MIN_ROWS to ROWS_KERNEL_MAX_ROWS rows without autograd go through the rows kernel
    (leading dimensions and bias as F.linear's); one row, more rows, a grad-recording call or bf16
    autocast keep torch's product."""
    from latentloop.models.backbone import ROWS_KERNEL_MAX_ROWS, ROWS_KERNEL_MIN_ROWS, linear

    calls = []
    monkeypatch.setattr(backbone, "rows_linear", lambda *a: calls.append(a[0].shape) or native.rows_linear(*a))
    torch.manual_seed(0)
    weight, bias = torch.randn(30, 20), torch.randn(30)
    for rows, used in [(1, False), (ROWS_KERNEL_MIN_ROWS - 1, False), (ROWS_KERNEL_MIN_ROWS, True),
                       (ROWS_KERNEL_MAX_ROWS, True),
                       (ROWS_KERNEL_MAX_ROWS + 1, False)]:
        x = torch.randn(rows, 1, 20)  # (B, T, D): B * T rows
        calls.clear()
        with torch.no_grad():
            out = linear(x, weight, bias)
        assert bool(calls) == used, rows
        assert out.shape == (rows, 1, 30)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    calls.clear()
    x = torch.randn(ROWS_KERNEL_MIN_ROWS, 20)
    leaf = weight.clone().requires_grad_()
    linear(x, leaf).sum().backward()  # autograd: F.linear, which has a backward
    assert leaf.grad is not None and not calls
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, weight).dtype == torch.bfloat16 and not calls


@needs_onednn
def test_a_large_product_without_autograd_runs_through_onednn_and_agrees_with_blas():
    """More rows than the rows kernel takes by a weight of >= ONEDNN_MIN_WEIGHT elements, or
    ONEDNN_ANY_WEIGHT_ROWS rows by any weight, no autograd: oneDNN's op, with F.linear's result to
    float32 rounding (the sums run in another order); a grad-recording call, or a small weight
    below that many rows, keep torch's own product."""
    from latentloop.models.backbone import ONEDNN_ANY_WEIGHT_ROWS, ONEDNN_MIN_WEIGHT, ROWS_KERNEL_MAX_ROWS, linear

    torch.manual_seed(0)
    fan_in = 512  # a weight of exactly ONEDNN_MIN_WEIGHT elements
    weight, bias = torch.randn(ONEDNN_MIN_WEIGHT // fan_in, fan_in), torch.randn(ONEDNN_MIN_WEIGHT // fan_in)
    x = torch.randn(2, ROWS_KERNEL_MAX_ROWS // 2 + 1, fan_in)  # (B, T, D): B * T rows
    onednn = "mkldnn::_linear_pointwise"
    with torch.no_grad():
        assert onednn in _ops_run(lambda: linear(x, weight, bias))
        out = linear(x, weight, bias)
        assert out.shape == (*x.shape[:2], weight.shape[0])
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
        assert onednn not in _ops_run(lambda: linear(x[:, :1], weight, bias))  # 2 rows: not oneDNN
        assert onednn not in _ops_run(lambda: linear(x, weight[:8], bias[:8]))  # a small weight
        many = torch.randn(ONEDNN_ANY_WEIGHT_ROWS, fan_in)  # from this many rows, a small weight too
        assert onednn in _ops_run(lambda: linear(many, weight[:8], bias[:8]))
        torch.testing.assert_close(linear(many, weight[:8], bias[:8]),
                                   torch.nn.functional.linear(many, weight[:8], bias[:8]), rtol=1e-5, atol=1e-4)
        assert onednn not in _ops_run(lambda: linear(many[:-1], weight[:8], bias[:8]))
    leaf = weight.clone().requires_grad_()
    assert onednn not in _ops_run(lambda: linear(x, leaf).sum().backward())  # autograd: F.linear
    assert leaf.grad is not None


@pytest.mark.parametrize("prompt_len", [16, backbone.ROWS_KERNEL_MAX_ROWS + 8])
def test_a_prefill_through_the_no_autograd_kernels_gives_the_training_forwards_logits(prompt_len):
    """A prefill (no autograd: the rows kernel for a short prompt, oneDNN for the MLP's large weights
    in a long one, where this machine has them) and a training forward (torch's product): the
    logits agree within this file's bar for two paths of one function."""
    from latentloop.models.backbone import ONEDNN_MIN_WEIGHT, ROWS_KERNEL_MAX_ROWS

    torch.manual_seed(0)
    model = ll.build("gpt", preset=None, n_layer=1, n_embd=512, n_head=4, vocab_size=64, bos_id=1,
                     sequence_len=2 * ROWS_KERNEL_MAX_ROWS)
    assert model.blocks[0].mlp.c_fc.weight.numel() >= ONEDNN_MIN_WEIGHT
    idx = torch.randint(0, 64, (1, prompt_len))
    logits = model(idx).logits  # grad recorded: torch's product
    with torch.no_grad():
        if backbone._ONEDNN and prompt_len > ROWS_KERNEL_MAX_ROWS:
            assert "mkldnn::_linear_pointwise" in _ops_run(lambda: model.prefill(idx, model.new_cache(1, prompt_len)))
        prefilled = model.prefill(idx, model.new_cache(1, prompt_len)).logits
    torch.testing.assert_close(prefilled, logits.detach(), rtol=0, atol=TOL)
