"""Kill `latentloop train` with SIGKILL while it writes checkpoints, then check that nothing was lost.

    python benchmarks/kill_trials.py [--trials 24] [--steps 8] [--seed 0] [--keep DIR]

A reference run trains uninterrupted (test preset, save_every=1, keep_last=1). Each trial then
starts the same run in a fresh folder and kills it, in turn:

- `write`:  as soon as checkpoint N (random, 2..steps) is being written (`.tmp-step_N` appears);
- `resave`: while a copy of the finished reference run is resumed, which re-saves its last step:
            in turn as soon as the old copy is set aside (`.old-step_N`) or the new one is being
            written (`.tmp-step_N`);
- `random`: a random 0-50 ms after checkpoint N (random, 1..steps-1) is in place: anywhere in the
            training step, logging or the next save.

After every kill the script checks that the latest checkpoint loads (`load_run` and the trainer
state), resumes the run to the end (`train --resume`), and compares the final weights and the logged
per-step losses with the reference bit for bit. It prints a tally and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from latentloop.checkpoint import read_trainer_state, resolve_checkpoint  # noqa: E402
from latentloop.runs import load_run  # noqa: E402

MODES = ("write", "resave", "random")
POLL_SECONDS = 0.0005  # how often the checkpoint folder is listed while waiting for a write to start
RANDOM_DELAY_SECONDS = 0.05  # `random` kills this long at most after a checkpoint appears (a few steps here)
WAIT_LIMIT_SECONDS = 120  # a trial whose moment never comes (the run finished first) gives up here
WORDS = "the quick brown fox jumps over the lazy dog while latent state loops forward".split()


def write_corpus(folder: Path) -> Path:
    """The same kind of small corpus the tests use: 40 documents of 200 words."""
    folder.mkdir(parents=True)
    for i in range(40):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(200)) + f"\nstory {i}\n"
        (folder / f"doc{i:02d}.txt").write_text(text)
    return folder


def train_command(corpus: Path, out: Path, steps: int, resume: bool = False) -> list[str]:
    command = [sys.executable, "-m", "latentloop.cli", "train", "--out", str(out), "--no-progress"]
    if resume:
        return command + ["--resume"]
    overrides = {"batch_size": 4, "sequence_len": 32, "save_every": 1, "keep_last": 1, "log_every": 1,
                 "eval_every": 0, "eval_batches": 1, "warmup_steps": 2}
    command += ["--preset", "test", "--data", f"text:{corpus}", "--steps", str(steps), "--device", "cpu"]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    return command


def run_to_end(command: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def listing(run: Path) -> list[str]:
    try:
        return sorted(os.listdir(run / "checkpoints"))
    except OSError:
        return []


def wait_for(proc: subprocess.Popen, run: Path, ready, pause: float = POLL_SECONDS) -> bool:
    """Poll the checkpoint folder until `ready(names)`; False when the process ended first."""
    deadline = time.monotonic() + WAIT_LIMIT_SECONDS
    while proc.poll() is None and time.monotonic() < deadline:
        if ready(listing(run)):
            return True
        if pause:
            time.sleep(pause)
    return False


def loss_rows(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(resolve_checkpoint(run) / "model.safetensors"))


def trial(mode: str, index: int, work: Path, corpus: Path, reference: Path, steps: int, env: dict,
          rng: random.Random) -> dict:
    run = work / f"trial{index:02d}-{mode}"
    if mode == "resave":
        shutil.copytree(reference, run)
        proc = subprocess.Popen(train_command(corpus, run, steps, resume=True), env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        prefix = (".old-", ".tmp-")[index // len(MODES) % 2]  # in turn: while set aside, while written
        # the old copy is aside only between two renames: poll without pausing to catch it
        moment = wait_for(proc, run, lambda names: any(n.startswith(prefix) for n in names), pause=0)
    else:
        proc = subprocess.Popen(train_command(corpus, run, steps), env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if mode == "write":
            target = f".tmp-step_{rng.randint(2, steps):08d}"
            moment = wait_for(proc, run, lambda names: target in names)
        else:
            target = f"step_{rng.randint(1, steps - 1):08d}"
            moment = wait_for(proc, run, lambda names: target in names)
            time.sleep(rng.uniform(0, RANDOM_DELAY_SECONDS))
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    on_disk = listing(run)
    result = {"mode": mode, "killed": killed, "moment_seen": moment, "on_disk_after_kill": on_disk}
    if not killed:
        result["outcome"] = "finished before the kill"
        return result
    try:
        checkpoint = resolve_checkpoint(run)
        load_run(run)
        read_trainer_state(checkpoint)
        result["latest_loads"] = checkpoint.name
    except Exception as exc:  # any failure here is what the trial is looking for
        result.update(outcome="latest checkpoint does not load", error=f"{type(exc).__name__}: {exc}")
        return result
    resumed = run_to_end(train_command(corpus, run, steps, resume=True), env)
    if resumed.returncode != 0:
        result.update(outcome="resume failed", error=resumed.stderr.strip().splitlines()[-1:])
        return result
    ours, theirs = final_weights(run), final_weights(reference)
    same_weights = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    same_losses = loss_rows(run) == loss_rows(reference)
    result["outcome"] = "bit-identical" if same_weights and same_losses else (
        f"differs (weights {'same' if same_weights else 'differ'}, losses {'same' if same_losses else 'differ'})")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=24, help="kills to attempt (cycling through the modes)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of each run (at least 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random kill moments")
    parser.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write every trial's result to this file")
    args = parser.parse_args(argv)

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kill-trials-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LATENTLOOP_CACHE": str(work / "cache"), "PYTHONPATH": str(ROOT)}
    corpus = write_corpus(work / "corpus")
    reference = work / "reference"
    start = time.monotonic()
    done = run_to_end(train_command(corpus, reference, args.steps), env)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    print(f"reference: {args.steps} steps in {time.monotonic() - start:.1f} s", flush=True)

    rng = random.Random(args.seed)
    results = []
    for i in range(args.trials):
        mode = MODES[i % len(MODES)]
        result = trial(mode, i, work, corpus, reference, args.steps, env, rng)
        results.append(result)
        print(f"trial {i:2d} {mode:6s} killed={result['killed']!s:5s} on disk {result['on_disk_after_kill']} -> "
              f"{result['outcome']}{' ' + str(result.get('error')) if result.get('error') else ''}", flush=True)

    tally = collections.Counter((r["mode"], r["outcome"]) for r in results)
    kills = sum(r["killed"] for r in results)
    def left(prefixes):
        return sum(r["killed"] and any(n.startswith(prefixes) for n in r["on_disk_after_kill"]) for r in results)

    print(f"\n{kills} kills in {args.trials} trials: {left(('.tmp-', '.old-'))} left a checkpoint mid-write "
          f"(.tmp-/.old-), {left(('.del-',))} one mid-rotation (.del-):")
    for (mode, outcome), count in sorted(tally.items()):
        print(f"  {mode:6s} {outcome}: {count}")
    failures = [r for r in results if r["killed"] and r["outcome"] != "bit-identical"]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
