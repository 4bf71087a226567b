"""RecurrentGPT: cache exactness, the g = 1 reduction, noise, early-exit cache rule, depth sampling,
truncated backprop, iso shapes and FLOPs."""

import json

import numpy as np
import pytest
import torch

import latentloop as ll
from latentloop.archs import build_objective
from latentloop.archs.rgpt.model import rgpt_shape_from_dense
from latentloop.cli import main
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.engine import row_info
from latentloop.objectives import token_cross_entropy
from latentloop.train import fit, setup

TOL = 1e-5  # fp32 max abs logit difference between two exact paths


def _model(**overrides):
    torch.manual_seed(0)
    return ll.build("rgpt", preset="test", n_layer=4, recurrence_steps=3, **overrides).eval()


@torch.no_grad()
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_cached_full_decoding_equals_uncached_forward(steps):
    model = _model(n_kv_head=2)
    idx = torch.randint(0, 256, (2, 14))
    full = model(idx, steps=steps).logits
    cache = model.new_cache(2, 14, steps=steps)
    pieces = [model.prefill(idx[:, :6], cache, steps=steps).logits]
    pieces += [model.decode(idx[:, t:t + 1], cache, steps=steps).logits for t in range(6, 14)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=TOL)


def test_generation_cached_equals_uncached_and_reports_depth():
    model = _model()
    prompts = [[256, 5, 6, 7], [256, 9]]
    for steps in (None, 2):
        assert ll.generate(model, prompts, 8, temperature=0.0, steps=steps) == \
            ll.generate(model, prompts, 8, temperature=0.0, steps=steps, use_cache=False)
    info = list(ll.stream(model, prompts, 3, temperature=0.0, steps=5))[-1].info
    assert info["beyond_trained"] and info["trained_steps"] == 3
    for mode in ("mean", "last"):
        assert len(ll.generate(model, prompts, 6, temperature=0.0, cache_mode=mode)[0]) == 6
    with pytest.raises(ll.ConfigError, match="cache_mode"):
        ll.generate(model, prompts, 2, cache_mode="half")
    with pytest.raises(ll.ConfigError, match="exit_threshold=0.1 needs the cache"):
        ll.generate(model, prompts, 2, exit_threshold=0.1, use_cache=False)


@torch.no_grad()
def test_gate_fixed_at_one_reduces_to_prelude_then_coda():
    model = _model()
    model.gate_out.bias.fill_(1e4)  # sigmoid saturates to exactly 1 in fp32
    idx = torch.randint(0, 256, (2, 10))
    ctx = model.context(idx, None, None)
    x = model.embed(idx)
    for block in list(model.prelude) + list(model.coda):
        x = block(x, ctx)
    torch.testing.assert_close(model(idx).logits, model.readout(x), rtol=0, atol=TOL)


def test_noise_only_in_training():
    model = _model()
    idx = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        assert torch.equal(model(idx).logits, model(idx).logits)
        model.train()
        assert not torch.equal(model(idx).logits, model(idx).logits)
        model.config.noise_std = 0.0
        assert torch.equal(model(idx).logits, model(idx).logits)


@torch.no_grad()
def test_early_exit_cache_rule_repeats_the_last_computed_step():
    model = _model()
    cache = model.new_cache(2, 8)
    model.prefill(torch.tensor([[256, 4, 5], [256, 6, 7]]), cache)
    # a huge state threshold makes every row stop after its first step
    model.decode(torch.tensor([[8], [9]]), cache, exit_threshold=1e9, exit_criterion="state")
    pos, n_pre, n_rec = 3, model.config.n_pre, model.config.n_rec
    for step in (2, 3):
        for j in range(n_rec):
            first, later = n_pre + j, n_pre + (step - 1) * n_rec + j
            assert torch.equal(cache.k[later, :, :, pos], cache.k[first, :, :, pos])
            assert torch.equal(cache.v[later, :, :, pos], cache.v[first, :, :, pos])
    assert cache.stats["rgpt.exit_steps"] == [1, 1]
    # a token that ran every step keeps distinct keys per step
    assert not torch.equal(cache.k[n_pre + n_rec, :, :, 2], cache.k[n_pre, :, :, 2])


