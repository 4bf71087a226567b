"""The prepared GPU benchmark (`benchmarks/gpu.sh` runs it on one H200): training tokens/s and MFU,
decode tokens/s, peak memory, and a numerical check of flex_attention; one JSON object on stdout.

    python -m benchmarks.gpu_bench                      # the full run, CUDA (about 7 minutes on an H200)
    python -m benchmarks.gpu_bench --cpu --tiny         # the same code paths at a tiny shape, in seconds

What it measures:
- Training (bf16 autocast, `train.compile` as the trainer applies it: gpt's whole forward, the other
  archs block by block; plus gpt with its cross-entropy compiled into the same graph, the headroom
  the trainer's model-only compile leaves): tokens/s of full optimizer steps (the arch's objective, backward, clip,
  AdamW) on fixed random batches at the `gpt2` preset shape (124M, T=1024), for gpt, fbt with
  K = 1 / 2 / 3 passes forced, lrt interleaved S = 2 and rgpt (random depth r ~ U{1..R}); MFU =
  structural FLOPs per token (`objective.flops_per_token(model, step)`, the same count the trainer
  logs) x tokens/s / the GPU's dense bf16 peak; peak memory (`torch.cuda.max_memory_allocated`).
  Timed after warmup steps (compilation happens there), synchronised at both ends.
- Decode: cached greedy `latentloop.stream` at batch 1 and 64, every regime / mode (fbt standard,
  soft, fused; lrt sequential and interleaved prefill; rgpt full / mean / last cache), bf16 weights;
  decode tokens/s from the first to the last new token (the prefill timed apart). Eager: a compiled or
  CUDA-graph decode step is not part of this issue.
- flex_attention: lrt's strided subset passes through flex_attention block masks vs SDPA's dense
  mask, forward and backward (the backward on CUDA only: torch 2.13 has no CPU flex backward), max
  differences and the time of each.

Every case is measured on its own and recorded even when it fails (`"error"`), so one broken case
never loses the others; `--budget-s` skips what would run past the time allowed.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

import latentloop as ll
from latentloop.archs import build_objective
from latentloop.config import TrainConfig
from latentloop.objectives import token_cross_entropy
from latentloop.optim import build_optimizers
from latentloop.parallel import grad_norm, wrap_model
from latentloop.runtime import autocast_for
from latentloop.train import FlopsMemo

# Dense bf16 tensor-core peak of an H200 (the same as an H100 SXM), no sparsity, FLOP/s.
H200_BF16_PEAK = 989e12
MFU_TARGET = 0.45  # issue 13's goal for gpt at the gpt2 shape


@dataclass(frozen=True)
class Shape:
    preset: str
    batch: int  # training sequences per step
    steps: int  # timed training steps per case
    warmup: int  # untimed steps first (compilation)
    prompt: int  # decode prompt tokens
    new_tokens: int  # decoded tokens per row
    decode_batches: tuple[int, ...]
    extra: dict  # model config overrides


# The full shape: 16 x 1024 tokens per step fills an H200 at 124M parameters without accumulation.
FULL = Shape("gpt2", batch=16, steps=15, warmup=3, prompt=128, new_tokens=128, decode_batches=(1, 64), extra={})
TINY = Shape("test", batch=4, steps=3, warmup=1, prompt=8, new_tokens=8, decode_batches=(1, 4),
             extra={"sequence_len": 64})

WHOLE_STEP = "gpt, loss compiled too"  # the headroom case: model and cross-entropy in one graph


def _cases(field: str) -> list[tuple[str, str, dict]]:
    """(label, arch, overrides) of every registered architecture's benchmark cases (its spec's
    `train_cases` or `decode_cases`: config overrides, or decoding options)."""
    from latentloop.archs import ARCHS

    return [(f"{name} {label}".strip(), name, dict(given)) for name, spec in ARCHS.items()
            for label, given in getattr(spec, field).items()]


TRAIN_CASES: list[tuple[str, str, dict]] = _cases("train_cases")
TRAIN_CASES.insert(1, (WHOLE_STEP, "gpt", {}))
DECODE_CASES: list[tuple[str, str, dict]] = _cases("decode_cases")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _build(arch: str, shape: Shape, overrides: dict, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return ll.build(arch, shape.preset, **{**shape.extra, **overrides}).to(device)


def bench_training(name: str, arch: str, overrides: dict, shape: Shape, device: torch.device, compile_: bool,
                   peak_flops: float | None) -> dict[str, Any]:
    """Tokens/s, MFU and peak memory of the trainer's optimizer step for one case."""
    _reset_memory(device)
    model = _build(arch, shape, overrides, device)
    train = TrainConfig(steps=1000, batch_size=shape.batch, warmup_steps=0, compile=compile_, device=device.type)
    objective = build_objective(model.config, train)
    flops = FlopsMemo(model)
    objective.flops_per_token(flops)  # counted on the plain model, before compilation
    whole_step = name == WHOLE_STEP
    forward_model = wrap_model(model, replace(train, compile=compile_ and not whole_step), device)
    optimizers = build_optimizers(model, train)
    T = model.config.sequence_len
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (shape.batch, T), generator=generator).to(device)
    y = torch.randint(0, model.config.vocab_size, (shape.batch, T), generator=generator).to(device)

    def loss_of(i: int) -> torch.Tensor:
        return objective(forward_model, x, y, i).loss

    if whole_step:  # next-token loss only (gpt): logits never leave the graph in fp32
        loss_of = torch.compile(lambda i: token_cross_entropy(forward_model(x).logits, y)) if compile_ else loss_of

    def step(i: int) -> float:
        with autocast_for(device, "auto"):
            loss = loss_of(i)
        loss.backward()
        grad_norm(model, train.grad_clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # a host float: one sync per step, as in the trainer

    started = time.perf_counter()
    for i in range(shape.warmup):
        step(i)
    _sync(device)
    warmup_s = time.perf_counter() - started
    start = time.perf_counter()
    losses = [step(shape.warmup + i) for i in range(shape.steps)]
    _sync(device)
    seconds = time.perf_counter() - start
    tokens = shape.steps * shape.batch * T
    step_flops = sum(objective.flops_per_token(flops, shape.warmup + i) for i in range(shape.steps)) * shape.batch * T
    result = {"case": name, "arch": arch, "params": model.num_params(), "tokens_per_step": shape.batch * T,
              "tokens_per_s": tokens / seconds, "step_ms": 1000 * seconds / shape.steps,
              "flops_per_token": step_flops / tokens, "achieved_tflops": step_flops / seconds / 1e12,
              "mfu": step_flops / seconds / peak_flops if peak_flops else None, "peak_memory_gib": _peak_gib(device),
              "warmup_s": warmup_s, "final_loss": losses[-1], "compiled": compile_}
    return result  # the model and optimizer go with this frame; the next case collects them first


def bench_decode(name: str, arch: str, options: dict, shape: Shape, device: torch.device) -> list[dict[str, Any]]:
    """Cached greedy decode tokens/s at every batch size of the shape (bf16 weights on CUDA)."""
    _reset_memory(device)
    model = _build(arch, shape, {}, device).eval()
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    rows = []
    generator = torch.Generator().manual_seed(2)
    for batch in shape.decode_batches:
        prompts = torch.randint(0, min(model.config.vocab_size, 256), (batch, shape.prompt), generator=generator)
        prompts = prompts.tolist()
        # compile=False: the eager decode, as the docstring says. The default ("auto") compiled gpt's step
        # in the middle of the timed stream on an H200 (2026-12-04: 15 tokens/s at batch 1, fbt's 141)
        ll.generate(model, prompts, 2, temperature=0.0, compile=False, **options)  # warm up this batch size's kernels
        _sync(device)
        stamps = []
        start = time.perf_counter()
        for _ in ll.stream(model, prompts, shape.new_tokens, temperature=0.0, compile=False, **options):
            stamps.append(time.perf_counter())  # the engine has read the token back: the step is done
        decode_s = stamps[-1] - stamps[0]
        rows.append({"case": name, "arch": arch, "options": options, "batch": batch, "prompt": shape.prompt,
                     "new_tokens": len(stamps), "prefill_s": stamps[0] - start,
                     "decode_tokens_per_s": batch * (len(stamps) - 1) / decode_s if decode_s > 0 else None,
                     "peak_memory_gib": _peak_gib(device)})
    del model
    return rows


def check_flex(shape: Shape, device: torch.device) -> dict[str, Any]:
    """lrt interleaved S=2 through flex_attention block masks vs the dense mask: max differences of
    the subset passes' logits (and of the gradients on CUDA), and the time of each path."""
    from latentloop.models import flex

    model = _build("lrt", shape, {"recurrence": "interleaved", "subsets": 2}, device)
    T = model.config.sequence_len
    x = torch.randint(0, min(model.config.vocab_size, 256), (2, T), generator=torch.Generator().manual_seed(3))
    x = x.to(device)
    backward = device.type == "cuda"  # torch 2.13 has no flex_attention backward on the CPU

    def run() -> tuple[list[torch.Tensor], dict[str, torch.Tensor], float]:
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = model(x)
            if backward:
                torch.stack([lg.float().logsumexp(-1).mean() for lg in out.pass_logits]).sum().backward()
        _sync(device)
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return [lg.detach().float() for lg in out.pass_logits], grads, time.perf_counter() - start

    forced = flex.FORCE
    flex._masks.clear()
    try:
        flex.FORCE = False
        original = flex.available  # dense: the flex path off even on CUDA
        flex.available = lambda device: False
        run()
        dense, dense_grads, dense_s = run()
        flex.available = original
        flex.FORCE = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex on the CPU warns that it is unfused
            run()  # compiles flex_attention on CUDA
            sparse, sparse_grads, sparse_s = run()
    finally:
        flex.FORCE, flex.available = forced, original
    return {"flex_masks_built": len(flex._masks),  # > 0: the subset passes did go through flex_attention
            "subset_logits_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(dense, sparse)),
            "grad_max_abs_diff": max((float((dense_grads[n] - sparse_grads[n]).abs().max()) for n in dense_grads),
                                     default=None),
            "backward_checked": backward, "dense_s": dense_s, "flex_s": sparse_s, "sequence_len": T}


def _guarded(results: list, budget_end: float, what: str, fn, *args) -> None:
    """Run one case, recording its result, its error or that the time budget skipped it."""
    if time.perf_counter() > budget_end:
        results.append({"case": what, "skipped": "time budget"})
        return
    try:
        out = fn(*args)
        results.extend(out if isinstance(out, list) else [out])
    except Exception as exc:  # recorded, so that the other cases still run and print
        results.append({"case": what, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[:1]}",
                        "traceback": traceback.format_exc(limit=4)})
    print(f"gpu_bench: {what} done", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device (use --cpu --tiny for the CPU fallback)")
    shape = TINY if args.tiny else FULL
    compile_ = args.compile if args.compile is not None else device.type == "cuda"  # inductor on a CPU: minutes
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (H200_BF16_PEAK if device.type == "cuda" else None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what little runs in fp32 (optimizer, norms)
    budget_end = time.perf_counter() + args.budget_s
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "shape": asdict(shape), "compiled": compile_,
        "peak_flops": peak, "mfu_target": MFU_TARGET, "training": [], "decode": [], "checks": []}
    for name, arch, overrides in TRAIN_CASES:
        if args.only and arch not in args.only:
            continue
        _guarded(report["training"], budget_end, f"train {name}", bench_training, name, arch, overrides, shape,
                 device, compile_, peak)
    for name, arch, options in DECODE_CASES:
        if args.only and arch not in args.only:
            continue
        _guarded(report["decode"], budget_end, f"decode {name}", bench_decode, name, arch, options, shape, device)
    _guarded(report["checks"], budget_end, "flex_attention vs dense mask (lrt subsets)", check_flex, shape, device)
    gpt = next((r for r in report["training"] if r.get("case") == "gpt" and "mfu" in r), None)
    report["gpt_mfu_meets_target"] = None if gpt is None or gpt["mfu"] is None else gpt["mfu"] >= MFU_TARGET
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (the fallback; no MFU unless --peak-tflops)")
    p.add_argument("--tiny", action="store_true", help="the tiny shape (test preset, T=64): seconds, not minutes")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="torch.compile the training step (default: on CUDA only)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager training steps")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"dense bf16 peak for MFU (default on CUDA: the H200's {H200_BF16_PEAK / 1e12:.0f})")
    p.add_argument("--only", nargs="*", default=None, help="only these archs (gpt fbt lrt rgpt)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="skip cases that would start after this many seconds (default 540: gpu.sh's 10 minutes "
                        "minus the distributed smoke run)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    failed = [r for section in ("training", "decode", "checks") for r in report[section] if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
