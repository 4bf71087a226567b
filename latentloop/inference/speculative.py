"""Self-speculative decoding on the fast path: the draft's steps and the full model's verification,
compiled, over one static cache.

The engine runs the rounds (`engine._speculative_round`: draft k tokens, take them back, verify them in
one full pass, keep what the full model accepts); a *drafting* object does the model and cache work
of a round. `engine.EagerDrafting` does it through an ordinary cache; `CompiledDrafting` here does it
through a frozen static cache (`fast.static_cache`):

- each draft step is the plain decode step of the draft's options (the same weights at fewer
  recurrence steps, its speed-only draft options removed: `without_speed_only`), run by a
  `FastDecoder` of its own: the ahead-of-time package or dynamo's graph that plain decoding at that
  depth runs, shared with it;
- the verification is the model's own `decode` of the pending token and the k drafts in one call,
  compiled once per (model, options, k + 1 tokens): on CPU an ahead-of-time package (`aot.AotDecodeStep`
  over k + 1 tokens per row; its products of 5-64 rows, biased ones too, call the rows kernel's C
  function, which dynamo's graph reaches through Python; under the earlier rule, 6-64 rows without a
  bias, on the Intel Xeon: 81 calls a verification, and r = 2, k = 8 on the trained `tiny` rgpt 0.84x
  against 1.11x compiled full depth's speed), dynamo's graph where no package builds; the
  static cache writes the k + 1 slots from its write position (`StaticCacheMixin.begin_tokens`);
- taking drafts back moves the cache's write position back (`StaticCacheMixin.keep_recent`), outside
  compiled code.

One row only: the rows of a frozen cache share one write position, and rows accept prefixes of
different lengths. A round that cannot draft its k tokens (the context's end) verifies eagerly over
the same static cache instead of compiling another shape.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from ..models.backbone import GPT, Draft, ModelOutput
from ..models.cache import KVCache
from ..models.options import without_speed_only
from .aot import AotDecodeStep, AotUnavailable, aot_enabled
from .fast import (
    AOT_BACKEND,
    DYNAMO_STEPS_LOCK,
    FastDecoder,
    compiled_copy,
    compiled_steps,
    fallback_reason,
    keep_state_buffers,
    release_package_cache,
    static_cache,
    static_length,
    use_compile_cache,
)

VERIFY_KEY = "verify"  # in a key of `fast.compiled_steps`: the verification of k + 1 tokens, not a decode step


def _verify(model, tokens: Tensor, cache: KVCache, options: dict) -> tuple[Tensor, Tensor, dict]:
    """The full model's decode of tokens (B, T) through a frozen static cache: logits (B, T, V), top
    states (B, T, D) and what the model reported, its carried state written back into the cache's
    fixed buffers."""
    buffers = dict(cache.state)
    out = model.decode(tokens, cache, **options)
    keep_state_buffers(cache, buffers)
    return out.logits, out.hidden, out.info


def _verify_for_package(model, tokens: Tensor, cache: KVCache, options: dict) -> tuple[Tensor, Tensor, dict, Tensor]:
    """`_verify` as an ahead-of-time package's step: (logits, greedy ids (B, T), info, top states)."""
    logits, hidden, info = _verify(model, tokens, cache, options)
    return logits, logits.argmax(dim=-1), info, hidden


def compiled_drafting_reason(model, options: dict, draft: Draft, batch_size: int) -> str | None:
    """Why self-speculative decoding with these options runs eagerly, or None when it compiles."""
    if not isinstance(model, GPT):
        return "the static cache is the backbone's"
    if batch_size != 1:
        return "compiled self-speculative decoding takes one row (rows accept drafts of different lengths)"
    return (fallback_reason(model, without_speed_only(model.OPTIONS, options))
            or fallback_reason(model, without_speed_only(model.OPTIONS, draft.options)))


