"""Post-training at CPU scale (issue 15): pretrain gpt / fbt / rgpt on code + English, SFT each on a
built-in *_steps task in the chat format, and measure accuracy and trace length (tokens before the
final answer) per regime / depth, before and after SFT; then a long-context extension and SFT on
GSM8K train.

    PYTHONPATH=. python experiments/post_training.py --out runs/post --seeds 0 1 2 --gsm8k ../shared/data

Per seed and arch (the `test` preset widened to 4 blocks of 64, T = 64):
1. pretrain `--pretrain-steps` on `--data` (default code + English: `mix:stdlib+text:TinyStories`);
2. SFT `--sft-steps` on `chat:task:addition_steps` (2-digit operands);
3. accuracy and trace length on the task's *training* range (the harder test split is out of reach
   at this scale; say so wherever the numbers are quoted), on held-out problems only: the task
   splits problems by a hash of each, SFT draws none of the held-out ones, and the run stops if an
   evaluation prompt is an SFT prompt (`evaluated_in_sft`); the base zero-shot in the plain task
   format, the SFT model in the chat format; every fbt regime, rgpt at depth 1 / 2 / 4 / 8.
With `--gsm8k DIR` (seed 0 only): each arch's base is extended to T = `--long` with `--stage
extend` (NTK RoPE base scaling, `--extend-steps`; gpt also for `--extend-more` steps), evaluated by
position against the base on the same targets with at most its own 64 tokens of context (does the
longer context help?) and against the base stretched without training, then SFT'd on GSM8K train
at that length and evaluated 0-shot on `--limit` GSM8K test problems.
Resumable: finished runs and evaluations are kept. Writes post_training.json and post_training.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from latentloop.archs import build_model
from latentloop.checkpoint import list_checkpoints
from latentloop.cli import main
from latentloop.data.chat import iter_conversations
from latentloop.data.loader import eval_batches
from latentloop.data.tasks import TASKS_VERSION, parse_task_spec
from latentloop.eval.generation import baseline_markdown, run_generation_tasks
from latentloop.eval.loss import loss_by_position
from latentloop.eval.stats import format_comparison, paired_comparison, t_interval, verdict
from latentloop.objectives.base import token_cross_entropy
from latentloop.runs import load_run
from latentloop.runtime import eval_data

TASK = "addition_steps:digits=2,n=4000"
EVAL_TASK = "addition_steps:digits=2,test=1-2"  # the training range (see the docstring)
DEFAULT_DATA = "mix:stdlib+text:../shared/data/text/tinystories_sample.txt"
SHAPE = ["--preset", "test", "--set", "n_layer=4"]
REGIMES = {"gpt": {"plain": {}},
           "fbt": {"standard": {"regime": "standard"}, "soft": {"regime": "soft"}, "fused": {"regime": "fused"}},
           "rgpt": {f"depth {r}": {"steps": r} for r in (1, 2, 4, 8)}}
MEASURES = ("accuracy", "n", "mean_trace_tokens", "mean_reasoning_tokens", "by_length")
BASELINE = "gpt"  # each regime's accuracy after SFT is paired by seed against this one's
TRACE_PAIRS = [("fbt", "soft", "standard"), ("fbt", "fused", "standard")]  # trace length: a regime minus another
DEPTH_PAIR = ("rgpt", "depth 8", "depth 4")  # test-time depth: twice the trained R minus R
POSITION_BUCKET = 64  # positions per bucket of the by-position loss: the base runs' whole context


def evaluated_in_sft(limit: int) -> tuple[int, int]:
    """(evaluation problems that are also SFT problems, evaluation problems): the first must be 0,
    or accuracy measures recall of the SFT data rather than addition."""
    parsed = parse_task_spec(EVAL_TASK)
    key = parsed.task.problem_key
    sft = {key(messages[0]["content"]) for _, messages in iter_conversations(f"chat:task:{TASK}")}
    evaluated = [key(example.prompt) for example in parsed.task.examples("test", limit, parsed.seed)]
    return sum(problem in sft for problem in evaluated), len(evaluated)


def _train(args: list[str]) -> None:
    code = main(["train", "--no-progress", *args])
    if code != 0:
        raise SystemExit(f"training failed ({code}): latentloop train {' '.join(args)}")


def _trained(run: Path) -> bool:
    return run.is_dir() and bool(list_checkpoints(run))


def _evaluate(run: Path, arch: str, task: str, limit: int, data_dir: str | None = None) -> dict:
    model, tokenizer, _, _ = load_run(run)
    rows = {}
    for label, options in REGIMES[arch].items():
        result = run_generation_tasks(model, tokenizer, [task], data_dir, options, limit=limit, progress=False)[task]
        rows[label] = {k: result[k] for k in MEASURES if k in result}  # by_length: accuracy and baselines per length
    return rows


def _cached(report: dict, key: str, compute):
    if key not in report:
        report[key] = compute()
    return report[key]


def task_arm(out: Path, report: dict, arch: str, seed: int, args) -> None:
    base, sft = out / f"{arch}-base-s{seed}", out / f"{arch}-sft-s{seed}"
    common = ["--seed", str(seed)]
    if not _trained(base):
        _train(["--arch", arch, *SHAPE, "--data", args.data, "--steps", str(args.pretrain_steps), "--batch-size", "16",
                "--out", str(base), "--set", "max_bytes=8000000", "--set", "eval_every=0", *common])
    if not _trained(sft):
        _train(["--stage", "sft", "--init-from", str(base), "--data", f"chat:task:{TASK}", "--steps",
                str(args.sft_steps), "--batch-size", "16", "--out", str(sft), "--set", "eval_every=0", "--lr", "3e-3",
                *common])
    entry = report.setdefault("task", {}).setdefault(f"{arch}/{seed}", {})
    started = time.perf_counter()
    _cached(entry, "before", lambda: _evaluate(base, arch, EVAL_TASK, args.limit))
    _cached(entry, "after", lambda: _evaluate(sft, arch, f"chat:{EVAL_TASK}", args.limit))
    entry.setdefault("eval_seconds", time.perf_counter() - started)


def _by_position(run: Path, data: str, seq_len: int | None = None, batches: int = 4) -> list[dict]:
    """Loss by position on the run's validation text; `seq_len` above the run's own evaluates its
    weights unchanged (same RoPE base) at that length: the no-extension control."""
    model, tokenizer, config, _ = load_run(run)
    if seq_len is not None and seq_len != config.model.sequence_len:
        config.model.sequence_len = seq_len
        stretched = build_model(config.model)
        stretched.load_state_dict(model.state_dict())
        model = stretched.eval()
    length = config.model.sequence_len
    tokens = eval_data(config, tokenizer, data).val
    return loss_by_position(model, tokens, 8, length, max(1, length // POSITION_BUCKET), max_batches=batches)


@torch.no_grad()
def _by_position_in_short_windows(run: Path, data: str, long: int, batches: int = 4) -> list[dict]:
    """The reference for the extended model's buckets: the base run on the same validation text
    and the same targets, each `long` window cut into windows of the base's own length, so every
    target is predicted from at most that much context."""
    model, tokenizer, config, _ = load_run(run)
    short = config.model.sequence_len
    pieces = long // short
    tokens = eval_data(config, tokenizer, data).val
    sums, rows = torch.zeros(pieces, dtype=torch.float64), 0
    for x, y in eval_batches(tokens, 8, long, batches):
        B = x.shape[0]
        logits = model.eval()(x.reshape(B * pieces, short)).logits
        losses = token_cross_entropy(logits, y.reshape(B * pieces, short), reduction="none")
        sums += losses.view(B, pieces, short).double().sum(dim=(0, 2))
        rows += B
    return [{"start": j * short, "end": (j + 1) * short, "loss": float(sums[j] / (rows * short)),
             "tokens": rows * short} for j in range(pieces)]


def gsm8k_arm(out: Path, report: dict, arch: str, args) -> None:
    base, long, sft = out / f"{arch}-base-s0", out / f"{arch}-long-s0", out / f"{arch}-gsm8k-s0"
    if not _trained(long):
        _train(["--stage", "extend", "--init-from", str(base), "--set", f"sequence_len={args.long}", "--steps",
                str(args.extend_steps), "--batch-size", "8", "--out", str(long), "--set", "eval_every=0"])
    entry = report.setdefault("long", {}).setdefault(arch, {})
    _cached(entry, f"base, windows of its own length (context <= {POSITION_BUCKET})",
            lambda: _by_position_in_short_windows(base, args.data, args.long))
    _cached(entry, "base stretched, no training", lambda: _by_position(base, args.data, args.long))
    _cached(entry, "extended", lambda: _by_position(long, args.data))
    if args.extend_more and arch == "gpt":  # the trend with the extension's length, on one arch
        longer = out / f"{arch}-long{args.extend_more}-s0"
        if not _trained(longer):
            _train(["--stage", "extend", "--init-from", str(base), "--set", f"sequence_len={args.long}", "--steps",
                    str(args.extend_more), "--batch-size", "8", "--out", str(longer), "--set", "eval_every=0"])
        _cached(entry, f"extended, {args.extend_more} steps", lambda: _by_position(longer, args.data))
    if not _trained(sft):
        _train(["--stage", "sft", "--init-from", str(long), "--data",
                f"chat:{args.gsm8k}/sft/gsm8k_train.jsonl:question=user,answer=assistant", "--steps",
                str(args.sft_steps), "--batch-size", "8", "--out", str(sft), "--set", "eval_every=0", "--lr", "3e-3"])
    gsm = report.setdefault("gsm8k", {})
    _cached(gsm, arch, lambda: _evaluate(sft, arch, "chat:gsm8k", args.limit, f"{args.gsm8k}/eval"))


def _mean_interval(values: list[float], digits: int = 2) -> str:
    """'mean [95% t-interval over seeds]' (the mean alone with one seed)."""
    interval = t_interval(values)
    mean = f"{statistics.mean(values):.{digits}f}"
    return mean if interval is None else f"{mean} [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


def _per_seed(report: dict, arch: str, label: str, phase: str, measure: str) -> dict[int, float]:
    return {int(key.split("/")[1]): entry[phase][label][measure] for key, entry in report.get("task", {}).items()
            if key.split("/")[0] == arch and phase in entry and label in entry[phase]}


def _name(arch: str, label: str) -> str:
    return arch if arch == "gpt" else f"{arch} {label}"


def task_lines(report: dict) -> list[str]:
    """The SFT table (accuracy with its interval over seeds, trace lengths), the baselines on the same
    items, and the decision rules' paired comparisons."""
    lines = ["## SFT on addition_steps (2 digits): accuracy and trace length on held-out problems of the "
             "training range", "",
             "| arch / regime | seeds | before: acc | after SFT: acc [95% t] | trace | reasoning |",
             "|---|---:|---:|---:|---:|---:|"]
    for arch in REGIMES:
        for label in REGIMES[arch]:
            after = _per_seed(report, arch, label, "after", "accuracy")
            if not after:
                continue
            before = list(_per_seed(report, arch, label, "before", "accuracy").values())
            cells = [_mean_interval(before) if before else "", _mean_interval(list(after.values())),
                     _mean_interval(list(_per_seed(report, arch, label, "after", "mean_trace_tokens").values()), 1),
                     _mean_interval(list(_per_seed(report, arch, label, "after", "mean_reasoning_tokens").values()),
                                    1)]
            lines.append(f"| {_name(arch, label)} | {len(after)} | " + " | ".join(cells) + " |")
    first = next((rows[label] for entry in report.get("task", {}).values() for rows in [entry.get("after", {})]
                  for label in rows if rows[label].get("by_length")), None)
    if first is not None:  # every seed draws the same held-out problems
        lines += ["", "Baselines on the same items (per operand length in digits):", "",
                  *baseline_markdown(first["by_length"], column="{} digits".format)]
    comparisons = []  # (what, per-seed values, per-seed baseline, lower word, higher word)
    base = _per_seed(report, BASELINE, "plain", "after", "accuracy")
    for arch in REGIMES:
        for label in REGIMES[arch]:
            if arch != BASELINE:
                comparisons.append((f"accuracy after SFT, {_name(arch, label)} - {BASELINE}",
                                    _per_seed(report, arch, label, "after", "accuracy"), base, "worse", "better"))
    for arch, label, other in TRACE_PAIRS:
        comparisons.append((f"trace tokens after SFT, {arch} {label} - {arch} {other}",
                            _per_seed(report, arch, label, "after", "mean_trace_tokens"),
                            _per_seed(report, arch, other, "after", "mean_trace_tokens"), "shorter", "longer"))
    arch, deep, trained = DEPTH_PAIR
    comparisons.append((f"accuracy after SFT, {arch} {deep} - {arch} {trained}",
                        _per_seed(report, arch, deep, "after", "accuracy"),
                        _per_seed(report, arch, trained, "after", "accuracy"), "hurts", "helps"))
    rows = []
    for what, values, baseline, lower, higher in comparisons:
        comparison = paired_comparison(values, baseline, "difference")
        if comparison["seeds"]:
            rows.append(f"| {what} | {format_comparison(comparison, 3)} | {verdict(comparison, lower, higher)} |")
    if rows:
        lines += ["", "Paired by seed, mean [95% t-interval]:", "", "| comparison | difference | verdict |",
                  "|---|---:|---|", *rows]
    return lines


