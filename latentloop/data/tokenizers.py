"""Tokenizers: a dependency-free byte tokenizer, a trainable byte-level BPE tokenizer, and a
pretrained model's own Hugging Face tokenizer (`HFTokenizer`, for imported Llama-family models).

All share one small interface, which is all the rest of latentloop relies on:

- `encode(text) -> list[int]` (no special tokens), `encode_batch(texts)`, `decode(ids) -> str`
  (special tokens skipped, invalid UTF-8 replaced), `encode_to_array(text) -> np.ndarray`
  (fast path for big texts); `encode_in_pieces(tokenizer, text)`: the same ids as arrays, a very
  long document tokenized a few MB at a time (cut at newlines);
- `bos_id`, `eos_id`, `pad_id`, `vocab_size`, `name`;
- `adds_bos`: whether the model's prompts start with BOS, as its training did (latentloop's own
  tokenizers do, and so does any tokenizer a model is trained with here; an imported model's as
  `transformers` prompts it: Llama's do, Qwen2's do not), and `as_prompt(ids)`: the ids a model
  reads for a prompt, BOS first or not by that one rule. Every prompt latentloop builds (generate,
  chat, serve, eval) goes through it; the training data's documents always start with BOS (`bos_id`
  separates them, and restarts the variants' carried state);
- `token_byte_lengths()`: how many UTF-8 bytes each token id stands for, so that losses can be
  reported in bits per byte, which is comparable across tokenizers;
- `save(directory)` writes `tokenizer.json`; `load_tokenizer(spec)` reads it back;
  `write_new_tokenizer(tokenizer, path)` writes a file that must not exist yet;
- `fingerprint()`: a short stable string that changes whenever the id mapping changes, used in
  cache keys of tokenized data;
- the chat interface (`latentloop.data.chat`): `chat_tokens` (a `ChatTokens` of the role and
  end-of-turn ids, or None when the tokenizer has none), `with_chat_tokens()` (the same tokenizer
  with them added: the ids of existing tokens never move, the new ones come after them), and
  `render(messages) -> (ids, mask)` / `render_prompt(messages) -> ids` (the conversation format).
  A tokenizer imported from Hugging Face renders with its own chat template when it has one
  (`chat_tokens` is then a `ChatTemplate`); otherwise `with_chat_tokens()` adds latentloop's
  tokens to it as to byte and BPE. Every consumer needs only `chat_tokens.end`, the id that ends
  an assistant turn (where decoding stops).

`write_hf_tokenizer(tokenizer, directory)` writes any of them as Hugging Face files
(`tokenizer.json` + `tokenizer_config.json`) that `transformers.AutoTokenizer` loads (the byte
tokenizer as a byte-level BPE without merges, whose ids are the byte values).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from latentloop.errors import ConfigError, DataError, LatentloopError, OutputError
from latentloop.util import first_line, give_default_mode

TOKENIZER_FILE = "tokenizer.json"

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

# The conversation format's special tokens, in the order their ids are appended to a vocabulary:
# one per role that opens a turn, and one that ends any turn.
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_OF_TURN_TOKEN = "<|end|>"
CHAT_TOKENS = (SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_OF_TURN_TOKEN)


@dataclass(frozen=True)
class ChatTokens:
    """Ids of the conversation format's special tokens."""

    system: int
    user: int
    assistant: int
    end: int

    def role(self, name: str) -> int:
        return {"system": self.system, "user": self.user, "assistant": self.assistant}[name]

    @property
    def ids(self) -> tuple[int, int, int, int]:
        return (self.system, self.user, self.assistant, self.end)


@dataclass(frozen=True)
class ChatTemplate:
    """A pretrained tokenizer's own conversation format: its Jinja chat template (as
    `tokenizer_config.json` carries it) and the id that ends an assistant turn in it."""

    source: str
    end: int


# latentloop's format (`latentloop.data.chat`) as a Jinja chat template, written into exported
# `tokenizer_config.json` files so that `AutoTokenizer.apply_chat_template` renders the same ids.
_ROLE_TOKENS = {"system": SYSTEM_TOKEN, "user": USER_TOKEN, "assistant": ASSISTANT_TOKEN}
CHAT_TEMPLATE = ("{% set role_tokens = " + json.dumps(_ROLE_TOKENS) + " %}{{ bos_token }}"
                 "{% for message in messages %}{{ role_tokens[message['role']] + message['content'] + "
                 + json.dumps(END_OF_TURN_TOKEN) + " }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ " + json.dumps(ASSISTANT_TOKEN) + " }}{% endif %}")
# ... for a tokenizer whose prompts start without BOS (`adds_bos` False: one imported without it, whose
# config may still name a BOS token, GPT-2's): latentloop renders its conversations without one
CHAT_TEMPLATE_WITHOUT_BOS = CHAT_TEMPLATE.replace("{{ bos_token }}", "")
# ... and for a SentencePiece-style tokenizer that prepends "▁" to the first piece of a text only
# (Metaspace, prepend_scheme "first"): latentloop encodes each message alone, so each begins with "▁",
# where transformers' one rendered text has none after a special token; a space before each message
# gives that "▁" back
_CONTENT = "message['content']"
_SPACED_CONTENT = "' ' + message['content']"


def _own_format_template(tokenizer) -> str:
    """latentloop's chat format as a Jinja template that renders, through this tokenizer, the ids
    its `render` gives (`write_hf_tokenizer`)."""
    template = CHAT_TEMPLATE if tokenizer.adds_bos else CHAT_TEMPLATE_WITHOUT_BOS
    if isinstance(tokenizer, HFTokenizer) and _metaspace_prepend_scheme(tokenizer.hf_json()) == "first":
        template = template.replace(_CONTENT, _SPACED_CONTENT)
    return template


def _metaspace_prepend_scheme(tokenizer_json: str) -> str | None:
    """The prepend scheme of a tokenizer.json's Metaspace pre-tokenizer (alone or in a sequence)."""
    pre = json.loads(tokenizer_json).get("pre_tokenizer") or {}
    for step in pre.get("pretokenizers", [pre]):
        if isinstance(step, dict) and step.get("type") == "Metaspace":
            return step.get("prepend_scheme", "always")
    return None


