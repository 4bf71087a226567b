"""Tests for latentloop.data: tokenizers, sources, token shards and loaders."""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from latentloop.data import (
    BPETokenizer,
    ByteTokenizer,
    TokenData,
    TokenLoader,
    eval_batches,
    load_tokenizer,
    parse_source,
    prepare_tokens,
    shards,
)
from latentloop.data import sources as data_sources
from latentloop.errors import ConfigError, DataError

SHARED_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "text"

WORDS = ["the", "cat", "sat", "on", "mat", "naïve", "café", "日本語", "über", "(x)", "\n"]


def make_corpus(num_texts: int = 60, words_per_text: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words_per_text)) for _ in range(num_texts)]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(make_corpus(), vocab_size=300)


# --- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo, wörld — 日本語 🙂\n\t"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert tok.encode_batch(["a", "é"]) == [[97], [0xC3, 0xA9]]
    assert tok.encode_to_array(text).tolist() == ids
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    lengths = tok.token_byte_lengths()
    assert lengths.shape == (259,) and lengths.dtype == np.int64
    assert lengths[:256].sum() == 256 and lengths[256:].sum() == 0
    assert tok.decode([0xC3]) == "\ufffd"  # a cut-off character is replaced, not an error


def test_byte_tokenizer_save_and_load(tmp_path):
    path = ByteTokenizer().save(tmp_path)
    assert json.loads(path.read_text()) == {"type": "byte"}
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(load_tokenizer(str(path)), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_bpe_round_trip_save_load_and_byte_lengths(bpe, tmp_path):
    assert 259 <= bpe.vocab_size <= 300
    text = "the naïve cat sat on the café mat 日本語 über\nand something unseen: Ωmega ✓"
    ids = bpe.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned
    assert bpe.decode(ids) == text
    assert bpe.decode([bpe.bos_id, *ids, bpe.eos_id]) == text
    assert int(bpe.token_byte_lengths()[ids].sum()) == len(text.encode("utf-8"))
    assert bpe.token_byte_lengths()[[bpe.bos_id, bpe.eos_id, bpe.pad_id]].sum() == 0
    assert bpe.encode_to_array(text).tolist() == ids
    assert bpe.encode_batch([text, "cat"]) == [ids, bpe.encode("cat")]

    bpe.save(tmp_path)
    for spec in (tmp_path, tmp_path / "tokenizer.json"):
        loaded = load_tokenizer(str(spec))
        assert isinstance(loaded, BPETokenizer)
        assert loaded.encode(text) == ids
        assert loaded.fingerprint() == bpe.fingerprint()
        assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (bpe.bos_id, bpe.eos_id, bpe.pad_id)


def test_bpe_encodes_special_token_text_as_plain_bytes(bpe):
    text = "a <|eos|> b <|bos|>"
    ids = bpe.encode(text)
    assert bpe.eos_id not in ids and bpe.bos_id not in ids
    assert bpe.decode(ids) == text


def test_bpe_errors(tmp_path):
    with pytest.raises(ConfigError):
        BPETokenizer.train(["abc"], vocab_size=200)
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(DataError, match="nope"):
        BPETokenizer.load(missing)
    corrupt = tmp_path / "tokenizer.json"
    corrupt.write_text("{not json")
    with pytest.raises(DataError, match=str(tmp_path)):
        load_tokenizer(str(corrupt))
    corrupt.write_text(json.dumps({"type": "something"}))
    with pytest.raises(DataError, match=str(tmp_path)):
        BPETokenizer.load(tmp_path)
    with pytest.raises(DataError, match="unknown tokenizer 'gpt9'"):
        load_tokenizer("gpt9")
    corrupt.write_text(json.dumps({"type": "byte", "chat": "yes"}))  # was read as a tokenizer without chat tokens
    with pytest.raises(DataError, match="'chat' must be true or false"):
        load_tokenizer(str(corrupt))
    corrupt.write_text(json.dumps({"type": "byte", "chat": True}))
    assert load_tokenizer(str(corrupt)).chat_tokens is not None


# --- sources ----------------------------------------------------------------------------------


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))


def test_single_txt_file_is_split_by_characters(tmp_path):
    text = "".join(f"line {i}: some words here\n" for i in range(200))
    (tmp_path / "one.txt").write_text(text)
    source = parse_source(f"text:{tmp_path / 'one.txt'}", val_fraction=0.1)
    train, val = list(source.iter_documents("train")), list(source.iter_documents("val"))
    assert len(train) == 1 and len(val) == 1
    assert train[0] + val[0] == text
    assert len(val[0]) == round(len(text) * 0.1)


