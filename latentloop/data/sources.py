"""Data sources: where training text comes from, split into "train" and "val".

`parse_source(spec)` understands these specs:

- `stdlib`: the `.py` files of the running interpreter's standard library, one document per file
  (no download needed, so it is the default for quick experiments and tests);
- `text:PATH`: a `.txt`/`.jsonl`/`.parquet` file, a folder of them (searched recursively) or a glob;
- `hf:NAME` / `hf:NAME:CONFIG`: a Hugging Face dataset, streamed (needs `latentloop[hf]`);
- `task:NAME`: reserved for task datasets (`latentloop.data.tasks`);
- `mix:SPEC+SPEC[+...]`: several of the above, interleaved so that each contributes about the
  same number of bytes (`MixSource`), e.g. `mix:stdlib+text:../shared/data/text/tinystories_sample.txt`.

Every split is decided by a stable hash of a document's identity (its file path, its index), never
by random state, so the same spec always gives the same split on every machine. Adding files
leaves existing documents on their side while the source holds at least
`MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT` documents before and after; a `text:` source with fewer is split
inside each document instead (`TextSource`), so growing one past that threshold (or shrinking it
below) changes every document's split.
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import hashlib
import itertools
import json
import os
import socket
import sys
import sysconfig
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from latentloop.data.base import Source
from latentloop.data.tasks import get_task_source
from latentloop.errors import ConfigError, DataError
from latentloop.util import encodable, first_line

SPLITS = ("train", "val")

# Separator used by GPT-2 style corpora (TinyStories, OpenWebText dumps) between documents.
END_OF_TEXT = "<|endoftext|>"
BYTE_ORDER_MARK = "\ufeff"  # UTF-8's, which some editors write first: passed over in .txt and .jsonl files

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
# Characters that make a `text:` path a glob.
GLOB_CHARS = "*?["

# A text source with fewer documents than this is split inside each document instead of by
# document, so that e.g. a single Shakespeare file still has a validation part.
MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT = 20

# Directories of the standard library that are not representative library code.
STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})

_HASH_BUCKETS = 10_000

# Bytes of a `.txt` file read at a time: a file of many `<|endoftext|>`-separated documents is never
# held whole in memory.
_TEXT_CHUNK_BYTES = 1 << 22


def goes_to_val(key: str, val_fraction: float) -> bool:
    """Whether the document identified by `key` belongs to the val split (stable across runs).

    A key holding a file name that is not UTF-8 (Python keeps its bytes as lone surrogates) is
    hashed with those raw bytes back ("surrogateescape"); every valid name encodes to the same bytes
    either way, so no existing split moves."""
    bucket = int.from_bytes(hashlib.sha1(key.encode("utf-8", "surrogateescape")).digest()[:8], "big") % _HASH_BUCKETS
    return bucket < round(val_fraction * _HASH_BUCKETS)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def _file_listing(root: Path, files: list[Path]) -> list[tuple[str, int, int, int]]:
    """(relative path, size, mtime_ns, ctime_ns) of each file: changes whenever a file is edited. The
    change time too: `cp -p`, `rsync -a` or `tar x` of another text of the same size restore the old
    mtime, and the stale tokens were reused; nothing sets the change time back (a chmod or a hard link
    made to the file moves it too: one rebuild more, never wrong tokens)."""
    listing = []
    for path in files:
        stat = path.stat()
        listing.append((path.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns))
    return listing


def _starts_with_mark(path: Path) -> bool:
    """Whether a file read as text (any but `.jsonl` and `.parquet`, as `_read_documents` splits them) begins
    with UTF-8's byte-order mark, which `_read_text` passes over."""
    if path.suffix in (".jsonl", ".parquet"):
        return False
    try:
        with path.open("rb") as handle:
            return handle.read(len(BYTE_ORDER_MARK.encode())) == BYTE_ORDER_MARK.encode()
    except OSError:
        return False