class _ChatInterface:
    """What every tokenizer shares: the conversation methods (see `latentloop.data.chat`), the tokens
    a generation stops at, and whether (and how) a prompt starts with BOS."""

    chat_tokens: ChatTokens | None
    bos_id: int
    eos_id: int
    names_bos = True  # whether the tokenizer names its BOS token (`HFTokenizer`: as its source does)

    @property
    def adds_bos(self) -> bool:
        """Whether this tokenizer starts a text with BOS, as its models read one: latentloop's own
        do (their models are trained on [BOS] + text); `HFTokenizer` says what its source does."""
        return True

    def as_prompt(self, ids: Sequence[int]) -> list[int]:
        """`ids` (a text's, or a rendered conversation's) as the start of what a model reads: BOS in
        front when this tokenizer starts texts with it and `ids` do not already begin with it, else
        `ids` as they are, so that an imported model is prompted as `transformers` prompts it. A
        prompt of nothing is [BOS] either way: a model needs a token to read, and BOS is what a
        document follows in latentloop's data (lm-eval reads a lone prefix token there too)."""
        ids = list(ids)
        if not ids or (self.adds_bos and ids[0] != self.bos_id):
            return [self.bos_id, *ids]
        return ids

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a generation: EOS, and for an imported model every end token its
        config names (Llama 3 instruct: <|end_of_text|>, <|eom_id|>, <|eot_id|>)."""
        return (self.eos_id,)

    def render(self, messages) -> tuple[list[int], list[bool]]:
        """Every turn as ids (after BOS where prompts start with one, `as_prompt`), and a mask True on
        the tokens a model is trained to write (the assistant's content and its end-of-turn token)."""
        from latentloop.data.chat import render_conversation

        return render_conversation(self, messages)

    def render_prompt(self, messages) -> list[int]:
        """The ids a model continues to answer `messages` (which end with a user turn)."""
        from latentloop.data.chat import render_prompt

        return render_prompt(self, messages)

# Byte-level BPE needs all 256 byte symbols in its alphabet plus our special tokens.
MIN_BPE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_BPE_VOCAB_SIZE = 2**21  # ids past this are a mistake, not a vocabulary (Gemma's is 262,144)
SENTENCEPIECE_SPACE = "\u2581"  # "▁": how SentencePiece-style tokenizers spell a space inside a token

# A document longer than this many characters is tokenized in pieces (`encode_in_pieces`): `tokenizers`
# keeps bookkeeping per token (offsets, token strings) for the whole text it encodes, so one very
# long document needed many times its size at once. Normal documents are far shorter, and encoded whole.
LONG_DOCUMENT_CHARS = 8 << 20


# Where `encode_in_pieces` may cut (a match's end is where the next piece begins). A newline between two
# characters that are not whitespace: a GPT-2-style pre-tokenizer always ends one pre-token before the
# newline and another after it, so tokenizing the two sides apart gives the same ids. A newline beside
# whitespace (a trailing space, the "\r" of CRLF, an indented line) may be one pre-token with it
# (" \n", "\r\n"): no cut there.
_CLEAN_NEWLINE = re.compile(r"(?<=\S)\n(?=\S)")
# For a text without such a newline: just before one space between two non-space characters, where
# such a pre-tokenizer ends a pre-token and starts the next with the space (" word").
_CLEAN_SPACE = re.compile(r"(?<=\S)(?= \S)")


def encode_in_pieces(tokenizer, text: str) -> Iterator[np.ndarray]:
    """`tokenizer.encode_to_array(text)` as consecutive arrays; concatenated, they are the ids of
    `text`. Only a text longer than `LONG_DOCUMENT_CHARS` is cut, into pieces of about that many
    characters: just after the window's last newline with a character other than whitespace on both
    sides, else just before its last space between two such characters (a text of one line: a
    minified file, a dump of words), else at the first such newline or space after the window (a text
    with neither stays whole). For the byte tokenizer the ids are exactly those of the whole text, and
    so for byte-level BPEs with GPT-2-style pre-tokenization (latentloop's own), which never merge
    across such a newline or before such a space; a tokenizer that treats the start of a text
    specially (SentencePiece's leading "▁", a byte-level prefix space) may tokenize the first
    characters after a cut differently. Either way only documents past the threshold are cut, so
    normal data is tokenized as before."""
    start, size = 0, LONG_DOCUMENT_CHARS
    while len(text) - start > size:
        begin = _last_cut(text, start, start + size)
        if begin <= start:  # no clean cut in this window: the first one after it, if any
            found = [m for m in (_CLEAN_NEWLINE.search(text, start + size), _CLEAN_SPACE.search(text, start + size))
                     if m is not None]
            if not found:
                break
            begin = min(m.end() for m in found)
        yield tokenizer.encode_to_array(text[start:begin])
        start = begin
    if start < len(text) or start == 0:
        yield tokenizer.encode_to_array(text[start:])


def _last_cut(text: str, start: int, end: int) -> int:
    """Where the next piece begins after the last clean newline in text[start:end], else before its
    last clean space, else -1 (at most two passes of a regular expression over the window)."""
    for pattern in (_CLEAN_NEWLINE, _CLEAN_SPACE):
        last = -1
        for found in pattern.finditer(text, start, end):
            last = found.end()
        if last > start:
            return last
    return -1


class ByteTokenizer(_ChatInterface):
    """Token ids 0..255 are raw UTF-8 bytes; 256, 257, 258 are BOS, EOS and PAD; with `chat=True`,
    259..262 are the chat tokens (system, user, assistant, end of turn). Without them the vocabulary
    is the 259 ids every earlier run was trained with, so those runs keep loading unchanged."""

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259  # the class's own (no chat tokens); an instance with chat=True has 263
    chat_tokens: ChatTokens | None = None

    def __init__(self, chat: bool = False):
        self.chat = chat
        base = 256 + len(SPECIAL_TOKENS)
        self.chat_tokens = ChatTokens(*range(base, base + len(CHAT_TOKENS))) if chat else None
        self.vocab_size = base + (len(CHAT_TOKENS) if chat else 0)

    def with_chat_tokens(self) -> ByteTokenizer:
        return ByteTokenizer(chat=True)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_to_array(self, text: str) -> np.ndarray:
        """Encode to a uint8 array without building a Python list (fast for big texts)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        # Vectorised so that decoding a long memory-mapped stream stays fast.
        array = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64)
        data = array[(array >= 0) & (array < 256)].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        lengths[:256] = 1
        return lengths

    def token_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (b"" for specials): streaming decoders join these, so a
        character split over several tokens is printed once complete."""
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def to_json(self) -> str:
        return json.dumps({"type": "byte", "chat": True} if self.chat else {"type": "byte"}) + "\n"

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_FILE
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    def fingerprint(self) -> str:
        return "byte-chat-v1" if self.chat else "byte-v1"

    def __repr__(self) -> str:
        return "ByteTokenizer(chat=True)" if self.chat else "ByteTokenizer()"


class BPETokenizer(_ChatInterface):
    """A Hugging Face byte-level BPE tokenizer with latentloop's three special tokens.

    Build one with `BPETokenizer.train(texts, vocab_size)` or `BPETokenizer.load(path)`.
    """

    name = "bpe"

    def __init__(self, hf_tokenizer, source: str = "<memory>"):
        self._tokenizer = hf_tokenizer
        # Text that happens to contain "<|eos|>" etc. must be encoded as ordinary bytes, never
        # turned into a control token; only our own code inserts special ids.
        self._tokenizer.encode_special_tokens = True
        ids = [hf_tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
        missing = [token for token, token_id in zip(SPECIAL_TOKENS, ids) if token_id is None]
        if missing:
            raise DataError(f"tokenizer {source} lacks the special tokens {', '.join(missing)}")
        self.bos_id, self.eos_id, self.pad_id = ids
        chat_ids = [hf_tokenizer.token_to_id(token) for token in CHAT_TOKENS]
        self.chat_tokens = ChatTokens(*chat_ids) if all(i is not None for i in chat_ids) else None
        self._special_ids = frozenset(ids) | frozenset(i for i in chat_ids if i is not None)
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self._byte_lengths: np.ndarray | None = None

    def with_chat_tokens(self) -> BPETokenizer:
        """A copy with the chat tokens appended as special tokens (ids vocab_size, +1, ...)."""
        if self.chat_tokens is not None:
            return self
        from tokenizers import AddedToken, Tokenizer

        copy = Tokenizer.from_str(self.to_json())
        copy.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in CHAT_TOKENS])
        return BPETokenizer(copy)

    @staticmethod
    def check_vocab_size(vocab_size: int) -> None:
        """A `ConfigError` for a vocabulary size a BPE tokenizer here cannot have (checked before any
        output folder is made, and again by `train`)."""
        if vocab_size < MIN_BPE_VOCAB_SIZE:
            raise ConfigError(
                f"BPE vocab_size {vocab_size} is too small: need at least {MIN_BPE_VOCAB_SIZE} "
                f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
            )
        if vocab_size > MAX_BPE_VOCAB_SIZE:  # 4e9 aborted the process in the trainer's allocation (exit 134)
            raise ConfigError(f"BPE vocab_size {vocab_size:,} is past the {MAX_BPE_VOCAB_SIZE:,} a tokenizer here "
                              f"may have (the largest models' vocabularies are ~260k)")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Learn merges on `texts` until the vocabulary (specials included) has `vocab_size` ids."""
        cls.check_vocab_size(vocab_size)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        hf_tokenizer = Tokenizer(models.BPE())
        hf_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf_tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            # Seed the alphabet with all 256 byte symbols so that any text stays encodable,
            # even bytes that never occurred in the training texts.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf_tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(hf_tokenizer)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Load from a `tokenizer.json` file or a directory holding one."""
        from tokenizers import Tokenizer

        path = Path(path).expanduser()
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise DataError(f"tokenizer file not found: {path}")
        try:
            hf_tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception for any parse problem
            raise DataError(f"cannot read tokenizer {path}: {first_line(exc)}") from exc
        return cls(hf_tokenizer, source=str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def encode_to_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_byte_lengths(self) -> np.ndarray:
        # In the ByteLevel alphabet every character of a token string stands for exactly one
        # byte, so a token's byte count is simply the length of its string.
        if self._byte_lengths is None:
            special_ids = self._special_ids
            lengths = np.zeros(self.vocab_size, dtype=np.int64)
            for token_id in range(self.vocab_size):
                token = self._tokenizer.id_to_token(token_id)
                if token is not None and token_id not in special_ids:
                    lengths[token_id] = len(token)
            self._byte_lengths = lengths
        return self._byte_lengths.copy()

    def token_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (b"" for specials), through the ByteLevel alphabet."""
        token = self._tokenizer.id_to_token(int(token_id))
        if token is None or token_id in self._special_ids:
            return b""
        table = _byte_level_decoding()
        return bytes(table[ch] for ch in token)

    def to_json(self) -> str:
        return self._tokenizer.to_str()

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_FILE
        self._tokenizer.save(str(path))
        return path

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


@functools.cache
def _byte_level_decoding() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet: printable Latin-1 bytes stand for
    themselves; the other bytes (controls, space, ...) were shifted to code points 256 and up, in
    byte order, so that every token string is printable."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    decoding, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            decoding[chr(byte)] = byte
        else:
            decoding[chr(256 + shifted)] = byte
            shifted += 1
    return decoding


def write_new_tokenizer(tokenizer, path: str | Path) -> Path:
    """Write `tokenizer` to the file `path`, which must not exist: a run's tokenizer.json is never
    replaced (its model would decode garbage). The text goes to a temporary file that is then
    hard-linked into place, which fails rather than overwrite a file that appeared meanwhile."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tokenizer.to_json())
            f.flush()
            os.fsync(f.fileno())
        give_default_mode(tmp)  # mkstemp's 0600 would lock colleagues out of the tokenizer
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: check, then rename
            if path.exists():
                raise FileExistsError(path) from None
            os.replace(tmp, path)
    except FileExistsError:
        raise OutputError(f"{path} already exists; choose another output (a tokenizer file is never replaced)"
                          ) from None
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def _token_string(entry) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


GENERATION_CONFIG_FILE = "generation_config.json"


def read_generation_config(folder: Path) -> dict:
    """A Hugging Face model folder's generation_config.json ({} when it has none); one that cannot be
    read is a one-line DataError: passing over it lost the end tokens only it names (Llama 3
    Instruct's `<|eot_id|>`) and its recommended decoding, without a word."""
    path = folder / GENERATION_CONFIG_FILE
    if not path.exists():
        return {}
    try:
        generation = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON's and UTF-8's decoding errors
        raise DataError(f"cannot read {path}: {first_line(exc)}") from None
    if not isinstance(generation, dict):
        raise DataError(f"{path} must hold a JSON object, got {type(generation).__name__}")
    return generation


def _end_ids(config: dict, generation: dict) -> list[int]:
    """Every end token a Hugging Face model names: `eos_token_id` of its config.json and of its
    generation_config.json (`read_generation_config`), each an id or a list (what `generate` stops at there)."""
    found: list[int] = []
    for source in (config, generation):
        value = source.get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and not isinstance(token_id, bool) and token_id not in found:
                found.append(token_id)
    return found


# What `_post_processor_starts_with` encodes: any short text (the post-processor adds its tokens around
# whatever the text is)
POST_PROCESSOR_PROBE_TEXT = "a"


def _post_processor_starts_with(tokenizer, token_id: int) -> bool:
    """Whether the `tokenizers` Tokenizer puts `token_id` before a text when special tokens are added
    (`transformers`' default: `tokenizer(text).input_ids`), through its post-processor: Llama's
    tokenizer.json puts its BOS first, Qwen2's and SmolLM2's add nothing. This is what decides in
    transformers 5 (tested): tokenizer_config.json's `add_bos_token` does not change it, so it is
    not read here either (real folders set it as their post-processor does anyway)."""
    with_specials = tokenizer.encode(POST_PROCESSOR_PROBE_TEXT, add_special_tokens=True).ids
    plain = tokenizer.encode(POST_PROCESSOR_PROBE_TEXT, add_special_tokens=False).ids
    return with_specials[:1] == [token_id] and plain[:1] != [token_id]


def _documents_start_id(probe, eos: int, pad: int | None, end_ids: Sequence[int], chat_template: str | None) -> int:
    """The id that starts documents for a model that names no BOS anywhere (a Qwen2 folder whose
    config.json and generation_config.json leave bos_token_id out): latentloop's data still separates
    documents with one id, and that id restarts the variants' carried state. The first of EOS, the
    model's other end tokens and PAD that its chat template does not write: a base model's EOS
    (`<|endoftext|>`); not an instruct model's EOS, which is its end of turn (`<|im_end|>`, written by
    the template), where the PAD or the other end token is `<|endoftext|>` again. EOS when the
    template writes every one of them. Nothing is put before a prompt unless the tokenizer does so
    itself (`adds_bos`)."""
    template = chat_template or ""
    by_name = {"eos_token": eos, "pad_token": pad}  # a template may write these by their names
    written = {token_id for name, token_id in by_name.items() if name in template}
    for token_id in dict.fromkeys([eos, *end_ids, *([] if pad is None else [pad])]):
        token = probe.id_to_token(token_id)
        if token is not None and token not in template and token_id not in written:
            return token_id
    return eos


class HFTokenizer(_ChatInterface):
    """A pretrained model's Hugging Face tokenizer (a `tokenizers` JSON: Llama 2 / 3, SmolLM,
    Qwen2, ...) with the special ids latentloop needs.

    - `bos_id`, `eos_id`, `pad_id`: from the model's config / tokenizer_config.json (BOS also from
      generation_config.json). A model that names no BOS anywhere separates latentloop's training
      documents with an id of its own that is no end of turn (`_documents_start_id`: a Qwen2
      instruct model's `<|endoftext|>`, not its `<|im_end|>`). Without a PAD token, EOS pads (padding
      is always masked).
    - `adds_bos`: whether a prompt starts with BOS. It belongs to the model, not to the tokenizer
      file: an imported model (`from_pretrained_folder`, what `import-hf` reads) is prompted as
      `transformers` reads the folder (tokenizer.json's post-processor, `_post_processor_starts_with`:
      Llama's puts BOS first, Qwen2's and SmolLM2's do not), while a model latentloop trains with a
      Hugging Face tokenizer (`load_tokenizer` of a tokenizer.json or folder) read every document
      after BOS and is prompted so, whatever the post-processor says. Prompts (`as_prompt`) and chat
      renders follow it. A run's tokenizer file keeps it (a file without it, written before it was
      kept, reads True: what those runs were trained and prompted with; in a run `import-hf` made,
      the post-processor's word, `checkpoint.prompting_as_its_model`). `names_bos`: whether the
      source names a BOS token (tokenizer_config.json's `bos_token`); an export writes one back only
      then (or where it puts BOS first for `adds_bos`).
    - `vocab_size`: the model's embedding rows, which may exceed the tokenizer's own ids (models pad
      their vocabulary to a multiple of 64 or 128); ids past the tokenizer never decode to text.
    - token bytes: through the byte-level alphabet for byte-level BPEs (Llama 3, Qwen2, SmolLM);
      otherwise byte-fallback tokens `<0xNN>` are their byte and `▁` is a space (SentencePiece
      style, Llama 2); special tokens have none.
    - conversations: with a `chat_template` (the model's own, from tokenizer_config.json or
      chat_template.jinja) `render` / `render_prompt` use it, as `apply_chat_template` would, and
      `chat_tokens` is a `ChatTemplate` whose `end` is the first special token the template writes
      after an assistant's words (`<|im_end|>`, `<|eot_id|>`, ...; EOS if it writes none). Without
      one, `with_chat_tokens()` appends latentloop's chat tokens, as for byte and BPE.

    In a run folder it is saved as latentloop's `tokenizer.json`: {"type": "hf", the ids, the chat
    template, and "tokenizer": the Hugging Face JSON}; `write_hf_tokenizer` writes the files back.
    """

    name = "hf"

    def __init__(self, tokenizer_json: str, bos_id: int, eos_id: int, pad_id: int, vocab_size: int | None = None,
                 source: str = "<memory>", chat_template: str | None = None, stop_ids: Sequence[int] = (),
                 names_bos: bool | None = None, adds_bos: bool | None = None, adds_bos_recorded: bool = True):
        """`adds_bos` None: as its tokenizer.json's post-processor (`transformers`' reading: an imported
        model's); `load_tokenizer` gives True to a tokenizer a model is trained with here. `names_bos`
        None: as `adds_bos` (a tokenizer that puts a BOS before texts names it; `from_pretrained_folder`
        also reads tokenizer_config.json's `bos_token`). `adds_bos_recorded` False: a run's tokenizer
        file written before it kept `adds_bos` (`from_saved`), whose `adds_bos` is then a guess."""
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the Rust side raises plain Exception for any parse problem
            raise DataError(f"cannot read tokenizer {source}: {first_line(exc)}") from None
        self._json = tokenizer_json
        # as for BPETokenizer: text that spells a special token is encoded as ordinary text
        self._tokenizer.encode_special_tokens = True
        self.own_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = max(self.own_size, vocab_size or 0)
        named = (("bos", bos_id), ("eos", eos_id), ("pad", pad_id), *(("end token", i) for i in stop_ids))
        for what, token_id in named:
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise DataError(f"tokenizer {source}: {what} id {token_id!r} is not a token id below {self.vocab_size}")
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self._stop_ids = tuple(dict.fromkeys([eos_id, *stop_ids]))  # EOS first, each once
        self.special_ids = {bos_id, eos_id, pad_id, *self._stop_ids} | {
            i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}
        content = json.loads(tokenizer_json)
        self._byte_level = '"ByteLevel"' in json.dumps([content.get("decoder"), content.get("pre_tokenizer")])
        self._byte_lengths: np.ndarray | None = None
        canonical = json.dumps(content, sort_keys=True)  # saving may reformat the JSON: hash its content
        ids = f"{bos_id},{eos_id},{pad_id},{self.vocab_size}"
        if chat_template is not None and not (isinstance(chat_template, str) and chat_template.strip()):
            raise DataError(f"tokenizer {source}: the chat template must be a non-empty string")
        if adds_bos is not None and not isinstance(adds_bos, bool):
            raise DataError(f"tokenizer {source}: adds_bos must be true or false, got {adds_bos!r}"[:200])
        self.chat_template = chat_template
        template = "" if chat_template is None else "\0" + chat_template  # rendered ids change with it
        try:
            self._post_processor_adds_bos = _post_processor_starts_with(self._tokenizer, bos_id)
        except Exception as exc:  # the Rust side raises plain Exception: a post-processor naming a missing token
            raise DataError(f"cannot encode with tokenizer {source}: {first_line(exc)}") from None
        self._adds_bos = self._post_processor_adds_bos if adds_bos is None else adds_bos
        # chat renders change with it; marked only where it is not the post-processor's, so that the
        # fingerprints (and cached data) of every tokenizer that reads as its post-processor stay as they were
        prompts = "" if self._adds_bos == self._post_processor_adds_bos else f"\0adds_bos={self._adds_bos}"
        self._fingerprint = hashlib.sha256((canonical + ids + template + prompts).encode("utf-8")).hexdigest()[:16]
        self._source = source
        self._markup_tokenizer = None
        self.names_bos = self._adds_bos if names_bos is None else names_bos
        self._names_bos_given = names_bos is not None
        self.adds_bos_recorded = adds_bos_recorded

    @property
    def adds_bos(self) -> bool:
        """Whether a prompt starts with BOS: as the model was trained (see the class docstring)."""
        return self._adds_bos

    @property
    def post_processor_adds_bos(self) -> bool:
        """Whether its tokenizer.json itself puts BOS before a text (`_post_processor_starts_with`)."""
        return self._post_processor_adds_bos

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @functools.cached_property
    def chat_tokens(self) -> ChatTemplate | ChatTokens | None:
        if self.chat_template is not None:
            from latentloop.data.chat import template_end_id

            return ChatTemplate(self.chat_template, template_end_id(self))
        chat_ids = [self._tokenizer.token_to_id(token) for token in CHAT_TOKENS]
        return ChatTokens(*chat_ids) if all(i is not None for i in chat_ids) else None

    def with_chat_tokens(self) -> HFTokenizer:
        """Itself when it has a chat format (its template, or our tokens added before); else a copy
        with latentloop's chat tokens appended as special tokens after its own ids."""
        if self.chat_tokens is not None:
            return self
        from tokenizers import AddedToken, Tokenizer

        copy = Tokenizer.from_str(self._json)
        copy.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in CHAT_TOKENS])
        grown = copy.get_vocab_size(with_added_tokens=True)
        return HFTokenizer(copy.to_str(), self.bos_id, self.eos_id, self.pad_id, max(self.vocab_size, grown),
                           source=self._source, stop_ids=self._stop_ids, names_bos=self.names_bos,
                           adds_bos=self.adds_bos)

    def _prompting(self, adds_bos: bool, names_bos: bool | None) -> HFTokenizer:
        """A copy whose prompts start with BOS as `adds_bos` says (itself where they already do)."""
        if self.adds_bos == adds_bos:
            return self
        return HFTokenizer(self._json, self.bos_id, self.eos_id, self.pad_id, self.vocab_size, source=self._source,
                           chat_template=self.chat_template, stop_ids=self._stop_ids, names_bos=names_bos,
                           adds_bos=adds_bos)

    def prompting_as_imported(self) -> HFTokenizer:
        """This tokenizer prompting as `transformers` reads its file (BOS first only where the
        post-processor puts one), as `import-hf` reads an imported model's: for a run imported before
        its tokenizer file recorded `adds_bos` (`checkpoint.prompting_as_its_model`). Where the file did
        not record `names_bos` either, it is derived as an import derives it (a Qwen2 export named
        `<|endoftext|>` its BOS, which transformers then took for one)."""
        return self._prompting(self.post_processor_adds_bos, self.names_bos if self._names_bos_given else None)

    def prompting_with_bos(self) -> HFTokenizer:
        """This tokenizer for a model trained here from scratch, whose data starts every document with
        BOS: its prompts start with BOS too (itself when they already do). An imported run's tokenizer
        file says its model reads none; a new model trained with that file reads one."""
        return self._prompting(True, self.names_bos)

    def encode_markup(self, text: str) -> list[int]:
        """Ids of text a chat template wrote: its special tokens (`<|im_start|>`, ...) are parsed as
        such, as `apply_chat_template` does; `encode` never does that for ordinary text."""
        if self._markup_tokenizer is None:
            from tokenizers import Tokenizer

            self._markup_tokenizer = Tokenizer.from_str(self._json)
        # encode_batch releases the GIL while it runs (encode holds it): a long rendered conversation
        # on a server's worker thread must not stop the event loop, nor the request timeout that ends it
        return self._markup_encoding(text).ids

    def encode_markup_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_markup(text)` and each id's (start, end) characters in `text`."""
        encoding = self._markup_encoding(text)
        return encoding.ids, encoding.offsets

    def _markup_encoding(self, text: str):
        if self._markup_tokenizer is None:
            from tokenizers import Tokenizer

            self._markup_tokenizer = Tokenizer.from_str(self._json)
        return self._markup_tokenizer.encode_batch([text], add_special_tokens=False)[0]

    @classmethod
    def from_pretrained_folder(cls, folder: str | Path, vocab_size: int | None = None,
                               config: dict | None = None, adds_bos: bool | None = None) -> HFTokenizer:
        """From a Hugging Face model folder: its tokenizer.json, and the special tokens: BOS named by
        the model's config.json (`bos_token_id`), else by its generation_config.json, else by
        tokenizer_config.json, and a BOS named nowhere is `_documents_start_id`; EOS and PAD named by
        tokenizer_config.json, as transformers' tokenizer names them (a chat template's `eos_token`),
        else by config.json. Every EOS id config.json and generation_config.json name stops a reply
        too (`stop_ids`). `adds_bos` None:
        prompts start with BOS as transformers prompts the folder's model (an import); `load_tokenizer`
        passes True (a model trained here)."""
        folder = Path(folder)
        file = folder / TOKENIZER_FILE
        if not file.is_file():
            raise DataError(f"no {TOKENIZER_FILE} in {folder} (a `tokenizers` JSON is needed; a SentencePiece "
                            f"tokenizer.model alone is not supported)")
        text = file.read_text(encoding="utf-8")
        settings = {}
        if (folder / "tokenizer_config.json").is_file():
            try:
                settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise DataError(f"cannot read {folder / 'tokenizer_config.json'}: {exc}") from None
        probe = cls._probe(text, str(file))
        config = config or {}

        generation = read_generation_config(folder)

        def configured(source: dict, name: str) -> int | None:
            token_id = source.get(f"{name}_token_id")
            if isinstance(token_id, list):  # several EOS ids (Llama 3 instruct): the first one, all stop
                token_id = token_id[0] if token_id else None
            return token_id if isinstance(token_id, int) else None

        def named(name: str) -> int | None:
            token = _token_string(settings.get(f"{name}_token"))
            return probe.token_to_id(token) if token is not None else None

        def special(name: str) -> int | None:  # the tokenizer's own (transformers' `eos_token`), else config.json's
            found = named(name)
            return configured(config, name) if found is None else found

        # BOS: config.json, else generation_config.json (where Qwen2 instruct folders may keep it alone),
        # else tokenizer_config.json, else `_documents_start_id` below
        bos = next((found for found in (configured(config, "bos"), configured(generation, "bos"), named("bos"))
                    if found is not None), None)
        eos, pad = special("eos"), special("pad")
        if bos is None and eos is None:
            raise DataError(f"tokenizer {folder} names neither a BOS nor an EOS token")
        chat_template = _folder_chat_template(folder, settings)
        end_ids = _end_ids(config, generation)
        if bos is None:
            bos = _documents_start_id(probe, eos, pad, end_ids, chat_template)
        eos = bos if eos is None else eos
        bos_in_settings = _token_string(settings.get("bos_token")) is not None  # else: named where it adds one
        return cls(text, bos, eos, eos if pad is None else pad, vocab_size, source=str(file),
                   chat_template=chat_template, stop_ids=end_ids, names_bos=True if bos_in_settings else None,
                   adds_bos=adds_bos)

    @staticmethod
    def _probe(text: str, source: str):
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_str(text)
        except Exception as exc:  # the Rust side raises plain Exception for any parse problem
            raise DataError(f"cannot read tokenizer {source}: {first_line(exc)}") from None

    @classmethod
    def from_saved(cls, content: dict, source: str) -> HFTokenizer:
        """A run folder's tokenizer file (`save`). Without `adds_bos` (written before it was kept) its
        prompts start with BOS: what latentloop trained and prompted every model with until then."""
        adds_bos = _saved_flag(content, "adds_bos", source)
        try:
            tokenizer = cls(json.dumps(content["tokenizer"]), int(content["bos_id"]), int(content["eos_id"]),
                            int(content["pad_id"]), int(content["vocab_size"]), source=source,
                            chat_template=content.get("chat_template"),
                            stop_ids=[int(i) for i in content.get("stop_ids", [])],
                            names_bos=_saved_flag(content, "names_bos", source),
                            adds_bos=True if adds_bos is None else adds_bos, adds_bos_recorded=adds_bos is not None)
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"tokenizer {source} is not a valid latentloop HF tokenizer file: {exc}") from None
        return tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def encode_to_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids if 0 <= int(i) < self.own_size], skip_special_tokens=True)

    def token_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (b"" for specials and ids past the tokenizer)."""
        token_id = int(token_id)
        token = self._tokenizer.id_to_token(token_id) if token_id < self.own_size else None
        if token is None or token_id in self.special_ids:
            return b""
        if self._byte_level:
            table = _byte_level_decoding()
            if all(ch in table for ch in token):
                return bytes(table[ch] for ch in token)
            return token.encode("utf-8")
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return token.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")

    def token_byte_lengths(self) -> np.ndarray:
        if self._byte_lengths is None:
            self._byte_lengths = np.array([len(self.token_to_bytes(i)) for i in range(self.vocab_size)],
                                          dtype=np.int64)
        return self._byte_lengths.copy()

    def hf_json(self) -> str:
        """The Hugging Face tokenizer JSON, as it was read."""
        return self._json

    def token_string(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(int(token_id)) if token_id < self.own_size else None

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_FILE
        payload = {"type": "hf", "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id,
                   "vocab_size": self.vocab_size, "tokenizer": json.loads(self._json)}
        if self.chat_template is not None:
            payload["chat_template"] = self.chat_template
        if len(self._stop_ids) > 1:
            payload["stop_ids"] = list(self._stop_ids)
        payload["names_bos"] = self.names_bos  # tokenizer_config.json's word, which the tokenizer JSON lacks
        payload["adds_bos"] = self.adds_bos  # the model's, not the tokenizer JSON's (an import's or a training's)
        path.write_text(json.dumps(payload, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    def fingerprint(self) -> str:
        return self._fingerprint

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"


def _saved_flag(content: dict, key: str, source: str) -> bool | None:
    """A true / false of a saved HF tokenizer file; None when absent (a file written before latentloop
    saved it: the tokenizer derives it)."""
    value = content.get(key)
    if value is not None and not isinstance(value, bool):
        raise DataError(f"tokenizer {source}: '{key}' must be true or false, got {value!r}"[:200])
    return value


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where recent transformers versions save the template


def _folder_chat_template(folder: Path, settings: dict) -> str | None:
    """The chat template of a Hugging Face tokenizer folder: chat_template.jinja, else the
    `chat_template` of tokenizer_config.json (a string, or a list of named templates: "default")."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise DataError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                        f"{{'name', 'template'}} objects, got {type(template).__name__}")
    return template


def _byte_tokenizer_json(chat: bool = False) -> str:
    """The byte tokenizer as a `tokenizers` JSON: a byte-level BPE without merges whose 256 base
    symbols have ids 0..255 in byte order, then <|bos|>, <|eos|>, <|pad|>: the same ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for char, byte in _byte_level_decoding().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    if chat:  # ids 259.., in the order ByteTokenizer(chat=True) numbers them
        tokenizer.add_special_tokens([AddedToken(token, special=True) for token in CHAT_TOKENS])
    return tokenizer.to_str()


def _with_bos_first(text: str, bos: str, bos_id: int) -> str:
    """A `tokenizers` JSON whose encoding (with special tokens, transformers' default) starts with
    BOS, as Llama's do: a TemplateProcessing post-processor `<bos> $A` (pair: `<bos> $A <bos> $B`),
    after any post-processor the JSON already has."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_str(text)
    template = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                             special_tokens=[(bos, bos_id)])
    before = tokenizer.post_processor
    tokenizer.post_processor = template if before is None else processors.Sequence([before, template])
    return tokenizer.to_str()


HF_PADDING_SIDE = "left"  # where an exported tokenizer pads a batch (`tokenizer(texts, padding=True)`)


# What an exported chat template starts with where the model reads BOS first but its template writes none
BOS_TEMPLATE_PREFIX = "{{ bos_token }}"


def _template_gets_bos(tokenizer: HFTokenizer, bos_token: str | None) -> str | None:
    """How an exported chat template starts a conversation with BOS where latentloop's renders do
    (`adds_bos`: `as_prompt` puts one before a render that has none, while `apply_chat_template` adds
    no special tokens): "written" when the template writes it itself (given the BOS token's name, as the
    export names it), "added" when it needs `BOS_TEMPLATE_PREFIX`; None for a model prompted without
    BOS, or a tokenizer without a template or a BOS token string. Any model prompted with BOS: one
    trained here with a Hugging Face tokenizer, and an import whose post-processor puts BOS first while
    its template writes none (latentloop chats with it after BOS, and its export then does too). A
    template that refuses the one-message probe is written back as read."""
    if tokenizer.chat_template is None or not tokenizer.adds_bos or bos_token is None:
        return None
    from latentloop.data.chat import PROBE_CONVERSATION, _template_context, render_template

    context = {**_template_context(tokenizer, list(PROBE_CONVERSATION[:1]), True), "bos_token": bos_token}
    try:
        rendered = render_template(tokenizer.chat_template, context)
    except LatentloopError:  # a template that will not render a lone user message: nothing is learnt of it
        return None
    written = tokenizer.encode_markup(rendered)[:1] == [tokenizer.bos_id]
    return "written" if written else "added"


def write_hf_tokenizer(tokenizer, directory: str | Path, model_max_length: int | None = None) -> list[Path]:
    """Write `tokenizer.json` and `tokenizer_config.json` that Hugging Face's `AutoTokenizer` loads
    (a fast tokenizer; the special tokens named as the model's config names their ids).

    A byte or BPE tokenizer is latentloop's own, whose models are trained on [BOS] + text and prompted
    so: its `tokenizer.json` prepends BOS when special tokens are added (`tokenizer(text).input_ids` is
    [BOS] + `encode(text)`), as Llama's do; chat templates write their BOS themselves and transformers
    renders them without special tokens, and latentloop's own encoders never add them. A Hugging Face
    tokenizer (an imported model's) is written back as read: its own post-processor, if any; one a model
    was trained with here (`adds_bos` where its post-processor adds no BOS: GPT-2's, Qwen2's) gets BOS
    first as a byte or BPE one does, since that model read every document after BOS, and its own chat
    template, where it writes no BOS, starts with one (`_template_gets_bos`). Every one pads on the left
    (`HF_PADDING_SIDE`), as decoder-only models decode a batch."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    template_bos = None  # latentloop's own formats write their BOS themselves
    if isinstance(tokenizer, ByteTokenizer):
        names = dict(zip(("bos", "eos", "pad"), SPECIAL_TOKENS))
        text = _with_bos_first(_byte_tokenizer_json(chat=tokenizer.chat), names["bos"], tokenizer.bos_id)
    elif isinstance(tokenizer, BPETokenizer):
        names = dict(zip(("bos", "eos", "pad"), SPECIAL_TOKENS))
        text = _with_bos_first(tokenizer.to_json(), names["bos"], tokenizer.bos_id)
    elif isinstance(tokenizer, HFTokenizer):
        text = tokenizer.hf_json()
        bos_token = tokenizer.token_string(tokenizer.bos_id)
        bos_first = tokenizer.adds_bos and not tokenizer.post_processor_adds_bos and bos_token is not None
        if bos_first:
            # a model trained here with a tokenizer whose post-processor puts no BOS first (GPT-2's, Qwen2's):
            # it read every document after BOS, so transformers must prompt it so too, as latentloop does
            text = _with_bos_first(text, bos_token, tokenizer.bos_id)
        # a BOS only where the source named one (or it now goes first): the id a model without one separates
        # documents with (`_documents_start_id`) is latentloop's, and transformers must not take it for its BOS
        template_bos = _template_gets_bos(tokenizer, bos_token)
        named = ("bos", "eos", "pad") if tokenizer.names_bos or bos_first or template_bos else ("eos", "pad")
        names = {what: tokenizer.token_string(getattr(tokenizer, f"{what}_id")) for what in named}
    else:
        raise DataError(f"cannot write {type(tokenizer).__name__} as a Hugging Face tokenizer")
    (directory / TOKENIZER_FILE).write_text(text, encoding="utf-8")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                # a padded batch keeps each text's last token in the last column, where generate() continues
                # and where the exported remote code takes padding (transformers' default is the right)
                "padding_side": HF_PADDING_SIDE,
                **{f"{what}_token": name for what, name in names.items() if name is not None}}
    if model_max_length is not None:
        settings["model_max_length"] = model_max_length
    own_template = getattr(tokenizer, "chat_template", None)  # written back as read, but for a BOS it lacks
    if own_template is not None:
        settings["chat_template"] = (BOS_TEMPLATE_PREFIX if template_bos == "added" else "") + own_template
    elif tokenizer.chat_tokens is not None:  # latentloop's format, as a template
        settings["chat_template"] = _own_format_template(tokenizer)
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    return [directory / TOKENIZER_FILE, directory / "tokenizer_config.json"]


def load_tokenizer(spec: str) -> ByteTokenizer | BPETokenizer | HFTokenizer:
    """Turn a tokenizer spec into a tokenizer.

    `"byte"` gives a ByteTokenizer; a path to a `tokenizer.json` (or a directory holding one)
    gives whichever kind the file describes: latentloop's byte or HF-wrapper files, a BPE trained
    here (it has latentloop's special tokens), or a pretrained model's Hugging Face tokenizer next
    to its `tokenizer_config.json` (an `HFTokenizer`).
    """
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file():
            raise DataError(f"no {TOKENIZER_FILE} in directory {path}")
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"unknown tokenizer '{spec}': use 'byte' or a path to a tokenizer.json")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read tokenizer {path}: {exc}") from exc
    except ValueError as exc:  # valid JSON Python will not read: a number past its int-to-str limit
        raise DataError(f"cannot read tokenizer {path}: {first_line(exc)}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise DataError(f"cannot read tokenizer {path}: its JSON is nested too deeply") from None
    if isinstance(content, dict) and content.get("type") == "byte":
        chat = content.get("chat", False)
        if not isinstance(chat, bool):  # "yes" was read as no chat tokens, silently
            raise DataError(f"tokenizer {path}: 'chat' must be true or false, got {chat!r}"[:200])
        return ByteTokenizer(chat=chat)
    if isinstance(content, dict) and content.get("type") == "hf":  # a run's: it says where BOS goes
        return HFTokenizer.from_saved(content, str(path))
    added = content.get("added_tokens") if isinstance(content, dict) else None
    if added is not None and not isinstance(added, list):  # iterating a number was a TypeError
        raise DataError(f"tokenizer {path}: 'added_tokens' must be a list, got {type(added).__name__}")
    # every Hugging Face tokenizer.json names its model; without one the tokenizers library's complaint
    # is a parse error at a column of valid JSON ("expected `,` or `}`"), which reads as a damaged file
    if not isinstance(content, dict) or "model" not in content:
        kind = ("a JSON object with no 'model'" if isinstance(content, dict)
                else f"JSON {'null' if content is None else type(content).__name__}, not an object")
        raise DataError(f"tokenizer {path}: not a tokenizer file ({kind}); use 'byte' or a tokenizer.json")
    ours = any(isinstance(token, dict) and token.get("content") == BOS_TOKEN for token in added or [])
    if not ours and (path.parent / "tokenizer_config.json").is_file():  # a pretrained model's own tokenizer
        # to train with: latentloop's documents start with BOS, so its prompts do, whatever the file's
        # post-processor (GPT-2's, Qwen2's, SmolLM2's put none); only `import-hf` prompts as transformers
        return HFTokenizer.from_pretrained_folder(path.parent, adds_bos=True)
    return BPETokenizer.load(path)
