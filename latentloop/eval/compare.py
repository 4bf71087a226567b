"""`latentloop compare RUN... [--out DIR]`: runs side by side, at matched tokens and matched compute.

Reads each run folder (`config.json`, `metrics.jsonl`, `evals/*.json` written by
`latentloop eval --tasks`) and writes into DIR:

- `compare.md`: a table of the runs (arch, parameters, steps, training tokens, training FLOPs,
  FLOPs per token, final val loss and BPB), a table of CORE and task accuracy per run and
  decoding regime, and the plots;
- `loss_vs_tokens.png`, `loss_vs_flops.png`: validation loss (points, joined) and training loss
  (thin) of every run against training tokens and training FLOPs (needs matplotlib, the `plot`
  extra; without it the plots are skipped with a note);
- `compare.json`: everything the tables show, for scripts.

Seeds: runs whose configs differ only in `train.seed` form a group (its label: the run name with a
trailing seed tag such as `-s1` or `_seed1` removed). When a group has two or more runs,
`compare.md` gets a table of each group's final validation loss and BPB as mean ± sd over its
seeds and, against the baseline group (`--baseline`, default the first), the paired difference of
BPB by seed with its 95% t-interval and whether it excludes zero (`eval.stats.seed_rows`), and the
plots draw each group's mean validation curve with a band of ± one sd over its seeds. Task
accuracies show their 95% Wilson interval where the eval recorded one. The final validation
figures are the training-time estimate (the first `train.eval_batches` batches of the val split, as
`train` logged them); `latentloop eval` scores the whole split.

Parameters and FLOPs per token come from the run's config (the model is built on the `meta`
device: no memory, no weights read); training FLOPs are those the trainer logged, else FLOPs per
token (the objective's run average: multi-pass K, recurrence depth, ...) times tokens.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..archs import scoring_notes
from ..config import RunConfig
from ..errors import CheckpointError, ConfigError, LatentloopError
from ..util import is_int, progress
from .core import CORE_TASKS
from .stats import format_comparison, seed_rows

EVALS_DIR = "evals"


def _read_jsonl(path: Path) -> list[dict]:
    """A metrics.jsonl's rows that are JSON objects with an integer step (or none), their numbers
    only: a line cut by an interrupted run, or damaged (not UTF-8, not JSON, a step that is not a
    number), is left out, and so is a value that is not a number (the trainer logs numbers only)."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            continue
        if isinstance(row, dict) and is_int(row.get("step", 0)):
            rows.append({key: value for key, value in row.items()
                         if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))})
    return rows


@functools.cache
def _model_facts(recipe: str) -> tuple[int | None, float | None]:
    """(parameters, training FLOPs per token) of a run's config without its seed (`recipe`, JSON),
    building the model on `meta`; remembered, as counting takes about a second and the seeds of one
    group share their answer."""
    from ..archs import build_model, build_objective

    config = RunConfig.from_dict(json.loads(recipe))
    try:
        with torch.device("meta"):
            model = build_model(config.model)
        params = int(model.num_params())
    except (LatentloopError, RuntimeError, NotImplementedError):
        return None, None
    try:
        flops = float(build_objective(config.model, config.train).flops_per_token(model, None))
    except (LatentloopError, RuntimeError, NotImplementedError, AttributeError):
        flops = None
    return params, flops


def read_evals(run_dir: Path) -> list[dict]:
    """The eval result files of a run (written by `latentloop eval --tasks`)."""
    results = []
    folder = run_dir / EVALS_DIR
    if not folder.is_dir():
        return results
    for path in sorted(folder.glob("*.json")):
        try:
            payload = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        if isinstance(payload, dict) and "task" in payload and isinstance(payload.get("result"), dict):
            payload["file"] = str(path)
            results.append(payload)
    return results


def _config_file(run_dir: Path) -> Path:
    config_file = run_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{run_dir} is not a run folder (no config.json)")
    return config_file