def test_endoftext_split_and_folder_of_txt_and_jsonl(tmp_path):
    stories = [f"story number {i}. " * 3 for i in range(30)]
    (tmp_path / "a.txt").write_text("<|endoftext|>\n".join(stories[:15]) + "<|endoftext|>\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    write_jsonl(sub / "b.jsonl", stories[15:] + ["   "])  # a blank document is dropped
    (tmp_path / "ignored.md").write_text("not a text source file")

    source = parse_source(f"text:{tmp_path}", val_fraction=0.3)
    train = list(source.iter_documents("train"))
    val = list(source.iter_documents("val"))
    # Pieces split on <|endoftext|> are stripped; jsonl texts are kept exactly.
    assert sorted(train + val) == sorted([s.strip() for s in stories[:15]] + stories[15:])
    assert train and val and not set(train) & set(val)
    # Deterministic: a fresh source gives the same split in the same order.
    again = parse_source(f"text:{tmp_path}", val_fraction=0.3)
    assert list(again.iter_documents("train")) == train
    assert list(again.iter_documents("val")) == val


def test_glob_source(tmp_path):
    for i in range(25):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}")
    (tmp_path / "other.jsonl").write_text(json.dumps({"text": "not matched"}) + "\n")
    source = parse_source(f"text:{tmp_path}/doc*.txt", val_fraction=0.2)
    docs = list(source.iter_documents("train")) + list(source.iter_documents("val"))
    assert sorted(docs) == sorted(f"document {i}" for i in range(25))


def test_fingerprint_changes_when_files_change(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello")
    before = parse_source(f"text:{path}").fingerprint()
    assert parse_source(f"text:{path}").fingerprint() == before
    path.write_text("hello, longer")
    assert parse_source(f"text:{path}").fingerprint() != before


def test_stdlib_source_has_both_splits():
    source = parse_source("stdlib", val_fraction=0.05)
    train = list(itertools.islice(source.iter_documents("train"), 3))
    val = list(itertools.islice(source.iter_documents("val"), 3))
    assert len(train) == 3 and len(val) == 3
    assert not set(train) & set(val)
    assert all(isinstance(doc, str) and doc.strip() for doc in train + val)
    assert all("site-packages" not in str(p) for p in source.files())
    assert all("test" not in p.relative_to(source.root).parts for p in source.files())


def test_source_errors_name_the_problem(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(DataError, match="missing.txt"):
        parse_source(f"text:{missing}")
    with pytest.raises(DataError, match="nothing_here"):
        parse_source(f"text:{tmp_path}/nothing_here*.txt")
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    with pytest.raises(DataError, match="empty_dir"):
        parse_source(f"text:{empty_dir}")

    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty.txt"):
        list(parse_source(f"text:{empty}").iter_documents("train"))

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        list(parse_source(f"text:{bad}").iter_documents("train"))
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"no_text\.jsonl:1"):
        list(parse_source(f"text:{no_text}").iter_documents("train"))

    with pytest.raises(DataError, match="unknown data source 'ftp:x'"):
        parse_source("ftp:x")
    if importlib.util.find_spec("latentloop.data.tasks") is None:
        with pytest.raises(DataError, match="task sources are not available"):
            parse_source("task:gsm8k")
    with pytest.raises(ConfigError):
        parse_source("stdlib", val_fraction=1.5)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path):
    if importlib.util.find_spec("pyarrow") is not None:
        pytest.skip("pyarrow is installed")
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError, match="pip install pyarrow"):
        list(parse_source(f"text:{path}").iter_documents("train"))


def test_parquet_source(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}" for i in range(30)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "data.parquet")
    source = parse_source(f"text:{tmp_path}")
    docs = list(source.iter_documents("train")) + list(source.iter_documents("val"))
    assert sorted(docs) == sorted(texts)


def test_hf_source_without_datasets_says_how_to_install(tmp_path):
    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed")
    source = parse_source(f"hf:{tmp_path}")
    with pytest.raises(DataError, match=r"pip install 'latentloop\[hf\]'"):
        list(source.iter_documents("train"))


