"""Review of the evaluation front-ends: compare keeps runs on other data or tokenizers apart, task
results name their checkpoint and quantization, the document interval needs enough documents,
analyze checks its data, --against checks the tokenizer, ties in Spearman, strict JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import TINY_RUN_ARGV, write_corpus

from latentloop.archs.rgpt.analyses import spearman
from latentloop.cli import main
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.errors import LatentloopError
from latentloop.eval import compare
from latentloop.eval import loss as eval_loss


def _strict(text: str):
    """json.loads that refuses NaN / Infinity (Python's default accepts them)."""
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def make_run(folder: Path, *, seed: int, bpb: float, checksums: dict | None = None, tokenizer: str | None = None,
             **train) -> Path:
    """A run folder compare can read: config, a metrics log, and (optionally) a checkpoint's recorded
    data checksums and a tokenizer.json."""
    folder.mkdir(parents=True)
    config = RunConfig(model=model_config("gpt", "test"), train=TrainConfig(steps=20, seed=seed, **train),
                       data=DataConfig(source="text:/data/corpus.txt"))
    config.save_json(folder / "config.json")
    rows = [{"step": 10, "loss": 3.0, "tokens": 10_000}, {"step": 10, "val_loss": bpb * 0.69, "val_bpb": bpb},
            {"step": 20, "loss": 2.5, "tokens": 20_000}, {"step": 20, "val_loss": bpb * 0.69, "val_bpb": bpb}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if checksums is not None:
        state = folder / "checkpoints" / "step_00000020"
        state.mkdir(parents=True)
        (state / "state.json").write_text(json.dumps({"step": 20, "data": checksums,
                                                      "data_source": "text:/data/corpus.txt"}))
    if tokenizer is not None:
        (folder / "tokenizer.json").write_text(tokenizer)
    return folder


DATA_A = {"train": "a" * 64, "val": "b" * 64}
DATA_B = {"train": "c" * 64, "val": "d" * 64}  # the same file name, other contents


def test_compare_does_not_group_or_pair_runs_on_other_data(tmp_path):
    runs = [make_run(tmp_path / "a-s1", seed=1, bpb=2.0, checksums=DATA_A),
            make_run(tmp_path / "a-s2", seed=2, bpb=2.1, checksums=DATA_A),
            make_run(tmp_path / "b-s1", seed=1, bpb=1.5, checksums=DATA_B),
            make_run(tmp_path / "b-s2", seed=2, bpb=1.6, checksums=DATA_B)]
    report = compare.compare_runs(runs, tmp_path / "out")
    assert [g["runs"] for g in report["groups"]] == [["a-s1", "a-s2"], ["b-s1", "b-s2"]]
    other = report["groups"][1]["val_bpb"]
    assert "paired" not in other and other["unpaired"]  # no paired difference across data
    text = (tmp_path / "out" / "compare.md").read_text()
    assert "– (other data)" in text
    assert any("not grouped as seeds, trained on other data" in n for n in report["notes"])
    assert any("is not paired with" in n and "val tokens dddddddddddd" in n for n in report["notes"])


def test_compare_keeps_tokenizers_apart_and_compares_bpb(tmp_path):
    runs = [make_run(tmp_path / "t-s1", seed=1, bpb=2.0, tokenizer='{"type": "byte"}'),
            make_run(tmp_path / "t-s2", seed=2, bpb=2.1, tokenizer='{"type": "byte"}'),
            make_run(tmp_path / "u-s1", seed=1, bpb=1.9, tokenizer='{"type": "bpe", "merges": [1]}')]
    report = compare.compare_runs(runs, tmp_path / "out")
    assert [g["runs"] for g in report["groups"]] == [["t-s1", "t-s2"], ["u-s1"]]
    assert "paired" in report["groups"][1]["val_bpb"]  # BPB still pairs: it does not depend on the tokenizer
    assert any("different tokenizers" in n and "BPB" in n for n in report["notes"])
    assert "tokenizer |" in report["markdown"].splitlines()[0]
    assert "val loss (nats/token)" in report["markdown"]
    pytest.importorskip("matplotlib")
    assert any("BPB only" in n for n in report["notes"])


def test_inert_settings_group_and_one_seed_shows_no_spread(tmp_path):
    runs = [make_run(tmp_path / "g-s1", seed=1, bpb=2.0, save_every=5, log_every=1),
            make_run(tmp_path / "g-s2", seed=2, bpb=2.1, save_every=0, keep_last=4, trackers=["tensorboard"]),
            make_run(tmp_path / "h-s1", seed=1, bpb=1.9, lr=0.01)]
    report = compare.compare_runs(runs, tmp_path / "out")
    assert [g["runs"] for g in report["groups"]] == [["g-s1", "g-s2"], ["h-s1"]]
    row = next(line for line in report["markdown"].splitlines() if line.startswith("| h-s1 |"))
    assert "±" not in row


def test_compare_json_is_strict(tmp_path):
    run = make_run(tmp_path / "n-s1", seed=1, bpb=2.0)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 30, "val_loss": NaN, "val_bpb": NaN}\n')
    compare.compare_runs([run, make_run(tmp_path / "n-s2", seed=2, bpb=2.0)], tmp_path / "out")
    _strict((tmp_path / "out" / "compare.json").read_text())


def test_task_results_record_checkpoint_and_quantization(tiny_run_copy, tmp_path, capsys):
    run = tiny_run_copy("gpt")
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    step = json.loads((checkpoint / "state.json").read_text())["step"]
    assert main(["eval", str(checkpoint), "--tasks", "addition", "--limit", "1", "--quantize", "int8",
                 "--no-progress"]) == 0
    files = sorted(p.name for p in (run / "evals").glob("*.json"))
    assert files == [f"addition-default-int8-step{step}-limit1.json"], files  # not the run's addition-default.json
    payload = json.loads((run / "evals" / files[0]).read_text())
    assert payload["quantize"] == "int8" and payload["step"] == step
    report = compare.compare_runs([run], tmp_path / "out")
    assert f"(default-int8-step{step}-limit1)" in report["markdown"]


def test_task_results_of_another_limit_are_kept_beside_each_other(tiny_run_copy, capsys):
    """A run scored with --limit 2, then --limit 1: the second replaced the first's file (and a CORE
    file computed from the first then sat beside task files of the second), 12-07 review."""
    run = tiny_run_copy("gpt")
    for limit in ("2", "1"):
        assert main(["eval", str(run), "--tasks", "addition", "--limit", limit, "--no-progress"]) == 0
    files = sorted(p.name for p in (run / "evals").glob("*.json"))
    assert files == ["addition-default-limit1.json", "addition-default-limit2.json"], files
    assert [json.loads((run / "evals" / f).read_text())["limit"] for f in files] == [1, 2]


@pytest.mark.parametrize("damage", [{"result": {"accuracy": 0.5, "accuracy_ci": ["a", "b"]}}, {"limit": [1]},
                                    {"task": 3}, {"result": [0.5]}])
def test_compare_skips_a_damaged_task_result(tmp_path, damage):
    """A hand-damaged evals/*.json was a traceback (a format of strings, a list hashed, an int sorted
    beside str); it is skipped, as a damaged metrics row is."""
    run = make_run(tmp_path / "n-s1", seed=1, bpb=2.0)
    (run / "evals").mkdir()
    good = {"task": "copa", "kind": "core", "tag": "default", "limit": None,
            "result": {"accuracy": 0.75, "accuracy_ci": [0.5, 0.9]}}
    (run / "evals" / "copa-default.json").write_text(json.dumps(good))
    (run / "evals" / "boolq-default.json").write_text(json.dumps(good | {"task": "boolq"} | damage))
    report = compare.compare_runs([run], tmp_path / "out")
    assert "| copa | 0.7500 [0.50, 0.90] |" in report["markdown"] and "boolq" not in report["markdown"]


def test_compare_refuses_a_checkpoint_folder_as_a_run(tiny_run_copy, tmp_path, capsys):
    run = tiny_run_copy("gpt")
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    capsys.readouterr()
    assert main(["compare", str(checkpoint), str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a checkpoint folder, not a run folder" in err[0]
    assert not (tmp_path / "out").exists()


def test_document_interval_needs_enough_documents():
    rng = np.random.default_rng(0)

    def sums(documents):
        tokens = rng.integers(200, 2000, documents).astype(float)
        nats = tokens * rng.normal(2.0, 0.3, documents)
        return {"nats": nats, "nats_bpb": nats, "tokens": tokens, "bytes": tokens * 4}

    few = eval_loss.document_intervals(sums(3))
    assert few["loss_ci"] is None and few["bpb_ci"] is None
    assert few["interval"].startswith("3 documents: too few for an interval")
    enough = eval_loss.document_intervals(sums(eval_loss.MIN_INTERVAL_DOCUMENTS))
    assert enough["loss_ci"] is not None and "bootstrap" in enough["interval"]


def test_plain_eval_prints_no_interval_line_without_one(tiny_run, tmp_path, capsys):
    text = tmp_path / "three.txt"
    text.write_text("<|endoftext|>".join(" ".join(f"word{i} {j}" for j in range(300)) for i in range(3)))
    capsys.readouterr()
    assert main(["eval", str(tiny_run("gpt")), "--data", f"text:{text}", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert not any(line.strip().startswith("interval:") for line in out.splitlines()), out
    assert "too few for an interval" in out


def test_eval_says_how_many_batches_were_scored(tiny_run, tiny_corpus, capsys):
    capsys.readouterr()
    assert main(["eval", str(tiny_run("gpt")), "--data", f"text:{tiny_corpus}", "--batches", "99999999999",
                 "--json", "--no-progress"]) == 0
    measured = json.loads(capsys.readouterr().out)["measured_on"]
    assert "99999999999" not in measured and "every batch" in measured


@pytest.mark.parametrize("flags", [["--batches", "2"], ["--split", "train"], ["--by-position", "4"],
                                   ["--against", "elsewhere"]])
def test_eval_tasks_refuses_flags_of_the_loss(flags, tiny_run_copy, capsys):
    run = tiny_run_copy("gpt")
    assert main(["eval", str(run), "--tasks", "addition", "--limit", "1", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert "not to --tasks" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_against_needs_by_position(tiny_run, capsys):
    assert main(["eval", str(tiny_run("gpt")), "--against", str(tiny_run("gpt")), "--no-progress"]) == 2
    assert "--by-position" in capsys.readouterr().err


def test_more_position_buckets_than_positions_are_said(tiny_run_copy, tiny_corpus, capsys):
    """`--by-position 100000` was reduced to one bucket per position without a word."""
    run = tiny_run_copy("gpt")  # its plot goes into the run's evals/
    capsys.readouterr()
    assert main(["eval", str(run), "--by-position", "100000", "--batches", "1", "--json", "--no-progress",
                 "--data", f"text:{tiny_corpus}"]) == 0
    printed = capsys.readouterr()
    seq_len = json.loads(printed.out)["sequence_len"]
    assert len(json.loads(printed.out)["by_position"]) == seq_len
    assert f"--by-position 100000: a context of {seq_len} positions makes at most {seq_len} buckets" in printed.err
    assert json.loads(printed.out)["quantize"] is None
    # an int8 model's curve says so (it could not be told from the float32 model's)
    assert main(["eval", str(run), "--by-position", "4", "--batches", "1", "--json", "--no-progress", "--quantize",
                 "int8", "--data", f"text:{tiny_corpus}"]) == 0
    assert json.loads(capsys.readouterr().out)["quantize"] == "int8"


def test_against_refuses_another_tokenizer(monkeypatch, tmp_path):
    from latentloop import runs
    from latentloop.cli import scoring

    def tokenizer(mark):
        return SimpleNamespace(fingerprint=lambda: mark)

    base = SimpleNamespace(model=SimpleNamespace(vocab_size=259, sequence_len=64))
    monkeypatch.setattr(runs, "load_run", lambda path, device: (object(), tokenizer("other"), base, None))
    args = SimpleNamespace(against=str(tmp_path), device="cpu")
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=259))
    with pytest.raises(LatentloopError, match="tokenizer"):
        scoring._position_base(args, tmp_path, model, tokenizer("mine"))
    path, _, context = scoring._position_base(args, tmp_path, model, tokenizer("other"))  # the same one: fine
    assert context == 64


def test_spearman_uses_average_ranks_for_ties():
    a = np.array([1, 1, 1, 2, 2, 3])
    b = np.array([0.1, 0.5, 0.2, 0.9, 0.4, 1.0])
    ranks_a = np.array([2, 2, 2, 4.5, 4.5, 6])  # ties share the mean of their ranks
    ranks_b = np.array([1, 4, 2, 5, 3, 6])
    assert spearman(a, b) == pytest.approx(np.corrcoef(ranks_a, ranks_b)[0, 1])
    assert math.isnan(spearman(np.ones(4), np.arange(4)))


def test_contraction_json_is_strict(tiny_run_copy, tmp_path, capsys):
    run = tiny_run_copy("fbt")
    capsys.readouterr()
    assert main(["analyze", "contraction", str(run), "--passes", "1", "--json", "--no-progress",
                 "--out", str(tmp_path / "a")]) == 0
    printed = _strict(capsys.readouterr().out)
    assert printed["relative_change"] == [None] and printed["final_relative_change"] is None
    _strict((tmp_path / "a" / f"{run.name}-contraction-passes1.json").read_text())  # in --out: by its run


def test_analyze_refuses_changed_data(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", documents=20)
    run = tmp_path / "run"
    assert main(["train", "--arch", "fbt", "--data", f"text:{corpus}", "--out", str(run), *TINY_RUN_ARGV]) == 0
    first = sorted(corpus.iterdir())[0]
    first.write_text(first.read_text() + " changed after training")
    capsys.readouterr()
    assert main(["analyze", "contraction", str(run), "--passes", "2", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "is not the data this run was trained on" in err and "Traceback" not in err
