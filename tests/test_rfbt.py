"""rfbt, rgpt's depth with fbt's feedback: what is its own beyond the contract suite (tests/test_contract.py
runs it through every front-end). Its parents' exactness, at every depth: the Jacobi fixed point of
the passes equals sequential soft decoding, and its standard regime is rgpt's stack itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from latentloop.archs import build_model, build_objective
from latentloop.config import TrainConfig, model_config
from latentloop.engine import teacher_forced_logits
from latentloop.errors import ConfigError

# fp32 rounding of the same operations grouped differently (T multi-pass forwards against the cache's
# one-token steps, each through R core steps): at most 1.9e-5 measured on logits of size ~5 (steps 1-4);
# a wrong state moves them by ~5 (two passes instead of the fixed point, asserted below)
EXACT_TOL = 1e-4
R = 3


def _model(**overrides):
    torch.manual_seed(0)
    return build_model(model_config("rfbt", "test", n_layer=3, recurrence_steps=R, **overrides)).eval()


def _tokens(model, length: int = 12) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 256, (2, length), generator=generator)
    rows[:, 0] = model.config.bos_id
    return rows


def test_the_config_validates_both_parents_fields():
    config = model_config("rfbt", "test", n_layer=3, recurrence_steps=2, jitter=0.0)
    assert (config.n_pre, config.n_rec, config.n_coda, config.recurrence_steps) == (1, 1, 1, 2)
    assert config.tie_embeddings  # fbt's default: the carried state lives in embedding space
    with pytest.raises(ConfigError, match="jitter"):
        model_config("rfbt", "test", jitter=-1.0)
    with pytest.raises(ConfigError, match="recurrence_steps"):
        model_config("rfbt", "test", recurrence_steps=0)


@torch.no_grad()
@pytest.mark.parametrize("steps", [1, 2, R, R + 1])
def test_the_fixed_point_of_the_passes_is_sequential_soft_decoding_at_every_depth(steps):
    """After T passes at depth r every position's input is fused with its predecessor's final state
    at depth r: exactly what the cache's one-token soft steps compute (prompt = the first token)."""
    model = _model()
    idx = _tokens(model)
    fixed_point = model(idx, passes=idx.shape[1], steps=steps).logits
    sequential = teacher_forced_logits(model, idx, regime="soft", steps=steps)
    torch.testing.assert_close(fixed_point, sequential, rtol=0, atol=EXACT_TOL)
    fewer = model(idx, passes=2, steps=steps).logits  # not yet the fixed point: the check can fail
    assert (fewer - sequential).abs().max() > 100 * EXACT_TOL


@torch.no_grad()
@pytest.mark.parametrize("steps", [1, R])
def test_the_standard_regime_is_rgpts_stack_with_the_same_weights(steps):
    """Plain inputs: rfbt's stack is rgpt's, so an rgpt holding rfbt's tensors (less the fusion)
    gives the same logits, cached and uncached."""
    model = _model()
    idx = _tokens(model)
    fields = {k: v for k, v in model.config.to_dict().items() if k in {f for f in model_config("rgpt").to_dict()}}
    fields.pop("arch")
    rgpt = build_model(model_config("rgpt", None, **fields)).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("fuse_")}
    rgpt.load_state_dict(state, strict=True)
    expected = rgpt(idx, steps=steps).logits
    torch.testing.assert_close(model.reference(idx, regime="standard", steps=steps).logits, expected, rtol=0, atol=0)
    torch.testing.assert_close(teacher_forced_logits(model, idx, regime="standard", steps=steps), expected,
                               rtol=0, atol=EXACT_TOL)


def test_the_objective_draws_passes_and_depth_independently_and_charges_both():
    config = model_config("rfbt", "test", n_layer=3, recurrence_steps=4)
    objective = build_objective(config, TrainConfig(steps=400, seed=7))
    draws = np.array([(objective.passes_for_step(s), objective.forward_options(s)["steps"]) for s in range(400)])
    assert set(draws[:, 0]) == {2, 3} and set(draws[:, 1]) == {1, 2, 3, 4}  # the short recipe; Uniform{1..4}
    # independent streams: each depth appears with both pass counts, in roughly its share
    for depth in range(1, 5):
        assert {2, 3} <= set(draws[draws[:, 1] == depth, 0])
    assert abs(np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]) < 0.15  # |r| of 400 independent pairs: sd 0.05
    again = build_objective(config, TrainConfig(steps=400, seed=7))  # a resumed run or another rank
    assert [again.forward_options(s)["steps"] for s in range(400)] == draws[:, 1].tolist()
    mix = objective.forward_mix()
    assert sum(weight for weight, _ in mix) == pytest.approx(1.0)
    drawn = {(kw["passes"], kw["steps"]) for weight, kw in mix if weight > 0}
    assert drawn == {(K, r) for K in (2, 3) for r in range(1, 5)}
    model = build_model(config)
    deeper = model.flops_per_token(passes=2, return_passes=True, steps=4)
    assert deeper > model.flops_per_token(passes=2, return_passes=True, steps=1)  # the depth is charged


def test_a_training_step_reaches_the_fusion_and_the_gate():
    config = model_config("rfbt", "test", n_layer=3, recurrence_steps=2)
    model = build_model(config).train()
    objective = build_objective(config, TrainConfig(steps=10, seed=0))
    x = _tokens(model, 16)
    result = objective(model, x[:, :-1], x[:, 1:], step=0)
    result.loss.backward()
    assert result.metrics["passes"] >= 2 and "steps" in result.metrics
    for name in ("fuse_value.weight", "fuse_gate.weight", "gate_out.bias", "proj.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
