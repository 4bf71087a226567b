"""The request bodies as pydantic models, and their refusals in one line: what /v1/completions,
/v1/chat/completions, /tokenize and /detokenize take, checked before any work is done for them.

Bodies are validated strictly (JSON's own types: no "3" for 3, no true for 1) with the server's
limits in the validation context (`body_context`). A refused body is one `APIError` (`refusal`): a
field of the wrong type or out of range is "<field> must be <what it takes>, got <value>", from the
field's description; the checks that say something else raise `refuse(...)` with their own line.
The server validates in a worker thread, after reading the body with its own limits (`serving.py`).

The architecture's inference options (fbt's `regime`, rgpt's `steps`, ...) are fields of every
completions and chat body, one per option of any registered architecture (`latentloop.archs.
option_union`, the declarations behind the CLI's flags): an option of another architecture than the
served model's is refused with the architecture's own message, any other unknown field by its name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..archs import option_union
from ..data.chat import prompt_written, replies_encoded_alone
from ..engine import MAX_SEED, model_options
from ..errors import ConfigError
from ..util import encodable
from .limits import Limits
from .protocol import DEFAULT_MAX_TOKENS, APIError, CompletionRequest, bad_request, chat_prompts, completion_prompts

MAX_LOGPROBS = 5  # OpenAI's limit on `logprobs` (alternatives reported per token) for completions
MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`
SHOWN_CHARS = 80  # the most characters of a refused value an error message repeats
REFUSED = "latentloop_refused"  # the pydantic error type of a check that says its own line (`refuse`)


# --------------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------------


def refuse(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> PydanticCustomError:
    """A check's own one-line refusal, raised inside a validator (`refusal` turns it into an APIError)."""
    return PydanticCustomError(REFUSED, "{message}", {"message": message, "param": param, "status": status,
                                                      "code": code})


def body_context(model, limits: Limits, served_name: str) -> dict:
    """What a body's validators read: the served model (its architecture's options), the limits,
    the vocabulary and the name clients send."""
    return {"model": model, "limits": limits, "vocab_size": int(model.config.vocab_size), "served_name": served_name}


