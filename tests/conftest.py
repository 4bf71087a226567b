"""Shared fixtures: a private token cache per test session, tiny corpora, seeded torch; one tiny
trained run per architecture (`tiny_run`, built once per session by `latentloop train`); and a
`latentloop serve` subprocess for the tests that talk to a real server."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Under pytest-xdist (`make test` runs one worker per core) each worker takes its share of the cores'
# threads (not each as many as there are cores), set before torch starts its thread pool and
# inherited by every process a test starts.
# A thread count given from outside is kept.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
THREADS_SHARED_OUT = XDIST_WORKERS > 0 and "OMP_NUM_THREADS" not in os.environ
if THREADS_SHARED_OUT:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // XDIST_WORKERS))

import torch  # noqa: E402  (after the thread share above)

# The suite's exactness and resume checks compare fp32 paths: `train.dtype=auto` would be bf16 on a
# CPU with bf16 instructions, so the suite (and every process it starts, which inherits this) hides
# them. The bf16 paths are tested with train.dtype=bfloat16 set explicitly.
os.environ["LATENTLOOP_CPU_BF16"] = "0"


def contract_kinds() -> dict[str, tuple[str, dict]]:
    """name -> (arch, model fields): every registered architecture with its defaults (named by the
    arch) and under each of its config's declared VARIANTS (named arch-variant), for the contract
    suite's grid."""
    from latentloop.archs import ARCHS

    kinds = {}
    for arch, spec in ARCHS.items():
        kinds[arch] = (arch, {})
        kinds |= {f"{arch}-{name}": (arch, dict(fields)) for name, fields in spec.config_class.VARIANTS.items()}
    return kinds


def option_sets(options) -> dict[str, dict]:
    """{label: options given} for an architecture's declared options (a tuple of `DecodeOption`):
    the defaults, then one set per declared choice and numeric edge (the contract suite's grid)."""
    sets: dict[str, dict] = {"defaults": {}}
    for option in options:
        values = list(option.choices) if option.choices else \
            [option.kind(option.minimum)] * (option.minimum is not None) + list(option.keywords)
        for value in values:
            given = {option.name: value}
            if option.applies_if is not None:
                given[option.applies_if.other] = option.applies_if.example
            sets[",".join(f"{k}={v}" for k, v in given.items())] = given
    return sets


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REPO = Path(__file__).resolve().parents[1]
SERVER_START_S = 120  # a server's start: importing torch and FastAPI on 2 busy cores
# A server started without --decode decodes as `--decode auto` chooses: compiled when this machine's
# compile cache holds the steps. The tests' servers get an empty compile cache instead, so they
# decode eagerly wherever they run (a machine that ran the slow compiled tests has some of them).
NO_COMPILED_STEPS = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="latentloop-tests-empty-compile-cache-")}
SERVER_EXIT_S = 20  # from SIGTERM to the process's end
SERVER_POLL_S = 0.05
# serve's start line names the address it bound: started with --port 0, each server takes a free port itself
LISTENING = re.compile(r" at (http://127\.0\.0\.1:(\d+))/v1 ")


def round_stored_keys_and_values(cache, dtype: torch.dtype) -> None:
    """An ordinary cache as one that stores keys and values in `dtype` (`kv_dtype`): what it holds
    rounded now, and every later write rounded as it is stored (an independent emulation of the
    frozen cache's half-precision slots)."""
    for stored in (cache.k, cache.v):
        stored.copy_(stored.to(dtype))
    update = cache.update
    cache.update = lambda slot, k, v: update(slot, k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype))


def _no_cxx_reason() -> str | None:
    from latentloop.inference import native

    return native.NO_CXX if native.cxx_compiler() is None else None


# Tests of what inductor compiles (the compiled decode step, its reductions, a package) need a C++
# compiler on the CPU; without one (a machine the suite is run on to check exactly that) they skip,
# and everything else runs on the eager paths.
needs_cxx = pytest.mark.skipif(_no_cxx_reason() is not None, reason=str(_no_cxx_reason()))


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    os.environ["LATENTLOOP_CACHE"] = str(tmp_path_factory.mktemp("llcache"))
    torch.set_num_threads(min(2, torch.get_num_threads()))
    yield


