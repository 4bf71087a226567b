"""Self-speculative decoding (issue 54) on trained runs: per run, draft depth and draft length, greedy
decoding at the test-time depth with drafts against plain full-depth decoding of the same prompts
(windows of the run's validation text): whether the tokens are equal (they must be), the acceptance
rate (each prompt's accepted / drafted, averaged over the prompts), tokens per full-depth pass, and the
speedup: the whole workload's (its total time over the path's), then the rounds' paired ratios as their
geometric mean with its interval, a same-run ratio (every path of a round on the same prompt, in
random order; per-token decode time, the prefill excluded) against the eager full-depth decode and
against the compiled one (`compile=True`, where the arch's step compiles: what `compile="auto"`, the
default, runs once compiling pays).
Speculative decoding runs compiled (`inference.speculative.CompiledDrafting`: the draft's compiled step,
the compiled verification; one row) where the arch's step compiles, eagerly elsewhere (the table
says which, and why).

The runs: a few hundred steps on `stdlib` at R = 8 (the test-time depth), one per arch whose spec
declares a draft, and rgpt at d 512, whose blocks' weights no longer fit a core's L2 cache: there a
verification of k + 1 tokens reads each weight once, as one step does, where `tiny`'s (weights in
L2, a step bound by latency and compute) costs about 3 steps (experiments/logs/2026-12-05-issue54-
fourth.md). A run may carry decoding options for every path (`RUN:name=value,...`, e.g. rfbt's
`regime=standard`, whose verification is one pass; its default soft regime verifies token by token):

    latentloop train --arch rgpt --preset tiny --data stdlib --steps 300 --set recurrence_steps=8 --out runs/spec-rgpt
    latentloop train --arch rgpt --preset tiny --data stdlib --steps 300 --batch-size 8 --set n_embd=512 \\
        --set n_head=8 --set recurrence_steps=8 --out runs/spec-rgpt-512
    latentloop train --arch rfbt --preset tiny --data stdlib --steps 300 --set recurrence_steps=8 --out runs/spec-rfbt
    latentloop train --arch mor --preset tiny --data stdlib --steps 300 --set recursions=8 --out runs/spec-mor
    python -m benchmarks.speculative runs/spec-rgpt runs/spec-rgpt-512 runs/spec-rfbt runs/spec-rfbt:regime=standard \\
        runs/spec-mor --depth 8 --threads 1 --json speculative.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    benchmark_main,
    decode_generate,
    describe_ratios,
    make_sync,
    render_table,
    require_threads,
    start_run,
)
from latentloop.archs import get_arch
from latentloop.engine import generate, model_options, stream
from latentloop.errors import ConfigError, LatentloopError
from latentloop.inference.fast import fallback_reason
from latentloop.inference.speculative import compiled_drafting_reason
from latentloop.runs import load_run
from latentloop.runtime import eval_data
from latentloop.util import first_line

SPEEDUP_TARGET = 1.3  # issue 54: a trained rgpt at depth 8, greedy, over full depth (same run)


def parse_run(text: str) -> tuple[Path, dict[str, str]]:
    """`RUN` or `RUN:name=value,...` -> (folder, options as text)."""
    folder, _, rest = text.partition(":")
    options = {}
    for part in filter(None, rest.split(",")):
        name, equals, value = part.partition("=")
        if not equals or not name:
            raise argparse.ArgumentTypeError(f"{text!r}: options are name=value, comma-separated")
        options[name] = value
    return Path(folder), options


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def validation_prompts(config, tokenizer, data: str | None, count: int, length: int) -> list[list[int]]:
    """`count` windows of the validation text, spread over it, each BOS + `length - 1` tokens."""
    tokens = eval_data(config, tokenizer, data).val
    span = len(tokens) - length
    if span <= count:
        raise ConfigError(f"the validation text holds {len(tokens)} tokens: too few for {count} prompts of {length}")
    starts = [i * span // count for i in range(count)]
    return [[tokenizer.bos_id] + [int(t) for t in tokens[start:start + length - 1]] for start in starts]


def label_of(folder: Path, given: dict) -> str:
    return folder.name + "".join(f" {name}={value}" for name, value in given.items())


def measure_run(folder: Path, given_text: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer, config, _ = load_run(folder)
    model.eval()
    arch = config.model.arch
    if get_arch(arch).draft is None:
        raise ConfigError(f"{folder}: arch {arch!r} declares no draft of itself")
    declared = {option.name: option for option in model.OPTIONS}
    unknown = sorted(set(given_text) - set(declared))
    if unknown:
        raise ConfigError(f"{folder}: arch {arch!r} declares no option(s) {', '.join(unknown)}")
    base = {name: declared[name].parse(value) for name, value in given_text.items()}
    if args.depth is not None:
        base["steps"] = args.depth
    model_options(model, base)  # a bad depth or option: one line, before any timing
    prompts = validation_prompts(config, tokenizer, args.data, args.prompts, args.prompt_len)
    sync = make_sync(torch.device("cpu"))
    reference = [generate(model, prompt, args.new_tokens, temperature=0.0, compile=False, **base) for prompt in prompts]

    drafts: dict[str, dict[str, Any]] = {}
    skipped = []
    for steps in args.draft_steps:
        for tokens in args.draft_tokens:
            options = {**base, "draft_steps": steps, "draft_tokens": tokens}
            try:
                checked = model_options(model, options)
            except ConfigError as error:  # a draft as deep as the full depth, say
                skipped.append(f"draft_steps={steps}, draft_tokens={tokens}: {error}")
                continue
            # the compiled rounds where the arch's step compiles (one row), else the eager ones
            eager_reason = ("--no-compiled" if args.no_compiled else
                            compiled_drafting_reason(model, checked, model.draft_options(checked), 1))
            options["compile"] = eager_reason is None
            equal, acceptance, passes = True, [], 0
            for prompt, expected in zip(prompts, reference):
                steps_out = list(stream(model, prompt, args.new_tokens, temperature=0.0, **options))
                equal = equal and [step.tokens[0] for step in steps_out] == expected
                acceptance.append(steps_out[-1].info.get("draft_acceptance"))
                passes += steps_out[-1].info.get("full_passes", 0)
            drafts[f"r={steps} k={tokens}"] = {"draft_steps": steps, "draft_tokens": tokens, "options": options,
                                               "compiled": eager_reason is None, "eager_reason": eager_reason,
                                               "greedy_equal": equal,
                                               "acceptance": statistics.mean(a for a in acceptance if a is not None),
                                               "tokens_per_full_pass": len(prompts) * (args.new_tokens - 1) / passes}
    paths: dict[str, dict[str, Any]] = {"eager": {**base, "compile": False}}
    compiled_reason = fallback_reason(model, model_options(model, base))
    if not args.no_compiled and compiled_reason is None:
        paths["compiled"] = {**base, "compile": True}
    paths |= {name: entry["options"] for name, entry in drafts.items()}

    print(f"{label_of(folder, given_text)}: {len(paths)} paths x {args.rounds} rounds ...", flush=True)
    for options in paths.values():  # the compiled step compiles here
        for _ in range(args.warmup):
            decode_generate(model, prompts[0], args.new_tokens, options, sync)
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    rng = random.Random(args.seed)
    for r in range(args.rounds):
        prompt = prompts[r % len(prompts)]
        order = list(paths)
        rng.shuffle(order)
        for name in order:
            seconds[name].append(decode_generate(model, prompt, args.new_tokens, paths[name], sync)["token_s"])
    for name, entry in drafts.items():
        entry.pop("options")
        entry["token_s_all"] = seconds[name]
        for baseline in ("eager", "compiled"):
            if baseline in seconds:
                entry[f"speedup_vs_{baseline}_all"] = [b / s for b, s in zip(seconds[baseline], seconds[name])]
                # every round's prompt weighed by its time: the speedup of the whole workload
                entry[f"speedup_vs_{baseline}"] = sum(seconds[baseline]) / sum(seconds[name])
    return {"arch": arch, "options": base, "depth": model_options(model, base).get("steps"),
            "eager_token_s_all": seconds["eager"], "compiled_token_s_all": seconds.get("compiled"),
            "compiled_not_run": None if "compiled" in paths else (compiled_reason or "--no-compiled"),
            "drafts": drafts, "skipped": skipped}


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(args)
    start = time.perf_counter()
    results: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items() if k != "runs"},
                               "runs": {}}
    for folder, given in args.runs:
        results["runs"][label_of(folder, given)] = measure_run(folder, given, args)
    print(f"measured in {time.perf_counter() - start:.0f} s", flush=True)
    return results


def _speedup(draft: dict[str, Any], baseline: str) -> str:
    """The whole workload's speedup, then the rounds' paired ratios (prompts differ in how much of
    the draft the full depth accepts, so the rounds spread)."""
    ratios = draft.get(f"speedup_vs_{baseline}_all")
    if not ratios:
        return "—"
    if not draft["greedy_equal"]:  # a faster path to other output is no speedup of this decode
        return "— (greedy output differs: no speedup claimed)"
    overall = f"{draft[f'speedup_vs_{baseline}']:.2f}x"
    return overall if len(ratios) < 2 else f"{overall}; rounds: {describe_ratios(ratios)}"


def markdown_table(results: dict[str, Any]) -> str:
    rows = [("run", "arch", "depth", "draft (r, k)", "path", "greedy equal", "acceptance", "tokens / full pass",
             "ms/token", "speedup over eager full depth", "speedup over compiled full depth")]
    for label, entry in results["runs"].items():
        eager = statistics.median(entry["eager_token_s_all"])
        compiled = entry["compiled_token_s_all"]
        rows.append((label, entry["arch"], entry["depth"] or "trained", "— (full depth)", "eager", "—", "—", "1",
                     f"{eager * 1e3:.2f}", "1", "—" if compiled is None else
                     f"compiled: {eager / statistics.median(compiled):.2f}x eager"))
        for name, draft in entry["drafts"].items():
            rows.append((label, entry["arch"], entry["depth"] or "trained", name,
                         "compiled" if draft.get("compiled") else "eager",
                         "yes" if draft["greedy_equal"] else "NO", f"{draft['acceptance']:.2f}",
                         f"{draft['tokens_per_full_pass']:.2f}", f"{statistics.median(draft['token_s_all']) * 1e3:.2f}",
                         _speedup(draft, "eager"), _speedup(draft, "compiled")))
    notes = [f"{label}: compiled full depth not run ({entry['compiled_not_run']})"
             for label, entry in results["runs"].items() if entry["compiled_not_run"]]
    notes += sorted({f"{label}: drafting eagerly ({draft['eager_reason']})" for label, entry in results["runs"].items()
                     for draft in entry["drafts"].values() if draft.get("eager_reason")})
    notes += [f"{label}: skipped {skip}" for label, entry in results["runs"].items() for skip in entry["skipped"]]
    notes.append(f"speedup: full-depth decode time over speculative, summed over the rounds, then per round "
                 f"(paired, the same prompt); target for a trained rgpt at depth 8: >= {SPEEDUP_TARGET}x")
    return render_table(rows) + "\n\n" + "\n".join(notes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("runs", nargs="+", type=parse_run, metavar="RUN[:name=value,...]",
                   help="trained run folders (of archs with a draft), with decoding options for every path")
    p.add_argument("--depth", type=int, default=None, help="test-time depth (the `steps` option; default: trained)")
    p.add_argument("--draft-steps", type=int_list, default=[1, 2, 4], help="draft depths (those not below the "
                   "full depth are skipped)")
    p.add_argument("--draft-tokens", type=int_list, default=[2, 4, 6], help="tokens drafted per full pass")
    p.add_argument("--data", default=None, help="where the prompts come from (default: the run's own data)")
    p.add_argument("--prompts", type=int, default=8, help="windows of the validation text")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (each on the next prompt)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls of each path first (compiles)")
    p.add_argument("--no-compiled", action="store_true", help="skip the compiled full-depth baseline")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="the order of the paths in each round")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    for name in ("prompts", "prompt_len", "rounds", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (per-token time is measured between tokens)")
    if args.depth is not None and args.depth < 1:
        p.error("--depth must be >= 1")
    require_threads(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return benchmark_main(args, run, markdown_table)
    except LatentloopError as error:  # a run, option or data source that does not fit: one line
        print(f"benchmarks.speculative: error: {first_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
