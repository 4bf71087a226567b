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
from latentloop.engine import generate
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