def test_hf_source_from_local_jsonl_folder(tmp_path):
    pytest.importorskip("datasets")
    texts = [f"hf document {i}" for i in range(200)]
    write_jsonl(tmp_path / "train.jsonl", texts)
    source = parse_source(f"hf:{tmp_path}", val_fraction=0.2, max_documents=100)
    train, val = list(source.iter_documents("train")), list(source.iter_documents("val"))
    assert sorted(train + val) == sorted(texts[:100])
    assert train and val and not set(train) & set(val)


def test_a_local_hf_folder_with_a_row_that_does_not_read_is_one_error(tmp_path):
    """The datasets library reads a local folder's rows as the source iterates: a broken JSON line or a
    non-UTF-8 text file ended `train` in pyarrow's or the codec's traceback (review)."""
    pytest.importorskip("datasets")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.jsonl").write_text('{"text": "hello"}\n{"text": \n')
    with pytest.raises(DataError, match=r"cannot read Hugging Face dataset 'hf:.*broken' at row \d+: \w+"):
        list(parse_source(f"hf:{broken}").iter_documents("train"))
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "a.txt").write_bytes(b"fine\n\xff\xfe not text\n")
    with pytest.raises(DataError, match=r"dataset 'hf:.*binary' at row \d+: UnicodeDecodeError"):
        list(parse_source(f"hf:{binary}").iter_documents("train"))


def test_a_hub_dataset_with_no_network_is_one_line_at_once(monkeypatch):
    """Where the Hub's host cannot be looked up, the source says so before the datasets library's
    retries (about 23 s, printing a line each) begin; behind a proxy the lookup is the proxy's."""
    datasets = pytest.importorskip("datasets")
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)

    def no_such_host(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    loads = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: loads.append(args) or [{"text": "a"}])
    source = parse_source("hf:org/name")
    with pytest.raises(DataError, match=r"'hf:org/name': the Hub's host \S+ cannot be looked up \(Name or service "
                                        r"not known\), .* pass a local copy \(hf:FOLDER or text:PATH\)"):
        list(source.iter_documents("train"))
    assert loads == []
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    list(source.iter_documents("train"))
    assert loads == [("org/name", None)]
    # "Temporary failure in name resolution" is asked again (a blip passes), and said after the last try
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(data_sources.time, "sleep", lambda seconds: None)
    answers = []

    def for_now(host, *args, **kwargs):
        answers.append(host)
        if len(answers) < 3:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return []

    monkeypatch.setattr(socket, "getaddrinfo", for_now)
    list(source.iter_documents("train"))
    assert len(answers) == 3 and len(loads) == 2
    answers.clear()

    def never(host, *args, **kwargs):
        answers.append(host)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", never)
    with pytest.raises(DataError, match=r"\(Temporary failure in name resolution, 3 times\)"):
        list(source.iter_documents("train"))
    assert len(answers) == 3 and len(loads) == 2


def test_hf_spec_parsing():
    source = parse_source("hf:org/name:config")
    assert (source.name, source.config, source.spec) == ("org/name", "config", "hf:org/name:config")


# --- shards -----------------------------------------------------------------------------------


def make_doc_folder(folder: Path, num_docs: int = 40) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    docs = [f"Document {i}: naïve café {'x' * (i % 7)}." for i in range(num_docs)]
    write_jsonl(folder / "docs.jsonl", docs)
    return docs


def split_documents(stream: np.ndarray, bos_id: int) -> list[list[int]]:
    """Cut a packed stream at BOS markers (the stream must start with one)."""
    assert stream[0] == bos_id
    starts = np.flatnonzero(stream == bos_id).tolist() + [len(stream)]
    return [stream[a + 1 : b].tolist() for a, b in zip(starts[:-1], starts[1:])]


