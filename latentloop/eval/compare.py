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
import hashlib
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
from ..runtime import check_output_folder, output_folder
from ..util import PLOT_EXTRA, is_int, json_safe, progress, pyplot, read_json_object, save_figure, write_text_atomic
from .core import CORE_TASKS
from .stats import format_comparison, seed_rows

EVALS_DIR = "evals"


def _read_jsonl(path: Path) -> tuple[list[dict], int]:
    """A metrics.jsonl's rows that are JSON objects with an integer step (or none), their numbers
    only, and how many lines were damaged: not UTF-8, not JSON, not such an object (left out and
    counted; the last line, which an interrupted run may have cut, is left out without counting). A
    value that is not a number is left out of its row (the trainer logs numbers only)."""
    rows: list[dict] = []
    if not path.is_file():
        return rows, 0
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    damaged = 0
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            row = None
        if isinstance(row, dict) and is_int(row.get("step", 0)):
            rows.append({key: value for key, value in row.items()
                         if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))})
        elif i < len(lines) - 1:
            damaged += 1
    return rows, damaged


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
        except (json.JSONDecodeError, OSError, UnicodeDecodeError):
            continue
        if _well_formed_eval(payload):
            payload["file"] = str(path)
            results.append(payload)
    return results


def _well_formed_eval(payload: Any) -> bool:
    """Whether a result file holds what the tables read, of the types they read (a damaged one is
    skipped, as a damaged metrics row is: an interval of strings or a list as the limit was a
    traceback)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("task"), str) \
            or not isinstance(payload.get("result"), dict):
        return False
    limit, interval = payload.get("limit"), payload["result"].get("accuracy_ci")
    return (limit is None or is_int(limit)) and (interval is None or (
        isinstance(interval, list) and len(interval) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in interval)))


def _config_file(run_dir: Path) -> Path:
    config_file = run_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{run_dir} is not a run folder (no config.json)")
    if (run_dir / "state.json").is_file() and run_dir.parent.name == "checkpoints":  # a row of dashes, no word
        raise CheckpointError(f"{run_dir} is a checkpoint folder, not a run folder: give its run "
                              f"({run_dir.parent.parent})")
    return config_file


# Train settings that cannot change what a run computes (how often it saves, keeps, logs, reports):
# seeds that differ only in these still form one group. `eval_every` is not among them: the
# validation points a group's curve averages by index must fall at the same steps.
INERT_SETTINGS = ("save_every", "keep_last", "log_every", "trackers")
FINGERPRINT_CHARS = 12  # of a sha256: enough to tell two tokenizers or data sets apart in a table


def _recorded_data(run_dir: Path, config: RunConfig) -> dict[str, Any]:
    """What the run was trained on, as its latest checkpoint's state.json records it (the token
    checksums of the train and val splits, the source), else as its config names it (source,
    val_fraction, max_bytes): runs whose answers differ were trained or validated on other tokens."""
    data = config.data
    found: dict[str, Any] = {"source": data.source, "val_fraction": data.val_fraction, "max_bytes": data.max_bytes}
    folder = run_dir / "checkpoints"
    # finished checkpoint folders, newest first (the checkpoint module is a layer eval may not import)
    found_steps = sorted(((int(m.group(1)), p) for p in (folder.iterdir() if folder.is_dir() else ())
                          if p.is_dir() and (m := CHECKPOINT_STEP.fullmatch(p.name))), reverse=True)
    for _, checkpoint in found_steps:
        state = read_json_object(checkpoint / "state.json")
        if not state:  # missing or unreadable: an older checkpoint may tell
            continue
        checksums = state.get("data")
        if isinstance(checksums, dict) and checksums:
            found["sha256"] = {str(k): str(v) for k, v in sorted(checksums.items())}
            if isinstance(state.get("data_source"), str):
                found["source"] = state["data_source"]
        break
    return found


def _data_key(data: dict[str, Any]) -> str:
    """The data a run's figures come from: its recorded checksums where there are some (a changed
    file under the same name differs), else its config's source and split."""
    if "sha256" in data:
        return json.dumps({"sha256": data["sha256"], "val_fraction": data["val_fraction"]}, sort_keys=True)
    return json.dumps(data, sort_keys=True, default=str)


