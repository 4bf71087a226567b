"""Baseline speed benchmark of the `gpt` backbone on CPU: training throughput and cached decoding.

Measures, at one fixed shape (4 layers, d=256, 4 heads, vocab 256):

1. training tokens/s (T=256, batch 16, fp32, AdamW; forward + backward + grad clip + step, the
   same step as `latentloop.train.fit`), the median over timed steps after warmup steps;
2. greedy decoding tokens/s through `latentloop.generate(..., temperature=0)` with the KV cache at
   batch 1 and batch 16, and the uncached reference (`use_cache=False`) at batch 1 for fewer tokens;
3. the ratios to reference points measured on the project's CPU machines at the same shape
   (nanoGPT's model.py training, Hugging Face LlamaForCausalLM cached greedy decoding at batch 1);
4. with `--hf` (needs the `hf` extra, i.e. `transformers`), Hugging Face LlamaForCausalLM of the same
   shape measured in this very run, for a side-by-side ratio that does not depend on the machine.

Decode tokens/s counts new tokens (all rows) over the wall time of the whole `generate` call,
prefill included. Threads are left as torch picks them unless `--threads` is given.

    .venv/bin/python -m benchmarks.baseline
    .venv/bin/python -m benchmarks.baseline --hf --json bench.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import latentloop
from benchmarks.common import (
    ContentionMeter,
    announce_environment,
    environment,
    load_average,
    make_train_step,
    render_table,
    write_results,
)
from latentloop.config import TrainConfig
from latentloop.objectives.base import NextTokenObjective
from latentloop.optim import build_optimizers

# Shape of the comparison (fixed by the reference figures below).
N_LAYER, N_EMBD, N_HEAD, VOCAB = 4, 256, 4, 256
MLP_HIDDEN = 4 * N_EMBD  # our relu2 MLP width; the Llama reference uses the same intermediate size

# Reference figures from the issue, measured on the project's CPU machines at the same shape.
NANOGPT_TRAIN_TOK_S = 4900.0  # nanoGPT model.py, T=256, batch 16, fp32, AdamW
HF_DECODE_B1_TOK_S = 160.0  # Hugging Face LlamaForCausalLM, greedy, batch 1, KV cache
TARGET_TRAIN_RATIO = 1.0  # training >= 1.0x nanoGPT
TARGET_DECODE_RATIO = 3.0  # batch-1 decode >= 3x HF


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def build_model(sequence_len: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # bos_id: the byte tokenizer's default (256) is outside vocab 256; 1 as in the Llama config
    return latentloop.build("gpt", preset=None, n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, vocab_size=VOCAB,
                            sequence_len=sequence_len, bos_id=1)


def bench_training(model: torch.nn.Module, seq_len: int, batch_size: int, warmup: int, steps: int,
                   grad_clip: float, seed: int) -> dict[str, Any]:
    """Median tokens/s of full optimizer steps on random tokens (the trainer's step, without data loading)."""
    train_cfg = TrainConfig(batch_size=batch_size, optimizer="adamw", grad_clip=grad_clip, dtype="float32",
                            device="cpu")
    optimizers = build_optimizers(model, train_cfg)
    objective = NextTokenObjective(model.config, train_cfg)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=gen)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    model.train()
    step = make_train_step(model, objective, x, y, optimizers, grad_clip)
    for i in range(warmup):
        step(i)
    times = []
    loss = float("nan")
    for i in range(steps):
        start = time.perf_counter()
        loss = step(warmup + i)
        times.append(time.perf_counter() - start)
    tokens = batch_size * seq_len
    median = statistics.median(times)
    return {"tokens_per_step": tokens, "step_s_median": median, "step_s_min": min(times), "step_s_all": times,
            "tok_s": tokens / median, "tok_s_best": tokens / min(times), "final_loss": loss}


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


