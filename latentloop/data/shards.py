"""Token shards: each split of a source, tokenized once into a flat memory-mapped file.

Layout of the cache (one folder per (source, tokenizer, max_bytes) combination):

    cache_dir/<16 hex chars of the cache key>/
        train.bin   flat token ids (uint16 when the vocabulary fits, else uint32)
        val.bin
        meta.json   spec, tokenizer, dtype, per-split token/document/byte counts, and per split
                    the sha256 of the file and its largest token id

Documents are packed back to back, each as `[bos_id] + tokenizer.encode(document)`, so a model
can see where documents start (a document of more than `LONG_DOCUMENT_CHARS` characters is
tokenized in pieces cut at newlines: `latentloop.data.tokenizers.encode_in_pieces`). A folder is
built under a temporary name and renamed into place only when complete: an interrupted run never
leaves a half-written cache behind. Every open
re-reads the shards against their checksums, so a corrupted or edited file (even one of the same
size) is a `DataError` rather than silently different training data, and so is a token id that the
tokenizer does not have. A folder is used only when its meta.json names the cache key asked for
and the dtype the vocabulary needs: one copied or renamed from another key is rebuilt, like any
folder whose layout is unreadable (a truncated shard, a half-written meta.json, a plain file or a
dangling link at its path). A folder this user can read but not remove, or cannot read at all (a
colleague's, on a shared cache), is a `DataError` naming it; a cache root that is not a writable
folder is an `OutputError` naming it and `$LATENTLOOP_CACHE` / `data.cache_dir`. Published folders
and files get the permissions a plain `mkdir` / `open()` gives, so colleagues sharing a cache
can read them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from latentloop.data.tokenizers import encode_in_pieces
from latentloop.errors import ConfigError, DataError, OutputError
from latentloop.util import current_umask, give_default_mode, remove_abandoned_staging

# Bump when the layout or the packing of shards changes, so that old caches are not reused.
# 2: meta.json holds a sha256 and the largest token id per split.
FORMAT_VERSION = 2

SPLIT_NAMES = ("train", "val")
META_FILE = "meta.json"

# Tokens are gathered in memory up to about this many before each write to disk.
_WRITE_CHUNK_TOKENS = 1 << 20
# Bytes read at a time when verifying a shard (a multiple of every token dtype's size).
_VERIFY_CHUNK_BYTES = 1 << 24
# What `mkdir` asks for a new folder; the umask then takes bits away (0o755 under the usual 0o022).
# `tempfile.mkdtemp` makes its folder 0o700 whatever the umask, which locked colleagues sharing a
# cache out of every entry this user built.
NEW_DIR_MODE = 0o777
# How an error about the cache root tells the user where that root comes from.
CACHE_SETTING = "$LATENTLOOP_CACHE (or data.cache_dir)"
# Name prefix of a damaged entry set aside to be removed (see `_remove_entry`).
ASIDE_PREFIX = ".old-"
TEMP_PREFIX = ".tmp-"  # an entry being built: TEMP_PREFIX + machine tag + - + key[:16] + -PID- + mkdtemp's tail


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

    cached = _open_cached(directory, key, tokenizer.vocab_size)
    if cached is not None:
        return cached
    _remove_entry(directory)  # unreadable or foreign leftover (e.g. edited by hand): rebuild it

    temp_dir = _make_temp_dir(cache_dir, key)
    try:
        meta = _build(source, tokenizer, temp_dir, max_bytes, progress)
        meta["cache_key"] = key
        (temp_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        for file in temp_dir.iterdir():
            give_default_mode(file)
        os.chmod(temp_dir, NEW_DIR_MODE & ~current_umask())  # mkdtemp's 0700 would lock colleagues out
        try:
            os.replace(temp_dir, directory)
        except OSError:
            # Another process finished the same cache first; its copy is just as good.
            if _open_cached(directory, key, tokenizer.vocab_size) is None:
                raise
    finally:
        if temp_dir.exists():
            shutil.rmtree(temp_dir, ignore_errors=True)
    opened = _open_cached(directory, key, tokenizer.vocab_size)
    if opened is None:
        raise DataError(f"token cache {directory} could not be read back after writing it")
    return opened


def _machine_tag() -> str:
    """This machine's name as 8 hex digits (no "-", which splits a build folder's name)."""
    return hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _make_temp_dir(cache_dir: Path, key: str) -> Path:
    """A new private folder in `cache_dir` (made if missing) to build an entry in. A cache root that is
    a file, or a folder this user cannot write, is an `OutputError` naming it and where it is set."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # a build killed part way (SIGKILL, a power cut) left its folder for good: removed once its
        # process is gone, by this machine's next build of any entry (`util.remove_abandoned_staging`).
        # Only this machine's: a cache shared by several (NFS, a volume mounted in containers) holds other
        # machines' builds, whose processes this one cannot see (a review found them deleted mid-build)
        ours = f"{TEMP_PREFIX}{_machine_tag()}-"
        remove_abandoned_staging(cache_dir, ours, None)
        return Path(tempfile.mkdtemp(prefix=f"{ours}{key[:16]}-{os.getpid()}-", dir=cache_dir))
    except FileExistsError:  # mkdir(exist_ok=True) still refuses a file (or a link to one) at the path
        reason = "it is not a folder"
    except OSError as exc:
        reason = exc.strerror or str(exc)
    raise OutputError(f"cannot use token cache folder {cache_dir}: {reason}; set {CACHE_SETTING} to a folder "
                      f"you can write")


