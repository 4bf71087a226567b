"""The conversation format: rendering, chat data files and packing into training rows.

Format (every tokenizer with latentloop's `chat_tokens`; a Hugging Face tokenizer with a chat
template renders with that instead, see "Chat templates" below):

    [BOS] <|system|> text <|end|>  <|user|> text <|end|>  <|assistant|> text <|end|>  <|user|> ...

([BOS] where the tokenizer starts a text with BOS, `tokenizer.as_prompt`: latentloop's own always
do; an imported tokenizer that adds none, Qwen2's, renders without it, as `transformers` does.)

The mask is True on the tokens the model is trained to write: the content of every assistant turn
and the `<|end|>` that closes it (so the model learns to stop). The role tokens, the system and
user turns and BOS are context only. To answer, a model reads `render_prompt(messages)`: the
conversation so far (ending with a user turn) followed by `<|assistant|>`, and writes until
`<|end|>`; so the position where training's mask starts is exactly where generation starts.

Chat data (`--data chat:SPEC`, `parse_chat_spec`):

- `chat:FILE.jsonl`: rows `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
  (OpenAI's format); an optional system turn first, then user and assistant alternating, starting
  with user and holding at least one assistant turn;
- `chat:FILE.jsonl:question=user,answer=assistant`: a field mapping for flat rows: each named
  field becomes one turn of that role, in the order given (e.g. `../shared/data/sft/gsm8k_train.jsonl`);
- `chat:task:NAME[:knobs]`: a built-in task (`latentloop.data.tasks`) as conversations: the
  prompt is the user turn, the completion (written steps and answer) the assistant turn.

Chat templates (`ChatTemplate`, an imported model's own format): the conversation is rendered to
text by its Jinja template in a sandbox, with the globals and filters `transformers` gives
templates (`bos_token`, `eos_token`, `raise_exception`, `strftime_now`, `tojson`), and the text
is tokenized with the template's special tokens parsed. The mask covers, for every assistant turn,
the text the template adds between the prompt rendered for that turn (`add_generation_prompt`)
and the conversation rendered through that turn: the reply and whatever closes it (`<|im_end|>`,
`<|eot_id|>`, ...). The whole text is tokenized at once, as `apply_chat_template` and the
chat-time prompt tokenize it (with BOS in front only where the tokenizer starts texts with it and
the template wrote none, `tokenizer.as_prompt`, so that training and chat read exactly the ids
`apply_chat_template` gives), and a token is trained when it begins inside such a span (tokenized
span by span, a SentencePiece-style tokenizer put a "▁" of its own before every reply, and the
ids differed from those the model reads at inference). A template that does not render a conversation as a
growing prefix (some drop earlier turns' reasoning) cannot be trained on: one-line error. Nor can
one that writes no assistant reply (every token would be masked: a loss of 0 that trains nothing),
and a prompt it renders as nothing cannot be answered: `EmptyChatTemplateError`, naming the template
(`import-hf` refuses such a template up front, `check_template_renders`).

A template is a program that comes with a model, so it renders in a worker process
(`chat_template_worker.py`, kept for the next conversation) under `TemplateLimits`: at most
`TEMPLATE_TIME_LIMIT_S` seconds a call (killed and replaced past it: a loop cannot hang the
caller), `MAX_CHAT_TEXT_CHARS` characters of output (checked while it writes, and before the text
reaches the tokenizer) and `TEMPLATE_MEMORY_BYTES` of address space. A template that breaks one
is a one-line `ChatTemplateLimitError`. `TEMPLATE_LIMITS` holds the limits in use (a program may
replace it); `render_template` is safe to call from several threads at once.

A bad row (not JSON, not an object, a missing or unknown role, an empty turn, a non-string content
or one that is not text (a lone surrogate), turns out of order, more than `MAX_CHAT_TEXT_CHARS`
characters of text) is a `ChatFormatError` naming the file and line.

Packing (`pack_conversations`): every row holds `seq_len + 1` tokens (inputs are the first
`seq_len`, targets the last `seq_len`). Conversations are placed whole, in order, one after
another; one that does not fit in what is left of a row starts the next row, and the rest of the
row is PAD with a False mask. So a row's mask says exactly which targets count, and a
conversation never spans two rows (each starts with its BOS, where every architecture restarts
its carried state; a conversation of a tokenizer without BOS, an imported Qwen2's, starts with
its template's first token instead, as transformers trains and prompts it, and the variants restart
at the start of the row only). A conversation longer than a row is cut to the row (its first `seq_len + 1`
tokens) when the cut keeps at least one assistant token, else dropped; both are counted in the
data's meta (`cut`, `dropped`). The rows record where each conversation starts (`PackedRows.starts`),
which is where an evaluation's documents begin (`eval.loss.row_documents`): a conversation without
BOS is still one document.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import selectors
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from latentloop.data.loader import TokenLoader
from latentloop.data.sources import goes_to_val, iter_jsonl
from latentloop.data.tokenizers import ChatTemplate, ChatTokens
from latentloop.errors import ConfigError, DataError
from latentloop.util import encodable

ROLES = ("system", "user", "assistant")
# OpenAI's keys of a message that calls a tool or answers one: a conversation holding them means what its
# text alone does not say, and there is no tool format here to render it in. Other keys ("name", a
# dataset's own) are ignored: they do not change what the turn says.
TOOL_KEYS = ("tool_calls", "tool_call_id", "function_call")
CHAT_PREFIX = "chat:"
# Bump when rendering or packing changes, so that a resumed run notices its data changed.
# 2: a tokenizer that starts no text with BOS (an imported Qwen2's) renders without one.
# 3: a file's conversations go to val by their messages, not by their line (`split_key`).
CHAT_FORMAT_VERSION = 3
# Characters of a conversation's text (its turns together; a chat template's output): the
# tokenizer reads all of it at once, and `tokenizers` needs some 200-300 bytes a character to do so
# (and panics near 10^8). A conversation this long is far past any model's context anyway.
MAX_CHAT_TEXT_CHARS = 1 << 21


class ChatFormatError(DataError):
    """A conversation that does not follow the format (roles, order, types, empty turns)."""


Message = dict  # {"role": str, "content": str}
_DESCRIBED_INT_BITS = 256  # an int longer than this is described by its size: its digits would not help


def _text_of_parts(content, at: str):
    """OpenAI's other form of a message's content, a list of parts, as the string it stands for:
    its text parts ({"type": "text", "text": ...}) joined by newlines, as vLLM joins them; any other
    content is returned as it is, for the checks that follow."""
    if not isinstance(content, list):
        return content
    texts = []
    for index, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            what = f"of type {part.get('type')!r}"[:60] if isinstance(part, dict) else _describe(part)
            raise ChatFormatError(f"{at}: content part {index} is {what}: only text parts "
                                  f'({{"type": "text", "text": ...}}) are supported')
        if not isinstance(part.get("text"), str):
            raise ChatFormatError(f"{at}: content part {index}'s 'text' must be a string, got "
                                  f"{_describe(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages, where: str = "conversation", for_training: bool = True) -> list[Message]:
    """The messages, checked: a non-empty list of {"role", "content"} objects (content a string, or
    OpenAI's list of text parts, joined; a tool call refused, other keys ignored), an optional system
    turn first, then user / assistant alternating from user; a conversation to train on holds an
    assistant turn, a prompt ends with a user turn (`for_training=False`)."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"{where}: 'messages' must be a non-empty list, got {_describe(messages)}")
    checked = []
    for index, message in enumerate(messages):
        at = f"{where}: message {index}"
        if not isinstance(message, dict):
            raise ChatFormatError(f"{at} must be an object with 'role' and 'content', got {_describe(message)}")
        if tool := next((key for key in TOOL_KEYS if message.get(key)), None):  # "tool_calls": [] calls none
            raise ChatFormatError(f"{at} has {tool!r}: tool calls are not supported (no chat format here "
                                  f"renders them)")
        role, content = message.get("role"), _text_of_parts(message.get("content"), at)
        if role is None:
            raise ChatFormatError(f"{at} has no 'role'")
        if role not in ROLES:
            raise ChatFormatError(f"{at}: unknown role {role!r} (use {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise ChatFormatError(f"{at}: 'content' must be a string, got {_describe(content)}")
        if not content.strip():
            raise ChatFormatError(f"{at}: empty {role} turn")
        if not encodable(content):
            raise ChatFormatError(f"{at}: 'content' holds a lone surrogate (an escape such as \\ud800 that is "
                                  f"half of a character), not text")
        if role == "system" and index != 0:
            raise ChatFormatError(f"{at}: a system turn may only come first")
        checked.append({"role": role, "content": content})
    length = sum(len(m["content"]) for m in checked)
    if length > MAX_CHAT_TEXT_CHARS:
        raise ChatFormatError(f"{where}: {length:,} characters of text, over the {MAX_CHAT_TEXT_CHARS:,} a "
                              f"conversation may hold")
    turns = [m["role"] for m in checked if m["role"] != "system"]
    for index, role in enumerate(turns):
        expected = "user" if index % 2 == 0 else "assistant"
        if role != expected:
            raise ChatFormatError(f"{where}: turn {index} is {role}, expected {expected} (user and assistant "
                                  f"alternate, starting with user)")
    if for_training and "assistant" not in turns:
        raise ChatFormatError(f"{where}: no assistant turn to train on")
    if not for_training and (not turns or turns[-1] != "user"):
        raise ChatFormatError(f"{where}: a prompt must end with a user turn")
    return checked


def _describe(value) -> str:
    if isinstance(value, int) and abs(value).bit_length() > _DESCRIBED_INT_BITS:
        return f"{type(value).__name__} of {abs(value).bit_length():,} bits"  # repr would refuse (or take long)
    return f"{type(value).__name__} {value!r}"[:80]


def _chat_format(tokenizer):
    """The tokenizer's chat format: latentloop's `ChatTokens` or a model's own `ChatTemplate`."""
    tokens = getattr(tokenizer, "chat_tokens", None)
    if tokens is None:
        raise ConfigError(f"{tokenizer!r} has no chat tokens: use tokenizer.with_chat_tokens() (an SFT run adds "
                          f"them, growing the model's vocabulary)")
    return tokens


def render_conversation(tokenizer, messages, where: str = "conversation") -> tuple[list[int], list[bool]]:
    """(ids, mask) of a conversation in the format above; mask[i] True when ids[i] is a token the
    model is trained to write."""
    tokens = _chat_format(tokenizer)
    if isinstance(tokens, ChatTemplate):
        return _render_with_template(tokenizer, check_messages(messages, where))
    ids, mask = [], []
    for message in check_messages(messages, where):
        content = tokenizer.encode(message["content"])
        trained = message["role"] == "assistant"
        ids += [tokens.role(message["role"]), *content, tokens.end]
        mask += [False] + [trained] * (len(content) + 1)
    return _as_prompt(tokenizer, ids, mask)


def render_prompt(tokenizer, messages, where: str = "conversation") -> list[int]:
    """The conversation so far (ending with a user turn) and `<|assistant|>`: what a model continues."""
    tokens = _chat_format(tokenizer)
    if isinstance(tokens, ChatTemplate):
        context = _template_context(tokenizer, check_messages(messages, where, for_training=False), True)
        text = render_template(tokenizer.chat_template, context)
        ids = tokenizer.encode_markup(text)
        if not text.strip() or ids in ([], [tokenizer.bos_id]):  # a model would answer nothing
            raise EmptyChatTemplateError(f"the tokenizer's chat template {template_name(tokenizer.chat_template)} "
                                         f"renders the prompt as nothing ({where}): there is nothing to answer")
        return tokenizer.as_prompt(ids)
    ids = []
    for message in check_messages(messages, where, for_training=False):
        ids += [tokens.role(message["role"]), *tokenizer.encode(message["content"]), tokens.end]
    return tokenizer.as_prompt(ids + [tokens.assistant])


def prompt_written(tokenizer, messages, prompt: Sequence[int], where: str = "conversation") -> list[bool]:
    """For each token of `prompt` (`render_prompt(tokenizer, messages)`), whether the model wrote it:
    the earlier replies' tokens that `render_conversation`'s mask marks (each reply and what closes
    it), the tokens SFT trains it to write and fbt's SFT fuses (`engine.stream`'s `written`). Where
    the prompt does not begin as the conversation renders (a template whose prompt is not its
    conversation's text plus a generation prompt), no token is marked: the prompt is read plain."""
    messages = check_messages(messages, where, for_training=False)
    unmarked = [False] * len(prompt)
    if not any(message["role"] == "assistant" for message in messages):
        return unmarked
    tokens = _chat_format(tokenizer)
    if isinstance(tokens, ChatTemplate):
        try:
            full, cuts = template_spans(tokenizer.chat_template, _template_context(tokenizer, messages, False))
        except ChatFormatError:  # a template that rewrites earlier turns (Qwen3's drops their <think>)
            return unmarked
        text = render_template(tokenizer.chat_template, _template_context(tokenizer, messages, True))
        if not text.startswith(full):
            return unmarked
        ids, offsets = tokenizer.encode_markup_with_offsets(text)  # as `render_prompt` encodes it
        trained = list(zip(cuts[1::2], cuts[2::2]))
        ids, mask = _as_prompt(tokenizer, ids, [any(start <= begin < end for start, end in trained)
                                                for begin, _ in offsets])
        return mask if list(ids) == list(prompt) else unmarked
    ids, mask = [], []
    for message in messages:
        content = tokenizer.encode(message["content"])
        ids += [tokens.role(message["role"]), *content, tokens.end]
        mask += [False] + [message["role"] == "assistant"] * (len(content) + 1)
    ids, mask = _as_prompt(tokenizer, ids + [tokens.assistant], mask + [False])  # it ends with <|assistant|>
    return mask if ids == list(prompt) else unmarked


def assistant_start(ids: Sequence[int], tokenizer) -> int:
    """Index of the first assistant content token (latentloop's format): the length of the prompt
    that precedes it."""
    return list(ids).index(_chat_format(tokenizer).assistant) + 1


# -- chat templates ---------------------------------------------------------------------------------
# A chat template is a program that comes with a model: it may loop forever or write gigabytes, and
# a thread cannot be stopped. So templates render in worker processes (`chat_template_worker.py`)
# that are killed when their time is up and capped in memory; a render waits for its reply at most
# `TemplateLimits.time_s`, and a worker is replaced after a timeout or a crash.
TEMPLATE_TIME_LIMIT_S = 5.0  # seconds one rendering may take: real templates take milliseconds
TEMPLATE_MEMORY_BYTES = 1 << 30  # address space a worker may add to what it holds at start
TEMPLATE_WORKERS = 4  # renderer processes at most; more concurrent renders wait for one
TEMPLATE_WORKER_START_S = 60.0  # a worker's start (a fresh Python and jinja2), on a loaded machine too
TEMPLATE_WORKER_SCRIPT = Path(__file__).with_name("chat_template_worker.py")
_FRAME_HEADER = struct.Struct(">I")  # the worker's framing: 4-byte big-endian length, then JSON
_ESCAPED_CHAR_BYTES = 12  # the most bytes one character takes in ASCII-escaped JSON ("\\ud83d\\ude00")
_REPLY_OVERHEAD_BYTES = 1 << 16  # a reply's JSON around its text (or its one-line error)


@dataclass(frozen=True)
class TemplateLimits:
    """What one rendering of a chat template may use: wall-clock seconds, characters of output
    (the text the tokenizer then reads) and address space of its worker."""

    time_s: float = TEMPLATE_TIME_LIMIT_S
    output_chars: int = MAX_CHAT_TEXT_CHARS
    memory_bytes: int = TEMPLATE_MEMORY_BYTES


# The limits of every rendering that is given none; a program (a test, a server) may replace it.
TEMPLATE_LIMITS = TemplateLimits()


class ChatTemplateLimitError(ChatFormatError):
    """A chat template that broke a rendering limit: it ran too long, wrote too much, ran out of
    memory or crashed its worker."""


class EmptyChatTemplateError(ChatFormatError):
    """A chat template that renders no assistant reply (nothing to train on: SFT's loss would be 0
    on every token) or a prompt of nothing (nothing for a model to answer)."""


TEMPLATE_NAME_CHARS = 60  # of a template's source, quoted in an error to name it
# The exchange that tells whether a template renders replies at all, and which token ends one.
PROBE_CONVERSATION = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})