def read_run(path: str | Path) -> dict[str, Any]:
    """Everything compare needs from one run folder."""
    run_dir = Path(path)
    config_file = _config_file(run_dir)
    try:
        config = RunConfig.from_dict(json.loads(config_file.read_text()))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"corrupt {config_file}: {exc}") from None
    except ConfigError as exc:
        raise CheckpointError(f"{config_file} is invalid: {exc}") from None
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r and "step" in r]
    val = [r for r in rows if "val_loss" in r and "step" in r]
    recipe = config.to_dict()
    recipe["train"].pop("seed", None)  # what makes runs seeds of one group: everything but the seed
    recipe = json.dumps(recipe, sort_keys=True, default=str)
    params, flops_per_token = _model_facts(recipe)
    last = train[-1] if train else {}
    tokens = last.get("tokens")
    flops = last.get("flops")
    if flops is None and tokens is not None and flops_per_token is not None:
        flops = flops_per_token * tokens
    final_val = val[-1] if val else {}
    return {"run": str(run_dir), "name": run_dir.resolve().name, "arch": config.model.arch, "params": params,
            "seed": config.train.seed, "recipe": recipe,
            "eval_batches": config.train.eval_batches,
            "steps": last.get("step"), "tokens": tokens, "flops": flops, "flops_per_token": flops_per_token,
            "val_loss": final_val.get("val_loss"), "val_bpb": final_val.get("val_bpb"), "train": train,
            "val": val, "evals": read_evals(run_dir)}


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def _num(value: Any, fmt: str = ".4f") -> str:
    """A logged number as the table shows it; a missing, NaN or damaged (not a number) value as "–"."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        return "–"
    return format(value, fmt)


def _si(value: Any) -> str:
    if value is None:
        return "–"
    value = float(value)
    for threshold, suffix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.3g}{suffix}"
    return f"{value:.3g}"


def runs_table(runs: list[dict]) -> str:
    lines = ["| run | arch | params | steps | tokens | train FLOPs | FLOPs/token | val loss | val BPB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        params = f"{r['params']:,}" if r["params"] is not None else "–"
        tokens = f"{r['tokens']:,}" if r["tokens"] is not None else "–"
        lines.append(f"| {r['label']} | {r['arch']} | {params} | {_num(r['steps'], 'd')} | {tokens} | "
                     f"{_si(r['flops'])} | {_si(r['flops_per_token'])} | {_num(r['val_loss'])} | "
                     f"{_num(r['val_bpb'])} |")
    return "\n".join(lines)


SEED_SUFFIX = re.compile(r"[-_.]?(?:seed|s)\d+$")  # run-name endings that name a seed: gpt-s1, gpt_seed1


def seed_groups(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs grouped by recipe (config without the seed), in first-seen order, by group label."""
    by_recipe: dict[str, list[dict]] = {}
    for r in runs:
        by_recipe.setdefault(r["recipe"], []).append(r)
    groups: dict[str, list[dict]] = {}
    for members in by_recipe.values():
        stems = {SEED_SUFFIX.sub("", m["label"]) or m["label"] for m in members}
        label = stems.pop() if len(stems) == 1 and len(members) > 1 else members[0]["label"]
        while label in groups:  # two recipes whose names strip alike
            label += "'"
        groups[label] = members
    return groups


