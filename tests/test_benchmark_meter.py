"""The benchmarks' contention meter must not count the benchmark's own helper processes (inductor's
compile workers, torchrun's ranks) as other load on the machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD_CPU_S = 0.5  # CPU seconds the child burns before it reports
# the child spins on its own CPU clock, so on a loaded machine it still burns CPU_S of CPU time
CHILD = f"""
import sys, time
start = time.process_time()
while time.process_time() - start < {CHILD_CPU_S}:
    pass
print("done", flush=True)
sys.stdin.read()  # stay alive until the parent closes stdin
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_own_cpu_seconds_include_live_children():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.common import _own_cpu_seconds
    finally:
        sys.path.remove(str(ROOT))
    before = _own_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        assert _own_cpu_seconds() - before >= CHILD_CPU_S * 0.9  # the child's time, while it is alive
    finally:
        child.stdin.close()
        child.wait(timeout=30)
