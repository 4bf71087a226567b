"""Bad input to the data pipeline ends in one clear error (or is handled), never in a traceback or in
silently different data: blank `text:` paths, foreign / damaged / unreadable token cache entries,
unusable cache roots, damaged parquet pages, non-UTF-8 file names, malformed tokenizer JSON, glob
sources growing in a sibling folder, and very long documents."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from latentloop.data import ByteTokenizer, load_tokenizer, parse_source, prepare_tokens, shards, sources
from latentloop.data.shards import cache_key, scan_shard
from latentloop.data.sources import MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT, goes_to_val
from latentloop.errors import DataError, OutputError
from latentloop.runtime import absolute_source

WORDS = "the quick brown fox jumps over the lazy dog while latent state loops forward".split()


def make_docs(folder: Path, count: int = MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT + 4, tag: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"doc{i:03d}.txt").write_text(f"{tag}story {i}: " + " ".join(WORDS[(i + j) % len(WORDS)]
                                                                            for j in range(12)) + "\n")
    return folder


def prepare(folder: Path, cache: Path):
    return prepare_tokens(parse_source(f"text:{folder}"), ByteTokenizer(), cache, progress=False)


# 1. `train --data text:` ------------------------------------------------------------------------


def test_a_blank_text_path_stays_blank_so_parse_source_refuses_it(tmp_path, monkeypatch):
    make_docs(tmp_path)
    monkeypatch.chdir(tmp_path)  # made absolute, "" was this folder: its files were trained on
    assert absolute_source("text:") == "text:"
    with pytest.raises(DataError, match="empty path"):
        parse_source(absolute_source("text:"))
    assert absolute_source("text:corpus") == f"text:{tmp_path / 'corpus'}"  # others still made absolute


# 2. foreign cache entries ------------------------------------------------------------------------


def test_an_entry_copied_under_another_key_is_rebuilt_not_used(tmp_path):
    a, b, cache = make_docs(tmp_path / "a", tag="A "), make_docs(tmp_path / "b", tag="B "), tmp_path / "cache"
    expected = np.array(prepare(a, cache).train)
    a_dir, b_dir = prepare(a, cache).directory, prepare(b, cache).directory
    shutil.rmtree(a_dir)
    shutil.copytree(b_dir, a_dir)  # B's finished, self-consistent folder under A's name
    data = prepare(a, cache)
    assert data.meta["spec"] == f"text:{a}"
    assert np.array_equal(np.array(data.train), expected)


def test_an_entry_of_another_dtype_is_rebuilt_not_used(tmp_path):
    folder, cache = make_docs(tmp_path / "a"), tmp_path / "cache"
    data = prepare(folder, cache)
    expected = np.array(data.train)
    meta = data.meta
    for split in ("train", "val"):  # a consistent entry, but in uint32 where the vocabulary needs uint16
        shard = data.directory / f"{split}.bin"
        np.fromfile(shard, dtype=np.uint16).astype(np.uint32).tofile(shard)
        meta["sha256"][split], meta["max_id"][split] = scan_shard(shard, np.dtype(np.uint32))
    meta["dtype"] = "uint32"
    (data.directory / "meta.json").write_text(json.dumps(meta))
    again = prepare(folder, cache)
    assert again.train.dtype == np.uint16 and again.meta["dtype"] == "uint16"
    assert np.array_equal(np.array(again.train), expected)


# 3. modes, unreadable and unremovable entries -------------------------------------------------------


def test_cache_entries_get_the_default_mode_not_mkdtemps_0700(tmp_path):
    old = os.umask(0o022)
    try:
        data = prepare(make_docs(tmp_path / "a"), tmp_path / "cache")
    finally:
        os.umask(old)
    assert data.directory.stat().st_mode & 0o777 == 0o755
    for file in data.directory.iterdir():
        assert file.stat().st_mode & 0o777 == 0o644, file


def test_a_build_killed_part_way_leaves_no_folder_past_the_next_build(tmp_path):
    """A first tokenization killed (SIGKILL) left its `.tmp-KEY-...` folder, a partial shard, in the cache
    for good (review). The next build on this machine removes this machine's such folders whose process is
    gone, of any entry, and leaves a live process's build and another machine's (a shared cache) alone."""
    import subprocess
    import sys

    cache = tmp_path / "cache"
    cache.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    here = f"{shards.TEMP_PREFIX}{shards._machine_tag()}-"
    abandoned = cache / f"{here}0123456789abcdef-{dead_pid}-abc_1234"
    other_key = cache / f"{here}fedcba9876543210-{dead_pid}-zz9_8765"
    building = cache / f"{here}0123456789abcdef-{os.getpid()}-live1234"  # a live process's
    # another machine sharing the cache (NFS): its processes cannot be seen from here, so its build stays
    elsewhere = cache / f"{shards.TEMP_PREFIX}00000000-0123456789abcdef-{dead_pid}-abc_1234"
    for folder in (abandoned, other_key, building, elsewhere):
        folder.mkdir()
        (folder / "train.bin").write_bytes(b"partial")
    data = prepare(make_docs(tmp_path / "a"), cache)
    assert not abandoned.exists() and not other_key.exists() and building.exists() and elsewhere.exists()
    assert data.directory.parent == cache and data.directory.name[:1] != "."


def test_an_entry_that_cannot_be_read_is_one_error_naming_it(tmp_path, monkeypatch):
    folder, cache = make_docs(tmp_path / "a"), tmp_path / "cache"
    directory = prepare(folder, cache).directory

    def refused(path, dtype):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shards, "scan_shard", refused)  # a colleague's entry: root would read it anyway
    with pytest.raises(DataError, match=f"{directory} cannot be read.*LATENTLOOP_CACHE"):
        prepare(folder, cache)
    assert (directory / "meta.json").is_file()  # left for its owner, not removed


def test_a_damaged_entry_that_cannot_be_removed_is_one_error_naming_it(tmp_path, monkeypatch):
    folder, cache = make_docs(tmp_path / "a"), tmp_path / "cache"
    shard = prepare(folder, cache).directory / "val.bin"
    os.truncate(shard, shard.stat().st_size - 2)

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shards.shutil, "rmtree", refused)
    with pytest.raises(DataError, match="cannot be removed.*delete it"):
        prepare(folder, cache)


# 4. cache housekeeping ------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["file", "dangling link"])
def test_a_non_folder_at_an_entry_path_is_replaced(tmp_path, what):
    folder, cache = make_docs(tmp_path / "a"), tmp_path / "cache"
    cache.mkdir()
    entry = cache / cache_key(parse_source(f"text:{folder}"), ByteTokenizer(), None)[:16]
    if what == "file":
        entry.write_text("junk")
    else:
        entry.symlink_to(tmp_path / "nowhere")
    data = prepare(folder, cache)
    assert data.directory == entry and entry.is_dir() and not entry.is_symlink()
    assert not (tmp_path / "nowhere").exists()


def test_a_cache_root_that_is_a_file_is_one_error_naming_it(tmp_path):
    root = tmp_path / "cache"
    root.write_text("not a folder")
    with pytest.raises(OutputError, match=f"{root}: it is not a folder.*LATENTLOOP_CACHE"):
        prepare(make_docs(tmp_path / "a"), root)


def test_a_cache_root_that_cannot_be_written_is_one_error_naming_it(tmp_path, monkeypatch):
    def refused(*args, **kwargs):  # what mkdtemp raises in a read-only folder (root ignores modes)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(shards.tempfile, "mkdtemp", refused)
    with pytest.raises(OutputError, match="cache.*Permission denied.*LATENTLOOP_CACHE"):
        prepare(make_docs(tmp_path / "a"), tmp_path / "cache")


# 5. damaged parquet pages ----------------------------------------------------------------------------


def test_a_parquet_file_with_damaged_data_pages_is_one_error(tmp_path):
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    file = tmp_path / "damaged.parquet"
    parquet.write_table(pa.table({"text": [f"document number {i} " * 20 for i in range(400)]}), file,
                        compression="snappy", row_group_size=100)
    with file.open("r+b") as handle:  # the footer (at the end) stays sound: only reading pages fails
        handle.seek(file.stat().st_size // 3)
        handle.write(b"\xff" * 300)
    source = parse_source(f"text:{file}")
    with pytest.raises(DataError, match="cannot read parquet file"):
        list(source.iter_documents("train"))


# 6. non-UTF-8 file names ---------------------------------------------------------------------------


def test_a_file_name_that_is_not_utf8_is_read_and_keys_of_valid_names_do_not_move(tmp_path):
    folder = make_docs(tmp_path / "a")
    try:
        (folder / os.fsdecode(b"caf\xe9.txt")).write_text("a document whose name is Latin-1\n")
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    source = parse_source(f"text:{folder}", val_fraction=0.5)
    documents = list(source.iter_documents("train")) + list(source.iter_documents("val"))
    assert len(documents) == MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT + 5
    for key in ("doc001.txt:0", "café.txt:0", "日本.txt:3"):  # the same bucket as a plain UTF-8 hash
        bucket = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big") % 10_000
        assert goes_to_val(key, 0.5) == (bucket < 5_000)


# 7. malformed tokenizer JSON -------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [('{"added_tokens": 5}', "'added_tokens' must be a list"),
                                           ("[" * 100_000 + "]" * 100_000, "nested too deeply")])
def test_a_malformed_tokenizer_json_is_one_error(tmp_path, text, message):
    file = tmp_path / "tokenizer.json"
    file.write_text(text)
    with pytest.raises(DataError, match=message):
        load_tokenizer(str(file))


# 8. glob sources ---------------------------------------------------------------------------------------


def test_a_file_added_in_a_sibling_folder_moves_no_glob_document(tmp_path):
    root = tmp_path / "corpus"
    make_docs(root / "a", count=40)
    spec = f"text:{root}/**/*.txt"

    def val_documents() -> set[str]:
        return set(parse_source(spec, val_fraction=0.5).iter_documents("val"))

    before = val_documents()
    make_docs(root / "b", count=1, tag="new ")
    after = val_documents()
    assert before <= after and len(after - before) <= 1  # only the new document may join val
    assert sources._glob_prefix(Path(f"{root}/**/*.txt")) == root


def test_a_recursive_glob_matches_as_glob_does_but_never_enters_a_symlinked_folder(tmp_path, monkeypatch):
    """`text:DIR/**/*.txt` went through glob, which follows symlinked folders: a link to its own folder
    listed its files again under loop/, loop/loop/, ... (the copies split between train and val), and
    two such links grew the list until the memory ran out (review). It matches what glob matched
    otherwise: `**` any number of folders, hidden names only where the pattern names them."""
    import glob as glob_module

    root = tmp_path / "corpus"
    for name in ("a.txt", "sub/b.txt", "sub/deep/c.txt", "sub/d.md", ".hidden/e.txt", "sub/.f.txt", "g.jsonl"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"document {name}")
    for pattern in ("**/*.txt", "**", "sub/**/*.txt", "*/*.txt", "**/.*.txt", "**/deep/*.txt", "*.txt"):
        want = sorted(p for p in glob_module.glob(f"{root}/{pattern}", recursive=True) if Path(p).is_file())
        got = sorted(str(p) for p in sources._walk_glob(Path(f"{root}/{pattern}"), root) if p.is_file())
        assert got == want, pattern
    monkeypatch.chdir(tmp_path)  # a pattern that starts with its wildcard: paths relative to here
    assert sorted(map(str, sources._walk_glob(Path("**/b.txt"), Path()))) == ["corpus/sub/b.txt"]
    (root / "loop").symlink_to(root)
    (root / "sub" / "up").symlink_to(root)
    source = parse_source(f"text:{root}/**/*.txt")
    assert sorted(p.relative_to(root).as_posix() for p in source.files) == ["a.txt", "sub/b.txt", "sub/deep/c.txt"]


# 9. very long inputs --------------------------------------------------------------------------------


def test_is_small_stops_reading_once_it_has_counted_enough_documents(tmp_path, monkeypatch):
    file = tmp_path / "stories.txt"
    stories = "".join(f"story {i}\n<|endoftext|>\n" for i in range(3 * MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT))
    file.write_bytes(stories.encode() + b"\xff never read")  # what a whole-file read would trip on
    monkeypatch.setattr(sources, "_TEXT_CHUNK_BYTES", 64, raising=False)
    source = parse_source(f"text:{file}")
    assert source.is_small() is False
    with pytest.raises(DataError, match=f"not valid UTF-8 \\(byte 0xff at offset {len(stories)}\\)"):
        list(source.iter_documents("train"))  # the whole file still is read in the end, and refused


def test_a_txt_file_read_in_chunks_gives_the_documents_a_whole_read_gave(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_TEXT_CHUNK_BYTES", 5, raising=False)  # separators cut across chunks
    cases = {"sep": " café <|endoftext|>\n\nb 日本 <|endoftext|><|endoftext|>  c\n", "whole": "  one docé\n\n",
             "blank": " \n ", "edge": "<|endoftext|>x<|endoftext"}
    for name, text in cases.items():
        (tmp_path / f"{name}.txt").write_text(text, encoding="utf-8")
        expected = ([p.strip() for p in text.split("<|endoftext|>") if p.strip()] if "<|endoftext|>" in text
                    else [text] if text.strip() else [])
        assert list(sources._read_documents(tmp_path / f"{name}.txt")) == expected, name


@pytest.fixture(scope="module")
def bpe():
    from latentloop.data import BPETokenizer

    return BPETokenizer.train([" ".join(WORDS * 20)] * 5, 300)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_a_very_long_document_is_tokenized_in_pieces_cut_at_newlines(tmp_path, monkeypatch, bpe, kind):
    from latentloop.data import tokenizers

    tokenizer = ByteTokenizer() if kind == "byte" else bpe
    document = "".join(f"line {i}: " + " ".join(WORDS[i % 5:]) + ("\n\n" if i % 7 == 0 else "\n") for i in range(200))
    threshold = 1000
    monkeypatch.setattr(tokenizers, "LONG_DOCUMENT_CHARS", threshold, raising=False)
    seen: list[str] = []
    whole = type(tokenizer).encode_to_array
    monkeypatch.setattr(type(tokenizer), "encode_to_array", lambda self, text: seen.append(text) or whole(self, text))
    (tmp_path / "doc.txt").write_text(document)
    data = prepare_tokens(parse_source(f"text:{tmp_path / 'doc.txt'}", val_fraction=0.01), tokenizer,
                          tmp_path / "cache", progress=False)
    train_text = document[: len(document) - max(1, round(len(document) * 0.01))]
    assert "".join(seen[:-1]) == train_text and len(seen) > 2  # the train split's pieces, then val's
    assert all(len(piece) <= threshold and piece.endswith("\n") for piece in seen[:-2])
    assert data.train[0] == tokenizer.bos_id
    assert np.array_equal(np.array(data.train[1:]), whole(tokenizer, train_text))  # the ids of the whole text


def test_a_cut_never_falls_beside_whitespace_so_bpe_ids_equal_the_whole_texts(monkeypatch):
    """A cut just after a newline that ends a line with a trailing space (or CRLF's "\\r", or before an
    indented line) split a pre-token (" \\n" is one where the whole text has " " and "\\n"): the ids
    changed for latentloop's own BPE (12-06 review). Cuts fall only between two non-space characters."""
    from latentloop.data import BPETokenizer, tokenizers

    lines = []
    for i in range(400):
        kind = i % 5
        lines.append(f"line {i} ends with a space \n" if kind == 0 else f"windows line {i}\r\n" if kind == 1
                     else f"    indented line {i}\n" if kind == 2 else f"plain line {i}\n" if kind == 3
                     else f"a paragraph ends {i} \n\n")  # " \n" then "\n": BPE learns the " \n" merge
    text = "".join(lines)
    tokenizer = BPETokenizer.train([text], 400)
    monkeypatch.setattr(tokenizers, "LONG_DOCUMENT_CHARS", 300)
    pieces = list(tokenizers.encode_in_pieces(tokenizer, text))
    assert len(pieces) > 5
    np.testing.assert_array_equal(np.concatenate(pieces), tokenizer.encode_to_array(text))


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_a_long_document_of_one_line_is_cut_before_spaces_and_keeps_its_ids(monkeypatch, bpe, kind):
    """A document past the threshold with no newline (a minified file, a dump of words) was tokenized
    whole, needing many times its size in memory."""
    from latentloop.data import tokenizers

    tokenizer = ByteTokenizer() if kind == "byte" else bpe
    text = " ".join(f"{WORDS[i % len(WORDS)]}{i}, {'  ' if i % 9 == 0 else ''}x" for i in range(600))
    monkeypatch.setattr(tokenizers, "LONG_DOCUMENT_CHARS", 300)
    pieces = list(tokenizers.encode_in_pieces(tokenizer, text))
    assert len(pieces) > 10
    np.testing.assert_array_equal(np.concatenate(pieces), tokenizer.encode_to_array(text))
    texts = []
    monkeypatch.setattr(type(tokenizer), "encode_to_array", lambda self, piece: texts.append(piece) or np.zeros(0))
    list(tokenizers.encode_in_pieces(tokenizer, text))
    assert "".join(texts) == text and all(len(piece) <= 300 for piece in texts)
    assert all(piece.startswith(" ") and not piece.startswith("  ") for piece in texts[1:])


