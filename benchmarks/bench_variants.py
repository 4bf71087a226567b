"""Speed and size benchmark of the variants (`fbt`, `lrt`, `rgpt`) against the `gpt` backbone, CPU first.

The figures for the closing notes of issues 3 (fbt), 4 (lrt) and 5 (rgpt):

1. fbt: decode latency per token at batch 1, regime `soft` over `standard` with the same weights, at
   d=256 (4 layers, 4 heads) and d=1024 (4 layers, 8 heads), byte vocab (target <= 1.03x); training
   step time with K=2 and K=3 passes over K=1 at the tiny preset, T=256, batch 16 (targets <= 2.05x
   and <= 3.1x).
2. lrt: decode latency per token at batch 1 over `gpt` of the same shape (target <= 1.05x); training
   step time of `interleaved` S=2 over `gpt` at the tiny preset (target <= 2.1x); parameter overhead of
   `shared` and `layerwise` at the tiny preset and at the nanochat d20 shape (models built on the
   `meta` device, so nothing is allocated; checked against a closed-form count).
3. rgpt: decode latency per token against an isoFLOPs dense `gpt` (the same effective depth, split by
   `rgpt_shape_from_dense`) in eager mode, and compiled with `--compile`; parameters and FLOPs per
   token; peak memory of a decode; KV-cache bytes per cache mode (`cache.memory_bytes()`).

How it measures:
- Decode latency per token: `latentloop.generate(model, prompt, N, temperature=0, **options)` with a
  `stream` callback that timestamps every new token; latency = (last - first stamp) / (N - 1), i.e.
  the decode loop (engine + model) without the prefill, which is reported on its own. The model step
  alone: `model.generate_step(token, cache=cache, **options)` N times after a prefill into a fresh
  cache, wall time / N. The difference of the two is the engine's overhead per token (sampling,
  `.tolist()`, bookkeeping). For scale, the tables also give the weight multiply-adds per token (the
  ratio a compute-bound machine would approach; at 4 layers fbt's two D×D fusion matrices are ~4% of
  them, not the paper's <1% at full depth).
- Training step: forward + backward + grad-norm clip + AdamW step, the trainer's step through the
  arch's registered objective (fp32, random tokens, no data loading). fbt gets K by a config with
  `feedback_start=0` and the whole pass mix on K, so its real objective (prefix mix-in included) runs.
- The variants compared in one table are measured interleaved (round robin, the order rotating every
  repeat), so that a change of machine load hits all of them alike; each figure is the median over
  the repeats, after warmup calls of each.
- Peak memory of rgpt vs dense, on CPU: the peak RSS of a fresh subprocess per model that builds it
  and decodes a `--mem-prompt-len` prompt plus N tokens, counted over the RSS the same process had just
  before building (torch's own footprint left out). The peak is /proc's VmHWM, reset before building;
  `getrusage`'s ru_maxrss would carry the parent's RSS across fork + exec (used only off Linux). Next
  to it, the exact bytes of parameters + buffers + the KV cache of that decode. On CUDA:
  `torch.cuda.max_memory_allocated`.

    .venv/bin/python benchmarks/bench_variants.py                      # ~4 min on 2 idle cores
    .venv/bin/python benchmarks/bench_variants.py --quick              # smaller, under a minute idle
    .venv/bin/python benchmarks/bench_variants.py --sections rgpt --compile --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# Measure this checkout's code (see bench_baseline.py), and find the sibling benchmark modules.
BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bench_baseline import ContentionMeter, environment, load_average  # noqa: E402
from common import announce_environment, make_train_step, render_table, write_results  # noqa: E402

import latentloop  # noqa: E402
from latentloop.config import PRESETS, TrainConfig, rgpt_shape_from_dense  # noqa: E402
from latentloop.data.tokenizers import ByteTokenizer  # noqa: E402
from latentloop.models.rgpt import CACHE_MODES  # noqa: E402
from latentloop.objectives import objective_for  # noqa: E402
from latentloop.optim import build_optimizers  # noqa: E402

BYTE_VOCAB = ByteTokenizer.vocab_size  # 259: bytes + BOS/EOS/PAD; prompts use bytes only (never BOS)
DECODE_SHAPES = {256: dict(n_layer=4, n_embd=256, n_head=4), 1024: dict(n_layer=4, n_embd=1024, n_head=8)}
NANOCHAT_D20 = dict(n_layer=20, n_embd=1280, n_head=10, vocab_size=65536, sequence_len=2048)
SECTIONS = ("fbt", "lrt", "rgpt")

TARGET_FBT_DECODE = 1.03  # soft / standard
TARGET_FBT_TRAIN = {2: 2.05, 3: 3.1}  # K passes / K=1
TARGET_LRT_DECODE = 1.05  # lrt / gpt (paper: 1.09)
TARGET_LRT_TRAIN = 2.1  # interleaved S=2 / gpt
PAPER_RGPT = {"decode_eager": "+23% (GPU eager)", "decode_compiled": "+10% (GPU compiled)",
              "params": "−63%", "memory": "−59%"}

# Sizes: the default run, and --quick; an explicit flag wins over both.
DEFAULTS = dict(dims="256,1024", prompt_len=16, new_tokens=64, repeats=5, warmup=1, train_seq_len=256,
                train_batch=16, train_warmup=2, train_steps=6, rgpt_dense_layers=14, rgpt_steps=4, rgpt_dim=256,
                rgpt_heads=4, mem_prompt_len=512, cache_context=1024)
QUICK = dict(dims="256", new_tokens=24, repeats=3, train_seq_len=128, train_batch=8, train_warmup=1, train_steps=3,
             rgpt_dense_layers=8, rgpt_steps=3, mem_prompt_len=128)

MiB = 2 ** 20


# --------------------------------------------------------------------------------------------
# Timing primitives
# --------------------------------------------------------------------------------------------


def make_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def run_interleaved(calls: dict[str, Callable[[], dict[str, float]]], warmup: int, repeats: int) -> dict[str, Any]:
    """Call every measurement `warmup` times, then `repeats` rounds of all of them in rotating order.

    Each call returns named figures (seconds); the result holds, per call and figure, the median
    (`figure`) and every sample (`figure_all`)."""
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            for key, value in calls[name]().items():
                samples[name].setdefault(key, []).append(value)
    return {name: {**{key: statistics.median(v) for key, v in figures.items()},
                   **{f"{key}_all": v for key, v in figures.items()}} for name, figures in samples.items()}


def decode_generate(model: nn.Module, prompt: list[int], new_tokens: int, options: dict[str, Any],
                    sync: Callable[[], None]) -> dict[str, float]:
    """One greedy `latentloop.generate` call; seconds per decoded token (prefill excluded) and prefill."""
    stamps: list[float] = []

    def stream(_tokens: list[int | None]) -> None:
        sync()
        stamps.append(time.perf_counter())

    start = time.perf_counter()
    out = latentloop.generate(model, prompt, new_tokens, temperature=0.0, stream=stream, **options)
    if len(out) != new_tokens or len(stamps) != new_tokens:
        raise RuntimeError(f"generate produced {len(out)} tokens ({len(stamps)} streamed), expected {new_tokens}")
    return {"token_s": (stamps[-1] - stamps[0]) / (new_tokens - 1), "prefill_s": stamps[0] - start}


@torch.no_grad()
def decode_steps(model: nn.Module, prompt: Tensor, tokens: list[Tensor], options: dict[str, Any],
                 sync: Callable[[], None]) -> dict[str, float]:
    """The model's own decode step: prefill a fresh cache, then one `generate_step` per token."""
    P = prompt.shape[1]
    cache = model.new_cache(1, P + len(tokens), **options)
    model.generate_step(prompt, cache=cache, prompt_len=P, **options)
    sync()
    start = time.perf_counter()
    for token in tokens:
        model.generate_step(token, cache=cache, prompt_len=P, **options)
    sync()
    return {"token_s": (time.perf_counter() - start) / len(tokens)}


