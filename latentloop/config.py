"""Typed configuration: model, training and data dataclasses, named presets, YAML and overrides.

Every config is a dataclass validated in `__post_init__`; an impossible value raises `ConfigError`
with a one-line message naming the field. Architecture variants subclass `ModelConfig` and add only
their own knobs (including the knobs of their training procedure, as Huginn keeps its mean
recurrence next to the model shape); each variant's config class lives in its model file
(`latentloop/archs/fbt/model.py`: `FBTConfig`, ...), as nanoGPT keeps `GPTConfig` beside `GPT`. This
module holds the backbone's `ModelConfig` (arch `gpt`), training and data configs, and finds a
variant's class by its `arch` name among the subclasses the package has imported (importing
`latentloop` imports every registered architecture).

A run is described by `RunConfig(model, train, data)`; it serialises to YAML/JSON with the sections
`model:`, `train:`, `data:`. Overrides use `key=value` with either a dotted (`model.n_layer=4`) or a
bare field name (`n_layer=4`) when the bare name is unambiguous.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import yaml

from .errors import ConfigError
from .util import first_line, write_json_atomic


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_field_types(config: Any) -> None:
    """Every field of a config dataclass holds its annotated type, converted as a YAML file's or the
    command line's values are (`_coerce`), and every float is finite: `ModelConfig(n_layer="4")` or
    `n_layer=2.5` built in Python is the ConfigError a YAML file gets, not a TypeError deep in torch,
    and an infinite lr or softcap, which passes every range check, does not silently train on NaN."""
    for f in fields(config):
        setattr(config, f.name, _coerce(getattr(config, f.name), f.type, f.name))


# --------------------------------------------------------------------------------------------
# Model configs
# --------------------------------------------------------------------------------------------


ROPE_SCALINGS = ("none", "linear", "llama3")
# The deepest stack a config may describe: published models stop near 130 layers. A config (an edited
# checkpoint's, a --set) claiming 10^9 layers hung every command that checks weights against it, its
# meta-device model growing by gigabytes
MAX_LAYERS = 1024


@dataclass
class ModelConfig:
    """Shape and options of the shared backbone (arch `gpt`)."""

    arch: ClassVar[str] = "gpt"

    vocab_size: int = 259  # the byte tokenizer's 256 bytes + BOS/EOS/PAD; set from the tokenizer
    sequence_len: int = 256  # longest context the model is trained for and decodes (its RoPE tables: as many rows)
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_kv_head: int | None = None  # None: same as n_head (no grouped-query attention)
    mlp: str = "relu2"  # "relu2" (nanochat) or "swiglu"
    mlp_ratio: float = 4.0  # hidden width / n_embd (SwiGLU uses 2/3 of it, to match params)
    tie_embeddings: bool = False
    logit_softcap: float = 0.0  # 0 disables; else logits = cap * tanh(logits / cap)
    rope_theta: float = 10000.0
    bos_id: int = 256  # the tokenizer's BOS id (set from the tokenizer): variants restart state there
    # Options that express the Llama family exactly (Llama, SmolLM, Qwen2, ...; see
    # `latentloop.interop`). The defaults are nanochat's; a new parameter exists only while its
    # option is on, so checkpoints written before these options load unchanged.
    embed_norm: bool = True  # RMSNorm on the token embedding (nanochat); Llama feeds the raw embedding
    qk_norm: bool = True  # RMSNorm on queries and keys after RoPE (nanochat); Llama has none
    learned_norms: bool = False  # a learned gain in every block norm and the final norm (Llama)
    norm_eps: float | None = None  # RMSNorm epsilon; None: torch's default (the dtype's machine epsilon)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2); the output projection never has one
    intermediate_size: int = 0  # MLP hidden width; 0: derived from mlp_ratio (see `mlp_hidden`)
    rope_scaling: str = "none"  # "none", "linear" (positions / factor) or "llama3" (Llama 3.1's per-frequency)
    rope_factor: float = 1.0  # linear and llama3: how much longer the context is than the trained one
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / low are scaled by 1 / factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / high are kept
    rope_original_max_positions: int = 8192  # llama3: the context the frequencies were trained for
    # an imported sliding-window model's window (Mistral, Qwen2 with use_sliding_window; 0: none): latentloop
    # attends to the whole context, which is the window's attention only while the context fits in it
    attention_window: int = 0

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        require(self.vocab_size >= 2, f"vocab_size must be >= 2, got {self.vocab_size}")
        require(self.sequence_len >= 1, f"sequence_len must be >= 1, got {self.sequence_len}")
        require(1 <= self.n_layer <= MAX_LAYERS, f"n_layer must be in [1, {MAX_LAYERS}], got {self.n_layer}")
        require(self.n_head >= 1, f"n_head must be >= 1, got {self.n_head}")
        # a negative or zero width divides evenly too, and then fails as a negative dimension deep in torch
        require(self.n_embd >= 1, f"n_embd must be >= 1, got {self.n_embd}")
        require(self.n_embd % self.n_head == 0,
                 f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        require(self.head_dim >= 2 and self.head_dim % 2 == 0,  # RoPE rotates pairs: one pair at least
                 f"head_dim (n_embd / n_head = {self.head_dim}) must be even for RoPE, and >= 2 (one rotary pair)")
        require(1 <= self.n_kv_head <= self.n_head and self.n_head % self.n_kv_head == 0,
                 f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        require(self.mlp in ("relu2", "swiglu"), f"mlp must be 'relu2' or 'swiglu', got {self.mlp!r}")
        require(self.mlp_ratio > 0, f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        require(self.logit_softcap >= 0, f"logit_softcap must be >= 0, got {self.logit_softcap}")
        require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        require(0 <= self.bos_id < self.vocab_size, f"bos_id ({self.bos_id}) must be a token id below vocab_size "
                 f"({self.vocab_size})")
        require(self.norm_eps is None or 0 < self.norm_eps < 1,
                 f"norm_eps must be in (0, 1) or null, got {self.norm_eps}")
        require(self.intermediate_size >= 0, f"intermediate_size must be >= 0 (0: from mlp_ratio), "
                 f"got {self.intermediate_size}")
        require(self.rope_scaling in ROPE_SCALINGS,
                 f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
        require(self.rope_factor > 0, f"rope_factor must be > 0, got {self.rope_factor}")
        require(0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                 f"rope_low_freq_factor ({self.rope_low_freq_factor}) must be > 0 and below rope_high_freq_factor "
                 f"({self.rope_high_freq_factor})")
        require(self.rope_original_max_positions >= 1,
                 f"rope_original_max_positions must be >= 1, got {self.rope_original_max_positions}")
        require(self.attention_window >= 0, f"attention_window must be >= 0 (0: none), got {self.attention_window}")
        require(not self.attention_window or self.sequence_len <= self.attention_window,
                 f"sequence_len {self.sequence_len} is past the model's sliding attention window "
                 f"({self.attention_window} tokens): latentloop attends to the whole context, which is the "
                 f"window's attention only up to {self.attention_window} tokens")

    # derived fields ---------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        hidden = self.mlp_ratio * self.n_embd
        if self.mlp == "swiglu":  # three matrices instead of two: keep the parameter count
            hidden = hidden * 2 / 3
        return max(1, int(round(hidden)))

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, **dataclasses.asdict(self)}

    # What the rest of the system asks of an architecture before a model exists (torchtitan hangs
    # such answers on its ModelSpec). The backbone's answers are the defaults; a variant's config
    # class overrides what differs, so no front-end branches on the arch's name.
    #
    # Model fields a later training stage sets (stage -> {field: value}), before the user's --set.
    stage_defaults: ClassVar[dict[str, dict[str, Any]]] = {}
    # Model fields set when a gpt run is upcycled into this arch (see `latentloop.interop.upcycle`).
    upcycle_defaults: ClassVar[dict[str, Any]] = {}
    # Fields whose training noise each process draws from its own torch stream (fbt's jitter, rgpt's
    # state noise): with each at 0, data-parallel training equals one process accumulating as many
    # micro-batches. A config class lists its own; `training_noise_fields` collects its parents' too.
    TRAINING_NOISE: ClassVar[tuple[str, ...]] = ()
    # Named settings of this config that give a model of another mechanism under the same arch (MoR's
    # routing: other parameters, another training route); the contract suite checks each as an
    # architecture of its own, beside the defaults.
    VARIANTS: ClassVar[dict[str, dict[str, Any]]] = {}

    def stage_fields(self, stage: str, base_steps: int, named: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The model fields a later training `stage` from a base run of this config sets, before the
        user's --set (`stage_defaults`; an arch may derive them from the base, which trained
        `base_steps` steps, and from what the user's own layers set: `named`, their field names)."""
        return dict(self.stage_defaults.get(stage, {}))

    @classmethod
    def training_noise_fields(cls) -> tuple[str, ...]:
        """Every field of this config (its own and its parents') that scales per-process training noise."""
        return tuple(dict.fromkeys(name for klass in reversed(cls.__mro__)
                                   for name in vars(klass).get("TRAINING_NOISE", ())))

    @classmethod
    def upcycle_shape(cls, base_layers: int) -> dict[str, int]:
        """The shape fields of this arch built on a base of `base_layers` pretrained blocks."""
        return {"n_layer": base_layers}

    def iso_fields(self, iso: str) -> dict[str, Any] | None:
        """The shape fields that match this config's dense depth (n_layer) at equal FLOPs
        (iso="flops") or parameters (iso="params"); None: the arch has no depth to trade."""
        return None

    def depth_summary(self) -> str:
        """The stack's depth in words, for reports."""
        return f"{self.n_layer} layers"