def _same_data(a: dict, b: dict) -> bool:
    """Whether two runs' figures come from the same data: the same recorded token checksums under one
    tokenizer; across tokenizers (whose token checksums always differ) the same source and split."""
    if a.get("tokenizer") == b.get("tokenizer"):
        return a.get("data_key") == b.get("data_key")
    return all(a["data"].get(k) == b["data"].get(k) for k in ("source", "val_fraction", "max_bytes"))


def _tokenizer_fingerprint(run_dir: Path, config: RunConfig) -> str:
    """A hash of the run's tokenizer.json (what its token ids mean), else its config's tokenizer spec."""
    try:
        return hashlib.sha256((run_dir / "tokenizer.json").read_bytes()).hexdigest()[:FINGERPRINT_CHARS]
    except OSError:
        return f"spec:{config.data.tokenizer}"


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
    rows, damaged = _read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r and "step" in r]
    val = [r for r in rows if "val_loss" in r and "step" in r]
    recipe = config.to_dict()
    recipe["train"].pop("seed", None)  # what makes runs seeds of one group: everything but the seed
    recipe = json.dumps(recipe, sort_keys=True, default=str)
    params, flops_per_token = _model_facts(recipe)
    data = _recorded_data(run_dir, config)
    tokenizer = _tokenizer_fingerprint(run_dir, config)
    grouping = json.loads(recipe)
    for name in INERT_SETTINGS:
        grouping["train"].pop(name, None)
    # seeds of one group: the same recipe (less the inert settings), the same tokens, the same tokenizer
    group_key = json.dumps({"recipe": grouping, "data": _data_key(data), "tokenizer": tokenizer}, sort_keys=True,
                           default=str)
    last = train[-1] if train else {}
    tokens = last.get("tokens")
    flops = last.get("flops")
    if flops is None and tokens is not None and flops_per_token is not None:
        flops = flops_per_token * tokens
    final_val = val[-1] if val else {}
    return {"run": str(run_dir), "name": run_dir.resolve().name, "arch": config.model.arch, "params": params,
            "seed": config.train.seed, "recipe": recipe, "group_key": group_key, "data": data,
            "data_key": _data_key(data), "tokenizer": tokenizer,
            "eval_batches": config.train.eval_batches,
            "steps": last.get("step"), "tokens": tokens, "flops": flops, "flops_per_token": flops_per_token,
            "val_loss": final_val.get("val_loss"), "val_bpb": final_val.get("val_bpb"), "train": train,
            "val": val, "evals": read_evals(run_dir), "damaged_metric_lines": damaged}


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
    """One row per run; a `tokenizer` column (its fingerprint) when the runs' tokenizers differ."""
    mixed = len({r.get("tokenizer") for r in runs}) > 1
    lines = ["| run | arch | params | steps | tokens | train FLOPs | FLOPs/token | val loss (nats/token) | val BPB |"
             + (" tokenizer |" if mixed else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if mixed else "")]
    for r in runs:
        params = f"{r['params']:,}" if r["params"] is not None else "–"
        tokens = f"{r['tokens']:,}" if r["tokens"] is not None else "–"
        lines.append(f"| {r['label']} | {r['arch']} | {params} | {_num(r['steps'], 'd')} | {tokens} | "
                     f"{_si(r['flops'])} | {_si(r['flops_per_token'])} | {_num(r['val_loss'])} | "
                     f"{_num(r['val_bpb'])} |" + (f" {r.get('tokenizer')} |" if mixed else ""))
    return "\n".join(lines)


SEED_SUFFIX = re.compile(r"[-_.]?(?:seed|s)\d+$")  # run-name endings that name a seed: gpt-s1, gpt_seed1


