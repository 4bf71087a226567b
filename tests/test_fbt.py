"""Full-bandwidth transformer: Jacobi exactness, regimes, cache agreement, objective, init."""

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import latentloop as ll
from latentloop.archs import build_objective, get_arch, offering
from latentloop.archs.fbt.model import per_batch_mix
from latentloop.archs.fbt.objective import document_prefix_mask
from latentloop.cli import main
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.engine import teacher_forced_logits
from latentloop.eval.loss import score_curve
from latentloop.models.backbone import shift_right
from latentloop.objectives import token_cross_entropy
from latentloop.train import fit, setup

TOL = 1e-5  # fp32 max abs logit difference between two exact paths


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ll.build("fbt", preset="test").eval()


def sequential_reference(model, idx, fuse_from=1):
    """Token by token without a cache: every fused input uses the state its predecessor produced."""
    e = model.embed(idx)
    inputs = e[:, :1]
    for t in range(1, idx.shape[1]):
        h = model.run_blocks(inputs, model.context(idx[:, :t], None, None))
        nxt = model.fuse(e[:, t:t + 1], model.carried_state(h[:, -1:])) if t >= fuse_from else e[:, t:t + 1]
        inputs = torch.cat([inputs, nxt], dim=1)
    return model.readout(model.run_blocks(inputs, model.context(idx, None, None)))


@torch.no_grad()
@pytest.mark.parametrize("T, dtype, tol", [(8, torch.float32, TOL), (16, torch.float64, 1e-10)])
def test_parallel_passes_are_a_jacobi_iteration_exact_after_T_passes(T, dtype, tol):
    """fp32 rounding differences are amplified along the recurrence (~1e-5 after 12 steps at init),
    so the long chain is checked in float64, where the two paths agree to 1e-10."""
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test").eval().to(dtype)
    idx = torch.randint(0, 256, (2, T))
    reference = sequential_reference(model, idx)
    torch.testing.assert_close(model(idx, passes=T).logits, reference, rtol=0, atol=tol)
    assert (model(idx, passes=T - 3).logits - reference).abs().max().item() > 1e-3  # K < T: not exact
    # soft evaluation (cached, token by token) is the same recurrence
    torch.testing.assert_close(teacher_forced_logits(model, idx, regime="soft"), reference, rtol=0, atol=tol)


@torch.no_grad()
def test_soft_teacher_forcing_equals_multipass_with_fuse_from(model):
    prompt, continuation = torch.randint(0, 256, (2, 7)), torch.randint(0, 256, (2, 6))
    cache = model.new_cache(2, 13)
    first = model.prefill(prompt, cache, regime="soft")  # plain prefill
    decoded = model.decode(continuation, cache, regime="soft")  # latent-feedback decode, teacher-forced
    stepped = torch.cat([first.logits, decoded.logits], dim=1)
    full = torch.cat([prompt, continuation], dim=1)
    parallel = model(full, passes=continuation.shape[1] + 1, fuse_from=7).logits
    torch.testing.assert_close(stepped, parallel, rtol=0, atol=TOL)
    torch.testing.assert_close(stepped, sequential_reference(model, full, fuse_from=7), rtol=0, atol=TOL)


@pytest.mark.parametrize("regime, passes", [("standard", None), ("soft", None), ("fused", None), ("fused", 3),
                                            ("fused", "auto")])
def test_cached_and_uncached_decoding_agree_in_every_regime(model, regime, passes):
    prompts = [[256, 5, 6, 7, 8], [256, 9], [256, 40, 41, 42]]
    steps = list(ll.stream(model, prompts, 10, temperature=0.0, regime=regime, passes=passes))
    info = steps[-1].info
    cached = [[s.tokens[row] for s in steps if s.tokens[row] is not None] for row in range(len(prompts))]
    assert cached == ll.generate(model, prompts, 10, temperature=0.0, regime=regime, passes=passes, use_cache=False)
    assert cached == [ll.generate(model, p, 10, temperature=0.0, regime=regime, passes=passes) for p in prompts]
    if regime == "fused":
        if passes != "auto":  # "auto" is tested against its criterion in test_decoding_protocol.py
            assert info["prefill_passes"] == (passes if isinstance(passes, int) else 2)