class StdlibSource(Source):
    """The `.py` files of the running interpreter's standard library, one document per file."""

    def __init__(self, val_fraction: float = 0.05, root: str | Path | None = None):
        self.spec = "stdlib"
        self.val_fraction = val_fraction
        self.root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
        if not self.root.is_dir():
            raise DataError(f"standard library folder not found: {self.root}")
        self._files: list[Path] | None = None

    def files(self) -> list[Path]:
        """The candidate `.py` files, sorted by relative path (decoding is checked later)."""
        if self._files is None:
            found = []
            for folder, dir_names, file_names in os.walk(self.root):
                # Pruning in place stops os.walk from descending into skipped directories.
                dir_names[:] = [name for name in dir_names if name not in STDLIB_SKIPPED_DIRS]
                found.extend(Path(folder) / name for name in file_names if name.endswith(".py"))
            self._files = sorted(found, key=lambda path: path.relative_to(self.root).as_posix())
        return self._files

    def iter_documents(self, split: str) -> Iterator[str]:
        _check_split(split)
        want_val = split == "val"
        for path in self.files():
            relative = path.relative_to(self.root).as_posix()
            if goes_to_val(relative, self.val_fraction) != want_val:
                continue
            try:
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # a few stdlib files are deliberately not UTF-8; they are not needed
            if text.strip():
                yield text

    def fingerprint(self) -> str:
        listing = _file_listing(self.root, self.files())
        return _digest(["stdlib", str(self.root), sys.version, self.val_fraction, listing])


class TextSource(Source):
    """Local text files: `.txt`, `.jsonl` (field `text`) and `.parquet` (column `text`).

    `.txt` files holding `<|endoftext|>` are split on it (each piece stripped of surrounding
    whitespace); other `.txt` files are one document each. Blank documents are dropped.
    Documents go to val by a stable hash of (file path relative to the folder, or to a glob's fixed
    folder part, document index), except
    that a source with fewer than 20 documents gives the last `val_fraction` of each document's
    characters (at least one) to val, so that a single file still yields both splits.
    """

    def __init__(self, path: str, val_fraction: float = 0.05):
        self.spec = f"text:{path}"
        self.path = path
        self.val_fraction = val_fraction
        self.root, self.files = _resolve_text_files(path)
        self._is_small: bool | None = None

    def _iter_all(self) -> Iterator[tuple[str, int, str]]:
        """Every non-blank document as (relative file path, index within the file, text)."""
        for file in self.files:
            relative = file.relative_to(self.root).as_posix()
            for index, text in enumerate(_read_documents(file)):
                yield relative, index, text

    def is_small(self) -> bool:
        """Whether the source has too few documents to split by document. Reading stops at the
        `MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT`-th document: a big corpus is not read through to answer."""
        if self._is_small is None:
            count = 0
            for _ in self._iter_all():
                count += 1
                if count >= MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT:
                    break
            if count == 0:
                raise DataError(f"no text in {self.path}: the files hold no non-blank documents")
            self._is_small = count < MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT
        return self._is_small

    def iter_documents(self, split: str) -> Iterator[str]:
        _check_split(split)
        want_val = split == "val"
        if self.is_small():
            for _, _, text in self._iter_all():
                cut = _val_cut(len(text), self.val_fraction)
                part = text[cut:] if want_val else text[:cut]
                if part:
                    yield part
            return
        for relative, index, text in self._iter_all():
            if goes_to_val(f"{relative}:{index}", self.val_fraction) == want_val:
                yield text

    def fingerprint(self) -> str:
        listing = _file_listing(self.root, self.files)
        parts = ["text", str(self.root.resolve()), self.val_fraction, listing]
        # text files read since 12-07 without their byte-order mark: their shards tokenized before it (the
        # mark as the first character) are not reused; every other source keeps its key, and its cache
        marked = [path.relative_to(self.root).as_posix() for path in self.files if _starts_with_mark(path)]
        return _digest(parts + [["byte order mark passed over", marked]] if marked else parts)


