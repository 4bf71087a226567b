"""Paired A/B of the package's step with and without aot_run.c's prepared run, in one process
(2026-12-04). Two copies of the engines benchmark's model (random init, seed 0) each get a decoder:
A makes the inputs' handles and the outputs' tensors every call (`_Library.run`, aot_run.c switched
off), B runs prepared. Each round times a whole 200-token greedy `generate` of both, in random
order; the tokens must agree.

    python experiments/logs/2026-12-04-prepared-run-ab.py ROUNDS [THREADS [SHAPE [NEW_TOKENS]]]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import describe_ratios, paired_ratios  # noqa: E402
from benchmarks.engines import SHAPES, switched_calls  # noqa: E402
from latentloop.models import aot  # noqa: E402

rounds = int(sys.argv[1])
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
shape = sys.argv[3] if len(sys.argv) > 3 else "small"
new_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 200
runner, switch = aot._runner, {"on": False}
aot._runner = lambda: runner() if switch["on"] else None  # read when a decoder binds a window
per_call, prepared = switched_calls(SHAPES[shape], switch, list(range(1, 17)), new_tokens)
assert per_call() == prepared(), "tokens differ"
print("prepared / per-call:", describe_ratios(paired_ratios(per_call, prepared, rounds)))