class _Body(BaseModel):
    """A JSON request body: JSON's own types, strictly; fields it does not declare are refused."""

    model_config = ConfigDict(strict=True, extra="forbid", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool | None = None


NonEmptyText = Annotated[list[str], Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]
TokenIdLists = Annotated[list[TokenIds], Field(min_length=1)]


class _NamesTheModel(_Body):
    """A body that may name the model it is for: only the served one (else 404)."""

    model: str | None = Field(None, description="a string")

    @field_validator("model")
    @classmethod
    def _served(cls, name: str | None, info: ValidationInfo) -> str | None:
        served = info.context["served_name"]
        if name is not None and name != served:
            raise refuse(f"the model {name!r} does not exist: this server serves {served!r}", "model", 404,
                         "model_not_found")
        return name


class _GenerationFields(_NamesTheModel):
    """The fields /v1/completions and /v1/chat/completions share, in the order they are checked."""

    user: str | None = Field(None, description="a string")
    presence_penalty: Any = None  # OpenAI's, accepted at their neutral value only
    frequency_penalty: Any = None
    logit_bias: Any = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False, description="a finite number >= 0")
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="a number in (0, 1]")
    top_k: int | None = Field(None, ge=1, description="an integer >= 1")  # beyond OpenAI's, as vLLM takes it
    seed: int | None = Field(None, ge=0, le=MAX_SEED - 1, description=f"an integer in [0, {MAX_SEED - 1}]")
    n: int | None = Field(None, ge=1, description="an integer in [1, {max_rows}]")
    best_of: Any = None
    stream: bool | None = Field(None, description="true or false")
    stream_options: StreamOptions | None = Field(None, description='{{"include_usage": true|false}}')
    max_tokens: int | None = Field(None, ge=0, description="an integer in [0, {max_tokens_cap}] (--max-tokens-cap)")
    stop: str | list[str] | None = Field(None, description="a string or a list of strings")
    # beyond OpenAI's, as vLLM and llama.cpp's server take it: every request generates max_tokens tokens (a
    # load test's equal work), `stop` strings still apply
    ignore_eos: bool | None = Field(None, description="true or false")
    _options: dict[str, Any] = PrivateAttr(default_factory=dict)  # set by `_together`
    _resolved: dict[str, Any] = PrivateAttr(default_factory=dict)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: Any, info: ValidationInfo) -> Any:
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if value is not None and (not number or value != 0):
            raise refuse(f"{info.field_name} is not supported (only 0)", info.field_name)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = isinstance(value, dict) and all(
            isinstance(bias, (int, float)) and not isinstance(bias, bool) and bias == 0 for bias in value.values())
        if value is not None and not neutral:
            raise refuse("logit_bias is not supported (only biases of 0)", "logit_bias")
        vocab = int(info.context["model"].config.vocab_size)
        for key in value or {}:  # OpenAI's keys: token ids as strings
            if not (key.isascii() and key.isdigit() and int(key) < vocab):
                raise refuse(f"logit_bias keys are token ids in [0, {vocab}), got {_shown(key)}", "logit_bias")
        return value

    @field_validator("n")
    @classmethod
    def _fits_a_batch(cls, n: int | None, info: ValidationInfo) -> int | None:
        if n is not None and n > info.context["limits"].max_rows:
            raise ValueError("n")  # described by the field
        return n

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)  # the latter: chat's
    @classmethod
    def _within_the_cap(cls, max_tokens: int | None, info: ValidationInfo) -> int | None:
        if max_tokens is not None and max_tokens > info.context["limits"].max_tokens_cap:
            raise ValueError(info.field_name)  # described by the field
        return max_tokens

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise refuse(f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}", "stop")
        if not all(encodable(text) for text in ([stop] if isinstance(stop, str) else stop or [])):
            # as a prompt's: a stop no generated text could ever hold
            raise refuse("stop is not valid UTF-8 text (it holds a lone surrogate)", "stop")
        return stop

    @model_validator(mode="after")
    def _together(self, info: ValidationInfo) -> _GenerationFields:
        if self.best_of is not None and self.best_of != (1 if self.n is None else self.n):
            raise refuse(f"best_of is not supported (only best_of = n), got {_shown(self.best_of)}", "best_of")
        if self.stream_options is not None and not self.stream:
            raise refuse("stream_options applies to stream=true only", "stream_options")
        model = info.context["model"]
        given = {name: value for name in option_union() if (value := getattr(self, name)) is not None}
        declared = {option.name: option for option in model.OPTIONS}
        try:
            for name, value in given.items():  # one option at a time first, so the error names it
                if name in declared:
                    declared[name].check(value)
            resolved = _applicable(model, model_options(model, given))
        except ConfigError as exc:
            raise refuse(str(exc), _first_named(str(exc), given)) from None
        self._options, self._resolved = given, resolved
        return self

    def arch_options(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the architecture's options given, every option that applies with defaults filled in)."""
        return self._options, self._resolved


def _first_named(message: str, names) -> str | None:
    """The name, of `names`, that `message` mentions first as a word of its own (`steps` is not
    named by a message about `draft_steps`)."""
    found = [(match.start(), name) for name in names if (match := re.search(rf"\b{re.escape(name)}\b", message))]
    return min(found)[1] if found else None


def _applicable(model, resolved: dict[str, Any]) -> dict[str, Any]:
    """The resolved options without those that do not apply (fbt's passes outside regime fused)."""
    out = {}
    for option in model.OPTIONS:
        if option.applies_if is not None and not option.applies_if.holds(resolved):
            continue
        out[option.name] = resolved[option.name]
    return out


class _CompletionFields(_GenerationFields):
    suffix: Any = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=f"an integer in [0, {MAX_LOGPROBS}]")
    echo: bool | None = Field(None, description="true or false")
    prompt: str | NonEmptyText | TokenIds | TokenIdLists = Field(
        description="a string, a list of strings, a list of token ids or a list of token-id lists (not a mix, "
                    "none empty)")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        if value not in (None, ""):
            raise refuse("suffix is not supported (this server only continues prompts)", "suffix")
        return value


class _ChatFields(_GenerationFields):
    prompt: Any = None  # /v1/completions' fields, refused by name
    echo: Any = None
    suffix: Any = None
    logprobs: Any = None  # OpenAI's chat logprobs: not supported
    top_logprobs: Any = None
    # OpenAI's chat name for max_tokens (which it keeps as a deprecated alias)
    max_completion_tokens: int | None = Field(None, ge=0, description="an integer in [0, {max_tokens_cap}] "
                                                                      "(--max-tokens-cap)")
    messages: Any  # checked by latentloop.data.chat as it renders them

    @model_validator(mode="after")
    def _one_budget(self) -> _ChatFields:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise refuse(f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                         f"differ: send one", "max_completion_tokens")
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    @field_validator("prompt", "echo", "suffix")
    @classmethod
    def _completions_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False):
            raise refuse(f"{info.field_name} is a /v1/completions field; a chat request sends messages",
                         info.field_name)
        return value

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False) or (info.field_name == "top_logprobs" and value is not None):
            raise refuse("logprobs are not supported on /v1/chat/completions (use /v1/completions)", "logprobs")
        return value


