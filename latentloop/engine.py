"""Inference engine: a generator that prefills the prompts into the KV cache, then yields one step
per new token, as nanochat's `Engine.generate` and litgpt's `generate_fn`.

    for step in stream(model, [prompt_ids], max_new_tokens=64, temperature=0.0, regime="soft"):
        print(step.tokens[0])          # the new token of row 0 (None once that row stopped)
        if done():                     # the caller stops by breaking out of the loop
            break

    ids = generate(model, prompt_ids, 64)   # the same, collected: the new ids of each prompt

The model decides what a prefill and a decode step mean for it through the decoding protocol
(`prefill` / `decode` / `reference`, see `latentloop.models.backbone`). The architecture's options
(`regime=`, `passes=`, `steps=`, ...) are checked here once per call against the options it
declares, then handed to the model complete. `use_cache=False` runs the naive reference: the whole
sequence again at every step, no cache; both paths sample identically, so greedy outputs must
match token for token (tested).

Prompts of different lengths are left-padded into one batch; the padding is masked and positions
are counted per row, so each row decodes exactly as it would alone.

`teacher_forced_logits` is the one scoring path: the prefix prefilled, the rest decoded
teacher-forced through the cache (loss/BPB and CORE scoring both use it).

Self-speculative decoding: when the options ask a model for a cheaper draft of itself (rgpt's
`draft_steps` / `draft_tokens`: the same weights and cache at fewer recurrence steps; the model's
`draft_options`), each round drafts k tokens with the draft, verifies them with ONE pass of the full
model over the k + 1 positions (the pending token and the drafts, teacher-forced through the cache),
keeps the prefix the full model accepts and takes the rest back out of the cache (`keep_verified`).
The acceptance is speculative sampling's (Leviathan et al. 2023, Chen et al. 2023): a drafted x is
kept with probability min(1, p(x) / q(x)) (p the full model's sampling distribution, q the draft's),
the first rejected position draws from normalize(max(0, p - q)), and a round whose drafts all pass
draws one more token from p; so every token has exactly the full model's distribution, and greedy
decoding (argmax agreement) gives the full model's tokens. Rows accept prefixes of their own
lengths; the generator still yields one token per row per step. The model and cache work of a round
is a drafting object's: `EagerDrafting` (an ordinary cache, any batch) or, for one row whose step
compiles, `inference.speculative.CompiledDrafting` (compiled steps over a static cache), chosen as
the plain decode chooses its path (`compile=True`, or "auto" once compiling pays).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .errors import LatentloopError
from .inference.fast import PROBE_STEPS, AutoCompile, FastDecoder, fallback_reason, static_length
from .inference.quant import quantize_int8  # noqa: F401 (the engine's callers quantise through it: cli, api)
from .inference.speculative import CompiledDrafting, compiled_drafting_reason
from .models.backbone import PER_ROW_INFO, PER_TOKEN_INFO, Draft, shift_right
from .models.cache import KVCache, regroup
from .models.options import check_options, couples_rows, without_speed_only
from .util import evaluating, is_int, keep_evaluating

MAX_SEED = 2**63  # torch.Generator seeds are 64-bit
DECODE_MODES = (True, False, "auto")  # `compile=`: always the compiled step, never, or where it pays
# `kv_dtype=`: what the compiled step's cache stores keys and values in (llama.cpp's `--cache-type-k`)
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class PromptError(LatentloopError):
    """An empty or malformed prompt, a prompt that does not fit the model's context, or an invalid
    sampling setting."""


@dataclass
class DecodeStep:
    """One step of `stream`: the new token of each row, None for rows that have stopped."""

    tokens: list[int | None]
    logprobs: list[float | None] | None = None  # log-probability of each new token, when asked for
    info: dict = field(default_factory=dict)  # what the model reports (prefill passes, mean exit depth);
    # info[PER_ROW_INFO], when present: {name: [value per row]}, each row's own value (see `row_info`)
    top_logprobs: list[list[tuple[int, float]] | None] | None = None  # per row: the k most likely (id, logprob)


def row_info(info: dict, row: int) -> dict:
    """What the model reported for one row: the shared facts, with the row's own values where the
    model gives them per row (`info[PER_ROW_INFO]`, e.g. rgpt's mean exit depth)."""
    shared = {name: value for name, value in reported(info).items() if name != PER_ROW_INFO}
    return {**shared, **{name: values[row] for name, values in info.get(PER_ROW_INFO, {}).items()}}


def reported(info: dict) -> dict:
    """A model output's info as a decode step reports it: without the per-column facts
    (`PER_TOKEN_INFO`), which only self-speculative decoding reads, for the columns it keeps."""
    return {name: value for name, value in info.items() if name != PER_TOKEN_INFO}


# --------------------------------------------------------------------------------------------
# Checking what a caller passes
# --------------------------------------------------------------------------------------------


def check_sampling(temperature: float, top_k: int | None, top_p: float | None,
                   seed: int | Sequence[int] | None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise PromptError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise PromptError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not math.isfinite(top_p) or not 0 < top_p <= 1):
        raise PromptError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is None or is_int(seed) and 0 <= seed < MAX_SEED:
        return
    if isinstance(seed, (list, tuple)) and seed and all(is_int(s) and 0 <= s < MAX_SEED for s in seed):
        return  # one per row (`RowGenerators`): the rows' count is checked with the prompts
    raise PromptError(f"seed must be an integer in [0, 2**63), or a list of them (one per prompt), got {seed!r}"[:200])


def normalize_prompts(prompts, vocab_size: int) -> tuple[list[list[int]], bool]:
    """(list of id lists, whether one prompt was given) from one id list, a list of id lists, or a
    1-D / 2-D integer tensor; every id checked to be an integer in [0, vocab_size)."""
    if isinstance(prompts, Tensor):
        if prompts.dim() not in (1, 2) or prompts.dtype.is_floating_point or prompts.dtype == torch.bool \
                or prompts.is_complex():
            raise PromptError(f"a prompt tensor must be 1-D or 2-D integer ids, got {prompts.dim()}-D {prompts.dtype}")
        single = prompts.dim() == 1
        prompts = [prompts.tolist()] if single else prompts.tolist()
    elif isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise PromptError(f"prompts must be token ids (a list of ints, a list of lists or a tensor), "
                          f"got {type(prompts).__name__}; encode text with the tokenizer first")
    else:
        single = len(prompts) > 0 and not isinstance(prompts[0], (Sequence, Tensor))
        prompts = [prompts] if single else prompts
    rows = []
    for prompt in prompts:
        if isinstance(prompt, Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise PromptError(f"each prompt must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise PromptError("every prompt needs at least one token")
        bad = next((t for t in prompt if not is_int(t) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise PromptError(f"token ids must be integers in [0, {vocab_size}), got {bad!r}")
        rows.append(list(prompt))
    if not rows:
        raise PromptError("no prompt given")
    return rows, single


def fit_prompt(ids: Sequence[int], budget: int, bos_id: int) -> tuple[list[int], bool]:
    """A prompt cut to at most `budget` tokens: its leading BOS (when it has one) and its most
    recent tokens. Returns (ids, whether anything was cut)."""
    ids = list(ids)
    if len(ids) <= budget:
        return ids, False
    if budget >= 2 and ids and ids[0] == bos_id:
        return [bos_id] + ids[len(ids) - budget + 1:], True
    return ids[len(ids) - budget:], True


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


class RowGenerators(list):
    """A generator per row (`seed=[s0, s1, ...]`): each row draws from its own, so its draws are the
    ones it makes alone with its seed, whatever other rows share the batch (an evaluation's samples
    then do not change with its batch size). Self-speculative rounds draft as many tokens as the
    batch's longest-owing row wants, so there a row's draws still depend on its batch."""


Generators = torch.Generator | RowGenerators | None  # one for the batch, one per row, or unseeded


def make_generators(seed: int | Sequence[int] | None, device) -> Generators:
    if seed is None:
        return None
    if is_int(seed):
        return torch.Generator(device=device).manual_seed(int(seed))
    return RowGenerators(torch.Generator(device=device).manual_seed(int(s)) for s in seed)


def draw_from(probs: Tensor, generator: Generators) -> Tensor:
    """One draw per row of probs (B, V) -> (B, 1), from `generator` or each row's own."""
    if isinstance(generator, RowGenerators):
        return torch.cat([torch.multinomial(probs[row:row + 1], 1, generator=g) for row, g in enumerate(generator)])
    return torch.multinomial(probs, 1, generator=generator)


def uniform(rows: int, k: int, generator: Generators, device) -> Tensor:
    """(rows, k) uniform numbers in [0, 1), from `generator` or each row's own."""
    if isinstance(generator, RowGenerators):
        return torch.cat([torch.rand((1, k), generator=g, device=device) for g in generator])
    return torch.rand((rows, k), generator=generator, device=device)


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: Generators = None) -> Tensor:
    """Pick one token per row from logits (B, V). temperature 0 is greedy; otherwise a draw from
    `sampling_probs`."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return draw_from(sampling_probs(logits, temperature, top_k, top_p), generator).squeeze(-1)


def sampling_probs(logits: Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> Tensor:
    """The distribution `sample_next` draws from (temperature > 0), over the last dimension of
    logits (..., V), in float32.

    top_k keeps the k most likely tokens (ties at the k-th value all stay); top_p keeps the
    smallest set of most likely tokens whose probability reaches p (the token that crosses p
    stays; of tokens tied there, the lower ids first)."""
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # (..., V), a maximum of 0
    # divided by at least float32's smallest normal number: a tiny temperature (1e-300, 0 in float32)
    # then sends the other tokens to -inf (greedy in the limit) instead of every logit to +-inf or 0/0
    # (NaN probabilities)
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    logits = shifted / temperature
    # which tokens top_k and top_p keep is read off the logits before the temperature, whose order is
    # the same: a temperature past float32's range (1e39, which a "finite number" admits) divided every
    # logit to 0, and top_k=1 then kept every token (a uniform draw where the greedy token was asked)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(shifted, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(shifted < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        # stable: of tokens tied at the cut the lower ids stay, whatever the tensor's shape (a draft
        # drawn from one row and checked in a stack of rows must see the same support)
        order = shifted.masked_fill(logits == float("-inf"), float("-inf")).sort(dim=-1, descending=True,
                                                                                 stable=True).indices
        probs = logits.gather(-1, order).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
        drop_sorted = before >= top_p
        # the most likely token always stays: a top_p below float32's smallest number (1e-300, which
        # (0, 1] admits) compares as 0 and would drop every token, leaving NaN probabilities
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def written_rows(rows: Sequence[tuple[Sequence[int], Sequence[bool] | None]]) -> list[list[bool]] | None:
    """`stream`'s `written` for rows of (prompt, its flags or None): None where no row marks a token."""
    if not any(flags and any(flags) for _, flags in rows):
        return None
    return [list(flags) if flags else [False] * len(prompt) for prompt, flags in rows]


def left_pad_flags(flags: Sequence[Sequence[bool]], device: torch.device) -> Tensor:
    """Per-token flags of prompts (B, P) as `left_pad` lays the prompts out, False on the padding."""
    P = max(len(f) for f in flags)
    out = torch.zeros((len(flags), P), dtype=torch.bool, device=device)
    for row, values in enumerate(flags):
        if values:
            out[row, P - len(values):] = torch.as_tensor(list(values), dtype=torch.bool)
    return out


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """Stack prompts into (B, P) ids, left-padded; the mask is None when no row needed padding."""
    P = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), P), dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        idx[row, P - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, P - len(prompt):] = True
    return idx, (None if bool(mask.all()) else mask)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def model_options(model, options: dict, cached: bool = True) -> dict:
    """The model's declared options with `options` applied, checked once (one-line errors), the
    draft they ask for included (`draft_options`, which knows the model's depth, refuses what it
    cannot draft and a depth option no step could reach)."""
    options = check_options(model.OPTIONS, options, model.config.arch, cached=cached)
    draft_of(model, options)
    return options


def draft_of(model, options: dict) -> Draft | None:
    """The cheaper draft of itself the model declares for these options (self-speculative decoding),
    or None: no draft asked for, or a model without the protocol (a test's scripted one)."""
    draft_options = getattr(model, "draft_options", None)
    return None if draft_options is None else draft_options(options)


def stream(model, prompts, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, seed: int | Sequence[int] | None = None, stop_tokens: Sequence[int] = (),
           use_cache: bool = True, pad_id: int = 0, logprobs: bool = False, top_logprobs: int = 0,
           compile: bool | str = "auto", on_compile: Callable[[str], None] | None = None,
           kv_dtype: str | None = None, written=None, **options) -> Iterator[DecodeStep]:
    """Yield one `DecodeStep` per new token, for every row together, until every row stopped (a
    stop token, which is not yielded) or `max_new_tokens` steps. Break out to stop early.
    `logprobs`: each new token's log-probability; `top_logprobs=k`: also the k most likely tokens
    of each step with theirs (both from the logits before temperature and truncation).

    prompts: one list of ids, a list of lists, or a 1-D / 2-D tensor. Everything is checked here,
    before any work: a bad argument raises at the call, not at the first step.

    seed: an integer seeds one generator for the batch; a list of integers, one per prompt, seeds a
    generator per row (`RowGenerators`), so that a row draws what it draws alone with its seed.

    written: for each prompt, a bool per token, True where the model wrote the token itself (a
    conversation's earlier replies, `chat.chat_prompt`). A model with latent feedback
    (`REPLAYS_WRITTEN`: fbt, rfbt) prefills those as it generated them, fused with the state before
    them, as SFT trains them; other models read every token alike and are not handed it.

    compile: True decodes through `latentloop.inference.fast.FastDecoder` (a static cache and the
    model's decode step under `torch.compile`; greedy argmax inside the compiled step); outputs equal
    the eager path's (tested). The first call per model, options and batch size pays the compile, or
    loads it from the on-disk cache a previous process filled. "auto" (the default) decodes the first
    `PROBE_STEPS` steps eagerly, timing them, and moves the rest onto the compiled step when the
    saving reaches the expected compile cost (`AutoCompile`: batch <= 4; a ski-rental rule that also
    counts the earlier eager calls of the same shape, in this process and earlier ones); otherwise,
    and with False, it stays eager. Options whose
    step cannot be captured (rgpt's adaptive exit, mor's routing) decode eagerly; self-speculative
    decoding compiles its rounds for one row (`CompiledDrafting`), by the same rule.
    on_compile(message): told when a compile starts and ends (the CLI prints it).
    kv_dtype: "float16" or "bfloat16" stores the compiled step's cache in that dtype, as llama.cpp's
    default cache does (f16): half the bytes each step reads over a long context, so faster there, at
    the price of logits that differ from the eager path's by the rounding of the keys and values
    (None: the model's dtype, exact; "float32": float32, also exact, the model's dtype for a float32
    model and twice a bf16 model's cache bytes). Eager steps (compile=False, the automatic mode's
    probes or a model that does not compile) keep the model's dtype; self-speculative rounds refuse it.

    Options that ask the model for a draft of itself (rgpt's `draft_steps` / `draft_tokens`) decode
    self-speculatively (see the module docstring): the full model's tokens (greedy) or its
    distribution (sampled), fewer full passes; a seeded sample differs from the plain path's draw.
    """
    return _decode_in_inference_mode(*_checked(model, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                               stop_tokens, use_cache, pad_id, logprobs, top_logprobs, compile,
                                               on_compile, options, kv_dtype, written))


def _written_rows(written, rows: list[list[int]], single: bool) -> list[list[bool]] | None:
    """`stream`'s `written`, checked against the prompts: a list of bools per prompt (one list for
    one prompt), each as long as its prompt; None when no token is marked."""
    if written is None:
        return None
    if single and isinstance(written, (list, tuple)) and (not written or isinstance(written[0], bool)):
        written = [written]
    if (not isinstance(written, (list, tuple)) or len(written) != len(rows)
            or not all(isinstance(w, (list, tuple)) and len(w) == len(r) and all(isinstance(b, bool) for b in w)
                       for w, r in zip(written, rows))):
        raise PromptError("written must give a bool for every token of every prompt (True: a token the model "
                          "wrote), as long as the prompts")
    return [list(w) for w in written] if any(any(w) for w in written) else None


def _checked(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, use_cache, pad_id,
             logprobs, top_logprobs, compile, on_compile, options, kv_dtype=None, written=None) -> tuple:
    """`_decode`'s arguments from `stream`'s, each checked (a one-line `PromptError` otherwise)."""
    rows, single = normalize_prompts(prompts, model.config.vocab_size)
    written = _written_rows(written, rows, single)
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise PromptError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p, seed)
    if isinstance(seed, (list, tuple)) and len(seed) != len(rows):
        raise PromptError(f"seed: {len(seed)} seeds for {len(rows)} prompts (one per prompt, or one integer)")
    if not is_int(top_logprobs) or not 0 <= top_logprobs <= model.config.vocab_size:
        raise PromptError(f"top_logprobs must be an integer in [0, {model.config.vocab_size}], got {top_logprobs!r}")
    options = model_options(model, options, cached=use_cache)
    if not (compile is True or compile is False or (isinstance(compile, str) and compile in DECODE_MODES)):
        raise PromptError(f"compile must be True, False or 'auto', got {compile!r}")
    if compile is True and not use_cache:
        raise PromptError("compile=True decodes through the cache: it cannot be combined with use_cache=False "
                          "(--no-cache)")
    try:
        stops = frozenset(stop_tokens)
    except TypeError:
        stops = None
    if stops is None or not all(is_int(t) for t in stops):
        raise PromptError(f"stop_tokens must be a collection of token ids, got {stop_tokens!r}"[:200])
    if not is_int(pad_id) or not 0 <= pad_id < model.config.vocab_size:
        raise PromptError(f"pad_id must be a token id in [0, {model.config.vocab_size}), got {pad_id!r}")
    check_kv_dtype(model, options, kv_dtype, compile, use_cache)
    context = model.config.sequence_len
    longest = max(len(p) for p in rows)
    if longest + max_new_tokens > context:
        raise PromptError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                          f"context of {context} tokens")
    return (model, rows, max_new_tokens, temperature, top_k, top_p, seed, stops, use_cache, pad_id,
            logprobs, top_logprobs, options, compile, on_compile, None if kv_dtype is None else KV_DTYPES[kv_dtype],
            written if getattr(model, "REPLAYS_WRITTEN", False) else None)


