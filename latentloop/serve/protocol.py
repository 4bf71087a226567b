"""The OpenAI completions protocol: a request body checked into a `CompletionRequest`, token
strings for logprobs, and errors in OpenAI's format.

Every check here raises an `APIError` with one clear line; the server turns it into
`{"error": {"message", "type", "param", "code"}}` with its HTTP status. Nothing here knows HTTP
or threads, so it is tested directly.

The architecture's inference options (fbt's `regime`, rgpt's `steps`, ...) are extra body fields,
taken from the model's declared `OPTIONS` (the same declarations as the CLI flags): an option of
another architecture is refused by `check_options` with the architecture's own message.

Every prompt is read as the start of a document, as the model was trained (`[BOS] + text`): the
server puts BOS in front of any prompt, text or token ids, that does not already start with it.
Echo and logprobs report the prompt as it was sent (without that added BOS); `usage` counts the
tokens the model read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..archs import option_union
from ..data.tokenizers import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
from ..engine import MAX_SEED, model_options
from ..errors import ConfigError, LatentloopError
from ..util import TokenText, is_int
from .limits import MAX_TEXT_BYTES, Limits, size_over

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions when max_tokens is not given
MAX_LOGPROBS = 5  # OpenAI's limit on `logprobs` (alternatives reported per token) for completions
MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`

# Body fields of OpenAI's /v1/completions this server reads (others are refused by name)
OPENAI_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                 "logprobs", "echo", "stop", "seed", "user", "best_of", "suffix", "presence_penalty",
                 "frequency_penalty", "logit_bias")
EXTRA_FIELDS = ("top_k",)  # sampling fields beyond OpenAI's (as vLLM accepts them)


class APIError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class CompletionRequest:
    prompts: list[list[int]]  # as the model reads them (BOS first)
    added_bos: list[bool]  # per prompt: whether the server put BOS in front (not echoed)
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k most likely
    echo: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    options: dict[str, Any] = field(default_factory=dict)  # the architecture's options given (checked)
    resolved: dict[str, Any] = field(default_factory=dict)  # every option that applies, defaults filled in

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# --------------------------------------------------------------------------------------------
# Field checks
# --------------------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_field(body: dict, name: str, default: Any, minimum: int, maximum: int | None = None,
               what: str | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise bad_request(f"{name} must be an integer {bounds}{what or ''}, got {value!r}", name)
    return value


def _bool_field(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value


def _unsupported(body: dict) -> None:
    """OpenAI fields this server accepts only at their neutral value."""
    if body.get("suffix") not in (None, ""):
        raise bad_request("suffix is not supported (this server only continues prompts)", "suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (not _is_number(value) or value != 0):
            raise bad_request(f"{name} is not supported (only 0)", name)
    if body.get("logit_bias") not in (None, {}):
        raise bad_request("logit_bias is not supported", "logit_bias")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"user must be a string, got {user!r}", "user")


def _stop_field(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
    return tuple(s for s in stops if s)  # an empty stop string would stop before any text


def _sampling(body: dict) -> tuple[float, float | None, int | None, int | None]:
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0  # OpenAI's default
    if not _is_number(temperature) or temperature < 0:
        raise bad_request(f"temperature must be a finite number >= 0, got {temperature!r}", "temperature")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise bad_request(f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    top_k = _int_field(body, "top_k", None, 1)
    seed = _int_field(body, "seed", None, 0, MAX_SEED - 1)
    return float(temperature), (None if top_p is None or top_p == 1 else float(top_p)), top_k, seed


CHAT_FIELDS = ("messages", "logprobs", "top_logprobs")  # chat-only fields, read before the shared checks


def _options(body: dict, model) -> tuple[dict[str, Any], dict[str, Any]]:
    """The architecture's options among the body's fields (given, and resolved with the defaults),
    checked against the model's declarations; any other unknown field is refused by name."""
    every_arch = option_union()
    known = set(OPENAI_FIELDS) | set(EXTRA_FIELDS)
    unknown = sorted(name for name in body if name not in known and name not in every_arch)
    if unknown:
        supported = ", ".join(option.name for option in model.OPTIONS) or "none"
        raise bad_request(f"unknown field(s): {', '.join(unknown)} (options of this model's arch "
                          f"{model.config.arch!r}: {supported})", unknown[0])
    given = {name: body[name] for name in body if name in every_arch and body[name] is not None}
    declared = {option.name: option for option in model.OPTIONS}
    try:
        for name, value in given.items():  # one option at a time first, so the error names it
            if name in declared and value is not None:
                declared[name].check(value)
        return given, _applicable(model, model_options(model, given))
    except ConfigError as exc:
        param = next((name for name in given if name in str(exc)), None)
        raise bad_request(str(exc), param) from None


