"""Upcycling: start an `fbt`, `lrt` or `rgpt` from a trained (or imported) `gpt` run, so that the
new mechanism is added to a pretrained stack instead of trained from scratch.

    config = upcycle_config("runs/llama", "lrt")          # the run's backbone + the arch's defaults
    model = build_model(config)
    report = initialise_from(model, "runs/llama")          # the per-arch mapping below

`latentloop train --arch lrt --init-from runs/llama --out runs/llama-lrt` does both (the shape and
the tokenizer come from the run; `--set` still overrides any field).

What each arch starts from, and what is exact at step 0:

- fbt: every pretrained tensor; W_U, W_G fresh. Decoding with `regime=standard` is the pretrained
  model exactly (plain inputs); the fused inputs are new and are learned by the multi-pass
  objective from its `feedback_start` on (the paper introduces the feedback late in pretraining:
  a pretrained base has had its single-pass phase, so the default recipe's start at step 0 fits).
  An untied head is allowed: the carried state is still what the
  head reads (after the final norm and its gain), and W_U learns the map into the input space that
  tying gives for free; without an embedding norm the fused input is rescaled to the embedding
  table's RMS (`fuse_scale`, re-measured here on the loaded embeddings).
- lrt: every pretrained tensor; the memory projections W_k, W_v start at zero (so the gated keys
  and values are g_loc · k = k, every gate being 2σ(0) = 1 at init) and the residual γ at
  `residual_gamma_init`, which upcycling sets to 0 (α = 1). Then every injected term vanishes and
  the logits equal the base model's exactly, in every recurrence and prefill; the gradients of
  W_k, W_v and γ are not zero, so the memory is learned from there.
- rgpt: prelude = the first n_pre pretrained blocks, core = the next n_rec, coda = the last n_coda
  (the blocks between core and coda, if any, are dropped); W_proj = [I, 0] (the core reads the
  state, not the prelude output); the gate's last layer has zero weights and bias
  `gate_bias_init`, which upcycling sets to -4. Exact: with R = 1 and a gate saturated open
  (σ(bias) below fp32 resolution, bias <= -17), prelude -> core -> coda *is* the pretrained stack
  restricted to those blocks (all of it when n_pre + n_rec + n_coda = n_layer, the default split
  1 / L-2 / 1). The default bias -4 (σ ≈ 0.018, the mirror image of the paper's +4) keeps the
  gate trainable (a saturated one has no gradient) at the price of mixing 1.8% of the previous
  state into each step; further steps (r > 1) re-apply the core, which no pretrained model did.

A run of the same arch (or a tied gpt into fbt) keeps the old rule: every tensor must fit.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import (
    grow_vocab_rows,
    load_fitting_tensors,
    load_matching_weights,
    read_run_config,
    read_weights,
    resolve_checkpoint,
)
from ..config import ModelConfig, config_classes, model_config
from ..errors import CheckpointError

UPCYCLE_DEFAULTS: dict[str, dict[str, Any]] = {
    # lrt: the residual memory enters with weight 0, so step 0 is the base model
    "lrt": {"residual_gamma_init": 0.0},
    # rgpt: each step starts as (almost) a replacement by the pretrained core, still trainable
    "rgpt": {"gate_bias_init": -4.0},
}
BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.*)$")


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
    values = {"arch": arch} | backbone_fields(source) | UPCYCLE_DEFAULTS.get(arch, {})
    if arch == "rgpt":  # every pretrained block by default; n_pre / n_rec / n_coda override the split
        values.pop("n_layer")
        values |= _default_rgpt_split(source.n_layer)
    return values


def upcycle_config(run: str | Path, arch: str, **overrides: Any) -> ModelConfig:
    """The config of an `arch` model upcycled from `run`: `upcycle_fields`, then `overrides`."""
    values = upcycle_fields(run, arch) | overrides
    return model_config(values.pop("arch"), None, **values)


def _default_rgpt_split(n_layer: int) -> dict[str, int]:
    """All pretrained blocks: 1 prelude, L-2 core, 1 coda (RGPTConfig's own default split)."""
    config = config_classes()["rgpt"](n_layer=n_layer)
    return {"n_pre": config.n_pre, "n_rec": config.n_rec, "n_coda": config.n_coda}


def initialise_from(model: nn.Module, run: str | Path, grow_vocab: bool = False) -> dict[str, Any]:
    """Load `run`'s weights into `model` by the rules of the module docstring. Returns a report:
    source arch, what was done, which parameters are new and whether step 0 is exact.
    `grow_vocab`: the model may have more token ids than the run (SFT's chat tokens)."""
    checkpoint = resolve_checkpoint(run)
    source = read_run_config(checkpoint).model
    target = model.config.arch
    if source.arch == target:
        return {"source_arch": source.arch, "mapping": "same tensors",
                "new": load_matching_weights(model, checkpoint, grow_vocab)}
    if source.arch != "gpt":
        raise CheckpointError(f"--init-from {checkpoint}: a {source.arch} run cannot be upcycled into {target}; "
                              f"start from a gpt run")
    _check_backbone(source, model.config, checkpoint)
    if target == "fbt":
        fresh = load_matching_weights(model, checkpoint, grow_vocab)
        model.reset_fuse_scale()  # the loaded embeddings set the scale of the fused input
        return {"source_arch": "gpt", "mapping": "same tensors", "new": fresh, "exact_at_step0": "regime=standard"}
    weights = read_weights(checkpoint)
    if grow_vocab:
        grow_vocab_rows(weights, model.state_dict())
    if target == "lrt":
        return _upcycle_lrt(model, weights)
    if target == "rgpt":
        return _upcycle_rgpt(model, weights, source.n_layer)
    raise CheckpointError(f"--init-from {checkpoint}: no upcycling from gpt into {target}")


def _check_backbone(source: ModelConfig, target: ModelConfig, checkpoint: Path) -> None:
    """The backbone options must agree (rgpt may use fewer blocks)."""
    mine, theirs = backbone_fields(target), backbone_fields(source)
    for name in sorted(theirs):
        if name in ("n_layer", "bos_id", "sequence_len"):
            continue
        if mine[name] != theirs[name]:
            raise CheckpointError(f"--init-from {checkpoint}: {name} is {theirs[name]!r} there, {mine[name]!r} here "
                                  f"(upcycling keeps the backbone)")


def _load(model: nn.Module, weights: dict[str, torch.Tensor], checkpoint_hint: str) -> list[str]:
    """Load base tensors (every one must fit); returns the parameters they do not cover."""
    return load_fitting_tensors(model, weights, f"--init-from ({checkpoint_hint} model)")


@torch.no_grad()
def _upcycle_lrt(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    fresh = _load(model, weights, "lrt")
    projections = [model.mem_kv] if model.mem_kv is not None else []
    projections += [b.attn.c_mem_kv for b in model.blocks if b.attn.inject and b.attn.layerwise]
    for linear in projections:
        nn.init.zeros_(linear.weight)  # W_k, W_v = 0: the memory adds nothing to keys and values yet
    gamma = model.config.residual_gamma_init
    return {"source_arch": "gpt", "mapping": "same tensors; W_k = W_v = 0", "new": fresh,
            "exact_at_step0": "all recurrences" if gamma == 0 else f"no (residual_gamma_init={gamma})"}


@torch.no_grad()
def _upcycle_rgpt(model: nn.Module, weights: dict[str, torch.Tensor], base_layers: int) -> dict[str, Any]:
    c = model.config
    if c.n_pre + c.n_rec + c.n_coda > base_layers:
        raise CheckpointError(f"--init-from: rgpt {c.n_pre} + {c.n_rec} + {c.n_coda} blocks need more than the "
                              f"{base_layers} pretrained blocks")
    coda_start = base_layers - c.n_coda
    chosen = [*range(c.n_pre + c.n_rec), *range(coda_start, base_layers)]  # new block i <- base block chosen[i]
    renumber = {old: new for new, old in enumerate(chosen)}
    mapped = {}
    for name, tensor in weights.items():
        match = BLOCK_KEY.match(name)
        if match is None:
            mapped[name] = tensor
        elif int(match.group(1)) in renumber:
            mapped[f"blocks.{renumber[int(match.group(1))]}.{match.group(2)}"] = tensor
    fresh = _load(model, mapped, "rgpt")
    D = c.n_embd
    model.proj.weight.copy_(torch.cat([torch.eye(D), torch.zeros(D, D)], dim=1))  # W_proj = [I, 0]
    nn.init.zeros_(model.gate_out.weight)  # the gate is its bias alone until it learns
    nn.init.constant_(model.gate_out.bias, c.gate_bias_init)
    gate = torch.sigmoid(torch.tensor(c.gate_bias_init)).item()
    exact = c.recurrence_steps == 1 and gate < torch.finfo(torch.float32).eps / 2
    return {"source_arch": "gpt", "new": fresh, "gate_at_init": gate,
            "mapping": f"prelude = {_span(0, c.n_pre)}, core = {_span(c.n_pre, c.n_pre + c.n_rec)}, "
                       f"coda = {_span(coda_start, base_layers)} of the {base_layers} pretrained blocks",
            "exact_at_step0": "r=1 (gate saturated open)" if exact else
                              f"no (r=1 mixes σ(gate_bias_init) = {gate:.3g} of the previous state in)"}


def _span(start: int, stop: int) -> str:
    """Pretrained blocks start..stop-1 in words."""
    if stop <= start:
        return "none"
    return f"block {start}" if stop == start + 1 else f"blocks {start}-{stop - 1}"
