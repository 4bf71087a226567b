"""Latent recurrent transformer: interleaved == sequential at S = T, cache exactness, gpt reduction,
gradients through the buffer, objective and compute accounting."""

import json

import pytest
import torch

import latentloop as ll
from latentloop.archs import build_objective
from latentloop.archs.lrt.model import upper_middle_layer
from latentloop.cli import main
from latentloop.config import TrainConfig, model_config
from latentloop.engine import left_pad
from latentloop.objectives import token_cross_entropy
from latentloop.optim import set_lr

TOL = 1e-5  # fp32 max abs logit difference between two exact paths

VARIANTS = [{}, {"kv_projection": "layerwise"}, {"injection": "kv"}, {"injection": "residual"},
            {"source_layer": 0}, {"source_layer": -1}, {"n_kv_head": 2, "inject_layers": (1,)},
            {"value_embeds": True}, {"kv_gate_channels": 32}, {"value_embeds": True, "kv_gate_channels": 32,
                                                               "kv_projection": "layerwise", "source_layer": -1}]


def _model(**overrides):
    torch.manual_seed(0)
    model = ll.build("lrt", preset="test", **overrides).eval()
    with torch.no_grad():  # value embeddings and gates start at zero; random ones make the checks bite
        for name, p in model.named_parameters():
            if ".value_embed." in name or ".c_gate." in name:
                p.normal_(std=0.5)
    return model


@torch.no_grad()
@pytest.mark.parametrize("overrides", VARIANTS)
def test_interleaved_with_T_subsets_equals_sequential(overrides):
    model = _model(**overrides)
    idx = torch.randint(0, 256, (2, 12))
    sequential = model(idx, recurrence="sequential").logits
    torch.testing.assert_close(model(idx, recurrence="interleaved", subsets=12).logits, sequential, rtol=0, atol=TOL)
    assert (model(idx, recurrence="interleaved", subsets=2).logits - sequential).abs().max().item() > 1e-4


def _ragged(lengths, seed=0):
    """Rows of random ids (BOS first) of the given lengths, and the same rows left-padded into one batch."""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.tensor([256]), torch.randint(0, 256, (n - 1,), generator=generator)]) for n in lengths]
    idx, pad_mask = left_pad([row.tolist() for row in rows], 0, torch.device("cpu"))
    return rows, idx, pad_mask


RAGGED = (12, 11, 10, 9, 8, 7)  # left paddings 0..5: every residue of the padding mod S for S <= 6


@torch.no_grad()
@pytest.mark.parametrize("subsets", [3, 4, 5])
def test_interleaved_prefill_of_a_left_padded_batch_equals_each_row_alone(subsets):
    """More than two subsets: rows whose padding differs mod S are refined in different groups, each
    by the stride subsets of its own positions, so every row (logits, then the memory its cache
    hands to the next token) is as alone."""
    model = _model(subsets=subsets)
    rows, idx, pad_mask = _ragged(RAGGED)
    B, T = idx.shape
    cache = model.new_cache(B, T + 1)
    batched = model.prefill(idx, cache, pad_mask, prefill="interleaved").logits
    following = torch.randint(0, 256, (B, 1), generator=torch.Generator().manual_seed(1))
    next_batched = model.decode(following, cache, prefill="interleaved").logits
    for r, row in enumerate(rows):
        alone_cache = model.new_cache(1, len(row) + 1)
        alone = model.prefill(row[None], alone_cache, None, prefill="interleaved").logits[0]
        torch.testing.assert_close(batched[r, T - len(row):], alone, rtol=0, atol=TOL)
        next_alone = model.decode(following[r:r + 1], alone_cache, prefill="interleaved").logits[0]
        torch.testing.assert_close(next_batched[r], next_alone, rtol=0, atol=TOL)
    # and it is the approximation, not the exact recurrence, at fewer subsets than tokens
    exact = model.sequential(idx, pad_mask).logits
    assert (batched - exact)[pad_mask].abs().max().item() > 1e-4


