"""Baseline speed of the `gpt` backbone on CPU, side by side with references run in the same
process: nanoGPT's `model.py` (from `../shared/anchors`) for training and Hugging Face's
`LlamaForCausalLM.generate` for cached greedy decoding. Only same-run ratios are reported: on these
shared machines absolute figures drift by tens of percent between runs and hosts.

At one fixed shape (4 layers, d=256, 4 heads, vocab 256, fp32):

1. training tokens/s (T=256, batch 16, AdamW, grad clip; forward + backward + clip + step, the
   trainer's step without data loading), latentloop and nanoGPT interleaved round by round (the
   order rotating), eager and with `--compile` both compiled; the ratio per round, median and range.
   In the same rounds a training *floor*: the matrix products (forward and both backward ones of
   every Linear and the head) and the causal attention kernels (SDPA forward and backward) of one
   step alone, the kernels both models call with the same shapes; nanoGPT's time over it bounds
   the ratio over nanoGPT that a model computing these products with these kernels can reach;
   With `--hf`, HF's LlamaForCausalLM of the same shape trains in the same rounds too;
2. greedy decoding tokens/s through the engine (`latentloop.generate(..., temperature=0)`, KV cache)
   at batch 1, interleaved with HF Llama of the same shape (`--hf`, needs transformers), and at
   batch 16; the uncached reference (`use_cache=False`) at batch 1. With `--compile`, also the
   fast path (`generate(..., compile=True)`: static cache, compiled step) in the same rounds.

Decode tokens/s counts new tokens over the wall time of the whole call, prefill included. Threads
are left as torch picks them unless `--threads` is given. As `latentloop train` does on CPU, the
process keeps freed memory (glibc's malloc, `latentloop.runtime.keep_freed_memory`) for every model
it measures, the references included; `--default-malloc` measures without it.

The decode rounds also time a *floor*: per new token, the batch-1 matrix products of every weight
a decode step must read (each Linear and the head on a (1, 1, in) vector, nothing else), i.e. what
streaming the fp32 weights through the cores costs on this machine, done two ways: `F.linear` (the
matmul library, what an eager decoder calls) and, with `--compile`, the same products compiled as
vectorised reductions (what the fast path's step does, `latentloop.inference.fast`). The floor is the
faster of the two in each round. A decoder's time over the floor is what it spends on everything else
(attention, norms, RoPE, dispatch); HF's time over the floor bounds the ratio over HF that any
exact fp32 decoder streaming its weights no faster than this could reach.

    .venv/bin/python -m benchmarks.baseline --hf
    .venv/bin/python -m benchmarks.baseline --hf --compile --json bench.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import latentloop
from benchmarks.common import (
    add_allocator_flag,
    benchmark_main,
    make_train_step,
    render_table,
    require_at_least_one,
    require_threads,
    run_interleaved,
    spread,
    start_run,
)
from latentloop.config import TrainConfig
from latentloop.objectives.base import NextTokenObjective
from latentloop.optim import build_optimizers

# Shape of the comparison (fixed by the reference figures below).
N_LAYER, N_EMBD, N_HEAD, VOCAB = 4, 256, 4, 256
MLP_HIDDEN = 4 * N_EMBD  # our relu2 MLP width; the Llama reference uses the same intermediate size

TARGET_TRAIN_RATIO = {"eager": 1.2, "compiled": 1.1}  # training over nanoGPT, the same run (issue 16)
TARGET_DECODE_RATIO = 5.0  # batch-1 greedy decode over HF Llama generate, the same run (issue 16)
STRETCH_DECODE_RATIO = 8.0  # the stretch goal for the same ratio
ANCHOR = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "nanogpt_model.py"  # ../shared beside the repo


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def build_model(sequence_len: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # bos_id: the byte tokenizer's default (256) is outside vocab 256; 1 as in the Llama config
    return latentloop.build("gpt", preset=None, n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, vocab_size=VOCAB,
                            sequence_len=sequence_len, bos_id=1)


def load_nanogpt():
    """nanoGPT's model.py from ../shared/anchors as a module, or None where the folder is absent."""
    if not ANCHOR.is_file():
        return None
    spec = importlib.util.spec_from_file_location("nanogpt_anchor", ANCHOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def training_steps(kind: str, seq_len: int, batch_size: int, grad_clip: float, seed: int, compile: bool):
    """(one optimizer step -> loss, tokens per step) at the shape for `kind`: latentloop's gpt,
    nanoGPT, HF Llama (`hf`, torch's AdamW as for nanoGPT) or the kernels' floor."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=gen)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    train_cfg = TrainConfig(batch_size=batch_size, optimizer="adamw", grad_clip=grad_clip, dtype="float32",
                            device="cpu")
    if kind == "floor":
        return training_floor_step(build_model(seq_len, seed), seq_len, batch_size), x.numel()
    if kind == "latentloop":
        model = build_model(seq_len, seed).train()
        optimizers = build_optimizers(model, train_cfg)
        objective = NextTokenObjective(model.config, train_cfg)
        step = make_train_step(model, torch.compile(model) if compile else model, objective, x, y, optimizers,
                               train_cfg)
        return step, x.numel()
    torch.manual_seed(seed)
    if kind == "hf":  # labels are the inputs: HF shifts them itself (T - 1 targets per row)
        model = hf_llama(seq_len).train()
        forward = torch.compile(model) if compile else model

        def loss_of() -> torch.Tensor:
            return forward(input_ids=x, labels=x).loss
    else:
        nanogpt = load_nanogpt()
        model = nanogpt.GPT(nanogpt.GPTConfig(block_size=seq_len, vocab_size=VOCAB, n_layer=N_LAYER, n_head=N_HEAD,
                                              n_embd=N_EMBD, dropout=0.0, bias=False)).train()
        forward = torch.compile(model) if compile else model

        def loss_of() -> torch.Tensor:
            return forward(x, y)[1]
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, betas=train_cfg.betas, weight_decay=0.0)

    def step(_i: int) -> float:
        loss = loss_of()
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, x.numel()


def training_floor_step(model: torch.nn.Module, seq_len: int, batch_size: int):
    """One step's worth of the kernels a training step of this shape cannot avoid, alone: for
    every Linear and the head, the forward product and the two backward ones (grad of the input,
    grad of the weight), and per layer causal SDPA forward and backward. nanoGPT's step and ours
    call exactly these (same shapes, same torch kernels), plus elementwise work, the optimizer and
    dispatch; so nanoGPT's time over this bounds the ratio over nanoGPT of any model of this shape
    that computes these products with these kernels."""
    gen = torch.Generator().manual_seed(0)
    tokens = batch_size * seq_len
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model.lm_head is None:  # the tied head's product
        weights.append(model.wte.weight.detach())
    # one activation and one gradient per width, shared by the products: a real step's operands
    # were just written and are partly in cache, which fresh tensors for each product would not be
    widths = {n for w in weights for n in w.shape}
    operand = {n: torch.randn(tokens, n, generator=gen) for n in widths}
    grad = {n: torch.randn(tokens, n, generator=gen) for n in widths}
    products = [(operand[w.shape[1]], w, grad[w.shape[0]]) for w in weights]
    cfg = model.config
    B, T, H, hd = batch_size, seq_len, cfg.n_head, cfg.head_dim
    # q, k, v as both models lay them out: heads-first views of one (B, T, 3 H hd) projection
    qkv = [torch.randn(B, T, 3 * H * hd, generator=gen).requires_grad_() for _ in range(cfg.n_layer)]
    grad_y = torch.randn(B, T, H, hd, generator=gen).transpose(1, 2)  # from the output projection

    def step(_i: int) -> float:
        for x, w, grad_out in products:
            torch.mm(x, w.t())  # forward
            torch.mm(grad_out, w)  # grad of the input
            torch.mm(grad_out.t(), x)  # grad of the weight
        for projected in qkv:
            q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in projected.split(H * hd, dim=2))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(y, projected, grad_y)
        return 0.0

    return step


def bench_training_side_by_side(args, compile: bool) -> dict[str, Any]:
    """latentloop's and nanoGPT's training steps and the kernels' floor, interleaved: per round
    each times `args.steps_per_round` steps; tokens/s per round, and the ratio per round."""
    kinds = ["latentloop", "floor"] + (["nanogpt"] if load_nanogpt() is not None else []) + (
        ["hf"] if args.hf and hf_available() is None else [])
    steps, tokens, counters = {}, {}, {}
    for kind in kinds:
        steps[kind], tokens[kind] = training_steps(kind, args.seq_len, args.batch_size, args.grad_clip, args.seed,
                                                   compile)
        counters[kind] = itertools.count()

    def timed(kind):
        def call():
            start = time.perf_counter()
            for _ in range(args.steps_per_round):
                steps[kind](next(counters[kind]))
            return {"step_s": (time.perf_counter() - start) / args.steps_per_round}
        return call

    raw = run_interleaved({kind: timed(kind) for kind in kinds}, args.warmup_steps, args.rounds)
    result = {kind: {"tok_s": tokens[kind] / raw[kind]["step_s"],
                     "tok_s_all": [tokens[kind] / s for s in raw[kind]["step_s_all"]]} for kind in kinds}
    if "nanogpt" in result:
        result["ratio_all"] = [ours / ref for ours, ref in zip(result["latentloop"]["tok_s_all"],
                                                                 result["nanogpt"]["tok_s_all"])]
        result["ratio"] = statistics.median(result["ratio_all"])
        result["bound_all"] = [floor / ref for floor, ref in zip(result["floor"]["tok_s_all"],  # its time over floor
                                                                 result["nanogpt"]["tok_s_all"])]
    if "hf" in result:
        result["hf_ratio_all"] = [ours / ref for ours, ref in zip(result["latentloop"]["tok_s_all"],
                                                                    result["hf"]["tok_s_all"])]
    result["latentloop"]["over_floor_all"] = [floor / ours for ours, floor in zip(
        result["latentloop"]["tok_s_all"], result["floor"]["tok_s_all"])]
    return result


def _time_calls(fn, repeats: int) -> tuple[float, list[float], Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result


def bench_decode(model: torch.nn.Module, batch_size: int, prompt_len: int, new_tokens: int, repeats: int,
                 use_cache: bool, seed: int) -> dict[str, Any]:
    """Median tokens/s of `latentloop.generate(..., temperature=0)` (one warmup call first)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (batch_size, prompt_len), generator=gen).tolist()

    def call():
        return latentloop.generate(model, prompts, max_new_tokens=new_tokens, temperature=0.0, use_cache=use_cache)

    call()  # warmup: allocator, kernels
    median, times, out = _time_calls(call, repeats)
    produced = sum(len(row) for row in out)
    assert produced == batch_size * new_tokens, f"expected {batch_size * new_tokens} tokens, got {produced}"
    return {"batch_size": batch_size, "prompt_len": prompt_len, "new_tokens": new_tokens, "use_cache": use_cache,
            "call_s_median": median, "call_s_all": times, "tok_s": produced / median,
            "tok_s_per_row": new_tokens / median, "first_row": out[0]}


