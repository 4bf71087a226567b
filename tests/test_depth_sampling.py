"""rgpt's training depth distributions: uniform (the RecurrentGPT paper, unchanged) and heavy_tail
(Huginn's log-normal Poisson), truncated backprop through the last k steps, the cap, the config
checks, resume, FLOPs charged by the depth run, and the same draw on every rank."""

import json
import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import latentloop as ll
from latentloop.archs import build_model, build_objective
from latentloop.archs.rgpt.model import HUGINN_DEPTH_SIGMA, MAX_RECURRENCE_STEPS
from latentloop.archs.rgpt.objective import draw_depth
from latentloop.checkpoint import list_checkpoints
from latentloop.cli import main
from latentloop.config import RunConfig, TrainConfig, model_config
from latentloop.objectives import token_cross_entropy

DRAWS = 20_000  # optimizer steps sampled for the distribution checks (~15 µs each)
MEAN_SDS = 5  # the sample mean of r - 1 is within this many of its standard errors of r̄
VARIANCE_RTOL = 0.10  # sample variance vs the exact one (measured within 4% on three seeds)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)  # fp32: a no_grad step against an explicitly detached one


def _objective(seed: int = 1337, steps: int = 200, **model):
    return build_objective(model_config("rgpt", "test", **model), TrainConfig(seed=seed, steps=steps))


# -- the draws --------------------------------------------------------------------------------------


def test_uniform_is_the_default_and_draws_what_it_drew_before_heavy_tail_existed():
    assert model_config("rgpt", "test").depth_sampling == "uniform"
    # computed with the code before depth_sampling existed (np.random.default_rng([seed, step]))
    pinned = {(5, 4): [3, 1, 4, 4, 3, 3, 1, 2, 2, 4, 2, 2], (1337, 8): [5, 2, 3, 6, 6, 4, 3, 7, 6, 5, 4, 2]}
    for (seed, R), draws in pinned.items():
        objective = _objective(seed, recurrence_steps=R)
        assert [objective.depth_for_step(s) for s in range(12)] == draws
        assert objective.depth_for_step(10**6) == 1


@pytest.mark.parametrize("mean", [4.0, 32.0])  # 32: Huginn's r̄
def test_heavy_tail_has_mean_r_bar_and_a_heavy_tail(mean):
    """tau ~ N(log r̄ - σ²/2, σ), r - 1 ~ Poisson(e^tau): E[r - 1] = E[e^tau] = e^(mu + σ²/2) = r̄, and
    Var[r - 1] = E[e^tau] + Var[e^tau] = r̄ + r̄² (e^σ² - 1), over-dispersed against a Poisson of mean
    r̄ (whose variance is r̄)."""
    objective = _objective(seed=3, depth_sampling="heavy_tail", depth_mean=mean)
    extra = np.array([objective.depth_for_step(s) - 1 for s in range(DRAWS)])  # r - 1
    sigma = HUGINN_DEPTH_SIGMA
    variance = mean + mean ** 2 * math.expm1(sigma ** 2)
    assert abs(extra.mean() - mean) < MEAN_SDS * math.sqrt(variance / DRAWS)
    assert extra.var() == pytest.approx(variance, rel=VARIANCE_RTOL)
    assert extra.var() > 2 * mean  # a plain Poisson would give r̄
    assert extra.max() >= 5 * mean  # some draws far above the mean


def test_heavy_tail_draws_are_pinned_by_seed_and_step():
    a = _objective(5, recurrence_steps=3, depth_sampling="heavy_tail")
    b = _objective(5, recurrence_steps=3, depth_sampling="heavy_tail")
    draws = [a.depth_for_step(s) for s in range(12)]
    assert draws == [b.depth_for_step(s) for s in range(12)]
    assert draws == [3, 6, 7, 1, 1, 7, 6, 4, 9, 10, 2, 4]  # depth_mean None: r̄ = R = 3
    other = _objective(6, recurrence_steps=3, depth_sampling="heavy_tail")
    assert [other.depth_for_step(s) for s in range(12)] != draws


