"""The fast decode path (`latentloop.inference.fast`): the static cache's eager step against the
ordinary cache (default suite), and the compiled step against the eager one (slow: CPU inductor
compiles take tens of seconds per architecture and option set)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_cxx, option_sets, round_stored_keys_and_values
from torch import Tensor, nn

import latentloop as ll
from latentloop.engine import PromptError, model_options
from latentloop.inference.fast import (
    LENGTH_BUCKET,
    REDUCTION_MAX_ROWS,
    WINDOW_BUCKET,
    FastDecoder,
    _attention_by_reduction,
    _int8_linear_by_reduction,
    _linear_by_reduction,
    bucketed_length,
    fallback_reason,
    rewrite_as_reductions,
)
from latentloop.inference.products import ROWS_KERNEL_MAX_ROWS

# fp32 max abs logit difference between the static step and the ordinary one: the static step
# attends over the whole buffer with masked keys, which the attention kernel sums in another
# order than the stored prefix alone; fbt's carried state feeds that back for every step, so the
# difference grows with the steps (measured over 20 steps: up to 2e-5 for gpt, fbt, lrt and rgpt;
# rfbt, the carried state through a recurrent depth, 6e-7 at the first step growing to 4e-5 with the
# full cache and 2.2e-4 with the running-mean one, tokens equal throughout)
FAST_TOL = 5e-4
# rfbt's running-mean cache (`cache_mode=mean`) averages every step's state into all later ones, so a
# rounding difference compounds: over the 20 steps it grew from 7.7e-7 to 6.3e-4 in dynamo's step and
# from 6e-7 to 2.0e-4 in the eager static step, about 2.5x every two steps near the end, tokens equal
# throughout (2026-12-07, AMD EPYC; on the Intel Xeon 2.2e-4)
RUNNING_MEAN_TOL = 2e-3


def tolerance(options: dict) -> float:
    """The largest logit difference a case's static or compiled step may show against the ordinary cache's."""
    return RUNNING_MEAN_TOL if options.get("cache_mode") == "mean" else FAST_TOL

STEPS = WINDOW_BUCKET + 4  # decode steps per check: the attended window grows past its first bucket
ROUNDED_STEPS = 4  # steps compared with a float16 cache's emulation (see its test)
BOS = 256

# two rows, the second left-padded: the static mask must hide padding exactly as the ordinary one
PROMPTS = torch.tensor([[BOS, 5, 9, 12, 40, 41], [0, 0, BOS, 7, 3, 8]])
PAD_MASK = torch.tensor([[True] * 6, [False, False, True, True, True, True]])

_MODELS: dict[str, torch.nn.Module] = {}


def model_for(arch: str):
    if arch not in _MODELS:
        torch.manual_seed(0)
        _MODELS[arch] = ll.build(arch, preset="test").eval()
    return _MODELS[arch]


def _compilable(arch: str, given: dict) -> bool:
    """The fast path takes this arch's option set (its model names no reason to decode eagerly)."""
    model = model_for(arch)
    return fallback_reason(model, model_options(model, given)) is None


def _fast_cases() -> list[tuple[str, dict]]:
    """Every registered arch under each declared option set its fast path takes (the contract
    suite's grid), each distinct set of filled-in options once (a choice equal to the default is
    the defaults' case: its compiled step would be the one already compiled)."""
    cases, seen = [], set()
    for arch, spec in ll.archs.ARCHS.items():
        for given in option_sets(spec.options).values():
            filled = (arch, tuple(sorted(model_options(model_for(arch), given).items())))
            if _compilable(arch, given) and filled not in seen:
                seen.add(filled)
                cases.append((arch, given))
    return cases


CASES = _fast_cases()
IDS = [f"{arch}-{'-'.join(f'{k}={v}' for k, v in opts.items()) or 'default'}" for arch, opts in CASES]


LAST_DECODER: dict[str, FastDecoder] = {}  # the decoder of the last `decode_both`, for what it ran


def decode_both(arch: str, options: dict, compile: bool, kv_dtype: torch.dtype | None = None, steps: int = STEPS):
    """Greedy decode with the ordinary cache and with the FastDecoder; logits per step of each.
    `kv_dtype`: the FastDecoder's cache stores keys and values in it, and the ordinary cache's are
    rounded to it as they are stored (the prefill's once it is done, as `freeze` rounds them)."""
    model = model_for(arch)  # built outside inference mode, as users build models
    with torch.inference_mode():
        return _decode_both(model, options, compile, kv_dtype, steps)


def _decode_both(model, options: dict, compile: bool, kv_dtype: torch.dtype | None = None, steps: int = STEPS):
    options = model_options(model, options)
    needed = PROMPTS.shape[1] + STEPS
    cache = model.new_cache(2, needed, **options)
    out = model.prefill(PROMPTS, cache, PAD_MASK, **options)
    if kv_dtype is not None:
        round_stored_keys_and_values(cache, kv_dtype)
    fast = FastDecoder(model, compile=compile, kv_dtype=kv_dtype, **options)
    LAST_DECODER["fast"], LAST_DECODER["ordinary cache"] = fast, cache
    assert fast.compiled == compile
    static = fast.new_cache(2, needed)
    fast_out = model.prefill(PROMPTS, static, PAD_MASK, **options)
    fast.begin_decoding(static)
    token = out.logits[:, -1].argmax(-1)
    fast_token = fast_out.logits[:, -1].argmax(-1)
    eager_logits, fast_logits = [], []
    for _ in range(steps):
        logits = model.decode(token[:, None], cache, **options).logits[:, -1]
        step_logits, greedy, _ = fast.step(fast_token)
        eager_logits.append(logits)
        fast_logits.append(step_logits.clone())
        token, fast_token = logits.argmax(-1), greedy
        assert torch.equal(greedy, step_logits.argmax(-1))  # the in-step argmax is the argmax
    return torch.stack(eager_logits, 1), torch.stack(fast_logits, 1)


@pytest.mark.parametrize(("arch", "options"), CASES, ids=IDS)
def test_static_cache_eager_step_matches_the_ordinary_cache(arch, options):
    eager, fast = decode_both(arch, options, compile=False)
    torch.testing.assert_close(fast, eager, rtol=0, atol=tolerance(options))
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))  # token for token


@pytest.mark.parametrize(("arch", "options"), CASES, ids=IDS)
def test_a_frozen_cache_takes_the_tensors_of_an_earlier_one_that_is_done(arch, options):
    """`stable_addresses` (on by default where CUDA graphs record the cache's addresses): a generation's
    frozen cache decodes through an earlier one's tensors once nothing holds that one, so the addresses
    a graph was recorded with stay, and decodes exactly as through new ones, though the earlier one
    filled more slots; while the earlier one lives, the next gets tensors of its own."""
    from latentloop.inference.fast import static_buffers

    model = model_for(arch)
    other_prompts = torch.where(PAD_MASK, (PROMPTS * 7 + 3) % 200, PROMPTS)

    def generate(prompts: Tensor, steps: int, stable: bool) -> tuple[object, Tensor]:
        fast = FastDecoder(model, compile=False, **filled)
        fast.stable_addresses = stable
        cache = fast.new_cache(2, PROMPTS.shape[1] + STEPS)
        token = model.prefill(prompts, cache, PAD_MASK, **filled).logits[:, -1].argmax(-1)
        fast.begin_decoding(cache)
        logits = []
        for _ in range(steps):
            step_logits, token, _ = fast.step(token)
            logits.append(step_logits.clone())
        return cache, torch.stack(logits, 1)

    def addresses(cache) -> list[int]:
        return [t.data_ptr() for t in (*cache.k_slots, *cache.v_slots, cache.key_pos, cache.next_pos,
                                       cache.write_index, *cache.state.values())]

    with torch.inference_mode():
        filled = model_options(model, options)
        static_buffers(model).clear()
        first, _ = generate(PROMPTS, STEPS, stable=True)
        held = addresses(first)
        second, _ = generate(other_prompts, 3, stable=True)  # the first is still held: its own tensors
        assert not set(addresses(second)) & set(held)
        del first, second
        third, third_logits = generate(other_prompts, 3, stable=True)
        assert addresses(third) == held
        # past what this generation wrote, zeros as in new tensors (not the first generation's keys)
        assert all(not slot[:, :, third.filled:].any() for slot in (*third.k_slots, *third.v_slots))
        _, new_logits = generate(other_prompts, 3, stable=False)
    torch.testing.assert_close(third_logits, new_logits, rtol=0, atol=0)
    with torch.no_grad():  # outside inference mode the inference-mode tensors are not lent (they cannot be written)
        outside, _ = generate(other_prompts, 3, stable=True)
        assert not set(addresses(outside)) & set(held)


