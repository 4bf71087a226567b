"""`latentloop export` (and import-hf's --out) against runs and output folders that are not as they
should be: the checks `load_run` makes (the tokenizer against the config, the weights' header against
the config before a model is built, a checkpoint with sharded weights only), a damaged state.json, the
model card's batch and an imported model's card, a config with a negative width, an existing empty or
symlinked --out, and the exported tokenizer's padding run through the remote code."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

import latentloop as ll
from latentloop.archs import ARCHS
from latentloop.checkpoint import CHECKSUMS, save_weights_checkpoint, write_checksums
from latentloop.cli import main
from latentloop.config import DataConfig, ModelConfig, RunConfig, TrainConfig, model_config
from latentloop.data import ByteTokenizer
from latentloop.errors import ConfigError
from latentloop.interop import export_hf, hf_export, import_hf

EXACT_TOL = 1e-5  # the remote code against itself on the same tokens: the same operations
SETGID_MODE = 0o2770  # a group-shared output folder: its mode (and setgid bit) must outlive the export


def _one_line_error(argv, capsys) -> str:
    """The CLI's error for `argv`: exit 2 and one line on stderr (warnings of older checkpoints aside)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "warning:" not in line]
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


def _checkpoint(run: Path) -> Path:
    return sorted((run / "checkpoints").iterdir())[-1]


def _rewrite_checksums(checkpoint: Path) -> None:
    """The checkpoint's checksums recorded again, as a save would after the files as they are now."""
    (checkpoint / CHECKSUMS).unlink()
    write_checksums(checkpoint)


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        section, _, name = key.partition("__")
        (data[section] if name else data)[name or section] = value
    path.write_text(json.dumps(data))


def _export(run: Path, out: Path, capsys, *flags: str) -> str:
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(out), "--no-progress", *flags]) == 0, capsys.readouterr().err
    return (out / "README.md").read_text()


def _weights_run(folder: Path, arch: str = "gpt", config: RunConfig | None = None, state: dict | None = None,
                 tokenizer=None) -> Path:
    """A run folder of a random `test`-preset model with one weights-only checkpoint."""
    torch.manual_seed(1)
    model = ll.build(arch, "test")
    folder.mkdir(parents=True)
    (config or RunConfig(model=model_config(arch, "test"))).save_json(folder / "config.json")
    (tokenizer or ByteTokenizer()).save(folder)
    save_weights_checkpoint(folder, 0, model, state or {"step": 0})
    return folder


# --------------------------------------------------------------------------------------------
# 1-3: the checks load_run makes
# --------------------------------------------------------------------------------------------


def test_export_refuses_a_tokenizer_that_does_not_fit_the_model(tiny_run_copy, tmp_path, capsys):
    """A chat tokenizer (3 ids more than the model's vocab) beside a run: refused as generate refuses it,
    nothing written (it was exported, and the Hugging Face model then indexed past its embedding)."""
    run = tiny_run_copy("gpt")
    checkpoint = _checkpoint(run)
    for stale in (checkpoint / "tokenizer.json", run / "tokenizer.json"):
        stale.unlink()
    _rewrite_checksums(checkpoint)
    ByteTokenizer(chat=True).save(run)
    generate = _one_line_error(["generate", str(run), "--prompt", "hi", "--max-new-tokens", "1"], capsys)
    err = _one_line_error(["export", str(run), "--out", str(tmp_path / "hf"), "--no-progress"], capsys)
    assert err == generate and "tokens but the model has vocab_size" in err
    assert not (tmp_path / "hf").exists()


def test_export_checks_the_config_against_the_weights_before_building_the_model(tiny_run_copy, tmp_path, capsys,
                                                                                monkeypatch):
    """A config edited to a far larger model than the weights hold is one line from the safetensors
    header, checked on the meta device: the model is never allocated (it was, and the allocation
    failed with a long traceback)."""
    run = tiny_run_copy("gpt")
    checkpoint = _checkpoint(run)
    _edit_json(checkpoint / "config.json", model__n_embd=4096, model__n_layer=8)
    _rewrite_checksums(checkpoint)
    build = hf_export.build_model

    def meta_only(config):
        assert torch.empty(0).device.type == "meta", "the model was allocated before its weights were checked"
        return build(config)

    monkeypatch.setattr(hf_export, "build_model", meta_only)
    err = _one_line_error(["export", str(run), "--out", str(tmp_path / "hf"), "--no-progress"], capsys)
    assert "do not fit the run's config.json" in err and "model.safetensors" in err
    assert not (tmp_path / "hf").exists()


