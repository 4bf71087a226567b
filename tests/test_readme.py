"""README.md's commands, run as a reader would run them, at tiny scale.

Every fenced `bash` and `python` block of README.md is extracted. Each command (backslash
continuations joined, `#` comments dropped) either runs here, after the substitutions below, or is
named in SKIPPED with the test that covers it instead; a README command that is neither fails
`test_every_readme_command_is_run_or_accounted_for`, and so does a SKIPPED entry that no longer
matches a command. `latentloop ...` commands run in-process through `cli.main` (one interpreter
start for all of them) in a scratch folder laid out as the README assumes: `configs/` of this
repository, `../shared` (the shared data), and `corpus/` (a small text folder).

The substitutions, in order (README -> here: why):

- `--preset tiny` -> `--preset test`: tiny models
- `--preset small` -> `--preset tiny`: tiny models; `--iso flops` needs a dense depth >= R (4)
- `--steps N`, `train.steps=N` -> 2; a `train` without `--steps` gets `--steps 2`: two steps prove it
- any `train` gets `--batch-size 2 --set train.eval_batches=1`: two rows a step, one validation batch
- `sequence_len=512` -> `sequence_len=128`: the `test` base has 64, so still an extension
- `--limit N` -> `--limit 2` (an `eval --tasks` without one gets it); `--max-new-tokens N` -> 4;
  `--vocab-size N` -> 300 (just above the 259 byte ids)
- `--tasks core` -> `--tasks copa,lambada_openai`: two of CORE's 22 tasks (a choice and a cloze task)
- `path/to/SmolLM-135M` -> `hf/llama-src`: a plain Llama folder exported here (offline)
- ` [--flag value]` -> removed: the README's notation for optional flags
- an `eval` without `--tasks` gets `--batches 1`: one batch of the val split
- `--config configs/...` gets `--set model.preset=test`: tiny models

Python blocks run in one namespace after the command list (which makes the runs they load), with
`idx`, `prompt_ids`, and `fbt` / `lrt` / `rgpt` (random `test` models) defined first, and the
README's placeholders `runs/NAME` / `runs/x` -> `runs/gpt`, `path/or/org-name` -> `hf/llama-src`,
`runs/llama` -> `runs/llama-py`.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass

import pytest
from conftest import REPO, SHARED_DATA, write_corpus

import latentloop as ll
from latentloop.cli import main
from latentloop.data import ByteTokenizer
from latentloop.interop import export_hf
from latentloop.runtime import save_run

README = REPO / "README.md"
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
    (r'"runs/NAME"', '"runs/gpt"'),
    (r'"runs/x"', '"runs/gpt"'),
    (r'"path/or/org-name"', '"hf/llama-src"'),
    (r'"runs/llama"', '"runs/llama-py"'),
    (r'"hf/x"', '"hf/x-py"'),
]
# README commands that do not run here, each with the reason and where it is tested instead.
SKIPPED: dict[str, str] = {
    r"^make demo": "the demo itself: tests/test_demo.py runs `latentloop demo` at a tiny step count",
    r"^make test": "the test suite itself",
    r"^latentloop demo": "tests/test_demo.py runs it at a tiny step count",
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
    language: str
    text: str
    line: int  # where it starts in README.md

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


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [Block(m.group(1), m.group(2), text[:m.start()].count("\n") + 1) for m in FENCE.finditer(text)
            if m.group(1) in RUN_LANGUAGES]


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


def test_every_readme_command_is_run_or_accounted_for():
    commands = [c for b in readme_blocks() if b.language == "bash" for c in b.commands()]
    python = "\n".join(b.text for b in readme_blocks() if b.language == "python")
    assert len(commands) >= 30  # the extraction sees the README's command list
    runnable = [c for c in commands if _skipped_by(c) is None]
    assert all(c.startswith("latentloop ") for c in runnable), [c for c in runnable if not c.startswith("latentloop ")]
    used = {_skipped_by(c) for c in commands} - {None} | {p for p in SKIPPED if re.search(p, python)}
    assert used == set(SKIPPED), f"SKIPPED entries that match no README command: {set(SKIPPED) - used}"


@pytest.fixture(scope="module")
def readme_folder(tmp_path_factory):
    """A scratch folder laid out as the README assumes, with a plain Llama checkpoint in
    hf/llama-src standing in for a downloaded one."""
    root = tmp_path_factory.mktemp("readme")
    work = root / "work"
    work.mkdir()
    (work / "configs").symlink_to(REPO / "configs")
    (root / "shared").mkdir()
    (root / "shared" / "data").symlink_to(SHARED_DATA)
    write_corpus(work / "corpus", documents=20)
    llama = ll.build("gpt", preset="test", mlp="swiglu", qk_norm=False, embed_norm=False, logit_softcap=0.0)
    save_run(llama, ByteTokenizer(), work / "llama-base")
    export_hf(work / "llama-base", work / "hf" / "llama-src", plain=True)
    return work


def _run_cli(command: str, monkeypatch, capsys) -> tuple[int, str]:
    argv = shlex.split(command)[1:]
    if argv[0] == "chat":
        monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT_INPUT))
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


FAST = r"^latentloop (import-hf|export |generate runs/fbt |eval runs/fbt (--json|--regime soft)|eval runs/smollm-lrt )"
FAST_RUNS = {"runs/fbt": "fbt", "runs/smollm-lrt": "lrt"}  # made untrained (save_run) for the fast test


def test_readme_commands_that_need_no_training_run_in_the_default_suite(readme_folder, monkeypatch, capsys):
    """The README's import, export, eval and generate lines, run as written (after SUBSTITUTIONS)
    on untrained `test`-preset runs saved here (data: the built-in task:addition, so eval's default
    data is its own); the full list, training included, is the slow test below."""
    from latentloop.config import DataConfig, RunConfig

    folder = readme_folder / "fast"
    folder.mkdir()
    (folder / "hf").mkdir()
    (folder / "hf" / "llama-src").symlink_to(readme_folder / "hf" / "llama-src")
    (folder / "corpus").symlink_to(readme_folder / "corpus")
    monkeypatch.chdir(folder)
    for run, arch in FAST_RUNS.items():
        model = ll.build(arch, preset="test")
        save_run(model, ByteTokenizer(), run, RunConfig(model=model.config, data=DataConfig(source="task:addition")))
    commands = [c for b in readme_blocks() if b.language == "bash" for c in b.commands() if re.search(FAST, c)]
    assert len(commands) >= 6
    for command in commands:
        code, output = _run_cli(substitute(command), monkeypatch, capsys)
        assert code == 0, f"{command}\nran: {substitute(command)}\n{output[-2000:]}"
    assert (folder / "runs" / "smollm" / "config.json").is_file()
    assert (folder / "hf" / "smollm-lrt" / "config.json").is_file()


@pytest.mark.slow  # every command trains or evaluates for real: minutes on 2 busy cores
@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="the shared data folder (../shared/data) is not here")
def test_readme_commands_and_python_run_as_written(readme_folder, monkeypatch, capsys):
    monkeypatch.chdir(readme_folder)
    ran, seconds = [], {}
    for block in readme_blocks():
        if block.language != "bash":
            continue
        for command in block.commands():
            if _skipped_by(command) is not None:
                continue
            run = substitute(command)
            start = time.perf_counter()
            code, output = _run_cli(run, monkeypatch, capsys)
            seconds[run] = time.perf_counter() - start
            if TIMINGS_ENV in os.environ:  # where the time goes, for choosing what the default suite runs
                with open(os.environ[TIMINGS_ENV], "a") as log:
                    log.write(f"{seconds[run]:8.1f}  {run}\n")
            assert code == 0, f"README line {block.line}: {command}\nran: {run}\n{output[-2000:]}"
            ran.append(run)
    assert len(ran) >= 20
    # what the commands promise: the runs they name exist and load
    for run in ("runs/gpt", "runs/fbt", "runs/fbt-ft", "runs/smollm-lrt", "runs/rgpt", "runs/fbt-sft", "runs/fbt-512"):
        assert ll.load(run)[0] is not None
    assert (readme_folder / "hf" / "smollm-lrt" / "config.json").is_file()
    assert (readme_folder / "report").is_dir() and (readme_folder / "tok" / "tokenizer.json").is_file()
    # the Python blocks, in one namespace, after the runs exist
    torch = pytest.importorskip("torch")
    namespace = {"idx": torch.randint(0, 256, (2, 16)), "prompt_ids": [256, 100, 101],
                 "fbt": ll.build("fbt", preset="test"), "lrt": ll.build("lrt", preset="test"),
                 "rgpt": ll.build("rgpt", preset="test")}
    namespace["ids"] = namespace["prompt_ids"]
    for block in readme_blocks():
        if block.language != "python" or _skipped_by(block.text) is not None:
            continue
        code = block.text
        for pattern, replacement in PYTHON_SUBSTITUTIONS:
            code = re.sub(pattern, replacement, code)
        exec(compile(code, f"README.md:{block.line}", "exec"), namespace)  # noqa: S102 - the README's own code
    assert (readme_folder / "runs" / "llama-py").is_dir() and (readme_folder / "hf" / "x-py").is_dir()
