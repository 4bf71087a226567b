"""Data for training and evaluation; this package knows no model.

The flow is one way:

    source ──> tokenizer ──> shards ──> loader
    parse_source("text:corpus/")         documents (str), split into "train" and "val"
    load_tokenizer("byte")                text -> token ids (or BPETokenizer.train(...))
    prepare_tokens(source, tok, cache)    each split tokenized once into a memory-mapped file
    TokenLoader(data.train, B, T, seed)   resumable shuffled (x, y) batches for training
    eval_batches(data.val, B, T)          ordered (x, y) batches for validation

Typical use:

    source = parse_source("stdlib")
    tokenizer = load_tokenizer("byte")
    data = prepare_tokens(source, tokenizer, "cache/tokens")
    loader = TokenLoader(data.train, batch_size=8, seq_len=256, seed=0)
    x, y = loader.next_batch()
"""

from latentloop.data.loader import TokenLoader, eval_batches
from latentloop.data.shards import TokenData, prepare_tokens
from latentloop.data.sources import parse_source
from latentloop.data.tokenizers import BPETokenizer, ByteTokenizer, HFTokenizer, load_tokenizer, write_hf_tokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenData",
    "TokenLoader",
    "eval_batches",
    "load_tokenizer",
    "parse_source",
    "prepare_tokens",
    "write_hf_tokenizer",
]
