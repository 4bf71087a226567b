"""Serial tasks where latent state should matter: accuracy by problem length, inside and beyond
the training range, for every architecture (issue 10, item 5).

    python experiments/serial_tasks.py --out runs/serial --seeds 0 1 2

Tasks (built-in generators, `latentloop.data.tasks`), trained on the short range, tested on
lengths 1..2x the training maximum:
- s3       state tracking: compose 1-4 permutations of S3 (`s5` task, size 3); test 1-8
- iterate  function iteration: f^k(x) for a random permutation f of 0..7, k 1-4 (one filler dot
           per step); test 1-8
- add      multi-digit addition, 1-3 digits per operand; test 1-5

Models: one shape for all (4 blocks x 64, 4 heads, T = 64), trained on the task's text
(`--data task:...`) for `--steps` steps of 32 rows: gpt; gpt-deep (8 blocks: about fbt's training
FLOPs, the matched-compute baseline); fbt (default recipe) decoded standard and soft; rgpt isoparams
1 + 2x4 + 1 (R = 4) decoded at every depth r = 1..8 (test-time depth up to twice the trained); lrt
(default: source block 3 of 4, interleaved S = 2 training) decoded with exact sequential memory.
Greedy decoding, `--limit` test examples per task, uniform over lengths.

Every test item is held out from training by construction (the tasks split problems by a hash:
a quarter of each in-range length is never trained on, and the lengths beyond the range never
are), so in-range accuracy measures state tracking, not recall. The report gives, per length, the
accuracy beside chance, copying the input and the majority training answer on the same items,
and each model's held-out accuracy in and beyond the range minus gpt's, paired by seed with its
95% t-interval. Resumable: finished (task, arch, seed) are kept in results.json. Writes results.md
and accuracy-by-length plots (serial_TASK.png) into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from latentloop.archs.rgpt.model import rgpt_shape_from_dense  # noqa: E402
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config  # noqa: E402
from latentloop.eval.generation import baseline_markdown, run_generation_tasks  # noqa: E402
from latentloop.eval.stats import format_comparison, paired_comparison, verdict  # noqa: E402
from latentloop.train import fit, setup  # noqa: E402
from latentloop.util import pyplot, save_figure  # noqa: E402

TASKS = {  # name -> (training data spec, evaluation task name)
    "s3": ("task:s5:size=3,length=1-4,n=20000", "s5:size=3,length=1-4,test=1-8"),
    "iterate": ("task:iteration:size=8,k=1-4,fill=1,n=20000", "iteration:size=8,k=1-4,fill=1,test=1-8"),
    "add": ("task:addition:digits=1-3,n=20000", "addition:digits=1-3,test=1-5"),
}
SHAPE = dict(n_layer=4, n_embd=64, n_head=4, sequence_len=64)
RECURRENCE = 4  # rgpt's trained depth R; it is also decoded at 2R
ARCHS = {  # name -> (model fields, {label: decoding options})
    "gpt": ({"arch": "gpt"}, {"gpt": {}}),
    # twice the blocks: about fbt's training FLOPs per token (its default recipe runs ~2.1 passes), the
    # matched-compute baseline of a data-efficiency claim
    "gpt-deep": ({"arch": "gpt", "n_layer": 2 * SHAPE["n_layer"]}, {"gpt-deep": {}}),
    "fbt": ({"arch": "fbt"}, {"fbt standard": {"regime": "standard"}, "fbt soft": {"regime": "soft"}}),
    # test-time depth: decoded at every depth 1..2R (R trained, depth drawn from Uniform{1..R})
    "rgpt": ({"arch": "rgpt", **rgpt_shape_from_dense(SHAPE["n_layer"], "params", RECURRENCE)},
             {f"rgpt r={r}": {"steps": r} for r in range(1, 2 * RECURRENCE + 1)}),
    "lrt": ({"arch": "lrt"}, {"lrt": {}}),
}
BASELINE = "gpt"  # each label's per-seed accuracy is paired against this one's
PLOTTED_DEPTHS = (f"rgpt r={RECURRENCE}", f"rgpt r={2 * RECURRENCE}")  # rgpt's depths on the plot


def run_one(out: Path, task: str, arch: str, seed: int, steps: int, limit: int) -> dict:
    fields, regimes = ARCHS[arch]
    fields = dict(fields)
    name = fields.pop("arch")
    data_spec, eval_name = TASKS[task]
    config = RunConfig(model=model_config(name, None, **{**SHAPE, **fields}),
                       train=TrainConfig(steps=steps, batch_size=32, lr=3e-3, warmup_steps=max(1, steps // 20),
                                         eval_every=0, eval_batches=2, seed=seed, log_every=50),
                       data=DataConfig(source=data_spec))
    run_dir = out / f"{task}-{arch}-s{seed}"
    started = time.time()
    state = setup(config, run_dir, resume=(run_dir / "config.json").exists(), progress=False)
    summary = fit(state, progress=False)
    model = state.model.eval()
    scores = {}
    for label, options in regimes.items():
        result = run_generation_tasks(model, state.tokenizer, [eval_name], None, options, limit=limit,
                                      progress=False)[eval_name]
        scores[label] = {"accuracy": result["accuracy"], "n": result["n"],
                         "by_length": {str(k): v for k, v in result["accuracy_by_steps"].items()},
                         "per_length": result.get("by_length", {})}  # n, accuracy, its interval, baselines
    return {"task": task, "arch": arch, "seed": seed, "steps": steps, "params": model.num_params(),
            "train_flops": summary["flops"], "seconds": time.time() - started, "scores": scores}


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}"


def _accuracy(entry) -> float:
    return entry["accuracy"] if isinstance(entry, dict) else float(entry)


def summarise(results: list[dict]) -> str:
    lines = []
    for task, (data_spec, eval_name) in TASKS.items():
        rows = [r for r in results if r["task"] == task]
        if not rows:
            continue
        train_high = _train_max(data_spec)
        lengths = sorted({int(k) for r in rows for s in r["scores"].values() for k in s["by_length"]})
        lines += [f"### {task}: train `{data_spec}`, test `{eval_name}` (lengths <= {train_high} are in the "
                  f"training range)", "",
                  "| model | seeds | " + " | ".join(f"len {n}" for n in lengths) + " | in range | beyond |",
                  "|---|---:|" + "---:|" * (len(lengths) + 2)]
        labels = {label: None for r in rows for label in r["scores"]}
        for label in labels:
            with_label = [r for r in rows if label in r["scores"]]
            cells = []
            for n in lengths:
                values = [_accuracy(r["scores"][label]["by_length"][str(n)]) for r in with_label
                          if str(n) in r["scores"][label]["by_length"]]
                cells.append(_mean_sd(values) if values else "")
            inside = [statistics.mean(_accuracy(v) for k, v in r["scores"][label]["by_length"].items()
                                      if int(k) <= train_high) for r in with_label]
            beyond = [statistics.mean(_accuracy(v) for k, v in r["scores"][label]["by_length"].items()
                                      if int(k) > train_high) for r in with_label]
            lines.append(f"| {label} | {len(with_label)} | " + " | ".join(cells) +
                         f" | {_mean_sd(inside)} | {_mean_sd(beyond)} |")
        lines += baseline_lines(rows, lengths) + paired_lines(rows, train_high) + [""]
    return "\n".join(lines)


def _range_accuracy(score: dict, train_high: int, inside: bool) -> float:
    """Accuracy over the test items in (or beyond) the training range: items pooled over lengths."""
    rows = [(v["n"], v["accuracy"]) for k, v in score["per_length"].items() if (int(k) <= train_high) == inside]
    count = sum(n for n, _ in rows)
    return sum(n * a for n, a in rows) / count if count else float("nan")


def baseline_lines(rows: list[dict], lengths: list[int]) -> list[str]:
    """What a model gets for nothing on the same test items, per length (the first run's items: every
    seed draws the same held-out test problems)."""
    first = next((score for r in rows for score in r["scores"].values() if score.get("per_length")), None)
    if first is None:
        return []
    return ["", *baseline_markdown(first["per_length"], lengths)]


def paired_lines(rows: list[dict], train_high: int) -> list[str]:
    """Each label's held-out accuracy in and beyond the training range minus the baseline's, paired by
    seed: mean [95% t-interval] and whether it excludes 0."""
    labels = {label: None for r in rows for label in r["scores"]}
    if BASELINE not in labels:
        return []
    lines = ["", f"Accuracy minus {BASELINE}'s, paired by seed, mean [95% t-interval]:", "",
             "| model | in range (held-out items) | beyond the range |", "|---|---:|---:|"]
    for label in labels:
        if label == BASELINE:
            continue
        cells = []
        for inside in (True, False):
            values = {r["seed"]: _range_accuracy(r["scores"][label], train_high, inside) for r in rows
                      if label in r["scores"] and r["scores"][label].get("per_length")}
            base = {r["seed"]: _range_accuracy(r["scores"][BASELINE], train_high, inside) for r in rows
                    if BASELINE in r["scores"] and r["scores"][BASELINE].get("per_length")}
            comparison = paired_comparison(values, base, "difference")
            cells.append(f"{format_comparison(comparison, 3)} ({verdict(comparison)})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _train_max(data_spec: str) -> int:
    knob = [item for item in data_spec.split(":", 2)[2].split(",") if "-" in item and not item.startswith("n=")][0]
    return int(knob.split("=")[1].split("-")[1])


def plot(results: list[dict], out: Path) -> None:
    plt = pyplot("the serial-task plots")
    if plt is None:
        return
    for task, (data_spec, _) in TASKS.items():
        rows = [r for r in results if r["task"] == task]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for label in {label: None for r in rows for label in r["scores"]}:
            if label not in PLOTTED_DEPTHS and label.startswith("rgpt r="):
                continue  # every depth is in results.md; the plot keeps R and 2R legible
            with_label = [r for r in rows if label in r["scores"]]
            lengths = sorted({int(k) for r in with_label for k in r["scores"][label]["by_length"]})
            per_length = [[_accuracy(r["scores"][label]["by_length"][str(n)]) for r in with_label
                           if str(n) in r["scores"][label]["by_length"]] for n in lengths]
            line, = ax.plot(lengths, [statistics.mean(v) for v in per_length], marker="o", label=label)
            ax.fill_between(lengths, [min(v) for v in per_length], [max(v) for v in per_length],
                            color=line.get_color(), alpha=0.12, linewidth=0)  # the seeds' range
        first = next((s["per_length"] for r in rows for s in r["scores"].values() if s.get("per_length")), {})
        lengths = sorted(first, key=int)
        for kind, style in (("copy", ":"), ("majority", "-.")):  # what a model gets for nothing, same items
            points = [(int(n), first[n][kind]) for n in lengths if first[n].get(kind) is not None]
            if points:
                ax.plot(*zip(*points), color="black", linestyle=style, linewidth=1.2, label=f"baseline: {kind}")
        ax.axvline(_train_max(data_spec) + 0.5, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks([int(n) for n in lengths])
        ax.set(xlabel="problem length (serial steps)", ylabel="accuracy (greedy, held-out items)", ylim=(-0.02, 1.02))
        ax.set_title(f"{task}: mean over seeds (band: their range); dashed: end of training range", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        save_figure(fig, out / f"serial_{task}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/serial")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--limit", type=int, default=160, help="test examples per task and model")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--archs", nargs="*", default=list(ARCHS), choices=list(ARCHS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else []
    done = {(r["task"], r["arch"], r["seed"]) for r in results}
    for seed in args.seeds:
        for task in args.tasks:
            for arch in args.archs:
                if (task, arch, seed) in done:
                    continue
                result = run_one(out, task, arch, seed, args.steps, args.limit)
                results.append(result)
                results_file.write_text(json.dumps(results, indent=2) + "\n")
                print(f"{task} {arch} seed {seed} ({result['seconds']:.0f} s): " +
                      ", ".join(f"{k} {v['accuracy']:.2f}" for k, v in result["scores"].items()), flush=True)
    table = summarise(results)
    (out / "results.md").write_text(f"# Serial tasks: accuracy by length\n\n{table}\n")
    plot(results, out)
    print(table)


if __name__ == "__main__":
    main()