def test_cache_memory_per_mode():
    model = _model()
    sizes = {mode: model.new_cache(1, 32, cache_mode=mode).memory_bytes() for mode in ("full", "mean", "last")}
    slots_full = 1 + 2 * 3 + 1
    slots_shared = 1 + 2 + 1
    assert sizes["mean"] == sizes["last"] < sizes["full"]
    kv_per_slot = 2 * 1 * 4 * 32 * 16 * 4  # k and v, B=1, H=4, L=32, hd=16, fp32
    assert sizes["full"] - sizes["mean"] == (slots_full - slots_shared) * kv_per_slot


def test_depth_sampling_is_uniform_and_seeded():
    objective = build_objective(model_config("rgpt", "test", recurrence_steps=4), TrainConfig(seed=5))
    draws = np.array([objective.depth_for_step(s) for s in range(4000)])
    assert set(draws) == {1, 2, 3, 4}
    assert all(abs((draws == r).mean() - 0.25) < 0.03 for r in range(1, 5))
    # drawn from (seed, step) alone: pinned, the same in a second objective, another with another seed
    assert draws[12:24].tolist() == [4, 3, 2, 4, 4, 3, 1, 2, 3, 3, 4, 2]
    again = build_objective(model_config("rgpt", "test", recurrence_steps=4), TrainConfig(seed=5))
    assert [again.depth_for_step(s) for s in range(23, 11, -1)] == draws[12:24].tolist()[::-1]
    other = build_objective(model_config("rgpt", "test", recurrence_steps=4), TrainConfig(seed=6))
    assert [other.depth_for_step(s) for s in range(12, 24)] != draws[12:24].tolist()


def test_truncated_backprop_only_differentiates_the_last_steps():
    torch.manual_seed(0)
    model = ll.build("rgpt", preset="test", n_layer=4, recurrence_steps=3, noise_std=0.0)
    idx, y = torch.randint(0, 256, (2, 10)), torch.randint(0, 256, (2, 10))
    loss = token_cross_entropy(model(idx, steps=3, no_grad_steps=2).logits, y)
    truncated = torch.autograd.grad(loss, model.proj.weight)[0]
    # by hand: two steps without gradient, then one with
    ctx = model.context(idx, None, None)
    h_pre = model.run_blocks(model.embed(idx), ctx, model.prelude)
    with torch.no_grad():
        h = h_pre
        for _ in range(2):
            h, _, _ = model.recur(h, h_pre, ctx)
    h, _, _ = model.recur(h, h_pre, ctx)
    manual = torch.autograd.grad(token_cross_entropy(model.readout(model.run_blocks(h, ctx, model.coda)), y),
                                 model.proj.weight)[0]
    full = torch.autograd.grad(token_cross_entropy(model(idx, steps=3).logits, y), model.proj.weight)[0]
    assert torch.allclose(truncated, manual, atol=1e-6)
    assert not torch.allclose(truncated, full, atol=1e-6)


def test_iso_shapes_and_flops():
    assert rgpt_shape_from_dense(12, "flops", 4) == dict(n_pre=2, n_rec=2, n_coda=2, recurrence_steps=4)
    assert rgpt_shape_from_dense(12, "params", 4) == dict(n_pre=1, n_rec=10, n_coda=1, recurrence_steps=4)
    model = ll.build("rgpt", preset=None, n_embd=8, n_head=2, vocab_size=10, bos_id=0, sequence_len=4,
                     n_pre=1, n_rec=1, n_coda=1, recurrence_steps=2)
    block = 4 * 8 * 8 + 2 * 8 * 32  # qkv + out, MLP up + down: 768 multiply-adds
    step = 16 * 8 + 16 * 8 + 8 * 8  # proj, gate_in, gate_out: 320 (bias adds are not multiply-adds)
    head = 10 * 8
    attention = 2 * 8 * 2  # QK^T and AV over an average context of 2, per block application
    for steps in (1, 2, 3):
        depth = 2 + steps
        expected = 3 * 2 * (depth * block + steps * step + head + depth * attention)
        assert model.flops_per_token(4, steps=steps) == expected


