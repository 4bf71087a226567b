"""The demo at a tiny step count (the same code as `make demo`'s): every architecture trains for the
given steps, is scored, samples, and the report is written with a full loss curve per arch."""

import json

import pytest

from latentloop.archs import ARCHS
from latentloop.cli import main
from latentloop.demo import CAVEAT

CURVE_STEPS = 20  # with the demo's CURVE_POINTS = 24, every step is logged: 20 points
FAST_STEPS = 2  # the default suite's run: the same code, two steps per arch


def test_demo_writes_a_report_for_every_architecture(corpus, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--steps", str(FAST_STEPS), "--out", str(out), "--data", f"text:{corpus}", "--preset",
                 "test", "--no-progress"]) == 0
    summary = json.loads((out / "demo.json").read_text())
    assert summary["status"] == "done"
    assert {r["arch"] for r in summary["results"]} == set(ARCHS)
    assert all(r["step"] == FAST_STEPS for r in summary["results"])  # steps, not seconds: every arch the same
    report = (out / "report.md").read_text()
    for arch in ARCHS:
        assert f"## {arch} sample" in report
    assert "| fbt |" in report and "soft" in report and "interleaved" in report
    assert CAVEAT in report and f"{FAST_STEPS} steps of" in report
    assert (out / "loss.png").is_file()
    # the folder is the demo's own: running again replaces it, but a stranger's folder is refused
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    capsys.readouterr()
    assert main(["demo", "--steps", "1", "--out", str(tmp_path / "mine"), "--data", f"text:{corpus}"]) == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_demo_rejects_a_step_count_that_is_not_a_positive_integer(steps, tmp_path, capsys):
    assert main(["demo", "--steps", steps, "--out", str(tmp_path / "d")]) == 2
    assert "--steps must be a whole number >= 1" in capsys.readouterr().err


def test_gates_line_lists_every_recurrence_step():
    from latentloop.archs.rgpt import gates_line

    line = gates_line({"openness_r2": 0.1, "gate_mean_r2": 0.9, "openness_r1": 0.5, "gate_mean_r1": 0.6})
    assert line.index("r=1") < line.index("r=2")
    assert "r=1: mean gate 0.600, effective openness ‖Δh‖/‖o‖ 0.500" in line and "mean gate 0.900" in line


@pytest.mark.slow  # five architectures for 20 steps each: about two minutes on 2 busy cores
def test_every_loss_curve_has_at_least_20_points(corpus, tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--steps", str(CURVE_STEPS), "--out", str(out), "--data", f"text:{corpus}", "--preset",
                 "test", "--no-progress"]) == 0
    for arch in ARCHS:
        rows = [json.loads(line) for line in (out / arch / "metrics.jsonl").read_text().splitlines()]
        assert sum("loss" in row for row in rows) >= 20, arch


