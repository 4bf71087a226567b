"""What a first day with latentloop ran into: files a colleague could not read, a demo report whose
caveat described other runs, a refused tokenizer command that left its folder behind, a Muon
setting whose typo was ignored, and a log whose figure link led nowhere."""

from __future__ import annotations

import json
import os
import re
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import REPO

from latentloop.cli import main

# What `open()` gives a new file under each umask: what every file of a run and an export must have
MODE_UNDER_UMASK = {0o022: 0o644, 0o077: 0o600}
TRAIN_ARGV = ("--preset", "test", "--steps", "1", "--batch-size", "2", "--set", "sequence_len=32",
              "--set", "eval_batches=1", "--no-progress")
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def _modes(folder: Path) -> dict[str, int]:
    return {str(path.relative_to(folder)): stat.S_IMODE(path.stat().st_mode)
            for path in sorted(folder.rglob("*")) if path.is_file()}


def _one_line_exit_2(argv: list, capsys) -> str:
    capsys.readouterr()
    assert main([str(arg) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("mask", sorted(MODE_UNDER_UMASK), ids=oct)
def test_a_run_its_checkpoints_and_an_export_get_the_mode_open_would_give(mask, corpus, tmp_path):
    """mkstemp (config.json) and safetensors (the weights, the trainer state) write 0600 whatever the
    umask: colleagues on a shared file system could not read a run. Every file is as `open()` makes it."""
    run, export, tokenizer = tmp_path / "run", tmp_path / "hf", tmp_path / "tok"
    with umask(mask):
        assert main(["train", "--arch", "gpt", "--data", f"text:{corpus}", "--out", str(run), *TRAIN_ARGV]) == 0
        assert main(["export", str(run), "--format", "hf", "--out", str(export), "--no-progress"]) == 0
        assert main(["tokenizer", "train", "--data", f"text:{corpus}", "--vocab-size", "270",
                     "--out", str(tokenizer)]) == 0
    modes = {f"run/{name}": mode for name, mode in _modes(run).items()}
    modes |= {f"hf/{name}": mode for name, mode in _modes(export).items()}
    modes |= {f"tok/{name}": mode for name, mode in _modes(tokenizer).items()}
    checkpoint = "run/checkpoints/step_00000001"
    named = ["run/config.json", f"{checkpoint}/model.safetensors", f"{checkpoint}/trainer.safetensors",
             f"{checkpoint}/config.json", "hf/model.safetensors", "tok/tokenizer.json"]
    assert set(named) <= set(modes)
    wrong = {name: oct(mode) for name, mode in modes.items() if mode != MODE_UNDER_UMASK[mask]}
    assert not wrong, f"not {oct(MODE_UNDER_UMASK[mask])} under umask {oct(mask)}: {wrong}"


def test_the_umask_is_read_without_changing_it():
    from latentloop.util import current_umask

    with umask(0o027):
        assert current_umask() == 0o027
        assert os.umask(0o027) == 0o027  # still the process's own after the reading


def test_the_demo_report_states_the_tokens_and_parameters_of_its_own_runs(corpus, tmp_path):
    """The caveat said "a few hundred thousand tokens on models of under a million parameters" over
    a table of 2,560 tokens: it now gives the runs' own figures."""
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "1", "--out", str(out), "--data", f"text:{corpus}", "--preset", "test",
                 "--archs", "gpt,fbt", "--no-progress"]) == 0
    results = json.loads((out / "demo.json").read_text())["results"]
    report = (out / "report.md").read_text()
    tokens, params = {r["tokens"] for r in results}, sorted(r["params"] for r in results)
    assert len(tokens) == 1 and params[0] != params[-1]  # every arch the same tokens, different sizes
    assert f"These are {tokens.pop():,} training tokens per architecture on models of " \
           f"{params[0]:,} to {params[-1]:,} parameters: " in report
    assert "hundred thousand" not in report and "under a million" not in report


def test_demo_help_gives_the_duration_the_demo_measured(capsys):
    from latentloop.demo import DEMO_MEASURED_S, DEMO_STEPS

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"default: {DEMO_STEPS}, about {round(DEMO_MEASURED_S / 60)} minutes on 2 quiet cores" in help_text