@pytest.fixture
def torch_products(monkeypatch):
    """An accelerated model's products through torch's op, as an exported model computes them (an
    export carries no inference code): a comparison with an export then sees what the export changed,
    not the kernels' rounding against BLAS (the kernels against torch's op: tests/test_products.py;
    both are equally far from a float64 reference)."""
    from latentloop.inference import products

    monkeypatch.setattr(products, "measured_here", lambda: False)


def write_corpus(folder: Path, documents: int = 40) -> Path:
    """A small text corpus in `folder` (created): `documents` .txt files of about 200 words each."""
    folder.mkdir(parents=True, exist_ok=True)
    words = "the quick brown fox jumps over the lazy dog while latent state loops forward".split()
    for i in range(documents):
        text = " ".join(words[(i + j) % len(words)] for j in range(200)) + f"\nstory {i}\n"
        (folder / f"doc{i:02d}.txt").write_text(text)
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A small text corpus (a folder of .txt documents) with enough tokens for a few batches."""
    return write_corpus(tmp_path / "corpus")


# The tiny runs: the `test` preset with a 32-token context (so that fbt's Jacobi iteration is exact
# after 32 passes, which `analyze contraction` shows), trained for two steps of two rows: enough to
# have a checkpoint, a config, a tokenizer, a metrics log and a final validation, in well under a
# second per architecture.
TINY_RUN_CONTEXT = 32
TINY_RUN_ARGV = ("--preset", "test", "--steps", "2", "--batch-size", "2", "--set", f"sequence_len={TINY_RUN_CONTEXT}",
                 "--set", "eval_batches=1", "--no-progress")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """The folder of text the tiny runs trained on: prose and code with nested brackets (what
    `analyze probe` labels)."""
    folder = write_corpus(tmp_path_factory.mktemp("tiny-corpus"), documents=20)
    for i in range(20):
        (folder / f"code{i:02d}.txt").write_text("".join(f"def f{j}(a, (b[{j}], {{c: d}})):\n    return (a)\n"
                                                         for j in range(i, i + 30)))
    return folder


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, modification time in ns)} of every file under `folder`."""
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="session")
def tiny_run(tiny_corpus, tmp_path_factory) -> Iterator[Callable[[str], Path]]:
    """arch -> a run folder of that architecture trained by `latentloop train` (the CLI's own path:
    `TINY_RUN_ARGV` on `tiny_corpus`), once per session, on first use. Shared by every test: read
    it, never write into it (checked when the session ends: a file added, removed or rewritten is
    an error); a test that changes a run (resumes it, writes evals/ or analysis/, damages a file)
    takes its own copy with `tiny_run_copy`."""
    from latentloop.cli import main

    folder = tmp_path_factory.mktemp("tiny-runs")
    made: dict[str, tuple[Path, dict]] = {}

    def run(arch: str) -> Path:
        if arch not in made:
            out = folder / arch
            # its output kept out of the test that happens to use the run first (which reads its own)
            said = io.StringIO()
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                code = main(["train", "--arch", arch, "--data", f"text:{tiny_corpus}", "--out", str(out),
                             *TINY_RUN_ARGV])
            assert code == 0, f"{arch}: {said.getvalue()}"
            made[arch] = out, _snapshot(out)
        return made[arch][0]

    yield run
    changed = [arch for arch, (out, snapshot) in made.items() if _snapshot(out) != snapshot]
    assert not changed, f"a test wrote into the shared tiny run of {changed}: use tiny_run_copy"


@pytest.fixture
def tiny_run_copy(tiny_run, tmp_path) -> Callable[[str], Path]:
    """arch -> a private copy of `tiny_run(arch)` under this test's tmp_path, free to change."""

    def copy(arch: str) -> Path:
        return Path(shutil.copytree(tiny_run(arch), tmp_path / f"{arch}-run"))

    return copy


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


@contextlib.contextmanager
def serving(servers: dict, start_timeout: float | None = None):
    """Wait until every server of {name: ServeProcess} (started together: their imports overlap) is
    ready (each within `start_timeout` s, default SERVER_START_S), yield them, and stop them all,
    whatever happened."""
    try:
        for server in servers.values():
            server.wait_ready(start_timeout)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