def test_iso_flops_is_exact_or_refuses_naming_the_nearest_exact_shape(tiny_corpus, tmp_path, capsys):
    """Every dense depth >= R gets n_pre + n_rec x R + n_coda == the dense depth exactly (a prelude
    and coda of >= 1 block when the core still fits R times); below R the refusal names shapes
    that are exact, and those shapes are."""
    for dense in range(1, 25):
        for steps in range(1, 7):
            if dense < steps:
                with pytest.raises(ll.ConfigError, match=f"--set recurrence_steps={dense} .*--set n_layer={steps}"):
                    rgpt_shape_from_dense(dense, "flops", steps)
                assert rgpt_shape_from_dense(dense, "flops", dense)["n_rec"] == 1
                continue
            shape = rgpt_shape_from_dense(dense, "flops", steps)
            assert shape["n_pre"] + shape["n_rec"] * steps + shape["n_coda"] == dense, (dense, steps)
            assert shape["n_rec"] >= 1 and (min(shape["n_pre"], shape["n_coda"]) >= 1) == (dense - 2 >= steps)
            params = rgpt_shape_from_dense(dense, "params", steps)
            assert params["n_pre"] + params["n_rec"] + params["n_coda"] == dense
    argv = ["train", "--arch", "rgpt", "--preset", "test", "--iso", "flops", "--data", f"text:{tiny_corpus}",
            "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress", "--set", "n_layer=2", "--set",
            "recurrence_steps=4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nearest exact shapes: --set recurrence_steps=2" in err[0], err
    assert not (tmp_path / "run").exists()


def test_an_iso_run_resumes_with_the_command_that_made_it(tiny_corpus, tmp_path, capsys):
    """"The same command plus --resume" reshaped the saved (already iso-shaped) config again, and the
    preset check compared the preset's dense depth with the run's: exit 2 either way (12-07 review)."""
    argv = ["train", "--arch", "rgpt", "--preset", "test", "--iso", "flops", "--data", f"text:{tiny_corpus}",
            "--out", str(tmp_path / "run"), "--no-progress", "--set", "recurrence_steps=2", "--batch-size", "2"]
    assert main([*argv, "--steps", "1"]) == 0
    shape = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    capsys.readouterr()
    assert main([*argv, "--steps", "2", "--resume"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"] == shape
    assert "--iso flops shapes a run when it starts: the resumed run keeps the shape" in capsys.readouterr().err
    # from a --config file, whose shape is the dense one, as when the run started
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"model:\n  arch: rgpt\n  preset: test\n  recurrence_steps: 2\ntrain:\n  batch_size: 2\n"
                           f"  steps: 1\ndata:\n  source: text:{tiny_corpus}\n")
    by_file = ["train", "--config", str(config_file), "--iso", "flops", "--out", str(tmp_path / "by-file"),
               "--no-progress"]
    assert main(by_file) == 0
    assert main([*by_file, "--steps", "2", "--resume"]) == 0, capsys.readouterr().err


def test_eval_generate_cli(tiny_run, tiny_corpus, capsys):
    run, corpus = tiny_run("rgpt"), tiny_corpus  # trained at the default R = 4: --steps 5 is beyond it
    capsys.readouterr()
    bpb = []
    for steps in ("1", "3"):
        assert main(["eval", str(run), "--json", "--batches", "1", "--data", f"text:{corpus}", "--steps", steps]) == 0
        bpb.append(json.loads(capsys.readouterr().out)["bpb"])
    assert bpb[0] != bpb[1]
    assert main(["generate", str(run), "--prompt", "ab", "--max-new-tokens", "3", "--steps", "5", "--json",
                 "--exit-threshold", "0.5", "--cache-mode", "mean"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["beyond_trained"] is True and 1 <= out["mean_exit_steps"] <= 5


def test_adaptive_exit_reports_each_rows_own_mean_depth():
    """In a batch, each row's mean exit depth is its own (as alone), not the batch's mean."""
    model = _model()
    prompts = [[256, 4, 5, 6], [256, 7], [256, 1, 2, 3, 9, 9]]
    options = dict(temperature=0.0, exit_threshold=0.02, exit_criterion="state", steps=4)
    batch = list(ll.stream(model, prompts, 6, **options))[-1].info
    alone = [list(ll.stream(model, p, 6, **options))[-1].info["mean_exit_steps"] for p in prompts]
    assert [row_info(batch, row)["mean_exit_steps"] for row in range(3)] == pytest.approx(alone)
    assert batch["mean_exit_steps"] == pytest.approx(sum(alone) / 3)


def test_default_gate_bias_lets_gates_learn_and_the_paper_init_stays_available():
    assert model_config("rgpt", "test").gate_bias_init == 0.0
    paper = ll.build("rgpt", preset="test", gate_bias_init=4.0)
    assert paper.gate_out.bias.detach().eq(4.0).all()


def test_openness_is_recorded_on_the_device_every_step_and_logged_on_log_steps(corpus, tmp_path):
    """Every training step records the gates (on the device: one graph per depth, whether the step is
    logged or not); only the logged steps read them back into metrics.jsonl."""
    config = RunConfig(model=model_config("rgpt", "test", sequence_len=32, recurrence_steps=3),
                       train=TrainConfig(steps=5, batch_size=2, eval_every=0, eval_batches=1, log_every=2,
                                         warmup_steps=1),
                       data=DataConfig(source=f"text:{corpus}"))
    state = setup(config, tmp_path / "run", progress=False)
    calls = []
    forward = state.model.forward

    def spy(*args, **kwargs):
        if state.model.training:  # validation forwards are not training steps
            calls.append(kwargs.get("record_gates", False))
        return forward(*args, **kwargs)

    state.model.forward = spy
    fit(state, progress=False)
    assert calls == [True] * 5
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "loss" in row]
    assert [row["step"] for row in logged] == [2, 4, 5]
    for row in logged:
        steps = row["steps"]
        assert all(f"openness_r{r}" in row and f"gate_mean_r{r}" in row for r in range(1, steps + 1))
        assert all(0 < row[f"gate_mean_r{r}"] < 1 and row[f"openness_r{r}"] > 0 for r in range(1, steps + 1))


def test_recording_the_gates_keeps_a_compiled_forward_one_graph():
    """A logging step's forward (`record_gates`) traces as one graph (`fullgraph`: a break raises),
    as `train.compile_scope=whole` compiles it, and records what the eager forward records. Reading
    a gate as a float inside the forward broke the graph at every recurrence step."""
    torch.manual_seed(0)
    model = ll.build("rgpt", preset="test", sequence_len=16, recurrence_steps=3).train()
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    torch.manual_seed(1)  # training noise drawn the same on both paths
    eager = model(x, steps=3, no_grad_steps=1, record_gates=True)
    torch.manual_seed(1)
    traced = torch.compile(model, fullgraph=True, backend="eager")(x, steps=3, no_grad_steps=1, record_gates=True)
    assert len(eager.gate_means) == len(eager.openness) == 3
    for name in ("gate_means", "openness"):
        torch.testing.assert_close(torch.stack(getattr(traced, name)), torch.stack(getattr(eager, name)),
                                   rtol=0, atol=TOL)
    torch.testing.assert_close(traced.logits, eager.logits, rtol=0, atol=TOL)