def test_export_of_a_sharded_only_checkpoint_says_to_run_export_dcp(tiny_run_copy, tmp_path, capsys):
    run = tiny_run_copy("gpt")
    checkpoint = _checkpoint(run)
    (checkpoint / "model.safetensors").unlink()
    _rewrite_checksums(checkpoint)
    (checkpoint / "dcp").mkdir()
    generate = _one_line_error(["generate", str(run), "--prompt", "hi"], capsys)
    err = _one_line_error(["export", str(run), "--out", str(tmp_path / "hf"), "--no-progress"], capsys)
    assert err == generate and f"latentloop export-dcp {checkpoint}" in err


# --------------------------------------------------------------------------------------------
# 4-6: the model card
# --------------------------------------------------------------------------------------------


def test_a_damaged_state_json_is_one_line(tiny_run_copy, tmp_path, capsys):
    """state.json edited after the save: its checksum differs, and the export says so (the card printed
    whatever the edit put there)."""
    run = tiny_run_copy("gpt")
    _edit_json(_checkpoint(run) / "state.json", tokens_seen=999_999_999)
    err = _one_line_error(["export", str(run), "--out", str(tmp_path / "hf"), "--no-progress"], capsys)
    assert "state.json is corrupt" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("tokens, flops", [("lots", 1.0), (None, "many"), (float("inf"), float("nan")),
                                           (-5, 1.0), (True, 1.0)])
def test_the_card_says_unknown_for_what_is_not_a_number(tokens, flops, tiny_run_copy, tmp_path, capsys):
    """A checkpoint without checksums (an older version's) whose state.json holds text, null, inf or NaN:
    the card says "unknown" (the export crashed formatting them, or printed them)."""
    run = tiny_run_copy("gpt")
    checkpoint = _checkpoint(run)
    (checkpoint / CHECKSUMS).unlink()
    state = json.loads((checkpoint / "state.json").read_text())
    state.update(tokens_seen=tokens, flops_seen=flops, world_size="two")
    (checkpoint / "state.json").write_text(json.dumps(state))  # json writes inf / NaN as Infinity / NaN
    card = _export(run, tmp_path / "hf", capsys)
    assert f"steps: {state['step']}, tokens: unknown" in card
    assert "batch unknown" in card
    for word in ("lots", "many", "None", "inf", "nan", "NaN", "True", "-5", "two"):
        assert word not in card.split("## Training")[1].split("## Final")[0], word


def test_the_cards_batch_counts_the_accumulation_batch_tokens_makes(tiny_corpus, tmp_path, capsys):
    """A run trained with train.batch_tokens: the card gives its real global batch (it printed
    grad_accum, which stays 1)."""
    from conftest import TINY_RUN_ARGV

    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--arch", "gpt", "--data", f"text:{tiny_corpus}", "--out", str(run), *TINY_RUN_ARGV,
                 "--set", "train.batch_tokens=128"]) == 0
    card = _export(run, tmp_path / "hf", capsys)
    assert "batch 4 sequences of 32 tokens (128 tokens; 2 x 2 accumulation x 1 processes)" in card


def test_the_cards_batch_from_the_config_where_state_json_has_none(tmp_path, capsys):
    """An older checkpoint (state.json without global_batch): the batch from the config, as the trainer
    computes it (batch_tokens over micro-batch x sequence length x processes)."""
    config = RunConfig(model=model_config("gpt", "test"), train=TrainConfig(batch_size=2, batch_tokens=512))
    run = _weights_run(tmp_path / "run", config=config, state={"step": 3, "tokens_seen": 1536})
    card = _export(run, tmp_path / "hf", capsys)
    assert "batch 8 sequences of 64 tokens (512 tokens; 2 x 4 accumulation x 1 processes)" in card


def test_the_card_names_no_local_tokenizer_path(tmp_path, capsys):
    """A run trained with a tokenizer file: the card names the file, not where it was on this machine."""
    tokenizer_file = tmp_path / "tokenizers" / "bpe-300.json"
    tokenizer_file.parent.mkdir()
    ByteTokenizer().save(tokenizer_file.parent)
    (tokenizer_file.parent / "tokenizer.json").rename(tokenizer_file)
    config = RunConfig(model=model_config("gpt", "test"), data=DataConfig(tokenizer=str(tokenizer_file)))
    run = _weights_run(tmp_path / "run", config=config)
    card = _export(run, tmp_path / "hf", capsys)
    assert "bpe-300.json" in card and str(tokenizer_file.parent) not in card


