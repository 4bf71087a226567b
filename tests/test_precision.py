"""bf16 emulated through float32 kernels (`latentloop.precision`) against torch's own bf16 autocast.

Both round each product's inputs and output to bf16 and sum in float32; only the order of the sums
may differ. So every result may differ from autocast's by one bf16 rounding (a relative 2**-7 at
most) on a few elements, and by nothing else: an emulation that skipped a rounding (inputs or
output) would differ on most elements, one that rounded twice or in the wrong place by more.
"""

import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F

from latentloop import precision
from latentloop.precision import bf16_product, emulated_bf16_autocast

BF16_ROUNDING = 2.0**-7  # the largest relative gap between two neighbouring bf16 numbers
# Elements whose float32 sums, summed in another order, land on the other side of a bf16 rounding
# boundary: 1e-5 to 3e-4 of them in these shapes (the rest are bit for bit autocast's)
MAX_DIFFERING_SHARE = 0.01


def _assert_within_one_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.detach(), expected.detach()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=BF16_ROUNDING,
                               atol=BF16_ROUNDING * float(expected.float().abs().max()) * 2**-8)
    share = float((actual != expected).float().mean())
    assert share <= MAX_DIFFERING_SHARE, f"{share:.2%} of the elements differ from autocast's"


def _saved_bytes(run) -> int:
    """The bytes autograd keeps for the backward while `run()` runs its forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def _layer_pair(context):
    """Two linear layers sharing a weight (its gradients meet, as a shared core's do), with a bias,
    forward and backward under `context`: outputs and every gradient."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 96, 64, generator=gen, requires_grad=True)
    w = torch.randn(64, 64, generator=gen, requires_grad=True)
    b = torch.randn(64, generator=gen, requires_grad=True)
    with context:
        first = F.linear(x, w, b)  # (4, 96, 64) bf16
        second = F.linear(first.float().relu(), w)  # the same weight again
        loss = first.float().square().mean() + second.float().sin().sum()
    loss.backward()
    return first, second, x.grad, w.grad, b.grad


def test_an_emulated_linear_is_autocasts_bf16_linear_up_to_the_order_of_its_sums():
    expected = _layer_pair(torch.autocast("cpu", dtype=torch.bfloat16))
    actual = _layer_pair(emulated_bf16_autocast())
    assert actual[0].dtype == torch.bfloat16 and actual[2].dtype == torch.float32
    for got, want in zip(actual, expected):
        _assert_within_one_rounding(got, want)


def test_float32_products_are_not_an_emulation():
    """The check above can fail: float32 throughout (no rounding) differs on most elements."""
    expected = _layer_pair(torch.autocast("cpu", dtype=torch.bfloat16))
    plain = _layer_pair(torch.autocast("cpu", enabled=False))
    with pytest.raises(AssertionError):
        _assert_within_one_rounding(plain[2].to(expected[2].dtype), expected[2])


def test_the_emulation_keeps_what_autocast_keeps_for_the_backward():
    """The same bytes saved for the backward as autocast's (bf16 inputs and weights, the weight cast
    once), so a step's memory is what the estimate says."""
    assert _saved_bytes(lambda: _layer_pair(emulated_bf16_autocast())) == _saved_bytes(
        lambda: _layer_pair(torch.autocast("cpu", dtype=torch.bfloat16)))


def _linear_backward_name() -> str:
    x, w = torch.randn(3, 4), torch.randn(5, 4, requires_grad=True)
    return type(F.linear(x, w).grad_fn).__name__


def test_autocasts_own_linear_is_back_after_the_region_nested_or_not():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = _linear_backward_name()
    with emulated_bf16_autocast():
        assert _linear_backward_name() == "_Bf16LinearBackward" != stock
        with emulated_bf16_autocast():
            assert _linear_backward_name() == "_Bf16LinearBackward"
        assert _linear_backward_name() == "_Bf16LinearBackward"  # the inner region's exit undid nothing
        with torch.autocast("cpu", enabled=False):  # autocast off inside: float32, as it says
            assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _linear_backward_name() == stock
    assert not precision.emulating()


def test_another_threads_autocast_is_torchs_own_while_a_region_is_open():
    """The emulation is this thread's (a torch function mode): a thread running torch's autocast
    meanwhile gets torch's linear, and nothing the process shares is rewritten under it."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = _linear_backward_name()
    seen, errors = [], []

    def other():
        try:
            for _ in range(200):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    seen.append(_linear_backward_name())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    for _ in range(200):  # regions opened and closed while the other thread runs
        with emulated_bf16_autocast():
            assert _linear_backward_name() == "_Bf16LinearBackward"
    thread.join(timeout=60)
    assert not errors and set(seen) == {stock}


def test_an_error_inside_the_region_leaves_no_emulation_behind():
    with pytest.raises(RuntimeError, match="boom"):
        with emulated_bf16_autocast():
            raise RuntimeError("boom")
    assert not precision.emulating()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _linear_backward_name() != "_Bf16LinearBackward"


def test_a_weight_cast_under_no_grad_does_not_cut_its_later_gradient():
    """rgpt's truncated backpropagation runs its first core steps under no_grad and the rest with
    autograd, in one region: a cast kept from the no_grad use would leave the shared core without a
    gradient, silently."""
    import latentloop as ll

    model = ll.build("rgpt", preset="test", truncate_steps=1)
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def gradients(context) -> dict[str, torch.Tensor | None]:
        model.zero_grad(set_to_none=True)
        with context:
            logits = model(x, steps=3, no_grad_steps=1).logits
        logits.float().logsumexp(-1).mean().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    expected = gradients(torch.autocast("cpu", dtype=torch.bfloat16))
    actual = gradients(emulated_bf16_autocast())
    assert {n for n, g in actual.items() if g is None} == {n for n, g in expected.items() if g is None}
    for name, grad in expected.items():
        if grad is not None:
            torch.testing.assert_close(actual[name], grad, rtol=0.05, atol=1e-3, msg=name)


def test_a_weight_changed_between_regions_is_cast_again():
    """An optimizer step changes the weights in place between two steps' regions: the second region
    must not use the first's cast."""
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4)
    with emulated_bf16_autocast():
        F.linear(x, w)
    with torch.no_grad():
        w.mul_(2.0)
    with emulated_bf16_autocast():
        after = F.linear(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, w)
    _assert_within_one_rounding(after, expected)


