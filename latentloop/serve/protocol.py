"""The OpenAI protocol's core, without HTTP and without the request models (`requests.py`): errors
in OpenAI's format, the `CompletionRequest` the scheduler decodes, a request's prompts as token ids,
token strings for logprobs, and the tokenizer endpoints' answers. Nothing here knows HTTP or
threads, so it is tested directly; nor does it need pydantic, so the scheduler runs without it.

Every refusal is an `APIError` with one clear line; the server turns it into
`{"error": {"message", "type", "param", "code"}}` with its HTTP status.

Every prompt is read as the start of a text, as the model's tokenizer starts one
(`tokenizer.as_prompt`): where it starts texts with BOS (latentloop's own; Llama's) the server puts
BOS in front of any prompt, text or token ids, that does not already start with it; a tokenizer
that adds none (an imported Qwen2's) reads the prompt as sent, as `transformers` does.
Echo and logprobs report the prompt as it was sent (without an added BOS); `usage` counts the
tokens the model read. A prompt's text is refused by its size before it is tokenized when it can
never fit the context (`limits.Limits.text_problem`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..data.tokenizers import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
from ..errors import LatentloopError
from ..util import TokenText, encodable, is_int
from .limits import MAX_TEXT_BYTES, Limits, size_over

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions when max_tokens is not given


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
    prompts: list[list[int]]  # as the model reads them (`tokenizer.as_prompt`: BOS first where it puts one)
    added_bos: list[bool]  # per prompt: whether the server put BOS in front (not echoed)
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # decode on past the model's end tokens, to max_tokens (vLLM's and llama.cpp's field)
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k most likely
    echo: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    options: dict[str, Any] = field(default_factory=dict)  # the architecture's options given (checked)
    resolved: dict[str, Any] = field(default_factory=dict)  # every option that applies, defaults filled in
    # per prompt, per token: True where the model wrote it (a chat's earlier replies; `engine.stream`'s
    # `written`); None when no token is marked
    written: list[list[bool]] | None = None
    reply: bool = False  # a chat reply encoded on its own (latentloop's format): `util.TokenText`'s message_start

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    if not encodable(text):
        raise bad_request(f"{what} is not valid UTF-8 text (it holds a lone surrogate)", param)
    return text


def completion_prompts(prompt: str | list, tokenizer, vocab_size: int, limits: Limits,
                       n: int = 1) -> tuple[list[list[int]], list[bool]]:
    """The prompt ids of a completions request (what the model reads, `tokenizer.as_prompt`) and,
    per prompt, whether BOS was added in front. `prompt`: a validated body's (a string, a list of
    strings, a list of token ids, or a list of token-id lists). Everything that can be refused
    without tokenizing is refused first: more prompts x `n` than a batch holds, a text too large for
    the context, an id list longer than the context."""
    if isinstance(prompt, str):
        texts, id_lists = [prompt], []
    elif all(isinstance(p, str) for p in prompt):
        texts, id_lists = prompt, []
    elif all(is_int(t) for t in prompt):
        texts, id_lists = [], [prompt]
    else:
        texts, id_lists = [], prompt
    rows = len(texts or id_lists) * n
    if rows > limits.max_rows:
        raise bad_request(f"this request asks for {rows} rows (prompts x n); the server decodes at most "
                          f"{limits.max_rows} together (--max-batch-size)", "n")
    for ids in id_lists:
        if len(ids) > limits.context:  # with BOS added, longer still
            raise bad_request(f"the prompt is {len(ids)} tokens; the model's context is {limits.context} tokens",
                              "prompt")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token ids must be integers in [0, {vocab_size}), got {bad!r}", "prompt")
    texts = [_checked_text(text, limits, "prompt", "the prompt") for text in texts]
    sent = [encode_text(tokenizer, text) for text in texts] + [list(ids) for ids in id_lists]
    prompts = [tokenizer.as_prompt(ids) for ids in sent]
    return prompts, [len(prompt) > len(ids) for prompt, ids in zip(prompts, sent)]


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
    offset into it: where the text stood when the token began, after what earlier tokens left
    (`TokenText.add_split`: the U+FFFD of an unfinished lead byte is the earlier token's, as `RowText`
    places a generated token)."""
    decoder = TokenText(tokenizer)
    text, offsets = "", []
    for token in ids:
        earlier, own = decoder.add_split(token)
        text += earlier
        offsets.append(len(text))
        text += own
    return text + decoder.finish(), offsets


def tokenize_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """/tokenize: the text's ids as a completions prompt would hold them; with add_special_tokens,
    as the model reads them (`tokenizer.as_prompt`: BOS in front where the tokenizer puts one). A
    text that is exactly one special token's name gives that token's id (clients such as lm-eval
    learn the special ids this way); special names inside a longer text stay text, as in prompts. A
    text past MAX_TEXT_BYTES is refused before it is tokenized."""
    over = size_over(text, MAX_TEXT_BYTES)
    if over is not None:
        raise bad_request(f"prompt is {over} of text, over the {MAX_TEXT_BYTES:,} bytes /tokenize takes", "prompt")
    if not encodable(text):
        raise bad_request("prompt is not valid UTF-8 text", "prompt")
    by_name = {name: token_id for token_id, name in special_names(tokenizer).items()}
    ids = [by_name[text]] if text in by_name else encode_text(tokenizer, text)
    return tokenizer.as_prompt(ids) if add_special_tokens else ids


def tokenizer_info(tokenizer, context: int) -> dict:
    """/tokenizer_info (vLLM's shape, read by lm-eval's remote tokenizer). eos_token is BOS's name:
    training documents are packed as [BOS] + text, so BOS is also what ends a text for these models
    (it is what they predict there, and lm-eval uses this token as the context of an empty prompt).
    A prompt starts with BOS only where the tokenizer adds one (`adds_bos`: a model trained here, a
    Llama; not an imported Qwen2), which `add_bos_token` says, as a transformers tokenizer_config does."""
    return {"tokenizer_class": type(tokenizer).__name__, "name": getattr(tokenizer, "name", None),
            "bos_token": BOS_TOKEN, "eos_token": BOS_TOKEN, "pad_token": PAD_TOKEN,
            "add_bos_token": bool(tokenizer.adds_bos),
            "model_max_length": context, "vocab_size": tokenizer.vocab_size}
