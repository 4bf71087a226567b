"""Token shards: each split of a source, tokenized once into a flat memory-mapped file.

Layout of the cache (one folder per (source, tokenizer, max_bytes) combination):

    cache_dir/<16 hex chars of the cache key>/
        train.bin   flat token ids (uint16 when the vocabulary fits, else uint32)
        val.bin
        meta.json   spec, tokenizer, dtype, per-split token/document/byte counts, and per split
                    the sha256 of the file and its largest token id

Documents are packed back to back, each as `[bos_id] + tokenizer.encode(document)`, so a model
can see where documents start. A folder is built under a temporary name and renamed into place
only when complete: an interrupted run never leaves a half-written cache behind. Every open
re-reads the shards against their checksums, so a corrupted or edited file (even one of the same
size) is a `DataError` rather than silently different training data, and so is a token id that the
tokenizer does not have.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from latentloop.errors import ConfigError, DataError

# Bump when the layout or the packing of shards changes, so that old caches are not reused.
# 2: meta.json holds a sha256 and the largest token id per split.
FORMAT_VERSION = 2

SPLIT_NAMES = ("train", "val")
META_FILE = "meta.json"

# Tokens are gathered in memory up to about this many before each write to disk.
_WRITE_CHUNK_TOKENS = 1 << 20
# Bytes read at a time when verifying a shard (a multiple of every token dtype's size).
_VERIFY_CHUNK_BYTES = 1 << 24


@dataclass
class TokenData:
    """Both splits of a tokenized source, memory-mapped read-only."""

    train: np.memmap
    val: np.memmap
    meta: dict
    directory: Path


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def split_byte_caps(max_bytes: int | None, val_fraction: float | None) -> dict[str, int | None]:
    """How many UTF-8 bytes each split may read.

    Train reads up to `max_bytes`; val up to `max_bytes * val_fraction` (at least 1 byte), which
    keeps the two splits in their natural proportion and keeps streamed sources from reading far
    more than `max_bytes` just to fill val. A source without a val_fraction gets `max_bytes` for
    both splits.
    """
    if max_bytes is None:
        return {"train": None, "val": None}
    if val_fraction is None or val_fraction <= 0:
        return {"train": max_bytes, "val": max_bytes}
    return {"train": max_bytes, "val": max(1, math.ceil(max_bytes * val_fraction))}


def cache_key(source, tokenizer, max_bytes: int | None) -> str:
    payload = [
        FORMAT_VERSION,
        source.fingerprint(),
        tokenizer.fingerprint(),
        max_bytes,
        getattr(source, "val_fraction", None),
    ]
    return hashlib.sha256(json.dumps(payload).encode("utf-8")).hexdigest()


def prepare_tokens(
    source,
    tokenizer,
    cache_dir: str | Path,
    max_bytes: int | None = None,
    progress: bool = True,
) -> TokenData:
    """Tokenize both splits of `source` into `cache_dir`, or reuse an earlier identical run.

    `source` is a `latentloop.data.sources.Source`; `tokenizer` any latentloop tokenizer.
    `max_bytes` caps the UTF-8 bytes read per split (see `split_byte_caps`); the document that
    crosses the cap is cut at the cap.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ConfigError(f"max_bytes must be at least 1, got {max_bytes}")
    cache_dir = Path(cache_dir).expanduser()
    key = cache_key(source, tokenizer, max_bytes)
    directory = cache_dir / key[:16]

    cached = _open_cached(directory, tokenizer.vocab_size)
    if cached is not None:
        return cached
    if directory.exists():
        shutil.rmtree(directory)  # unreadable leftover (e.g. edited by hand): rebuild it

    cache_dir.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=cache_dir))
    try:
        meta = _build(source, tokenizer, temp_dir, max_bytes, progress)
        meta["cache_key"] = key
        (temp_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        try:
            os.replace(temp_dir, directory)
        except OSError:
            # Another process finished the same cache first; its copy is just as good.
            if _open_cached(directory, tokenizer.vocab_size) is None:
                raise
    finally:
        if temp_dir.exists():
            shutil.rmtree(temp_dir, ignore_errors=True)
    opened = _open_cached(directory, tokenizer.vocab_size)
    if opened is None:
        raise DataError(f"token cache {directory} could not be read back after writing it")
    return opened


def _build(source, tokenizer, directory: Path, max_bytes: int | None, progress: bool) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    caps = split_byte_caps(max_bytes, getattr(source, "val_fraction", None))
    meta: dict = {
        "format_version": FORMAT_VERSION,
        "spec": source.spec,
        "source_fingerprint": source.fingerprint(),
        "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": tokenizer.fingerprint(),
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": int(tokenizer.bos_id),
        "dtype": dtype.name,
        "max_bytes": max_bytes,
        "split_byte_caps": caps,
        "tokens": {},
        "documents": {},
        "bytes": {},
        "sha256": {},
        "max_id": {},
    }
    for split in SPLIT_NAMES:
        counts = _write_split(source, tokenizer, split, directory / f"{split}.bin", dtype, caps[split], progress)
        if counts["tokens"] <= counts["documents"]:
            raise DataError(f"data source '{source.spec}' has no text in its {split} split")
        for measure, value in counts.items():
            meta[measure][split] = value
    return meta


def _write_split(
    source, tokenizer, split: str, path: Path, dtype: np.dtype, byte_cap: int | None, progress: bool
) -> dict[str, int]:
    """Stream the split's documents into `path`; returns token, document and byte counts, the
    file's sha256 and its largest token id."""
    bos = np.array([tokenizer.bos_id], dtype=dtype)
    counts = {"tokens": 0, "documents": 0, "bytes": 0}
    pending: list[np.ndarray] = []
    pending_tokens = 0
    digest, max_id = hashlib.sha256(), 0

    def write(out, arrays: list[np.ndarray]) -> None:
        nonlocal max_id
        chunk = np.concatenate(arrays)
        max_id = max(max_id, int(chunk.max()))
        data = chunk.tobytes()
        digest.update(data)
        out.write(data)

    # leave=False: the bar is transient, so an error that follows it is the only line left on screen
    bar = tqdm(desc=f"tokenizing {source.spec} [{split}]", unit="doc", disable=not progress, leave=False)
    with path.open("wb") as out, bar:
        for document in source.iter_documents(split):
            document_bytes = len(document.encode("utf-8"))
            reached_cap = False
            if byte_cap is not None and counts["bytes"] + document_bytes >= byte_cap:
                document = _truncate_utf8(document, byte_cap - counts["bytes"])
                document_bytes = len(document.encode("utf-8"))
                reached_cap = True
            if document:
                ids = tokenizer.encode_to_array(document).astype(dtype, copy=False)
                pending += [bos, ids]
                pending_tokens += 1 + len(ids)
                counts["tokens"] += 1 + len(ids)
                counts["documents"] += 1
                counts["bytes"] += document_bytes
                bar.update(1)
            if pending_tokens >= _WRITE_CHUNK_TOKENS:
                write(out, pending)
                pending, pending_tokens = [], 0
            if reached_cap:
                break  # stop pulling documents: a streamed source should not read any further
        if pending:
            write(out, pending)
        out.flush()
        os.fsync(out.fileno())
    return {**counts, "sha256": digest.hexdigest(), "max_id": max_id}


def _truncate_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of `text` whose UTF-8 encoding fits in `max_bytes` (no split chars)."""
    return text.encode("utf-8")[: max(0, max_bytes)].decode("utf-8", errors="ignore")


def scan_shard(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """(sha256 hex digest, largest token id) of a shard file, read in chunks."""
    digest, max_id = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(_VERIFY_CHUNK_BYTES):
            digest.update(chunk)
            max_id = max(max_id, int(np.frombuffer(chunk, dtype=dtype).max()))
    return digest.hexdigest(), max_id


def _open_cached(directory: Path, vocab_size: int | None = None) -> TokenData | None:
    """Open a finished cache folder, or None when there is none (or its layout is unreadable, so it
    is rebuilt). A shard that does not match its checksum, or holds an id outside the vocabulary
    (`vocab_size`, else the one recorded in meta.json), is a `DataError`."""
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format_version") != FORMAT_VERSION:
            return None
        dtype = np.dtype(meta["dtype"])
        vocab = int(meta["vocab_size"]) if vocab_size is None else vocab_size
        for split in SPLIT_NAMES:
            path = directory / f"{split}.bin"
            if path.stat().st_size != meta["tokens"][split] * dtype.itemsize:
                return None
            checksum, max_id = scan_shard(path, dtype)
            if checksum != meta["sha256"][split]:
                raise DataError(f"token cache file {path} does not match its checksum (corrupted or edited); "
                                f"delete {directory} to rebuild it")
            if max_id >= vocab or max_id != meta["max_id"][split]:
                raise DataError(f"token cache file {path} holds token id {max_id}, outside the tokenizer's "
                                f"{vocab} ids; delete {directory} to rebuild it")
        arrays = {split: np.memmap(directory / f"{split}.bin", dtype=dtype, mode="r") for split in SPLIT_NAMES}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return TokenData(train=arrays["train"], val=arrays["val"], meta=meta, directory=directory)
