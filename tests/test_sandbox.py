"""The sandbox for untrusted code: outcomes and limits, and each escape a hostile review found.

The escapes are attempted both through plain Python (where the audit hook answers first) and through
`_posixsubprocess.fork_exec`, which no audit hook sees: there the kernel isolation alone must hold.
"""

import ctypes
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import time

import pytest
from conftest import shared_data

from benchmarks.bad_inputs import FRAME_WALK
from latentloop.errors import LatentloopError, SandboxUnavailable
from latentloop.eval import sandbox
from latentloop.eval.generation import humaneval_program
from latentloop.eval.sandbox import DISK_LIMIT, FILE_LIMIT, PROCESS_LIMIT, require_sandbox, run_untrusted

BLOCKED = "network access is blocked"

# Starts a process past every audit hook (the route the review used); the child shares our stdout.
SPAWN = '''
import _posixsubprocess, os, sys

def spawn(*argv):
    errors_read, errors_write = os.pipe()
    args = [[a.encode() for a in argv], [argv[0].encode()], False, (), None, None, -1, -1, -1, -1, -1, -1,
            errors_read, errors_write, False, False]
    if sys.version_info >= (3, 11):
        args.append(-1)  # process_group
    args += [None, None, None, -1, None]  # gid, extra groups, uid, umask, preexec_fn
    if sys.version_info >= (3, 11):
        args.append(False)  # vfork
    pid = _posixsubprocess.fork_exec(*args)
    os.close(errors_write)
    failure = os.read(errors_read, 1000)
    assert not failure, failure
    return pid

def run(*argv):
    return os.waitstatus_to_exitcode(os.waitpid(spawn(*argv), 0)[1])

def python(code):
    return run(sys.executable, "-I", "-S", "-c", code)
'''


needs_sandbox = pytest.mark.usefixtures("code_sandbox")  # skipped where isolation is unavailable (conftest)


def _processes_with(marker: str) -> list[int]:
    """Pids of host processes whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


# -- outcomes and limits ---------------------------------------------------------------------------
@needs_sandbox
def test_passing_and_failing_assertions_are_reported():
    ok = run_untrusted("def f(x):\n    return x + 1\nassert f(1) == 2\nprint('done')\n")
    assert ok.passed and ok.status == "passed" and "done" in ok.output
    bad = run_untrusted("def f(x):\n    return x\nassert f(1) == 2, 'wrong value'\n")
    assert not bad.passed and bad.status == "failed"
    assert "AssertionError: wrong value" in bad.output and 'candidate.py", line 3' in bad.output


@needs_sandbox
def test_other_exceptions_and_early_exit_are_errors():
    for code in ("def f(:\n    pass\n", "raise ValueError('boom')\n", "undefined_name\n",
                 "import sys\nsys.exit(0)\nassert False\n", "import os\nos._exit(0)\n"):
        result = run_untrusted(code)
        assert result.status == "error" and not result.passed, code


@needs_sandbox
def test_standard_library_works_inside():
    code = ("import collections, json, math, re, typing, dataclasses, itertools, tempfile\n"
            "Point = collections.namedtuple('Point', 'x y')\n"
            "T = typing.TypeVar('T')\n"
            "assert json.loads(json.dumps([Point(1, 2)])) == [[1, 2]] and math.isqrt(17) == 4\n"
            "with tempfile.NamedTemporaryFile('w') as handle:\n"
            "    handle.write('scratch')\n")
    result = run_untrusted(code)
    assert result.passed, result.output


@needs_sandbox
def test_infinite_loop_is_killed_within_the_timeout():
    started = time.monotonic()
    result = run_untrusted("while True:\n    pass\n", timeout=1.0)
    assert result.status == "timeout" and not result.passed
    assert time.monotonic() - started < 3.0


@needs_sandbox
def test_sleeping_code_is_killed_too():
    started = time.monotonic()
    result = run_untrusted("import time\ntime.sleep(30)\n", timeout=0.5)
    assert result.status == "timeout" and time.monotonic() - started < 3.0


@needs_sandbox
def test_memory_limit_is_enforced():
    result = run_untrusted("block = bytearray(1024 * 1024 * 1024)\n", memory_mb=128)
    assert result.status == "error" and "MemoryError" in result.output
    small = run_untrusted("block = bytearray(16 * 1024 * 1024)\nassert len(block) > 0\n", memory_mb=256)
    assert small.passed
    raised = run_untrusted("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n", memory_mb=128)
    assert raised.status == "error"


# System V IPC past the audit hook (an interpreter started with _posixsubprocess can load ctypes): a
# shared memory segment or a message queue holds the kernel's memory, which the address-space limit
# does not count, and a detached segment lives on after its process.
SYSTEM_V = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
segment = libc.shmget(0, ctypes.c_size_t(1 << 20), 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
print("shmget", segment, ctypes.get_errno())
queue = libc.msgget(0, 0o1000 | 0o600)
print("msgget", queue, ctypes.get_errno())
"""