def test_the_pool_of_frozen_cache_tensors_keeps_a_bounded_number_of_sets():
    """Generations of many shapes (batch sizes) in turn: the pool keeps at most POOL_SETS sets, the most
    recently used; a set a live cache holds is never dropped; `clear` drops them all."""
    from latentloop.inference.fast import POOL_SETS, static_buffers

    model = model_for("gpt")
    pool = static_buffers(model)
    pool.clear()
    with torch.inference_mode():

        def frozen(rows: int):  # a generation's decoder and cache, as the engine makes them
            fast = FastDecoder(model, compile=False)
            fast.stable_addresses = True
            cache = fast.new_cache(rows, 16)
            model.prefill(torch.full((rows, 2), BOS), cache)
            fast.begin_decoding(cache)
            return cache

        held = [frozen(rows) for rows in range(1, POOL_SETS + 3)]  # all alive: none may be dropped
        assert len(pool) == POOL_SETS + 2
        del held
        for rows in range(1, POOL_SETS + 3):
            frozen(rows)
        assert len(pool) == POOL_SETS
        last = frozen(POOL_SETS + 2)  # the most recent shapes are kept: this one takes its set again
        assert last.k_slots[0].data_ptr() in {s.k_slots[0].data_ptr() for s in pool._sets.values()}
    pool.clear()
    assert len(pool) == 0


@pytest.mark.parametrize(("arch", "options"), CASES, ids=IDS)
def test_a_half_precision_static_cache_stores_half_and_rounds_nothing_else(arch, options):
    """`kv_dtype=float16` (llama.cpp's default cache type): the frozen cache's slots are float16 and
    hold the prompt's keys and values rounded, bit for bit as the ordinary cache's rounded (the same
    prefill), and the steps equal the ordinary cache's whose stored keys and values are rounded as
    they are stored, at the fp32 tolerance, for the first `ROUNDED_STEPS` steps. Later, a decoded
    token's value whose last fp32 bits differ between the two paths (as they do unrounded) can round
    to neighbouring float16 values, a step of ~1e-3 relative, which a carried state feeds back: rfbt's
    logits drift to 1.3e-3 by step 20 (2.7e-5 unrounded), and to 1.2e-2 with the running-mean cache."""
    eager, fast = decode_both(arch, options, compile=False, kv_dtype=torch.float16, steps=ROUNDED_STEPS)
    static, ordinary = LAST_DECODER["fast"].cache, LAST_DECODER["ordinary cache"]
    assert {t.dtype for t in (*static.k_slots, *static.v_slots)} == {torch.float16}
    prompt = PROMPTS.shape[1]
    for stored, slots in ((ordinary.k, static.k_slots), (ordinary.v, static.v_slots)):
        for slot, half in enumerate(slots):
            assert torch.equal(half[:, :, :prompt].float(), stored[slot, :, :, :prompt])
    torch.testing.assert_close(fast, eager, rtol=0, atol=FAST_TOL)


def _resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm's second field, in pages)."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from Linux's /proc")
def test_a_long_contexts_cache_touches_the_memory_of_the_slots_it_fills():
    """A decode cache sized for a long context (here 2 slots x 64 MiB of keys and as much of values)
    costs the memory, and the time, of the slots a prompt fills: the prefill cache's buffers are the
    operating system's zeros until written (`zeros_on_touch`), and freezing copies the filled slots
    only. torch.zeros, or copying the whole buffer, would make all 256 MiB resident. The frozen slots
    hold the prompt's keys and values, and zeros after them."""
    from latentloop.inference.fast import static_cache
    from latentloop.models.cache import KVCache, zeros_on_touch

    assert torch.equal(zeros_on_touch((3, 5), torch.float16, "cpu"), torch.zeros(3, 5, dtype=torch.float16))
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):  # the mapped branch: zeros, sized
        mapped = zeros_on_touch((4, 2**18), dtype, "cpu")  # 1 MiB at a byte a value: the threshold
        assert mapped.shape == (4, 2**18) and mapped.dtype == dtype and not mapped.any()
        mapped[-1, -1] = 1  # its last element is inside the map
        assert mapped.sum() == 1
    before = _resident_bytes()
    cache = static_cache(KVCache(1, 65536, n_slots=2, n_kv_head=4, head_dim=64))
    keys = torch.randn(1, 4, 3, 64)
    cache.begin(3)
    for slot in range(2):
        cache.update(slot, keys, -keys)
    cache.advance()
    cache.freeze()
    grown = _resident_bytes() - before
    assert grown < 32 * 2**20, f"{grown / 2**20:.0f} MiB resident for 256 MiB of cache holding 3 tokens"
    for slot in range(2):
        assert torch.equal(cache.k_slots[slot][:, :, :3], keys) and torch.equal(cache.v_slots[slot][:, :, :3], -keys)
        assert not cache.k_slots[slot][:, :, 3:].any() and not cache.v_slots[slot][:, :, 3:].any()


def test_a_model_with_a_compiled_decoder_is_freed_with_its_last_reference():
    """A compiled step holds its model (a package resolves the weights from it): kept on the model,
    they are freed together; a global map keyed weakly by the model kept every such model alive. A
    deep copy of the model starts without the original's steps (they are bound to its tensors)."""
    import copy
    import gc
    import weakref

    from latentloop.inference import fast

    model = ll.build("gpt", preset="test").eval()
    decoder = FastDecoder(model, compile=True)
    if decoder.aot is not None:
        assert decoder.aot in fast.compiled_steps(model).values()  # the step that holds the model
    assert not fast.compiled_steps(copy.deepcopy(model))
    gone = weakref.ref(model)
    del model, decoder
    gc.collect()
    assert gone() is None


def test_a_half_precision_window_is_widened_except_for_the_packages_attention():
    """A float16 cache's window reaches attention widened to the step's float32 (eager SDPA and
    dynamo's reductions take one dtype), but as stored while a package's step is traced (the
    attention kernel reads float16, half the bytes; `fast._window_as_stored`), and widened again
    after the trace."""
    from latentloop.inference import aot
    from latentloop.inference.fast import static_cache
    from latentloop.models.cache import KVCache

    cache = static_cache(KVCache(1, 32, n_slots=2, n_kv_head=2, head_dim=8))
    k = torch.randn(1, 2, 3, 8)
    cache.begin(3)
    for slot in range(2):
        cache.update(slot, k, k)
    cache.advance()
    cache.freeze(kv_dtype=torch.float16)
    new = torch.randn(1, 2, 1, 8)
    for tracing, dtype in ((False, torch.float32), (True, torch.float16), (False, torch.float32)):
        cache.begin(1)
        if tracing:
            with aot._products_as_reductions():
                keys, values = cache.update(0, new, new)
        else:
            keys, values = cache.update(0, new, new)
        assert keys.dtype == values.dtype == dtype
        torch.testing.assert_close(keys[:, :, :3].float(), k.half().float(), rtol=0, atol=0)  # the prompt, rounded


@pytest.mark.slow
@needs_cxx
def test_a_half_precision_cache_compiles_into_the_package_and_gives_the_eager_steps():
    """The compiled step (the ahead-of-time package, the default on CPU) over a float16 cache: a
    package of its own (its inputs' dtypes), equal to the rounded ordinary cache's steps; its one-query
    attention calls the attention kernel where the kernel's package build loads (the window as stored:
    `test_a_half_precision_window_is_widened_except_for_the_packages_attention`)."""
    import zipfile

    from latentloop.inference import native

    eager, fast = decode_both("gpt", {}, compile=True, kv_dtype=torch.float16)
    aot = LAST_DECODER["fast"].aot
    assert aot is not None and LAST_DECODER["fast"].aot_reason is None
    torch.testing.assert_close(fast, eager, rtol=0, atol=FAST_TOL)
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))
    if native.attention_package_kernel() is not None:
        for package in aot.packages.values():
            with zipfile.ZipFile(package.path) as archive:
                code = "".join(archive.read(name).decode(errors="replace") for name in archive.namelist()
                               if name.endswith(".cpp"))
            assert "aoti_torch_cpu_decode_attention(" in code, package.path.name


def test_static_cache_length_is_bucketed_and_capped():
    assert bucketed_length(1, 1024) == LENGTH_BUCKET
    assert bucketed_length(LENGTH_BUCKET + 1, 1024) == 2 * LENGTH_BUCKET
    assert bucketed_length(1000, 1000) == 1000  # never beyond the context


