"""The ahead-of-time CPU decode step (`latentloop.inference.aot`): what a package is made of and named by
(default suite, no compile), and packages compiled, reused and rebound to weights (slow: each
AOTInductor compile takes tens of seconds on two cores)."""

import copy
import ctypes
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import needs_cxx

import latentloop as ll
from latentloop.engine import model_options
from latentloop.inference import aot, native
from latentloop.inference.aot import AOT_ENV, AOT_SUBDIR, _attributes_as_buffers, cache_fields, flatten, package_key
from latentloop.inference.fast import FastDecoder, _decode_step

BOS = 256
PROMPT = torch.tensor([[BOS, 5, 9, 12, 40, 41]])
REPO = Path(__file__).resolve().parents[1]


def frozen(model, options=None, rows=1, needed=24):
    """A static cache after the prefill, frozen, its window set, as the first compiled step sees it."""
    options = model_options(model, options or {})
    fast = FastDecoder(model, compile=False, **options)
    cache = fast.new_cache(rows, needed)
    with torch.inference_mode():
        model.prefill(PROMPT.expand(rows, -1), cache, **options)
    fast.begin_decoding(cache)
    cache.set_window()
    return cache, options


def built(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return ll.build(arch, preset="test").eval()


@pytest.mark.parametrize("arch", ll.archs.ARCHS)
def test_cache_fields_flatten_and_restore_every_tensor_of_the_frozen_cache(arch):
    cache, _ = frozen(built(arch))
    fields = cache_fields(cache)
    names = {name for name, _, _ in fields}
    assert {"k_slots", "v_slots", "key_pos", "next_pos", "write_index", "window"} <= names
    if cache.state:
        assert "state" in names
    cache.window.fill_(float("nan"))  # uninitialised bytes may be NaNs (a CI run's were): always so here
    flat = flatten(cache, fields)
    assert all(isinstance(t, torch.Tensor) for t in flat)
    other = copy.copy(cache)
    aot.restore(other, fields, [t.clone() for t in flat])
    for mine, theirs in zip(flat, flatten(other, fields)):
        assert mine is not theirs  # every tensor went back where it came from: a clone, bit for bit
        # `window` is uninitialised (only its size is read): NaN equals NaN here.
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0, equal_nan=True)


def test_package_key_names_code_shapes_and_options_but_not_weight_values():
    first, second = built("gpt", seed=0), built("gpt", seed=1)
    cache, options = frozen(first)
    key = package_key(first, options, cache, cache_fields(cache))
    other_cache, _ = frozen(second)
    assert package_key(second, options, other_cache, cache_fields(other_cache)) == key  # another checkpoint
    two_rows, _ = frozen(first, rows=2)
    assert package_key(first, options, two_rows, cache_fields(two_rows)) != key
    cache.filled += 20  # a longer window below the buffer's length: the same package (a dynamic dimension)
    cache.set_window()
    assert package_key(first, options, cache, cache_fields(cache)) == key
    cache.filled = cache.max_len - 1  # the whole buffer: a package of its own
    cache.set_window()
    assert package_key(first, options, cache, cache_fields(cache)) != key
    fbt = built("fbt")
    fbt_cache, fbt_options = frozen(fbt)
    fused, fused_options = frozen(fbt, {"regime": "fused"})
    assert package_key(fbt, fbt_options, fbt_cache, cache_fields(fbt_cache)) != \
        package_key(fbt, fused_options, fused, cache_fields(fused))


def test_attributes_are_buffers_only_while_exported():
    model = built("fbt")
    model.prepare_fast_decoding()
    table = model._gate_table
    holder = aot._ExportedStep(model, {}, _decode_step)
    with _attributes_as_buffers(holder):
        assert dict(holder.named_buffers())["model._gate_table"] is table
    assert "_gate_table" not in dict(model.named_buffers()) and model._gate_table is table
    assert "_gate_table" not in model.state_dict()


