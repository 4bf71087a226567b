"""Trainer: exact resume, checkpoints, run-folder safety, BPB arithmetic, Muon and schedules."""

import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import latentloop as ll
from latentloop import checkpoint as ckpt
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.errors import NonFiniteError
from latentloop.eval import evaluate_loss
from latentloop.optim import lr_multiplier
from latentloop.train import fit, setup, validate


def _config(corpus, steps=6, **train):
    train = {"steps": steps, "batch_size": 4, "eval_every": 0, "eval_batches": 2, "log_every": 1,
             "warmup_steps": 2, "save_every": 3, **train}
    return RunConfig(model=model_config("gpt", "test", sequence_len=32),
                     train=TrainConfig(**train), data=DataConfig(source=f"text:{corpus}"))


def _weights(run_dir):
    return load_file(str(sorted((run_dir / "checkpoints").iterdir())[-1] / "model.safetensors"))


@pytest.mark.parametrize("optimizer,dtype", [("adamw", "float32"), ("muon", "float32"), ("adamw", "bfloat16"),
                                             ("muon", "bfloat16")])
def test_resume_is_bit_identical(corpus, tmp_path, optimizer, dtype):
    train = dict(optimizer=optimizer, grad_accum=2, dtype=dtype)
    straight = setup(_config(corpus, **train), tmp_path / "a", progress=False)
    fit(straight, progress=False)

    half = _config(corpus, steps=3, **train)
    fit(setup(half, tmp_path / "b", progress=False), progress=False)
    resumed = setup(_config(corpus, **train), tmp_path / "b", resume=True, progress=False)
    assert resumed.step == 3
    summary = fit(resumed, progress=False)
    assert summary["precision"] == dtype

    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]  # no duplicated steps after resume


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_resume_with_changed_optimizer_settings_trains_with_them(corpus, tmp_path, capsys, optimizer):
    """The saved optimizer states keep their moments, but the settings (base lr, weight decay, betas)
    are the resumed run's: the checkpoint's came back with its state and the run trained on at its old
    lr while logging the new one. The change is said; the run's config.json holds them from the next
    checkpoint on (`test_changed_settings_reach_config_json_with_the_first_checkpoint_made_under_them`)."""
    fit(setup(_config(corpus, steps=3, optimizer=optimizer), tmp_path / "run", progress=False), progress=False)
    changed = _config(corpus, steps=6, optimizer=optimizer, lr=0.05, muon_lr=0.07, weight_decay=0.3)
    capsys.readouterr()
    resumed = setup(changed, tmp_path / "run", resume=True, progress=False)
    fresh = setup(_config(corpus, steps=6, optimizer=optimizer, lr=0.05, muon_lr=0.07, weight_decay=0.3),
                  tmp_path / "fresh", progress=False)  # what this config builds
    for opt, reference in zip(resumed.optimizers, fresh.optimizers, strict=True):
        for group, want in zip(opt.param_groups, reference.param_groups, strict=True):
            assert {k: v for k, v in group.items() if k != "params"} == \
                {k: v for k, v in want.items() if k != "params"}
        assert opt.state  # the moments came back
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert "resuming with changed train settings" in said and "lr: 0.003 -> 0.05" in said
    assert "the lr schedule" in said  # steps changed
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["lr"] == 0.003  # until a save
    for opened in (resumed, fresh):
        opened.lock.release()


def test_cuda_rng_states_of_more_devices_than_are_visible_restore_the_visible_ones(monkeypatch):
    from latentloop.train import resume

    saved = resume._rng_state()
    saved["cuda"] = [[1] * 16, [2] * 16, [3] * 16]  # three devices saved; one visible now
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((device, state[0].item())))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(("all", len(states))))
    resume._set_rng_state(saved)
    assert restored == [(0, 1)]


def test_a_resume_that_fails_leaves_the_runs_config_as_it_was(corpus, tmp_path, capsys):
    fit(setup(_config(corpus, steps=3), tmp_path / "run", progress=False), progress=False)
    before = (tmp_path / "run" / "config.json").read_text()
    for checkpoint in ckpt.list_checkpoints(tmp_path / "run"):
        (checkpoint / "state.json").write_text("{")
    capsys.readouterr()
    with pytest.raises(ll.CheckpointError, match="cannot resume"):
        setup(_config(corpus, steps=6, lr=0.05), tmp_path / "run", resume=True, progress=False)
    assert (tmp_path / "run" / "config.json").read_text() == before
    assert "changed train settings" not in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("seed", 7), ("optimizer", "adamw"), ("stage", "extend")])
def test_a_resume_that_changes_the_seed_or_the_optimizer_is_refused_in_one_line(corpus, tmp_path, field, value):
    fit(setup(_config(corpus, steps=3), tmp_path / "run", progress=False), progress=False)
    with pytest.raises(ll.CheckpointError, match=f"train.{field} {value!r}: it ran with .*--init-from"):
        setup(_config(corpus, steps=6, **{field: value}), tmp_path / "run", resume=True, progress=False)