@needs_sandbox
def test_no_memory_is_held_through_system_v_ipc():
    """The sandbox's IPC namespace allows no shared memory segment and no message queue (the review held
    256 MB in detached segments at memory_mb=64); this machine's own limits are left as they were."""
    before = {name: open(f"/proc/sys/kernel/{name}").read() for name in ("shmall", "shmmni", "msgmni")}
    result = run_untrusted(SPAWN + f"python({SYSTEM_V!r})\n", memory_mb=64)
    assert "shmget -1 28" in result.output and "msgget -1 28" in result.output, result  # ENOSPC both
    assert {name: open(f"/proc/sys/kernel/{name}").read() for name in before} == before


# Holds memory through memfd files: mapped, touched and unmapped, so no address space counts it.
MEMFD = """
import mmap, os
held = []
for i in range(8):
    try:
        fd = os.memfd_create("held")
    except OSError as error:
        print("memfd_create refused", error.errno)
        break
    os.ftruncate(fd, 16 << 20)
    with mmap.mmap(fd, 16 << 20) as mapped:
        for offset in range(0, 16 << 20, 4096):
            mapped[offset] = 1
    held.append(fd)
print("held", 16 * len(held), "MiB")
"""


@needs_sandbox
def test_no_memory_is_held_through_memfd_files():
    """memfd_create fails with EPERM in the code and in a process started past the audit hook (the
    kernel's seccomp filter, not Python, refuses it); before, the review held 128 MiB at memory_mb=64."""
    for code in (MEMFD, SPAWN + f"python({MEMFD!r})\n"):
        result = run_untrusted(code, memory_mb=64, timeout=20)
        assert "memfd_create refused 1" in result.output and "held 0 MiB" in result.output, result


def _run_classic_bpf(program: bytes, nr: int, arch: int) -> int:
    """What a classic BPF seccomp program returns for a call (the opcodes `seccomp_filter` uses)."""
    instructions = [program[i:i + 8] for i in range(0, len(program), 8)]
    accumulator, pc = 0, 0
    while True:
        code, jump_true, jump_false, value = struct.unpack("=HBBI", instructions[pc])
        if code == 0x20:  # load a word of struct seccomp_data
            accumulator = {0: nr, 4: arch}[value]
        elif code in (0x15, 0x45):  # jump if equal / if any bit set
            taken = accumulator == value if code == 0x15 else bool(accumulator & value)
            pc += jump_true if taken else jump_false
        elif code == 0x06:
            return value
        else:
            raise AssertionError(f"opcode {code:#x}")
        pc += 1


# Loads the filter into this process (no root needed: no_new_privs first), then makes system calls.
KERNEL_CHECK = """
import ctypes, os, sys
from latentloop.eval.sandbox import _SECCOMP_MACHINES, seccomp_filter
program = seccomp_filter()
libc = ctypes.CDLL(None, use_errno=True)

class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

instructions = ctypes.create_string_buffer(program, len(program))
fprog = SockFprog(len(program) // 8, ctypes.cast(instructions, ctypes.c_void_p))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # SECCOMP_MODE_FILTER
    print("no seccomp filters:", os.strerror(ctypes.get_errno()))  # EINVAL: a kernel built without them
    sys.exit(0)

def call(number, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(number), *args)
    return result, ctypes.get_errno()

memfd_create = _SECCOMP_MACHINES[os.uname().machine][3]
print("memfd_create", *call(memfd_create, b"held", 0))
print("memfd_secret", *call(447, 0))
print("getpid", call({"x86_64": 39, "aarch64": 172}[os.uname().machine])[0] == os.getpid())
print("x32 getpid", *call(0x40000000 | 39) if os.uname().machine == "x86_64" else (-1, 1))
with open(os.devnull, "w") as still:  # ordinary calls go on
    still.write("ok")
print("open ok")
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="the check's getpid numbers")
def test_the_kernel_runs_the_seccomp_filter_as_written():
    """The filter loaded by the kernel itself (into a fresh process, as bwrap does; no root needed):
    memfd_create, memfd_secret and an x32 call fail with EPERM, ordinary calls run. Without the filter
    an x32 call is ENOSYS or runs, so this tells the filter's answer apart."""
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.startswith("no seccomp filters"):  # the sandbox fails closed there too
        pytest.skip(done.stdout.strip())
    lines = done.stdout.splitlines()
    assert lines == ["memfd_create -1 1", "memfd_secret -1 1", "getpid True", "x32 getpid -1 1", "open ok"], lines


