"""fbt over the gpt backbone: decode latency per token at batch 1, regime `soft` over `standard`
with the same weights, at d=256 and d=1024 (target <= 1.03x); training step time with K=2 and K=3
passes over K=1 at the tiny preset (targets <= 2.05x and <= 3.1x).

    python -m benchmarks.fbt [--quick] [--json out.json]    (the options of benchmarks.variants)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

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

DECODE_SHAPES = {256: dict(n_layer=4, n_embd=256, n_head=4), 1024: dict(n_layer=4, n_embd=1024, n_head=8)}
TARGET_FBT_DECODE = 1.03  # soft / standard
TARGET_FBT_TRAIN = {2: 2.05, 3: 3.1}  # K passes / K=1


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
          f"at least {args.train_warmup} warmup + {args.train_steps} timed steps each ...", flush=True)
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


def main(argv: list[str] | None = None) -> int:
    from benchmarks.variants import main as run_sections

    return run_sections(["--sections", "fbt", *(argv or [])])


if __name__ == "__main__":
    raise SystemExit(main())
