"""What the benchmarks' figures rest on: the contention meter must not count the benchmark's own
helper processes (inductor's compile workers, torchrun's ranks) as other load on the machine, and
the training floor must compute exactly the products and attention of a real training step."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import shared_data

ROOT = Path(__file__).resolve().parents[1]
CHILD_CPU_S = 0.5  # CPU seconds the child burns before it reports
# the child spins on its own CPU clock, so on a loaded machine it still burns CPU_S of CPU time
CHILD = f"""
import sys, time
start = time.process_time()
while time.process_time() - start < {CHILD_CPU_S}:
    pass
print("done", flush=True)
sys.stdin.read()  # stay alive until the parent closes stdin
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_own_cpu_seconds_include_live_children():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.common import _own_cpu_seconds
    finally:
        sys.path.remove(str(ROOT))
    before = _own_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        alive = _own_cpu_seconds() - before
        assert alive >= CHILD_CPU_S * 0.9  # the child's time, while it is alive
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    reaped = _own_cpu_seconds() - before  # now in RUSAGE_CHILDREN instead: counted once, not twice
    assert alive * 0.9 <= reaped <= alive * 1.5 + 0.05, (alive, reaped)


def test_the_training_floor_runs_the_products_and_attention_of_a_training_step():
    """The matmuls and attention kernels (with their operand shapes) of one floor step are those
    of our gpt's forward + backward at the same shape: none missing, none extra."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.baseline import N_LAYER, VOCAB, build_model, training_floor_step
    finally:
        sys.path.remove(str(ROOT))

    class Kernels(TorchDispatchMode):
        """(op, operand shapes) of every matmul and attention kernel dispatched."""

        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name == "mm" or name.startswith("_scaled_dot_product"):
                self.seen[name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))] += 1
            return func(*args, **(kwargs or {}))

    seq_len, batch = 32, 2
    model = build_model(seq_len, seed=0)
    with Kernels() as floor:
        training_floor_step(model, seq_len, batch)(0)
    idx = torch.randint(0, VOCAB, (batch, seq_len))
    with Kernels() as step:
        model(idx).logits.sum().backward()
    assert sum(n for (name, _), n in step.seen.items() if name.startswith("_scaled_dot_product")) == 2 * N_LAYER
    assert floor.seen == step.seen



def _benchmark(name: str):
    """The module `benchmarks.NAME` of this checkout (the folder is not an installed package)."""
    import importlib

    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(f"benchmarks.{name}")
    finally:
        sys.path.remove(str(ROOT))


def test_time_to_quality_finds_the_first_kept_state_at_the_target_by_bisection():
    ttq = _benchmark("time_to_quality")
    values = [5.0, 4.0, 3.5, 3.0, 2.875, 2.5, 2.375, 2.0]  # val BPB of each kept state, falling (exact in fp32)

    class Bench:  # evaluates a state as its one weight's value, counting the evaluations
        calls = 0

        def val_bpb(self, model):
            Bench.calls += 1
            return float(model.weight)

    model = torch.nn.Linear(1, 1, bias=False)
    kept = [(10 * (i + 1), 1.5 * (i + 1), {"weight": torch.tensor([[v]])}) for i, v in enumerate(values)]
    assert ttq.first_reaching(Bench(), model, kept, 2.95) == (50, 7.5, 2.875)
    assert Bench.calls <= 1 + 3  # the last state, then log2(8) bisection steps
    assert ttq.first_reaching(Bench(), model, kept, 5.0) == (10, 1.5, 5.0)
    assert ttq.first_reaching(Bench(), model, kept, 1.9) is None


def test_time_to_quality_runs_every_registered_arch_against_nanogpt(tmp_path):
    """A few steps on a small corpus: a row per registered arch, the target is nanoGPT's BPB, and each
    figure is nanoGPT's time over the time of the first kept state at or below it."""
    from latentloop.archs import ARCHS

    ttq = _benchmark("time_to_quality")
    if ttq.load_nanogpt() is None:
        pytest.skip("../shared/anchors/nanogpt_model.py is absent")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}\n" for i in range(400)))
    steps, check_every = 24, 6  # past latentloop's 20 warmup steps
    out = tmp_path / "ttq.json"
    assert ttq.main(["--preset", "test", "--data", f"text:{corpus}", "--steps", str(steps), "--repeats", "2",
                     "--batch-size", "2", "--check-every", str(check_every), "--threads", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"nanogpt", *(f"{arch}/default" for arch in ARCHS)}
    first, second = runs["nanogpt"]
    assert first["train_s"] > 0 and math.isfinite(first["val_bpb"])
    assert not second["evaluated"] and second["val_bpb"] == first["val_bpb"]  # the same weights, bit for bit
    for arch in ARCHS:
        rows = runs[f"{arch}/default"]
        assert rows[0]["target_bpb"] == first["val_bpb"] and rows[0]["precision"] == "float32"
        assert rows[0]["steps_run"] == steps and math.isfinite(rows[0]["final_bpb"])
        if not rows[0]["reached"]:
            assert len(rows) == 1  # nothing to time again
            continue
        assert len(rows) == 2 and rows[1]["steps_run"] == rows[1]["step"] == rows[0]["step"]
        assert not rows[1]["evaluated"]  # deterministic: the first repeat's weights at that step again
        for row, nano in zip(rows, (first, second)):
            assert row["step"] % check_every == 0 and row["step"] <= steps
            assert row["val_bpb"] <= row["target_bpb"] and row["time_s"] <= row["train_s"]
            assert row["speedup"] == pytest.approx(nano["train_s"] / row["time_s"])


def _engines_smoke(tmp_path, capsys, chosen: list[str]) -> None:
    """`python -m benchmarks.engines` at a tiny shape: every row it can run is timed and its greedy
    tokens agree with latentloop eager's (fp32 engines, the same exported weights); the engines it
    cannot run are rows with a note, not errors."""
    import json

    engines = _benchmark("engines")
    out = tmp_path / "engines.json"
    assert engines.main(["--shape", "smoke", "--prompt-len", "4", "--new-tokens", "6", "--repeats", "1",
                         "--settle", "0", "--engines", ",".join(chosen), "--json", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["smoke / prompt 4"]
    rows = case["threads"]["1"]
    assert list(rows) == chosen
    ceiling = case["read_ceiling"]["1"]  # measured in the run, or why not
    assert case["weight_bytes"] > 0 and (isinstance(ceiling, str) or min(ceiling) > 0)
    paired = "llama.cpp" in chosen and engines.unavailable("llama.cpp") is None
    for engine in chosen:
        if engines.unavailable(engine) is not None:
            assert "not installed (pip install" in rows[engine]["note"]
            continue
        assert rows[engine]["ms_per_token"] > 0
        assert len(rows[engine]["first_token_ms_all"]) == len(rows[engine]["decode_ms_per_token_all"]) == 1
        if paired:  # every row, llama.cpp's own included (1.0), paired with llama.cpp's round
            assert len(rows[engine]["over_llama_cpp_all"]) == 1 and rows[engine]["verdict"] == "one round"
        if "int8" in engine:  # int8 follows latentloop's eager int8 decode (the float one it may leave)
            assert rows[engine]["agree_int8"] == 6, (engine, rows[engine])
        else:
            assert rows[engine]["agree"] == 6 and "agree_int8" not in rows[engine], (engine, rows[engine])
        assert paired or "over_llama_cpp_all" not in rows[engine]  # nothing to pair with
    assert f"| {chosen[-1]}" in capsys.readouterr().out


def _rope(x, positions, pairs):
    """Rotary embedding of x (T, heads, head_dim) where `pairs` names each rotated pair's two dims:
    "halves" (j, j + head_dim / 2), Hugging Face's; "adjacent" (2j, 2j + 1), llama.cpp's."""
    half = x.shape[-1] // 2
    angle = positions[:, None, None] / 10000.0 ** (torch.arange(half) / half)  # (T, 1, half)
    a, b = (x[..., :half], x[..., half:]) if pairs == "halves" else (x[..., 0::2], x[..., 1::2])
    a, b = a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()
    return torch.cat([a, b], -1) if pairs == "halves" else torch.stack([a, b], -1).flatten(-2)


def test_the_gguf_layout_gives_llama_cpp_the_same_attention_scores():
    """Reordered q / k rows under llama.cpp's adjacent-pair rotation give the attention scores the
    original rows give under Hugging Face's half-split rotation."""
    engines = _benchmark("engines")
    torch.manual_seed(0)
    heads, head_dim, d, T = 3, 8, 12, 5
    wq, wk, x = torch.randn(heads * head_dim, d), torch.randn(heads * head_dim, d), torch.randn(T, d)
    positions = torch.arange(T, dtype=torch.float32)

    def scores(wq, wk, pairs):
        q = _rope((x @ wq.T).view(T, heads, head_dim), positions, pairs)
        k = _rope((x @ wk.T).view(T, heads, head_dim), positions, pairs)
        return torch.einsum("qhd,khd->hqk", q, k)  # (heads, T, T)

    moved = [torch.from_numpy(engines.interleave_rotary_halves(w.numpy(), heads)) for w in (wq, wk)]
    torch.testing.assert_close(scores(*moved, "adjacent"), scores(wq, wk, "halves"), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(scores(wq, wk, "adjacent"), scores(wq, wk, "halves"), atol=1e-2)  # order matters


def test_write_gguf_holds_every_tensor_and_the_shape(tmp_path):
    gguf = pytest.importorskip("gguf")
    engines = _benchmark("engines")
    model, _, hf_dir = engines.build_export(engines.SHAPES["smoke"], 16, 0, tmp_path)
    engines.write_gguf(hf_dir, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    layers = engines.SHAPES["smoke"]["n_layer"]
    assert len(tensors) == 3 + 9 * layers and {f"blk.{layers - 1}.ffn_down.weight", "output.weight"} <= set(tensors)
    assert tensors["token_embd.weight"].data.tobytes() == model.state_dict()["wte.weight"].numpy().tobytes()
    field = reader.fields["tokenizer.ggml.model"]
    assert bytes(field.parts[field.data[0]]).decode() == "none"
    assert int(reader.fields["llama.block_count"].parts[-1][0]) == layers


def test_engines_benchmark_smoke(tmp_path, capsys):
    _engines_smoke(tmp_path, capsys, ["latentloop eager", "latentloop eager int8", "llama.cpp"])


def test_llama_cpp_evaluates_the_whole_prompt_on_every_call():
    """llama-cpp-python's `generate` reuses the previous call's tokens (its longest common prefix with
    the new prompt is not evaluated again): the benchmark's call resets it first, so each timed call
    prefills the whole prompt as every other engine does. A fake that behaves as llama-cpp-python
    does counts the prompt tokens each call evaluates."""
    engines = _benchmark("engines")

    class PrefixCachingLlama:
        def __init__(self):
            self.kept: list[int] = []
            self.evaluated: list[int] = []

        def reset(self):
            self.kept = []

        def generate(self, tokens, top_k, temp, reset):
            assert top_k == 1 and temp == 0.0
            common = 0
            for a, b in zip(self.kept, tokens[:-1]):  # its prefix match leaves at least the last token
                if a != b:
                    break
                common += 1
            self.evaluated.append(len(tokens) - common)
            self.kept = list(tokens)
            token = 7
            while True:
                yield token
                self.kept.append(token)
                token += 1

    llm, prompt = PrefixCachingLlama(), [1, 5, 6, 9]
    assert engines.llama_greedy(llm, prompt, 3) == [7, 8, 9]
    assert engines.llama_greedy(llm, prompt, 1) == [7]
    assert llm.evaluated == [4, 4]  # without the reset, the second call evaluates 1 token


def test_the_engines_timing_splits_the_first_token_from_the_decode():
    """Rounds of (seconds for N new tokens, seconds for the first only): per token of the whole call,
    the first token in ms, and the decode after it per token."""
    engines = _benchmark("engines")
    entry = engines.timing_entry([(0.021, 0.003), (0.030, 0.012)], new_tokens=10)
    assert entry["ms_per_token_all"] == pytest.approx([2.1, 3.0]) and entry["ms_per_token"] == pytest.approx(2.55)
    assert entry["first_token_ms_all"] == pytest.approx([3.0, 12.0])
    assert entry["decode_ms_per_token_all"] == pytest.approx([2.0, 2.0])
    assert "decode_ms_per_token_all" not in engines.timing_entry([(0.01, 0.01)], new_tokens=1)


def test_an_engine_is_called_faster_than_llama_cpp_only_when_its_interval_says_so():
    """Whole calls paired by round with llama.cpp's: the mean ratio's t interval decides; rounds that
    go both ways leave it undecided."""
    engines = _benchmark("engines")
    llama = [(1.0, 0.1), (2.0, 0.1), (1.5, 0.1), (1.2, 0.1)]
    faster = engines.paired_with([(0.8 * w + 0.01 * i, f) for i, (w, f) in enumerate(llama)], llama)
    assert faster["verdict"] == "faster" and faster["over_llama_cpp"]["high"] < 1
    assert faster["over_llama_cpp_all"] == pytest.approx([0.8, 0.805, 0.81333, 0.825], rel=1e-4)
    mixed = engines.paired_with([(w * s, f) for (w, f), s in zip(llama, (0.8, 1.2, 0.9, 1.1))], llama)
    assert mixed["verdict"] == "undecided"
    assert engines.paired_with([(1.1 * w, f) for w, f in llama], llama)["verdict"] == "slower"


def test_paired_ratios_time_both_calls_each_round_in_random_order(monkeypatch):
    """A change against the code without it, in one process: one ratio a round (after over before),
    the order drawn each round, both calls timed; the summary's figures from the ratios."""
    common = _benchmark("common")
    clock, order = [0.0], []

    def call(name: str, seconds: float):
        def run() -> None:
            order.append(name)
            clock[0] += seconds
        return run

    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    common.random.seed(0)
    ratios = common.paired_ratios(call("before", 2.0), call("after", 1.5), rounds=20)
    assert ratios == [0.75] * 20 and len(order) == 40
    rounds = [order[i:i + 2] for i in range(0, 40, 2)]
    assert all(sorted(pair) == ["after", "before"] for pair in rounds)
    assert {first for first, _ in rounds} == {"before", "after"}  # each order drawn in some round
    text = common.describe_ratios([0.9, 1.1, 0.8, 1.0])
    # on the logs, Student's t with 3 degrees of freedom (t = 3.182): exp(mean log) = 0.9432, exp(mean log
    # -/+ 3.182 x sd / 2) = 0.7585, 1.1733
    assert "median 0.950" in text and "geometric mean 0.943 [0.758, 1.173]" in text, text
    assert "below 1 in 2/4 rounds" in text
    # a ratio's interval stays positive, and 0.5x and 2x cancel (the arithmetic mean read 1.25 [-8.28, 10.78])
    assert "geometric mean 1.000 [0.000, 6682.6" in common.describe_ratios([0.5, 2.0])


def test_an_engine_worker_that_fails_is_reported_by_name(tmp_path):
    """Each engine runs in a process of its own; one that cannot start (here: no exported run in its
    folder) raises in the parent naming the engine and its exit code, instead of hanging or passing."""
    engines = _benchmark("engines")
    with pytest.raises(RuntimeError, match=r"the latentloop eager worker exited with code [1-9]"):
        engines.EngineWorker("latentloop eager", tmp_path, [[1, 2, 3]], 2, 1)


@pytest.mark.slow  # compiles the int8 step twice (a package and dynamo's graph): ~1 min on 2 cores
def test_engines_benchmark_smoke_compiled_int8(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _engines_smoke(tmp_path, capsys, ["latentloop eager int8", "latentloop compiled int8",
                                      "latentloop compiled int8 dynamo"])


@pytest.mark.slow  # compiles the step over a float16 cache (a package of its own): ~30 s on 2 cores
def test_engines_benchmark_smoke_default_path_with_a_float16_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _engines_smoke(tmp_path, capsys, ["latentloop eager", "latentloop default f16 cache"])


@pytest.mark.slow  # imports transformers and converts for CTranslate2: ~40 s on the shared 2 cores
def test_engines_benchmark_smoke_against_hf_and_ctranslate2(tmp_path, capsys):
    _engines_smoke(tmp_path, capsys, ["latentloop eager", "hf generate", "ctranslate2 fp32", "llama.cpp"])


def test_engines_benchmark_refuses_an_unknown_engine(capsys):
    engines = _benchmark("engines")
    with pytest.raises(SystemExit) as exc:
        engines.parse_args(["--engines", "vllm"])
    assert exc.value.code == 2 and "unknown engine 'vllm'" in capsys.readouterr().err


@pytest.mark.slow
def test_decode_profile_times_every_variant_and_lists_kernels(tmp_path, capsys):
    """`python -m benchmarks.decode_profile` at a tiny length: each A/B variant timed in every round,
    and the compiled step's kernels and the eager step's ops listed (the top N by self time)."""
    decode_profile = _benchmark("decode_profile")
    out = tmp_path / "profile.json"
    assert decode_profile.main(["--prompt-len", "4", "--new-tokens", "6", "--repeats", "2", "--top", "3",
                                "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["ms_per_step"]) == {"compiled (window, guards skipped)", "compiled, attention over the whole "
                                          "buffer", "compiled, guards checked every step", "eager (static cache)"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["ms_per_step"].values())
    assert len(result["compiled_ops"]) == 3 and len(result["eager_ops"]) == 3
    assert "over the default compiled step" in capsys.readouterr().out


def test_fast_training_covers_every_registered_arch_and_selects_some(capsys):
    """Every arch of the registry has a row (rfbt and mor included); `--archs` picks rows, gpt (every
    row's base) always among them, and an unknown arch is refused by name."""
    from latentloop.archs import ARCHS

    fast_training = _benchmark("fast_training")
    assert {arch for arch, _, _ in fast_training.VARIANTS.values()} == set(ARCHS)
    assert fast_training.selected("rfbt, mor") == ["gpt", "rfbt K=2", "mor"]
    assert fast_training.selected(None) == list(fast_training.VARIANTS)
    with pytest.raises(SystemExit) as exit_info:
        fast_training.parse_args(["--archs", "rgpt,gtp"])
    assert exit_info.value.code == 2 and "gtp" in capsys.readouterr().err


@pytest.mark.slow  # compiles every arch's training step twice (whole and by blocks)
def test_fast_training_runs_the_trainers_recipe_eager_and_compiled(tmp_path, monkeypatch):
    """`python -m benchmarks.fast_training` at a tiny shape with the trainer's optimizer and precision
    given by flag: every arch eager and compiled both ways, the ratios paired per round."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    fast_training = _benchmark("fast_training")
    out = tmp_path / "fast_training.json"
    assert fast_training.main(["--train-seq-len", "16", "--train-batch", "2", "--rounds", "2", "--train-warmup", "2",
                               "--threads", "1", "--optimizer", "muon", "--dtype", "bfloat16",
                               "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["args"]["optimizer"] == "muon" and result["args"]["dtype"] == "bfloat16"
    names = list(fast_training.VARIANTS)
    assert set(result["modes"]["eager"]) == set(names)
    compiled = result["modes"]["compiled"]
    assert set(compiled) == {f"{name} [{scope}]" for name in names for scope in fast_training.SCOPES}
    for name in names:
        whole = compiled[f"{name} [whole]"]
        assert len(whole["whole_over_blocks_all"]) == 2 and len(whole["speedup_over_eager_all"]) == 2
        assert all(math.isfinite(entry["final_loss"]) for entry in (whole, result["modes"]["eager"][name]))


@pytest.mark.slow  # four `latentloop generate` processes: ~20 s on the shared 2 cores
def test_first_token_benchmark_times_whole_processes_cold_then_warm(tmp_path):
    import json

    first_token = _benchmark("first_token")
    out = tmp_path / "first.json"
    assert first_token.main(["--shape", "smoke", "--modes", "eager,auto", "--warm", "1", "--new-tokens", "6",
                             "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == ["eager", "auto"]
    for entry in modes.values():
        for timing in [entry["cold"], *entry["warm"]]:
            assert 0 < timing["first_token_s"] <= timing["process_s"]


def test_first_token_benchmark_refuses_an_unknown_mode(capsys):
    first_token = _benchmark("first_token")
    with pytest.raises(SystemExit) as exc:
        first_token.parse_args(["--modes", "jit"])
    assert exc.value.code == 2 and "unknown mode 'jit'" in capsys.readouterr().err


def test_prefill_products_pairs_the_rows_kernel_with_torchs_products(tmp_path, capsys, monkeypatch):
    """`python -m benchmarks.prefill_products` at a tiny shape: every row count's float32 and int8
    products and the one-token generate are timed in every round for each variant, each paired with
    the kernel's round; without the kernel the table says why."""
    from latentloop.inference import native

    products = _benchmark("prefill_products")
    out = tmp_path / "products.json"
    argv = ["--shape", "smoke", "--rows", "3,9", "--prompt-len", "6", "--repeats", "2", "--json", str(out)]
    with monkeypatch.context() as patch:
        patch.setattr(native, "_rows_library", lambda: None)
        assert products.main(argv) == 0
        assert json.loads(out.read_text())["first_token"] is None
        assert "no rows kernel here" in capsys.readouterr().out
    if native.rows_linear_status() != "native":
        pytest.skip(f"no rows kernel here: {native.rows_linear_status()}")
    assert products.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["products"]) == {"float32, 3 rows", "int8, 3 rows", "float32, 9 rows", "int8, 9 rows"}
    for entry in [*result["products"].values(), result["first_token"], result["first_token_cold"]]:
        assert all(len(s) == 2 and min(s) > 0 for s in entry["seconds"].values())
        assert set(entry["over_kernel"]) == set(entry["seconds"]) - {products.KERNEL}
    assert "time over the kernel's" in capsys.readouterr().out


def test_decode_attention_benchmark_refuses_bad_windows_in_one_line(capsys):
    bench = _benchmark("decode_attention")
    for bad, message in [("64,x", "comma-separated integers"), ("3", "must be > 5 keys")]:
        with pytest.raises(SystemExit) as exc:
            bench.main(["--windows", bad])
        assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # one inductor compile of the reductions (~20 s)
def test_decode_attention_benchmark_pairs_the_kernel_with_the_reductions(tmp_path, capsys):
    """Each window's rounds pair the kernel with inductor's reductions (both checked against SDPA
    first), and the JSON keeps every ratio."""
    from latentloop.inference import native

    bench = _benchmark("decode_attention")
    if native.decode_attention_status() != "native":
        pytest.skip(f"no attention kernel here: {native.decode_attention_status()}")
    half = tmp_path / "attention-half.json"  # a float16 cache (one inductor compile; float32's: the slow test)
    assert bench.main(["--shape", "smoke", "--windows", "40", "--rounds", "3", "--cache-dtype", "float16",
                       "--json", str(half)]) == 0
    result = json.loads(half.read_text())
    assert result["cache_dtype"] == "float16" and set(result["windows"]) == {"40"}
    row = result["windows"]["40"]
    assert len(row["ratios"]) == 3 and min(row["ratios"]) > 0 and row["kernel_ms"] > 0
    assert "kernel / reductions" in capsys.readouterr().out
    shape = bench.SHAPES["smoke"]  # keys and values of every layer, 2 bytes each: half float32's bytes streamed
    attended = 40 - bench.MASKED_TAIL  # the window's last slots hold no key yet
    assert row["attended_mb"] == pytest.approx(2 * shape["n_layer"] * attended * shape["n_embd"] * 2 / 1e6)
    assert row["window_mb"] == pytest.approx(row["attended_mb"] * 40 / attended)  # the reductions read it all


@pytest.mark.slow
def test_decode_attention_benchmark_measures_every_window_it_is_given(tmp_path):
    from latentloop.inference import native

    if native.decode_attention_status() != "native":
        pytest.skip(f"no attention kernel here: {native.decode_attention_status()}")
    bench = _benchmark("decode_attention")
    out = tmp_path / "attention.json"  # the model's own float32 cache, two windows, a batch of rows
    assert bench.main(["--shape", "smoke", "--windows", "40,70", "--rounds", "2", "--rows", "3",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    windows = result["windows"]
    assert result["cache_dtype"] == "float32" and result["rows"] == 3 and set(windows) == {"40", "70"}
    attended = {window: sum(bench.filled_lengths(window, 3)) for window in (40, 70)}
    assert windows["70"]["attended_mb"] == pytest.approx(windows["40"]["attended_mb"] * attended[70] / attended[40])
    assert windows["70"]["window_mb"] == pytest.approx(windows["40"]["window_mb"] * 70 / 40)
    assert all(len(row["ratios"]) == 2 and min(row["ratios"]) > 0 for row in windows.values())


def test_decode_attention_benchmarks_rows_step_down_from_the_longest_and_zero_rows_are_refused(capsys):
    bench = _benchmark("decode_attention")
    assert bench.filled_lengths(40, 1) == [40 - bench.MASKED_TAIL]
    assert bench.filled_lengths(40, 4) == [8, 17, 26, 35]  # a continuous batch's rows of other lengths
    assert bench.filled_lengths(8, 32)[0] == 1  # no row is empty
    with pytest.raises(SystemExit) as exc:
        bench.main(["--rows", "0"])
    assert exc.value.code == 2 and "--rows must be at least 1" in capsys.readouterr().err


def test_prefill_products_refuses_bad_rows(capsys):
    products = _benchmark("prefill_products")
    for rows, message in [("2,x", "comma-separated integers"), ("0,4", ">= 1")]:
        with pytest.raises(SystemExit) as exc:
            products.parse_args(["--rows", rows])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_engines_pool_pools_the_runs_of_one_command(tmp_path, capsys):
    """`--pool`: each run's geometric mean ratio over llama.cpp's, their geometric mean and its interval over
    the runs (each run's rounds share its machine state: pooled as independent rounds, the interval was
    too narrow), judged ahead (upper end < 1), at llama.cpp's speed (upper end <= AT_MARGIN) or not shown;
    an engine in one run only keeps that run's own interval over its rounds."""
    import json
    import math
    import statistics

    from latentloop.eval.stats import t_quantile

    engines = _benchmark("engines")
    per_run = {"fast": ([0.80, 0.82, 0.81], [0.79, 0.80, 0.83]), "level": ([1.00, 1.01, 0.99], [1.00, 0.98, 1.02]),
               "slow": ([1.10, 1.12, 1.09], [1.11, 1.10, 1.12]), "one-sided": ([0.99, 1.00, 1.01], [])}
    paths = []
    for run in range(2):
        rows = {engine: {"over_llama_cpp_all": ratios[run]} for engine, ratios in per_run.items()}
        rows["llama.cpp"] = {"over_llama_cpp_all": [1.0, 1.0, 1.0]}
        paths.append(tmp_path / f"run{run}.json")
        paths[-1].write_text(json.dumps({"args": {"shape": "small", "prompt_len": 16, "new_tokens": 200},
                                         "threads": {"1": rows}}))
    assert engines.main(["--pool", *map(str, paths)]) == 0
    table = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
             for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert "llama.cpp" not in table

    def geometric(values):
        return math.exp(statistics.fmean(map(math.log, values)))

    for engine, shown in (("fast", "ahead"), ("level", "at"), ("slow", "not shown"), ("one-sided", "at")):
        threads, runs, rounds, means, interval, verdict = table[engine]
        runs_with = [ratios for ratios in per_run[engine] if ratios]
        over = runs_with[0] if len(runs_with) == 1 else [geometric(ratios) for ratios in runs_with]
        logs = [math.log(v) for v in over]
        half = t_quantile(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        mean = statistics.fmean(logs)
        expected = f"{math.exp(mean):.3f} [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]"
        assert (runs, rounds, verdict) == (str(len(runs_with)), str(sum(map(len, runs_with))), shown), table[engine]
        assert means == ", ".join(f"{geometric(r):.3f}" for r in runs_with) and interval.startswith(expected), \
            (engine, interval, expected)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"args": {"shape": "large", "prompt_len": 32, "new_tokens": 128}, "threads": {}}))
    with pytest.raises(SystemExit, match="differ"):
        engines.main(["--pool", str(paths[0]), str(other)])
    assert engines.main(["--pool", str(tmp_path / "missing.json")]) == 2


def test_cpu_attention_benchmark_pairs_float32_with_bf16_and_reports_the_rule(tmp_path, capsys, monkeypatch):
    """Each cell pairs float32 with bf16 attention and names the rule's pick; each training row pairs
    the rule's step with bf16 everywhere; bad cells and names get one line from argparse, and a CPU
    without bf16 instructions one message."""
    from latentloop.models.backbone import cpu_training_attention_in_fp32
    from latentloop.runtime import CPU_BF16_ENV, cpu_bf16_support

    bench = _benchmark("cpu_attention")
    for flag, bad, message in [("--cells", "128x", "TOKENSxHEAD_DIM"), ("--cells", "0x16", "positive"),
                               ("--sizes", "xl", "unknown 'xl'"), ("--archs", "nope", "unknown 'nope'")]:
        with pytest.raises(SystemExit) as exc:
            bench.parse_args([flag, bad])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no bf16 instructions"):  # the suite hides them (conftest)
        bench.main(["--cells", "32x16", "--sizes", ""])
    monkeypatch.delenv(CPU_BF16_ENV)  # this CPU's own answer
    if cpu_bf16_support() is None:
        pytest.skip("no bf16 instructions on this CPU")
    out = tmp_path / "cpu-attention.json"
    assert bench.main(["--cells", "32x16,32x128", "--tokens", "64", "--width", "128", "--sizes", "xs",
                       "--archs", "gpt,lrt", "--rounds", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {name: cell["rule"] for name, cell in result["cells"].items()} == {
        "32x16": "float32" if cpu_training_attention_in_fp32(16, 32) else "bf16",
        "32x128": "float32" if cpu_training_attention_in_fp32(128, 32) else "bf16"}
    assert result["cells"]["32x16"]["shape"] == [2, 8, 32, 16]
    assert [(row["arch"], row["size"]) for row in result["steps"]] == [("gpt", "xs"), ("lrt", "xs")]
    assert all(len(row["ratios"]) == 2 and min(row["ratios"]) > 0 for row in result["steps"])
    assert "step: rule / bf16 everywhere" in capsys.readouterr().out


# -- the reviewed benchmarks' defects (timing order, intervals, flags, result records) -----------------


def test_time_prompt_spends_the_cold_call_untimed_and_stamps_the_first_token_in_the_call():
    """A fake engine whose first call after a pause costs COLD more: `time_prompt` spends that call untimed,
    then times one call for every new token, its first token stamped inside it (a one-token call of its own
    took another path on latentloop's compiled decode: its setup was charged to the decode)."""
    engines = _benchmark("engines")
    clock, calls, paused = [0.0], [], [True]
    cold, prefill, per_token = 0.5, 0.03, 0.01

    def call(prompt, new_tokens, marks=None):
        calls.append(new_tokens)
        clock[0] += prefill + per_token + (cold if paused[0] else 0.0)
        paused[0] = False
        if marks is not None:
            marks.append(clock[0])
        clock[0] += per_token * (new_tokens - 1)
        return list(range(new_tokens))

    paused[0] = True  # the settle pause before the round
    outputs: list = []
    whole, first = engines.time_prompt(call, [1, 2], 5, clock=lambda: clock[0], outputs=outputs)
    assert calls == [1, 5]  # the untimed one-token call, then the timed whole call
    assert whole == pytest.approx(prefill + 5 * per_token) and first == pytest.approx(prefill + per_token)
    assert outputs == [[0, 1, 2, 3, 4]]  # the timed call's tokens, for the worker to check


def test_an_engine_whose_timed_call_gives_other_tokens_ends_the_run_in_one_line():
    """Every timed call's tokens are checked against the engine's warm-up (only the warm-up's were):
    a timing of other work is refused, naming the engine and the prompt."""
    engines = _benchmark("engines")
    worker = engines.EngineWorker.__new__(engines.EngineWorker)
    worker.engine = "latentloop default"
    worker.process = type("P", (), {"stdin": type("S", (), {"write": lambda self, text: None,
                                                            "flush": lambda self: None})()})()
    for same, outcome in ((True, (0.2, 0.01)), (False, None)):
        worker._answer = lambda same=same: {"seconds": 0.2, "first_seconds": 0.01, "same_tokens": same}
        if outcome is not None:
            assert worker.time_call(1) == outcome
        else:
            with pytest.raises(SystemExit, match="latentloop default's timed call for prompt 1 gave other tokens"):
                worker.time_call(1)


def test_prefill_products_refuses_a_prompt_outside_the_rows_kernels_rows(capsys):
    """Outside the kernel's rows `accelerated_linear` takes torch's products, and the "rows kernel"
    row would time them: such a --prompt-len is refused, naming the range."""
    from latentloop.inference.products import ROWS_KERNEL_MAX_ROWS, ROWS_KERNEL_MIN_ROWS

    products = _benchmark("prefill_products")
    for bad in (ROWS_KERNEL_MIN_ROWS - 1, ROWS_KERNEL_MAX_ROWS + 1):
        with pytest.raises(SystemExit) as exc:
            products.parse_args(["--prompt-len", str(bad)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err
        assert f"{ROWS_KERNEL_MIN_ROWS}-{ROWS_KERNEL_MAX_ROWS}" in err
    for good in (ROWS_KERNEL_MIN_ROWS, ROWS_KERNEL_MAX_ROWS):
        assert products.parse_args(["--prompt-len", str(good)]).prompt_len == good


def test_the_precision_check_alternates_the_dtypes_over_the_repeats_and_leaves_out_the_first_steps(monkeypatch):
    """--precision-check: `--repeats` runs of each dtype, the order alternating, the step time
    after the untimed first steps (here 10 s each, slower as a process's first run), and the speedup
    as median [min, max] of the per-repeat ratios."""
    import argparse

    ttq = _benchmark("time_to_quality")
    order = []
    per_step = {"float32": [2.0, 2.0, 2.4], "bfloat16": [1.0, 1.0, 1.0]}  # seconds a timed step, per repeat

    def train(bench, arch, steps, check_every, stop_at=None, dtype="float32"):
        repeat = sum(d == dtype for _, d in order)
        order.append((arch, dtype))
        first = 10.0 if len(order) == 1 else 5.0  # the first step: slowest in the process's first run
        seconds = [first] + [per_step[dtype][repeat]] * (steps - 1)
        weights = {"w": torch.zeros(1)}
        return [(steps, sum(seconds), weights)], {"model": torch.nn.Linear(1, 1), "train_s": sum(seconds),
                                                  "step_s_all": seconds, "others_cpu_share": None, "params": 2,
                                                  "precision": dtype, "optimizer": "adamw"}

    class Bench:
        args = argparse.Namespace(steps=6, repeats=3)

        @staticmethod
        def val_bpb(model):
            return 2.0

    monkeypatch.setattr(ttq, "train_latentloop", train)
    result = ttq.precision_check(Bench(), ["gpt"])["gpt"]
    assert [dtype for _, dtype in order] == ["float32", "bfloat16", "bfloat16", "float32", "float32", "bfloat16"]
    assert result["speedup_all"] == pytest.approx([2.0, 2.0, 2.4])
    assert (result["speedup"], result["speedup_min"], result["speedup_max"]) == pytest.approx((2.0, 2.0, 2.4))
    assert len(result["float32"]) == len(result["bfloat16"]) == 3 and result["bpb_change"] == 0
    assert [run["evaluated"] for run in result["float32"]] == [True, False, False]  # the same weights: not again
    assert "2.00x [2.00x–2.40x]" in ttq.markdown_table({"args": {"preset": "test", "steps": 5, "repeats": 3},
                                                        "precision": {"gpt": result}})


def test_cpu_bf16_benchmark_pairs_the_emulated_step_with_torchs_bf16_and_float32(tmp_path, capsys):
    """Each row pairs the emulated step with torch's bf16 step and with float32's, and checks in its
    warmup that the emulated path ran emulated linear layers and torch's path none; bad names get one
    line from argparse."""
    bench = _benchmark("cpu_bf16")
    for flag, bad, message in [("--sizes", "xl", "unknown 'xl'"), ("--archs", "nope", "unknown 'nope'"),
                               ("--archs", "", "at least one name"), ("--rounds", "1", "--rounds must be >= 2")]:
        with pytest.raises(SystemExit) as exc:
            bench.parse_args([flag, bad])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    out = tmp_path / "cpu-bf16.json"
    assert bench.main(["--sizes", "xs", "--archs", "gpt", "--rounds", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    [row] = result["steps"]
    assert (row["arch"], row["size"]) == ("gpt", "xs") and row["params"] > 0
    assert len(row["over_torch_bf16"]) == len(row["over_float32"]) == 2
    assert min(row["over_torch_bf16"] + row["over_float32"]) > 0
    assert "step: emulated / torch's bf16" in capsys.readouterr().out


def test_ratio_interval_is_students_t():
    """The paired ratios' 95% interval is Student's t (as engines and serve_load give theirs), far
    wider than the normal's at a few rounds."""
    from latentloop.eval.stats import t_interval

    common = _benchmark("common")
    for ratios in ([0.9, 1.2, 1.0], [0.95, 1.0, 1.02, 0.97, 1.05, 0.99, 1.01, 0.98, 1.03]):
        mean, low, high = common.ratio_interval(ratios)
        logs = [math.log(r) for r in ratios]
        assert (math.log(low), math.log(high)) == pytest.approx(t_interval(logs))
        assert math.log(mean) == pytest.approx(sum(logs) / len(logs))


@pytest.mark.parametrize("module, argv, message", [
    ("decode_attention", ["--rounds", "1"], "--rounds must be >= 2"),
    ("cpu_attention", ["--rounds", "1"], "--rounds must be >= 2"),
    ("cpu_attention", ["--rounds", "0"], "--rounds must be >= 2"),
    ("cpu_attention", ["--tokens", "0"], "--tokens must be >= 1"),
    ("cpu_attention", ["--width", "0"], "--width must be >= 1"),
    ("baseline", ["--compile", "--warmup-steps", "0"], "--compile needs --warmup-steps >= 1"),
    ("variants", ["--compile", "--warmup", "0"], "--compile needs --warmup >= 1"),
    ("fast_training", ["--rounds", "0"], "--rounds must be >= 1"),  # it named a --train-steps there is not
    ("engines", ["--settle", "nan"], "--settle must be a number of seconds >= 0"),
    ("first_token", ["--prompt-len", "1"], "--prompt-len must be >= 13"),  # it failed inside the child process
])
def test_paired_benchmarks_refuse_too_few_rounds_and_empty_cells(module, argv, message, capsys):
    """A single round has no quartiles or interval (StatisticsError after all the work), and a cell of
    0 tokens or width was clamped to another shape: refused by argparse in one line. So is a compiled
    run with no untimed call first (the compile landed in the first timed round)."""
    with pytest.raises(SystemExit) as exc:
        _benchmark(module).parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("module, argv", [
    ("fast_decode", []), ("fast_training", []), ("speculative", ["runs/x"]), ("time_to_quality", []),
    ("decode_attention", []), ("cpu_attention", []), ("cpu_bf16", []), ("baseline", []), ("variants", []),
    ("gpu_bench", []),
])
def test_threads_below_one_are_refused_in_one_line(module, argv, capsys):
    """`torch.set_num_threads(0)` raised a RuntimeError once the run started (gpu_bench fell back to
    torch's default): refused by argparse instead."""
    with pytest.raises(SystemExit) as exc:
        _benchmark(module).parse_args([*argv, "--threads", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--threads must be >= 1" in err and "Traceback" not in err


def _serve_load():
    """`benchmarks.serve_load`, sys.path as it was after (it puts benchmarks/ on it)."""
    saved = list(sys.path)
    try:
        return _benchmark("serve_load")
    finally:
        sys.path[:] = saved


@pytest.mark.parametrize("argv, message", [
    (["--presets", "foo"], "unknown 'foo'"),
    (["--json", "out.json"], "--json only applies with --against llama.cpp"),
    (["--run", "runs/x", "--new-tokens", "8", "--decode", "eager"],
     "--run, --decode, --new-tokens only apply with --against"),
    (["--kv-dtype", "float16"], "--kv-dtype only applies with --against"),
    (["--short", "8", "--long", "16"], "--short, --long only apply with --against"),
    (["--against", "llama.cpp", "--presets", "tiny"], "--presets only applies without --against"),
    (["--against", "llama.cpp", "--batching", "rounds", "--varied-lengths"],
     "--batching, --varied-lengths only apply without --against"),
])
def test_serve_load_refuses_unknown_presets_and_the_other_modes_flags(argv, message, capsys):
    """An unknown preset was a ConfigError traceback; a flag of the other mode (--json without
    --against, --presets with it) was silently ignored."""
    serve_load = _serve_load()
    with pytest.raises(SystemExit) as exc:
        serve_load.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err
    args = serve_load.parse_args(["--presets", "test"])
    assert (args.presets, args.batching, args.varied_lengths) == (["test"], ["continuous", "rounds"], False)


def test_engines_pool_refuses_a_file_that_is_not_a_runs_json_in_one_line(tmp_path, capsys):
    engines = _benchmark("engines")
    files = {"text.json": "not json {", "list.json": "[1, 2]", "other.json": json.dumps({"args": {"x": 1}}),
             "cases.json": json.dumps({"args": {"new_tokens": 8}, "cases": {"a": {"threads": [1]}}})}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        assert engines.main(["--pool", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(tmp_path / name) in err[0] and err[0].startswith("--pool:"), (name, err)


@pytest.mark.parametrize("argv, message", [
    (["--only", "foo"], "unknown arch 'foo'"), (["--only", "gpt", "lrtt"], "unknown arch 'lrtt'"),
    (["--peak-tflops", "0"], "--peak-tflops must be a positive number"),
    (["--peak-tflops", "nan"], "--peak-tflops must be a positive number"),
    (["--budget-s", "0"], "--budget-s must be > 0"),
])
def test_gpu_bench_refuses_unknown_archs_and_bad_numbers(argv, message, capsys):
    """`--only foo` ran nothing and exited 0; a peak of 0 fell back to the H200's: refused instead."""
    with pytest.raises(SystemExit) as exc:
        _benchmark("gpu_bench").parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err


def test_no_compile_lands_in_a_timed_training_step(monkeypatch):
    """rgpt draws its depth per step (here: 2, then 1, 1, 2, ...): warmed up for --train-warmup 1
    step only, its first depth-1 step, a compile of its own, was timed. The warm-up now runs until
    every kind of forward of the timed steps has run untimed."""
    import argparse

    common = _benchmark("common")
    depths = _benchmark("fast_decode").RGPT_EQUAL_DEPTH
    kinds: list[str] = []  # each step's kind of forward, in the order the steps ran
    real_step = common.train_step

    def spy(model, forward_model, objective, batch, i, *rest):
        kinds.append(repr(objective.forward_mix(i)))
        return real_step(model, forward_model, objective, batch, i, *rest)

    monkeypatch.setattr(common, "train_step", spy)
    shape = dict(n_embd=32, n_head=2, vocab_size=259, sequence_len=8)
    args = argparse.Namespace(seed=0, grad_clip=1.0, train_batch=1, train_seq_len=8, train_warmup=1, train_steps=4)
    result = common.training_comparison({"rgpt": ("rgpt", shape, depths, None)}, args, torch.device("cpu"))["rgpt"]
    warmup = len(kinds) - args.train_steps  # the untimed steps: the first ones
    assert len(set(kinds)) == 2 and set(kinds[warmup:]) <= set(kinds[:warmup])
    assert warmup == result["warmup_steps"] >= args.train_warmup  # recorded
    kind = "abacaaaaaa".__getitem__  # a step's kind of forward
    assert common.covering_warmup(kind, 1, 1) == 2  # b at step 1: warmed up through it
    assert common.covering_warmup(kind, 1, 3) == 4  # ... and then c at step 3
    assert common.covering_warmup(kind, 4, 6) == 4 and common.covering_warmup(kind, 0, 1) == 2  # a, then b


def test_every_benchmark_result_records_its_command_module_and_arguments(tmp_path, monkeypatch):
    """`benchmark_main` (every `python -m benchmarks.NAME` but a few) writes the command line, the
    module and every parsed argument into the JSON, whatever the benchmark stored itself."""
    import argparse

    common = _benchmark("common")
    out = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--flag", "a"])
    args = argparse.Namespace(json=out, threads=2, cells=[(32, 16)], path=tmp_path)
    assert common.benchmark_main(args, lambda args: {"figure": 1.0}, lambda results: "table") == 0
    result = json.loads(out.read_text())
    assert result["command"] == ["benchmarks/x.py", "--flag", "a"] and result["module"] == __name__
    assert result["args"] == {"json": str(out), "threads": 2, "cells": [[32, 16]], "path": str(tmp_path)}
    assert result["figure"] == 1.0


def test_gpu_bench_records_its_command_and_arguments(tmp_path, monkeypatch, capsys):
    gpu_bench = _benchmark("gpu_bench")
    monkeypatch.setattr(gpu_bench, "run", lambda args, save=None: {section: [] for section in
                                                        ("training", "fill", "decode", "hf", "checks")})
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--cpu"])
    assert gpu_bench.main(["--cpu", "--tiny", "--threads", "1", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["command"] == ["gpu_bench", "--cpu"] and report["module"] == "benchmarks.gpu_bench"
    assert report["args"]["threads"] == 1 and report["args"]["tiny"] and report["args"]["out_dir"] == str(tmp_path)


def test_shared_prompts_pairs_the_two_ways_of_scoring_a_task(tmp_path, capsys):
    """`python -m benchmarks.shared_prompts` at a tiny size: both ways timed every round, the rows each
    prefilled (fewer shared: a question's choices take one row), and the same scores both ways."""
    folder = shared_data("eval")
    bench = _benchmark("shared_prompts")
    out = tmp_path / "shared.json"
    argv = ["--preset", "test", "--limit", "4", "--rounds", "2", "--eval-dir", str(folder), "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["shared_over_every_row"]) == 2 and all(len(s) == 2 for s in result["seconds"].values())
    assert result["prefilled_rows"]["every row"] == result["rows"] == 16  # hellaswag: 4 choices an example
    assert result["prefilled_rows"]["shared"] < result["rows"]
    assert result["max_logprob_difference"] < 1e-4
    assert "shared / every row" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "1"])


def test_timed_rounds_keep_every_call_at_the_same_count():
    """A training step's work follows its call count (rgpt's depth, fbt's passes): in each round every
    call runs once, so each round times the same step of each (cpu_bf16 paired float32 at steps 2-4
    with the emulation at 5-7 when it ran two pairings one after the other)."""
    common = _benchmark("common")
    counts: dict[str, int] = {}
    seen: list[tuple[str, int]] = []

    def counter(name: str):
        def call():
            counts[name] = counts.get(name, 0) + 1
            seen.append((name, counts[name]))
        return call

    common.random.seed(1)
    seconds = common.timed_rounds({name: counter(name) for name in ("float32", "torch", "emulated")}, rounds=6)
    assert {name: len(s) for name, s in seconds.items()} == {"float32": 6, "torch": 6, "emulated": 6}
    rounds = [seen[i:i + 3] for i in range(0, len(seen), 3)]
    assert all(len({count for _, count in r}) == 1 and len({name for name, _ in r}) == 3 for r in rounds)
    assert len({tuple(name for name, _ in r) for r in rounds}) > 1  # the order is drawn per round


def test_speculative_claims_no_speedup_for_a_draft_whose_greedy_output_differs():
    """A faster path to other tokens is no speedup: the table shows none where greedy output differs
    from full depth (it printed the ratio beside "NO")."""
    speculative = _benchmark("speculative")
    draft = {"greedy_equal": True, "speedup_vs_eager": 1.5, "speedup_vs_eager_all": [1.4, 1.6, 1.5]}
    assert speculative._speedup(draft, "eager").startswith("1.50x; rounds:")
    assert speculative._speedup({**draft, "greedy_equal": False}, "eager") == \
        "— (greedy output differs: no speedup claimed)"


def test_prefill_products_refuses_to_time_a_variant_that_computes_something_else():
    """Every variant's output is checked against the kernel's before any timing: a faster product of
    other numbers was timed as a speedup."""
    products = _benchmark("prefill_products")
    x = torch.randn(4, 8)
    right = {products.KERNEL: lambda: [x * 2], "torch": lambda: [x * 2 * (1 + 1e-6)]}
    assert set(products.paired(right, 2)["over_kernel"]) == {"torch"}
    wrong = {products.KERNEL: lambda: [x * 2], "torch": lambda: [x * 2 + 1]}
    with pytest.raises(SystemExit, match="torch does not give the rows kernel's output"):
        products.paired(wrong, 2)
    with pytest.raises(SystemExit):
        products.paired({products.KERNEL: lambda: [1, 2], "other": lambda: [1, 3]}, 2)  # tokens: exactly


def test_batch_load_finishes_every_request_and_times_its_parts(tiny_run, tmp_path, capsys):
    """The continuous batch in-process, eager: every request runs to --new-tokens (no stop token), so
    the steps are at least the tokens over the rows in flight; decode and joins are parts of the wall."""
    bench = _benchmark("batch_load")
    out = tmp_path / "load.json"
    rows, requests, new_tokens = 3, 7, 5
    assert bench.main([str(tiny_run("gpt")), "--rows", str(rows), "--requests", str(requests), "--short", "4",
                       "--long", "12", "--new-tokens", str(new_tokens), "--decode", "eager", "--repeats", "2",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["loads"]) == 2 and result["kv_dtype"] == "float32"
    for load in result["loads"]:
        assert load["steps"] >= math.ceil(requests * new_tokens / rows)
        assert 0 < load["decode_s"] + load["join_s"] <= load["wall_s"]
        assert load["requests_per_s"] == pytest.approx(requests / load["wall_s"])
    assert "decode ms a step" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--rows", "0"], "--rows must be >= 1"),
    (["--new-tokens", "0"], "--new-tokens must be >= 1"),
    (["--short", "40", "--long", "20"], "must not be longer than --long"),
    (["--short", "4", "--long", "30", "--new-tokens", "10"], "more than the model's context (32)"),
])
def test_batch_load_refuses_bad_loads_in_one_line(tiny_run, argv, message, capsys):
    bench = _benchmark("batch_load")
    with pytest.raises(SystemExit) as exc:
        bench.main([str(tiny_run("gpt")), *argv])
    said = str(exc.value.code) + capsys.readouterr().err
    assert message in said and "Traceback" not in said