def check_kv_dtype(model, options: dict, kv_dtype: str | None, compile: bool | str, use_cache: bool) -> None:
    """A one-line PromptError for a `kv_dtype` the decoding would not use (each was ignored silently,
    or, in `latentloop chat`, refused at every message): the compiled step's cache only. `options`
    are checked already (`model_options`)."""
    if kv_dtype is None:
        return
    if kv_dtype not in KV_DTYPES:
        raise PromptError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if not use_cache:
        raise PromptError("kv_dtype is the cache's dtype: it cannot be combined with use_cache=False (--no-cache)")
    if compile is False:
        raise PromptError("kv_dtype is the compiled step's cache: decode with compile=True or 'auto' "
                          "(--decode compiled or auto)")
    if draft_of(model, options) is not None:
        raise PromptError("kv_dtype applies to plain decoding: self-speculative rounds (draft_steps / "
                          "draft_tokens) keep the model's dtype")
    reason = fallback_reason(model, options)
    if reason is not None:
        raise PromptError(f"kv_dtype is the compiled step's cache, and this decoding does not compile ({reason}): "
                          f"it keeps the model's dtype")


def _decode(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, use_cache, pad_id,
            logprobs, top_logprobs, options, compile=False, on_compile=None,
            kv_dtype: torch.dtype | None = None, written: list[list[bool]] | None = None) -> Iterator[DecodeStep]:
    """The decode loop behind `stream`; run it in inference mode (lighter than no_grad: no version
    counters on the cache writes)."""
    with evaluating(model):
        device = next(model.parameters()).device
        idx, pad_mask = left_pad(prompts, pad_id, device)
        B, P = idx.shape
        generator = make_generators(seed, device)
        if max_new_tokens == 0:
            return
        finished = [False] * B
        # One new token comes from the prefill alone: no decode step, so no decoder and no static cache
        decodes = max_new_tokens > 1
        draft = draft_of(model, options) if use_cache and decodes else None
        drafting, auto_drafting = None, None
        if draft is not None:  # self-speculative rounds: compiled (`CompiledDrafting`, one row) or eager
            why_not = compiled_drafting_reason(model, options, draft, B)
            compiles = why_not is None
            if compiles and compile is True:
                drafting = CompiledDrafting(model, options, draft, on_compile)
            elif compile is True and on_compile is not None:  # asked for: said, not silently eager
                on_compile(f"decoding eagerly: the speculative rounds do not compile here ({why_not})")
            elif compiles and compile == "auto" and max_new_tokens > PROBE_STEPS + 1:
                auto_drafting = AutoCompile(model, options)  # a record of its own: the options name the draft
            compile = False
        fast = (FastDecoder(model, on_compile=on_compile, kv_dtype=kv_dtype, **options) if compile is True and decodes
                else None)
        if fast is not None and fast.reason is not None:  # this step cannot be captured: decode eagerly
            if on_compile is not None:  # compile=True asked for it: said, not silently eager
                on_compile(f"decoding eagerly: the decode step does not compile here ({fast.reason})")
            fast = None
        auto = AutoCompile(model, options, kv_dtype) if compile == "auto" and use_cache else None
        if auto is not None and not (auto.applies(B) and max_new_tokens > PROBE_STEPS + 1):
            auto = None  # too many rows, a step that does not compile, or too few steps to decide on
        probe_times: list[float] = []  # seconds of the eager steps timed for the automatic mode
        if fast is not None:
            cache = fast.new_cache(B, P + max_new_tokens)
        elif draft is not None:  # room for one round's verification past the generation (`_speculate`)
            needed = min(P + max_new_tokens + draft.tokens, model.config.sequence_len)
            if drafting is not None:
                cache = drafting.new_cache(needed)
            elif auto_drafting is not None:  # an ordinary cache of the static cache's length, to be adopted
                plain = without_speed_only(model.OPTIONS, options)
                cache = model.new_cache(B, static_length(model, B, needed, **plain), **options)
            else:
                cache = model.new_cache(B, needed, **options)
        elif auto is not None:  # an ordinary cache of the static cache's length, so the decoder can adopt it
            cache = model.new_cache(B, static_length(model, B, P + max_new_tokens, **options), **options)
        else:
            cache = model.new_cache(B, P + max_new_tokens, **options) if use_cache else None
        replay = {} if written is None else {"written": left_pad_flags(written, device)}  # (B, P)
        if cache is not None:
            out = model.prefill(idx, cache, pad_mask, last_logits=True, **replay, **options)
        else:
            out = model.reference(idx, pad_mask, P, **replay, **options)
        if auto is not None and auto.compiled_already(cache):  # compiled in this process: no probe steps
            fast = FastDecoder(model, on_compile=on_compile, kv_dtype=kv_dtype, **options)
            fast.adopt(cache)
            auto = None
        elif fast is not None:
            fast.begin_decoding(cache)
        info = reported(out.info)
        last, greedy = out.logits[:, -1], None  # (B, V); the compiled step's own argmax, once it runs
        if draft is not None:
            if drafting is not None:
                drafting.begin_decoding(cache)
            else:
                drafting = EagerDrafting(model, cache, options, draft)
            switch = None if auto_drafting is None else _AutoDrafting(auto_drafting, options, draft, on_compile)
            for made in _speculate(drafting, last, max_new_tokens, temperature, top_k, top_p, generator, stop_tokens,
                                   logprobs, top_logprobs, info, switch):
                yield made
                keep_evaluating(model)  # the caller may have set the model to training while this one waited
            return
        sequence = idx
        for step in range(max_new_tokens):
            if temperature == 0 and greedy is not None:
                next_ids = greedy  # (B,) argmax taken inside the compiled step: the same as sample_next's
            else:
                next_ids = sample_next(last, temperature, top_k, top_p, generator)  # (B,)
            tokens: list[int | None] = []
            for row, token in enumerate(next_ids.tolist()):
                finished[row] = finished[row] or token in stop_tokens
                tokens.append(None if finished[row] else token)
            if all(finished):
                return
            yield _step(tokens, next_ids, last, logprobs, top_logprobs, info)
            keep_evaluating(model)  # the caller may have set the model to training while this one waited
            if step == max_new_tokens - 1:
                return
            if auto is not None and len(probe_times) == PROBE_STEPS:
                if auto.decide(min(probe_times), max_new_tokens - 1 - step, cache):
                    fast = FastDecoder(model, on_compile=on_compile, kv_dtype=kv_dtype, **options)
                    fast.adopt(cache)
                auto = None
            if fast is not None:
                last, greedy, step_info = fast.step(next_ids)
                info = {**info, **step_info}
                continue
            if auto is not None:  # a probe step: timed (the device finishes it before the logits are read)
                start = time.perf_counter()
                out = model.decode(next_ids[:, None], cache, **options)
                out.logits[:, -1, :1].sum().item()
                probe_times.append(time.perf_counter() - start)
            elif cache is not None:
                out = model.decode(next_ids[:, None], cache, **options)
            else:
                sequence = torch.cat([sequence, next_ids[:, None]], dim=1)
                if pad_mask is not None:
                    pad_mask = torch.cat([pad_mask, torch.ones_like(pad_mask[:, :1])], dim=1)
                out = model.reference(sequence, pad_mask, P, **replay, **options)
            last = out.logits[:, -1]
            info = {**info, **reported(out.info)}


