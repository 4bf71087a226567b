"""latentloop's decode against the CPU engines users pick for local inference, same model, same run
(issues 26 and 54): one gpt of a Llama-compatible shape (SwiGLU, no qk/embedding norm) saved as a
run, exported with `latentloop export --plain`, and decoded greedily at batch 1 by

- latentloop: its default path (`compile="auto"`, what `latentloop.generate` and the CLI do), eager
  (`compile=False`), compiled (`compile=True`: the ahead-of-time package on CPU), compiled through
  dynamo (`LATENTLOOP_AOT=0`, the compiled path before it), eager and compiled int8 (`quantize_int8`;
  compiled both ways too: the package's int8 reduction, dynamo's native kernel), and the default path
  with a float16 cache (`latentloop default f16 cache`: `kv_dtype="float16"`, llama.cpp's default
  cache type, where its other rows keep fp32 keys and values);
- Hugging Face `generate` on the exported folder (needs transformers);
- CTranslate2 fp32 and int8 (`pip install ctranslate2`), converted from the exported folder;
- llama.cpp's own decode loop (`llama.cpp`, `LlamaCppLoop`): its C API through llama-cpp-python's
  ctypes bindings, as llama-bench drives it: the prompt in one `llama_decode`, then one `llama_decode`
  per token and an argmax over the last logits, no sampler, flash attention off (`llama.cpp flash
  attention`: on, llama-bench's default on the CPU, whose tokens may leave the others': see
  `LlamaCppLoop`), with its default f16 cache (`llama.cpp f32 cache`: keys and values in fp32, as
  latentloop's default path keeps them: the same-precision comparison); and llama-cpp-python's
  `Llama.generate` (`llama-cpp-python generate`, the row of issue 26), which adds its Python sampler
  work to every token. All read the exported folder written as an fp32 GGUF file by `write_gguf`
  (no tokenizer: llama.cpp's "none" vocabulary of `vocab_size` ids takes and gives token ids, as
  every other engine here is given them).
  `pip install llama-cpp-python gguf`: PyPI has only its source for this platform, a ~17 min build
  on 2 cores (~60 min beside other work); `CMAKE_ARGS=-DGGML_NATIVE=ON` builds for this CPU.

Shapes (`--shapes`): `small` (4 layers, d 256), `large` (12 layers, d 768) and `smoke` (a test's),
with the byte tokenizer's 259-token vocabulary, and each of them with a real model's vocabulary:
`-32k` (32,000 ids) or `-128k` (128,000), e.g. `large-32k`. The larger vocabularies pad the byte
tokenizer (`HFTokenizer` with `vocab_size`: ids past the 259 never decode to text; CTranslate2 names
them `<extra_id_N>`), so every engine reads the same ids. Each shape's context covers the longest
prompt and the new tokens.

Prompts (`--prompt-len 16` or several, `512,2048,4096`): BOS, then a window of real text as bytes
(the Python standard library's own sources, `text_prompt`), the same for every engine. Every engine
decodes each prompt for the same number of new tokens, no stop token, from a fresh state (llama.cpp's
cache is cleared: `LlamaCppLoop`, `llama_greedy`). Each round times, per engine and prompt, one call for
all the new tokens (the whole call), after an untimed one-token call (`time_prompt`: the first call
after the settle pause is slower), and stamps the moment its first token exists, inside the call (time
to first token: the prompt's prefill, one token and whatever the engine does before it hands it over,
as a streaming user waits for it); the decode is the rest per token after the first. (Until 12-07 the
first token was a call of its own, which on latentloop's compiled paths took the eager path and skipped
the static cache's setup: that setup, 18-20 ms at a 4,096-token prompt by a review's measure, was
charged to the decode.) Each
figure of each engine is also given over llama.cpp's in the same round, a ratio per round, and
their geometric mean with its 95% t-interval (on the logs) over the interleaved rounds (below 1: faster than llama.cpp).
The compiled rows are warmed up (compiled) before timing; the default path is warmed up as a user's
process that decoded this shape before (`worker`). Each engine runs in a process of its own
(`EngineWorker`), started and warmed up one after another, then called in turn, one call at a time:
in one process CTranslate2's OpenMP runtime (a second copy, beside torch's) and the pools' spinning
workers took the cores from whichever engine ran next whenever more than one thread was asked for
(see `SETTLE_S`). Greedy agreement: each engine's tokens against the first latentloop float row's
(eager's when it runs), token by token (fp32 engines should agree on all; int8 may drift). The memory
wall: after each thread count's rounds the run measures the machine's read ceiling (`read_ceiling`,
`stream_read.c`) and gives each float-weight row's decode as the GB/s it streams, and that over the
ceiling (`decode_gb_per_s`): a row near 1.00 is bound by its bytes, not its code.

    .venv/bin/python -m benchmarks.engines [--shapes small,large-32k] [--threads 1,2]
        [--prompt-len 16|512,2048,4096] [--new-tokens 200] [--repeats 3] [--engines all|NAME,...]
        [--settle 0.5] [--json out.json]
    .venv/bin/python -m benchmarks.engines --pool run1.json run2.json   # the runs' rounds pooled
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import benchmark_main, render_table, require_at_least_one, spread, start_run

SHAPES = {  # the two shapes, with the byte vocabulary (a vocabulary suffix: `resolve_shape`)
    "small": dict(n_layer=4, n_embd=256, n_head=4),
    "large": dict(n_layer=12, n_embd=768, n_head=12),
    "smoke": dict(n_layer=2, n_embd=64, n_head=2),  # for the test: seconds, not minutes
}
# A shape's name may end in one of these for a real model's vocabulary instead of the byte one
VOCABULARIES = {"32k": 32_000, "128k": 128_000}
LLAMA_COMPATIBLE = dict(qk_norm=False, embed_norm=False, mlp="swiglu")  # what `export --plain` requires
ENGINES = ("latentloop default", "latentloop default f16 cache", "latentloop eager", "latentloop compiled",
           "latentloop compiled dynamo",
           "latentloop eager int8", "latentloop compiled int8", "latentloop compiled int8 dynamo",
           "hf generate", "ctranslate2 fp32", "ctranslate2 int8", "llama.cpp", "llama.cpp f32 cache",
           "llama.cpp flash attention", "llama-cpp-python generate")
# every engine's tokens are compared with the first of these that runs
REFERENCES = ("latentloop eager", "latentloop default", "latentloop compiled", "latentloop compiled dynamo")
# int8 engines' tokens drift from the float model's within a few tokens (a random model's logits are
# close together): they are compared with latentloop's eager int8 decode too, which they should follow
INT8_REFERENCE = "latentloop eager int8"
PAIRED_WITH = "llama.cpp"  # every engine's figures are also given over this engine's, round by round
# (key of the per-round ratios, what the ratio is of) for the figures paired with llama.cpp's
FIGURES = (("over_llama_cpp", "whole call"), ("first_over_llama_cpp", "time to first token"),
           ("decode_over_llama_cpp", "decode per token"))
# Seconds each timed call waits first, so the threads of the engine that ran before it (in its own
# process) have stopped spinning: OpenMP and ggml pools spin for a while after their work. A
# precaution whose effect was not measured apart: what mattered was the processes. With all engines
# in one process and 2 threads on the project's 2-core machine, latentloop compiled took 2.54 ms a
# token and llama.cpp 2.07 at the small shape, against 0.305 and 0.272 each alone; with only
# CTranslate2 beside it, latentloop compiled still took 2.4 ms (CTranslate2 brings its own libgomp),
# and this pause alone did not help there (2.00 ms).
SETTLE_S = 0.5
REPO_ROOT = Path(__file__).resolve().parent.parent  # `python -m benchmarks.engines` runs from here
WORKER_EXIT_S = 30  # how long a worker may take to exit once told to
# Hugging Face's plain-Llama tensor names -> GGUF's (llama.cpp's LLM_ARCH_LLAMA); {i} the layer
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}
# Bytes of the standard library's sources the prompts' windows are drawn from (`text_prompt`)
PROMPT_TEXT_BYTES = 1 << 20
# The memory wall. A decode step at batch 1 reads every weight but the embedding table (one row of
# it) and the whole cache once, and does a few flops per byte: its time is the bytes over the memory
# speed. Each run measures that speed's ceiling itself (`read_ceiling`: `stream_read.c`, the fastest
# plain read, on the run's threads, right after its engines' rounds), and gives each float-weight
# engine's decode as the bytes it streams a second against it (`decode_gb_per_s`): an engine at the
# ceiling can be beaten only by reading fewer bytes. Bytes of one cache element, per engine (its
# weights fp32 in every one of these; the int8 rows read a quarter and are left out):
CACHE_ELEMENT_BYTES = {"latentloop default": 4, "latentloop default f16 cache": 2, "latentloop eager": 4,
                       "latentloop compiled": 4, "latentloop compiled dynamo": 4, "hf generate": 4,
                       "ctranslate2 fp32": 4, "llama.cpp": 2, "llama.cpp f32 cache": 4, "llama.cpp flash attention": 2,
                       "llama-cpp-python generate": 2}
READ_CEILING_MIB = 256  # far past any cache (the project's machine: 48 MiB of L3)
READ_CEILING_REPEATS = 15


def shape_names() -> list[str]:
    """Every name `--shapes` takes: each shape, with the byte vocabulary and with each of `VOCABULARIES`."""
    return [f"{base}{suffix}" for base in SHAPES for suffix in ("", *(f"-{v}" for v in VOCABULARIES))]


def resolve_shape(name: str) -> tuple[dict, int | None]:
    """(the model's layers, its vocabulary size or None for the byte tokenizer's) of a shape's name:
    `small`, `large-32k`, ... A ValueError names the choices."""
    base, _, vocabulary = name.partition("-")
    if base not in SHAPES or (vocabulary and vocabulary not in VOCABULARIES):
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}, each optionally with "
                         f"{' or '.join('-' + v for v in VOCABULARIES)} (e.g. large-32k)")
    return SHAPES[base], VOCABULARIES.get(vocabulary)


def comma_integers(text: str, flag: str) -> list[int]:
    """`--flag 1,2` as [1, 2]; a ValueError (its message one line, naming the flag) when a value is
    not an integer >= 1."""
    try:
        values = [int(value) for value in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(value < 1 for value in values):
        raise ValueError(f"{flag} must be >= 1, got {text!r}")
    return values


def padded_tokenizer(vocab_size: int, folder: Path):
    """The byte tokenizer with its vocabulary padded to `vocab_size` ids (as models pad theirs): the
    byte-level JSON `write_hf_tokenizer` gives it, read back as an `HFTokenizer` of that size."""
    from latentloop.data.tokenizers import ByteTokenizer, HFTokenizer, write_hf_tokenizer

    write_hf_tokenizer(ByteTokenizer(), folder / "byte-tokenizer")
    return HFTokenizer.from_pretrained_folder(folder / "byte-tokenizer", vocab_size=vocab_size)


def build_export(shape: dict, context: int, seed: int, folder: Path, vocab_size: int | None = None):
    """(model, tokenizer, hf folder): a random-init gpt saved as a run and exported as plain Llama;
    with the byte tokenizer's vocabulary, or `vocab_size` ids (`padded_tokenizer`)."""
    import latentloop
    from latentloop.data.tokenizers import ByteTokenizer
    from latentloop.interop import export_hf
    from latentloop.runs import save_run

    tokenizer = ByteTokenizer() if vocab_size is None else padded_tokenizer(vocab_size, folder)
    torch.manual_seed(seed)
    model = latentloop.build("gpt", preset=None, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id,
                             sequence_len=context, **shape, **LLAMA_COMPATIBLE).eval()
    save_run(model, tokenizer, folder / "run")
    export_hf(folder / "run", folder / "hf", plain=True)
    return model, tokenizer, folder / "hf"