@pytest.mark.parametrize("machine", sorted(sandbox._SECCOMP_MACHINES))
def test_the_seccomp_filter_refuses_memfd_and_foreign_abis_only(machine):
    """Each machine's filter, interpreted: its memfd calls and any call of another ABI fail with EPERM,
    every other call runs. The audit arches are linux/audit.h's, written out."""
    arch = {"x86_64": 0xC000003E, "i686": 0x40000003, "aarch64": 0xC00000B7, "riscv64": 0xC00000F3,
            "loongarch64": 0xC0000102, "ppc64le": 0xC0000015, "s390x": 0x80000016, "armv7l": 0x40000028}[machine]
    memfd_create = sandbox._SECCOMP_MACHINES[machine][3]
    program = sandbox.seccomp_filter(machine)
    allow, eperm = 0x7FFF0000, 0x00050001
    for nr in (memfd_create, 447):
        assert _run_classic_bpf(program, nr, arch) == eperm
    for nr in (0, 1, 2, 56, 57, 59, 60, 63, 231, memfd_create - 1, memfd_create + 1, 446, 448):
        assert _run_classic_bpf(program, nr, arch) == allow, nr
    assert _run_classic_bpf(program, 0, arch ^ 0x80000000) == eperm  # the other width's ABI
    x32 = _run_classic_bpf(program, 0x40000000 | 1, arch)
    assert x32 == (eperm if machine == "x86_64" else allow)
    with pytest.raises(SandboxUnavailable, match="no system call table for vax"):
        sandbox.seccomp_filter("vax")


@needs_sandbox
def test_output_is_bounded():
    result = run_untrusted("for i in range(200000):\n    print('line', i)\n")
    assert result.passed and len(result.output) <= 10_000 and "line 199999" in result.output


@needs_sandbox
def test_code_runs_as_a_throwaway_user_in_a_temporary_folder():
    code = ("import os\n"
            "print('UID', os.getuid(), os.getgid(), os.getgroups(), 'CWD', os.getcwd())\n"
            "try:\n    os.setuid(0)\nexcept PermissionError:\n    print('no root')\n"
            "open('scratch.txt', 'w').write('x')\n")
    result = run_untrusted(code)
    assert result.passed, result.output
    uid, gid, groups = result.output.split("UID ")[1].split()[:3]
    assert int(uid) >= 1 << 30 and int(gid) >= 1 << 30 and groups == "[]"
    assert "CWD /sandbox" in result.output and "no root" in result.output
    assert not os.path.exists("/sandbox/scratch.txt")


# -- the escapes -----------------------------------------------------------------------------------
@needs_sandbox
def test_files_outside_the_work_folder_can_be_neither_read_nor_written(tmp_path):
    owned = tmp_path / "owned.txt"
    owned.write_text("original secret")
    host_tmp = f"/tmp/latentloop-escape-{secrets.token_hex(4)}"
    targets = [str(owned), str(tmp_path / "created.txt"), "/usr/escape", "/etc/escape", "/root/escape", "/escape",
               "/proc/escape", os.path.join(os.getcwd(), "escape"), host_tmp]
    code = SPAWN + (
        f"targets = {targets!r}\n"
        "for path in targets:\n"
        "    try:\n"
        "        open(path, 'a').write('escaped')\n"
        "    except OSError as error:\n"
        "        print('refused', type(error).__name__)\n"
        "for path in targets[:1] + ['/etc/shadow', '/etc/passwd', os.path.expanduser('~root') + '/.bashrc']:\n"
        "    try:\n"
        "        print('LEAKED', open(path).read())\n"
        "    except OSError:\n"
        "        print('unreadable')\n"
        "print('ROOT', ' '.join(sorted(os.listdir('/'))))\n"
        "for path in targets:\n"  # the same through a shell that no audit hook watches
        "    run('/bin/sh', '-c', f'echo escaped >> {path}')\n")
    result = run_untrusted(code)
    assert result.passed, result.output
    assert result.output.count("refused") == len(targets) - 1  # /tmp is the work folder inside
    assert "LEAKED" not in result.output and result.output.count("unreadable") == 4
    visible = set(result.output.split("ROOT ")[1].split("\n")[0].split())
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "root", "sandbox", "sbin", "tmp", "usr"}
    assert {"usr", "dev", "sandbox", "tmp"} <= visible <= allowed
    assert owned.read_text() == "original secret"
    assert [p.name for p in tmp_path.iterdir()] == ["owned.txt"]
    for path in targets[2:]:
        assert not os.path.exists(path), path