def summarise(report: dict) -> str:
    lines = task_lines(report)
    if report.get("long"):
        lines += ["", "## Long-context extension: validation loss (nats) by position bucket", ""]
        for arch, entry in report["long"].items():
            columns = len(entry["extended"])
            lines += [f"{arch}:", "", "| model | " + " | ".join(f"{b['start']}-{b['end'] - 1}" for b in
                                                                   entry["extended"]) + " |",
                      "|---|" + "---:|" * columns]
            for label, buckets in entry.items():
                cells = [f"{b['loss']:.3f}" for b in buckets] + [""] * (columns - len(buckets))
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            lines.append("")
    if report.get("gsm8k"):
        lines += ["## GSM8K: SFT on gsm8k_train at the extended length, 0-shot on test", "",
                  "| arch / regime | n | accuracy | trace | reasoning |", "|---|---:|---:|---:|---:|"]
        for arch, rows in report["gsm8k"].items():
            for label, row in rows.items():
                lines.append(f"| {arch} {label} | {row['n']} | {row['accuracy']:.3f} | "
                             f"{row['mean_trace_tokens']:.1f} | {row['mean_reasoning_tokens']:.1f} |")
    return "\n".join(lines)


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_file = out / "post_training.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    # runs and numbers kept from before the held-out split (version 1) evaluated on SFT prompts
    made_with = report.setdefault("tasks_version", TASKS_VERSION if not report else 1)
    if made_with != TASKS_VERSION:
        raise SystemExit(f"{out} holds runs made with task data version {made_with}, not {TASKS_VERSION}: their "
                         f"evaluation prompts were not held out from SFT; use a new --out")

    def save():
        report_file.write_text(json.dumps(report, indent=1))
        (out / "post_training.md").write_text(summarise(report) + "\n")

    overlap, evaluated = evaluated_in_sft(args.limit)
    if overlap:
        raise SystemExit(f"{overlap} of {evaluated} evaluation prompts ({EVAL_TASK}) are in the SFT data "
                         f"(chat:task:{TASK}): the accuracy would not be held out")
    archs = args.archs.split(",")
    for seed in args.seeds:
        for arch in archs:
            task_arm(out, report, arch, seed, args)
            save()
            print(f"{arch} seed {seed}: " + json.dumps(report["task"][f"{arch}/{seed}"]["after"]), flush=True)
    if args.gsm8k:
        for arch in archs:
            gsm8k_arm(out, report, arch, args)
            save()
            print(f"{arch} gsm8k: " + json.dumps(report["gsm8k"][arch]), flush=True)
    print(summarise(report))
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/post")
    parser.add_argument("--archs", default="gpt,fbt,rgpt")
    parser.add_argument("--data", default=DEFAULT_DATA, help="pretraining data")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--extend-steps", type=int, default=100)
    parser.add_argument("--extend-more", type=int, default=0, metavar="STEPS",
                        help="also extend gpt for this many steps (the trend with the extension's length)")
    parser.add_argument("--long", type=int, default=512, help="the extended context")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--gsm8k", default=None, help="the shared data folder (with sft/ and eval/)")
    run(parser.parse_args())
