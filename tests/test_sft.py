"""SFT: the masked loss of every architecture's objective, fbt's prefix at the assistant start, the
sft and extend stages end to end, and exactness at an extended context."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from latentloop.api import build
from latentloop.archs import build_objective
from latentloop.archs.fbt.objective import sft_fuse_mask
from latentloop.cli import main
from latentloop.config import TrainConfig, extended_rope_theta
from latentloop.data import ByteTokenizer
from latentloop.data.chat import (
    FIT_FRACTION,
    SEQUENCE_LEN_STEP,
    assistant_start,
    pack_conversations,
    sequence_len_that_fits,
)
from latentloop.engine import teacher_forced_logits
from latentloop.errors import ConfigError
from latentloop.runs import load_run, save_run
from latentloop.train.stages import EXTEND_LR_SHARE, SFT_LR_SHARE

CHAT = ByteTokenizer(chat=True)


def _batch(seq_len: int = 24):
    """Two packed rows of real rendered conversations: (x, y, loss_mask), and the rendered ones."""
    convs = [CHAT.render([{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}])
             for a, b in ((1, 2), (13, 4), (7, 70), (5, 5))]
    packed, _ = pack_conversations(convs, seq_len, CHAT.pad_id)
    x, y, mask = packed.batch(torch.arange(len(packed.tokens)).numpy())
    return x, y, mask, convs


def _masked_ce(logits, y, mask):
    """The hand-computed reference: the mean cross-entropy over the counted targets only."""
    picked = [F.cross_entropy(logits[b, t][None].float(), y[b, t][None]) for b, t in mask.nonzero().tolist()]
    return torch.stack(picked).mean()


def _model(arch: str, **kw):
    torch.manual_seed(0)
    return build(arch, preset="test", vocab_size=CHAT.vocab_size, **kw)


def test_gpt_sft_loss_is_the_mean_over_assistant_targets_only():
    x, y, mask, _ = _batch()
    model = _model("gpt")
    result = build_objective(model.config, TrainConfig())(model, x, y, 0, loss_mask=mask)
    expected = _masked_ce(model(x).logits, y, mask)
    torch.testing.assert_close(result.loss, expected, rtol=0, atol=1e-5)
    unmasked = build_objective(model.config, TrainConfig())(model, x, y, 0).loss
    assert abs(float(unmasked.detach()) - float(expected.detach())) > 1e-3  # the mask changes what is counted


def test_fbt_prefix_ends_where_the_assistant_turn_begins():
    x, y, mask, convs = _batch()
    fuse = sft_fuse_mask(mask)
    ids, _ = convs[0]
    start = assistant_start(ids, CHAT)  # = len(render_prompt(...)): where generation starts at inference
    assert fuse[0].nonzero()[0].item() == start
    # in every row, an input position is fused exactly when its token was written by the assistant
    packed_mask = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    assert torch.equal(fuse, packed_mask)


def test_fbt_sft_objective_is_the_multipass_loss_with_the_assistant_prefix(monkeypatch):
    x, y, mask, _ = _batch()
    model = _model("fbt", jitter=0.0)
    objective = build_objective(model.config, TrainConfig())
    monkeypatch.setattr(objective, "passes_for_step", lambda step: 3)
    result = objective(model, x, y, 0, loss_mask=mask)
    fuse = sft_fuse_mask(mask) & (x != CHAT.bos_id)
    out = model(x, passes=3, fuse_mask=fuse, return_passes=True)
    losses = [_masked_ce(logits, y, mask) for logits in out.pass_logits]
    lam = model.config.loss_lambda
    torch.testing.assert_close(result.loss, losses[0] + lam / 2 * (losses[1] + losses[2]), rtol=0, atol=1e-5)
    assert result.next_token_loss == pytest.approx(float(losses[0]), abs=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("arch", ["fbt", "rfbt"])
def test_an_sft_runs_soft_score_reads_the_conversations_as_chat_and_training_do(arch):
    """`eval` of an SFT run under soft fused every position, the users' turns included, which neither
    SFT (the replies fused) nor chat (which replays the earlier replies fused) computes. It scores
    the training forward's computation now: fuse_mask = the written inputs, exact (T passes)."""
    from latentloop.eval.loss import decoding_logits, evaluate_batches

    x, y, mask, convs = _batch(seq_len=40)
    model = _model(arch, jitter=0.0).eval().double()
    token_bytes = CHAT.token_byte_lengths()
    scored = evaluate_batches(model, [(x, y, mask)], token_bytes, decoding_logits({"regime": "soft"}))["loss"]
    fuse = sft_fuse_mask(mask) & (x != CHAT.bos_id)
    exact = _masked_ce(model(x, passes=x.shape[1], fuse_mask=fuse).logits, y, mask)
    assert scored == pytest.approx(float(exact), abs=1e-6)  # `_masked_ce` takes the cross-entropy in float32
    everywhere = _masked_ce(model(x, passes=x.shape[1]).logits, y, mask)  # what soft scored before
    assert abs(float(everywhere) - float(exact)) > 1e-4


