"""Bad input refused in one line (exit 2) before anything is written: data the demo cannot train on,
runs compare cannot read, a non-finite analysis option, a resume's --init-from of another run, a folder given as
--config. Each was accepted, or refused only after an earlier result had been removed or an empty
output folder made."""

import json
from pathlib import Path

import pytest

from latentloop.cli import main


def _contents(folder: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `folder`."""
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def _one_error_line(err: str) -> str:
    assert err.startswith("latentloop: error: ") and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("data", ["empty", "not-utf8", "too-small", "task:s5:n=1"])
def test_demo_on_data_it_cannot_train_on_keeps_the_previous_demo(data, tmp_path, capsys):
    """Only the --data spec was parsed before the folder was emptied: an empty file, a file that is
    not UTF-8, or data too small for one validation window was refused by the first arch's setup,
    after the previous demo's report and runs had been removed."""
    files = {"empty": b"", "not-utf8": b"\xff\xfe story \xff\n", "too-small": b"hello world\n"}
    if data in files:
        (tmp_path / "data.txt").write_bytes(files[data])
        data = f"text:{tmp_path / 'data.txt'}"
    out = tmp_path / "demo"
    (out / "gpt").mkdir(parents=True)
    (out / "demo.json").write_text(json.dumps({"status": "done", "results": []}) + "\n")
    (out / "report.md").write_text("# latentloop demo\n")
    (out / "gpt" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    previous = _contents(out)
    capsys.readouterr()
    assert main(["demo", "--steps", "2", "--preset", "test", "--archs", "gpt", "--data", data, "--out", str(out),
                 "--no-progress"]) == 2
    _one_error_line(capsys.readouterr().err)
    assert _contents(out) == previous


@pytest.mark.parametrize("mistake", ["missing-run", "baseline", "list-config", "corrupt-config"])
def test_compare_refusing_its_runs_creates_no_output_folder(mistake, tiny_run, tmp_path, capsys):
    """--out was created before the runs and the baseline were read: every refusal left an empty folder."""
    bad = tmp_path / "bad-run"
    bad.mkdir()
    if mistake == "list-config":
        (bad / "config.json").write_text("[1, 2]\n")
    elif mistake == "corrupt-config":
        (bad / "config.json").write_text('{"model": {')
    runs = [str(tiny_run("gpt"))]
    flags = ["--baseline", "no-such-run"] if mistake == "baseline" else []
    if mistake != "baseline":
        runs.append(str(tmp_path / "nothere") if mistake == "missing-run" else str(bad))
    out = tmp_path / "cmp"
    capsys.readouterr()
    assert main(["compare", *runs, *flags, "--out", str(out), "--no-progress"]) == 2
    _one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_compare_names_an_out_that_is_a_file(tiny_run, tmp_path):
    """compare_runs made its folder with a bare mkdir: a file in the way was a FileExistsError."""
    from latentloop.errors import OutputError
    from latentloop.eval.compare import compare_runs

    (tmp_path / "cmp").write_text("mine")
    with pytest.raises(OutputError, match="is a file"):
        compare_runs([tiny_run("gpt")], tmp_path / "cmp")
    assert (tmp_path / "cmp").read_text() == "mine"


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_analysis_options_refuse_a_non_finite_number(value, tmp_path, capsys):
    """`nan < minimum` is False: `analyze depth --exit-threshold nan` (or inf) ran and recorded null."""
    with pytest.raises(SystemExit) as stopped:
        main(["analyze", "depth", str(tmp_path / "run"), "--exit-threshold", value, "--no-progress"])
    assert stopped.value.code == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "--exit-threshold" in err and "finite" in err and repr(value) in err


@pytest.mark.parametrize("argv, flag, most", [(["contraction", "--passes", "1000000"], "--passes", 4096),
                                              (["probe", "--passes", "5000"], "--passes", 4096),
                                              (["depth", "--max-steps", "1000000"], "--max-steps", 256),
                                              (["depth", "--min-steps", "257"], "--min-steps", 256)])
def test_analysis_options_refuse_work_past_decodings_bounds(argv, flag, most, tmp_path, capsys):
    """`analyze contraction --passes 1000000` ran for an hour and more, `depth --max-steps 1000000`
    scored every depth to a million; decoding's own options stop at the same bounds."""
    with pytest.raises(SystemExit) as stopped:
        main(["analyze", argv[0], str(tmp_path / "run"), *argv[1:], "--no-progress"])
    assert stopped.value.code == 2
    err = _one_error_line(capsys.readouterr().err)
    assert flag in err and f"expected at most {most}" in err


def test_a_resume_refuses_an_init_from_it_did_not_start_from(tiny_run, tiny_run_copy, capsys):
    """The --init-from weights were loaded, then overwritten by the resumed checkpoint: the run said
    "initialised from ..." and trained as a plain resume. Another run than the one it started from is
    refused now, with nothing written."""
    out = tiny_run_copy("gpt")
    before = _contents(out)
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--init-from", str(tiny_run("gpt")),
                 "--no-progress"]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "cannot resume" in err and "--init-from" in err and "started from fresh weights" in err
    assert _contents(out) == before


def test_a_resume_accepts_the_init_from_it_started_from_and_loads_only_its_checkpoint(tiny_run, corpus, tmp_path,
                                                                                      capsys, monkeypatch):
    """The run's own command with --resume added (an SFT or extend run names its base run) goes on from
    its checkpoint, initialising nothing and saying nothing of it."""
    base = tiny_run("gpt")
    argv = ["train", "--init-from", str(base), "--data", f"text:{corpus}", "--batch-size", "2", "--set",
            "eval_every=0", "--out", str(tmp_path / "run"), "--no-progress"]
    assert main([*argv, "--steps", "2"]) == 0
    assert "initialised from" in capsys.readouterr().err
    assert main([*argv, "--steps", "3", "--resume"]) == 0
    assert "initialised from" not in capsys.readouterr().err
    # the base named by one of its checkpoints, and by a relative path, is the same base
    checkpoint = sorted((base / "checkpoints").iterdir())[-1]
    monkeypatch.chdir(checkpoint.parent)
    named = [*argv[:2], checkpoint.name, *argv[3:]]
    assert main([*named, "--steps", "4", "--resume"]) == 0
    state = json.loads(sorted((tmp_path / "run" / "checkpoints").iterdir())[-1].joinpath("state.json").read_text())
    assert state["step"] == 4 and state["init_from"] == str(base.resolve())
    # a newest state.json that does not read is the resume's to handle (it goes on from an older
    # checkpoint), not a reason to call the base another run
    sorted((tmp_path / "run" / "checkpoints").iterdir())[-1].joinpath("state.json").write_text("{")
    assert main([*named, "--steps", "5", "--resume"]) == 0, capsys.readouterr().err


def test_a_config_that_is_a_folder_is_named_a_folder(tmp_path, capsys):
    """`--config FOLDER` said "config file not found" of a path that is there."""
    (tmp_path / "configs").mkdir()
    assert main(["train", "--config", str(tmp_path / "configs"), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "is a folder" in err and "not found" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [
    ["train", "--arch", "gpt", "--preset", "test", "--out", ""],
    ["train", "--arch", "gpt", "--preset", "test", "--tokenizer", " ", "--out", "run"],
    ["import-hf", "some/model", "--out", ""],
    ["import-hf", "", "--out", "run"],  # it said ". holds no config.json"
    ["export", "run", "--out", ""],
    ["demo", "--out", ""],
    ["compare", "run", "--out", ""],
])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(argv, tmp_path, monkeypatch, capsys):
    """`--out ""` (an unset shell variable) said ". exists and is not empty", and `--tokenizer ""` "no
    tokenizer.json in directory .": an empty path is a usage error naming the flag."""
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's refusals exit from inside the parser
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "expected a path, got an empty one" in err, err
    assert "--out" in err or "--tokenizer" in err or "PATH" in err
    assert list(tmp_path.iterdir()) == []
