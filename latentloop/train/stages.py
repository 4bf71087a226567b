"""Training stages after pretraining: which data each takes (`check_stage`) and the config an sft /
extend run gets from its base run (`stage_config`: the base's model, the stage's defaults, then
the arch's, a config file, the flags and the overrides)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint import find_tokenizer_file, read_run_config, resolve_checkpoint
from ..config import SECTIONS, RunConfig, TrainConfig, apply_overrides, config_sections, extended_rope_theta
from ..data.chat import is_chat_source
from ..errors import ConfigError


def check_stage(config: RunConfig, resume: bool, init_from: str | Path | None) -> None:
    stage, chat = config.train.stage, is_chat_source(config.data.source)
    if chat and stage != "sft":
        raise ConfigError(f"chat data ({config.data.source}) trains with stage sft (--stage sft --init-from RUN)")
    if stage == "sft" and not chat:
        raise ConfigError(f"stage sft trains on conversations: use --data chat:FILE or chat:task:NAME, got "
                          f"{config.data.source!r}")
    if stage in ("sft", "extend") and init_from is None and not resume:
        raise ConfigError(f"stage {stage} continues a trained run: give --init-from RUN")


# Each stage's peak learning rates as a share of pretraining's defaults, for both optimizers' groups
# (AdamW's lr and Muon's muon_lr), so that neither optimizer's half of a muon run keeps pretraining's
# step size
SFT_LR_SHARE = 1 / 5  # nanochat's SFT uses a small lr too
EXTEND_LR_SHARE = 1 / 3


def _peak_lrs(share: float) -> dict[str, float]:
    pretraining = TrainConfig()
    return {"train.lr": pretraining.lr * share, "train.muon_lr": pretraining.muon_lr * share}


# What each stage changes in the base run's config unless the user says otherwise (why, each):
STAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    # A short run on few tokens: a fifth of pretraining's peak lrs decaying to zero, no warm start
    # from a stable phase.
    "sft": {**_peak_lrs(SFT_LR_SHARE), "train.warmup_steps": 10, "train.min_lr_ratio": 0.0,
            "train.schedule": "cosine", "train.eval_every": 50},
    # Continued pretraining at the new length: a third of the peak lrs with a short re-warmup (the
    # optimizer state starts afresh), cosine to 10%.
    "extend": {**_peak_lrs(EXTEND_LR_SHARE), "train.warmup_steps": 20, "train.min_lr_ratio": 0.1,
               "train.schedule": "cosine"},
}


def stage_config(stage: str, init_from: str | Path, overrides: list[str] = (), data: str | None = None,
                 flags: dict[str, Any] | None = None, file: dict[str, Any] | None = None,
                 file_name: str | Path = "the config file") -> RunConfig:
    """The config of an sft / extend run from its base run: the base's model (shape, arch, its
    tokenizer), the stage's defaults (`STAGE_DEFAULTS`, then the arch's `stage_defaults`), then a
    config file's sections (`file`, read from `file_name`), then `flags` ({"section.key": value}) and
    `overrides` ("key=value"): each layer sets only what it names, so a file that sets its own lr or
    rope_theta keeps it, and what it leaves out is the stage's. For extend, a `sequence_len` above the
    base's scales `rope_theta` by `extended_rope_theta` unless the file or the overrides set rope_theta
    themselves."""
    checkpoint = resolve_checkpoint(init_from)
    base = read_run_config(checkpoint)
    tokenizer_file = find_tokenizer_file(checkpoint)
    file = config_sections(file or {})
    unknown = sorted(set(file) - set(SECTIONS))  # as RunConfig.from_dict says it of a file without a stage
    if unknown:
        raise ConfigError(f"unknown config section(s): {', '.join(unknown)} (use model, train, data)")
    # the stage trains the base's own weights: another arch, a preset's shape or another tokenizer
    # would not fit them (the same as --arch / --preset / --tokenizer, refused with a stage)
    foreign = [f"model.{key}" for key in ("arch", "preset") if key in file["model"]
               and not (key == "arch" and file["model"][key] == base.model.arch)]
    foreign += ["data.tokenizer"] if "tokenizer" in file["data"] else []
    if foreign:
        raise ConfigError(f"--stage {stage} keeps the base run's arch, shape and tokenizer: drop "
                          f"{', '.join(foreign)} from {file_name}")
    raw = base.to_dict()
    raw["train"] = {"stage": stage, "seed": base.train.seed, "batch_size": base.train.batch_size,
                    "device": base.train.device, "dtype": base.train.dtype}
    raw["data"] = {"source": base.data.source, "tokenizer": str(tokenizer_file), "val_fraction": base.data.val_fraction,
                   "max_bytes": base.data.max_bytes}
    # the model fields the user's own layers set (the file, the flags, --set with a dotted or bare key)
    named = frozenset([*file["model"], *(k.split(".", 1)[1] for k, v in (flags or {}).items()
                                         if k.startswith("model.") and v is not None),
                       *(item.split("=", 1)[0].strip().removeprefix("model.") for item in overrides)])
    arch_fields = base.model.stage_fields(stage, base.train.steps, named)
    layers = [STAGE_DEFAULTS[stage], {f"model.{k}": v for k, v in arch_fields.items()},
              {f"{section}.{name}": value for section in SECTIONS for name, value in file[section].items()},
              {"train.stage": stage},  # --stage (or the file's own train.stage) chose this path
              {k: v for k, v in (flags or {}).items() if v is not None}]
    for layer in layers:
        for key, value in layer.items():
            section, name = key.split(".")
            raw[section][name] = value
    if data is not None:
        raw["data"]["source"] = data
    raw = apply_overrides(raw, list(overrides))
    config = RunConfig.from_dict(raw)
    if stage == "extend":
        if config.model.sequence_len <= base.model.sequence_len:
            raise ConfigError(f"stage extend needs a sequence_len above the base run's {base.model.sequence_len} "
                              f"(--set sequence_len=N), got {config.model.sequence_len}")
        chosen = "rope_theta" in file["model"] or any(item.split("=", 1)[0].strip().endswith("rope_theta")
                                                      for item in overrides)
        if not chosen:
            config.model.rope_theta = extended_rope_theta(base.model.rope_theta, base.model.head_dim,
                                                          base.model.sequence_len, config.model.sequence_len)
    return config