@needs_sandbox
def test_process_creation_is_blocked_or_stays_inside(tmp_path):
    for code in ("import subprocess\nsubprocess.run(['true'])\n", "import os\nos.system('true')\n",
                 "import os\nos.fork()\n", "import os\nos.posix_spawn('/bin/true', ['true'], {})\n"):
        result = run_untrusted(code)
        assert result.status == "error" and "process creation is blocked" in result.output, code
    result = run_untrusted("import ctypes\nctypes.CDLL(None).system(b'true')\n")
    assert result.status == "error" and "blocked" in result.output
    marker = tmp_path / "made-by-a-child"
    result = run_untrusted(SPAWN + f"print('exit', run('/bin/sh', '-c', 'echo started; touch {marker}'))\n")
    assert result.passed and "started" in result.output and "exit 1" in result.output, result.output
    assert not marker.exists()


@needs_sandbox
def test_fork_bomb_is_bounded():
    bomb = ("import os, time\n"
            "children = 0\n"
            "for _ in range(40):\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError:\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(30)\n"
            "        os._exit(0)\n"
            "    children += 1\n"
            "print('CHILDREN', children)\n")
    started = time.monotonic()
    result = run_untrusted(SPAWN + f"python({bomb!r})\n")
    assert result.passed, result.output
    children = int(result.output.split("CHILDREN")[1].split()[0])
    assert 0 < children < PROCESS_LIMIT
    assert time.monotonic() - started < 5.0  # the sleeping children went with the namespace


@needs_sandbox
def test_no_daemon_outlives_the_call(tmp_path):
    markers, late = [], tmp_path / "written-after-return"
    for ending, status in (("", "passed"), ("while True:\n    pass\n", "timeout")):  # ends by itself / is killed
        marker = f"{30 + secrets.randbelow(10**6) / 10**7:.7f}"  # a unique `sleep` argument to find it by
        markers.append(marker)
        daemon = f"sleep 0.5; touch {late}; echo late >> /sandbox/late; sleep {marker}"
        code = SPAWN + f"run('/usr/bin/setsid', '-f', '/bin/sh', '-c', {daemon!r})\n"
        code += "print('spawned', flush=True)\n" + ending
        result = run_untrusted(code, timeout=1.0)
        assert result.status == status and "spawned" in result.output, result.output
        assert _processes_with(marker) == []
    time.sleep(1.0)
    assert [_processes_with(marker) for marker in markers] == [[], []] and not late.exists()


@needs_sandbox
def test_other_processes_cannot_be_killed():
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = SPAWN + (f"import signal\n"
                        f"try:\n    os.kill({victim.pid}, signal.SIGKILL)\nexcept ProcessLookupError:\n"
                        f"    print('no such process')\n"
                        f"run('/bin/sh', '-c', 'kill -9 {victim.pid}')\n")
        result = run_untrusted(code)
        assert result.passed and "no such process" in result.output, result.output
        everything = run_untrusted(SPAWN + "run('/bin/sh', '-c', 'kill -9 -1')\n")  # all it may signal
        assert everything.status == "error"
        time.sleep(0.2)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@needs_sandbox
def test_disk_use_is_bounded():
    code = ("import os\n"
            "written = 0\n"
            "try:\n"
            "    for i in range(1000):\n"
            "        with open(f'big{i}', 'wb') as handle:\n"
            "            handle.write(b'x' * (1 << 20))\n"
            "        written += 1 << 20\n"
            "except OSError as error:\n"
            "    print('BYTES', written, error.errno)\n"
            "for name in os.listdir('.'):\n"
            "    if name.startswith('big'):\n"
            "        os.remove(name)\n"
            "files = 0\n"
            "try:\n"
            "    for i in range(100000):\n"
            "        open(f'empty{i}', 'w').close()\n"
            "        files += 1\n"
            "except OSError as error:\n"
            "    print('FILES', files, error.errno)\n")
    result = run_untrusted(code, timeout=10.0)
    assert result.passed, result.output
    written, errno = (int(v) for v in result.output.split("BYTES")[1].split()[:2])
    assert errno == 28 and 0 < written <= DISK_LIMIT
    files, errno = (int(v) for v in result.output.split("FILES")[1].split()[:2])
    assert errno == 28 and 0 < files <= FILE_LIMIT