def test_lrt_sft_objective_masks_each_interleaved_term():
    x, y, mask, _ = _batch()
    model = _model("lrt")
    result = build_objective(model.config, TrainConfig())(model, x, y, 0, loss_mask=mask)
    out = model(x, recurrence="interleaved")
    terms = [_masked_ce(logits, y[:, cols], mask[:, cols]) if mask[:, cols].any() else torch.zeros(())
             for logits, cols in zip(out.pass_logits, out.pass_columns)]
    assert len(terms) == model.config.subsets + 1
    torch.testing.assert_close(result.loss, sum(terms) / len(terms), rtol=0, atol=1e-5)


def test_rgpt_sft_objective_is_the_masked_loss_at_the_drawn_depth():
    x, y, mask, _ = _batch()
    model = _model("rgpt", noise_std=0.0)
    objective = build_objective(model.config, TrainConfig())
    result = objective(model, x, y, 5, loss_mask=mask)
    steps = objective.depth_for_step(5)
    assert result.metrics["steps"] == steps
    torch.testing.assert_close(result.loss, _masked_ce(model(x, steps=steps).logits, y, mask), rtol=0, atol=1e-5)


def _base_run(tmp_path, arch="gpt"):
    base = tmp_path / f"base-{arch}"
    save_run(build(arch, preset="test"), ByteTokenizer(), base)
    return base


@pytest.mark.parametrize("start", [["--stage", "sft"], ["--arch", "fbt"]])
def test_the_same_command_with_a_config_file_plus_resume_resumes_a_run_built_on_a_base(start, tmp_path, capsys):
    """`--config FILE` with `--stage sft` or `--init-from`: the resume took the file alone as the run's
    config, without the base's model, and refused "the same command plus --resume" as a different run
    (model.n_embd 64 there, 128 here). The file is laid over the run's own config instead."""
    base = _base_run(tmp_path)
    config = tmp_path / "recipe.yaml"
    config.write_text("train:\n  batch_size: 2\n  eval_batches: 1\n")
    data = "chat:task:addition_steps:n=60" if "sft" in start else "task:addition:n=200"
    command = ["train", *start, "--init-from", str(base), "--config", str(config), "--data", data,
               "--out", str(tmp_path / "run"), "--no-progress"]
    assert main([*command, "--steps", "2"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*command, "--steps", "3", "--resume"]) == 0, capsys.readouterr().err
    _, _, config_after, checkpoint = load_run(tmp_path / "run")
    assert checkpoint.name == "step_00000003" and config_after.train.batch_size == 2
    config.write_text("model:\n  n_embd: 32\ntrain:\n  batch_size: 2\n")  # a file that changes the model: refused
    assert main([*command, "--steps", "4", "--resume"]) == 2
    assert "holds a different run" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["gpt", "fbt"])
def test_sft_stage_grows_the_vocabulary_trains_and_resumes(tmp_path, capsys, arch):
    base = _base_run(tmp_path, arch)
    out = tmp_path / "sft"
    args = ["train", "--stage", "sft", "--init-from", str(base), "--data", "chat:task:addition_steps:n=200",
            "--steps", "3", "--batch-size", "4", "--out", str(out), "--no-progress", "--json",
            "--set", "eval_batches=1"]
    assert main(args) == 0
    printed = capsys.readouterr()
    summary = json.loads(printed.out)
    assert summary["step"] == 3 and summary["val_loss"] == summary["val_loss"]  # finite, masked val loss
    # it said "same tensors; 0 new tensors" while the vocabulary grew by the 4 chat tokens
    assert "; 4 new token rows (the chat tokens), each the mean of the old rows" in printed.err
    model, tokenizer, config, _ = load_run(out)
    assert tokenizer.chat_tokens is not None and config.model.vocab_size == 263 and config.train.stage == "sft"
    pretraining = TrainConfig()  # both optimizers' peak lrs a fifth of pretraining's (Muon's too, not 0.02)
    assert config.train.optimizer == pretraining.optimizer
    assert (config.train.lr, config.train.muon_lr) == pytest.approx(
        (pretraining.lr * SFT_LR_SHARE, pretraining.muon_lr * SFT_LR_SHARE))
    base_model, _, _, _ = load_run(base)
    # old ids kept their rows until training moved them a little; the new ones started at the mean
    assert model.wte.weight.shape[0] == base_model.wte.weight.shape[0] + 4
    assert main(args[:-4] + ["--resume", "--steps", "4", "--no-progress"]) == 0