def _decode_in_inference_mode(*args) -> Iterator[DecodeStep]:
    """`_decode`, each of its steps under `torch.inference_mode`, as torch's decorator runs a generator
    function; but a generator dropped unfinished closes without entering the mode again: torch's
    decorator did, which at the interpreter's exit (a `stream` held in a variable, one step taken)
    found torch half torn down and printed a traceback."""
    steps = _decode(*args)
    while True:
        with torch.inference_mode():
            try:
                step = next(steps)
            except StopIteration:
                return
        yield step


def _step(tokens: list[int | None], ids: Tensor, logits: Tensor, logprobs: bool, top_logprobs: int,
          info: dict) -> DecodeStep:
    """The `DecodeStep` of new ids (B,) drawn from logits (B, V); `tokens`: each row's token, None
    for rows that stopped (their log-probabilities are not reported)."""
    logp = logits.float().log_softmax(dim=-1) if logprobs or top_logprobs else None
    row_logprobs = None
    if logprobs:
        chosen = logp.gather(-1, ids[:, None]).squeeze(-1)
        row_logprobs = [None if t is None else lp for t, lp in zip(tokens, chosen.tolist())]
    row_top = None
    if top_logprobs:
        values, top_ids = logp.topk(top_logprobs, dim=-1)
        row_top = [None if t is None else list(zip(i, v)) for t, i, v in zip(tokens, top_ids.tolist(),
                                                                              values.tolist())]
    return DecodeStep(tokens, row_logprobs, info, row_top)