@needs_cxx
def test_the_off_switch_keeps_dynamos_step_and_int8_weights_take_a_package(monkeypatch):
    from latentloop.inference.quant import quantize_int8

    model = built("gpt")
    assert FastDecoder(model).aot is not None
    monkeypatch.setenv(AOT_ENV, "0")
    assert FastDecoder(model).aot is None
    monkeypatch.delenv(AOT_ENV)
    quantize_int8(model)
    assert FastDecoder(model).aot is not None  # the int8 product is an inductor reduction in the package


@pytest.mark.parametrize("kernel", [True, False], ids=["int8 kernel", "no int8 kernel"])
def test_export_swaps_every_product_the_dynamo_backend_rewrites_and_restores_them(kernel, monkeypatch):
    """What `torch.export` traces and what dynamo's backend rewrites must be the same step: every
    rewritten call has its module attribute swapped while exporting, and put back after. The int8
    product stays the operator where the package can call its kernel, and is a reduction elsewhere."""
    from latentloop.inference import fast, quant

    if not kernel:
        monkeypatch.setattr(quant, "package_kernel", lambda: None)
    elif quant.package_kernel() is None:
        pytest.skip(f"no int8 kernel for packages here: {native.native_status(quant.KERNEL, for_packages=True)}")
    assert {(module, name) for module, name, _ in fast.EXPORT_SWAPS} == {
        (torch.nn.functional, "linear"), (torch.nn.functional, "scaled_dot_product_attention"), (quant, "int8_linear"),
        (fast, "widened")}  # the static cache's window reaches the package's attention as stored
    before = [getattr(module, name) for module, name, _ in fast.EXPORT_SWAPS]
    originals = {(module, name): original for (module, name, _), original in zip(fast.EXPORT_SWAPS, before)}
    with aot._products_as_reductions():
        for module, name, reduction in fast.EXPORT_SWAPS:
            kept = kernel and module is quant
            assert getattr(module, name) is (originals[(module, name)] if kept else reduction)
        assert (quant.int8_linear is fast._int8_linear_by_reduction) is not kernel
    assert [getattr(module, name) for module, name, _ in fast.EXPORT_SWAPS] == before
    shims = aot._kernel_config().get("aot_inductor.custom_ops_to_c_shims", {})
    assert (torch.ops.latentloop.int8_linear.default in shims) is kernel
    # a batch's float32 products call the rows kernel's C function wherever its package build loads
    assert (torch.ops.latentloop.rows_linear.default in shims) is (native.rows_package_kernel() is not None)
    # one-query attention over a float32 or float16 cache calls the attention kernel's C function where it loads
    assert ((torch.ops.latentloop.decode_attention.default in shims)
            is (native.attention_package_kernel() is not None))


# --------------------------------------------------------------------------------------------
# Compiled packages (slow)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def compile_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv(AOT_ENV, "1")
    return tmp_path / "inductor"


def compiled_and_eager(model, prompt, steps: int, **options):
    eager = ll.generate(model, prompt, steps, temperature=0.0, compile=False, **options)
    return ll.generate(model, prompt, steps, temperature=0.0, compile=True, **options), eager


@pytest.mark.slow
def test_a_package_reads_the_weights_of_the_model_it_runs_for(compile_dir):
    """One package for every checkpoint of a config: it must read the live weights, never those it
    was compiled beside (fbt: its gate table too, recomputed from the embeddings)."""
    first, second = built("fbt", seed=0), built("fbt", seed=1)
    prompt, steps = [BOS, 5, 9, 12, 40, 41], 24
    compiled, eager = compiled_and_eager(first, prompt, steps)
    assert compiled == eager
    packages = sorted((compile_dir / AOT_SUBDIR).glob("*.pt2"))
    assert len(packages) == 1
    compiled, eager = compiled_and_eager(second, prompt, steps)  # loads the first model's package
    assert compiled == eager and sorted((compile_dir / AOT_SUBDIR).glob("*.pt2")) == packages
    assert first.lm_head is None  # tied: scaling the embeddings changes the head and the gate table too
    with torch.no_grad():  # weights changed in place after loading: the next decode reads them
        first.wte.weight.mul_(-1.5)
    compiled, eager = compiled_and_eager(first, prompt, steps)
    assert compiled == eager


