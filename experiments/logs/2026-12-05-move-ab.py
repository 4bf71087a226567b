"""Decode speed before and after the inference package moved out of models/ (issue 50), paired in one
run: a worker process per source tree (the commit before the move, and this one), each with the
engines benchmark's small model (4 layers, d 256, byte vocabulary, seed 0, 1 thread), warmed up
(the compiled step compiled or loaded), then one whole greedy `generate` timed per call, the two
trees' calls alternating in random order round by round. The new tree's model is accelerated as
`load_run` does on the CPU (the old one routed every product itself). Tokens must agree.

    python experiments/logs/2026-12-05-move-ab.py OLD_TREE NEW_TREE ROUNDS [--eager] [--new-tokens 200]
"""

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys, time, torch
import latentloop as ll
torch.set_num_threads(1)
compile_, new_tokens = sys.argv[1] == "compiled", int(sys.argv[2])
torch.manual_seed(0)
model = ll.build("gpt", preset=None, n_layer=4, n_embd=256, n_head=4, vocab_size=259, bos_id=256,
                 sequence_len=256).eval()
try:
    from latentloop.inference import accelerate
    accelerate(model)  # as load_run does on the CPU
except ImportError:
    pass  # the old tree: every product was routed inside the model
prompt = [256] + torch.randint(0, 256, (15,), generator=torch.Generator().manual_seed(0)).tolist()
def call():
    start = time.perf_counter()
    ids = ll.generate(model, prompt, new_tokens, temperature=0.0, compile=compile_)
    return time.perf_counter() - start, ids
for _ in range(3):
    call()  # warm-up: the compile (or the package's load) and the first windows
print(json.dumps({"ready": True, "tokens": call()[1]}), flush=True)
for line in sys.stdin:
    seconds, ids = call()
    print(json.dumps({"seconds": seconds}), flush=True)
"""


def start(tree: str, mode: str, new_tokens: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": tree}
    return subprocess.Popen([sys.executable, "-c", WORKER, mode, str(new_tokens)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tree)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old"), p.add_argument("new"), p.add_argument("rounds", type=int)
    p.add_argument("--eager", action="store_true", help="time the eager path instead of the compiled one")
    p.add_argument("--new-tokens", type=int, default=200)
    args = p.parse_args()
    mode = "eager" if args.eager else "compiled"
    workers = {name: start(tree, mode, args.new_tokens) for name, tree in (("old", args.old), ("new", args.new))}
    ready = {name: json.loads(w.stdout.readline()) for name, w in workers.items()}
    agree = ready["old"]["tokens"] == ready["new"]["tokens"]
    ratios = []
    for _ in range(args.rounds):
        seconds = {}
        for name in random.sample(list(workers), 2):
            workers[name].stdin.write("go\n")
            workers[name].stdin.flush()
            seconds[name] = json.loads(workers[name].stdout.readline())["seconds"]
        ratios.append(seconds["new"] / seconds["old"])
    for w in workers.values():
        w.stdin.close()
        w.wait()
    mean, sd = statistics.mean(ratios), statistics.stdev(ratios)
    half = 1.96 * sd / math.sqrt(len(ratios))  # normal approximation over the rounds
    print(json.dumps({"mode": mode, "rounds": len(ratios), "new_over_old_mean": round(mean, 4),
                      "interval_95": [round(mean - half, 4), round(mean + half, 4)],
                      "median": round(statistics.median(ratios), 4),
                      "rounds_below_1": sum(r < 1 for r in ratios), "tokens_agree": agree}))


if __name__ == "__main__":
    main()