def groups_table(groups: dict[str, list[dict]], baseline: str) -> tuple[str, list[dict]]:
    """Mean ± sd over seeds of each group's final val loss and BPB, and BPB's paired difference
    from the baseline group (by seed, 95% t-interval); also the rows, for compare.json."""
    def by_seed(key: str) -> dict[str, dict]:
        return {label: {r["seed"]: r[key] for r in members if r[key] is not None}
                for label, members in groups.items()}

    loss_rows = {row["name"]: row for row in seed_rows(by_seed("val_loss"))}
    bpb_rows = seed_rows(by_seed("val_bpb"), baseline, kind="difference")
    lines = [f"| group | arch | seeds | val loss (mean ± sd) | val BPB (mean ± sd) | BPB − {baseline} "
             "(paired, 95% t) | excludes 0 |", "|---|---|---|---:|---:|---:|---|"]
    rows = []
    for row in bpb_rows:
        members = groups[row["name"]]
        loss = loss_rows[row["name"]]
        paired = row.get("paired")
        cells = ("(baseline)", "") if paired is None else (
            format_comparison(paired), {True: "yes", False: "no", None: "–"}[paired["excludes"]])
        seeds = ", ".join(str(m["seed"]) for m in members)
        lines.append(f"| {row['name']} | {members[0]['arch']} | {seeds} | {_num(loss['mean'])} ± {_num(loss['sd'])} | "
                     f"{_num(row['mean'])} ± {_num(row['sd'])} | {cells[0]} | {cells[1]} |")
        rows.append({"group": row["name"], "runs": [m["label"] for m in members], "val_loss": loss, "val_bpb": row})
    return "\n".join(lines), rows


def collect_task_columns(runs: list[dict]) -> tuple[list[tuple[str, str]], dict[tuple[str, str], dict], list[str]]:
    """Columns (run label, tag), {(label, tag): {task: cell}} and the task rows in display order."""
    columns: list[tuple[str, str]] = []
    cells: dict[tuple[str, str], dict] = {}
    tasks: set[str] = set()
    for r in runs:
        for payload in r["evals"]:
            key = (r["label"], str(payload.get("tag", "default")))
            if key not in cells:
                columns.append(key)
                cells[key] = {"_limits": set()}
            result, name = payload["result"], payload["task"]
            if payload.get("limit") is not None:
                cells[key]["_limits"].add(payload["limit"])
            if payload.get("kind") == "core_aggregate":
                cells[key]["CORE"] = _num(result.get("core"))
                if result.get("missing"):
                    cells[key]["CORE"] += f" ({result.get('evaluated')} tasks)"
                continue
            accuracy = result.get("accuracy")
            if not isinstance(accuracy, (int, float)):
                continue
            cell = _num(accuracy)
            interval = result.get("accuracy_ci")
            if isinstance(interval, list) and len(interval) == 2:
                cell += f" [{interval[0]:.2f}, {interval[1]:.2f}]"
            trace = result.get("mean_trace_tokens")
            if isinstance(trace, (int, float)):
                cell += f" ({trace:.0f} tok)"
            cells[key][name] = cell
            tasks.add(name)
    core_order = [t for t in CORE_TASKS if t in tasks]
    others = sorted(tasks - set(core_order))
    has_core = any("CORE" in c for c in cells.values())
    return columns, cells, (["CORE"] if has_core else []) + core_order + others


def tasks_table(runs: list[dict]) -> str | None:
    columns, cells, rows = collect_task_columns(runs)
    if not columns or not rows:
        return None
    header = "| task | " + " | ".join(f"{label} ({tag})" for label, tag in columns) + " |"
    lines = [header, "|---|" + "---:|" * len(columns)]
    for task in rows:
        name = f"**{task}** (centred)" if task == "CORE" else task
        lines.append(f"| {name} | " + " | ".join(cells[c].get(task, "–") for c in columns) + " |")
    limits = [f"{label} ({tag}): {', '.join(map(str, sorted(cells[(label, tag)]['_limits'])))}"
              for label, tag in columns if cells[(label, tag)]["_limits"]]
    note = ("\n\nAccuracy per task; CORE is the mean centred accuracy. Examples per task were limited "
            f"(--limit) for {'; '.join(limits)}." if limits else
            "\n\nAccuracy per task; CORE is the mean centred accuracy.")
    return "\n".join(lines) + note


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _val_metric(runs: list[dict]) -> tuple[str, str]:
    """(val row key, axis label): BPB when every run logged it (comparable across tokenizers), else loss."""
    if runs and all(run["val"] and all(row.get("val_bpb") is not None for row in run["val"]) for run in runs):
        return "val_bpb", "validation bits per byte"
    return "val_loss", "validation loss (nats/token)"