@pytest.mark.parametrize("tokenizer_kind", ["byte", "bpe"])
def test_prepare_tokens_packs_documents_and_reuses_cache(tmp_path, monkeypatch, bpe, tokenizer_kind):
    tok = ByteTokenizer() if tokenizer_kind == "byte" else bpe
    make_doc_folder(tmp_path / "corpus")
    source = parse_source(f"text:{tmp_path / 'corpus'}", val_fraction=0.2)
    data = prepare_tokens(source, tok, tmp_path / "cache", progress=False)

    assert isinstance(data, TokenData)
    assert data.train.dtype == np.uint16 and not data.train.flags.writeable
    for split, stream in (("train", data.train), ("val", data.val)):
        expected = list(source.iter_documents(split))
        pieces = split_documents(np.asarray(stream), tok.bos_id)
        assert [tok.decode(p) for p in pieces] == expected
        assert data.meta["tokens"][split] == len(stream)
        assert data.meta["documents"][split] == len(expected)
        assert data.meta["bytes"][split] == sum(len(d.encode()) for d in expected)
    assert sorted(p.name for p in data.directory.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [data.directory.name]

    # A second call must not tokenize again.
    calls = []
    real_build = shards._build
    monkeypatch.setattr(shards, "_build", lambda *a, **k: calls.append(1) or real_build(*a, **k))
    mtime = (data.directory / "train.bin").stat().st_mtime_ns
    again = prepare_tokens(source, tok, tmp_path / "cache", progress=False)
    assert calls == [] and again.directory == data.directory
    assert (data.directory / "train.bin").stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again.train, data.train)

    # Changing the data or the cap makes a new cache entry.
    prepare_tokens(source, tok, tmp_path / "cache", max_bytes=100, progress=False)
    assert calls == [1]


def test_prepare_tokens_max_bytes_caps_each_split(tmp_path):
    (tmp_path / "big.txt").write_text("é" * 5000)  # 10,000 bytes, one document
    source = parse_source(f"text:{tmp_path / 'big.txt'}", val_fraction=0.1)
    data = prepare_tokens(source, ByteTokenizer(), tmp_path / "cache", max_bytes=1001, progress=False)
    assert data.meta["bytes"] == {"train": 1000, "val": 100}  # never cuts a character in half
    assert ByteTokenizer().decode(data.train) == "é" * 500