@needs_sandbox
def test_a_forged_status_is_not_a_pass():
    forgeries = [
        # the review's: a status file and a clean exit, before the tests could fail
        "import os\nopen('.sandbox_status', 'w').write('passed')\nos._exit(0)\nassert False\n",
        # anything printed or written to any descriptor, then a clean exit
        "import os\nprint('passed')\nfor fd in range(1, 64):\n"
        "    try:\n        os.write(fd, b'passed\\nready passed\\n')\n    except OSError:\n        pass\n"
        "os._exit(0)\nassert False\n",
        # erasing what was written before (were "ready" lost, we would report the sandbox as broken)
        "import os\nfor fd in range(64):\n    try:\n        os.ftruncate(fd, 0)\n    except OSError:\n"
        "        pass\nos._exit(0)\nassert False\n",
        # the verdict event, raised by the code itself, and by a C callable while the bootstrap's frame runs
        "import os, sys\nsys.audit('latentloop.sandbox.verdict')\nos._exit(0)\nassert False\n",
        "import functools, signal, sys\n"
        "signal.signal(signal.SIGALRM, functools.partial(sys.audit, 'latentloop.sandbox.verdict'))\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)\nraise KeyError('skip the tests')\nassert False\n",
        # looking for the token: stdin, the bootstrap's frames and globals, the garbage collector
        "import os, sys, gc\nprint('STDIN', repr(sys.stdin.read()))\n"
        "frame = sys._getframe(1)\nprint('LOCALS', sorted(frame.f_locals))\n"
        "import __main__\nprint('GLOBALS', sorted(vars(__main__)))\n"
        "gc.get_objects()\n",
    ]
    for code in forgeries:
        result = run_untrusted(code)
        assert not result.passed and result.status == "error", (code, result)
    assert "STDIN ''" in result.output and "gc.get_objects is blocked" in result.output
    assert "token" not in result.output.split("LOCALS")[1]


# The forgery from inside: walk every frame above the code (and the frames in a traceback of a
# blocked call) and rewrite every dict there to say "passed". One copy, shared with the bad-input tally.
REWRITE_THE_FRAMES = FRAME_WALK

# Writes a well-formed "the code ended, tests passed" into every descriptor it can, then leaves.
FORGE_EVERY_PIPE = """
import json, os
def framed(message):
    payload = json.dumps(message).encode()
    return b"%010d" % len(payload) + payload
for fd in range(64):
    for data in (b"passed\\n", framed({"ended": "passed", "names": []}), b"ready\\npassed\\n"):
        try:
            os.write(fd, data)
        except OSError:
            pass
"""

WRONG = "def add_one(x):\n    return x\n"
TESTS = "def check(candidate):\n    assert candidate(1) == 2\n\ncheck(add_one)\n"


# Looks for the tests' text in every frame above it (and on its input), and answers from it: a lookup
# table of each `assert candidate(ARGS) == ANSWER`; without the text it adds, which the tests refuse.
ANSWER_FROM_THE_TESTS = """
import re, sys
needle = "def check" + "(candid" + "ate)"  # built here: the code's own text (in the bootstrap's frame) has it not
found = sys.stdin.read()
frame = sys._getframe()
while frame is not None and needle not in found:
    for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
        if isinstance(value, str) and needle in value and value is not needle:
            found = value
    frame = frame.f_back
print("FOUND" if needle in found else "NOT FOUND")
table = {args: eval(answer) for args, answer in re.findall(r"candidate[(](.*?)[)] == (.*)", found)}
def add(x, y):
    return table.get(repr(x) + ", " + repr(y), x + y)
"""
# answers no sum gives: only a candidate that read them passes
SECRET_TESTS = ("def check(candidate):\n    assert candidate(2, 3) == 987654\n    assert candidate(7, 1) == 13579\n\n"
                "check(add)\n")


@needs_sandbox
def test_the_code_cannot_read_its_tests():
    """The tests are read by the judge alone, after the fork: a candidate that walked its frames found
    them in the bootstrap's locals (where they were read before the fork) and passed from a table."""
    result = run_untrusted(ANSWER_FROM_THE_TESTS, tests=SECRET_TESTS, exports=["add"])
    assert result.status == "failed" and "NOT FOUND" in result.output, result


