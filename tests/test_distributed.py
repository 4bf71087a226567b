"""Training on several processes (CPU, gloo, localhost): DDP and FSDP2 equal one process with as
much gradient accumulation, sharded checkpoints resume exactly and export to the single-file
format, every random draw agrees across ranks, and an error on one rank ends the job.

Processes are started with `torch.multiprocessing` (what torchrun's workers do, without its
agent), forked from the tests' fork server, or with torchrun itself for the command line; every
start is bounded in time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import dist_workers
import pytest
import torch
import torch.multiprocessing as mp
from conftest import fork_context, write_corpus
from safetensors.torch import load_file

import latentloop as ll
from latentloop.archs import ARCHS as REGISTERED
from latentloop.checkpoint import list_checkpoints
from latentloop.cli import main
from latentloop.errors import CheckpointError
from latentloop.train import fit, setup, validate

ARCHS = list(REGISTERED)  # every registered architecture: a new one is checked here too
# and gpt accumulating 2 micro-batches per process: the gradients synchronise on the second only
CASES = [*ARCHS, dist_workers.ACCUMULATING, dist_workers.MUON]
WORLD = 2
SPAWN_TIMEOUT_S = 150  # a hung collective fails the test instead of the suite
TORCHRUN_TIMEOUT_S = 120
# DDP averages the two processes' gradients where one process sums two halves of accumulation:
# the same numbers added in another order, so fp32 rounding (~1e-7 relative) is the only difference,
# amplified a little by Adam's division by small second moments over 3 steps.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
# Weights, per tensor: the root mean square of the difference within WEIGHT_TOL (atol + rtol x the RMS
# of the weights), and no element off by more than WEIGHT_MAX_ABS. Adam divides each element's step by
# its gradient's size, so an element whose gradient is a near-cancelling sum (a different summation
# order changes it relatively much) moves differently by up to ~lr per step: fsdp2's reduce-scatter
# leaves a few such elements of Mixture-of-Recursions 4e-5 to 8e-5 off (measured; the other archs
# ~1e-6, DDP 0), while a gradient lost or counted twice moves whole tensors.
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)
WEIGHT_MAX_ABS = 1e-3

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="this torch build has no gloo backend")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(fn, *args, nprocs: int = WORLD):
    """`fn(rank, nprocs, port, *args)` in `nprocs` new processes (not waited for), forked from the
    tests' fork server (conftest.fork_context: torch imported once, not once per process)."""
    fork_context()  # the fork server torch.multiprocessing's "forkserver" start uses, with its preload set
    return mp.start_processes(fn, args=(nprocs, _free_port(), *args), nprocs=nprocs, join=False,
                              start_method="forkserver")


def _join(context, timeout: float = SPAWN_TIMEOUT_S) -> None:
    """Wait for `_start`'s processes; a failure in one re-raises its traceback, and a run that
    outlives `timeout` (a hung collective) is killed and fails the test."""
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.5, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {len(context.processes)} processes did not finish within {timeout} s")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """This process's one-process references run while the spawned processes work: at this size a
    second thread buys nothing, and on busy cores OpenMP threads that wait for each other cost seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _final_weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(checkpoint) / "model.safetensors"))


def _reference(case: str, corpus: Path, run: Path) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
    """One process, WORLD times the gradient accumulation: the run the data-parallel processes must equal."""
    arch, grad_accum = dist_workers.case_arch(case)
    state = setup(dist_workers.run_config(arch, corpus, "none", grad_accum=grad_accum * WORLD,
                                          **dist_workers.case_train(case)), run, progress=False)
    summary = fit(state, progress=False)
    val = validate(state, dist_workers.VAL_BATCHES)
    assert val["tokens"] == dist_workers.VAL_BATCHES * 2 * 32  # every batch counted (batch 2, sequence 32)
    return ([row["loss"] for row in state.history if "loss" in row], _final_weights(summary["checkpoint"]),
            dist_workers.training_rows(state.history), val)