# --------------------------------------------------------------------------------------------
# Self-speculative decoding (see the module docstring)
# --------------------------------------------------------------------------------------------


@dataclass
class _SpeculativeRow:
    """One row of a self-speculative decode: the tokens it made that were not yielded yet, each with
    the full model's logits (V,) it was drawn from, and its draft statistics."""

    queued: deque = field(default_factory=deque)  # (token, logits, facts) in order
    made: int = 0  # tokens made (queued or yielded)
    open: bool = True  # makes more tokens: no stop token made, the budget not reached
    drafted: int = 0
    accepted: int = 0

    def push(self, token: int, logits: Tensor, stop_tokens: frozenset, budget: int, facts: dict | None = None) -> None:
        """`facts`: what the model reported of the column whose logits these are (mor's depth)."""
        if self.open:
            self.queued.append((token, logits, facts or {}))
            self.made += 1
            self.open = token not in stop_tokens and self.made < budget


def accept_drafts(logits: Tensor, drafts: Tensor, draft_logits: Tensor, temperature: float,
                  top_k: int | None = None, top_p: float | None = None,
                  generator: Generators = None) -> tuple[Tensor, Tensor]:
    """Speculative sampling's acceptance over one verification: `logits` (B, k + 1, V), the full
    model's after the pending token and after each of the k drafts (B, k), which were drawn from
    `draft_logits` (B, k, V) (argmax at temperature 0). Returns the drafts each row accepts (B,),
    a prefix, and the token that follows them (B,): greedy, the full model's argmax there; sampled,
    a draw from normalize(max(0, p - q)) at the first rejected draft, from p after a full accept
    (p, q: `sampling_probs` of the full and draft logits)."""
    B, n, _ = logits.shape
    k = n - 1
    if k == 0:  # nothing drafted: the plain draw
        return logits.new_zeros(B, dtype=torch.long), sample_next(logits[:, 0], temperature, top_k, top_p, generator)
    if temperature == 0:
        target = logits.argmax(dim=-1)  # (B, k + 1)
        accepted = (target[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)
        return accepted, target.gather(1, accepted[:, None]).squeeze(1)
    p = sampling_probs(logits, temperature, top_k, top_p)  # (B, k + 1, V)
    q = sampling_probs(draft_logits, temperature, top_k, top_p)  # (B, k, V)
    p_drafted = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # (B, k)
    q_drafted = q.gather(-1, drafts[..., None]).squeeze(-1)  # > 0: each draft was drawn from q
    u = uniform(B, k, generator, logits.device)
    accepted = (u * q_drafted < p_drafted).long().cumprod(dim=1).sum(dim=1)  # u < p / q, drawn per draft
    rows = torch.arange(B, device=logits.device)
    target = p[rows, accepted]  # (B, V): p where each row stops
    q_after = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, accepted]  # after a full accept: no q
    residual = (target - q_after).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q up to rounding leaves no residual mass: p itself is then the distribution
    following = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), target)
    return accepted, draw_from(following, generator).squeeze(1)