def test_a_micro_batch_past_the_devices_memory_is_refused_before_anything_is_built(corpus, tmp_path, monkeypatch):
    """`--batch-size 1e11` built window ids for minutes before failing: one line now, nothing written.
    The bound is the micro-batch's token ids and embeddings (here 4 x (33 x 8 + 32 x n_embd x 4) bytes)."""
    from latentloop.train import memory

    config = _config(corpus, batch_size=10 ** 11)
    with pytest.raises(ll.ConfigError, match=r"train.batch_size=100,000,000,000: .* GiB, more than the"):
        setup(config, tmp_path / "huge", progress=False)
    assert not (tmp_path / "huge").exists()
    least = 4 * (33 * 8 + 32 * config.model.n_embd * 4)  # batch 4 at sequence_len 32
    monkeypatch.setattr(memory, "memory_limit_bytes", lambda: least - 1)
    with pytest.raises(ll.ConfigError, match="train.batch_size=4: "):
        setup(_config(corpus), tmp_path / "short", progress=False)
    # at the bound this check lets it through, and the plan's estimate of a whole step refuses it
    monkeypatch.setattr(memory, "memory_limit_bytes", lambda: least)
    with pytest.raises(ll.ConfigError, match="one training step is planned to hold"):
        setup(_config(corpus, steps=1), tmp_path / "fits", progress=False)
    assert not (tmp_path / "fits").exists()


def test_training_lowers_loss_and_keeps_last_checkpoints(corpus, tmp_path):
    state = setup(_config(corpus, steps=12, save_every=2, keep_last=2, lr=1e-2), tmp_path / "run", progress=False)
    before = validate(state)["loss"]
    summary = fit(state, progress=False)
    assert summary["val_loss"] < before - 0.5
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step_00000010", "step_00000012"]
    model, tokenizer = ll.load(tmp_path / "run")
    ids = ll.generate(model, [tokenizer.bos_id], 5, temperature=0.0)
    assert len(ids) == 5


def test_run_folder_is_never_clobbered(corpus, tmp_path):
    fit(setup(_config(corpus, steps=2), tmp_path / "run", progress=False), progress=False)
    before = (tmp_path / "run" / "config.json").read_text()
    with pytest.raises(ll.CheckpointError, match="already holds a run"):
        setup(_config(corpus, steps=2), tmp_path / "run", progress=False)
    other = _config(corpus, steps=4)
    other.model.n_layer = 3
    with pytest.raises(ll.CheckpointError, match="n_layer"):
        setup(other, tmp_path / "run", resume=True, progress=False)
    assert (tmp_path / "run" / "config.json").read_text() == before
    (tmp_path / "stranger").mkdir()
    (tmp_path / "stranger" / "notes.txt").write_text("mine")
    with pytest.raises(ll.CheckpointError, match="not empty"):
        setup(_config(corpus), tmp_path / "stranger", progress=False)
    with pytest.raises(ll.DataError):
        setup(RunConfig(data=DataConfig(source=f"text:{tmp_path / 'missing'}")), tmp_path / "new", progress=False)
    assert not (tmp_path / "new").exists()  # nothing half-written


def _ctrl_c_at_batch(state, batch: int, presses: int = 1) -> None:
    """The loader's `batch`-th draw sends this process SIGINT `presses` times (a user's Ctrl+C)."""
    import os
    import signal

    draw, calls = state.loader.next_batch, [0]

    def next_batch():
        calls[0] += 1
        if calls[0] == batch:
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)
        return draw()

    state.loader.next_batch = next_batch


def test_ctrl_c_stops_after_its_step_saves_and_the_resumed_run_equals_a_straight_one(corpus, tmp_path):
    """The first Ctrl+C finishes the step it lands in, then validates and saves as a run's end does
    (with save_every 0 nothing was saved, and the folder could be neither resumed nor reused); the
    resumed run equals an uninterrupted one bit for bit. A second Ctrl+C stops at once, unsaved."""
    import signal

    found = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a job started with `&`
    straight = setup(_config(corpus, save_every=0), tmp_path / "straight", progress=False)
    fit(straight, progress=False)
    state = setup(_config(corpus, save_every=0), tmp_path / "run", progress=False)
    _ctrl_c_at_batch(state, 3)
    summary = fit(state, progress=False)
    assert summary["interrupted"] and summary["step"] == 3 and summary["checkpoint"].endswith("step_00000003")
    assert signal.getsignal(signal.SIGINT) is found  # given back
    resumed = setup(_config(corpus, save_every=0), tmp_path / "run", resume=True, progress=False)
    assert resumed.step == 3 and not fit(resumed, progress=False)["interrupted"]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)
    twice = setup(_config(corpus, save_every=0), tmp_path / "twice", progress=False)
    _ctrl_c_at_batch(twice, 3, presses=2)
    with pytest.raises(KeyboardInterrupt):
        fit(twice, progress=False)
    assert not (tmp_path / "twice" / "checkpoints").exists() or not any((tmp_path / "twice" / "checkpoints").iterdir())