def test_a_decoder_that_is_gone_releases_its_cache_from_the_shared_step_and_no_other():
    """The package step is shared by a model's decoders of the same options and kept the last cache it
    was bound to (a finished generation's keys and values, 56 MiB at 4 layers, d 256, 4 rows of 1,800
    tokens) until the next compiled decode. A decoder that is gone lets go of its own cache, never of
    one another decoder bound since."""
    import gc
    import weakref

    model = built("gpt")
    step = aot.AotDecodeStep.__new__(aot.AotDecodeStep)
    first, _ = frozen(model)
    step._bound = type("Bound", (), {"cache": first})()
    decoder = FastDecoder(model, compile=False)
    decoder.aot, decoder.cache = step, first
    held = weakref.ref(first)
    del decoder, first
    gc.collect()
    assert step._bound is None and held() is None  # released, and nothing else kept the cache
    other, _ = frozen(model)
    step._bound = type("Bound", (), {"cache": other})()
    gone = FastDecoder(model, compile=False)
    gone.aot, gone.cache = step, frozen(model)[0]  # a decoder of another cache
    del gone
    gc.collect()
    assert step._bound.cache is other  # the decode bound since keeps its cache


@pytest.mark.slow
def test_a_compiled_generation_leaves_no_cache_bound_to_the_models_steps(compile_dir):
    """After `generate(compile=True)` returns, no package step of the model holds its cache."""
    from latentloop.inference.fast import compiled_steps

    model = built("gpt")
    assert ll.generate(model, [BOS, 5, 9, 12], 12, temperature=0.0, compile=True) == \
        ll.generate(model, [BOS, 5, 9, 12], 12, temperature=0.0, compile=False)
    steps = [step for step in compiled_steps(model).values() if isinstance(step, aot.AotDecodeStep)]
    assert steps and all(step._bound is None for step in steps)


AUTO_PROCESSES = 6  # each banks ~56 steps' saving; one was enough on a quiet machine


