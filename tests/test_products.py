"""Faster CPU products applied to a built model (`latentloop.inference.products`): the rows kernel and
oneDNN against torch's product, the rule that picks them, the module swap, and the gate that keeps
them off a CPU they were not measured on."""

import pytest
import torch

import latentloop as ll
from latentloop.inference import native, products, quant, torch_internals
from latentloop.inference.products import (
    ONEDNN_ANY_WEIGHT_ROWS,
    ONEDNN_MIN_WEIGHT,
    ROWS_KERNEL_MAX_ROWS,
    ROWS_KERNEL_MIN_ROWS,
    AcceleratedLinear,
    accelerate,
    accelerated_linear,
)

TOL = 1e-5  # fp32 max abs logit difference between two paths that compute the same function

ONEDNN_HERE = (native.measured_here() and torch_internals.onednn_linear(torch.ones(1, 1), torch.ones(1, 1), None)
               is not None)
needs_onednn = pytest.mark.skipif(not ONEDNN_HERE, reason="oneDNN's linear op is not in this torch build, not tested "
                                  "with this torch, or not an x86 CPU with AVX2")
needs_rows_kernel = pytest.mark.skipif(native.rows_linear_status() != "native",
                                       reason=f"no rows kernel here: {native.rows_linear_status()}")


def _ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


# (rows, out, in): one vector of rows, a partial one, several; outputs that are and are not whole
# tiles of the kernel (12); widths of one, odd and long
# up to 8 rows and an even width: rows_linear.c's paired tile (with AVX-512); the others its plain one
ROWS_SHAPES = [(1, 12, 16), (2, 7, 1), (3, 5, 2), (5, 13, 37), (6, 25, 130), (8, 30, 512), (9, 30, 512),
               (16, 24, 256), (17, 100, 33), (64, 25, 683), (70, 12, 8)]


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
    shifted = torch.randn(out * width + 1)[1:].view(out, width)  # contiguous, 4 bytes past an 8-byte boundary
    torch.testing.assert_close(native.rows_linear(x, shifted).double(), torch.nn.functional.linear(
        x.double(), shifted.double()), rtol=1e-5, atol=1e-5 * float(expected.abs().max() + 1))
    with pytest.raises(TypeError, match="float32 weight"):
        native.rows_linear(x, weight.double())


@needs_rows_kernel
def test_linear_picks_the_rows_kernel_by_rows_and_keeps_torch_for_autograd(monkeypatch):
    """`accelerated_linear`'s rule: ROWS_KERNEL_MIN_ROWS to ROWS_KERNEL_MAX_ROWS rows without autograd go
    through the rows kernel (leading dimensions and bias as F.linear's); one row, more rows, a
    grad-recording call or bf16 autocast keep torch's product."""

    calls = []
    monkeypatch.setattr(products, "rows_linear", lambda *a: calls.append(a[0].shape) or native.rows_linear(*a))
    torch.manual_seed(0)
    weight, bias = torch.randn(30, 20), torch.randn(30)
    for rows, used in [(1, False), (ROWS_KERNEL_MIN_ROWS - 1, False), (ROWS_KERNEL_MIN_ROWS, True),
                       (ROWS_KERNEL_MAX_ROWS, True),
                       (ROWS_KERNEL_MAX_ROWS + 1, False)]:
        x = torch.randn(rows, 1, 20)  # (B, T, D): B * T rows
        calls.clear()
        with torch.no_grad():
            out = accelerated_linear(x, weight, bias)
        assert bool(calls) == used, rows
        assert out.shape == (rows, 1, 30)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    calls.clear()
    x = torch.randn(ROWS_KERNEL_MIN_ROWS, 20)
    leaf = weight.clone().requires_grad_()
    accelerated_linear(x, leaf).sum().backward()  # autograd: F.linear, which has a backward
    assert leaf.grad is not None and not calls
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert accelerated_linear(x, weight).dtype == torch.bfloat16 and not calls