def test_heavy_tail_depth_is_capped():
    objective = _objective(depth_sampling="heavy_tail", depth_mean=200.0, depth_sigma=3.0)
    draws = [objective.depth_for_step(s) for s in range(2000)]
    assert max(draws) == MAX_RECURRENCE_STEPS and draws.count(MAX_RECURRENCE_STEPS) > 10
    # a rate beyond what numpy's Poisson accepts (~1e19) is the cap, not an error; no valid setting
    # reaches one but with odds ~1e-18 a step, so the clamp is exercised with an r̄ of 1e30 directly
    wild = SimpleNamespace(depth_sampling="heavy_tail", depth_sigma=1e-3, heavy_tail_mean=1e30)
    assert [draw_depth(wild, 0, s) for s in range(3)] == [MAX_RECURRENCE_STEPS] * 3


def test_the_draw_is_the_same_on_every_rank(monkeypatch):
    """What DDP ranks (and a resumed run) rely on: the depth depends on (seed, step) only, not on
    the rank, nor on the torch / numpy global streams (which differ per rank: training noise)."""
    config = model_config("rgpt", "test", depth_sampling="heavy_tail", depth_mean=8.0, backprop_steps=2)
    ranks = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        torch.manual_seed(100 + rank)
        np.random.seed(200 + rank)
        objective = build_objective(config, TrainConfig(seed=9))
        ranks.append([objective.depth_for_step(s) for s in range(300)])
    assert ranks[0] == ranks[1] == [draw_depth(config, 9, s) for s in range(300)]
    assert len(set(ranks[0])) > 5


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    (dict(depth_sampling="heavy"), "depth_sampling must be one of uniform, heavy_tail"),
    (dict(depth_sigma=0.0), "depth_sigma must be > 0"),
    (dict(depth_sigma=-1.0), "depth_sigma must be > 0"),
    (dict(depth_sigma=float("nan")), "depth_sigma must be a finite number"),
    (dict(depth_mean=0.5), "depth_mean must be in"),
    (dict(depth_mean=float(MAX_RECURRENCE_STEPS)), "depth_mean must be in"),
    (dict(backprop_steps=0), "backprop_steps must be in"),
    (dict(backprop_steps=2, truncate_steps=1), "set one of truncate_steps"),
    # past decoding's bound on steps (100,000 hung `train` and `plan`; 300 trained a depth no decode could run)
    (dict(recurrence_steps=MAX_RECURRENCE_STEPS + 1), "recurrence_steps must be in"),
])
def test_bad_settings_are_one_line_config_errors(override, message):
    with pytest.raises(ll.ConfigError, match=message) as error:
        model_config("rgpt", "test", **override)
    assert "\n" not in str(error.value)