@pytest.mark.parametrize("stage", ["sft", "extend"])
def test_a_later_stage_of_a_paper_recipe_fbt_mixes_passes_as_its_base_did_after_feedback_started(tmp_path, stage):
    """The paper recipe's whole-run mix 75/22/3 with feedback from 75% is 0/88/12 per batch after the
    start; a later stage starts feedback at step 0, and kept the whole-run mix there, so it trained
    75% of its batches single-pass. The default recipe's per-batch mix is kept as it is."""
    from latentloop.train.stages import stage_config

    paper = tmp_path / "paper"
    save_run(build("fbt", preset="test", recipe="paper"), ByteTokenizer(), paper)
    extra = ["sequence_len=128"] if stage == "extend" else []
    config = stage_config(stage, paper, extra, data="chat:task:addition_steps:n=50").model
    assert config.feedback_start == 0.0 and config.run_mix is None
    assert config.batch_mix(1000) == pytest.approx((0.0, 0.88, 0.12))
    # a mix or a start of the user's own stands (a derived pass_mix beside their run_mix was refused)
    for mine in (["run_mix=[0.5,0.5]"], ["model.pass_mix=[0.2,0.8]"], ["feedback_start=0.5"]):
        config = stage_config(stage, paper, extra + mine, data="chat:task:addition_steps:n=50").model
        key, value = mine[0].removeprefix("model.").split("=")
        assert getattr(config, key) == pytest.approx(json.loads(value))
    short = tmp_path / "short"
    save_run(build("fbt", preset="test"), ByteTokenizer(), short)
    base = load_run(short)[2].model
    config = stage_config(stage, short, extra, data="chat:task:addition_steps:n=50").model
    assert config.batch_mix(1000) == base.batch_mix(1000) and config.feedback_start == 0.0


