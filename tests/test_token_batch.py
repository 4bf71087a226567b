"""A token batch, not a micro-batch (issue 51): `train.batch_tokens` sets the accumulation so that a
step sees that many tokens whatever micro-batch fills the device, and accumulating N micro-batches
gives the gradients of one batch N times larger; Muon's batched Newton-Schulz iteration equals the
matrix-by-matrix one; `train --profile` writes a trace and its summary."""

from __future__ import annotations

import json

import pytest
import torch

import latentloop as ll
from latentloop.archs import ARCHS, build_objective
from latentloop.cli import main
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.errors import ConfigError
from latentloop.objectives import IGNORE_INDEX
from latentloop.optim import Muon, orthogonalize
from latentloop.train import FiniteGuard, setup, train_step
from latentloop.train.step import accumulation

CPU = torch.device("cpu")
SEQ_LEN = 32
# fp32: the same sums taken in another order (two micro-batches' means halved and added, against one
# mean), so the gradients agree to rounding
ACCUMULATION_RTOL, ACCUMULATION_ATOL = 1e-5, 1e-7

# Every arch with its spec's settings under which a training forward draws nothing from the global
# RNG (fbt: multi-pass forced, no jitter; rgpt: no noise) and fbt's prefixes off: their uniform draws
# are per (row, position) of a micro-batch, so two micro-batches of 2 rows draw other prefixes than
# one of 4 rows.
QUIET = {name: dict(spec.deterministic) for name, spec in ARCHS.items()}
for name in ("fbt", "rfbt"):
    QUIET[name] = {**QUIET[name], "prefix_mixin": False}


