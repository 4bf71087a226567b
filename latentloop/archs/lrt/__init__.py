"""lrt: the Latent Recurrent Transformer. The previous token's state injected into every layer's keys and
values (gated) and its residual stream (`model.py`); interleaved parallel training (`objective.py`)."""

from torch import nn

from ...config import TrainConfig
from ..registry import ArchSpec, ParamGroup, register
from .model import LRT, LRTConfig
from .objective import LRTObjective

RESIDUAL_SCALARS = (".mem_alpha", ".mem_gamma")  # α_l, γ_l: how much of the previous token's state each layer adds


def residual_group(model: nn.Module, train: TrainConfig) -> list[ParamGroup]:
    """α_l, γ_l at their own learning rate when the config sets one (`residual_lr` > 0)."""
    lr = float(getattr(model.config, "residual_lr", 0.0) or 0.0)
    if lr <= 0:
        return []
    scalars = [p for name, p in model.named_parameters() if name.endswith(RESIDUAL_SCALARS) and p.requires_grad]
    return [ParamGroup(scalars, lr=lr, weight_decay=0.0)] if scalars else []


TRAIN_CASES = {"": {}, "interleaved S=2": {"recurrence": "interleaved", "subsets": 2}}
DECODE_CASES = {"sequential prefill": {"prefill": "sequential"}, "interleaved prefill": {"prefill": "interleaved"}}

SPEC = register(ArchSpec(
    "lrt", "latent recurrent transformer: the previous token's state in keys/values and residual", LRTConfig, LRT,
    LRTObjective, param_groups=residual_group, train_cases=TRAIN_CASES, decode_cases=DECODE_CASES))