def prompt_text() -> bytes:
    """Up to `PROMPT_TEXT_BYTES` of real text: the Python standard library's own sources, file after
    file in name order (the same bytes for every engine and round of a run)."""
    text = bytearray()
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        try:
            text += path.read_bytes()
        except OSError:
            continue
        if len(text) >= PROMPT_TEXT_BYTES:
            break
    return bytes(text[:PROMPT_TEXT_BYTES])


def text_prompt(length: int, bos_id: int, seed: int, text: bytes | None = None) -> list[int]:
    """`length` ids: BOS, then a window of real text as bytes (ids below 256, an id of every
    vocabulary here) at an offset the seed draws; deterministic random bytes where there is not
    enough text."""
    text = prompt_text() if text is None else text
    draw = random.Random(seed)
    if len(text) < length:
        return [bos_id] + [draw.randrange(256) for _ in range(length - 1)]
    start = draw.randrange(len(text) - length + 1)
    return [bos_id] + list(text[start:start + length - 1])


def engine_kv_dtype(engine: str) -> str | None:
    """The compiled step's cache dtype of a latentloop row: float16 for the "f16 cache" row."""
    return "float16" if engine.endswith("f16 cache") else None


def latentloop_generate(model, prompt: list[int], new_tokens: int, compile: bool | str, aot: bool = True,
                        kv_dtype: str | None = None, marks: list | None = None) -> list[int]:
    """latentloop's greedy tokens through `latentloop.generate`, the ahead-of-time package on or off,
    the compiled step's cache in `kv_dtype`; with `marks`, through `latentloop.stream` (in one inference
    mode, as `generate` runs it), the clock appended to `marks` as the first token arrives."""
    import latentloop
    from latentloop.inference.aot import AOT_ENV

    saved = os.environ.get(AOT_ENV)
    os.environ[AOT_ENV] = "1" if aot else "0"  # read when the call makes its decoder
    try:
        if marks is None:
            return latentloop.generate(model, prompt, new_tokens, temperature=0.0, compile=compile, kv_dtype=kv_dtype)
        tokens: list[int] = []
        with torch.inference_mode():
            for step in latentloop.stream(model, prompt, new_tokens, temperature=0.0, compile=compile,
                                          kv_dtype=kv_dtype):
                if not marks:
                    marks.append(time.perf_counter())
                tokens += [token for token in step.tokens if token is not None]
        return tokens
    finally:
        os.environ.pop(AOT_ENV) if saved is None else os.environ.__setitem__(AOT_ENV, saved)


