"""Adding an architecture touches its own folder and one registry line: a throwaway architecture in a
temporary package (a model, an objective, a spec) registered through `LATENTLOOP_ARCHS`, with no other
file edited, is seen by every front-end and passes the contract suite."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

MODEL = textwrap.dedent('''
    """A throwaway architecture: gpt with a learned gain on each embedding channel."""

    from dataclasses import dataclass
    from typing import ClassVar

    import torch
    from torch import Tensor, nn

    from latentloop.config import ModelConfig
    from latentloop.models.backbone import GPT


    @dataclass
    class ToyConfig(ModelConfig):
        arch: ClassVar[str] = "toy"


    class Toy(GPT):
        def __init__(self, config: ToyConfig):
            super().__init__(config)
            self.embed_gain = nn.Parameter(torch.ones(config.n_embd))

        def embed(self, idx: Tensor) -> Tensor:
            return super().embed(idx) * self.embed_gain  # (B, T, D)
''')

SPEC = textwrap.dedent('''
    from latentloop.archs import ArchSpec, register
    from latentloop.objectives.base import NextTokenObjective

    from .model import Toy, ToyConfig

    SPEC = register(ArchSpec("toy", "a throwaway: gpt with a learned embedding gain", ToyConfig, Toy,
                             NextTokenObjective))
''')


@pytest.fixture
def toy_package(tmp_path) -> dict[str, str]:
    package = tmp_path / "plugins" / "toyarch"
    package.mkdir(parents=True)
    (package / "model.py").write_text(MODEL)
    (package / "__init__.py").write_text(SPEC)
    path = os.pathsep.join([str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "LATENTLOOP_ARCHS": "toyarch"}


def run(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)


def test_a_plugin_architecture_is_registered_for_every_front_end(toy_package, tmp_path):
    code = textwrap.dedent(f'''
        import latentloop as ll
        from latentloop.archs import ARCHS
        from latentloop.cli import main
        assert "toy" in ARCHS, list(ARCHS)
        model = ll.build("toy", preset="test")
        assert model.embed_gain.shape == (64,)
        assert main(["train", "--arch", "toy", "--preset", "test", "--data", "stdlib", "--steps", "2",
                     "--batch-size", "2", "--set", "sequence_len=32", "--out", {str(tmp_path / "run")!r},
                     "--no-progress"]) == 0
        assert main(["generate", {str(tmp_path / "run")!r}, "--prompt", "hi", "--max-new-tokens", "3"]) == 0
        print("OK")
    ''')
    done = run(code, toy_package)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-2000:]


def test_a_second_architecture_under_a_registered_name_is_refused(toy_package):
    code = textwrap.dedent('''
        from latentloop.archs import ARCHS, register
        try:
            register(ARCHS["toy"])
        except ValueError as error:
            print("refused:", error)
    ''')
    done = run(code, toy_package)
    assert "refused: an architecture named 'toy' is registered already" in done.stdout, done.stderr[-2000:]


def test_entry_points_register_in_either_form(tmp_path):
    """A distribution's `latentloop.archs` entry points register a module that registers its spec on
    import, named as a module (`toy3 = toyarch3`) or in the usual `module:attr` form (`toy = toyarch:SPEC`),
    and a spec its module only defines (`toy2 = toyarch2:SPEC`)."""
    plugins = tmp_path / "plugins"
    for name, registers in (("toy", True), ("toy2", False), ("toy3", True)):
        package = plugins / ("toyarch" + name[3:])
        package.mkdir(parents=True)
        (package / "model.py").write_text(MODEL.replace('"toy"', f'"{name}"'))
        spec = SPEC.replace('ArchSpec("toy"', f'ArchSpec("{name}"')
        (package / "__init__.py").write_text(spec if registers else spec.replace("SPEC = register(", "SPEC = (", 1))
    info = plugins / "toyplugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[latentloop.archs]\ntoy = toyarch:SPEC\ntoy2 = toyarch2:SPEC\n"
                                           "toy3 = toyarch3\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")])}
    env.pop("LATENTLOOP_ARCHS", None)
    done = run("from latentloop.archs import ARCHS; print(sorted(name for name in ARCHS if name.startswith('toy')))",
               env)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "['toy', 'toy2', 'toy3']"


def test_a_plugin_that_does_not_import_is_one_warning_and_the_rest_works(tmp_path):
    env = {**os.environ, "LATENTLOOP_ARCHS": "no_such_arch_module"}
    done = subprocess.run([sys.executable, "-m", "latentloop", "train", "--arch", "gpt", "--preset", "test",
                           "--data", "stdlib", "--steps", "1", "--batch-size", "2", "--out", str(tmp_path / "run"),
                           "--no-progress"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    warned = [line for line in done.stderr.splitlines() if "no_such_arch_module" in line]
    assert len(warned) == 1 and "left out" in warned[0] and "Traceback" not in done.stderr


@pytest.mark.slow  # the whole contract suite for one more architecture: a few minutes on 2 cores
def test_a_plugin_architecture_passes_the_contract_suite(toy_package):
    """Every contract case the baseline gets (the toy declares no options, as gpt) is collected for the
    toy architecture too, and every one passes."""
    def pytest_run(*args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                              capture_output=True, text=True, env=toy_package, cwd=REPO, timeout=timeout)

    collected = pytest_run("--collect-only", "tests/test_contract.py", timeout=300).stdout.splitlines()
    toy = [test for test in collected if "[toy" in test]
    baseline = [test for test in collected if "[gpt" in test]
    assert toy and len(toy) == len(baseline), (len(toy), len(baseline))
    done = pytest_run("-x", "tests/test_contract.py", "-k", "toy", timeout=1800)
    tail = done.stdout[-3000:]
    assert done.returncode == 0, tail + done.stderr[-2000:]
    assert f"{len(toy)} passed" in tail, tail  # none skipped, none deselected by accident


def test_a_model_that_carries_state_and_drafts_must_restore_it():
    """The default `keep_verified` rolls back the keys and values only: a spec whose model drafts
    itself and carries state from token to token (CARRIED_STATE) without restoring it is refused when
    the spec is made, not found later as wrong tokens."""
    from latentloop.archs import ArchSpec
    from latentloop.archs.fbt.model import FBT, FBTConfig
    from latentloop.archs.fbt.objective import MultiPassObjective

    class DraftingFBT(FBT):
        def draft_options(self, options):
            return None

    with pytest.raises(ValueError, match=r"DraftingFBT drafts itself and carries fbt\.prev_top .* keep_verified"):
        ArchSpec("fbt", "fbt drafting itself", FBTConfig, DraftingFBT, MultiPassObjective)

    class RestoringFBT(DraftingFBT):
        def keep_verified(self, cache, out, kept, state_before, options):
            super().keep_verified(cache, out, kept, state_before, options)

    assert ArchSpec("fbt", "fbt drafting itself", FBTConfig, RestoringFBT, MultiPassObjective).draft is not None
    assert ArchSpec("fbt", "fbt as it is", FBTConfig, FBT, MultiPassObjective).draft is None
