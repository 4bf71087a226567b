"""`latentloop analyze`: contraction and probe on an fbt run, depth on an rgpt run."""

import importlib.util
import json

import pytest
import torch

from latentloop.analysis import bracket_depth_labels, fit_linear_probe, spearman
from latentloop.cli import main
from latentloop.data import ByteTokenizer

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def code_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("code")
    for i in range(30):
        (folder / f"f{i}.txt").write_text("".join(f"def f{j}(a, (b[{j}], {{c: d}})):\n    return (a)\n"
                                                  for j in range(i, i + 30)))
    return folder


def _train(arch, corpus, out, *extra):
    assert main(["train", "--arch", arch, "--preset", "test", "--data", f"text:{corpus}", "--steps", "3",
                 "--out", str(out), "--set", "batch_size=2", "--set", "sequence_len=32", "--no-progress",
                 *extra]) == 0


def test_contraction_and_probe(code_corpus, tmp_path, capsys):
    _train("fbt", code_corpus, tmp_path / "fbt")
    capsys.readouterr()
    assert main(["analyze", "contraction", str(tmp_path / "fbt"), "--passes", "40", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["loss"]) == 40 and len(result["relative_change"]) == 40
    # the Jacobi iteration is exact after sequence_len (32) passes: from then on nothing moves
    assert max(result["relative_change"][33:]) < 1e-6 < max(result["relative_change"][1:8])
    assert (tmp_path / "fbt" / "analysis" / "contraction.json").is_file()
    assert main(["analyze", "probe", str(tmp_path / "fbt"), "--passes", "3", "--batches", "2", "--json"]) == 0
    probes = json.loads(capsys.readouterr().out)["probes"]
    assert set(probes) == {"standard/block0_in", "standard/block0_out", "recurrent/block0_in",
                           "recurrent/block0_out"}
    assert (tmp_path / "fbt" / "analysis" / "probe.json").is_file()
    if HAVE_MATPLOTLIB:  # plots are optional (the `plot` extra); the analysis runs without them
        assert (tmp_path / "fbt" / "analysis" / "probe.png").is_file()
    assert main(["analyze", "depth", str(tmp_path / "fbt")]) == 2  # wrong architecture: one-line error


def test_depth(code_corpus, tmp_path, capsys):
    _train("rgpt", code_corpus, tmp_path / "rgpt", "--set", "recurrence_steps=3")
    capsys.readouterr()
    assert main(["analyze", "depth", str(tmp_path / "rgpt"), "--max-steps", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == [1, 2, 3, 4] and len(result["gate_mean_per_step"]) == 4
    assert len(result["openness_per_step"]) == 4 and all(v > 0 for v in result["openness_per_step"])
    assert sum(result["exit_depth_histogram"]) > 0


def test_bracket_labels_and_probe_arithmetic():
    tok = ByteTokenizer()
    x = torch.tensor([[tok.bos_id] + tok.encode("a(b[c]d)e")])
    assert bracket_depth_labels(tok, x).tolist() == [[0, 0, 1, 1, 2, 2, 1, 1, 0, 0]]
    torch.manual_seed(0)
    labels = torch.randint(0, 5, (600,))
    separable = torch.nn.functional.one_hot(labels, 5).float() + 0.01 * torch.randn(600, 5)
    assert fit_linear_probe(separable, labels)["test_accuracy"] > 0.95
    assert fit_linear_probe(torch.randn(600, 5), labels)["test_accuracy"] < 0.4
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)


def test_depth_reports_task_accuracy_for_task_runs(tmp_path, capsys):
    assert main(["train", "--arch", "rgpt", "--preset", "test", "--data", "task:addition:digits=2,n=400",
                 "--steps", "2", "--out", str(tmp_path / "run"), "--set", "batch_size=2", "--set", "sequence_len=32",
                 "--set", "recurrence_steps=2", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["analyze", "depth", str(tmp_path / "run"), "--json", "--task-limit", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["task_accuracy"]) == 2 and all(0.0 <= a <= 1.0 for a in result["task_accuracy"])


def test_analysis_without_matplotlib_writes_json_only(code_corpus, tmp_path, capsys, monkeypatch):
    _train("fbt", code_corpus, tmp_path / "fbt")
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if the plot extra were absent
    assert main(["analyze", "contraction", str(tmp_path / "fbt"), "--passes", "3", "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "contraction.json").is_file() and not (tmp_path / "a" / "contraction.png").exists()
