"""Run untrusted generated code (HumanEval candidates and their tests) in a separate process.

Nothing generated ever runs in the evaluating process. Each call of `run_untrusted`:

- writes the code into a fresh temporary directory, which is the child's working directory and
  its HOME/TMPDIR, and is deleted afterwards;
- starts `python -I` (isolated: no PYTHON* variables, no user site, no script folder on sys.path)
  with a minimal environment: none of the parent's variables (tokens, keys, proxies) are inherited;
- in its own session / process group, killed as a whole (SIGKILL) when the timeout expires;
- under a bootstrap that, before running the code, sets resource limits (address space
  RLIMIT_AS = `memory_mb`, CPU seconds, size of written files, no core dumps), replaces
  `socket.socket`, `socket.create_connection` and the other socket constructors by ones that raise
  `PermissionError("sandbox: network access is blocked")`, and installs an audit hook that raises
  the same for every socket event (so `_socket` used directly is refused too; audit hooks cannot be
  removed from inside) and "sandbox: process creation is blocked" for subprocess, os.system, exec,
  fork and spawn. The interpreter runs with `-S` (standard library only, no site-packages);
- inside a new network namespace (`unshare --user --map-root-user --net`, or `unshare --net` when
  that is what is permitted), when the system allows one; otherwise silently without it. In the
  namespace a process also cannot raise its own resource limits back up.

Outcome: "passed" (the code ran to its end), "failed" (an AssertionError escaped, i.e. a test
failed), "timeout", or "error" (any other exception, including MemoryError, a syntax error, a kill
by a signal, or the code calling exit() / os._exit() before finishing).

This is a guard against accidents of generated code (a runaway loop, a huge allocation, a stray
request), not a hardened jail against a deliberate attacker.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

OUTPUT_LIMIT = 8_000  # characters of output kept (the tail)
FILE_SIZE_LIMIT = 16 << 20  # bytes any one file (output included) may grow to
CODE_FILE = "candidate.py"
STATUS_FILE = ".sandbox_status"

# Runs in the child before the untrusted code. argv: [code file, status file, memory bytes, cpu seconds,
# file size limit]. Exit codes: 0 passed, 1 failed (AssertionError), 2 error.
_BOOTSTRAP = r'''
import resource, sys

def _limit(which, value):
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):
        pass

_code_file, _status_file = sys.argv[1], sys.argv[2]
_memory, _cpu, _fsize = (int(v) for v in sys.argv[3:6])
_limit(resource.RLIMIT_AS, _memory)
_limit(resource.RLIMIT_CPU, _cpu)
_limit(resource.RLIMIT_FSIZE, _fsize)
_limit(resource.RLIMIT_CORE, 0)

def _write_status(text):
    with open(_status_file, "w") as handle:
        handle.write(text)

_NETWORK = "sandbox: network access is blocked"
_PROCESS = "sandbox: process creation is blocked"
_PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                             "os.forkpty", "pty.spawn"})

def _audit(event, args):
    if event.startswith("socket."):
        raise PermissionError(_NETWORK)
    if event in _PROCESS_EVENTS:
        raise PermissionError(_PROCESS)

import socket as _socket_module  # imported before the hook so that its own setup is not refused

def _refuse(*args, **kwargs):
    raise PermissionError(_NETWORK)

class _BlockedSocket(_socket_module.socket):  # a class, so that modules subclassing socket still import
    def __init__(self, *args, **kwargs):
        raise PermissionError(_NETWORK)

_socket_module.socket = _BlockedSocket
for _name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
    setattr(_socket_module, _name, _refuse)
sys.addaudithook(_audit)

with open(_code_file, encoding="utf-8") as _handle:
    _source = _handle.read()
sys.argv = [_code_file]
_namespace = {"__name__": "__main__", "__file__": _code_file, "__builtins__": __builtins__}
try:
    exec(compile(_source, _code_file, "exec"), _namespace)
except AssertionError:
    import traceback
    traceback.print_exc()
    _write_status("failed")
    sys.stdout.flush()
    sys.stderr.flush()
    import os
    os._exit(1)
except SystemExit as _exit:
    print(f"sandbox: the code called exit({_exit.code!r}) before finishing", file=sys.stderr)
    _write_status("error")
    sys.stdout.flush()
    sys.stderr.flush()
    import os
    os._exit(2)
except BaseException as _error:
    import traceback
    traceback.print_exc()
    if isinstance(_error, MemoryError):
        print("sandbox: memory limit exceeded", file=sys.stderr)
    _write_status("error")
    sys.stdout.flush()
    sys.stderr.flush()
    import os
    os._exit(2)
_write_status("passed")
sys.stdout.flush()
sys.stderr.flush()
'''


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str  # "passed" | "failed" | "timeout" | "error"
    output: str  # the tail of the child's stdout and stderr, plus a note from the sandbox


@functools.lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """The `unshare` command line that puts a child in a fresh network namespace, or () if none works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for flags in (("--user", "--map-root-user", "--net"), ("--net",)):
        command = (unshare, *flags, "--")
        try:
            probe = subprocess.run([*command, sys.executable, "-I", "-c", "pass"], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10,
                                   env=_child_environment(tempfile.gettempdir()))
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return command
    return ()


