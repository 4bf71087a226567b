"""The decode attention kernel (`inference/attention.c`, through `native.decode_attention` and the
operator an ahead-of-time package calls): SDPA's output for one query per row, in float64 as the
reference, over every layout the static cache hands it, its keys and values float32 or float16 (a
`kv_dtype=float16` cache); where the package step routes to it."""

import pytest
import torch
import torch.nn.functional as F

from latentloop.inference import fast, native

needs_kernel = pytest.mark.skipif(native.decode_attention_status() != "native",
                                  reason=f"no attention kernel here: {native.decode_attention_status()}")

# (rows B, query heads H, key/value heads Hkv, window L, head dims D and Dv, mask's shape: "shared"
# (1, 1, 1, L), "rows" (B, 1, 1, L), "heads" (B, H, 1, L)). Windows below, at and past the kernel's
# blocks of 4 keys and 16-lane vectors, one past its stack buffer of 4,096 scores; head dims that are
# and are not whole vectors (24: the scalar tail), values wider than keys; grouped-query heads.
CASES = [(1, 2, 2, 1, 64, 64, "shared"), (1, 4, 4, 3, 64, 64, "shared"), (2, 4, 2, 37, 64, 64, "rows"),
         (3, 6, 3, 130, 128, 128, "heads"), (1, 2, 2, 17, 24, 24, "shared"), (2, 4, 1, 70, 32, 64, "rows"),
         (1, 3, 3, 5000, 64, 64, "shared")]