@pytest.mark.parametrize("frozen", ["input", "weight"])
def test_only_what_the_backward_needs_is_kept(frozen):
    """Autocast's linear keeps the input for the weight's gradient and the weight for the input's:
    with one of them frozen, only the other's tensor."""
    def one_linear(context) -> None:
        x = torch.randn(16, 32, requires_grad=frozen != "input")
        w = torch.randn(64, 32, requires_grad=frozen != "weight")
        with context:
            F.linear(x, w)

    assert _saved_bytes(lambda: one_linear(emulated_bf16_autocast())) == _saved_bytes(
        lambda: one_linear(torch.autocast("cpu", dtype=torch.bfloat16)))


def test_a_bias_on_a_non_contiguous_input_is_rounded_as_autocast_rounds_it():
    """at::linear adds the bias inside the product for a contiguous input, and after it (a second
    rounding) for a non-contiguous one; the emulation follows both."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(48, 4, 64, generator=gen).transpose(0, 1)  # (4, 48, 64), not contiguous
    w, b = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen) * 10
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, w, b)
    with emulated_bf16_autocast():
        actual = F.linear(x, w, b)
    _assert_within_one_rounding(actual, expected)


def test_what_the_emulation_does_not_cover_goes_to_autocast_as_is():
    """A float64 input against a float32 weight is refused by autocast's linear, and so here; a
    vector weight is computed as autocast computes it."""
    with emulated_bf16_autocast(), pytest.raises(RuntimeError):
        F.linear(torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4))
    x, v = torch.randn(3, 4), torch.randn(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, v)
    with emulated_bf16_autocast():
        torch.testing.assert_close(F.linear(x, v), expected, rtol=0, atol=0)


def test_activation_checkpointing_recomputes_the_emulated_forward():
    """The recomputation runs in the backward, after the region closed: it must emulate as the forward
    did (else it saves other tensors and torch's checkpoint refuses), and give the same gradients as
    the step without checkpointing, bit for bit."""
    import latentloop as ll
    from latentloop.parallel import apply_activation_checkpointing

    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def gradients(checkpointed: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = ll.build("gpt", preset="test")
        if checkpointed:
            apply_activation_checkpointing(model)
        with emulated_bf16_autocast():
            logits = model(x).logits
        logits.float().logsumexp(-1).mean().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, recomputed = gradients(False), gradients(True)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0, msg=name)


def test_a_compiled_checkpointed_step_still_compiles():
    """Under torch.compile a checkpoint's context_fn must give dispatch modes: the compiled blocks take
    none (and emulate nothing), in float32 and in bf16 alike (aot_eager: dynamo's and AOT's tracing,
    eager kernels)."""
    import latentloop as ll
    from latentloop.config import TrainConfig
    from latentloop.parallel import wrap_model

    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for dtype in ("float32", "bfloat16"):
        torch._dynamo.reset()
        model = ll.build("gpt", preset="test")
        config = TrainConfig(compile=True, compile_backend="aot_eager", compile_scope="blocks",
                             activation_checkpointing=True, dtype=dtype)
        compiled = wrap_model(model, config, torch.device("cpu"))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = compiled(x).logits
        logits.float().logsumexp(-1).mean().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_linear_called_by_keywords_is_emulated_too():
    x, w = torch.randn(3, 4), torch.randn(5, 4, requires_grad=True)
    with emulated_bf16_autocast():
        out = F.linear(input=x, weight=w)
    assert type(out.grad_fn).__name__ == "_Bf16LinearBackward"


def test_the_region_is_the_threads_own():
    """Another thread sees no region of this thread's (its own state: no emulation, no cache)."""
    seen = []
    with emulated_bf16_autocast():
        thread = threading.Thread(target=lambda: seen.append(precision.emulating()))
        thread.start()
        thread.join(timeout=30)
        assert precision.emulating()
    assert seen == [False]


def _weight_cast_nodes(context, uses) -> int:
    """How many distinct casts of one weight `uses` run under `context` (each a callable taking the
    weight): one when the cast is kept for the region, one per use when it is not."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    nodes = set()
    with emulated_bf16_autocast(), context:
        for use in uses:
            out = use(x, w)
            if out.grad_fn is not None:
                nodes.add(out.grad_fn.next_functions[1][0])  # the weight's cast (_Bf16Linear's inputs: x, w, b)
    return len(nodes)


def test_a_weight_is_cast_once_per_region_unless_autocast_says_not_to_cache():
    twice = [F.linear, F.linear]
    assert _weight_cast_nodes(contextlib.nullcontext(), twice) == 1
    # autocast's own switch: a region inside with cache_enabled=False casts on every use
    assert _weight_cast_nodes(torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), twice) == 2


def test_a_cast_under_inference_mode_is_not_kept_either():
    def inference_use(x, w):
        with torch.inference_mode():
            F.linear(x, w)
        return F.linear(x, w)  # then with autograd: its own cast, with a gradient path

    w = torch.randn(4, 4, requires_grad=True)
    with emulated_bf16_autocast():
        with torch.inference_mode():
            F.linear(torch.randn(2, 4), w)
        out = F.linear(torch.randn(2, 4), w)
    out.float().sum().backward()
    assert w.grad is not None and torch.count_nonzero(w.grad) > 0
    assert _weight_cast_nodes(contextlib.nullcontext(), [inference_use, F.linear]) == 1


@pytest.mark.parametrize("shape", [(72, 288), (3, 48, 72)])
def test_a_bf16_product_is_torchs_bf16_matmul_up_to_the_order_of_its_sums(shape):
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(shape, generator=gen).bfloat16()
    b = torch.randn(shape, generator=gen).bfloat16().mT
    _assert_within_one_rounding(bf16_product(a, b), a @ b)


def test_muons_emulated_iteration_stays_within_the_bf16_iterations_reach():
    """Newton-Schulz through `bf16_product`: every product rounded as torch's bf16 matmul rounds it.
    Five iterations amplify the order of the sums, so the result is compared as the bf16 iteration is
    compared with float32's (tests/test_optim.py): far closer to torch's bf16 iteration than to float32's."""
    from latentloop.optim import orthogonalize

    G = torch.randn(288, 72, generator=torch.Generator().manual_seed(2))
    stock = orthogonalize(G, 5, torch.bfloat16)
    emulated = orthogonalize(G, 5, torch.bfloat16, emulate_bf16=True)
    exact = orthogonalize(G, 5, torch.float32)

    def gap(x, y):
        return float(torch.linalg.matrix_norm(x - y) / torch.linalg.matrix_norm(y))

    assert gap(emulated, stock) < gap(stock, exact) / 4


def test_muon_emulates_only_on_a_cpu_without_bf16_instructions(monkeypatch):
    import latentloop as ll
    from latentloop import optim
    from latentloop.config import TrainConfig

    model = ll.build("gpt", preset="test")
    config = TrainConfig(optimizer="muon", dtype="bfloat16")
    monkeypatch.setattr(optim, "cpu_bf16_support", lambda: None)
    assert optim.build_optimizers(model, config, "bfloat16")[1].ns_emulate_bf16
    assert not optim.build_optimizers(model, config, "float32")[1].ns_emulate_bf16  # float32: nothing to emulate
    # compiled (train.compile): inductor would drop the round trips, so torch's own bf16 products
    compiled = TrainConfig(optimizer="muon", dtype="bfloat16", compile=True, compile_backend="eager")
    assert not optim.build_optimizers(model, compiled, "bfloat16")[1].ns_emulate_bf16
    monkeypatch.setattr(optim, "cpu_bf16_support", lambda: "amx_bf16")
    assert not optim.build_optimizers(model, config, "bfloat16")[1].ns_emulate_bf16


def test_autocast_for_emulates_bf16_only_where_the_cpu_lacks_it(monkeypatch):
    from latentloop import runtime

    cpu = torch.device("cpu")
    monkeypatch.setattr(runtime, "cpu_bf16_support", lambda: None)
    with runtime.autocast_for(cpu, "bfloat16"):
        assert _linear_backward_name() == "_Bf16LinearBackward"
    with runtime.autocast_for(cpu, "bfloat16", emulate=False):  # a compiled model: torch's autocast
        assert _linear_backward_name() != "_Bf16LinearBackward"
    with runtime.autocast_for(cpu, "auto"):  # fp32 here
        assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float32
    monkeypatch.setattr(runtime, "cpu_bf16_support", lambda: "amx_bf16")  # the instructions: torch's own
    with runtime.autocast_for(cpu, "bfloat16"):
        assert _linear_backward_name() != "_Bf16LinearBackward"


def test_a_bf16_training_step_on_a_cpu_without_bf16_takes_the_emulation(corpus, tmp_path, monkeypatch):
    """The trainer's step and its validation go through `autocast_for` with the emulation (the suite
    hides the CPU's bf16 instructions, tests/conftest.py)."""
    from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
    from latentloop.train import fit, setup, validate

    calls = []  # whether autograd was on: the training step's forward, or validation's
    original = precision._Bf16Linear.apply
    monkeypatch.setattr(precision._Bf16Linear, "apply",
                        lambda *args: calls.append(torch.is_grad_enabled()) or original(*args))
    config = RunConfig(model=model_config("gpt", "test", sequence_len=32),
                       train=TrainConfig(steps=2, batch_size=2, dtype="bfloat16", device="cpu", eval_every=0),
                       data=DataConfig(source=f"text:{corpus}"))
    state = setup(config, tmp_path / "run", progress=False)
    fit(state, progress=False)
    assert True in calls, "no linear layer of the bf16 training step ran emulated"
    calls.clear()
    validate(state, max_batches=1)
    assert calls and not any(calls), "validation's linear layers did not run emulated"