@pytest.mark.slow
def test_a_second_process_decodes_from_the_package_without_importing_dynamo(compile_dir, tmp_path):
    """The first process compiles (`compile=True`) and records what loading its package cost; a
    later one, with the default `compile="auto"`, expects that load, takes the compiled path after its
    probe steps, and never imports dynamo. The rule weighs measured times: on a loaded machine one
    process's saving may fall short of the load, and it banks the saving for the next (the test
    failed there with one "auto" process), so up to AUTO_PROCESSES run until one takes the package."""
    new_tokens = 56  # to the test preset's context of 64: the saving (~0.5 ms a step) well past the load
    model = built("gpt")
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    script = (
        "import json, sys, torch, latentloop as ll\n"
        "from latentloop.inference import fast\n"
        "torch.manual_seed(0)\n"
        "model = ll.build('gpt', preset='test').eval()\n"
        f"model.load_state_dict(torch.load({str(path)!r}))\n"
        "mode = {'True': True}.get(sys.argv[1], sys.argv[1])\n"
        f"tokens = ll.generate(model, {[BOS, 5, 9, 12]}, {new_tokens}, temperature=0.0, compile=mode)\n"
        "print(json.dumps({'tokens': tokens, 'dynamo': 'torch._dynamo' in sys.modules,\n"
        "                  'compiled': bool(fast._RAN_SHAPES.get(model))}))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def process(mode: str, temp: Path) -> dict:
        temp.mkdir()
        done = subprocess.run([sys.executable, "-c", script, mode], env={**env, "TMPDIR": str(temp)},
                              capture_output=True, text=True, check=True, timeout=900)
        return json.loads(done.stdout.splitlines()[-1])

    first = process("True", tmp_path / "temp-1")
    eager = ll.generate(model, [BOS, 5, 9, 12], new_tokens, temperature=0.0, compile=False)
    assert first["tokens"] == eager and first["compiled"] and first["dynamo"]  # compiling imports dynamo
    for attempt in range(AUTO_PROCESSES):
        later = process("auto", tmp_path / f"temp-auto-{attempt}")
        assert not list((tmp_path / f"temp-auto-{attempt}").iterdir())  # the loader's unpacked library removed
        assert later["tokens"] == eager and not later["dynamo"]  # loading the package does not import it
        if later["compiled"]:
            break
    assert later["compiled"], f"{AUTO_PROCESSES} processes with compile='auto' never took the package"


@pytest.mark.slow
def test_a_step_that_does_not_export_falls_back_to_dynamo(compile_dir, monkeypatch):
    real_export = torch.export.export

    def export_then_fail(*args, **kwargs):  # traced (and the inputs marked), then refused
        real_export(*args, **kwargs)
        raise RuntimeError("planted export failure")

    monkeypatch.setattr(torch.export, "export", export_then_fail)
    model = built("gpt", seed=2)
    heard: list[str] = []
    fast_tokens = ll.generate(model, [BOS, 5, 9, 12], 40, temperature=0.0, compile=True, on_compile=heard.append)
    assert fast_tokens == ll.generate(model, [BOS, 5, 9, 12], 40, temperature=0.0, compile=False)
    assert any("no ahead-of-time step" in line and "planted export failure" in line for line in heard), heard
    assert not list((compile_dir / AOT_SUBDIR).glob("*.pt2"))


@pytest.mark.slow
def test_a_batchs_package_calls_the_rows_kernel_and_decodes_the_eager_tokens(compile_dir):
    """At 8 rows (past the reductions' 4) the package's float32 products call the rows kernel's C
    function (as continuous batching's steps do), and the tokens are the eager decode's, whose
    products of 8 rows run through the same kernel."""
    import zipfile

    from latentloop.inference import native

    if native.rows_package_kernel() is None:
        pytest.skip(f"no rows kernel for packages here: {native.native_status(native.ROWS_KERNEL, for_packages=True)}")
    model = built("gpt")
    prompts = [[BOS, 5 + row, 9, 12, 40 + row] for row in range(8)]
    compiled, eager = compiled_and_eager(model, prompts, 24)
    assert compiled == eager
    (package,) = (compile_dir / AOT_SUBDIR).glob("*.pt2")
    with zipfile.ZipFile(package) as archive:
        code = "".join(archive.read(name).decode(errors="replace") for name in archive.namelist()
                       if name.endswith(".cpp"))
    assert "aoti_torch_cpu_rows_linear(" in code


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 2])
def test_a_packages_attention_calls_the_kernel_and_decodes_the_eager_tokens(compile_dir, rows):
    """A package's one-query attention over the float32 cache calls the attention kernel's C function,
    through windows past its blocks of keys and its vectors (a 40-token prompt, 24 steps), one row and
    a batch's rows (each with its own mask), and the tokens are the eager decode's (SDPA's)."""
    if native.attention_package_kernel() is None:
        pytest.skip(f"no attention kernel for packages here: "
                    f"{native.native_status(native.ATTENTION_KERNEL, for_packages=True)}")
    model = built("gpt")
    prompts = [[BOS, *((7 * i + row) % 250 for i in range(39))] for row in range(rows)]
    compiled, eager = compiled_and_eager(model, prompts if rows > 1 else prompts[0], 24)
    assert compiled == eager
    packages = list((compile_dir / AOT_SUBDIR).glob("*.pt2"))  # the window's step, and the whole buffer's
    assert packages
    for package in packages:
        with zipfile.ZipFile(package) as archive:
            code = "".join(archive.read(name).decode(errors="replace") for name in archive.namelist()
                           if name.endswith(".cpp"))
        assert "aoti_torch_cpu_decode_attention(" in code, package.name