def sdpa_reference(q, k, v, mask):
    """F.scaled_dot_product_attention in float64 (grouped heads repeated), rows whose keys are all
    masked set to zeros, as SDPA's CPU kernel gives."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask)
    return torch.where(mask.expand(*out.shape[:3], -1).any(-1, keepdim=True), out, torch.zeros_like(out))


def case_inputs(B, H, Hkv, L, D, Dv, mask_kind, seed=0, cache_dtype=torch.float32):
    """q (B, H, 1, D) float32; k, v (`cache_dtype`) windows of a longer buffer (B, Hkv, L + 9, .), as
    the static cache slices them; a mask that hides a few keys of each row, and every key of the last
    row where B > 1."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=generator)
    k = torch.randn(B, Hkv, L + 9, D, generator=generator).to(cache_dtype)[:, :, :L]
    v = torch.randn(B, Hkv, L + 9, Dv, generator=generator).to(cache_dtype)[:, :, :L]
    shape = {"shared": (1, 1, 1, L), "rows": (B, 1, 1, L), "heads": (B, H, 1, L)}[mask_kind]
    mask = torch.rand(shape, generator=generator) > 0.2
    mask[..., 0] = True  # every row sees a key ...
    if B > 1 and mask_kind != "shared":
        mask[-1] = False  # ... but the last, which sees none: zeros
    return q, k, v, mask


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32 cache", "float16 cache"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("B,H,Hkv,L,D,Dv,mask_kind", CASES)
def test_the_kernel_equals_sdpa(B, H, Hkv, L, D, Dv, mask_kind, threads, cache_dtype, monkeypatch):
    """float32 rounding of float64 SDPA (the kernel's sums run in another order and its exp is a
    polynomial: 2e-6 of the output's scale), on one thread and split over two (every head on both
    where the threshold is 0); a row with no visible key gets zeros, as SDPA gives. A float16 cache's
    elements are widened exactly, so the reference is SDPA over the same float16 values, at the same
    tolerance."""
    q, k, v, mask = case_inputs(B, H, Hkv, L, D, Dv, mask_kind, cache_dtype=cache_dtype)
    expected = sdpa_reference(q, k, v, mask)
    previous = torch.get_num_threads()
    monkeypatch.setattr(native, "PARALLEL_MIN_MACS", 0)
    try:
        torch.set_num_threads(threads)
        got = native.decode_attention(q, k, v, mask, D ** -0.5)
    finally:
        torch.set_num_threads(previous)
    assert got.shape == (B, H, 1, Dv) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6)
    if B > 1 and mask_kind != "shared":
        assert bool((got[-1] == 0).all())


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32 cache", "float16 cache"])
def test_a_batchs_rows_of_other_lengths_attend_over_their_own_keys(cache_dtype):
    """A batch's rows share one window, as long as its longest row: the others' windows end in
    slots they never filled (masked, skipped four at a time without being read), and a free row sees
    only its first slot. Those slots hold what a row that left wrote there (here: huge keys and
    values, which would swamp any output they reached). Last blocks of four holding 0 to 3 visible keys, a
    masked run inside a row that starts and ends inside blocks, the keys and values a window of a longer
    buffer as the static cache's, one thread so that each row's scores reuse the last row's buffer."""
    B, H, L, D = 6, 2, 64, 64
    q, k, v, _ = case_inputs(B, H, H, L, D, D, "rows", seed=3, cache_dtype=cache_dtype)
    filled = [64, 37, 6, 1, 50, 15]  # the free row (1) sees its first slot only
    mask = torch.arange(L)[None, None, None, :] < torch.tensor(filled)[:, None, None, None]  # (B, 1, 1, L)
    mask[4, ..., 9:23] = False  # a masked run inside a row, partial blocks at both ends
    k.masked_fill_(~mask.transpose(-1, -2), 3e4)  # (B, 1, L, 1) over the keys' slots
    v.masked_fill_(~mask.transpose(-1, -2), -3e4)
    expected = sdpa_reference(q, k, v, mask)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = native.decode_attention(q, k, v, mask, D ** -0.5)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_the_scale_is_the_callers():
    q, k, v, mask = case_inputs(1, 2, 2, 40, 64, 64, "shared")
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(native.decode_attention(q, k, v, mask, 0.3).double(), expected, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_float16_subnormals_and_signed_zeros_widen_exactly():
    """A float16 cache's subnormals (below 6.1e-5) and signed zeros are widened as torch widens them,
    by the vector loads and by the scalar tail (head dim 20: one 16-lane vector and 4 more): keys and
    values drawn from such values only, the scale large enough that the keys decide the weights, and
    an absolute tolerance far below the values (a flushed subnormal would move the output by ~1e-5)."""
    q, _, _, mask = case_inputs(1, 2, 2, 9, 20, 20, "shared")
    subnormal = torch.tensor([0.0, -0.0, 6e-8, -6e-8, 3e-5, -6e-6, 1.2e-6], dtype=torch.float16)
    assert bool((subnormal.float().abs() < 6.1e-5).all())
    k, v = (subnormal[torch.randint(0, len(subnormal), (1, 2, 9, 20), generator=torch.Generator().manual_seed(seed))]
            for seed in (1, 2))
    scale = 1e4
    torch.testing.assert_close(native.decode_attention(q, k, v, mask, scale).double(),
                               F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                              scale=scale), rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("change", ["two queries", "float16 keys only", "float16 query", "bfloat16 cache",
                                    "additive mask", "no mask", "heads not grouped", "mask of another length"])
def test_what_the_kernel_does_not_take(change):
    """The fit check refuses what the kernel does not compute; the package step then keeps the reductions."""
    q, k, v, mask = case_inputs(1, 4, 2, 20, 64, 64, "shared")
    assert native.decode_attention_fits(q, k, v, mask)
    assert native.decode_attention_fits(q, k.half(), v.half(), mask)  # a float16 cache
    if change == "two queries":
        q = q.expand(-1, -1, 2, -1)
    elif change == "float16 keys only":
        k = k.half()
    elif change == "float16 query":
        q, k, v = q.half(), k.half(), v.half()
    elif change == "bfloat16 cache":
        k, v = k.bfloat16(), v.bfloat16()
    elif change == "additive mask":
        mask = torch.zeros(mask.shape)
    elif change == "no mask":
        mask = None
    elif change == "heads not grouped":
        q = torch.randn(1, 3, 1, 64)
    else:
        mask = mask[..., :10]
    assert not native.decode_attention_fits(q, k, v, mask)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32 cache", "float16 cache"])
@pytest.mark.parametrize("available", [True, False], ids=["kernel", "no kernel"])
def test_the_package_step_routes_one_query_attention_to_the_operator(available, cache_dtype, monkeypatch):
    """`_attention_for_package` (what export traces for SDPA) calls the operator where the kernel's
    package build loads and the inputs fit, the cache's keys and values as stored, else the reductions
    over them widened; each gives SDPA's output."""
    calls = []
    operator = torch.ops.latentloop.decode_attention
    monkeypatch.setattr(native, "attention_package_kernel", lambda: "attention-packages.so" if available else None)
    monkeypatch.setattr(torch.ops.latentloop, "decode_attention", lambda *a: calls.append(a) or operator(*a))
    q, k, v, mask = case_inputs(2, 4, 2, 37, 64, 64, "rows", cache_dtype=cache_dtype)
    got = fast._attention_for_package(q, k, v, attn_mask=mask, enable_gqa=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), sdpa_reference(q, k, v, mask), rtol=1e-5, atol=2e-6)
    assert len(calls) == int(available)
    if available:
        assert calls[0][1].dtype == calls[0][2].dtype == cache_dtype  # not a widened copy of the window
    calls.clear()
    got = fast._attention_for_package(q, k, v, attn_mask=mask.float(), enable_gqa=True)  # additive: the reductions
    assert not calls and got.dtype == torch.float32


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32 cache", "float16 cache"])
def test_the_operator_without_the_kernel_is_sdpa(cache_dtype, monkeypatch):
    monkeypatch.setattr(native, "decode_attention", lambda *a: None)
    q, k, v, mask = case_inputs(1, 2, 2, 33, 64, 64, "shared", cache_dtype=cache_dtype)
    torch.testing.assert_close(torch.ops.latentloop.decode_attention(q, k, v, mask, 0.125).double(),
                               sdpa_reference(q, k, v, mask), rtol=1e-5, atol=2e-6)