def test_a_stop_on_an_eval_and_save_step_validates_once_and_saves_before_validating(corpus, tmp_path, monkeypatch):
    """A Ctrl+C (or torchrun's SIGTERM) that lands on a step due for validation and a checkpoint: the
    step is validated and saved once (both were done on schedule, then again as the run's end), and
    the checkpoint comes first, so a signal's grace period goes to what must not be lost."""
    from latentloop.train import loop

    order: list[str] = []
    validate_, save_ = loop.validate, loop.save
    monkeypatch.setattr(loop, "validate", lambda state, *a: order.append("validate") or validate_(state, *a))
    monkeypatch.setattr(loop, "save", lambda state: order.append("save") or save_(state))
    state = setup(_config(corpus, steps=6, eval_every=3, save_every=3), tmp_path / "run", progress=False)
    _ctrl_c_at_batch(state, 3)
    summary = fit(state, progress=False)
    assert summary["interrupted"] and summary["step"] == 3 and summary["val_loss"] > 0
    assert order == ["save", "validate"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [3]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000003"]
    # a second Ctrl+C during that save ("it stops once the checkpoint is written"): saved, not validated
    order.clear()
    monkeypatch.setattr(loop, "save", _pressing_ctrl_c(lambda state: order.append("save") or save_(state)))
    again = setup(_config(corpus, steps=6, eval_every=0, save_every=0), tmp_path / "again", progress=False)
    _ctrl_c_at_batch(again, 2)
    summary = fit(again, progress=False)
    assert summary["interrupted"] and summary["validation_skipped"] and order == ["save"]
    assert (tmp_path / "again" / "checkpoints" / "step_00000002" / "model.safetensors").is_file()


def test_tokens_per_second_counts_the_steps_time_not_validations(corpus, tmp_path, monkeypatch):
    """`tok_per_s` is the window's tokens over the steps' own time (the `elapsed` the rows log): a
    validation between two log rows counted in it, and throughput seemed to dip after every one."""
    import time

    from latentloop.train import loop

    validate_ = loop.validate
    monkeypatch.setattr(loop, "validate", lambda state, *a: time.sleep(0.3) or validate_(state, *a))
    fit(setup(_config(corpus, steps=6, eval_every=2, log_every=2, save_every=0), tmp_path / "run", progress=False),
        progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert len(train_rows) == 3
    for before, row in zip(train_rows, train_rows[1:]):
        steps_time = row["elapsed"] - before["elapsed"]
        assert row["tok_per_s"] == pytest.approx((row["tokens"] - before["tokens"]) / steps_time, rel=1e-6)


def test_a_step_before_a_validation_or_save_waits_for_its_kernels_inside_its_own_time(corpus, tmp_path, monkeypatch):
    """On an accelerator a step's kernels run after its host code: a validation or checkpoint that
    follows a step which does not log would wait for them outside the steps' time, and `elapsed`
    and `tok_per_s` would read high. Such a step reads the device (the guard's check) within its
    time, as a logging step does."""
    from latentloop.train import loop

    checked = []
    state = setup(_config(corpus, steps=6, eval_every=2, log_every=3, save_every=5), tmp_path / "run", progress=False)
    monkeypatch.setattr(loop.FiniteGuard, "check", lambda guard: checked.append(state.step))
    fit(state, progress=False)
    # validations at 2 and 4, a save at 5 (which checks the guard again before it writes), log rows at 3 and 6
    assert checked[:5] == [2, 3, 4, 5, 5] and set(checked) == {2, 3, 4, 5, 6}


def _pressing_ctrl_c(function):
    """`function(state)` after this process gets SIGINT (a user's Ctrl+C as it starts)."""
    import os
    import signal

    def pressed(state):
        os.kill(os.getpid(), signal.SIGINT)
        return function(state)
    return pressed


def _fit_with_ctrl_c_at_a_line(state, when) -> dict:
    """`fit(state)` with a SIGINT handled at the first line `_fit` runs once `when()` is true (as the interpreter
    may handle a real one there): the installed handler is called in that line's frame, once."""
    import signal
    import sys

    from latentloop.train import loop

    delivered = []

    def tracer(frame, event, arg):
        if frame.f_code is not loop._fit.__code__:
            return None

        def lines(frame, event, arg):
            if event == "line" and when() and not delivered:
                delivered.append(True)
                signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)
            return lines
        return lines

    sys.settrace(tracer)
    try:
        summary = fit(state, progress=False)
    finally:
        sys.settrace(None)
    assert delivered, "the line was never reached"
    return summary


def test_ctrl_c_just_after_the_final_validation_returns_still_saves(corpus, tmp_path, monkeypatch):
    """A Ctrl+C handled in the lines between the final validation's return and the phase's move to
    "saving" raised the skip outside its `try`: the run ended unsaved (with save_every 0, all of it). And a
    second Ctrl+C handled at the first line after a skip was raised again, outside the try, with the same
    end. The signal is delivered at those lines as the interpreter may deliver it there."""
    import signal

    from latentloop.train import loop

    validate_, returned = loop.validate, []

    def validated(state):
        out = validate_(state)
        returned.append(True)
        return out

    monkeypatch.setattr(loop, "validate", validated)
    state = setup(_config(corpus, steps=2, save_every=0), tmp_path / "run", progress=False)
    summary = _fit_with_ctrl_c_at_a_line(state, lambda: bool(returned))
    assert summary["validation_skipped"] and "val_loss" not in summary
    assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "model.safetensors").is_file()

    pressed = []

    def interrupted(state):  # the first Ctrl+C, inside the validation: skipped
        pressed.append(True)
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)

    monkeypatch.setattr(loop, "validate", interrupted)
    state = setup(_config(corpus, steps=2, save_every=0), tmp_path / "twice", progress=False)
    summary = _fit_with_ctrl_c_at_a_line(state, lambda: bool(pressed))  # the second, just after the skip
    assert summary["validation_skipped"]
    assert (tmp_path / "twice" / "checkpoints" / "step_00000002" / "model.safetensors").is_file()


