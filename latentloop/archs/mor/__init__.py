"""mor: Mixture-of-Recursions, the RecurrentGPT paper's baseline. A shared core whose routers choose which
tokens take each further recursion (expert choice or token choice) (`model.py`, `objective.py`)."""

from ..registry import ArchSpec, register
from .model import MoR, MoRConfig
from .objective import RoutedRecursionObjective

SPEC = register(ArchSpec(
    "mor", "Mixture-of-Recursions: a shared core, routers choose which tokens recur", MoRConfig, MoR,
    RoutedRecursionObjective,
    train_cases={"expert choice": {"routing": "expert"}, "token choice": {"routing": "token"}}))