def test_the_card_names_no_folder_of_the_machine_that_trained_or_exported(tmp_path, capsys):
    """The card printed the checkpoint's absolute path and the data source's folders (`text:/home/...`)."""
    corpus = tmp_path / "my corpora" / "stories.txt"  # a folder with a space in its name, too
    config = RunConfig(model=model_config("gpt", "test"),
                       data=DataConfig(source=f"mix:{corpus}=0.5,text:{corpus}=0.5"))
    run = _weights_run(tmp_path / "run", config=config)
    card = _export(run, tmp_path / "hf", capsys)
    assert str(tmp_path) not in card
    assert "`mix:stories.txt=0.5,text:stories.txt=0.5`" in card


def test_an_imported_models_card_says_where_it_came_from(tmp_path, capsys):
    """A Llama checkpoint imported and exported again: the card says it was imported and that latentloop
    did not train it (it invented a training run from the config's defaults and printed the absolute
    path of the tokenizer)."""
    pytest.importorskip("transformers")
    from test_interop import _hf_model

    (tmp_path / "llama").mkdir()
    _hf_model("llama", tmp_path / "llama")
    import_hf(tmp_path / "llama", tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    training = card.split("## Training")[1].split("## How to load it")[0]
    assert "imported from `llama` (llama) with `latentloop import-hf`" in training
    assert "latentloop did not train this model" in training
    for invented in ("optimizer", "learning rate", "batch", "stage:", "steps:"):
        assert invented not in training, invented
    assert str(tmp_path / "run" / "tokenizer.json") not in card and str(tmp_path / "llama") not in card


# --------------------------------------------------------------------------------------------
# 7: the config's width
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("n_embd", [-64, 0])
def test_a_width_below_one_is_a_config_error(arch, n_embd):
    with pytest.raises(ConfigError, match=rf"n_embd must be >= 1, got {n_embd}"):
        model_config(arch, "test", n_embd=n_embd)


def test_a_config_too_narrow_for_one_rotary_pair_is_refused():
    with pytest.raises(ConfigError, match="head_dim .* must be even for RoPE"):
        ModelConfig(n_embd=4, n_head=4)


def test_export_of_a_run_with_a_negative_width_is_one_line(tiny_run_copy, tmp_path, capsys):
    run = tiny_run_copy("gpt")
    checkpoint = _checkpoint(run)
    _edit_json(checkpoint / "config.json", model__n_embd=-64)
    _rewrite_checksums(checkpoint)
    err = _one_line_error(["export", str(run), "--out", str(tmp_path / "hf"), "--no-progress"], capsys)
    assert "n_embd must be >= 1, got -64" in err


# --------------------------------------------------------------------------------------------
# 8-9: an existing empty --out, a symlinked one
# --------------------------------------------------------------------------------------------


def test_an_empty_out_folder_is_written_into_and_kept(tiny_run, tmp_path, capsys, monkeypatch):
    """An existing empty --out (group-shared: setgid) keeps its inode and mode, config.json arrives in it
    last, and its parent need not take new entries (it was replaced by a fresh folder renamed from
    beside it: mode, group and setgid bit lost, and refused under a parent it could not write)."""
    out = tmp_path / "exports" / "shared"
    out.mkdir(parents=True)
    os.chmod(out, SETGID_MODE)
    before = out.stat()
    real_access, real_replace, moved = os.access, os.replace, []

    def parent_not_writable(path, mode, *args, **kwargs):
        if Path(path) == out.parent and mode & os.W_OK:
            return False  # a shared area owned by someone else (root passes every real access check)
        return real_access(path, mode, *args, **kwargs)

    def recorded(src, dst, *args, **kwargs):
        moved.append(Path(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "access", parent_not_writable)
    monkeypatch.setattr(os, "replace", recorded)
    os.chmod(out.parent, 0o555)
    try:
        _export(tiny_run("fbt"), out, capsys)
    finally:
        os.chmod(out.parent, 0o755)
    after = out.stat()
    assert (after.st_ino, stat.S_IMODE(after.st_mode)) == (before.st_ino, SETGID_MODE)
    assert sorted(p.name for p in out.parent.iterdir()) == ["shared"]
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    into_out = [p for p in moved if p.parent == out]
    assert into_out and into_out[-1].name == "config.json"


def test_a_failed_export_into_an_empty_folder_leaves_it_empty(tiny_run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "shared"
    out.mkdir()
    os.chmod(out, SETGID_MODE)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(hf_export, "write_hf_tokenizer", full_disk)
    err = _one_line_error(["export", str(tiny_run("gpt")), "--out", str(out), "--no-progress"], capsys)
    assert "No space left on device" in err
    assert out.is_dir() and not list(out.iterdir()) and stat.S_IMODE(out.stat().st_mode) == SETGID_MODE
    monkeypatch.undo()
    _export(tiny_run("gpt"), out, capsys)
    assert (out / "config.json").is_file()


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)  # exited: no process has this id now (reused only after the system wraps around)


def test_what_a_killed_export_left_in_or_beside_out_does_not_block_the_retry(tiny_run, tmp_path, capsys,
                                                                             monkeypatch):
    """A SIGKILLed export into an existing empty --out left its staging folder inside, and every retry
    was refused: "exists and is not empty"."""
    out = tmp_path / "shared"
    out.mkdir()
    dead = _dead_pid()
    left_inside = out / f"{hf_export.STAGING_PREFIX}shared-{dead}-0123abcd"
    left_inside.mkdir()
    (left_inside / "model.safetensors").write_bytes(b"cut short")
    live = out / f"{hf_export.STAGING_PREFIX}shared-{os.getpid()}-0123abcd"  # a process still writing: kept
    live.mkdir()
    err = _one_line_error(["export", str(tiny_run("gpt")), "--out", str(out), "--no-progress"], capsys)
    assert "not empty" in err and live.is_dir()
    live.rmdir()
    _export(tiny_run("gpt"), out, capsys)
    assert (out / "config.json").is_file() and not [p for p in out.iterdir() if p.name.startswith(".")]
    dot = tmp_path / "dot"  # --out .: the leftover is named after the folder's own name
    dot.mkdir()
    (dot / f"{hf_export.STAGING_PREFIX}dot-{dead}-89abcdef").mkdir()
    monkeypatch.chdir(dot)
    _export(tiny_run("gpt"), Path("."), capsys)
    assert (dot / "config.json").is_file() and not [p for p in dot.iterdir() if p.name.startswith(".")]
    beside = tmp_path / "new"
    left_beside = tmp_path / f"{hf_export.STAGING_PREFIX}new-{dead}-4567cdef"
    left_beside.mkdir()
    _export(tiny_run("gpt"), beside, capsys)
    assert (beside / "config.json").is_file() and not left_beside.exists()


def test_a_symlinked_out_folder_is_written_through(tiny_run, tmp_path, capsys):
    """--out a link to an empty folder: the export lands in the folder and the link stays (it failed
    with ENOTDIR at the final rename, after all the work)."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    _export(tiny_run("gpt"), tmp_path / "link", capsys)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]


def test_a_symlink_to_a_full_folder_is_refused_before_loading(tiny_run, tmp_path, capsys, monkeypatch):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "target")

    def no_loading(*args, **kwargs):
        raise AssertionError("the run was read before the output folder was checked")

    monkeypatch.setattr(hf_export, "resolve_checkpoint", no_loading)
    err = _one_line_error(["export", str(tiny_run("gpt")), "--out", str(tmp_path / "link")], capsys)
    assert "exists and is not empty" in err
    assert (tmp_path / "target" / "keep.txt").read_text() == "mine"


# --------------------------------------------------------------------------------------------
# 10: the exported tokenizer's padding through the remote code
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_exported_tokenizers_padded_batch_runs_through_the_remote_code(arch, tmp_path):
    """A batch the exported tokenizer pads (`padding=True`: on the left, as its tokenizer_config.json
    says) scores every real position as the row alone does; so does one padded on the right
    (transformers' default side; fbt / rfbt refused both)."""
    transformers = pytest.importorskip("transformers")
    _weights_run(tmp_path / "run", arch)
    export_hf(tmp_path / "run", tmp_path / "hf", plain=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    texts = ["the quick brown fox", "hi"]
    for side in ("left", "right"):
        tokenizer.padding_side = side
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        assert not bool(batch.attention_mask.all())
        with torch.no_grad():
            logits = hf(**batch).logits
            for row, text in enumerate(texts):
                alone = hf(**tokenizer([text], return_tensors="pt")).logits[0]
                real = batch.attention_mask[row].bool()
                torch.testing.assert_close(logits[row, real], alone, rtol=0, atol=EXACT_TOL, msg=f"{side}: {text}")
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["padding_side"] == "left"
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    assert reloaded.padding_side == "left"


def test_import_into_an_empty_symlinked_folder(tmp_path):
    """import-hf takes the same --out: a link to an empty folder is written through, the folder kept."""
    pytest.importorskip("transformers")
    from test_interop import _hf_model

    (tmp_path / "llama").mkdir()
    _hf_model("llama", tmp_path / "llama")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    import_hf(tmp_path / "llama", tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "config.json").is_file()
    assert ll.load(tmp_path / "link")[0] is not None
    shutil.rmtree(tmp_path / "target")
