"""The sandbox for untrusted code: outcomes, timeout, memory limit, no network, no inherited secrets."""

import os
import socket
import time

import pytest

from latentloop.eval.sandbox import network_namespace_prefix, run_untrusted

BLOCKED = "network access is blocked"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_passing_and_failing_assertions_are_reported():
    ok = run_untrusted("def f(x):\n    return x + 1\nassert f(1) == 2\nprint('done')\n")
    assert ok.passed and ok.status == "passed" and "done" in ok.output
    bad = run_untrusted("def f(x):\n    return x\nassert f(1) == 2, 'wrong value'\n")
    assert not bad.passed and bad.status == "failed"
    assert "AssertionError: wrong value" in bad.output


def test_other_exceptions_and_early_exit_are_errors():
    for code in ("def f(:\n    pass\n", "raise ValueError('boom')\n", "undefined_name\n",
                 "import sys\nsys.exit(0)\nassert False\n", "import os\nos._exit(0)\n"):
        result = run_untrusted(code)
        assert result.status == "error" and not result.passed, code


@pytest.mark.parametrize("namespace", [True, False])
def test_network_is_blocked_inside_the_child(namespace):
    port = _free_port()
    attempts = [
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
        f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\n",
        f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\n",  # below the socket module
        f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)\n",
    ]
    for code in attempts:
        result = run_untrusted(code, network_namespace=namespace)
        assert result.status == "error", code
        assert BLOCKED in result.output, result.output
        assert "refused" not in result.output.lower(), result.output


def test_child_processes_are_blocked():
    result = run_untrusted("import subprocess\nsubprocess.run(['true'])\n")
    assert result.status == "error" and "process creation is blocked" in result.output
    result = run_untrusted("import os\nos.system('true')\n")
    assert result.status == "error" and "process creation is blocked" in result.output


def test_infinite_loop_is_killed_within_the_timeout():
    started = time.monotonic()
    result = run_untrusted("while True:\n    pass\n", timeout=1.0)
    elapsed = time.monotonic() - started
    assert result.status == "timeout" and not result.passed
    assert elapsed < 3.0


def test_sleeping_code_is_killed_too():
    started = time.monotonic()
    result = run_untrusted("import time\ntime.sleep(30)\n", timeout=0.5)
    assert result.status == "timeout" and time.monotonic() - started < 3.0


def test_memory_limit_is_enforced():
    result = run_untrusted("block = bytearray(1024 * 1024 * 1024)\n", memory_mb=128)
    assert result.status == "error" and "MemoryError" in result.output
    small = run_untrusted("block = bytearray(16 * 1024 * 1024)\nassert len(block) > 0\n", memory_mb=256)
    assert small.passed
    if network_namespace_prefix():  # inside the namespace the limit cannot be raised again
        raised = run_untrusted("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n", memory_mb=128)
        assert raised.status == "error"


def test_environment_is_not_inherited_and_workdir_is_temporary(monkeypatch):
    monkeypatch.setenv("LATENTLOOP_TEST_SECRET", "hunter2")
    code = ("import os, sys\n"
            "assert 'LATENTLOOP_TEST_SECRET' not in os.environ\n"
            "assert 'hunter2' not in repr(os.environ)\n"
            "print('CWD=' + os.getcwd())\n"
            "open('scratch.txt', 'w').write('x')\n")
    result = run_untrusted(code)
    assert result.passed, result.output
    cwd = result.output.split("CWD=")[1].split()[0]
    assert cwd != os.getcwd() and not os.path.exists(cwd)  # removed afterwards


def test_output_is_bounded():
    result = run_untrusted("for i in range(200000):\n    print('line', i)\n")
    assert result.passed and len(result.output) <= 10_000 and "line 199999" in result.output