def _assert_same_run(result: dict, reference: tuple, arch: str) -> None:
    """Losses and final weights as one process's; and, where the reference has them, every logged
    training number (the objective's metrics: fbt's `objective`, rgpt's gates, MoR's router loss
    were one micro-batch's on rank 0 alone) and the validation figures after the run (its batches
    shared out among the processes: every batch counted once)."""
    losses, weights, *rows = reference
    if len(rows) > 1:
        rows, val = rows[:1], rows[1]
        assert result["val"]["tokens"] == val["tokens"], (arch, result["val"], val)
        torch.testing.assert_close(torch.tensor([result["val"]["loss"], result["val"]["bpb"]]),
                                   torch.tensor([val["loss"], val["bpb"]]), **LOSS_TOL,
                                   msg=lambda m: f"{arch}: validation differs: {m}")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), **LOSS_TOL,
                               msg=lambda m: f"{arch}: losses differ: {m}")
    for got, want in zip(result.get("rows", []), rows[0] if rows else [], strict=True):
        assert got.keys() == want.keys(), (arch, got.keys(), want.keys())
        torch.testing.assert_close(torch.tensor([float(v) for v in got.values()], dtype=torch.float64),
                                   torch.tensor([float(v) for v in want.values()], dtype=torch.float64), **LOSS_TOL,
                                   msg=lambda m, got=got: f"{arch}: logged {list(got)} differ: {m}")
    parallel = _final_weights(result["checkpoint"])
    assert parallel.keys() == weights.keys()
    for name in weights:
        _assert_weights_close(parallel[name], weights[name], f"{arch}: {name}")


def _assert_weights_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """The per-tensor rule of WEIGHT_TOL / WEIGHT_MAX_ABS."""
    difference = got.double() - expected.double()
    rms, scale = difference.square().mean().sqrt().item(), expected.double().square().mean().sqrt().item()
    worst = difference.abs().max().item()
    assert rms <= WEIGHT_TOL["atol"] + WEIGHT_TOL["rtol"] * scale, f"{what}: RMS difference {rms:.3g} ({scale:.3g})"
    assert worst <= WEIGHT_MAX_ABS, f"{what} differs by {worst:.3g}"


@pytest.fixture(scope="module")
def ddp_runs(corpus, tmp_path_factory) -> tuple[Path, dict, dict]:
    """The two-process DDP runs of every arch, and (computed meanwhile) their one-process references."""
    out = tmp_path_factory.mktemp("ddp")
    context = _start(dist_workers.equivalence, str(corpus), str(out), "ddp", CASES)
    references = {case: _reference(case, corpus, out / f"{case}-reference") for case in CASES}
    _join(context)
    return out, json.loads((out / "ddp.json").read_text()), references


@pytest.mark.parametrize("case", CASES)
def test_ddp_on_two_processes_equals_one_process_with_twice_the_accumulation(ddp_runs, case):
    _, results, references = ddp_runs
    _assert_same_run(results[case], references[case], case)


def _shared(draws: list[dict]) -> list[dict]:
    return [{name: value for name, value in draw.items() if name != "own"} for draw in draws]


def test_schedule_draws_agree_on_every_rank_and_data_and_noise_differ(ddp_runs):
    """What shapes a step (fbt's pass count, rgpt's depth, lrt's subsets) must be drawn alike on every
    rank, or the ranks run different graphs; each rank's batch, its training-noise stream (fbt's
    jitter, rgpt's noise) and fbt's prefixes must be its own, or the ranks repeat one another's data,
    noise and prefixes (each rank's rows drew the same prefix boundaries as the other's)."""
    _, results, _ = ddp_runs
    for arch in ARCHS:
        rank0, rank1 = results[arch]["draws"]
        assert len(rank0) == 3 and _shared(rank0) == _shared(rank1), f"{arch}: the ranks drew differently"
        for step, (a, b) in enumerate(zip(rank0, rank1)):
            assert a["own"]["batch"] != b["own"]["batch"], f"{arch} step {step}: both ranks had the same batch"
            assert a["own"]["noise"] != b["own"]["noise"], f"{arch} step {step}: both ranks share a noise stream"
    fbt, fbt_rank1 = results["fbt"]["draws"]
    assert {d["passes"] for d in fbt} == {1, 2}  # K = 1 (fusion unused) and K = 2 both ran
    fused = [(a["own"]["prefix_u"], b["own"]["prefix_u"]) for a, b in zip(fbt, fbt_rank1) if a["passes"] > 1]
    assert fused and all(len(a) == len(b) == 2 * 32 and a != b for a, b in fused)  # a boundary per row and position
    assert len({d["steps"] for d in results["rgpt"]["draws"][0]}) > 1  # the depth changed between steps
    lrt = results["lrt"]["draws"][0]
    assert all(d["columns"][1:] == [list(range(0, 32, 2)), list(range(1, 32, 2))] for d in lrt)  # S = 2 subsets


def test_a_two_process_ddp_run_resumes_exactly(ddp_runs):
    """rgpt with its training noise on: each process's own RNG stream is saved and restored."""
    out, _, _ = ddp_runs
    assert json.loads((out / "rgpt-ddp-resume.json").read_text()) == {"resumed_from": 2}
    straight = _final_weights(out / "rgpt-ddp-resume-straight")
    resumed = _final_weights(list_checkpoints(out / "rgpt-ddp-resume")[-1])
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    trainer = json.loads((out / "rgpt-ddp-resume-straight" / "trainer.json").read_text())
    ranks = trainer["state"]["rng_ranks"]
    assert len(ranks) == WORLD and ranks[0]["torch"] != ranks[1]["torch"]  # two streams, both kept