def test_regimes_differ_and_options_are_checked(model):
    prompt = [256, 10, 11, 12, 13, 14]
    outputs = {r: ll.generate(model, prompt, 12, temperature=0.0, regime=r) for r in ("standard", "soft")}
    assert outputs["standard"] != outputs["soft"]
    with pytest.raises(ll.ConfigError, match="regime"):
        ll.generate(model, prompt, 4, regime="hard")
    with pytest.raises(ll.ConfigError, match="passes"):
        ll.generate(model, prompt, 4, regime="fused", passes=0)
    with pytest.raises(ll.ConfigError, match="fused"):
        ll.generate(model, prompt, 4, regime="soft", passes=2)


def test_config_and_parameters():
    with pytest.raises(ll.ConfigError, match="pass_mix"):
        model_config("fbt", "test", pass_mix=(0.5, 0.4))
    fbt, gpt = ll.build("fbt", preset="test"), ll.build("gpt", preset="test", tie_embeddings=True)
    assert fbt.num_params() - gpt.num_params() == 2 * 64 * 64  # only W_U and W_G are new


@pytest.mark.parametrize("depth", [2, 12, 48])
def test_fed_back_state_stays_bounded_with_depth(depth):
    torch.manual_seed(depth)
    model = ll.build("fbt", preset="test", n_layer=depth, n_embd=128, state_source="pre_norm").eval()
    with torch.no_grad():
        states = model(torch.randint(0, 256, (4, 48)), passes=3, return_passes=True).pass_hidden
    for h in states:
        rms = h.pow(2).mean().sqrt().item()
        assert 0.8 < rms < 2.5, f"pass state RMS {rms:.3f} at depth {depth}"


def test_jitter_only_in_training():
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test")
    idx = torch.randint(0, 256, (2, 16))
    model.train()
    assert not torch.equal(model(idx, passes=2).logits, model(idx, passes=2).logits)
    model.eval()
    assert torch.equal(model(idx, passes=2).logits, model(idx, passes=2).logits)
    model.config.jitter = 0.0
    model.train()
    assert torch.equal(model(idx, passes=2).logits, model(idx, passes=2).logits)


def test_default_recipe_starts_feedback_at_once():
    objective = build_objective(model_config("fbt", "test"), TrainConfig(steps=4000, seed=3))
    draws = np.array([objective.passes_for_step(s) for s in range(4000)])
    assert set(draws.tolist()) == {2, 3}  # "short": every batch multi-pass from step 0
    assert abs((draws == 3).mean() - 0.5) < 0.03  # 50/50 two-/three-pass
    # drawn from (seed, step) alone: pinned, the same in a second objective, another with another seed
    assert draws[3000:3012].tolist() == [2, 2, 2, 2, 2, 3, 3, 2, 3, 2, 2, 2]
    again = build_objective(model_config("fbt", "test"), TrainConfig(steps=4000, seed=3))
    assert [again.passes_for_step(s) for s in range(3012, 2999, -1)] == draws[3000:3013].tolist()[::-1]
    other = build_objective(model_config("fbt", "test"), TrainConfig(steps=4000, seed=4))
    assert [other.passes_for_step(s) for s in range(3000, 3012)] != draws[3000:3012].tolist()
    assert objective.expected_passes() == pytest.approx(2 * 0.5 + 3 * 0.5)