class MixSource(Source):
    """Several sources as one: documents interleaved so that the mix is balanced by bytes (the
    next document comes from the source that has given the fewest UTF-8 bytes so far; once one
    runs out, the others continue). Each part keeps its own train/val split, so a capped run
    (`max_bytes`) sees the same share of every part."""

    SEPARATOR = "+"

    def __init__(self, parts: list[Source]):
        if len(parts) < 2:
            raise DataError("a mix: source needs at least two parts (mix:SPEC+SPEC)")
        self.parts = parts
        self.spec = "mix:" + self.SEPARATOR.join(part.spec for part in parts)
        self.val_fraction = parts[0].val_fraction

    def iter_documents(self, split: str) -> Iterator[str]:
        _check_split(split)
        streams = [part.iter_documents(split) for part in self.parts]
        given = [0] * len(streams)
        active = list(range(len(streams)))
        while active:
            index = min(active, key=lambda i: given[i])
            document = next(streams[index], None)
            if document is None:
                active.remove(index)
                continue
            given[index] += len(document.encode("utf-8"))
            yield document

    def fingerprint(self) -> str:
        return _digest(["mix", *(part.fingerprint() for part in self.parts)])


def _val_cut(length: int, val_fraction: float) -> int:
    """Character position where a document's val share starts (its last `val_fraction`)."""
    if val_fraction <= 0:
        return length
    return length - max(1, round(length * val_fraction))


def _resolve_text_files(path: str) -> tuple[Path, list[Path]]:
    """The files behind a `text:` path (file, folder or glob), and the root they are relative to."""
    if not path:
        raise DataError("empty path in data source 'text:': use text:PATH")
    expanded = Path(path).expanduser()
    if expanded.is_file():
        # A file named explicitly is read even with another suffix (.md, .csv...), as plain text.
        return expanded.parent, [expanded]
    if expanded.is_dir():
        # hidden files and folders skipped, as the glob form skips them: a `.ipynb_checkpoints/` copy was
        # read beside its original, each document split on its own path, so val documents were trained on
        files = sorted(
            (p for p in expanded.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
             and not any(part.startswith(".") for part in p.relative_to(expanded).parts)),
            key=lambda p: p.relative_to(expanded).as_posix(),
        )
        if not files:
            raise DataError(f"no .txt, .jsonl or .parquet files in folder {expanded}")
        return expanded, files
    if any(char in path for char in GLOB_CHARS):
        root = _glob_prefix(expanded)
        matches = (_walk_glob(expanded, root) if "**" in expanded.parts
                   else [Path(p) for p in glob.glob(str(expanded))])
        files = [p for p in matches if p.is_file() and p.suffix in TEXT_SUFFIXES]
        if not files:
            raise DataError(f"no .txt, .jsonl or .parquet files match {path}")
        return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())
    raise DataError(f"data path not found: {expanded}")


def _walk_glob(pattern: Path, root: Path) -> list[Path]:
    """The paths below `root` that a recursive glob (`root/**/*.txt`) matches, as `glob.glob` matches
    them (`**` any number of folders, names starting with a dot only where the pattern's part does),
    but without entering symlinked folders, as the folder form (`text:DIR`) does not: glob followed
    them, so a link to its own folder listed every file again under loop/, loop/loop/, ... (their
    copies split apart between train and val), and two such links grew the list past the memory."""
    wanted = pattern.parts[len(root.parts):]
    found = []
    for folder, subfolders, names in os.walk(root, followlinks=False):  # Path() walks ".": paths stay relative
        subfolders.sort()
        relative = Path(folder).relative_to(root).parts
        found.extend(Path(folder, name) for name in sorted(names) if _parts_match(wanted, (*relative, name)))
    return found