def test_ctrl_c_in_the_final_validation_or_save_still_saves_and_one_in_the_last_step_is_no_interruption(
        corpus, tmp_path, monkeypatch):
    """The handler stays until the final checkpoint is written: a Ctrl+C in the final validation
    drops the validation and saves (the handler was restored before it, and with save_every 0 the
    whole run was lost); one in the save is waited out. One during the last step, honoured after
    it, leaves a finished run, not an interrupted one."""
    import signal

    from latentloop.train import loop

    found = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a job started with `&`
    validate_, save_ = loop.validate, loop.save
    monkeypatch.setattr(loop, "validate", _pressing_ctrl_c(validate_))
    summary = fit(setup(_config(corpus, steps=3, save_every=0), tmp_path / "in-val", progress=False), progress=False)
    assert summary["validation_skipped"] and not summary["interrupted"] and "val_loss" not in summary
    assert (tmp_path / "in-val" / "checkpoints" / "step_00000003" / "model.safetensors").is_file()
    assert signal.getsignal(signal.SIGINT) is found  # given back
    monkeypatch.setattr(loop, "validate", validate_)
    monkeypatch.setattr(loop, "save", _pressing_ctrl_c(save_))
    summary = fit(setup(_config(corpus, steps=3, save_every=0), tmp_path / "in-save", progress=False), progress=False)
    assert not summary["validation_skipped"] and summary["val_loss"] > 0
    assert (tmp_path / "in-save" / "checkpoints" / "step_00000003" / "model.safetensors").is_file()
    monkeypatch.setattr(loop, "save", save_)
    log_ = loop._log

    def pressed_while_logging_the_final_row(state, row):
        if "val_loss" in row:
            _pressing_ctrl_c(lambda state: None)(state)
        log_(state, row)
    monkeypatch.setattr(loop, "_log", pressed_while_logging_the_final_row)  # trackers may take seconds here
    summary = fit(setup(_config(corpus, steps=3, save_every=0), tmp_path / "in-log", progress=False), progress=False)
    assert summary["val_loss"] > 0 and summary["checkpoint"].endswith("step_00000003")
    monkeypatch.setattr(loop, "_log", log_)
    state = setup(_config(corpus, steps=3, save_every=0), tmp_path / "last", progress=False)
    _ctrl_c_at_batch(state, 3)
    summary = fit(state, progress=False)
    assert summary["step"] == 3 and not summary["interrupted"] and summary["val_loss"] > 0


def test_a_finished_run_resumed_trains_logs_and_saves_nothing_and_fewer_steps_are_refused(corpus, tmp_path):
    """Resuming a finished run appended a second final validation row and saved again; `--steps`
    below the saved step said "trained for 6 steps" and saved the checkpoint with the lower count."""
    fit(setup(_config(corpus, steps=4), tmp_path / "run", progress=False), progress=False)
    log = (tmp_path / "run" / "metrics.jsonl").read_text()
    saved = (tmp_path / "run" / "checkpoints" / "step_00000004" / "config.json").read_text()
    summary = fit(setup(_config(corpus, steps=4), tmp_path / "run", resume=True, progress=False), progress=False)
    assert summary["nothing_to_train"] and summary["step"] == 4 and summary["checkpoint"].endswith("step_00000004")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == log
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "config.json").read_text() == saved
    with pytest.raises(ll.ConfigError, match="train.steps=3 is below the step 4 this run resumes at") as refused:
        setup(_config(corpus, steps=3), tmp_path / "run", resume=True, progress=False)
    assert getattr(refused.value, "shared", False)  # every rank resumes the same step: said once under torchrun
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "config.json").read_text() == saved


def test_changed_settings_reach_config_json_with_the_first_checkpoint_made_under_them(corpus, tmp_path):
    """A resume with a new lr that dies before its first checkpoint leaves config.json as it was (it
    was written at once, and a later plain --resume trained at the new lr without saying so)."""
    fit(setup(_config(corpus, steps=2), tmp_path / "run", progress=False), progress=False)
    before = json.loads((tmp_path / "run" / "config.json").read_text())
    died = setup(_config(corpus, steps=4, lr=0.5), tmp_path / "run", resume=True, progress=False)
    died.lock.release()  # the process is gone: nothing trained, nothing saved
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == before
    fit(setup(_config(corpus, steps=4, lr=0.5), tmp_path / "run", resume=True, progress=False), progress=False)
    run = tmp_path / "run"
    for config in (run / "config.json", run / "checkpoints" / "step_00000004" / "config.json"):
        assert json.loads(config.read_text())["train"]["lr"] == 0.5


