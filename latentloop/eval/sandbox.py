"""Run untrusted generated code (HumanEval candidates and their tests) in an isolated process.

Nothing generated ever runs in the evaluating process. Each call of `run_untrusted` starts the
interpreter under bubblewrap (`bwrap`, Debian package `bubblewrap`), as root, with:

- **its own PID, network, IPC, UTS and mount namespaces** (`--unshare-pid/net/ipc/uts`): the code
  sees only its own processes, so it cannot signal or trace anything of ours; it has a loopback
  device and nothing else (no route out, and nothing of ours listens there); when the sandbox's
  init (PID 1) ends, the kernel kills everything left in the namespace, and the init's exit waits
  for all of it. We kill that init (found through `--info-fd`) when the code's process has ended or
  timed out, and return only once it has exited: no daemon (`setsid`, double fork) outlives the
  call. `--die-with-parent` covers our own death;
- **a filesystem view of its own**: `/usr` (with the `/bin`, `/lib`, ... links), the Python
  installation and two files of `/etc` (`ld.so.cache`, `localtime`), all read-only; a minimal
  `/dev`; no `/proc` (nothing of ours — environment, command lines, memory — can be read there);
  no home folders, no project, no `/tmp` of ours. The only writable place is the work folder
  `/sandbox` (also `/tmp`, `HOME`, `TMPDIR`), a tmpfs of `DISK_LIMIT` bytes and `FILE_LIMIT` files
  that vanishes with the namespace: the code can neither read our files nor fill the disk;
- **a throwaway unprivileged uid**: a first stage mounts the work folder and joins a new, empty
  session keyring (ours, and the keys we possess through it, stay out of reach), then executes the
  bootstrap, which drops to a random uid and gid in [2^30, 2^31) that owns no file, with no
  supplementary groups and no capabilities permitted, effective or ambient (bwrap sets
  no_new_privs: setuid binaries and file capabilities give nothing; the uid change also makes the
  bootstrap undumpable, so the code's own child processes cannot trace it or read its memory).
  The uid is the code's own, so the per-user process limit (`PROCESS_LIMIT` tasks, threads
  included) counts exactly its processes: a fork bomb stops there. Other limits: address space
  `memory_mb`, CPU seconds, `FILE_SIZE_LIMIT` bytes per written file (output included),
  `OPEN_FILES_LIMIT` descriptors, no core dumps;
- a fresh environment (`PATH`, `HOME`, `LANG` and thread counts; nothing of ours is passed on) and
  `python -I -S` (standard library only, no user site, no PYTHON* variables);
- in Python, an audit hook that refuses sockets ("sandbox: network access is blocked"), subprocess
  / os.system / exec / fork / spawn ("sandbox: process creation is blocked"), ctypes, building code
  objects, gc object walks, frame listings and trace/profile hooks. These give clear messages for
  honest code and guard the verdict (below); the isolation itself does not depend on them
  (`_posixsubprocess`, for instance, still forks, and whatever it starts is confined as above).

Verdict. The parent decides, never a file or exit code the code controls: the bootstrap receives a
random token on stdin (a file only we can open; stdin is `/dev/null` before the code runs) and
keeps it in the audit hook only. The hook writes `<token> <status>` to a verdict pipe of ours when
the bootstrap reaches one of its verdict lines, checking that the call comes from the bootstrap's
own frame at that line (the line, not an argument, gives the status). "passed": the code ran to
its end; "failed": an AssertionError escaped (a test failed); "error": any other exception
(MemoryError, a syntax error, exit() / sys.exit()); "timeout": the wall-clock timeout or the CPU
limit. No verdict (os._exit(), a kill by a signal) is an error. Writing "passed" somewhere and
exiting 0 therefore gains nothing.

Limits of the guarantee: the verdict is as strong as the token's secrecy inside one CPython
process. Code written against this bootstrap that runs Python inside the audit hook (a signal
handler or finalizer firing there) or corrupts the interpreter (a hand-made .pyc) could read the
token and fake a pass; it still cannot leave the isolation above. Memory of tmpfs files counts
against `DISK_LIMIT`, not `memory_mb`.

Fails closed: when the process is not root, bwrap is missing, or the sandbox does not come
up (e.g. namespaces are forbidden), `run_untrusted` raises `SandboxUnavailable` with one line that
says what is missing; it never runs code with less isolation. `require_sandbox()` checks this once
up front. Install the tool with `apt-get install bubblewrap` (`make test` does, as root).
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from latentloop.errors import SandboxUnavailable

OUTPUT_LIMIT = 8_000  # characters of output kept (the tail)
FILE_SIZE_LIMIT = 16 << 20  # bytes any one written file (output included) may grow to
DISK_LIMIT = 64 << 20  # bytes of the work folder (a tmpfs)
FILE_LIMIT = 4096  # files and folders in the work folder
PROCESS_LIMIT = 16  # tasks (processes and threads) of the sandbox's uid
OPEN_FILES_LIMIT = 128
WORKDIR = "/sandbox"
CODE_FILE = "candidate.py"
ID_RANGE = (1 << 30, (1 << 31) - 1)  # throwaway uids/gids: far above any real account

# Runs first, as root inside bwrap, with ctypes (which must never be loaded where the code runs: its
# types would stay reachable). argv: work folder, disk bytes, files, uid, then the bootstrap's source
# and arguments. Gives the process a new, empty session keyring (it would otherwise share ours, and
# possess our keys), mounts the work folder, and executes the bootstrap in a fresh interpreter.
_PREPARE = r'''
import ctypes, os, sys

def fail(message):
    os.write(2, ("sandbox setup failed: " + message + "\n").encode("utf-8", "replace"))
    os._exit(70)

workdir, disk, inodes, uid = sys.argv[1], *(int(v) for v in sys.argv[2:5])
libc = ctypes.CDLL(None, use_errno=True)
keyctl = {"x86_64": 250, "i686": 288, "aarch64": 219, "riscv64": 219, "ppc64le": 271, "s390x": 280,
          "armv7l": 311, "loongarch64": 219}.get(os.uname().machine)
if keyctl is None:
    fail("no keyctl system call number for " + os.uname().machine)
if libc.syscall(keyctl, 1, None) < 0 and ctypes.get_errno() not in (38, 1):  # JOIN_SESSION_KEYRING
    fail("could not join a new session keyring: " + os.strerror(ctypes.get_errno()))  # (38, 1: no keyrings)
options = f"size={disk},nr_inodes={inodes},mode=0700,uid={uid},gid={uid}".encode()
if libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", 2 | 4 | 8, options) != 0:  # nosuid, nodev, noexec
    fail("could not mount the work folder: " + os.strerror(ctypes.get_errno()))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", *sys.argv[5:]])
'''

# Runs as root inside bwrap, after _PREPARE. argv: uid, address space bytes, cpu seconds, file size,
# processes, open files, verdict fd, work folder, code file name, verdict lines ("line:status,...").
# stdin: the token, a newline, the code. Exit 70: the setup failed.
_BOOTSTRAP = r'''
import os, sys

def _fail(message):
    os.write(2, ("sandbox setup failed: " + message + "\n").encode("utf-8", "replace"))
    os._exit(70)

def _guard(token, verdict_fd, main_frame, verdict_lines, getframe=sys._getframe, write=os.write):
    network = "sandbox: network access is blocked"
    process = "sandbox: process creation is blocked"
    process_events = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                                "os.fork", "os.forkpty", "pty.spawn"})
    introspection = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                               "sys.settrace", "sys.setprofile", "code.__new__", "sys.monitoring.register_callback",
                               "cpython.PyInterpreterState_New"})  # a sub-interpreter would have no hook
    native = frozenset({"ctypes", "_ctypes"})
    given = []

    def hook(event, args):  # never calls anything the code could have supplied
        if event == "latentloop.sandbox.verdict":
            caller = getframe(1)
            if caller is main_frame and not given:
                status = verdict_lines.get(caller.f_lineno)
                if status is not None:
                    given.append(status)
                    write(verdict_fd, token + b" " + status + b"\n")
            return
        if event.startswith("socket."):
            raise PermissionError(network)
        if event in process_events:
            raise PermissionError(process)
        if event in introspection or event.startswith("ctypes."):
            raise PermissionError("sandbox: " + event + " is blocked")
        if event == "import":
            name = args[0]
            if type(name) is not str or name.partition(".")[0] in native:
                raise PermissionError("sandbox: importing this module is blocked")
        elif event == "sys.addaudithook":
            raise RuntimeError("sandbox: audit hooks cannot be added")

    write(verdict_fd, token + b" ready\n")
    return hook

def _main():
    main_frame = sys._getframe()
    try:
        uid, memory, cpu, fsize, processes, files, verdict_fd = (int(v) for v in sys.argv[1:8])
        workdir, code_name = sys.argv[8:10]
        verdict_lines = {int(line): status.encode() for line, status in
                         (item.split(":") for item in sys.argv[10].split(","))}
        data = b""
        while True:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            data += chunk
        token, _, source = data.partition(b"\n")
        del data
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        try:
            os.setresuid(0, 0, 0)
        except PermissionError:
            pass
        else:
            _fail("root privileges could not be dropped")
        os.chdir(workdir)
        code_file = os.path.join(workdir, code_name)
        with open(code_file, "wb") as handle:
            handle.write(source)
        source = source.decode("utf-8", "replace")
        os.set_inheritable(verdict_fd, False)
        import resource, socket, traceback
        def refuse(*args, **kwargs):
            raise PermissionError("sandbox: network access is blocked")
        class BlockedSocket(socket.socket):  # a class, so that modules subclassing socket still import
            def __init__(self, *args, **kwargs):
                refuse()
        socket.socket = BlockedSocket
        for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
            setattr(socket, name, refuse)
        for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0),
                             (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_NOFILE, files),
                             (resource.RLIMIT_AS, memory)):
            resource.setrlimit(which, (value, value))
        sys.addaudithook(_guard(token, verdict_fd, main_frame, verdict_lines))
        del token
    except Exception as error:
        _fail(f"{type(error).__name__}: {error}")
    sys.argv = [code_file]
    namespace = {"__name__": "__main__", "__file__": code_file, "__builtins__": __builtins__}
    try:
        exec(compile(source, code_file, "exec"), namespace)
    except AssertionError as error:
        sys.audit("latentloop.sandbox.verdict")  # verdict: failed
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)  # from the code's frame on
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except SystemExit as stop:
        sys.audit("latentloop.sandbox.verdict")  # verdict: error
        print(f"sandbox: the code called exit({stop.code!r}) before finishing", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    except BaseException as error:
        sys.audit("latentloop.sandbox.verdict")  # verdict: error
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        if isinstance(error, MemoryError):
            print("sandbox: memory limit exceeded", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    sys.audit("latentloop.sandbox.verdict")  # verdict: passed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

_main()
'''
_VERDICT_LINES = ",".join(f"{number}:{match[1]}" for number, line in enumerate(_BOOTSTRAP.split("\n"), 1)
                          if (match := re.search(r"# verdict: (\w+)$", line)))
_STATUSES = ("passed", "failed", "error")


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str  # "passed" | "failed" | "timeout" | "error"
    output: str  # the tail of the child's stdout and stderr, plus a note from the sandbox


def _bwrap() -> str:
    """The path of bwrap, or SandboxUnavailable saying what is missing."""
    if os.geteuid() != 0:
        raise SandboxUnavailable(f"the code sandbox must be started as root (to drop the code to a throwaway uid); "
                                 f"this process runs as uid {os.geteuid()}")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("the code sandbox needs bubblewrap: `bwrap` is not on PATH "
                                 "(install it with `apt-get install bubblewrap`, or run `make test`)")
    return bwrap


def _mapped(path: str, low: int, high: int) -> bool:
    """Whether ids low..high are all mapped in this process's user namespace (uid_map / gid_map)."""
    try:
        rows = [[int(v) for v in line.split()] for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError:
        return True  # no /proc: assume the initial namespace
    return any(inside <= low and high < inside + count for inside, _, count in rows)


def _throwaway_id() -> int:
    low, high = ID_RANGE
    if not (_mapped("/proc/self/uid_map", low, high) and _mapped("/proc/self/gid_map", low, high)):
        raise SandboxUnavailable(f"the code sandbox needs the ids {low}..{high} mapped in this user namespace "
                                 "(/proc/self/uid_map, gid_map) to run code as a throwaway uid")
    return low + secrets.randbelow(high - low)


def _python() -> tuple[str, str]:
    """The base interpreter (not a venv's link to it) and the folder it is installed in."""
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return executable, os.path.realpath(sys.base_prefix)


def _bwrap_command(bwrap: str, info_fd: int, uid: int) -> list[str]:
    executable, prefix = _python()
    command = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
               "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
               "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
               "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            command += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            command += ["--ro-bind", path, path]
    outside = [path for path, inside in ((prefix, ("/usr/",)), (executable, ("/usr/", prefix + "/")))
               if not (path + "/").startswith(inside)]  # the interpreter, when not already in the view
    for path in outside:
        # bwrap would create the missing parents with mode 0700 (as /root is): make them 0755
        command += [arg for parent in reversed(Path(path).parents[:-1]) for arg in ("--dir", str(parent))]
        command += ["--ro-bind", path, path]
    command += ["--dir", "/etc"]
    for path in ("/etc/ld.so.cache", "/etc/localtime"):
        command += ["--ro-bind-try", path, path]
    command += ["--dev", "/dev", "--dir", WORKDIR, "--symlink", WORKDIR, "/tmp", "--chdir", "/",
                executable, "-I", "-S", "-c", _PREPARE, WORKDIR, str(DISK_LIMIT), str(FILE_LIMIT), str(uid),
                _BOOTSTRAP, str(uid)]
    return command


def _child_environment() -> dict[str, str]:
    """A fresh environment: nothing of the parent's is passed on."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": WORKDIR,
        "TMPDIR": WORKDIR,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _kill_group(process: subprocess.Popen) -> None:
    """Kill bwrap and its process group, unless it has ended: then its pid may already name another group."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.kill()
    except ProcessLookupError:
        pass


def _end_namespace(process: subprocess.Popen, info: int) -> None:
    """Kill the sandbox's init (PID 1 of its namespace, named by bwrap's --info-fd) and wait until it is gone.

    bwrap returns as soon as the code's process ends and leaves its init to die by --die-with-parent; the
    kernel then kills whatever the code left in the namespace, and the init's exit waits for all of it. So
    once the init has exited, nothing of the code runs any more. Then bwrap's own group is killed too."""
    try:
        text = os.read(info, 4096)
    except OSError:  # bwrap wrote nothing (yet)
        text = b""
    found = re.search(rb'"child-pid":\s*(\d+)', text), re.search(rb'"pid-namespace":\s*(\d+)', text)
    if all(found):
        init, namespace = (int(match[1]) for match in found)
        try:
            handle = os.pidfd_open(init)  # pins the process: its pid cannot be reused while we hold this
        except OSError:
            handle = None  # already exited and reaped: the namespace is gone
        if handle is not None:
            try:
                if os.stat(f"/proc/{init}/ns/pid").st_ino == namespace:  # still that init, not a reused pid
                    signal.pidfd_send_signal(handle, signal.SIGKILL)
                    select.select([handle], [], [], 10.0)  # readable once it has exited
            except OSError:
                pass  # exiting already (a zombie has no namespaces left)
            finally:
                os.close(handle)
    _kill_group(process)


def run_untrusted(code: str, timeout: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run `code` in the sandbox (see the module docstring) and report how it ended.

    Raises SandboxUnavailable (one line) when the isolation cannot be set up on this machine."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb must be at least 32, got {memory_mb}")
    bwrap = _bwrap()
    uid = _throwaway_id()
    token = secrets.token_hex(16).encode()
    cpu_seconds = max(1, int(timeout) + 1)
    with tempfile.TemporaryDirectory(prefix="latentloop-sandbox-") as host:
        folder = Path(host)
        input_file, output_file = folder / "input", folder / "output"
        input_file.write_bytes(token + b"\n" + code.encode("utf-8", "surrogatepass"))
        # Pipes, not files: the code holds the write ends but can neither truncate nor read them.
        (verdict, verdict_write), (info, info_write) = os.pipe(), os.pipe()
        try:
            with input_file.open("rb") as stdin, output_file.open("wb") as output:
                command = [*_bwrap_command(bwrap, info_write, uid), str(memory_mb << 20), str(cpu_seconds),
                           str(FILE_SIZE_LIMIT), str(PROCESS_LIMIT), str(OPEN_FILES_LIMIT), str(verdict_write),
                           WORKDIR, CODE_FILE, _VERDICT_LINES]
                process = subprocess.Popen(command, stdin=stdin, stdout=output, stderr=subprocess.STDOUT,
                                           env=_child_environment(), pass_fds=(verdict_write, info_write),
                                           start_new_session=True)
            for end in (verdict_write, info_write):
                os.close(end)
            verdict_write = info_write = -1
            os.set_blocking(info, False)
            os.set_blocking(verdict, False)
            timed_out = False
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            _end_namespace(process, info)
            returncode = process.wait()
            verdicts = _verdicts(verdict, token)
        finally:
            for end in (verdict, verdict_write, info, info_write):
                if end >= 0:
                    os.close(end)
        text = _read_tail(output_file)
    if "ready" not in verdicts and not timed_out:
        raise SandboxUnavailable(f"the code sandbox did not start: {_setup_error(text, returncode)}")
    given = [status for status in verdicts if status in _STATUSES]
    signum = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    note = ""
    if timed_out:
        status, note = "timeout", f"sandbox: killed after the {timeout:g} s timeout"
    elif len(given) == 1:
        status = given[0]
    elif signum == signal.SIGXCPU:
        status, note = "timeout", f"sandbox: CPU time limit ({cpu_seconds} s) exceeded"
    elif signum:
        status = "error"
        name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
        note = f"sandbox: killed by signal {name}"
    else:
        status, note = "error", f"sandbox: the code ended before finishing (exit code {returncode})"
    if note:
        text = f"{text.rstrip()}\n{note}".lstrip("\n")
    return SandboxResult(passed=status == "passed", status=status, output=text)


@functools.lru_cache(maxsize=1)
def _probe(bwrap: str) -> None:
    result = run_untrusted("assert sum(range(4)) == 6\n", timeout=30.0)
    if not result.passed:
        last = (result.output.strip().splitlines() or ["no output"])[-1]
        raise SandboxUnavailable(f"the code sandbox does not run code correctly: {result.status}: {last}")


def require_sandbox() -> None:
    """Raise SandboxUnavailable (one line) unless untrusted code can be run here; checked once per process."""
    _probe(_bwrap())


def _verdicts(pipe: int, token: bytes) -> list[str]:
    """The statuses the bootstrap wrote (lines `<token> <status>`), in order; anything else is ignored."""
    data = b""
    while len(data) < (1 << 20):  # the pipe holds what the code wrote; nothing writes any more
        try:
            chunk = os.read(pipe, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    prefix = token + b" "
    return [line[len(prefix):].decode("ascii", "replace") for line in data.split(b"\n") if line.startswith(prefix)]


def _setup_error(text: str, returncode: int) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(("bwrap:", "sandbox setup failed:")):
            return line
    return lines[-1] if lines else f"exit code {returncode} without output"


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


__all__ = ["SandboxResult", "SandboxUnavailable", "require_sandbox", "run_untrusted"]