class CompiledDrafting:
    """The model and cache work of self-speculative rounds on the fast path (see the module docstring).
    `new_cache(needed)`, the model's eager `prefill` into it, `begin_decoding(cache)` (or `adopt` an
    ordinary cache part way through), then the engine's rounds call `drafts`, `snapshot`, `draft`,
    `take_back`, `verify` and `keep`."""

    def __init__(self, model, options: dict, draft: Draft, on_compile=None, compile: bool = True):
        self.model, self.draft_spec = model, draft
        self.options = without_speed_only(model.OPTIONS, options)  # the full model's output function
        self.drafter = FastDecoder(model, compile=compile, on_compile=on_compile,
                                   **without_speed_only(model.OPTIONS, draft.options))
        self.on_compile = on_compile
        self._verify_step = _verify  # compile=False: the same work eagerly over the static cache (tests)
        self.aot: AotDecodeStep | None = None  # on CPU: the verification as an ahead-of-time package
        self._key = (model.wte.weight.device.type, tuple(sorted(self.options.items())), VERIFY_KEY, draft.tokens + 1)
        if compile:
            use_compile_cache()
            per_model = compiled_steps(model)
            if self._key[0] == "cpu" and aot_enabled() and AotDecodeStep.refuses(model) is None:
                if (*self._key, AOT_BACKEND) not in per_model:
                    per_model[(*self._key, AOT_BACKEND)] = AotDecodeStep(model, self.options, _verify_for_package,
                                                                         tokens=draft.tokens + 1)
                self.aot = per_model[(*self._key, AOT_BACKEND)]
            else:
                self._verify_step = self._dynamo_verify()
        self._verified_once = False
        self.cache: KVCache | None = None

    def __del__(self, _finalizing=sys.is_finalizing) -> None:  # bound here: globals may be gone at exit
        if not _finalizing():
            release_package_cache(self)  # the verification package's hold on this decoder's cache

    def _dynamo_verify(self):
        per_model = compiled_steps(self.model)
        if self._key not in per_model:
            # CUDA: no graphs for the verification (the drafts' steps have them)
            per_model[self._key] = compiled_copy(_verify, self._key[0], cuda_graphs=False)
        return per_model[self._key]

    def new_cache(self, needed: int) -> KVCache:
        """A static cache of one row with room for `needed` tokens (the prompt, the generation and one
        round's drafts), shaped by the full model's options (its depth may exceed the draft's)."""
        max_len = static_length(self.model, 1, needed, **self.options)
        return static_cache(self.model.new_cache(1, max_len, **self.options))

    def adopt(self, cache: KVCache) -> None:
        """Continue an ordinary cache (`model.new_cache(1, static_length(...))`) on this path."""
        self.begin_decoding(static_cache(cache))

    def begin_decoding(self, cache: KVCache) -> None:
        self.drafter.begin_decoding(cache)
        if self.aot is not None:
            self.aot.forget()
        self.cache = cache

    # -- a round's work (engine._speculative_round) --
    def drafts(self, wanted: int) -> int:
        """How many tokens this round drafts: the draft's k whatever the row still needs (a smaller k
        would be another compiled shape; drafts past the budget are not kept), fewer only where the
        cache has no room for k + 1 more slots."""
        cache = self.cache
        return max(0, min(self.draft_spec.tokens, cache.max_len - cache.filled - 1))

    def snapshot(self) -> dict[str, Tensor]:
        return {name: value.clone() for name, value in self.cache.state.items()}

    def draft(self, token: Tensor) -> Tensor:
        """The draft's logits (B, V) after `token` (B,), which enters the cache."""
        logits, _, _ = self.drafter.step(token)
        return logits.clone()  # a package's outputs are written again by its next call

    def take_back(self, k: int, before: dict[str, Tensor]) -> None:
        """The k drafted slots leave the cache (not cleared: the verification writes them again at
        once); the carried state is the one before the drafts."""
        self.cache.keep_recent(torch.zeros(1, dtype=torch.long), k, clear=False)
        for name, value in before.items():
            self.cache.state[name].copy_(value)

    def verify(self, tokens: Tensor) -> ModelOutput:
        """The full model over tokens (B, k + 1): the pending token and the drafts, in one call."""
        cache = self.cache
        T = tokens.shape[1]
        if cache.filled + T > cache.max_len:
            raise ValueError(f"cache overflow: {cache.filled} + {T} tokens > max_len {cache.max_len}")
        cache.set_window(T)
        if T != self.draft_spec.tokens + 1:  # a short round at the context's end: not worth a compile
            logits, hidden, info = _verify(self.model, tokens, cache, self.options)
        else:
            compiles = self.aot is not None or self._verify_step is not _verify
            if not self._verified_once and self.on_compile is not None and compiles:
                self.on_compile("compiling the verification of the drafts ...")
            logits, hidden, info = self._compiled(tokens)
            self._verified_once = True
        cache.filled += T
        return ModelOutput(logits=logits, hidden=hidden, info=dict(info))

    def _compiled(self, tokens: Tensor) -> tuple[Tensor, Tensor, dict]:
        """The verification's package (its outputs are written again by its next call: copied), or
        dynamo's graph where the package is unavailable."""
        if self.aot is not None:
            try:
                logits, _, info = self.aot(self.model, tokens, self.cache, self.options)
                (hidden,) = self.aot.extras
                return logits.clone(), hidden.clone(), info
            except AotUnavailable:  # export or the package build refused this step: dynamo's graph instead
                self.aot = None
                self._verify_step = self._dynamo_verify()
        if self._verify_step is _verify:  # compile=False (tests)
            return _verify(self.model, tokens, self.cache, self.options)
        with DYNAMO_STEPS_LOCK:  # dynamo's graph: one compiled step at a time in a process (see fast.py)
            return self._verify_step(self.model, tokens, self.cache, self.options)

    def keep(self, out: ModelOutput, kept: Tensor, before: dict[str, Tensor]) -> None:
        """Of the verified tokens the row keeps its first kept (1,) (`model.keep_verified`); the
        carried state it sets is copied into the cache's fixed buffers."""
        buffers = dict(self.cache.state)
        self.model.keep_verified(self.cache, out, kept, before, self.options)
        keep_state_buffers(self.cache, buffers)
