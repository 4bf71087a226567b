"""Tokenizers: a dependency-free byte tokenizer and a trainable byte-level BPE tokenizer.

Both share one small interface, which is all the rest of latentloop relies on:

- `encode(text) -> list[int]` (no special tokens), `encode_batch(texts)`, `decode(ids) -> str`
  (special tokens skipped, invalid UTF-8 replaced), `encode_to_array(text) -> np.ndarray`
  (fast path for big texts);
- `bos_id`, `eos_id`, `pad_id`, `vocab_size`, `name`;
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
  A tokenizer imported from Hugging Face implements `render` with its own chat template when it
  has one; byte and BPE use `latentloop.data.chat.render_conversation`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from latentloop.errors import ConfigError, DataError, OutputError

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


class _ChatInterface:
    """The conversation methods byte and BPE share (see `latentloop.data.chat`)."""

    chat_tokens: ChatTokens | None

    def render(self, messages) -> tuple[list[int], list[bool]]:
        """[BOS] + every turn as ids, and a mask True on the tokens a model is trained to write
        (the assistant's content and its end-of-turn token)."""
        from latentloop.data.chat import render_conversation

        return render_conversation(self, messages)

    def render_prompt(self, messages) -> list[int]:
        """The ids a model continues to answer `messages` (which end with a user turn)."""
        from latentloop.data.chat import render_prompt

        return render_prompt(self, messages)

# Byte-level BPE needs all 256 byte symbols in its alphabet plus our special tokens.
MIN_BPE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


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

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Learn merges on `texts` until the vocabulary (specials included) has `vocab_size` ids."""
        if vocab_size < MIN_BPE_VOCAB_SIZE:
            raise ConfigError(
                f"BPE vocab_size {vocab_size} is too small: need at least {MIN_BPE_VOCAB_SIZE} "
                f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
            )
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
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(f"cannot read tokenizer {path}: {reason}") from exc
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


def load_tokenizer(spec: str) -> ByteTokenizer | BPETokenizer:
    """Turn a tokenizer spec into a tokenizer.

    `"byte"` gives a ByteTokenizer; a path to a `tokenizer.json` (or a directory holding one)
    gives whichever kind the file describes.
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
    if isinstance(content, dict) and content.get("type") == "byte":
        return ByteTokenizer(chat=content.get("chat") is True)
    return BPETokenizer.load(path)
