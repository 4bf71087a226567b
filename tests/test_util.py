"""The leaf helpers in `latentloop.util`, each against what it promises."""

import json

import pytest

from latentloop.data.tokenizers import ByteTokenizer
from latentloop.errors import OutputError
from latentloop.util import TokenText, first_line, is_int, read_json_object, write_json_atomic


def test_token_text_holds_a_character_split_across_tokens_until_it_is_whole():
    tokenizer = ByteTokenizer()  # one token per byte: "é" is two tokens, "😀" four
    stream = TokenText(tokenizer)
    pieces = [stream.add(byte) for byte in "aé😀".encode()]
    assert pieces == ["a", "", "é", "", "", "", "😀"]
    assert stream.finish() == ""
    cut = TokenText(tokenizer)
    assert cut.add("é".encode()[0]) == "" and cut.finish() == "\ufffd"  # an unfinished character, replaced
    # a byte that begins a character ends the open one (replaced, the earlier token's); a continuation
    # byte that cannot continue it is the decoder's to replace, this token's
    split = TokenText(tokenizer)
    assert [split.add_split(byte) for byte in (0xC3, ord("x"), 0xC3, 0xA9, 0xE2, 0x82)] == \
        [("", ""), ("\ufffd", "x"), ("", ""), ("", "é"), ("", ""), ("", "")]
    assert split.finish() == "\ufffd"
    joined = TokenText(tokenizer)
    assert [joined.add(byte) for byte in b"\xe2(a"] == ["", "\ufffd(", "a"]  # `add` joins the two


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


def test_evaluating_puts_every_module_in_eval_mode_and_restores_each_flag():
    """Inside the block every submodule is in eval mode; after it (also after an error) exactly the
    submodules that were training train again: `model.train(was_training)` would have set the frozen
    one to training too. A model already in eval mode stays untouched."""
    from torch import nn

    from latentloop.util import evaluating

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5), nn.Linear(2, 2)))
    model[1][0].eval()  # one submodule frozen in eval mode while the rest trains
    before = [m.training for m in model.modules()]
    with pytest.raises(RuntimeError), evaluating(model):
        assert not any(m.training for m in model.modules())
        raise RuntimeError("inside")
    assert [m.training for m in model.modules()] == before
    model.eval()
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert not any(m.training for m in model.modules())


def test_a_decode_beside_a_paused_stream_runs_in_eval_mode_after_train():
    """A stream the caller paused holds its block open; `.train()` then, and every later `generate`
    reused the open block and decoded with training's noise (rfbt's greedy tokens moved, 12-07
    review). The next block puts the model in eval mode again; the last to end leaves it training."""
    import torch

    import latentloop

    torch.manual_seed(0)
    model = latentloop.build("rfbt", preset="test").eval()
    prompt = [model.config.bos_id, *b"hi"]
    alone = latentloop.generate(model, prompt, 10, temperature=0.0, compile=False)
    paused = latentloop.stream(model, prompt, 10, temperature=0.0, compile=False)
    first = next(paused).tokens[0]
    model.train()
    for _ in range(2):
        assert latentloop.generate(model, prompt, 10, temperature=0.0, compile=False) == alone
        assert model.training and all(m.training for m in model.modules())  # given back as it was found
    # the paused stream, resumed, decodes in eval mode too; the model trains again once it ends
    assert [first, *(step.tokens[0] for step in paused)] == alone
    assert model.training and all(m.training for m in model.modules())


def test_a_generation_leaves_a_training_model_training():
    """`generate` decodes in eval mode (no training noise) and gives the model back as it found it."""
    import torch

    import latentloop

    model = latentloop.build("rgpt", preset=None, n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_id=1,
                             sequence_len=32, n_pre=1, n_rec=1, n_coda=1, recurrence_steps=2)
    model.train()
    seen = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    latentloop.generate(model, [1, 2, 3], 2, temperature=0.0, compile=False)
    assert seen and not any(seen) and model.training and all(m.training for m in model.modules())


@pytest.mark.parametrize("content", [None, b"\xff\xfe", b'{"step": ', b"[" * 100_000 + b"]" * 100_000, b"[1, 2]",
                                     b'"text"'], ids=["missing", "not-utf8", "cut-short", "nested-deep", "a-list",
                                                      "a-string"])
def test_read_json_object_does_without_a_file_that_does_not_read_as_an_object(content, tmp_path):
    """The lenient readers of a checkpoint's state.json (a step, a base, a data source, a card's facts)
    each caught their own exceptions; some let JSON nested past the parser's recursion through as a
    traceback (RecursionError is no ValueError), some a list (its `.get` an AttributeError)."""
    path = tmp_path / "state.json"
    if content is not None:
        path.write_bytes(content)
    assert read_json_object(path) == {}
    path.write_text('{"step": 3}')
    assert read_json_object(path) == {"step": 3}


def test_a_checkpoints_step_reads_from_its_name_when_its_state_nests_too_deep(tmp_path):
    """`latentloop eval`'s step of a checkpoint: a state.json nested 100,000 deep was a RecursionError."""
    from latentloop.cli.scoring import _checkpoint_step

    checkpoint = tmp_path / "step_00000007"
    checkpoint.mkdir()
    (checkpoint / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    assert _checkpoint_step(checkpoint) == 7


def test_compare_reads_an_older_checkpoints_data_when_the_newest_state_nests_too_deep(tmp_path):
    """`compare`'s reader of the data a run trained on caught ValueError only: a state.json nested
    100,000 deep was a RecursionError; it now goes on to the older checkpoint, as for any unreadable one."""
    from latentloop.config import RunConfig
    from latentloop.eval.compare import _recorded_data

    newest, older = (tmp_path / "checkpoints" / f"step_{step:08d}" for step in (20, 10))
    for folder in (newest, older):
        folder.mkdir(parents=True)
    (newest / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    (older / "state.json").write_text(json.dumps({"data": {"train": "abc"}, "data_source": "text:/x"}))
    found = _recorded_data(tmp_path, RunConfig())
    assert found["sha256"] == {"train": "abc"} and found["source"] == "text:/x"


def test_a_figure_is_saved_whole_or_not_at_all_and_a_missing_matplotlib_is_said(tmp_path, monkeypatch, capsys):
    """`save_figure` replaces the file only once the new one is written (a reader never sees half a
    PNG; a failed save leaves the old one and no temporary file); `pyplot(what)` without matplotlib
    says on stderr what was not drawn and which extra draws it (analyze's plots were skipped silently)."""
    import sys

    pytest.importorskip("matplotlib")
    from latentloop.util import pyplot, save_figure

    plt = pyplot()
    path = tmp_path / "plot.png"
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    save_figure(fig, path, dpi=50)
    old = path.read_bytes()
    assert old.startswith(b"\x89PNG")
    fig, _ = plt.subplots()
    monkeypatch.setattr(fig, "savefig", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("disk gone")))
    with pytest.raises(RuntimeError, match="disk gone"):
        save_figure(fig, path, dpi=50)
    assert path.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert pyplot("depth.png") is None
    err = capsys.readouterr().err
    assert "depth.png not drawn" in err and "latentloop[plot]" in err
    assert pyplot() is None and capsys.readouterr().err == ""