@pytest.mark.parametrize("extra", ["model/data/aotinductor/model/extern_kernels.json",
                                   "model/data/aotinductor/model/second.wrapper.so"])
def test_a_package_the_library_loader_cannot_run_is_refused_before_loading_anything(tmp_path, extra):
    """Operators run through torch's proxy executor (a JSON file), or a second model library: not
    loaded through ctypes (the step would call a proxy executor it was never given), but refused,
    so that dynamo's step is used instead."""
    import zipfile

    path = tmp_path / "package.pt2"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model/data/aotinductor/model/abc.wrapper.so", b"not a library")
        archive.writestr("model/data/aotinductor/model/abc.wrapper_metadata.json", "{}")
        archive.writestr(extra, b"")
    with pytest.raises(aot.AotUnavailable, match=extra.rsplit("/", 1)[1].replace(".", r"\.")):
        aot._Library(path)


@pytest.mark.slow
def test_a_loaded_package_reads_weights_changed_in_place_and_lets_other_threads_run(compile_dir):
    """The package points at the model's own tensors (nothing copied): a decoder kept across a change
    made in place (`load_state_dict`, an optimizer step) decodes with the new weights. And its step
    releases the GIL: a server's HTTP thread runs while the step does."""
    model = built("gpt")
    cache, options = frozen(model, rows=8)
    reference = copy.deepcopy(cache)
    fast, eager = FastDecoder(model, compile=True, **options), FastDecoder(model, compile=False, **options)
    fast.attach(cache)
    eager.attach(reference)
    token = torch.arange(8) + 5
    with torch.inference_mode():
        for change in (None, 1.0, -1.5):
            if change is not None:
                with torch.no_grad():
                    model.blocks[0].mlp.c_fc.weight.mul_(change)
            logits, _, _ = fast.step(token)
            expected, _, _ = eager.step(token)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)  # summation order only
    (package,) = fast.aot.packages.values()
    inputs = [token, *flatten(cache, cache_fields(cache))]
    prepared = fast.aot._bound.prepared
    assert prepared is not None, native.native_status(aot.RUNNER, for_packages=True)
    with torch.inference_mode():
        before = [tensor.clone() for tensor in inputs[1:]]

    def restore() -> None:  # the cache as it was: each call writes a slot, and the 64 slots would run out
        with torch.inference_mode():
            for tensor, saved in zip(inputs[1:], before):
                tensor.copy_(saved)

    # both ways of calling a step: handles made per call (`_Library.run`), and made once (aot_run.c)
    for name, run in (("the library's run", lambda: package.library.run(inputs)), ("the prepared run", prepared.run)):
        assert main_thread_ran_inside_a_step(run, restore), f"{name} holds the GIL for the whole step"


def main_thread_ran_inside_a_step(run, restore, calls_between_restores: int = 25, budget_s: float = 20.0) -> bool:
    """Whether this thread held the GIL while a second thread, calling `run` over and over (`restore()`
    after every `calls_between_restores` calls, outside them) for up to `budget_s`, was inside a call.
    The switch interval is set far past the budget, so the GIL changes hands only where a thread gives
    it up: seeing a call in progress proves that the call gave it up, and a `run` that holds it is never
    seen inside (this thread then takes the GIL only between calls, in `restore`'s copies, or once the
    worker has stopped). This thread looks again (`time.sleep(0)` gives the GIL up) until it sees a call
    or the budget is spent, so a machine that schedules it late (another process on the other core)
    makes it look more often, not fail."""
    import threading
    import time

    saved = sys.getswitchinterval()
    sys.setswitchinterval(100 * budget_s)
    inside, stop = [False], [False]
    deadline = time.monotonic() + budget_s

    def steps() -> None:  # stops by itself at the deadline: a `run` holding the GIL never lets this thread stop it
        while not stop[0] and time.monotonic() < deadline:
            restore()
            for _ in range(calls_between_restores):
                with torch.inference_mode():
                    inside[0] = True
                    run()
                    inside[0] = False

    seen = False
    worker = threading.Thread(target=steps, daemon=True)
    try:
        worker.start()
        while not seen and time.monotonic() < deadline:
            time.sleep(0)
            seen = inside[0]
    finally:
        stop[0] = True
        worker.join()
        sys.setswitchinterval(saved)
    return seen


