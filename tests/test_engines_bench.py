"""`benchmarks.engines` (issue 54): llama.cpp's own decode loop through its C API gives latentloop's
greedy tokens from an empty cache on every call, at a real model's vocabulary; the shapes and prompt
lengths its flags take (and their one-line refusals); the time to first token and the decode split
apart and paired with llama.cpp's round by round."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _engines():
    """`benchmarks.engines` of this checkout (the folder is not an installed package)."""
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module("benchmarks.engines")
    finally:
        sys.path.remove(str(ROOT))


def test_llama_cpp_loop_gives_latentloop_greedy_tokens_from_an_empty_cache(tmp_path):
    """The C-API loop on the exported GGUF of a 32,000-token model (llama.cpp's "none" vocabulary of
    that many ids): the same greedy tokens as latentloop's engine, for a prompt and for another one
    after it (a cache left from the first call would continue that sequence instead)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import latentloop

    engines = _engines()
    model, tokenizer, hf_dir = engines.build_export(engines.SHAPES["smoke"], 64, 0, tmp_path, vocab_size=32_000)
    loop = engines.LlamaCppLoop(engines.gguf_path(hf_dir, tmp_path), context=64, batch=40, threads=1)
    try:
        assert loop.vocab_size == 32_000
        first = engines.text_prompt(40, tokenizer.bos_id, seed=0)
        second = [tokenizer.bos_id, 31_999, 7, 20_000, 5]  # ids past the byte tokenizer's included
        expected = {tuple(prompt): latentloop.generate(model, prompt, 12, temperature=0.0, compile=False)
                    for prompt in (first, second)}
        for prompt in (first, second, first):
            assert loop(prompt, 12) == expected[tuple(prompt)]
        assert loop(second, 1) == expected[tuple(second)][:1]  # the prefill's argmax alone
        assert expected[tuple(first)] != expected[tuple(second)]  # a stale cache would continue the first
        assert all(len(set(tokens)) > 1 for tokens in expected.values())  # not a fixed id
    finally:
        loop.close()


