"""Sharded (fsdp2, torch.distributed.checkpoint) checkpoints read safely: a planted pickle in
`dcp/` runs nothing on resume or export-dcp, every file is checked against the sha256 recorded when
it was saved, a damaged file is one error line (exit 2), and a distributed command line ends its
process without the interpreter's teardown. One process here (a group of one); on two processes
under torchrun: test_distributed.py."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from latentloop.checkpoint import (
    DCP_CHECKSUMS,
    DCP_METADATA,
    LOCK_FILE,
    SHARDED_CHECKSUMS_KEY,
    TRAINER_JSON,
    RunLock,
    read_sharded_metadata,
    sha256_file,
    write_checksums,
    write_sharded_checksums,
)
from latentloop.cli import main
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.errors import CheckpointError
from latentloop.runs import export_full_weights, load_run
from latentloop.train import fit, setup

REFUSED = f"{os.system.__module__}.system"  # how a pickle names os.system (posix.system here)
RESUME_STEPS = "3"  # one step past the saved checkpoint
SUBPROCESS_TIMEOUT_S = 120

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="this torch build has no gloo backend")


def run_config(corpus: Path, steps: int = 2) -> RunConfig:
    return RunConfig(model=model_config("gpt", "test", sequence_len=32),
                     train=TrainConfig(steps=steps, batch_size=2, eval_every=0, eval_batches=1, log_every=1,
                                       warmup_steps=1, strategy="fsdp2", device="cpu", full_weights=False),
                     data=DataConfig(source=f"text:{corpus}"))


def leave_group() -> None:
    """A command that failed in this process leaves its group of one up (a failed process exits
    instead): the next test starts without it."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A two-step fsdp2 run of one process whose checkpoint holds its weights in dcp/ only."""
    corpus = tmp_path_factory.mktemp("corpus")
    words = "the quick brown fox jumps over the lazy dog while latent state loops forward".split()
    for i in range(40):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(200)) + "\n")
    run = tmp_path_factory.mktemp("saved") / "run"
    try:
        fit(setup(run_config(corpus), run, progress=False), progress=False)
    finally:
        leave_group()
    return run


@pytest.fixture
def run(saved_run, tmp_path):
    """A copy of the saved run for one test to damage."""
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy)
    yield copy
    leave_group()


def dcp_folder(run: Path) -> Path:
    return sorted((run / "checkpoints").iterdir())[-1] / "dcp"