def test_paper_recipe_gives_the_whole_run_mix():
    cfg = model_config("fbt", "test", recipe="paper")
    assert cfg.feedback_start == 0.75 and cfg.run_mix == (0.75, 0.22, 0.03)
    objective = build_objective(cfg, TrainConfig(steps=8000, seed=3))
    draws = np.array([objective.passes_for_step(s) for s in range(8000)])
    assert set(draws[:6000].tolist()) == {1}  # single-pass before the start
    assert set(draws[6000:].tolist()) == {2, 3}  # after it, every batch feeds back (88/12)
    freq = [(draws == k).mean() for k in (1, 2, 3)]  # over the whole run: the paper's 75/22/3
    assert freq[0] == pytest.approx(0.75) and abs(freq[1] - 0.22) < 0.015 and abs(freq[2] - 0.03) < 0.015
    assert objective.expected_passes() == pytest.approx(0.75 + 2 * 0.22 + 3 * 0.03)  # the paper's 1.28x


def test_loss_lambda_comes_from_the_recipe_unless_given():
    # short: the deeper passes weighted 1.5 (issue 25's fused bound); paper: 1.0; a saved config's
    # explicit value (older runs wrote 1.0) is kept, so they train as before
    assert model_config("fbt", "test").loss_lambda == 1.5
    assert model_config("rfbt", "test").loss_lambda == 1.5
    assert model_config("fbt", "test", recipe="paper").loss_lambda == 1.0
    assert model_config("fbt", "test", loss_lambda=1.0).loss_lambda == 1.0
    with pytest.raises(ll.ConfigError, match="loss_lambda"):
        model_config("fbt", "test", loss_lambda=-1.0)


def test_schedule_follows_the_run_length_set_after_building_the_objective():
    train = TrainConfig(steps=1_000_000)
    objective = build_objective(model_config("fbt", "test", recipe="paper"), train)
    train.steps = 800  # as the demo does once it has timed a few steps
    assert objective.passes_for_step(599) == 1 and objective.passes_for_step(600) in (2, 3)


def test_per_batch_mix_conversion():
    assert per_batch_mix((0.75, 0.22, 0.03), 0.75) == pytest.approx((0.0, 0.88, 0.12))
    assert per_batch_mix((0.75, 0.22, 0.03), 0.5) == pytest.approx((0.5, 0.44, 0.06))
    assert per_batch_mix((0.75, 0.22, 0.03), 0.0) == pytest.approx((0.75, 0.22, 0.03))
    with pytest.raises(ll.ConfigError, match="feedback_start"):
        per_batch_mix((0.75, 0.22, 0.03), 0.8)  # more single-pass steps before the start than the run has
    # a start given as a step converts with the run's length: 600 of 800 steps = 0.75
    cfg = model_config("fbt", "test", feedback_start=600, run_mix=(0.75, 0.22, 0.03))
    assert cfg.batch_mix(800) == pytest.approx((0.0, 0.88, 0.12))
    assert build_objective(cfg, TrainConfig(steps=800)).passes_for_step(599) == 1


def test_recipe_config_errors():
    with pytest.raises(ll.ConfigError, match="recipe"):
        model_config("fbt", "test", recipe="long")
    with pytest.raises(ll.ConfigError, match="not both"):
        model_config("fbt", "test", pass_mix=(0.0, 1.0), run_mix=(0.5, 0.5))
    with pytest.raises(ll.ConfigError, match="run_mix"):
        model_config("fbt", "test", feedback_start=0.9, run_mix=(0.75, 0.22, 0.03))
    with pytest.raises(ll.ConfigError, match="run_mix"):
        model_config("fbt", "test", run_mix=(0.5, 0.4))
    with pytest.raises(ll.ConfigError, match="feedback_start"):
        model_config("fbt", "test", feedback_start=2.5)
    with pytest.raises(ll.ConfigError, match="feedback_start"):
        model_config("fbt", "test", feedback_start=-0.1)
    with pytest.raises(ll.ConfigError, match="not both"):
        model_config("fbt", "test", plain_fraction=0.5, feedback_start=0.2)
    with pytest.raises(ll.ConfigError, match="plain_fraction"):
        model_config("fbt", "test", plain_fraction=1.5)