def test_prepare_tokens_interrupted_run_leaves_no_cache(tmp_path, monkeypatch):
    make_doc_folder(tmp_path / "corpus")
    source = parse_source(f"text:{tmp_path / 'corpus'}")

    def explode(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards, "_write_split", explode)
    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(source, ByteTokenizer(), tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_prepare_tokens_empty_val_split_raises(tmp_path):
    make_doc_folder(tmp_path / "corpus")
    source = parse_source(f"text:{tmp_path / 'corpus'}", val_fraction=0.0)
    with pytest.raises(DataError, match=r"corpus.*val"):
        prepare_tokens(source, ByteTokenizer(), tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_prepare_tokens_empty_file_raises_with_path(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    source = parse_source(f"text:{tmp_path / 'empty.txt'}")
    with pytest.raises(DataError, match="empty.txt"):
        prepare_tokens(source, ByteTokenizer(), tmp_path / "cache", progress=False)


def test_prepare_tokens_on_shared_shakespeare(tmp_path):
    path = SHARED_TEXT / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.skip("../shared/data is not available")
    source = parse_source(f"text:{path}")
    data = prepare_tokens(source, ByteTokenizer(), tmp_path, max_bytes=50_000, progress=False)
    assert data.meta["tokens"] == {"train": 50_001, "val": 2_501}
    assert ByteTokenizer().decode(data.train[1:40]).startswith("First Citizen")


# --- loaders ----------------------------------------------------------------------------------


def test_token_loader_batches_are_shifted_windows():
    tokens = np.arange(1000, dtype=np.uint16)
    loader = TokenLoader(tokens, batch_size=4, seq_len=10, seed=0)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 10) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.all(x[:, 0] % 10 == 0)  # windows start at multiples of seq_len


def test_token_loader_epoch_visits_every_window_once():
    tokens = np.arange(101, dtype=np.uint16)  # exactly 10 windows of 11 tokens
    loader = TokenLoader(tokens, batch_size=3, seq_len=10, seed=1)
    starts = torch.cat([loader.next_batch()[0][:, 0] for _ in range(4)]).tolist()
    assert sorted(starts[:10]) == list(range(0, 100, 10))  # first epoch: a permutation
    assert starts[:10] != list(range(0, 100, 10))  # ...that is shuffled
    assert loader.epoch == 1 and loader.index == 2  # the 4th batch ran into epoch 1

    ordered = TokenLoader(tokens, batch_size=3, seq_len=10, seed=1, shuffle=False)
    assert ordered.next_batch()[0][:, 0].tolist() == [0, 10, 20]


def test_token_loader_resume_is_exact():
    tokens = np.random.default_rng(0).integers(0, 259, size=500).astype(np.uint16)
    loader = TokenLoader(tokens, batch_size=4, seq_len=16, seed=7)
    for _ in range(3):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [loader.next_batch() for _ in range(8)]  # crosses an epoch boundary (31 windows)

    resumed = TokenLoader(tokens, batch_size=4, seq_len=16, seed=999)
    resumed.load_state_dict(state)
    for x_expected, y_expected in expected:
        x, y = resumed.next_batch()
        assert torch.equal(x, x_expected) and torch.equal(y, y_expected)

    with pytest.raises(ConfigError, match="seq_len"):
        TokenLoader(tokens, batch_size=4, seq_len=8, seed=7).load_state_dict(state)


def test_token_loader_too_little_data():
    with pytest.raises(DataError, match="data has 10 tokens; need at least seq_len\\+1 = 11"):
        TokenLoader(np.zeros(10, dtype=np.uint16), batch_size=1, seq_len=10, seed=0)
    with pytest.raises(DataError):
        eval_batches(np.zeros(5, dtype=np.uint16), batch_size=1, seq_len=10)


def test_eval_batches_are_ordered_with_partial_last_batch():
    tokens = np.arange(71, dtype=np.uint16)  # 7 windows of seq_len 10
    batches = list(eval_batches(tokens, batch_size=3, seq_len=10))
    assert [x.shape[0] for x, _ in batches] == [3, 3, 1]
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert starts == list(range(0, 70, 10))
    x, y = batches[-1]
    assert torch.equal(y, x + 1)
    assert len(list(eval_batches(tokens, batch_size=3, seq_len=10, max_batches=2))) == 2


def test_token_to_bytes_rebuilds_the_utf8_stream(tmp_path):
    text = "naïve café, 日本語 and emoji 🙂 " * 20
    byte = ByteTokenizer()
    assert b"".join(byte.token_to_bytes(t) for t in byte.encode(text)) == text.encode()
    assert byte.token_to_bytes(byte.bos_id) == b""
    bpe = BPETokenizer.train([text, "plain ascii words " * 50], vocab_size=300)
    ids = bpe.encode(text)
    assert b"".join(bpe.token_to_bytes(t) for t in ids) == text.encode()
    assert sum(len(bpe.token_to_bytes(t)) for t in ids) == int(bpe.token_byte_lengths()[ids].sum())


def test_a_mix_interleaves_its_parts_balanced_by_bytes(tmp_path):
    (tmp_path / "long").mkdir()
    (tmp_path / "short").mkdir()
    for i in range(30):
        (tmp_path / "long" / f"l{i:02d}.txt").write_text("L" * 100)
        (tmp_path / "short" / f"s{i:02d}.txt").write_text("s" * 10)
    mix = parse_source(f"mix:text:{tmp_path / 'long'}+text:{tmp_path / 'short'}", val_fraction=0.2)
    parts = [parse_source(f"text:{tmp_path / name}", val_fraction=0.2) for name in ("long", "short")]
    for split in ("train", "val"):
        documents = list(mix.iter_documents(split))
        # every document of both parts, each part's own split, in each part's order
        assert sorted(documents) == sorted(d for p in parts for d in p.iter_documents(split))
        assert [d for d in documents if d[0] == "L"] == list(parts[0].iter_documents(split))
    head = list(mix.iter_documents("train"))[:22]
    assert [d[0] for d in head].count("s") == 20  # ten short ones per long one while both last
    assert mix.fingerprint() != parse_source(f"mix:text:{tmp_path / 'short'}+text:{tmp_path / 'long'}").fingerprint()
    for bad in ("mix:stdlib", "mix:stdlib+", "mix:stdlib+mix:stdlib+stdlib", "mix:stdlib+nope"):
        with pytest.raises(DataError):
            parse_source(bad)


def test_spread_eval_batches_sample_windows_from_the_whole_split():
    tokens = np.arange(101, dtype=np.uint16)  # 10 windows of 10 (+1 target token)
    first = [int(x[0, 0]) for x, _ in eval_batches(tokens, batch_size=2, seq_len=10, max_batches=2)]
    spread = [x[:, 0].tolist() for x, _ in eval_batches(tokens, batch_size=2, seq_len=10, max_batches=2, spread=True)]
    assert first == [0, 20]  # stream order: the first four windows
    assert spread == [[0, 30], [60, 90]]  # four windows spaced over all ten, the last one included
    whole = [x[:, 0].tolist() for x, _ in eval_batches(tokens, batch_size=4, seq_len=10, spread=True)]
    assert sum(whole, []) == list(range(0, 100, 10))  # nothing left out: every window, in order
