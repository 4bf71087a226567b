"""rfbt: latentloop's own composition of rgpt's recurrent depth (its stack) with fbt's latent feedback (its
passes). The model and objective combine the two (`model.py`, `objective.py`); fbt's analyses run on it."""

from ..fbt import DETERMINISTIC as FBT_DETERMINISTIC
from ..fbt.analyses import ANALYSES, CURVES
from ..registry import ArchSpec, register
from ..rgpt import demo_lines
from ..rgpt.fast import StaticRecurrentCache
from ..rgpt.model import RecurrentKVCache
from .model import RFBT, RFBTConfig
from .objective import RecurrentMultiPassObjective

SPEC = register(ArchSpec(
    "rfbt", "rgpt's recurrent depth with fbt's latent feedback (latentloop's own)", RFBTConfig, RFBT,
    RecurrentMultiPassObjective, analyses=ANALYSES, curves=CURVES, demo_lines=demo_lines,
    static_cache_mixins={RecurrentKVCache: StaticRecurrentCache},
    decode_cases={"soft": {"regime": "soft"}, "fused K=2": {"regime": "fused", "passes": 2}},
    deterministic={**FBT_DETERMINISTIC, "noise_std": 0.0}))