def _val_axis(run: dict, key: str, metric: str = "val_loss") -> tuple[list[float], list[float]]:
    """Validation `metric` against training tokens or FLOPs (interpolated from the training log)."""
    steps = [r["step"] for r in run["train"] if r.get(key) is not None]
    values = [r[key] for r in run["train"] if r.get(key) is not None]
    if key == "flops" and not values and run["flops_per_token"] is not None:
        steps = [r["step"] for r in run["train"] if r.get("tokens") is not None]
        values = [r["tokens"] * run["flops_per_token"] for r in run["train"] if r.get("tokens") is not None]
    if not values:
        return [], []
    per_step = values[-1] / steps[-1] if steps[-1] else 0.0
    xs, ys = [], []
    for row in run["val"]:
        step = row["step"]
        x = float(np.interp(step, steps, values)) if step <= steps[-1] else step * per_step
        if step < steps[0]:
            x = step * (values[0] / steps[0] if steps[0] else 0.0)
        xs.append(x)
        ys.append(row.get(metric))
    return xs, ys


def group_curve(members: list[dict], key: str, metric: str) -> tuple[list[float], list[float], list[float]]:
    """A seed group's validation curve: x, mean and sd over its seeds at each validation point they
    all reached (seeds of one recipe validate at the same steps; x is their mean)."""
    curves = [_val_axis(run, key, metric) for run in members]
    length = min((len(xs) for xs, _ in curves), default=0)
    if length == 0:
        return [], [], []
    xs = np.mean([c[0][:length] for c in curves], axis=0)
    ys = np.array([c[1][:length] for c in curves], dtype=np.float64)
    sd = ys.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros(length)
    return xs.tolist(), ys.mean(axis=0).tolist(), sd.tolist()


