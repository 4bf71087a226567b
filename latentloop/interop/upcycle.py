"""Upcycling: start a variant from a trained (or imported) `gpt` run, so that the
new mechanism is added to a pretrained stack instead of trained from scratch.

    config = upcycle_config("runs/llama", "lrt")          # the run's backbone + the arch's defaults
    model = build_model(config)
    report = initialise_from(model, "runs/llama")          # the per-arch mapping below

`latentloop train --arch lrt --init-from runs/llama --out runs/llama-lrt` does both (the shape and
the tokenizer come from the run; `--set` still overrides any field).

What each arch starts from, and what is exact at step 0, is the arch's own answer: its config
class's `upcycle_defaults` (fields such as lrt's residual_gamma_init = 0) and `upcycle_shape` (rgpt's
split of the pretrained blocks), and its model's `upcycle_from(weights, base_layers, load)`, whose
docstring states the mapping (archs/fbt/model.py, archs/lrt/model.py, archs/rgpt/model.py). An arch without
`upcycle_from` cannot start from a gpt run and says so in one line.

A run of the same arch (or a tied gpt into fbt) keeps the old rule: every tensor must fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ..checkpoint import (
    check_full_weights,
    grow_vocab_rows,
    load_fitting_tensors,
    load_matching_weights,
    read_run_config,
    read_weights,
    resolve_checkpoint,
    token_row_tensors,
)
from ..config import ModelConfig, config_classes, model_config
from ..errors import CheckpointError


def backbone_fields(config: ModelConfig) -> dict[str, Any]:
    """The backbone fields of any model config (what every arch shares)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return {name: value for name, value in config.to_dict().items() if name in names}


def upcycle_fields(run: str | Path, arch: str | None = None) -> dict[str, Any]:
    """The model-config fields of a model upcycled from `run` into `arch` (default: the run's own
    arch): the run's backbone (shape and options) and the arch's upcycling defaults, `arch` included."""
    source = read_run_config(resolve_checkpoint(run)).model
    arch = arch or source.arch
    if arch == source.arch:
        return source.to_dict()
    config_class = config_classes().get(arch)
    if config_class is None:
        raise CheckpointError(f"unknown arch {arch!r}: choose from {', '.join(sorted(config_classes()))}")
    values = {"arch": arch} | backbone_fields(source) | config_class.upcycle_defaults
    values.pop("n_layer")
    return values | config_class.upcycle_shape(source.n_layer)  # every pretrained block by default


def upcycle_config(run: str | Path, arch: str, **overrides: Any) -> ModelConfig:
    """The config of an `arch` model upcycled from `run`: `upcycle_fields`, then `overrides`."""
    values = upcycle_fields(run, arch) | overrides
    return model_config(values.pop("arch"), None, **values)


def initialise_from(model: nn.Module, run: str | Path, grow_vocab: bool = False,
                    new_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Load `run`'s weights into `model` by the rules of the module docstring. Returns a report:
    source arch, what was done, which parameters are new and whether step 0 is exact.
    `grow_vocab`: the model may have more token ids than the run (SFT's chat tokens, `new_ids`); the
    report's `grown_rows` then counts the token rows that start as the mean row (`grow_vocab_rows`)."""
    checkpoint = resolve_checkpoint(run)
    # an fsdp2 run's sharded weights: how to write model.safetensors, not "missing from checksums.json"
    check_full_weights(checkpoint)
    source = read_run_config(checkpoint).model
    target = model.config.arch
    # new token rows past the run's vocabulary, and added ids on rows it has (a padded vocabulary)
    grown = ({"grown_rows": model.config.vocab_size - source.vocab_size + sum(i < source.vocab_size for i in new_ids)}
             if grow_vocab else {})
    if source.arch == target:
        return {"source_arch": source.arch, "mapping": "same tensors",
                "new": load_matching_weights(model, checkpoint, grow_vocab, new_ids)} | grown
    if source.arch != ModelConfig.arch:
        raise CheckpointError(f"--init-from {checkpoint}: a {source.arch} run cannot be upcycled into {target}; "
                              f"start from a {ModelConfig.arch} run")
    _check_backbone(source, model.config, checkpoint)
    weights = read_weights(checkpoint)
    if grow_vocab:
        grow_vocab_rows(weights, model.state_dict(), token_row_tensors(model), new_ids)
    report = model.upcycle_from(weights, source.n_layer,
                                lambda tensors: load_fitting_tensors(model, tensors, f"--init-from {checkpoint}"))
    if report is None:
        raise CheckpointError(f"--init-from {checkpoint}: no upcycling from {source.arch} into {target}")
    return {"source_arch": source.arch} | report | grown


def _check_backbone(source: ModelConfig, target: ModelConfig, checkpoint: Path) -> None:
    """The backbone options must agree (rgpt may use fewer blocks)."""
    mine, theirs = backbone_fields(target), backbone_fields(source)
    for name in sorted(theirs):
        if name in ("n_layer", "bos_id", "sequence_len"):
            continue
        if mine[name] != theirs[name]:
            raise CheckpointError(f"--init-from {checkpoint}: {name} is {theirs[name]!r} there, {mine[name]!r} here "
                                  f"(upcycling keeps the backbone)")