@functools.cache
def _with_arch_options(base: type[_GenerationFields]) -> type[_GenerationFields]:
    """`base` with one field per option of every registered architecture (checked together against
    the served model's declarations by `_GenerationFields._together`). Built at first use, from the
    architectures registered by then."""
    fields = {name: (Any, Field(None, description=option.help)) for name, (option, _) in option_union().items()}
    return create_model(base.__name__.strip("_").replace("Fields", "Body"), __base__=base, **fields)


def completion_body() -> type[_CompletionFields]:
    """The /v1/completions body's model."""
    return _with_arch_options(_CompletionFields)


def chat_body() -> type[_ChatFields]:
    """The /v1/chat/completions body's model."""
    return _with_arch_options(_ChatFields)


def _fields_taken(model_class: type[BaseModel]) -> str:
    """The fields a body takes, as its refusals list them: those with a description (a field read only to be
    refused, `messages` say, has none)."""
    return ", ".join(name for name, field in model_class.model_fields.items() if field.description)


# vLLM's chat-form fields of /tokenize beside `messages` (read so that such a body hears about messages)
CHAT_FORM_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                    "tools")


class TokenizeBody(_NamesTheModel):
    """/tokenize: vLLM's completion form (lm-eval's remote tokenizer sends prompt and
    add_special_tokens). vLLM's chat form (messages) and its token strings are refused by name, and
    any other field as unknown: ignoring them answered a question the client did not ask."""

    messages: Any = None  # before prompt: a chat-form body hears of this, not that prompt is missing
    # vLLM's chat form's other fields (its clients send add_generation_prompt by default): read so that such a
    # body hears about messages, not about an unknown field; not listed as fields this endpoint takes
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    tools: Any = None
    prompt: str = Field(description="a string")
    add_special_tokens: bool = Field(True, description="true or false")
    return_token_strs: bool | None = Field(None, description="false (token strings are not supported)")

    @field_validator("return_token_strs")
    @classmethod
    def _no_token_strings(cls, value: bool | None) -> bool | None:
        if value:
            raise refuse("return_token_strs is not supported (/detokenize turns ids into text)", "return_token_strs")
        return value

    @model_validator(mode="after")
    def _chat_fields_only_with_messages(self) -> TokenizeBody:
        """The chat form's other fields in a prompt body: unknown there, as any field this endpoint ignores."""
        given = sorted(name for name in CHAT_FORM_FIELDS if getattr(self, name) is not None)
        if self.messages is None and given:
            raise refuse(f"unknown field(s): {', '.join(given)} (this endpoint takes {_fields_taken(type(self))})",
                         given[0])
        return self

    @field_validator("messages")
    @classmethod
    def _no_chat_form(cls, value: Any) -> Any:
        if value is not None:
            raise refuse("/tokenize takes a prompt, not messages (a conversation's tokens: POST /v1/chat/completions "
                         "with max_tokens 0 reports them in usage.prompt_tokens)", "messages")
        return value


class DetokenizeBody(_NamesTheModel):
    """/detokenize (vLLM's)."""

    tokens: list[int] = Field(description="a list of token ids in [0, {vocab_size})")

    @field_validator("tokens")
    @classmethod
    def _in_the_vocabulary(cls, tokens: list[int], info: ValidationInfo) -> list[int]:
        vocab = info.context["vocab_size"]
        if any(not 0 <= token < vocab for token in tokens):
            raise ValueError("tokens")  # described by the field
        return tokens