@torch.no_grad()
@pytest.mark.parametrize("subsets", [2, 3])
def test_the_forward_of_a_left_padded_batch_gives_each_row_as_alone(subsets):
    """`model(idx, pad_mask)` under interleaved refines each row by its own positions' subsets (it
    took them by column: off by 8e-3 at a padding of 3 in two subsets); chunked and multi_refine,
    which cut by column, refuse a pad_mask instead of ignoring it."""
    model = _model(subsets=subsets)
    rows, idx, pad_mask = _ragged(RAGGED)
    T = idx.shape[1]
    for recurrence in ("sequential", "interleaved"):
        batched = model(idx, pad_mask, recurrence=recurrence).logits
        for r, row in enumerate(rows):
            alone = model(row[None], recurrence=recurrence).logits[0]
            torch.testing.assert_close(batched[r, T - len(row):], alone, rtol=0, atol=TOL)
    for recurrence in ("chunked", "multi_refine"):
        with pytest.raises(ValueError, match=f"{recurrence}.*takes no pad_mask"):
            model(idx, pad_mask, recurrence=recurrence)
    # the same fields whatever the padding (one group or several), and a prefill keeps no pass's
    # (B, T, V) logits alive beside its own
    one_group = pad_mask.clone()
    one_group[:] = True
    for mask in (pad_mask, one_group):
        assert model(idx, mask, recurrence="interleaved").pass_logits == []
    cache = model.new_cache(idx.shape[0], T + 1)
    assert model.prefill(idx, cache, pad_mask, prefill="interleaved").pass_logits == []


@torch.no_grad()
def test_interleaved_with_a_subset_per_token_equals_sequential_under_left_padding():
    """S = T subsets of one column each, refined in position order whatever a row's padding: the
    exact recurrence, equal to the sequential reference of the padded batch and of each row alone."""
    rows, idx, pad_mask = _ragged(RAGGED)
    B, T = idx.shape
    model = _model(subsets=T)
    interleaved = model.prefill(idx, model.new_cache(B, T), pad_mask, prefill="interleaved").logits
    sequential = model.sequential(idx, pad_mask).logits
    torch.testing.assert_close(interleaved[pad_mask], sequential[pad_mask], rtol=0, atol=TOL)
    for r, row in enumerate(rows):
        alone = model.sequential(row[None]).logits[0]
        torch.testing.assert_close(interleaved[r, T - len(row):], alone, rtol=0, atol=TOL)


@torch.no_grad()
@pytest.mark.parametrize("overrides", VARIANTS)
def test_cached_decoding_equals_sequential(overrides):
    model = _model(**overrides)
    idx = torch.randint(0, 256, (3, 14))
    sequential = model(idx, recurrence="sequential").logits
    cache = model.new_cache(3, 14)
    stepped = torch.cat([model.prefill(idx[:, :5], cache).logits, model.decode(idx[:, 5:], cache).logits], dim=1)
    torch.testing.assert_close(stepped, sequential, rtol=0, atol=TOL)


def test_greedy_generation_cached_uncached_and_batched():
    model = _model()
    prompts = [[256, 5, 6, 7, 8], [256, 9], [256, 40, 41, 42]]
    cached = ll.generate(model, prompts, 8, temperature=0.0)
    assert cached == ll.generate(model, prompts, 8, temperature=0.0, use_cache=False)
    assert cached == [ll.generate(model, p, 8, temperature=0.0) for p in prompts]
    approx = ll.generate(model, prompts, 8, temperature=0.0, prefill="interleaved")
    assert all(len(row) == 8 for row in approx)
    # the approximate prefill still treats each row as it would alone, whatever its padding
    assert approx == [ll.generate(model, p, 8, temperature=0.0, prefill="interleaved") for p in prompts]
    with pytest.raises(ll.ConfigError, match="prefill"):
        ll.generate(model, prompts, 2, prefill="parallel")
    with pytest.raises(ll.ConfigError, match="needs the cache"):
        ll.generate(model, prompts, 2, prefill="interleaved", use_cache=False)


@torch.no_grad()
@pytest.mark.parametrize("recurrence", ["sequential", "interleaved", "chunked", "multi_refine"])
def test_without_feedback_lrt_is_gpt(recurrence):
    """gamma = 0 and the feedback keys/values at 0 (W_k = W_v = 0; the gates start at 1):
    the same weights as a gpt give the gpt's logits."""
    torch.manual_seed(1)
    gpt = ll.build("gpt", preset="test").eval()
    lrt = ll.build("lrt", preset="test", residual_gamma_init=0.0, chunk_size=5).eval()
    missing, unexpected = lrt.load_state_dict(gpt.state_dict(), strict=False)
    assert not unexpected and all("mem" in name or "gate" in name for name in missing)
    lrt.mem_kv.weight.zero_()
    idx = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(lrt(idx, recurrence=recurrence).logits, gpt(idx).logits, rtol=0, atol=TOL)


