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
