"""Extras as every pip installs them: the built metadata's `Provides-Extra` names equal the names in
pyproject.toml (so a pip that compares the typed name literally, as pip < 23.3 does, finds them),
and every `latentloop[...]` / `.[...]` that the README, the Makefile or the package's messages tell a
user to install names only those extras, spelled the same way. Offline: the metadata is prepared
by the installed setuptools, as `pip install .` would. The version is written once; the built sdist
and wheel carry the package data; the wheel installed in a fresh venv runs outside the checkout
(slow)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import torch
from conftest import THREADS_SHARED_OUT, XDIST_WORKERS

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the project supports 3.10, where this file skips)

REPO = Path(__file__).resolve().parents[1]
# What users are told to install: `pip install 'latentloop[a,b]'`, `pip install -e ".[a,b]"`, and
# the Makefile's EXTRAS default.
INSTALL_MENTION = re.compile(r"""[`'"](?:latentloop|\.)\[([A-Za-z0-9_.,\- ]+)\]""")
MAKEFILE_EXTRAS = re.compile(r"^EXTRAS \?= (.+)$", re.MULTILINE)


def normalised(name: str) -> str:
    """PEP 685's form of an extra name: lowercase, each run of '-', '_' and '.' one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_declared_extras_are_written_as_the_metadata_holds_them(tmp_path):
    build_meta = pytest.importorskip("setuptools.build_meta")
    info = build_meta.prepare_metadata_for_build_wheel(str(tmp_path))
    metadata = Parser().parsestr((tmp_path / info / "METADATA").read_text())
    provided = set(metadata.get_all("Provides-Extra") or [])
    declared = _declared()
    assert provided == declared, "an extra's name in pyproject.toml is not the one the metadata carries"
    assert all(name == normalised(name) for name in declared)
    # each extra brings what it names (lm-eval: lm-eval's API client, whose retries need tenacity)
    requires = metadata.get_all("Requires-Dist") or []
    assert any(r.startswith("lm_eval[api]") and 'extra == "lm-eval"' in r for r in requires)


def test_every_install_instruction_names_a_declared_extra():
    declared = _declared()
    texts = {path: path.read_text() for path in [REPO / "README.md", REPO / "Makefile",
                                                 *sorted((REPO / "latentloop").rglob("*.py"))]}
    mentioned: dict[str, set[str]] = {}
    for path, text in texts.items():
        groups = INSTALL_MENTION.findall(text)
        if path.name == "Makefile":
            groups += MAKEFILE_EXTRAS.findall(text)
        for group in groups:
            for name in (part.strip() for part in group.split(",")):
                if name and not name.startswith("$("):  # a make variable, checked through EXTRAS itself
                    mentioned.setdefault(name, set()).add(path.relative_to(REPO).as_posix())
    assert {"hf", "lm-eval", "serve", "plot"} <= set(mentioned), mentioned  # the pattern finds the mentions
    unknown = {name: files for name, files in mentioned.items() if name not in declared}
    assert not unknown, f"install instructions name extras that pip will not find: {unknown}"


def test_the_package_data_ships_every_file_the_native_kernels_build_from():
    """`native.py` builds each kernel from its C file and the headers beside it (and hashes them all
    into the build's key): an installed wheel must carry every one, or the kernels fail to build there."""
    from fnmatch import fnmatch

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "latentloop.inference"]
    sources = [path.name for pattern in ("*.c", "*.h") for path in (REPO / "latentloop" / "inference").glob(pattern)]
    assert any(name.endswith(".h") for name in sources)  # the kernels include headers of their own
    assert [name for name in sources if not any(fnmatch(name, pattern) for pattern in patterns)] == []


# --------------------------------------------------------------------------------------------
# The version, the built sdist and wheel, and the wheel installed without the checkout
# --------------------------------------------------------------------------------------------

# What the package needs beside its modules (pyproject's package-data), as paths in the package
PACKAGE_DATA_GLOBS = ("inference/*.c", "inference/*.h", "eval/lm_eval_tasks/*.yaml", "interop/hf_remote/*.py",
                      "serve/static/*", "measured_mfu.json")


def test_the_version_is_written_once(tmp_path):
    """latentloop/__init__.py's __version__ is the one place: pyproject reads it (dynamic), the built
    metadata carries it, `latentloop --version` prints it, and the changelog has its section."""
    import latentloop
    from latentloop.cli import main

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "latentloop.__version__"}
    build_meta = pytest.importorskip("setuptools.build_meta")
    info = build_meta.prepare_metadata_for_build_wheel(str(tmp_path))
    assert Parser().parsestr((tmp_path / info / "METADATA").read_text())["Version"] == latentloop.__version__
    result = subprocess.run([sys.executable, "-m", "latentloop", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout == f"latentloop {latentloop.__version__}\n"
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert f"## {latentloop.__version__}" in (REPO / "CHANGELOG.md").read_text()


def _source_copy(dest: Path) -> Path:
    """The checkout's files as a fresh clone would have them (tracked and new, not ignored), so that
    building writes its build/ and egg-info there, not into the checkout."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip("git is needed to list the checkout's files")
    for name in listed.stdout.splitlines():
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel, built by `python -m build` from a copy of the checkout (no isolation:
    the build backend installed here, no download)."""
    pytest.importorskip("build")
    source = _source_copy(tmp_path_factory.mktemp("source"))
    dist = tmp_path_factory.mktemp("dist")
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return {"wheel": next(dist.glob("latentloop-*.whl")), "sdist": next(dist.glob("latentloop-*.tar.gz"))}


def test_the_sdist_and_the_wheel_carry_the_package_data(built):
    """Every C source and header the native kernels build from, the lm-eval task files, the remote-code
    files the HF export copies, the chat page and plan's measured MFU: in the wheel and in the sdist."""
    import latentloop

    expected = sorted(f"latentloop/{path.relative_to(REPO / 'latentloop').as_posix()}"
                      for pattern in PACKAGE_DATA_GLOBS for path in (REPO / "latentloop").glob(pattern))
    assert any(name.endswith(".c") for name in expected) and any("static/" in name for name in expected)
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = set(wheel.namelist())
        metadata = Parser().parsestr(wheel.read(f"latentloop-{latentloop.__version__}.dist-info/METADATA").decode())
        entry_points = wheel.read(f"latentloop-{latentloop.__version__}.dist-info/entry_points.txt").decode()
    assert [name for name in expected if name not in names] == []
    assert metadata["Version"] == latentloop.__version__ and "serve" in metadata.get_all("Provides-Extra")
    assert "latentloop = latentloop.cli:main" in entry_points
    with tarfile.open(built["sdist"]) as sdist:
        root = f"latentloop-{latentloop.__version__}/"
        members = {member.name.removeprefix(root) for member in sdist.getmembers()}
    assert [name for name in expected if name not in members] == []
    # the license's text travels with every copy (MIT asks it); the sdist leaves out the tests, which
    # read the repository around them and cannot run from it
    assert any(name.endswith("licenses/LICENSE") for name in names) and "LICENSE" in members
    assert metadata["License-Expression"] == "MIT"
    assert not any(name.startswith("tests/") for name in members)


WHEEL_STEPS = 3  # the demo's training steps per arch in the installed-wheel test: a few, as the issue asks


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(built, tmp_path):
    """`pip install latentloop-*.whl[serve]` into a fresh venv (torch from the pinned CPU wheel, as the
    Makefile installs it), then, from a folder that is not the checkout and without its path:
    --version, a short demo, generate, and a serve round trip (the chat page and a completion)."""
    import latentloop

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python, cli = venv / "bin" / "python", venv / "bin" / "latentloop"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def run(*argv, timeout=900, **kwargs):
        result = subprocess.run([str(a) for a in argv], cwd=work, env=env, capture_output=True, text=True,
                                timeout=timeout, **kwargs)
        assert result.returncode == 0, f"{argv}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
        return result

    work = tmp_path / "elsewhere"
    work.mkdir()
    # torch first, pinned to the version installed here (the Makefile's TORCH_SPEC): never a CUDA build
    import torch

    run(python, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}")
    run(python, "-m", "pip", "install", "-q", f"{built['wheel']}[serve]")
    assert run(cli, "--version").stdout == f"latentloop {latentloop.__version__}\n"
    where = run(python, "-c", "import latentloop, sys; print(latentloop.__file__); print(sys.path)").stdout
    assert str(venv) in where.splitlines()[0] and str(REPO) not in where
    run(cli, "demo", "--steps", WHEEL_STEPS, "--preset", "test", "--archs", "gpt,rgpt", "--out", "demo",
        "--no-progress")
    demo_run = next(path.parent for path in sorted((work / "demo").rglob("config.json"))
                    if (path.parent / "checkpoints").is_dir())
    generated = json.loads(run(cli, "generate", demo_run, "--prompt", "def ", "--max-new-tokens", "8",
                               "--temperature", "0", "--json").stdout)
    assert generated["prompt"] == "def " and generated["new_tokens"] == len(generated["ids"]) <= 8

    server = subprocess.Popen([str(cli), "serve", str(demo_run), "--port", "0"], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            found = re.search(r"at (http://[^/\s]+)/v1", line)
            url = found.group(1) if found else None
            assert line or server.poll() is None, "the server stopped before it listened"
        assert url, "the server did not say where it listens"
        while True:  # the port is bound before the model loads; it answers once uvicorn runs
            try:
                with urllib.request.urlopen(url + "/health", timeout=10):
                    break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the server never answered"
                time.sleep(0.2)
        with urllib.request.urlopen(url + "/", timeout=60) as reply:
            assert b'"page/chat.js"' in reply.read()  # relative: a proxy's path too
        request = urllib.request.Request(url + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "def ", "max_tokens": 4,
                                                          "temperature": 0}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            completion = json.loads(reply.read())
        assert completion["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.skipif(not THREADS_SHARED_OUT, reason="not under pytest-xdist, or OMP_NUM_THREADS given from outside")
def test_each_test_worker_takes_its_share_of_the_cores():
    """`make test` runs one pytest worker per core: every worker, and every process its tests start,
    keeps to its share of the threads instead of each starting one per core."""
    share = max(1, (os.cpu_count() or 1) // XDIST_WORKERS)
    assert torch.get_num_threads() == min(2, share)  # the suite's own processes keep to 2 (conftest's cache fixture)
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)
    assert int(child.stdout) == share
