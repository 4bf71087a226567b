"""`latentloop analyze KIND RUN`: looking inside trained runs, with the analyses the run's architecture
offers (its spec's `analyses`: fbt's contraction and probe, rgpt's depth, ...).

This module is the one driver: it loads the run and a validation batch, hands them to the analysis,
and writes `RUN/analysis/<kind>.json` and, with matplotlib, `<kind>.png`. What an analysis computes
lives with its architecture (`latentloop/archs/<arch>/analyses.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .archs import ARCHS, Analysis, AnalysisContext, get_arch, offering
from .data import eval_batches
from .data.chat import ChatData
from .errors import ConfigError, OutputError
from .runs import load_run
from .runtime import eval_data, output_folder
from .util import json_safe, progress


def available() -> dict[str, Analysis]:
    """Every analysis a registered architecture offers, by name (one object per name: rfbt shares fbt's)."""
    found: dict[str, Analysis] = {}
    for spec in ARCHS.values():
        for name, analysis in spec.analyses.items():
            found.setdefault(name, analysis)
    return found


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
    result["folder"] = str(_save(checkpoint, out, kind, result, analysis.plot))
    return result


def _save(checkpoint: Path, out: Path | None, name: str, result: dict[str, Any], plot) -> Path:
    folder = output_folder(Path(out) if out else checkpoint.parent.parent / "analysis", "analysis folder")
    try:
        # strict JSON: a value with no number (a NaN correlation, a diverged loss) is null
        (folder / f"{name}.json").write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
    except OSError as exc:
        raise OutputError(f"cannot write {folder / f'{name}.json'}: {exc.strerror or exc}") from None
    if plot is None:
        return folder
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return folder
    fig = plot(plt, result)
    fig.tight_layout()
    try:
        fig.savefig(folder / f"{name}.png", dpi=120)
    except OSError as exc:
        raise OutputError(f"cannot write {folder / f'{name}.png'}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return folder
