"""The architecture contract, driven by the registry: every architecture in `ARCHS`, under each of its
declared option sets, through the command line's `generate` and `chat`.

No architecture is named here: registering one adds it to every check. Option sets come from the
declarations (`DecodeOption`): the defaults, each choice of every choice-option, and the minimum of
every numeric one (with the choice of the option it depends on that makes it apply).
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from latentloop import build
from latentloop.archs import ARCHS, get_arch
from latentloop.cli import main
from latentloop.data.tokenizers import ByteTokenizer
from latentloop.engine import generate, model_options, stream, teacher_forced_logits
from latentloop.errors import ConfigError
from latentloop.models.options import DecodeOption
from latentloop.runtime import load_run, save_run

PROMPT = "hi"
NEW_TOKENS = 4


def option_sets(options: tuple[DecodeOption, ...]) -> dict[str, dict]:
    """{label: options given}: the defaults, then one set per declared choice and numeric edge."""
    sets: dict[str, dict] = {"defaults": {}}
    for option in options:
        values = list(option.choices) if option.choices else \
            [option.kind(option.minimum)] * (option.minimum is not None) + list(option.keywords)
        for value in values:
            given = {option.name: value}
            if option.applies_if is not None:
                other, applies = option.applies_if
                given[other] = applies[0]
            sets[",".join(f"{k}={v}" for k, v in given.items())] = given
    return sets


def _flags(given: dict) -> list[str]:
    return [part for name, value in given.items() for part in (f"--{name.replace('_', '-')}", str(value))]


CASES = [(arch, label, given) for arch in ARCHS for label, given in option_sets(get_arch(arch).options).items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per architecture: a random `test`-preset run and a short SFT of it (chat tokens)."""
    root = tmp_path_factory.mktemp("contract")
    made = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        base = root / f"{arch}-base"
        save_run(build(arch, preset="test"), ByteTokenizer(), base)
        sft = root / f"{arch}-sft"
        assert main(["train", "--stage", "sft", "--init-from", str(base), "--data", "chat:task:addition_steps:n=64",
                     "--steps", "2", "--batch-size", "2", "--out", str(sft), "--no-progress",
                     "--set", "eval_batches=1"]) == 0, arch
        made[arch] = (base, sft)
    return made


def test_option_sets_cover_every_declared_choice():
    for arch, spec in ARCHS.items():
        labels = option_sets(spec.options)
        for option in spec.options:
            for choice in option.choices:
                assert any(given.get(option.name) == choice for given in labels.values()), (arch, option.name)


@pytest.mark.parametrize("arch, label, given", CASES, ids=[f"{a}-{label}" for a, label, _ in CASES])
def test_cli_generate_equals_the_api_for_every_option_set(arch, label, given, runs, capsys):
    base, _ = runs[arch]
    capsys.readouterr()
    code = main(["generate", str(base), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                 "--temperature", "0", "--json", *_flags(given)])
    out = capsys.readouterr()
    assert code == 0, out.err
    ids = json.loads(out.out)["ids"]
    model, tokenizer, _, _ = load_run(base)
    prompt_ids = [tokenizer.bos_id] + tokenizer.encode(PROMPT)
    expected = generate(model, prompt_ids, NEW_TOKENS, temperature=0.0,
                        stop_tokens=[tokenizer.eos_id, tokenizer.bos_id], **given)
    assert ids == expected


@pytest.mark.parametrize("arch, label, given", CASES, ids=[f"{a}-{label}" for a, label, _ in CASES])
def test_cli_chat_after_sft_answers_for_every_option_set(arch, label, given, runs, capsys, monkeypatch):
    _, sft = runs[arch]
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("what is 2+2?\n/reset\nand 3+4?\n/quit\n"))
    code = main(["chat", str(sft), "--max-new-tokens", "3", *_flags(given)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.count("> ") >= 3 and "[new conversation]" in out.out


# -- the decoding contract, through the API ---------------------------------------------------------
TOL = 1e-5  # fp32: two paths computing the same function (the decoding protocol's bar)
BOS = 256  # the byte tokenizer's
PROMPTS = ([BOS, *b"hello"], [BOS, *b"a latent"])  # of different lengths: a ragged batch
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def models():
    made = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        made[arch] = build(arch, preset="test").eval()
    return made


def _decode(model, prompt, given, **kwargs):
    steps = list(stream(model, prompt, DECODE_STEPS, temperature=0.0, logprobs=True, **given, **kwargs))
    return [s.tokens[0] for s in steps], torch.tensor([s.logprobs[0] for s in steps])


def _exact_cache(model, given) -> bool:
    """Whether the declarations call the cache exact with these options. An approximate cache (rgpt's
    mean / last) makes decoding depend on how tokens are grouped into calls, so neither the reference
    path nor teacher-forced scoring (the rest of a text in one call) computes what token-by-token
    decoding does."""
    filled = model_options(model, given)
    return all(option.exact_with_cache(filled[option.name]) for option in model.OPTIONS)


def _has_a_reference(model, given) -> bool:
    """Whether the uncached reference path is defined for these options (some need the cache)."""
    try:
        model_options(model, given, cached=False)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("arch, label, given", CASES, ids=[f"{a}-{label}" for a, label, _ in CASES])
def test_cached_decoding_equals_the_reference_path_and_scoring(arch, label, given, models):
    model = models[arch]
    prompt = PROMPTS[0]
    tokens, logprobs = _decode(model, prompt, given)
    if not _exact_cache(model, given):
        pytest.skip(f"{label}: the declaration calls this cache approximate")
    if _has_a_reference(model, given):
        ref_tokens, ref_logprobs = _decode(model, prompt, given, use_cache=False)
        assert tokens == ref_tokens
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=TOL)
    full = torch.tensor([prompt + tokens])
    scored = teacher_forced_logits(model, full, prompt_len=len(prompt), **given)  # (1, T, V)
    scored = torch.log_softmax(scored[0, len(prompt) - 1:-1].float(), -1)
    torch.testing.assert_close(scored.gather(-1, torch.tensor(tokens)[:, None])[:, 0], logprobs, rtol=0, atol=TOL)


@pytest.mark.parametrize("arch, label, given", CASES, ids=[f"{a}-{label}" for a, label, _ in CASES])
def test_a_ragged_batch_decodes_each_row_as_alone(arch, label, given, models):
    model = models[arch]
    declared = {option.name: option for option in model.OPTIONS}
    filled = model_options(model, given)
    if any(declared[name].couples_rows is not None and declared[name].couples_rows(value)
           for name, value in filled.items()):
        pytest.skip(f"{label}: the declaration says a row may decode differently in a batch")
    together = generate(model, list(PROMPTS), DECODE_STEPS, temperature=0.0, **given)
    alone = [generate(model, prompt, DECODE_STEPS, temperature=0.0, **given) for prompt in PROMPTS]
    assert together == alone
