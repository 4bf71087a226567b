"""Paired A/B of the package's step with and without aot_run.c's prepared run, in one process
(2026-12-04). Two copies of the engines benchmark's model (random init, seed 0) each get a decoder:
A makes the inputs' handles and the outputs' tensors every call (`_Library.run`, aot_run.c switched
off), B runs prepared. Each round times a whole 200-token greedy `generate` of both, in random
order; the tokens must agree.

    python experiments/logs/2026-12-04-prepared-run-ab.py ROUNDS [THREADS [SHAPE [NEW_TOKENS]]]
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
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
shape = sys.argv[3] if len(sys.argv) > 3 else "small"
new_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 200
model_a, _, _ = build_export(SHAPES[shape], 256, 0, Path(tempfile.mkdtemp()))
model_b = copy.deepcopy(model_a)
runner, use_runner = aot._runner, {"on": False}
aot._runner = lambda: runner() if use_runner["on"] else None  # read when a decoder binds a window
prompt = list(range(1, 17))
call_a, call_b = latentloop_call(model_a, prompt, compile=True), latentloop_call(model_b, prompt, compile=True)


def per_call(n):
    use_runner["on"] = False
    return call_a(n)


def prepared(n):
    use_runner["on"] = True
    return call_b(n)


assert per_call(new_tokens) == prepared(new_tokens), "tokens differ"
ratios = []
for _ in range(rounds):
    order = [(per_call, "a"), (prepared, "b")]
    random.shuffle(order)
    seconds = {}
    for call, name in order:
        start = time.perf_counter()
        call(new_tokens)
        seconds[name] = time.perf_counter() - start
    ratios.append(seconds["b"] / seconds["a"])
q = statistics.quantiles(ratios, n=4)
print(f"prepared / per-call: median {statistics.median(ratios):.3f}, quartiles {q[0]:.3f} {q[2]:.3f}, "
      f"below 1 in {sum(r < 1 for r in ratios)}/{len(ratios)} rounds")