def test_a_resume_finds_its_data_tokenizer_and_trainer_state_as_well_as_they_can_be_found(corpus, tmp_path,
                                                                                       monkeypatch, capsys):
    """From another folder with a relative data path (the path was recorded as typed); with the run
    folder's tokenizer.json gone (the checkpoints hold checked copies); past a newest checkpoint whose
    trainer.json is gone (its checksums name it: damaged, set aside, not "weights only")."""
    monkeypatch.chdir(corpus.parent)
    fit(setup(_config(corpus.name, steps=4, save_every=2), tmp_path / "run", progress=False), progress=False)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["source"] == f"text:{corpus}"
    (tmp_path / "run" / "tokenizer.json").unlink()
    (tmp_path / "run" / "checkpoints" / "step_00000004" / "trainer.json").unlink()
    monkeypatch.chdir(tmp_path)
    state = setup(_config(str(corpus), steps=6), tmp_path / "run", resume=True, progress=False)
    assert state.step == 2 and "trainer.json" in capsys.readouterr().err
    assert fit(state, progress=False)["step"] == 6


def test_a_mix_with_a_relative_text_path_resumes_from_another_folder(corpus, tmp_path, monkeypatch):
    """A `mix:` source's `text:` part was recorded as typed (only a top-level `text:` was made
    absolute), so a resume from another folder read another path, or none."""
    monkeypatch.chdir(corpus.parent)
    config = _config(corpus, steps=4, save_every=2)
    config.data.source = f"mix:stdlib+text:{corpus.name}"
    fit(setup(config, tmp_path / "run", progress=False), progress=False)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["source"] == \
        f"mix:stdlib+text:{corpus}"
    monkeypatch.chdir(tmp_path)
    again = _config(corpus, steps=6, save_every=2)
    again.data.source = f"mix:stdlib+text:{corpus}"
    state = setup(again, tmp_path / "run", resume=True, progress=False)
    assert state.step == 4 and fit(state, progress=False)["step"] == 6


def test_a_checkpoint_folder_given_as_the_run_is_refused_and_left_untouched(corpus, tmp_path):
    fit(setup(_config(corpus, steps=2), tmp_path / "run", progress=False), progress=False)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    files = sorted(p.name for p in checkpoint.iterdir())
    with pytest.raises(ll.CheckpointError, match="is a checkpoint folder; give its run folder"):
        setup(_config(corpus, steps=4), checkpoint, resume=True, progress=False)
    assert sorted(p.name for p in checkpoint.iterdir()) == files