def template_name(source: str) -> str:
    """A chat template as an error names it: its source on one line, cut to TEMPLATE_NAME_CHARS."""
    text = " ".join(source.split())
    return repr(text if len(text) <= TEMPLATE_NAME_CHARS else text[:TEMPLATE_NAME_CHARS] + "...")


def render_template(source: str, context: dict, limits: TemplateLimits | None = None) -> str:
    """The text of the Jinja chat template `source` rendered with `context` (JSON values: the
    messages, add_generation_prompt, the special tokens), in a sandbox as `transformers` renders it,
    in a worker process under `limits` (default `TEMPLATE_LIMITS`). Thread-safe: concurrent calls
    render in different workers. A template that does not compile is a `DataError`, one that fails
    or refuses the conversation a `ChatFormatError`, one that breaks a limit a `ChatTemplateLimitError`."""
    return _template_reply(source, context, limits, spans=False)["text"]


def template_spans(source: str, context: dict, limits: TemplateLimits | None = None) -> tuple[str, list[int]]:
    """The text of the conversation `context["messages"]` through the template, and its cuts
    [0, prompt_1, through_1, ..., len(text)]: text[prompt_i:through_i] is what the template writes
    for the i-th assistant turn (its reply and what closes it), prompt_i the length of the prompt
    rendered for it. All renders of the conversation share one request (and its time limit).
    Errors as `render_template`'s, and a `ChatFormatError` when the template does not render the
    conversation as a growing prefix."""
    reply = _template_reply(source, context, limits, spans=True)
    cuts = reply["cuts"]
    if cuts != sorted(cuts) or cuts[-1] != len(reply["text"]):  # the worker's own logic: a broken reply
        raise ChatTemplateLimitError("chat template: the renderer process replied with inconsistent spans")
    return reply["text"], cuts