def test_a_ctrl_c_in_an_archs_final_validation_stops_the_demo(corpus, tmp_path, monkeypatch):
    """fit honours it by skipping the validation and saving; the demo went on to the next arch and
    ended, after all the training, in a KeyError on the missing val loss (no report)."""
    import os
    import signal

    from latentloop.demo import run_demo
    from latentloop.train import loop

    validate = loop.validate

    def pressed(state, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return validate(state, *args, **kwargs)
    monkeypatch.setattr(loop, "validate", pressed)
    with pytest.raises(KeyboardInterrupt):
        run_demo(tmp_path / "demo", archs=["gpt", "fbt"], steps=FAST_STEPS, preset="test", data=f"text:{corpus}",
                 progress=False)
    assert not (tmp_path / "demo" / "fbt").exists()  # stopped at the first arch, whose run is saved
    assert any((tmp_path / "demo" / "gpt" / "checkpoints").iterdir())
    # the marker says so (it said "running" forever after, the earlier demo already gone)
    assert json.loads((tmp_path / "demo" / "demo.json").read_text()) == {
        "status": "interrupted", "archs": ["gpt", "fbt"], "finished": []}


@pytest.mark.parametrize("mistake", [["--preset", "bogus"], ["--data", "text:{tmp}/nothere.txt"],
                                     ["--data", "task:bogus"]], ids=["preset", "text-file", "task"])
def test_a_mistyped_option_leaves_the_previous_demo_as_it_was(mistake, corpus, tmp_path, capsys):
    """The folder was emptied for the new demo before the first arch's config and data were read:
    a mistyped --preset or --data exited 2 and left a demo.json saying "running" and nothing else."""
    out = tmp_path / "demo"
    (out / "gpt").mkdir(parents=True)
    previous = {"demo.json": json.dumps({"status": "done", "results": []}) + "\n", "report.md": "# latentloop demo\n",
                "gpt/metrics.jsonl": '{"step": 1, "loss": 5.0}\n'}
    for name, text in previous.items():
        (out / name).write_text(text)
    capsys.readouterr()
    argv = ["demo", "--steps", "3", "--archs", "gpt", "--preset", "test", "--data", f"text:{corpus}", "--out", str(out),
            "--no-progress", *(word.format(tmp=tmp_path) for word in mistake)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("latentloop: error: ") and len(err.strip().splitlines()) == 1, err
    assert {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*") if p.is_file()} == previous


@pytest.mark.parametrize("archs, words", [("gpt,gpt", "--archs names gpt more than once"),
                                          ("", "--archs names no arch"), (" , ", "--archs names no arch")])
def test_archs_named_twice_or_none_are_refused_before_anything_trains(archs, words, corpus, tmp_path, capsys):
    """`--archs gpt,gpt` trained the first, then failed on its folder with advice it cannot take
    (`--resume`); `--archs ""` ran every arch."""
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "3", "--archs", archs, "--preset", "test", "--data", f"text:{corpus}",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"latentloop: error: {words}" or (words in err and len(err.splitlines()) == 1), err
    assert not out.exists()


def test_a_file_of_the_users_own_in_an_earlier_demos_folder_is_not_deleted(corpus, tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "demo.json").write_text(json.dumps({"status": "done", "results": []}) + "\n")
    (out / "notes.txt").write_text("precious")
    assert main(["demo", "--steps", "3", "--archs", "gpt", "--preset", "test", "--data", f"text:{corpus}",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds notes.txt, which the demo did not write" in err and len(err.strip().splitlines()) == 1
    assert (out / "notes.txt").read_text() == "precious"


def test_the_report_describes_its_brackets_only_when_a_row_has_them(tmp_path, monkeypatch):
    """The report said "in brackets, the 95% bootstrap interval ..." under every table, also under the
    default demo's, whose 18 validation documents are too few for any interval."""
    import numpy as np

    from latentloop import demo
    from latentloop.eval.loss import MIN_INTERVAL_DOCUMENTS, document_intervals

    def result(documents: int) -> dict:
        rng = np.random.default_rng(documents)
        tokens = rng.integers(100, 200, documents).astype(float)
        per_token = rng.uniform(1.5, 2.5, documents)  # each document's own loss: an interval of some width
        sums = {"tokens": tokens, "bytes": 2 * tokens, "nats": per_token * tokens, "nats_bpb": per_token * tokens}
        scores = {"loss": 2.0, "bpb": 1.4, **document_intervals(sums)}
        return {"arch": "gpt", "params": 1000, "step": 1, "tokens": 2048, "elapsed": 1.0, "val_loss": 2.0,
                "by_option": {"plain": scores}, "sample": "def ", "history": []}

    monkeypatch.setattr(demo, "_plot", lambda out, results: None)  # no figure needed
    few = MIN_INTERVAL_DOCUMENTS - 2
    demo._write_report(tmp_path, [result(few)], "stdlib", "tiny", 1, 1.0)
    report = (tmp_path / "report.md").read_text()
    assert "in brackets" not in report
    assert f"no interval of BPB: {few} documents: too few for an interval" in report
    demo._write_report(tmp_path, [result(MIN_INTERVAL_DOCUMENTS)], "stdlib", "tiny", 1, 1.0)
    report = (tmp_path / "report.md").read_text()
    assert "in brackets, the 95% bootstrap interval of BPB over the documents they cover._" in report
    assert "no interval" not in report