def test_a_val_split_no_document_went_to_says_how_to_get_one(tmp_path, monkeypatch):
    """Of a few dozen documents, none may hash to val (0.95^20 = 36% at 20): the refusal named no way
    out (12-07 review)."""
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "a.txt").write_text("<|endoftext|>".join(f"document {i} " * 40 for i in range(
        MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT)))
    monkeypatch.setattr(sources, "goes_to_val", lambda key, fraction: False)  # as the hash fell for them
    with pytest.raises(DataError, match=r"has no text in its val split: .* raise data.val_fraction"):
        prepare_tokens(parse_source(f"text:{corpus}"), ByteTokenizer(), tmp_path / "cache")


def test_a_same_size_text_with_its_old_mtime_restored_is_tokenized_again(tmp_path):
    """`cp -p` / `rsync -a` of another text of the same size keep the old mtime: the cache key was
    (path, size, mtime) and the stale tokens were reused (12-07 review)."""
    corpus = tmp_path / "a.txt"
    corpus.write_text("A" * 5000)
    first = prepare_tokens(parse_source(f"text:{corpus}"), ByteTokenizer(), tmp_path / "cache")
    stat = corpus.stat()
    time.sleep(0.01)  # a change time the filesystem can tell apart
    corpus.write_text("B" * 5000)
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = prepare_tokens(parse_source(f"text:{corpus}"), ByteTokenizer(), tmp_path / "cache")
    assert second.directory != first.directory
    assert set(np.unique(np.asarray(second.train)).tolist()) >= {ord("B")}
    assert ord("A") not in np.asarray(second.train).tolist()