def test_static_cache_refuses_to_overflow():
    model = model_for("gpt")
    fast = FastDecoder(model, compile=False)
    with torch.inference_mode():
        cache = fast.new_cache(1, model.config.sequence_len)
        model.prefill(torch.full((1, model.config.sequence_len), 3), cache)
        fast.begin_decoding(cache)
        with pytest.raises(ValueError, match="overflow"):
            fast.step(torch.tensor([3]))


# fp32 max abs difference between a product summed as a reduction and the matmul library's, for
# unit-scale inputs over 1024 terms: another summation order, so a few ulps of the ~30-sized sums
REDUCTION_TOL = 1e-4


@pytest.mark.parametrize("rows", [1, 3, REDUCTION_MAX_ROWS])
def test_linear_by_reduction_is_the_linear_product(rows):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(rows, 1, 1024), torch.randn(96, 1024), torch.randn(96)
    torch.testing.assert_close(_linear_by_reduction(x, weight), F.linear(x, weight), rtol=0, atol=REDUCTION_TOL)
    torch.testing.assert_close(_linear_by_reduction(x, weight, bias), F.linear(x, weight, bias), rtol=0,
                               atol=REDUCTION_TOL)


def test_linear_by_reduction_keeps_the_library_product_past_the_rows_kernels_rows():
    torch.manual_seed(0)
    x, weight = torch.randn(ROWS_KERNEL_MAX_ROWS + 1, 1024), torch.randn(96, 1024)
    assert torch.equal(_linear_by_reduction(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("vendor, library", [("GenuineIntel", True), ("AuthenticAMD", False)])
def test_a_wide_head_keeps_the_library_product_only_where_mkl_runs_on_an_intel_cpu(vendor, library, monkeypatch):
    """A product with more than `REDUCTION_MAX_OUTPUTS` outputs (a 32k vocabulary's head) at one row:
    torch's own product (MKL's) on an Intel CPU, the reduction elsewhere (the sum written out, bit for
    bit); a product with fewer outputs is a reduction on both."""
    from latentloop.inference import fast

    monkeypatch.setattr(fast, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    fast._library_streams_wide_products.cache_clear()
    try:
        torch.manual_seed(0)
        x, wide, narrow = torch.randn(1, 64), torch.randn(fast.REDUCTION_MAX_OUTPUTS + 1, 64), torch.randn(96, 64)
        by_reduction = (x[..., None, :] * wide).sum(-1)
        assert torch.equal(_linear_by_reduction(x, wide), F.linear(x, wide) if library else by_reduction)
        assert torch.equal(_linear_by_reduction(x, narrow), (x[..., None, :] * narrow).sum(-1))
    finally:
        fast._library_streams_wide_products.cache_clear()


@pytest.mark.parametrize("rows", [REDUCTION_MAX_ROWS + 1, 6, 16, 64])
def test_a_batchs_rows_go_through_the_rows_kernel_operator(rows, monkeypatch):
    """Past the reductions' rows, up to 64 rows of float32: the compiled step's product is the rows
    kernel's operator (the C function a package calls), equal to `F.linear` to float32 rounding, a
    bias added after it; past 64 rows, or without the kernel's package build, torch's own product."""
    from latentloop.inference import native

    if native.rows_package_kernel() is None:
        pytest.skip(f"no rows kernel for packages here: {native.native_status(native.ROWS_KERNEL, for_packages=True)}")
    torch.manual_seed(0)
    x, weight, bias = torch.randn(rows, 1, 256), torch.randn(96, 256), torch.randn(96)  # a batch's rows, one token each
    calls = []
    operator = torch.ops.latentloop.rows_linear
    monkeypatch.setattr(torch.ops.latentloop, "rows_linear", lambda *a: calls.append(a) or operator(*a))
    y = _linear_by_reduction(x, weight)
    assert len(calls) == 1 and y.shape == (rows, 1, 96)
    torch.testing.assert_close(y, F.linear(x, weight), rtol=1e-5, atol=1e-4)  # another summation order
    torch.testing.assert_close(_linear_by_reduction(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert len(calls) == 2
    _linear_by_reduction(torch.randn(ROWS_KERNEL_MAX_ROWS + 1, 256), weight)
    _linear_by_reduction(x.double(), weight.double(), bias.double())
    with pytest.raises(RuntimeError, match="dtype"):  # a float64 bias: torch's product refuses it, as F.linear does
        _linear_by_reduction(x, weight, bias.double())
    monkeypatch.setattr(native, "rows_package_kernel", lambda: None)
    _linear_by_reduction(x, weight)
    assert len(calls) == 2


@pytest.mark.parametrize("rows", [1, 3, REDUCTION_MAX_ROWS, REDUCTION_MAX_ROWS + 1])
def test_int8_linear_by_reduction_is_the_dequantised_product(rows):
    """The compiled step's int8 product (a reduction up to its row limit, the converted weight's
    product past it) is the float product of the dequantised weight."""
    from latentloop.inference.quant import quantize_rows

    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(96, 1024))
    x = torch.randn(rows, 1, 1024)
    expected = F.linear(x, q.float() * scale[:, None])
    torch.testing.assert_close(_int8_linear_by_reduction(x, q, scale), expected, rtol=0, atol=REDUCTION_TOL)


@pytest.mark.parametrize(("heads", "kv_heads", "mask_kind", "scale"),
                         [(4, 4, "bool", None), (4, 2, "bool", None), (4, 1, "float", None), (4, 4, "per-head", None),
                          (6, 3, "per-head", None), (4, 2, None, 0.3), (4, 4, "one row for all", None)])
def test_attention_by_reduction_is_sdpa_for_one_query(heads, kv_heads, mask_kind, scale):
    torch.manual_seed(0)
    B, L, hd, hd_v = 3, 40, 16, 8  # values may be narrower than keys
    q, k, v = torch.randn(B, heads, 1, hd), torch.randn(B, kv_heads, L, hd), torch.randn(B, kv_heads, L, hd_v)
    mask_rows = 1 if mask_kind == "one row for all" else B
    visible = torch.rand(mask_rows, heads if "per-head" == mask_kind else 1, 1, L) < 0.7
    visible[..., 0] = True  # every query sees a key
    mask = {"float": torch.where(visible, 0.0, float("-inf")), None: None}.get(mask_kind, visible)
    gqa = kv_heads != heads
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    got = _attention_by_reduction(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    torch.testing.assert_close(got, expected, rtol=0, atol=REDUCTION_TOL)


def test_attention_by_reduction_gives_zeros_where_sdpa_does():
    """A row whose keys are all masked: SDPA returns zeros, a plain softmax NaN."""
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 5, 16), torch.randn(2, 4, 5, 16)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(_attention_by_reduction(q, k, v, attn_mask=mask), expected, rtol=0,
                               atol=REDUCTION_TOL)


def test_attention_by_reduction_keeps_sdpa_for_several_queries_or_other_masks():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 4, 5, 16), torch.randn(2, 4, 5, 16)
    assert torch.equal(_attention_by_reduction(q, k, v, is_causal=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))
    q1, mask = q[:, :, :1], torch.rand(1, 5) < 0.5  # one query, a (Tq, Tk) mask: SDPA broadcasts it
    mask[:, 0] = True
    assert torch.equal(_attention_by_reduction(q1, k, v, attn_mask=mask),
                       F.scaled_dot_product_attention(q1, k, v, attn_mask=mask))


def loops_over(code: str, bound: int) -> list[str]:
    """The bodies of the C++ loops in inductor's `code` that run up to the constant `bound`."""
    bodies = []
    header = r"for\([^;]*;[^;]*<\s*static_cast<int64_t>\(" + str(bound) + r"L\)[^)]*\)[^{]*\{"
    for loop in re.finditer(header, code):
        depth, end = 1, loop.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            end += 1
        bodies.append(code[loop.end():end])
    return bodies


@pytest.mark.slow  # compiles a step to read its generated code: 15 s, the default suite's longest test
@needs_cxx
def test_the_attention_reduction_computes_its_query_once_not_per_key():
    """Compiled by inductor, the one-query attention reads its query from a buffer: the query's
    producer (here `sin`, in the model RoPE) stays out of the loops over the keys, where inductor
    would otherwise inline it and compute it again for every key."""
    from torch._inductor.utils import run_and_get_code

    keys = 50  # a loop bound that nothing else in the step has

    def attend(q_raw, k, v):
        return _attention_by_reduction(q_raw.sin(), k, v)

    args = (torch.randn(1, 3, 1, 24), torch.randn(1, 3, keys, 24), torch.randn(1, 3, keys, 24))
    got, (code, *_) = run_and_get_code(torch.compile(attend, backend="inductor", dynamic=False), *args)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(args[0].sin(), *args[1:]), rtol=0,
                               atol=REDUCTION_TOL)
    over_keys = loops_over(code, keys)
    assert over_keys and "sin" in code
    assert not any("sin" in body for body in over_keys)


@needs_cxx
@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_a_product_reduction_computes_its_input_once_not_per_output_row(weights):
    """The one-row products read their input from a buffer: its producer (here `sin`; in the model
    the residual sum and its RMSNorm) stays out of the loop over the output rows, where inductor
    would otherwise compute it again for every row."""
    from torch._inductor.utils import run_and_get_code

    from latentloop.inference.quant import quantize_rows

    rows_out = 50  # a loop bound that nothing else here has
    q, scale = quantize_rows(torch.randn(rows_out, 32))
    weight = q.float() * scale[:, None]

    def product(x):
        if weights == "int8":
            return _int8_linear_by_reduction(x.sin(), q, scale)
        return _linear_by_reduction(x.sin(), weight)

    x = torch.randn(1, 32)
    got, (code, *_) = run_and_get_code(torch.compile(product, backend="inductor", dynamic=False), x)
    torch.testing.assert_close(got, F.linear(x.sin(), weight), rtol=0, atol=REDUCTION_TOL)
    over_rows = loops_over(code, rows_out)
    assert over_rows and "sin" in code
    assert not any("sin" in body for body in over_rows)


def test_the_cpu_decode_backend_rewrites_every_product_of_the_step():
    """The static cache's decode step traced by dynamo and run as rewritten (without inductor, so
    the reductions themselves run, over the step's real mask): modules' and functional linears
    alike (the head is `F.linear` on the tied embedding), and every layer's attention; the logits
    those give are the eager step's."""
    from latentloop.inference.fast import _decode_step

    model = model_for("gpt")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(rewrite_as_reductions(gm))
        return gm.forward

    with torch.inference_mode():
        logits = {}
        for name, step in (("eager", _decode_step), ("rewritten", torch.compile(_decode_step, backend=capture))):
            fast = FastDecoder(model, compile=False)
            cache = fast.new_cache(2, PROMPTS.shape[1] + STEPS)
            model.prefill(PROMPTS, cache, PAD_MASK)
            fast.begin_decoding(cache)
            logits[name] = step(model, torch.tensor([5, 9]), cache, {})[0]
    targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    n_linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules()) + (model.lm_head is None)  # tied head
    assert targets.count(_linear_by_reduction) == n_linears
    assert targets.count(_attention_by_reduction) == model.config.n_layer
    assert not {F.linear, F.scaled_dot_product_attention} & set(targets)
    torch.testing.assert_close(logits["rewritten"], logits["eager"], rtol=0, atol=REDUCTION_TOL)
    assert_cacheable_on_disk(graphs)


def assert_cacheable_on_disk(graphs) -> None:
    """AOT autograd's on-disk cache takes the rewritten graphs with the backend's marks (without
    them it refused the reductions' calls, and every process traced the step again), and refuses
    them without: the check can fail."""
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe

    from latentloop.inference.fast import _reduction_cache_keys

    nodes = [node for gm in graphs for node in gm.graph.nodes]
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions=_reduction_cache_keys()):
        for node in nodes:
            check_node_safe(node)
    with pytest.raises(BypassAOTAutogradCache, match="_linear_by_reduction|_attention_by_reduction"):
        for node in nodes:
            check_node_safe(node)