def decode_comparison(entries: dict[str, tuple[nn.Module, dict[str, Any]]], args: argparse.Namespace,
                      device: torch.device, warmup: int | None = None) -> dict[str, dict[str, Any]]:
    """Decode latency of several (model, generation options) at batch 1, measured interleaved."""
    sync = make_sync(device)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, 256, (1, args.prompt_len), generator=gen)
    tokens = torch.randint(0, 256, (1, args.new_tokens), generator=gen).to(device)
    token_views = [tokens[:, t:t + 1] for t in range(args.new_tokens)]
    calls: dict[str, Callable[[], dict[str, float]]] = {}
    for name, (model, options) in entries.items():
        model.eval()
        calls[f"{name}/generate"] = partial(decode_generate, model, prompt[0].tolist(), args.new_tokens, options, sync)
        calls[f"{name}/step"] = partial(decode_steps, model, prompt.to(device), token_views, options, sync)
    raw = run_interleaved(calls, args.warmup if warmup is None else warmup, args.repeats)
    results = {}
    for name in entries:
        g, s = raw[f"{name}/generate"], raw[f"{name}/step"]
        results[name] = {"generate_s_per_token": g["token_s"], "step_s_per_token": s["token_s"],
                         "engine_overhead_s_per_token": g["token_s"] - s["token_s"], "prefill_s": g["prefill_s"],
                         "generate_s_per_token_all": g["token_s_all"], "step_s_per_token_all": s["token_s_all"]}
    return results


def training_call(arch: str, shape: dict[str, Any], overrides: dict[str, Any], args: argparse.Namespace,
                  device: torch.device, data: Tensor, passes: int | None = None) -> tuple[Callable, dict[str, Any]]:
    """A fresh model, optimizer and objective; returns a call that times one optimizer step."""
    torch.manual_seed(args.seed)
    model = latentloop.build(arch, preset=None, **shape, **overrides).to(device)
    model.train()
    train_cfg = TrainConfig(batch_size=data.shape[0], optimizer="adamw", grad_clip=args.grad_clip,
                            dtype="float32", device=device.type)
    objective = objective_for(model.config, train_cfg)
    if passes is not None and any(objective.passes_for_step(i) != passes for i in range(64)):
        raise RuntimeError(f"the fbt objective did not fix K={passes}")
    x, y = data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
    step = make_train_step(model, objective, x, y, build_optimizers(model, train_cfg), args.grad_clip)
    counter = itertools.count()
    sync = make_sync(device)

    def call() -> dict[str, float]:
        start = time.perf_counter()
        loss = step(next(counter))
        sync()
        return {"step_s": time.perf_counter() - start, "loss": loss}

    info = {"arch": arch, "params": model.num_params(), "tokens_per_step": x.numel(),
            "charged_flops_per_token": objective.flops_per_token(model, step=0)}
    return call, info


