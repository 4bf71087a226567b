"""latentloop's decode against the CPU engines users pick for local inference, same model, same run
(issue 26): one gpt of a Llama-compatible shape (SwiGLU, no qk/embedding norm) saved as a run,
exported with `latentloop export --plain`, and decoded greedily at batch 1 by

- latentloop: eager (`compile=False`), compiled (`compile=True`: the ahead-of-time package on CPU),
  compiled through dynamo (`LATENTLOOP_AOT=0`, the compiled path before it), eager and compiled int8
  (`quantize_int8`; compiled both ways too: the package's int8 reduction, dynamo's native kernel);
- Hugging Face `generate` on the exported folder (needs transformers);
- CTranslate2 fp32 and int8 (`pip install ctranslate2`), converted from the exported folder;
- llama.cpp through llama-cpp-python (`pip install llama-cpp-python gguf`: PyPI has only its source
  for this platform, a ~17 min build on 2 cores; `CMAKE_ARGS=-DGGML_NATIVE=ON` builds for this CPU),
  on the exported folder written as an fp32 GGUF file by `write_gguf` (no tokenizer: llama.cpp's
  "none" vocabulary takes and gives token ids, as every other engine here is given them).

Every engine decodes the same prompt for the same number of new tokens, no stop token, from a fresh
state (llama.cpp's prompt cache is reset: `llama_greedy`); the figure is the whole call (prefill
included) over the new tokens, median over interleaved rounds; each round also times a call for the
first token alone, so the table splits the call into the first token (prefill included) and the
decode after it, and gives each engine's whole call over llama.cpp's in the same round. The compiled
rows are warmed up (compiled) before timing. Each engine runs in a process of its own (`EngineWorker`),
started and warmed up one after another, then called in turn, one call at a time: in one process
CTranslate2's OpenMP runtime (a second copy, beside torch's) and the pools' spinning workers took the
cores from whichever engine ran next whenever more than one thread was asked for (see `SETTLE_S`).
Greedy agreement: each engine's tokens against latentloop eager's, token by token (fp32 engines
should agree on all; int8 may drift). The vocabulary is the byte tokenizer's 259 (the export carries
the run's tokenizer, which CTranslate2 reads for its vocabulary), so the large shape's head is
smaller than the issue's 32000-token one.

    .venv/bin/python -m benchmarks.engines [--shape small|large] [--threads 1,2] [--prompt-len 16]
        [--new-tokens 200] [--repeats 3] [--engines all|NAME,...] [--settle 0.5] [--json out.json]
    .venv/bin/python -m benchmarks.engines --pool run1.json run2.json   # the runs' rounds pooled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    add_decode_shape_arguments,
    benchmark_main,
    render_table,
    require_at_least_one,
    spread,
    start_run,
)

SHAPES = {  # the two shapes (with the byte vocabulary, see the docstring)
    "small": dict(n_layer=4, n_embd=256, n_head=4),
    "large": dict(n_layer=12, n_embd=768, n_head=12),
    "smoke": dict(n_layer=2, n_embd=64, n_head=2),  # for the test: seconds, not minutes
}
LLAMA_COMPATIBLE = dict(qk_norm=False, embed_norm=False, mlp="swiglu")  # what `export --plain` requires
ENGINES = ("latentloop eager", "latentloop compiled", "latentloop compiled dynamo", "latentloop eager int8",
           "latentloop compiled int8", "latentloop compiled int8 dynamo",
           "hf generate", "ctranslate2 fp32", "ctranslate2 int8", "llama.cpp")
REFERENCE = "latentloop eager"  # every engine's tokens are compared with these
# int8 engines' tokens drift from the float model's within a few tokens (a random model's logits are
# close together): they are compared with latentloop's eager int8 decode too, which they should follow
INT8_REFERENCE = "latentloop eager int8"
PAIRED_WITH = "llama.cpp"  # every engine's whole call is also given over this engine's, round by round
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


def build_export(shape: dict, context: int, seed: int, folder: Path):
    """(model, tokenizer, hf folder): a random-init gpt saved as a run and exported as plain Llama."""
    import latentloop
    from latentloop.data.tokenizers import ByteTokenizer
    from latentloop.interop import export_hf
    from latentloop.runs import save_run

    tokenizer = ByteTokenizer()
    torch.manual_seed(seed)
    model = latentloop.build("gpt", preset=None, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id,
                             sequence_len=context, **shape, **LLAMA_COMPATIBLE).eval()
    save_run(model, tokenizer, folder / "run")
    export_hf(folder / "run", folder / "hf", plain=True)
    return model, tokenizer, folder / "hf"


def latentloop_call(model, prompt: list[int], compile: bool, aot: bool = True):
    import os

    import latentloop
    from latentloop.inference.aot import AOT_ENV

    def call(new_tokens: int) -> list[int]:
        saved = os.environ.get(AOT_ENV)
        os.environ[AOT_ENV] = "1" if aot else "0"  # read when the call makes its decoder
        try:
            return latentloop.generate(model, prompt, new_tokens, temperature=0.0, compile=compile)
        finally:
            os.environ.pop(AOT_ENV) if saved is None else os.environ.__setitem__(AOT_ENV, saved)

    return call


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


def hf_call(hf_dir: Path, prompt: list[int]):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    @torch.inference_mode()
    def call(new_tokens: int) -> list[int]:
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return call


def ctranslate2_call(hf_dir: Path, folder: Path, prompt: list[int], threads: int, quantization: str | None):
    import ctranslate2
    import transformers
    from ctranslate2.converters import TransformersConverter

    out = folder / f"ct2-{quantization or 'float32'}"
    if not out.exists():
        TransformersConverter(str(hf_dir)).convert(str(out), quantization=quantization, force=True)
    generator = ctranslate2.Generator(str(out), device="cpu", intra_threads=threads, compute_type=quantization or
                                      "float32")
    tokens = transformers.AutoTokenizer.from_pretrained(hf_dir).convert_ids_to_tokens(prompt)

    def call(new_tokens: int) -> list[int]:
        result = generator.generate_batch([tokens], max_length=new_tokens, sampling_topk=1,
                                          include_prompt_in_result=False, end_token=[])
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


def llama_cpp_call(hf_dir: Path, folder: Path, prompt: list[int], context: int, threads: int):
    from llama_cpp import Llama

    path = folder / "model-f32.gguf"
    if not path.exists():
        write_gguf(hf_dir, path)
    llm = Llama(model_path=str(path), n_ctx=context, n_batch=len(prompt), n_threads=threads,
                n_threads_batch=threads, verbose=False)
    return lambda new_tokens: llama_greedy(llm, prompt, new_tokens)


def llama_greedy(llm, prompt: list[int], new_tokens: int) -> list[int]:
    """llama-cpp-python's greedy tokens for `prompt`, its state reset first. Its `generate` keeps the
    last call's tokens and evaluates only what follows their longest common prefix: called again with
    the same prompt it skipped the prefill (one token evaluated instead of 16), a call's worth of work
    the other engines do every time (found 2026-12-03: its first token took 0.02 ms against 3.6-4.7 ms
    after a reset, at the small shape)."""
    llm.reset()
    tokens = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy: its argmax sampler
        tokens.append(token)
        if len(tokens) == new_tokens:
            break
    return tokens


def unavailable(engine: str) -> str | None:
    """Why an engine cannot run here, or None."""
    module = {"hf generate": ("transformers",), "ctranslate2 fp32": ("ctranslate2",),
              "ctranslate2 int8": ("ctranslate2",), "llama.cpp": ("llama_cpp", "gguf")}
    install = {"llama_cpp": "llama-cpp-python"}
    for name in module.get(engine, ()):
        try:
            __import__(name)
        except ImportError:
            return f"not installed (pip install {install.get(name, name)})"
    return None


def make_calls(engines: list[str], model, hf_dir: Path, folder: Path, prompt: list[int], context: int,
               threads: int) -> dict:
    """engine -> call(new_tokens) -> greedy token ids, for prompts of up to `context` tokens in all."""
    from latentloop.inference.quant import quantize_int8

    calls = {}
    for engine in engines:
        if engine == "latentloop eager":
            calls[engine] = latentloop_call(model, prompt, compile=False)
        elif engine == "latentloop compiled":
            calls[engine] = latentloop_call(model, prompt, compile=True)
        elif engine == "latentloop compiled dynamo":
            calls[engine] = latentloop_call(model, prompt, compile=True, aot=False)
        elif engine.startswith("latentloop") and "int8" in engine:
            import copy

            calls[engine] = latentloop_call(quantize_int8(copy.deepcopy(model)), prompt,
                                            compile="compiled" in engine, aot=not engine.endswith("dynamo"))
        elif engine == "hf generate":
            calls[engine] = hf_call(hf_dir, prompt)
        elif engine.startswith("ctranslate2"):
            quantization = "int8" if engine.endswith("int8") else None
            calls[engine] = ctranslate2_call(hf_dir, folder, prompt, threads, quantization)
        elif engine == "llama.cpp":
            calls[engine] = llama_cpp_call(hf_dir, folder, prompt, context, threads)
    return calls


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
    exported model, warms the engine up and answers with its greedy tokens, then, for every line it
    reads until its input closes, times a call for one new token (the prompt's prefill and the first
    token) and one for all of them. Answers go to the original stdout, one JSON line each;
    anything a library prints goes to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the libraries' own prints (llama.cpp, transformers) stay out of the answers
    torch.set_num_threads(spec["threads"])
    folder, engine = Path(spec["folder"]), spec["engine"]
    model = None
    if engine.startswith("latentloop"):
        import latentloop

        model, _ = latentloop.load(folder / "run")
        model.eval()
    new_tokens = spec["new_tokens"]
    call = make_calls([engine], model, folder / "hf", folder, spec["prompt"], len(spec["prompt"]) + new_tokens,
                      spec["threads"])[engine]
    tokens = call(new_tokens)  # the warm-up (compiles), and the tokens
    call(1)
    answers.write(json.dumps({"tokens": tokens}) + "\n")
    answers.flush()
    for _ in sys.stdin:
        start = time.perf_counter()
        call(1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        call(new_tokens)
        answers.write(json.dumps({"seconds": time.perf_counter() - start, "first_seconds": first}) + "\n")
        answers.flush()
    return 0


class EngineWorker:
    """The parent's handle on one engine's process: started and warmed up on construction (its greedy
    tokens in `tokens`), then `time_call()` per timed call; `close()` ends it."""

    def __init__(self, engine: str, folder: Path, prompt: list[int], new_tokens: int, threads: int):
        self.engine = engine
        spec = {"engine": engine, "folder": str(folder), "prompt": prompt, "new_tokens": new_tokens,
                "threads": threads}
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.process = subprocess.Popen([sys.executable, "-m", "benchmarks.engines", "--worker", json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                        env=environment)
        self.tokens: list[int] = self._answer()["tokens"]

    def _answer(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.engine} worker exited with code {self.process.wait()} (its stderr is above)")
        return json.loads(line)

    def time_call(self) -> tuple[float, float]:
        """Seconds of (a call for all the new tokens, one for the first new token only)."""
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        answer = self._answer()
        return answer["seconds"], answer["first_seconds"]

    def close(self) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=WORKER_EXIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(argparse.Namespace(threads=args.threads[0]))  # each thread count is set again below
    shape = SHAPES[args.shape]
    results: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()}, "threads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, tokenizer, _ = build_export(shape, args.prompt_len + args.new_tokens, args.seed, folder)
        byte_ids = torch.randint(0, 256, (args.prompt_len - 1,), generator=torch.Generator().manual_seed(args.seed))
        prompt = [tokenizer.bos_id] + byte_ids.tolist()  # BOS, then random bytes
        results["params"] = model.num_params()
        for threads in args.threads:
            torch.set_num_threads(threads)
            notes = {engine: unavailable(engine) for engine in args.engines}
            runnable = [e for e in args.engines if notes[e] is None]
            print(f"{threads} thread(s): preparing {', '.join(runnable)}, a process each ...", flush=True)
            workers: dict[str, EngineWorker] = {}
            try:
                for name in runnable:  # one after another: a warm-up (a compile) has the machine to itself
                    workers[name] = EngineWorker(name, folder, prompt, args.new_tokens, threads)
                tokens = {name: w.tokens for name, w in workers.items()}
                timed: dict[str, list[tuple[float, float]]] = {name: [] for name in workers}
                names = list(workers)
                for r in range(args.repeats):  # interleaved, order rotating
                    shift = r % len(names)
                    for name in names[shift:] + names[:shift]:
                        time.sleep(args.settle)
                        timed[name].append(workers[name].time_call())
            finally:
                for w in workers.values():
                    w.close()
            reference = tokens.get(REFERENCE)
            rows = {}
            for engine in args.engines:
                if notes[engine] is not None:
                    rows[engine] = {"note": notes[engine]}
                    continue
                entry = timing_entry(timed[engine], args.new_tokens)
                if reference is not None:
                    entry["agree"] = agreement(tokens[engine], reference)
                if "int8" in engine and INT8_REFERENCE in tokens:
                    entry["agree_int8"] = agreement(tokens[engine], tokens[INT8_REFERENCE])
                rows[engine] = entry
            if PAIRED_WITH in timed:  # each engine's rounds over llama.cpp's in the same round
                for engine in timed:
                    rows[engine].update(paired_with(timed[engine], timed[PAIRED_WITH]))
            results["threads"][str(threads)] = rows
    return results


def paired_with(rounds: list[tuple[float, float]], reference: list[tuple[float, float]]) -> dict[str, Any]:
    """An engine's whole calls over the reference engine's of the same rounds: every round's ratio,
    their mean with its t interval over rounds, and the verdict ("faster" when the interval lies
    below 1, "slower" above it, "undecided" when it holds 1)."""
    from latentloop.eval.stats import paired_comparison, verdict

    comparison = paired_comparison({r: whole for r, (whole, _) in enumerate(rounds)},
                                   {r: whole for r, (whole, _) in enumerate(reference)}, kind="ratio")
    return {"over_llama_cpp_all": [whole / paired for (whole, _), (paired, _) in zip(rounds, reference)],
            "over_llama_cpp": comparison,
            "verdict": verdict(comparison, "faster", "slower").replace("seed", "round")}  # rounds pair here


def timing_entry(rounds: list[tuple[float, float]], new_tokens: int) -> dict[str, Any]:
    """One engine's figures from its rounds of (seconds for all new tokens, seconds for the first):
    the whole call per new token, the first token's time (prefill included), and the decode alone,
    per token after the first (the difference of the two calls of the same round)."""
    per_token = [whole / new_tokens * 1e3 for whole, _ in rounds]
    entry = {"ms_per_token_all": per_token, "ms_per_token": statistics.median(per_token),
             "first_token_ms_all": [first * 1e3 for _, first in rounds]}
    if new_tokens > 1:
        entry["decode_ms_per_token_all"] = [(whole - first) / (new_tokens - 1) * 1e3 for whole, first in rounds]
    return entry


def markdown_table(results: dict[str, Any]) -> str:
    from latentloop.eval.stats import format_comparison

    args = results["args"]
    header = (f"Engine ({args['shape']}: {results['params']:,} params; prompt {args['prompt_len']} + "
              f"{args['new_tokens']} new, batch 1, greedy)", "threads", "ms / new token (prefill included)",
              "first token, ms (prefill included)", "decode, ms / token after the first",
              f"whole call over {PAIRED_WITH}'s, paired by round: mean [95% t-interval], verdict",
              f"greedy tokens agreeing with {REFERENCE} (int8 rows: and with {INT8_REFERENCE})")
    rows = [header]
    for threads, engines in results["threads"].items():
        for engine, entry in engines.items():
            if "note" in entry:
                rows.append((engine, threads, "—", "—", "—", "—", entry["note"]))
                continue
            agree = f"{entry['agree']}/{args['new_tokens']}" if "agree" in entry else "—"
            if "agree_int8" in entry:
                agree += f" ({entry['agree_int8']}/{args['new_tokens']})"
            optional = [spread(entry[key], fmt) if key in entry else "—" for key, fmt in (
                ("first_token_ms_all", "{:.2f}"), ("decode_ms_per_token_all", "{:.3f}"))]
            paired = "—"
            if "over_llama_cpp" in entry and engine != PAIRED_WITH:
                paired = f"{format_comparison(entry['over_llama_cpp'], 3)}, {entry['verdict']}"
            rows.append((engine, threads, spread(entry["ms_per_token_all"], "{:.3f}"), *optional, paired, agree))
    return render_table(rows)


# The "at or above llama.cpp": latentloop's whole call at most this many times llama.cpp's,
# with 95% confidence (the upper end of the mean ratio's t-interval over the pooled rounds of several
# runs, `pool`). Fixed before the runs it was first applied to (2026-12-04): 5% slower is below what a
# user notices and below llama.cpp's own change between runs of one command on the project's machine.
AT_MARGIN = 1.05


def pool(paths: list[Path]) -> str:
    """Several runs' JSON (`--json`) of one command, their rounds pooled: per thread count and engine,
    the rounds, the mean whole-call ratio over llama.cpp's with its 95% t-interval, and whether that
    shows the engine ahead of llama.cpp (upper end below 1) or at its speed (upper end at most
    `AT_MARGIN`)."""
    from latentloop.eval.stats import format_comparison, paired_comparison

    runs = [json.loads(path.read_text()) for path in paths]
    keys = ("shape", "prompt_len", "new_tokens")
    if any({k: run["args"][k] for k in keys} != {k: runs[0]["args"][k] for k in keys} for run in runs):
        raise SystemExit(f"--pool: the runs differ in {', '.join(keys)}; pool runs of one command")
    rows = [("engine", "threads", "runs", "rounds", f"whole call over {PAIRED_WITH}'s, pooled: mean [95% t-interval]",
             f"ahead (< 1) / at its speed (<= {AT_MARGIN})")]
    for threads in runs[0]["threads"]:
        for engine, entry in runs[0]["threads"][threads].items():
            if engine == PAIRED_WITH or "over_llama_cpp_all" not in entry:
                continue
            ratios = [ratio for run in runs for ratio in
                      run["threads"].get(threads, {}).get(engine, {}).get("over_llama_cpp_all", [])]
            comparison = paired_comparison(dict(enumerate(ratios)), dict.fromkeys(range(len(ratios)), 1.0),
                                           kind="ratio")
            high = comparison["high"]
            shown = "—" if high is None else ("ahead" if high < 1 else "at" if high <= AT_MARGIN else "not shown")
            rows.append((engine, threads, str(len(runs)), str(len(ratios)), format_comparison(comparison, 3), shown))
    return render_table(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_decode_shape_arguments(p, SHAPES, "small")
    p.add_argument("--threads", default="1", help="comma-separated thread counts, each measured in turn")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median and range reported)")
    p.add_argument("--engines", default="all", help=f"comma-separated, from: {', '.join(ENGINES)}")
    p.add_argument("--settle", type=float, default=SETTLE_S,
                   help="seconds each timed call waits first, for the previous engine's threads to stop spinning")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    if args.settle < 0:
        p.error(f"--settle must be >= 0, got {args.settle}")
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        p.error(f"--threads must be comma-separated integers, got {args.threads!r}")
    if any(t < 1 for t in args.threads):
        p.error("--threads must be >= 1")
    args.engines = list(ENGINES) if args.engines == "all" else [e.strip() for e in args.engines.split(",")]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine {unknown[0]!r}; choose from: {', '.join(ENGINES)}")
    require_at_least_one(p, args, ("prompt_len", "new_tokens", "repeats"))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"] and len(argv) == 2:  # one engine's process (`EngineWorker`)
        return worker(json.loads(argv[1]))
    if argv[:1] == ["--pool"]:  # earlier runs' JSON, pooled (`pool`)
        if len(argv) < 2 or not all(Path(path).is_file() for path in argv[1:]):
            print("--pool needs the JSON files of earlier runs (--json PATH)", file=sys.stderr)
            return 2
        print(pool([Path(path) for path in argv[1:]]))
        return 0
    return benchmark_main(parse_args(argv), run, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
