"""What each process of `test_distributed.py`'s multi-process runs does (imported by the spawned
processes, so it lives in a module of its own). Every worker joins a gloo group on localhost the
way torchrun would set it up (env vars), runs its scenario through `latentloop.train`, and rank 0
writes what the test reads into `out` (JSON / safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from latentloop.config import DataConfig, RunConfig, TrainConfig, config_classes, model_config

# Settings that make each architecture's random draws observable in 3 steps; a registered architecture
# missing here trains with its `test` preset as it is. Every arch's training noise is off besides
# (its config's `training_noise_fields`): it comes from each process's own RNG stream, so with it
# two processes cannot equal one that accumulates.
ARCH_OVERRIDES = {
    "gpt": {},
    # multi-pass batches from the first step on (K = 1 and 2 both drawn in the first 3 steps with SEED,
    # asserted by the test)
    "fbt": {"plain_fraction": 0.0, "pass_mix": (0.5, 0.5)},
    "lrt": {"recurrence": "interleaved", "subsets": 2},
    "rgpt": {"recurrence_steps": 3},
}
# validation batches after a run: shared out among 2 processes as 2 and 1 (padded with a batch that adds
# nothing), the figures one process gets from all 3
VAL_BATCHES = 3
SEED = 2  # steps 0-2 draw fbt K = 1, 2, 2 and rgpt depths 3, 1, 2 (asserted by the test)
# fbt K = 1, 1, 2, ...: a checkpoint after step 2 holds no optimizer state for the fusion matrices yet
LATE_FUSION_SEED = 11


def run_config(arch: str, corpus: Path, strategy: str, steps: int = 3, grad_accum: int = 1,
               model: dict | None = None, **train) -> RunConfig:
    train = {"steps": steps, "batch_size": 2, "grad_accum": grad_accum, "eval_every": 0, "eval_batches": 1,
             "log_every": 1, "warmup_steps": 1, "lr": 1e-2, "seed": SEED, "strategy": strategy, "device": "cpu",
             **train}
    quiet = dict.fromkeys(config_classes()[arch].training_noise_fields(), 0.0)
    overrides = {**quiet, **ARCH_OVERRIDES.get(arch, {}), **(model or {})}
    return RunConfig(model=model_config(arch, "test", sequence_len=32, **overrides),
                     train=TrainConfig(**train), data=DataConfig(source=f"text:{corpus}"))


def join(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # two processes share the machine's cores


NOISE_PROBE = 4  # numbers read ahead from a rank's own torch stream (the one training noise draws from)


def record_draws(objective, model) -> list[dict]:
    """Wrap the objective so that every call records the random draws it made (fbt: pass count and
    rgpt: depth; lrt: the subsets' columns), which every rank must draw alike, and under "own" what
    each rank must have to itself: its batch, the next numbers of its torch stream (read from a copy:
    the run draws them unchanged) and fbt's uniform field that places its rows' prefix boundaries."""
    from latentloop.archs.fbt import objective as fbt_objective

    draws: list[dict] = []
    real_mask = fbt_objective.document_prefix_mask

    def mask(idx, bos_id, generator):
        probe = torch.Generator().set_state(generator.get_state())
        draws[-1]["own"]["prefix_u"] = torch.rand(idx.shape, generator=probe).flatten().tolist()
        return real_mask(idx, bos_id, generator)

    fbt_objective.document_prefix_mask = mask
    real_plan, real_loss = type(objective).plan, type(objective).loss

    def plan(self, step, x, loss_mask=None, draw=0):  # the trainer draws each micro-batch's plan, then runs its loss
        stream = torch.Generator().set_state(torch.get_rng_state())
        own = {"batch": x.tolist(), "noise": torch.rand(NOISE_PROBE, generator=stream).tolist()}
        draws.append({"step": step, "own": own})
        return real_plan(self, step, x, loss_mask, draw)

    def loss(self, forward_model, x, y, loss_mask=None, **plan):
        result = real_loss(self, forward_model, x, y, loss_mask, **plan)
        draws[-1].update({k: v for k, v in result.metrics.items() if k in ("passes", "steps")})
        return result

    objective.__class__ = type("Recording", (type(objective),), {"plan": plan, "loss": loss})
    if model.config.arch == "lrt":
        real_interleaved = type(model).interleaved

        def interleaved(self, idx, subsets, pad_mask=None, pad_shift=0):
            out, buffer = real_interleaved(self, idx, subsets, pad_mask, pad_shift)
            if self.training:
                draws[-1]["columns"] = [c.tolist() for c in out.pass_columns]
            return out, buffer

        model.interleaved = interleaved.__get__(model)
    return draws


ACCUMULATING = "gpt+accum"  # a case of its own: gpt with 2 micro-batches per step on every process


MUON = "gpt+muon"  # gpt trained with Muon: under fsdp2 its matrices are gathered for the orthogonalisation


def case_arch(case: str) -> tuple[str, int]:
    """(arch, grad_accum) of a case name: an arch, ACCUMULATING or MUON."""
    return {ACCUMULATING: ("gpt", 2), MUON: ("gpt", 1)}.get(case, (case, 1))


def case_train(case: str) -> dict:
    """The TrainConfig fields a case sets beyond `run_config`'s."""
    return {"optimizer": "muon"} if case == MUON else {}


def _runs(rank: int, corpus: str, out: str, strategy: str, cases: list[str]) -> None:
    """One run per case under `strategy`; rank 0 writes the losses and every rank's draws."""
    from latentloop.parallel import gather_objects
    from latentloop.train import fit, setup, validate

    results = {}
    for case in cases:
        arch, grad_accum = case_arch(case)
        state = setup(run_config(arch, Path(corpus), strategy, grad_accum=grad_accum, **case_train(case)),
                      Path(out) / f"{case}-{strategy}", progress=False)
        draws = record_draws(state.objective, state.model)
        held = watch_gradients(state)
        summary = fit(state, progress=False)
        results[case] = {"losses": [row["loss"] for row in state.history if "loss" in row],
                         "rows": training_rows(state.history), "gradients_held": held,
                         "draws": gather_objects(draws), "checkpoint": summary["checkpoint"],
                         "val": validate(state, VAL_BATCHES)}
    if rank == 0:
        (Path(out) / f"{strategy}.json").write_text(json.dumps(results))


# a training row's clock readings (never equal between two runs) and the job's shape (the first row of
# a multi-process run says it)
NOT_COMPARED = ("tok_per_s", "elapsed", "world_size", "global_batch")


def training_rows(history: list[dict]) -> list[dict]:
    """A run's training rows without clock readings and the job's shape: what one process and N must
    agree on."""
    return [{key: value for key, value in row.items() if key not in NOT_COMPARED} for row in history if "loss" in row]


def watch_gradients(state) -> list[dict]:
    """As each micro-batch's plan is drawn (just before its forward): whether every parameter holds a
    gradient, and the elements this process holds of them (a sharded gradient: its shard) against the
    parameters' whole size. (The step draws its batches first, so the loader's calls come too early.)"""
    seen, plan = [], state.objective.plan

    def watched(*args, **kwargs):
        params = list(state.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        seen.append({"all": len(grads) == len(params), "full": sum(p.numel() for p in params),
                     "local": sum(g.to_local().numel() if hasattr(g, "to_local") else g.numel() for g in grads)})
        return plan(*args, **kwargs)

    state.objective.plan = watched
    return seen


NOISY_RGPT = {"noise_std": 0.1}  # rgpt's training noise on: each rank's own RNG stream must be saved and restored


def equivalence(rank: int, world: int, port: int, corpus: str, out: str, strategy: str, cases: list[str]) -> None:
    """`_runs`, then (ddp) a noisy rgpt run interrupted after step 2 and resumed (`interrupted`)."""
    from latentloop.distributed import destroy_distributed

    join(rank, world, port)
    _runs(rank, corpus, out, strategy, cases)
    if strategy == "ddp":
        interrupted(rank, corpus, out, "rgpt-ddp-resume", "rgpt", "ddp", NOISY_RGPT)
    destroy_distributed()


def interrupted(rank: int, corpus: str, out: str, name: str, arch: str, strategy: str, model: dict,
                **train) -> int:
    """A 4-step run saving at steps 2 and 4; rank 0 keeps its final checkpoint as NAME-straight and
    deletes it, and the run resumes from step 2 on as many processes into NAME/. Returns the step
    it resumed from (also written to NAME.json by rank 0)."""
    import shutil

    from latentloop.checkpoint import list_checkpoints
    from latentloop.train import fit, setup

    run = Path(out) / name
    config = dict(steps=4, save_every=2, keep_last=3, model=model, **train)
    fit(setup(run_config(arch, Path(corpus), strategy, **config), run, progress=False), progress=False)
    if rank == 0:
        final = list_checkpoints(run)[-1]
        shutil.copytree(final, Path(out) / f"{name}-straight")  # what the uninterrupted run ended with
        shutil.rmtree(final)
    torch.distributed.barrier()
    resumed = setup(run_config(arch, Path(corpus), strategy, **config), run, resume=True, progress=False)
    start = resumed.step
    fit(resumed, progress=False)
    if rank == 0:
        (Path(out) / f"{name}.json").write_text(json.dumps({"resumed_from": start}))
    return start


def sharded(rank: int, world: int, port: int, corpus: str, out: str, cases: list[str]) -> None:
    """fsdp2 runs of `cases` (as `equivalence`), then `sharded_checkpoints`, in one process group."""
    from latentloop.distributed import destroy_distributed

    join(rank, world, port)
    _runs(rank, corpus, out, "fsdp2", cases)
    sharded_checkpoints(rank, corpus, out)
    destroy_distributed()


def sharded_checkpoints(rank: int, corpus: str, out: str) -> None:
    """An fsdp2 run of 4 steps saving at 2 and 4 (sharded only), its logits on a fixed batch; then
    the step-4 checkpoint removed and the run resumed from step 2 on as many processes."""
    import shutil

    from safetensors.torch import save_file

    from latentloop.checkpoint import list_checkpoints
    from latentloop.train import fit, setup

    run = Path(out) / "fsdp2-run"
    config = run_config("fbt", Path(corpus), "fsdp2", steps=4, save_every=2, keep_last=3, full_weights=False,
                        seed=LATE_FUSION_SEED)
    state = setup(config, run, progress=False)
    fit(state, progress=False)
    x = torch.arange(2 * 32).reshape(2, 32) % 250
    state.model.eval()
    with torch.no_grad():
        logits = state.model(x).logits.detach()
    if rank == 0:
        save_file({"x": x, "logits": logits.contiguous()}, str(Path(out) / "fsdp2-logits.safetensors"))
        final = list_checkpoints(run)[-1]
        shutil.copytree(final, Path(out) / "fsdp2-straight")  # what the uninterrupted run ended with
        shutil.rmtree(final)
    torch.distributed.barrier()
    resumed = setup(run_config("fbt", Path(corpus), "fsdp2", steps=4, save_every=2, keep_last=3,
                               full_weights=True, seed=LATE_FUSION_SEED), run, resume=True, progress=False)
    start = resumed.step
    fit(resumed, progress=False)
    # a run whose deadline passed before its first step saves step 0, its optimizer without state: resumed,
    # it must train as a run never stopped (the zero states torch fills in to save were taken for real)
    losses = {}
    for name, cut in (("straight", None), ("stopped", 0.0)):
        config = run_config("gpt", Path(corpus), "fsdp2", steps=3, optimizer="adamw", full_weights=False)
        first = setup(config, Path(out) / f"step0-{name}", progress=False)
        fit(first, progress=False, max_seconds=cut)
        if cut is not None:
            first = setup(config, Path(out) / f"step0-{name}", resume=True, progress=False)
            fit(first, progress=False)
        losses[name] = [row["loss"] for row in first.history if "loss" in row]
    if rank == 0:
        (Path(out) / "fsdp2-resume.json").write_text(json.dumps({"resumed_from": start, "step0": losses}))


def plant_fault(rank: int, at_batch: int = 3) -> None:
    """On rank 1 only: the loader's `at_batch`-th batch fails with a DataError, as an unreadable shard
    on one node would (rank 0 carries on into the step's collectives)."""
    if rank != 1:
        return
    from latentloop.data import loader
    from latentloop.errors import DataError

    calls = {"n": 0}
    real = loader.TokenLoader.next_batch

    def next_batch(self):
        calls["n"] += 1
        if calls["n"] == at_batch:
            raise DataError("shard unreadable on this node (planted by the test)")
        return real(self)

    loader.TokenLoader.next_batch = next_batch


SFT_DATA = "chat:task:addition_steps:n=60"


def sft_config(base: str, strategy: str, grad_accum: int = 1) -> RunConfig:
    """An SFT stage on `base` (a gpt run): 3 steps of 2 conversations rows per process."""
    from latentloop.train import stage_config

    return stage_config("sft", base, data=SFT_DATA,
                        flags={"train.steps": 3, "train.batch_size": 2, "train.grad_accum": grad_accum,
                               "train.log_every": 1, "train.eval_every": 0, "train.eval_batches": 1,
                               "train.warmup_steps": 1, "train.lr": 1e-2, "train.strategy": strategy,
                               "train.device": "cpu"})


def sft(rank: int, world: int, port: int, base: str, out: str) -> None:
    """The SFT stage on `world` processes (each rank its own rows of the packed conversations)."""
    from latentloop.distributed import destroy_distributed
    from latentloop.train import fit, setup

    join(rank, world, port)
    run = Path(out) / "sft-ddp"
    state = setup(sft_config(base, "ddp"), run, progress=False, init_from=base)
    summary = fit(state, progress=False)
    if rank == 0:
        (Path(out) / "sft-ddp.json").write_text(json.dumps(
            {"losses": [row["loss"] for row in state.history if "loss" in row], "checkpoint": summary["checkpoint"]}))
    destroy_distributed()


def resume_under_fsdp2(rank: int, world: int, port: int, corpus: str, run: str) -> None:
    """`run` (saved by one process, strategy none) resumed under fsdp2 for 2 more steps; rank 0 writes
    the step it resumed from to RUN.json."""
    from latentloop.distributed import destroy_distributed
    from latentloop.train import fit, setup

    join(rank, world, port)
    resumed = setup(run_config("fbt", Path(corpus), "fsdp2", steps=4, seed=LATE_FUSION_SEED), Path(run), resume=True,
                    progress=False)
    start = resumed.step
    fit(resumed, progress=False)
    if rank == 0:
        Path(f"{run}.json").write_text(json.dumps({"resumed_from": start, "step": resumed.step}))
    destroy_distributed()
