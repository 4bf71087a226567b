"""rgpt: RecurrentGPT. Prelude, a gated shared core applied R times, coda; random depth in training, early
exit in decoding (`model.py`, `objective.py`); the depth analysis (`analyses.py`); its cache in the fast
decode path's static mode (`fast.py`)."""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..registry import ArchSpec, register
from .analyses import ANALYSES
from .fast import StaticRecurrentCache
from .model import RGPT, RecurrentKVCache, RGPTConfig
from .objective import RecurrentDepthObjective

GATE_METRICS = ("openness_r", "gate_mean_r")  # logged per recurrence step r on logging steps


def gates_line(gates: dict[str, float]) -> str:
    """'r=1: mean gate 0.52, effective openness 0.41; r=2: ...' from openness_rN / gate_mean_rN readings."""
    steps = sorted(int(k[len("openness_r"):]) for k in gates if k.startswith("openness_r"))
    return "; ".join(f"r={r}: mean gate {gates.get(f'gate_mean_r{r}', float('nan')):.3f}, effective openness "
                     f"‖Δh‖/‖o‖ {gates[f'openness_r{r}']:.3f}" for r in steps)


def demo_lines(history: list[dict[str, Any]], config: ModelConfig) -> list[str]:
    """Each recurrence step's latest logged mean gate and openness (a logged step ran its drawn depth r
    only, so deeper steps come from earlier rows)."""
    gates: dict[str, float] = {}
    for row in history:
        gates |= {k: v for k, v in row.items() if k.startswith(GATE_METRICS)}
    if not gates:
        return []
    return [f"gates (R = {getattr(config, 'recurrence_steps', None)}), each step r at the last logged step that "
            f"ran it: " + gates_line(gates)]


DECODE_CASES = {f"{mode} cache": {"cache_mode": mode} for mode in ("full", "mean", "last")}

SPEC = register(ArchSpec(
    "rgpt", "RecurrentGPT: prelude, gated shared core x R, coda", RGPTConfig, RGPT, RecurrentDepthObjective,
    analyses=ANALYSES, demo_lines=demo_lines, static_cache_mixins={RecurrentKVCache: StaticRecurrentCache},
    decode_cases=DECODE_CASES, deterministic={"noise_std": 0.0}))
