"""`eval.loss.score_run`, the one scoring of a run under each of its architecture's ways (what
`latentloop eval`, the demo's report and the CPU comparison print): each way equals the loss
computed directly from the engine's teacher-forced logits, and `eval` and the demo show exactly it."""

from __future__ import annotations

import json
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from latentloop import demo
from latentloop.archs import ARCHS
from latentloop.cli import main
from latentloop.data import eval_batches
from latentloop.engine import teacher_forced_logits
from latentloop.errors import ConfigError
from latentloop.eval import score_run, text_batches
from latentloop.runs import load_run
from latentloop.runtime import eval_data

BATCH, BATCHES = 2, 1


def _loaded(run, corpus):
    model, tokenizer, config, _ = load_run(run, torch.device("cpu"))
    return model, tokenizer, config, eval_data(config, tokenizer, f"text:{corpus}").val


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_way_is_the_mean_loss_of_the_engine_logits(arch, tiny_run, tiny_corpus):
    model, tokenizer, config, tokens = _loaded(tiny_run(arch), tiny_corpus)
    batches = partial(eval_batches, tokens, BATCH, config.model.sequence_len, BATCHES)
    scores = score_run(model, batches, tokenizer.token_byte_lengths())
    modes = model.scoring_modes(config.model)
    assert list(scores) == list(modes)  # the architecture's own ways, in its order
    for label, options in modes.items():
        losses = torch.cat([F.cross_entropy(teacher_forced_logits(model, x, **options).flatten(0, 1).float(),
                                            y.flatten(), reduction="none") for x, y in batches()])
        assert scores[label]["tokens"] == losses.numel() == BATCHES * BATCH * config.model.sequence_len
        torch.testing.assert_close(torch.tensor(scores[label]["loss"]), losses.double().mean().float(),
                                   rtol=0, atol=1e-5, msg=f"{arch} {label}")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_eval_and_the_demo_report_what_score_run_gives(arch, tiny_run, tiny_corpus, capsys, monkeypatch):
    run = tiny_run(arch)
    model, tokenizer, config, tokens = _loaded(run, tiny_corpus)
    capsys.readouterr()
    assert main(["eval", str(run), "--json", "--batch-size", str(BATCH), "--batches", str(BATCHES),
                 "--data", f"text:{tiny_corpus}"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = score_run(model, text_batches(tokens, BATCH, config.model.sequence_len, BATCHES,
                                             bos_id=tokenizer.bos_id), tokenizer.token_byte_lengths())
    keys = ("loss", "ppl", "bpb", "tokens", "documents", "loss_ci", "bpb_ci", "interval")
    shown = printed.get("by_option", {printed["scored_as"]: {k: printed[k] for k in keys}})
    assert shown == expected  # the same numbers, not merely close: one code path
    # the demo scores its trained state the same way, over its EVAL_BATCHES validation batches spread over the split
    monkeypatch.setattr(demo, "EVAL_BATCHES", BATCHES)
    state = SimpleNamespace(config=config, model=model, tokenizer=tokenizer, data=SimpleNamespace(val=tokens))
    assert demo.score_options(state) == score_run(
        model, text_batches(tokens, config.train.batch_size, config.model.sequence_len, BATCHES, spread=True,
                            bos_id=tokenizer.bos_id), tokenizer.token_byte_lengths())


def test_every_way_is_checked_before_the_first_batch(tiny_run):
    model, tokenizer, _, _ = load_run(tiny_run("gpt"), torch.device("cpu"))

    def batches():
        raise AssertionError("a batch was read before the options were checked")

    with pytest.raises(ConfigError, match="regime"):
        score_run(model, batches, tokenizer.token_byte_lengths(), {"plain": {}, "odd": {"regime": "soft"}})