def test_engine_compile_needs_the_cache():
    with pytest.raises(PromptError, match="use_cache"):
        ll.generate(model_for("gpt"), [BOS, 5], 4, temperature=0.0, use_cache=False, compile=True)


def test_rgpt_adaptive_exit_falls_back_to_eager_with_the_same_tokens():
    model = model_for("rgpt")
    options = model_options(model, {"exit_threshold": 1e-2})
    assert "adaptive exit" in FastDecoder(model, **options).reason  # no compile is attempted
    kwargs = dict(temperature=0.0, exit_threshold=1e-2)
    assert ll.generate(model, [BOS, 5, 9], STEPS, compile=True, **kwargs) == ll.generate(model, [BOS, 5, 9], STEPS,
                                                                                           **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot", "dynamo"])
@pytest.mark.parametrize(("arch", "options"), CASES, ids=IDS)
def test_compiled_step_matches_the_eager_step(arch, options, backend, monkeypatch):
    """Both CPU compiled steps: the ahead-of-time package (the default) and dynamo's (its fallback)."""
    from torch._dynamo.utils import counters

    from latentloop.inference.aot import AOT_ENV

    monkeypatch.setenv(AOT_ENV, "1" if backend == "aot" else "0")
    counters.clear()
    eager, fast = decode_both(arch, options, compile=True)
    if backend == "aot":  # the package ran every step: nothing fell back to dynamo
        assert not counters["stats"]["unique_graphs"]
        assert LAST_DECODER["fast"].aot is not None and LAST_DECODER["fast"].aot_reason is None
    else:
        assert not counters["graph_break"], dict(counters["graph_break"])  # the whole step is one graph
        assert counters["stats"]["unique_graphs"] == 1  # one graph as the window grows (a dynamic dimension)
    torch.testing.assert_close(fast, eager, rtol=0, atol=tolerance(options))
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))


