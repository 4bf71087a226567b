"""`plan`: size a training run before starting it (latentloop.plan): the model from the registry
(an arch with a preset or a parameter count), its training FLOPs for a token budget, its memory per
device and its wall-clock on the chosen GPUs."""

from __future__ import annotations

import argparse
import re

from ..errors import LatentloopError
from .parser import print_json

# Token counts as people write them: 300M, 2.5B, 1e9, 10_000_000.
SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
# The devices and strategies `latentloop.plan` knows (its ACCELERATORS and STRATEGIES; tests/test_plan.py
# checks they agree): named here so that the parser imports no torch.
GPUS = ("h200", "h100", "a100", "cpu")
PLANNED_STRATEGIES = ("ddp", "fsdp2")
# --tokens is rounded up to whole steps; past this share over it (a step larger than the budget) it is said
OVERSHOOT_SAID = 0.1
COUNT = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


def count(text: str) -> int:
    """A positive count: digits, an exponent or a suffix (k, M, B/G, T)."""
    match = COUNT.match(text)
    value = float(match.group(1).replace("_", "")) * SUFFIXES[match.group(2).lower()] if match else 0
    if not match or value < 1 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive count such as 300M, 2.5B or 1e9, got {text!r}")
    return int(round(value))


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from .parser import _positive_int

    p.add_argument("--arch", required=True, help="architecture (one registered in latentloop.archs)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--preset", help="model size preset: test, tiny, small, gpt2, 1b")
    size.add_argument("--params", type=count, metavar="N",
                      help="a model of about N parameters (64 channels per layer, heads of 64, the gpt2 preset's "
                           "vocabulary and context), e.g. 350M")
    p.add_argument("--tokens", type=count, required=True, metavar="T", help="training tokens, e.g. 10B")
    p.add_argument("--gpus", type=_positive_int, default=1, metavar="G", help="devices (processes) (default 1)")
    p.add_argument("--gpu", choices=GPUS, default="h100",
                   help="the device: its bf16 peak and memory (cpu: this machine's, measured) (default h100)")
    p.add_argument("--strategy", choices=PLANNED_STRATEGIES, default=None,
                   help="how the devices share the model (default: ddp with more than one, else one process)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute the blocks' activations in the backward (train.activation_checkpointing)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="sequences per micro-batch per device")
    p.add_argument("--mfu", type=float, default=None,
                   help="model FLOPs utilisation to assume (default: gpu_bench's measurement where it measured "
                        "this arch on this GPU, else an assumed one; the output says which)")
    p.add_argument("--config", help="a training config (YAML, sections model/train/data) to plan for")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, as train does (e.g. --set sequence_len=4096, "
                        "--set train.grad_accum=4)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _config(args):
    from ..config import RunConfig, apply_overrides, config_sections, load_yaml

    raw = config_sections(load_yaml(args.config) if args.config else {})
    raw["model"]["arch"] = args.arch
    if args.preset:
        raw["model"]["preset"] = args.preset
    if args.batch_size:
        raw["train"]["batch_size"] = args.batch_size
    if args.activation_checkpointing:
        raw["train"]["activation_checkpointing"] = True
    if args.strategy:
        raw["train"]["strategy"] = args.strategy
    given = apply_overrides(raw, args.overrides)
    if given["train"].get("steps") is not None:  # --tokens sets the length: a steps given was replaced without a word
        from ..util import warn_once

        warn_once(f"train.steps {given['train']['steps']} (from --config or --set) is not planned: --tokens sets the "
                  f"run's length")
    config = RunConfig.from_dict(given)
    if args.params:
        from ..plan import config_for_params

        # the shape from --params; every other model field from the config and --set (n_layer, n_embd and
        # n_head are what --params chooses)
        raw_model = given["model"]  # from_dict copied the sections: this one is still as given
        # a preset names a shape too (and its vocabulary and context, dropped here without a word)
        shape = sorted(k for k in ("n_layer", "n_embd", "n_head", "preset") if raw_model.get(k) is not None)
        if shape:
            raise LatentloopError(f"--params chooses the shape; it cannot also take {', '.join(shape)} (from "
                                  f"--set or --config): give one or the other")
        config.model = config_for_params(args.arch, args.params, **{
            k: v for k, v in raw_model.items() if k not in ("arch", "preset", "n_layer", "n_embd", "n_head")})
    return config


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _duration(seconds: float) -> str:
    for unit, scale in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s"


def render(plan) -> str:
    """The plan as a person reads it."""
    m = plan.memory
    shape = ", ".join(f"{k} {v}" for k, v in plan.shape.items())
    lines = [f"{plan.arch}: {plan.params:,} parameters ({shape})",
             f"training: {plan.tokens:,} tokens = {plan.steps:,} steps x {plan.tokens_per_step:,} tokens on "
             f"{plan.devices} x {plan.gpu} ({plan.strategy}, {plan.precision} products)",
             f"FLOPs: {plan.flops:.4g} ({plan.flops_per_token:,.0f} per token on average; {plan.flops_method})",
             f"memory per device ({'activation checkpointing' if plan.activation_checkpointing else 'no checkpointing'}"
             f"; probed on {plan.probe}):",
             f"  weights (fp32)            {_size(m['weights'])}",
             f"  gradients (fp32)          {_size(m['gradients'])}",
             f"  optimizer states          {_size(m['optimizer_states'])}",
             f"  activations               {_size(m['activations'])} (with checkpointing: "
             f"{_size(m['activations_checkpointed'])})"]
    if m["fsdp2_gathered_blocks"]:
        lines.append(f"  fsdp2's gathered blocks   {_size(m['fsdp2_gathered_blocks'])}")
    capacity = "" if plan.capacity_bytes is None else (
        f" of {_size(plan.capacity_bytes)}: " + ("fits" if plan.fits else "DOES NOT FIT"))
    lines += [f"  peak                      {_size(m['peak'])}{capacity}",
              f"decode: KV cache {_size(m['kv_cache_per_sequence'])} per sequence at the full context "
              f"({plan.shape['sequence_len']} tokens)",
              f"wall-clock: {_duration(plan.seconds)} at MFU {plan.mfu:.3f} ({plan.mfu_source}) of "
              f"{plan.peak_flops / 1e12:.4g} TFLOP/s per device"]
    return "\n".join(lines)


def cmd_plan(args) -> int:
    from ..archs import ARCHS
    from ..plan import plan_run

    if args.arch not in ARCHS:
        raise LatentloopError(f"unknown --arch {args.arch!r}: choose from {', '.join(ARCHS)}")
    config = _config(args)
    from ..plan import STRATEGIES

    strategy = args.strategy or (config.train.strategy if config.train.strategy in STRATEGIES else None)
    plan = plan_run(config, args.tokens, devices=args.gpus, gpu=args.gpu, strategy=strategy, mfu=args.mfu)
    if plan.tokens > args.tokens * (1 + OVERSHOOT_SAID):  # a step larger than the budget: planned, but said
        from ..util import warn_once

        warn_once(f"one step takes {plan.tokens_per_step:,} tokens (batch, accumulation, devices and sequence "
                  f"length), so --tokens {args.tokens:,} is planned as {plan.steps:,} step(s) = {plan.tokens:,} "
                  f"tokens; lower the batch or give more tokens")
    if args.json:
        print_json(plan.to_dict())
    else:
        print(render(plan))
    return 0