def latentloop_call(model, prompt: list[int], compile: bool | str, aot: bool = True):
    """call(new_tokens) -> latentloop's greedy tokens for `prompt` (`latentloop_generate`)."""
    return lambda new_tokens: latentloop_generate(model, prompt, new_tokens, compile, aot)


def switched_calls(shape: dict, switch: dict, prompt: list[int], new_tokens: int):
    """(off, on): a whole greedy generation each, on two copies of the engines' model (a decoder of
    its own each), with `switch["on"]` set False / True around the call: for an A/B of a change that
    reads the switch, in one process (`common.paired_ratios`)."""
    import copy
    import tempfile

    model_off, _, _ = build_export(shape, 256, 0, Path(tempfile.mkdtemp()))
    model_on = copy.deepcopy(model_off)
    calls = {False: latentloop_call(model_off, prompt, compile=True),
             True: latentloop_call(model_on, prompt, compile=True)}

    def call(on: bool) -> list[int]:
        switch["on"] = on
        return calls[on](new_tokens)

    return (lambda: call(False)), (lambda: call(True))


def hf_call(hf_dir: Path):
    """call(prompt, new_tokens, marks=None) -> Hugging Face `generate`'s greedy tokens (the clock appended to
    `marks` as the first one arrives, through a streamer)."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    class FirstToken(transformers.generation.streamers.BaseStreamer):
        """Stamps the clock when `generate` hands over its first new token (its first `put` is the prompt)."""

        def __init__(self, marks: list):
            self.marks, self.puts = marks, 0

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.marks.append(time.perf_counter())

        def end(self) -> None:
            pass

    @torch.inference_mode()
    def call(prompt: list[int], new_tokens: int, marks: list | None = None) -> list[int]:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0, streamer=None if marks is None else FirstToken(marks))
        return out[0, len(prompt):].tolist()

    return call


def ctranslate2_call(hf_dir: Path, folder: Path, threads: int, quantization: str | None):
    """call(prompt, new_tokens, marks=None) -> CTranslate2's greedy tokens (the first one stamped in `marks` by
    its step callback). It takes tokens as strings: each id's
    entry of the converted model's own vocabulary (the tokenizer's, padded with `<extra_id_N>` up
    to the model's vocabulary size)."""
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    out = folder / f"ct2-{quantization or 'float32'}"
    if not out.exists():
        TransformersConverter(str(hf_dir)).convert(str(out), quantization=quantization, force=True)
    generator = ctranslate2.Generator(str(out), device="cpu", intra_threads=threads, compute_type=quantization or
                                      "float32")
    vocabulary = json.loads((out / "vocabulary.json").read_text(encoding="utf-8"))

    def call(prompt: list[int], new_tokens: int, marks: list | None = None) -> list[int]:
        def first_token(step) -> bool:  # called as each token is made (greedy, one batch row)
            if not marks:
                marks.append(time.perf_counter())
            return False  # go on

        result = generator.generate_batch([[vocabulary[i] for i in prompt]], max_length=new_tokens, sampling_topk=1,
                                          include_prompt_in_result=False, end_token=[],
                                          callback=None if marks is None else first_token)
        return list(result[0].sequences_ids[0])

    return call


def interleave_rotary_halves(weight, heads: int):
    """A q or k projection's output rows reordered, head by head, from Hugging Face's rotary layout
    to llama.cpp's: HF rotates row j of a head with row j + head_dim / 2 (`rotate_half`), llama.cpp
    rotates rows 2j and 2j + 1, so row j goes to 2j and row j + head_dim / 2 to 2j + 1."""
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, cols).transpose(0, 2, 1, 3).reshape(rows, cols)  # (rows, cols)


