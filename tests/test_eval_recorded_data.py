"""`latentloop eval RUN` without --data on a run trained on `text:PATH`: it reads the file the run
recorded (absolute, so from any folder) when that is on this machine and still holds the tokens
training recorded, says which file it read, and refuses with one line otherwise."""

from __future__ import annotations

import json

from latentloop.cli import main


def _train(corpus, run, monkeypatch):
    """A `test` run trained on `text:corpus` given as a path relative to the folder it ran in."""
    monkeypatch.chdir(corpus.parent)
    assert main(["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus.name}", "--steps", "1",
                 "--batch-size", "2", "--out", str(run), "--no-progress", "--set", "eval_batches=1"]) == 0


def test_eval_reads_the_recorded_text_source_and_says_which(corpus, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _train(corpus, run, monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the relative path in config.json means nothing here
    capsys.readouterr()
    assert main(["eval", str(run), "--json", "--batches", "1"]) == 0
    captured = capsys.readouterr()
    assert f"evaluating on text:{corpus} (the data this run was trained on, as recorded)" in captured.err
    read_back = json.loads(captured.out)
    assert main(["eval", str(run), "--json", "--batches", "1", "--data", f"text:{corpus}"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == read_back["loss"]  # the same tokens as naming it
    # an int8 model's figures say so (they could not be told from the float32 model's)
    assert read_back["quantize"] is None
    assert main(["eval", str(run), "--json", "--batches", "1", "--quantize", "int8"]) == 0
    assert json.loads(capsys.readouterr().out)["quantize"] == "int8"
    assert main(["eval", str(run), "--batches", "1", "--quantize", "int8", "--no-progress"]) == 0
    assert "quantize: int8" in capsys.readouterr().out


def test_eval_refuses_a_recorded_source_that_is_gone_or_changed(corpus, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _train(corpus, run, monkeypatch)
    capsys.readouterr()
    (corpus / "doc00.txt").write_text("another text altogether\n")  # the file is here but not what was trained on
    assert main(["eval", str(run), "--batches", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"latentloop: error: {corpus} is not the data this run was trained on (its tokens differ from "
                   f"the checksums the run recorded); name the data to evaluate on with --data"]
    corpus.rename(tmp_path / "moved")  # a run folder from another machine
    assert main(["eval", str(run), "--batches", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"latentloop: error: this run was trained on 'text:{corpus}', which is not on this machine; "
                   f"name the data to evaluate on with --data"]
