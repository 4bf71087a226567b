"""What a user waits for before the first token (issue 26): `latentloop generate RUN` as a whole
process, timed from its start to the first generated text on its stdout and to its exit, under
each `--decode` mode, with the compile cache cold (a fresh `LATENTLOOP_CACHE`) and warm (the same
folder, a second and third process).

The run is a random-init gpt saved as a run folder (the time does not depend on the weights) of
the shape of `benchmarks.engines` (`--shape small`: 4 layers x 256, or `large`). Each process
generates `--new-tokens` greedy tokens after a short prompt; its first output chunk after the
echoed prompt marks the first token (a byte model's first bytes may wait for a whole UTF-8
character: a few steps, milliseconds). The order is fixed: cold first, then warm; the median of
the warm processes is reported beside each one's range.

    .venv/bin/python -m benchmarks.first_token [--shape small] [--new-tokens 200] [--warm 2]
        [--modes compiled,auto,eager] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import benchmark_main, render_table, require_at_least_one, spread, start_run
from benchmarks.engines import SHAPES

MODES = ("compiled", "auto", "eager")  # --decode
PROMPT = "def main():\n"
PROCESS_TIMEOUT_S = 600  # a cold compile under load took 81-222 s (issue 26); this bounds a hung one
REPO = Path(__file__).resolve().parents[1]


def save_random_run(shape: dict, context: int, folder: Path) -> Path:
    import torch

    import latentloop
    from latentloop.data.tokenizers import ByteTokenizer
    from latentloop.runs import save_run

    tokenizer = ByteTokenizer()
    torch.manual_seed(0)
    model = latentloop.build("gpt", preset=None, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id,
                             sequence_len=context, **shape)
    save_run(model, tokenizer, folder / "run")
    return folder / "run"


def time_process(run: Path, mode: str, new_tokens: int, cache: Path, threads: int) -> dict[str, float]:
    """One `latentloop generate` process: seconds to its first generated text and to its exit."""
    command = [sys.executable, "-m", "latentloop", "generate", str(run), "--prompt", PROMPT, "--max-new-tokens",
               str(new_tokens), "--temperature", "0", "--decode", mode, "--device", "cpu"]
    env = {**os.environ, "LATENTLOOP_CACHE": str(cache), "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the cache under LATENTLOOP_CACHE, cold or warm as chosen
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    first: list[float] = []
    echoed = len(PROMPT.encode())
    errors: list[bytes] = []

    def read_stdout() -> None:
        seen = 0
        while chunk := proc.stdout.read1(4096):
            seen += len(chunk)
            if seen > echoed and not first:
                first.append(time.perf_counter() - started)

    def read_stderr() -> None:
        errors.append(proc.stderr.read())

    readers = [threading.Thread(target=read_stdout), threading.Thread(target=read_stderr)]
    for reader in readers:
        reader.start()
    try:
        proc.wait(PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SystemExit(f"latentloop generate --decode {mode} did not end within {PROCESS_TIMEOUT_S} s") from None
    for reader in readers:
        reader.join()
    total = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"latentloop generate --decode {mode} failed ({proc.returncode}): "
                         f"{b''.join(errors).decode(errors='replace')[-2000:]}")
    return {"first_token_s": first[0] if first else total, "process_s": total}


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = start_run(argparse.Namespace(threads=args.threads))
    results: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()}, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        run_dir = save_random_run(SHAPES[args.shape], args.prompt_len + args.new_tokens, folder)
        for mode in args.modes:
            cache = folder / f"cache-{mode}"  # each mode starts cold: its own fresh cache folder
            print(f"--decode {mode}: a cold process, then {args.warm} warm ...", file=sys.stderr, flush=True)
            cold = time_process(run_dir, mode, args.new_tokens, cache, args.threads)
            warm = [time_process(run_dir, mode, args.new_tokens, cache, args.threads) for _ in range(args.warm)]
            results["modes"][mode] = {"cold": cold, "warm": warm}
    return results


def markdown_table(results: dict[str, Any]) -> str:
    args = results["args"]
    rows = [(f"--decode ({args['shape']}, {args['new_tokens']} new tokens, {args['threads']} thread(s))",
             "cold cache: first token s", "process s", "warm (median [range]): first token s", "process s")]
    for mode, entry in results["modes"].items():
        warm_first = [w["first_token_s"] for w in entry["warm"]]
        warm_total = [w["process_s"] for w in entry["warm"]]
        rows.append((mode, f"{entry['cold']['first_token_s']:.2f}", f"{entry['cold']['process_s']:.2f}",
                     spread(warm_first, "{:.2f}") if warm_first else "—",
                     spread(warm_total, "{:.2f}") if warm_total else "—"))
    return render_table(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="small")
    p.add_argument("--prompt-len", type=int, default=16, help="context reserved for the prompt")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--warm", type=int, default=2, help="warm processes after the cold one, per mode")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from: {', '.join(MODES)}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode {unknown[0]!r}; choose from: {', '.join(MODES)}")
    require_at_least_one(p, args, ("prompt_len", "new_tokens", "threads"))
    if args.prompt_len < len(PROMPT.encode()) + 1:  # the byte tokenizer's tokens, and BOS: it failed in the child
        p.error(f"--prompt-len must be >= {len(PROMPT.encode()) + 1}: the prompt {PROMPT!r} is that many tokens "
                f"with BOS")
    if args.warm < 0:
        p.error("--warm must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(parse_args(argv), run, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