@pytest.mark.parametrize("weights", [False, True])
def test_a_folder_with_a_config_json_that_is_not_a_runs_is_refused_and_left_untouched(corpus, tmp_path, weights):
    """A Hugging Face folder (any folder with a config.json) as --out was taken for a run that stopped
    before its first save: its config.json and tokenizer.json were overwritten, exit 0 (12-07 review).
    With a model.safetensors it was called a checkpoint folder whose run folder was its parent's parent."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    if weights:
        (folder / "model.safetensors").write_bytes(b"weights")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    words = "holds model weights and is not a run folder" if weights else "config.json is not a latentloop run's"
    for resume in (False, True):
        with pytest.raises(ll.CheckpointError, match=words):
            setup(_config(corpus, steps=2), folder, resume=resume, progress=False)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_validation_split_shorter_than_a_window_is_refused_before_training(tmp_path):
    """It was found by the run's final validation, after every step, and the run ended unsaved."""
    text = tmp_path / "short.txt"
    text.write_text("a few hundred bytes of text. " * 10)  # 5% of 290 tokens: 14, and a window is 33
    with pytest.raises(ll.DataError, match="the validation split holds 1[0-9] tokens .* needs sequence_len \\+ 1 = 33"):
        setup(_config(text), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_that_stopped_before_its_first_checkpoint_starts_again_in_its_folder(corpus, tmp_path, monkeypatch):
    """A run that diverged (or was killed) before saving left a folder that refused both a new run
    ("already holds a run") and --resume ("no checkpoint"); its log is kept aside."""
    from latentloop.train import loop

    def diverge(*args, **kwargs):
        raise NonFiniteError("training diverged at step 1")
    monkeypatch.setattr(loop, "train_step", diverge)
    with pytest.raises(NonFiniteError):
        fit(setup(_config(corpus, eval_every=1), tmp_path / "run", progress=False), progress=False)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # what the stopped run logged
    monkeypatch.undo()
    with pytest.raises(ll.CheckpointError, match="start it again without --resume"):
        setup(_config(corpus), tmp_path / "run", resume=True, progress=False)
    # it stops before its first save once more, and is started again: both stopped logs are kept
    monkeypatch.setattr(loop, "train_step", diverge)
    with pytest.raises(NonFiniteError):
        fit(setup(_config(corpus, eval_every=1), tmp_path / "run", progress=False), progress=False)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 8.0}\n')
    # killed during its first save: a cut-short `.tmp-` folder is no checkpoint (the run was told to pass
    # --resume, then that it held no checkpoint); and its trackers' files (TensorBoard drew the dead run's
    # steps beside the new run's, W&B continued its id) are kept aside with its log
    partial = tmp_path / "run" / "checkpoints" / ".tmp-step_00000003"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"\0" * 10)
    for tracker in ("tensorboard", "wandb"):
        (tmp_path / "run" / tracker).mkdir()
        (tmp_path / "run" / tracker / "from-the-stopped-run").write_text("x")
    monkeypatch.undo()
    summary = fit(setup(_config(corpus, steps=2), tmp_path / "run", progress=False), progress=False)
    assert summary["step"] == 2
    assert (tmp_path / "run" / "metrics-stopped.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert (tmp_path / "run" / "metrics-stopped-2.jsonl").read_text() == '{"step": 1, "loss": 8.0}\n'
    for tracker in ("tensorboard", "wandb"):
        assert (tmp_path / "run" / f"{tracker}-stopped" / "from-the-stopped-run").is_file()
        assert not (tmp_path / "run" / tracker / "from-the-stopped-run").exists()
    with pytest.raises(ll.CheckpointError, match="already holds a run"):  # now it has a checkpoint
        setup(_config(corpus, steps=2), tmp_path / "run", progress=False)


def test_a_resume_keeps_the_good_metrics_rows_of_a_damaged_log(corpus, tmp_path):
    """Rows past the checkpoint, cut short, not UTF-8, or with a step that is not a number are
    dropped; the rest are kept. A binary row ended the resume in UnicodeDecodeError, a text step in
    TypeError."""
    fit(setup(_config(corpus, steps=3), tmp_path / "run", progress=False), progress=False)
    log = tmp_path / "run" / "metrics.jsonl"
    good = log.read_text().splitlines()
    with open(log, "ab") as f:
        f.write(b'\xff\xfe\n{"step": "abc"}\n{"step": 2, "loss": 1.0, "cut sh')
    resumed = setup(_config(corpus, steps=4), tmp_path / "run", resume=True, progress=False)
    assert resumed.step == 3
    assert log.read_text().splitlines() == good


def test_corrupt_checkpoint_is_a_clear_error(corpus, tmp_path):
    fit(setup(_config(corpus, steps=2), tmp_path / "run", progress=False), progress=False)
    weights = next((tmp_path / "run" / "checkpoints").iterdir()) / "model.safetensors"
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(ll.CheckpointError, match="model.safetensors is corrupt: its sha256 differs"):
        ll.load(tmp_path / "run")
    ckpt.write_checksums(weights.parent)  # a checkpoint saved so (checksums that agree): safetensors refuses it
    with pytest.raises(ll.CheckpointError, match="cannot read weights"):
        ll.load(tmp_path / "run")


def test_bpb_is_nats_over_bytes_without_specials():
    model = ll.build("gpt", preset="test", sequence_len=8).eval()
    tokens = np.array([256, 104, 105, 33, 256, 200, 201, 65, 66], dtype=np.uint16)  # BOS h i ! BOS ...
    byte_lengths = np.ones(259, dtype=np.int64)
    byte_lengths[256:] = 0
    result = evaluate_loss(model, tokens, byte_lengths, batch_size=1, seq_len=8)
    with torch.no_grad():
        logits = model(torch.tensor(tokens[:8][None].astype(np.int64))).logits[0]
    targets = torch.tensor(tokens[1:].astype(np.int64))
    nats = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    real = targets < 256
    assert result["loss"] == pytest.approx(nats.mean().item(), rel=1e-6)
    assert result["bpb"] == pytest.approx(nats[real].sum().item() / math.log(2) / int(real.sum()), rel=1e-6)


def test_schedules():
    cosine = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, cosine) == pytest.approx(0.1)
    assert lr_multiplier(9, cosine) == pytest.approx(1.0)
    assert lr_multiplier(99, cosine) == pytest.approx(0.1, abs=1e-3)
    wsd = TrainConfig(steps=100, warmup_steps=10, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    assert lr_multiplier(50, wsd) == 1.0 and lr_multiplier(79, wsd) == 1.0
    assert lr_multiplier(89, wsd) == pytest.approx(0.5)
    assert lr_multiplier(99, wsd) == pytest.approx(0.0)
    # a warmup past the decay's start: the decay follows the warmup, never a jump from the peak to half
    # of it (1.0 -> 0.505 at 90 of 100 steps, 12-07 review)
    late = TrainConfig(steps=100, warmup_steps=90, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.1)
    multipliers = [lr_multiplier(step, late) for step in range(100)]
    assert multipliers[89] == pytest.approx(1.0) and multipliers[99] == pytest.approx(0.1)
    assert all(later < earlier for earlier, later in zip(multipliers[89:], multipliers[90:]))
    assert max(earlier - later for earlier, later in zip(multipliers[89:], multipliers[90:])) < 0.1


def test_a_warmup_as_long_as_the_run_is_said(corpus, tmp_path, capsys):
    """A short try at warmup's default (20 steps) never reached the peak lr or decayed, silently."""
    setup(_config(corpus, steps=4, warmup_steps=8), tmp_path / "short", progress=False)
    assert ("train.warmup_steps=8 is not below train.steps=4: the learning rate only warms up (to 50% of its peak) "
            "and never decays") in capsys.readouterr().err
    setup(_config(corpus, steps=4, warmup_steps=2), tmp_path / "fine", progress=False)
    assert "warmup" not in capsys.readouterr().err


def test_a_train_split_smaller_than_one_batch_is_said(tmp_path, capsys):
    """A corpus of 10 windows trained with batches of 16, each repeating windows, without a word."""
    small = tmp_path / "small.txt"
    small.write_text("the quick brown fox jumps over the lazy dog. " * 30)  # ~1,350 bytes
    config = RunConfig(model=model_config("gpt", "test", sequence_len=32),
                       train=TrainConfig(steps=1, batch_size=64, device="cpu", warmup_steps=0),
                       data=DataConfig(source=f"text:{small}", val_fraction=0.5, cache_dir=str(tmp_path / "cache")))
    setup(config, tmp_path / "run", progress=False)
    err = capsys.readouterr().err
    assert "windows of 33 tokens, fewer than one batch of 64: every batch repeats windows" in err, err


# A 16 MiB tensor allocated and freed again and again: with glibc's defaults much of each allocation
# is fresh memory from the OS (first-touch page faults of 4 KiB); kept in the process, almost none.
ALLOC_CHURN = """
import resource, sys, torch
from latentloop.runtime import keep_freed_memory

def faults_per_allocation():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.ones(4 * 2**20)  # 16 MiB, freed at once
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20

default = faults_per_allocation()
assert keep_freed_memory()
faults_per_allocation()  # the first allocation after the switch may still come fresh
print(default, faults_per_allocation())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_keep_freed_memory_stops_the_page_fault_churn():
    result = subprocess.run([sys.executable, "-c", ALLOC_CHURN], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    default, kept = map(float, result.stdout.split())
    if default < 100:  # measured ~400 here; a malloc that already keeps its memory leaves nothing to show
        pytest.skip(f"no page-fault churn with this malloc's defaults ({default:.0f} per allocation)")
    assert kept < default / 20, (default, kept)


def test_precision_is_resolved_and_noted(monkeypatch):
    from latentloop import runtime

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # a GPU from Ampere on: auto is bf16; before it bf16 is emulated, so auto is fp32 and the note says why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert runtime.resolve_dtype(cuda, "auto") == "bfloat16"
    assert "no native bf16" not in runtime.precision_note(cuda, "auto")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert runtime.resolve_dtype(cuda, "auto") == "float32" and runtime.resolve_dtype(cuda, "bfloat16") == "bfloat16"
    assert "compute capability 7.0) has no native bf16" in runtime.precision_note(cuda, "auto")
    assert "emulated" in runtime.precision_note(cuda, "bfloat16")
    # FSDP2's mixed-precision policy computes in bf16 where the run's autocast does, and only there
    from latentloop.parallel import _bf16_on_gpu

    assert not _bf16_on_gpu(TrainConfig(), cuda) and _bf16_on_gpu(TrainConfig(dtype="bfloat16"), cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert _bf16_on_gpu(TrainConfig(), cuda) and not _bf16_on_gpu(TrainConfig(), cpu)
    assert runtime.resolve_dtype(cpu, "bfloat16") == "bfloat16"
    # a CPU with bf16 instructions: auto is bf16, and float32 still means fp32
    monkeypatch.setattr(runtime, "cpu_bf16_support", lambda: "avx512_bf16")
    assert runtime.resolve_dtype(cpu, "auto") == "bfloat16" and runtime.resolve_dtype(cpu, "float32") == "float32"
    assert "bf16 autocast" in runtime.precision_note(cpu, "auto") and "avx512_bf16" in runtime.precision_note(
        cpu, "auto")
    assert "fp32 throughout" in runtime.precision_note(cpu, "float32")
    with runtime.autocast_for(cpu, "auto"):
        assert torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.bfloat16
    # one without: auto is fp32, and an explicit bf16 is named as emulated
    monkeypatch.setattr(runtime, "cpu_bf16_support", lambda: None)
    assert runtime.resolve_dtype(cpu, "auto") == "float32"
    assert "fp32 throughout" in runtime.precision_note(cpu, "auto")
    assert "emulated" in runtime.precision_note(cpu, "bfloat16")
    assert "emulated" not in runtime.precision_note(cpu, "float32")
    with runtime.autocast_for(cpu, "bfloat16"):
        assert torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.bfloat16
    with runtime.autocast_for(cpu, "auto"):
        assert torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float32


def test_cpu_bf16_switch_reads_the_environment(monkeypatch):
    """LATENTLOOP_CPU_BF16=0 hides the CPU's bf16 instructions (auto trains in fp32); any other value
    leaves the detection to /proc/cpuinfo (read by `latentloop.precision`)."""
    from latentloop import precision, runtime

    monkeypatch.setenv(runtime.CPU_BF16_ENV, "0")
    assert runtime.cpu_bf16_support() is None and runtime.resolve_dtype(torch.device("cpu"), "auto") == "float32"
    monkeypatch.setenv(runtime.CPU_BF16_ENV, "1")
    monkeypatch.setattr(precision, "open", lambda *a, **k: io.StringIO("processor: 0\nflags\t: fpu avx2 avx512_bf16\n"),
                        raising=False)
    assert runtime.cpu_bf16_support() == "avx512_bf16"
    monkeypatch.setattr(precision, "open", lambda *a, **k: io.StringIO("processor: 0\nflags\t: fpu avx2\n"))
    assert runtime.cpu_bf16_support() is None


def test_every_rank_draws_training_noise_from_a_stream_of_its_own():
    """rank_seed(seed, rank): distinct for every rank and every seed (with 3+ processes, ranks 1 and up
    shared one stream when the rank was ignored; rank 0 never calls it), and the same on every call."""
    from latentloop.train import rank_seed

    seeds = {(seed, rank): rank_seed(seed, rank) for seed in (0, 1, 1234) for rank in range(8)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= value < 2**63 for value in seeds.values())  # a valid torch seed
    assert rank_seed(1234, 3) == seeds[(1234, 3)]
    streams = []
    for rank in (1, 2, 3):
        torch.manual_seed(rank_seed(0, rank))
        streams.append(torch.rand(4))
    assert not torch.equal(streams[0], streams[1]) and not torch.equal(streams[1], streams[2])


def test_a_checkpoint_that_fails_part_way_leaves_the_configured_optimizer_settings(monkeypatch):
    """Loading brings back the saved run's lr; the configured one was put back only after a load that
    succeeded, so a checkpoint failing after its first optimizer's state left the next one tried with
    the failed checkpoint's settings."""
    from types import SimpleNamespace

    from latentloop.train import resume

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-3, weight_decay=0.1)

    def fails_part_way(state, checkpoint, trainer, weights):
        state.optimizers[0].param_groups[0].update(lr=9.0, weight_decay=0.5)  # the saved run's, loaded
        raise ll.CheckpointError("the second optimizer's state is corrupt")

    monkeypatch.setattr(resume, "_load_saved_states", fails_part_way)
    with pytest.raises(ll.CheckpointError):
        resume._load_states(SimpleNamespace(optimizers=[optimizer]), None, {}, None)
    assert optimizer.param_groups[0]["lr"] == 3e-3 and optimizer.param_groups[0]["weight_decay"] == 0.1