@needs_onednn
def test_a_large_product_without_autograd_runs_through_onednn_and_agrees_with_blas():
    """More rows than the rows kernel takes by a weight of >= ONEDNN_MIN_WEIGHT elements, or
    ONEDNN_ANY_WEIGHT_ROWS rows by any weight, no autograd: oneDNN's op, with F.linear's result to
    float32 rounding (the sums run in another order); a grad-recording call, or a small weight
    below that many rows, keep torch's own product."""

    torch.manual_seed(0)
    fan_in = 512  # a weight of exactly ONEDNN_MIN_WEIGHT elements
    weight, bias = torch.randn(ONEDNN_MIN_WEIGHT // fan_in, fan_in), torch.randn(ONEDNN_MIN_WEIGHT // fan_in)
    x = torch.randn(2, ROWS_KERNEL_MAX_ROWS // 2 + 1, fan_in)  # (B, T, D): B * T rows
    onednn = "mkldnn::_linear_pointwise"
    with torch.no_grad():
        assert onednn in _ops_run(lambda: accelerated_linear(x, weight, bias))
        out = accelerated_linear(x, weight, bias)
        assert out.shape == (*x.shape[:2], weight.shape[0])
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
        assert onednn not in _ops_run(lambda: accelerated_linear(x[:, :1], weight, bias))  # 2 rows: not oneDNN
        assert onednn not in _ops_run(lambda: accelerated_linear(x, weight[:8], bias[:8]))  # a small weight
        many = torch.randn(ONEDNN_ANY_WEIGHT_ROWS, fan_in)  # from this many rows, a small weight too
        assert onednn in _ops_run(lambda: accelerated_linear(many, weight[:8], bias[:8]))
        torch.testing.assert_close(accelerated_linear(many, weight[:8], bias[:8]),
                                   torch.nn.functional.linear(many, weight[:8], bias[:8]), rtol=1e-5, atol=1e-4)
        assert onednn not in _ops_run(lambda: accelerated_linear(many[:-1], weight[:8], bias[:8]))
    leaf = weight.clone().requires_grad_()
    assert onednn not in _ops_run(lambda: accelerated_linear(x, leaf).sum().backward())  # autograd: F.linear
    assert leaf.grad is not None


@pytest.mark.parametrize("prompt_len", [16, ROWS_KERNEL_MAX_ROWS + 8])
def test_a_prefill_through_the_no_autograd_kernels_gives_the_training_forwards_logits(prompt_len):
    """A prefill (no autograd: the rows kernel for a short prompt, oneDNN for the MLP's large weights
    in a long one, where this machine has them) and a training forward (torch's product): the
    logits agree within this file's bar for two paths of one function."""

    torch.manual_seed(0)
    model = accelerate(ll.build("gpt", preset=None, n_layer=1, n_embd=512, n_head=4, vocab_size=64, bos_id=1,
                                sequence_len=2 * ROWS_KERNEL_MAX_ROWS))
    assert model.blocks[0].mlp.c_fc.weight.numel() >= ONEDNN_MIN_WEIGHT
    idx = torch.randint(0, 64, (1, prompt_len))
    logits = model(idx).logits  # grad recorded: torch's product
    with torch.no_grad():
        if ONEDNN_HERE and prompt_len > ROWS_KERNEL_MAX_ROWS:
            assert "mkldnn::_linear_pointwise" in _ops_run(lambda: model.prefill(idx, model.new_cache(1, prompt_len)))
        prefilled = model.prefill(idx, model.new_cache(1, prompt_len)).logits
    torch.testing.assert_close(prefilled, logits.detach(), rtol=0, atol=TOL)


# --- the module swap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_accelerate_swaps_every_linear_in_place_and_keeps_the_state_dict(tied, monkeypatch):
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", tie_embeddings=tied).eval()
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and not products.is_accelerated(model)  # a built model is plain: torch's products
    assert accelerate(model) is model and accelerate(model) is model  # in place; twice changes nothing
    assert all(type(m) is AcceleratedLinear for m in linears)
    assert products.is_accelerated(model)
    assert model.state_dict().keys() == plain.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in plain.items())
    assert model.tied_head_product is accelerated_linear
    assert type(model).tied_head_product is torch.nn.functional.linear  # the class stays plain
    # the head's product goes through the kernels' rule: with a tied head, the embedding's matrix
    monkeypatch.setattr(products, "measured_here", lambda: True)
    heads = []
    monkeypatch.setattr(products, "rows_linear", lambda x, w: heads.append(w) or torch.nn.functional.linear(x, w))
    with torch.no_grad():
        model.head(torch.randn(ROWS_KERNEL_MIN_ROWS, model.config.n_embd))
    head_weight = model.wte.weight if tied else model.lm_head.weight
    assert len(heads) == 1 and heads[0] is head_weight


@pytest.mark.parametrize("arch", ll.archs.ARCHS)
def test_an_accelerated_model_decodes_as_the_plain_one(arch):
    """Every registered architecture: prefill and a few decode steps, plain against accelerated (the
    kernels sum in another order: float32 rounding apart)."""
    torch.manual_seed(0)
    model = ll.build(arch, preset="test").eval()
    prompt = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        plain = ll.generate(model, prompt, 6, temperature=0.0, compile=False)
        plain_logits = model.prefill(prompt, model.new_cache(2, 26)).logits
        accelerate(model)
        fast_logits = model.prefill(prompt, model.new_cache(2, 26)).logits
        accelerated = ll.generate(model, prompt, 6, temperature=0.0, compile=False)
    torch.testing.assert_close(fast_logits, plain_logits, rtol=0, atol=TOL)
    assert accelerated == plain


def test_a_loaded_run_is_accelerated_on_the_cpu_and_a_built_model_is_not(tiny_run):
    model, _ = ll.load(tiny_run("gpt"))
    assert products.is_accelerated(model)
    plain, _ = ll.load(tiny_run("gpt"), accelerate=False)
    assert not products.is_accelerated(plain)
    assert not products.is_accelerated(ll.build("gpt", preset="test"))


# --- the gate: kernels only on the CPUs they were measured on ------------------------------------------


def test_off_a_measured_cpu_every_product_is_torchs(monkeypatch):
    """With the gate forced off (as on an ARM CPU, or x86 without AVX2), the rows kernel, oneDNN and
    the int8 kernel are never called: each product is torch's own, bit for bit."""
    monkeypatch.setattr(native, "measured_here", lambda: False)
    monkeypatch.setattr(products, "measured_here", lambda: False)
    monkeypatch.setattr(quant, "measured_here", lambda: False)
    native._rows_library.cache_clear()
    quant._kernel.cache_clear()
    try:
        called = []
        monkeypatch.setattr(products, "rows_linear", lambda *a: called.append("rows"))
        monkeypatch.setattr(torch_internals, "onednn_linear", lambda *a: called.append("onednn"))
        torch.manual_seed(0)
        weight = torch.randn(ONEDNN_MIN_WEIGHT // 512, 512)
        for rows in (ROWS_KERNEL_MIN_ROWS, ROWS_KERNEL_MAX_ROWS, ONEDNN_ANY_WEIGHT_ROWS):
            x = torch.randn(rows, 512)
            with torch.no_grad():
                torch.testing.assert_close(accelerated_linear(x, weight), torch.nn.functional.linear(x, weight),
                                           rtol=0, atol=0)
        assert not called
        assert native.rows_linear(torch.randn(8, 16), torch.randn(4, 16)) is None
        assert "not one the kernels were measured on" in native.rows_linear_status()
        assert quant._kernel() is None and quant.package_kernel() is None
        layer = quant.Int8Linear(torch.nn.Linear(64, 32, bias=False))
        x = torch.randn(3, 64)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), quant._converted_product(x, layer.weight_int8, layer.scale),
                                       rtol=0, atol=0)
    finally:
        native._rows_library.cache_clear()
        quant._kernel.cache_clear()


