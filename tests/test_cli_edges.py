"""Edges of `eval` and `generate` that once gave tracebacks or ran unbounded: each is one line and
exit code 2, or works."""

import json

import pytest
from conftest import TINY_RUN_CONTEXT

from latentloop.cli import main


@pytest.fixture
def runs(tiny_run, tiny_corpus):
    return {arch: tiny_run(arch) for arch in ("gpt", "rgpt")}, tiny_corpus


def _one_line_exit_2(argv, words, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("flags", [["--exit-threshold", "0.5"], ["--cache-mode", "mean"],
                                   ["--exit-criterion", "state", "--exit-threshold", "0.1"],
                                   ["--min-steps", "2", "--exit-threshold", "0.1"],
                                   ["--steps", "2", "--cache-mode", "last"]])
def test_rgpt_eval_takes_every_option_of_its_arch(runs, flags, capsys):
    made, corpus = runs
    capsys.readouterr()
    assert main(["eval", str(made["rgpt"]), "--data", f"text:{corpus}", "--batches", "1", "--json", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["bpb"] > 0


@pytest.mark.parametrize("argv, words", [
    (["generate", "{gpt}", "--prompt", "hi", "--device", "cuda:abc"], "device"),
    (["generate", "{gpt}", "--prompt", "hi", "--temperature", "nan"], "temperature"),
    (["generate", "{gpt}", "--prompt", "hi", "--seed", "100000000000000000000000"], "seed"),
    (["generate", "{rgpt}", "--prompt", "hi", "--steps", "100000"], "steps"),
    (["generate", "{rgpt}", "--prompt", "hi", "--steps", "1e3"], "steps"),
    (["generate", "{gpt}", "--prompt", "hi", "--passes", "1000000000"], "passes"),
    (["generate", "{gpt}", "--prompt", "hi", "--regime", "soft"], "does not support"),
    (["generate", "{rgpt}", "--prompt", "hi", "--exit-threshold", "0.1", "--no-cache"], "needs the cache"),
    # a cache of less memory without a cache changed nothing, silently
    (["generate", "{rgpt}", "--prompt", "hi", "--cache-mode", "mean", "--no-cache"],
     "cache_mode='mean' needs the cache"),
    (["generate", "{gpt}", "--prompt", "hi", "--compile", "--no-cache"], "use_cache"),
    (["eval", "{rgpt}", "--exit-threshold", "-1", "--data", "stdlib"], "exit_threshold"),
    # options of an adaptive exit that could change nothing decoded as if not given, silently
    (["generate", "{rgpt}", "--prompt", "hi", "--min-steps", "2"], "min_steps applies to exit_threshold > 0 only"),
    (["generate", "{rgpt}", "--prompt", "hi", "--exit-threshold", "0.1", "--steps", "1", "--min-steps", "2"],
     "min_steps must be at most the decoding depth (1 step)"),
])
def test_bad_generation_flags_are_one_line(runs, argv, words, capsys):
    made, _ = runs
    _one_line_exit_2([a.format(gpt=made["gpt"], rgpt=made["rgpt"]) for a in argv], words, capsys)


def test_a_prompt_that_is_not_utf8_is_one_line(runs, capsys):
    made, _ = runs
    _one_line_exit_2(["generate", str(made["gpt"]), "--prompt", "caf\udce9"],  # what $'caf\xe9' arrives as
                     "--prompt is not valid UTF-8 text (byte 0xe9 at character 4)", capsys)


def test_generate_compile_falls_back_to_eager_where_the_step_cannot_be_captured(runs, capsys):
    made, _ = runs  # rgpt's adaptive exit decodes eagerly under --compile: the same text, no compile
    argv = ["generate", str(made["rgpt"]), "--prompt", "hi", "--temperature", "0", "--json", "--max-new-tokens", "6",
            "--exit-threshold", "0.01"]
    capsys.readouterr()
    assert main(argv) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*argv, "--compile"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == eager["ids"]


def test_generate_defaults_fit_a_short_context(runs, capsys):
    made, _ = runs  # the tiny runs' context is 32 tokens: the default budget must fit it
    capsys.readouterr()
    assert main(["generate", str(made["gpt"]), "--prompt", "hi", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["prompt_tokens"] + out["new_tokens"] <= TINY_RUN_CONTEXT


def test_the_help_says_which_options_apply_only_under_another(capsys):
    """The registry's `applies_if` reaches `--help`: `--min-steps` alone was refused with no hint before."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "before any exit (at most the decoding depth); only with exit_threshold > 0" in text
    assert "only with regime 'fused'" in text


def test_an_option_flag_is_parsed_by_the_loaded_models_own_declaration():
    """mor's `--steps` was parsed by rgpt's declaration (the first of the flag's archs): `--steps 300`
    on a mor run said "in [1, 256]", rgpt's bound, where mor's own check names its recursions."""
    import argparse

    import latentloop as ll
    from latentloop.cli.parser import generation_options
    from latentloop.engine import model_options

    mor, rgpt = ll.build("mor", preset="test"), ll.build("rgpt", preset="test")
    given = argparse.Namespace(option_steps="300")
    assert generation_options(given, mor) == {"steps": 300}
    with pytest.raises(ll.ConfigError, match=r"steps must be in \[1, \d+\] \(the trained recursions\), got 300"):
        model_options(mor, generation_options(given, mor))
    with pytest.raises(ll.ConfigError, match=r"steps must be an integer in \[1, 256\]"):
        generation_options(given, rgpt)
