"""Load test of `latentloop serve` on loopback: requests/s, tokens/s and p50 / p99 latency at
concurrency 1, 8 and 32, for each batching mode measured in the same run: `continuous` (rows join
the running batch at its next step and leave when done; the default), `rounds` (the scheduler
before it: a batch of the requests waiting, run to its end while new ones wait), both with
`--max-batch-size 32`, `compiled` (continuous batching with `--decode compiled`: its steps on the
compiled path), and `unbatched` (`--max-batch-size 1`: one row per engine call, requests
served one after another); for random-init `tiny` and `small` gpt models saved as run folders
(speed does not depend on the weights).

Bounded: the servers start together (a compiled server compiles its step for every batch size
before it answers; the time to ready is printed), then every cell (preset x mode x concurrency)
gets an equal share of `--budget` seconds (default 55).
In a cell, C client tasks (asyncio + httpx, in this process) send greedy /v1/completions requests
back to back (prompts of 12-40 characters, max_tokens 32, or 8-64 cycling with
`--varied-lengths`); requests still running when the cell's time is up are abandoned (their
connections close and the server drops their rows, so the next cell starts clean) and not counted,
so latencies of overloaded cells are those of the lucky ones. Latency is per completed request,
queueing included; tokens/s counts `usage.completion_tokens` of completed requests (random weights
sometimes stop early at BOS/EOS). "rows per step" is the mean number of rows a decode step ran.
Client and servers share the machine's cores.

    .venv/bin/python benchmarks/serve_load.py
    .venv/bin/python benchmarks/serve_load.py --presets tiny --batching continuous rounds --budget 120
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO_ROOT / "benchmarks"
for _path in (str(REPO_ROOT), str(BENCH_DIR)):  # this checkout's code, and `common`
    if _path not in sys.path:
        sys.path.insert(0, _path)

import httpx  # noqa: E402
import torch  # noqa: E402
from common import render_table, spread  # noqa: E402

import latentloop as ll  # noqa: E402
from latentloop.data import ByteTokenizer  # noqa: E402
from latentloop.runs import save_run  # noqa: E402

BATCHED_ROWS = 32  # --max-batch-size of the batching server (>= the highest concurrency)
NEW_TOKENS = 32  # max_tokens of every request
TEXT = "import os\nclass Loop:\n    def step(self, state, token):\n        return self.cell(state, token)\n"
PROMPT_LENGTHS = (12, 20, 28, 40)  # characters; requests cycle through them
VARIED_TOKENS = (8, 64, 16, 32, 48, 24)  # max_tokens cycled through with --varied-lengths
MODES = {"continuous": ("continuous", BATCHED_ROWS, "eager"), "rounds": ("rounds", BATCHED_ROWS, "eager"),
         "compiled": ("continuous", BATCHED_ROWS, "compiled"),
         "unbatched": ("continuous", 1, "eager")}  # mode -> (--batching, --max-batch-size, --decode)
# for the servers to answer /health: a compiled server first compiles its step for 1, 2, 4, ... 32
# rows (cold: tens of seconds each on 2 busy cores; warm: loaded from the on-disk cache)
START_TIMEOUT_S = 900
DRAIN_TIMEOUT_S = 10  # after a cell, for the server to drop the abandoned requests
MIN_CELL_S = 1.0  # below this a cell measures nothing useful: refuse the budget instead
POLL_S = 0.05
DEFAULT_BUDGET_S = 55.0  # the cells' seconds: with the imports and an eager server's start, about a minute


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, run: Path, batching: str, max_rows: int, decode: str, log: Path, threads: int | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "latentloop", "serve", str(run), "--port",
                                          str(self.port), "--device", "cpu", "--max-batch-size", str(max_rows),
                                          "--batching", batching, "--decode", decode, "--max-queue", "1024",
                                          *(["--threads", str(threads)] if threads else [])],
                                         cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.log = log

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {self.log.read_text()[-1000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        raise SystemExit("a server did not start in time")

    def stats(self) -> dict:
        return httpx.get(self.url + "/v1/stats", timeout=DRAIN_TIMEOUT_S).json()

    def drain(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            stats = self.stats()
            if stats["queued"] == 0 and stats["active_rows"] == 0:
                return
            time.sleep(POLL_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(DRAIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def body(i: int, varied: bool = False) -> dict:
    tokens = VARIED_TOKENS[i % len(VARIED_TOKENS)] if varied else NEW_TOKENS
    return {"prompt": TEXT[:PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]], "max_tokens": tokens, "temperature": 0}


async def load(url: str, concurrency: int, seconds: float, varied: bool) -> tuple[list[float], int, int, float]:
    """(latencies of completed requests, their completion tokens, failed requests, measured seconds).
    A failed request (not 200) is counted and its client goes on: a client that stopped would
    lower the concurrency of the rest of the cell."""
    latencies: list[float] = []
    tokens = failed = 0
    start = time.perf_counter()
    stop_at = start + seconds
    async with httpx.AsyncClient(base_url=url, timeout=None,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker(k: int) -> None:
            nonlocal tokens, failed
            i = k
            while time.perf_counter() < stop_at:
                sent = time.perf_counter()
                reply = await client.post("/v1/completions", json=body(i, varied))
                if reply.status_code != 200:
                    failed += 1
                elif time.perf_counter() <= stop_at:
                    latencies.append(time.perf_counter() - sent)
                    tokens += reply.json()["usage"]["completion_tokens"]
                i += concurrency

        tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        await asyncio.wait(tasks, timeout=max(0.0, stop_at - time.perf_counter()))
        for task in tasks:  # abandon what still runs: closing its connection frees its row
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return latencies, tokens, failed, time.perf_counter() - start


def measure(server: Server, concurrency: int, seconds: float, varied: bool) -> dict:
    """One cell: `concurrency` clients for `seconds`, then the server drained."""
    before = server.stats()
    latencies, tokens, failed, wall = asyncio.run(load(server.url, concurrency, seconds, varied))
    server.drain()
    after = server.stats()
    steps = after["steps"] - before["steps"]
    nan = float("nan")  # no completed request: no latency (shown as "-")
    return {"requests": len(latencies), "failed": failed, "req/s": len(latencies) / wall, "tokens/s": tokens / wall,
            "p50": statistics.median(latencies) if latencies else nan,
            "p99": percentile(latencies, 0.99) if latencies else nan,
            "rows per step": (after["row_steps"] - before["row_steps"]) / steps if steps else 0.0}


def cell_spread(values: list[float], digits: int) -> str:
    """A cell's figure over its repeats: the value alone for one, else `common.spread`'s median
    [min–max]; NaNs (no completed request) dropped, "-" when nothing is left."""
    values = [v for v in values if v == v]
    fmt = f"{{:.{digits}f}}"
    if not values:
        return "-"
    return fmt.format(values[0]) if len(values) == 1 else spread(values, fmt)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for the cells, once the servers are ready")
    p.add_argument("--batching", nargs="+", choices=list(MODES), default=["continuous", "rounds"],
                   help="the modes to compare (default: continuous rounds; unbatched: --max-batch-size 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="every server's --threads (default: torch's choice, one per core)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every cell this many times, the cells in a new order each time (the budget is "
                        "shared by all); the table gives each cell's median and, with 2 or more, its range")
    p.add_argument("--varied-lengths", action="store_true",
                   help=f"max_tokens cycles through {VARIED_TOKENS} instead of {NEW_TOKENS} for every request")
    args = p.parse_args(argv)
    if max(args.concurrency) > BATCHED_ROWS or min(args.concurrency) < 1:
        p.error(f"concurrency must be in [1, {BATCHED_ROWS}]")
    if args.repeats < 1 or (args.threads is not None and args.threads < 1):
        p.error("--repeats and --threads must be >= 1")
    began = time.monotonic()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    servers: dict[tuple[str, str], Server] = {}
    with tempfile.TemporaryDirectory(prefix="serve_load_") as folder:
        try:
            for preset in args.presets:
                torch.manual_seed(0)
                run = save_run(ll.build("gpt", preset=preset), ByteTokenizer(), Path(folder) / preset).parents[1]
                for mode in args.batching:
                    batching, rows, decode = MODES[mode]
                    servers[preset, mode] = Server(run, batching, rows, decode, Path(folder) / f"{preset}-{mode}.log",
                                                     args.threads)
            for server in servers.values():
                server.wait_ready(time.monotonic() + START_TIMEOUT_S)
            for server in servers.values():  # first calls pay one-off costs: not measured
                httpx.post(server.url + "/v1/completions", json=body(0), timeout=START_TIMEOUT_S).raise_for_status()
            cells = [(preset, mode, c) for preset in args.presets for c in args.concurrency for mode in args.batching]
            seconds = args.budget / (len(cells) * args.repeats) * 0.8  # the rest: draining between cells
            if seconds < MIN_CELL_S:
                raise SystemExit(f"the budget leaves {seconds:.1f} s per cell; "
                                 f"raise --budget or measure fewer cells")
            print(f"servers ready after {time.monotonic() - began:.0f} s; {len(cells)} cells x {args.repeats} "
                  f"of {seconds:.1f} s", flush=True)
            measured: dict[tuple, list[dict]] = {cell: [] for cell in cells}
            order = random.Random(0)
            for repeat in range(args.repeats):
                # a new order each time: a slow spell of the machine does not always hit the same cell
                for preset, mode, c in cells if repeat == 0 else order.sample(cells, len(cells)):
                    cell = measure(servers[preset, mode], c, seconds, args.varied_lengths)
                    measured[preset, mode, c].append(cell)
                    print(preset, mode, c, " ".join(f"{k} {v:.2f}" for k, v in cell.items()), flush=True)
            rows = [["preset", "server", "concurrency", "requests", "failed", "req/s", "tokens/s", "p50 latency s",
                     "p99 latency s", "rows per step"]]
            for (preset, mode, c), repeats in measured.items():
                rows.append([preset, mode, c, sum(r["requests"] for r in repeats), sum(r["failed"] for r in repeats),
                             *(cell_spread([r[key] for r in repeats], digits) for key, digits in
                               (("req/s", 1), ("tokens/s", 0), ("p50", 2), ("p99", 2), ("rows per step", 1)))])
        finally:
            for server in servers.values():
                server.stop()
    print()
    print(render_table(rows))
    if "rounds" in args.batching and len(args.batching) > 1:
        print("\nagainst rounds, repeat by repeat (median [min–max]): the issue's bar is req/s >= 2x with p99 <= 1x")
        ratios = [["preset", "server", "concurrency", "req/s / rounds", "p99 / rounds"]]
        for preset, mode, c in cells:
            if mode != "rounds":
                pairs = list(zip(measured[preset, mode, c], measured[preset, "rounds", c]))
                ratios.append([preset, mode, c, *(cell_spread([a[key] / b[key] for a, b in pairs if b[key]], 2)
                                                  for key in ("req/s", "p99"))])
        print(render_table(ratios))
    print(f"\ntotal {time.monotonic() - began:.0f} s; load average {os.getloadavg()[0]:.1f} at the end "
          f"(client and servers share the cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
