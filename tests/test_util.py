"""The leaf helpers in `latentloop.util`, each against what it promises."""

import json

import pytest

from latentloop.data.tokenizers import ByteTokenizer
from latentloop.errors import OutputError
from latentloop.util import TokenText, first_line, is_int, write_json_atomic


def test_token_text_holds_a_character_split_across_tokens_until_it_is_whole():
    tokenizer = ByteTokenizer()  # one token per byte: "é" is two tokens, "😀" four
    stream = TokenText(tokenizer)
    pieces = [stream.add(byte) for byte in "aé😀".encode()]
    assert pieces == ["a", "", "é", "", "", "", "😀"]
    assert stream.finish() == ""
    cut = TokenText(tokenizer)
    assert cut.add("é".encode()[0]) == "" and cut.finish() == "\ufffd"  # an unfinished character, replaced


def test_first_line_and_is_int():
    assert first_line(ValueError("one\ntwo")) == "one" and first_line(KeyError()) == "KeyError"
    assert [is_int(v) for v in (3, -2**80, True, 3.0, "3")] == [True, True, False, False, False]


def test_write_json_atomic_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "sub" / "a.json"
    write_json_atomic(target, {"x": 1})
    write_json_atomic(target, {"x": 2})
    assert json.loads(target.read_text()) == {"x": 2}
    class Unwritable:
        def __str__(self):  # the writer's fallback for values JSON has no type for
            raise RuntimeError("no text")

    with pytest.raises(RuntimeError):  # failing half-way: the old file stays, no temporary left
        write_json_atomic(target, {"x": Unwritable()})
    assert json.loads(target.read_text()) == {"x": 2} and [p.name for p in target.parent.iterdir()] == ["a.json"]
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="cannot write"):
        write_json_atomic(tmp_path / "file" / "b.json", {})