@pytest.mark.parametrize("case", ["vocab too small", "vocab too large", "no such data", "empty data"])
def test_a_refused_tokenizer_command_leaves_no_folder_behind(case, corpus, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    data, vocab = {"vocab too small": (corpus, 100), "vocab too large": (corpus, 2**22),
                   "no such data": (tmp_path / "missing.txt", 300), "empty data": (tmp_path / "empty.txt", 300)}[case]
    errors = [_one_line_exit_2(["tokenizer", "train", "--data", f"text:{data}", "--vocab-size", vocab,
                                "--out", out], capsys)
              for out in (tmp_path / "tok9", tmp_path / "new" / "deeper" / "tok.json")]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus", "empty.txt"]
    assert all(("BPE vocab_size" in err) == case.startswith("vocab") for err in errors), errors


@pytest.mark.parametrize("arch", ["gpt", "fbt"])
def test_a_muon_exclude_pattern_that_matches_nothing_is_refused(arch):
    import latentloop as ll
    from latentloop.config import TrainConfig
    from latentloop.errors import ConfigError
    from latentloop.optim import build_optimizers

    model = ll.build(arch, preset="test")
    with pytest.raises(ConfigError) as refused:
        build_optimizers(model, TrainConfig(optimizer="muon", muon_exclude=("mlp", "nonexistent_param")))
    message = str(refused.value)
    assert "\n" not in message and "'nonexistent_param'" in message and "'mlp'" not in message
    assert "blocks.0.attn.c_qkv.weight" in message  # a real name to copy from
    build_optimizers(model, TrainConfig(optimizer="muon", muon_exclude=("mlp",)))  # a pattern that matches: fine


@pytest.mark.parametrize("arch", ["gpt", "mor"])
def test_a_muon_exclude_that_moves_every_matrix_is_refused_and_one_that_moves_none_is_said(arch, capsys):
    """Parts that moved every matrix off Muon ('blocks') built an empty Muon, torch's traceback; a part of
    only the embeddings' names ('wte': AdamW's anyway) moved nothing without a word. It is a warning, not
    a refusal: `muon_exclude` is fixed on resume, and a run that ran with it must resume."""
    import latentloop as ll
    from latentloop.config import TrainConfig
    from latentloop.errors import ConfigError
    from latentloop.optim import build_optimizers

    model = ll.build(arch, preset="test")
    everything = ("blocks", "router") if arch == "mor" else ("blocks",)
    with pytest.raises(ConfigError, match=r"leaves Muon no matrix .*\(train.optimizer=adamw\)"):
        build_optimizers(model, TrainConfig(optimizer="muon", muon_exclude=everything))
    [adamw] = build_optimizers(model, TrainConfig(optimizer="adamw", muon_exclude=everything))  # no Muon: fine
    assert sum(len(group["params"]) for group in adamw.param_groups) == len(list(model.parameters()))
    capsys.readouterr()
    adamw_only = ("wte", "mlp") if arch == "gpt" else ("wte.", "mlp")  # a distinct message per case (said once)
    adamw_part, muon = build_optimizers(model, TrainConfig(optimizer="muon", muon_exclude=adamw_only))
    assert len(muon.param_groups[0]["params"]) == len([p for n, p in model.named_parameters()
                                                      if p.dim() >= 2 and "mlp" not in n
                                                      and not n.startswith(("wte", "lm_head"))])
    err = capsys.readouterr().err
    assert f"train.muon_exclude: {adamw_only[0]!r} matches only parameters AdamW trains anyway" in err
    assert err.count("\n") == 1 and "'mlp'" not in err
    build_optimizers(model, TrainConfig(optimizer="adamw", muon_exclude=("wte",)))  # without Muon: nothing to say
    assert "muon_exclude" not in capsys.readouterr().err


def test_a_muon_exclude_typo_stops_train_before_anything_is_written(corpus, tmp_path, capsys):
    config = tmp_path / "typo.yaml"
    config.write_text("train:\n  muon_exclude: [nonexistent_param]\n")
    run = tmp_path / "run"
    err = _one_line_exit_2(["train", "--config", config, "--data", f"text:{corpus}", "--out", run, *TRAIN_ARGV],
                           capsys)
    assert "nonexistent_param" in err and "muon_exclude" in err
    assert not run.exists()


def test_every_link_of_the_experiment_logs_leads_to_a_file():
    """A log moved into experiments/logs/ kept links relative to experiments/ (its figures)."""
    missing = {page.name: link for page in sorted((REPO / "experiments" / "logs").glob("*.md"))
               for link in MARKDOWN_LINK.findall(page.read_text())
               if "://" not in link and not (page.parent / link).exists()}
    assert not missing, missing
