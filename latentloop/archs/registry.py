"""`ArchSpec` and the one registry, `ARCHS` (as torchtitan's `ModelSpec`): everything the rest of the
system knows of an architecture comes from its spec, which the architecture's own package registers.

    spec = get_arch("fbt")
    model = spec.build_model(spec.config_class(n_layer=2))
    objective = spec.build_objective(model.config, TrainConfig())

A spec bundles the config class, the model class (which declares its inference options, scoring modes
and the model-level hooks: `upcycle_from`, `fast_path_blocker`, `prepare_fast_decoding`, ...), the
training objective, and the hooks the layers above call by name instead of knowing the architecture:
optimizer parameter groups, analyses, demo report lines, the fast path's cache adapters, the cases
benchmarks and tests run it in, and the cheaper draft of itself it offers for self-speculative
decoding (`draft`, from its model class, turned on by decoding options it declares). Front-ends, tests
and benchmarks enumerate `ARCHS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from ..config import ModelConfig, TrainConfig
from ..errors import ConfigError
from ..models.backbone import GPT, Draft
from ..models.options import DecodeOption, all_options
from ..objectives.base import Objective
from ..optim import build_optimizers
from ..util import first_line


@dataclass(frozen=True)
class ParamGroup:
    """Parameters an architecture trains with settings of their own (AdamW, never Muon): `lr` None
    keeps the run's learning rate; the group is scheduled like the rest."""

    params: list[nn.Parameter]
    lr: float | None = None
    weight_decay: float = 0.0


@dataclass(frozen=True)
class AnalysisOption:
    """A setting of an analysis: the CLI's `--name` flag (underscores as dashes) and its keyword."""

    name: str
    type: type
    default: Any
    help: str
    minimum: float | None = None  # the smallest value allowed (None: any)
    maximum: float | None = None  # the largest (None: any): a bound on asked-for work, as decoding's options have


@dataclass(frozen=True)
class Analysis:
    """A `latentloop analyze` kind an architecture offers. `run(model, x, y, context, **options)` computes
    it on a validation batch (x, y) of the run (`context`: its tokenizer and config, whether to show
    progress, and `task_accuracy(options)` for a run trained on a built-in task) and returns a JSON-able
    dict; `plot(plt, result)` draws it (matplotlib, when installed); `summary(result)` is the line the
    CLI prints. `batches` x `batch_size` rows of validation data by default."""

    help: str
    run: Callable[..., dict[str, Any]]
    summary: Callable[[dict[str, Any]], str]
    plot: Callable[[Any, dict[str, Any]], Any] | None = None
    options: tuple[AnalysisOption, ...] = ()
    batches: int = 1
    batch_size: int = 8


@dataclass(frozen=True)
class AnalysisContext:
    """What an analysis gets beside the model and its batch (`latentloop.analysis` fills it in)."""

    tokenizer: Any
    config: Any  # the run's RunConfig
    task: str | None  # the built-in task (`task:NAME`) the run was trained on, if any
    # (decoding options, examples) -> {"accuracy", "accuracy_ci", "n", "distinct"} on the task
    task_accuracy: Callable[[dict[str, Any], int], dict[str, Any]]
    progress: Callable[..., Any]  # progress(iterable, total=None, desc="") -> the iterable, with a bar when shown


def _no_groups(model: nn.Module, train: TrainConfig) -> list[ParamGroup]:
    return []


def _no_demo_lines(history: list[dict[str, Any]], config: ModelConfig) -> list[str]:
    return []