class EagerDrafting:
    """The model and cache work of self-speculative rounds through an ordinary cache (any batch; the
    fast path's is `inference.speculative.CompiledDrafting`, with the same methods)."""

    def __init__(self, model, cache, options: dict, draft: Draft):
        self.model, self.cache, self.options, self.draft_spec = model, cache, options, draft

    def drafts(self, wanted: int) -> int:
        """Tokens to draft this round: the draft's k, fewer when no row needs them or the cache has no
        room for k + 1 more slots (after reclaiming the holes ragged rounds left)."""
        cache = self.cache
        k = min(self.draft_spec.tokens, wanted)
        if cache.length + k + 1 > cache.max_len:
            cache.compact()
        return max(0, min(k, cache.max_len - cache.length - 1))

    def snapshot(self) -> dict[str, Tensor]:
        return {name: value.clone() for name, value in self.cache.state.items()}

    def draft(self, token: Tensor) -> Tensor:
        return self.model.decode(token[:, None], self.cache, **self.draft_spec.options).logits[:, -1]  # (B, V)

    def take_back(self, k: int, before: dict[str, Tensor]) -> None:
        self.cache.rewind(k)
        self.cache.state = {name: value.clone() for name, value in before.items()}

    def verify(self, tokens: Tensor):
        return self.model.decode(tokens, self.cache, **self.options)  # (B, k + 1, V): one full pass

    def keep(self, out, kept: Tensor, before: dict[str, Tensor]) -> None:
        self.model.keep_verified(self.cache, out, kept, before, self.options)


