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

Parameters and FLOPs per token come from the run's config (the model is built on the `meta`
device: no memory, no weights read); training FLOPs are those the trainer logged, else FLOPs per
token (the objective's run average: multi-pass K, recurrence depth, ...) times tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..archs import ARCHS
from ..config import RunConfig
from ..errors import CheckpointError, ConfigError, LatentloopError
from .core import CORE_TASKS

EVALS_DIR = "evals"


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted run
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _model_facts(config: RunConfig) -> tuple[int | None, float | None]:
    """(parameters, training FLOPs per token) from the config, building the model on `meta`."""
    from ..archs import build_model, build_objective

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


def read_run(path: str | Path) -> dict[str, Any]:
    """Everything compare needs from one run folder."""
    run_dir = Path(path)
    config_file = run_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{run_dir} is not a run folder (no config.json)")
    try:
        config = RunConfig.from_dict(json.loads(config_file.read_text()))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"corrupt {config_file}: {exc}") from None
    except ConfigError as exc:
        raise CheckpointError(f"{config_file} is invalid: {exc}") from None
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r and "step" in r]
    val = [r for r in rows if "val_loss" in r and "step" in r]
    params, flops_per_token = _model_facts(config)
    last = train[-1] if train else {}
    tokens = last.get("tokens")
    flops = last.get("flops")
    if flops is None and tokens is not None and flops_per_token is not None:
        flops = flops_per_token * tokens
    final_val = val[-1] if val else {}
    return {"run": str(run_dir), "name": run_dir.resolve().name, "arch": config.model.arch, "params": params,
            "steps": last.get("step"), "tokens": tokens, "flops": flops, "flops_per_token": flops_per_token,
            "val_loss": final_val.get("val_loss"), "val_bpb": final_val.get("val_bpb"), "train": train,
            "val": val, "evals": read_evals(run_dir)}


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def _num(value: Any, fmt: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
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


def _val_axis(run: dict, key: str) -> tuple[list[float], list[float]]:
    """Validation losses against training tokens or FLOPs (interpolated from the training log)."""
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
        ys.append(row["val_loss"])
    return xs, ys


def plot_losses(runs: list[dict], out: Path) -> tuple[list[str], list[str]]:
    """Write loss_vs_tokens.png and loss_vs_flops.png; returns (file names, notes)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], ["matplotlib is not installed: plots skipped (pip install 'latentloop[plot]')"]
    written, notes = [], []
    for key, label, filename in (("tokens", "training tokens", "loss_vs_tokens.png"),
                                 ("flops", "training FLOPs", "loss_vs_flops.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        drawn = False
        for i, run in enumerate(runs):
            color = f"C{i % 10}"
            train = [(r[key], r["loss"]) for r in run["train"] if r.get(key) is not None]
            if key == "flops" and not train and run["flops_per_token"] is not None:
                train = [(r["tokens"] * run["flops_per_token"], r["loss"]) for r in run["train"]
                         if r.get("tokens") is not None]
            if train:
                ax.plot(*zip(*train), color=color, alpha=0.3, linewidth=1)
                drawn = True
            xs, ys = _val_axis(run, key)
            if xs:
                ax.plot(xs, ys, color=color, marker="o", label=f"{run['label']} ({run['arch']}) val")
                drawn = True
            elif train:
                ax.plot([], [], color=color, label=f"{run['label']} ({run['arch']}) train")
        if not drawn:
            plt.close(fig)
            notes.append(f"no logged {label} to plot")
            continue
        ax.set_xlabel(label)
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(f"validation loss vs {label} (thin: training loss)")
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


def compare_runs(paths: list[str | Path], out: str | Path = "compare") -> dict[str, Any]:
    """Read the runs, write DIR/compare.md (+ PNG plots, compare.json); returns the report."""
    if not paths:
        raise ConfigError("give at least one run folder")
    runs = [read_run(p) for p in paths]
    _labels(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = runs_table(runs)
    tasks = tasks_table(runs)
    plots, notes = plot_losses(runs, out)
    parts = ["# latentloop compare", "", table, ""]
    if tasks:
        parts += ["## CORE and task accuracy per decoding regime", "", tasks, ""]
    else:
        notes.append("no task results in RUN/evals/ (run `latentloop eval RUN --tasks core` first)")
    for plot in plots:
        parts += [f"![{plot[:-4].replace('_', ' ')}]({plot})", ""]
    for arch in dict.fromkeys(r.get("arch") for r in runs):  # each arch's caveats once (e.g. fbt's soft BPB)
        spec = ARCHS.get(arch)
        notes += [] if spec is None else list(spec.model_class.SCORING_NOTES.values())
    parts += [f"_{note}_" for note in notes]
    markdown = "\n".join(parts).rstrip() + "\n"
    report = out / "compare.md"
    report.write_text(markdown)
    slim = [{k: v for k, v in r.items() if k not in ("train", "val")} for r in runs]
    (out / "compare.json").write_text(json.dumps({"runs": slim}, indent=2, default=str) + "\n")
    return {"markdown": "\n\n".join(p for p in (table, tasks) if p), "report": str(report), "plots": plots,
            "notes": notes, "runs": slim}


__all__ = ["collect_task_columns", "compare_runs", "plot_losses", "read_evals", "read_run", "runs_table",
           "tasks_table"]
