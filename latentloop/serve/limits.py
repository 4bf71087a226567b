"""What one request may ask of the server, and how much text its model's context can hold.

A prompt is refused by its size before it is tokenized when it can never fit the context: a tokenizer
whose tokens spell the text byte for byte (latentloop's byte and BPE tokenizers, a byte-level BPE or a
SentencePiece BPE with byte fallback imported from Hugging Face) needs at least one token per
`longest token` bytes, so a text of more than `context x longest token` bytes needs more tokens than
the context holds. Tokenizing first would cost a thread seconds to minutes on a 16 MB prompt (the body
cap) and answer the same. A tokenizer that may drop or shrink text (a normalizer, a pre-tokenizer that
removes what it splits on, an unknown-token model that covers many characters with one token) gets no
such bound, only MAX_TEXT_BYTES, which every text has (the /tokenize endpoint's too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# The most UTF-8 bytes one text may have before it is tokenized, whatever the tokenizer: /tokenize's
# texts (lm-eval sends whole documents there, longer than any context), and every prompt of a tokenizer
# that does not spell its text byte for byte. A long document, tokenized in well under a second; the
# 16 MiB a body may carry would hold a tokenizer thread for seconds to minutes.
MAX_TEXT_BYTES = 2**20
MAX_UTF8_BYTES = 4  # the most bytes one character takes in UTF-8
MAX_BODY_BYTES = 16 * 2**20  # the most bytes any request body may have (413 past it, holding no more)
# What a completions body can need, to refuse a larger one by its size (413) before decoding it: each
# prompt's text JSON-escaped (at most 6 bytes per byte: "\u0000" for a control byte), or its token ids
# (digits, separators and a pretty-printer's indentation), and room for every other field
JSON_ESCAPED_BYTES = 6
JSON_ID_BYTES = 16
BODY_FIELDS_BYTES = 2**20

# Pre-tokenizers that keep every byte of the text in some piece (ByteLevel maps bytes into its alphabet,
# Metaspace spaces to "▁", and a token's bytes map them back); the others may drop what they split on
# (Whitespace, BertPreTokenizer; Split and Punctuation with the "Removed" behaviour).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})
# Normalizers that never shrink a text (Prepend adds; a Replace is checked to grow)
_GROWING_NORMALIZERS = frozenset({"Prepend", "Replace"})


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server."""

    context: int  # the model's context: prompt + max_tokens must fit
    max_tokens_cap: int  # --max-tokens-cap
    max_rows: int  # --max-batch-size: a request's prompts x n must fit one batch
    # the most UTF-8 bytes of prompt text that can fit the context (`prompt_text_limit`), checked before
    # tokenizing; None: the tokenizer gives no such bound (MAX_TEXT_BYTES still applies)
    prompt_bytes: int | None = None
    prompt_bytes_why: str = ""  # how prompt_bytes follows from the context and the tokenizer

    @classmethod
    def for_model(cls, context: int, max_tokens_cap: int, max_rows: int, tokenizer) -> Limits:
        """The limits of a server of this context and tokenizer (the text bound computed once)."""
        return cls(context, max_tokens_cap, max_rows, *prompt_text_limit(tokenizer, context))

    @property
    def completion_body_bytes(self) -> int:
        """The most bytes a /v1/completions body can need: max_rows prompts, each the most text that
        fits the context (JSON-escaped) or a context of token ids, and BODY_FIELDS_BYTES for the
        rest; at most MAX_BODY_BYTES."""
        text = MAX_TEXT_BYTES if self.prompt_bytes is None else min(self.prompt_bytes, MAX_TEXT_BYTES)
        prompt = max(text * JSON_ESCAPED_BYTES, self.context * JSON_ID_BYTES)
        return min(MAX_BODY_BYTES, self.max_rows * prompt + BODY_FIELDS_BYTES)

    def completion_body_why(self) -> str:
        """How `completion_body_bytes` follows (for the 413's message)."""
        if self.completion_body_bytes == MAX_BODY_BYTES:
            return "the most any request may have"
        return (f"the most a completions request to this model can need: {self.max_rows} prompts (--max-batch-size) "
                f"of a context's text or token ids, JSON-escaped, and {BODY_FIELDS_BYTES // 2**20} MiB for the other "
                f"fields")

    def text_problem(self, text: str, what: str = "the prompt") -> str | None:
        """Why a prompt's text can never be served, by its size alone (None: it may fit)."""
        bound = MAX_TEXT_BYTES if self.prompt_bytes is None else min(self.prompt_bytes, MAX_TEXT_BYTES)
        over = size_over(text, bound)
        if over is None:
            return None
        if bound == self.prompt_bytes:
            return (f"{what} is {over} of text: more than the model's context of {self.context} tokens can hold "
                    f"({self.prompt_bytes_why})")
        return f"{what} is {over} of text, over the {MAX_TEXT_BYTES:,} bytes one text may have"


