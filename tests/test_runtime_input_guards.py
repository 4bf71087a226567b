"""Bad input met at run time (an unusable cache folder, a padded API key, a checkpoint of sharded
weights, a JSON file that is no tokenizer): one line naming the problem, or the documented fallback,
never a traceback."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from latentloop import util
from latentloop.cli import main
from latentloop.errors import CheckpointError, DataError, LatentloopError

# --------------------------------------------------------------------------------------------
# A folder this process may not write
# --------------------------------------------------------------------------------------------


@pytest.fixture
def read_only(monkeypatch):
    """folder -> `folder` made read-only (mode 0555, restored after the test). Root writes a folder of
    any mode, so where this process still may, making a folder in it and `os.access` refuse as the
    kernel does for a read-only mount."""
    made = []

    def make(folder: Path) -> Path:
        folder = Path(os.path.abspath(folder))
        folder.chmod(0o555)
        made.append(folder)
        if os.access(folder, os.W_OK):
            real_mkdir, real_access = os.mkdir, os.access

            def mkdir(path, mode=0o777, *args, **kwargs):
                if Path(os.path.abspath(path)).parent == folder:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
                return real_mkdir(path, mode, *args, **kwargs)

            def access(path, mode, *args, **kwargs):
                if Path(os.path.abspath(path)) == folder and mode & os.W_OK:
                    return False
                return real_access(path, mode, *args, **kwargs)

            monkeypatch.setattr(os, "mkdir", mkdir)
            monkeypatch.setattr(os, "access", access)
        return folder

    yield make
    for folder in made:
        folder.chmod(0o755)


# --------------------------------------------------------------------------------------------
# 1. The compile cache in a folder that cannot be made or written: a private temporary one serves
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["parent is a file", "read-only parent", "read-only inductor folder"])
def test_an_unusable_compile_cache_falls_back_to_a_private_folder_with_one_warning(case, tmp_path, monkeypatch,
                                                                                   capsys, read_only):
    """LATENTLOOP_CACHE under a folder we may not write, or an inductor/ there we may not write, ended
    `generate --compile` (and chat, serve --decode compiled) in a PermissionError traceback."""
    from latentloop.inference import fast

    if case == "parent is a file":
        (tmp_path / "a-file").write_text("")
        cache = tmp_path / "a-file" / "cache"
    elif case == "read-only parent":
        (tmp_path / "locked").mkdir()
        cache = read_only(tmp_path / "locked") / "cache"
    else:
        cache = tmp_path / "cache"
        (cache / "inductor").mkdir(parents=True, mode=0o700)
        cache.chmod(0o700)
        read_only(cache / "inductor")
    monkeypatch.setenv("LATENTLOOP_CACHE", str(cache))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(fast, "_private_compile_dirs", {})
    monkeypatch.setattr(util, "_warned", set())
    capsys.readouterr()
    fast.use_compile_cache()
    chosen = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert not chosen.is_relative_to(cache) and chosen.is_dir()
    assert os.access(chosen, os.W_OK)
    fast.use_compile_cache()  # said once a process
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(cache / "inductor") in err[0] and str(chosen) in err[0], err


def test_unwritable_folder_says_why_a_folder_cannot_be_used(tmp_path, read_only):
    from latentloop.inference.cache_trust import unwritable_folder

    assert unwritable_folder(tmp_path / "new" / "folder") is None and (tmp_path / "new" / "folder").is_dir()
    (tmp_path / "a-file").write_text("")
    assert "cannot be made" in unwritable_folder(tmp_path / "a-file" / "folder")
    locked = read_only(tmp_path / "new")
    assert "is not writable" in unwritable_folder(locked)
    assert "cannot be made" in unwritable_folder(locked / "inside")


# --------------------------------------------------------------------------------------------
# 2. The eval bundle's cache folder cannot be made or written: one DataError, nothing downloaded
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["cache is a file", "read-only cache"])
def test_an_unusable_eval_bundle_folder_is_one_data_error_before_any_download(case, tmp_path, monkeypatch,
                                                                              read_only):
    import urllib.request

    from latentloop.eval import core
    from latentloop.runtime import EVAL_DIR_ENV

    def no_download(*args, **kwargs):
        raise AssertionError("the download was attempted")

    monkeypatch.setattr(urllib.request, "urlopen", no_download)
    monkeypatch.delenv(EVAL_DIR_ENV, raising=False)
    cache = tmp_path / "cache"
    if case == "cache is a file":
        cache.write_text("")
    else:
        cache.mkdir()
        read_only(cache)
    monkeypatch.setenv("LATENTLOOP_CACHE", str(cache))
    with pytest.raises(DataError, match="cannot fetch the eval bundle into " + str(cache)) as raised:
        core.locate_eval_dir()
    assert "\n" not in str(raised.value)
    if case == "cache is a file":
        assert "a file is there, not a folder" in str(raised.value)


# --------------------------------------------------------------------------------------------
# 3. An API key the client cannot send
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [" abc", "abc ", "\tabc\n", " "])
def test_a_blank_or_whitespace_padded_api_key_is_refused(key):
    """' abc' started a server that refused every request, `Bearer abc` included (the client's key is
    stripped); ' ' started one that asked for a key nobody could send."""
    from latentloop.serve.settings import ServeSettings, check_settings

    why = "is blank" if not key.strip() else "begins or ends with whitespace"
    with pytest.raises(LatentloopError, match=why) as raised:
        check_settings(ServeSettings("run", api_key=key))
    assert key.strip() not in str(raised.value) or not key.strip()  # the secret is not echoed
    check_settings(ServeSettings("run", api_key="abc"))
    check_settings(ServeSettings("run", api_key="a b"))  # inner spaces arrive as they are
    check_settings(ServeSettings("run", api_key=None))
    check_settings(ServeSettings("run", api_key=""))  # none (an empty $LATENTLOOP_API_KEY): served without a key


@pytest.mark.parametrize("key", ["ключ", "caf\u00e9", "a\x00b", "a\tb"])
def test_an_api_key_outside_printable_ascii_is_refused(key):
    """'ключ' started a server that refused every request: curl sends the key's UTF-8 bytes, the
    server reads a header as Latin-1, and browsers and http.client refuse to send it at all."""
    from latentloop.serve.settings import ServeSettings, check_settings

    with pytest.raises(LatentloopError, match="outside printable ASCII") as raised:
        check_settings(ServeSettings("run", api_key=key))
    assert key not in str(raised.value)  # the secret is not echoed
    check_settings(ServeSettings("run", api_key="A-z0-9_.~!#$%&'*+^`|"))


def test_serve_refuses_a_padded_api_key_from_the_environment_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LATENTLOOP_API_KEY", "secret ")
    assert main(["serve", str(tmp_path / "no-run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "begins or ends with whitespace" in err[0] and "LATENTLOOP_API_KEY" in err[0], err


# --------------------------------------------------------------------------------------------
# 4. --init-from a checkpoint of sharded weights only
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt", "lrt"])  # the same tensors (SFT's path) and an upcycle
def test_init_from_sharded_weights_only_says_how_to_export_them(arch, tiny_run_copy):
    """Said "model.safetensors is not among the files checksums.json recorded", as if damaged."""
    from latentloop.archs import build_model
    from latentloop.interop.upcycle import initialise_from, upcycle_config

    run = tiny_run_copy("gpt")
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    model = build_model(upcycle_config(run, arch))
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "dcp").mkdir()  # what an fsdp2 run with train.full_weights=false keeps instead
    with pytest.raises(CheckpointError, match=f"holds sharded weights only.*latentloop export-dcp {checkpoint}"):
        initialise_from(model, run)


# --------------------------------------------------------------------------------------------
# 5. A JSON file that is not a tokenizer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content, kind", [({"foo": 1}, "a JSON object with no 'model'"),
                                           ([1, 2], "JSON list, not an object"),
                                           (None, "JSON null, not an object")])
def test_json_that_is_not_a_tokenizer_is_named_so(content, kind, tmp_path):
    """Said "cannot read tokenizer ...: expected `,` or `}` at line 1 column 7" of valid JSON."""
    from latentloop.data.tokenizers import load_tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(content))
    with pytest.raises(DataError, match="not a tokenizer file") as raised:
        load_tokenizer(str(path))
    assert kind in str(raised.value) and str(path) in str(raised.value)


def test_train_with_a_json_that_is_not_a_tokenizer_is_one_line(tmp_path, capsys):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"foo": 1}')
    assert main(["train", "--arch", "gpt", "--preset", "test", "--steps", "1", "--tokenizer", str(path),
                 "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("latentloop: error: tokenizer") and "not a tokenizer file" in err[-1], err
