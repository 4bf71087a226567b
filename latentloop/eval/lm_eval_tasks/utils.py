"""Data loading for the local lm-eval tasks of this folder (lm-eval imports this file by path)."""

from __future__ import annotations

import json
import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[3]  # the repository, where the package runs from a clone
# ../shared next to the project: looked at only from a checkout (in an installed package the same
# parents name a folder of the Python installation)
SHARED_EVAL_DIR = CHECKOUT.parent / "shared" / "data" / "eval" if (CHECKOUT / "pyproject.toml").is_file() else None


def eval_file(name: str, eval_dir: str | None = None) -> Path:
    """The jsonl file `name` from eval_dir when one is given (only there: a folder the user named that
    lacks it is an error, where the search went on and scored the cached bundle's data instead), else
    from $LATENTLOOP_EVAL_DIR, the cached bundle or ../shared/data/eval."""
    from latentloop.errors import DataError
    from latentloop.runtime import EVAL_DIR_ENV, default_eval_dir

    if eval_dir:
        candidates = [eval_dir]
    else:
        candidates = [os.environ.get(EVAL_DIR_ENV), default_eval_dir(), SHARED_EVAL_DIR]
    for folder in candidates:
        if not folder:
            continue
        folder = Path(folder).expanduser()
        if (folder / name).is_file():
            return folder / name
        found = sorted(folder.rglob(name)) if folder.is_dir() else []
        if found:
            return found[0]
    if eval_dir:
        raise DataError(f"{name} not found in eval_dir {eval_dir} (--metadata): name the folder that holds it")
    raise DataError(f"{name} not found: pass --metadata '{{\"eval_dir\": PATH}}' or set LATENTLOOP_EVAL_DIR")


def load_eval_file(file: str, eval_dir: str | None = None, limit_rows: int | None = None, **unused) -> dict:
    """{"test": Dataset} of one jsonl file, for a task's `custom_dataset`."""
    import datasets

    rows = []
    with open(eval_file(file, eval_dir), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if limit_rows is not None and len(rows) >= limit_rows:
                break
    return {"test": datasets.Dataset.from_list(rows)}