def hf_available() -> str | None:
    """None when transformers is importable, else the reason it is not."""
    try:
        import transformers  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"{type(exc).__name__}: {exc}"
    return None


def hf_llama(context: int):
    """HF LlamaForCausalLM of the comparison's shape, random init (no download). Its SwiGLU MLP
    has a third matrix, so it does 4/3 of our MLP's matmul work per token."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    config = LlamaConfig(hidden_size=N_EMBD, num_hidden_layers=N_LAYER, num_attention_heads=N_HEAD,
                         num_key_value_heads=N_HEAD, intermediate_size=MLP_HIDDEN, vocab_size=VOCAB,
                         max_position_embeddings=max(2048, context), tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config)


def hf_decode_call(prompt_len: int, new_tokens: int, seed: int):
    """A call of HF LlamaForCausalLM.generate of the same shape (random init, no download), greedy,
    batch 1, KV cache; and a description of the model."""
    import transformers

    torch.manual_seed(seed)
    model = hf_llama(prompt_len + new_tokens).eval()
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (1, prompt_len), generator=gen)
    attention_mask = torch.ones_like(input_ids)

    def call():
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape[1] - prompt_len == new_tokens
        return out

    return call, {"transformers_version": transformers.__version__,
                  "params": sum(p.numel() for p in model.parameters())}


def matmul_floor_calls(model: torch.nn.Module, new_tokens: int, compiled: bool):
    """Calls, each `new_tokens` x the batch-1 products with every weight one decode step reads
    (see the docstring): through `F.linear`, and (`compiled`) compiled as the fast path compiles
    them; and the bytes of those weights."""
    from latentloop.inference.fast import compile_cpu_decode

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not any(w.shape[0] == VOCAB for w in weights):  # a tied head reads the embedding
        weights.append(model.wte.weight)
    inputs = [torch.randn(1, 1, w.shape[1]) for w in weights]

    def products(inputs, weights):
        return [torch.nn.functional.linear(x, w) for x, w in zip(inputs, weights)]

    def calls(fn):
        @torch.inference_mode()
        def call():
            for _ in range(new_tokens):
                fn(inputs, weights)
        return call

    floors = {"floor F.linear": calls(products)}
    if compiled:  # the fast path's way needs inductor (and a C++ compiler), as the fast path does
        floors["floor reductions"] = calls(compile_cpu_decode(products))
    return floors, sum(w.numel() * w.element_size() for w in weights)


def bench_decode_side_by_side(model, args) -> dict[str, Any]:
    """Batch-1 greedy decode of latentloop and (with --hf) HF Llama, interleaved round by round,
    with the matrix-product floor in the same rounds."""
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, VOCAB, (1, args.prompt_len), generator=gen)[0].tolist()
    floor_calls, weight_bytes = matmul_floor_calls(model, args.new_tokens, args.compile)
    calls = {"latentloop": lambda: latentloop.generate(model, prompt, args.new_tokens, temperature=0.0),
             **floor_calls}
    if args.compile:  # the fast path: static cache, compiled step (compiled in the warmup round)
        calls["latentloop compiled"] = lambda: latentloop.generate(model, prompt, args.new_tokens, temperature=0.0,
                                                                   compile=True)
    info = {}
    if args.hf and hf_available() is None:
        calls["hf"], info = hf_decode_call(args.prompt_len, args.new_tokens, args.seed)

    def timed(fn):
        def call():
            start = time.perf_counter()
            fn()
            return {"call_s": time.perf_counter() - start}
        return call

    raw = run_interleaved({name: timed(fn) for name, fn in calls.items()}, 1, args.repeats)
    result = {name: {"tok_s": args.new_tokens / raw[name]["call_s"],
                     "tok_s_all": [args.new_tokens / s for s in raw[name]["call_s_all"]]} for name in calls}
    result["hf_info"] = info
    result["weight_bytes"] = weight_bytes
    floor = [max(rates) for rates in zip(*(result[name]["tok_s_all"] for name in floor_calls))]  # the faster way
    result["floor"] = {"tok_s_all": floor, "tok_s": statistics.median(floor)}
    for name in calls:  # how far above the floor each decoder runs (time per token over the floor's)
        if name not in floor_calls:
            result[name]["over_floor_all"] = [f / ours for ours, f in zip(result[name]["tok_s_all"], floor)]
    if "hf" in result:
        result["ratio_all"] = [ours / ref for ours, ref in zip(result["latentloop"]["tok_s_all"],
                                                                 result["hf"]["tok_s_all"])]
        result["ratio"] = statistics.median(result["ratio_all"])
        if "latentloop compiled" in result:
            result["compiled_ratio_all"] = [ours / ref for ours, ref in zip(
                result["latentloop compiled"]["tok_s_all"], result["hf"]["tok_s_all"])]
            result["compiled_ratio"] = statistics.median(result["compiled_ratio_all"])
    return result


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _fmt_rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _fmt_ratio(value: float | None, target: float | None = None) -> str:
    if value is None:
        return "—"
    text = f"{value:.2f}x"
    if target is not None:
        text += " ✅" if value >= target else " ❌"
    return text


def markdown_table(results: dict[str, Any]) -> str:
    """Every figure with its same-run reference: median [min–max] over the interleaved rounds."""
    rows = [("Figure (same run, interleaved)", "latentloop gpt (tok/s)", "reference (tok/s)", "ratio", "target")]
    for mode, train in results["train"].items():
        ref = train.get("nanogpt")
        ratio = "—" if ref is None else spread(train["ratio_all"], "{:.2f}x")
        mark = "" if ref is None else (" ✅" if train["ratio"] >= TARGET_TRAIN_RATIO[mode] else " ❌")
        rows.append((f"training {mode}, T={results['args']['seq_len']}, batch {results['args']['batch_size']}",
                     spread(train["latentloop"]["tok_s_all"]),
                     "— (no ../shared/anchors)" if ref is None else spread(ref["tok_s_all"]) + " nanoGPT",
                     ratio + mark, f"≥ {TARGET_TRAIN_RATIO[mode]}x"))
        over_floor = "time over floor: ours " + spread(train["latentloop"]["over_floor_all"], "{:.2f}x")
        bound = "—"
        if ref is not None:
            over_floor += ", nanoGPT " + spread(train["bound_all"], "{:.2f}x")
            bound = "nanoGPT over floor = the largest ratio over nanoGPT with these kernels"
        if "hf" in train:
            rows.append((f"training {mode}, against HF Llama (4/3 of our MLP matmuls)",
                         spread(train["latentloop"]["tok_s_all"]), spread(train["hf"]["tok_s_all"]) + " HF Llama",
                         spread(train["hf_ratio_all"], "{:.2f}x"), "—"))
        rows.append((f"floor ({mode} rounds): the step's matrix products (forward, grad of input and weight) and "
                     "causal SDPA forward + backward alone", spread(train["floor"]["tok_s_all"]), "—", over_floor,
                     bound))
    decode = results["decode_b1"]
    hf = decode.get("hf")
    rows.append((f"greedy decode, cached, batch 1, {results['args']['new_tokens']} new",
                 spread(decode["latentloop"]["tok_s_all"]),
                 (spread(hf["tok_s_all"]) + " HF Llama") if hf else f"— ({results['hf_note']})",
                 (spread(decode["ratio_all"], "{:.2f}x") + (" ✅" if decode["ratio"] >= TARGET_DECODE_RATIO
                                                             else " ❌")) if hf else "—",
                 f"≥ {TARGET_DECODE_RATIO:.0f}x"))
    fast = decode.get("latentloop compiled")
    if fast is not None:
        rows.append((f"greedy decode, compiled static cache (`compile=True`), batch 1, "
                     f"{results['args']['new_tokens']} new", spread(fast["tok_s_all"]),
                     (spread(hf["tok_s_all"]) + " HF Llama") if hf else f"— ({results['hf_note']})",
                     (spread(decode["compiled_ratio_all"], "{:.2f}x")
                      + (" ✅" if decode["compiled_ratio"] >= TARGET_DECODE_RATIO else " ❌")) if hf else "—",
                     f"≥ {TARGET_DECODE_RATIO:.0f}x (stretch {STRETCH_DECODE_RATIO:.0f}x)"))
    floor = decode["floor"]
    ways = f"F.linear ({spread(decode['floor F.linear']['tok_s_all'])})"
    if "floor reductions" in decode:
        ways = f"the faster of {ways} and compiled reductions ({spread(decode['floor reductions']['tok_s_all'])})"
    rows.append((f"floor: batch-1 products with every weight ({decode['weight_bytes'] / 1e6:.1f} MB fp32) "
                 f"per token, {ways}",
                 spread(floor["tok_s_all"]), "—",
                 "time over floor: ours " + spread(decode["latentloop"]["over_floor_all"], "{:.2f}x")
                 + (", compiled " + spread(fast["over_floor_all"], "{:.2f}x") if fast is not None else "")
                 + (", HF " + spread(hf["over_floor_all"], "{:.2f}x") if hf else ""),
                 "HF over floor bounds the ratio over HF of a decoder streaming weights at the floor's speed"))
    b16, naive = results["decode_b16"], results["decode_b1_naive"]
    rows.append((f"greedy decode, cached, batch {b16['batch_size']}, {b16['new_tokens']} new (all rows)",
                 f"{b16['tok_s']:,.0f}", "—", f"{b16['tok_s'] / decode['latentloop']['tok_s']:.2f}x vs batch 1", "—"))
    rows.append((f"greedy decode, uncached, batch 1, {naive['new_tokens']} new", f"{naive['tok_s']:,.0f}", "—",
                 f"{decode['latentloop']['tok_s'] / naive['tok_s']:.2f}x cached/uncached", "—"))
    return render_table(rows)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-len", type=int, default=256, help="training sequence length T")
    p.add_argument("--batch-size", type=int, default=16, help="training batch size")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed rounds of training steps first")
    p.add_argument("--rounds", type=int, default=5, help="interleaved training rounds (median and range reported)")
    p.add_argument("--steps-per-round", type=int, default=2, help="training steps timed per round and model")
    p.add_argument("--compile", action="store_true", help="also compare with both models torch.compile'd "
                   "(training), and decode through the compiled static-cache step (`generate(compile=True)`)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="grad-norm clip in the step, as the trainer (0: off)")
    p.add_argument("--prompt-len", type=int, default=16, help="decode prompt length")
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens per cached decode call")
    p.add_argument("--decode-batch", type=int, default=16, help="the larger decode batch size")
    p.add_argument("--naive-tokens", type=int, default=64, help="new tokens for the uncached batch-1 reference")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per decode measurement (median)")
    p.add_argument("--hf", action="store_true",
                   help="train and decode side by side with HF LlamaForCausalLM (needs transformers)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    add_allocator_flag(p)
    args = p.parse_args(argv)
    require_at_least_one(p, args, ("seq_len", "batch_size", "rounds", "steps_per_round", "prompt_len", "new_tokens",
                                   "decode_batch", "naive_tokens", "repeats"))
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if args.compile and args.warmup_steps < 1:  # else the first round times the compile
        p.error("--compile needs --warmup-steps >= 1: the first call compiles, and it must not be timed")
    require_threads(p, args)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(args)
    context = max(args.seq_len, args.prompt_len + args.new_tokens, args.prompt_len + args.naive_tokens)
    model = build_model(context, args.seed)
    print(f"model: gpt {N_LAYER} layers, d={N_EMBD}, {N_HEAD} heads, vocab {VOCAB}, "
          f"{model.num_params() / 1e6:.2f}M params, sequence_len {context}", flush=True)
    results: dict[str, Any] = {"env": env, "shape": {"n_layer": N_LAYER, "n_embd": N_EMBD, "n_head": N_HEAD,
                                                     "vocab_size": VOCAB, "params": model.num_params()},
                               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if load_nanogpt() is None:
        print(f"note: {ANCHOR} not found: training is measured without its nanoGPT reference", flush=True)
    results["train"] = {}
    for mode in ("eager", "compiled") if args.compile else ("eager",):
        print(f"training ({mode}): {args.rounds} interleaved rounds of {args.steps_per_round} steps ...", flush=True)
        results["train"][mode] = bench_training_side_by_side(args, compile=mode == "compiled")

    print("decoding: cached batch 1 / batch "
          f"{args.decode_batch}, uncached batch 1 ...", flush=True)
    results["hf_note"] = "" if args.hf and hf_available() is None else (
        "pass --hf" if not args.hf else "transformers not importable")
    results["decode_b1"] = bench_decode_side_by_side(model, args)
    results["decode_b16"] = bench_decode(model, args.decode_batch, args.prompt_len, args.new_tokens, args.repeats,
                                         True, args.seed)
    results["decode_b1_naive"] = bench_decode(model, 1, args.prompt_len, args.naive_tokens, args.repeats, False,
                                              args.seed)
    for key in ("decode_b16", "decode_b1_naive"):
        results[key].pop("first_row")
    return results


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