def training_comparison(variants: dict[str, tuple[str, dict, dict, int | None]], args: argparse.Namespace,
                        device: torch.device) -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, 256, (args.train_batch, args.train_seq_len + 1), generator=gen)
    calls, infos = {}, {}
    for name, (arch, shape, overrides, passes) in variants.items():
        calls[name], infos[name] = training_call(arch, shape, overrides, args, device, data, passes)
    raw = run_interleaved(calls, args.train_warmup, args.train_steps)
    return {name: {**infos[name], "step_s": raw[name]["step_s"], "step_s_all": raw[name]["step_s_all"],
                   "tok_s": infos[name]["tokens_per_step"] / raw[name]["step_s"],
                   "final_loss": raw[name]["loss_all"][-1]} for name in variants}


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def ratio_vs(value: float, target: float | None = None) -> str:
    """`value`x, with a mark against an upper-bound target."""
    text = f"{value:.3f}x"
    if target is not None:
        text += " ✅" if value <= target else " ❌"
    return text


def change(value: float) -> str:
    return f"{value:.2f}x ({value - 1:+.0%})"


def shape_label(cfg: Any) -> str:
    return f"d={cfg.n_embd}, {cfg.n_layer} layers, {cfg.n_head} heads"


def tiny_shape(seq_len: int = 0) -> dict[str, Any]:
    """The `tiny` preset with the byte vocabulary, its context stretched to `seq_len` if longer."""
    preset = PRESETS["tiny"]
    return {**preset, "vocab_size": BYTE_VOCAB, "sequence_len": max(preset["sequence_len"], seq_len)}


def build(arch: str, device: torch.device, seed: int, **kwargs: Any) -> nn.Module:
    torch.manual_seed(seed)
    return latentloop.build(arch, preset=None, **kwargs).to(device)


def weight_macs_per_token(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """Multiply-adds of the weight matrices one decoded token goes through (attention over the cache
    not counted): every parameter except the embedding lookup, plus the head (tied or not). `skip`:
    modules the measured path does not run (e.g. fbt's fusion under `standard`)."""
    n = model.num_params() - sum(p.numel() for m in skip for p in m.parameters())
    return n if model.lm_head is None else n - model.wte.weight.numel()


def param_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def bench_fbt(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], list[str]]:
    results: dict[str, Any] = {"decode": {}, "train": {}}
    tables = []
    context = args.prompt_len + args.new_tokens
    rows = [("Shape", "Measured, batch 1", "standard (ms/tok)", "soft (ms/tok)", "soft / standard", "Target")]
    for dim in args.dims:
        model = build("fbt", device, args.seed, vocab_size=BYTE_VOCAB, sequence_len=context, **DECODE_SHAPES[dim])
        label = f"{shape_label(model.config)} ({model.num_params() / 1e6:.1f}M params)"
        print(f"fbt decode: {label}, {args.new_tokens} new tokens ...", flush=True)
        res = decode_comparison({"standard": (model, {"regime": "standard"}), "soft": (model, {"regime": "soft"})},
                                args, device)
        std, soft = res["standard"], res["soft"]
        macs = {"standard": weight_macs_per_token(model, skip=(model.fuse_value, model.fuse_gate)),
                "soft": weight_macs_per_token(model)}
        ratios = {"generate": soft["generate_s_per_token"] / std["generate_s_per_token"],
                  "step": soft["step_s_per_token"] / std["step_s_per_token"]}
        results["decode"][f"d{dim}"] = {"shape": DECODE_SHAPES[dim], "params": model.num_params(), **res,
                                        "soft_over_standard": ratios, "weight_macs_per_token": macs}
        target = f"≤ {TARGET_FBT_DECODE}x"
        rows += [(label, "`generate` (engine + model)", ms(std["generate_s_per_token"]),
                  ms(soft["generate_s_per_token"]), ratio_vs(ratios["generate"], TARGET_FBT_DECODE), target),
                 ("", "`generate_step` (model only)", ms(std["step_s_per_token"]), ms(soft["step_s_per_token"]),
                  ratio_vs(ratios["step"], TARGET_FBT_DECODE), target),
                 ("", "engine overhead (difference)", ms(std["engine_overhead_s_per_token"]),
                  ms(soft["engine_overhead_s_per_token"]), "—", "—"),
                 ("", f"prefill, {args.prompt_len} tokens (ms, plain in both)", ms(std["prefill_s"]),
                  ms(soft["prefill_s"]), "—", "—"),
                 ("", "weight MACs per token (analytic, M)", f"{macs['standard'] / 1e6:.2f}",
                  f"{macs['soft'] / 1e6:.2f}", f"{macs['soft'] / macs['standard']:.3f}x", "—")]
        del model
    tables.append(f"### fbt: decode latency per token, `soft` over `standard`, same weights (vocab {BYTE_VOCAB})\n\n"
                  + render_table(rows))

    shape = tiny_shape(args.train_seq_len)
    print(f"fbt training: K=1/2/3, T={args.train_seq_len}, batch {args.train_batch}, "
          f"{args.train_warmup} warmup + {args.train_steps} timed steps each ...", flush=True)
    variants = {f"K={k}": ("fbt", shape, dict(feedback_start=0.0, pass_mix=tuple(float(i == k - 1) for i in range(k))),
                           k) for k in (1, 2, 3)}
    train = training_comparison(variants, args, device)
    base = train["K=1"]
    rows = [("Passes", "step (ms, median)", "tokens/s", "over K=1", "charged FLOPs over K=1", "Target")]
    for k in (1, 2, 3):
        t = train[f"K={k}"]
        t["over_k1"] = t["step_s"] / base["step_s"]
        target = TARGET_FBT_TRAIN.get(k)
        rows.append((f"K={k}", ms(t["step_s"]), f"{t['tok_s']:,.0f}", ratio_vs(t["over_k1"], target),
                     f"{t['charged_flops_per_token'] / base['charged_flops_per_token']:.2f}x",
                     f"≤ {target}x" if target else "—"))
    results["train"] = {"seq_len": args.train_seq_len, "batch_size": args.train_batch, "shape": shape, **train}
    tables.append(f"### fbt: training step (forward + backward + clip + AdamW), tiny shape, T={args.train_seq_len}, "
                  f"batch {args.train_batch}\n\n" + render_table(rows))
    return results, tables