@needs_sandbox
def test_failing_tests_stay_failing_whatever_the_code_does():
    right = run_untrusted("def add_one(x):\n    return x + 1\n", tests=TESTS)
    assert right.passed, right.output
    assert run_untrusted(WRONG, tests=TESTS).status == "failed"
    attacks = {
        "frames": WRONG + REWRITE_THE_FRAMES,
        "frames, then a forged report on every pipe": WRONG + REWRITE_THE_FRAMES + FORGE_EVERY_PIPE,
        "forged report, then leave": WRONG + FORGE_EVERY_PIPE + "os._exit(0)\n",
        "frames during the call": "def add_one(x):\n" + "".join(f"    {line}\n" for line in
                                  (REWRITE_THE_FRAMES + FORGE_EVERY_PIPE).splitlines()) + "    return x\n",
    }
    for name, code in attacks.items():  # what a walk of the frames breaks first decides between the two
        result = run_untrusted(code, tests=TESTS)
        assert not result.passed and result.status in ("failed", "error"), (name, result)
    exact = {  # (code, verdict, words of the output)
        "an answer that equals anything": ("class Yes:\n    def __eq__(self, other):\n        return True\n"
                                           "def add_one(x):\n    return Yes()\n", "error",
                                           "type Yes cannot pass between the code and its tests"),
        "exit during the call": ("import os\ndef add_one(x):\n    os._exit(0)\n", "error",
                                 "ended during a call from its tests"),
        "the tests' own names replaced": ("import builtins\nbuiltins.AssertionError = None\n" + WRONG, "failed",
                                          "AssertionError"),
    }
    for name, (code, status, words) in exact.items():
        result = run_untrusted(code, tests=TESTS)
        assert result.status == status and words in result.output, (name, result)


# A subclass of each type that crosses, claiming to equal anything, holding a wrong answer: refused
# ("error"), never converted to its plain value (which would compare honestly but let a subclass by).
SUBCLASSED = {"str": "'1'", "int": "1", "float": "1.0", "complex": "1j", "bytes": "b'1'", "list": "[1]",
              "tuple": "(1,)", "dict": "{1: 1}", "set": "{1}", "frozenset": "frozenset({1})"}


@needs_sandbox
@pytest.mark.parametrize("base", sorted(SUBCLASSED))
def test_a_subclass_of_a_built_in_type_cannot_cross(base):
    code = (f"class Forged({base}):\n    def __eq__(self, other):\n        return True\n"
            f"    __hash__ = {base}.__hash__\n"
            f"def add_one(x):\n    return Forged({SUBCLASSED[base]})\n")
    result = run_untrusted(code, tests=TESTS)
    assert result.status == "error", result
    assert "type Forged cannot pass between the code and its tests" in result.output, result.output


@needs_sandbox
def test_values_cross_between_the_code_and_its_tests_exactly():
    values = ("[None, True, 3, -2**70, 0.1, float('inf'), -0.0, 1+2j, b'\\x00\\xff', 'é\\n', (1, (2,)), {1, 2}, "
              "frozenset({3}), {(1, 2): [3], 'k': {'n': None}}]")
    code = f"def same():\n    return {values}\ndef echo(*args, **kwargs):\n    return [args, kwargs]\n"
    tests = (f"expected = {values}\n"
             "got = same()\n"
             "assert got == expected and [type(v) for v in got] == [type(v) for v in expected]\n"
             "assert str(got[6]) == '-0.0'\n"
             "assert echo(1, (2, 3), key={'a': [1.5]}) == [(1, (2, 3)), {'key': {'a': [1.5]}}]\n"
             "try:\n    echo(object())\nexcept TypeError as error:\n    assert 'cannot pass' in str(error)\n"
             "else:\n    raise AssertionError('an object crossed')\n")
    result = run_untrusted(code, tests=tests)
    assert result.passed, result.output
    raised = run_untrusted("def f():\n    raise KeyError('k')\nclass Mine(Exception):\n    pass\n"
                           "def g():\n    raise Mine('m')\n",
                           tests="try:\n    f()\nexcept KeyError:\n    pass\ntry:\n    g()\n"
                                 "except RuntimeError as error:\n    assert str(error) == 'Mine: m'\n")
    assert raised.passed, raised.output