class _AutoDrafting:
    """The automatic mode (`AutoCompile`'s rule) for self-speculative decoding of one row: the first
    rounds run eagerly, timed per token made; once they made `PROBE_STEPS` tokens, the rest moves to
    `CompiledDrafting` when compiling pays (the compile record is the draft options' own), adopting
    the cache (made at the static length for that)."""

    def __init__(self, rule: AutoCompile, options: dict, draft: Draft, on_compile):
        self.rule, self.options, self.draft, self.on_compile = rule, options, draft, on_compile
        self.seconds, self.tokens = 0.0, 0
        self.compiling_since: float | None = None

    def after_round(self, drafting, seconds: float, made: int, remaining: int):
        """The drafting object for the next rounds (`drafting`, or the compiled one it moves to)."""
        if self.compiling_since is not None:  # the first compiled round ran: what the next call pays
            self.rule.note_compiled(drafting.cache, time.perf_counter() - self.compiling_since)
            self.compiling_since = None
            return drafting
        if not isinstance(drafting, EagerDrafting) or self.tokens >= PROBE_STEPS:
            return drafting
        self.seconds, self.tokens = self.seconds + seconds, self.tokens + made
        if self.tokens < PROBE_STEPS:
            return drafting
        if not self.rule.decide(self.seconds / self.tokens, remaining, drafting.cache):
            return drafting
        compiled = CompiledDrafting(drafting.model, self.options, self.draft, self.on_compile)
        compiled.adopt(drafting.cache)
        self.compiling_since = time.perf_counter()
        return compiled