def _parts_match(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":  # no folder, or any number of them (not hidden ones, as glob's)
        return any(_parts_match(rest, parts[skip:]) for skip in range(len(parts) + 1)
                   if not any(part.startswith(".") for part in parts[:skip]))
    return (bool(parts) and (head.startswith(".") or not parts[0].startswith("."))
            and fnmatch.fnmatchcase(parts[0], head) and _parts_match(rest, parts[1:]))


def _glob_prefix(pattern: Path) -> Path:
    """The folder part of a glob before its first wildcard (`data/**/*.txt` -> `data`), which every
    match lies below. Keys are relative to it, not to the matches' common folder: that moved
    whenever a file was added in a sibling folder, and every document's key (so its split) with it."""
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if any(char in part for char in GLOB_CHARS))
    return Path(*parts[:fixed]) if fixed else Path()


def _read_documents(file: Path) -> Iterator[str]:
    """The non-blank documents of one file, in order."""
    if file.suffix == ".jsonl":
        yield from _read_jsonl(file)
    elif file.suffix == ".parquet":
        yield from _read_parquet(file)
    else:
        yield from _read_text(file)


def _read_text(file: Path) -> Iterator[str]:
    """The documents of a `.txt` file, read `_TEXT_CHUNK_BYTES` at a time: the pieces between
    `<|endoftext|>` separators (each stripped) when the file has any, else the whole text. A file of
    many documents is never held whole (a reader that stops early, as `TextSource.is_small` does, reads
    no further); a file without separators is one document, held whole, as before."""
    try:
        handle = file.open("rb")
    except OSError as exc:
        raise DataError(f"cannot read {file}: {exc.strerror}") from exc
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts: list[str] = []  # the current document so far (joined once: += on a huge str copies it again and again)
    held = ""  # the last characters read, which may be the start of a separator the next chunk completes
    separated, offset, final = False, 0, False
    with handle:
        while not final:
            try:
                chunk = handle.read(_TEXT_CHUNK_BYTES)
            except OSError as exc:
                raise DataError(f"cannot read {file}: {exc.strerror}") from exc
            final = not chunk
            undecoded = len(decoder.getstate()[0])  # bytes of a character the last chunk began
            try:
                window = held + decoder.decode(chunk, final=final)
            except UnicodeDecodeError as exc:
                raise DataError(f"{file} is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset "
                                f"{offset - undecoded + exc.start})") from exc
            if offset == 0 and window.startswith(BYTE_ORDER_MARK):  # an editor's mark, not the text's first character
                window = window[1:]
            offset += len(chunk)
            start = 0
            while (end := window.find(END_OF_TEXT, start)) != -1:
                separated = True
                piece = ("".join(parts) + window[start:end]).strip()
                parts = []
                if piece:
                    yield piece
                start = end + len(END_OF_TEXT)
            rest = window[start:]
            keep = len(rest) if final else max(0, len(rest) - len(END_OF_TEXT) + 1)
            parts.append(rest[:keep])
            held = rest[keep:]
    text = "".join(parts)
    if separated:
        text = text.strip()
    if text.strip():
        yield text