def write_gguf(hf_dir: Path, path: Path) -> None:
    """An exported plain-Llama folder (config.json, model.safetensors) as an fp32 GGUF file for
    llama.cpp, with no tokenizer (the "none" vocabulary of `vocab_size` ids)."""
    import json

    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("none")
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if name in GGUF_NAMES:
            writer.add_tensor(GGUF_NAMES[name], tensor)
            continue
        _, _, layer, rest = name.split(".", 3)  # model.layers.{i}.{rest}.weight
        part = rest.removesuffix(".weight")
        if part == "self_attn.q_proj":
            tensor = interleave_rotary_halves(tensor, heads)
        elif part == "self_attn.k_proj":
            tensor = interleave_rotary_halves(tensor, kv_heads)
        writer.add_tensor(f"blk.{layer}.{GGUF_LAYER_NAMES[part]}.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_path(hf_dir: Path, folder: Path) -> Path:
    """The exported folder as an fp32 GGUF file (`write_gguf`), written once per folder."""
    path = folder / "model-f32.gguf"
    if not path.exists():
        write_gguf(hf_dir, path)
    return path


class LlamaCppLoop:
    """llama.cpp's own greedy decode, through its C API (llama-cpp-python's ctypes bindings, none of
    its Python sampling): a call clears the cache, decodes the prompt in one batch
    (`llama_batch_get_one`: only the last position's logits are computed), then takes the argmax of
    the last logits (a numpy view of llama.cpp's float buffer) and decodes that token, one
    `llama_decode` per token, as llama-bench times generation. Context settings are llama.cpp's
    defaults (its f16 KV cache, 512-token micro-batches inside a batch) except the context, the batch
    (the longest prompt), the threads, the cache's type (fp32 with `f32_cache`) and flash attention:
    off unless `flash_attn`. llama-bench's
    default ("auto") turns it on for the CPU, where its kernel rounds the queries to f16 too: on the
    benchmark's random models, whose logits lie close together, greedy tokens then left latentloop's
    after 65 of 128 at the small shape (1 and 2 threads), where with it off they agree on all 128, as
    with llama-cpp-python's `Llama`, which turns it off."""

    def __init__(self, path: Path, context: int, batch: int, threads: int, flash_attn: bool = False,
                 f32_cache: bool = False):
        import llama_cpp as ll

        self.ll = ll
        _quiet_llama_cpp()
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch = context, batch
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if f32_cache:  # `--cache-type-k f32 --cache-type-v f32`
            params.type_k = params.type_v = ll.GGML_TYPE_F32
        self.context = ll.llama_init_from_model(self.model, params)
        if not self.context:
            raise RuntimeError(f"llama.cpp could not make a context of {context} tokens for {path}")
        self.vocab_size = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.memory = ll.llama_get_memory(self.context)
        self.token = (ll.llama_token * 1)()  # the one-token batch's id, reused

    def _decode(self, tokens, count: int) -> None:
        status = self.ll.llama_decode(self.context, self.ll.llama_batch_get_one(tokens, count))
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for {count} token(s)")

    def _argmax(self) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.context, -1), shape=(self.vocab_size,))
        return int(logits.argmax())

    def __call__(self, prompt: list[int], new_tokens: int, marks: list | None = None) -> list[int]:
        self.ll.llama_memory_clear(self.memory, False)  # an empty cache: the whole prompt is decoded again
        self._decode((self.ll.llama_token * len(prompt))(*prompt), len(prompt))
        tokens = [self._argmax()]
        if marks is not None:
            marks.append(time.perf_counter())
        while len(tokens) < new_tokens:
            self.token[0] = tokens[-1]
            self._decode(self.token, 1)
            tokens.append(self._argmax())
        return tokens

    def close(self) -> None:
        if self.context:
            self.ll.llama_free(self.context)
            self.context = None
        if self.model:
            self.ll.llama_model_free(self.model)
            self.model = None


_LOG_CALLBACK = None  # llama.cpp's log callback while it is set (ctypes must keep it alive)


def _quiet_llama_cpp() -> None:
    """llama.cpp's log on stderr with its errors only (llama-cpp-python prints every line by default)."""
    global _LOG_CALLBACK
    import llama_cpp as ll

    if _LOG_CALLBACK is None:
        def log(level: int, text: bytes, _data) -> None:
            if level == 4:  # GGML_LOG_LEVEL_ERROR in ggml.h (llama-cpp-python's own comment has older numbers)
                sys.stderr.write(text.decode("utf-8", errors="replace"))

        _LOG_CALLBACK = ll.llama_log_callback(log)
    ll.llama_log_set(_LOG_CALLBACK, None)


def llama_cpp_python_call(path: Path, context: int, batch: int, threads: int):
    """call(prompt, new_tokens, marks=None) -> llama-cpp-python's `Llama.generate` greedy tokens (`llama_greedy`)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=context, n_batch=batch, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    return lambda prompt, new_tokens, marks=None: llama_greedy(llm, prompt, new_tokens, marks)


def llama_greedy(llm, prompt: list[int], new_tokens: int, marks: list | None = None) -> list[int]:
    """llama-cpp-python's greedy tokens for `prompt`, its state reset first. Its `generate` keeps the
    last call's tokens and evaluates only what follows their longest common prefix: called again with
    the same prompt it skipped the prefill (one token evaluated instead of 16), a call's worth of work
    the other engines do every time (found 2026-12-03: its first token took 0.02 ms against 3.6-4.7 ms
    after a reset, at the small shape)."""
    llm.reset()
    tokens = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy: its argmax sampler
        if marks is not None and not marks:
            marks.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == new_tokens:
            break
    return tokens


def unavailable(engine: str) -> str | None:
    """Why an engine cannot run here, or None."""
    module = {"hf generate": ("transformers",), "ctranslate2 fp32": ("ctranslate2",),
              "ctranslate2 int8": ("ctranslate2",), "llama.cpp": ("llama_cpp", "gguf"),
              "llama.cpp f32 cache": ("llama_cpp", "gguf"),
              "llama.cpp flash attention": ("llama_cpp", "gguf"), "llama-cpp-python generate": ("llama_cpp", "gguf")}
    install = {"llama_cpp": "llama-cpp-python"}
    for name in module.get(engine, ()):
        try:
            __import__(name)
        except ImportError:
            return f"not installed (pip install {install.get(name, name)})"
    return None


def make_call(engine: str, model, folder: Path, context: int, batch: int, threads: int):
    """call(prompt, new_tokens, marks=None) -> `engine`'s greedy token ids (with `marks`, a list, the clock
    appended to it as the first token exists), for prompts of up to `batch` tokens
    and `context` tokens in all; `model` is the run's (latentloop rows), `folder` holds its export."""
    hf_dir = folder / "hf"
    if engine.startswith("latentloop"):
        if "int8" in engine:
            import copy

            from latentloop.inference.quant import quantize_int8

            model = quantize_int8(copy.deepcopy(model))
        compile = {"default": "auto", "eager": False}.get(engine.split()[1], True)
        aot = not engine.endswith("dynamo")
        kv_dtype = engine_kv_dtype(engine)
        return lambda prompt, new_tokens, marks=None: latentloop_generate(model, prompt, new_tokens, compile, aot,
                                                                          kv_dtype, marks)
    if engine == "hf generate":
        return hf_call(hf_dir)
    if engine.startswith("ctranslate2"):
        return ctranslate2_call(hf_dir, folder, threads, "int8" if engine.endswith("int8") else None)
    if engine in ("llama.cpp", "llama.cpp f32 cache", "llama.cpp flash attention"):
        return LlamaCppLoop(gguf_path(hf_dir, folder), context, batch, threads,
                            flash_attn=engine == "llama.cpp flash attention", f32_cache=engine == "llama.cpp f32 cache")
    if engine == "llama-cpp-python generate":
        return llama_cpp_python_call(gguf_path(hf_dir, folder), context, batch, threads)
    raise ValueError(f"unknown engine {engine!r}")


