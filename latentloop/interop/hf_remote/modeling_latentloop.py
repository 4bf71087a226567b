"""latentloop's architectures as a transformers model (trust_remote_code), computed by latentloop's own code.

Written by `latentloop export RUN --format hf` beside `configuration_latentloop.py`, copies of the
package files the run's architecture needs (its model file, the backbone, cache, options, ...,
config.py, errors.py, util.py, with their imports made local to the folder) and `latentloop_arch.py`,
which names the architecture's model and config classes. Loads with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and needs torch, transformers
(5.x) and pyyaml, never latentloop. Nothing here knows an architecture: the model is the package's
own class, so the exported model computes what the package computes, operation for operation, for
every registered architecture (the contract suite compares the two for each), and its tensors are
the package's state dict under `model.`.

Decoding goes through the package's decoding protocol: the model's own cache object (keys/values per
slot, per-row positions, and the latent state a token leaves for the next one: fbt's carried top
state, lrt's memory; rgpt keeps one slot per recurrence step), `prefill` for the prompt, `decode`
for each new token. `generate()` always decodes through it (its `use_cache` flag is ignored: the
latent state has nowhere else to live). The architecture's declared decoding options (fbt
`regime` / `passes`, rgpt `steps`, ...) are keyword arguments of `forward` and `generate`, with the
config's `decoding` as defaults, checked as the package checks them.

`forward(input_ids)` without a cache scores a whole text the way decoding would produce it: the
first `prompt_len` tokens are prefilled (default: what the architecture prefills when scoring, e.g.
fbt soft only the first), the rest decoded teacher-forced. Left-padded batches (attention_mask with
zeros on the left) decode each row as it would alone; scored without a cache, a batch padded on the
right (or on the left past what is prefilled) is scored row by row, each as it would be alone.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .config import model_config
from .configuration_latentloop import LatentloopConfig
from .latentloop_arch import CONFIG_CLASS, MODEL_CLASS
from .options import check_options

OPTION_NAMES = tuple(option.name for option in MODEL_CLASS.OPTIONS)
IGNORED_LABEL = -100  # transformers' label for positions without a loss


@dataclass
class LatentloopOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None
    cache: Any = None


class LatentloopForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LatentloopConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def __init__(self, config: LatentloopConfig):
        super().__init__(config)
        fields = {name: value for name, value in config.latentloop.items() if name != "arch"}
        self.model = MODEL_CLASS(model_config(CONFIG_CLASS.arch, None, **fields))
        self.rope_ready = False  # transformers builds the model on the meta device: computed tables come later
        self.post_init()

    # -- transformers plumbing ---------------------------------------------------------------
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model keeps its own cache (see the module docstring)

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing: an export holds every tensor; the RoPE tables, computed rather than stored, are
        recomputed by the first forward (`reset_rope`)."""

    def reset_rope(self) -> None:
        """The package's RoPE tables (`GPT.reset_rope`, computed in float32), in the weights' dtype:
        as the package's own model has them after `.to(dtype)`. A model loaded with `dtype=torch.bfloat16`
        (or moved to it before its first forward) computes its tables only then, so they would stay
        float32 and the attention would mix dtypes."""
        self.model.reset_rope()
        dtype = self.model.wte.weight.dtype
        if dtype.is_floating_point:
            self.model.rope_cos = self.model.rope_cos.to(dtype)
            self.model.rope_sin = self.model.rope_sin.to(dtype)
        self.rope_ready = True

    def get_input_embeddings(self) -> nn.Module:
        return self.model.wte

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache=None, attention_mask: Tensor | None = None,
                                      **kwargs) -> dict[str, Any]:
        """The tokens the cache has not seen; the first call prefills the whole prompt."""
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        inputs = {"attention_mask": attention_mask, "use_cache": True, "cache": cache}
        if cache is None:
            inputs.update(input_ids=input_ids, prompt_len=input_ids.shape[1])
        else:
            inputs["input_ids"] = input_ids[:, cache.length:]
        inputs.update({name: kwargs[name] for name in OPTION_NAMES if kwargs.get(name) is not None})
        return inputs

    def options(self, given: dict[str, Any]) -> dict[str, Any]:
        """Every declared option: given, else the export's default, else the architecture's; checked
        as the package checks them, the checks that need the model's depth included (its
        `draft_options`, e.g. a min_steps past the depth)."""
        options = check_options(MODEL_CLASS.OPTIONS, {**self.config.decoding, **given}, CONFIG_CLASS.arch)
        checked_with_the_model = getattr(self.model, "draft_options", None)
        if checked_with_the_model is not None:
            checked_with_the_model(options)
        return options

    # -- the forward -------------------------------------------------------------------------
    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, cache=None,
                use_cache: bool | None = None, labels: Tensor | None = None, prompt_len: int | None = None,
                return_dict: bool | None = None, **kwargs) -> LatentloopOutput:
        """Logits of input_ids (B, T). Without a cache: prefill the first `prompt_len` tokens, decode
        the rest teacher-forced; with one: the new tokens after what it holds. The architecture's
        decoding options are keyword arguments (named in the signature)."""
        if not self.rope_ready:  # the first forward after loading: the tables the package computes
            self.reset_rope()
        cache = cache if cache is not None else kwargs.get("past_key_values")
        given = {name: kwargs[name] for name in OPTION_NAMES if name in kwargs}
        opts = self.options(given)
        model = self.model
        T = input_ids.shape[1]
        pad_mask = None
        if attention_mask is not None:
            new_columns = attention_mask[:, -T:].bool()
            if not bool(new_columns.all()):
                if cache is not None and cache.length > 0:
                    raise ValueError("padding is supported on the left of the prompt only")
                pad_mask = new_columns
        if cache is None:
            P = model.teacher_forced_prompt_len(T, opts) if prompt_len is None else prompt_len
            P = max(1, min(P, T))
            if pad_mask is not None and not _left_padding_within(pad_mask, P):
                if use_cache:  # a cache decodes every row on from its last column: the padding must precede it
                    raise ValueError("padding is supported on the left of the prompt only")
                logits, cache = self._rows_alone(input_ids, pad_mask, prompt_len, given), None
            else:
                cache = model.new_cache(input_ids.shape[0], model.config.sequence_len, **opts)
                logits = model.prefill(input_ids[:, :P], cache, None if pad_mask is None else pad_mask[:, :P],
                                       **opts).logits
                if P < T:
                    logits = torch.cat([logits, model.decode(input_ids[:, P:], cache, **opts).logits], dim=1)
        else:
            logits = model.decode(input_ids, cache, **opts).logits
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=IGNORED_LABEL)
        return LatentloopOutput(loss=loss, logits=logits, cache=cache if use_cache else None)

    def _rows_alone(self, input_ids: Tensor, pad_mask: Tensor, prompt_len: int | None,
                    given: dict[str, Any]) -> Tensor:
        """Logits of a batch scored without a cache whose padding the batched prefill cannot take (on
        the right, as transformers' tokenizers pad by default, or on the left past the tokens the
        architecture prefills when scoring, e.g. fbt soft's one): each row's tokens scored as that row
        alone, padded positions left at zero. `prompt_len` counts from the batch's first column; `given`:
        the decoding options as the caller gave them."""
        B, T = input_ids.shape
        logits = None
        for row in range(B):
            where = pad_mask[row].nonzero().flatten()
            if len(where) == 0:
                continue
            start, end = int(where[0]), int(where[-1]) + 1
            if end - start != len(where):
                raise ValueError("attention_mask must mark one run of tokens per row (padding on the left or "
                                 "the right of it)")
            own = None if prompt_len is None else max(1, prompt_len - start)
            scored = self.forward(input_ids[row:row + 1, start:end], prompt_len=own, **given).logits
            if logits is None:
                logits = scored.new_zeros(B, T, scored.shape[-1])
            logits[row, start:end] = scored[0]
        if logits is None:  # every row padding only
            logits = self.model.wte.weight.new_zeros(B, T, self.model.config.vocab_size)
        return logits


def _left_padding_within(pad_mask: Tensor, prompt_len: int) -> bool:
    """Every row's padding (mask zeros) lies before its tokens and within the first `prompt_len`
    columns: what the batched prefill takes."""
    ordered = bool((pad_mask[:, 1:].int() >= pad_mask[:, :-1].int()).all())  # zeros, then ones
    return ordered and bool(pad_mask[:, prompt_len:].all())


def _name_the_options(forward):
    """`forward`'s signature names the architecture's options as keyword arguments: transformers
    checks generate()'s keyword arguments against it, and a caller can see what the model takes."""
    signature = inspect.signature(forward)
    named = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    rest = [p for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD]
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in OPTION_NAMES]
    forward.__signature__ = signature.replace(parameters=named + options + rest)
    return forward


_name_the_options(LatentloopForCausalLM.forward)