def size_over(text: str, bound: int) -> str | None:
    """The text's size ("N characters" or "N bytes") when it is more than `bound` UTF-8 bytes, else
    None. Its characters are counted first (each is one byte or more): a huge text is refused
    without a pass over it."""
    if len(text) > bound:
        return f"{len(text):,} characters"
    if len(text) * MAX_UTF8_BYTES <= bound:
        return None
    size = len(text.encode("utf-8", "surrogatepass"))
    return f"{size:,} bytes" if size > bound else None


def spells_its_text(tokenizer) -> bool:
    """Whether the tokenizer's tokens spell every text byte for byte (the bytes of a text's tokens,
    `token_to_bytes`, are at least the text's): then a text of B bytes is at least B / (longest
    token's bytes) tokens. Read from the Hugging Face JSON of BPE and HF tokenizers; unknown kinds
    of tokenizer: False."""
    spec_text = tokenizer.hf_json() if hasattr(tokenizer, "hf_json") else tokenizer.to_json() \
        if hasattr(tokenizer, "to_json") else None
    try:
        spec = json.loads(spec_text) if spec_text is not None else None
    except ValueError:
        return False
    if not isinstance(spec, dict):
        return False
    if spec.get("type") == "byte":  # latentloop's byte tokenizer: one token per byte
        return True
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return False  # WordPiece, Unigram, WordLevel: an unknown token may stand for a whole word
    if model.get("unk_token") is not None and not model.get("byte_fallback"):
        return False  # one unknown token may stand for many characters
    return _keeps_text(spec.get("normalizer"), _GROWING_NORMALIZERS, _grows) and \
        _keeps_text(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS, _keeps)


def _keeps_text(step, allowed: frozenset, check) -> bool:
    if step is None:
        return True
    if not isinstance(step, dict):
        return False
    if step.get("type") == "Sequence":
        parts = step.get("normalizers", step.get("pretokenizers"))
        return isinstance(parts, list) and all(_keeps_text(part, allowed, check) for part in parts)
    return step.get("type") in allowed and check(step)


def _grows(normalizer: dict) -> bool:
    """A Replace of a plain string by one at least as long (Llama 2's " " -> "▁"); Prepend always."""
    if normalizer.get("type") != "Replace":
        return True
    pattern, content = normalizer.get("pattern"), normalizer.get("content")
    return isinstance(pattern, dict) and isinstance(pattern.get("String"), str) and isinstance(content, str) \
        and len(content.encode("utf-8")) >= len(pattern["String"].encode("utf-8"))


def _keeps(pre_tokenizer: dict) -> bool:
    return pre_tokenizer.get("behavior") != "Removed"


def prompt_text_limit(tokenizer, context: int) -> tuple[int | None, str]:
    """(the most UTF-8 bytes of text that can fit `context` tokens, how that follows), or (None, "")
    for a tokenizer that does not spell its text byte for byte (`spells_its_text`)."""
    if not spells_its_text(tokenizer):
        return None, ""
    longest = max(1, int(tokenizer.token_byte_lengths().max()))
    return context * longest, (f"{context} tokens x {longest} bytes, this tokenizer's longest token, = "
                               f"{context * longest:,} bytes at most")