def test_a_two_process_run_logs_once_with_the_global_batch(ddp_runs):
    out, results, _ = ddp_runs
    rows = [json.loads(line) for line in (out / "gpt-ddp" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]  # rank 0 alone writes: no row twice
    assert train_rows[-1]["tokens"] == 3 * 2 * 1 * WORLD * 32  # steps x micro-batch x accumulation x world x T
    state = json.loads((Path(results["gpt"]["checkpoint"]) / "state.json").read_text())
    assert (state["world_size"], state["global_batch"], state["strategy"]) == (WORLD, 2 * WORLD, "ddp")


# lrt: its loss terms weighed by their shares of the step's targets over the processes (slow: one torchrun
# job more; the reduction is the one gpt's single share takes)
@pytest.mark.parametrize("arch", ["gpt", pytest.param("lrt", marks=pytest.mark.slow)])
def test_sft_on_two_processes_equals_one_process_with_twice_the_accumulation(corpus, tmp_path, arch):
    """The SFT stage shards its packed conversation rows by rank as pretraining shards windows:
    two processes train on exactly the rows (and masks) one process sees in two micro-batches."""
    base = tmp_path / "base"
    fit(setup(dist_workers.run_config(arch, corpus, "none", steps=1), base, progress=False), progress=False)
    context = _start(dist_workers.sft, str(base), str(tmp_path))
    reference = setup(dist_workers.sft_config(str(base), "none", grad_accum=WORLD), tmp_path / "sft-one",
                      progress=False, init_from=base)
    summary = fit(reference, progress=False)
    _join(context)
    losses = [row["loss"] for row in reference.history if "loss" in row]
    assert len(losses) == 3
    _assert_same_run(json.loads((tmp_path / "sft-ddp.json").read_text()),
                     (losses, _final_weights(summary["checkpoint"])), f"{arch} sft")


def _fsdp2_on_gloo() -> str | None:
    """Why FSDP2 cannot run here, or None."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)"
    return None


@pytest.fixture(scope="module")
def fsdp2_runs(corpus, tmp_path_factory) -> tuple[Path, dict, dict]:
    """In one two-process group: fsdp2 runs of gpt, lrt and rgpt, then an fbt run with sharded
    checkpoints (`dist_workers.sharded_checkpoints`); meanwhile their one-process references."""
    reason = _fsdp2_on_gloo()
    if reason is not None:
        pytest.skip(reason)  # the GPU benchmark (benchmarks/gpu.sh) runs fsdp2 with NCCL instead
    out = tmp_path_factory.mktemp("fsdp2")
    cases = [case for case in CASES if case != "fbt"]  # fbt: the checkpoint run below
    context = _start(dist_workers.sharded, str(corpus), str(out), cases)
    references = {case: _reference(case, corpus, out / f"{case}-reference") for case in cases}
    # fbt: K = 1, 1, 2, ... so the fusion matrices first get gradients (and optimizer state) after step 2
    config = dist_workers.run_config("fbt", corpus, "none", steps=4, grad_accum=WORLD, save_every=2, keep_last=3,
                                     seed=dist_workers.LATE_FUSION_SEED)
    fbt = _final_weights(fit(setup(config, out / "fbt-reference", progress=False), progress=False)["checkpoint"])
    _join(context)
    return out, json.loads((out / "fsdp2.json").read_text()), {**references, "fbt": fbt}


def test_fsdp2_on_two_processes_equals_one_process(fsdp2_runs):
    _, results, references = fsdp2_runs
    for arch in results:
        assert _shared(results[arch]["draws"][0]) == _shared(results[arch]["draws"][1])
        _assert_same_run(results[arch], references[arch], arch)


@pytest.mark.slow
def test_a_one_process_checkpoint_without_every_optimizer_state_resumes_under_fsdp2(corpus, tmp_path):
    """fbt saved by one process before its fusion matrices had an optimizer state (K = 1, 1), resumed
    on two processes under fsdp2: the whole-state load was strict and refused the checkpoint."""
    reason = _fsdp2_on_gloo()
    if reason is not None:
        pytest.skip(reason)
    run = tmp_path / "fbt-none"
    fit(setup(dist_workers.run_config("fbt", corpus, "none", steps=2, seed=dist_workers.LATE_FUSION_SEED), run,
              progress=False), progress=False)
    _join(_start(dist_workers.resume_under_fsdp2, str(corpus), str(run)))
    assert json.loads((tmp_path / "fbt-none.json").read_text()) == {"resumed_from": 2, "step": 4}


def test_fsdp2_keeps_only_its_shard_of_the_gradients_between_micro_batches(fsdp2_runs):
    """With gradient accumulation each micro-batch's gradients are reduce-scattered, so a process holds
    its 1/N shard of them into the next micro-batch. Skipping that sync until the last micro-batch
    kept every parameter's whole gradient on every process (none in `.grad` until then)."""
    _, results, _ = fsdp2_runs
    held = results[dist_workers.ACCUMULATING]["gradients_held"]
    later = held[1::2]  # the second micro-batch of each step: the first one's gradients are held
    assert later and all(seen["all"] for seen in later), held
    assert all(seen["local"] <= seen["full"] / WORLD * 1.05 for seen in later), held  # rows split unevenly


def test_a_sharded_checkpoint_resumes_exactly_and_exports_to_one_file(fsdp2_runs, corpus, capsys):
    out, _, references = fsdp2_runs
    run, straight = out / "fsdp2-run", out / "fsdp2-straight"
    resumed = json.loads((out / "fsdp2-resume.json").read_text())
    assert resumed["resumed_from"] == 2
    # saved at step 0 (a deadline before the first step), resumed: AdamW's first step as a run never stopped
    # takes it (its bias correction was step 2's: the zero states torch filled in to save were kept)
    step0 = resumed["step0"]
    assert len(step0["stopped"]) == len(step0["straight"]) == 3
    torch.testing.assert_close(step0["stopped"], step0["straight"], rtol=0, atol=0)

    # saved with full_weights=false: sharded only, and the loaders say how to export it
    assert (straight / "dcp").is_dir() and not (straight / "model.safetensors").exists()
    with pytest.raises(CheckpointError, match="export-dcp"):
        ll.load(straight)
    assert main(["export-dcp", str(straight)]) == 0
    written = (straight / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["export-dcp", str(straight)]) == 2  # never overwritten unless asked
    assert "exists already (pass --force" in capsys.readouterr().err
    assert (straight / "model.safetensors").stat().st_mtime_ns == written
    assert main(["export-dcp", str(straight), "--force"]) == 0
    resumed = list_checkpoints(run)[-1]  # saved with full_weights=true: gathered on rank 0
    assert (resumed / "dcp").is_dir() and (resumed / "model.safetensors").is_file()
    a, b = _final_weights(straight), _final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # resumed == uninterrupted
    for name, tensor in references["fbt"].items():  # and the sharded run == one process, twice the accumulation
        _assert_weights_close(a[name], tensor, f"fsdp2 fbt {name}")

    # the exported file loads in one process and gives the sharded model's logits
    model, _ = ll.load(straight)
    saved = load_file(str(out / "fsdp2-logits.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(model(saved["x"]).logits, saved["logits"], rtol=1e-5, atol=1e-5)

    # on another number of processes (here one, unsharded) the run continues, and says it is not exact
    capsys.readouterr()
    state = setup(dist_workers.run_config("fbt", corpus, "none", steps=6, save_every=2, keep_last=3,
                                          seed=dist_workers.LATE_FUSION_SEED), run, resume=True, progress=False)
    assert state.step == 4 and "saved by 2 process(es), resumed on 1, strategy fsdp2 -> none" in capsys.readouterr().err
    assert fit(state, progress=False)["step"] == 6


def _torchrun(args: list[str], tmp_path: Path, script: str | None = None,
              extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    here = Path(__file__).resolve().parent  # this checkout's package and the test helpers, not an installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]),
           **(extra_env or {})}
    target = [script] if script else ["-m", "latentloop"]
    # --standalone: torchrun binds a free port itself (a port found free here could be taken before it binds)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
               *target, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S, env=env, cwd=tmp_path)


def _error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if "latentloop: error:" in line]


def test_an_error_on_one_rank_ends_the_job_with_one_line(corpus, tmp_path):
    script = tmp_path / "faulty_train.py"
    script.write_text("import os, sys\nimport dist_workers\ndist_workers.plant_fault(int(os.environ['RANK']))\n"
                      "from latentloop.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    started = time.monotonic()
    result = _torchrun(["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus}", "--steps", "6",
                        "--batch-size", "2", "--set", "sequence_len=32", "--set", "train.strategy=ddp", "--set",
                        "train.eval_every=0", "--out", str(tmp_path / "run"), "--no-progress"], tmp_path, str(script))
    assert result.returncode != 0
    assert _error_lines(result) == ["latentloop: error: rank 1: shard unreadable on this node (planted by the test)"]
    workers = result.stderr.split("failed (exitcode")[0]  # what the processes printed before torchrun's report
    assert "Traceback" not in result.stdout + workers  # the other rank was stopped by torchrun, quietly
    assert "exitcode  : 2" in result.stderr  # torchrun names rank 1's exit code 2 as the root cause
    assert time.monotonic() - started < TORCHRUN_TIMEOUT_S


def test_rank_0_preparing_the_data_longer_than_the_collective_timeout_ends_no_job(corpus, tmp_path):
    """The other ranks wait out rank 0's first tokenization in `in_turns`: they waited in a collective
    of the training timeout (LATENTLOOP_DIST_TIMEOUT, 30 min by default), and a large dataset's first
    tokenization ended the job with a gloo timeout and a traceback (12-06 review). Phases wait in a
    group of their own with a long timeout now (here 2 s stands for 30 min, 5 s for the tokenization)."""
    script = tmp_path / "slow_prepare.py"
    script.write_text("import os, sys, time\nimport latentloop.train.start as start\n"
                      "prepare = start.prepare_data\n"
                      "def slow(*args, **kwargs):\n"
                      "    if os.environ['RANK'] == '0':\n        time.sleep(5)\n"
                      "    return prepare(*args, **kwargs)\n"
                      "start.prepare_data = slow\n"
                      "from latentloop.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    result = _torchrun(["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus}", "--steps", "2",
                        "--batch-size", "2", "--set", "sequence_len=32", "--set", "train.strategy=ddp",
                        "--out", str(tmp_path / "run"), "--no-progress"], tmp_path, str(script),
                       extra_env={"LATENTLOOP_DIST_TIMEOUT": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert list_checkpoints(tmp_path / "run")


def test_a_setting_every_rank_refuses_alike_is_said_once(corpus, tmp_path):
    """A muon_exclude typo is refused by every rank's optimizer build: it was printed once per rank,
    the second copy as "rank 1: ..." as if that rank alone had failed (12-06 review)."""
    result = _torchrun(["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus}", "--steps", "2",
                        "--batch-size", "2", "--set", "sequence_len=32", "--set", "train.strategy=ddp", "--set",
                        "train.muon_exclude=[nosuchparam]", "--out", str(tmp_path / "run"), "--no-progress"], tmp_path)
    assert result.returncode != 0
    lines = _error_lines(result)
    assert len(lines) == 1 and "nosuchparam" in lines[0] and "rank 1" not in lines[0], lines


def test_ctrl_c_on_a_torchrun_job_stops_every_rank_after_one_step_and_saves(corpus, tmp_path):
    """torchrun forwards a Ctrl+C (SIGINT) to every worker: the graceful stop was for one process only,
    so each worker died mid-step and a run with save_every 0 was lost whole, its folder neither
    resumable nor reusable (12-06 review). The ranks now agree on the stop at a logging step, then
    validate and save together; it is said once."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])}
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
               "-m", "latentloop", "train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus}",
               "--steps", "100000", "--batch-size", "2", "--set", "sequence_len=32", "--set", "train.strategy=ddp",
               "--set", "train.eval_every=0", "--set", "train.log_every=1", "--set", "train.eval_batches=1",
               "--out", str(run), "--no-progress"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + TORCHRUN_TIMEOUT_S
        while not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        job.send_signal(signal.SIGINT)  # as a terminal's Ctrl+C reaches torchrun
        out, err = job.communicate(timeout=TORCHRUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    saved = list_checkpoints(run)
    assert saved, err[-3000:]
    said = [line for line in err.splitlines() if "latentloop: interrupted at step" in line]
    assert len(said) == 1, err[-3000:]
    step = int(said[0].split("at step ")[1].split()[0])
    assert saved[-1].name.endswith(f"{step:08d}")


def test_an_error_before_the_processes_connect_is_printed_by_rank_0_only(corpus, tmp_path, monkeypatch, capsys):
    """torchrun starts every process with the same command line, so a config error (found before
    the process group exists) happens on all of them: rank 0 prints it, the others only exit 2."""
    argv = ["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus}", "--steps", "2",
            "--set", "train.strategy=none", "--out", str(tmp_path / "run")]  # told: one process
    printed = {}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # what torchrun sets in every process it starts
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(WORLD))
        capsys.readouterr()
        assert main(argv) == 2
        printed[rank] = capsys.readouterr().err.strip().splitlines()
    said = "latentloop: error: started as 2 processes (torchrun) but train.strategy is none: set --set " \
           "train.strategy=ddp or fsdp2 (or auto, the default: ddp under torchrun)"
    assert printed == {0: [said], 1: []}
    assert not (tmp_path / "run").exists()
    # so is a usage mistake, which argparse finds on every process alike
    for rank, expected in ((1, ""), (0, "latentloop: error: argument --steps")):
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(SystemExit) as usage:
            main(["train", "--steps", "abc", "--out", str(tmp_path / "run")])
        assert usage.value.code == 2 and capsys.readouterr().err.startswith(expected)
    # RANK set by hand, not by torchrun: no rank 0 will speak, so this process does (it exited 2 silently)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [said]


def test_a_launch_half_set_or_never_formed_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    """MASTER_ADDR / MASTER_PORT left in a shell without RANK / WORLD_SIZE: one process, as without
    them (torch's ValueError traceback before); a rendezvous whose other processes never come: one
    line naming the address and the timeout, after it (torch's DistStoreError traceback)."""
    port = _free_port()
    argv = ["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus}", "--steps", "1",
            "--set", "train.strategy=ddp", "--set", "train.eval_every=0", "--no-progress"]
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    assert main([*argv, "--out", str(tmp_path / "alone")]) == 0
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LATENTLOOP_DIST_TIMEOUT", "2")
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "waiting")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the process group at 127.0.0.1:{port} did not form within 2 s" in err[0], err


def test_a_run_keeps_the_strategy_as_given_in_its_config(corpus, tmp_path):
    """Setup saved what auto resolved to (none in one process) into config.json, so the run was
    refused when resumed under torchrun, though the user never chose none (12-06 review). The config
    keeps auto; what ran is the resolved strategy, and a strategy given on resume is a changed setting."""
    from latentloop.train.resume import _sync_metrics
    from latentloop.train.start import check_run_folder

    run = tmp_path / "run"
    state = setup(dist_workers.run_config("gpt", corpus, "auto", steps=1), run, progress=False)
    try:
        assert state.config.train.strategy == "none"  # what runs in one process
        assert json.loads((run / "config.json").read_text())["train"]["strategy"] == "auto"
        (run / "checkpoints").mkdir()  # as after a save: a run to resume
        assert check_run_folder(run, state.config, True, "auto") == []  # auto both: nothing changed
        assert check_run_folder(run, state.config, True, "ddp") == ['strategy: "auto" -> "ddp"']
        state.config_unsaved = True  # a resume that changed a train setting writes the config again
        _sync_metrics(state)
        assert json.loads((run / "config.json").read_text())["train"]["strategy"] == "auto"  # still as given
    finally:
        state.lock.release()


def _resume_config(run: Path, *extra: str) -> str:
    """The train.strategy `latentloop train --out RUN --resume EXTRA` resumes with (nothing trained)."""
    from latentloop.cli.parser import build_parser
    from latentloop.cli.training import _run_config_from_args

    args = build_parser().parse_args(["train", "--out", str(run), "--resume", *extra])
    return _run_config_from_args(args).train.strategy


def test_a_recorded_none_resumes_under_torchrun_as_auto_unless_none_is_given_now(corpus, tmp_path, monkeypatch,
                                                                                capsys):
    """A run saved before the config kept auto records none: under torchrun (2 processes) it resumes
    with auto (said once, by rank 0); a recorded ddp / fsdp2 / auto stands; a none given now is refused."""
    for recorded in ("none", "ddp", "fsdp2", "auto"):
        run = tmp_path / recorded
        run.mkdir()
        dist_workers.run_config("gpt", corpus, recorded).save_json(run / "config.json")
        notice = f"latentloop: {run / 'config.json'} records train.strategy none, as a run of one process"
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        monkeypatch.delenv("RANK", raising=False)
        assert _resume_config(run) == recorded  # one process: as recorded, nothing said
        monkeypatch.setenv("WORLD_SIZE", str(WORLD))
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            assert _resume_config(run) == ("auto" if recorded == "none" else recorded), recorded
            said = [line for line in capsys.readouterr().err.splitlines() if line.startswith(notice)]
            assert len(said) == (recorded == "none" and rank == 0), (recorded, rank, said)
        monkeypatch.setenv("RANK", "0")
        assert _resume_config(run, "--set", "train.strategy=none") == "none"  # given now: it stands
        # ... from a config file laid over a run built on a base too (the file's none was read as recorded)
        (tmp_path / "none.yaml").write_text("train:\n  strategy: none\n")
        assert _resume_config(run, "--config", str(tmp_path / "none.yaml"), "--init-from", str(run)) == "none"
        assert _resume_config(run, "--set", "strategy=fsdp2") == "fsdp2"
        assert notice not in capsys.readouterr().err
        assert main(["train", "--out", str(run), "--resume", "--set", "train.strategy=none"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            "latentloop: error: started as 2 processes (torchrun) but train.strategy is none: set --set "
            "train.strategy=ddp or fsdp2 (or auto, the default: ddp under torchrun)"]


@pytest.mark.parametrize("fails", [False, True], ids=["after success", "after a user error"])
def test_a_process_in_a_group_skips_the_interpreters_teardown(corpus, tmp_path, monkeypatch, fails):
    """A gloo group's threads outlive it and can abort the interpreter's teardown (SIGABRT after
    the work is done: torchrun then reports a failed job, and a user error's exit code 2 is lost),
    so the process's own command line ends every command in a group through
    `exit_without_finalizing`, with the command's code; called with argv it returns the code."""
    import latentloop.cli as cli
    import latentloop.distributed as distributed

    class Exited(Exception):
        pass

    def record(code):
        raise Exited(code)

    monkeypatch.setattr(distributed, "exit_without_finalizing", record)
    data = tmp_path / "missing.txt" if fails else corpus  # a data error: raised by the command, not argparse
    argv = ["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{data}", "--steps", "1",
            "--batch-size", "2", "--set", "sequence_len=16", "--set", "train.eval_every=0",
            "--out", str(tmp_path / "run"), "--no-progress"]
    monkeypatch.setattr(sys, "argv", ["latentloop", *argv])
    try:
        for own_command_line in (True, False):
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
            if own_command_line:
                with pytest.raises(Exited) as exited:
                    cli.main()
                assert exited.value.args == (2 if fails else 0,)
            else:
                assert cli.main([*argv[:-3], "--out", str(tmp_path / "again"), "--no-progress"]) == (2 if fails else 0)
            assert distributed.in_process_group() == fails  # a failure stays in the group: a peer may wait
            if fails:
                torch.distributed.destroy_process_group()
    finally:
        if distributed.in_process_group():
            torch.distributed.destroy_process_group()


# the bit flip in the default suite; the planted pickle (the same refusal path, another trigger) with
# the slow tests: each case is a two-process torchrun (~6 s)
@pytest.mark.parametrize("damage", [pytest.param("planted metadata pickle", marks=pytest.mark.slow),
                                    "flipped bit in rank 1's share"])
def test_a_damaged_sharded_checkpoint_ends_a_torchrun_resume_with_one_line(corpus, tmp_path, damage):
    """Every process checks its share of the checksums and reads DCP's metadata without unpickling
    it freely before DCP reads anything; all agree, rank 0 prints the one line."""
    from test_sharded_checkpoints import dcp_folder, flip_bit, plant_metadata

    run, marker = tmp_path / "run", tmp_path / "pwned"
    try:  # a one-process fsdp2 run (a group of one) whose checkpoint holds dcp/ only
        fit(setup(dist_workers.run_config("gpt", corpus, "fsdp2", steps=2, full_weights=False), run, progress=False),
            progress=False)
    finally:
        torch.distributed.destroy_process_group()
    if damage == "planted metadata pickle":
        path = plant_metadata(run, marker)
        reason = "holds a pickled object that is not checkpoint metadata"
    else:
        path = dcp_folder(run) / "__0_0.distcp"  # the checksums' second file: rank 1 hashes it
        flip_bit(path)
        reason = "is corrupt: its sha256 differs"
    result = _torchrun(["train", "--resume", "--out", str(run), "--steps", "3", "--no-progress"], tmp_path)
    assert not marker.exists()
    lines = _error_lines(result)
    assert result.returncode != 0 and len(lines) == 1 and f"{path} {reason}" in lines[0], result.stderr[-2000:]
    workers = result.stderr.split("failed (exitcode")[0]  # what the processes printed before torchrun's report
    assert "exitcode  : 2" in result.stderr and "Traceback" not in result.stdout + workers


POOL_EXIT_TIMEOUT_S = 120  # the process's start (importing torch) on 2 busy cores; the exit itself is instant


def test_the_exit_under_torchrun_stops_thread_pools_before_joining_threads(tmp_path):
    """`exit_without_finalizing` stops concurrent.futures' pools as Python's own exit does before it
    joins the non-daemon threads: a pool's idle worker (inductor's compile workers, after any
    compiled step) was joined for good, and every torchrun job with train.compile=true hung after
    its last checkpoint."""
    script = tmp_path / "pool_exit.py"
    script.write_text("from concurrent.futures import ThreadPoolExecutor\n"
                      "from latentloop.distributed import exit_without_finalizing\n"
                      "pool = ThreadPoolExecutor(2)\n"
                      "assert pool.submit(lambda: 41 + 1).result() == 42\n"
                      "print('done', flush=True)\n"
                      "exit_without_finalizing(3)\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=POOL_EXIT_TIMEOUT_S)
    assert result.returncode == 3 and result.stdout == "done\n", result.stderr[-2000:]
    # a task still running: the pool's stop waits for it, so the exit bounds that wait too
    busy = tmp_path / "busy_exit.py"
    busy.write_text("import time\nfrom concurrent.futures import ThreadPoolExecutor\n"
                    "from latentloop import distributed\n"
                    "distributed.THREAD_JOIN_S = 0.5\n"
                    "ThreadPoolExecutor(1).submit(time.sleep, 3600)\n"
                    "started = time.monotonic()\n"
                    "print('exiting', flush=True)\n"
                    "distributed.exit_without_finalizing(4)\n")
    result = subprocess.run([sys.executable, str(busy)], capture_output=True, text=True, timeout=POOL_EXIT_TIMEOUT_S)
    assert result.returncode == 4 and result.stdout == "exiting\n", result.stderr[-2000:]


def test_only_a_broken_collective_waits_for_torchrun_before_raising(monkeypatch):
    """A process of a group waits PEER_GRACE_S before raising only where its error came out of a
    collective (a peer probably failed first, and torchrun should report that one); its own error
    (a bug in its step) was held back 10 s as well."""
    import torch.distributed as dist

    from latentloop import cli
    from latentloop.distributed import DistEnv, is_collective_failure

    assert is_collective_failure(dist.DistStoreError("store timed out"))
    assert is_collective_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
                                              "by peer [127.0.0.1]:1234"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))
    slept: list[float] = []
    monkeypatch.setattr("time.sleep", slept.append)
    monkeypatch.setattr("latentloop.distributed.current_dist", lambda: DistEnv(1, 1, 2, "gloo"))
    for error, waits in ((RuntimeError("shapes cannot be multiplied"), []),
                         (RuntimeError("gloo: Connection reset by peer"), [cli.PEER_GRACE_S])):
        monkeypatch.setitem(cli.COMMANDS, "plan", lambda args, error=error: (_ for _ in ()).throw(error))
        slept.clear()
        with pytest.raises(RuntimeError):
            cli.main(["plan", "--arch", "gpt", "--preset", "test", "--tokens", "1000"])
        assert slept == waits, error


def test_a_group_that_cannot_start_is_told_apart_from_one_that_never_formed(monkeypatch):
    """A port already taken: "could not start"; a rendezvous whose others never came (rank 0's store
    times out, a peer's client socket times out as a network error): "did not form within ..."."""
    import torch.distributed as dist

    from latentloop.distributed import init_distributed
    from latentloop.errors import ConfigError

    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29999"), ("RANK", "1"), ("WORLD_SIZE", "2"),
                        ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    for error, words in ((dist.DistNetworkError("The server socket has failed to listen on any local network "
                                                "address. port: 29999, useIpv6: 0, code: -98, name: EADDRINUSE"),
                          "could not start"),
                         (dist.DistNetworkError("The client socket has timed out after 5000ms while trying to "
                                                "connect to (127.0.0.1, 29999)."), "did not form within"),
                         (dist.DistStoreError("Timed out after 16 seconds waiting for clients. 1/2 clients joined."),
                          "did not form within")):
        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(dist, "init_process_group", fail)
        with pytest.raises(ConfigError, match=words):
            init_distributed("ddp", "cpu")


@pytest.mark.parametrize("batches, world", [(5, 2), (3, 2), (7, 3), (1, 4), (0, 2)])
def test_validation_shares_every_batch_out_once_and_pads_the_shares_to_one_length(batches, world):
    """Each batch is counted by exactly one process; every process runs as many forwards (fsdp2's are
    collective), the padding being the first batch with a mask of no target."""
    from latentloop.train.loop import process_share

    every = [(torch.full((1, 2), i), torch.full((1, 2), i)) for i in range(batches)]
    shares = [list(process_share(iter(every), rank, world)) for rank in range(world)]
    counted = sorted(int(batch[0][0, 0]) for share in shares for batch in share if len(batch) == 2)
    assert counted == list(range(batches))
    assert len({len(share) for share in shares}) == 1 and len(shares[0]) == -(-batches // world)
    padding = [batch for share in shares for batch in share if len(batch) == 3]
    assert all(int(x[0, 0]) == 0 and not mask.any() for x, _, mask in padding)


def test_padding_batches_run_but_add_nothing_to_the_figures():
    from latentloop.eval.loss import evaluate_batches
    from latentloop.train.loop import process_share

    model = ll.build("gpt", preset="test").eval()
    generator = torch.Generator().manual_seed(0)
    batches = [(x, torch.roll(x, 1, 1)) for x in (torch.randint(0, 256, (2, 8), generator=generator) for _ in range(3))]
    table = torch.ones(model.config.vocab_size, dtype=torch.long).numpy()
    alone = evaluate_batches(model, batches[1:2], table)
    padded = evaluate_batches(model, process_share(iter(batches), 1, 2), table)  # batch 1, then a padding one
    assert padded["tokens"] == alone["tokens"] == 16
    torch.testing.assert_close(padded["loss"], alone["loss"], rtol=0, atol=0)