def iter_jsonl(file: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line; unreadable files and bad lines raise
    DataError naming the file and line. Lines end at "\n" alone, as JSON Lines defines them (a text
    mode read also ended one at a bare "\r", which JSON allows between tokens), and each is decoded
    on its own, so a byte that is not UTF-8 is named on its own line (a decoder reading ahead named
    a line hundreds before it). A UTF-8 byte-order mark before the first line is passed over."""
    try:
        handle = file.open("rb")
    except OSError as exc:
        raise DataError(f"cannot read {file}: {exc.strerror}") from exc
    with handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{file}:{line_number}: not valid UTF-8 (byte {raw[exc.start]:#04x} at offset "
                                f"{exc.start} of the line)") from None
            if line_number == 1:
                line = line.removeprefix(BYTE_ORDER_MARK)
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{file}:{line_number}: invalid JSON ({exc.msg})") from exc
            except ValueError as exc:  # valid JSON Python will not read: a number past its int-to-str limit
                raise DataError(f"{file}:{line_number}: unreadable JSON ({str(exc).split(';')[0]})") from None
            except RecursionError:  # arrays or objects nested thousands deep
                raise DataError(f"{file}:{line_number}: unreadable JSON (nested too deeply)") from None
            yield line_number, value


def _read_jsonl(file: Path) -> Iterator[str]:
    for line_number, record in iter_jsonl(file):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{file}:{line_number}: expected an object with a string 'text'")
        if not encodable(record["text"]):  # JSON lets an escape such as \ud800 through
            raise DataError(f"{file}:{line_number}: 'text' holds a lone surrogate (an escape such as \\ud800 "
                            f"that is half of a character): not valid text")
        if record["text"].strip():
            yield record["text"]


def _read_parquet(file: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as parquet
    except ImportError as exc:
        raise DataError(f"reading {file} needs pyarrow: pip install pyarrow") from exc
    try:
        parquet_file = parquet.ParquetFile(file)
    except Exception as exc:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(f"cannot read parquet file {file}: {exc}") from exc
    if "text" not in parquet_file.schema_arrow.names:
        raise DataError(f"parquet file {file} has no 'text' column")
    batches = parquet_file.iter_batches(columns=["text"])
    while True:
        # A sound footer says nothing of the data pages, which are only decoded here: a damaged page
        # raises while iterating (OSError, ArrowInvalid...), so each batch is read inside the guard.
        try:
            batch = next(batches, None)
            texts = None if batch is None else batch.column(0).to_pylist()
        except Exception as exc:  # pyarrow raises several unrelated types for unreadable data
            raise DataError(f"cannot read parquet file {file}: {first_line(exc)}") from None
        if texts is None:
            return
        for text in texts:
            if isinstance(text, str) and text.strip():
                yield text


class HFSource(Source):
    """A Hugging Face dataset, streamed (nothing is downloaded in full).

    Uses the `train` split of the dataset and divides it into train/val by a stable hash of each
    document's index in the stream; `max_documents` caps how many documents are read (before
    dividing). The text is field `text`, or else the first string field of the first record.
    Each of our splits streams the dataset once.
    """

    def __init__(
        self,
        name: str,
        config: str | None = None,
        val_fraction: float = 0.05,
        max_documents: int | None = None,
    ):
        if not name:
            raise DataError("empty dataset name in data source 'hf:': use hf:NAME[:CONFIG]")
        if max_documents is not None and max_documents < 1:
            raise ConfigError(f"max_documents must be at least 1, got {max_documents}")
        self.name = name
        self.config = config
        self.spec = f"hf:{name}" + (f":{config}" if config else "")
        self.val_fraction = val_fraction
        self.max_documents = max_documents

    def _load_stream(self):
        try:
            import datasets
        except ImportError as exc:
            raise DataError(
                f"data source '{self.spec}' needs the datasets library: pip install 'latentloop[hf]'"
            ) from exc
        if not Path(self.name).expanduser().is_dir():
            unreachable = _hub_unreachable_reason()
            if unreachable:
                raise DataError(f"cannot load Hugging Face dataset '{self.spec}': {unreachable}, and a streamed "
                                f"dataset is read from the Hub as it trains; with no network, pass a local copy "
                                f"(hf:FOLDER or text:PATH)")
        try:
            return datasets.load_dataset(self.name, self.config, split="train", streaming=True)
        except Exception as exc:  # network, missing dataset, bad config...: all user-facing here
            raise DataError(f"cannot load Hugging Face dataset '{self.spec}': {first_line(exc)}") from exc

    def iter_documents(self, split: str) -> Iterator[str]:
        _check_split(split)
        want_val = split == "val"
        text_field = None
        records = iter(self._load_stream())
        for index in itertools.count():
            if self.max_documents is not None and index >= self.max_documents:
                break
            try:
                record = next(records)
            except StopIteration:
                break
            except Exception as exc:  # noqa: BLE001 - the library's own, as rows are read: bad JSON, non-UTF-8 text
                raise DataError(f"cannot read Hugging Face dataset '{self.spec}' at row {index:,}: "
                                f"{type(exc).__name__}: {first_line(exc)}") from None
            if text_field is None:
                text_field = _pick_text_field(record, self.spec)
            if goes_to_val(str(index), self.val_fraction) != want_val:
                continue
            text = record.get(text_field)
            if isinstance(text, str) and text.strip():
                yield text

    def fingerprint(self) -> str:
        # A hub dataset is identified by name and config (assumed not to change underneath us);
        # a local folder also by the files it holds.
        listing = None
        local = Path(self.name).expanduser()
        if local.is_dir():
            files = sorted(p for p in local.rglob("*") if p.is_file())
            listing = _file_listing(local, files)
        return _digest(["hf", self.name, self.config, self.max_documents, self.val_fraction, listing])


# A lookup that failed for now ("Temporary failure in name resolution": no DNS server answered, as on a
# machine with no network, or a passing blip) is tried this many times more, a second apart.
HUB_LOOKUP_RETRIES = 2


def _hub_unreachable_reason() -> str | None:
    """Why the Hugging Face Hub cannot be reached from this machine, where a name lookup of its host
    already says so; None where it may be reached. Without it a machine with no network waited about
    23 s while the datasets library retried, printing a line each time, before it gave up."""
    proxies = urllib.request.getproxies()
    if proxies.get("https") or proxies.get("all"):
        return None  # the proxy looks the host up, not this machine (the environment's or the system's)
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    if constants.HF_HUB_OFFLINE:
        return None  # the datasets library says so itself, at once
    host = urllib.parse.urlsplit(constants.ENDPOINT).hostname
    if not host:
        return None
    for attempt in range(HUB_LOOKUP_RETRIES + 1):
        try:
            socket.getaddrinfo(host, 443)
            return None
        except socket.gaierror as exc:
            if exc.errno != socket.EAI_AGAIN:
                return f"the Hub's host {host} cannot be looked up ({exc.strerror})"
            if attempt == HUB_LOOKUP_RETRIES:
                return f"the Hub's host {host} cannot be looked up ({exc.strerror}, {attempt + 1} times)"
            time.sleep(1.0)
        except OSError:
            return None
    return None


def _pick_text_field(record: dict, spec: str) -> str:
    if isinstance(record.get("text"), str):
        return "text"
    for key, value in record.items():
        if isinstance(value, str):
            return key
    raise DataError(f"dataset '{spec}' has no string field to use as text (fields: {list(record)})")


def parse_source(spec: str, val_fraction: float = 0.05, max_documents: int | None = None) -> Source:
    """Turn a data spec (`stdlib`, `text:PATH`, `hf:NAME[:CONFIG]`, `task:NAME`) into a Source.

    `max_documents` caps the documents read from an `hf:` dataset; other sources ignore it.
    """
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    spec = spec.strip()
    kind, colon, rest = spec.partition(":")
    if spec == "stdlib":
        return StdlibSource(val_fraction)
    if kind == "text" and colon:
        return TextSource(rest, val_fraction)
    if kind == "hf" and colon:
        name, _, config = rest.partition(":")
        return HFSource(name, config or None, val_fraction, max_documents)
    if kind == "task" and colon:
        return get_task_source(rest, val_fraction)
    if kind == "mix" and colon:
        parts = [part.strip() for part in rest.split(MixSource.SEPARATOR)]
        if any(not part or part.startswith("mix:") for part in parts):
            raise DataError(f"data source '{spec}': a mix is mix:SPEC+SPEC[+...] of non-empty, non-mix specs")
        return MixSource([parse_source(part, val_fraction, max_documents) for part in parts])
    raise DataError(f"unknown data source '{spec}': use stdlib, text:PATH, hf:NAME[:CONFIG], task:NAME or "
                    f"mix:SPEC+SPEC")