def lrt_extra_params(cfg: Any) -> int:
    """Closed-form count of what `lrt` adds to `gpt` of the same shape."""
    kv = cfg.injection in ("kv", "both")
    residual = cfg.injection in ("residual", "both")
    layers = [i for i in range(cfg.n_layer) if cfg.injects(i)]
    mem_kv = cfg.n_embd * 2 * cfg.n_kv_head * cfg.head_dim  # one (W_k; W_v)
    n = mem_kv if kv and cfg.kv_projection == "shared" else 0
    for _ in layers:
        if kv:
            n += cfg.n_embd * 2 * cfg.n_kv_head  # the per-head gates (g_loc, g_fb)
            n += mem_kv if cfg.kv_projection == "layerwise" else 0
        n += 2 if residual else 0  # alpha_l, gamma_l
    return n


def lrt_param_overhead() -> tuple[dict[str, Any], list[tuple]]:
    shapes = {"tiny preset": tiny_shape(), "nanochat d20": NANOCHAT_D20}
    results: dict[str, Any] = {}
    rows = [("Shape", "gpt params", "non-embedding", "lrt `shared` extra", "lrt `layerwise` extra")]
    for label, shape in shapes.items():
        with torch.device("meta"):  # shapes only, no memory
            gpt = latentloop.build("gpt", preset=None, **shape)
            variants = {kind: latentloop.build("lrt", preset=None, kv_projection=kind, **shape)
                        for kind in ("shared", "layerwise")}
        total, body = gpt.num_params(), gpt.num_params(exclude_embedding=True)
        entry: dict[str, Any] = {"shape": shape, "gpt_params": total, "gpt_params_non_embedding": body}
        cells = []
        for kind, model in variants.items():
            extra = model.num_params() - total
            closed_form = lrt_extra_params(model.config)
            entry[kind] = {"params": model.num_params(), "extra": extra, "extra_closed_form": closed_form,
                           "extra_fraction": extra / total, "extra_fraction_non_embedding": extra / body}
            check = "" if extra == closed_form else f" (closed form says {closed_form:,}!)"
            cells.append(f"+{extra:,} ({extra / total:.2%}; {extra / body:.2%} of non-emb.){check}")
        results[label] = entry
        rows.append((f"{label}: {shape_label(gpt.config)}, vocab {shape['vocab_size']}", f"{total:,}", f"{body:,}",
                     *cells))
    return results, rows