def test_an_unpadded_buffer_plans_its_full_pass_without_reading_positions():
    """Without a pad mask no column is padding, known from the call: the full pass is plainly causal
    with no read of `key_pos` (a data-dependent branch that split the compiled training step in two).
    A buffer that may hold padding still reads it."""
    from latentloop.models.cache import KVBuffer

    positions = torch.arange(6)[None]
    everything = torch.arange(6)
    plan = KVBuffer(2, positions, padded=False).begin_columns(everything)
    assert plan.is_causal and plan.mask is None
    padded = positions.masked_fill(positions < 2, -1)  # two left-padding columns
    plan = KVBuffer(2, padded, padded=True).begin_columns(everything)
    assert not plan.is_causal
    compiled = torch.compile(lambda pos: KVBuffer(2, pos, padded=False).begin_columns(everything).positions,
                             fullgraph=True, backend="eager")  # fullgraph: a graph break raises
    assert torch.equal(compiled(positions), positions)
    model = ll.build("lrt", preset="test")  # training builds its buffer without a pad mask: unpadded
    idx = torch.randint(0, model.config.vocab_size, (2, 6))
    assert not model._buffer(idx, None).padded and model._buffer(idx, torch.ones(2, 6, dtype=torch.bool)).padded


def test_gradients_flow_through_the_buffer():
    """Subset 1 (odd columns) sees even columns only through the init pass's buffer: its loss
    must still reach the embeddings of tokens that occur only at even columns."""
    model = _model()
    model.train()
    idx = torch.tensor([[256, 3, 100, 4, 101, 5, 102, 6, 103, 7]])
    y = torch.randint(0, 256, (1, 10))
    out = model(idx, recurrence="interleaved", subsets=2)
    odd_loss = token_cross_entropy(out.pass_logits[2], y[:, out.pass_columns[2]])
    grad = torch.autograd.grad(odd_loss, model.wte.weight)[0]
    assert grad[100:104].abs().sum() > 0


def test_objective_loss_and_flops():
    cfg = model_config("lrt", "test", subsets=3)
    objective = build_objective(cfg, TrainConfig(steps=2))
    model = _model(subsets=3)
    x, y = torch.randint(0, 256, (2, 12)), torch.randint(0, 256, (2, 12))
    result = objective(model, x, y, step=0)
    out = model(x, recurrence="interleaved", subsets=3)
    terms = [token_cross_entropy(lg, y[:, c]) for lg, c in zip(out.pass_logits, out.pass_columns)]
    assert len(terms) == 4
    assert result.loss.item() == pytest.approx((sum(terms) / 4).item(), rel=1e-6)
    # the logged loss is the merged estimate's next-token loss, as lrt is scored (the composite also
    # averages in the zero-memory pass, which read higher than gpt's comparable curve)
    torch.testing.assert_close(result.reported_loss, token_cross_entropy(out.logits, y), rtol=1e-6, atol=0)
    refining = build_objective(model_config("lrt", "test", recurrence="multi_refine", refine_passes=3), TrainConfig())
    refiner = _model(recurrence="multi_refine", refine_passes=3)
    passes = refiner(x, recurrence="multi_refine").pass_logits
    torch.testing.assert_close(refining(refiner, x, y, step=0).reported_loss, token_cross_entropy(passes[-1], y),
                               rtol=1e-6, atol=0)
    one_pass = model.flops_per_token(recurrence="chunked")  # chunk_size >= T: one pass over the stack
    assert objective.flops_per_token(model) == pytest.approx(2 * one_pass)  # init pass + one refinement
    refine = build_objective(model_config("lrt", "test", recurrence="multi_refine", refine_passes=3), TrainConfig())
    assert refine.flops_per_token(_model(recurrence="multi_refine", refine_passes=3)) == pytest.approx(3 * one_pass)


def test_parameter_overhead_counts():
    D, L, H = 64, 2, 4
    gpt = ll.build("gpt", preset="test").num_params()
    shared = ll.build("lrt", preset="test").num_params()
    layerwise = ll.build("lrt", preset="test", kv_projection="layerwise").num_params()
    per_layer = D * 2 * H + 2  # gates + alpha, gamma
    assert shared - gpt == 2 * D * D + L * per_layer
    assert layerwise - gpt == L * (2 * D * D + per_layer)


def test_released_code_options_change_the_model_and_count_their_parameters():
    D, L, H, V = 64, 2, 4, 259
    base = ll.build("lrt", preset="test").num_params()
    assert ll.build("lrt", preset="test", value_embeds=True).num_params() - base == L * (V * D + D * H)  # + 3rd gate
    assert ll.build("lrt", preset="test", kv_gate_channels=32).num_params() - base == -L * 32 * 2 * H
    idx = torch.randint(0, 256, (2, 10))
    plain, ve = _model(), _model(value_embeds=True)
    with torch.no_grad():
        assert (plain(idx, recurrence="sequential").logits - ve(idx, recurrence="sequential").logits).abs().max() > 1e-3
    narrow = _model(kv_gate_channels=32)
    assert narrow.blocks[0].attn.c_gate.in_features == 32  # the gate reads only the first 32 channels