def test_old_config_with_plain_fraction_loads_and_trains_as_before(tmp_path):
    old = {"model": {"arch": "fbt", "preset": "test", "plain_fraction": 0.5, "pass_mix": [0.75, 0.22, 0.03]},
           "train": {"steps": 4000, "seed": 3}, "data": {}}
    cfg = RunConfig.from_dict(old)
    assert cfg.model.feedback_start == 0.5 and cfg.model.pass_mix == (0.75, 0.22, 0.03)
    objective = build_objective(cfg.model, cfg.train)
    assert {objective.passes_for_step(s) for s in range(2000)} == {1}
    draws = np.array([objective.passes_for_step(s) for s in range(2000, 4000)])
    freq = [(draws == k).mean() for k in (1, 2, 3)]
    assert abs(freq[0] - 0.75) < 0.04 and abs(freq[1] - 0.22) < 0.04 and 0.01 < freq[2] < 0.06
    assert objective.expected_passes() == pytest.approx(0.5 + 0.5 * (0.75 + 2 * 0.22 + 3 * 0.03))
    # the resolved config round-trips through config.json
    cfg.save_json(tmp_path / "config.json")
    again = RunConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert again.model.to_dict() == cfg.model.to_dict()
    for recipe in ("short", "paper"):  # and so do the new recipes
        fresh = RunConfig(model=model_config("fbt", "test", recipe=recipe))
        assert RunConfig.from_dict(fresh.to_dict()).model.to_dict() == fresh.model.to_dict()


def test_prefix_is_drawn_afresh_per_pass():
    cfg = model_config("fbt", "test", feedback_start=0.0, pass_mix=(0.0, 0.0, 1.0), jitter=0.0)
    model = ll.build("fbt", preset="test", jitter=0.0)
    seen = []
    original = model.multipass

    def spy(idx, ctx, passes, mask, **kwargs):
        seen.append(mask)
        return original(idx, ctx, passes, mask, **kwargs)

    model.multipass = spy
    x = torch.full((8, 64), 5)
    x[:, 0] = 256
    build_objective(cfg, TrainConfig(steps=10))(model, x, x, step=0)
    masks = seen[0]
    assert isinstance(masks, list) and len(masks) == 2  # passes 2 and 3
    assert not torch.equal(masks[0], masks[1])


def test_per_pass_masks_match_single_mask_when_equal(model):
    idx = torch.randint(0, 256, (2, 24))
    mask = torch.rand(2, 24) > 0.3
    with torch.no_grad():
        one = model(idx, passes=3, fuse_mask=mask).logits
        listed = model(idx, passes=3, fuse_mask=[mask, mask]).logits
        # a different second-pass mask changes the output: the list is really used per pass
        other = model(idx, passes=3, fuse_mask=[mask, torch.zeros_like(mask)]).logits
    torch.testing.assert_close(listed, one, rtol=0, atol=0)  # the same computation, bit for bit
    assert (other - one).abs().max() > 1e-3
    with pytest.raises(ll.ConfigError, match="passes - 1"):
        model(idx, passes=3, fuse_mask=[mask])