def config_classes() -> dict[str, type[ModelConfig]]:
    """Every model config class by its `arch` name: ModelConfig and its subclasses (an
    architecture's spec in `latentloop.archs` names the same class; the subclasses live in their
    model files, imported with the package)."""
    found, pending = {}, [ModelConfig]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.arch, cls)
        pending.extend(cls.__subclasses__())
    return found


# Presets: shapes only; they apply to every architecture. Parameter counts are for the byte
# tokenizer (vocab 259) except gpt2/1b, which assume a GPT-2-sized BPE vocabulary.
PRESETS: dict[str, dict[str, Any]] = {
    "test": dict(n_layer=2, n_embd=64, n_head=4, sequence_len=64),  # ~0.1M params, unit tests
    "tiny": dict(n_layer=4, n_embd=128, n_head=4, sequence_len=256),  # ~0.8M, CPU demo
    "small": dict(n_layer=6, n_embd=384, n_head=6, sequence_len=512),  # ~10.7M
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, sequence_len=1024, vocab_size=50304,
                 tie_embeddings=True),  # ~124M
    "1b": dict(n_layer=18, n_embd=2048, n_head=16, n_kv_head=8, sequence_len=2048,
               vocab_size=50304, tie_embeddings=True),  # ~0.85B with GQA, a single-GPU run
}