def bench_lrt(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], list[str]]:
    results: dict[str, Any] = {"decode": {}, "train": {}}
    tables = []
    context = args.prompt_len + args.new_tokens
    rows = [("Shape", "Measured, batch 1", "gpt (ms/tok)", "lrt (ms/tok)", "lrt / gpt", "Target")]
    for dim in args.dims:
        shape = dict(vocab_size=BYTE_VOCAB, sequence_len=context, **DECODE_SHAPES[dim])
        gpt, lrt = build("gpt", device, args.seed, **shape), build("lrt", device, args.seed, **shape)
        label = f"{shape_label(gpt.config)} (gpt {gpt.num_params() / 1e6:.1f}M, lrt {lrt.num_params() / 1e6:.1f}M)"
        print(f"lrt decode: {label}, {args.new_tokens} new tokens ...", flush=True)
        res = decode_comparison({"gpt": (gpt, {}), "lrt": (lrt, {})}, args, device)
        g, r = res["gpt"], res["lrt"]
        macs = {"gpt": weight_macs_per_token(gpt), "lrt": weight_macs_per_token(lrt)}
        ratios = {"generate": r["generate_s_per_token"] / g["generate_s_per_token"],
                  "step": r["step_s_per_token"] / g["step_s_per_token"]}
        results["decode"][f"d{dim}"] = {"shape": DECODE_SHAPES[dim], "params_gpt": gpt.num_params(),
                                        "params_lrt": lrt.num_params(), **res, "lrt_over_gpt": ratios,
                                        "weight_macs_per_token": macs}
        target = f"≤ {TARGET_LRT_DECODE}x"
        rows += [(label, "`generate` (engine + model)", ms(g["generate_s_per_token"]), ms(r["generate_s_per_token"]),
                  ratio_vs(ratios["generate"], TARGET_LRT_DECODE), target),
                 ("", "`generate_step` (model only)", ms(g["step_s_per_token"]), ms(r["step_s_per_token"]),
                  ratio_vs(ratios["step"], TARGET_LRT_DECODE), target),
                 ("", "engine overhead (difference)", ms(g["engine_overhead_s_per_token"]),
                  ms(r["engine_overhead_s_per_token"]), "—", "—"),
                 ("", f"prefill, {args.prompt_len} tokens (ms; lrt: exact, token by token)", ms(g["prefill_s"]),
                  ms(r["prefill_s"]), f"{r['prefill_s'] / g['prefill_s']:.1f}x", "—"),
                 ("", "weight MACs per token (analytic, M)", f"{macs['gpt'] / 1e6:.2f}", f"{macs['lrt'] / 1e6:.2f}",
                  f"{macs['lrt'] / macs['gpt']:.3f}x", "—")]
        del gpt, lrt
    tables.append("### lrt: decode latency per token over `gpt` of the same shape (paper: +9%)\n\n"
                  + render_table(rows))

    shape = tiny_shape(args.train_seq_len)
    print(f"lrt training: gpt vs interleaved S=2, T={args.train_seq_len}, batch {args.train_batch}, "
          f"{args.train_warmup} warmup + {args.train_steps} timed steps each ...", flush=True)
    train = training_comparison({"gpt": ("gpt", shape, {}, None),
                                 "lrt interleaved S=2": ("lrt", shape, dict(recurrence="interleaved", subsets=2),
                                                         None)}, args, device)
    base = train["gpt"]
    rows = [("Model", "step (ms, median)", "tokens/s", "over gpt", "charged FLOPs over gpt", "Target")]
    for name, t in train.items():
        t["over_gpt"] = t["step_s"] / base["step_s"]
        target = TARGET_LRT_TRAIN if name != "gpt" else None
        rows.append((name, ms(t["step_s"]), f"{t['tok_s']:,.0f}", ratio_vs(t["over_gpt"], target),
                     f"{t['charged_flops_per_token'] / base['charged_flops_per_token']:.2f}x",
                     f"≤ {target}x" if target else "—"))
    results["train"] = {"seq_len": args.train_seq_len, "batch_size": args.train_batch, "shape": shape, **train}
    tables.append(f"### lrt: training step (forward + backward + clip + AdamW), tiny shape, T={args.train_seq_len}, "
                  f"batch {args.train_batch}\n\n" + render_table(rows))

    results["params"], rows = lrt_param_overhead()
    tables.append("### lrt: parameter overhead over `gpt` of the same shape (built on the meta device; injection "
                  "`both` into every layer; issue: ~0.3% for `shared` at d20)\n\n" + render_table(rows))
    return results, tables