def seed_groups(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs grouped by recipe (config without the seed and the settings that cannot change results),
    data (recorded checksums) and tokenizer, in first-seen order, by group label."""
    by_recipe: dict[str, list[dict]] = {}
    for r in runs:
        by_recipe.setdefault(r.get("group_key", r["recipe"]), []).append(r)
    groups: dict[str, list[dict]] = {}
    for members in by_recipe.values():
        first_of_seed: dict[Any, dict] = {}
        for member in members:  # a copy of a run is not a second seed: its figures were cut to one without a word
            other = first_of_seed.setdefault(member["seed"], member)
            if other is not member:
                raise ConfigError(f"runs {other['run']} and {member['run']} share their recipe and seed "
                                  f"{member['seed']}: one seed counts once; compare one of them")
        stems = {SEED_SUFFIX.sub("", m["label"]) or m["label"] for m in members}
        label = stems.pop() if len(stems) == 1 and len(members) > 1 else members[0]["label"]
        while label in groups:  # two recipes whose names strip alike
            label += "'"
        groups[label] = members
    return groups


def _spread(summary: dict) -> str:
    """'mean ± sd' over a group's seeds; the mean alone for one seed (one value has no spread)."""
    if summary.get("seeds", 0) < 2:
        return _num(summary["mean"])
    return f"{_num(summary['mean'])} ± {_num(summary['sd'])}"


def _data_text(data: dict[str, Any]) -> str:
    """A run's data in a note: its source, its recorded val checksum (short) and its val fraction."""
    checksum = data.get("sha256", {}).get("val")
    return (f"{data['source']}" + (f" (val tokens {checksum[:FINGERPRINT_CHARS]})" if checksum else "")
            + f", val_fraction {data['val_fraction']}")


def groups_table(groups: dict[str, list[dict]], baseline: str) -> tuple[str, list[dict]]:
    """Mean ± sd over seeds of each group's final val loss and BPB, and BPB's paired difference
    from the baseline group (by seed, 95% t-interval); also the rows, for compare.json. A group
    trained or validated on other data than the baseline is not paired with it: its figures come
    from other tokens, so a difference by seed would measure the data as much as the recipe."""
    def by_seed(key: str) -> dict[str, dict]:
        return {label: {r["seed"]: r[key] for r in members if r[key] is not None}
                for label, members in groups.items()}

    loss_rows = {row["name"]: row for row in seed_rows(by_seed("val_loss"))}
    bpb_rows = seed_rows(by_seed("val_bpb"), baseline, kind="difference")
    base = groups[baseline][0]
    lines = [f"| group | arch | seeds | val loss (nats/token, mean ± sd) | val BPB (mean ± sd) | BPB − {baseline} "
             "(paired, 95% t) | excludes 0 |", "|---|---|---|---:|---:|---:|---|"]
    rows = []
    for row in bpb_rows:
        members = groups[row["name"]]
        loss = loss_rows[row["name"]]
        if row["name"] != baseline and not _same_data(members[0], base):
            row.pop("paired", None)
            row.pop("verdict", None)
            row["unpaired"] = f"other data than {baseline}"
            cells = ("– (other data)", "–")
        else:
            paired = row.get("paired")
            cells = ("(baseline)", "") if paired is None else (
                format_comparison(paired), {True: "yes", False: "no", None: "–"}[paired["excludes"]])
        seeds = ", ".join(str(m["seed"]) for m in members)
        lines.append(f"| {row['name']} | {members[0]['arch']} | {seeds} | {_spread(loss)} | "
                     f"{_spread(row)} | {cells[0]} | {cells[1]} |")
        rows.append({"group": row["name"], "runs": [m["label"] for m in members], "val_loss": loss, "val_bpb": row})
    return "\n".join(lines), rows


def grouping_notes(runs: list[dict], groups: dict[str, list[dict]], baseline: str | None = None) -> list[str]:
    """One line per difference that keeps runs apart although their configs agree (other data under
    the same name, another tokenizer file), per group not paired with the baseline for its data, and
    one when the runs' tokenizers differ (their per-token losses do not compare)."""
    notes = []
    by_config: dict[str, list[dict]] = {}
    for r in runs:
        key = json.loads(r.get("group_key", "{}")).get("recipe")
        by_config.setdefault(json.dumps(key, sort_keys=True, default=str), []).append(r)
    for members in by_config.values():
        if len({m.get("data_key") for m in members}) > 1:
            notes.append("not grouped as seeds, trained on other data: " + "; ".join(
                f"{m['label']}: {_data_text(m['data'])}" for m in members))
        if len({m.get("tokenizer") for m in members}) > 1:
            notes.append("not grouped as seeds, other tokenizers: " + "; ".join(
                f"{m['label']}: {m['tokenizer']}" for m in members))
    if baseline is not None and baseline in groups:
        base = groups[baseline][0]
        for label, members in groups.items():
            if label != baseline and not _same_data(members[0], base):
                notes.append(f"{label} is not paired with {baseline}: other data ({_data_text(members[0]['data'])} "
                             f"vs {_data_text(base['data'])})")
    tokenizers = {r.get("tokenizer") for r in runs}
    if len(tokenizers) > 1:
        notes.append(f"the runs use {len(tokenizers)} different tokenizers (column `tokenizer`): val loss is nats per "
                     "token of each run's own tokenizer and does not compare across them; compare val BPB "
                     "(bits per byte), which does")
    return notes


CHECKPOINT_STEP = re.compile(r"step_0*(\d+)$")  # a checkpoint folder's name: step_00000020


def _scored_as(payload: dict) -> str:
    """What a task result scored, as its column says: the decoding tag (which, since eval records
    them, also names the quantization and a checkpoint chosen by step), the quantization where the
    tag does not say it, and the checkpoint's step."""
    tag = str(payload.get("tag", "default"))
    quantize = payload.get("quantize")
    if isinstance(quantize, str) and quantize not in tag.split("-"):
        tag += f"-{quantize}"
    step = payload.get("step")
    if not is_int(step):
        found = CHECKPOINT_STEP.search(str(payload.get("checkpoint", "")).rstrip("/"))
        step = int(found.group(1)) if found else None
    if step is None or f"step{step}" in tag.split("-"):
        return tag
    return f"{tag}, step {step}"


def collect_task_columns(runs: list[dict]) -> tuple[list[tuple[str, str]], dict[tuple[str, str], dict], list[str]]:
    """Columns (run label, tag), {(label, tag): {task: cell}} and the task rows in display order."""
    columns: list[tuple[str, str]] = []
    cells: dict[tuple[str, str], dict] = {}
    tasks: set[str] = set()
    for r in runs:
        for payload in r["evals"]:
            key = (r["label"], _scored_as(payload))
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


def _val_metric(runs: list[dict], per_token: bool = True) -> tuple[str, str]:
    """(val row key, axis label): BPB when every run logged it (comparable across tokenizers), else loss;
    BPB always where the runs' tokenizers differ (`per_token` False: a loss per token does not compare)."""
    if not per_token or (runs and all(run["val"] and all(row.get("val_bpb") is not None for row in run["val"])
                                      for run in runs)):
        return "val_bpb", "validation BPB (bits/byte)"
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
        if row.get(metric) is None:  # a point that did not log this metric (BPB under mixed tokenizers)
            continue
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
    plt = pyplot()
    if plt is None:
        return [], [f"matplotlib is not installed: plots skipped ({PLOT_EXTRA})"]
    written: list[str] = []
    notes: list[str] = []
    groups = groups or {run["label"]: [run] for run in runs}
    per_token = len({run.get("tokenizer") for run in runs}) <= 1  # nats per token compare under one tokenizer only
    metric, metric_label = _val_metric(runs, per_token)
    if not per_token:
        notes.append("the runs' tokenizers differ: the plots show validation BPB only (no per-token training loss)")
        unplotted = [r["label"] for r in runs if not any(row.get("val_bpb") is not None for row in r["val"])]
        if unplotted:
            notes.append(f"no validation BPB logged, left out of the plots: {', '.join(unplotted)}")
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
                if train and per_token:
                    train_ax.plot(*zip(*train), color=color, alpha=0.25, linewidth=0.8)
                    drawn = True
            # a seed with no validation point (an empty or cut log) left out of its group's curve, said:
            # the group's mean ran over the points every seed reached, which were then none
            plotted = [m for m in members if any(row.get(metric) is not None for row in m["val"])]
            if plotted and len(plotted) < len(members):
                note = (f"{', '.join(m['label'] for m in members if m not in plotted)}: no validation points "
                        f"logged, left out of {name}'s curve")
                notes += [note] if note not in notes else []
            xs, mean, sd = group_curve(plotted, key, metric) if plotted else ([], [], [])
            seeds = f", {len(plotted)} seeds, ± sd" if len(plotted) > 1 else ""
            if xs:
                ax.plot(xs, mean, color=color, marker="o", label=f"{name} ({members[0]['arch']}{seeds})")
                if len(plotted) > 1:
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
        if per_token:
            train_ax.set_ylabel("training loss (nats/token, thin)", alpha=0.6)
        else:
            train_ax.set_axis_off()
        ax.set_title(f"{metric_label.split(' (')[0]} vs {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        save_figure(fig, out / filename, dpi=120)
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
    resolved = [Path(path).resolve() for path in paths]
    twice = next((path for path, where in zip(paths, resolved) if resolved.count(where) > 1), None)
    if twice is not None:  # it would count as two seeds of one recipe, and narrow their interval
        raise ConfigError(f"run {twice} is named twice")
    for path in paths:  # a wrong folder is named before the progress bar starts
        _config_file(Path(path))
    check_output_folder(out, "--out")  # a file in its way, too; it is made once the runs are read
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
    # created only now that every run and the baseline are read: a mistyped run left an empty --out behind
    out = output_folder(out, "--out")
    table = runs_table(runs)
    tasks = tasks_table(runs)
    plots, notes = plot_losses(runs, out, groups)
    shown_groups = any(len(members) > 1 for members in groups.values())
    notes = grouping_notes(runs, groups, baseline if shown_groups else None) + notes
    notes += [f"{r['run']}/metrics.jsonl: {r['damaged_metric_lines']} damaged line"
              f"{'s' * (r['damaged_metric_lines'] != 1)} (not UTF-8, not JSON or not a row of numbers) left out"
              for r in runs if r["damaged_metric_lines"]]
    parts = ["# latentloop compare", "", table, "",
             f"_val loss and BPB: the training-time estimate, the first {_batches_text(runs)} of the validation "
             "split as `train` logged them (`latentloop eval RUN` scores the whole split)._", ""]
    seeds_table, seed_summary = (None, [])
    if shown_groups:
        seeds_table, seed_summary = groups_table(groups, baseline)
        parts += ["## Over seeds", "", seeds_table, "",
                  "_Groups: runs whose configs differ only in the seed (and in settings that cannot change results: "
                  f"{', '.join(INERT_SETTINGS)}), trained on the same data (recorded checksums) with the same "
                  "tokenizer. Groups on other data than the baseline are not paired with it. A difference excludes 0 "
                  "when its 95% t-interval over the paired seeds does; otherwise the groups are not told apart._", ""]
    if tasks:
        parts += ["## CORE and task accuracy per decoding regime", "", tasks, ""]
    else:
        notes.append("no task results in RUN/evals/ (run `latentloop eval RUN --tasks core` first; `--eval-dir PATH` "
                     "names the task files where they are not downloaded)")
    for plot in plots:
        parts += [f"![{plot[:-4].replace('_', ' ')}]({plot})", ""]
    notes = list(dict.fromkeys(notes + scoring_notes(r.get("arch") for r in runs)))
    parts += [f"_{note}_" for note in notes]
    markdown = "\n".join(parts).rstrip() + "\n"
    report = out / "compare.md"
    write_text_atomic(report, markdown)
    slim = [{k: v for k, v in r.items() if k not in ("train", "val", "recipe", "group_key", "data_key")} for r in runs]
    payload = json_safe({"runs": slim, "groups": seed_summary, "baseline": baseline})  # strict JSON: NaN as null
    write_text_atomic(out / "compare.json", json.dumps(payload, indent=2, default=str, allow_nan=False) + "\n")
    return {"markdown": "\n\n".join(p for p in (table, seeds_table, tasks) if p), "report": str(report),
            "plots": plots, "notes": notes, "runs": slim, "groups": seed_summary, "baseline": baseline}


def _batches_text(runs: list[dict]) -> str:
    counts = sorted({r["eval_batches"] for r in runs})
    return " / ".join(map(str, counts)) + (" batch" if counts == [1] else " batches")


__all__ = ["collect_task_columns", "compare_runs", "group_curve", "groups_table", "plot_losses", "read_evals",
           "read_run", "runs_table", "seed_groups", "tasks_table"]
