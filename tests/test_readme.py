"""The commands of README.md and of every docs/ page, run as a reader would run them, at tiny scale.

Every fenced `bash` and `python` block of README.md and of each page in mkdocs.yml's nav is
extracted. Each command (backslash continuations joined, `#` comments dropped) either runs here,
after the substitutions below, or is named in SKIPPED with the test that covers it instead; a
command that is neither fails `test_every_docs_command_is_run_or_accounted_for`, and so does a
SKIPPED entry that no longer matches a command. `latentloop ...` commands run in-process through
`cli.main` (one interpreter start for all of them). Each page runs in a scratch folder of its own,
laid out as the pages assume: `configs/` of this repository, `../shared` (the shared data),
`corpus/` (a small text folder) and `hf/llama-src` (a plain Llama checkpoint). A page is read
from the top, as a reader would: the runs its commands read are the runs its earlier commands wrote.

The substitutions, in order (page -> here: why):

- `--preset tiny` -> `--preset test`: tiny models
- `--preset small` -> `--preset tiny`: tiny models; `--iso flops` needs a dense depth >= R (4)
- `--steps N`, `train.steps=N` -> 2; a `train` without `--steps` gets `--steps 2`: two steps prove it
- any `train` gets `--batch-size 2 --set train.eval_batches=1`: two rows a step, one validation batch
- `sequence_len=512` -> `sequence_len=128`: the `test` base has 64, so still an extension
- `--limit N` -> `--limit 2` (an `eval --tasks` without one gets it); `--max-new-tokens N` -> 4;
  `--vocab-size N` -> 300 (just above the 259 byte ids)
- `--tasks core` -> `--tasks copa,lambada_openai`: two of CORE's 22 tasks (a choice and a cloze task)
- `path/to/SmolLM-135M` -> `hf/llama-src`: a plain Llama folder exported here (offline)
- ` [--flag value]` -> removed: the pages' notation for optional flags
- an `eval` without `--tasks` gets `--batches 1`: one batch of the val split
- `--config configs/...` gets `--set model.preset=test`: tiny models

A page's Python blocks run in one namespace after its commands (which make the runs they load),
with `idx`, `prompt_ids` / `ids`, and `fbt` / `lrt` / `rgpt` (random `test` models) defined first,
and the placeholders `runs/NAME` -> `runs/fbt`, `path/or/org-name` -> `hf/llama-src`.

The default suite runs the commands that need no training (FAST) on untrained runs saved here; the
slow test runs every page whole.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SHARED_DATA, write_corpus

import latentloop as ll
from latentloop.cli import main
from latentloop.data import ByteTokenizer
from latentloop.interop import export_hf
from latentloop.runs import save_run

README = REPO / "README.md"
DOCS = REPO / "docs"
MKDOCS = REPO / "mkdocs.yml"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
RUN_LANGUAGES = ("bash", "python")

SUBSTITUTIONS: list[tuple[str, str]] = [
    (r"--preset tiny\b", "--preset test"),
    (r"--preset small\b", "--preset tiny"),
    (r"--steps \d+", "--steps 2"),
    (r"train\.steps=\d+", "train.steps=2"),
    (r"sequence_len=512\b", "sequence_len=128"),
    (r"--limit \d+", "--limit 2"),
    (r"--tasks core\b", "--tasks copa,lambada_openai"),
    (r"--max-new-tokens \d+", "--max-new-tokens 4"),
    (r"--vocab-size \d+", "--vocab-size 300"),
    (r"path/to/SmolLM-135M", "hf/llama-src"),
    (r" \[[^\]]*\]", ""),
]
PYTHON_SUBSTITUTIONS: list[tuple[str, str]] = [
    (r'"runs/NAME"', '"runs/fbt"'),
    (r'"path/or/org-name"', '"hf/llama-src"'),
]
# Commands that do not run here, each with the reason and where it is tested instead.
SKIPPED: dict[str, str] = {
    r"^make demo": "the demo itself: tests/test_demo.py runs `latentloop demo` at a tiny step count",
    r"^make test": "the test suite itself",
    r"^pip install": "needs the network; tests/test_packaging.py checks the extras' names in the metadata",
    r"^latentloop serve": "a server process: tests/test_serve.py (every arch) and test_contract.py",
    r"^curl ": "talks to a running server: tests/test_serve.py sends these requests",
    r"^lm_eval ": "lm-eval's client against a running server: tests/test_lm_eval_adapter.py",
    r"^torchrun ": "several processes (GPUs): tests/test_distributed.py and test_contract.py's torchrun jobs",
    r"^latentloop export-dcp": "an fsdp2 run's shards: tests/test_sharded_checkpoints.py",
    r"^#!/bin/bash|^#SBATCH|^head=|^srun ": "a SLURM job script",
    r"OpenAI\(base_url": "a running server: tests/test_serve.py's OpenAI-client tests",
}
TIMINGS_ENV = "LATENTLOOP_README_TIMINGS"  # a file to append each command's seconds to
CHAT_INPUT = "what is 2+2?\n/quit\n"  # `latentloop chat` reads the user's lines from stdin


@dataclass
class Block:
    page: Path
    language: str
    text: str
    line: int  # where it starts in its page

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[str]:
        """Shell commands: continuation lines joined, comments and blank lines dropped."""
        joined = re.sub(r"\\\n\s*", "", self.text)
        out = []
        for line in joined.splitlines():
            if line.startswith("#!") or line.startswith("#SBATCH"):
                out.append(line)
                continue
            words = shlex.split(line, comments=True)
            if words:
                out.append(_strip_comment(line))
        return out


def _strip_comment(line: str) -> str:
    """The command without its trailing `# comment` (a '#' outside quotes after whitespace)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split, lexer.commenters = True, "#"
    words = list(lexer)
    text = line
    for match in re.finditer(r"\s#", line):
        if shlex.split(line[:match.start()], comments=False) == words:
            text = line[:match.start()]
            break
    return text.strip()