def test_llama_cpp_f32_cache_row_stores_twice_the_bytes_and_gives_the_same_tokens(tmp_path):
    """`llama.cpp f32 cache` (the same-precision row beside latentloop's fp32 cache): its context's
    state after the same prompt is larger than the f16 cache's by exactly 2 more bytes per stored key
    and value element, and its greedy tokens are latentloop's eager ones."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import latentloop

    engines = _engines()
    model, tokenizer, hf_dir = engines.build_export(engines.SHAPES["smoke"], 64, 0, tmp_path)
    prompt = engines.text_prompt(40, tokenizer.bos_id, seed=1)
    expected = latentloop.generate(model, prompt, 12, temperature=0.0, compile=False)
    sizes = {}
    for f32_cache in (False, True):
        loop = engines.LlamaCppLoop(engines.gguf_path(hf_dir, tmp_path), context=64, batch=40, threads=1,
                                    f32_cache=f32_cache)
        try:
            assert loop(prompt, 12) == expected
            sizes[f32_cache] = loop.ll.llama_state_get_size(loop.context)
        finally:
            loop.close()
    # the states differ by the stored keys and values alone: 40 prompt tokens and the 11 decoded
    # ones (the last token is never decoded), per layer a key and a value of n_kv_head x head_dim,
    # 4 bytes each against 2
    config = model.config
    stored = (40 + 11) * config.n_layer * 2 * config.n_kv_head * (config.n_embd // config.n_head)
    assert sizes[True] - sizes[False] == stored * (4 - 2), sizes


def test_shapes_and_prompt_lengths_parse_from_their_flags():
    engines = _engines()
    args = engines.parse_args(["--shapes", "small,large-32k,small-128k", "--prompt-len", "512,2048,4096",
                               "--threads", "1,2"])
    assert args.shapes == ["small", "large-32k", "small-128k"]
    assert args.prompt_len == [512, 2048, 4096] and args.threads == [1, 2]
    assert engines.resolve_shape("large-32k") == (engines.SHAPES["large"], 32_000)
    assert engines.resolve_shape("small-128k") == (engines.SHAPES["small"], 128_000)
    assert engines.resolve_shape("small") == (engines.SHAPES["small"], None)  # the byte vocabulary
    old = engines.parse_args(["--shape", "large", "--prompt-len", "16"])  # the flags of issue 26's runs
    assert old.shapes == ["large"] and old.prompt_len == [16]
    assert {"small", "large", "large-32k", "small-128k"} <= set(engines.shape_names())


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "small,huge"], "unknown shape 'huge'"),
    (["--shapes", "large-64k"], "unknown shape 'large-64k'"),
    (["--prompt-len", "512,x"], "--prompt-len must be comma-separated integers, got '512,x'"),
    (["--prompt-len", "512,0"], "--prompt-len must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--prompt-len", "16,16"], "must not name a value twice"),
])
def test_bad_shapes_and_prompt_lengths_are_refused_in_one_line(argv, message, capsys):
    engines = _engines()
    with pytest.raises(SystemExit) as exc:
        engines.parse_args(argv)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and message in error and "Traceback" not in error


def test_prompts_are_bos_then_a_window_of_real_text():
    engines = _engines()
    text = b"def f(x):\n    return x + 1\n" * 20
    prompt = engines.text_prompt(30, 256, seed=3, text=text)
    assert len(prompt) == 30 and prompt[0] == 256
    assert bytes(prompt[1:]) in text
    assert engines.text_prompt(30, 256, seed=3, text=text) == prompt  # deterministic
    short = engines.text_prompt(30, 256, seed=3, text=b"abc")  # too little text: random bytes
    assert len(short) == 30 and all(0 <= i < 256 for i in short[1:])


class FakeEngine:
    """An engine whose call advances a fake clock: `prefill_s` per prompt token, then `decode_s` per
    new token after the first; its tokens are 0, 1, 2, ..."""

    def __init__(self, clock: list[float], prefill_s: float, decode_s: float):
        self.clock, self.prefill_s, self.decode_s = clock, prefill_s, decode_s

    def __call__(self, prompt: list[int], new_tokens: int, marks: list | None = None) -> list[int]:
        self.clock[0] += len(prompt) * self.prefill_s
        if marks is not None:  # its first token exists: stamped as the engines stamp it
            marks.append(self.clock[0])
        self.clock[0] += (new_tokens - 1) * self.decode_s
        return list(range(new_tokens))


def test_time_to_first_token_and_decode_split_and_pair_with_llama_cpp():
    """A fake engine with twice llama.cpp's prefill and half its decode time per token: the time to
    first token, the decode per token and its rate come out as built, and the paired ratios over
    llama.cpp's are 2 (first token) and 0.5 (decode), with the whole call in between."""
    engines = _engines()
    clock = [0.0]
    prompt, new_tokens = list(range(100)), 11
    ours = FakeEngine(clock, prefill_s=2e-4, decode_s=0.01)
    llama = FakeEngine(clock, prefill_s=1e-4, decode_s=0.02)
    rounds = {name: [engines.time_prompt(engine, prompt, new_tokens, clock=lambda: clock[0]) for _ in range(3)]
              for name, engine in (("latentloop default", ours), ("llama.cpp", llama))}
    assert rounds["latentloop default"][0] == pytest.approx((0.02 + 0.1, 0.02))  # (whole, first)
    rows, reference = engines.case_rows(["latentloop default", "llama.cpp", "ctranslate2 fp32"],
                                        {"ctranslate2 fp32": "not installed (pip install ctranslate2)"},
                                        {"latentloop default": list(range(11)), "llama.cpp": [0, 1, 2, 9]},
                                        rounds, new_tokens)
    assert reference == "latentloop default"
    row = rows["latentloop default"]
    assert row["first_token_ms_all"] == pytest.approx([20.0] * 3)
    assert row["decode_ms_per_token_all"] == pytest.approx([10.0] * 3)
    assert row["decode_tokens_per_s_all"] == pytest.approx([100.0] * 3)
    assert row["first_over_llama_cpp_all"] == pytest.approx([2.0] * 3)
    assert row["decode_over_llama_cpp_all"] == pytest.approx([0.5] * 3)
    assert row["over_llama_cpp_all"] == pytest.approx([0.12 / 0.21] * 3)
    assert row["first_over_llama_cpp"]["mean"] == pytest.approx(2.0)
    assert (row["first_verdict"], row["decode_verdict"]) == ("slower", "faster")
    assert rows["llama.cpp"]["agree"] == 3 and row["agree"] == 11
    assert rows["ctranslate2 fp32"] == {"note": "not installed (pip install ctranslate2)"}