def _speculate(drafting, last: Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
               top_p: float | None, generator: Generators, stop_tokens: frozenset, logprobs: bool,
               top_logprobs: int, info: dict, switch: _AutoDrafting | None = None) -> Iterator[DecodeStep]:
    """`_decode`'s loop after the prefill when drafting: rounds of `_speculative_round` whenever a row
    still decoding has nothing queued, one `DecodeStep` per token position as the plain loop yields.
    `switch`: the automatic mode's move to the compiled rounds."""
    B = last.shape[0]
    rows = [_SpeculativeRow() for _ in range(B)]
    pending = sample_next(last, temperature, top_k, top_p, generator)  # (B,): made, not yet in the cache
    for row, token, logits in zip(rows, pending.tolist(), last):
        row.push(token, logits, stop_tokens, max_new_tokens)
    finished, passes = [False] * B, 0
    for _ in range(max_new_tokens):
        while any(not done and not row.queued for row, done in zip(rows, finished)):
            if switch is not None:  # only the automatic mode times its rounds
                start, made = time.perf_counter(), sum(row.made for row in rows)
            pending, round_info = _speculative_round(drafting, pending, rows, max_new_tokens, temperature, top_k,
                                                     top_p, generator, stop_tokens)
            passes += 1
            info = {**info, **round_info, "full_passes": passes}  # full-depth passes after the prefill
            if switch is not None:
                drafting = switch.after_round(drafting, time.perf_counter() - start,
                                              sum(row.made for row in rows) - made,
                                              max_new_tokens - min(row.made for row in rows))
        tokens: list[int | None] = []
        ids, logits = [0] * B, [last.new_zeros(last.shape[1:])] * B  # rows that stopped: placeholders
        facts: list[dict] = [{}] * B
        for b, row in enumerate(rows):
            if not finished[b]:
                ids[b], logits[b], facts[b] = row.queued.popleft()
                finished[b] = ids[b] in stop_tokens
            tokens.append(None if finished[b] else ids[b])
        if all(finished):
            return
        chosen = torch.stack(logits) if logprobs or top_logprobs else last  # read only for log-probabilities
        yield _step(tokens, torch.tensor(ids, device=last.device), chosen, logprobs, top_logprobs,
                    _with_token_facts(info, facts))


def _with_token_facts(info: dict, facts: list[dict]) -> dict:
    """The round's info with each row's per-row facts replaced by those of the token it yields now
    (a round verifies several columns; the model's per-row figure is its last one's, often a
    rejected draft's)."""
    names = {name for row_facts in facts for name in row_facts}
    if not names:
        return info
    per_row = dict(info.get(PER_ROW_INFO, {}))
    for name in names:
        values = list(per_row.get(name, [None] * len(facts)))
        per_row[name] = [row_facts.get(name, value) for row_facts, value in zip(facts, values)]
    return {**info, PER_ROW_INFO: per_row}


def _speculative_round(drafting, pending: Tensor, rows: list[_SpeculativeRow], max_new_tokens: int,
                       temperature: float, top_k: int | None, top_p: float | None,
                       generator: Generators, stop_tokens: frozenset) -> tuple[Tensor, dict]:
    """One round for every row (rows that stopped run along and keep nothing): up to the draft's k
    drafts from the pending tokens (B,), taken back out of the cache, then one full pass over the
    pending tokens and the drafts; each row keeps what the full model accepts (`accept_drafts`) and
    queues it with the token that follows, which becomes its pending token (returned). `drafting`
    does the model and cache work (`EagerDrafting`, `CompiledDrafting`)."""
    B, device = pending.shape[0], pending.device
    left = [max_new_tokens - row.made for row in rows]  # tokens each row may still make (>= 1 while open)
    wanted = max(n for n, row in zip(left, rows) if row.open) - 1  # drafts that could be used
    k = drafting.drafts(wanted)
    # A compiled round drafts its fixed k whatever is wanted; drafts past `useful` are made (argmax: no
    # random draw) and never judged, so a seed draws the same numbers on every path
    useful = min(k, wanted)
    before = drafting.snapshot()
    drafts, draft_logits, token = [], [], pending
    for i in range(k):
        q = drafting.draft(token)  # (B, V)
        token = sample_next(q, temperature if i < useful else 0.0, top_k, top_p, generator)
        drafts.append(token)
        draft_logits.append(q)
    if k:
        drafting.take_back(k, before)
    out = drafting.verify(torch.stack([pending, *drafts], dim=1))  # (B, k + 1, V): one full pass
    drafted = torch.stack(drafts[:useful], dim=1) if useful else pending.new_zeros((B, 0))
    accepted, following = accept_drafts(out.logits[:, :useful + 1], drafted,
                                        torch.stack(draft_logits[:useful], dim=1) if useful else out.logits[:, :0],
                                        temperature, top_k, top_p, generator)
    # the cache keeps the pending token and the accepted drafts, at most up to the row's budget (so
    # that it never holds more than a plain decode's tokens); rows that stopped keep nothing
    room = torch.tensor([max(n, 0) if row.open else 0 for n, row in zip(left, rows)], device=device)
    drafting.keep(out, torch.minimum(accepted + 1, room), before)
    counts, following_ids, drafted_ids = accepted.tolist(), following.tolist(), drafted.tolist()
    per_token = out.info.get(PER_TOKEN_INFO, {})  # {name: (B, k + 1) nested lists}: each verified column's
    for b, row in enumerate(rows):
        if row.open:
            row.drafted += useful
            row.accepted += counts[b]
            for i in range(counts[b] + 1):  # the accepted drafts, then the token that follows them
                token = drafted_ids[b][i] if i < counts[b] else following_ids[b]
                row.push(token, out.logits[b, i], stop_tokens, max_new_tokens,
                         {name: values[b][i] for name, values in per_token.items()})
    drafted_total = sum(row.drafted for row in rows)
    per_row = {**out.info.get(PER_ROW_INFO, {}),
               "draft_acceptance": [row.accepted / row.drafted if row.drafted else None for row in rows]}
    return following, {**reported(out.info), "draft_acceptance": (sum(row.accepted for row in rows) / drafted_total
                                                                  if drafted_total else None), PER_ROW_INFO: per_row}


