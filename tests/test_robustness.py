"""Hostile input and hostile timing: pickles in checkpoints, diverging runs, two writers, kills during
saves, foreign tokenizers, corrupted shards, unwritable outputs, untrusted run configs."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import latentloop as ll
from latentloop import checkpoint as ckpt
from latentloop import runs, runtime
from latentloop.archs import ARCHS
from latentloop.cli import main
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.data import ByteTokenizer, load_tokenizer, parse_source, prepare_tokens
from latentloop.data.shards import scan_shard
from latentloop.errors import CheckpointError, ConfigError, DataError, NonFiniteError, OutputError
from latentloop.optim import build_optimizers
from latentloop.train import FiniteGuard, fit, setup
from latentloop.train import start as train_module  # where setup reads the data
from latentloop.train.resume import save


def _config(corpus, steps=3, **train):
    train = {"steps": steps, "batch_size": 4, "eval_every": 0, "eval_batches": 1, "log_every": 1,
             "warmup_steps": 1, "save_every": 1, "keep_last": 1, **train}
    return RunConfig(model=model_config("gpt", "test", sequence_len=32),
                     train=TrainConfig(**train), data=DataConfig(source=f"text:{corpus}"))


def _train(corpus, run, steps=3, **train):
    fit(setup(_config(corpus, steps, **train), run, progress=False), progress=False)
    return run


def _strict_rows(path):
    """metrics.jsonl parsed as strict JSON: a bare NaN / Infinity fails."""
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _one_line_exit_2(argv, capsys) -> str:
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own rejections
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------------------------
# 1. no pickle on any load path
# --------------------------------------------------------------------------------------------


class _Payload:
    """Unpickling this opens (creates) the marker file: code run by loading a checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_in_a_checkpoint_never_runs(corpus, tmp_path):
    run = _train(corpus, tmp_path / "run", steps=2)
    checkpoint = ckpt.resolve_checkpoint(run)
    assert {p.name for p in checkpoint.iterdir()} >= {ckpt.TRAINER_JSON, ckpt.TRAINER_TENSORS}
    assert not (checkpoint / ckpt.LEGACY_TRAINER).exists()
    marker = tmp_path / "pwned"
    torch.save({"optimizers": [_Payload(marker)], "rng": {}}, checkpoint / ckpt.LEGACY_TRAINER)

    resumed = setup(_config(corpus, 2), run, resume=True, progress=False)  # a stray trainer.pt is never read
    assert resumed.step == 2 and not marker.exists()
    resumed.lock.release()

    (checkpoint / ckpt.TRAINER_JSON).unlink()  # now only the planted pickle holds the trainer state
    (checkpoint / ckpt.CHECKSUMS).unlink()  # as in a checkpoint of the version that wrote trainer.pt
    with pytest.raises(CheckpointError, match="trainer.pt is an older pickle format"):
        setup(_config(corpus, 2), run, resume=True, progress=False)
    assert not marker.exists()


def test_a_legacy_trainer_pt_of_plain_tensors_is_read_with_weights_only(corpus, tmp_path):
    run = _train(corpus, tmp_path / "run", steps=2)
    checkpoint = ckpt.resolve_checkpoint(run)
    trainer = ckpt.read_trainer_state(checkpoint)[1]
    torch.save(trainer, checkpoint / ckpt.LEGACY_TRAINER)
    (checkpoint / ckpt.TRAINER_JSON).unlink()
    (checkpoint / ckpt.TRAINER_TENSORS).unlink()
    (checkpoint / ckpt.CHECKSUMS).unlink()  # that version recorded none
    state = setup(_config(corpus, 2), run, resume=True, progress=False)
    assert state.step == 2
    saved = trainer["optimizers"][0]["state"]
    assert all(torch.equal(state.optimizers[0].state_dict()["state"][i]["exp_avg"], saved[i]["exp_avg"])
               for i in saved)
    state.lock.release()