def test_cli_sets_depth_sampling_for_rgpt_only(corpus, tmp_path, capsys):
    argv = ["train", "--preset", "test", "--data", f"text:{corpus}", "--steps", "1", "--no-progress",
            "--set", "depth_sampling=heavy_tail", "--set", "batch_size=2", "--set", "sequence_len=32"]
    assert main([*argv, "--arch", "gpt", "--out", str(tmp_path / "gpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "latentloop: error: unknown config field 'depth_sampling' in override 'depth_sampling=heavy_tail'"
    assert main([*argv, "--arch", "rgpt", "--out", str(tmp_path / "rgpt"), "--set", "backprop_steps=1"]) == 0
    saved = json.loads((tmp_path / "rgpt" / "config.json").read_text())["model"]
    assert (saved["depth_sampling"], saved["backprop_steps"], saved["depth_mean"]) == ("heavy_tail", 1, None)


# -- truncated backprop through the last k steps ----------------------------------------------------


def _grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()}


def _detached_reference(model, idx, y, steps: int, k: int):
    """By hand: r steps, the state detached after the first r - k (no gradient into them)."""
    ctx = model.context(idx, None, None)
    h_pre = model.run_blocks(model.embed(idx), ctx, model.prelude)
    h = h_pre
    for r in range(1, steps + 1):
        h, _, _ = model.recur(h, h_pre, ctx)
        if r == steps - k:
            h = h.detach()
    return token_cross_entropy(model.readout(model.run_blocks(h, ctx, model.coda)), y)


def test_backprop_steps_differentiates_only_the_last_k_steps():
    k = 2
    objective = _objective(depth_sampling="heavy_tail", recurrence_steps=4, backprop_steps=k)
    step = next(s for s in range(100) if objective.depth_for_step(s) >= k + 3)
    steps = objective.depth_for_step(step)
    assert objective.no_grad_steps(steps) == steps - k
    torch.manual_seed(0)
    model = build_model(objective.model_config).train()
    model.config.noise_std = 0.0  # the same forward in both computations
    idx, y = torch.randint(0, 256, (2, 12)), torch.randint(0, 256, (2, 12))
    truncated = _grads(model, objective(model, idx, y, step).loss)
    reference = _grads(model, _detached_reference(model, idx, y, steps, k))
    full = _grads(model, token_cross_entropy(model(idx, steps=steps).logits, y))
    for name in truncated:
        torch.testing.assert_close(truncated[name], reference[name], **GRAD_TOL, msg=name)
    core = [name for name in truncated if name.startswith("proj") or name.startswith("gate_")]
    assert core and all(not torch.allclose(truncated[n], full[n], **GRAD_TOL) for n in core)


def test_backprop_steps_at_least_the_depth_is_full_backprop():
    objective = _objective(depth_sampling="heavy_tail", recurrence_steps=4, backprop_steps=MAX_RECURRENCE_STEPS)
    step = next(s for s in range(100) if objective.depth_for_step(s) >= 3)
    steps = objective.depth_for_step(step)
    assert objective.no_grad_steps(steps) == 0
    torch.manual_seed(0)
    model = build_model(objective.model_config).train()
    model.config.noise_std = 0.0
    idx, y = torch.randint(0, 256, (2, 12)), torch.randint(0, 256, (2, 12))
    via_objective = _grads(model, objective(model, idx, y, step).loss)
    full = _grads(model, token_cross_entropy(model(idx, steps=steps).logits, y))
    for name in full:
        torch.testing.assert_close(via_objective[name], full[name], rtol=0, atol=0, msg=name)


# -- FLOPs charged by the depth run ---------------------------------------------------------------


def test_flops_are_charged_by_the_drawn_depth_without_the_no_grad_backward():
    """The closed form of test_rgpt's iso test: a forward at depth s costs 2 (depth x block + s x step +
    head + depth x attention) with depth = 2 + s; a training step at r with k steps of gradient costs
    forward(r) + 2 forward(min(k, r)) (the no-grad steps' backward never runs)."""
    k = 2
    shape = dict(n_embd=8, n_head=2, vocab_size=10, bos_id=0, sequence_len=4, n_pre=1, n_rec=1, n_coda=1)
    model = ll.build("rgpt", preset=None, recurrence_steps=3, **shape)
    config = model_config("rgpt", None, recurrence_steps=3, depth_sampling="heavy_tail", backprop_steps=k, **shape)
    objective = build_objective(config, TrainConfig(steps=40))
    block, step_cost, head, attention = 768, 320, 80, 32

    def forward(s: int) -> int:
        depth = 2 + s
        return 2 * (depth * block + s * step_cost + head + depth * attention)

    charged = []
    for step in range(40):
        r = objective.depth_for_step(step)
        charged.append(objective.flops_per_token(model, step))
        assert charged[-1] == pytest.approx(forward(r) + 2 * forward(min(k, r)), rel=1e-12), (step, r)
    depths = {objective.depth_for_step(s) for s in range(40)}
    assert min(depths) <= k < max(depths)  # both cases ran
    assert objective.flops_per_token(model, None) == pytest.approx(sum(charged) / len(charged), rel=1e-12)
    # uniform's truncate_steps follows the same rule: the first n steps' backward is not charged
    uniform = build_objective(model_config("rgpt", None, recurrence_steps=3, truncate_steps=1, **shape),
                              TrainConfig())
    for step in range(6):
        r = uniform.depth_for_step(step)
        expected = forward(r) + 2 * forward(r - min(1, r - 1))
        assert uniform.flops_per_token(model, step) == pytest.approx(expected, rel=1e-12)
    mean = sum(forward(r) + 2 * forward(r - min(1, r - 1)) for r in (1, 2, 3)) / 3
    assert uniform.flops_per_token(model, None) == pytest.approx(mean, rel=1e-12)


def test_a_long_heavy_tail_runs_depth_shares_come_from_draws_spread_over_it(monkeypatch):
    """The run average drew every step's depth: `plan --tokens 1e12` of a heavy-tailed rgpt (10^9
    steps) ran for hours. Past RUN_DEPTH_DRAWS steps, that many draws spread evenly over the run."""
    from latentloop.archs.rgpt import objective as rgpt_objective

    monkeypatch.setattr(rgpt_objective, "RUN_DEPTH_DRAWS", 100)
    drawn = []
    short, long = (_objective(steps=steps, depth_sampling="heavy_tail") for steps in (60, 10**9))
    draw = short.depth_for_step  # both runs' seed: one draw per step
    for objective in (short, long):
        monkeypatch.setattr(objective, "depth_for_step", lambda step: drawn.append(step) or draw(step))
    short_shares, long_shares = short._run_depth_shares, long._run_depth_shares
    assert drawn[:60] == list(range(60))  # a short run: every step
    spread = range(0, 10**9, 10**9 // 100)
    assert drawn[60:] == list(spread)
    for shares, steps in ((short_shares, range(60)), (long_shares, spread)):
        counts = Counter(draw(step) for step in steps)
        assert shares == pytest.approx({r: n / len(steps) for r, n in counts.items()}, rel=1e-12)


# -- resume ----------------------------------------------------------------------------------------

RESUME_STEPS = 4
# every step in the warmup, whose learning rate does not depend on the run's total steps, so that N / 2
# steps resumed to N is the run of N (as tests/test_contract.py)
SETTINGS = {"sequence_len": 32, "eval_every": 0, "eval_batches": 1, "log_every": 1, "save_every": RESUME_STEPS // 2,
            "warmup_steps": 2 * RESUME_STEPS, "depth_sampling": "heavy_tail", "depth_mean": 3.0,
            "backprop_steps": 2, "seed": 4}


def _train_argv(corpus, out, steps: int) -> list[str]:
    settings = [part for name, value in SETTINGS.items() for part in ("--set", f"{name}={value}")]
    return ["train", "--arch", "rgpt", "--preset", "test", "--data", f"text:{corpus}", "--steps", str(steps),
            "--batch-size", "2", "--lr", "1e-2", "--out", str(out), "--no-progress", *settings]


def _rows(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def test_heavy_tail_resume_is_bit_exact_and_logs_the_charged_flops(corpus, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(_train_argv(corpus, straight, RESUME_STEPS)) == 0
    assert main(_train_argv(corpus, resumed, RESUME_STEPS // 2)) == 0
    assert main(["train", "--out", str(resumed), "--resume", "--steps", str(RESUME_STEPS), "--no-progress"]) == 0
    expected = load_file(str(list_checkpoints(straight)[-1] / "model.safetensors"))
    got = load_file(str(list_checkpoints(resumed)[-1] / "model.safetensors"))
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    rows = _rows(straight)
    assert [(r["step"], r["loss"], r["steps"]) for r in _rows(resumed)] == [(r["step"], r["loss"], r["steps"])
                                                                             for r in rows]
    assert max(r["steps"] for r in rows) > SETTINGS["backprop_steps"]  # a truncated step ran
    config = RunConfig.from_dict(json.loads((straight / "config.json").read_text()))
    model, objective = build_model(config.model), build_objective(config.model, config.train)
    total = 0.0
    for row in rows:
        total += objective.flops_per_token(model, row["step"] - 1) * rows[0]["tokens"]
        assert row["flops"] == pytest.approx(total, rel=1e-9), row["step"]