def _template_reply(source: str, context: dict, limits: TemplateLimits | None, spans: bool) -> dict:
    limits = limits or TEMPLATE_LIMITS
    request = json.dumps({"source": source, "context": context, "max_output": limits.output_chars,
                          "time_limit": limits.time_s, "spans": spans}).encode("ascii")  # escaped: any str travels
    reply = _RENDERERS.render(request, limits)
    if "text" in reply:
        if len(reply["text"]) > limits.output_chars:  # the worker checks it too: this is the caller's own guard
            raise ChatTemplateLimitError(f"chat template: output over {limits.output_chars:,} characters (limit)")
        return reply
    kind, message = reply.get("error"), reply.get("message", "")
    if kind == "compile":
        raise DataError(f"the tokenizer's chat template does not compile: {message}")
    if kind == "refused":
        raise ChatFormatError(f"the chat template refused the conversation: {message}")
    if kind == "prefix":
        raise ChatFormatError(f"the tokenizer's chat template does not render this conversation as a growing "
                              f"prefix at message {reply.get('index')} (it rewrites earlier turns), so its assistant "
                              f"turns cannot be masked for training")
    if kind == "output":
        how = f": {message}" if message else ""
        raise ChatTemplateLimitError(f"chat template: output over {limits.output_chars:,} characters (limit){how}")
    if kind == "memory":
        raise ChatTemplateLimitError(f"chat template: rendering ran out of memory (limit "
                                     f"{limits.memory_bytes / 2**20:,.0f} MiB)")
    raise ChatFormatError(f"the tokenizer's chat template failed on a conversation: {message}")


