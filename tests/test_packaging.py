"""Extras as every pip installs them: the built metadata's `Provides-Extra` names equal the names in
pyproject.toml (so a pip that compares the typed name literally, as pip < 23.3 does, finds them),
and every `latentloop[...]` / `.[...]` that the README, the Makefile or the package's messages tell a
user to install names only those extras, spelled the same way. Offline: the metadata is prepared
by the installed setuptools, as `pip install .` would."""

from __future__ import annotations

import re
from email.parser import Parser
from pathlib import Path

import pytest

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