# What a process forked for a test (a server, a distributed worker) has imported before it starts
FORK_PRELOAD = ["torch", "torch.distributed", "latentloop.cli", "latentloop.train", "latentloop.serve.app", "uvicorn"]


def _serve_forked(argv: list[str], log: str, env: dict) -> None:
    """A forked server's body: `latentloop serve ...` as its command line would run it, output to
    `log`, in the environment `env` (the starting test's, as a subprocess would inherit it, not the
    fork server's; a thread count is applied: torch read the variables at its import)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from latentloop.cli import main

    sys.exit(main(argv))


_forks = None


def fork_context():
    """multiprocessing's fork server, `FORK_PRELOAD` imported once: a process forked from it starts
    in well under a second instead of importing torch again (~3 s of a core each; the suite starts
    ~20 servers and a few distributed workers this way). Its children inherit the environment the
    fork server started with: ServeProcess hands its server the starting test's; a distributed
    worker sets the variables it reads itself (dist_workers.join)."""
    global _forks
    if _forks is None:
        import multiprocessing

        _forks = multiprocessing.get_context("forkserver")
        _forks.set_forkserver_preload(FORK_PRELOAD)
    return _forks


class _ForkedProcess:
    """A forked server seen through the part of `subprocess.Popen` the tests use."""

    def __init__(self, process):
        self._process = process

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self._process.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("latentloop serve (forked)", timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


class ServeProcess:
    """`latentloop serve RUN --port 0 FLAGS` in a process of its own on the loopback interface; `url`
    and `port` are known once `wait_ready` returns. `env`: variables added to ours. Forked from a
    process that has imported the server already (`fork_context`), or with `entry_point=True`
    started as `python -m latentloop serve ...`, the way a user starts it."""

    def __init__(self, run: Path, log: Path, *flags: str, env: dict | None = None, entry_point: bool = False):
        self.log, self.url, self.port = log, None, None
        argv = ["serve", str(run), "--host", "127.0.0.1", "--port", "0", "--device", "cpu", *flags]
        if "--decode" not in flags:
            env = {**NO_COMPILED_STEPS, **(env or {})}
        log.write_text("")
        if not entry_point:
            process = fork_context().Process(target=_serve_forked, args=(argv, str(log), {**os.environ, **(env or {})}),
                                             daemon=False)
            process.start()
            self.proc = _ForkedProcess(process)
            return
        env = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "latentloop", *argv],
                                         cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float | None = None) -> ServeProcess:
        deadline = time.monotonic() + (SERVER_START_S if timeout is None else timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            if self.url is None:
                found = LISTENING.search(self.log.read_text())
                if found:
                    self.url, self.port = found.group(1), int(found.group(2))
            else:
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=1) as reply:
                        if reply.status == 200:
                            return self
                except OSError:  # not listening yet
                    pass
            time.sleep(SERVER_POLL_S)
        pytest.fail(f"the server did not answer /health within {SERVER_START_S} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(SERVER_EXIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# A small Hugging Face model's weights made to matter in a comparison with transformers: its norm gains
# and biases perturbed from their init, its matrices scaled (transformers' 0.02 init makes greedy
# decoding repeat one token; ten times that gives varied ones)
HF_RANDOM_SCALE = 0.1
HF_WEIGHT_SCALE = 10.0


def perturb_hf_weights(model) -> None:
    """Perturb a transformers model's weights in place (see HF_RANDOM_SCALE / HF_WEIGHT_SCALE), drawing
    from torch's global generator."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * HF_RANDOM_SCALE)
            else:
                p.mul_(HF_WEIGHT_SCALE)


def count_prefill_rows(monkeypatch, model) -> list[int]:
    """The rows of each `model.prefill` call from now on (the list fills as the test runs)."""
    prefilled: list[int] = []
    prefill = model.prefill

    def counted(ids, *args, **kwargs):
        prefilled.append(ids.shape[0])
        return prefill(ids, *args, **kwargs)

    monkeypatch.setattr(model, "prefill", counted)
    return prefilled