def plot_losses(runs: list[dict], out: Path, groups: dict[str, list[dict]] | None = None
                ) -> tuple[list[str], list[str]]:
    """Write loss_vs_tokens.png and loss_vs_flops.png: each group's validation curve (BPB where
    logged; a group of seeds as its mean with a ± sd band) and each run's training loss (thin, on
    a second axis); returns (file names, notes)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], ["matplotlib is not installed: plots skipped (pip install 'latentloop[plot]')"]
    groups = groups or {run["label"]: [run] for run in runs}
    metric, metric_label = _val_metric(runs)
    written, notes = [], []
    for key, label, filename in (("tokens", "training tokens", "loss_vs_tokens.png"),
                                 ("flops", "training FLOPs", "loss_vs_flops.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        train_ax = ax.twinx()
        drawn = False
        for i, (name, members) in enumerate(groups.items()):
            color = f"C{i % 10}"
            for run in members:
                train = [(r[key], r["loss"]) for r in run["train"] if r.get(key) is not None]
                if key == "flops" and not train and run["flops_per_token"] is not None:
                    train = [(r["tokens"] * run["flops_per_token"], r["loss"]) for r in run["train"]
                             if r.get("tokens") is not None]
                if train:
                    train_ax.plot(*zip(*train), color=color, alpha=0.25, linewidth=0.8)
                    drawn = True
            xs, mean, sd = group_curve(members, key, metric)
            seeds = f", {len(members)} seeds, ± sd" if len(members) > 1 else ""
            if xs:
                ax.plot(xs, mean, color=color, marker="o", label=f"{name} ({members[0]['arch']}{seeds})")
                if len(members) > 1:
                    ax.fill_between(xs, np.subtract(mean, sd), np.add(mean, sd), color=color, alpha=0.2)
                drawn = True
            elif drawn:
                ax.plot([], [], color=color, label=f"{name} ({members[0]['arch']}) train only")
        if not drawn:
            plt.close(fig)
            notes.append(f"no logged {label} to plot")
            continue
        ax.set_xlabel(label)
        ax.set_ylabel(metric_label + " (points)")
        train_ax.set_ylabel("training loss (thin)", alpha=0.6)
        ax.set_title(f"{metric_label.split(' (')[0]} vs {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=120)
        plt.close(fig)
        written.append(filename)
    return written, notes


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def _labels(runs: list[dict]) -> None:
    names = [r["name"] for r in runs]
    for r in runs:
        r["label"] = r["name"] if names.count(r["name"]) == 1 else r["run"]


def compare_runs(paths: list[str | Path], out: str | Path = "compare", baseline: str | None = None,
                 show_progress: bool = False) -> dict[str, Any]:
    """Read the runs, write DIR/compare.md (+ PNG plots, compare.json); returns the report.
    `baseline`: the group (or run) the others' paired differences are taken against (default: the
    first group)."""
    if not paths:
        raise ConfigError("give at least one run folder")
    for path in paths:  # a wrong folder is named before the progress bar starts
        _config_file(Path(path))
    runs = [read_run(p) for p in progress(paths, desc="reading runs", enabled=show_progress)]
    _labels(runs)
    groups = seed_groups(runs)
    if baseline is None:
        baseline = next(iter(groups))
    elif baseline not in groups:
        by_run = [label for label, members in groups.items() if baseline in (m["label"] for m in members)]
        if not by_run:
            raise ConfigError(f"--baseline {baseline!r} names none of the groups ({', '.join(groups)}) or runs")
        baseline = by_run[0]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = runs_table(runs)
    tasks = tasks_table(runs)
    plots, notes = plot_losses(runs, out, groups)
    parts = ["# latentloop compare", "", table, "",
             f"_val loss and BPB: the training-time estimate, the first {_batches_text(runs)} of the validation "
             "split as `train` logged them (`latentloop eval RUN` scores the whole split)._", ""]
    seeds_table, seed_summary = (None, [])
    if any(len(members) > 1 for members in groups.values()):
        seeds_table, seed_summary = groups_table(groups, baseline)
        parts += ["## Over seeds", "", seeds_table, "",
                  "_Groups: runs whose configs differ only in the seed. A difference excludes 0 when its 95% "
                  "t-interval over the paired seeds does; otherwise the groups are not told apart._", ""]
    if tasks:
        parts += ["## CORE and task accuracy per decoding regime", "", tasks, ""]
    else:
        notes.append("no task results in RUN/evals/ (run `latentloop eval RUN --tasks core` first)")
    for plot in plots:
        parts += [f"![{plot[:-4].replace('_', ' ')}]({plot})", ""]
    notes = list(dict.fromkeys(notes + scoring_notes(r.get("arch") for r in runs)))
    parts += [f"_{note}_" for note in notes]
    markdown = "\n".join(parts).rstrip() + "\n"
    report = out / "compare.md"
    report.write_text(markdown)
    slim = [{k: v for k, v in r.items() if k not in ("train", "val", "recipe")} for r in runs]
    (out / "compare.json").write_text(json.dumps({"runs": slim, "groups": seed_summary, "baseline": baseline},
                                                 indent=2, default=str) + "\n")
    return {"markdown": "\n\n".join(p for p in (table, seeds_table, tasks) if p), "report": str(report),
            "plots": plots, "notes": notes, "runs": slim, "groups": seed_summary, "baseline": baseline}


def _batches_text(runs: list[dict]) -> str:
    counts = sorted({r["eval_batches"] for r in runs})
    return " / ".join(map(str, counts)) + (" batch" if counts == [1] else " batches")


__all__ = ["collect_task_columns", "compare_runs", "group_curve", "groups_table", "plot_losses", "read_evals",
           "read_run", "runs_table", "seed_groups", "tasks_table"]