@pytest.mark.parametrize("masked", [False, True, "ignored"], ids=["every-target", "sft-mask", "sft-mask-ignored"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_n_micro_batches_give_the_gradients_of_one_batch_n_times_larger(arch, masked):
    """Also under SFT's loss mask, where the two micro-batches train on 2 and 48 targets: a mean per
    micro-batch weighed alike gave those 2 targets 24x the weight each of the others (the gradients
    were ~300% off); each micro-batch now counts by its share of the step's targets, and lrt's loss
    terms (its init pass's and each column subset's masked means: the first micro-batch trains only
    odd columns) each by its own share, as mor's router loss terms (means over a row's real inputs,
    up to its last trained target, and over each recursion's candidates: the last row ends in padding,
    so that its top-k quotas differ). The objective's losses are one batch's too. A target the mask marks
    but the data ignores (`IGNORE_INDEX`) counts for nothing, in the loss's mean and in its micro-batch's
    share alike."""
    torch.manual_seed(0)
    model = ll.build(arch, preset="test", sequence_len=SEQ_LEN, **QUIET[arch]).train()
    data = torch.randint(0, model.config.vocab_size, (4, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1], data[:, 1:]
    mask = torch.zeros(x.shape, dtype=torch.bool)
    mask[0:2, -1:] = True  # the first micro-batch: a reply of 1 token per row (an odd column)
    mask[2, 8:] = True  # the second: a reply of 24 tokens, and one of 12 followed by padding
    mask[3, 8:20] = True
    if masked == "ignored":
        y = y.clone()
        y[2, 8:20] = IGNORE_INDEX  # half of the second micro-batch's marked targets

    def gradients(micro_batches: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = len(x) // micro_batches
        batches = iter([(x[i:i + rows], y[i:i + rows], *([mask[i:i + rows]] if masked else []))
                        for i in range(0, len(x), rows)])
        train = TrainConfig(batch_size=rows, grad_accum=micro_batches, grad_clip=0.0, device="cpu", dtype="float32")
        objective = build_objective(model.config, train)
        model.zero_grad(set_to_none=True)
        outcome = train_step(model, model, objective, lambda: next(batches), 5, [], train, CPU, FiniteGuard(CPU))
        # the objective's losses (lrt's loss_init / loss_final, mor's router loss and its recursions' shares
        # of the real tokens): means over their own tokens, as the loss is (other metrics, such as a gate's
        # mean, are not means over tokens, and need not add up so)
        metrics = {k: v for k, v in outcome.metrics.items() if k.startswith(("loss", "router_loss", "active_r"))}
        return ({"loss": outcome.loss_on_device, **metrics},
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    (whole_loss, whole), (accumulated_loss, accumulated) = gradients(1), gradients(2)
    assert accumulated_loss.keys() == whole_loss.keys()
    torch.testing.assert_close(accumulated_loss, whole_loss, rtol=ACCUMULATION_RTOL, atol=ACCUMULATION_ATOL)
    assert whole.keys() == accumulated.keys() and whole
    for name, grad in whole.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=ACCUMULATION_RTOL, atol=ACCUMULATION_ATOL, msg=name)


@pytest.mark.parametrize("arch", ["fbt", "rfbt"])
def test_each_of_a_steps_batches_draws_its_own_fbt_prefixes(arch):
    """The pass count is the step's (one graph for all its batches); the prefixes are each batch's own
    (`draw`: micro-batch x processes + rank). One seed per step gave every micro-batch and process
    the same prefix boundaries row for row. The step's first batch draws as a one-batch step did."""
    model = ll.build(arch, preset="test", sequence_len=SEQ_LEN, **{**dict(ARCHS[arch].deterministic),
                                                                    "prefix_mixin": True})
    objective = build_objective(model.config, TrainConfig(steps=10))
    x = torch.randint(1, model.config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    step = next(s for s in range(10) if objective.plan(s, x)["passes"] > 1)
    plans = [objective.plan(step, x, None, draw) for draw in range(3)]
    assert len({p["passes"] for p in plans}) == 1
    masks = [torch.stack(p["fuse_mask"]) for p in plans]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    assert torch.equal(masks[0], torch.stack(objective.plan(step, x)["fuse_mask"]))


def test_an_objective_whose_plan_predates_draw_still_trains():
    """`plan(step, x, loss_mask)` as objectives of one's own were written before `draw` (12-06): the
    step calls it without `draw` instead of failing with a TypeError."""
    from latentloop.objectives import NextTokenObjective

    seen = []

    class OwnObjective(NextTokenObjective):
        def plan(self, step, x, loss_mask=None):
            seen.append(step)
            return {}

    model = ll.build("gpt", preset="test", sequence_len=SEQ_LEN).train()
    data = torch.randint(0, model.config.vocab_size, (4, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    batches = iter([(data[:2, :-1], data[:2, 1:]), (data[2:, :-1], data[2:, 1:])])
    train = TrainConfig(batch_size=2, grad_accum=2, device="cpu", dtype="float32")
    outcome = train_step(model, model, OwnObjective(model.config, train), lambda: next(batches), 3, [], train, CPU,
                         FiniteGuard(CPU))
    assert seen == [3, 3] and torch.isfinite(outcome.loss_on_device)


def test_batch_tokens_sets_the_accumulation_exactly_or_says_what_would():
    train = TrainConfig(batch_size=4, batch_tokens=4 * 128 * 6)
    assert accumulation(train, 128, 1) == 6 and accumulation(train, 128, 2) == 3 and accumulation(train, 128, 3) == 2
    with pytest.raises(ConfigError, match=r"not a multiple of one micro-batch's tokens over the processes "
                                          r"\(4 x 128 x 4 = 2,048\); try 4,096"):
        accumulation(train, 128, 4)
    with pytest.raises(ConfigError, match="give train.batch_tokens or train.grad_accum, not both"):
        accumulation(TrainConfig(batch_size=4, grad_accum=2, batch_tokens=4096), 128, 1)
    assert accumulation(TrainConfig(grad_accum=3), 128, 2) == 3  # unset: grad_accum as given
    with pytest.raises(ConfigError, match="batch_tokens must be >= 0"):
        TrainConfig(batch_tokens=-1)


def test_a_run_with_batch_tokens_accumulates_to_them(corpus, tmp_path):
    config = RunConfig(model=model_config("gpt", "test", sequence_len=SEQ_LEN),
                       train=TrainConfig(steps=2, batch_size=2, batch_tokens=3 * 2 * SEQ_LEN, eval_every=0,
                                         eval_batches=1, device="cpu"),
                       data=DataConfig(source=f"text:{corpus}"))
    state = setup(config, tmp_path / "run", progress=False)
    assert state.accumulation == 3 and state.global_batch == 6
    drawn = []
    real = state.loader.next_batch
    state.loader.next_batch = lambda: drawn.append(1) or real()
    from latentloop.train import fit

    summary = fit(state, progress=False)
    assert len(drawn) == 2 * 3 and summary["tokens"] == 2 * 3 * 2 * SEQ_LEN


def test_a_token_batch_that_does_not_divide_is_one_line(corpus, tmp_path, capsys):
    code = main(["train", "--preset", "test", "--data", f"text:{corpus}", "--out", str(tmp_path / "run"),
                 "--batch-size", "2", "--set", f"sequence_len={SEQ_LEN}", "--set", "train.batch_tokens=100",
                 "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "batch_tokens=100 is not a multiple" in err, err
    assert not (tmp_path / "run").exists()


# fp32: one batched product against one product per matrix, the same sums (MKL may block them alike or
# not), so the updates agree to rounding
BATCHED_TOL = 1e-6


@pytest.mark.parametrize("compiled", [None, "eager"])
def test_muons_batched_iteration_is_each_matrixs_own(compiled):
    """Three matrices of one shape and one of another, stepped together, against each stepped by a
    Muon of its own (a stack of one). Compiled (as under train.compile), the same numbers."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(24, 16), (24, 16), (24, 16), (16, 40)]
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    grads = [torch.randn(s, generator=generator) for s in shapes]
    alone = [p.detach().clone().requires_grad_() for p in params]
    together = Muon(params, lr=0.05, weight_decay=0.1, ns_dtype=torch.float32, compiled=compiled)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    together.step()
    for p, g, p0 in zip(params, grads, alone):
        one = Muon([p0], lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
        p0.grad = g.clone()
        one.step()
        torch.testing.assert_close(p.detach(), p0.detach(), rtol=0, atol=BATCHED_TOL)
    stack = torch.stack(grads[:3])
    torch.testing.assert_close(orthogonalize(stack, 5, torch.float32)[1], orthogonalize(grads[1], 5, torch.float32),
                               rtol=0, atol=BATCHED_TOL)


def test_train_profile_writes_a_trace_and_where_the_time_went(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--preset", "test", "--data", f"text:{corpus}", "--out", str(run), "--steps", "6",
                 "--batch-size", "2", "--set", f"sequence_len={SEQ_LEN}", "--set", "eval_batches=1",
                 "--set", "eval_every=0", "--profile", "2", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    traces = list((run / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]  # Chrome trace format: Perfetto and TensorBoard
    assert sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#")) == 2  # the steps recorded
    assert any(e.get("name") == "latentloop.optimizer" for e in events)
    summary = json.loads((run / "profile" / "summary.json").read_text())
    shares = summary["share_of_kernel_time"]
    assert summary["steps"] == 2 and summary["step_ms"] > 0 and 0 <= summary["idle_share_of_window"] < 1
    assert sum(shares.values()) == pytest.approx(1, abs=1e-3) and shares.get("matmul", 0) > 0
    assert shares.get("optimizer", 0) > 0  # the kernels inside the optimizer's range
    # a one-off: not kept in config.json, so a later plain resume does not profile again (it did, with a
    # warning about a flag it was not given)
    assert "profile_steps" not in json.loads((run / "config.json").read_text())["train"]
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "7", "--no-progress"]) == 0
    assert "profile" not in capsys.readouterr().err
    assert len(list((run / "profile").glob("*.pt.trace.json"))) == 1
    assert main(["train", "--out", str(run), "--resume", "--steps", "12", "--profile", "1", "--no-progress"]) == 0
    assert "profile_steps" not in capsys.readouterr().err  # a one-off, not a change of the run
    assert main(["train", "--out", str(run), "--resume", "--steps", "13", "--no-progress"]) == 0
    assert "profile" not in capsys.readouterr().err
    saved = json.loads((run / "config.json").read_text())  # as a run saved before it was left out records it
    saved["train"]["profile_steps"] = 1
    (run / "config.json").write_text(json.dumps(saved))
    assert main(["train", "--out", str(run), "--resume", "--steps", "14", "--no-progress"]) == 0
    assert "profile" not in capsys.readouterr().err


def test_profile_steps_is_validated(capsys, tmp_path):
    with pytest.raises(ConfigError, match="profile_steps must be >= 0"):
        TrainConfig(profile_steps=-2)
    with pytest.raises(SystemExit):  # argparse: a positive count
        main(["train", "--out", str(tmp_path / "x"), "--profile", "0"])
    assert "--profile" in capsys.readouterr().err


@pytest.mark.parametrize("steps, says", [(3, "records nothing"), (4, "records only 1")])
def test_a_run_too_short_for_its_profile_says_so(corpus, tmp_path, capsys, steps, says):
    """The profiler skips the first 3 steps: a run of 3 recorded nothing (an empty profile/ folder)
    without a word."""
    run = tmp_path / "run"
    assert main(["train", "--preset", "test", "--data", f"text:{corpus}", "--out", str(run), "--steps", str(steps),
                 "--batch-size", "2", "--set", f"sequence_len={SEQ_LEN}", "--set", "eval_batches=1",
                 "--set", "eval_every=0", "--profile", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "--profile 2: the profiler skips the first 3 steps" in err and says in err
    assert (run / "profile").exists() == (steps == 4)