@pytest.mark.slow
def test_prepared_steps_decode_as_steps_that_make_their_handles_each_call(compile_dir, monkeypatch):
    """aot_run.c's prepared run (handles made once, outputs copied into the last step's tensors) against
    `_Library.run` (everything made per call), step by step over the same package: the same logits to
    the bit, across windows (every 16 steps: the window's handle swapped, no new binding) and with
    tokens that are not the last step's greedy ids (copied into the token's tensor)."""
    prepared_model = built("gpt")
    per_call_model = copy.deepcopy(prepared_model)  # a decoder of its own (one binding per model's step)
    runner = aot._runner
    decoders = []
    for model, use_runner in ((prepared_model, True), (per_call_model, False)):
        monkeypatch.setattr(aot, "_runner", runner if use_runner else lambda: None)
        cache, options = frozen(model, rows=2, needed=48)
        fast = FastDecoder(model, compile=True, **options)
        fast.attach(cache)
        decoders.append(fast)
    prepared, per_call = decoders
    runs, binds = [0], [0]
    prepared_run, bind = aot._PreparedRun.run, aot.AotDecodeStep._bind

    def counted(self) -> None:
        runs[0] += 1
        prepared_run(self)

    def counted_bind(self, token, cache):
        binds[0] += self is prepared.aot
        return bind(self, token, cache)

    monkeypatch.setattr(aot._PreparedRun, "run", counted)
    monkeypatch.setattr(aot.AotDecodeStep, "_bind", counted_bind)
    windows = set()
    prepared_token = per_call_token = torch.tensor([5, 9])
    steps = 40
    with torch.inference_mode():
        for step in range(steps):
            monkeypatch.setattr(aot, "_runner", runner)
            logits, greedy, _ = prepared.step(prepared_token)
            windows.add(prepared.cache.window.shape[0])
            monkeypatch.setattr(aot, "_runner", lambda: None)
            expected, expected_greedy, _ = per_call.step(per_call_token)
            torch.testing.assert_close(logits, expected, rtol=0, atol=0)  # one package, the same inputs
            assert torch.equal(greedy, expected_greedy)
            if step % 3 == 2:  # a token of its own, as sampling gives
                prepared_token = (expected_greedy + 7) % 256
                per_call_token = prepared_token.clone()
            else:  # the greedy ids passed back: the prepared run's own tensor
                prepared_token, per_call_token = greedy, expected_greedy
    assert per_call.aot._bound.prepared is None
    assert len(windows) >= 3 and max(windows) < prepared.cache.max_len  # windows of one dynamic package
    # every step but the first ran prepared: a new window swaps its input's handle (`_slide`), not a `_bind`
    assert (runs[0], binds[0]) == (steps - 1, 1), native.native_status(aot.RUNNER, for_packages=True)


class _FakeLibrary:
    """What `_PreparedRun` reads of a `_Library`, its run a Python function (see the test below)."""

    def __init__(self, run):
        self._lib = type("Lib", (), {"AOTInductorModelContainerRun": run})()
        self._handle = ctypes.c_void_p(0)

    def _fail(self, name: str) -> None:
        raise RuntimeError(f"{name} failed: the fake run said so")