# -- what the tests take from the code -------------------------------------------------------------
# The review's forgeries: a wrong candidate that defines the builtin its tests' assertion calls, so
# that the assertion agrees with it. name: (prompt, the tests' assertion, wrong body, the forgery)
HALVE = 'def halve(x: float) -> float:\n    """Half of x."""\n'
EVENS = 'def evens(xs: list) -> list:\n    """The even numbers of xs, in order."""\n'
RIGHT = {HALVE: "    return x / 2\n", EVENS: "    return [x for x in xs if x % 2 == 0]\n"}
SHADOWING = {
    "def abs": (HALVE, "assert abs(candidate(3.0) - 1.5) < 1e-6", "    return 0.0\n", "def abs(x):\n    return 0\n"),
    "abs = lambda": (HALVE, "assert abs(candidate(3.0) - 1.5) < 1e-6", "    return 0.0\n", "abs = lambda x: 0\n"),
    "def set": (EVENS, "assert set(candidate([1, 2, 4])) == set([2, 4])", "    return []\n",
                "def set(xs=()):\n    return 1\n"),
    "def len": (EVENS, "assert len(candidate([1, 2, 4])) == 2", "    return []\n", "def len(xs):\n    return 2\n"),
    "def sorted": (EVENS, "assert sorted(candidate([4, 1, 2])) == [2, 4]", "    return []\n",
                   "def sorted(xs):\n    return [2, 4]\n"),
}


def _problem(prompt: str, test: str) -> dict:
    entry = prompt.rpartition("def ")[2].partition("(")[0]  # the last function: the one to write
    return {"task_id": f"forged/{entry}", "prompt": prompt, "entry_point": entry, "test": test}


@needs_sandbox
@pytest.mark.parametrize("forgery", sorted(SHADOWING))
def test_a_candidate_that_shadows_a_builtin_stays_failing(forgery):
    prompt, assertion, wrong, shadow = SHADOWING[forgery]
    problem = _problem(prompt, f"def check(candidate):\n    {assertion}\n")
    program, tests, exports = humaneval_program(problem, wrong + shadow)
    assert exports == (problem["entry_point"],)
    result = run_untrusted(program, tests=tests, exports=exports)
    assert result.status == "failed" and "AssertionError" in result.output, result
    # the judge's own rule, for a caller that names no exports: never a builtin's name
    assert run_untrusted(program, tests=tests).status == "failed"
    # the candidate's names stay its own: the right answer beside the same definition passes
    program, tests, exports = humaneval_program(problem, RIGHT[prompt] + shadow)
    assert run_untrusted(program, tests=tests, exports=exports).passed
    assert run_untrusted(program, tests=tests).passed


# A prompt with a helper its tests call (as HumanEval/38's encode_cyclic): the helper the tests call is
# the prompt's, which the candidate can redefine only for itself.
ROTATE = ('def rotate(s: str) -> str:\n    return s[1:] + s[:1]\n\n\n'
          'def unrotate(s: str) -> str:\n    """Undo rotate."""\n')
ROTATE_TESTS = ("def check(candidate):\n    for word in ('loop', 'state'):\n"
                "        assert candidate(rotate(word)) == word\n")


@needs_sandbox
def test_the_prompts_helpers_are_the_prompts_and_honest_helpers_keep_passing():
    problem = _problem(ROTATE, ROTATE_TESTS)
    honest = {
        "plain": "    return s[-1:] + s[:-1]\n",
        "its own helper": "    return _back(s)\n\n\ndef _back(s):\n    return s[-1:] + s[:-1]\n",
        "the prompt's helper": "    for _ in range(len(s) - 1):\n        s = rotate(s)\n    return s\n",
        "a builtin of its own": "    return s[-len(s[:1]):] + s[:-1]\n\n\ndef len(s):\n    return 1\n",
    }
    for name, completion in honest.items():
        program, tests, exports = humaneval_program(problem, completion)
        result = run_untrusted(program, tests=tests, exports=exports)
        assert result.passed, (name, result.output)
    # the forgery: rotate redefined as the identity, and unrotate as the identity too
    program, tests, exports = humaneval_program(problem, "    return s\n\n\ndef rotate(s):\n    return s\n")
    assert exports == ("unrotate",)
    assert run_untrusted(program, tests=tests, exports=exports).status == "failed"


def test_exports_name_code_the_tests_may_call():
    for exports in (["abs"], ["len", "add_one"], ["not an identifier"], ["__import__"]):
        with pytest.raises(ValueError, match="cannot export"):
            run_untrusted(WRONG, tests=TESTS, exports=exports)
    with pytest.raises(ValueError, match="give tests too"):
        run_untrusted(WRONG, exports=["add_one"])
    with pytest.raises(LatentloopError, match="entry_point 'sorted'"):
        humaneval_program({"task_id": "t", "prompt": "", "entry_point": "sorted", "test": ""}, "")