def agreement(tokens: list[int], reference: list[int]) -> int:
    """Greedy tokens equal to the reference's, counted from the start until the first difference."""
    same = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        same += 1
    return same


def worker(spec: dict[str, Any]) -> int:
    """One engine in a process of its own (`--worker SPEC`, started by `EngineWorker`): loads the
    exported model, warms the engine up on every prompt and answers with its greedy tokens for each,
    then, for every line it reads until its input closes (a prompt's index), times a call for all the
    new tokens and the moment its first one exists (`time_prompt`). Answers go to the
    original stdout, one JSON line each; anything a library prints goes to stderr.

    The default path (`compile="auto"`) is warmed up as a process that decoded this shape before:
    a compiled call first, so that its calls find the step compiled (`AutoCompile.compiled_already`)
    and move onto it after their eager probe steps, as a user's do once the automatic rule has
    compiled (a fresh process's first calls stay eager until the saving pays for the compile)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the libraries' own prints (llama.cpp, transformers) stay out of the answers
    torch.set_num_threads(spec["threads"])
    folder, engine, prompts, new_tokens = Path(spec["folder"]), spec["engine"], spec["prompts"], spec["new_tokens"]
    model = None
    if engine.startswith("latentloop"):
        import latentloop

        model, _ = latentloop.load(folder / "run")
        model.eval()
    longest = max(len(prompt) for prompt in prompts)
    call = make_call(engine, model, folder, longest + new_tokens, longest, spec["threads"])
    tokens = []
    for prompt in prompts:
        if engine.startswith("latentloop default"):  # the f16 cache's step is a package of its own
            latentloop_generate(model, prompt, new_tokens, compile=True, kv_dtype=engine_kv_dtype(engine))
        tokens.append(call(prompt, new_tokens))  # the warm-up (compiles), and the tokens
        call(prompt, 1)
    answers.write(json.dumps({"tokens": tokens}) + "\n")
    answers.flush()
    for line in sys.stdin:
        index = int(line)
        outputs: list = []
        whole, first = time_prompt(call, prompts[index], new_tokens, outputs=outputs)
        # every timed call's tokens against the warm-up's: a timing of other work is no comparison
        answers.write(json.dumps({"seconds": whole, "first_seconds": first,
                                  "same_tokens": list(outputs[0]) == list(tokens[index])}) + "\n")
        answers.flush()
    return 0


def time_prompt(call, prompt: list[int], new_tokens: int, clock=time.perf_counter,
                outputs: list | None = None) -> tuple[float, float]:
    """Seconds of (a call for `new_tokens` new tokens, its first token: the time to first token,
    stamped by the call itself as that token exists, the prompt's prefill and whatever the engine
    does before it included). An untimed one-token call goes first: the first call after the settle
    pause ran slower (1.6 ms against 1.0 for the same one-token call, every round). The first token
    was a call of its own before 12-07, which on latentloop's compiled paths took another path (no
    static cache to set up: 18-20 ms at a 4,096-token prompt by a review's measure, then charged to the decode)."""
    call(prompt, 1)  # untimed: whatever the first call after the pause pays, the timed call does not carry it
    marks: list[float] = []
    start = clock()
    out = call(prompt, new_tokens, marks)
    whole = clock() - start
    if outputs is not None:  # the tokens of the timed call, for the caller to check
        outputs.append(out)
    return whole, marks[0] - start


class EngineWorker:
    """The parent's handle on one engine's process: started and warmed up on construction (its greedy
    tokens for each prompt in `tokens`), then `time_call(index)` per timed call; `close()` ends it."""

    def __init__(self, engine: str, folder: Path, prompts: list[list[int]], new_tokens: int, threads: int):
        self.engine = engine
        spec = {"engine": engine, "folder": str(folder), "prompts": prompts, "new_tokens": new_tokens,
                "threads": threads}
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.process = subprocess.Popen([sys.executable, "-m", "benchmarks.engines", "--worker", json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                        env=environment)
        self.tokens: list[list[int]] = self._answer()["tokens"]

    def _answer(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.engine} worker exited with code {self.process.wait()} (its stderr is above)")
        return json.loads(line)

    def time_call(self, prompt: int = 0) -> tuple[float, float]:
        """Seconds of (a call for all the new tokens, one for the first new token only) for the
        `prompt`-th prompt."""
        self.process.stdin.write(f"{prompt}\n")
        self.process.stdin.flush()
        answer = self._answer()
        if answer.get("same_tokens") is False:
            raise SystemExit(f"engines: {self.engine}'s timed call for prompt {prompt} gave other tokens than its "
                             f"warm-up: its time is not of the same work (a decode that is not deterministic)")
        return answer["seconds"], answer["first_seconds"]

    def close(self) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=WORKER_EXIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def streamed_bytes(model) -> tuple[int, int]:
    """(bytes of weights a batch-1 decode step reads, cache elements a position holds) of a gpt: every
    parameter but an untied embedding table (a step looks up one of its rows; a tied one is read
    whole, as the output head), and keys and values of every layer's key/value heads."""
    config = model.config
    table = model.wte.weight if model.lm_head is not None else None
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not table)
    return weights, config.n_layer * 2 * config.n_kv_head * config.head_dim


def decode_gb_per_s(case: dict[str, Any], engine: str, ms_per_token: float, new_tokens: int) -> float | None:
    """The bytes an engine's decode step streams a second (GB/s): the weights (`streamed_bytes`) and
    the cache at the decode's mean length (the prompt and half the new tokens), at the engine's
    cache element (`CACHE_ELEMENT_BYTES`); None for an engine not listed there or a run from before
    the case recorded its bytes."""
    streamed = step_bytes(case, engine, new_tokens)
    if streamed is None or ms_per_token <= 0:
        return None
    return streamed / (ms_per_token * 1e-3) / 1e9