def nav_pages() -> list[Path]:
    """The docs pages in mkdocs.yml's nav, in its order."""
    def files(entries) -> list[str]:
        out = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            out += files(value) if isinstance(value, list) else [value]
        return out

    return [DOCS / name for name in files(yaml.safe_load(MKDOCS.read_text())["nav"])]


PAGES = [README, *nav_pages()]


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(page, m.group(1), m.group(2), text[:m.start()].count("\n") + 1) for m in FENCE.finditer(text)
            if m.group(1) in RUN_LANGUAGES]


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]


def _skipped_by(command: str) -> str | None:
    return next((pattern for pattern in SKIPPED if re.search(pattern, command)), None)


def substitute(command: str) -> str:
    for pattern, replacement in SUBSTITUTIONS:
        command = re.sub(pattern, replacement, command)
    words = command.split()
    if words[:2] == ["latentloop", "train"]:
        if "--steps" not in words and "train.steps=" not in command:
            command += " --steps 2"
        command += " --batch-size 2 --set train.eval_batches=1"
        if "--config" in words:
            command += " --set model.preset=test"
    if words[:2] == ["latentloop", "eval"] and "--tasks" not in words:
        command += " --batches 1"
    if words[:2] == ["latentloop", "eval"] and "--tasks" in words and "--limit" not in words:
        command += " --limit 2"
    return command


def _written_by(command: str) -> str | None:
    """The folder or file a command says it writes (`--out X`), if any."""
    words = shlex.split(command)
    return words[words.index("--out") + 1] if "--out" in words else None


def test_every_docs_page_is_in_the_nav():
    """A page left out of mkdocs.yml's nav would be neither in the site nor run here."""
    assert sorted(p.name for p in DOCS.glob("*.md")) == sorted(p.name for p in nav_pages())
    assert all(page.is_file() for page in PAGES)


def test_every_docs_command_is_run_or_accounted_for():
    blocks = all_blocks()
    commands = [c for b in blocks if b.language == "bash" for c in b.commands()]
    python = "\n".join(b.text for b in blocks if b.language == "python")
    assert len(commands) >= 40  # the extraction sees the pages' command lists
    runnable = [c for c in commands if _skipped_by(c) is None]
    assert all(c.startswith("latentloop ") for c in runnable), [c for c in runnable if not c.startswith("latentloop ")]
    used = {_skipped_by(c) for c in commands} - {None} | {p for p in SKIPPED if re.search(p, python)}
    assert used == set(SKIPPED), f"SKIPPED entries that match no command: {set(SKIPPED) - used}"
    # every page a reader can run from the top has something that runs here
    for page in RUN_PAGES:
        assert any(_skipped_by(c) is None for b in page_blocks(page) if b.language == "bash" for c in b.commands())


@pytest.fixture(scope="module")
def docs_root(tmp_path_factory):
    """`shared/` and a plain Llama checkpoint (standing in for a downloaded one) that every page's
    folder links to."""
    root = tmp_path_factory.mktemp("docs")
    (root / "shared").mkdir()
    (root / "shared" / "data").symlink_to(SHARED_DATA)
    llama = ll.build("gpt", preset="test", mlp="swiglu", qk_norm=False, embed_norm=False, logit_softcap=0.0)
    save_run(llama, ByteTokenizer(), root / "llama-base")
    export_hf(root / "llama-base", root / "llama-src", plain=True)
    write_corpus(root / "corpus", documents=20)
    return root


