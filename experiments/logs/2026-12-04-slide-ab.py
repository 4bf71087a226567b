"""Paired A/B of a new decode window with and without `AotDecodeStep._slide`, in one process
(2026-12-04, third session). Two copies of the engines benchmark's small model (random init, seed 0)
each get a decoder: A binds its package again at every window (every 16 steps: `_bind`, which runs
the library once through handles made in Python), B swaps only the window's input handle. Each round
times a whole 200-token greedy `generate` of both, in random order; the tokens must agree.

    python experiments/logs/2026-12-04-slide-ab.py ROUNDS
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import describe_ratios, paired_ratios  # noqa: E402
from benchmarks.engines import SHAPES, switched_calls  # noqa: E402
from latentloop.models import aot  # noqa: E402

rounds = int(sys.argv[1])
torch.set_num_threads(1)
slide, switch = aot.AotDecodeStep._slide, {"on": True}
aot.AotDecodeStep._slide = staticmethod(lambda bound, cache: slide(bound, cache) if switch["on"] else False)
rebind, slid = switched_calls(SHAPES["small"], switch, list(range(1, 17)), 200)
assert rebind() == slid(), "tokens differ"
print("slide / rebind:", describe_ratios(paired_ratios(rebind, slid, rounds)))