def test_pool_pools_each_figure_of_each_case(tmp_path, capsys):
    """Runs with several cases: `--pool` gives a table per case and figure, the decode's included."""
    engines = _engines()
    paths = []
    for run, decode in enumerate(([0.9, 0.92], [0.91, 0.93])):
        rows = {"latentloop default": {"over_llama_cpp_all": [1.2, 1.1], "first_over_llama_cpp_all": [1.6, 1.5],
                                       "decode_over_llama_cpp_all": decode},
                "llama.cpp": {"over_llama_cpp_all": [1.0, 1.0]}}
        cases = {engines.case_name(shape, 2048): {"threads": {"1": rows}} for shape in ("small", "large-32k")}
        paths.append(tmp_path / f"run{run}.json")
        paths[-1].write_text(json.dumps({"args": {"new_tokens": 128}, "cases": cases}))
    assert engines.main(["--pool", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "large-32k / prompt 2048, decode per token:" in out and "small / prompt 2048, time to first token:" in out
    decode = out.split("large-32k / prompt 2048, decode per token:")[1]
    row = next(line for line in decode.splitlines() if line.startswith("| latentloop default"))
    cells = [cell.strip() for cell in row.split("|")[2:-1]]
    # over the runs' geometric means (0.90997, 0.91996), not their four rounds as if independent
    means = [math.exp(sum(map(math.log, run)) / 2) for run in ([0.9, 0.92], [0.91, 0.93])]
    assert cells[:4] == ["1", "2", "4", f"{means[0]:.3f}, {means[1]:.3f}"], cells
    half = 12.706 * abs(math.log(means[1]) - math.log(means[0])) / 2  # t(0.975, 1) x s / sqrt(2)
    low, high = (math.exp(sum(map(math.log, means)) / 2 + sign * half) for sign in (-1, 1))
    assert cells[4].startswith(f"{math.sqrt(means[0] * means[1]):.3f} [{low:.3f}, {high:.3f}]"), cells[4]
    assert cells[5] == "ahead"


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_step_streams_every_weight_but_an_untied_embedding_table_and_the_cache(tied):
    """The bytes behind the GB/s column: an untied embedding table is looked up (one row), so it is
    not streamed; a tied one is the output head's weight, read whole. Cache elements per position:
    keys and values of every layer's key/value heads (grouped-query attention: fewer than the
    query heads')."""
    import latentloop

    engines = _engines()
    model = latentloop.build("gpt", preset=None, vocab_size=300, n_layer=3, n_embd=64, n_head=4, n_kv_head=2,
                             sequence_len=32, tie_embeddings=tied)
    every = sum(p.numel() for p in model.parameters()) * 4
    weights, cache = engines.streamed_bytes(model)
    assert weights == (every if tied else every - 300 * 64 * 4)
    assert cache == 3 * 2 * 2 * 16


def test_decode_gb_per_s_counts_the_weights_and_the_cache_at_its_mean_length():
    """1 MB of weights and 100 cache elements a position, a 50-token prompt and 20 new tokens: the
    decode's mean length is 60 positions, so llama.cpp (f16 cache) streams 1e6 + 100 * 2 * 60 bytes a
    step and latentloop's default path (fp32 cache) 1e6 + 100 * 4 * 60; at 1 ms a step that many kB
    a ms; an int8 row and a run without the case's bytes give None."""
    engines = _engines()
    case = {"prompt_len": 50, "weight_bytes": 1_000_000, "cache_elements_per_position": 100}
    assert engines.decode_gb_per_s(case, "llama.cpp", 1.0, 20) == pytest.approx(1.012)
    assert engines.decode_gb_per_s(case, "latentloop default", 0.5, 20) == pytest.approx(2.048)
    assert engines.decode_gb_per_s(case, "latentloop eager int8", 1.0, 20) is None
    assert engines.decode_gb_per_s({"prompt_len": 50}, "llama.cpp", 1.0, 20) is None


def test_the_read_ceiling_kernel_reads_every_whole_block_on_one_and_two_threads(tmp_path):
    """`stream_read.c` sums what it reads: 1,000 ones hold 15 whole blocks of 64, so 960, whichever
    thread count splits them (a share skipped or read twice changes the sum); `read_ceiling` gives
    one finite speed a repeat."""
    import torch

    engines = _engines()
    library = engines.read_library(tmp_path)
    if isinstance(library, str):
        pytest.skip(f"stream_read.c did not build: {library}")
    ones = torch.ones(1000)
    for threads in (1, 2):
        assert library.latentloop_bench_read(ones.data_ptr(), ones.numel(), threads) == 960.0
    ramp = torch.arange(128, dtype=torch.float32)  # two blocks: the second is not the first again
    assert library.latentloop_bench_read(ramp.data_ptr(), ramp.numel(), 2) == float(ramp.sum())
    speeds = engines.read_ceiling(library, 1, mib=4, repeats=3)
    assert len(speeds) == 3 and all(0 < s < float("inf") for s in speeds)


def test_the_table_gives_each_float_rows_streamed_gb_per_s_against_the_ceiling():
    """A case where latentloop's decode takes 2 ms a step and the ceiling's median is 10 GB/s: its
    row reads 1e7 bytes (the weights, and 10 fp32 elements a position over 4 + 5 / 2 positions) / 2 ms
    = 5.0 GB/s, 0.50 of the ceiling; an int8 row reads "—"; the ceiling is printed under the table."""
    engines = _engines()
    entry = {"ms_per_token_all": [2.0], "first_token_ms_all": [3.0], "decode_ms_per_token_all": [2.0],
             "decode_tokens_per_s_all": [500.0], "agree": 5}
    case = {"vocab_size": 259, "params": 1, "prompt_len": 4, "weight_bytes": 10_000_000 - 260,
            "cache_elements_per_position": 10, "reference": "latentloop default",
            "threads": {"1": {"latentloop default": entry, "latentloop eager int8": dict(entry)}},
            "read_ceiling": {"1": [9.0, 10.0, 11.0]}}
    table = engines.markdown_table({"args": {"new_tokens": 5}, "cases": {"smoke / prompt 4": case}})
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in table.splitlines() if line.startswith("| latentloop"))}
    assert rows["latentloop default"][6] == "5.0 (0.50)" and rows["latentloop eager int8"][6] == "—"
    assert "read ceiling, 1 thread(s)" in table and "10.0 [9.0–11.0]" in table
    # a step whose bytes fit the CPU's last cache is read from it, not from memory: its ratio says so
    for cache, fits in ((16 * 2**20, True), (4 * 2**20, False)):
        table = engines.markdown_table({"args": {"new_tokens": 5}, "cases": {"smoke / prompt 4": {
            **case, "last_level_cache_bytes": cache}}})
        row = next(line for line in table.splitlines() if line.startswith("| latentloop default"))
        assert ("5.0 (0.50; its bytes fit the CPU's cache: not a memory rate)" in row) is fits
        assert "5.0 (0.50)" in row or fits