def _remove_entry(directory: Path) -> None:
    """Remove whatever is at an entry's path so that it can be built again: a plain file or a
    (dangling) link by unlinking it (rmtree refuses both), a folder by setting it aside under a name
    of this process's own and removing that, so that of several processes that found it damaged one
    moves it and the others find it gone. Nothing there is fine. What cannot be removed (a colleague's
    entry in a shared cache) is put back where it was and is a `DataError` naming it and saying what
    to do."""
    aside = None
    try:
        if directory.is_symlink() or not directory.is_dir():
            directory.unlink(missing_ok=True)
            return
        aside = directory.with_name(f"{ASIDE_PREFIX}{directory.name}-{secrets.token_hex(4)}")
        try:
            os.rename(directory, aside)
        except FileNotFoundError:
            return  # another process set it aside first
        shutil.rmtree(aside)
    except NotADirectoryError:  # the cache root is a file: nothing to remove; _make_temp_dir says so
        return
    except OSError as exc:
        where = ""
        if aside is not None and aside.exists():
            try:
                os.rename(aside, directory)  # its owner finds it where it was
            except OSError:
                where = f" (set aside as {aside})"
        raise DataError(f"token cache entry {directory}{where} is damaged or out of date and cannot be removed "
                        f"({exc.strerror or exc}): delete it (or ask its owner to), or set {CACHE_SETTING} "
                        f"to a folder of your own") from None


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
            # documents go to val by a hash of their name: of a few dozen, none may (0.95^20 = 36% at 20)
            how = (": its documents each go to val by a hash of their name, and none did; raise data.val_fraction "
                   "(--set data.val_fraction=0.2) or add documents") if split == "val" else ""
            raise DataError(f"data source '{source.spec}' has no text in its {split} split{how}")
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
                pending.append(bos)
                pending_tokens += 1
                counts["tokens"] += 1
                # a very long document in pieces, each written once enough has gathered: its ids are
                # never all in memory at once (see encode_in_pieces)
                for ids in encode_in_pieces(tokenizer, document):
                    ids = ids.astype(dtype, copy=False)
                    pending.append(ids)
                    pending_tokens += len(ids)
                    counts["tokens"] += len(ids)
                    if pending_tokens >= _WRITE_CHUNK_TOKENS:
                        write(out, pending)
                        pending, pending_tokens = [], 0
                counts["documents"] += 1
                counts["bytes"] += document_bytes
                bar.update(1)
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


def _open_cached(directory: Path, key: str, vocab_size: int) -> TokenData | None:
    """Open the finished cache folder of `key`, or None when there is none, or when it is unusable and
    is to be rebuilt: an unreadable layout, or a meta.json that names another cache key (a folder
    copied from another entry) or another dtype than `vocab_size` needs. A shard that does not match
    its checksum, or holds an id outside the vocabulary, is a `DataError`; so is a folder this user
    may not read (a colleague's, on a shared cache), which no rebuild could replace."""
    meta_path = directory / META_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            return None
        dtype = token_dtype(vocab_size)
        # The key's prefix is only the folder's name: the whole key and the dtype must be this entry's.
        if meta.get("cache_key") != key or meta.get("dtype") != dtype.name:
            return None
        for split in SPLIT_NAMES:
            path = directory / f"{split}.bin"
            if path.stat().st_size != meta["tokens"][split] * dtype.itemsize:
                return None
            checksum, max_id = scan_shard(path, dtype)
            if checksum != meta["sha256"][split]:
                raise DataError(f"token cache file {path} does not match its checksum (corrupted or edited); "
                                f"delete {directory} to rebuild it")
            if max_id >= vocab_size or max_id != meta["max_id"][split]:
                raise DataError(f"token cache file {path} holds token id {max_id}, outside the tokenizer's "
                                f"{vocab_size} ids; delete {directory} to rebuild it")
        arrays = {split: np.memmap(directory / f"{split}.bin", dtype=dtype, mode="r") for split in SPLIT_NAMES}
    except PermissionError as exc:
        raise DataError(f"token cache entry {directory} cannot be read ({exc.strerror}): ask its owner to make it "
                        f"readable or delete it, or set {CACHE_SETTING} to a folder of your own") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return TokenData(train=arrays["train"], val=arrays["val"], meta=meta, directory=directory)
