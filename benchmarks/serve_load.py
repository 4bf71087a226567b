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

`--against llama.cpp` (issue 54): llama.cpp's own server (`llama-server`: `-np 32` slots, continuous
batching on; build it with `benchmarks/build_llama_server.sh`, pass it as `--llama-server PATH` or
env LLAMA_SERVER) and `latentloop serve` (continuous batching, `--max-batch-size 32`) on one model:
`--run RUN` (a gpt run of the Llama-compatible shape: `--set mlp=swiglu --set qk_norm=false --set
embed_norm=false`; default a random-init one of engines' small shape), exported with `export --plain`
and written as an fp32 GGUF by `benchmarks.engines.write_gguf`, given the byte tokenizer's vocabulary
(llama-server turns every token into text, which write_gguf's "none" vocabulary cannot: it aborts).
Both servers get the same requests as token ids (BOS, then bytes of a stdlib source file), short
and long prompts alternating (`--short` / `--long` tokens), `--new-tokens` (128) greedy tokens each
with no early stop on either side (`ignore_eos`, which both servers take: equal work; a request
that still ends early is counted as a "short" completion), no prompt cache on either (llama.cpp:
`cache_prompt: false`, `--cache-ram 0`). The same `--threads` for both (default: the CPU count).
Cells (server x concurrency) are interleaved repeat by repeat, the server order alternating; in a
cell C clients send requests back to back for the cell's seconds, then the requests in flight run
to their end (bounded by `TAIL_S`): req/s is completed requests over the time to the last one, and
p50 / p99 are of the requests' wall latency, queueing included. Ratios are latentloop's over
llama.cpp's of the same repeat, geometric mean with its 95% t-interval (on the logs) over the repeats.
Before the load, a few greedy requests (short and long) go to both, and their tokens are compared. `--kv-dtype float16`
serves latentloop's compiled batches over llama-server's default cache type (f16; latentloop's
default keeps the model's fp32).

    .venv/bin/python benchmarks/serve_load.py --against llama.cpp --llama-server PATH --run runs/serve-gpt \
        --repeats 3 --budget 540 --json runs/serve_load/against_llama_cpp.json

Each mode's own flags are refused in the other, where nothing would read them: `--run`, `--decode`,
`--kv-dtype`, `--new-tokens`, `--short`, `--long`, `--json` and `--llama-server` need `--against`;
`--presets`, `--batching` and `--varied-lengths` are for the batching comparison only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from common import ContentionMeter, invocation, render_table, spread  # noqa: E402

import latentloop as ll  # noqa: E402
from latentloop.config import PRESETS  # noqa: E402
from latentloop.data import ByteTokenizer  # noqa: E402
from latentloop.engine import KV_DTYPES  # noqa: E402
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

# --against llama.cpp
AGAINST = ("llama.cpp",)
LLAMA_SERVER_ENV = "LLAMA_SERVER"  # the llama-server binary, when --llama-server is not given
AGAINST_NEW_TOKENS = 128  # every request's completion (no early stop on llama.cpp's side)
SHORT_PROMPT, LONG_PROMPT = 32, 352  # prompt tokens (BOS included): a long one + 128 fits a 512 context
DEFAULT_PRESETS, DEFAULT_BATCHING = ("tiny", "small"), ("continuous", "rounds")
# flag -> argument of the flags only one of the two modes reads (parse_args refuses them in the other)
AGAINST_ONLY = {"--llama-server": "llama_server", "--run": "run", "--decode": "decode", "--kv-dtype": "kv_dtype",
                "--new-tokens": "new_tokens", "--short": "short", "--long": "long", "--json": "json"}
BATCHING_ONLY = {"--presets": "presets", "--batching": "batching", "--varied-lengths": "varied_lengths"}
# the defaults of the flags above that have one, filled in once the mode's flags are checked
DEFAULTS = {"presets": list(DEFAULT_PRESETS), "batching": list(DEFAULT_BATCHING), "varied_lengths": False,
            "decode": "auto", "new_tokens": AGAINST_NEW_TOKENS, "short": SHORT_PROMPT, "long": LONG_PROMPT}
MIX_SIZE = 64  # distinct prompts in the request mix; request i takes prompt i % MIX_SIZE
SPOT_CHECKS = 4  # greedy requests (the mix's first: short, long, short, long) whose tokens are compared
AGAINST_REPEATS = 3  # default --repeats with --against: its ratios are paired over repeats, with an interval
AGAINST_BUDGET_S = 540.0  # default --budget with --against: 18 cells (2 servers x 3 concurrencies x 3 repeats)
TAIL_S = 120.0  # after a cell's seconds, how long its requests in flight may take to finish
SETTLE_S = 1.0  # pause before each cell: the previous server's threads stop spinning


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, run: Path, batching: str, max_rows: int, decode: str, log: Path, threads: int | None,
                 kv_dtype: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "latentloop", "serve", str(run), "--port",
                                          str(self.port), "--device", "cpu", "--max-batch-size", str(max_rows),
                                          "--batching", batching, "--decode", decode, "--max-queue", "1024",
                                          *(["--threads", str(threads)] if threads else []),
                                          *(["--kv-dtype", kv_dtype] if kv_dtype else [])],
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


# below this many requests a cell's p99 (`percentile`'s rank, round(0.99 (n - 1))) is its slowest request (52)
P99_SAMPLES = next(n for n in range(2, 1000) if percentile(list(range(n)), 0.99) != n - 1)


# --- --against llama.cpp ----------------------------------------------------------------------

def find_llama_server(path: str | None) -> Path:
    """The llama-server binary: `path` (--llama-server), else env LLAMA_SERVER; SystemExit with one
    line naming what is missing and how to get it."""
    given = path or os.environ.get(LLAMA_SERVER_ENV)
    how = ("build one with benchmarks/build_llama_server.sh SOURCE (a llama.cpp checkout or a source tarball) "
           f"and pass --llama-server PATH or set {LLAMA_SERVER_ENV}")
    if not given:
        raise SystemExit(f"serve_load: --against llama.cpp needs llama.cpp's llama-server binary; {how}")
    binary = Path(given)
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise SystemExit(f"serve_load: no llama-server binary at {binary} (not an executable file); {how}")
    return binary


def prompt_source() -> bytes:
    """The bytes the prompts are cut from: a stdlib module's source (what the stdlib runs trained on)."""
    return Path(os.__file__).read_bytes()


def request_mix(bos: int, source: bytes, short: int = SHORT_PROMPT, long: int = LONG_PROMPT,
                size: int = MIX_SIZE) -> list[list[int]]:
    """`size` prompts as token ids, BOS then `short` - 1 or `long` - 1 bytes of `source` (short first,
    alternating), each from its own offset: what both servers are sent, request i taking prompt
    i % size."""
    if len(source) < long:
        raise ValueError(f"the prompt source has {len(source)} bytes, fewer than a long prompt's {long}")
    prompts = []
    for i in range(size):
        length = short if i % 2 == 0 else long
        offset = (i * 7919) % (len(source) - long + 1)
        prompts.append([bos, *source[offset:offset + length - 1]])
    return prompts


def client_requests(client: int, concurrency: int, mix: list[list[int]]):
    """The prompts client `client` of `concurrency` sends, in order: requests client, client + C, ..."""
    i = client
    while True:
        yield mix[i % len(mix)]
        i += concurrency


class LatentloopEndpoint(Server):
    """`latentloop serve` as the against-mode's load sees it: token-id prompts on /v1/completions."""

    name = "latentloop"
    path = "/v1/completions"

    def __init__(self, run: Path, decode: str, log: Path, threads: int, kv_dtype: str | None = None):
        super().__init__(run, "continuous", BATCHED_ROWS, decode, log, threads, kv_dtype)

    def body(self, ids: list[int], new_tokens: int, tokens: bool = False) -> dict:
        body = {"prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        return {**body, "logprobs": 0} if tokens else body

    @staticmethod
    def generated(reply: dict) -> int:
        return reply["usage"]["completion_tokens"]

    @staticmethod
    def prompt_tokens(reply: dict) -> int:
        return reply["usage"]["prompt_tokens"]

    def step_counts(self) -> tuple[int, int]:
        """(decode steps, rows over those steps) so far: their difference over a cell gives rows per step."""
        stats = self.stats()
        return stats["steps"], stats["row_steps"]

    def announced(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if line.startswith("latentloop:")]


class LlamaServer:
    """llama.cpp's `llama-server` on the GGUF file: `slots` slots of `context` tokens each,
    continuous batching on, no prompt cache, `threads` threads for decode and prompt alike."""

    name = "llama.cpp"
    path = "/completion"

    def __init__(self, binary: Path, gguf: Path, context: int, slots: int, threads: int, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = ["-np", str(slots), "--cont-batching", "-c", str(context * slots), "-t", str(threads),
                      "-tb", str(threads), "--cache-ram", "0", "--no-webui"]
        self.command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), *self.flags]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.log = log

    wait_ready = Server.wait_ready  # GET /health: 503 while loading, 200 once it serves
    stop = Server.stop

    def body(self, ids: list[int], new_tokens: int, tokens: bool = False) -> dict:
        body = {"prompt": ids, "n_predict": new_tokens, "temperature": 0, "cache_prompt": False, "ignore_eos": True}
        return {**body, "return_tokens": True} if tokens else body

    @staticmethod
    def generated(reply: dict) -> int:
        return reply["tokens_predicted"]

    @staticmethod
    def prompt_tokens(reply: dict) -> int:
        return reply["tokens_evaluated"]

    @staticmethod
    def step_counts() -> None:  # llama-server does not count its batches' rows
        return None

    def drain(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            slots = httpx.get(self.url + "/slots", timeout=DRAIN_TIMEOUT_S).json()
            if not any(slot.get("is_processing") for slot in slots):
                return
            time.sleep(POLL_S)


def reply_tokens(server, reply: dict, ids_of: dict[str, int]) -> list[int]:
    """A spot-check reply's generated token ids: llama.cpp's `tokens` (return_tokens), latentloop's
    logprobs token strings mapped back through `ids_of` (token string -> id)."""
    if isinstance(server, LlamaServer):
        return list(reply["tokens"])
    return [ids_of[t] for t in reply["choices"][0]["logprobs"]["tokens"]]


def token_ids_by_string(tokenizer, vocab_size: int) -> dict[str, int]:
    """How latentloop's logprobs name each id (`token_string`), inverted (the first id of a string)."""
    from latentloop.serve.protocol import special_names, token_string

    specials = special_names(tokenizer)
    ids: dict[str, int] = {}
    for token_id in range(vocab_size):
        ids.setdefault(token_string(tokenizer, token_id, specials), token_id)
    return ids


def spot_check(servers: list, mix: list[list[int]], new_tokens: int, ids_of: dict[str, int]) -> list[dict]:
    """The first SPOT_CHECKS prompts of the mix, one at a time to each server, greedy: per prompt its
    length, each server's prompt tokens, generated count and tokens, the tokens agreeing from the
    start, and how many distinct ids latentloop's hold (a trained model's greedy tokens may repeat one)."""
    from benchmarks.engines import agreement

    checks = []
    for ids in mix[:SPOT_CHECKS]:
        got = {}
        for server in servers:
            reply = httpx.post(server.url + server.path, json=server.body(ids, new_tokens, tokens=True),
                               timeout=START_TIMEOUT_S)
            reply.raise_for_status()
            got[server.name] = (server.prompt_tokens(reply.json()), reply_tokens(server, reply.json(), ids_of))
        (prompt_a, a), (prompt_b, b) = got.values()
        checks.append({"prompt": len(ids), "prompt_tokens": [prompt_a, prompt_b], "generated": [len(a), len(b)],
                       "agree": agreement(a, b), "equal": a == b, "distinct": len(set(a)), "tokens": [a, b]})
    return checks


async def load_mix(server, concurrency: int, seconds: float, mix: list[list[int]], new_tokens: int,
                   tail: float = TAIL_S) -> dict:
    """One cell: `concurrency` clients send the mix's prompts back to back for `seconds`, then the
    requests in flight run to their end, for at most `tail` seconds more (those still running then
    are abandoned and counted). Returns the raw figures: latencies, generated tokens, failures."""
    latencies: list[float] = []
    generated: list[int] = []
    prompts: list[int] = []  # each completed request's prompt length
    finished: list[float] = []
    failed = 0
    start = time.perf_counter()
    stop_sending = start + seconds
    async with httpx.AsyncClient(base_url=server.url, timeout=None,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker(k: int) -> None:
            nonlocal failed
            for ids in client_requests(k, concurrency, mix):
                if time.perf_counter() >= stop_sending:
                    return
                sent = time.perf_counter()
                reply = await client.post(server.path, json=server.body(ids, new_tokens))
                if reply.status_code != 200:
                    failed += 1
                    continue
                done = time.perf_counter()
                latencies.append(done - sent)
                finished.append(done)
                generated.append(server.generated(reply.json()))
                prompts.append(len(ids))

        tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        _, running = await asyncio.wait(tasks, timeout=seconds + tail)
        for task in running:  # past the tail: abandoned (closing the connection frees its slot)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = (max(finished) if finished and not running else time.perf_counter()) - start
    return {"latencies": latencies, "generated": generated, "prompts": prompts, "failed": failed,
            "abandoned": len(running), "wall": wall}


def summarize_cell(raw: dict, new_tokens: int) -> dict:
    """A cell's figures from `load_mix`'s raw ones: requests, req/s, tokens/s, p50 / p99 latency (s),
    "short": completed requests that generated fewer than `new_tokens` (a stop token), and the p50
    latency of the requests with the shortest and with the longest prompt apart ("p50 short prompt",
    "p50 long prompt"; with concurrency 1 they tell prefill from decode)."""
    latencies, wall = raw["latencies"], raw["wall"]
    nan = float("nan")
    lengths = raw.get("prompts", [])
    by_kind = {f"p50 {kind} prompt": statistics.median(t for t, n in zip(latencies, lengths) if n == length)
               if lengths else nan for kind, length in (("short", min(lengths, default=0)),
                                                        ("long", max(lengths, default=0)))}
    return {**by_kind, "requests": len(latencies), "failed": raw["failed"], "abandoned": raw["abandoned"],
            "short": sum(1 for g in raw["generated"] if g < new_tokens), "wall": wall,
            "req/s": len(latencies) / wall if wall > 0 else nan, "tokens/s": sum(raw["generated"]) / wall
            if wall > 0 else nan, "p50": statistics.median(latencies) if latencies else nan,
            "p99": percentile(latencies, 0.99) if latencies else nan}


def against_summary(measured: dict, names: tuple[str, str]) -> tuple[list[list], list[list], dict]:
    """The tables and the ratios from `measured`: (concurrency, server name) -> the cells of the
    repeats in order. Ratios are the first name's over the second's, repeat by repeat, for req/s,
    p50 and p99: mean and 95% t-interval over the repeats (`paired_comparison`)."""
    from latentloop.eval.stats import format_comparison, paired_comparison

    ours, theirs = names
    table = [["concurrency", "server", "requests (fewest in a cell)", "failed", "short", "req/s", "tokens/s",
              "p50 latency s", "p99 latency s", "p50 s, short prompt", "p50 s, long prompt", "rows per step"]]
    concurrencies = sorted({c for c, _ in measured})
    for c in concurrencies:
        for name in names:
            cells = measured[c, name]
            fewest = min(r["requests"] for r in cells)
            # a cell's p99 is its slowest request below P99_SAMPLES requests: said so in the table
            requests = f"{sum(r['requests'] for r in cells)} ({fewest}" + (
                ": p99 is a cell's slowest)" if fewest < P99_SAMPLES else ")")
            table.append([c, name, requests, sum(r["failed"] + r["abandoned"] for r in cells),
                          sum(r["short"] for r in cells),
                          *(cell_spread([r[key] for r in cells], digits) for key, digits in
                            (("req/s", 2), ("tokens/s", 0), ("p50", 2), ("p99", 2))),
                          *(cell_spread([r.get(f"p50 {kind} prompt", float("nan")) for r in cells], 2)
                            for kind in ("short", "long")),
                          cell_spread([r.get("rows per step", float("nan")) for r in cells], 1)])
    ratio_table = [["concurrency", f"req/s {ours} / {theirs}", "p50 ratio", "p99 ratio", "the same work"]]
    ratios: dict[str, dict] = {}
    for c in concurrencies:
        a, b = measured[c, ours], measured[c, theirs]
        ratios[str(c)] = {key: paired_comparison(dict(enumerate(r[key] for r in a)),
                                                 dict(enumerate(r[key] for r in b)), kind="log_ratio")
                          for key in ("req/s", "p50", "p99")}
        # both servers are asked to ignore their end tokens (`ignore_eos`): a cell where any request still
        # stopped short (a server that ignores the field) compares unequal work, and says so
        short = {name: sum(r["short"] for r in measured[c, name]) for name in names}
        ratios[str(c)]["stopped_short"] = short
        same = "yes" if not any(short.values()) else "no: " + ", ".join(
            f"{count} of {name}'s requests stopped short" for name, count in short.items() if count)
        ratio_table.append([c, *(format_comparison(ratios[str(c)][key], 3) for key in ("req/s", "p50", "p99")), same])
    return table, ratio_table, ratios


def llama_server_version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({error})"
    return " ".join((out.stdout + out.stderr).split())[:200]


def with_byte_vocabulary(source: Path, out: Path, tokenizer, vocab_size: int) -> None:
    """`source` (a GGUF file of `write_gguf`: the "none" vocabulary) copied to `out` with the byte
    tokenizer's vocabulary as a SentencePiece-style one: ids 0-255 the byte tokens <0x00>..<0xFF>,
    BOS / EOS / PAD control tokens, any id past them unused. llama-server turns every generated id
    into text (`token_to_piece`), which the "none" vocabulary cannot do: it aborts on the first token.
    Prompts are still sent as ids; no BOS is added to them (`add_bos_token` false)."""
    import gguf

    from latentloop.serve.protocol import special_names

    if not isinstance(tokenizer, ByteTokenizer):
        raise SystemExit("serve_load: --against llama.cpp serves runs of the byte tokenizer only (llama-server "
                         "gets its vocabulary from it)")
    specials = special_names(tokenizer)
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():  # the model's keys as they were; the tokenizer's replaced
        if name.startswith(("GGUF.", "tokenizer.")) or name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    kinds = gguf.TokenType
    tokens = [specials[i] if i in specials else f"<0x{i:02X}>" if i < 256 else f"<unused{i}>"
              for i in range(vocab_size)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types([kinds.CONTROL if i in specials else kinds.BYTE if i < 256 else kinds.UNUSED
                            for i in range(vocab_size)])
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_pad_token_id(tokenizer.pad_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_model(run: Path | None, folder: Path) -> tuple[Path, Path]:
    """(the run folder served by latentloop, the GGUF file of the same weights for llama.cpp): `run`
    (or a random-init gpt of engines' small shape) exported with `export --plain`, written as fp32
    GGUF by `benchmarks.engines.write_gguf`, then given the byte vocabulary (`with_byte_vocabulary`)."""
    from benchmarks.engines import SHAPES, build_export, write_gguf
    from latentloop.interop import export_hf

    if run is None:
        build_export(SHAPES["small"], 512, 0, folder)
        run, hf = folder / "run", folder / "hf"
    else:
        hf = folder / "hf"
        export_hf(run, hf, plain=True)
    plain, gguf = folder / "model-f32-no-vocab.gguf", folder / "model-f32.gguf"
    write_gguf(hf, plain)
    _, tokenizer = ll.load(run)
    with_byte_vocabulary(plain, gguf, tokenizer, json.loads((hf / "config.json").read_text())["vocab_size"])
    plain.unlink()
    return run, gguf


def against_llama_cpp(args: argparse.Namespace, binary: Path) -> int:
    """`--against llama.cpp`: see the module's docstring."""
    began = time.monotonic()
    threads = args.threads or os.cpu_count() or 1
    meter = ContentionMeter().start()
    print(f"torch {torch.__version__}, {threads} threads for each server, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    print(f"llama-server: {binary} ({llama_server_version(binary)})", flush=True)
    servers: list = []
    results: dict = {**invocation(args, "benchmarks.serve_load"), "llama_server": str(binary), "threads": threads}
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        folder = Path(tmp)
        try:
            run, gguf = export_model(args.run, folder)
            model, tokenizer = ll.load(run)
            context = int(model.config.sequence_len)
            if args.long + args.new_tokens > context:
                raise SystemExit(f"serve_load: a long prompt ({args.long}) + --new-tokens ({args.new_tokens}) is "
                                 f"more than the model's context ({context}); lower --long")
            ids_of = token_ids_by_string(tokenizer, int(model.config.vocab_size))
            mix = request_mix(tokenizer.bos_id, prompt_source(), args.short, args.long)
            del model
            latentloop = LatentloopEndpoint(run, args.decode, folder / "latentloop.log", threads, args.kv_dtype)
            servers.append(latentloop)
            llama = LlamaServer(binary, gguf, context, BATCHED_ROWS, threads, folder / "llama.log")
            servers.append(llama)
            for server in servers:
                server.wait_ready(time.monotonic() + START_TIMEOUT_S)
            results["llama_server_command"] = llama.flags
            results["latentloop_announced"] = latentloop.announced()
            print(f"servers ready after {time.monotonic() - began:.0f} s; llama-server flags: {' '.join(llama.flags)}")
            for line in latentloop.announced():
                print(line)
            checks = spot_check(servers, mix, args.new_tokens, ids_of)
            results["spot_checks"] = checks
            for check in checks:
                print(f"spot check, prompt of {check['prompt']} tokens: prompt tokens read {check['prompt_tokens']}, "
                      f"generated {check['generated']} (latentloop, llama.cpp), greedy tokens agreeing "
                      f"{check['agree']}/{min(check['generated'])} ({check['distinct']} distinct ids)", flush=True)
            cells = len(args.concurrency) * len(servers) * args.repeats
            seconds = args.budget / cells
            if seconds < MIN_CELL_S:
                raise SystemExit(f"the budget leaves {seconds:.1f} s per cell; raise --budget or measure fewer cells")
            print(f"{cells} cells of {seconds:.1f} s (+ their requests in flight, at most {TAIL_S:.0f} s)", flush=True)
            measured: dict[tuple[int, str], list[dict]] = {(c, s.name): [] for c in args.concurrency for s in servers}
            for repeat in range(args.repeats):
                order = servers if repeat % 2 == 0 else servers[::-1]  # A, B, then B, A: neither always first
                for c in args.concurrency:
                    for server in order:
                        time.sleep(SETTLE_S)
                        before = server.step_counts()
                        cell = summarize_cell(asyncio.run(load_mix(server, c, seconds, mix, args.new_tokens)),
                                              args.new_tokens)
                        server.drain()
                        if before is not None:  # latentloop: the mean rows a decode step ran
                            steps, rows = (after - first for after, first in zip(server.step_counts(), before))
                            cell["rows per step"] = rows / steps if steps else 0.0
                        measured[c, server.name].append(cell)
                        print(repeat, server.name, c, " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                               for k, v in cell.items()), flush=True)
        finally:
            for server in servers:
                server.stop()
    table, ratio_table, ratios = against_summary(measured, (LatentloopEndpoint.name, LlamaServer.name))
    others = meter.stop()
    results.update(cells={f"{c} {name}": cells for (c, name), cells in measured.items()}, ratios=ratios,
                   wall_s=time.monotonic() - began, others_cpu_share=others)
    print()
    print(render_table(table))
    print("\nlatentloop over llama.cpp, paired by repeat: geometric mean [95% t-interval on the logs] (req/s above 1 "
          "and latency below 1: latentloop ahead)")
    print(render_table(ratio_table))
    print(f"\ntotal {time.monotonic() - began:.0f} s; load average {os.getloadavg()[0]:.1f} at the end; other "
          f"processes used {'?' if others is None else f'{others:.0%}'} of the CPUs (client and servers share them)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=None, help=f"without --against: the models' presets, from "
                   f"{', '.join(PRESETS)} (default: {' '.join(DEFAULT_PRESETS)})")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the cells, once the servers are ready (default {DEFAULT_BUDGET_S:.0f}; "
                        f"{AGAINST_BUDGET_S:.0f} with --against)")
    p.add_argument("--batching", nargs="+", choices=list(MODES), default=None,
                   help=f"without --against: the modes to compare (default: {' '.join(DEFAULT_BATCHING)}; "
                        "unbatched: --max-batch-size 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="every server's --threads (default: torch's choice, one per core)")
    p.add_argument("--repeats", type=int, default=None,
                   help="measure every cell this many times, the cells in a new order each time (the budget is "
                        "shared by all); the table gives each cell's median and, with 2 or more, its range "
                        f"(default 1; with --against {AGAINST_REPEATS}, at least 2)")
    p.add_argument("--varied-lengths", action="store_true", default=None,
                   help=f"without --against: max_tokens cycles through {VARIED_TOKENS} instead of {NEW_TOKENS} "
                        "for every request")
    p.add_argument("--against", choices=AGAINST, default=None,
                   help="compare latentloop serve with llama.cpp's llama-server instead of batching modes "
                        "(see the module's docstring)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help=f"with --against: the llama-server binary (default: env {LLAMA_SERVER_ENV}; "
                        "benchmarks/build_llama_server.sh builds one)")
    p.add_argument("--run", type=Path, default=None,
                   help="with --against: the run to serve (a Llama-compatible gpt; default: a random-init one)")
    p.add_argument("--decode", choices=("auto", "eager", "compiled"), default=None,
                   help="with --against: latentloop serve's --decode (default auto, the server's own default)")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                   help="with --against: latentloop serve's --kv-dtype (float16: llama-server's default cache "
                        "type; its compiled steps compile at the server's start with --decode compiled)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"with --against: tokens generated per request (default {AGAINST_NEW_TOKENS})")
    p.add_argument("--short", type=int, default=None,
                   help=f"with --against: a short prompt's tokens (default {SHORT_PROMPT})")
    p.add_argument("--long", type=int, default=None,
                   help=f"with --against: a long prompt's tokens (default {LONG_PROMPT})")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="with --against: also write the results")
    args = p.parse_args(argv)
    # each mode's own flags (None when not given), refused in the other mode, where nothing reads them
    wrong = AGAINST_ONLY if args.against is None else BATCHING_ONLY
    given = [flag for flag, name in wrong.items() if getattr(args, name) is not None]
    if given:
        p.error(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} "
                + ("with --against llama.cpp" if args.against is None else "without --against"))
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    unknown = [preset for preset in args.presets if preset not in PRESETS]
    if unknown:
        p.error(f"--presets: unknown {unknown[0]!r}; choose from {', '.join(PRESETS)}")
    if max(args.concurrency) > BATCHED_ROWS or min(args.concurrency) < 1:
        p.error(f"concurrency must be in [1, {BATCHED_ROWS}]")
    if args.repeats is None:
        args.repeats = AGAINST_REPEATS if args.against else 1
    if args.repeats < 1 or (args.threads is not None and args.threads < 1):
        p.error("--repeats and --threads must be >= 1")
    if args.against and args.repeats < 2:  # its figures are paired ratios with an interval, which one repeat lacks
        p.error("--against compares latentloop with llama.cpp by paired repeats: give --repeats 2 or more")
    if min(args.new_tokens, args.short) < 1 or args.long < args.short:
        p.error("--new-tokens and --short must be >= 1, and --long >= --short")
    if args.budget is None:
        args.budget = AGAINST_BUDGET_S if args.against else DEFAULT_BUDGET_S
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.against == "llama.cpp":
        try:
            binary = find_llama_server(args.llama_server)
        except SystemExit as error:
            print(error, file=sys.stderr)
            return 2
        return against_llama_cpp(args, binary)
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
