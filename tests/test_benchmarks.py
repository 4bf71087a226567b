"""What the benchmarks' figures rest on: the contention meter must not count the benchmark's own
helper processes (inductor's compile workers, torchrun's ranks) as other load on the machine, and
the training floor must compute exactly the products and attention of a real training step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_the_training_floor_runs_the_products_and_attention_of_a_training_step():
    """FLOPs counted by torch (matmuls and SDPA, forward and backward) of one floor step equal
    those of our gpt's forward + backward at the same shape: no product missing, none extra."""
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.baseline import VOCAB, build_model, training_floor_step
    finally:
        sys.path.remove(str(ROOT))
    seq_len, batch = 32, 2
    model = build_model(seq_len, seed=0)
    with FlopCounterMode(display=False) as floor:
        training_floor_step(model, seq_len, batch)(0)
    idx = torch.randint(0, VOCAB, (batch, seq_len))
    with FlopCounterMode(display=False) as step:
        model(idx).logits.sum().backward()
    assert floor.get_total_flops() == step.get_total_flops() > 0