@pytest.mark.parametrize("arch", offering("passes_curve"))
def test_passes_curve_matches_the_fused_forward(arch):
    """Every arch whose spec offers the curve (fbt, rfbt): each point is the K-pass fused forward's
    loss over the batches, and the fixed point (K = T) the sequential recurrence's."""
    torch.manual_seed(0)
    model = ll.build(arch, preset="test").eval()
    tokens = np.random.default_rng(0).integers(0, 256, 2000)
    byte_lengths = np.ones(259, dtype=np.int64)
    curve = score_curve(model, get_arch(arch).curves["passes_curve"], tokens, byte_lengths, 2, 32, max_batches=1)
    assert list(curve) == ["K=1", "K=2", "K=3", "K=4", "K=8", "K=16", "fixed_point"]
    x = torch.as_tensor(tokens[:33]).view(1, 33)
    x2 = torch.as_tensor(tokens[32:65]).view(1, 33)
    batch, target = torch.cat([x[:, :-1], x2[:, :-1]]), torch.cat([x[:, 1:], x2[:, 1:]])
    assert all(point["tokens"] == target.numel() for point in curve.values())
    with torch.no_grad():
        for k in (1, 2, 16):
            expected = token_cross_entropy(model(batch, passes=k).logits, target).item()
            assert curve[f"K={k}"]["loss"] == pytest.approx(expected, rel=1e-5)
            # every target stands for one byte here: BPB is the loss in bits
            assert curve[f"K={k}"]["bpb"] == pytest.approx(expected / math.log(2), rel=1e-5)
        # T passes = the sequential recurrence: the cached soft decoding, token by token
        exact = token_cross_entropy(teacher_forced_logits(model, batch, regime="soft"), target).item()
    assert curve["fixed_point"]["loss"] == pytest.approx(exact, rel=1e-4)


def test_prefix_mixin_mask_keeps_a_plain_prefix_per_document():
    idx = torch.tensor([[256, 1, 2, 3, 4, 256, 5, 6, 7, 8, 9, 10]] * 64)
    mask = document_prefix_mask(idx, 256, torch.Generator().manual_seed(0))
    for row in mask:
        for start, end in ((0, 5), (5, 12)):
            doc = row[start:end].tolist()
            p = doc.index(True) if True in doc else len(doc)
            assert p >= 1 and all(doc[p:]) and not any(doc[:p])
    lengths = [row[5:12].tolist().index(True) if True in row[5:12].tolist() else 7 for row in mask]
    assert len(set(lengths)) > 3  # prefixes are random


def test_multipass_loss_formula_and_gradients_through_passes():
    cfg = model_config("fbt", "test", feedback_start=0.0, pass_mix=(0.0, 0.0, 1.0), prefix_mixin=False, jitter=0.0,
                       loss_lambda=0.7)
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test", jitter=0.0)
    objective = build_objective(cfg, TrainConfig(steps=10))
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    result = objective(model, x, y, step=0)
    assert result.metrics["passes"] == 3
    out = model(x, passes=3, return_passes=True)
    losses = [token_cross_entropy(lg, y) for lg in out.pass_logits]
    expected = losses[0] + 0.7 / 2 * (losses[1] + losses[2])
    assert result.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    grad = torch.autograd.grad(losses[2], out.pass_hidden[0])[0]  # no detach between passes
    assert grad.abs().sum() > 0


def _run_config(corpus, arch="fbt", steps=6, **model):
    return RunConfig(model=model_config(arch, "test", sequence_len=32, **model),
                     train=TrainConfig(steps=steps, batch_size=4, eval_every=0, eval_batches=2, log_every=1,
                                       warmup_steps=2, save_every=3),
                     data=DataConfig(source=f"text:{corpus}"))


