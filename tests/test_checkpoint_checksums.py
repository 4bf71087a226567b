"""Plain checkpoints carry checksums as sharded ones do: every file is checked when it is read, so a
flipped bit in any of them is named on load and on resume, never a silently different model or resume."""

import json

import pytest
import torch

import latentloop as ll
from latentloop import checkpoint as ckpt
from latentloop.cli import main
from latentloop.errors import CheckpointError

EVERY_FILE = ("model.safetensors", "config.json", "tokenizer.json", "state.json", "trainer.json",
              "trainer.safetensors")
READ_BY_LOAD = ("model.safetensors", "config.json", "tokenizer.json")


def flip_bit(path, at: float = 0.5) -> None:
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * at)] ^= 0x01
    path.write_bytes(bytes(raw))


def run_main(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip()


def test_a_saved_checkpoint_records_the_sha256_of_each_of_its_files(tiny_run_copy):
    checkpoint = ckpt.resolve_checkpoint(tiny_run_copy("gpt"))
    recorded = json.loads((checkpoint / ckpt.CHECKSUMS).read_text())
    assert recorded["format"] == ckpt.CHECKSUMS_FORMAT
    assert set(recorded["sha256"]) == set(EVERY_FILE)
    for name, digest in recorded["sha256"].items():
        assert ckpt.sha256_file(checkpoint / name) == digest


@pytest.mark.parametrize("name", READ_BY_LOAD)
def test_a_flipped_bit_in_a_file_load_reads_is_named(tiny_run_copy, capsys, name):
    run = tiny_run_copy("gpt")
    checkpoint = ckpt.resolve_checkpoint(run)
    flip_bit(checkpoint / name)
    with pytest.raises(CheckpointError, match=f"{name} is corrupt: its sha256 differs"):
        ll.load(run)
    code, err = run_main(["generate", run, "--prompt", "a", "--max-new-tokens", "2"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and name in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_deleted_file_the_checksums_record_is_named_not_replaced_by_the_run_folders(tiny_run_copy, capsys, name):
    """The checkpoint's config.json deleted, load read the run folder's copy unchecked: an edited
    rope_theta loaded a model the run never trained, exit 0 (12-07 review)."""
    run = tiny_run_copy("gpt")
    checkpoint = ckpt.resolve_checkpoint(run)
    (checkpoint / name).unlink()
    assert (run / name).is_file()  # the run folder's copy is there to fall back on
    with pytest.raises(CheckpointError, match=f"{name} is missing: .* recorded it"):
        ll.load(run)
    code, err = run_main(["generate", run, "--prompt", "a", "--max-new-tokens", "2"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and f"{name} is missing" in err


def test_a_config_claiming_a_billion_layers_is_one_line_not_a_hang(tiny_run_copy, capsys):
    """An older checkpoint (no checksums) whose config.json claims 10^9 layers: `generate` built the
    model on the meta device to check the weights' shapes, and ran out of memory slowly (12-07 review)."""
    run = tiny_run_copy("gpt")
    checkpoint = ckpt.resolve_checkpoint(run)
    (checkpoint / ckpt.CHECKSUMS).unlink()
    for config_file in (checkpoint / "config.json", run / "config.json"):
        config = json.loads(config_file.read_text())
        config["model"]["n_layer"] = 10**9
        config_file.write_text(json.dumps(config))
    code, err = run_main(["generate", run, "--prompt", "a", "--max-new-tokens", "2"], capsys)
    assert code == 2 and "n_layer must be in [1, 1024], got 1000000000" in err.splitlines()[-1]


def test_weights_stored_as_integers_are_refused(tiny_run_copy, capsys):
    """An older checkpoint (no checksums) whose weights were rewritten as int32 loaded (each value cast
    into the float parameters) and generated, exported and resumed a garbage model, exit 0."""
    from safetensors.torch import load_file, save_file

    run = tiny_run_copy("gpt")
    checkpoint = ckpt.resolve_checkpoint(run)
    (checkpoint / ckpt.CHECKSUMS).unlink()
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file({name: tensor.to(torch.int32) for name, tensor in weights.items()}, str(checkpoint / "model.safetensors"))
    with pytest.raises(CheckpointError, match="torch.int32 tensor .*: a model's weights are floating point"):
        ll.load(run)
    code, err = run_main(["generate", run, "--prompt", "a", "--max-new-tokens", "2"], capsys)
    assert code == 2 and "are floating point" in err.splitlines()[-1]


@pytest.mark.parametrize("name", EVERY_FILE)
def test_a_flipped_bit_in_any_file_is_named_on_resume_and_nothing_is_written(tiny_run_copy, capsys, name):
    run = tiny_run_copy("gpt")
    checkpoint = ckpt.resolve_checkpoint(run)
    flip_bit(checkpoint / name, at=0.7)
    metrics = (run / "metrics.jsonl").read_text()
    code, err = run_main(["train", "--out", run, "--resume", "--steps", "3", "--no-progress"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert f"{name} is corrupt" in err.splitlines()[-1]
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing of the run was changed or lost
    assert ckpt.list_checkpoints(run) == [checkpoint]


def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(tiny_run_copy, capsys):
    run = tiny_run_copy("gpt")
    assert run_main(["train", "--out", run, "--resume", "--steps", "4", "--set", "keep_last=2",
                     "--set", "save_every=1", "--no-progress"], capsys)[0] == 0
    older, newest = ckpt.list_checkpoints(run)[-2:]
    flip_bit(newest / "trainer.safetensors")
    code, err = run_main(["train", "--out", run, "--resume", "--steps", "5", "--no-progress"], capsys)
    assert code == 0, err
    assert "trainer.safetensors is corrupt" in err and f"resumed from {older.name}" in err


@pytest.mark.parametrize("step", [-1, 999999, "3", True])
def test_a_hand_edited_step_is_refused_on_resume_even_with_checksums_that_agree(tiny_run_copy, capsys, step):
    run = tiny_run_copy("gpt")
    checkpoint = ckpt.resolve_checkpoint(run)
    state = json.loads((checkpoint / "state.json").read_text())
    state["step"] = step
    (checkpoint / "state.json").write_text(json.dumps(state))
    ckpt.write_checksums(checkpoint)  # an edit that also rewrote the checksums: the step check stands alone
    code, err = run_main(["train", "--out", run, "--resume", "--steps", "3", "--no-progress"], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"its state.json says step {step!r}" in err.splitlines()[-1]


def test_a_checkpoint_saved_before_checksums_loads_with_one_warning(tiny_run_copy, capsys):
    run = tiny_run_copy("gpt")
    checkpoint = ckpt.resolve_checkpoint(run)
    (checkpoint / ckpt.CHECKSUMS).unlink()
    capsys.readouterr()
    ll.load(run)
    ll.load(run)
    err = capsys.readouterr().err
    assert err.count(f"has no {ckpt.CHECKSUMS}") == 1 and str(checkpoint) in err


def test_a_file_the_checksums_do_not_name_is_refused(tiny_run_copy):
    run = tiny_run_copy("gpt")
    checkpoint = ckpt.resolve_checkpoint(run)
    recorded = json.loads((checkpoint / ckpt.CHECKSUMS).read_text())
    del recorded["sha256"]["model.safetensors"]
    (checkpoint / ckpt.CHECKSUMS).write_text(json.dumps(recorded))
    with pytest.raises(CheckpointError, match="model.safetensors is not among the files"):
        ll.load(run)