class Payload:
    """Unpickled freely, it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def rehash(folder: Path) -> None:
    """Record the checksums again, as whoever planted a file could."""
    (folder / DCP_CHECKSUMS).unlink()
    write_sharded_checksums(folder)


def plant_metadata(run: Path, marker: Path) -> Path:
    folder = dcp_folder(run)
    (folder / DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))
    rehash(folder)
    return folder / DCP_METADATA


def plant_entry(run: Path, marker: Path, entry: str = "optim.param_groups.0.lr") -> Path:
    """Point the non-tensor entry `entry` of the metadata at a torch.save'd payload appended to the
    shard file (metadata and checksums rewritten to match, all of them legitimate in form)."""
    folder = dcp_folder(run)
    metadata = read_sharded_metadata(folder)
    info, = [s for i, s in metadata.storage_data.items() if i.fqn == entry]
    shard = folder / info.relative_path
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    info.offset, info.length = shard.stat().st_size, len(payload.getvalue())
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    (folder / DCP_METADATA).write_bytes(pickle.dumps(metadata))
    rehash(folder)
    return shard


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def resume_argv(run: Path, *extra: str) -> list[str]:
    return ["train", "--resume", "--out", str(run), "--steps", RESUME_STEPS, "--no-progress", *extra]


ENTRY_POINTS = {
    "export-dcp": lambda run: ["export-dcp", str(run)],
    "resume under fsdp2": lambda run: resume_argv(run),
    "resume in one plain process": lambda run: resume_argv(run, "--set", "train.strategy=none"),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_planted_metadata_pickle_runs_nothing(run, tmp_path, capsys, entry):
    marker = tmp_path / "pwned"
    path = plant_metadata(run, marker)
    code, err = run_cli(ENTRY_POINTS[entry](run), capsys)
    assert not marker.exists()
    assert code == 2 and len(err) == 1, err
    assert f"{path} holds a pickled object that is not checkpoint metadata ({REFUSED}): refusing to load it" in err[0]


def test_the_export_function_refuses_a_planted_metadata_pickle(run, tmp_path):
    marker = tmp_path / "pwned"
    plant_metadata(run, marker)
    with pytest.raises(CheckpointError, match="not checkpoint metadata"):
        export_full_weights(run)
    assert not marker.exists() and not (dcp_folder(run).parent / "model.safetensors").exists()


def test_a_planted_non_tensor_entry_runs_nothing_on_resume(run, tmp_path, capsys):
    """DCP's own planner unpickles non-tensor entries (an optimizer's param_groups) with
    weights_only=False; ours only decodes plain data."""
    marker = tmp_path / "pwned"
    shard = plant_entry(run, marker)
    code, err = run_cli(resume_argv(run), capsys)
    assert not marker.exists()
    assert code == 2 and len(err) == 1, err
    assert (f"{shard} holds a pickled object that is not plain data ({REFUSED}, in entry optim.param_groups.0.lr): "
            f"refusing to load it") in err[0]


def test_the_checksums_cover_every_file_of_dcp(saved_run):
    folder = dcp_folder(saved_run)
    recorded = json.loads((folder / DCP_CHECKSUMS).read_text())
    files = {p.name for p in folder.iterdir()} - {DCP_CHECKSUMS}
    assert DCP_METADATA in files and any(name.endswith(".distcp") for name in files)
    assert recorded == {"format": 1, "sha256": {name: sha256_file(folder / name) for name in sorted(files)}}


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", [DCP_METADATA, "__0_0.distcp"])
@pytest.mark.parametrize("entry", ["export-dcp", "resume under fsdp2"])
def test_a_flipped_bit_is_named_before_anything_is_read(run, capsys, name, entry):
    path = dcp_folder(run) / name
    flip_bit(path)
    code, err = run_cli(ENTRY_POINTS[entry](run), capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{path} is corrupt: its sha256 differs from the one recorded when it was saved" in err[0]


def test_a_missing_shard_is_named(run, capsys):
    shard = dcp_folder(run) / "__0_0.distcp"
    shard.unlink()
    code, err = run_cli(ENTRY_POINTS["export-dcp"](run), capsys)
    assert code == 2 and err == [f"latentloop: error: {shard} is missing (listed in {shard.parent / DCP_CHECKSUMS})"]


def saved_before_checksums(run: Path) -> Path:
    """A checkpoint as a version before checksums wrote it: no dcp/checksums.json, and its trainer.json
    (whose sha256 the checkpoint's manifest holds) without the entry saying one was written."""
    folder = dcp_folder(run)
    (folder / DCP_CHECKSUMS).unlink()
    trainer = json.loads((folder.parent / TRAINER_JSON).read_text())
    del trainer["state"]["sharded"][SHARDED_CHECKSUMS_KEY]
    (folder.parent / TRAINER_JSON).write_text(json.dumps(trainer))
    write_checksums(folder.parent)
    return folder


@pytest.mark.parametrize("entry", ["export-dcp", "resume under fsdp2"])
def test_a_lost_manifest_of_a_checkpoint_that_wrote_one_is_refused(run, capsys, entry):
    """A checkpoint of this version whose dcp/checksums.json is gone was loaded unchecked, with a
    warning that it was "saved by an older version" (a flipped bit in its shards then trained on)."""
    manifest = dcp_folder(run) / DCP_CHECKSUMS
    manifest.unlink()
    code, err = run_cli(ENTRY_POINTS[entry](run), capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{manifest} is missing, though" in err[0] and "records that it was written" in err[0]


@pytest.mark.parametrize("entry", ["export-dcp", "resume under fsdp2"])
def test_a_cut_short_metadata_is_one_line(run, capsys, entry):
    path = saved_before_checksums(run) / DCP_METADATA
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, err = run_cli(ENTRY_POINTS[entry](run), capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{path} is unreadable (cut short or corrupt): pickle data was truncated" in err[0]


@pytest.mark.parametrize("entry", ["export-dcp", "resume under fsdp2"])
def test_a_garbled_shard_is_one_line(run, capsys, entry):
    """DCP's own error is a CheckpointException, a BaseException that used to escape as a traceback."""
    folder = saved_before_checksums(run)
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    code, err = run_cli(ENTRY_POINTS[entry](run), capsys)
    errors = [line for line in err if line.startswith("latentloop: error:")]
    assert code == 2 and len(errors) == 1 and not any("Traceback" in line for line in err), err
    assert f"cannot load the sharded checkpoint {folder}: PytorchStreamReader failed reading zip archive" in errors[0]


def test_export_dcp_of_a_run_that_trains_is_one_line_and_writes_nothing(run, capsys):
    """export-dcp took no run lock: a training resumed meanwhile rotated out (keep_last) the checkpoint
    being exported (12-06 review). It holds the run's lock now, and a held one refuses it."""
    checkpoint = dcp_folder(run).parent
    before = sorted(p.name for p in checkpoint.iterdir())
    held = RunLock(run).acquire()  # as a training holds it from setup to the end of fit
    try:
        for target in (run, checkpoint):  # the run folder or its checkpoint: the same run's lock
            code, err = run_cli(["export-dcp", str(target)], capsys)
            assert code == 2 and err == [f"latentloop: error: {run} is in use: another training writes to it (it "
                                         f"holds {run / LOCK_FILE}); wait for it to finish"], err
        assert sorted(p.name for p in checkpoint.iterdir()) == before
    finally:
        held.release()
    assert run_cli(["export-dcp", str(run)], capsys)[0] == 0
    RunLock(run).acquire().release()  # and the export let go of it


def test_a_checkpoint_removed_or_unwritable_during_the_export_is_one_line(saved_run, run, tmp_path, capsys,
                                                                         monkeypatch):
    """safetensors reports its I/O failures as SafetensorError, which escaped as a traceback."""
    import latentloop.runs as runs

    checkpoint = dcp_folder(run).parent
    read = runs.load_sharded_state

    def read_then_remove(*args, **kwargs):
        read(*args, **kwargs)
        shutil.rmtree(checkpoint)  # as another process's keep_last rotation removes it

    monkeypatch.setattr(runs, "load_sharded_state", read_then_remove)
    code, err = run_cli(["export-dcp", str(checkpoint)], capsys)
    assert code == 2 and err == [f"latentloop: error: {checkpoint} was removed while it was being exported (nothing "
                                 f"was written): export again"], err
    monkeypatch.undo()
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    run = shutil.copytree(saved_run, tmp_path / "again")
    checkpoint = dcp_folder(run).parent
    before = sorted(p.name for p in checkpoint.iterdir())
    code, err = run_cli(["export-dcp", str(run)], capsys)
    assert code == 2 and err == [f"latentloop: error: cannot write {checkpoint / 'model.safetensors'}: Error while "
                                 f"serializing: I/O error: No space left on device (os error 28)"], err
    assert sorted(p.name for p in checkpoint.iterdir()) == before  # its temporary file removed


def test_a_checkpoint_saved_before_checksums_loads_with_a_warning(saved_run, run, tmp_path, capsys):
    folder = saved_before_checksums(run)
    code, err = run_cli(["export-dcp", str(run)], capsys)
    assert code == 0
    assert err == [f"latentloop: warning: {folder} has no {DCP_CHECKSUMS} (saved by an older version): its shards "
                   f"are loaded without a checksum check"]
    checked = shutil.copytree(saved_run, tmp_path / "checked")
    a, b = load_file(str(folder.parent / "model.safetensors")), load_file(str(export_full_weights(checked)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_sharded_checkpoint_resumes_and_records_new_checksums(run, capsys):
    code, err = run_cli(resume_argv(run), capsys)
    assert code == 0, err
    folder = dcp_folder(run)
    assert folder.parent.name.endswith(RESUME_STEPS) and (folder / DCP_CHECKSUMS).is_file()


# Python's exit, step by step: atexit handlers run while the interpreter is whole, module teardown
# (where an object's __del__ runs) only in its finalization.
TEARDOWN_PROBE = """
import atexit, sys
from latentloop.cli import main

atexit.register(lambda: print("atexit handlers ran", flush=True))

class Teardown:
    def __del__(self, out=sys.stdout):
        out.write("the interpreter was torn down\\n")
        out.flush()

probe = Teardown()
sys.exit(main())
"""


def test_a_distributed_command_line_ends_without_the_interpreter_teardown(saved_run, tmp_path):
    """After a distributed command, the process group's C++ threads are still running (FSDP2 keeps
    the gloo group alive past destroy_process_group), and a thread that meets a finalizing
    interpreter can abort the process ("terminate called without an active exception"): the
    command line ends its process after the atexit handlers, before the teardown."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    script = tmp_path / "probe.py"
    script.write_text(TEARDOWN_PROBE)
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(script), *resume_argv(run)], capture_output=True, text=True,
                            env=env, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert "atexit handlers ran" in result.stdout and "the interpreter was torn down" not in result.stdout
    assert "trained gpt" in result.stdout  # what the command printed last still came out


# Globals of torch that are not checkpoint metadata: each callable by a pickle's REDUCE, several of them
# writing files (torch.save) or reading and running them (torch.load, torch.hub's loaders)
TORCH_GLOBALS_REFUSED = [("torch", "save"), ("torch.serialization", "save"), ("torch", "load"),
                         ("torch.hub", "load"), ("torch", "compile"), ("torch.distributed.checkpoint.metadata", "os")]


@pytest.mark.parametrize("module, name", TORCH_GLOBALS_REFUSED)
def test_a_metadata_pickle_calling_a_torch_global_is_refused_before_it_runs(tmp_path, module, name):
    """Only DCP's metadata classes, torch.Size, the dtypes and two layout helpers pass the unpickler: a
    `torch.*` global such as torch.save (which would write anywhere) is refused by name, as os.system is."""
    folder = tmp_path / "dcp"
    folder.mkdir()
    target = tmp_path / "written-by-the-pickle"
    # protocol 0, by hand: GLOBAL module name, MARK, {}, "path", TUPLE, REDUCE -> module.name({}, "path")
    planted = f"c{module}\n{name}\n(}}V{target}\ntR.".encode()
    (folder / DCP_METADATA).write_bytes(planted)
    with pytest.raises(CheckpointError, match=rf"not checkpoint metadata \({module}\.{name}\)"):
        read_sharded_metadata(folder)
    assert not target.exists()


def test_an_export_cut_short_before_its_checksum_says_how_to_write_it_again(run, capsys):
    """export-dcp writes model.safetensors, then records its sha256: a crash between the two left a file the
    manifest does not list, and the loaders said only that, not how to mend it."""
    checkpoint = dcp_folder(run).parent
    assert run_cli(["export-dcp", str(run)], capsys)[0] == 0
    manifest = checkpoint / "checksums.json"
    recorded = json.loads(manifest.read_text())
    del recorded["sha256"]["model.safetensors"]  # the crash's state: written, not yet recorded
    manifest.write_text(json.dumps(recorded))
    with pytest.raises(CheckpointError, match="export-dcp cut short.*--force"):
        load_run(checkpoint)
    assert run_cli(["export-dcp", str(run), "--force"], capsys)[0] == 0
    load_run(checkpoint)  # mended as said