def _page_folder(root: Path, page: Path, kind: str) -> Path:
    """A fresh folder for one page, laid out as the pages assume (`../shared` is root/shared)."""
    folder = root / f"{kind}-{page.stem}"
    folder.mkdir()
    (folder / "configs").symlink_to(REPO / "configs")
    (folder / "corpus").symlink_to(root / "corpus")
    (folder / "hf").mkdir()
    (folder / "hf" / "llama-src").symlink_to(root / "llama-src")
    return folder


def _run_cli(command: str, monkeypatch, capsys) -> tuple[int, str]:
    argv = shlex.split(command)[1:]
    if argv[0] == "chat":
        monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT_INPUT))
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _run_commands(page: Path, commands: list[tuple[Block, str]], folder: Path, monkeypatch, capsys) -> int:
    """Each command after SUBSTITUTIONS; each must exit 0 and write what its --out names."""
    ran = 0
    for block, command in commands:
        run = substitute(command)
        start = time.perf_counter()
        code, output = _run_cli(run, monkeypatch, capsys)
        if TIMINGS_ENV in os.environ:  # where the time goes, for choosing what the default suite runs
            with open(os.environ[TIMINGS_ENV], "a") as log:
                log.write(f"{time.perf_counter() - start:8.1f}  {page.name}: {run}\n")
        assert code == 0, f"{block.where}: {command}\nran: {run}\n{output[-2000:]}"
        out = _written_by(run)
        assert out is None or (folder / out).exists(), f"{block.where}: {command}\nwrote no {out}"
        ran += 1
    return ran


# Commands that need no training, run in the default suite on untrained `test` runs saved under
# these names (data: the built-in task:addition, so eval's default data is its own); a generation
# that compiles its decode step (tens of seconds) runs in the slow test only.
FAST = (r"^latentloop (import-hf|export |generate runs/fbt (?!.*--decode compiled)"
        r"|eval runs/(fbt|smollm-lrt) (--json|--regime soft|--data))")
FAST_RUNS = {"runs/fbt": "fbt", "runs/smollm-lrt": "lrt"}
RUN_PAGES = [page for page in PAGES if any(
    _skipped_by(c) is None for b in page_blocks(page) if b.language == "bash" for c in b.commands())]
FAST_PAGES = [page for page in RUN_PAGES if any(
    re.search(FAST, c) for b in page_blocks(page) if b.language == "bash" for c in b.commands())]


@pytest.mark.parametrize("page", FAST_PAGES, ids=lambda page: page.name)
def test_docs_commands_that_need_no_training_run_in_the_default_suite(page, docs_root, monkeypatch, capsys):
    """The pages' import, export, eval and generate lines, run as written (after SUBSTITUTIONS) on
    untrained `test`-preset runs saved here; every page whole, training included, is the slow test below."""
    from latentloop.config import DataConfig, RunConfig

    folder = _page_folder(docs_root, page, "fast")
    monkeypatch.chdir(folder)
    for run, arch in FAST_RUNS.items():
        model = ll.build(arch, preset="test")
        save_run(model, ByteTokenizer(), run, RunConfig(model=model.config, data=DataConfig(source="task:addition")))
    commands = [(b, c) for b in page_blocks(page) if b.language == "bash" for c in b.commands() if re.search(FAST, c)]
    assert _run_commands(page, commands, folder, monkeypatch, capsys) == len(commands) > 0


@pytest.mark.slow  # every command trains or evaluates for real: minutes on 2 busy cores
@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="the shared data folder (../shared/data) is not here")
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda page: page.name)
def test_docs_commands_and_python_run_as_written(page, docs_root, monkeypatch, capsys):
    folder = _page_folder(docs_root, page, "slow")
    monkeypatch.chdir(folder)
    blocks = page_blocks(page)
    commands = [(b, c) for b in blocks if b.language == "bash" for c in b.commands() if _skipped_by(c) is None]
    assert _run_commands(page, commands, folder, monkeypatch, capsys) == len(commands) > 0
    # the Python blocks, in one namespace, after the runs exist
    torch = pytest.importorskip("torch")
    namespace = {"idx": torch.randint(0, 256, (2, 16)), "prompt_ids": [256, 100, 101],
                 "fbt": ll.build("fbt", preset="test"), "lrt": ll.build("lrt", preset="test"),
                 "rgpt": ll.build("rgpt", preset="test")}
    namespace["ids"] = namespace["prompt_ids"]
    for block in blocks:
        if block.language != "python" or _skipped_by(block.text) is not None:
            continue
        code = block.text
        for pattern, replacement in PYTHON_SUBSTITUTIONS:
            code = re.sub(pattern, replacement, code)
        exec(compile(code, block.where, "exec"), namespace)  # noqa: S102 - the page's own code