def step_bytes(case: dict[str, Any], engine: str, new_tokens: int) -> float | None:
    """The bytes one decode step of `engine` streams at the decode's mean length (`decode_gb_per_s`)."""
    if engine not in CACHE_ELEMENT_BYTES or "weight_bytes" not in case:
        return None
    positions = case["prompt_len"] + new_tokens / 2
    return case["weight_bytes"] + case["cache_elements_per_position"] * CACHE_ELEMENT_BYTES[engine] * positions


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache (Linux: the highest `index*` level of cpu0), or None where it cannot be read."""
    found: dict[int, int] = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if size[-1:] in units and size[:-1].isdigit():
            found[level] = max(found.get(level, 0), int(size[:-1]) * units[size[-1]])
    return found[max(found)] if found else None


def read_library(folder: Path) -> ctypes.CDLL | str:
    """`stream_read.c` built into `folder` with the flags the library's kernels get; or why not (one line)."""
    from latentloop.inference import native

    cc = native._compiler()
    if cc is None:
        return "no C compiler"
    target = folder / "stream_read.so"
    flags = (*native.LIBRARY_FLAGS, *native.FLAG_CHOICES[0])  # -march=native -fopenmp, as the kernels
    done = subprocess.run([cc, *flags, str(Path(__file__).with_name("stream_read.c")), "-o", str(target)],
                          capture_output=True, text=True, timeout=native.BUILD_TIMEOUT_S)
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or [f"{cc} exited with {done.returncode}"])[-1]
    library = ctypes.CDLL(str(target))
    library.latentloop_bench_read.restype = ctypes.c_float
    library.latentloop_bench_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return library


def read_ceiling(library: ctypes.CDLL, threads: int, mib: int = READ_CEILING_MIB,
                 repeats: int = READ_CEILING_REPEATS) -> list[float]:
    """GB/s of `repeats` plain reads of `mib` MiB on `threads` threads (`stream_read.c`), the first
    untimed (it faults the pages in)."""
    data = torch.ones(mib << 18)  # float32: 4 bytes each
    whole = data.numel() // 64 * 64 * data.element_size()  # the blocks the kernel reads
    library.latentloop_bench_read(data.data_ptr(), data.numel(), threads)
    speeds = []
    for _ in range(repeats):
        start = time.perf_counter()
        library.latentloop_bench_read(data.data_ptr(), data.numel(), threads)
        speeds.append(whole / (time.perf_counter() - start) / 1e9)
    return speeds


def case_name(shape: str, prompt_len: int) -> str:
    return f"{shape} / prompt {prompt_len}"


Rounds = list[tuple[float, float]]  # (seconds of the whole call, seconds of the first token's call) per round


def measure(engines: list[str], folder: Path, prompts: list[list[int]], new_tokens: int, threads: int,
            repeats: int, settle: float) -> tuple[dict[str, list[list[int]]], dict[str, list[Rounds]]]:
    """(engine -> its greedy tokens per prompt, engine -> its rounds per prompt): every engine in a
    process of its own, started and warmed up one after another, then `repeats` rounds, each timing
    every prompt on every engine, the engines' order rotating from round to round."""
    workers: dict[str, EngineWorker] = {}
    try:
        for name in engines:  # one after another: a warm-up (a compile) has the machine to itself
            workers[name] = EngineWorker(name, folder, prompts, new_tokens, threads)
        timed = {name: [[] for _ in prompts] for name in workers}
        for r in range(repeats):  # interleaved, order rotating
            shift = r % len(engines)
            for index in range(len(prompts)):
                for name in engines[shift:] + engines[:shift]:
                    time.sleep(settle)
                    timed[name][index].append(workers[name].time_call(index))
    finally:
        for w in workers.values():
            w.close()
    return {name: w.tokens for name, w in workers.items()}, timed


def case_rows(engines: list[str], notes: dict[str, str | None], tokens: dict[str, list[int]],
              timed: dict[str, list[tuple[float, float]]], new_tokens: int) -> tuple[dict[str, Any], str | None]:
    """(engine -> its figures, the reference engine) for one prompt at one thread count: the timing
    (`timing_entry`), the greedy agreement with the reference row's tokens (and the int8 rows' with
    latentloop eager int8's), and every figure over llama.cpp's of the same round (`paired_with`)."""
    reference = next((name for name in REFERENCES if name in tokens), None)
    rows: dict[str, Any] = {}
    for engine in engines:
        if notes.get(engine) is not None:
            rows[engine] = {"note": notes[engine]}
            continue
        entry = timing_entry(timed[engine], new_tokens)
        if reference is not None:
            entry["agree"] = agreement(tokens[engine], tokens[reference])
        if "int8" in engine and INT8_REFERENCE in tokens:
            entry["agree_int8"] = agreement(tokens[engine], tokens[INT8_REFERENCE])
        if PAIRED_WITH in timed:  # each engine's rounds over llama.cpp's in the same round
            entry.update(paired_with(timed[engine], timed[PAIRED_WITH], new_tokens))
        rows[engine] = entry
    return rows, reference


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(argparse.Namespace(threads=args.threads[0]))  # each thread count is set again below
    results: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()}, "cases": {}}
    context = max(args.prompt_len) + args.new_tokens  # every shape's context covers the longest call
    text = prompt_text()
    for shape in args.shapes:
        layers, vocab_size = resolve_shape(shape)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            model, tokenizer, _ = build_export(layers, context, args.seed, folder, vocab_size)
            prompts = [text_prompt(length, tokenizer.bos_id, args.seed, text) for length in args.prompt_len]
            weight_bytes, cache_elements = streamed_bytes(model)
            cases = {length: results["cases"].setdefault(case_name(shape, length), {
                "shape": shape, "vocab_size": tokenizer.vocab_size, "params": model.num_params(),
                "context": context, "prompt_len": length, "weight_bytes": weight_bytes,
                "cache_elements_per_position": cache_elements, "threads": {}, "read_ceiling": {},
                "last_level_cache_bytes": last_level_cache_bytes()})
                for length in args.prompt_len}
            del model
            library = read_library(folder)
            for threads in args.threads:
                torch.set_num_threads(threads)
                notes = {engine: unavailable(engine) for engine in args.engines}
                runnable = [e for e in args.engines if notes[e] is None]
                print(f"{shape}, {threads} thread(s): preparing {', '.join(runnable)}, a process each ...", flush=True)
                tokens, timed = measure(runnable, folder, prompts, args.new_tokens, threads, args.repeats, args.settle)
                ceiling = library if isinstance(library, str) else read_ceiling(library, threads)  # the engines closed
                for index, length in enumerate(args.prompt_len):
                    rows, reference = case_rows(args.engines, notes, {e: t[index] for e, t in tokens.items()},
                                                {e: t[index] for e, t in timed.items()}, args.new_tokens)
                    cases[length]["threads"][str(threads)] = rows
                    cases[length]["reference"] = reference
                    cases[length]["read_ceiling"][str(threads)] = ceiling
    return results


