"""The documentation's shape, checked so that it cannot drift from the code (issue 50): the README
stays a front page (at most 200 lines, no timings), experiments/RESULTS.md a page of current figures
(at most 200 lines); the architecture lists are the registry's; every link, repository path,
`python -m benchmarks.NAME` and dotted `latentloop.` name the pages mention exists; and the docs
site builds with `mkdocs build --strict` where mkdocs is installed (the `dev` extra).

The pages' commands themselves run in tests/test_readme.py."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest
from conftest import REPO
from test_readme import PAGES

from latentloop.archs import ARCHS

README = REPO / "README.md"
RESULTS = REPO / "experiments" / "RESULTS.md"
MAX_LINES = 200  # issue 50: a page one reads, not a record

# Figures that go stale with every speed-up: a duration, a rate, a ratio, a percentage.
TIMING = re.compile(
    r"\b\d+(?:\.\d+)?\s*(?:ms|µs|us|ns|s|sec|seconds?|min|minutes?|h|hours?)\b"
    r"|(?:tokens?|tok|req(?:uest)?s?|GB|MB|G?FLOPs?)/s\b"
    r"|\b\d+(?:\.\d+)?\s*x\b|\d(?:\.\d+)?\s*×"
    r"|\b\d+(?:\.\d+)?\s*%",
    re.IGNORECASE,
)
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
REPO_PATH = re.compile(r"`((?:latentloop|benchmarks|experiments|configs|tests|docs)/[\w./-]*)`")
BENCHMARK = re.compile(r"python -m benchmarks\.([a-z_][a-z0-9_]*)")  # NAME: a placeholder
DOTTED = re.compile(r"`(latentloop(?:\.\w+)+)")


def _table_rows(text: str, header: str) -> dict[str, str]:
    """{arch: its row} of the markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2:]:
        match = re.match(r"\| `(\w+)` \|", line)
        if not match:
            break
        rows[match.group(1)] = line
    return rows


def test_the_readme_and_results_are_pages_one_reads():
    assert len(README.read_text().splitlines()) <= MAX_LINES
    assert len(RESULTS.read_text().splitlines()) <= MAX_LINES


def test_the_readme_states_no_timing():
    """Speed figures live in experiments/RESULTS.md with their commands; a README figure would go
    stale with the next speed-up."""
    found = [(n, m.group(0)) for n, line in enumerate(README.read_text().splitlines(), 1)
             for m in TIMING.finditer(line)]
    assert not found, f"README.md states figures (line, text): {found}"


def test_the_timing_pattern_catches_the_figures_the_readme_once_had():
    for figure in ("0.43 ms per token", "8.1x Hugging Face", "2.47x the round server", "46.0 tokens/s",
                   "3-4% faster", "about 3 minutes cold", "7 s to listening", "45-61 GB/s"):
        assert TIMING.search(figure), figure
    for plain in ("--steps 600", "600 steps", "a 2-core CPU", "T=256", "sequence_len=512", "`gpt2`"):
        assert not TIMING.search(plain), plain


def test_the_architecture_lists_are_the_registrys():
    """The README's and the architectures page's tables list exactly the registered archs, in the
    registry's order; the decoding-options table names every option each arch declares."""
    names = list(ARCHS)
    assert list(_table_rows(README.read_text(), "| arch | what it is |")) == names
    architectures = (REPO / "docs" / "architectures.md").read_text()
    assert list(_table_rows(architectures, "| arch | mechanism |")) == names
    options = _table_rows((REPO / "docs" / "inference.md").read_text(), "| arch | options |")
    assert list(options) == names
    for name, spec in ARCHS.items():
        missing = [o.name for o in spec.options if f"`{o.name}`" not in options[name]]
        assert not missing, f"docs/inference.md's options of {name} leave out {missing}"


@pytest.mark.parametrize("page", [*PAGES, RESULTS], ids=lambda page: page.name)
def test_every_link_and_path_a_page_names_exists(page):
    """Links to files, repository paths in code spans, benchmark modules and dotted names: a file the
    code moved (a restructure, a rename) fails here rather than sending a reader nowhere."""
    text = page.read_text()
    missing = [link for link in MARKDOWN_LINK.findall(text)
               if "://" not in link and not (page.parent / link).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"
    if page == RESULTS:  # a record of its days: the paths it names are those of the code then
        return
    missing = [path for path in REPO_PATH.findall(text) if not (REPO / path).exists()]
    missing += [f"benchmarks.{name}" for name in BENCHMARK.findall(text)
                if not (REPO / "benchmarks" / f"{name}.py").is_file()]
    missing += [name for name in DOTTED.findall(text) if not _resolves(name)]
    assert not missing, f"{page.name} names what does not exist: {missing}"


def _resolves(dotted: str) -> bool:
    """Whether `a.b.c` is a module, or an attribute chain on the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def test_the_path_checks_catch_a_moved_file():
    assert _resolves("latentloop.archs.ARCHS") and _resolves("latentloop.interop.initialise_from")
    assert not _resolves("latentloop.archs.NO_SUCH_THING") and not _resolves("latentloop.no_such_module")
    assert REPO_PATH.findall("see `latentloop/no_such.py` and `benchmarks/common.py`") == [
        "latentloop/no_such.py", "benchmarks/common.py"]


def test_the_docs_site_builds_strictly(tmp_path):
    """mkdocs.yml's validation makes a page left out of the nav, a broken link or a missing anchor
    a warning, and --strict makes a warning fail the build."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "inference" / "index.html").is_file()
