"""`latentloop compare`: tables from run folders (config, metrics log, eval results) and the plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from latentloop.archs import build_model, build_objective
from latentloop.cli import main
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.errors import CheckpointError
from latentloop.eval import compare


def make_run(folder: Path, arch: str, losses: list[float], *, flops: bool = True, evals: dict | None = None,
             seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    config = RunConfig(model=model_config(arch, "test"), train=TrainConfig(steps=len(losses) * 10, seed=seed),
                       data=DataConfig(source="stdlib"))
    config.save_json(folder / "config.json")
    rows = []
    for i, loss in enumerate(losses, 1):
        row = {"step": i * 10, "loss": loss, "tokens": i * 10_000, "lr": 1e-3}
        if flops:
            row["flops"] = i * 1e9
        rows.append(row)
        rows.append({"step": i * 10, "val_loss": loss + 0.1, "val_bpb": (loss + 0.1) / 0.69, "val_tokens": 99})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9')  # cut line
    for (task, tag), payload in (evals or {}).items():
        (folder / "evals").mkdir(exist_ok=True)
        (folder / "evals" / f"{task}-{tag}.json").write_text(json.dumps({"task": task, "tag": tag, **payload}))
    return folder


@pytest.fixture
def runs(tmp_path):
    gpt = make_run(tmp_path / "gpt", "gpt", [3.0, 2.5, 2.0], evals={
        ("core", "default"): {"kind": "core_aggregate", "limit": 10,
                              "result": {"core": 0.0123, "evaluated": 20, "missing": ["squad", "coqa"]}},
        ("arc_easy", "default"): {"kind": "core", "limit": 10, "result": {"accuracy": 0.3, "centered": 0.0667}},
    })
    fbt = make_run(tmp_path / "fbt", "fbt", [2.9, 2.2], flops=False, evals={
        ("arc_easy", "soft"): {"kind": "core", "result": {"accuracy": 0.35}},
        ("arc_easy", "fused-passes2"): {"kind": "core", "result": {"accuracy": 0.4}},
        ("gsm8k", "soft"): {"kind": "generation", "result": {"accuracy": 0.05, "mean_trace_tokens": 41.6}},
    })
    return gpt, fbt


def test_read_run_counts_params_and_flops(runs):
    gpt, fbt = runs
    info = compare.read_run(gpt)
    config = RunConfig.from_dict(json.loads((gpt / "config.json").read_text()))
    model = build_model(config.model)
    assert info["params"] == model.num_params() and info["arch"] == "gpt"
    assert info["flops_per_token"] == pytest.approx(build_objective(config.model, config.train).flops_per_token(model))
    assert (info["tokens"], info["flops"], info["steps"]) == (30_000, 3e9, 30)
    assert info["val_loss"] == pytest.approx(2.1) and info["val_bpb"] == pytest.approx(2.1 / 0.69)
    fbt_info = compare.read_run(fbt)  # no FLOPs logged: FLOPs per token x tokens
    assert fbt_info["flops"] == pytest.approx(fbt_info["flops_per_token"] * 20_000)
    assert len(fbt_info["evals"]) == 3


def test_compare_writes_tables_and_plots(runs, tmp_path):
    report = compare.compare_runs(list(runs), tmp_path / "out")
    text = (tmp_path / "out" / "compare.md").read_text()
    assert "| gpt | gpt |" in text and "| fbt | fbt |" in text and "3G" in text
    assert "| **CORE** (centred) | 0.0123 (20 tasks) | – | – |" in text
    assert "| arc_easy | 0.3000 | 0.4000 | 0.3500 |" in text  # columns: gpt default, fbt fused, fbt soft
    assert "| gsm8k | – | – | 0.0500 (42 tok) |" in text
    assert "limited (--limit) for gpt (default): 10" in text
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["runs"][0]["tokens"] == 30_000
    pytest.importorskip("matplotlib")
    assert report["plots"] == ["loss_vs_tokens.png", "loss_vs_flops.png"]
    for name in report["plots"]:
        assert (tmp_path / "out" / name).stat().st_size > 1000 and f"]({name})" in text


def test_plots_are_skipped_without_matplotlib(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    report = compare.compare_runs(list(runs), tmp_path / "out")
    assert report["plots"] == [] and any("matplotlib is not installed" in n for n in report["notes"])
    assert "matplotlib is not installed" in (tmp_path / "out" / "compare.md").read_text()


def test_validation_points_follow_training_tokens(runs):
    info = compare.read_run(runs[0])
    info["label"] = "gpt"
    xs, ys = compare._val_axis(info, "tokens")
    assert xs == [10_000.0, 20_000.0, 30_000.0] and ys == pytest.approx([3.1, 2.6, 2.1])


def test_cli_compare(runs, tmp_path, capsys):
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "| run | arch |" in out and "report:" in out and (tmp_path / "cmp" / "compare.md").is_file()
    assert main(["compare", str(tmp_path / "missing"), "--out", str(tmp_path / "cmp")]) == 2
    assert capsys.readouterr().err.startswith("latentloop: error:")
    # the same run twice read as two seeds of one recipe ("seeds 1337, 1337"), its interval over a copy
    again = str(runs[0].parent / ".." / runs[0].parent.name / runs[0].name)
    assert main(["compare", str(runs[0]), again, "--out", str(tmp_path / "twice")]) == 2
    assert capsys.readouterr().err.strip() == f"latentloop: error: run {runs[0]} is named twice"
    assert not (tmp_path / "twice").exists()


def test_not_a_run_folder(tmp_path):
    with pytest.raises(CheckpointError, match="not a run folder"):
        compare.read_run(tmp_path)


def test_runs_without_evals_or_metrics(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    RunConfig(model=model_config("gpt", "test")).save_json(bare / "config.json")
    report = compare.compare_runs([bare], tmp_path / "out")
    assert "| bare | gpt |" in report["markdown"] and any("no task results" in n for n in report["notes"])


def test_damaged_metrics_rows_are_left_out_not_a_traceback(tmp_path):
    """A metrics.jsonl with a row that is not UTF-8, a step that is not a number and a value that is
    not one: compare read it as text (UnicodeDecodeError) and formatted the values (ValueError,
    TypeError)."""
    run = make_run(tmp_path / "run", "gpt", [4.0, 3.5])
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'\xff\xfe{"step": 9}\n{"step": "abc", "loss": 1.0}\n{"step": 10, "val_loss": [1], "val_bpb": "x"}\n')
    report = compare.compare_runs([run], tmp_path / "out")
    assert "| run | gpt |" in report["markdown"]
    # said, not left silent (a "–" with no word): the cut line the appended bytes joined, and "abc"
    assert f"{run}/metrics.jsonl: 2 damaged lines (not UTF-8, not JSON or not a row of numbers) left out" in (
        tmp_path / "out" / "compare.md").read_text()
    intact = compare.compare_runs([make_run(tmp_path / "cut", "gpt", [4.0, 3.5])], tmp_path / "out2")
    assert not any("damaged" in note for note in intact["notes"])  # a cut last line: an interrupted run's


def test_seeds_of_one_recipe_are_grouped_and_paired_against_the_baseline(tmp_path, capsys):
    """Runs differing only in the seed form a group: mean ± sd over seeds, and BPB's paired
    difference from the baseline group with its t-interval (seed by seed, not group means)."""
    from latentloop.eval.stats import paired_comparison

    base = [3.0, 3.2, 2.9]
    shifts = {"better": [-0.20, -0.21, -0.19], "same": [0.05, -0.06, 0.0]}
    paths = [make_run(tmp_path / f"gpt-s{seed}", "gpt", [4.0, loss], seed=seed) for seed, loss in enumerate(base)]
    for name, shift in shifts.items():
        arch = "fbt" if name == "better" else "lrt"
        paths += [make_run(tmp_path / f"{name}_seed{seed}", arch, [4.0, loss + d], seed=seed)
                  for seed, (loss, d) in enumerate(zip(base, shift))]
    report = compare.compare_runs(paths, tmp_path / "out")
    groups = {g["group"]: g for g in report["groups"]}
    assert list(groups) == ["gpt", "better", "same"] and report["baseline"] == "gpt"
    bpb = {seed: (loss + 0.1) / 0.69 for seed, loss in enumerate(base)}  # make_run's val_bpb
    better = {seed: (loss + d + 0.1) / 0.69 for seed, (loss, d) in enumerate(zip(base, shifts["better"]))}
    paired, expected = groups["better"]["val_bpb"]["paired"], paired_comparison(better, bpb, "difference")
    assert paired["seeds"] == expected["seeds"] == [0, 1, 2] and paired["excludes"] is True
    for key in ("mean", "sd", "low", "high"):
        assert paired[key] == pytest.approx(expected[key], rel=1e-12)
    assert groups["same"]["val_bpb"]["verdict"] == "undecided"
    assert groups["gpt"]["val_loss"]["mean"] == pytest.approx(sum(base) / 3 + 0.1)
    text = (tmp_path / "out" / "compare.md").read_text()
    assert "## Over seeds" in text and "| better | fbt | 0, 1, 2 |" in text and "training-time estimate" in text
    # another baseline, by group or by one of its runs; an unknown one is one line
    assert compare.compare_runs(paths, tmp_path / "out2", baseline="same")["baseline"] == "same"
    assert compare.compare_runs(paths, tmp_path / "out3", baseline="better_seed1")["baseline"] == "better"
    assert main(["compare", *map(str, paths), "--out", str(tmp_path / "cli"), "--baseline", "nope"]) == 2
    assert "--baseline 'nope' names none of the groups" in capsys.readouterr().err


def test_a_copy_of_a_run_in_its_group_is_refused_not_cut_to_one_seed(tmp_path, capsys):
    """Two runs of one recipe and one seed (a copy): the seeds column listed "0, 1, 0" while the mean,
    sd and pairing used two values, without a word. It is one line naming both, and exit code 2."""
    import shutil

    paths = [make_run(tmp_path / f"gpt-s{seed}", "gpt", [4.0, 3.0 + seed / 10], seed=seed) for seed in (0, 1)]
    paths.append(Path(shutil.copytree(paths[0], tmp_path / "gpt-s0-copy")))
    capsys.readouterr()
    assert main(["compare", *map(str, paths), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"runs {paths[0]} and {paths[2]} share their recipe and seed 0" in err
    assert not (tmp_path / "out").exists()
    assert compare.compare_runs(paths[:2], tmp_path / "fine")["groups"]  # the two seeds alone compare


def test_group_curves_are_the_mean_and_sd_over_seeds(tmp_path):
    paths = [make_run(tmp_path / f"r-s{seed}", "gpt", [3.0 + seed, 2.0 + seed], seed=seed) for seed in range(3)]
    runs = [compare.read_run(p) for p in paths]
    compare._labels(runs)
    (members,) = compare.seed_groups(runs).values()
    xs, mean, sd = compare.group_curve(members, "tokens", "val_bpb")
    assert xs == [10_000.0, 20_000.0]
    assert mean == pytest.approx([(4.1) / 0.69, (3.1) / 0.69]) and sd == pytest.approx([1 / 0.69, 1 / 0.69])
    pytest.importorskip("matplotlib")
    assert compare.plot_losses(runs, tmp_path, {"r": members})[0] == ["loss_vs_tokens.png", "loss_vs_flops.png"]


def test_seeds_share_one_flops_count_and_variants_one_note(tmp_path, monkeypatch, capsys):
    """Counting FLOPs builds and runs the model (about a second a run): seeds of one recipe count it
    once. A variant with its parent's caveat (rfbt shares fbt's soft-BPB note) prints it once, and the
    progress bar goes to stderr only when asked for."""
    compare._model_facts.cache_clear()
    counted = []
    real = compare._model_facts.__wrapped__
    monkeypatch.setattr(compare, "_model_facts", compare.functools.cache(lambda r: counted.append(r) or real(r)))
    paths = [make_run(tmp_path / f"fbt-s{seed}", "fbt", [2.9, 2.2], seed=seed) for seed in (0, 1, 2)]
    paths.append(make_run(tmp_path / "rfbt", "rfbt", [2.8, 2.3]))
    report = compare.compare_runs(paths, tmp_path / "out", show_progress=True)
    assert len(counted) == 2  # fbt once for three seeds, rfbt once
    assert len({r["flops_per_token"] for r in report["runs"][:3]}) == 1
    assert len(report["notes"]) == len(set(report["notes"]))
    assert sum("fbt soft" in n for n in report["notes"]) == 1
    assert "reading runs" in capsys.readouterr().err
    compare.compare_runs(paths[:1], tmp_path / "quiet")
    assert "reading runs" not in capsys.readouterr().err


def test_a_seed_without_validation_points_is_left_out_of_its_groups_curve_and_named(tmp_path):
    """One seed's empty or cut log: its group's curve is over the seeds that logged (the mean over
    the points every seed reached was over none: the group read "train only"), and a note names it."""
    pytest.importorskip("matplotlib")
    paths = [make_run(tmp_path / f"r-s{seed}", "gpt", [3.0 + seed, 2.0 + seed], seed=seed) for seed in range(3)]
    runs = [compare.read_run(p) for p in paths]
    compare._labels(runs)
    (members,) = compare.seed_groups(runs).values()
    members[2]["val"] = []  # its metrics.jsonl held no validation line
    xs, mean, _ = compare.group_curve(members[:2], "tokens", "val_bpb")
    plots, notes = compare.plot_losses(runs, tmp_path, {"r": members})
    assert plots == ["loss_vs_tokens.png", "loss_vs_flops.png"] and xs and len(mean) == 2
    assert notes == [f"{members[2]['label']}: no validation points logged, left out of r's curve"]
