"""The conversation format: rendering, chat data files and packing into training rows.

Format (every tokenizer with latentloop's `chat_tokens`; a Hugging Face tokenizer with a chat
template renders with that instead, see "Chat templates" below):

    [BOS] <|system|> text <|end|>  <|user|> text <|end|>  <|assistant|> text <|end|>  <|user|> ...

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
`<|eot_id|>`, ...). Each such span is tokenized on its own, so that the ids before it are exactly
the prompt the model reads at inference. A template that does not render a conversation as a
growing prefix (some drop earlier turns' reasoning) cannot be trained on: one-line error.

A bad row (not JSON, not an object, a missing or unknown role, an empty turn, a non-string content,
turns out of order) is a `ChatFormatError` naming the file and line.

Packing (`pack_conversations`): every row holds `seq_len + 1` tokens (inputs are the first
`seq_len`, targets the last `seq_len`). Conversations are placed whole, in order, one after
another; one that does not fit in what is left of a row starts the next row, and the rest of the
row is PAD with a False mask. So a row's mask says exactly which targets count, and a
conversation never spans two rows (each starts with its BOS, where every architecture restarts
its carried state). A conversation longer than a row is cut to the row (its first `seq_len + 1`
tokens) when the cut keeps at least one assistant token, else dropped; both are counted in the
data's meta (`cut`, `dropped`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from latentloop.data.loader import TokenLoader
from latentloop.data.sources import goes_to_val, iter_jsonl
from latentloop.data.tokenizers import ChatTemplate
from latentloop.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant")
CHAT_PREFIX = "chat:"
# Bump when rendering or packing changes, so that a resumed run notices its data changed.
CHAT_FORMAT_VERSION = 1


class ChatFormatError(DataError):
    """A conversation that does not follow the format (roles, order, types, empty turns)."""


Message = dict  # {"role": str, "content": str}


def check_messages(messages, where: str = "conversation", for_training: bool = True) -> list[Message]:
    """The messages, checked: a non-empty list of {"role", "content"} objects, an optional system
    turn first, then user / assistant alternating from user; a conversation to train on holds an
    assistant turn, a prompt ends with a user turn (`for_training=False`)."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"{where}: 'messages' must be a non-empty list, got {_describe(messages)}")
    checked = []
    for index, message in enumerate(messages):
        at = f"{where}: message {index}"
        if not isinstance(message, dict):
            raise ChatFormatError(f"{at} must be an object with 'role' and 'content', got {_describe(message)}")
        role, content = message.get("role"), message.get("content")
        if role is None:
            raise ChatFormatError(f"{at} has no 'role'")
        if role not in ROLES:
            raise ChatFormatError(f"{at}: unknown role {role!r} (use {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise ChatFormatError(f"{at}: 'content' must be a string, got {_describe(content)}")
        if not content.strip():
            raise ChatFormatError(f"{at}: empty {role} turn")
        if role == "system" and index != 0:
            raise ChatFormatError(f"{at}: a system turn may only come first")
        checked.append({"role": role, "content": content})
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
    ids, mask = [tokenizer.bos_id], [False]
    for message in check_messages(messages, where):
        content = tokenizer.encode(message["content"])
        trained = message["role"] == "assistant"
        ids += [tokens.role(message["role"]), *content, tokens.end]
        mask += [False] + [trained] * (len(content) + 1)
    return ids, mask


def render_prompt(tokenizer, messages, where: str = "conversation") -> list[int]:
    """The conversation so far (ending with a user turn) and `<|assistant|>`: what a model continues."""
    tokens = _chat_format(tokenizer)
    if isinstance(tokens, ChatTemplate):
        text = _template_text(tokenizer, check_messages(messages, where, for_training=False), True)
        return _starting_with_bos(tokenizer, tokenizer.encode_markup(text), [])[0]
    ids = [tokenizer.bos_id]
    for message in check_messages(messages, where, for_training=False):
        ids += [tokens.role(message["role"]), *tokenizer.encode(message["content"]), tokens.end]
    return ids + [tokens.assistant]


def assistant_start(ids: Sequence[int], tokenizer) -> int:
    """Index of the first assistant content token (latentloop's format): the length of the prompt
    that precedes it."""
    return list(ids).index(_chat_format(tokenizer).assistant) + 1


# -- chat templates ---------------------------------------------------------------------------------
def _raise_from_template(message: str):
    raise ChatFormatError(f"the chat template refused the conversation: {message}")


@functools.cache
def _template_environment():
    """A sandboxed Jinja environment set up as `transformers` sets up chat templates."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("rendering a Hugging Face chat template needs jinja2: pip install 'latentloop[hf]'") from None

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                                        undefined=jinja2.Undefined)
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    import jinja2

    try:
        return _template_environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise DataError(f"the tokenizer's chat template does not compile: {exc}") from None


def _template_text(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    import jinja2

    specials = {f"{what}_token": tokenizer.token_string(getattr(tokenizer, f"{what}_id")) or ""
                for what in ("bos", "eos", "pad")}
    try:
        return _compiled_template(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **specials)
    except jinja2.TemplateError as exc:
        raise ChatFormatError(f"the tokenizer's chat template failed on a conversation: {exc}") from None


def _starting_with_bos(tokenizer, ids: list[int], mask: list[bool]) -> tuple[list[int], list[bool]]:
    """Every latentloop sequence starts with BOS (where the variants restart their carried state);
    templates that write none (ChatML) get it in front."""
    if ids[:1] == [tokenizer.bos_id]:
        return ids, mask
    return [tokenizer.bos_id, *ids], [False, *mask]


def _render_with_template(tokenizer, messages: list[Message]) -> tuple[list[int], list[bool]]:
    """(ids, mask) of `messages` through the tokenizer's chat template (module docstring)."""
    full = _template_text(tokenizer, messages, False)
    cuts = [0]  # alternate context / trained spans of `full`
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _template_text(tokenizer, messages[:index], True)
        through = _template_text(tokenizer, messages[:index + 1], False)
        if not (through.startswith(prompt) and full.startswith(through) and len(prompt) >= cuts[-1]):
            raise ChatFormatError(f"the tokenizer's chat template does not render this conversation as a growing "
                                  f"prefix at message {index} (it rewrites earlier turns), so its assistant turns "
                                  f"cannot be masked for training")
        cuts += [len(prompt), len(through)]
    cuts.append(len(full))
    ids, mask = [], []
    for span, (start, end) in enumerate(zip(cuts, cuts[1:])):
        piece = tokenizer.encode_markup(full[start:end]) if end > start else []
        ids += piece
        mask += [span % 2 == 1] * len(piece)
    return _starting_with_bos(tokenizer, ids, mask)


def template_end_id(tokenizer) -> int:
    """The id that ends an assistant turn in the tokenizer's chat template: the first special
    token it writes after a reply (EOS when it writes none)."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = _render_with_template(tokenizer, probe)
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
    path_text, mapping = rest, ()
    head, colon, tail = rest.rpartition(":")
    if colon and "=" in tail:
        path_text = head
        pairs = []
        for pair in tail.split(","):
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
    """(stable key, checked messages) of every conversation of a chat source."""
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

    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, loss_mask) for the given row indices; loss_mask[b, t] says whether target y[b, t] counts."""
        tokens = torch.from_numpy(self.tokens[rows])
        mask = torch.from_numpy(self.mask[rows])
        return tokens[:, :-1], tokens[:, 1:], mask[:, 1:]

    def sha256(self) -> str:
        digest = hashlib.sha256(np.ascontiguousarray(self.tokens).tobytes())
        digest.update(np.ascontiguousarray(self.mask).tobytes())
        return digest.hexdigest()


def pack_conversations(conversations: Sequence[tuple[list[int], list[bool]]], seq_len: int,
                       pad_id: int) -> tuple[PackedRows, dict[str, int]]:
    """Pack rendered conversations into rows (see the module docstring); returns the rows and
    counts {"conversations", "rows", "cut", "dropped", "trained_tokens"}."""
    width = seq_len + 1
    rows, masks = [], []
    row, row_mask = [], []
    counts = {"conversations": 0, "rows": 0, "cut": 0, "dropped": 0, "trained_tokens": 0}

    def flush():
        if row:
            rows.append(row + [pad_id] * (width - len(row)))
            masks.append(row_mask + [False] * (width - len(row_mask)))

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
            row, row_mask = [], []
        row, row_mask = row + list(ids), row_mask + list(mask)
        counts["conversations"] += 1
        counts["trained_tokens"] += sum(mask[1:])
    flush()
    counts["rows"] = len(rows)
    tokens = np.asarray(rows, dtype=np.int64).reshape(-1, width)
    return PackedRows(tokens, np.asarray(masks, dtype=bool).reshape(-1, width)), counts


@dataclass
class ChatData:
    """Both splits of a chat source, packed. Mirrors `TokenData` where the trainer reads it."""

    train: PackedRows
    val: PackedRows
    meta: dict


def prepare_chat(spec: str, tokenizer, seq_len: int, val_fraction: float = 0.05) -> ChatData:
    """Render every conversation of `spec` and pack each split; conversations go to val by a
    stable hash of their key (file line or task index), as documents do."""
    parsed = parse_chat_spec(spec)
    rendered: dict[str, list] = {"train": [], "val": []}
    for key, messages in iter_conversations(parsed):
        split = "val" if goes_to_val(f"{parsed.spec}:{key}", val_fraction) else "train"
        rendered[split].append(tokenizer.render(messages))
    meta: dict = {"format_version": CHAT_FORMAT_VERSION, "spec": parsed.spec, "seq_len": seq_len,
                  "tokenizer_fingerprint": tokenizer.fingerprint(), "sha256": {}}
    packed = {}
    for split in ("train", "val"):
        if not rendered[split]:
            raise DataError(f"chat data {parsed.spec} has no conversations in its {split} split")
        packed[split], counts = pack_conversations(rendered[split], seq_len, tokenizer.pad_id)
        if counts["rows"] == 0:
            raise DataError(f"chat data {parsed.spec}: no {split} conversation fits a row of {seq_len + 1} tokens")
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
    """Validation batches (x, y, loss_mask) of packed rows, in order."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    count = -(-len(rows.tokens) // batch_size)
    if max_batches is not None:
        count = min(count, max(0, max_batches))
    for batch in range(count):
        yield rows.batch(np.arange(batch * batch_size, min((batch + 1) * batch_size, len(rows.tokens))))