def test_a_deadline_passed_during_validation_stops_one_process_before_the_next_step(corpus, tmp_path, monkeypatch):
    """`fit(max_seconds=)`: one process checks its deadline before every step (only under several
    processes is it agreed at logging steps); a validation that ran past it is not followed by a step."""
    import latentloop.train.loop as loop

    real = loop.validate

    def slow(state, max_batches=None):
        time.sleep(0.5)
        return real(state, max_batches)

    monkeypatch.setattr(loop, "validate", slow)
    state = setup(_config(corpus, steps=20, eval_every=1, log_every=1), tmp_path / "run", progress=False)
    fit(state, progress=False, max_seconds=0.3)
    assert state.step == 1


def test_a_run_resumes_on_its_data_moved_to_another_path_and_not_on_other_data(corpus, tmp_path, capsys):
    """The data moved (another disk, another machine): `--set data.source=` with its new path was refused as
    "a different run". It resumes now, its token shards checked against the checkpoint's (sha256), and the
    run's config takes the new path; data that tokenizes otherwise is still refused, naming why."""
    import shutil

    run = tmp_path / "run"
    summary = fit(setup(_config(corpus, steps=3), run, progress=False), progress=False)
    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(corpus, moved)
    shutil.rmtree(corpus)
    config = _config(moved, steps=5)
    state = setup(config, run, resume=True, progress=False)
    assert state.step == summary["step"] == 3
    assert "resuming on data given by another path" in capsys.readouterr().err
    fit(state, progress=False)
    saved = json.loads((run / "config.json").read_text())["data"]["source"]
    assert saved.endswith(str(moved)), saved  # the next resume reads the new path
    other = tmp_path / "other"
    shutil.copytree(moved, other)
    first = sorted(other.glob("*.txt"))[0]
    first.write_text(first.read_text().upper())
    with pytest.raises(ll.DataError, match="the token data of .* changed since checkpoint"):
        setup(_config(other, steps=7), run, resume=True, progress=False)


