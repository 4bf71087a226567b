"""The demo on a tiny budget: every architecture trains, is scored, samples, and the report is written."""

import json

import pytest

from latentloop.archs import ARCHS
from latentloop.cli import main


def test_demo_writes_a_report_for_every_architecture(corpus, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--minutes", "0.1", "--out", str(out), "--data", f"text:{corpus}", "--preset", "test",
                 "--no-progress"]) == 0
    summary = json.loads((out / "demo.json").read_text())
    assert summary["status"] == "done"
    assert {r["arch"] for r in summary["results"]} == set(ARCHS)
    report = (out / "report.md").read_text()
    for arch in ARCHS:
        assert f"## {arch} sample" in report
    assert "| fbt |" in report and "soft" in report and "interleaved" in report
    assert (out / "loss.png").is_file()
    # the folder is the demo's own: running again replaces it, but a stranger's folder is refused
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    capsys.readouterr()
    assert main(["demo", "--minutes", "0.1", "--out", str(tmp_path / "mine"), "--data", f"text:{corpus}"]) == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("minutes", ["0", "-1"])
def test_demo_rejects_a_non_positive_budget(minutes, tmp_path):
    assert main(["demo", "--minutes", minutes, "--out", str(tmp_path / "d")]) == 2


def test_gates_line_lists_every_recurrence_step():
    from latentloop.demo import gates_line

    line = gates_line({"openness_r2": 0.1, "gate_mean_r2": 0.9, "openness_r1": 0.5, "gate_mean_r1": 0.6})
    assert line.index("r=1") < line.index("r=2")
    assert "r=1: mean gate 0.600, effective openness ‖Δh‖/‖o‖ 0.500" in line and "mean gate 0.900" in line