def test_optimizer_and_rng_state_round_trip_exactly_through_safetensors_and_json(tmp_path):
    model = ll.build("gpt", preset="test", n_layer=1)
    optimizers = build_optimizers(model, TrainConfig(optimizer="muon", betas=(0.9, 0.95)))
    for _ in range(2):
        model(torch.randint(0, 259, (2, 8))).logits.square().mean().backward()
        for opt in optimizers:
            opt.step()
    state = {"optimizers": [opt.state_dict() for opt in optimizers],
             "rng": {"numpy": [v.tolist() if isinstance(v, np.ndarray) else v for v in np.random.get_state()],
                     "torch": torch.get_rng_state().tolist(), "python": random.getstate(),
                     "odd": {"inf": float("inf"), "tuple": (1, 2.5)}}}
    meta, tensors = ckpt.flatten_state(state)
    save_file(tensors, str(tmp_path / "t.safetensors"))
    (tmp_path / "t.json").write_text(json.dumps(meta, allow_nan=False))
    back = ckpt.unflatten_state(json.loads((tmp_path / "t.json").read_text()),
                                load_file(str(tmp_path / "t.safetensors")))

    def assert_same(a, b):
        assert type(a) is type(b), (a, b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            for key in a:
                assert_same(a[key], b[key])
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert_same(x, y)
        else:
            assert a == b

    assert_same(state, back)
    assert any("momentum_buffer" in key for key in tensors)  # Muon's buffers are among the tensors
    assert isinstance(back["optimizers"][0]["param_groups"][0]["betas"], tuple)


# --------------------------------------------------------------------------------------------
# 2. non-finite values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--lr", "inf"], ["--lr", "nan"], ["--set", "logit_softcap=inf"],
                                   ["--set", "betas=[0.9,.nan]"], ["--set", "train.min_lr_ratio=.inf"]])
def test_non_finite_config_values_are_rejected(flags, tmp_path, capsys):
    err = _one_line_exit_2(["train", "--preset", "test", "--out", tmp_path / "x", *flags], capsys)
    assert "finite" in err
    assert not (tmp_path / "x").exists()


def test_non_finite_values_are_rejected_in_python_too():
    with pytest.raises(ConfigError, match="lr must be a finite"):
        TrainConfig(lr=float("inf"))
    with pytest.raises(ConfigError, match="logit_softcap must be a finite"):
        model_config("gpt", "test", logit_softcap=float("inf"))
    with pytest.raises(ConfigError, match="val_fraction"):
        DataConfig(val_fraction=float("nan"))