@pytest.mark.slow
def test_cudas_window_sizes_compile_one_graph_inside_the_buffer(monkeypatch):
    """CUDA's window policy (powers of two from 64, then the buffer's last buckets) run by dynamo's
    compiled step on the CPU, to the end of a 512-token context: one graph for every window inside the
    buffer (the window is a dynamic dimension: a power of two brings no specialisation) and one for the
    whole buffer, no graph break, the eager tokens."""
    from torch._dynamo.utils import counters

    from latentloop.inference import fast as fast_module
    from latentloop.inference.aot import AOT_ENV

    monkeypatch.setenv(AOT_ENV, "0")
    real = fast_module.window_length
    windows = []

    def as_on_cuda(needed: int, max_len: int, device_type: str) -> int:
        windows.append(real(needed, max_len, "cuda"))
        return windows[-1]

    monkeypatch.setattr(fast_module, "window_length", as_on_cuda)
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", sequence_len=512).eval()
    prompt = [[BOS, 5, 9, 12]]
    new_tokens = model.config.sequence_len - len(prompt[0])
    counters.clear()
    compiled = ll.generate(model, prompt, new_tokens, temperature=0.0, compile=True)
    assert sorted(set(windows)) == [64, 128, 256, 496, 512]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2  # inside the buffer, and the whole buffer
    assert compiled == ll.generate(model, prompt, new_tokens, temperature=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt", "fbt"])
def test_engine_compile_gives_the_eager_tokens(arch):
    model = model_for(arch)
    prompts = [[BOS, 5, 9, 12, 40, 41], [BOS, 7]]  # left-padded into one batch
    compiled = ll.generate(model, prompts, STEPS, temperature=0.0, compile=True)
    assert compiled == ll.generate(model, prompts, STEPS, temperature=0.0)
    assert all(len(row) == STEPS for row in compiled)
    sampled = dict(temperature=0.9, top_k=20, seed=3)  # sampling stays outside the compiled step
    assert ll.generate(model, prompts, STEPS, compile=True, **sampled) == ll.generate(model, prompts, STEPS, **sampled)
    # up to the end of the context: the window reaches the whole buffer (a graph of its own, with guards)
    to_the_end = model.config.sequence_len - len(prompts[0])
    assert ll.generate(model, prompts, to_the_end, temperature=0.0, compile=True) == \
        ll.generate(model, prompts, to_the_end, temperature=0.0, compile=False)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot", "dynamo"])
def test_a_compiled_step_survives_a_change_of_threads(backend, monkeypatch):
    """The same model decoded compiled at 1 then 2 CPU threads (as `benchmarks.engines --threads
    1,2` does): dynamo recompiles for a new thread count, which its skipped guards once refused
    ("Recompilation triggered"); a package is compiled per thread count."""
    from latentloop.inference.aot import AOT_ENV

    monkeypatch.setenv(AOT_ENV, "1" if backend == "aot" else "0")
    model = model_for("gpt")
    prompt = [BOS, 5, 9, 12]
    eager = ll.generate(model, prompt, STEPS, temperature=0.0, compile=False)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert ll.generate(model, prompt, STEPS, temperature=0.0, compile=True) == eager
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------
# The automatic mode (engine `compile="auto"`, the default) and the compile records
# --------------------------------------------------------------------------------------------


@pytest.fixture
def compile_dir(tmp_path, monkeypatch):
    """Compile records and inductor's cache in a folder of the test's own."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor"


def test_compile_record_expects_the_cold_cost_then_the_fastest_first_call(compile_dir):
    from latentloop.inference.fast import COLD_COMPILE_S, CompileRecord, compile_cache_dir

    model = model_for("gpt")
    fast = FastDecoder(model, compile=False)
    cache = fast.new_cache(1, 8)
    record = CompileRecord(model, {}, cache)
    assert compile_cache_dir() == compile_dir and record.path.is_relative_to(compile_dir)
    assert not record.seen() and record.expected_seconds() == COLD_COMPILE_S
    record.add(30.0)
    record.add(4.0)
    again = CompileRecord(model, {}, fast.new_cache(1, 8))  # the same key, read back from disk
    assert again.seen() and again.expected_seconds() == 4.0
    other = CompileRecord(model, {}, fast.new_cache(3, 8))  # another batch size is another graph
    assert not other.seen()
    half = CompileRecord(model, {}, fast.new_cache(1, 8), torch.float16)  # a float16 cache is a package of its own
    assert not half.seen()
    # a NaN or a negative time in the file is not a first call: the minimum stayed NaN for good (never
    # compiling that shape again) or went negative (always compiling)
    again.path.write_text(json.dumps({"first_call_s": [float("nan"), -5.0, 6.0]}))
    assert again.expected_seconds() == 6.0
    again.path.write_text(json.dumps({"first_call_s": [float("nan")]}))
    assert not again.seen() and again.expected_seconds() == COLD_COMPILE_S


def test_a_recorded_package_gone_from_the_cache_is_expected_to_compile_again_and_said_so(compile_dir, monkeypatch):
    """An ahead-of-time package's process records what loading it cost (all a later process pays). With
    the package gone (a cleared cache), the next first call compiles again: it was announced as "under
    a second, as last time" and the automatic mode counted the load time against a minute's compile."""
    from latentloop.inference import fast as fast_module
    from latentloop.inference.fast import COLD_COMPILE_S, CompileRecord

    model = model_for("gpt")
    fast = FastDecoder(model, compile=False)
    record = CompileRecord(model, {}, fast.new_cache(1, 8))
    package = compile_dir / "package.pt2"
    package.parent.mkdir(parents=True, exist_ok=True)
    package.write_bytes(b"a package")
    record.add(0.2, package=package, compile_seconds=41.5)
    assert not record.package_gone() and record.expected_seconds() == 0.2
    package.unlink()
    assert record.package_gone() and record.expected_seconds() == 41.5
    record.path.write_text(json.dumps({"first_call_s": [0.2], "package": str(package), "compile_s": "x"}))
    assert record.expected_seconds() == COLD_COMPILE_S  # a damaged compile time: the cold cost
    heard = []

    class GoneAgain(fast_module.CompileRecord):  # the decoder's own record: the package gone
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.path = record.path

    monkeypatch.setattr(fast_module, "CompileRecord", GoneAgain)
    decoder = FastDecoder(model, compile=False, on_compile=heard.append)
    cache = decoder.new_cache(1, 8)
    with torch.inference_mode():
        model.prefill(torch.full((1, 2), BOS), cache)
    decoder.begin_decoding(cache)
    cache.set_window()
    decoder._step = lambda *args: (None, None, {})  # the announcement is what is checked, not the step
    decoder._first_compiled_step(torch.tensor([1]))
    assert "its ahead-of-time package is gone from the cache, built again: ~20 s" in heard[0], heard


def test_compile_cache_dir_counts_inductors_default_as_unset_without_importing_inductor(tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    from latentloop.inference.fast import compile_cache_dir

    monkeypatch.setenv("LATENTLOOP_CACHE", str(tmp_path / "ll"))
    ours = tmp_path / "ll" / "inductor"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compile_cache_dir() == ours
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_default())  # what importing dynamo writes
    assert compile_cache_dir() == ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "torchinductor_someone"))
    assert compile_cache_dir() == ours  # inherited from a parent process run by another user
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice
    assert compile_cache_dir() == tmp_path / "mine"
    script = ("import sys\nfrom latentloop.inference.fast import compile_cache_dir\ncompile_cache_dir()\n"
              "print('torch._inductor' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr[-2000:]  # the automatic mode's check costs no import


@needs_cxx
def test_auto_rule_banks_the_saving_of_eager_calls_until_it_pays_the_compile(compile_dir):
    from latentloop.inference.fast import COMPILED_OVER_EAGER, PROBE_STEPS, AutoCompile, CompileRecord

    torch.manual_seed(0)
    model = ll.build("gpt", preset="test").eval()
    cache = FastDecoder(model, compile=False).new_cache(1, 8)
    CompileRecord(model, {}, cache).add(1.0)  # the next process expects to pay 1 s
    rule = AutoCompile(model, {})
    step_s = 0.01  # eager step; compiling saves (1 - COMPILED_OVER_EAGER) of it
    steps = int(0.6 / (step_s * (1 - COMPILED_OVER_EAGER))) - PROBE_STEPS  # a call that saves ~0.6 s
    assert not rule.decide(step_s, steps, cache)  # 0.6 s < 1 s: stay eager, bank it
    assert rule.decide(step_s, steps, cache)  # 1.2 s banked and expected >= 1 s: compile
    assert rule.applies(1) and not rule.applies(64)


@needs_cxx
def test_auto_rule_banks_across_processes(compile_dir):
    """The saving an eager call banks is kept beside the compile record, so short calls in separate
    processes (a command-line user's `generate`s) add up to a compile as one process's calls do;
    the bank is per shape, and a folder it cannot write keeps this process's bank in memory."""
    import json
    import subprocess
    import sys

    from latentloop.inference import fast

    torch.manual_seed(0)
    model = ll.build("gpt", preset="test").eval()
    cache = FastDecoder(model, compile=False).new_cache(1, 8)
    record = fast.CompileRecord(model, {}, cache)
    record.add(1.0)
    step_s = 0.01
    steps = int(0.4 / (step_s * (1 - fast.COMPILED_OVER_EAGER))) - fast.PROBE_STEPS  # a call that saves ~0.4 s
    script = f"""
import json, sys, torch
import latentloop as ll
from latentloop.inference.fast import AutoCompile, FastDecoder
torch.set_num_threads({torch.get_num_threads()})  # the record's key holds the thread count
torch.manual_seed(0)
model = ll.build("gpt", preset="test").eval()
cache = FastDecoder(model, compile=False).new_cache(1, 8)
print(json.dumps(AutoCompile(model, {{}}).decide({step_s}, {steps}, cache)))
"""
    decisions = []
    for _ in range(3):  # each a process of its own: ~0.4 s, ~0.8 s, ~1.2 s banked
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        decisions.append(json.loads(result.stdout.strip().splitlines()[-1]))
    assert decisions == [False, False, True]
    assert 0.75 < json.loads(record.path.read_text())["banked_s"] < 0.85
    assert json.loads(record.path.read_text())["first_call_s"] == [1.0]  # banking keeps the timings
    other = fast.CompileRecord(model, {}, FastDecoder(model, compile=False).new_cache(2, 8))
    assert other.banked_seconds() == 0.0  # another batch size is another compile

    fast._BANKED_SAVING.clear()
    record.path.write_text("not json")  # a broken record: nothing banked, the cold estimate
    assert record.banked_seconds() == 0.0 and record.expected_seconds() == fast.COLD_COMPILE_S
    import shutil

    shutil.rmtree(record.path.parent)
    record.path.parent.write_text("")  # a file where the records' folder would be: nothing can be written
    rule = fast.AutoCompile(model, {})
    long_steps = int(12.0 / (step_s * (1 - fast.COMPILED_OVER_EAGER))) - fast.PROBE_STEPS  # ~12 s a call
    assert not rule.decide(step_s, long_steps, cache) and record.path.parent.is_file()
    assert rule.decide(step_s, long_steps, cache)  # ~24 s banked in memory >= the cold 20 s


@pytest.mark.parametrize("arch", ll.archs.ARCHS)
def test_auto_mode_stays_eager_when_compiling_does_not_pay_and_gives_the_eager_tokens(arch, compile_dir):
    """A default `generate` on a tiny model: the probe's saving is far below a cold compile, so it
    decodes eagerly through the ordinary cache: bit for bit what `compile=False` gives."""
    model = model_for(arch)
    prompts = [[BOS, 5, 9, 12, 40, 41], [BOS, 7]]
    logged = []
    auto = ll.generate(model, prompts, STEPS, temperature=0.0, on_compile=logged.append)
    assert auto == ll.generate(model, prompts, STEPS, temperature=0.0, compile=False)
    assert not logged  # nothing compiled


def test_auto_mode_decodes_no_probe_step_once_this_process_compiled_the_shape(compile_dir, monkeypatch):
    """When this process already ran the compiled step for the model, options and cache shape, the
    automatic mode adopts the cache right after the prefill: no eager probe step (they cost ~8% of a
    128-token decode of the engines' large shape), and the tokens are the eager ones."""
    import latentloop.engine as engine

    model = model_for("gpt")
    prompt = [BOS, 5, 9, 12]
    monkeypatch.setattr(engine.AutoCompile, "compiled_already", lambda self, cache: True)
    adopted, eager_steps = [], []
    monkeypatch.setattr(engine, "FastDecoder", lambda model, on_compile=None, **options: _Adopting(
        FastDecoder(model, compile=False, **options), adopted))
    decode = model.decode
    monkeypatch.setattr(model, "decode", lambda *a, **k: (eager_steps.append(len(adopted)), decode(*a, **k))[1])
    tokens = ll.generate(model, prompt, STEPS, temperature=0.0)
    monkeypatch.undo()
    assert adopted == [True] and eager_steps and not any(before == 0 for before in eager_steps)
    assert tokens == ll.generate(model, prompt, STEPS, temperature=0.0, compile=False)


class _Adopting:
    """A FastDecoder that records when it adopts a cache."""

    def __init__(self, decoder, adopted: list):
        self.decoder, self.adopted = decoder, adopted

    def adopt(self, cache):
        self.adopted.append(True)
        self.decoder.adopt(cache)

    def __getattr__(self, name):
        return getattr(self.decoder, name)


@pytest.mark.parametrize("compile", [True, "auto"])
def test_the_engine_hands_its_kv_dtype_to_the_compiled_step_and_refuses_what_cannot_take_it(compile, monkeypatch):
    """`stream(kv_dtype=...)` reaches the decoder's frozen cache, on the compiled path and when the
    automatic mode adopts the cache (its steps here eager static ones: the same cache, no compile);
    a dtype it does not know, an eager decode and self-speculative rounds are refused at the call."""
    import latentloop.engine as engine

    model = model_for("gpt")
    decoders = []
    monkeypatch.setattr(engine.AutoCompile, "compiled_already", lambda self, cache: True)
    monkeypatch.setattr(engine, "FastDecoder", lambda model, on_compile=None, **kw: decoders.append(
        FastDecoder(model, compile=False, **kw)) or decoders[-1])
    tokens = ll.generate(model, [BOS, 5, 9, 12], STEPS, temperature=0.0, compile=compile, kv_dtype="bfloat16")
    assert len(decoders) == 1 and {t.dtype for t in decoders[0].cache.k_slots} == {torch.bfloat16}
    assert len(tokens) == STEPS
    for bad, words in [(dict(kv_dtype="int8"), "kv_dtype must be one of"),
                       (dict(kv_dtype="float16", compile=False), "compiled step's cache"),
                       (dict(kv_dtype=torch.float16), "kv_dtype must be one of")]:
        with pytest.raises(PromptError, match=words):
            ll.generate(model, [BOS, 5], 3, **bad)
    with pytest.raises(PromptError, match="self-speculative"):
        ll.generate(model_for("rgpt"), [BOS, 5], 3, kv_dtype="float16", draft_steps=1, draft_tokens=2)
    # a step that never compiles kept the model's dtype without a word (the docs said: refused)
    for compile_mode in (True, "auto"):
        with pytest.raises(PromptError, match=r"this decoding does not compile \(rgpt's adaptive exit"):
            ll.generate(model_for("rgpt"), [BOS, 5], 3, kv_dtype="float16", compile=compile_mode, exit_threshold=0.1)


def test_engine_refuses_an_unknown_decode_mode():
    with pytest.raises(PromptError, match="compile must be"):
        ll.generate(model_for("gpt"), [BOS, 5], 4, compile="fast")


@pytest.mark.slow
def test_auto_mode_compiles_when_it_pays_and_gives_the_eager_tokens(compile_dir):
    """With a recorded cost of zero, the auto mode moves onto the compiled step after its probe steps
    (the cache adopted mid-call), announces the compile, and gives the eager tokens."""
    from latentloop.inference.fast import CompileRecord

    torch.manual_seed(0)
    model = ll.build("fbt", preset="test").eval()
    prompt = [BOS, 5, 9, 12]
    with torch.inference_mode():
        cache = FastDecoder(model, compile=False, **model_options(model, {})).new_cache(1, 8)
    CompileRecord(model, model_options(model, {}), cache).add(0.0)
    logged = []
    auto = ll.generate(model, prompt, STEPS, temperature=0.0, on_compile=logged.append)
    assert any("compiled in" in line for line in logged)
    assert auto == ll.generate(model, prompt, STEPS, temperature=0.0, compile=False)


# --------------------------------------------------------------------------------------------
# Weight-only int8
# --------------------------------------------------------------------------------------------


def test_int8_rows_round_to_within_half_a_step():
    from latentloop.inference.quant import INT8_MAX, quantize_rows

    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.rand(64, 1)  # rows of different scales
    weight[3] = 0  # a zero row quantises to zeros, not NaN
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= INT8_MAX
    error = (q.float() * scale[:, None] - weight).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())
    assert bool((q[3] == 0).all())