def bench_hf_decode(prompt_len: int, new_tokens: int, repeats: int, seed: int) -> dict[str, Any]:
    """HF LlamaForCausalLM of the same shape (random init, no download), greedy, batch 1, KV cache."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    config = LlamaConfig(hidden_size=N_EMBD, num_hidden_layers=N_LAYER, num_attention_heads=N_HEAD,
                         num_key_value_heads=N_HEAD, intermediate_size=MLP_HIDDEN, vocab_size=VOCAB,
                         max_position_embeddings=max(2048, prompt_len + new_tokens), tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (1, prompt_len), generator=gen)
    attention_mask = torch.ones_like(input_ids)

    def call():
        with torch.no_grad():
            return model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    call()  # warmup
    median, times, out = _time_calls(call, repeats)
    produced = out.shape[1] - prompt_len
    assert produced == new_tokens, f"HF produced {produced} tokens, expected {new_tokens}"
    return {"transformers_version": transformers.__version__, "batch_size": 1, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "params": sum(p.numel() for p in model.parameters()),
            "call_s_median": median, "call_s_all": times, "tok_s": produced / median}


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
    train, b1, b16, naive = results["train"], results["decode_b1"], results["decode_b16"], results["decode_b1_naive"]
    hf = results.get("hf")
    rows = [("Metric", "latentloop gpt (tok/s)", "Reference (tok/s)", "Ratio", "Target")]
    rows.append((f"Training, T={train['seq_len']}, batch {train['batch_size']}, fp32 AdamW (median)",
                 _fmt_rate(train["tok_s"]), f"{_fmt_rate(NANOGPT_TRAIN_TOK_S)} (nanoGPT, issue)",
                 _fmt_ratio(train["tok_s"] / NANOGPT_TRAIN_TOK_S, TARGET_TRAIN_RATIO), f"≥ {TARGET_TRAIN_RATIO:.1f}x"))
    rows.append((f"Greedy decode, cached, batch 1, {b1['new_tokens']} new",
                 _fmt_rate(b1["tok_s"]), f"{_fmt_rate(HF_DECODE_B1_TOK_S)} (HF Llama, issue)",
                 _fmt_ratio(b1["tok_s"] / HF_DECODE_B1_TOK_S, TARGET_DECODE_RATIO), f"≥ {TARGET_DECODE_RATIO:.0f}x"))
    if hf is not None:
        rows.append((f"Greedy decode, cached, batch 1, {hf['new_tokens']} new",
                     _fmt_rate(b1["tok_s"]), f"{_fmt_rate(hf['tok_s'])} (HF Llama, this run)",
                     _fmt_ratio(b1["tok_s"] / hf["tok_s"], TARGET_DECODE_RATIO), f"≥ {TARGET_DECODE_RATIO:.0f}x"))
    else:
        rows.append(("Greedy decode, HF Llama batch 1, this run", "—", "skipped", "—", results["hf_note"]))
    rows.append((f"Greedy decode, cached, batch 16, {b16['new_tokens']} new (all rows)",
                 _fmt_rate(b16["tok_s"]), "—", _fmt_ratio(b16["tok_s"] / b1["tok_s"]) + " vs batch 1", "—"))
    rows.append((f"Greedy decode, uncached (`use_cache=False`), batch 1, {naive['new_tokens']} new",
                 _fmt_rate(naive["tok_s"]), "—", _fmt_ratio(b1["tok_s"] / naive["tok_s"]) + " cached/uncached",
                 "—"))
    return render_table(rows)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-len", type=int, default=256, help="training sequence length T")
    p.add_argument("--batch-size", type=int, default=16, help="training batch size")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed training steps first")
    p.add_argument("--steps", type=int, default=10, help="timed training steps (the median is reported)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="grad-norm clip in the step, as the trainer (0: off)")
    p.add_argument("--prompt-len", type=int, default=16, help="decode prompt length")
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens per cached decode call")
    p.add_argument("--decode-batch", type=int, default=16, help="the larger decode batch size")
    p.add_argument("--naive-tokens", type=int, default=64, help="new tokens for the uncached batch-1 reference")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per decode measurement (median)")
    p.add_argument("--hf", action="store_true", help="also measure HF LlamaForCausalLM decoding (needs transformers)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    for name in ("seq_len", "batch_size", "steps", "prompt_len", "new_tokens", "decode_batch", "naive_tokens",
                 "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    env = environment()
    announce_environment(env)
    context = max(args.seq_len, args.prompt_len + args.new_tokens, args.prompt_len + args.naive_tokens)
    model = build_model(context, args.seed)
    print(f"model: gpt {N_LAYER} layers, d={N_EMBD}, {N_HEAD} heads, vocab {VOCAB}, "
          f"{model.num_params() / 1e6:.2f}M params, sequence_len {context}", flush=True)
    results: dict[str, Any] = {"env": env, "shape": {"n_layer": N_LAYER, "n_embd": N_EMBD, "n_head": N_HEAD,
                                                     "vocab_size": VOCAB, "params": model.num_params()},
                               "reference": {"nanogpt_train_tok_s": NANOGPT_TRAIN_TOK_S,
                                             "hf_decode_b1_tok_s": HF_DECODE_B1_TOK_S},
                               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}

    print(f"training: {args.warmup_steps} warmup + {args.steps} timed steps ...", flush=True)
    train = bench_training(model, args.seq_len, args.batch_size, args.warmup_steps, args.steps, args.grad_clip,
                           args.seed)
    results["train"] = {"seq_len": args.seq_len, "batch_size": args.batch_size, **train}

    print("decoding: cached batch 1 / batch "
          f"{args.decode_batch}, uncached batch 1 ...", flush=True)
    results["decode_b1"] = bench_decode(model, 1, args.prompt_len, args.new_tokens, args.repeats, True, args.seed)
    results["decode_b16"] = bench_decode(model, args.decode_batch, args.prompt_len, args.new_tokens, args.repeats,
                                         True, args.seed)
    results["decode_b1_naive"] = bench_decode(model, 1, args.prompt_len, args.naive_tokens, args.repeats, False,
                                              args.seed)
    # Same prompt (same seed) and greedy: the uncached tokens must be a prefix of the cached ones.
    cached, naive = results["decode_b1"]["first_row"], results["decode_b1_naive"]["first_row"]
    results["cached_matches_uncached"] = cached[:len(naive)] == naive
    for key in ("decode_b1", "decode_b16", "decode_b1_naive"):
        results[key].pop("first_row")

    results["hf"], results["hf_note"] = None, ""
    if args.hf:
        missing = hf_available()
        if missing is None:
            print("HF LlamaForCausalLM: decoding batch 1 ...", flush=True)
            results["hf"] = bench_hf_decode(args.prompt_len, args.new_tokens, args.repeats, args.seed)
        else:
            results["hf_note"] = "transformers not importable (pip install -e '.[hf]')"
            print(f"note: --hf skipped, {missing}", flush=True)
    else:
        results["hf_note"] = "pass --hf to measure"

    results["ratios"] = {
        "train_vs_nanogpt": results["train"]["tok_s"] / NANOGPT_TRAIN_TOK_S,
        "decode_b1_vs_hf_issue": results["decode_b1"]["tok_s"] / HF_DECODE_B1_TOK_S,
        "decode_b1_vs_hf_measured": (results["decode_b1"]["tok_s"] / results["hf"]["tok_s"]
                                     if results["hf"] else None),
        "cached_vs_uncached_b1": results["decode_b1"]["tok_s"] / results["decode_b1_naive"]["tok_s"],
    }
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    meter = ContentionMeter().start()
    results = run(args)
    results["wall_s"] = time.perf_counter() - start
    results["env"]["others_cpu_share_during_run"] = others = meter.stop()
    results["env"]["load_avg_1min_at_end"] = load_average()
    print()
    print(markdown_table(results))
    print()
    print(f"training step: median {results['train']['step_s_median'] * 1e3:.0f} ms, best "
          f"{results['train']['step_s_min'] * 1e3:.0f} ms ({_fmt_rate(results['train']['tok_s_best'])} tok/s); "
          f"cached greedy == uncached greedy: {results['cached_matches_uncached']}; "
          f"total {results['wall_s']:.0f} s; other processes used "
          f"{'?' if others is None else f'{others:.0%}'} of the CPUs during the run")
    write_results(results, others, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
