"""The experiment scripts draw through latentloop.util's `pyplot` and `save_figure`: a figure lands
whole (written atomically) and, without matplotlib, the script says which plot it skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))

import cpu_comparison  # noqa: E402

CURVES = {"rgpt": [{"fraction": 0.5, "mean": 0.9, "interval": (0.88, 0.92)},
                   {"fraction": 1.0, "mean": 1.0, "interval": (1.0, 1.0)}]}


def test_early_exit_plot_is_written_whole(tmp_path):
    pytest.importorskip("matplotlib")
    assert cpu_comparison.plot_early_exit(CURVES, tmp_path) == "early_exit.png"
    assert (tmp_path / "early_exit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["early_exit.png"]  # no temporary file left beside it


def test_early_exit_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails, as without the plot extra
    assert cpu_comparison.plot_early_exit(CURVES, tmp_path) is None
    assert "the early-exit plot not drawn" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