class _RendererGone(Exception):
    """The worker closed its pipe or exited (killed, crashed)."""


class _Renderer:
    """One worker process; used by one thread at a time."""

    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        # no stderr: a crashing worker is reported by the caller in one line, not by its traceback
        try:
            self.process = subprocess.Popen([sys.executable, str(TEMPLATE_WORKER_SCRIPT), str(memory_bytes)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, bufsize=0)
        except OSError as exc:
            python = sys.executable or "no Python executable"
            raise ConfigError(f"cannot start the chat template renderer ({python}): {exc.strerror or exc}") from None
        self._replies = selectors.DefaultSelector()  # epoll where there is one: any fd number
        self._replies.register(self.process.stdout, selectors.EVENT_READ)
        try:
            ready = self._receive(time.monotonic() + TEMPLATE_WORKER_START_S, _REPLY_OVERHEAD_BYTES)
        except (TimeoutError, _RendererGone):
            self.close()
            raise ChatTemplateLimitError(f"chat template: the renderer process did not start (in "
                                         f"{TEMPLATE_WORKER_START_S:g} s)") from None
        if not ready.get("ready"):
            self.close()
            raise ConfigError("rendering a Hugging Face chat template needs jinja2: pip install 'latentloop[hf]'")

    def request(self, data: bytes, limits: TemplateLimits) -> dict:
        try:
            self.process.stdin.write(_FRAME_HEADER.pack(len(data)) + data)
        except (BrokenPipeError, OSError):
            raise _RendererGone from None
        # the clock starts once the worker has the whole request: the template cannot run before
        deadline = time.monotonic() + limits.time_s
        return self._receive(deadline, limits.output_chars * _ESCAPED_CHAR_BYTES + _REPLY_OVERHEAD_BYTES)

    def _receive(self, deadline: float, max_bytes: int) -> dict:
        (size,) = _FRAME_HEADER.unpack(self._read(_FRAME_HEADER.size, deadline))
        if size > max_bytes:  # the worker bounds its replies: this one is broken
            raise _RendererGone
        return json.loads(self._read(size, deadline))

    def _read(self, size: int, deadline: float) -> bytes:
        data = bytearray()
        fd = self.process.stdout.fileno()
        while len(data) < size:
            left = deadline - time.monotonic()
            if left <= 0 or not self._replies.select(left):
                raise TimeoutError
            chunk = os.read(fd, min(size - len(data), 1 << 20))
            if not chunk:
                raise _RendererGone
            data += chunk
        return bytes(data)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # not terminate: a template in a loop does not get to clean up
        self.process.wait()
        self._replies.close()
        for pipe in (self.process.stdin, self.process.stdout):
            pipe.close()


class _RendererPool:
    """Idle workers kept for the next rendering (so that thousands of conversations render without
    starting a process each); a worker that timed out, crashed or ran out of memory is replaced."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reset()
        atexit.register(self.close)

    def _reset(self):
        self._pid = os.getpid()  # a forked child must not share its parent's workers (their pipes)
        self._slots = threading.BoundedSemaphore(TEMPLATE_WORKERS)
        self._idle: list[_Renderer] = []
        self._live: set[_Renderer] = set()

    def render(self, request: bytes, limits: TemplateLimits) -> dict:
        with self._lock:
            if self._pid != os.getpid():
                self._reset()
            slots = self._slots
        with slots:
            renderer = self._take(limits.memory_bytes)
            try:
                reply = renderer.request(request, limits)
            except TimeoutError:
                self._discard(renderer)
                raise ChatTemplateLimitError(f"chat template: rendering took longer than {limits.time_s:g} s "
                                             f"(limit)") from None
            except _RendererGone:
                self._discard(renderer)
                code = renderer.process.returncode
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                raise ChatTemplateLimitError(f"chat template: the renderer process stopped while rendering "
                                             f"({how})") from None
            except BaseException:  # interrupted mid-request (Ctrl-C): its state is unknown
                self._discard(renderer)
                raise
            if reply.get("error") == "memory":  # a fresh worker rather than one that just ran out
                self._discard(renderer)
            else:
                with self._lock:
                    self._idle.append(renderer)
            return reply

    def _take(self, memory_bytes: int) -> _Renderer:
        with self._lock:
            for renderer in self._idle:
                if renderer.memory_bytes == memory_bytes:
                    self._idle.remove(renderer)
                    return renderer
            stale = [r for r in self._idle if r.memory_bytes != memory_bytes]  # limits changed: not needed
        for renderer in stale:
            self._discard(renderer)
        renderer = _Renderer(memory_bytes)
        with self._lock:
            self._live.add(renderer)
        return renderer

    def _discard(self, renderer: _Renderer) -> None:
        with self._lock:
            if renderer in self._idle:
                self._idle.remove(renderer)
            self._live.discard(renderer)
        renderer.close()

    def close(self) -> None:
        """Stop every worker (at exit)."""
        with self._lock:
            if self._pid != os.getpid():
                return
            live, self._idle, self._live = list(self._live), [], set()
        for renderer in live:
            renderer.close()


_RENDERERS = _RendererPool()


def _template_context(tokenizer, messages: list[Message], add_generation_prompt: bool) -> dict:
    """What a template reads, as `transformers` gives it: the messages, add_generation_prompt and
    the special tokens' text (a BOS the tokenizer does not name, `names_bos`, is "": transformers
    gives a template only the tokens its tokenizer names)."""
    specials = {f"{what}_token": tokenizer.token_string(getattr(tokenizer, f"{what}_id")) or ""
                for what in ("bos", "eos", "pad")}
    if not tokenizer.names_bos:
        specials["bos_token"] = ""
    return {"messages": messages, "add_generation_prompt": add_generation_prompt, **specials}


def _as_prompt(tokenizer, ids: list[int], mask: list[bool]) -> tuple[list[int], list[bool]]:
    """`tokenizer.as_prompt(ids)` (BOS in front where the tokenizer starts texts with it and `ids`
    have none: latentloop's own format, a template that writes none) and `mask` aligned with it. A
    conversation's training render and its chat-time prompt both go through here, so that a prompt
    is always the start of the row the model was trained on."""
    prompt = tokenizer.as_prompt(ids)
    return prompt, [False] * (len(prompt) - len(ids)) + mask


def _render_with_template(tokenizer, messages: list[Message]) -> tuple[list[int], list[bool]]:
    """(ids, mask) of `messages` through the tokenizer's chat template (module docstring)."""
    full, cuts = template_spans(tokenizer.chat_template, _template_context(tokenizer, messages, False))
    # The whole text encoded at once, as `apply_chat_template` and the chat-time prompt encode it: span
    # by span, a SentencePiece-style tokenizer put a "▁" of its own before every reply, and a byte-level
    # BPE split a reply's first word from the space before it. A token is trained when it begins
    # inside a trained span (the cuts alternate context / trained).
    ids, offsets = tokenizer.encode_markup_with_offsets(full)
    trained = list(zip(cuts[1::2], cuts[2::2]))
    mask = [any(start <= begin < end for start, end in trained) for begin, _ in offsets]
    replies = "".join(full[start:end] for start, end in trained)
    if not replies.strip() or not any(mask):  # every reply has content: a template that writes none ignores them
        raise EmptyChatTemplateError(f"the tokenizer's chat template {template_name(tokenizer.chat_template)} "
                                     f"renders no assistant reply: there is nothing to train on and no turn to chat in")
    return _as_prompt(tokenizer, ids, mask)


def check_template_renders(tokenizer) -> None:
    """Raise EmptyChatTemplateError when the tokenizer's chat template renders `PROBE_CONVERSATION`
    without its reply, or its prompt as nothing: a template no one can fine-tune or chat with.
    Other problems of the template are raised as rendering raises them."""
    template_end_id(tokenizer)
    render_prompt(tokenizer, list(PROBE_CONVERSATION[:1]), "a one-message conversation")


def template_end_id(tokenizer) -> int:
    """The id that ends an assistant turn in the tokenizer's chat template: the first special
    token it writes after a reply (EOS when it writes none)."""
    ids, mask = _render_with_template(tokenizer, list(PROBE_CONVERSATION))
    trained = [token for token, m in zip(ids, mask) if m]
    return next((token for token in trained if token in tokenizer.special_ids), tokenizer.eos_id)


# -- chat data --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatSpec:
    spec: str  # canonical `chat:...`
    path: Path | None  # a jsonl file, or None for a built-in task
    mapping: tuple[tuple[str, str], ...]  # (field, role) in turn order; () = rows hold "messages"
    task: str | None  # `task:NAME[:knobs]` for a built-in task


def is_chat_source(spec: str) -> bool:
    return spec.strip().startswith(CHAT_PREFIX)


def split_chat_file(rest: str) -> tuple[str, str | None]:
    """`FILE[:field=role,...]` (a chat spec past `chat:`, not a task) as (FILE, the mapping or None):
    the mapping is what follows the last colon when it holds an `=`, so a path may hold colons."""
    head, colon, tail = rest.rpartition(":")
    return (head, tail) if colon and "=" in tail else (rest, None)


def parse_chat_spec(spec: str) -> ChatSpec:
    """`chat:FILE`, `chat:FILE:field=role,field=role` or `chat:task:NAME[:knobs]`."""
    text = spec.strip()
    if not text.startswith(CHAT_PREFIX) or not text[len(CHAT_PREFIX):]:
        raise DataError(f"chat data spec {spec!r}: use chat:FILE.jsonl[:field=role,...] or chat:task:NAME")
    rest = text[len(CHAT_PREFIX):]
    if rest.startswith("task:"):
        from latentloop.data.tasks import parse_task_spec

        parsed = parse_task_spec(rest)  # a bad task name or knob fails here
        return ChatSpec(f"chat:{parsed.spec}", None, (), parsed.spec)
    path_text, mapping_text = split_chat_file(rest)
    mapping = ()
    if mapping_text is not None:
        pairs = []
        for pair in mapping_text.split(","):
            field, eq, role = (part.strip() for part in pair.partition("="))
            if not eq or not field or role not in ("system", "user", "assistant"):
                raise DataError(f"chat data spec {spec!r}: mapping items are FIELD=ROLE with a role of "
                                f"{', '.join(ROLES)}, got {pair!r}")
            pairs.append((field, role))
        mapping = tuple(pairs)
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise DataError(f"chat data file not found: {path}")
    return ChatSpec(text, path, mapping, None)


def iter_conversations(spec: ChatSpec | str) -> Iterator[tuple[str, list[Message]]]:
    """(stable key, checked messages) of every conversation of a chat source: a file's rows (the
    key is the line number) or a built-in task's training stream (the key is the index)."""
    spec = parse_chat_spec(spec) if isinstance(spec, str) else spec
    if spec.task is not None:
        from latentloop.data.tasks import parse_task_spec

        parsed = parse_task_spec(spec.task)
        for index, example in enumerate(parsed.task.iter_examples("train", parsed.n, parsed.seed)):
            yield str(index), [{"role": "user", "content": example.prompt},
                               {"role": "assistant", "content": example.completion}]
        return
    try:
        for line_number, row in iter_jsonl(spec.path):
            yield str(line_number), row_messages(row, spec, f"{spec.path}:{line_number}")
    except DataError as exc:
        if isinstance(exc, ChatFormatError):
            raise
        raise ChatFormatError(str(exc)) from None  # not JSON, not UTF-8: a bad chat file all the same


def split_key(messages: list[Message]) -> str:
    """What decides a file conversation's split: its checked messages, role and text. Keyed by the file's
    name and line number before, the copies of a conversation a dataset holds twice (common in scraped and
    merged chat data) went to train and val alike, so val scored conversations trained on; and a line
    added at the top moved every later conversation's split. Not the path as typed, nor the field
    mapping, nor the file's other rows."""
    return json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)