@needs_sandbox
def test_real_humaneval_solutions_pass_and_wrong_ones_fail():
    path = shared_data("eval") / "human_eval.jsonl"  # skips when the shared data is not beside the checkout
    problems = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][::16]
    for problem in problems:
        program, tests, exports = humaneval_program(problem, problem["canonical_solution"])
        result = run_untrusted(program, tests=tests, exports=exports, timeout=10.0)
        assert result.passed, (problem["task_id"], result.output)
        program, tests, exports = humaneval_program(problem, "    return None\n")
        assert not run_untrusted(program, tests=tests, exports=exports, timeout=10.0).passed, problem["task_id"]


@needs_sandbox
def test_network_is_blocked_inside_the_child():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        attempts = [
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
            f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\n",
            f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\n",  # below the socket module
            f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)\n",
        ]
        for code in attempts:
            result = run_untrusted(code)
            assert result.status == "error", code
            assert BLOCKED in result.output, result.output
            assert "refused" not in result.output.lower(), result.output
        connect = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                   f"except OSError as error:\n    print('CONNECT', type(error).__name__)\nelse:\n"
                   f"    print('CONNECTED')\n")
        result = run_untrusted(SPAWN + f"python({connect!r})\n")  # an interpreter without the hook
        assert result.passed and "CONNECT ConnectionRefusedError" in result.output, result.output
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()


@needs_sandbox
def test_our_environment_is_not_readable(monkeypatch):
    secret = f"hunter2-{secrets.token_hex(4)}"
    monkeypatch.setenv("LATENTLOOP_TEST_SECRET", secret)
    code = SPAWN + (
        "assert 'LATENTLOOP_TEST_SECRET' not in os.environ\n"
        f"for path in ['/proc/{os.getpid()}/environ', '/proc/self/environ', '/proc/1/environ']:\n"
        "    try:\n"
        "        print('LEAKED', open(path, 'rb').read())\n"
        "    except OSError as error:\n"
        "        print('no', path, type(error).__name__)\n"
        f"run('/bin/sh', '-c', 'cat /proc/{os.getpid()}/environ /proc/*/environ; env')\n")
    result = run_untrusted(code)
    assert result.passed, result.output
    assert secret not in result.output and "LEAKED" not in result.output
    assert result.output.count("FileNotFoundError") == 3


@needs_sandbox
def test_our_keys_and_the_bootstraps_memory_are_out_of_reach():
    number = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)  # keyctl
    if number is None:
        pytest.skip(f"no keyctl number for {os.uname().machine} in this test")
    ours = ctypes.CDLL(None).syscall(number, 0, -3, 0)  # our session keyring
    child = ("import ctypes, os\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             f"session = libc.syscall({number}, 0, -3, 0)\n"
             f"print('KEYRING', session, libc.syscall({number}, 11, session, None, 0))\n"  # its size: empty
             "print('PTRACE', libc.ptrace(16, os.getppid(), 0, 0), ctypes.get_errno())\n"  # attach the bootstrap
             "local, remote = (ctypes.c_size_t * 2)(ctypes.addressof(ctypes.create_string_buffer(8)), 8), "
             "(ctypes.c_size_t * 2)(0x400000, 8)\n"
             "print('READ', libc.process_vm_readv(os.getppid(), local, 1, remote, 1, 0), ctypes.get_errno())\n")
    result = run_untrusted(SPAWN + f"python({child!r})\n")  # ctypes in a child: the bootstrap refuses it
    assert result.passed, result.output
    session, size = (int(v) for v in result.output.split("KEYRING ")[1].split()[:2])
    assert session > 0 and session != ours and size == 0
    assert "PTRACE -1 1\n" in result.output and "READ -1 1\n" in result.output  # EPERM


# -- fails closed ----------------------------------------------------------------------------------
def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert isinstance(error.value, LatentloopError) and message and "\n" not in message
    return message


def test_missing_isolation_fails_closed(monkeypatch):
    real_which = sandbox.shutil.which
    sandbox._probe.cache_clear()
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, **kw: None if name == "bwrap" else real_which(name, **kw))
    for call in (lambda: run_untrusted("assert True\n"), require_sandbox):
        with pytest.raises(SandboxUnavailable) as error:
            call()
        assert "bubblewrap" in _one_line(error) and "apt-get install bubblewrap" in str(error.value)
    monkeypatch.setattr(sandbox.shutil, "which",
                        lambda name, **kw: "/bin/false" if name == "bwrap" else real_which(name, **kw))
    if os.path.exists("/bin/false"):  # a bwrap that cannot start anything
        with pytest.raises(SandboxUnavailable) as error:
            run_untrusted("assert True\n")
        assert "did not start" in _one_line(error)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable) as error:
        run_untrusted("assert True\n")
    assert "root" in _one_line(error)
    sandbox._probe.cache_clear()