def _runner_and_run_signature():
    """aot_run.c's function (the test skips where it does not build) and the C signature of a package's
    `AOTInductorModelContainerRun`, for a Python function to stand in for a package's library."""
    function = aot._runner()
    if function is None:
        pytest.skip(native.native_status(aot.RUNNER, for_packages=True))
    handle_array = ctypes.POINTER(ctypes.c_void_p)
    signature = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, handle_array, ctypes.c_size_t, handle_array,
                                 ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
    return function, signature


def test_a_prepared_run_hands_its_inputs_over_and_copies_each_output_into_its_tensor():
    """aot_run.c without a package: the container's run is a Python function with its C signature,
    which takes the input handles over and hands back outputs, as a package's library does."""
    function, signature = _runner_and_run_signature()
    behaviour = {"wrong shape": False, "fail": False}

    def run(container, inputs, n_inputs, outputs, n_outputs, stream, proxy):
        x, ids = aot._tensors([inputs[i] for i in range(n_inputs)])  # the inputs' handles, taken over
        if behaviour["fail"]:
            return 1
        logits = x * 2 + ids[:, None]  # (B, V)
        if behaviour["wrong shape"]:
            logits = torch.cat([logits, logits], dim=1)
        for j, handle in enumerate(aot._handles([logits, logits.argmax(-1)])):
            outputs[j] = handle
        return 0

    callback = signature(run)
    x, ids = torch.randn(2, 5), torch.tensor([1, 3])
    logits, greedy = torch.empty(2, 5), torch.empty(2, dtype=torch.long)
    prepared = aot._PreparedRun(_FakeLibrary(callback), function, [x, ids], [logits, greedy])
    for change in (0.0, 1.5):  # the held handles are the live tensors: a change in place is read
        x.add_(change)
        prepared.run()
        torch.testing.assert_close(logits, x * 2 + ids[:, None], rtol=0, atol=0)
        assert torch.equal(greedy, logits.argmax(-1))
    other = torch.randn(2, 5)  # a new window's tensor: only its input's handle is made again
    prepared.replace_input(0, other)
    prepared.run()
    torch.testing.assert_close(logits, other * 2 + ids[:, None], rtol=0, atol=0)
    x.add_(1.0)  # the old tensor is no longer read
    prepared.run()
    torch.testing.assert_close(logits, other * 2 + ids[:, None], rtol=0, atol=0)
    behaviour["wrong shape"] = True
    with pytest.raises(RuntimeError, match="differs from the tensor prepared for it"):
        prepared.run()
    behaviour.update({"wrong shape": False, "fail": True})
    with pytest.raises(RuntimeError, match="the fake run said so"):
        prepared.run()


class _FakeCache:
    """The fields of a cache `AotDecodeStep` reads: tensors (flattened by name: `keys`, then `window`),
    the buffer's length, and a window whose length is all a step reads of it."""

    def __init__(self, window_len: int, max_len: int = 64):
        self.keys = torch.arange(6.0).reshape(2, 3)
        self.window = torch.empty(window_len)
        self.max_len = max_len


def _fake_outputs(token, keys, window):
    """The fake step: logits (B, 4) that depend on the token, the keys and the window's length."""
    logits = keys.sum() + window.shape[0] + token.float()[:, None] * torch.arange(1.0, 5.0)
    return logits, logits.argmax(-1)