def paired_with(rounds: list[tuple[float, float]], reference: list[tuple[float, float]],
                new_tokens: int | None = None) -> dict[str, Any]:
    """An engine's figures over the reference engine's of the same rounds: its whole calls
    (`over_llama_cpp`), and with `new_tokens` its first tokens (`first_over_llama_cpp`) and its
    decode after the first (`decode_over_llama_cpp`, when more than one token); per figure every
    round's ratio (`..._all`), their mean with its t interval over rounds, and the verdict ("faster"
    when the interval lies below 1, "slower" above it, "undecided" when it holds 1)."""
    from latentloop.eval.stats import paired_comparison, verdict

    figures = {"over_llama_cpp": [whole for whole, _ in rounds]}
    paired = {"over_llama_cpp": [whole for whole, _ in reference]}
    if new_tokens is not None:
        figures["first_over_llama_cpp"] = [first for _, first in rounds]
        paired["first_over_llama_cpp"] = [first for _, first in reference]
        if new_tokens > 1:  # the decode's time: the whole call less the first token's (per token: the same ratio)
            figures["decode_over_llama_cpp"] = [whole - first for whole, first in rounds]
            paired["decode_over_llama_cpp"] = [whole - first for whole, first in reference]
    entry: dict[str, Any] = {}
    for key, values in figures.items():
        comparison = paired_comparison(dict(enumerate(values)), dict(enumerate(paired[key])), kind="log_ratio")
        entry[f"{key}_all"] = [value / other for value, other in zip(values, paired[key])]
        entry[key] = comparison
        prefix = key.removesuffix("over_llama_cpp")
        entry[f"{prefix}verdict"] = verdict(comparison, "faster", "slower").replace("seed", "round")  # rounds pair
    return entry


def timing_entry(rounds: list[tuple[float, float]], new_tokens: int) -> dict[str, Any]:
    """One engine's figures from its rounds of (seconds for all new tokens, seconds for the first):
    the whole call per new token, the first token's time (prefill included), and the decode alone,
    per token after the first (the difference of the two calls of the same round) and as tokens per
    second."""
    per_token = [whole / new_tokens * 1e3 for whole, _ in rounds]
    entry = {"ms_per_token_all": per_token, "ms_per_token": statistics.median(per_token),
             "first_token_ms_all": [first * 1e3 for _, first in rounds]}
    if new_tokens > 1:
        decode = [(whole - first) / (new_tokens - 1) for whole, first in rounds]
        entry["decode_ms_per_token_all"] = [seconds * 1e3 for seconds in decode]
        entry["decode_tokens_per_s_all"] = [1 / seconds if seconds > 0 else float("inf") for seconds in decode]
    return entry


def streamed_cell(case: dict[str, Any], threads: str, engine: str, entry: dict[str, Any], new_tokens: int) -> str:
    """An engine's decode as GB/s streamed (`decode_gb_per_s`, its median round) and that over the
    median read ceiling at its thread count; "—" where either is missing."""
    if "decode_ms_per_token_all" not in entry:
        return "—"
    speed = decode_gb_per_s(case, engine, statistics.median(entry["decode_ms_per_token_all"]), new_tokens)
    if speed is None:
        return "—"
    ceiling = case.get("read_ceiling", {}).get(threads)
    cache = case.get("last_level_cache_bytes")
    # the ceiling is a read from memory (256 MiB): a step whose bytes fit the CPU's last cache reads faster
    fits = "; its bytes fit the CPU's cache: not a memory rate" if cache and step_bytes(
        case, engine, new_tokens) <= cache else ""
    return f"{speed:.1f}" + (f" ({speed / statistics.median(ceiling):.2f}{fits})" if isinstance(ceiling, list) else "")


def ceiling_lines(case: dict[str, Any]) -> str:
    """The read ceilings the case's run measured (`read_ceiling`), a line per thread count."""
    lines = [f"- read ceiling, {threads} thread(s) (stream_read.c, {READ_CEILING_MIB} MiB): "
             + (f"GB/s {spread(ceiling, '{:.1f}')}" if isinstance(ceiling, list) else f"not measured: {ceiling}")
             for threads, ceiling in case.get("read_ceiling", {}).items()]
    return "\n\n" + "\n".join(lines) if lines else ""


def markdown_table(results: dict[str, Any]) -> str:
    """A table per case (shape and prompt length): each engine's figures at each thread count."""
    from latentloop.eval.stats import format_comparison

    args = results["args"]
    tables = []
    for name, case in results["cases"].items():
        reference = case.get("reference") or "—"
        header = (f"Engine ({name}: vocabulary {case['vocab_size']:,}, {case['params']:,} params; "
                  f"{args['new_tokens']} new, batch 1, greedy)", "threads", "ms / new token (prefill included)",
                  "first token, ms (prefill included)", "decode, ms / token after the first", "decode, tokens / s",
                  "decode, GB/s streamed (median; over the read ceiling's)",
                  *(f"{what} over {PAIRED_WITH}'s, by round: geometric mean [95% t-interval], verdict"
                    for _, what in FIGURES),
                  f"greedy tokens agreeing with {reference} (int8 rows: and with {INT8_REFERENCE})")
        rows = [header]
        for threads, engines in case["threads"].items():
            for engine, entry in engines.items():
                if "note" in entry:
                    rows.append((engine, threads, *["—"] * (len(header) - 3), entry["note"]))
                    continue
                agree = f"{entry['agree']}/{args['new_tokens']}" if "agree" in entry else "—"
                if "agree_int8" in entry:
                    agree += f" ({entry['agree_int8']}/{args['new_tokens']})"
                optional = [spread(entry[key], fmt) if key in entry else "—" for key, fmt in (
                    ("first_token_ms_all", "{:.2f}"), ("decode_ms_per_token_all", "{:.3f}"),
                    ("decode_tokens_per_s_all", "{:.1f}"))]
                paired = []
                for key, _ in FIGURES:
                    if key in entry and engine != PAIRED_WITH:
                        paired.append(f"{format_comparison(entry[key], 3)}, "
                                      f"{entry[key.removesuffix('over_llama_cpp') + 'verdict']}")
                    else:
                        paired.append("—")
                rows.append((engine, threads, spread(entry["ms_per_token_all"], "{:.3f}"), *optional,
                             streamed_cell(case, threads, engine, entry, args["new_tokens"]), *paired, agree))
        tables.append(render_table(rows) + ceiling_lines(case))
    return "\n\n".join(tables)


# The "at or above llama.cpp": latentloop's whole call at most this many times llama.cpp's,
# with 95% confidence (the upper end of the mean ratio's t-interval over the pooled rounds of several
# runs, `pool`). Fixed before the runs it was first applied to (2026-12-04): 5% slower is below what a
# user notices and below llama.cpp's own change between runs of one command on the project's machine.
AT_MARGIN = 1.05