def model_config(arch: str = "gpt", preset: str | None = None, **overrides: Any) -> ModelConfig:
    """Build a validated model config from an arch name, an optional preset and field overrides."""
    classes = config_classes()
    for what, name in (("arch", arch), ("preset", preset)):
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"{what} must be a name, got {type(name).__name__} {_shown(name)}"[:200])
    if arch not in classes:
        raise ConfigError(f"unknown arch {arch!r}: choose from {', '.join(sorted(classes))}")
    values: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
        values.update(PRESETS[preset])
    values.update(overrides)
    return _construct(classes[arch], values, f"{arch} model")


# --------------------------------------------------------------------------------------------
# Training and data configs
# --------------------------------------------------------------------------------------------


# Training stages: pretraining from scratch, supervised fine-tuning on conversations, and
# long-context extension; sft and extend start from another run (`setup(init_from=...)`).
STAGES = ("pretrain", "sft", "extend")


def extended_rope_theta(theta: float, head_dim: int, old_len: int, new_len: int) -> float:
    """RoPE base for a context stretched from `old_len` to `new_len` ("NTK-aware" base scaling):
    theta * s^(d / (d - 2)) with s = new_len / old_len, d = head_dim. The slowest rotary pair then
    turns at the new length by exactly the angle it reached at the old one (it is interpolated, so
    no position looks farther away than training ever showed), while the fastest pair keeps its
    frequency (local word order stays as sharp as before). Positions stay integers, so the cached
    and uncached paths stay the same code and stay exact."""
    scale = new_len / old_len
    if scale <= 1:
        return theta
    exponent = head_dim / (head_dim - 2) if head_dim > 2 else 1.0  # one rotary pair: plain base scaling
    return theta * scale ** exponent