@pytest.mark.parametrize("where, grad_clip", [("loss", 1.0), ("gradient", 1.0), ("gradient", 0.0)])
def test_a_diverging_run_stops_naming_the_step_and_keeps_its_last_good_checkpoint(corpus, tmp_path, monkeypatch,
                                                                                   where, grad_clip):
    state = setup(_config(corpus, steps=6, grad_clip=grad_clip), tmp_path / "run", progress=False)
    objective_class = type(state.objective)
    healthy_plan, healthy_loss = objective_class.plan, objective_class.loss
    bad_step = 3  # the 1-based step that goes wrong; steps 1 and 2 are saved
    drawn = []  # the steps whose plans were drawn: the trainer draws each step's plan, then runs its loss

    def plan(self, step, x, loss_mask=None, draw=0):
        drawn.append(step)
        return healthy_plan(self, step, x, loss_mask, draw)

    def poisoned(self, model, x, y, loss_mask=None, **plan):
        result = healthy_loss(self, model, x, y, loss_mask, **plan)
        if drawn[-1] + 1 == bad_step and where == "loss":
            result.loss = result.loss * float("nan")
        elif drawn[-1] + 1 == bad_step:
            model.lm_head.weight.register_hook(lambda grad: grad * float("inf"))
        return result

    monkeypatch.setattr(objective_class, "plan", plan)
    monkeypatch.setattr(objective_class, "loss", poisoned)
    with pytest.raises(NonFiniteError, match=f"diverged at step {bad_step}: the {where}"):
        fit(state, progress=False)
    names = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()]
    assert names == ["step_00000002"]
    weights = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert [r["step"] for r in _strict_rows(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert not state.lock.held  # a failed fit lets go of the run folder


def test_a_huge_learning_rate_ends_the_cli_run_with_one_line(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    err = _one_line_exit_2(["train", "--preset", "test", "--data", f"text:{corpus}", "--steps", "6", "--lr", "1e30",
                            "--out", run, "--set", "batch_size=4", "--set", "sequence_len=32", "--set", "save_every=1",
                            "--set", "warmup_steps=2", "--no-progress"], capsys)
    assert "training diverged at step" in err
    for checkpoint in ckpt.list_checkpoints(run):  # whatever was saved before the divergence is finite
        assert ckpt._first_non_finite(load_file(str(checkpoint / "model.safetensors"))) is None
    _strict_rows(run / "metrics.jsonl")


def test_the_deferred_guard_names_the_first_bad_step():
    guard = FiniteGuard(torch.device("cpu"), deferred=True)  # as on an accelerator: no host read per step
    guard.observe_grad_norm(torch.tensor(1.0), 1)
    guard.observe_loss(torch.tensor(2.0), 2)
    guard.observe_grad_norm(torch.tensor(float("nan")), 2)  # no exception yet: nothing was read back
    guard.observe_loss(torch.tensor(float("inf")), 3)
    with pytest.raises(NonFiniteError, match="at step 2: the gradient norm"):
        guard.check()
    guard = FiniteGuard(torch.device("cpu"), deferred=True)
    guard.observe_loss(torch.tensor(float("nan")), 4)  # the loss, too, stays on the device until checked
    guard.observe_grad_norm(torch.tensor(float("nan")), 5)
    with pytest.raises(NonFiniteError, match="at step 4: the loss"):
        guard.check()


def test_non_finite_weights_are_never_saved_nor_rotate_out_a_good_checkpoint(tmp_path):
    model = ll.build("gpt", preset="test", n_layer=1)
    ckpt.save_checkpoint(tmp_path, 1, model, {}, {"step": 1}, keep_last=1)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="lm_head.weight"):
        ckpt.save_checkpoint(tmp_path, 2, model, {}, {"step": 2}, keep_last=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]


@pytest.mark.parametrize("device, words", [("gpu", "unknown device 'gpu'"), ("cuda:x", "unknown device 'cuda:x'"),
                                           ("cuda:99", "device 'cuda:99' requested but"),
                                           ("cpu:5", "there is one CPU device")])
def test_loading_onto_a_device_there_is_not_is_a_config_error(tiny_run, device, words):
    """`ll.load(run, device=...)` checks the device as `train --device` does, before reading the run:
    torch's own RuntimeError or AssertionError for "gpu" or a CUDA a CPU build lacks is not a user's message."""
    with pytest.raises(ConfigError, match=words):
        ll.load(tiny_run("gpt"), device=device)


def test_loading_non_finite_weights_is_a_one_line_error(tiny_run_copy, capsys):
    run = tiny_run_copy("gpt")
    file = ckpt.resolve_checkpoint(run) / "model.safetensors"
    weights = load_file(str(file))
    weights["wte.weight"][3, 3] = float("inf")
    save_file(weights, str(file))
    ckpt.write_checksums(file.parent)  # checksums that agree: non-finite weights are refused all the same
    with pytest.raises(CheckpointError, match="NaN or inf"):
        ll.load(run)
    err = _one_line_exit_2(["generate", run, "--prompt", "a"], capsys)
    assert "wte.weight" in err


# --------------------------------------------------------------------------------------------
# 3. one writer per run folder
# --------------------------------------------------------------------------------------------


def test_a_second_training_into_a_locked_run_folder_is_refused(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    first = setup(_config(corpus, steps=2), run, progress=False)  # holds RUN/.lock until fit ends
    metrics_before = (run / "metrics.jsonl").read_text()
    err = _one_line_exit_2(["train", "--out", run, "--resume", "--no-progress"], capsys)
    assert "in use" in err
    with pytest.raises(CheckpointError, match="in use"):
        setup(_config(corpus, steps=2), tmp_path / "run", resume=True, progress=False)
    assert (run / "metrics.jsonl").read_text() == metrics_before
    fit(first, progress=False)  # releases the lock: now a resume may go ahead
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-progress"]) == 0


def test_two_new_runs_racing_for_one_empty_folder(corpus, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    real_prepare = train_module.prepare_data

    others = []

    def meanwhile_another_run_starts(*args, **kwargs):  # both saw an empty folder; the other one locked first
        monkeypatch.setattr(train_module, "prepare_data", real_prepare)
        others.append(setup(_config(corpus, steps=2), run, progress=False))  # and holds it, training
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(train_module, "prepare_data", meanwhile_another_run_starts)
    try:
        with pytest.raises(CheckpointError, match="is in use"):  # a run without a checkpoint yet, but alive
            setup(_config(corpus, steps=3), run, progress=False)
        assert json.loads((run / "config.json").read_text())["train"]["steps"] == 2
        fit(others[0], progress=False)
    finally:
        others[0].lock.release()
    with pytest.raises(CheckpointError, match="already holds a run"):  # it has its checkpoint now
        setup(_config(corpus, steps=3), run, progress=False)


# --------------------------------------------------------------------------------------------
# 4. interrupted saves and resuming
# --------------------------------------------------------------------------------------------


def test_a_kill_while_re_saving_a_step_loses_nothing(corpus, tmp_path, monkeypatch, capsys):
    run = _train(corpus, tmp_path / "run", steps=3)
    rows = (run / "metrics.jsonl").read_text()
    real_replace = os.replace

    def killed_before_the_new_copy_is_in_place(src, dst):
        if os.path.basename(str(src)).startswith(ckpt.TMP_PREFIX):
            raise SystemExit("SIGKILL")  # not an OSError: no cleanup runs, as with a real kill
        real_replace(src, dst)

    resumed = setup(_config(corpus, 3), run, resume=True, progress=False)
    monkeypatch.setattr(os, "replace", killed_before_the_new_copy_is_in_place)
    try:
        with pytest.raises(SystemExit):  # a save at the step it resumed from re-saves that step
            save(resumed)
    finally:
        resumed.lock.release()
    monkeypatch.setattr(os, "replace", real_replace)
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [".old-step_00000003", ".tmp-step_00000003"]

    model, _ = ll.load(run)  # a reader finds the copy set aside
    assert model is not None
    capsys.readouterr()
    state = setup(_config(corpus, 3), run, resume=True, progress=False)
    assert state.step == 3  # not a restart from step 0
    assert "recovered checkpoint step_00000003" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000003"]
    assert (run / "metrics.jsonl").read_text().startswith(rows)  # nothing truncated
    state.lock.release()


def test_resume_falls_back_to_the_newest_loadable_checkpoint(corpus, tmp_path, capsys):
    run = _train(corpus, tmp_path / "run", steps=4, save_every=2, keep_last=2)
    (run / "checkpoints" / "step_00000004" / "model.safetensors").write_bytes(b"cut short")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a line torn by the crash
    capsys.readouterr()
    state = setup(_config(corpus, 4, save_every=2, keep_last=2), run, resume=True, progress=False)
    assert state.step == 2
    err = capsys.readouterr().err
    assert "resumed from step_00000002" in err and len(err.strip().splitlines()) == 1
    assert [r["step"] for r in _strict_rows(run / "metrics.jsonl")] == [1, 2]
    assert (run / "checkpoints" / ".bad-step_00000004").is_dir()  # kept, but no longer "the latest"
    fit(state, progress=False)
    straight = _train(corpus, tmp_path / "straight", steps=4, save_every=2, keep_last=2)
    a, b = (load_file(str(ckpt.resolve_checkpoint(r) / "model.safetensors")) for r in (run, straight))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_this_machine_cannot_read_now_is_not_set_aside(corpus, tmp_path, monkeypatch):
    """An I/O error while reading the newest checkpoint is this machine's, not the checkpoint's: the
    resume stops in one error and nothing is moved or trimmed (setting it aside rewound the run and
    cut its metrics for good)."""
    run = _train(corpus, tmp_path / "run", steps=4, save_every=2, keep_last=2)
    metrics = (run / "metrics.jsonl").read_text()
    real = ckpt.sha256_file

    def failing_read(path):
        if "step_00000004" in str(path):
            raise OSError(5, "Input/output error")
        return real(path)

    monkeypatch.setattr(ckpt, "sha256_file", failing_read)
    with pytest.raises(CheckpointError, match="Input/output error.*nothing was set aside"):
        setup(_config(corpus, 4, save_every=2, keep_last=2), run, resume=True, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert (run / "metrics.jsonl").read_text() == metrics


def test_resume_without_any_loadable_checkpoint_is_refused_not_restarted(corpus, tmp_path, capsys):
    run = _train(corpus, tmp_path / "run", steps=2)
    metrics = (run / "metrics.jsonl").read_text()
    for checkpoint in ckpt.list_checkpoints(run):
        (checkpoint / "state.json").write_text("{")
    err = _one_line_exit_2(["train", "--out", run, "--resume", "--no-progress"], capsys)
    assert "no checkpoint" in err and "loads" in err
    shutil.rmtree(run / "checkpoints")
    err = _one_line_exit_2(["train", "--out", run, "--resume", "--no-progress"], capsys)
    assert "holds no checkpoint" in err
    assert (run / "metrics.jsonl").read_text() == metrics and metrics


def test_saves_fsync_every_file_and_folder(tmp_path, monkeypatch):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name the fsynced descriptors")
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    model = ll.build("gpt", preset="test", n_layer=1)
    final = ckpt.save_checkpoint(tmp_path, 1, model, {"rng": [1]}, {"step": 1}, keep_last=1)
    tmp = final.with_name(ckpt.TMP_PREFIX + final.name)
    assert {str(tmp / p.name) for p in final.iterdir()} | {str(tmp), str(final.parent)} <= set(synced)
    synced.clear()
    ckpt.write_json_atomic(tmp_path / "x.json", {"a": 1})
    assert str(tmp_path) in synced and any(".x.json." in path for path in synced)


# --------------------------------------------------------------------------------------------
# 5, 6. tokenizers
# --------------------------------------------------------------------------------------------


def test_tokenizer_train_never_overwrites_or_moves_a_tokenizer(corpus, tiny_run_copy, capsys):
    run = tiny_run_copy("gpt")
    before = (run / "tokenizer.json").read_text()
    common = ["tokenizer", "train", "--data", f"text:{corpus}", "--vocab-size", "270", "--out"]
    err = _one_line_exit_2([*common, run], capsys)
    assert "already exists" in err
    assert main([*common, str(run / "other.json")]) == 0  # once wrote tokenizer.json, then moved it away
    assert (run / "tokenizer.json").read_text() == before
    assert load_tokenizer(str(run / "other.json")).vocab_size > 259
    _one_line_exit_2([*common, run / "other.json"], capsys)


@pytest.fixture
def bpe_file(corpus, tmp_path):
    assert main(["tokenizer", "train", "--data", f"text:{corpus}", "--vocab-size", "280",
                 "--out", str(tmp_path / "bpe.json")]) == 0
    return tmp_path / "bpe.json"


@pytest.mark.parametrize("trained_with", ["byte", "bpe"])
def test_a_tokenizer_that_does_not_fit_the_model_is_refused(corpus, tmp_path, bpe_file, trained_with, capsys):
    config = _config(corpus, 1)
    config.data.tokenizer = "byte" if trained_with == "byte" else str(bpe_file)
    fit(setup(config, tmp_path / "run", progress=False), progress=False)
    # the other tokenizer: larger than the model's vocabulary (IndexError) or smaller (garbage text)
    other = bpe_file.read_text() if trained_with == "byte" else ByteTokenizer().to_json()
    (ckpt.resolve_checkpoint(tmp_path / "run") / "tokenizer.json").write_text(other)
    ckpt.write_checksums(ckpt.resolve_checkpoint(tmp_path / "run"))  # saved so: the checksums agree
    with pytest.raises(CheckpointError, match="vocab_size"):
        ll.load(tmp_path / "run")
    _one_line_exit_2(["generate", tmp_path / "run", "--prompt", "the"], capsys)


# --------------------------------------------------------------------------------------------
# 7. token shards
# --------------------------------------------------------------------------------------------


def test_a_corrupted_shard_of_the_same_size_is_an_error(corpus, tmp_path):
    source, tokenizer = parse_source(f"text:{corpus}"), ByteTokenizer()
    data = prepare_tokens(source, tokenizer, tmp_path, progress=False)
    shard = data.directory / "train.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1  # still a valid byte id: only the checksum can tell
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="checksum"):
        prepare_tokens(source, tokenizer, tmp_path, progress=False)


def test_ids_outside_the_vocabulary_are_an_error(corpus, tmp_path):
    source, tokenizer = parse_source(f"text:{corpus}"), ByteTokenizer()
    data = prepare_tokens(source, tokenizer, tmp_path, progress=False)
    shard = data.directory / "train.bin"
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[7] = 60000
    ids.tofile(shard)
    meta = json.loads((data.directory / "meta.json").read_text())  # a consistent but hostile cache
    meta["sha256"]["train"], meta["max_id"]["train"] = scan_shard(shard, np.dtype(np.uint16))
    (data.directory / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="60000"):
        prepare_tokens(source, tokenizer, tmp_path, progress=False)


def test_resume_over_changed_data_is_refused(corpus, tmp_path):
    run = _train(corpus, tmp_path / "run", steps=2)
    doc = corpus / "doc00.txt"
    doc.write_text(doc.read_text().replace("quick", "quack"))  # same size: the same windows, other tokens
    with pytest.raises(DataError, match="changed since checkpoint"):
        setup(_config(corpus, 3), run, resume=True, progress=False)


# --------------------------------------------------------------------------------------------
# 8. unwritable outputs
# --------------------------------------------------------------------------------------------


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("mine")
    return path


@pytest.mark.parametrize("below", [False, True])
def test_train_and_tokenizer_outputs_in_the_way_of_a_file(corpus, a_file, below, capsys):
    out = a_file / "sub" if below else a_file
    err = _one_line_exit_2(["train", "--preset", "test", "--data", f"text:{corpus}", "--out", out], capsys)
    assert "a_file" in err and "is a file" in err
    err = _one_line_exit_2(["tokenizer", "train", "--data", f"text:{corpus}", "--vocab-size", "270",
                            "--out", a_file / "tok.json" if not below else out], capsys)
    assert "a_file" in err
    assert a_file.read_text() == "mine"


def test_an_output_folder_that_is_a_dangling_link_names_the_link(corpus, tmp_path, capsys):
    """`--out LINK` where the link's target does not exist was "cannot create output folder LINK: File
    exists" (review)."""
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "nowhere" / "run")
    err = _one_line_exit_2(["train", "--preset", "test", "--data", f"text:{corpus}", "--out", link], capsys)
    assert "is a link to" in err and "nowhere" in err and "which does not exist" in err
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


def test_compare_analyze_eval_and_demo_outputs_in_the_way_of_a_file(tiny_run_copy, tmp_path, a_file, capsys):
    run = tiny_run_copy("gpt")
    assert "is a file" in _one_line_exit_2(["compare", run, "--out", a_file], capsys)
    assert "a_file" in _one_line_exit_2(["compare", run, "--out", a_file / "sub"], capsys)
    assert "is a file" in _one_line_exit_2(["analyze", "contraction", run, "--out", a_file], capsys)
    assert "is a file" in _one_line_exit_2(["demo", "--out", a_file, "--preset", "test"], capsys)
    eval_dir = tmp_path / "evaldata"
    eval_dir.mkdir()
    (eval_dir / "copa.jsonl").write_text("".join(json.dumps({"query": f"q{i}", "choices": ["a", "b"], "gold": 0})
                                                 + "\n" for i in range(2)))
    (run / "evals").write_text("in the way")
    err = _one_line_exit_2(["eval", run, "--tasks", "copa", "--eval-dir", eval_dir, "--no-progress"], capsys)
    assert "evals" in err
    assert a_file.read_text() == "mine"


def test_a_full_disk_while_saving_is_one_error_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error, not an OSError: still one OutputError, and
    the half-written folder is removed."""
    def full(*args, **kwargs):
        raise ckpt.SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr(ckpt, "save_file", full)
    tmp = tmp_path / "checkpoints" / ".tmp-step_00000003"
    tmp.mkdir(parents=True)
    with pytest.raises(OutputError, match="cannot write checkpoint .*No space left on device") as raised:
        ckpt.write_checkpoint_files(tmp, tmp_path, 3, {"w": torch.zeros(2)}, None, {"step": 3})
    assert not tmp.exists()
    # what to do: a save needs room for one checkpoint more than keep_last keeps, named with its size
    assert "about 1 MiB; a run keeps train.keep_last checkpoints and writes the next one before" in str(raised.value)
    done = tmp_path / "checkpoints" / "step_00000002"
    done.mkdir()
    (done / "model.safetensors").write_bytes(bytes(3 * 2**20))
    tmp.mkdir()
    monkeypatch.setattr(ckpt, "save_file", lambda *args, **kwargs: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OutputError, match="No space left on device .a checkpoint takes about 3 MiB; .*lower "
                                          "train.keep_last, then --resume"):
        ckpt.write_checkpoint_files(tmp, tmp_path, 3, {"w": torch.zeros(2)}, None, {"step": 3})


def test_write_json_atomic_reports_an_unwritable_path(a_file):
    with pytest.raises(OutputError, match="a_file"):
        ckpt.write_json_atomic(a_file / "x.json", {})


# --------------------------------------------------------------------------------------------
# 9. a run's config.json is not trusted
# --------------------------------------------------------------------------------------------


def test_config_is_checked_against_the_weights_header_before_allocating(tiny_run_copy, monkeypatch):
    run = tiny_run_copy("gpt")
    for file in (run / "config.json", ckpt.resolve_checkpoint(run) / "config.json"):
        raw = json.loads(file.read_text())
        raw["model"].update(n_embd=2048, n_head=16)  # ~0.4 GB of weights, were it built
        file.write_text(json.dumps(raw))
    ckpt.write_checksums(ckpt.resolve_checkpoint(run))  # saved so: the checksums agree
    built_on = []
    real_build = runs.build_model

    def recording_build(config):
        model = real_build(config)
        built_on.append(next(model.parameters()).device.type)
        return model

    monkeypatch.setattr(runs, "build_model", recording_build)
    with pytest.raises(CheckpointError, match=r"is \[259, 64\] in the file but \[259, 2048\] by the config"):
        ll.load(run)
    assert built_on and set(built_on) == {"meta"}  # shapes only: nothing was allocated


def test_eval_never_follows_the_cache_dir_a_run_names(corpus, tmp_path, capsys):
    run = _train(corpus, tmp_path / "run", steps=1)
    trap = tmp_path / "trap"
    raw = json.loads((run / "config.json").read_text())
    raw["data"]["cache_dir"] = str(trap)
    for file in (run / "config.json", ckpt.resolve_checkpoint(run) / "config.json"):
        file.write_text(json.dumps(raw))
    ckpt.write_checksums(ckpt.resolve_checkpoint(run))  # saved so: the checksums agree
    # without --data eval reads the recorded text source itself (checked against its recorded checksums)
    assert main(["eval", str(run), "--batches", "1", "--json", "--no-progress"]) == 0
    recorded = json.loads(capsys.readouterr().out)["loss"]
    assert main(["eval", str(run), "--batches", "1", "--json", "--data", f"text:{corpus}"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == recorded > 0
    assert not trap.exists()  # the run's cache_dir is never followed


def test_a_built_in_source_of_a_run_is_used_without_data(monkeypatch):
    seen = []
    monkeypatch.setattr(runtime, "prepare_data", lambda config, tokenizer, progress=True: seen.append(config.data))
    config = RunConfig(data=DataConfig(source="task:addition", cache_dir="/somewhere/else"))
    runtime.eval_data(config, ByteTokenizer())
    runtime.eval_data(config, ByteTokenizer(), "stdlib")
    assert [(d.source, d.cache_dir) for d in seen] == [("task:addition", ""), ("stdlib", "")]


# --------------------------------------------------------------------------------------------
# 10. flags that once gave tracebacks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--seed", "100000000000000000000000"], ["--set", "train.seed=1.0e+23"],
                                   ["--set", "seed=9223372036854775808"], ["--seed", "-1"]])
def test_out_of_range_seeds_are_one_line(flags, tmp_path, capsys):
    assert "seed" in _one_line_exit_2(["train", "--preset", "test", "--out", tmp_path / "x", *flags], capsys)


@pytest.mark.parametrize("steps", ["nan", "inf"])
def test_demo_rejects_a_non_finite_step_count(steps, tmp_path, capsys):
    assert "--steps" in _one_line_exit_2(["demo", "--steps", steps, "--out", tmp_path / "d"], capsys)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("content", ['{"model": {"arch": "gpt", "n_la', "[1, 2]"])
def test_resume_with_a_partial_config_is_one_line(corpus, tmp_path, content, capsys):
    run = _train(corpus, tmp_path / "run", steps=1)
    (run / "config.json").write_text(content)
    assert "config.json" in _one_line_exit_2(["train", "--out", run, "--resume", "--no-progress"], capsys)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_model_too_large_to_allocate_is_one_config_error(arch):
    """A config whose model this machine cannot allocate (a checkpoint's config.json saying sequence_len
    1e11: its RoPE tables; a typo'd width) is one line with what it needs, for every architecture, not
    the CPU allocator's traceback from deep in the model's constructor."""
    with pytest.raises(ll.ConfigError, match=r"cannot build the \w+ model: .* buffers \(RoPE tables, sequence_len "
                                             r"100,000,000,000\) [\d,.]+ GiB, more than this machine could allocate"):
        ll.build(arch, preset="test", sequence_len=10 ** 11)