def _shown(value: Any) -> str:
    """A value as an error message repeats it: its repr, cut at SHOWN_CHARS characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def refusal(error: ValidationError, model_class: type[BaseModel], body: Any, context: dict) -> APIError:
    """The one line a refused body gets: the refused model first (404), then the unknown fields,
    then the first field checked (the order of the model's fields)."""
    errors = error.errors(include_url=False)
    if not isinstance(body, dict):
        return bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    own = [e for e in errors if e["type"] == REFUSED]
    unknown = [e["loc"][0] for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    if own and own[0]["ctx"]["status"] != 400:
        return _own(own[0])
    if unknown and issubclass(model_class, _GenerationFields):
        model = context["model"]
        supported = ", ".join(option.name for option in model.OPTIONS) or "none"
        return bad_request(f"unknown field(s): {', '.join(sorted(unknown))} (options of this model's arch "
                           f"{model.config.arch!r}: {supported})", sorted(unknown)[0])
    if unknown:
        return bad_request(f"unknown field(s): {', '.join(sorted(unknown))} (this endpoint takes "
                           f"{_fields_taken(model_class)})", sorted(unknown)[0])
    first = errors[0]
    if first["type"] == REFUSED:
        return _own(first)
    name = first["loc"][0]
    if first["type"] == "missing":
        return bad_request(f"{name} is required", name)
    values = {**dataclasses.asdict(context["limits"]), "vocab_size": context["vocab_size"]}
    what = model_class.model_fields[name].description.format(**values)
    return bad_request(f"{name} must be {what}, got {_shown(body.get(name))}", name)


def _own(error: dict) -> APIError:
    ctx = error["ctx"]
    return APIError(ctx["status"], ctx["message"], param=ctx["param"], code=ctx["code"])


def validate(model_class: type[BaseModel], body: Any, context: dict) -> Any:
    """The body as `model_class`, or the APIError of its first problem (`refusal`)."""
    try:
        return model_class.model_validate(body, context=context)
    except ValidationError as error:
        raise refusal(error, model_class, body, context) from None


# --------------------------------------------------------------------------------------------
# A validated body into the scheduler's CompletionRequest
# --------------------------------------------------------------------------------------------


def completion_request(body: _GenerationFields, model, tokenizer, limits: Limits) -> CompletionRequest:
    """The `CompletionRequest` of a validated completions or chat body: its prompts tokenized (or
    its conversation rendered), the defaults filled in, and what needs the prompts' lengths checked."""
    n = 1 if body.n is None else body.n
    written = None
    if isinstance(body, _ChatFields):
        prompts, added = chat_prompts(body.messages, tokenizer, limits)
        logprobs, echo = None, False
        if getattr(model, "REPLAYS_WRITTEN", False):  # the earlier replies, read as the model wrote them (fbt)
            written = [prompt_written(tokenizer, body.messages, prompts[0], "messages")]
    else:
        prompts, added = completion_prompts(body.prompt, tokenizer, int(model.config.vocab_size), limits, n)
        logprobs, echo = body.logprobs, bool(body.echo)
    longest = max(len(p) for p in prompts)
    if longest > limits.context:
        raise bad_request(f"the prompt is {longest} tokens (with BOS); the model's context is {limits.context} tokens",
                          "prompt")
    if body.max_tokens is None:  # OpenAI's defaults: 16 for completions, a chat reply up to the context
        default = limits.max_tokens_cap if isinstance(body, _ChatFields) else DEFAULT_MAX_TOKENS
        max_tokens = min(default, limits.max_tokens_cap, limits.context - longest)
    else:
        max_tokens = body.max_tokens
        if longest + max_tokens > limits.context:
            raise bad_request(f"the prompt ({longest} tokens, with BOS) + max_tokens ({max_tokens}) exceeds the "
                              f"model's context of {limits.context} tokens", "max_tokens")
    stop = [] if body.stop is None else [body.stop] if isinstance(body.stop, str) else body.stop
    options, resolved = body.arch_options()
    return CompletionRequest(
        prompts=prompts, added_bos=added, max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
        top_p=None if body.top_p in (None, 1) else body.top_p, top_k=body.top_k, n=n, seed=body.seed,
        stop=tuple(s for s in stop if s),  # an empty stop string would stop before any text
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs, echo=echo, stream=bool(body.stream),
        include_usage=bool(body.stream_options is not None and body.stream_options.include_usage),
        options=options, resolved=resolved, written=written,
        reply=isinstance(body, _ChatFields) and replies_encoded_alone(tokenizer))


def parse_completion(body: Any, model, tokenizer, limits: Limits, served_name: str,
                     chat: bool = False) -> CompletionRequest:
    """A checked `CompletionRequest` from a decoded JSON body, or an APIError naming the problem.
    `chat`: a /v1/chat/completions body (`messages` instead of `prompt`; no echo, no logprobs)."""
    body_class = chat_body() if chat else completion_body()
    validated = validate(body_class, body, body_context(model, limits, served_name))
    return completion_request(validated, model, tokenizer, limits)
