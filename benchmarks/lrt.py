"""lrt over the gpt backbone: decode latency per token at batch 1 (target <= 1.05x); training step
time of `interleaved` S=2 over gpt at the tiny preset (target <= 2.1x); parameter overhead of
`shared` and `layerwise` at the tiny preset and at the nanochat d20 shape (built on the meta device).

    python -m benchmarks.lrt [--quick] [--json out.json]    (the options of benchmarks.variants)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import latentloop
from benchmarks.common import (
    BYTE_VOCAB,
    build,
    decode_comparison,
    ms,
    ratio_vs,
    render_table,
    shape_label,
    tiny_shape,
    training_comparison,
    weight_macs_per_token,
)
from benchmarks.fbt import DECODE_SHAPES

NANOCHAT_D20 = dict(n_layer=20, n_embd=1280, n_head=10, vocab_size=65536, sequence_len=2048)
TARGET_LRT_DECODE = 1.05  # lrt / gpt (paper: 1.09)
TARGET_LRT_TRAIN = 2.1  # interleaved S=2 / gpt


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
          f"at least {args.train_warmup} warmup + {args.train_steps} timed steps each ...", flush=True)
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


def main(argv: list[str] | None = None) -> int:
    from benchmarks.variants import main as run_sections

    return run_sections(["--sections", "lrt", *(argv or [])])


if __name__ == "__main__":
    raise SystemExit(main())