def run_cases(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A run's JSON as case name -> {"threads": ...}; a run written before the cases (one shape and
    prompt length: `threads` at the top) is its one case."""
    if "cases" in run:
        return run["cases"]
    return {case_name(run["args"]["shape"], run["args"]["prompt_len"]): {"threads": run["threads"]}}


class NotARun(ValueError):
    """A `--pool` file that is not the JSON of a run: its message is one line naming the file."""


def read_run(path: Path) -> dict[str, Any]:
    """One run's JSON (`--json`) for `pool`; `NotARun` when the file cannot be read, is not JSON, or
    is not such a run (its cases, thread counts and engines' rows)."""
    try:
        run = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise NotARun(f"--pool: cannot read {path} as JSON ({reason})") from None
    foreign = NotARun(f"--pool: {path} is not the JSON of a benchmarks.engines run (--json PATH)")
    if not isinstance(run, dict) or not isinstance(run.get("args"), dict) or "new_tokens" not in run["args"]:
        raise foreign
    if "cases" not in run and not {"shape", "prompt_len"} <= set(run["args"]):
        raise foreign
    try:
        cases = run_cases(run)
    except (KeyError, TypeError):
        raise foreign from None
    if not isinstance(cases, dict) or not all(
            isinstance(case, dict) and isinstance(case.get("threads"), dict)
            and all(isinstance(engines, dict) and all(isinstance(row, dict) for row in engines.values())
                    for engines in case["threads"].values()) for case in cases.values()):
        raise foreign
    return run


def pool(paths: list[Path]) -> str:
    """Several runs' JSON (`--json`) of one command, pooled: per case, figure, thread count and
    engine, each run's geometric mean ratio over llama.cpp's, their geometric mean with its 95%
    t-interval over the runs (on the logs: runs - 1 degrees of freedom), and whether that shows the
    engine ahead of llama.cpp (upper end below 1) or at its speed (upper end at most `AT_MARGIN`).
    The interval is over runs, not rounds: a run's rounds share its machine state, and the runs'
    means scattered several times more than their rounds said (2026-12-04: two runs of 15 rounds at
    0.753 and 0.836, both outside the rounds' pooled interval [0.770, 0.818])."""
    from latentloop.eval.stats import format_comparison, paired_comparison

    runs = [read_run(path) for path in paths]
    cases = [run_cases(run) for run in runs]
    if any(set(c) != set(cases[0]) or run["args"]["new_tokens"] != runs[0]["args"]["new_tokens"]
           for c, run in zip(cases, runs)):
        raise SystemExit("--pool: the runs differ in their shapes, prompt lengths or new tokens; pool runs of one "
                         "command")
    tables = []
    for name in cases[0]:
        for key, what in FIGURES:
            rows = [("engine", "threads", "runs", "rounds", "each run's geometric mean",
                     f"{what} over {PAIRED_WITH}'s, pooled: geometric mean [95% t-interval over runs]",
                     f"ahead (< 1) / at its speed (<= {AT_MARGIN})")]
            for threads, engines in cases[0][name]["threads"].items():
                for engine in engines:
                    if engine == PAIRED_WITH:
                        continue
                    per_run = [c[name]["threads"].get(threads, {}).get(engine, {}).get(f"{key}_all", []) for c in cases]
                    per_run = [ratios for ratios in per_run if ratios]
                    if not per_run:
                        continue
                    means = [math.exp(statistics.fmean(math.log(r) for r in ratios)) for ratios in per_run]
                    # one run with this engine: its own rounds' interval, as that run gave it
                    over = per_run[0] if len(per_run) == 1 else means
                    comparison = paired_comparison(dict(enumerate(over)), dict.fromkeys(range(len(over)), 1.0),
                                                   kind="log_ratio")
                    high = comparison["high"]
                    shown = ("—" if high is None else "ahead" if high < 1 else "at" if high <= AT_MARGIN
                             else "not shown")
                    interval = format_comparison(comparison, 3) + (" (over rounds: one run)" if len(per_run) == 1
                                                                    else "")
                    rows.append((engine, threads, str(len(per_run)), str(sum(map(len, per_run))),
                                 ", ".join(f"{mean:.3f}" for mean in means), interval, shown))
            if len(rows) > 1:
                tables.append(f"{name}, {what}:\n\n{render_table(rows)}")
    return "\n\n".join(tables)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", "--shape", default="small",
                   help=f"comma-separated shapes, each measured in turn, from: {', '.join(shape_names())}")
    p.add_argument("--prompt-len", default="16",
                   help="comma-separated prompt lengths (BOS and real text), each timed in every round")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--threads", default="1", help="comma-separated thread counts, each measured in turn")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median and range reported)")
    p.add_argument("--engines", default="all", help=f"comma-separated, from: {', '.join(ENGINES)}")
    p.add_argument("--settle", type=float, default=SETTLE_S,
                   help="seconds each timed call waits first, for the previous engine's threads to stop spinning")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    if not (math.isfinite(args.settle) and args.settle >= 0):  # nan passed the check and failed in time.sleep
        p.error(f"--settle must be a number of seconds >= 0, got {args.settle}")
    try:
        args.threads = comma_integers(args.threads, "--threads")
        args.prompt_len = comma_integers(args.prompt_len, "--prompt-len")
        args.shapes = [shape.strip() for shape in args.shapes.split(",")]
        for shape in args.shapes:
            resolve_shape(shape)
    except ValueError as exc:
        p.error(str(exc))
    if len(set(args.shapes)) < len(args.shapes) or len(set(args.prompt_len)) < len(args.prompt_len):
        p.error("--shapes and --prompt-len must not name a value twice")
    args.engines = list(ENGINES) if args.engines == "all" else [e.strip() for e in args.engines.split(",")]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine {unknown[0]!r}; choose from: {', '.join(ENGINES)}")
    require_at_least_one(p, args, ("new_tokens", "repeats"))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"] and len(argv) == 2:  # one engine's process (`EngineWorker`)
        return worker(json.loads(argv[1]))
    if argv[:1] == ["--pool"]:  # earlier runs' JSON, pooled (`pool`)
        if len(argv) < 2 or not all(Path(path).is_file() for path in argv[1:]):
            print("--pool needs the JSON files of earlier runs (--json PATH)", file=sys.stderr)
            return 2
        try:
            print(pool([Path(path) for path in argv[1:]]))
        except NotARun as exc:  # a file that is not a run's JSON: one line naming it
            print(exc, file=sys.stderr)
            return 2
        return 0
    return benchmark_main(parse_args(argv), run, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
