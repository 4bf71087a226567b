"""Shared fixtures: a private token cache per test session, tiny corpora, seeded torch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    os.environ["LATENTLOOP_CACHE"] = str(tmp_path_factory.mktemp("llcache"))
    torch.set_num_threads(min(2, torch.get_num_threads()))
    yield


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A small text corpus (a folder of .txt documents) with enough tokens for a few batches."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    words = "the quick brown fox jumps over the lazy dog while latent state loops forward".split()
    for i in range(40):
        text = " ".join(words[(i + j) % len(words)] for j in range(200)) + f"\nstory {i}\n"
        (folder / f"doc{i:02d}.txt").write_text(text)
    return folder


def shared_data(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not available")
    return path


@pytest.fixture(scope="session")
def code_sandbox():
    """Skip a test that runs untrusted code where the sandbox cannot start (e.g. not root, no bubblewrap);
    with LATENTLOOP_REQUIRE_SANDBOX=1 (CI) fail instead."""
    from latentloop.errors import SandboxUnavailable
    from latentloop.eval.sandbox import require_sandbox

    try:
        require_sandbox()
    except SandboxUnavailable as error:
        if os.environ.get("LATENTLOOP_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"{error} (LATENTLOOP_REQUIRE_SANDBOX=1)")
        pytest.skip(str(error))
