"""Checkpoint rotation and the run's metrics log across a resume."""

import latentloop as ll
from latentloop.checkpoint import list_checkpoints, save_checkpoint
from latentloop.cli import main


def test_rotation_never_removes_the_checkpoint_just_written(tmp_path):
    """The rotation keeps the `keep_last` newest steps: a step saved below them (a run saved over
    another) was the oldest and was deleted as soon as it was written."""
    model = ll.build("gpt", preset="test")
    save_checkpoint(tmp_path, 6, model, trainer_state={}, state={"step": 6}, keep_last=1)
    written = save_checkpoint(tmp_path, 0, model, trainer_state={}, state={"step": 0}, keep_last=1)
    assert written.is_dir() and (written / "model.safetensors").is_file()
    assert written in list_checkpoints(tmp_path)


def test_rotation_and_the_latest_go_by_step_past_eight_digits(tmp_path):
    """Folder names pad steps to 8 digits: sorted by name, step_100000000 came before step_99999900, so
    rotation deleted the newest and kept the oldest, and "the latest" was not."""
    model = ll.build("gpt", preset="test")
    for step in (99_999_900, 100_000_000, 100_000_100):
        save_checkpoint(tmp_path, step, model, trainer_state={}, state={"step": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_100000000", "step_100000100"]


def test_a_resume_drops_a_metrics_row_that_is_json_but_not_utf8(tiny_run_copy, capsys):
    """An encoded surrogate (ED A0 80) is accepted by json.loads of bytes but is not UTF-8: the
    resume ended in UnicodeDecodeError rewriting the log; the row is dropped as a damaged one."""
    run = tiny_run_copy("gpt")
    log = run / "metrics.jsonl"
    good = log.read_text().splitlines()
    with open(log, "ab") as f:
        f.write(b'{"step": 1, "note": "\xed\xa0\x80"}\n')
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-progress"]) == 0
    rows = log.read_text().splitlines()
    assert rows[:len(good)] == good and not any("note" in row for row in rows)
    assert len(rows) > len(good)  # step 3's rows were logged after the kept ones


def test_resuming_a_saved_model_says_it_holds_weights_only(tmp_path, capsys):
    """`runs.save_run` wrote an empty trainer state: `--resume` called its checkpoint damaged ("its
    trainer state is incomplete") where it holds weights only, and can seed a new run."""
    from latentloop.data import ByteTokenizer
    from latentloop.runs import save_run

    save_run(ll.build("gpt", preset="test"), ByteTokenizer(), tmp_path / "saved")
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "saved"), "--resume", "--steps", "8"]) == 2
    err = capsys.readouterr().err
    assert "holds weights only" in err and "--init-from" in err and "incomplete" not in err, err