def _child_environment(home: str) -> dict[str, str]:
    """A fresh environment: nothing of the parent's is passed on."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",  # ignored under -I, harmless
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.kill()
    except ProcessLookupError:
        pass


def run_untrusted(code: str, timeout: float = 5.0, memory_mb: int = 512, network_namespace: bool = True
                  ) -> SandboxResult:
    """Run `code` in a sandboxed child process (see the module docstring) and report how it ended."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb must be at least 32, got {memory_mb}")
    workdir = tempfile.mkdtemp(prefix="latentloop-sandbox-")
    try:
        work = Path(workdir)
        code_file = work / CODE_FILE
        code_file.write_text(code, encoding="utf-8")
        status_file = work / STATUS_FILE
        output_file = work / ".sandbox_output"
        prefix = network_namespace_prefix() if network_namespace else ()
        cpu_seconds = max(1, int(timeout) + 1)
        command = [*prefix, sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(code_file), str(status_file),
                   str(memory_mb << 20), str(cpu_seconds), str(FILE_SIZE_LIMIT)]
        with output_file.open("wb") as output:
            process = subprocess.Popen(command, cwd=workdir, env=_child_environment(workdir), stdin=subprocess.DEVNULL,
                                       stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                       close_fds=True)
            timed_out = False
            try:
                returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(process)
                returncode = process.wait()
            # Children the code may have left behind share the process group: end them too.
            _kill_group(process)
        text = _read_tail(output_file)
        written = status_file.read_text(encoding="utf-8").strip() if status_file.is_file() else ""
        if timed_out:
            status, note = "timeout", f"sandbox: killed after the {timeout:g} s timeout"
        elif returncode == 0 and written == "passed":
            status, note = "passed", ""
        elif returncode == 1 and written == "failed":
            status, note = "failed", ""
        elif returncode < 0:
            status = "error"
            name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
            if -returncode == signal.SIGXCPU:
                status, note = "timeout", f"sandbox: CPU time limit ({cpu_seconds} s) exceeded"
            else:
                note = f"sandbox: killed by signal {name}"
        else:
            status = "error"
            note = "" if written else f"sandbox: the code ended before finishing (exit code {returncode})"
        if note:
            text = f"{text.rstrip()}\n{note}".lstrip("\n")
        return SandboxResult(passed=status == "passed", status=status, output=text)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _read_tail(path: Path) -> str:
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            if size > OUTPUT_LIMIT:
                handle.seek(size - OUTPUT_LIMIT)
            data = handle.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


__all__ = ["SandboxResult", "network_namespace_prefix", "run_untrusted"]