def test_resume_is_bit_identical_with_passes_and_jitter(corpus, tmp_path):
    mix = dict(feedback_start=0.0, pass_mix=(0.4, 0.4, 0.2))
    fit(setup(_run_config(corpus, **mix), tmp_path / "a", progress=False), progress=False)
    fit(setup(_run_config(corpus, steps=3, **mix), tmp_path / "b", progress=False), progress=False)
    fit(setup(_run_config(corpus, **mix), tmp_path / "b", resume=True, progress=False), progress=False)
    a = load_file(str(tmp_path / "a" / "checkpoints" / "step_00000006" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoints" / "step_00000006" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    passes = [json.loads(r).get("passes") for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert {p for p in passes if p} >= {2}


def test_start_from_a_tied_gpt_checkpoint(corpus, tmp_path):
    fit(setup(_run_config(corpus, arch="gpt", steps=2, tie_embeddings=True), tmp_path / "gpt", progress=False),
        progress=False)
    state = setup(_run_config(corpus, steps=2), tmp_path / "fbt", progress=False, init_from=tmp_path / "gpt")
    gpt, _ = ll.load(tmp_path / "gpt")
    assert torch.equal(state.model.blocks[1].mlp.c_fc.weight, gpt.blocks[1].mlp.c_fc.weight)
    assert torch.equal(state.model.wte.weight, gpt.wte.weight)
    fit(state, progress=False)


def test_cli_regimes(tiny_run, tiny_corpus, capsys):
    run = tiny_run("fbt")
    capsys.readouterr()
    bpb = {}
    for regime, extra in (("standard", []), ("soft", []), ("fused", ["--passes", "2"])):
        assert main(["eval", str(run), "--json", "--batches", "1", "--data", f"text:{tiny_corpus}",
                     "--regime", regime, *extra]) == 0
        bpb[regime] = json.loads(capsys.readouterr().out)["bpb"]
    assert len(set(bpb.values())) == 3
    assert main(["generate", str(run), "--prompt", "ab", "--max-new-tokens", "4", "--regime", "fused",
                 "--passes", "auto", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] <= 4 and 1 <= out["prefill_passes"] <= 16
    assert main(["generate", str(run), "--prompt", "ab", "--passes", "0", "--regime", "fused"]) == 2
    assert "passes" in capsys.readouterr().err


@torch.no_grad()
def test_a_position_fused_in_one_pass_and_not_the_next_goes_back_to_its_plain_input(model):
    """Per-pass masks differ in training (a fresh prefix per pass): pass k + 1's input at a position
    the mask of that pass leaves unfused is the plain embedding, whatever the pass before fused."""
    torch.manual_seed(3)
    idx = torch.randint(0, 256, (2, 12))
    fused_in_2 = torch.ones(2, 12, dtype=torch.bool)
    fused_in_3 = torch.rand(2, 12) > 0.5
    fused_in_3[:, 0] = False
    fused_in_3[0, 5] = False  # certainly a position fused in pass 2 and not in pass 3
    ctx = model.context(idx, None, None)
    e = model.embed(idx)
    passes = model.pass_states(idx, ctx, [fused_in_2, fused_in_3])
    (h1, x1), (h2, x2), (h3, x3) = (next(passes) for _ in range(3))
    torch.testing.assert_close(x1, e, rtol=0, atol=0)
    expected_3 = torch.where(fused_in_3[..., None], model.fuse(e, shift_right(model.carried_state(h2))), e)
    torch.testing.assert_close(x3, expected_3, rtol=0, atol=0)  # the same ops: bit for bit
    torch.testing.assert_close(x3[0, 5], e[0, 5], rtol=0, atol=0)
    assert (x2[0, 5] - e[0, 5]).abs().max() > 1e-3  # pass 2 did fuse it


@torch.no_grad()
@pytest.mark.parametrize("arch", ["fbt", "rfbt"])
def test_tokens_the_model_wrote_are_prefilled_fused_as_sft_trains_them(arch):
    """A second turn's prompt holds the first reply, which SFT fuses (`sft_fuse_mask`) and which was
    generated fused; the soft prefill read it plain, a history training never showed. With `written`
    it replays those tokens fused: the training forward's logits (fuse_mask = written, exact after T
    passes), in float64 to 1e-9; and decoding on, cached == uncached."""
    torch.manual_seed(0)
    model = ll.build(arch, preset="test").eval().double()
    bos = model.config.bos_id
    prompts = [[bos, 5, 6, 7, 60, 61, 62, 63, 9, 10, 11, 64, 65],  # two replies the model wrote
               [bos, 8, 70, 71, 72, 12]]  # one, in a shorter (left-padded) row
    written = [[False] * 4 + [True] * 4 + [False] * 3 + [True] * 2, [False, False, True, True, True, False]]
    cache = model.new_cache(2, 16)
    idx, pad_mask = ll.engine.left_pad(prompts, 0, torch.device("cpu"))
    flags = ll.engine.left_pad_flags(written, torch.device("cpu"))
    replayed = model.prefill(idx, cache, pad_mask, regime="soft", written=flags).logits
    for row, (prompt, marks) in enumerate(zip(prompts, written)):
        ids = torch.tensor([prompt])
        trained = model(ids, passes=len(prompt), fuse_mask=torch.tensor([marks])).logits  # the SFT forward, exact
        torch.testing.assert_close(replayed[row, -len(prompt):], trained[0], rtol=0, atol=1e-9)
        plain = model(ids).logits
        assert (trained - plain).abs().max() > 1e-3  # what the prefill read before: not the same
    kwargs = dict(temperature=0.0, regime="soft", written=written, compile=False)
    cached = ll.generate(model, prompts, 6, **kwargs)
    assert cached == ll.generate(model, prompts, 6, use_cache=False, **kwargs)
    alone = [ll.generate(model, p, 6, **{**kwargs, "written": w}) for p, w in zip(prompts, written)]
    assert cached == alone


def test_written_is_checked_against_the_prompts():
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test").eval()
    with pytest.raises(ll.engine.PromptError, match="written must give a bool for every token"):
        ll.generate(model, [[256, 5, 6]], 2, written=[[False, True]])
    gpt = ll.build("gpt", preset="test").eval()  # reads every token alike: not handed it, the same tokens
    assert ll.generate(gpt, [256, 5, 6], 3, temperature=0.0, written=[False, False, True]) == \
        ll.generate(gpt, [256, 5, 6], 3, temperature=0.0)


@torch.no_grad()
def test_a_rows_first_token_is_never_replayed_fused():
    """`written` on a row's first real token (a prompt without BOS) read a state nothing had set alone
    (KeyError) and the padding's state behind left padding; it stays plain, as `reference` keeps it."""
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test").eval()
    prompt, marks = [8, 9, 10, 11], [True, True, False, True]
    kwargs = dict(temperature=0.0, regime="soft", compile=False)
    alone = ll.generate(model, prompt, 6, written=marks, **kwargs)
    assert alone == ll.generate(model, prompt, 6, written=marks, use_cache=False, **kwargs)
    batched = ll.generate(model, [[256, 5, 6, 7, 8, 9, 10], prompt], 6,
                          written=[[False] * 7, marks], **kwargs)
    assert batched[1] == alone


def test_the_gate_table_follows_a_swapped_weight_that_reuses_the_old_ones_memory_and_version():
    """Decoding's table of σ(W_G e) per token was keyed by the weights' versions and addresses: a module
    swap (`quantize_int8`'s) whose new weight lands at the old one's address at the same version kept
    the old table (seen: the dequantised weight reused the float weight's memory). The table now holds
    the weights it was made from and is remade for any other."""
    model = ll.build("fbt", preset="test").eval()
    stale = model.token_gates().clone()
    old = model.fuse_gate.weight
    swapped = torch.nn.Linear(*reversed(old.shape), bias=False)
    swapped.weight = torch.nn.Parameter(old.data)  # the old memory, under a version counter of its own
    with torch.no_grad():
        swapped.weight.data.mul_(2)  # new values, written past both counters
        while swapped.weight._version < old._version:
            swapped.weight.add_(0)  # the same version as the old weight
    assert (swapped.weight.data_ptr(), swapped.weight._version) == (old.data_ptr(), old._version)
    model.fuse_gate = swapped
    with torch.no_grad():
        expected = torch.sigmoid(swapped(model.embed_norm(model.wte.weight)))
    assert not torch.allclose(expected, stale)
    torch.testing.assert_close(model.token_gates(), expected, rtol=0, atol=0)  # the same computation