def compile_blocks(model: nn.Module) -> nn.Module:
    """A copy whose transformer blocks are `torch.compile`d with dynamic shapes (the cache grows every step).

    The caches it makes run `update` eagerly (a graph break around it): the update slices with Python
    ints that change every step, and under dynamic shapes `RecurrentKVCache.update`'s `slot not in
    self.core_range` raises inside dynamo (InternalTorchDynamoError, torch 2.13). Each block thus
    compiles as two graphs, before and after the cache update."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 64))  # prefill/decode x slots: never fall back to eager
    model = copy.deepcopy(model)
    for block in model.blocks:
        block.compile(dynamic=True)
    make_cache = model.new_cache

    def new_cache(*args: Any, **kwargs: Any):
        cache = make_cache(*args, **kwargs)
        cache.update = torch.compiler.disable(cache.update)
        return cache

    model.new_cache = new_cache  # an instance attribute of this copy only
    return model


def dynamo_summary() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return {"frames": dict(counters["frames"]), "unique_graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values())}


def proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: build one model and decode it; report the peak RSS over the RSS before building.

    The peak is VmHWM, the high-water mark of this process's own address space. getrusage's ru_maxrss
    is not used on Linux: across fork + exec it keeps the parent's RSS at the fork (here the parent holds
    every model of the run), so it would report the parent's size, not this model's."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    a = torch.randn(256, 256)
    float((a @ a).sum())  # start torch's thread pool and allocator before the baseline reading
    base = proc_status_bytes("VmRSS")
    was_reset = reset_peak_rss()
    model = build(spec["arch"], torch.device("cpu"), spec["seed"], **spec["kwargs"]).eval()
    gen = torch.Generator().manual_seed(spec["seed"])
    prompt = torch.randint(0, 256, (spec["prompt_len"],), generator=gen).tolist()
    latentloop.generate(model, prompt, spec["new_tokens"], temperature=0.0, **spec["options"])
    peak, method = proc_status_bytes("VmHWM"), "VmHWM" + (" (reset before building)" if was_reset else "")
    if peak is None:  # not Linux: ru_maxrss is bytes on macOS, KiB elsewhere (and may include the parent's)
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak, method = (ru if sys.platform == "darwin" else ru * 1024), "ru_maxrss"
    return {"base_rss": base, "peak_rss": peak, "peak_over_base": None if base is None else peak - base,
            "peak_method": method}


def measure_peak_memory(spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        model = build(spec["arch"], device, spec["seed"], **spec["kwargs"]).eval()
        prompt = list(range(spec["prompt_len"]))
        latentloop.generate(model, prompt, spec["new_tokens"], temperature=0.0, **spec["options"])
        peak = torch.cuda.max_memory_allocated(device)
        del model
        return {"method": "torch.cuda.max_memory_allocated", "base": base, "peak": peak, "peak_over_base": peak - base}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_rss-child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory subprocess failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"method": "subprocess peak RSS over its RSS before building", **out}


def bench_rgpt(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], list[str]]:
    L, R = args.rgpt_dense_layers, args.rgpt_steps
    context = max(args.prompt_len, args.mem_prompt_len) + args.new_tokens
    shared = dict(n_embd=args.rgpt_dim, n_head=args.rgpt_heads, vocab_size=BYTE_VOCAB, sequence_len=context)
    split = rgpt_shape_from_dense(L, "flops", R)
    specs = {"dense": ("gpt", dict(n_layer=L, **shared)), "rgpt": ("rgpt", dict(**split, **shared))}
    dense, rgpt = (build(arch, device, args.seed, **kwargs) for arch, kwargs in specs.values())
    c = rgpt.config
    rgpt_label = f"rgpt {c.n_pre} + {c.n_rec}×{c.recurrence_steps} + {c.n_coda}"
    dense_label = f"gpt, {L} layers"
    results: dict[str, Any] = {"dense_kwargs": specs["dense"][1], "rgpt_kwargs": specs["rgpt"][1],
                               "effective_depth": c.effective_depth, "dense_depth": L}
    tables = []

    # parameters and FLOPs
    flops_T = args.train_seq_len
    sizes = {"dense": (dense.num_params(), dense.flops_per_token(flops_T)),
             "rgpt": (rgpt.num_params(), rgpt.flops_per_token(flops_T))}
    results["params"] = {k: v[0] for k, v in sizes.items()}
    results["flops_per_token"] = {k: v[1] for k, v in sizes.items()}
    rows = [("Model", "Effective depth", "Params", "Params over dense", f"FLOPs/token (fwd+bwd, T={flops_T})",
             "FLOPs over dense", "Paper (params)")]
    for name, label, depth in (("dense", dense_label, L), ("rgpt", rgpt_label, c.effective_depth)):
        p, f = sizes[name]
        rows.append((label, depth, f"{p:,}", change(p / sizes["dense"][0]), f"{f / 1e6:.1f}M",
                     change(f / sizes["dense"][1]), PAPER_RGPT["params"] if name == "rgpt" else "—"))
    tables.append(f"### rgpt vs isoFLOPs dense `gpt`: parameters and compute (d={args.rgpt_dim}, "
                  f"{args.rgpt_heads} heads, vocab {BYTE_VOCAB})\n\n" + render_table(rows))

    # decode latency, eager (and compiled)
    print(f"rgpt decode: {dense_label} vs {rgpt_label} (cache modes {', '.join(CACHE_MODES)}), "
          f"{args.new_tokens} new tokens ...", flush=True)
    entries = {"dense": (dense, {}), **{f"rgpt {m}": (rgpt, {"cache_mode": m}) for m in CACHE_MODES}}
    decode = decode_comparison(entries, args, device)
    if args.compile:
        print("rgpt decode, compiled blocks (warmup includes compilation) ...", flush=True)
        compiled = {"dense compiled": (compile_blocks(dense), {}),
                    "rgpt full compiled": (compile_blocks(rgpt), {"cache_mode": "full"})}
        compile_s = {}
        for name, (model, options) in compiled.items():
            start = time.perf_counter()
            for _ in range(2):  # compile the prefill and the decode graphs, and settle recompilations
                decode_generate(model, list(range(args.prompt_len)), args.new_tokens, options, make_sync(device))
                decode_steps(model.eval(), torch.arange(args.prompt_len, device=device)[None],
                             [torch.zeros(1, 1, dtype=torch.long, device=device)] * args.new_tokens, options,
                             make_sync(device))
            compile_s[name] = time.perf_counter() - start
        results["compile_warmup_s"] = compile_s
        results["dynamo"] = dynamo = dynamo_summary()
        print(f"compiled in {sum(compile_s.values()):.0f} s: {dynamo['unique_graphs']} graphs, "
              f"{dynamo['graph_breaks']} graph breaks, frames {dynamo['frames']}", flush=True)
        if dynamo["frames"].get("ok", 0) != dynamo["frames"].get("total", 0):
            print("warning: some frames failed to compile and run eagerly", flush=True)
        decode.update(decode_comparison(compiled, args, device, warmup=0))
    results["decode"] = decode
    base = decode["dense"]
    rows = [("Model", "`generate` (ms/tok)", "`generate_step` (ms/tok)", "engine overhead (ms/tok)",
             f"prefill {args.prompt_len} tok (ms)", "over dense (generate)", "over dense (step)", "Paper")]
    for name, d in decode.items():
        ref = decode["dense compiled"] if name.endswith("compiled") else base
        label = dense_label if name.startswith("dense") else f"{rgpt_label}, cache `{name.split()[1]}`"
        label += ", compiled" if name.endswith("compiled") else ", eager"
        paper = "—"
        if name == "rgpt full":
            paper = PAPER_RGPT["decode_eager"]
        elif name == "rgpt full compiled":
            paper = PAPER_RGPT["decode_compiled"]
        d["over_dense"] = {"generate": d["generate_s_per_token"] / ref["generate_s_per_token"],
                           "step": d["step_s_per_token"] / ref["step_s_per_token"]}
        rows.append((label, ms(d["generate_s_per_token"]), ms(d["step_s_per_token"]),
                     ms(d["engine_overhead_s_per_token"]), ms(d["prefill_s"]), change(d["over_dense"]["generate"]),
                     change(d["over_dense"]["step"]), paper))
    note = (" (`--compile`: every block `torch.compile(dynamic=True)`, the cache update eager in between; "
            "meant for GPU)") if args.compile else ""
    tables.append(f"### rgpt vs isoFLOPs dense `gpt`: decode latency per token, batch 1, {device.type}{note}\n\n"
                  + render_table(rows))

    # memory: exact bytes and measured peak of one decode
    mem_context = args.mem_prompt_len + args.new_tokens
    memory: dict[str, Any] = {}
    mem_entries = {"dense": ("dense", {}), **{f"rgpt {m}": ("rgpt", {"cache_mode": m}) for m in CACHE_MODES}}
    for name, (which, options) in mem_entries.items():
        model = dense if which == "dense" else rgpt
        cache = model.new_cache(1, mem_context, **options)
        memory[name] = {"param_buffer_bytes": param_bytes(model), "cache_bytes": cache.memory_bytes()}
        memory[name]["exact_bytes"] = memory[name]["param_buffer_bytes"] + memory[name]["cache_bytes"]
        del cache
    if not args.no_peak_memory:
        print(f"rgpt memory: peak of a decode ({args.mem_prompt_len}-token prompt + {args.new_tokens} new), "
              "one subprocess per model ..." if device.type == "cpu" else "rgpt memory: CUDA peak ...", flush=True)
        for name, (which, options) in mem_entries.items():
            arch, kwargs = specs[which]
            spec = {"arch": arch, "kwargs": kwargs, "options": options, "prompt_len": args.mem_prompt_len,
                    "new_tokens": args.new_tokens, "seed": args.seed, "threads": args.threads}
            memory[name]["peak"] = measure_peak_memory(spec, device)
    results["memory"] = {"context": mem_context, **memory}
    ref = memory["dense"]
    peak_col = "peak RSS over base (MiB)" if device.type == "cpu" else "CUDA peak over base (MiB)"
    rows = [("Model", "params + buffers (MiB)", f"KV cache, {mem_context} tok (MiB)", "exact total (MiB)",
             "exact over dense", peak_col, "peak over dense", "Paper (memory)")]
    for name, m in memory.items():
        label = dense_label if name == "dense" else f"{rgpt_label}, cache `{name.split()[1]}`"
        peak = m.get("peak", {}).get("peak_over_base")
        ref_peak = ref.get("peak", {}).get("peak_over_base")
        rows.append((label, f"{m['param_buffer_bytes'] / MiB:.2f}", f"{m['cache_bytes'] / MiB:.2f}",
                     f"{m['exact_bytes'] / MiB:.2f}", change(m["exact_bytes"] / ref["exact_bytes"]),
                     "—" if peak is None else f"{peak / MiB:.1f}",
                     "—" if peak is None or not ref_peak else change(peak / ref_peak),
                     PAPER_RGPT["memory"] if name == "rgpt full" else "—"))
    how = ("exact = parameter + buffer bytes + `cache.memory_bytes()`; peak = peak RSS (VmHWM) of a subprocess "
           "that builds the model and decodes, over its RSS just before building" if device.type == "cpu" else
           "exact = parameter + buffer bytes + `cache.memory_bytes()`; peak = torch.cuda.max_memory_allocated")
    tables.append(f"### rgpt vs isoFLOPs dense `gpt`: memory of a batch-1 decode ({how})\n\n" + render_table(rows))

    # KV cache per mode at a given context
    C = args.cache_context
    kv: dict[str, Any] = {}
    dense_cache = dense.new_cache(1, C)
    kv["dense"] = {"slots": dense_cache.k.shape[0], "bytes": dense_cache.memory_bytes()}
    del dense_cache
    for mode in CACHE_MODES:
        cache = rgpt.new_cache(1, C, cache_mode=mode)
        kv[f"rgpt {mode}"] = {"slots": cache.k.shape[0], "bytes": cache.memory_bytes()}
        del cache
    results["kv_cache"] = {"context": C, "batch_size": 1, **kv}
    rows = [("Cache", "attention slots", "bytes", "MiB", "over dense", "over rgpt `full`")]
    for name, k in kv.items():
        label = f"{dense_label}" if name == "dense" else f"{rgpt_label}, mode `{name.split()[1]}`"
        rows.append((label, k["slots"], f"{k['bytes']:,}", f"{k['bytes'] / MiB:.2f}",
                     change(k["bytes"] / kv["dense"]["bytes"]),
                     "—" if name == "dense" else change(k["bytes"] / kv["rgpt full"]["bytes"])))
    tables.append(f"### rgpt: KV-cache memory per mode, batch 1, context {C} (`cache.memory_bytes()`, fp32)\n\n"
                  + render_table(rows))
    return results, tables


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Defaults: " + ", ".join(f"{k}={v}" for k, v in DEFAULTS.items())
                                + ".\n--quick: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
                                + " (explicit flags win).")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of fbt,lrt,rgpt")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (see below)")
    p.add_argument("--dims", help="fbt/lrt decode shapes: 256 (4 layers, 4 heads) and/or 1024 (4 layers, 8 heads)")
    p.add_argument("--prompt-len", type=int, help="decode prompt length")
    p.add_argument("--new-tokens", type=int, help="new tokens per decode measurement (>= 2)")
    p.add_argument("--repeats", type=int, help="timed decode calls per measurement (median)")
    p.add_argument("--warmup", type=int, help="untimed decode calls per measurement first")
    p.add_argument("--train-seq-len", type=int, help="training sequence length T")
    p.add_argument("--train-batch", type=int, help="training batch size")
    p.add_argument("--train-warmup", type=int, help="untimed training steps per variant first")
    p.add_argument("--train-steps", type=int, help="timed training steps per variant (median)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="grad-norm clip in the step, as the trainer")
    p.add_argument("--rgpt-dense-layers", type=int, help="depth of the dense gpt that rgpt matches in FLOPs")
    p.add_argument("--rgpt-steps", type=int, help="rgpt's trained recurrence R")
    p.add_argument("--rgpt-dim", type=int, help="n_embd of the rgpt comparison")
    p.add_argument("--rgpt-heads", type=int, help="n_head of the rgpt comparison")
    p.add_argument("--mem-prompt-len", type=int, help="prompt length of the peak-memory decode")
    p.add_argument("--cache-context", type=int, help="context of the KV-cache-per-mode table")
    p.add_argument("--no-peak-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--compile", action="store_true",
                   help="also time rgpt/dense decode with torch.compile'd blocks (meant for GPU; slow on CPU)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]; all figures are fp32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    p.add_argument("--_rss-child", dest="rss_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick and name in QUICK else value)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not args.sections or any(s not in SECTIONS for s in args.sections):
        p.error(f"--sections must be a comma-separated subset of {','.join(SECTIONS)}")
    try:
        args.dims = [int(d) for d in str(args.dims).split(",") if d.strip()]
    except ValueError:
        p.error("--dims must be comma-separated integers")
    if not args.dims or any(d not in DECODE_SHAPES for d in args.dims):
        p.error(f"--dims must be a comma-separated subset of {','.join(map(str, DECODE_SHAPES))}")
    for name in ("prompt_len", "repeats", "train_seq_len", "train_batch", "train_steps", "rgpt_dense_layers",
                 "rgpt_steps", "rgpt_dim", "rgpt_heads", "mem_prompt_len", "cache_context"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (latency is measured between the first and last token)")
    if args.warmup < 0 or args.train_warmup < 0:
        p.error("--warmup and --train-warmup must be >= 0")
    if args.rgpt_dim % args.rgpt_heads:
        p.error("--rgpt-dim must be divisible by --rgpt-heads")
    return args


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    env = environment()
    announce_environment(env)
    print(f"device {device}; sections {', '.join(args.sections)}{'; --quick' if args.quick else ''}", flush=True)
    results: dict[str, Any] = {"env": env, "device": str(device),
                               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                        if k != "rss_child"}}
    tables: list[str] = []
    benches = {"fbt": bench_fbt, "lrt": bench_lrt, "rgpt": bench_rgpt}
    for section in args.sections:
        start, meter = time.perf_counter(), ContentionMeter().start()
        section_results, section_tables = benches[section](args, device)
        others = meter.stop()
        section_results["wall_s"] = time.perf_counter() - start
        section_results["others_cpu_share"] = others
        results[section] = section_results
        share = "?" if others is None else f"{others:.0%}"
        tables += section_tables
        tables.append(f"_{section}: {section_results['wall_s']:.0f} s; other processes used {share} of the CPUs "
                      "meanwhile._")
    return results, tables


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rss_child is not None:  # internal: one peak-memory measurement in a fresh process
        print(json.dumps(rss_child(json.loads(args.rss_child))))
        return 0
    start = time.perf_counter()
    meter = ContentionMeter().start()
    results, tables = run(args)
    results["wall_s"] = time.perf_counter() - start
    results["env"]["others_cpu_share_during_run"] = others = meter.stop()
    results["env"]["load_avg_1min_at_end"] = load_average()
    print()
    print("\n\n".join(tables))
    print()
    print(f"total {results['wall_s']:.0f} s; other processes used {'?' if others is None else f'{others:.0%}'} "
          "of the CPUs during the run")
    write_results(results, others, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