def generate(model, prompts, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | Sequence[int] | None = None, stop_tokens: Sequence[int] = (),
             use_cache: bool = True, pad_id: int = 0, compile: bool | str = "auto",
             on_compile: Callable[[str], None] | None = None, kv_dtype: str | None = None, written=None,
             **options):
    """Continue each prompt by up to max_new_tokens tokens: the new ids (without the stop token),
    a list for one prompt, a list of lists for several. `stream` is the same, step by step (its
    arguments, `kv_dtype` and `written` included)."""
    rows, single = normalize_prompts(prompts, model.config.vocab_size)
    outputs: list[list[int]] = [[] for _ in rows]
    arguments = _checked(model, prompts if single else rows, max_new_tokens, temperature, top_k, top_p, seed,
                         stop_tokens, use_cache, pad_id, False, 0, compile, on_compile, options, kv_dtype, written)
    # One inference mode around the whole loop, where `stream` enters and leaves it around each step
    # (torch's decorator on a generator, so that a caller's code between steps runs in its own
    # mode): that cost ~4% of a 200-token greedy compiled decode of the small engines shape, 1 thread
    # (0.959x, paired in one process; issue 26)
    with torch.inference_mode():
        for step in _decode(*arguments):
            for row, token in enumerate(step.tokens):
                if token is not None:
                    outputs[row].append(token)
    return outputs[0] if single else outputs


def written_inputs(loss_mask: Tensor) -> Tensor:
    """The inputs (B, T) of packed conversation rows that the model wrote (its replies, as `stream`'s
    `written` marks them), from the rows' loss mask over their targets (B, T): input t was written
    exactly when target t - 1 counts (the positions fbt's SFT fuses, `sft_fuse_mask`)."""
    return shift_right(loss_mask.bool())


@torch.no_grad()
def teacher_forced_logits(model, idx: Tensor, pad_mask: Tensor | None = None, prompt_len: int | None = None,
                          written: Tensor | None = None, share_prompts: bool = False, **options) -> Tensor:
    """Logits (B, T, V) for a given text idx (B, T) as decoding would produce them: the first
    `prompt_len` columns prefilled into a cache (left-padded rows masked by `pad_mask`), the rest
    decoded teacher-forced. `prompt_len` None: as much as the architecture prefills when scoring
    a whole text (`teacher_forced_prompt_len`: all of it, fbt soft only position 0). `written`
    (B, T): the tokens the model wrote (a conversation's replies, `written_inputs`); a model that
    replays them (`REPLAYS_WRITTEN`) prefills the whole text so, as a chat reads its history (fbt
    soft: the replies fused, the rest plain, as SFT trains it). `share_prompts`: rows that repeat a
    prompt (a multiple-choice question's choices) prefill it once and copy its cache rows
    (`shared_prompts`, `regroup`): each row's logits are its own alone as in any batch, to float
    rounding, where the declarations do not couple the rows of a prefill."""
    options = model_options(model, options)
    replay = written is not None and getattr(model, "REPLAYS_WRITTEN", False) and bool(written.any())
    if replay and prompt_len is None:
        prompt_len = idx.shape[1]
    B, T = idx.shape
    context = model.config.sequence_len
    if T > context:  # found by the cache token by token, in fbt soft's decode as "65 tokens" whatever T was
        raise PromptError(f"the text is {T} tokens, beyond the model's context of {context} tokens")
    P = model.teacher_forced_prompt_len(T, options) if prompt_len is None else prompt_len
    if not 1 <= P <= T:
        raise PromptError(f"prompt_len must be in [1, {T}], got {P}")
    if pad_mask is not None and P < T and not bool(pad_mask[:, P:].all()):
        # the columns after the prefill are decoded unmasked: a pad there was read as text (fbt soft
        # prefills position 0 only, so any left padding reached them)
        raise PromptError(f"left padding reaches past the prefilled {P} columns; pass prompt_len >= the padding "
                          f"(the widest row's pad count) so every pad is masked in the prefill")
    prompts, prompt_mask = idx[:, :P], None if pad_mask is None else pad_mask[:, :P]
    shared = (shared_prompts(prompts, prompt_mask) if share_prompts and not replay
              and not couples_rows(model.OPTIONS, options) else None)
    with evaluating(model):  # as generate and stream: training's noise (fbt's jitter, rgpt's) off
        cache = model.new_cache(B, T, **options)
        if shared is None or not isinstance(cache, KVCache):  # (a test's scripted model: a cache of its own)
            extra = {"written": written[:, :P]} if replay else {}
            logits = model.prefill(prompts, cache, prompt_mask, **extra, **options).logits
        else:  # a multiple-choice example's choices share its context: prefilled once, its rows copied
            first, inverse = shared
            once = model.new_cache(len(first), T, **options)
            logits = model.prefill(prompts[first], once, None if prompt_mask is None else prompt_mask[first],
                                   **options).logits[inverse]
            if P == T:  # nothing to decode: no rows to copy
                return logits
            regroup(cache, [(once, inverse)])
            del once  # the decode holds B rows of cache, not B + U
        if P == T:
            return logits
        return torch.cat([logits, model.decode(idx[:, P:], cache, **options).logits], dim=1)


def shared_prompts(prompts: Tensor, pad_mask: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """Where rows of prompts (B, P) repeat (with their padding): the first row of each distinct
    prompt (U,) and each row's distinct prompt (B,), for a prefill of the U alone; None where
    every row differs."""
    key = prompts if pad_mask is None else torch.where(pad_mask, prompts, -1)  # (B, P)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    if len(distinct) == len(key):
        return None
    rows = torch.arange(len(key), device=key.device)
    first = torch.full((len(distinct),), len(key), device=key.device).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse
