"""`latentloop analyze KIND RUN`: looking inside trained runs, with the analyses the run's architecture
offers (its spec's `analyses`: fbt's contraction and probe, rgpt's depth, ...).

This module is the one driver: it loads the run and a validation batch, hands them to the analysis,
and writes `RUN/analysis/<kind>.json` and, with matplotlib, `<kind>.png` (`<kind>-<setting><value>...`
where a setting differs from its default: `result_name`). What an analysis computes
lives with its architecture (`latentloop/archs/<arch>/analyses.py`).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import torch

from .archs import ARCHS, Analysis, AnalysisContext, get_arch, offering
from .checkpoint import step_in_name
from .data import eval_batches
from .data.chat import ChatData
from .errors import ConfigError
from .runs import load_run
from .runtime import eval_data, output_folder
from .util import json_safe, progress, pyplot, save_figure, write_json_atomic


def available() -> dict[str, Analysis]:
    """Every analysis a registered architecture offers, by name (one object per name: rfbt shares fbt's)."""
    found: dict[str, Analysis] = {}
    for spec in ARCHS.values():
        for name, analysis in spec.analyses.items():
            found.setdefault(name, analysis)
    return found


DATA_DIGEST_CHARS = 8  # of a --data name's sha256, in its result's file name
TASK_SCORE_FIELDS = ("accuracy", "accuracy_ci", "n", "distinct")  # what an analysis gets of a task's report


def _task_accuracy(model, tokenizer, task: str):
    def accuracy(options: dict[str, Any], limit: int) -> dict[str, Any]:
        from .eval.generation import run_generation_tasks

        report = run_generation_tasks(model, tokenizer, [task], options=options, limit=limit, progress=False)[task]
        return {field: report.get(field) for field in TASK_SCORE_FIELDS}  # the figure with its interval and n

    return accuracy


def run_analysis(kind: str, run: str | Path, batches: int | None = None, out: Path | None = None,
                 show_progress: bool = False, data: str | None = None, **options) -> dict[str, Any]:
    """The analysis `kind` of a run (its architecture must offer it), on `batches` validation batches
    (default: the analysis's own) of `data` (default: the run's own data, where `eval` finds it);
    `options` are its settings. Returns the result, with the folder it was written to."""
    model, tokenizer, config, checkpoint = load_run(run)
    spec = get_arch(config.model.arch)
    if kind not in spec.analyses:
        raise ConfigError(f"analyze {kind} needs a run of {' or '.join(offering(kind)) or 'no registered arch'}; "
                          f"this one is {config.model.arch}")
    analysis = spec.analyses[kind]
    # the run's recorded data, read only when it still holds the tokens training recorded (eval's check)
    tokens = eval_data(config, tokenizer, data, progress=False, checkpoint=checkpoint)
    if isinstance(tokens, ChatData):  # rows of conversations, not a token stream (a TypeError before)
        raise ConfigError(f"analyze {kind} reads a stream of text, and {run} was trained on conversations "
                          f"({config.data.source}): give --data (e.g. stdlib or text:PATH)")
    pairs = list(eval_batches(tokens.val, analysis.batch_size, config.model.sequence_len, batches or analysis.batches))
    x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    task = config.data.source if config.data.source.startswith("task:") else None
    context = AnalysisContext(
        tokenizer=tokenizer, config=config, task=task,
        task_accuracy=_task_accuracy(model, tokenizer, task) if task else None,
        progress=lambda items, total=None, desc="": progress(items, total=total, desc=desc, enabled=show_progress))
    result = {"run": str(run), "analysis": kind, **analysis.run(model, x, y, context, **options)}
    from .eval.suite import run_folder

    run_dir = run_folder(run, checkpoint)  # a checkpoint folder outside a run is its own
    chosen = None  # a checkpoint named by path, not the run's latest: kept apart, as `eval --tasks` keeps it
    if Path(run).resolve() != run_dir.resolve():
        step = step_in_name(checkpoint)
        chosen = f"step{step}" if step is not None else checkpoint.name
    name = result_name(kind, analysis, options, batches, data, checkpoint=chosen,
                       run_name=run_dir.resolve().name if out else None)
    result["folder"] = str(_save(run_dir, out, name, result, analysis.plot))
    return result


def result_name(kind: str, analysis, options: dict[str, Any], batches: int | None, data: str | None,
                checkpoint: str | None = None, run_name: str | None = None) -> str:
    """The file stem of an analysis's result: its kind, then each setting that differs from its
    default (`depth-max_steps2`), so that a run analysed with other settings keeps each result (the
    last replaced the first); the data, when named, by a short digest of its name; a checkpoint
    chosen by path, by its step (`step20`); and in a folder of the caller's (`--out`), which other
    runs' results may share, the run's folder name first (`rgpt-s1-depth`). Without these, an earlier
    checkpoint's result replaced the latest's, and one run's another's."""
    defaults = {option.name: option.default for option in analysis.options}
    parts = [kind] + [f"{name}{value:g}" if isinstance(value, float) else f"{name}{value}"
                      for name, value in sorted(options.items()) if value is not None and value != defaults.get(name)]
    if batches is not None and batches != analysis.batches:
        parts.append(f"batches{batches}")
    if data is not None:
        parts.append("data" + hashlib.sha256(data.encode()).hexdigest()[:DATA_DIGEST_CHARS])
    if checkpoint is not None:
        parts.append(checkpoint)
    if run_name is not None:
        parts.insert(0, run_name)
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", "-".join(parts))


def _save(run_dir: Path, out: Path | None, name: str, result: dict[str, Any], plot) -> Path:
    folder = output_folder(Path(out) if out else run_dir / "analysis", "analysis folder")
    # strict JSON: a value with no number (a NaN correlation, a diverged loss) is null; written whole or not at all
    write_json_atomic(folder / f"{name}.json", json_safe(result))
    if plot is None:
        return folder
    plt = pyplot(f"{name}.png")
    if plt is None:
        return folder
    fig = plot(plt, result)
    fig.tight_layout()
    save_figure(fig, folder / f"{name}.png", dpi=120)
    return folder