def iter_split_conversations(spec: ChatSpec | str, split: str,
                             val_fraction: float = 0.05) -> Iterator[list[Message]]:
    """The checked messages of each conversation of one split ("train" or "val") of a chat source.
    A file's rows go to val by a stable hash of their messages (`split_key`: copies go together); a
    built-in task's come from its own
    streams (`TaskSource.iter_examples`): train its `n` training examples, val its distinct
    held-out problems, so that no val prompt is ever a training prompt."""
    for _, messages in _iter_split_where(spec, split, val_fraction):
        yield messages


def _iter_split_where(spec: ChatSpec | str, split: str, val_fraction: float) -> Iterator[tuple[str, list[Message]]]:
    """`iter_split_conversations`, each conversation with where it comes from (FILE:LINE, or the
    task's example), for an error to name."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    spec = parse_chat_spec(spec) if isinstance(spec, str) else spec
    if spec.task is not None:
        from latentloop.data.tasks import TaskSource, parse_task_spec

        for index, example in enumerate(TaskSource(parse_task_spec(spec.task), val_fraction).iter_examples(split)):
            yield f"{spec.spec} ({split} example {index})", [
                {"role": "user", "content": example.prompt}, {"role": "assistant", "content": example.completion}]
        return
    want_val = split == "val"
    for key, messages in iter_conversations(spec):
        if goes_to_val(split_key(messages), val_fraction) == want_val:
            yield f"{spec.path}:{key}", messages


def _render_where(tokenizer, messages: list[Message], where: str) -> tuple[list[int], list[bool]]:
    """`tokenizer.render(messages)`, a refusal (a template that raises, loops or renders no growing
    prefix) naming the conversation, as a malformed row's error names its line."""
    try:
        return tokenizer.render(messages)
    except DataError as exc:
        exc.args = (f"{where}: {exc}",)
        raise


