"""Paired A/B of a new decode window with and without `AotDecodeStep._slide`, in one process
(2026-12-04, third session). Two copies of the engines benchmark's small model (random init, seed 0)
each get a decoder: A binds its package again at every window (every 16 steps: `_bind`, which runs
the library once through handles made in Python), B swaps only the window's input handle. Each round
times a whole 200-token greedy `generate` of both, in random order; the tokens must agree.

    python experiments/logs/2026-12-04-slide-ab.py ROUNDS
"""

import copy
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.engines import SHAPES, build_export, latentloop_call  # noqa: E402
from latentloop.models import aot  # noqa: E402

rounds = int(sys.argv[1])
torch.set_num_threads(1)
model_a, _, _ = build_export(SHAPES["small"], 256, 0, Path(tempfile.mkdtemp()))
model_b = copy.deepcopy(model_a)
slide, use = aot.AotDecodeStep._slide, {"on": True}
aot.AotDecodeStep._slide = staticmethod(lambda bound, cache: slide(bound, cache) if use["on"] else False)
prompt = list(range(1, 17))
call_a, call_b = latentloop_call(model_a, prompt, compile=True), latentloop_call(model_b, prompt, compile=True)


def rebind(n):
    use["on"] = False
    return call_a(n)


def slid(n):
    use["on"] = True
    return call_b(n)


assert rebind(200) == slid(200), "tokens differ"
ratios = []
for _ in range(rounds):
    order = [(rebind, "a"), (slid, "b")]
    random.shuffle(order)
    seconds = {}
    for call, name in order:
        start = time.perf_counter()
        call(200)
        seconds[name] = time.perf_counter() - start
    ratios.append(seconds["b"] / seconds["a"])
q = statistics.quantiles(ratios, n=4)
mean, half = statistics.mean(ratios), 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5
print(f"slide / rebind: median {statistics.median(ratios):.3f}, quartiles {q[0]:.3f} {q[2]:.3f}, mean {mean:.3f} "
      f"[{mean - half:.3f}, {mean + half:.3f}], below 1 in {sum(r < 1 for r in ratios)}/{len(ratios)}")