# Seeds feed torch.manual_seed, which takes a signed 64-bit integer (larger ones overflow inside torch).
SEED_LIMIT = 2**63
# How training spreads over processes (one per GPU, launched by torchrun): none (one process), ddp
# (replicated model, all-reduced gradients) or fsdp2 (parameters, gradients and optimizer states
# sharded per block with torch.distributed.fsdp.fully_shard). auto, the default, is what nanoGPT,
# nanochat and torchtitan do: ddp when torchrun started more than one process, else none; training
# resolves it when it starts (runtime.resolve_strategy): what ran is in every checkpoint's state.json and
# the log, while the run's config.json keeps the setting as given (`train.state.config_as_given`).
STRATEGIES = ("auto", "none", "ddp", "fsdp2")
COMPILE_SCOPES = ("auto", "whole", "blocks")  # TrainConfig.compile_scope
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # TrainConfig.compile_backend
OPTIMIZERS = ("adamw", "muon")  # TrainConfig.optimizer
DTYPES = ("auto", "float32", "bfloat16")  # TrainConfig.dtype
TRACKERS = ("tensorboard", "wandb")  # where training metrics go besides metrics.jsonl (latentloop.train.trackers)


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    # the global batch in tokens (0: batch_size x grad_accum x processes sequences): the accumulation is
    # then batch_tokens / (batch_size x sequence_len x processes), exactly (nanoGPT's total_batch_size)
    batch_tokens: int = 0
    # "muon" (Muon for the block matrices, AdamW for embeddings, head and vectors) or "adamw" (AdamW for
    # all). Muon is the default because it reached nanoGPT's 300-step validation BPB in fewer steps and
    # less time than AdamW on every arch (benchmarks/time_to_quality.py; experiments/RESULTS.md, issue 25).
    optimizer: str = "muon"
    lr: float = 3e-3
    # the floor: wsd's last step is at lr * min_lr_ratio; cosine reaches it a step after the last
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # "cosine" or "wsd" (warmup-stable-decay)
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    muon_lr: float = 0.02
    # muon: the matrices whose parameter names contain one of these go to AdamW instead (e.g. "fuse_":
    # fbt's feedback fusion, a map applied again at every recurrence step rather than a block's matrix)
    muon_exclude: tuple[str, ...] = ()
    grad_clip: float = 1.0  # 0 disables
    seed: int = 1337
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 8
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2  # checkpoints kept on disk
    log_every: int = 10
    compile: bool = False
    # with compile: "auto" compiles the whole forward where the arch declares it (COMPILES_WHOLE), else
    # each block; "whole" / "blocks" choose (blocks compile sooner; the whole forward fuses across them)
    compile_scope: str = "auto"
    # torch.compile's backend: inductor (kernels), or aot_eager / eager (dynamo's graphs run by eager
    # kernels: the same graph breaks and recompiles in seconds, to check a step's graphs)
    compile_backend: str = "inductor"
    profile_steps: int = 0  # > 0: torch.profiler records this many steps after the warm-up (train --profile)
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", "mps"
    # autocast dtype: "auto" (bf16 on cuda and on a cpu with bf16 instructions), "float32", "bfloat16"
    dtype: str = "auto"
    stage: str = "pretrain"  # see STAGES: sft trains on chat data with the assistant-only loss
    strategy: str = "auto"  # auto | none | ddp | fsdp2 (see STRATEGIES); launch with torchrun for more than one process
    activation_checkpointing: bool = False  # recompute each block's activations in the backward (less memory)
    keep_freed_memory: bool = True  # on CPU with glibc: freed tensors' memory stays in the process (runtime.py)
    full_weights: bool = True  # fsdp2: every checkpoint also gets model.safetensors, gathered on rank 0's CPU
    trackers: tuple[str, ...] = ()  # besides metrics.jsonl, any of TRACKERS (`train --log tensorboard,wandb`)

    def __post_init__(self) -> None:
        check_field_types(self)
        self.trackers = tuple(dict.fromkeys(self.trackers))
        require(all(name in TRACKERS for name in self.trackers),
                f"trackers must be among {', '.join(TRACKERS)}, got {', '.join(self.trackers)}")
        require(self.stage in STAGES, f"stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        require(self.compile_backend in COMPILE_BACKENDS,
                f"compile_backend must be one of {', '.join(COMPILE_BACKENDS)}, got {self.compile_backend!r}")
        require(self.compile_scope in COMPILE_SCOPES,
                f"compile_scope must be one of {', '.join(COMPILE_SCOPES)}, got {self.compile_scope!r}")
        require(isinstance(self.seed, int) and 0 <= self.seed < SEED_LIMIT,
                 f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("steps", "batch_size", "grad_accum", "log_every"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every", "eval_batches", "batch_tokens", "profile_steps"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        require(self.keep_last >= 1, f"keep_last must be >= 1, got {self.keep_last}")
        require(self.optimizer in OPTIMIZERS,
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        require(self.schedule in ("cosine", "wsd"), f"schedule must be 'cosine' or 'wsd', got {self.schedule!r}")
        require(self.lr > 0 and self.muon_lr > 0, "lr and muon_lr must be > 0")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(0.0 < self.decay_fraction <= 1.0, f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 f"betas must be two values in [0, 1), got {self.betas}")
        require(self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip}")
        require(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"),
                 f"device must be auto, cpu, cuda[:N] or mps, got {self.device!r}")
        require(self.strategy in STRATEGIES, f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")


@dataclass
class DataConfig:
    # stdlib | text:PATH | hf:NAME[:CONFIG] | task:NAME[:knobs] | mix:SOURCE+SOURCE[+...] | chat:FILE[:field=role,...]
    # or chat:task:NAME (conversations, for stage sft)
    source: str = "stdlib"
    tokenizer: str = "byte"  # "byte" or a path to a tokenizer.json (see `latentloop tokenizer train`)
    val_fraction: float = 0.05
    max_bytes: int = 0  # cap on UTF-8 bytes read per split; 0 = no cap
    cache_dir: str = ""  # "" = $LATENTLOOP_CACHE or ~/.cache/latentloop

    def __post_init__(self) -> None:
        check_field_types(self)
        require(bool(self.source), "data source must not be empty")
        require(0.0 < self.val_fraction < 1.0, f"val_fraction must be in (0, 1), got {self.val_fraction}")
        require(self.max_bytes >= 0, f"max_bytes must be >= 0, got {self.max_bytes}")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "train": dataclasses.asdict(self.train),
                "data": dataclasses.asdict(self.data)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        raw = config_sections(raw)
        unknown = set(raw) - set(SECTIONS)
        require(not unknown, f"unknown config section(s): {', '.join(sorted(unknown))} (use model, train, data)")
        model_raw = raw["model"]
        arch = model_raw.pop("arch", "gpt")
        preset = model_raw.pop("preset", None)
        return cls(model=model_config(arch, preset, **model_raw),
                   train=_construct(TrainConfig, raw["train"], "train"),
                   data=_construct(DataConfig, raw["data"], "data"))

    def save_json(self, path: str | Path) -> None:
        """Written atomically (and fsynced): a crash never leaves a half-written config behind."""

        write_json_atomic(Path(path), self.to_dict())


SECTIONS = ("model", "train", "data")


def config_sections(raw: Any) -> dict[str, Any]:
    """A raw run config with each section a fresh dict (absent or empty: {}); anything else kept as it
    is. A config that is not a mapping, or a section that is not one, is a ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError("a run config must be a mapping with sections model/train/data")
    out = dict(raw)
    for section in SECTIONS:
        value = raw.get(section) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"config section {section!r} must be a mapping of fields, got "
                              f"{type(value).__name__} {_shown(value)}"[:200])
        out[section] = dict(value)
    return out


def _construct(cls: type, values: dict[str, Any], what: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {what} field(s): {', '.join(unknown)}")
    for f in fields(cls):  # reject wrong types early with a clear message (YAML/CLI give strings)
        if f.name in values:
            values[f.name] = _coerce(values[f.name], f.type, f"{what}.{f.name}")
    try:
        return cls(**values)
    except TypeError as exc:  # pragma: no cover - defensive: dataclass signature mismatch
        raise ConfigError(f"invalid {what} config: {exc}") from None


MAX_CONFIG_INT = 2**40  # no count a config holds (tokens, steps, widths) comes near it
BOOLS = (bool, np.bool_)  # numpy's is no subclass of bool


# A value as an error message shows it: a few items and characters of each level. A 600-byte YAML file
# of aliases is a list of 10**9 strings, whose whole repr ran out of memory (a MemoryError traceback).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 2, 4, 4, 4, 60, 60


def _shown(value: Any) -> str:
    return _SHOWN.repr(value)


def _coerce(value: Any, type_name: Any, name: str) -> Any:
    """Convert YAML/CLI values, and what Python code passes (paths, numpy scalars and arrays, ranges,
    0-d tensors), to the annotated type (annotations are strings here); refuse what does not convert
    exactly (2.5 for an integer, 2 for a boolean, a mapping for a list)."""
    t = str(type_name)
    optional = "None" in t
    if value is None:
        require(optional, f"{name} must not be null")
        return None
    try:
        if t.startswith("bool"):
            if isinstance(value, str):
                require(value.lower() in ("true", "false", "1", "0", "yes", "no"),
                         f"{name} must be true or false, got {_shown(value)}")
                return value.lower() in ("true", "1", "yes")
            require(isinstance(value, BOOLS) or (isinstance(value, numbers.Integral) and value in (0, 1)),
                    f"{name} must be true or false, got {_shown(value)}")
            return bool(value)
        if t.startswith("int"):
            require(not isinstance(value, BOOLS), f"{name} must be an integer, got {_shown(value)}")
            if isinstance(value, numbers.Integral) or (isinstance(value, str) and value.strip().lstrip("+-").isdigit()):
                number = int(value)  # exact, however long (through a float a 64-bit seed would round)
            else:  # a float, a numeric string, a 0-d tensor: only a whole number
                as_float = float(value)
                if not as_float.is_integer():
                    raise ValueError
                number = int(as_float)
            # past any real count; beyond it a value overflowed torch's 64-bit arguments (a traceback).
            # A seed is no count: any 64-bit one (its own check, TrainConfig.seed)
            limit = SEED_LIMIT if name.rsplit(".", 1)[-1] == "seed" else MAX_CONFIG_INT
            require(abs(number) <= limit, f"{name} must be at most {limit:,} in size, got {number:,}"
                    if number.bit_length() <= 64 else f"{name} must be at most {limit:,} in size, got an "
                                                      f"integer of {number.bit_length()} bits")
            return number
        if t.startswith("float"):
            require(not isinstance(value, BOOLS), f"{name} must be a number, got {_shown(value)}")
            number = float(value)
            require(math.isfinite(number), f"{name} must be a finite number, got {_shown(value)}")
            return number
        if t.startswith("tuple"):
            if isinstance(value, str):
                value = [v.strip() for v in value.strip("[]() ").split(",") if v.strip()]
            elif isinstance(value, numbers.Number) and not isinstance(value, BOOLS):
                value = [value]
            # a mapping or a set iterates as its keys, or in no set order: {wandb: 1} read as (wandb,)
            require(not isinstance(value, (Mapping, set, frozenset, bytes)) and isinstance(value, Iterable),
                    f"{name} must be a list, got {_shown(value)}")
            value = list(value)  # a list, tuple, range, numpy array or tensor
            if t.startswith("tuple[str"):  # names (train.trackers)
                require(all(isinstance(v, str) for v in value), f"{name} must be names, got {_shown(value)}")
                return tuple(value)
            # each item as one number of its type is: a block index of 0.7 is refused, not read as 0
            item_type = "int" if "int" in t else "float"
            return tuple(_coerce(v, item_type, f"{name}[{i}]") for i, v in enumerate(value))
        if t.startswith("str"):
            if isinstance(value, os.PathLike):
                return os.fspath(value)
            require(isinstance(value, (str, int, float)) and not isinstance(value, bool),
                    f"{name} must be a string, got {_shown(value)}")
            return str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name} has an invalid value {_shown(value)} (expected {t})") from None
    return value


# --------------------------------------------------------------------------------------------
# YAML files and key=value overrides
# --------------------------------------------------------------------------------------------


class _ConfigLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, stricter where a config's meaning would change silently: a key
    written twice in one mapping (PyYAML keeps the last) and a key that is not a name (YAML reads
    `on:`, `yes:`, `null:` or `1:` as a bool, None or a number) are errors naming the line."""

    def __init__(self, stream):
        super().__init__(stream)
        self._own_pairs: dict[int, tuple] = {}  # id(node) -> (node, its pairs before any merge was written in)

    def flatten_mapping(self, node):
        # a mapping's own pairs, kept before PyYAML writes a merge's pairs into it (in place: a mapping
        # merged elsewhere may be flattened before it is constructed), for the check below
        self._own_pairs.setdefault(id(node), (node, list(node.value)))
        super().flatten_mapping(node)

    def construct_mapping(self, node, deep=False):
        self._own_pairs.setdefault(id(node), (node, list(node.value)))
        seen: dict[str, int] = {}
        for key_node, _ in self._own_pairs[id(node)][1]:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys may be overridden here
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            if not isinstance(key, str):
                raise ConfigError(f"line {line}: the key {key_node.value!r} is read as {type(key).__name__} "
                                  f"{key!r}, not a name (YAML reads on/off/yes/no/null and numbers as values): "
                                  f"quote it if a field is meant")
            if key in seen:
                raise ConfigError(f"line {line}: {key!r} is given twice in one section (first at line {seen[key]}); "
                                  f"keep one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():  # "not found" sent the user looking for a file that is there, as a folder
        raise ConfigError(f"config file {path} is a folder, not a file: give the path of a YAML file")
    if not path.exists():  # not is_file(): a pipe (`--config <(...)`) is read as well
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}): "
                          f"save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        raw = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {first_line(exc)}") from None
    except ConfigError as exc:
        raise ConfigError(f"config file {path}, {exc}") from None
    if raw is None:
        return {}
    require(isinstance(raw, dict), f"config file {path} must hold a mapping with sections model/train/data")
    return raw


def _override_value(text: str) -> Any:
    """The value of a `key=value` override, read as YAML (as it is in a config file); text that is not
    YAML is kept as it is."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key=value` strings (value parsed as YAML) to a raw run-config mapping."""
    raw = config_sections(raw)
    arch = raw["model"].get("arch", "gpt")
    for item in overrides:  # the last arch an override names picks the model fields the others may set
        key, _, text = item.partition("=")
        if key.strip() in ("arch", "model.arch"):
            arch = _override_value(text)
    model_cls = config_classes().get(arch, ModelConfig) if isinstance(arch, str) else ModelConfig  # checked later
    section_fields = {"model": {f.name for f in fields(model_cls)} | {"arch", "preset"},
                      "train": {f.name for f in fields(TrainConfig)},
                      "data": {f.name for f in fields(DataConfig)}}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        value = _override_value(text)
        if "." in key:
            section, name = key.split(".", 1)
            require(section in section_fields, f"unknown config section {section!r} in override {item!r}")
        else:
            owners = [s for s, names in section_fields.items() if key in names]
            require(len(owners) >= 1, f"unknown config field {key!r} in override {item!r}")
            require(len(owners) == 1, f"config field {key!r} is ambiguous: write {owners[0]}.{key}")
            section, name = owners[0], key
        require(name in section_fields[section], f"unknown {section} field {name!r} in override {item!r}")
        raw[section][name] = value
    return raw