# (rows, out, in): one row and a decode batch; widths that are and are not multiples of the kernel's
# 32- and 8-wide steps; more rows than the decode kernel takes (the rows kernel then: a partial
# vector of rows, several, outputs that are and are not whole tiles); more than either takes (the
# converted product)
INT8_SHAPES = [(1, 96, 64), (3, 40, 37), (8, 130, 200), (1, 7, 5), (2, 256, 1024), (9, 33, 70), (17, 24, 5),
               (40, 130, 96), (129, 12, 16)]


@pytest.mark.parametrize("packed", [False, True], ids=["widened", "packed"])
@pytest.mark.parametrize("rows,out,width", INT8_SHAPES)
def test_native_int8_kernel_equals_the_dequantised_product(rows, out, width, packed, monkeypatch):
    """The native kernels (the decode kernel up to KERNEL_MAX_ROWS rows: float32 products of the
    widened int8 weights, or with a packed weight VNNI's integer products of the activations' digits;
    the rows kernel past it) equal the float product of the dequantised weight up to float32
    rounding, on one thread and on several (each output is one thread's sum, so the two are
    bit-identical), and it is a kernel that ran."""
    from latentloop.inference import native, quant

    if native.native_status(quant.KERNEL) != "native":
        pytest.skip(f"no native int8 kernel here: {native.native_status(quant.KERNEL)}")
    if packed and not quant.packs_weights():
        pytest.skip("the int8 kernel here does not read a packed weight (no AVX-512 VNNI)")
    by_kernel = rows <= quant.KERNEL_MAX_ROWS or (rows <= quant.ROWS_KERNEL_MAX_ROWS
                                                  and native.rows_linear_status() == "native")
    torch.manual_seed(rows * out + width)
    q, scale = quant.quantize_rows(torch.randn(out, width))
    x = torch.randn(rows, width) * 3
    reference = x.double() @ (q.double() * scale.double()[:, None]).T
    if by_kernel:  # the torch path must not run where a kernel applies
        monkeypatch.setattr(quant, "_converted_product", lambda *a: pytest.fail("the torch path ran"))
    copy = quant.pack_weight(q) if packed else None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant.int8_product(x, q, scale, copy)
        torch.set_num_threads(2)
        monkeypatch.setattr(native, "PARALLEL_MIN_MACS", 0)  # every shape split over the threads
        split = quant.int8_product(x, q, scale, copy)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one.double(), reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    if by_kernel:
        assert torch.equal(split, one)
    else:  # torch's matrix product may sum in another order on two threads
        torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    if packed and rows <= quant.KERNEL_MAX_ROWS:  # the packed copy is what the kernel read: another weight's
        other_q, _ = quant.quantize_rows(torch.randn(out, width))
        other = x.double() @ (other_q.double() * scale.double()[:, None]).T
        torch.testing.assert_close(quant.int8_product(x, q, scale, quant.pack_weight(other_q)).double(), other,
                                   rtol=1e-5, atol=1e-5 * float(other.abs().max()))
    # leading dimensions pass through, as F.linear's do
    assert quant.int8_product(x.reshape(1, rows, width), q, scale, copy).shape == (1, rows, out)
    monkeypatch.undo()  # an input that wants its gradient takes torch's path, which has a backward
    wanting = x.clone().requires_grad_()
    quant.int8_product(wanting, q, scale).sum().backward()
    expected_grad = (q.double() * scale.double()[:, None]).sum(0).expand(rows, width)
    torch.testing.assert_close(wanting.grad.double(), expected_grad, rtol=1e-5, atol=1e-6 * out)