def row_messages(row, spec: ChatSpec, where: str) -> list[Message]:
    if not isinstance(row, dict):
        raise ChatFormatError(f"{where}: expected a JSON object, got {_describe(row)}")
    if not spec.mapping:
        if "messages" not in row:
            raise ChatFormatError(f"{where}: no 'messages' (for rows of other fields give a mapping, e.g. "
                                  f"chat:FILE:question=user,answer=assistant)")
        return check_messages(row["messages"], where)
    messages = []
    for field, role in spec.mapping:
        if field not in row:
            raise ChatFormatError(f"{where}: no field {field!r} (the mapping names it as the {role} turn)")
        messages.append({"role": role, "content": row[field]})
    return check_messages(messages, where)


@dataclass
class PackedRows:
    """Conversations packed into rows of seq_len + 1 tokens, and which tokens are trained."""

    tokens: np.ndarray  # (N, seq_len + 1) int64
    mask: np.ndarray  # (N, seq_len + 1) bool: mask[:, i] True when tokens[:, i] is an assistant token
    # (N, seq_len + 1) bool: starts[:, i] True when a conversation starts at tokens[:, i] (None: not known;
    # documents are then told by BOS, which conversations without one do not start with)
    starts: np.ndarray | None = None

    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, loss_mask) for the given row indices; loss_mask[b, t] says whether target y[b, t] counts."""
        tokens = torch.from_numpy(self.tokens[rows])
        mask = torch.from_numpy(self.mask[rows])
        return tokens[:, :-1], tokens[:, 1:], mask[:, 1:]

    def sha256(self) -> str:
        """Of the tokens and mask (`starts` follow from the conversations these hold)."""
        digest = hashlib.sha256(np.ascontiguousarray(self.tokens).tobytes())
        digest.update(np.ascontiguousarray(self.mask).tobytes())
        return digest.hexdigest()


def pack_conversations(conversations: Sequence[tuple[list[int], list[bool]]], seq_len: int,
                       pad_id: int) -> tuple[PackedRows, dict[str, int]]:
    """Pack rendered conversations into rows (see the module docstring), recording where each starts
    in its row; returns the rows and counts {"conversations", "rows", "cut", "dropped", "trained_tokens"}."""
    width = seq_len + 1
    rows, masks, starts = [], [], []
    row, row_mask, row_starts = [], [], []
    counts = {"conversations": 0, "rows": 0, "cut": 0, "dropped": 0, "trained_tokens": 0}

    def flush():
        if row:
            rows.append(row + [pad_id] * (width - len(row)))
            masks.append(row_mask + [False] * (width - len(row_mask)))
            opened = [False] * width
            for start in row_starts:
                opened[start] = True
            starts.append(opened)

    for ids, mask in conversations:
        if len(ids) > width:
            # the first token is never a target, so a cut conversation needs an assistant token after it
            if not any(mask[1:width]):
                counts["dropped"] += 1
                continue
            ids, mask = ids[:width], mask[:width]
            counts["cut"] += 1
        if len(row) + len(ids) > width:
            flush()
            row, row_mask, row_starts = [], [], []
        row_starts.append(len(row))
        row, row_mask = row + list(ids), row_mask + list(mask)
        counts["conversations"] += 1
        counts["trained_tokens"] += sum(mask[1:])
    flush()
    counts["rows"] = len(rows)
    tokens = np.asarray(rows, dtype=np.int64).reshape(-1, width)
    return PackedRows(tokens, np.asarray(masks, dtype=bool).reshape(-1, width),
                      np.asarray(starts, dtype=bool).reshape(-1, width)), counts


@dataclass
class ChatData:
    """Both splits of a chat source, packed. Mirrors `TokenData` where the trainer reads it."""

    train: PackedRows
    val: PackedRows
    meta: dict


# When no conversation fits, the error suggests a sequence_len that holds this fraction of the
# split's conversations whole (the longest few are then cut or dropped, and counted), rounded up to
# a multiple of SEQUENCE_LEN_STEP (lengths as presets and kernels like them).
FIT_FRACTION = 0.9
SEQUENCE_LEN_STEP = 64


def sequence_len_that_fits(lengths: Sequence[int], fraction: float = FIT_FRACTION) -> int:
    """The smallest multiple of SEQUENCE_LEN_STEP whose rows (sequence_len + 1 tokens) hold
    `fraction` of conversations of these rendered lengths whole."""
    ordered = sorted(lengths)
    needed = ordered[max(0, math.ceil(fraction * len(ordered)) - 1)] - 1  # a row holds sequence_len + 1 tokens
    return max(SEQUENCE_LEN_STEP, -(-needed // SEQUENCE_LEN_STEP) * SEQUENCE_LEN_STEP)


def prepare_chat(spec: str, tokenizer, seq_len: int, val_fraction: float = 0.05) -> ChatData:
    """Render every conversation of each split of `spec` (`iter_split_conversations`: a file's rows
    by a stable hash of file name and line, a task's from its train and held-out val streams) and
    pack each split."""
    parsed = parse_chat_spec(spec)
    rendered: dict[str, list] = {split: [_render_where(tokenizer, messages, where)
                                         for where, messages in _iter_split_where(parsed, split, val_fraction)]
                                 for split in ("train", "val")}
    meta: dict = {"format_version": CHAT_FORMAT_VERSION, "spec": parsed.spec, "seq_len": seq_len,
                  "tokenizer_fingerprint": tokenizer.fingerprint(), "sha256": {}}
    packed = {}
    for split in ("train", "val"):
        if not rendered[split]:
            raise DataError(f"chat data {parsed.spec} has no conversations in its {split} split")
        packed[split], counts = pack_conversations(rendered[split], seq_len, tokenizer.pad_id)
        if counts["rows"] == 0:
            fits = sequence_len_that_fits([len(ids) for ids, _ in rendered[split]])
            raise DataError(f"chat data {parsed.spec}: no {split} conversation fits a row of {seq_len + 1} tokens "
                            f"(sequence_len {seq_len}); --set sequence_len={fits} fits "
                            f"{FIT_FRACTION:.0%} of them whole")
        meta[split] = counts
        meta["sha256"][split] = packed[split].sha256()
    return ChatData(packed["train"], packed["val"], meta)


class ChatLoader(TokenLoader):
    """`TokenLoader` over packed rows: the same shuffled, resumable order, sharded by rank the same
    way (its state dict has the same fields, `num_windows` counting rows); `next_batch` returns
    (x, y, loss_mask)."""

    def __init__(self, rows: PackedRows, batch_size: int, seed: int, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1):
        if len(rows.tokens) == 0:
            raise DataError("no packed chat rows to train on")
        super().__init__(rows.tokens[0], batch_size, rows.tokens.shape[1] - 1, seed, shuffle, rank, world_size)
        self.rows = rows
        self.num_windows = len(rows.tokens)

    def next_batch(self):
        return self.rows.batch(self._next_windows())


def masked_batches(rows: PackedRows, batch_size: int, max_batches: int | None = None):
    """Validation batches (x, y, loss_mask) of packed rows, in order (so `rows.starts` follow them:
    `eval.loss.row_documents`)."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    count = -(-len(rows.tokens) // batch_size)
    if max_batches is not None:
        count = min(count, max(0, max_batches))
    for batch in range(count):
        yield rows.batch(np.arange(batch * batch_size, min((batch + 1) * batch_size, len(rows.tokens))))


def replies_encoded_alone(tokenizer) -> bool:
    """Whether a reply's ids were encoded from its text alone: latentloop's own format (`ChatTokens`)
    encodes each message on its own, so a SentencePiece-style tokenizer's "▁" before a reply is the
    tokenizer's, not the model's (`util.TokenText`'s message_start drops it from the text); a chat
    template renders the whole conversation into one text, where that "▁" is a space the model wrote."""
    return isinstance(getattr(tokenizer, "chat_tokens", None), ChatTokens)