def test_source_layer_defaults_to_the_upper_middle():
    assert upper_middle_layer(20) == 11  # the paper: layer 12 of 20 (1-based)
    assert model_config("lrt", "tiny").source_layer == 1  # 4 blocks: round(2.4) - 1
    assert model_config("lrt", "small").source_layer == 3  # 6 blocks
    assert model_config("lrt", "tiny", source_layer=-1).source_layer == -1  # the released code's top state


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_residual_scalars_get_their_own_learning_rate(optimizer):
    model = ll.build("lrt", preset="test", residual_lr=0.05)
    spec = ll.archs.get_arch("lrt")  # the spec owns the group (`param_groups`), as the trainer builds it
    opt = spec.build_optimizers(model, TrainConfig(lr=1e-3, optimizer=optimizer))[0]  # AdamW: first under both
    scalars = {id(b.mem_alpha) for b in model.blocks} | {id(b.mem_gamma) for b in model.blocks}
    groups = [g for g in opt.param_groups if {id(p) for p in g["params"]} & scalars]
    assert len(groups) == 1 and {id(p) for p in groups[0]["params"]} == scalars
    assert groups[0]["initial_lr"] == 0.05 and groups[0]["weight_decay"] == 0.0
    set_lr([opt], 0.5)
    assert groups[0]["lr"] == pytest.approx(0.025)  # scheduled like every other group
    plain_opt = spec.build_optimizers(ll.build("lrt", preset="test"), TrainConfig(lr=1e-3, optimizer=optimizer))[0]
    assert all(g["initial_lr"] == 1e-3 for g in plain_opt.param_groups)  # residual_lr 0: the run's lr
    ve = ll.build("lrt", preset="test", value_embeds=True)
    muon_opts = spec.build_optimizers(ve, TrainConfig(optimizer="muon"))
    muon_ids = {id(p) for g in muon_opts[1].param_groups for p in g["params"]}
    assert all(id(b.attn.value_embed.weight) not in muon_ids for b in ve.blocks)  # lookup tables stay on AdamW


def test_config_errors():
    with pytest.raises(ll.ConfigError, match="source_layer"):
        model_config("lrt", "test", source_layer=2)
    with pytest.raises(ll.ConfigError, match="residual_lr"):
        model_config("lrt", "test", residual_lr=-1.0)
    with pytest.raises(ll.ConfigError, match="kv_gate_channels"):
        model_config("lrt", "test", kv_gate_channels=65)
    with pytest.raises(ll.ConfigError, match="value_embeds"):
        model_config("lrt", "test", value_embeds=True, injection="residual")
    with pytest.raises(ll.ConfigError, match="injection"):
        model_config("lrt", "test", injection="attention")
    with pytest.raises(ll.ConfigError, match="recurrence"):
        model_config("lrt", "test", recurrence="jacobi")


def test_eval_generate_cli(tiny_run, tiny_corpus, capsys):
    run, corpus = tiny_run("lrt"), tiny_corpus
    capsys.readouterr()
    results = {}
    for prefill in ("sequential", "interleaved"):
        assert main(["eval", str(run), "--json", "--batches", "1", "--data", f"text:{corpus}",
                     "--prefill", prefill]) == 0
        results[prefill] = json.loads(capsys.readouterr().out)["bpb"]
    assert results["sequential"] != results["interleaved"]
    # no flag: both ways, sequential first
    assert main(["eval", str(run), "--json", "--batches", "1", "--data", f"text:{corpus}"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["scored_as"] == "sequential" and both["bpb"] == results["sequential"]
    assert both["by_option"]["interleaved"]["bpb"] == results["interleaved"]
    assert main(["generate", str(run), "--prompt", "ab", "--max-new-tokens", "3", "--prefill", "interleaved",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] <= 3


def test_the_flop_count_of_flex_attention_subset_passes_equals_the_dense_masks(monkeypatch):
    """On a GPU the interleaved subset passes run flex_attention; under torch's FLOP counter that
    raised (an H200 with torch 2.11: lrt's training stopped at its setup). The counter takes the
    dense mask instead, with the same shapes, so the count is the dense path's."""
    from latentloop.models import flex

    flex_attend = flex.attend
    cfg = model_config("lrt", "test", subsets=3)
    objective = build_objective(cfg, TrainConfig(steps=2))
    model = _model(subsets=3)
    dense = objective.flops_per_token(model)
    monkeypatch.setattr(flex, "FORCE", True)  # flex_attention on the CPU too, as on CUDA
    assert objective.flops_per_token(model) == dense
    plans = []
    monkeypatch.setattr(flex, "attend", lambda *args, **kwargs: plans.append(1) or flex_attend(*args, **kwargs))
    with torch.no_grad():  # (torch has no flex_attention backward on the CPU)
        model(torch.randint(0, 256, (2, 12)), recurrence="interleaved", subsets=3)
    assert plans  # outside the count the subset passes still take flex_attention
