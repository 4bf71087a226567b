"""Task suites: run CORE and generation tasks by name and keep the results in the run folder.

    results = run_tasks(model, tokenizer, "core,gsm8k", data_dir="../shared/data/eval",
                        options={"regime": "soft"}, limit=100, run_dir="runs/fbt")

Names: `core` (all CORE tasks, plus their aggregate), any single CORE task (`arc_easy`), or any
task of `latentloop.eval.generation.GENERATION_TASKS` (when that module is installed). Each result
is written as it completes to `RUN/evals/<name>-<tag>.json` (atomically), where the tag names the
decoding options: the regime or `default`, then any `passes`, `steps`, `prefill`
(e.g. `arc_easy-fused-passes4.json`), then the `variant`: `int8` for a quantized model, `step<N>` for a
checkpoint chosen by step (`arc_easy-default-int8-step10.json`), so such results never replace the
run's own; `core` also writes `core-<tag>.json` with the CORE mean. Each file records the options,
the quantization and the checkpoint (path and step) it scored.
`latentloop compare` reads these files.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ..engine import model_options
from ..errors import ConfigError, DataError
from ..util import write_json_atomic
from . import core

EVALS_DIR = "evals"


def _generation_module():
    """latentloop.eval.generation, or None where it is not available."""
    try:
        from . import generation
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith("generation"):
            return None
        raise
    return generation


def options_tag(options: dict | None) -> str:
    """`soft`, `fused-passes4`, `default-steps8`, ...: the decoding options in a file name, in the order
    the registered architectures declare them: a named mode's value as it is (the first one leads, else
    `default`), any other option as its name and value."""
    from ..archs import option_union

    options = {k: v for k, v in (options or {}).items() if v is not None}
    declared = option_union()
    order = [name for name in declared if name in options] + sorted(set(options) - set(declared))
    is_mode = {name: bool(declared[name][0].choices) if name in declared else False for name in order}
    parts = [] if order and is_mode[order[0]] else ["default"]
    parts += [str(options[name]) if is_mode[name] else f"{name}{options[name]}" for name in order]
    return "-".join(parts)


def variant_tag(tag: str, variant: dict | None, limit: int | None = None) -> str:
    """`tag` with what else changes the scores: the quantization (`int8`), a checkpoint chosen by step
    (`step10`) and a limit on the examples (`limit20`), in that order; unchanged without them. A limited
    run's files are its own: one with another limit replaced them, and CORE's file then disagreed with
    the task files beside it."""
    variant = variant or {}
    parts = [tag]
    if variant.get("quantize"):
        parts.append(str(variant["quantize"]))
    if variant.get("step") is not None:
        parts.append(f"step{variant['step']}")
    if limit is not None:
        parts.append(f"limit{limit}")
    return "-".join(parts)


def result_filename(name: str, tag: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", name).strip("_") or "task"
    return f"{safe}-{tag}.json"


def split_names(names: str | Sequence[str]) -> list[str]:
    if not isinstance(names, str):
        return [str(n).strip() for n in names if str(n).strip()]
    generation = _generation_module()
    if generation is not None and hasattr(generation, "split_task_names"):
        return generation.split_task_names(names)  # keeps knob lists such as addition:digits=3,test=4-5
    return [n.strip() for n in names.split(",") if n.strip()]


def plan_tasks(names: str | Sequence[str]) -> tuple[list[str], list[tuple[str, Any]], bool]:
    """(CORE task names, [(generation task name, function)], whether 'core' was asked for); every
    name is checked before anything runs."""
    core_names: list[str] = []
    generation_tasks: list[tuple[str, Any]] = []
    whole_core = False
    generation = _generation_module()
    for name in split_names(names):
        if name == "core" or name in core.CORE_TASKS:
            whole_core = whole_core or name == "core"
            core_names += [n for n in core.resolve_task_names(name) if n not in core_names]
            continue
        if generation is None:
            raise ConfigError(f"unknown task {name!r}: choose from core, {', '.join(core.CORE_TASKS)}")
        if hasattr(generation, "resolve_generation_task"):
            try:
                fn = generation.resolve_generation_task(name)
            except ConfigError:
                raise ConfigError(f"unknown task {name!r}: choose from core, {', '.join(core.CORE_TASKS)}, "
                                  f"{', '.join(generation.GENERATION_TASKS)}") from None
        elif name in generation.GENERATION_TASKS:
            fn = generation.GENERATION_TASKS[name]
        else:
            raise ConfigError(f"unknown task {name!r}: choose from core, {', '.join(core.CORE_TASKS)}, "
                              f"{', '.join(generation.GENERATION_TASKS)}")
        generation_tasks.append((name, fn))
    if not core_names and not generation_tasks:
        raise ConfigError("no task given")
    return core_names, generation_tasks, whole_core


def _generation_data_dir(data_dir: str | Path | None) -> Path | None:
    """The eval data folder for generation tasks, without downloading (built-in tasks need none)."""
    try:
        return core.resolve_eval_dir(data_dir, download=False)
    except DataError:
        if data_dir is not None:
            raise
        return None


def run_tasks(model: nn.Module, tokenizer, names: str | Sequence[str], data_dir: str | Path | None = None,
              options: dict | None = None, limit: int | None = None, progress: bool = True, *,
              run_dir: str | Path | None = None, batch_size: int = core.DEFAULT_BATCH_SIZE,
              meta: dict | None = None, variant: dict | None = None) -> dict[str, Any]:
    """Run the named tasks; with `run_dir`, write each result to `run_dir/evals/` as it completes.
    `variant`: {"quantize": "int8" or None, "step": a checkpoint's step when one was chosen, else
    None}, named in the tag (and so the file name) and recorded in each file.

    Returns {"tag", "options", "limit", "tasks": {name: result}, "core": CORE summary or None,
    "missing": CORE tasks without data, "files": written paths}.
    """
    options = {k: v for k, v in (options or {}).items() if v is not None}
    model_options(model, options)
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    core_names, generation_tasks, whole_core = plan_tasks(names)
    tag = variant_tag(options_tag(options), variant, limit)
    stamp = {"options": options, "limit": limit, "tag": tag, "quantize": (variant or {}).get("quantize"),
             **(meta or {})}
    folder = Path(run_dir) / EVALS_DIR if run_dir is not None else None
    written: list[str] = []

    def save(name: str, kind: str, result: dict) -> None:
        if folder is None:
            return
        path = folder / result_filename(name, tag)
        write_json_atomic(path, {"task": name, "kind": kind, **stamp,
                                 "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                 "result": result})
        written.append(str(path))

    results: dict[str, dict] = {}
    summary = None
    missing: list[str] = []
    if core_names:
        summary = core.run_core(model, tokenizer, core_names, data_dir, options, limit, batch_size, progress,
                                on_task=lambda name, result: save(name, "core", result))
        results.update(summary["tasks"])
        missing = summary["missing"]
        if whole_core:
            save("core", "core_aggregate", {k: v for k, v in summary.items() if k != "tasks"}
                 | {"accuracy": {n: r["accuracy"] for n, r in summary["tasks"].items()},
                    "centered": {n: r["centered"] for n, r in summary["tasks"].items()}})
    if generation_tasks:
        gen_dir = _generation_data_dir(data_dir)
        for name, fn in generation_tasks:
            result = fn(model, tokenizer, gen_dir, dict(options), limit, progress)
            results[name] = result
            save(name, "generation", result)
    core_summary = None
    if summary is not None:
        core_summary = {"core": summary["core"], "evaluated": summary["evaluated"], "missing": missing,
                        "whole": whole_core, "data_dir": summary["data_dir"], "data_source": summary["data_source"],
                        "seconds": summary["seconds"]}
    return {"tag": tag, "options": options, "limit": limit, "tasks": results, "core": core_summary,
            "missing": missing, "files": written}


def format_suite(result: dict) -> str:
    """Plain-text table of a `run_tasks` result."""
    lines = [core.TASK_HEADER]
    for name, r in result["tasks"].items():
        lines += core.task_lines(name, r)
        generation = _generation_module() if "by_length" in r else None
        if generation is not None and hasattr(generation, "format_by_length"):
            lines += generation.format_by_length(r)  # built-in tasks: accuracy per length beside its baselines
    for name in result.get("missing", []):
        lines.append(f"{name:<34} {'missing (no data file)':>22}")
    summary = result.get("core")
    if summary is not None:
        label = "CORE" if summary["whole"] else "mean centred"
        lines.append(f"{label:<34} {'':>5} {'':>7} {'':>15} {summary['core']:>8.4f} {summary['seconds']:>7.1f}   "
                     f"({summary['evaluated']} tasks)")
        lines.append(f"CORE data: {summary['data_dir']} ({summary['data_source']})")
    return "\n".join(lines)


def run_folder(path: str | Path, checkpoint: Path) -> Path:
    """Where evals of a run are kept: the run folder, also when a checkpoint folder was given."""
    path = Path(path)
    if (path / "model.safetensors").is_file() and checkpoint.parent.name == "checkpoints" \
            and (checkpoint.parent.parent / "config.json").is_file():
        return checkpoint.parent.parent
    return path


__all__ = ["EVALS_DIR", "format_suite", "options_tag", "plan_tasks", "result_filename", "run_folder", "run_tasks",
           "variant_tag"]
