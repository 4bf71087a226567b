"""One spec per architecture, one registry (as torchtitan's `ModelSpec`).

An `ArchSpec` bundles what the rest of the system needs to know about an architecture: its config
class, model class, training objective, declared inference options and scoring modes. Front-ends
derive from it instead of re-listing: the CLI's `--arch` choices and option flags, `eval`'s
default scoring modes, the lm-eval `model_args` and the server's request fields.

    spec = get_arch("fbt")
    model = spec.build_model(spec.config_class(n_layer=2))
    objective = spec.build_objective(model.config, TrainConfig())

It lives above `models` and `objectives` (it imports both), so that models keep importing only
the config. A new architecture adds a config subclass (with its `arch` name), a model class with
its `OPTIONS`, an objective, and one `register(ArchSpec(...))`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import ModelConfig, TrainConfig
from .errors import ConfigError
from .models.backbone import GPT
from .models.fbt import FBT, FBTConfig
from .models.lrt import LRT, LRTConfig
from .models.mor import MoR, MoRConfig
from .models.options import DecodeOption, all_options
from .models.rfbt import RFBT, RFBTConfig
from .models.rgpt import RGPT, RGPTConfig
from .objectives.base import NextTokenObjective, Objective
from .objectives.fbt import MultiPassObjective
from .objectives.lrt import LRTObjective
from .objectives.mor import RoutedRecursionObjective
from .objectives.rfbt import RecurrentMultiPassObjective
from .objectives.rgpt import RecurrentDepthObjective


@dataclass(frozen=True)
class ArchSpec:
    name: str
    summary: str  # one line for --help and reports
    config_class: type[ModelConfig]
    model_class: type[GPT]
    objective_class: type[Objective]

    @property
    def options(self) -> tuple[DecodeOption, ...]:
        """The declared inference options (name, type, choices, default, help, cache need)."""
        return self.model_class.OPTIONS

    @property
    def scoring_modes(self) -> Callable[[ModelConfig], dict[str, dict]]:
        """config -> {label: options}: the ways `eval` scores a model of this arch by default."""
        return self.model_class.scoring_modes

    @property
    def analyses(self) -> frozenset[str]:
        """The `latentloop analyze` kinds (and eval curves) the model offers."""
        return self.model_class.ANALYSES

    def notes_for(self, labels) -> list[str]:
        """The caveats to print beside the scoring modes `labels` (e.g. fbt's soft BPB)."""
        return [note for label, note in self.model_class.SCORING_NOTES.items() if label in labels]

    def build_model(self, config: ModelConfig) -> GPT:
        if not isinstance(config, self.config_class):
            raise ConfigError(f"arch {self.name!r} needs a {self.config_class.__name__}, got {type(config).__name__}")
        return self.model_class(config)

    def build_objective(self, model_config: ModelConfig, train_config: TrainConfig) -> Objective:
        return self.objective_class(model_config, train_config)


ARCHS: dict[str, ArchSpec] = {}


def scoring_notes(arch_names) -> list[str]:
    """The caveats of every scoring mode of the registered archs among `arch_names`, each once (a
    variant shares its parent's: rfbt's soft BPB is fbt's), in the order the archs come."""
    return list(dict.fromkeys(note for name in dict.fromkeys(arch_names) if name in ARCHS
                              for note in ARCHS[name].model_class.SCORING_NOTES.values()))


def register(spec: ArchSpec) -> ArchSpec:
    if spec.config_class.arch != spec.name:
        raise ValueError(f"spec {spec.name!r} names a config class of arch {spec.config_class.arch!r}")
    ARCHS[spec.name] = spec
    return spec


register(ArchSpec("gpt", "nanochat-style decoder (the baseline)", ModelConfig, GPT, NextTokenObjective))
register(ArchSpec("fbt", "full-bandwidth transformer: the previous top state re-enters the stack", FBTConfig, FBT,
                  MultiPassObjective))
register(ArchSpec("lrt", "latent recurrent transformer: the previous token's state in keys/values and residual",
                  LRTConfig, LRT, LRTObjective))
register(ArchSpec("rgpt", "RecurrentGPT: prelude, gated shared core x R, coda", RGPTConfig, RGPT,
                  RecurrentDepthObjective))
register(ArchSpec("rfbt", "rgpt's recurrent depth with fbt's latent feedback (latentloop's own)", RFBTConfig, RFBT,
                  RecurrentMultiPassObjective))
register(ArchSpec("mor", "Mixture-of-Recursions: a shared core, routers choose which tokens recur", MoRConfig, MoR,
                  RoutedRecursionObjective))


def get_arch(name: str) -> ArchSpec:
    if name not in ARCHS:
        raise ConfigError(f"unknown arch {name!r}: choose from {', '.join(ARCHS)}")
    return ARCHS[name]


def build_model(config: ModelConfig) -> GPT:
    """The model of `config.arch`, freshly initialised."""
    return get_arch(config.arch).build_model(config)


def build_objective(model_config: ModelConfig, train_config: TrainConfig) -> Objective:
    return get_arch(model_config.arch).build_objective(model_config, train_config)


def offering(analysis: str) -> list[str]:
    """The archs that offer `analysis` (for a one-line refusal naming them)."""
    return [name for name, spec in ARCHS.items() if analysis in spec.analyses]


def option_union() -> dict[str, tuple[DecodeOption, list[str]]]:
    """Every arch's options by name, with the archs that declare each (for CLI flags and servers)."""
    return all_options((spec.name, spec.options) for spec in ARCHS.values())