def test_a_source_no_checksum_proves_the_same_data_is_refused_naming_the_trained_one(corpus, tmp_path):
    """A resume may name its data by another path because the checkpoint's shard checksums prove it the same
    data. A checkpoint from before they were recorded was resumed on any folder unchecked: refused now, naming
    the source it was trained on; a refusal of other data (here another task) names it too."""
    import dataclasses
    import shutil

    from latentloop.checkpoint import add_checksum

    task_run = tmp_path / "task-run"
    on_addition = dataclasses.replace(_config(corpus, steps=3), data=DataConfig(source="task:addition"))
    fit(setup(on_addition, task_run, progress=False), progress=False)
    other_task = dataclasses.replace(_config(corpus, steps=5), data=DataConfig(source="task:multiplication"))
    with pytest.raises(ll.DataError, match="changed since checkpoint .*where it was trained on 'task:addition'"):
        setup(other_task, task_run, resume=True, progress=False)
    assert setup(dataclasses.replace(on_addition, train=other_task.train), task_run, resume=True,
                 progress=False).step == 3  # its own task resumes

    run = tmp_path / "run"
    fit(setup(_config(corpus, steps=3), run, progress=False), progress=False)
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    state_json = json.loads((checkpoint / "state.json").read_text())
    del state_json["data"]  # as a checkpoint saved before the shards' checksums were recorded
    (checkpoint / "state.json").write_text(json.dumps(state_json))
    add_checksum(checkpoint, "state.json")  # its manifest agrees with the edit
    moved = tmp_path / "elsewhere"
    shutil.copytree(corpus, moved)
    with pytest.raises(ll.DataError, match="records no checksums of its token data"):
        setup(_config(moved, steps=5), run, resume=True, progress=False)
    assert setup(_config(corpus, steps=5), run, resume=True, progress=False).step == 3
