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
  honest code; neither the isolation nor the verdict depends on them (`_posixsubprocess`, for
  instance, still forks, and whatever it starts is confined as above).

Verdict. It is decided by a process that never runs the code: the bootstrap reads the code, forks,
and only the parent reads the tests (the code's process never holds them); the child drops
to the code's uid and runs the code, and the parent — the judge — drops to a second throwaway uid
(so the code can neither signal nor trace it; there is no `/proc`) and is the only process that
holds the verdict pipe to us. With `tests` (HumanEval's `check(candidate)`), the judge runs them
with the real builtins; each name the tests may take from the code (`exports`: HumanEval's entry
point and the helpers its prompt defines; by default every name the code defined at its top level),
but never a builtin's name, is in the judge a call into the code's process (so a candidate's own
`abs` or `len` changes nothing the tests compute), and arguments and results cross as plain data
of the exact built-in types (JSON with tags; an object of the code's own class, or a subclass of a
built-in type such as a `str` with its own `__eq__`, cannot cross, even by value: "error"). So the
tests' assertions are evaluated where the code cannot reach them, and walking the code's frames,
rewriting its interpreter or writing to any descriptor it holds changes no verdict: at most it
answers the judge's calls. "passed": the tests ran to their end; "failed": an AssertionError escaped
them (or the code's own top level); "error": any other exception (MemoryError, a syntax error,
exit() / sys.exit(), a value that cannot cross, the code's process ending during a call);
"timeout": the wall-clock timeout or the CPU limit. Without tests, the verdict is the code's own
account of how its top level ended, which code written against this protocol can fake: trust a
pass only from tests.

Limits of the guarantee: the judge runs the tests, which are ours (a data set's) and trusted only
as far as the sandbox confines them too. Memory of tmpfs files counts against `DISK_LIMIT`, not
`memory_mb`. The address-space limit does not count memory the kernel holds for the code, reachable
from a process started past the audit hook (which can load ctypes): System V shared memory and
message queues are allowed none (the sandbox's IPC namespace's `shmall`, `shmmni` and `msgmni` at 0;
a detached segment would outlive its process), memfd files none (a seccomp filter, `seccomp_filter`,
makes memfd_create and memfd_secret fail with EPERM, and refuses every call of a foreign ABI), and
POSIX message queues no bytes (`RLIMIT_MSGQUEUE` 0). No cgroup caps the whole: pipe and socket
buffers are bounded per buffer, descriptor and process, not in sum. The work folder belongs to the
code's uid; the judge's working directory is `/`.

Fails closed: when the process is not root, bwrap is missing, or the sandbox does not come
up (e.g. namespaces are forbidden), `run_untrusted` raises `SandboxUnavailable` with one line that
says what is missing; it never runs code with less isolation. `require_sandbox()` checks this once
up front. Install the tool with `apt-get install bubblewrap` (`make test` does, as root).
"""

from __future__ import annotations

import builtins
import errno
import functools
import os
import re
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from latentloop.errors import SandboxUnavailable

OUTPUT_LIMIT = 8_000  # characters of output kept (the tail)
FILE_SIZE_LIMIT = 16 << 20  # bytes any one written file (output included) may grow to
DISK_LIMIT = 64 << 20  # bytes of the work folder (a tmpfs)
FILE_LIMIT = 4096  # files and folders in the work folder
PROCESS_LIMIT = 16  # tasks (processes and threads) of the sandbox's uid
OPEN_FILES_LIMIT = 128
MESSAGE_LIMIT = 16 << 20  # bytes of one message (a call or its value) between the code and its judge
NESTING_LIMIT = 100  # levels of lists, tuples, dicts... in one value passed between them
WORKDIR = "/sandbox"
CODE_FILE = "candidate.py"
ID_RANGE = (1 << 30, (1 << 31) - 1)  # throwaway uids/gids: far above any real account
BUILTIN_NAMES = frozenset(vars(builtins))  # never a name the tests take from the code (the judge checks too)

# The seccomp filter bwrap loads before the sandbox's first stage (`--seccomp`): memfd files hold memory
# that neither the address-space limit nor the work folder's size counts (the review held 128 MiB at
# memory_mb=64 through closed mappings), so the calls that make them fail with EPERM, and so does every
# call of another ABI than the interpreter's (x86_64's i386 and x32 calls, whose numbers differ).
# Per machine: the ELF machine of its audit arch (linux/elf-em.h), 64-bit, little-endian, and the number of
# memfd_create (memfd_secret is 447 everywhere, the numbering shared since Linux 5.1).
_SECCOMP_MACHINES = {"x86_64": (62, True, True, 319), "i686": (3, False, True, 356),
                     "aarch64": (183, True, True, 279), "riscv64": (243, True, True, 279),
                     "loongarch64": (258, True, True, 279), "ppc64le": (21, True, True, 360),
                     "s390x": (22, True, False, 350), "armv7l": (40, False, True, 385)}
MEMFD_SECRET = 447
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: its calls carry this bit
_BPF_LOAD_WORD, _BPF_JUMP_IF_EQUAL, _BPF_JUMP_IF_SET, _BPF_RETURN = 0x20, 0x15, 0x45, 0x06
_SECCOMP_ALLOW, _SECCOMP_ERRNO = 0x7FFF0000, 0x00050000
_SECCOMP_NR_OFFSET, _SECCOMP_ARCH_OFFSET = 0, 4  # struct seccomp_data: int nr; __u32 arch; ...

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
# System V shared memory and message queues hold the kernel's memory, which no limit of a process
# counts: none at all in the sandbox's own IPC namespace, whose limits are its sysctls, written through
# a proc mounted for the moment on the work folder.
if libc.mount(b"proc", workdir.encode(), b"proc", 2 | 4 | 8, None) != 0:
    fail("could not mount proc to limit System V IPC: " + os.strerror(ctypes.get_errno()))
try:
    for name in ("shmall", "shmmni", "msgmni"):
        with open(workdir + "/sys/kernel/" + name, "w") as limit:
            limit.write("0")
except OSError as error:
    fail("could not limit System V IPC: " + str(error))
if libc.umount2(workdir.encode(), 2) != 0:  # MNT_DETACH
    fail("could not unmount proc: " + os.strerror(ctypes.get_errno()))
options = f"size={disk},nr_inodes={inodes},mode=0700,uid={uid},gid={uid}".encode()
if libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", 2 | 4 | 8, options) != 0:  # nosuid, nodev, noexec
    fail("could not mount the work folder: " + os.strerror(ctypes.get_errno()))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", *sys.argv[5:]])
'''

# Runs as root inside bwrap, after _PREPARE. argv: the code's uid, the judge's uid, address space bytes,
# cpu seconds, file size, processes, open files, verdict fd, work folder, code file name. stdin: a line
# "<code bytes> <tests bytes or -1> <exports bytes or -1>", then the code, then the tests, then the
# names the tests may take from the code (separated by spaces). Exit 70: the setup failed.
# Forks: the child runs the code (uid A); this process becomes the judge (uid B), which never runs it.
_BOOTSTRAP = r'''
import os, sys

MESSAGE_LIMIT = @MESSAGE_LIMIT@  # bytes of one message between the code and the judge
NESTING_LIMIT = @NESTING_LIMIT@  # levels of containers in one value passed between them
TESTS_FILE = "tests.py"  # the name tracebacks give the tests
FRAME_DIGITS = 10  # a message is its length in ASCII digits, then that many bytes of JSON

def _fail(message):
    os.write(2, ("sandbox setup failed: " + message + "\n").encode("utf-8", "replace"))
    os._exit(70)

def _read_exactly(fd, size):
    data = b""
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 16))
        if not chunk:
            raise EOFError
        data += chunk
    return data

def _send(fd, message):
    import json
    payload = json.dumps(message).encode()
    if len(payload) > MESSAGE_LIMIT:
        raise ValueError(f"a message of {len(payload)} bytes is over the sandbox's limit of {MESSAGE_LIMIT}")
    data = str(len(payload)).zfill(FRAME_DIGITS).encode() + payload
    while data:
        data = data[os.write(fd, data):]

def _receive(fd):
    import json
    header = _read_exactly(fd, FRAME_DIGITS)
    if not header.isdigit() or int(header) > MESSAGE_LIMIT:
        raise ValueError("a malformed message")
    return json.loads(_read_exactly(fd, int(header)))

# Values cross between the code and the judge as JSON with tags: plain data of the exact built-in
# types only, so nothing of the code's (a subclass, an object with its own __eq__) reaches the judge.
def _encode(value, depth=0):
    if depth > NESTING_LIMIT:
        raise ValueError("a value nested too deeply to pass between the code and its tests")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return {"f": value.hex()}
    if kind is complex:
        return {"c": [value.real.hex(), value.imag.hex()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is list:
        return [_encode(item, depth + 1) for item in value]
    tags = {tuple: "t", set: "s", frozenset: "z"}
    if kind in tags:
        return {tags[kind]: [_encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"d": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"a value of type {kind.__name__} cannot pass between the code and its tests")

def _decode(data):
    if type(data) is list:
        return [_decode(item) for item in data]
    if type(data) is not dict:
        return data
    (tag, body), = data.items()
    if tag == "f":
        return float.fromhex(body)
    if tag == "c":
        return complex(float.fromhex(body[0]), float.fromhex(body[1]))
    if tag == "b":
        return bytes.fromhex(body)
    if tag == "d":
        return {_decode(k): _decode(v) for k, v in body}
    return {"t": tuple, "s": set, "z": frozenset}[tag](_decode(item) for item in body)

def _drop_privileges(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    try:
        os.setresuid(0, 0, 0)
    except PermissionError:
        pass
    else:
        _fail("root privileges could not be dropped")

def _limit(memory, cpu, fsize, processes, files):
    import resource
    for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_NOFILE, files),
                         (resource.RLIMIT_AS, memory), (resource.RLIMIT_MSGQUEUE, 0)):
        resource.setrlimit(which, (value, value))

def _guard(PermissionError=PermissionError, RuntimeError=RuntimeError, str=str, type=type):
    network = "sandbox: network access is blocked"
    process = "sandbox: process creation is blocked"
    process_events = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                                "os.fork", "os.forkpty", "pty.spawn"})
    introspection = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                               "sys.settrace", "sys.setprofile", "code.__new__", "sys.monitoring.register_callback",
                               "cpython.PyInterpreterState_New"})  # a sub-interpreter would have no hook
    native = frozenset({"ctypes", "_ctypes"})

    def hook(event, args):  # clear messages for honest code; the isolation does not rest on it
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

    return hook

def _flush():
    sys.stdout.flush()
    sys.stderr.flush()

def _run_code(source, code_file, report):
    """The code's process: run the code, say how it ended; then answer the judge's calls."""
    import traceback
    namespace = {"__name__": "__main__", "__file__": code_file, "__builtins__": __builtins__}
    try:
        exec(compile(source, code_file, "exec"), namespace)
    except AssertionError as error:
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)  # from the code's frame on
        _flush()
        _send(report, {"ended": "failed"})
        os._exit(1)
    except SystemExit as stop:
        print(f"sandbox: the code called exit({stop.code!r}) before finishing", file=sys.stderr)
        _flush()
        _send(report, {"ended": "error"})
        os._exit(2)
    except BaseException as error:
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        if isinstance(error, MemoryError):
            print("sandbox: memory limit exceeded", file=sys.stderr)
        _flush()
        _send(report, {"ended": "error"})
        os._exit(2)
    _flush()
    names = sorted(name for name, value in namespace.items()  # what the tests may call
                   if isinstance(name, str) and not name.startswith("__") and callable(value))
    _send(report, {"ended": "passed", "names": names})
    return namespace

def _serve_calls(namespace, requests, report):
    while True:
        try:
            request = _receive(requests)
        except EOFError:
            os._exit(0)
        try:
            value = namespace[request["name"]]
            if request.get("call"):
                value = value(*_decode(request["args"]), **_decode(request["kwargs"]))
            reply = {"value": _encode(value)}
        except BaseException as error:
            if isinstance(error, SystemExit):
                print(f"sandbox: the code called exit({error.code!r}) in a call from its tests", file=sys.stderr)
            reply = {"raised": type(error).__name__, "message": str(error)[:1000]}
        _flush()
        _send(report, reply)

class _CodeEnded(Exception):
    """The code's process ended (or broke the protocol) while the tests needed it."""

def _remote(requests, replies):
    import builtins
    def ask(request):
        try:
            _send(requests, request)
            reply = _receive(replies)
        except (EOFError, BrokenPipeError) as error:
            raise _CodeEnded("the code's process ended during a call from its tests") from None
        except (ValueError, TypeError, KeyError) as error:
            raise _CodeEnded(f"the code's process broke the protocol: {error}") from None
        if "raised" not in reply:
            return _decode(reply["value"])
        name, message = str(reply["raised"]), str(reply["message"])
        kind = getattr(builtins, name, None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(message)  # a built-in exception keeps its type: tests may expect it
        raise RuntimeError(f"{name}: {message}")
    return ask

def _proxy(ask, name):
    def call(*args, **kwargs):
        return ask({"name": name, "call": True, "args": _encode(list(args)), "kwargs": _encode(kwargs)})
    call.__name__ = call.__qualname__ = name
    return call

def _judge(child, tests, exports, verdict_fd, requests, replies):
    """The judge's process: it never runs the code. It decides the verdict, from the code's report when
    there are no tests, else by running the tests against the code's names that they may take (each a
    call into the code's process), and is the only process that holds the verdict pipe."""
    import signal, traceback

    def verdict(status, note=""):
        os.write(verdict_fd, (status + " " + note).strip().encode("utf-8", "replace")[:4000] + b"\n")
        _flush()
        os._exit(0)

    def code_ended(note):
        try:
            _, status = os.waitpid(child, 0)
        except ChildProcessError:
            status = 0
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            if number == signal.SIGXCPU:
                verdict("timeout", "sandbox: CPU time limit exceeded")
            name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
            verdict("error", f"sandbox: killed by signal {name}")
        code = os.waitstatus_to_exitcode(status)
        verdict("error", f"sandbox: {note} (exit code {code})")

    try:
        started = _receive(replies)
    except EOFError:
        os._exit(70)  # the code's process failed its setup (it said why on stderr)
    if started != {"started": True}:
        _fail("the code's process did not start")
    os.write(verdict_fd, b"ready\n")
    try:
        report = _receive(replies)
        ended = report["ended"]
    except EOFError:
        code_ended("the code ended before finishing")
    except Exception:
        code_ended("the code broke the protocol")
    if ended not in ("passed", "failed", "error"):
        code_ended("the code broke the protocol")
    if ended != "passed" or tests is None:
        verdict(ended)
    ask = _remote(requests, replies)
    import builtins
    # The tests see the real builtins and, of the code, only the names they may take from it (the
    # caller's `exports`, else what the code defined): never a builtin's name, so that a candidate's
    # own `abs` or `len` cannot stand in for the one the tests' assertions call.
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for name in report.get("names", []) if exports is None else exports:
        if type(name) is str and name.isidentifier() and not name.startswith("__") and name not in vars(builtins):
            namespace[name] = _proxy(ask, name)
    import linecache
    linecache.cache[TESTS_FILE] = (len(tests), None, tests.splitlines(True), TESTS_FILE)  # for tracebacks
    try:
        exec(compile(tests, TESTS_FILE, "exec"), namespace)
    except _CodeEnded as error:
        code_ended(str(error))
    except AssertionError as error:
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        verdict("failed")
    except BaseException as error:
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        verdict("error")
    verdict("passed")

def _main():
    try:
        code_uid, judge_uid, memory, cpu, fsize, processes, files, verdict_fd = (int(v) for v in sys.argv[1:9])
        workdir, code_name = sys.argv[9:11]
        header = b""
        while not header.endswith(b"\n"):
            byte = os.read(0, 1)
            if not byte:
                _fail("no input")
            header += byte
        code_size, tests_size, exports_size = (int(v) for v in header.split())
        source = _read_exactly(0, code_size)
        requests, request_end = os.pipe()  # judge -> code
        reply_end, replies = os.pipe()     # code -> judge
        # the tests and exports are read by the judge alone, after the fork: the code's process never
        # holds them (a frame walk up from the code found them in this function's locals)
        child = os.fork()
        null = os.open("/dev/null", os.O_RDONLY)
        if child == 0:  # the code's process: no verdict pipe, no input, and the judge's ends closed
            os.dup2(null, 0)
            for fd in (null, verdict_fd, request_end, reply_end):
                os.close(fd)
            _drop_privileges(code_uid)
            os.chdir(workdir)
            code_file = os.path.join(workdir, code_name)
            with open(code_file, "wb") as handle:
                handle.write(source)
            source = source.decode("utf-8", "replace")
            import socket, traceback, json
            def refuse(*args, **kwargs):
                raise PermissionError("sandbox: network access is blocked")
            class BlockedSocket(socket.socket):  # a class, so that modules subclassing socket still import
                def __init__(self, *args, **kwargs):
                    refuse()
            socket.socket = BlockedSocket
            for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
                setattr(socket, name, refuse)
            _limit(memory, cpu, fsize, processes, files)
            sys.addaudithook(_guard())
            sys.argv = [code_file]
            _send(replies, {"started": True})
        else:  # the judge
            for fd in (requests, replies):
                os.close(fd)
            del source
            tests = _read_exactly(0, tests_size).decode("utf-8", "replace") if tests_size >= 0 else None
            exports = _read_exactly(0, exports_size).decode("utf-8").split() if exports_size >= 0 else None
            os.dup2(null, 0)
            os.close(null)
            os.set_inheritable(verdict_fd, False)
            _drop_privileges(judge_uid)
            os.chdir("/")
            import signal, traceback, json, builtins
            _limit(memory, cpu, fsize, processes, files)
            sys.addaudithook(_guard())
    except Exception as error:
        _fail(f"{type(error).__name__}: {error}")
    if child == 0:
        namespace = _run_code(source, code_file, replies)
        del source
        _serve_calls(namespace, requests, replies)
    else:
        _judge(child, tests, exports, verdict_fd, request_end, reply_end)

_main()
'''.replace("@MESSAGE_LIMIT@", str(MESSAGE_LIMIT)).replace("@NESTING_LIMIT@", str(NESTING_LIMIT))
_STATUSES = ("passed", "failed", "error", "timeout")


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


def seccomp_filter(machine: str | None = None) -> bytes:
    """The classic BPF program (struct sock_filter[], native byte order) bwrap loads for the sandbox:
    memfd_create and memfd_secret, and any call of a foreign ABI, fail with EPERM; everything else
    runs. SandboxUnavailable on a machine without a table (the sandbox fails closed)."""
    machine = machine or os.uname().machine
    if machine not in _SECCOMP_MACHINES:
        raise SandboxUnavailable(f"the code sandbox has no system call table for {machine} (seccomp filter)")
    elf_machine, is_64bit, little_endian, memfd_create = _SECCOMP_MACHINES[machine]
    audit_arch = elf_machine | (0x80000000 if is_64bit else 0) | (0x40000000 if little_endian else 0)
    refuse = _SECCOMP_ERRNO | errno.EPERM
    checks = [(_BPF_JUMP_IF_SET, X32_SYSCALL_BIT)] if machine == "x86_64" else []
    checks += [(_BPF_JUMP_IF_EQUAL, number) for number in (memfd_create, MEMFD_SECRET)]
    program = [(_BPF_LOAD_WORD, 0, 0, _SECCOMP_ARCH_OFFSET),
               (_BPF_JUMP_IF_EQUAL, 1, 0, audit_arch),  # our ABI: skip the refusal below
               (_BPF_RETURN, 0, 0, refuse),
               (_BPF_LOAD_WORD, 0, 0, _SECCOMP_NR_OFFSET)]
    # check i of k jumps, when it matches, over the checks after it and the allow: to the refusal
    program += [(code, len(checks) - i, 0, value) for i, (code, value) in enumerate(checks)]
    program += [(_BPF_RETURN, 0, 0, _SECCOMP_ALLOW), (_BPF_RETURN, 0, 0, refuse)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


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


def _bwrap_command(bwrap: str, info_fd: int, seccomp_fd: int, uid: int) -> list[str]:
    executable, prefix = _python()
    command = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
               "--die-with-parent", "--new-session", "--info-fd", str(info_fd), "--seccomp", str(seccomp_fd),
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


def run_untrusted(code: str, timeout: float = 5.0, memory_mb: int = 512, tests: str | None = None,
                  exports: Sequence[str] | None = None) -> SandboxResult:
    """Run `code` in the sandbox (see the module docstring) and report how it ended.

    With `tests`, the verdict is the tests': they run in the judge's process, with the real builtins,
    each name of `exports` (default: every name the code defined at its top level that is not a
    builtin's) standing for a call into the code's process. Without them, the verdict is the code's
    own account of how it ended. Raises SandboxUnavailable (one line) when the isolation cannot be set
    up on this machine."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb must be at least 32, got {memory_mb}")
    if exports is not None:
        if tests is None:
            raise ValueError("exports name what tests take from the code: give tests too")
        exports = list(exports)
        for name in exports:
            if not (isinstance(name, str) and name.isidentifier()) or name.startswith("__") or name in BUILTIN_NAMES:
                raise ValueError(f"cannot export {name!r} to the tests: an identifier that is no builtin's name "
                                 f"is needed")
    bwrap = _bwrap()
    code_uid = _throwaway_id()
    judge_uid = _throwaway_id()
    while judge_uid == code_uid:  # the judge must be a user the code cannot signal
        judge_uid = _throwaway_id()
    cpu_seconds = max(1, int(timeout) + 1)
    code_bytes = code.encode("utf-8", "surrogatepass")
    tests_bytes = None if tests is None else tests.encode("utf-8", "surrogatepass")
    exports_bytes = None if exports is None else " ".join(exports).encode("utf-8")
    with tempfile.TemporaryDirectory(prefix="latentloop-sandbox-") as host:
        folder = Path(host)
        input_file, output_file = folder / "input", folder / "output"
        sizes = [len(code_bytes), *(-1 if part is None else len(part) for part in (tests_bytes, exports_bytes))]
        header = (" ".join(str(size) for size in sizes) + "\n").encode()
        input_file.write_bytes(header + code_bytes + (tests_bytes or b"") + (exports_bytes or b""))
        seccomp_file = folder / "seccomp"
        seccomp_file.write_bytes(seccomp_filter())
        # Pipes, not files: only the judge holds the verdict's write end, and nobody can truncate it.
        (verdict, verdict_write), (info, info_write) = os.pipe(), os.pipe()
        try:
            with input_file.open("rb") as stdin, output_file.open("wb") as output, seccomp_file.open("rb") as rules:
                command = [*_bwrap_command(bwrap, info_write, rules.fileno(), code_uid), str(judge_uid),
                           str(memory_mb << 20), str(cpu_seconds), str(FILE_SIZE_LIMIT), str(PROCESS_LIMIT),
                           str(OPEN_FILES_LIMIT), str(verdict_write), WORKDIR, CODE_FILE]
                process = subprocess.Popen(command, stdin=stdin, stdout=output, stderr=subprocess.STDOUT,
                                           env=_child_environment(),
                                           pass_fds=(verdict_write, info_write, rules.fileno()),
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
            lines = _verdicts(verdict)
        finally:
            for end in (verdict, verdict_write, info, info_write):
                if end >= 0:
                    os.close(end)
        text = _read_tail(output_file)
    if "ready" not in lines and not timed_out:
        raise SandboxUnavailable(f"the code sandbox did not start: {_setup_error(text, returncode)}")
    given = [line.partition(" ") for line in lines if line.partition(" ")[0] in _STATUSES]
    if timed_out:
        status, note = "timeout", f"sandbox: killed after the {timeout:g} s timeout"
    elif given:
        status, _, note = given[0]
    else:  # the judge itself ended without a verdict (its limits, or a kill)
        status, note = "error", f"sandbox: the judge ended without a verdict (exit code {returncode})"
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


def _verdicts(pipe: int) -> list[str]:
    """The lines the judge wrote ("ready", then "<status> [note]"), in order."""
    data = b""
    while len(data) < (1 << 20):  # only the judge writes there, and it has ended
        try:
            chunk = os.read(pipe, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return [line.decode("utf-8", "replace") for line in data.split(b"\n") if line]


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
