"""`latentloop analyze`: contraction and probe on an fbt run, depth on an rgpt run."""

import importlib.util
import json

import pytest
import torch
from conftest import TINY_RUN_CONTEXT

import latentloop as ll
from latentloop.archs.fbt.analyses import bracket_depth_labels, fit_linear_probe
from latentloop.archs.rgpt.analyses import spearman
from latentloop.cli import main
from latentloop.data import ByteTokenizer

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_contraction_and_probe(tiny_run_copy, capsys):
    run = tiny_run_copy("fbt")  # analyze writes into RUN/analysis/
    capsys.readouterr()
    passes = TINY_RUN_CONTEXT + 8
    assert main(["analyze", "contraction", str(run), "--passes", str(passes), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["loss"]) == passes and len(result["relative_change"]) == passes
    # the Jacobi iteration is exact after sequence_len passes: from then on nothing moves
    assert max(result["relative_change"][TINY_RUN_CONTEXT + 1:]) < 1e-6 < max(result["relative_change"][1:8])
    assert (run / "analysis" / f"contraction-passes{passes}.json").is_file()  # a setting not the default
    assert main(["analyze", "contraction", str(run), "--passes", "3"]) == 0  # without --json: a progress bar
    shown = capsys.readouterr()
    assert "passes" in shown.err and "final relative change" in shown.out
    assert main(["analyze", "contraction", str(run), "--passes", "3", "--no-progress"]) == 0
    assert "passes:" not in capsys.readouterr().err
    assert main(["analyze", "probe", str(run), "--passes", "3", "--batches", "2", "--json"]) == 0
    probes = json.loads(capsys.readouterr().out)["probes"]
    assert set(probes) == {"standard/block0_in", "standard/block0_out", "recurrent/block0_in",
                           "recurrent/block0_out"}
    assert (run / "analysis" / "probe-passes3-batches2.json").is_file()
    assert main(["analyze", "probe", str(run), "--passes", "3", "--batches", "2", "--no-progress"]) == 0
    line = capsys.readouterr().out  # says what the figures are (it printed bare names and numbers)
    assert "bracket nesting depth (0..4+) from layer 0, held-out probe accuracy: standard/block0_in " in line
    if HAVE_MATPLOTLIB:  # plots are optional (the `plot` extra); the analysis runs without them
        assert (run / "analysis" / "probe-passes3-batches2.png").is_file()
    assert main(["analyze", "depth", str(run)]) == 2  # wrong architecture: one-line error


def test_depth(tiny_run_copy, capsys):
    run = tiny_run_copy("rgpt")
    capsys.readouterr()
    assert main(["analyze", "depth", str(run), "--max-steps", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == [1, 2, 3, 4] and len(result["gate_mean_per_step"]) == 4
    assert len(result["openness_per_step"]) == 4 and all(v > 0 for v in result["openness_per_step"])
    assert sum(result["exit_depth_histogram"]) > 0
    written = sorted((run / "analysis").iterdir())
    # a --min-steps no position could reach gave exit figures of nothing (mean R, Spearman nan), exit 0
    assert main(["analyze", "depth", str(run), "--max-steps", "2", "--min-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "--min-steps 3 is past the depth evaluated (2 steps" in err and "Traceback" not in err
    assert sorted((run / "analysis").iterdir()) == written


def test_bracket_labels_and_probe_arithmetic():
    tok = ByteTokenizer()
    x = torch.tensor([[tok.bos_id] + tok.encode("a(b[c]d)e")])
    assert bracket_depth_labels(tok, x).tolist() == [[0, 0, 1, 1, 2, 2, 1, 1, 0, 0]]
    torch.manual_seed(0)
    labels = torch.randint(0, 5, (600,))
    rows = torch.arange(20).repeat_interleave(30)  # 20 rows of 30 positions
    separable = torch.nn.functional.one_hot(labels, 5).float() + 0.01 * torch.randn(600, 5)
    assert fit_linear_probe(separable, labels, rows)["test_accuracy"] > 0.95
    assert fit_linear_probe(torch.randn(600, 5), labels, rows)["test_accuracy"] < 0.4
    # labels that hold over runs of 8 positions, and features blind to the text, constant over each run:
    # positions split at random put a test position's twins in the fit (0.997 held out, 12-07 review);
    # rows split apart leave the probe nothing to read
    runs = torch.randint(0, 5, (75,))
    constant_labels, noise = runs.repeat_interleave(8), torch.randn(75, 16).repeat_interleave(8, dim=0)
    held_out = fit_linear_probe(noise, constant_labels, rows)
    assert held_out["test_accuracy"] < 0.45 < held_out["train_accuracy"]
    with pytest.raises(ll.ConfigError, match="at least two rows"):
        fit_linear_probe(separable, labels, torch.zeros(600, dtype=torch.long))
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)


def test_depth_reports_task_accuracy_for_task_runs(tmp_path, capsys):
    assert main(["train", "--arch", "rgpt", "--preset", "test", "--data", "task:addition:digits=2,n=400",
                 "--steps", "2", "--out", str(tmp_path / "run"), "--set", "batch_size=2", "--set", "sequence_len=32",
                 "--set", "recurrence_steps=2", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["analyze", "depth", str(tmp_path / "run"), "--json", "--task-limit", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["task_accuracy"]) == 2 and all(0.0 <= a <= 1.0 for a in result["task_accuracy"])
    # each depth's figure with its interval and what it rests on (a bare accuracy of 4 items before)
    assert result["task_n"] == [4, 4] and all(1 <= d <= 4 for d in result["task_distinct"])
    assert all(len(ci) == 2 and 0.0 <= ci[0] <= ci[1] <= 1.0 for ci in result["task_accuracy_ci"])
    assert (tmp_path / "run" / "analysis" / "depth-task_limit4.png").is_file() \
        or "matplotlib" not in __import__("sys").modules
    # the same analysis with other settings keeps each result (the last replaced the first, 12-07 review)
    assert main(["analyze", "depth", str(tmp_path / "run"), "--json", "--task-limit", "4", "--max-steps", "1",
                 "--no-progress"]) == 0
    capsys.readouterr()
    kept = sorted(p.name for p in (tmp_path / "run" / "analysis").glob("*.json"))
    assert kept == ["depth-max_steps1-task_limit4.json", "depth-task_limit4.json"], kept
    assert len(json.loads((tmp_path / "run" / "analysis" / kept[1]).read_text())["task_accuracy"]) == 2


def test_a_checkpoint_chosen_by_path_and_another_run_in_one_out_folder_keep_their_own_results(
        tiny_run_copy, tmp_path, capsys):
    """The result's file named neither the checkpoint nor the run: analysing an earlier checkpoint
    replaced the latest's result, and a second run's result in one --out folder the first run's."""
    import shutil

    run = tiny_run_copy("rgpt")
    [checkpoint] = sorted((run / "checkpoints").iterdir())
    step = int(checkpoint.name.removeprefix("step_"))
    assert main(["analyze", "depth", str(run), "--max-steps", "2", "--no-progress"]) == 0
    assert main(["analyze", "depth", str(checkpoint), "--max-steps", "2", "--no-progress"]) == 0
    written = {p.name: json.loads(p.read_text())["run"] for p in (run / "analysis").glob("*.json")}
    assert written == {"depth-max_steps2.json": str(run), f"depth-max_steps2-step{step}.json": str(checkpoint)}
    other = shutil.copytree(run, tmp_path / "other-run")
    for source in (run, other):
        assert main(["analyze", "depth", str(source), "--max-steps", "2", "--out", str(tmp_path / "shared")]) == 0
    assert sorted(p.name for p in (tmp_path / "shared").glob("*.json")) == [
        "other-run-depth-max_steps2.json", f"{run.name}-depth-max_steps2.json"]
    # a checkpoint folder copied out of its run is named by itself, not by the folder above it
    alone = shutil.copytree(checkpoint, tmp_path / "elsewhere" / "best")
    shutil.copy(run / "config.json", alone / "config.json")
    shutil.copy(run / "tokenizer.json", alone / "tokenizer.json")
    assert main(["analyze", "depth", str(alone), "--max-steps", "2", "--out", str(tmp_path / "alone")]) == 0
    assert [p.name for p in (tmp_path / "alone").glob("*.json")] == ["best-depth-max_steps2.json"]


def test_analysis_without_matplotlib_writes_json_only(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if the plot extra were absent
    assert main(["analyze", "contraction", str(tiny_run("fbt")), "--passes", "3", "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "fbt-contraction-passes3.json").is_file()  # in a folder of the caller's: by run
    assert not (tmp_path / "a" / "fbt-contraction-passes3.png").exists()


def test_analyze_takes_data_and_refuses_a_chat_run_in_one_line(tiny_run_copy, tmp_path, capsys):
    """`analyze` told the user to give --data, which it did not take, where a run's own data was not
    on this machine; on an SFT run (conversations) it ended in a TypeError traceback (12-06 review)."""
    import shutil

    from conftest import write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    assert main(["train", "--arch", "fbt", "--preset", "test", "--data", f"text:{corpus}", "--steps", "1",
                 "--batch-size", "2", "--set", "sequence_len=32", "--out", str(run), "--no-progress"]) == 0
    moved = shutil.move(str(corpus), str(tmp_path / "moved"))
    capsys.readouterr()
    assert main(["analyze", "contraction", str(run), "--passes", "2", "--json"]) == 2
    assert "--data" in capsys.readouterr().err
    assert main(["analyze", "contraction", str(run), "--passes", "2", "--json", "--data", f"text:{moved}"]) == 0
    sft = tmp_path / "sft"
    assert main(["train", "--stage", "sft", "--init-from", str(run), "--data", "chat:task:addition", "--steps", "1",
                 "--batch-size", "2", "--set", "sequence_len=64", "--set", "eval_batches=1", "--out", str(sft),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["analyze", "contraction", str(sft), "--passes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained on conversations" in err[0] and "--data" in err[0], err
    assert main(["analyze", "contraction", str(sft), "--passes", "2", "--json", "--data", "stdlib"]) == 0


def test_rgpts_depth_plot_labels_its_units_and_an_undefined_correlation():
    """The early-exit curve's axis names its unit, a correlation that does not exist (every token
    exiting at one depth) reads n/a, not nan, and step axes tick at whole numbers."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from latentloop.archs.rgpt.analyses import _plot

    result = {"steps": [1, 2, 3], "loss": [3.0, 2.5, 2.4], "trained_steps": 2, "gate_mean_per_step": [0.5] * 3,
              "openness_per_step": [0.1] * 3, "exit_depth_histogram": [0, 5, 0],
              "spearman_exit_depth_vs_token_loss": float("nan")}
    fig = _plot(plt, result)
    try:
        curve, _, depth = fig.axes[:3]
        assert curve.get_ylabel() == "val loss (nats/token)"
        assert depth.get_title() == "exit depth (Spearman vs loss n/a)"
        fig.canvas.draw()
        assert all(float(t).is_integer() for t in curve.get_xticks())
        result["spearman_exit_depth_vs_token_loss"] = None  # as the JSON keeps it
        assert _plot(plt, result).axes[2].get_title().endswith("n/a)")
    finally:
        plt.close("all")