def test_extend_stage_scales_rope_theta_and_stays_exact(tmp_path, capsys):
    base = _base_run(tmp_path)
    out = tmp_path / "long"
    code = main(["train", "--stage", "extend", "--init-from", str(base), "--data", "task:addition:n=500",
                 "--set", "sequence_len=128", "--steps", "2", "--batch-size", "2", "--out", str(out),
                 "--no-progress", "--set", "eval_batches=1"])
    err = capsys.readouterr().err
    assert code == 0, err
    model, _, config, _ = load_run(out)
    head_dim = config.model.head_dim
    assert f"extend: context 64 -> 128, RoPE base (rope_theta) 10000 -> {config.model.rope_theta:g}" in err
    assert config.model.sequence_len == 128
    assert (config.train.lr, config.train.muon_lr) == pytest.approx(
        (TrainConfig().lr * EXTEND_LR_SHARE, TrainConfig().muon_lr * EXTEND_LR_SHARE))
    assert config.model.rope_theta == pytest.approx(10000.0 * 2 ** (head_dim / (head_dim - 2)))
    # the slowest rotary pair turns at position 2p by the angle it had at p before the extension
    slow_old = 10000.0 ** (-(head_dim - 2) / head_dim)
    slow_new = config.model.rope_theta ** (-(head_dim - 2) / head_dim)
    assert slow_new * 128 == pytest.approx(slow_old * 64)
    idx = torch.randint(0, 256, (2, 128))
    idx[:, 0] = 256
    torch.testing.assert_close(teacher_forced_logits(model, idx, prompt_len=40), model(idx).logits, rtol=0, atol=1e-5)
    assert main(["train", "--stage", "extend", "--init-from", str(base), "--set", "sequence_len=32",
                 "--out", str(tmp_path / "short"), "--no-progress"]) == 2
    # eval --by-position draws the extended run beside the run it started from (recorded in its checkpoint):
    # the same position ranges, the base's up to its own context, on the run's own windows: the same text at
    # the same positions (it read windows of its own context, half the text the run's two batches read)
    capsys.readouterr()
    assert main(["eval", str(out), "--by-position", "4", "--batches", "2", "--batch-size", "2", "--json",
                 "--data", "task:addition:n=500"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["base"]["run"] == str(base.resolve()) and shown["base"]["sequence_len"] == 64
    assert [(b["start"], b["end"]) for b in shown["by_position"]] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert [(b["start"], b["end"]) for b in shown["base"]["by_position"]] == [(0, 32), (32, 64)]
    from latentloop.runtime import eval_data

    base_model, tokenizer, base_config, _ = load_run(base)
    tokens = eval_data(base_config, tokenizer, "task:addition:n=500").val
    from latentloop.data.loader import eval_batches
    from latentloop.objectives.base import token_cross_entropy

    with torch.no_grad():  # the run's windows of 128, each read up to the base's 64
        per_position = torch.cat([token_cross_entropy(base_model(x[:, :64]).logits, y[:, :64], reduction="none")
                                  .view(-1, 64) for x, y in eval_batches(tokens, 2, 128, 2)])
    by_hand = [per_position[:, :32].mean().item(), per_position[:, 32:].mean().item()]
    assert [b["loss"] for b in shown["base"]["by_position"]] == pytest.approx(by_hand, rel=1e-5)
    assert [b["tokens"] for b in shown["base"]["by_position"]] == [b["tokens"] for b in shown["by_position"][:2]]
    plot = Path(shown["plot"])
    assert plot == out / "evals" / "loss_by_position.png" and plot.stat().st_size > 1000
    # buckets of 128 / 3 positions: the base's context ends inside the second, whose figure it printed
    # beside the run's whole bucket without a word (positions later in a context have lower loss)
    capsys.readouterr()
    assert main(["eval", str(out), "--by-position", "3", "--batches", "1", "--batch-size", "2",
                 "--data", "task:addition:n=500", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    cut = re.findall(r"\* the base's figure covers positions (\d+)-63 only \(its context ends there\), "
                     r"the run's (\d+)-(\d+)", printed)
    assert len(cut) == 1 and cut[0][0] == cut[0][1] and int(cut[0][2]) > 63
    assert re.search(rf"^\s+{cut[0][0]}-{cut[0][2]}\s+\S+\s+\S+\*$", printed, re.M)  # the row is marked
    assert main(["eval", str(out), "--by-position", "4", "--batches", "1", "--data", "task:addition:n=500",
                 "--against", str(tmp_path / "nowhere")]) == 2


def test_conversations_longer_than_the_row_name_a_sequence_len_that_fits(tmp_path, capsys):
    """The README's SFT from a `test` base (rows of 65 tokens): the error names the setting and a
    length; training at that length then holds at least FIT_FRACTION of the conversations whole."""
    base = _base_run(tmp_path)
    chat = tmp_path / "long.jsonl"
    chat.write_text("".join(json.dumps({"question": f"{i} " + "how many? " * (7 + i % 10),
                                        "answer": "it is " * (5 + i % 7) + str(i)}) + "\n" for i in range(200)))
    data = f"chat:{chat}:question=user,answer=assistant"
    args = ["train", "--stage", "sft", "--init-from", str(base), "--data", data, "--steps", "1", "--batch-size", "2",
            "--out", str(tmp_path / "sft"), "--no-progress", "--json", "--set", "eval_batches=1"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fits a row of 65 tokens (sequence_len 64); --set sequence_len=" in err[0], err
    fits = int(err[0].split("--set sequence_len=")[1].split()[0])
    assert fits % SEQUENCE_LEN_STEP == 0 and fits > 64
    assert main(args + ["--set", f"sequence_len={fits}"]) == 0
    # the length: the smallest multiple of the step whose rows hold the fraction whole
    assert sequence_len_that_fits([10] * 9 + [1000]) == SEQUENCE_LEN_STEP
    assert sequence_len_that_fits([65] * 9 + [1000]) == SEQUENCE_LEN_STEP  # a row holds sequence_len + 1
    assert sequence_len_that_fits([66] * 9 + [1000]) == 2 * SEQUENCE_LEN_STEP
    assert sequence_len_that_fits([10] * 8 + [200, 1000]) == 4 * SEQUENCE_LEN_STEP
    assert FIT_FRACTION == 0.9


def test_extended_rope_theta_is_identity_without_extension():
    assert extended_rope_theta(500.0, 16, 256, 256) == 500.0
    assert extended_rope_theta(500.0, 16, 256, 1024) == pytest.approx(500.0 * 4 ** (16 / 14))


def _resolved(*argv: str) -> dict:
    """The run config `latentloop train ARGV` would train, without training."""
    from latentloop.cli.parser import build_parser
    from latentloop.cli.training import _run_config_from_args

    return _run_config_from_args(build_parser().parse_args(["train", *argv])).to_dict()


def test_extend_with_a_config_file_resolves_as_with_the_same_set(tmp_path):
    """`--stage extend --config FILE` took the generic --init-from path: no RoPE scaling, pretraining's
    lrs (12-06 review: "RoPE base 10000 -> 10000"). The file now sits between the stage and the flags."""
    base = _base_run(tmp_path)
    common = ["--stage", "extend", "--init-from", str(base), "--out", str(tmp_path / "long")]
    (tmp_path / "ext.yaml").write_text("model:\n  sequence_len: 128\ntrain:\n  batch_size: 4\n")
    from_file = _resolved(*common, "--config", str(tmp_path / "ext.yaml"))
    assert from_file == _resolved(*common, "--set", "sequence_len=128", "--batch-size", "4")
    head_dim = 64 // 4
    assert from_file["model"]["rope_theta"] == pytest.approx(10000.0 * 2 ** (head_dim / (head_dim - 2)))
    assert (from_file["train"]["lr"], from_file["train"]["muon_lr"], from_file["train"]["stage"]) == pytest.approx(
        (TrainConfig().lr * EXTEND_LR_SHARE, TrainConfig().muon_lr * EXTEND_LR_SHARE, "extend"))
    # the file's own train.stage chooses the stage as --stage does
    (tmp_path / "staged.yaml").write_text("model:\n  sequence_len: 128\ntrain:\n  batch_size: 4\n  stage: extend\n")
    assert _resolved(*common[2:], "--config", str(tmp_path / "staged.yaml")) == from_file


def test_a_stage_config_file_keeps_what_it_sets_itself_and_the_flags_win(tmp_path):
    base, fbt = _base_run(tmp_path), _base_run(tmp_path, "fbt")
    (tmp_path / "own.yaml").write_text("model:\n  sequence_len: 128\n  rope_theta: 50000\ntrain:\n  lr: 0.002\n")
    extend = ["--stage", "extend", "--init-from", str(base), "--config", str(tmp_path / "own.yaml"),
              "--out", str(tmp_path / "long")]
    own = _resolved(*extend)
    assert (own["model"]["rope_theta"], own["train"]["lr"]) == (50000, 0.002)
    assert own["train"]["muon_lr"] == pytest.approx(TrainConfig().muon_lr * EXTEND_LR_SHARE)  # not in the file
    flagged = _resolved(*extend, "--lr", "0.005", "--set", "rope_theta=70000")
    assert (flagged["model"]["rope_theta"], flagged["train"]["lr"]) == (70000, 0.005)
    # sft: the stage's lrs and fbt's own stage default (feedback_start=0) unless the file sets them
    (tmp_path / "sft.yaml").write_text("train:\n  batch_size: 4\n")
    sft = ["--stage", "sft", "--init-from", str(fbt), "--data", "chat:task:addition_steps:n=60",
           "--out", str(tmp_path / "sft")]
    plain = _resolved(*sft, "--config", str(tmp_path / "sft.yaml"))
    assert plain == _resolved(*sft, "--batch-size", "4")
    assert plain["model"]["feedback_start"] == 0.0 and plain["train"]["lr"] == pytest.approx(
        TrainConfig().lr * SFT_LR_SHARE)
    (tmp_path / "sft-own.yaml").write_text("model:\n  feedback_start: 0.25\ntrain:\n  lr: 0.0001\n")
    kept = _resolved(*sft, "--config", str(tmp_path / "sft-own.yaml"))
    assert (kept["model"]["feedback_start"], kept["train"]["lr"]) == (0.25, 0.0001)


def test_a_stage_config_file_that_changes_the_base_model_is_one_line(tmp_path, capsys):
    base = _base_run(tmp_path)
    (tmp_path / "sized.yaml").write_text("model:\n  preset: tiny\n  sequence_len: 128\ndata:\n  tokenizer: bytes\n")
    capsys.readouterr()
    assert main(["train", "--stage", "extend", "--init-from", str(base), "--config", str(tmp_path / "sized.yaml"),
                 "--out", str(tmp_path / "long"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"latentloop: error: --stage extend keeps the base run's arch, shape and tokenizer: drop model.preset, "
        f"data.tokenizer from {tmp_path / 'sized.yaml'}"]
    assert not (tmp_path / "long").exists()
    # another tokenizer alone would not fit the base's embeddings either (it was taken as it stood)
    (tmp_path / "tokenizer.yaml").write_text("model:\n  sequence_len: 128\ndata:\n  tokenizer: bytes\n")
    with pytest.raises(ConfigError, match="drop data.tokenizer from"):
        _resolved("--stage", "extend", "--init-from", str(base), "--config", str(tmp_path / "tokenizer.yaml"),
                  "--out", str(tmp_path / "long"))


def test_stage_mistakes_are_one_line(tmp_path, capsys):
    base = _base_run(tmp_path)
    assert main(["train", "--stage", "sft", "--data", "chat:task:addition", "--out", str(tmp_path / "a")]) == 2
    assert main(["train", "--stage", "sft", "--init-from", str(base), "--data", "stdlib",
                 "--out", str(tmp_path / "b"), "--no-progress"]) == 2
    assert main(["train", "--data", "chat:task:addition", "--out", str(tmp_path / "c"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("latentloop: error:") for line in err)


def test_loss_by_position_averages_each_bucket_of_the_context():
    from latentloop.eval.loss import loss_by_position

    model = _model("gpt")
    tokens = torch.randint(0, 256, (2 * 64 * 3 + 1,)).numpy()
    buckets = loss_by_position(model, tokens, batch_size=4, seq_len=64, buckets=4)
    assert [(b["start"], b["end"]) for b in buckets] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    x = torch.as_tensor(tokens[:6 * 64 + 1].astype("int64"))
    windows = torch.stack([x[i * 64:i * 64 + 65] for i in range(6)])
    with torch.no_grad():
        losses = F.cross_entropy(model(windows[:, :-1]).logits.transpose(1, 2), windows[:, 1:], reduction="none")
    assert buckets[2]["loss"] == pytest.approx(float(losses[:, 32:48].mean()), abs=1e-5)
    assert buckets[0]["tokens"] == 6 * 16


def test_chat_tasks_report_accuracy_and_reasoning_tokens(tmp_path):
    from latentloop.eval.generation import (
        Generation,
        run_generation_tasks,
        task_answer_start,
        tokens_before,
        word_problem_answer_start,
    )

    text = "3+4+0=7,1+2+0=3;37"
    generation = Generation(text, len(text), tuple(text.encode()))
    assert tokens_before(CHAT, generation, task_answer_start(text)) == text.index(";")
    assert word_problem_answer_start("5*2=10 so 10+1=11 #### 11") == 18
    model = _model("rgpt")
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"context": "1+1?", "chain_of_thought": "", "answer": "2"}) + "\n")
    results = run_generation_tasks(model, CHAT, "chat:addition_steps:digits=1,test=2,chat:gsm8k", tmp_path,
                                   {"steps": 2}, limit=3, progress=False)
    assert set(results) == {"chat:addition_steps:digits=1,test=2", "chat:gsm8k"}
    for result in results.values():
        assert result["n"] in (1, 3) and 0 <= result["mean_reasoning_tokens"] <= result["mean_trace_tokens"]
    with pytest.raises(Exception, match="no chat tokens"):
        run_generation_tasks(build("gpt", preset="test"), ByteTokenizer(), "chat:addition", None, limit=1,
                             progress=False)


def test_eval_of_an_sft_run_is_the_masked_loss_on_held_out_conversations(tmp_path, capsys):
    base = _base_run(tmp_path, "fbt")
    out = tmp_path / "sft"
    assert main(["train", "--stage", "sft", "--init-from", str(base), "--data", "chat:task:addition_steps:n=200",
                 "--steps", "2", "--batch-size", "4", "--out", str(out), "--no-progress", "--json",
                 "--set", "eval_batches=2"]) == 0
    trained = json.loads(capsys.readouterr().out)
    # the run's own source is built in (chat:task:...), so eval needs no --data; standard = plain inputs,
    # which is what the trainer's validation scores
    assert main(["eval", str(out), "--regime", "standard", "--batches", "2", "--batch-size", "4", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["loss"] == pytest.approx(trained["val_loss"], abs=1e-5) and scored["tokens"] == trained["val_tokens"]
    assert main(["eval", str(out), "--batches", "1", "--batch-size", "4", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["by_option"]) == {"standard", "soft", "fused"}
    assert main(["eval", str(out), "--passes-curve"]) == 2


def test_an_sft_run_on_a_relative_chat_file_resumes_from_another_folder(tmp_path, monkeypatch):
    """`chat:FILE` was recorded as typed (only `text:` paths were made absolute): a resume from any
    other folder ended in "chat data file not found" (12-06 review)."""
    base = _base_run(tmp_path)
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "c.jsonl").write_text("".join(json.dumps({"question": f"{i}?", "answer": f"it is {i}"}) + "\n"
                                            for i in range(60)))
    monkeypatch.chdir(folder)
    out = tmp_path / "sft"
    common = ["--no-progress", "--set", "eval_batches=1", "--batch-size", "2"]
    assert main(["train", "--stage", "sft", "--init-from", str(base), "--data",
                 "chat:c.jsonl:question=user,answer=assistant", "--steps", "1", "--out", str(out), *common]) == 0
    recorded = json.loads((out / "config.json").read_text())["data"]["source"]
    assert recorded == f"chat:{folder / 'c.jsonl'}:question=user,answer=assistant"
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--out", str(out), "--resume", "--steps", "2", *common]) == 0


@pytest.mark.parametrize("how", ["--tokenizer", "--set data.tokenizer"])
def test_init_from_refuses_a_tokenizer_that_gives_the_bases_ids_other_tokens(tmp_path, capsys, how):
    """The base's token rows were loaded under ids that meant other tokens, without a word, wherever
    the sizes fitted (SFT over `--set data.tokenizer=`, pretraining over `--tokenizer`)."""
    from latentloop.data.tokenizers import BPETokenizer

    base = _base_run(tmp_path)  # the byte tokenizer: 259 ids
    other = BPETokenizer.train(["the cat sat on the mat " * 40], 300).save(tmp_path / "bpe")
    if how == "--tokenizer":
        args = ["train", "--init-from", str(base), "--tokenizer", str(other), "--data", "task:addition:n=200"]
    else:
        args = ["train", "--stage", "sft", "--init-from", str(base), "--set", f"data.tokenizer={other}",
                "--data", "chat:task:addition_steps:n=200"]
    out = tmp_path / "run"
    assert main([*args, "--steps", "1", "--batch-size", "2", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "this run's tokenizer" in err and "train with the base's tokenizer" in err and "Traceback" not in err
    assert not out.exists()
    # the base's own tokenizer with the chat tokens appended (SFT of an SFT run's base) is the same ids
    from latentloop.train.start import check_tokenizer_of_base

    check_tokenizer_of_base(ByteTokenizer().with_chat_tokens(), base)


def test_eval_on_the_runs_own_chat_file_warns_when_its_val_split_is_not_the_one_set_aside(tmp_path, capsys):
    """A chat file's split changed rule on 12-07 (its line, then its messages), and a file may change after
    training: evaluated on it, an SFT run scored a val split that may hold conversations it trained on,
    without a word. Its own split: silent; another: a warning naming why."""
    chat = tmp_path / "c.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(12) for b in range(12)]
    chat.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "sft"
    assert main(["train", "--stage", "sft", "--init-from", str(_base_run(tmp_path)), "--data", f"chat:{chat}",
                 "--out", str(run), "--steps", "2", "--no-progress", "--set", "train.batch_size=2",
                 "--set", "train.eval_batches=1"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["eval", str(run), "--data", f"chat:{chat}"]) == 0
    assert "is not the one this run set aside" not in capsys.readouterr().err
    more = [{"messages": [{"role": "user", "content": f"{a}*{b}="}, {"role": "assistant", "content": str(a * b)}]}
            for a in range(12) for b in range(12)]
    chat.write_text("".join(json.dumps(row) + "\n" for row in rows + more))  # changed since: a new val split
    assert main(["eval", str(run), "--data", f"chat:{chat}"]) == 0
    assert "is not the one this run set aside when it trained" in capsys.readouterr().err
