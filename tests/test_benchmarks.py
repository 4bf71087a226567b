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
        alive = _own_cpu_seconds() - before
        assert alive >= CHILD_CPU_S * 0.9  # the child's time, while it is alive
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    reaped = _own_cpu_seconds() - before  # now in RUSAGE_CHILDREN instead: counted once, not twice
    assert alive * 0.9 <= reaped <= alive * 1.5 + 0.05, (alive, reaped)


def test_the_training_floor_runs_the_products_and_attention_of_a_training_step():
    """The matmuls and attention kernels (with their operand shapes) of one floor step are those
    of our gpt's forward + backward at the same shape: none missing, none extra."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.baseline import N_LAYER, VOCAB, build_model, training_floor_step
    finally:
        sys.path.remove(str(ROOT))

    class Kernels(TorchDispatchMode):
        """(op, operand shapes) of every matmul and attention kernel dispatched."""

        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name == "mm" or name.startswith("_scaled_dot_product"):
                self.seen[name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))] += 1
            return func(*args, **(kwargs or {}))

    seq_len, batch = 32, 2
    model = build_model(seq_len, seed=0)
    with Kernels() as floor:
        training_floor_step(model, seq_len, batch)(0)
    idx = torch.randint(0, VOCAB, (batch, seq_len))
    with Kernels() as step:
        model(idx).logits.sum().backward()
    assert sum(n for (name, _), n in step.seen.items() if name.startswith("_scaled_dot_product")) == 2 * N_LAYER
    assert floor.seen == step.seen