def test_without_a_compiler_every_path_runs_on_torch_and_decoding_stays_eager(monkeypatch, tmp_path):
    """No compiler (or one that cannot build): no kernel library loads, the status says why in one line,
    and prefill, eager decoding and int8 decoding give torch's numbers."""
    monkeypatch.setenv("LATENTLOOP_CACHE", str(tmp_path / "empty-cache"))  # nothing built already
    monkeypatch.setenv(native.NATIVE_ENV, "1")  # the kernels on: only the compiler is missing
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setattr(native, "cxx_compiler", lambda: None)  # no C++ either: inductor cannot compile
    for cached in (native.native_library, native._rows_library, quant._kernel):
        cached.cache_clear()
    try:
        assert native.native_library("rows_linear") is None
        assert native.native_status("rows_linear") == "no C compiler (cc, gcc or clang; or set CC)"
        assert native.rows_linear(torch.randn(8, 16), torch.randn(4, 16)) is None
        torch.manual_seed(0)
        model = ll.build("gpt", preset="test").eval()
        prompt = torch.randint(0, 256, (1, 12))
        with torch.no_grad():
            plain = model.prefill(prompt, model.new_cache(1, 20)).logits
            accelerate(model)
            torch.testing.assert_close(model.prefill(prompt, model.new_cache(1, 20)).logits, plain, rtol=0, atol=TOL)
        tokens = ll.generate(model, prompt, 6, temperature=0.0, compile=False)
        from latentloop.inference.fast import FastDecoder

        assert FastDecoder(model).reason == native.NO_CXX  # compiled decoding falls back to the eager step
        assert ll.generate(model, prompt, 6, temperature=0.0, compile=True) == tokens
        quant.quantize_int8(model)
        assert len(ll.generate(model, prompt, 6, temperature=0.0, compile=False)[0]) == 6 and len(tokens[0]) == 6
    finally:
        for cached in (native.native_library, native._rows_library, quant._kernel):
            cached.cache_clear()
