"""fbt: the Full-Bandwidth Transformer. The previous position's top state, fused with the token embedding
through a GLU, is the next input (`model.py`); scheduled multi-pass training (`objective.py`); STANDARD /
SOFT / FUSED decoding with the same weights; the contraction and probe analyses (`analyses.py`)."""

from ..registry import ArchSpec, register
from .analyses import ANALYSES, CURVES
from .model import FBT, FBTConfig
from .objective import MultiPassObjective

# training configurations a benchmark times: K passes every step (the default mixes K = 2 and 3)
TRAIN_CASES = {f"K={k}": {"feedback_start": 0.0, "pass_mix": tuple(1.0 if i == k - 1 else 0.0 for i in range(k))}
               for k in (1, 2, 3)}
DECODE_CASES = {"standard": {"regime": "standard"}, "soft": {"regime": "soft"},
                "fused K=2": {"regime": "fused", "passes": 2}}
# multi-pass forced, no jitter: a training forward that draws nothing from the global RNG
DETERMINISTIC = {"feedback_start": 0.0, "pass_mix": (0.0, 1.0), "jitter": 0.0}

SPEC = register(ArchSpec(
    "fbt", "full-bandwidth transformer: the previous top state re-enters the stack", FBTConfig, FBT,
    MultiPassObjective, analyses=ANALYSES, curves=CURVES, train_cases=TRAIN_CASES,
    decode_cases=DECODE_CASES, deterministic=DETERMINISTIC))