def test_a_jsonl_text_with_a_lone_surrogate_is_named_by_file_and_line(tmp_path, capsys):
    """JSON admits an escape such as \\ud800 that no UTF-8 text holds (web-scraped JSONL has them):
    the text source names the line, where the shard writer and the tokenizer trainer crashed on it."""
    from latentloop.cli import main

    data = tmp_path / "scraped.jsonl"
    data.write_text(json.dumps({"text": "word " * 300}) + "\n" + '{"text": "a\\ud800b"}\n')
    with pytest.raises(DataError, match=r"scraped.jsonl:2: 'text' holds a lone surrogate"):
        list(sources._read_jsonl(data))
    out = tmp_path / "run"
    assert main(["train", "--arch", "gpt", "--preset", "test", "--steps", "1", "--data", f"text:{data}",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "scraped.jsonl:2" in err and "Traceback" not in err and not out.exists()
    assert main(["tokenizer", "train", "--data", f"text:{data}", "--vocab-size", "300",
                 "--out", str(tmp_path / "tok.json")]) == 2
    assert "scraped.jsonl:2" in capsys.readouterr().err


def test_jsonl_lines_end_at_newline_alone_and_a_bad_byte_is_named_on_its_own_line(tmp_path):
    """A text-mode read ended a line at a bare "\\r" (JSON whitespace), so valid rows were refused as
    invalid JSON; and its decoder, reading ahead in blocks, named a line hundreds before the one
    holding a byte that is not UTF-8. A byte-order mark before the first row is passed over."""
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'\xef\xbb\xbf{"text": "a",\r "id": 1}\r\n{"text": "b"}\n')
    assert list(sources.iter_jsonl(rows)) == [(1, {"text": "a", "id": 1}), (2, {"text": "b"})]
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"row {i}"}).encode() for i in range(1, 501)]
    lines[399] = b'{"text": "row \xff"}'
    bad.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=r"bad.jsonl:400: not valid UTF-8 \(byte 0xff at offset 14 of the line\)"):
        list(sources.iter_jsonl(bad))