def _frozen(mapping: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class ArchSpec:
    name: str
    summary: str  # one line for --help and reports
    config_class: type[ModelConfig]
    model_class: type[GPT]
    objective_class: type[Objective]
    # optimizer: extra AdamW groups (e.g. lrt's residual scalars with their own lr), taken out of the others
    param_groups: Callable[[nn.Module, TrainConfig], list[ParamGroup]] = _no_groups
    # `latentloop analyze NAME`: the analyses this architecture offers
    analyses: Mapping[str, Analysis] = field(default_factory=_frozen)
    # `latentloop eval --passes-curve`: the eval curves it offers, name -> curve(model, x (B, T), y (B, T)) ->
    # {point: per-token losses (B, T)}, summed over the text by `eval.loss.score_curve` (fbt's `passes_curve`)
    curves: Mapping[str, Callable[[nn.Module, Tensor, Tensor], dict[str, Tensor]]] = field(default_factory=_frozen)
    # the demo's report: lines about a run from its logged metrics (rgpt's gates per recurrence step)
    demo_lines: Callable[[list[dict[str, Any]], ModelConfig], list[str]] = _no_demo_lines
    # the fast decode path: cache class -> a mixin put before the static mode's (rgpt's core-step views)
    static_cache_mixins: Mapping[type, type] = field(default_factory=_frozen)
    # benchmarks: the training configurations (label -> config overrides) and decoding options (label ->
    # options) that show this architecture's costs; "" labels its plain case
    train_cases: Mapping[str, dict[str, Any]] = field(default_factory=lambda: _frozen({"": {}}))
    decode_cases: Mapping[str, dict[str, Any]] = field(default_factory=lambda: _frozen({"": {}}))
    # tests: config overrides under which a training forward draws no random numbers (exact comparisons)
    deterministic: Mapping[str, Any] = field(default_factory=_frozen)

    def __post_init__(self) -> None:
        for name in ("analyses", "curves", "static_cache_mixins", "train_cases", "decode_cases", "deterministic"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        if getattr(self.config_class, "arch", None) != self.name:
            raise ValueError(f"spec {self.name!r} names a config class of arch "
                             f"{getattr(self.config_class, 'arch', None)!r}")
        if self.draft is not None and self.model_class.CARRIED_STATE \
                and self.model_class.keep_verified is GPT.keep_verified:
            # the default keeps the verified tokens' keys and values only: the carried state would be
            # the last drafted token's, and decoding would go on from a token it took back
            raise ValueError(f"spec {self.name!r}: {self.model_class.__name__} drafts itself and carries "
                             f"{', '.join(self.model_class.CARRIED_STATE)} from token to token, so it must "
                             "override keep_verified to restore it to the last kept token's")

    @property
    def options(self) -> tuple[DecodeOption, ...]:
        """The declared inference options (name, type, choices, default, help, cache need)."""
        return self.model_class.OPTIONS

    @property
    def draft(self) -> Callable[[GPT, dict], Draft | None] | None:
        """A cheaper draft of the model (self-speculative decoding), or None when the arch offers
        none: the model class's `draft_options(model, options)`, which maps complete decoding
        options to the draft's (the same weights and cache at fewer recurrence steps) and the
        tokens it drafts a round, and is turned on by options the arch declares (`draft_steps`,
        `draft_tokens`), so every front-end gets them as it gets any option."""
        hook = self.model_class.draft_options
        return None if hook is GPT.draft_options else hook

    @property
    def upcycles(self) -> bool:
        """Whether a gpt run's weights can start this arch (`--init-from` a gpt run: the model class
        maps them in its own `upcycle_from`; gpt itself loads them as they are)."""
        return self.model_class.upcycle_from is not GPT.upcycle_from

    @property
    def scoring_modes(self) -> Callable[[ModelConfig], dict[str, dict]]:
        """config -> {label: options}: the ways `eval` scores a model of this arch by default."""
        return self.model_class.scoring_modes

    def offers(self, analysis: str) -> bool:
        """Whether `latentloop analyze` (or eval's curve) of this name runs on this architecture."""
        return analysis in self.analyses or analysis in self.curves

    def notes_for(self, labels) -> list[str]:
        """The caveats to print beside the scoring modes `labels` (e.g. fbt's soft BPB)."""
        return [note for label, note in self.model_class.SCORING_NOTES.items() if label in labels]

    def build_model(self, config: ModelConfig) -> GPT:
        if not isinstance(config, self.config_class):
            raise ConfigError(f"arch {self.name!r} needs a {self.config_class.__name__}, got {type(config).__name__}")
        try:
            return self.model_class(config)
        except torch.OutOfMemoryError as exc:
            raise self._does_not_fit(config, exc) from None
        except RuntimeError as exc:  # the CPU allocator's failure is a plain RuntimeError
            if "allocate" not in str(exc):
                raise
            raise self._does_not_fit(config, exc) from None

    def _does_not_fit(self, config: ModelConfig, exc: Exception) -> ConfigError:
        """A model too large for the memory it is built in (a typo'd n_embd, a checkpoint's config that
        says sequence_len 1e9): one line with what it needs, counted on the meta device, not torch's
        allocator traceback."""
        with torch.device("meta"):
            shapes = self.model_class(config)
        weights = sum(p.numel() * p.element_size() for p in shapes.parameters())
        buffers = sum(b.numel() * b.element_size() for b in shapes.buffers())  # RoPE tables: sequence_len rows

        def size(n: int) -> str:
            return f"{n / 2 ** 30:,.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:,.1f} MiB"

        return ConfigError(f"cannot build the {self.name} model: its weights take {size(weights)} and its buffers "
                           f"(RoPE tables, sequence_len {config.sequence_len:,}) {size(buffers)}, more than this "
                           f"machine could allocate ({first_line(exc)[:120]})")

    def build_objective(self, model_config: ModelConfig, train_config: TrainConfig) -> Objective:
        return self.objective_class(model_config, train_config)

    def build_optimizers(self, model: nn.Module, train: TrainConfig,
                         products_dtype: str = "float32") -> list[torch.optim.Optimizer]:
        """The run's optimizers (`optim.build_optimizers`) with this architecture's own parameter groups."""
        own = [{"params": group.params, "lr": group.lr, "weight_decay": group.weight_decay}
               for group in self.param_groups(model, train)]
        return build_optimizers(model, train, products_dtype, own_groups=own)


ARCHS: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    """Add `spec` to the registry; a name already registered is refused (a second package under the
    same name would silently replace the first's model for every front-end)."""
    if spec.name in ARCHS:
        raise ValueError(f"an architecture named {spec.name!r} is registered already (by "
                         f"{ARCHS[spec.name].model_class.__module__}): choose another name")
    ARCHS[spec.name] = spec
    _install_cache_mixins(spec)
    return spec


def _install_cache_mixins(spec: ArchSpec) -> None:
    if spec.static_cache_mixins:
        from ..inference.fast import register_static_mixin

        for cache_class, mixin in spec.static_cache_mixins.items():
            register_static_mixin(cache_class, mixin)


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
    return [name for name, spec in ARCHS.items() if spec.offers(analysis)]


def option_union() -> dict[str, tuple[DecodeOption, list[str]]]:
    """Every arch's options by name, with the archs that declare each (for CLI flags and servers)."""
    return all_options((spec.name, spec.options) for spec in ARCHS.values())


def scoring_notes(arch_names) -> list[str]:
    """The caveats of every scoring mode of the registered archs among `arch_names`, each once (a
    variant shares its parent's: rfbt's soft BPB is fbt's), in the order the archs come."""
    return list(dict.fromkeys(note for name in dict.fromkeys(arch_names) if name in ARCHS
                              for note in ARCHS[name].model_class.SCORING_NOTES.values()))