def test_a_new_window_of_the_same_cache_swaps_only_the_windows_handle(monkeypatch):
    """`AotDecodeStep` without a package (a Python step behind aot_run.c): a new window of the same cache
    is taken by `_slide` (its handle swapped in the prepared run, the outputs the same tensors), never a
    new `_bind`, and the step reads the new window, not the old one."""
    function, signature = _runner_and_run_signature()

    def prepared_run(container, inputs, n_inputs, outputs, n_outputs, stream, proxy):
        for j, handle in enumerate(aot._handles(list(_fake_outputs(*aot._tensors([inputs[i]
                                                                                  for i in range(n_inputs)]))))):
            outputs[j] = handle
        return 0

    callback = signature(prepared_run)
    library = _FakeLibrary(callback)
    library.run = lambda inputs: list(_fake_outputs(*inputs))  # the first step's per-call run
    package = type("Package", (), {"library": library, "info": {"fake": True}, "checked": True})()
    step = aot.AotDecodeStep.__new__(aot.AotDecodeStep)
    step.packages, step._bound = {}, None
    cache = _FakeCache(window_len=16)
    step.packages[step._shape([cache.keys, cache.window], cache.window, cache.max_len)] = package
    binds = []
    bind = aot.AotDecodeStep._bind
    monkeypatch.setattr(aot.AotDecodeStep, "_bind", lambda self, token, c: binds.append(1) or bind(self, token, c))
    token = torch.tensor([1, 2])
    logits, greedy, info = step(None, token, cache, {})
    assert info == {"fake": True} and len(binds) == 1
    outputs = (logits, greedy)
    for window_len in (16, 32, 48):  # the same window, then two new ones (a step every 16 slots)
        if window_len != cache.window.shape[0]:
            cache.window = torch.empty(window_len)
        expected_logits, expected_greedy = _fake_outputs(greedy.clone(), cache.keys, cache.window)
        logits, greedy, _ = step(None, greedy, cache, {})  # the greedy ids passed back as the token
        assert logits is outputs[0] and greedy is outputs[1]  # the prepared run's own tensors, written again
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)  # the new window is read
        assert torch.equal(greedy, expected_greedy)
    assert len(binds) == 1  # windows slid, never bound again
    cache.keys, cache.window = cache.keys.clone(), torch.empty(16)  # a resize: new tensors, bound again
    logits, _, _ = step(None, greedy, cache, {})
    assert len(binds) == 2
    torch.testing.assert_close(logits, _fake_outputs(greedy, cache.keys, cache.window)[0], rtol=0, atol=0)


def test_a_packages_metadata_is_read_from_its_archive_beside_its_library(tmp_path):
    """The metadata (the step's `info`, the device) is the JSON inductor writes beside the model library
    in the package's archive, read without torch's private loader; a package without it is refused."""
    path = tmp_path / "package.pt2"
    library = "tmpx/data/aotinductor/model/abc.wrapper.so"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(library, b"")
        archive.writestr("tmpx/data/aotinductor/model/abc.wrapper_metadata.json",
                         json.dumps({aot.INFO_KEY: '{"passes": 2}', "AOTI_DEVICE_KEY": "cpu"}))
        archive.writestr("tmpx/data/aotinductor/model/k.kernel_metadata.json", json.dumps({"other": "x"}))
    with zipfile.ZipFile(path) as archive:
        assert aot._package_metadata(archive, library) == {aot.INFO_KEY: '{"passes": 2}', "AOTI_DEVICE_KEY": "cpu"}
        with pytest.raises(aot.AotUnavailable, match="metadata"):
            aot._package_metadata(archive, "tmpx/data/aotinductor/model/missing.wrapper.so")


def test_torchs_own_leaf_spec_deprecation_is_silenced_while_a_package_is_made_and_nothing_else():
    """Exporting and packaging deep-copy tree specs, and torch 2.13 warns on every copy of a leaf's
    (its own deprecation, printed in the middle of `latentloop generate`'s output): inside the context
    the package is made in, that warning is gone and any other still shows."""
    import copy
    import warnings

    from torch.utils._pytree import tree_flatten

    spec = tree_flatten((1,))[1]
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        copy.deepcopy(spec)
    if not any("LeafSpec" in str(w.message) for w in outside):
        pytest.skip("this torch does not warn on copying a leaf's tree spec")
    with warnings.catch_warnings(record=True) as inside:
        warnings.simplefilter("always")
        with aot._without_torch_leaf_spec_warning():
            copy.deepcopy(spec)
            warnings.warn("another deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in inside] == ["another deprecation"]