def test_a_text_folder_skips_hidden_files_and_folders_as_its_glob_does(tmp_path):
    """`text:DIR` read a `.ipynb_checkpoints/` copy beside its original (the glob form `text:DIR/**/*.txt`
    skips it); each copy's documents were split on their own paths, so val documents were trained on."""
    folder = tmp_path / "corpus"
    (folder / ".ipynb_checkpoints").mkdir(parents=True)
    documents = "".join(f"document {i}\n<|endoftext|>\n" for i in range(40))
    (folder / "a.txt").write_text(documents)
    (folder / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text(documents)
    (folder / ".hidden.txt").write_text(documents)
    by_folder, by_glob = parse_source(f"text:{folder}"), parse_source(f"text:{folder}/**/*.txt")
    for split in ("train", "val"):
        assert list(by_folder.iter_documents(split)) == list(by_glob.iter_documents(split))
    val = set(by_folder.iter_documents("val"))
    assert val and not val & set(by_folder.iter_documents("train"))


def test_a_byte_order_mark_before_a_text_files_first_document_is_passed_over(tmp_path):
    """Notepad's UTF-8 writes a byte-order mark first: it was read as the first document's first
    character (trained on, and its tokens in every val figure of that document). Only the file's
    first one is an editor's mark; one inside the text stays."""
    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbffirst document\n<|endoftext|>\nsecond \xef\xbb\xbfdocument\n")
    assert list(sources._read_text(marked)) == ["first document", "second \ufeffdocument"]
    whole = tmp_path / "whole.txt"
    whole.write_bytes(b"\xef\xbb\xbfone document, no separator\n")
    assert list(sources._read_text(whole)) == ["one document, no separator\n"]


def test_a_text_file_with_a_byte_order_mark_is_tokenized_again_and_others_keep_their_cache_key(tmp_path):
    """Shards cached before the mark was passed over hold it as a first character: such a file's source gets
    a key of its own; a folder without one keeps the key it had (no user's cache is rebuilt for nothing)."""
    plain, marked = tmp_path / "plain", tmp_path / "marked"
    plain.mkdir()
    marked.mkdir()
    (plain / "a.txt").write_bytes(b"some text\n")
    (marked / "a.txt").write_bytes(b"\xef\xbb\xbfsome text\n")
    listing = sources._file_listing(plain, sorted(plain.glob("*.txt")))
    unchanged = sources._digest(["text", str(plain.resolve()), 0.05, listing])  # the key's form before 12-07
    assert parse_source(f"text:{plain}", val_fraction=0.05).fingerprint() == unchanged
    listing = sources._file_listing(marked, sorted(marked.glob("*.txt")))
    before = sources._digest(["text", str(marked.resolve()), 0.05, listing])
    assert parse_source(f"text:{marked}", val_fraction=0.05).fingerprint() != before
    notes = tmp_path / "notes.md"  # a file named directly is read as text whatever its suffix: the same
    notes.write_bytes(b"\xef\xbb\xbfsome text\n")
    source = parse_source(f"text:{notes}", val_fraction=0.05)
    before = sources._digest(["text", str(source.root.resolve()), 0.05, sources._file_listing(source.root,
                                                                                              source.files)])
    assert source.fingerprint() != before