def _applicable(model, resolved: dict[str, Any]) -> dict[str, Any]:
    """The resolved options without those that do not apply (fbt's passes outside regime fused)."""
    out = {}
    for option in model.OPTIONS:
        if option.applies_if is not None and resolved.get(option.applies_if[0]) not in option.applies_if[1]:
            continue
        out[option.name] = resolved[option.name]
    return out


# --------------------------------------------------------------------------------------------
# Prompts: the seam between a request and the model's token ids
# --------------------------------------------------------------------------------------------


def encode_text(tokenizer, text: str) -> list[int]:
    """The text's ids, through `encode_batch`: a Hugging Face tokenizer's one-text `encode` holds the
    GIL for its whole run (the event loop and every other thread of the server stop meanwhile), while
    its batch call releases it, so a long tokenization in a server thread holds up nobody else."""
    return tokenizer.encode_batch([text])[0]


def _checked_text(text: str, limits: Limits, param: str, what: str) -> str:
    """The text, or a 400 before it is tokenized: one that can never fit (by its size), or not UTF-8."""
    problem = limits.text_problem(text, what)
    if problem is not None:
        raise bad_request(problem, param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{what} is not valid UTF-8 text (it holds a lone surrogate)", param) from None
    return text


def completion_prompts(prompt: Any, tokenizer, vocab_size: int, limits: Limits,
                       n: int = 1) -> tuple[list[list[int]], list[bool]]:
    """The prompt ids of a completions request (what the model reads) and, per prompt, whether
    BOS was added in front. `prompt`: a string, a list of strings, a list of token ids, or a list
    of token-id lists (as OpenAI accepts). Everything that can be refused without tokenizing is
    refused first: more prompts x `n` than a batch holds, a text too large for the context, an id
    list longer than the context."""
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
        id_lists: list[Any] = []
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            texts, id_lists = prompt, []
        elif all(is_int(t) for t in prompt):
            texts, id_lists = None, [prompt]
        elif all(isinstance(p, list) for p in prompt):
            texts, id_lists = None, prompt
        else:
            raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                              "token-id lists (not a mix)", "prompt")
    else:
        raise bad_request(f"prompt must be a non-empty string or list, got {_describe(prompt)}", "prompt")
    _check_rows(len(texts or id_lists), n, limits)
    bos = tokenizer.bos_id
    for ids in id_lists:
        if len(ids) > limits.context:  # with BOS added, longer still
            raise bad_request(f"the prompt is {len(ids)} tokens; the model's context is {limits.context} tokens",
                              "prompt")
    texts = [_checked_text(text, limits, "prompt", "the prompt") for text in texts or []]
    prompts: list[list[int]] = []
    added: list[bool] = []
    for text in texts:
        prompts.append([bos] + encode_text(tokenizer, text))
        added.append(True)
    for ids in id_lists:
        if not ids:
            raise bad_request("a token-id prompt needs at least one token", "prompt")
        bad = next((t for t in ids if not is_int(t) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token ids must be integers in [0, {vocab_size}), got {bad!r}", "prompt")
        prompts.append(list(ids) if ids[0] == bos else [bos] + list(ids))
        added.append(ids[0] != bos)
    return prompts, added


def _check_rows(prompts: int, n: int, limits: Limits) -> None:
    if prompts * n > limits.max_rows:
        raise bad_request(f"this request asks for {prompts * n} rows (prompts x n); the server decodes at "
                          f"most {limits.max_rows} together (--max-batch-size)", "n")


def chat_prompts(messages: Any, tokenizer, limits: Limits) -> tuple[list[list[int]], list[bool]]:
    """The prompt ids of a chat request: the conversation rendered in the chat format of
    `latentloop.data.chat` (the one SFT trains on), ending with `<|assistant|>`. In latentloop's
    own format every message's content is in the prompt, so contents too large for the context
    together are refused before anything is rendered; a model's own template may leave text out
    (its output is bounded by the template's limits instead)."""
    from ..data.chat import ChatFormatError, render_prompt
    from ..data.tokenizers import ChatTemplate

    chat_format = getattr(tokenizer, "chat_tokens", None)
    if chat_format is None:
        raise bad_request("this model has no chat format (its tokenizer has no chat tokens): fine-tune it with "
                          "`latentloop train --stage sft`, or use /v1/completions", "messages")
    if not isinstance(chat_format, ChatTemplate) and isinstance(messages, list):
        contents = [m.get("content") for m in messages if isinstance(m, dict)]
        if all(isinstance(c, str) for c in contents):
            _checked_text("".join(contents), limits, "messages", "the messages' content")
    try:
        return [render_prompt(tokenizer, messages, "messages")], [False]
    except ChatFormatError as error:  # this conversation: the client can send another
        raise bad_request(str(error), "messages") from None
    except LatentloopError as error:  # the model's template itself (past its limits, ...): the server's fault
        raise APIError(500, f"the model's chat template failed: {error}", type="server_error",
                       code="chat_template_failed") from None


def _describe(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__


# --------------------------------------------------------------------------------------------
# The whole request
# --------------------------------------------------------------------------------------------


def parse_completion(body: Any, model, tokenizer, limits: Limits, served_name: str,
                     chat: bool = False) -> CompletionRequest:
    """A checked `CompletionRequest` from a decoded JSON body, or an APIError naming the problem.
    `chat`: a /v1/chat/completions body (`messages` instead of `prompt`; no echo, no logprobs)."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"model must be a string, got {name!r}", "model")
    if name is not None and name != served_name:
        raise APIError(404, f"the model {name!r} does not exist: this server serves {served_name!r}",
                       param="model", code="model_not_found")
    if chat:
        for field_name in ("prompt", "echo", "suffix"):
            if body.get(field_name) not in (None, False):
                raise bad_request(f"{field_name} is a /v1/completions field; a chat request sends messages", field_name)
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
            raise bad_request("logprobs are not supported on /v1/chat/completions (use /v1/completions)", "logprobs")
        messages = body.get("messages")
        body = {key: value for key, value in body.items() if key not in CHAT_FIELDS}
    options, resolved = _options(body, model)
    _unsupported(body)
    # the fields that cost nothing to check come before the prompt's, which tokenize or render
    temperature, top_p, top_k, seed = _sampling(body)
    n = _int_field(body, "n", 1, 1, limits.max_rows)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad_request(f"best_of is not supported (only best_of = n), got {best_of!r}", "best_of")
    if chat:
        if messages is None:
            raise bad_request("messages is required", "messages")
        prompts, added = chat_prompts(messages, tokenizer, limits)
    elif "prompt" not in body:
        raise bad_request("prompt is required", "prompt")
    else:
        prompts, added = completion_prompts(body["prompt"], tokenizer, model.config.vocab_size, limits, n)
    logprobs = _int_field(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = _bool_field(body, "echo")
    stream = _bool_field(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise bad_request("stream_options applies to stream=true only", "stream_options")
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise bad_request(f"stream_options must be {{\"include_usage\": true|false}}, got {stream_options!r}",
                              "stream_options")
        include_usage = _bool_field(stream_options, "include_usage")
    longest = max(len(p) for p in prompts)
    if longest > limits.context:
        raise bad_request(f"the prompt is {longest} tokens (with BOS); the model's context is {limits.context} tokens",
                          "prompt")
    if body.get("max_tokens") is None:  # OpenAI's default, shortened to what the context leaves
        max_tokens = min(DEFAULT_MAX_TOKENS, limits.max_tokens_cap, limits.context - longest)
    else:
        max_tokens = _int_field(body, "max_tokens", None, 0, limits.max_tokens_cap, " (--max-tokens-cap)")
        if longest + max_tokens > limits.context:
            raise bad_request(f"the prompt ({longest} tokens, with BOS) + max_tokens ({max_tokens}) exceeds the "
                              f"model's context of {limits.context} tokens", "max_tokens")
    return CompletionRequest(prompts=prompts, added_bos=added, max_tokens=max_tokens, temperature=temperature,
                             top_p=top_p, top_k=top_k, n=n, seed=seed, stop=_stop_field(body), logprobs=logprobs,
                             echo=echo, stream=stream, include_usage=include_usage, options=options,
                             resolved=resolved)


# --------------------------------------------------------------------------------------------
# Tokens as text (logprobs) and the tokenizer endpoints
# --------------------------------------------------------------------------------------------


def special_names(tokenizer) -> dict[int, str]:
    return {tokenizer.bos_id: BOS_TOKEN, tokenizer.eos_id: EOS_TOKEN, tokenizer.pad_id: PAD_TOKEN}


def token_string(tokenizer, token_id: int, specials: dict[int, str]) -> str:
    """How logprobs name a token: its text, a special token's name, or `bytes:\\xNN...` for bytes
    that are not whole UTF-8 characters (OpenAI's convention)."""
    if token_id in specials:
        return specials[token_id]
    raw = tokenizer.token_to_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def decode_with_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, list[int]]:
    """The text of ids (whole characters, invalid bytes replaced) and each token's character
    offset into it: where the text stood when the token began."""
    decoder = TokenText(tokenizer)
    text, offsets = "", []
    for token in ids:
        offsets.append(len(text))
        text += decoder.add(token)
    return text + decoder.finish(), offsets


def tokenize_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """/tokenize: the text's ids as a completions prompt would hold them; with add_special_tokens,
    BOS in front. A text that is exactly one special token's name gives that token's id (clients
    such as lm-eval learn the special ids this way); special names inside a longer text stay text,
    as in prompts. A text past MAX_TEXT_BYTES is refused before it is tokenized."""
    over = size_over(text, MAX_TEXT_BYTES)
    if over is not None:
        raise bad_request(f"prompt is {over} of text, over the {MAX_TEXT_BYTES:,} bytes /tokenize takes", "prompt")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("prompt is not valid UTF-8 text", "prompt") from None
    by_name = {name: token_id for token_id, name in special_names(tokenizer).items()}
    ids = [by_name[text]] if text in by_name else encode_text(tokenizer, text)
    return [tokenizer.bos_id] + ids if add_special_tokens else ids


def tokenizer_info(tokenizer, context: int) -> dict:
    """/tokenizer_info (vLLM's shape, read by lm-eval's remote tokenizer). eos_token is BOS's name:
    documents are packed as [BOS] + text, so BOS is also what ends a text for these models (it is
    what they predict there, and lm-eval uses this token as the context of an empty prompt)."""
    return {"tokenizer_class": type(tokenizer).__name__, "name": getattr(tokenizer, "name", None),
            "bos_token": BOS_TOKEN, "eos_token": BOS_TOKEN, "pad_token": PAD_TOKEN,
            "model_max_length": context, "vocab_size": tokenizer.vocab_size}
