"""Inference engine: prefill and one-token decode steps with the KV cache, plus sampling.

`generate` works for every architecture: it calls `model.generate_step(idx, cache, pad_mask,
prompt_len, **options)`, where the model decides what a prefill and a decode step mean for it
(options such as `regime=`, `passes=`, `steps=` belong to the variants; the baseline accepts none).
`use_cache=False` runs the naive reference: the whole sequence again at every step, no cache.
Both paths sample identically, so greedy outputs must match token for token (tested).

Prompts of different lengths are left-padded into one batch; the padding is masked and positions
are counted per row, so each row decodes exactly as it would alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .errors import LatentloopError

StreamCallback = Callable[[list[int | None]], None]  # new token per row (None once a row stopped)


class PromptError(LatentloopError):
    """An empty prompt, or a prompt that does not fit the model's context."""


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """Pick one token per row from logits (B, V). temperature 0 is greedy."""
    if temperature < 0:
        raise PromptError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keeps the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """Stack prompts into (B, P) ids, left-padded; the mask is None when no row needed padding."""
    P = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), P), dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        idx[row, P - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, P - len(prompt):] = True
    return idx, (None if bool(mask.all()) else mask)


@torch.inference_mode()  # lighter than no_grad: no version counters on the cache writes
def generate(model, prompts, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop_tokens: Sequence[int] = (),
             stream: StreamCallback | None = None, use_cache: bool = True, pad_id: int = 0, info: dict | None = None,
             **options):
    """Continue each prompt by up to max_new_tokens tokens.

    prompts: one list of ids, a list of lists, or a (B, T) tensor. Returns the new ids (without the
    stop token) as a list, or a list of lists when several prompts were given. Pass a dict as `info`
    to receive what the model reports about the prefill (e.g. `prefill_passes` under passes="auto").
    """
    single = isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int)
    if isinstance(prompts, Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    elif single:
        prompts = [list(prompts)]
    prompts = [list(p) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise PromptError("every prompt needs at least one token")
    if max_new_tokens < 0:
        raise PromptError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    options = {name: value for name, value in options.items() if value is not None}
    model.check_options(options)
    context = model.config.sequence_len
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context:
        raise PromptError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                          f"context of {context} tokens")
    was_training = model.training
    model.eval()
    try:
        generated = _decode_loop(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, set(stop_tokens),
                                 stream, use_cache, pad_id, options, info if info is not None else {})
    finally:
        model.train(was_training)
    return generated[0] if single else generated


def _decode_loop(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, stream,
                 use_cache, pad_id, options, info) -> list[list[int]]:
    device = next(model.parameters()).device
    idx, pad_mask = left_pad(prompts, pad_id, device)
    B, P = idx.shape
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in range(B)]
    if max_new_tokens == 0:
        return outputs
    finished = [False] * B
    cache = model.new_cache(B, P + max_new_tokens, **options) if use_cache else None
    out = model.generate_step(idx, cache=cache, pad_mask=pad_mask, prompt_len=P, **options)
    info.update(out.info)
    sequence = idx
    for step in range(max_new_tokens):
        next_ids = sample_next(out.logits[:, -1], temperature, top_k, top_p, generator)  # (B,)
        ids = next_ids.tolist()
        reported: list[int | None] = []
        for row, token in enumerate(ids):
            if finished[row] or token in stop_tokens:
                finished[row] = True
                reported.append(None)
            else:
                outputs[row].append(token)
                reported.append(token)
        if stream is not None:
            stream(reported)
        if all(finished) or step == max_new_tokens - 1:
            break
        if cache is not None:
            out = model.generate_step(next_ids[:, None], cache=cache, prompt_len=P, **options)
            info.update(out.info)
        else:
            sequence = torch.cat([sequence, next_ids[:, None]], dim=1)
            if pad_mask is not None:
                pad_mask = torch.cat([pad_mask, torch.ones_like(pad_mask[:, :1])], dim=1)
            out = model.generate_step(sequence, cache=None, pad_mask=pad_mask, prompt_len=P, **options)
    return outputs