@pytest.mark.parametrize("packed", [False, True], ids=["widened", "packed"])
def test_a_non_finite_activation_gives_non_finite_outputs_from_the_int8_kernel(packed):
    """A row holding NaN or inf gives NaN or inf in every output, as the dequantised product does (the
    VNNI path split NaN into finite digits: the trainer's and the server's non-finite checks saw
    nothing); the other rows are untouched."""
    from latentloop.inference import native, quant

    if native.native_status(quant.KERNEL) != "native":
        pytest.skip(f"no native int8 kernel here: {native.native_status(quant.KERNEL)}")
    if packed and not quant.packs_weights():
        pytest.skip("the int8 kernel here does not read a packed weight (no AVX-512 VNNI)")
    torch.manual_seed(0)
    q, scale = quant.quantize_rows(torch.randn(40, 70))
    x = torch.randn(4, 70)
    x[0, 33], x[1, 69], x[2, 0] = float("nan"), float("inf"), -float("inf")  # the last in a partial vector
    out = quant.int8_product(x, q, scale, quant.pack_weight(q) if packed else None)
    assert not out[:3].isfinite().any()
    reference = x[3:].double() @ (q.double() * scale.double()[:, None]).T
    torch.testing.assert_close(out[3:].double(), reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


def test_native_kernels_can_be_turned_off_and_a_failed_build_falls_back(monkeypatch, tmp_path):
    """LATENTLOOP_NATIVE=0, or a compiler that fails: the statuses say why in one line and int8
    layers compute the same products through torch, for a decode's rows and a prefill's."""
    from latentloop.inference import native, quant

    torch.manual_seed(0)  # the draws must not depend on what the tests before used of the generator
    q, scale = quant.quantize_rows(torch.randn(24, 40))
    x = torch.randn(1, 40)
    expected = F.linear(x, q.float()) * scale
    monkeypatch.setenv("LATENTLOOP_CACHE", str(tmp_path))  # no build of this machine's cache is reused
    for env, status in [({"LATENTLOOP_NATIVE": "0"}, "turned off (LATENTLOOP_NATIVE=0)"),
                        ({"CC": "false"}, "int8_linear.c did not build with false")]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        caches = (native.native_library, native._rows_library, native._attention_library, quant._kernel)
        for cache in caches:
            cache.cache_clear()
        try:
            assert native.native_status(quant.KERNEL).startswith(status)
            assert native.native_status(quant.KERNEL, for_packages=True).startswith(status)
            assert quant.package_kernel() is None and not quant.packs_weights()
            assert native.rows_linear_status().startswith(status.replace("int8_linear.c", "rows_linear.c"))
            assert native.decode_attention_status().startswith(status.replace("int8_linear.c", "attention.c"))
            assert native.attention_package_kernel() is None  # a package then runs the reductions
            torch.testing.assert_close(quant.int8_product(x, q, scale), expected, rtol=1e-6, atol=1e-6)
            many = x.expand(quant.KERNEL_MAX_ROWS + 1, -1)  # the rows kernel's rows, torch's product instead
            torch.testing.assert_close(quant.int8_product(many, q, scale), expected.expand(len(many), -1),
                                       rtol=1e-6, atol=1e-6)
        finally:
            for name in env:
                monkeypatch.delenv(name)
            for cache in caches:
                cache.cache_clear()
    assert not list(tmp_path.glob("kernels/*.partial"))  # a failed build leaves no half-written file


def test_packed_weight_layout_and_kernel_constants():
    """`pack_weight` lays q + 128 out as int8_linear.c reads it ([N/16][K/4][16][4], zero weights in
    the padding), of the size the kernel expects; the kernel's thread threshold is native.py's."""
    import ctypes

    from latentloop.inference import native, quant

    if native.native_status(quant.KERNEL) != "native":
        pytest.skip(f"no native int8 kernel here: {native.native_status(quant.KERNEL)}")
    q, _ = quant.quantize_rows(torch.randn(37, 10))
    packed = quant.pack_weight(q)
    lib = quant._kernel()
    lib.latentloop_int8_packed_bytes.restype = ctypes.c_int64
    lib.latentloop_int8_packed_bytes.argtypes = [ctypes.c_int64] * 2
    assert packed.dtype == torch.uint8 and packed.numel() == lib.latentloop_int8_packed_bytes(37, 10) == 48 * 12
    for n, k in [(1, 1), (16, 4), (17, 5), (683, 256), (256, 683)]:  # the size int8_product checks, as C counts it
        assert math.prod(quant._packed_shape(n, k)) == lib.latentloop_int8_packed_bytes(n, k)
    for n, k in [(0, 0), (5, 9), (36, 3), (16, 4)]:
        assert int(packed[n // 16, k // 4, n % 16, k % 4]) == int(q[n, k]) + quant.WEIGHT_OFFSET
    assert int(packed[2, 2, 10, 3]) == quant.WEIGHT_OFFSET  # row 42 > 36, k 11 > 9: a zero weight
    assert lib.latentloop_parallel_min_macs() == native.PARALLEL_MIN_MACS


def test_an_int8_layer_repacks_when_its_weight_is_loaded():
    """The packed copy is not saved; loading a state dict makes it again from the loaded weight (a
    stale copy would be what the kernel reads)."""
    from latentloop.inference import quant

    first, second = quant.Int8Linear(nn.Linear(40, 24)), quant.Int8Linear(nn.Linear(40, 24))
    assert "weight_packed" not in first.state_dict()
    first.load_state_dict(second.state_dict())
    assert torch.equal(first.weight_packed, second.weight_packed)
    x = torch.randn(1, 40)
    torch.testing.assert_close(first(x), second(x), rtol=0, atol=0)
    if quant.packs_weights():
        assert first.weight_packed.numel() > 0


@pytest.mark.parametrize("arch", ll.archs.ARCHS)
def test_int8_replaces_every_linear_and_decodes(arch):
    """Every registered arch quantises: no float `nn.Linear` left, the logits near the float model's
    (per-channel int8 of the test preset's weights), and generation runs."""
    from latentloop.inference.quant import Int8Linear, quantize_int8

    torch.manual_seed(0)
    model = ll.build(arch, preset="test").eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        before = model(idx).logits
        n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        quantize_int8(model)
        after = model(idx).logits
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == n_linear > 0
    # int8 steps are 1/254 of each row's range: the logits move by a small fraction of their scale
    torch.testing.assert_close(after, before, rtol=0, atol=0.02 * float(before.abs().max()))
    assert len(ll.generate(model, [BOS, 5, 9], 6, temperature=0.0, compile=False)) == 6


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot", "dynamo"])
@pytest.mark.parametrize("arch", ll.archs.ARCHS)
def test_int8_compiled_step_matches_the_int8_eager_step(arch, backend, monkeypatch):
    """int8 weights through both compiled steps, the package's inductor reduction over the int8
    weights and dynamo's graph around the native kernel, against eager decoding's native kernel."""
    from latentloop.inference.aot import AOT_ENV
    from latentloop.inference.quant import quantize_int8

    monkeypatch.setenv(AOT_ENV, "1" if backend == "aot" else "0")
    torch.manual_seed(0)
    model = quantize_int8(ll.build(arch, preset="test").eval())
    if not _compilable(arch, {}):
        pytest.skip(f"{arch}'s decode step does not compile: {fallback_reason(model, model_options(model, {}))}")
    with torch.inference_mode():
        eager, fast = _decode_both(model, {}, compile=True)  # the options as a caller gives them
    if backend == "aot":  # the package ran every step: nothing fell back to dynamo
        assert LAST_DECODER["fast"].aot is not None and LAST_DECODER["fast"].aot_reason is None
    torch.testing.assert_close(fast, eager, rtol=0, atol=FAST_TOL)
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize("arch", ll.archs.ARCHS)
def test_int8_through_the_cli(arch, tiny_run, tiny_corpus, capsys):
    """`generate --quantize int8` decodes a trained run of every arch, and `eval --quantize int8`
    reports its quality cost: the int8 loss differs from the float one, by a small fraction of it."""
    import json

    from latentloop.cli import main

    run = str(tiny_run(arch))
    assert main(["generate", run, "--prompt", "the ", "--max-new-tokens", "4", "--quantize", "int8",
                 "--decode", "eager"]) == 0
    capsys.readouterr()
    scored = {}
    for extra in ([], ["--quantize", "int8"]):
        assert main(["eval", run, "--json", "--no-progress", "--batches", "1", "--batch-size", "2",
                     "--data", f"text:{tiny_corpus}", *extra]) == 0
        scored[bool(extra)] = json.loads(capsys.readouterr().out)["loss"]
    assert scored[True] != scored[False] and abs(scored[True] - scored[False]) < 0.05 * scored[False]


def test_the_step_for_the_buffers_last_tokens_is_announced_when_a_decode_first_reaches_them(monkeypatch):
    """A window as long as the whole buffer is a graph (a package) of its own: a generation reaching the
    context's last 16 tokens compiled it mid-decode, a stall of a whole compile without a word, and
    never recorded for the automatic mode. Its first step now goes through the announced, recorded
    first call. (The decoder steps eagerly here, through the compiled path's routing: no compile.)"""
    model = ll.build("gpt", preset="test").eval()
    options = model_options(model, {})
    heard: list[str] = []
    decoder = FastDecoder(model, compile=False, on_compile=heard.append, **options)
    monkeypatch.setattr(decoder, "_compiled", True)
    prompt = [BOS, 5, 9, 12]
    context = model.config.sequence_len
    cache = decoder.new_cache(1, context)
    assert cache.max_len == context  # the whole context fits: the window reaches the whole buffer
    tokens = []
    with torch.inference_mode():
        logits = model.prefill(torch.tensor([prompt]), cache, **options).logits
        decoder.begin_decoding(cache)
        token = logits[:, -1].argmax(-1)
        for _ in range(context - len(prompt) - 1):
            tokens.append(int(token))
            logits, token, _ = decoder.step(token)
        tokens.append(int(token))
    starts = [line for line in heard if line.startswith("compiling")]
    assert len(starts) == 2, heard
    assert "buffer's last tokens" not in starts[0] and "buffer's last tokens" in starts[1]
    assert tokens == ll.generate(model, prompt, context - len(prompt), temperature=0.0, compile=False)


def test_the_attended_window_grows_in_buckets_on_cpu_and_in_few_sizes_on_cuda():
    """The window covers what is needed and never passes the buffer; on CPU in steps of WINDOW_BUCKET
    (the compiled step's dynamic dimension), on CUDA in powers of two from CUDA_MIN_WINDOW up to a bucket
    short of the buffer's end, so that CUDA graph trees, which record a graph per input shape, record 7
    up to 2,048 slots; the whole buffer (a graph of its own) only for its last bucket, as on the CPU,
    and never for a server's rows."""
    from latentloop.inference.fast import CUDA_MIN_WINDOW, window_length
    from latentloop.serve.batch import slot_length

    for device_type in ("cpu", "cuda"):
        for max_len in (40, 100, 1024, 2048):
            windows = [window_length(needed, max_len, device_type) for needed in range(1, max_len + 1)]
            assert all(needed <= w <= max_len for needed, w in zip(range(1, max_len + 1), windows))
            assert windows == sorted(windows)
            # the whole buffer is attended only once the last bucket is needed
            assert all(w < max_len for needed, w in enumerate(windows, 1) if needed <= max_len - WINDOW_BUCKET)
    assert {window_length(n, 2048, "cpu") for n in range(1, 2049)} == set(range(WINDOW_BUCKET, 2049, WINDOW_BUCKET))
    cuda = {window_length(n, 2048, "cuda") for n in range(1, 2049)}
    assert cuda == {CUDA_MIN_WINDOW << k for k in range(5)} | {2032, 2048}
    # a server's rows: a bucket more than the context, so its window never spans the whole buffer
    model = ll.build("gpt", preset="test", sequence_len=1000)
    assert slot_length(model) == 1008 + WINDOW_BUCKET
    assert max(window_length(n, slot_length(model), d) for n in range(1, 1001) for d in ("cpu", "cuda")) == 1008


def test_dynamos_steps_in_several_threads_run_one_at_a_time_and_leave_the_stance_as_they_found_it(monkeypatch,
                                                                                                   tmp_path):
    """`torch.compiler.set_stance` is the process's, and each use puts back what it found: four threads'
    compiled decodes overlapped inside it, put back each other's stance, and left the unsafe one on
    (every later compile in the process failed). The compiled step here is the eager one, slowed, so
    that overlaps happen; the stance is recorded as each step enters it."""
    import threading
    import time

    import latentloop.inference.fast as fast

    monkeypatch.setenv("LATENTLOOP_AOT", "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fast, "_compiled_step", lambda device_type: fast._decode_step)
    real_stance = torch.compiler.set_stance
    inside, most = [0], [0]

    class Recorded:
        def __init__(self, *args, **kwargs):
            self.stance = real_stance(*args, **kwargs)

        def __enter__(self):
            self.stance.__enter__()
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.002)  # the GIL let go inside the stance, as a compiled step lets it go

        def __exit__(self, *exc):
            inside[0] -= 1
            return self.stance.__exit__(*exc)

    monkeypatch.setattr(torch.compiler, "set_stance", Recorded)
    model = model_for("gpt")
    prompts = [[BOS, 5 + i, 9, 12] for i in range(4)]
    alone = [ll.generate(model, prompt, 24, temperature=0.0, compile=False) for prompt in prompts]
    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, ll.generate(model, prompts[i], 24, temperature=0.0, compile=True))) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [results.get(i) for i in range(4)] == alone
    assert most[0] == 1  # one compiled step inside the stance at a time
    from torch._dynamo import eval_frame

    assert not eval_frame._stance.skip_guard_eval_unsafe  # the process's stance as it was


def test_a_compiler_that_fails_leaves_the_generation_eager_and_says_why(monkeypatch, tmp_path):
    """A C++ compiler that is there but fails (or a damaged file in inductor's own cache) ended
    `generate --decode compiled` in inductor's traceback: the decoder now decodes eagerly from that
    step on, saying why once, and the tokens are the eager ones. A step that cannot compile at all
    (mor) is said too, where `compile=True` asked for it (silently eager before)."""
    import latentloop.inference.fast as fast

    monkeypatch.setenv("LATENTLOOP_AOT", "0")  # dynamo's path, whose first call is what fails here
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    attempts: list[int] = []

    def failing_compiled_step(device_type: str):
        def step(model, token, cache, options):
            attempts.append(1)
            cache.next_pos += 1  # a first graph ran before the next failed to compile: put back before the retry
            raise RuntimeError("InvalidCxxCompiler: No working C compiler found\nmore lines of the compiler's log")
        return step

    monkeypatch.setattr(fast, "_compiled_step", failing_compiled_step)
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test").eval()
    heard: list[str] = []
    prompt = [1, 2, 3, 4]
    eager = ll.generate(model, prompt, 6, temperature=0.0, compile=False)
    assert ll.generate(model, prompt, 6, temperature=0.0, compile=True, on_compile=heard.append) == eager
    failed = [line for line in heard if "compiling the decode step failed" in line]
    assert len(failed) == 1 and "InvalidCxxCompiler: No working C compiler found; decoding eagerly" in failed[0]
    heard.clear()  # a later generation of the model starts eager, saying why, without compiling again
    assert ll.generate(model, prompt, 6, temperature=0.0, compile=True, on_compile=heard.append) == eager
    assert len(attempts) == 1 and any("does not compile here (compiling the decode step failed" in h for h in heard)
    mor = ll.build("mor", preset="test").eval()
    heard.clear()
    ll.generate(mor, prompt, 3, temperature=0.0, compile=True, on_compile=heard.append)
    assert any(line.startswith("decoding eagerly: ") for line in heard), heard


def test_a_compiles_expected_time_under_a_second_is_said_so():
    """A cached package loads in a fraction of a second: the announcement read "~0 s, as last time"."""
    from latentloop.inference.fast import about_seconds

    assert about_seconds(0.3) == "under a second" and about_seconds(0.999) == "under a second"
    assert about_seconds(1.0) == "~1 s" and about_seconds(12.4) == "~12 s"
