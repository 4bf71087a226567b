"""Mixture-of-Recursions (arch `mor`): its routing, recursion-wise attention and objective, checked
against computations written out here. (The contract suite checks it through every front-end.)"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import latentloop as ll
from latentloop.archs import build_objective
from latentloop.archs.mor.objective import real_inputs
from latentloop.cli import main
from latentloop.config import TrainConfig, model_config
from latentloop.data.chat import PackedRows
from latentloop.errors import ConfigError
from latentloop.models.backbone import norm
from latentloop.models.cache import AttentionPlan, attention_mask
from latentloop.objectives.base import token_cross_entropy

TOL = dict(rtol=1e-5, atol=1e-5)  # two fp32 paths over the same arithmetic in another order
T = 12


def _model(routing: str = "expert", seed: int = 0, **fields):
    torch.manual_seed(seed)
    return ll.build("mor", preset="test", routing=routing, **fields)


def _idx(seed: int = 1, rows: int = 2, length: int = T):
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def _prelude(model, idx):
    """The prelude's states of a whole unpadded sequence: h^(0)."""
    plain = model.context_from_plan(AttentionPlan(torch.arange(idx.shape[1])[None], None, True))
    return model.run_blocks(model.embed(idx), plain, model.prelude)


def _by_hand(model, idx, choose):
    """The MoR forward written out with a mask per recursion: `choose(r, h, alive) -> (go (B, T), gate (B, T))`;
    at recursion r the tokens in `go` attend among themselves (causally), the others keep their state."""
    c = model.config
    x = model.embed(idx)
    B, L, _ = x.shape
    positions = torch.arange(L)[None].expand(B, L)
    plain = model.context_from_plan(AttentionPlan(torch.arange(L)[None], None, True))
    h = model.run_blocks(x, plain, model.prelude)
    alive = torch.ones(B, L, dtype=torch.bool)
    for r in range(1, c.recursions + 1):
        go, gate = choose(r, h, alive)
        key_pos = torch.where(go, positions, torch.full_like(positions, -1))
        slots = torch.arange(L)
        ctx = model.context_from_plan(AttentionPlan(positions, attention_mask(positions, key_pos, slots, slots), False))
        o = model.run_blocks(h, ctx, model.core)
        h = torch.where(go[..., None], h + gate[..., None] * (o - h), h)
        alive = go
    return model.readout(model.run_blocks(h, plain, model.coda))


@torch.no_grad()
def test_expert_choice_training_keeps_the_top_k_of_the_candidates_and_attends_among_them():
    """The training route gathers the top ceil(capacity_r · T) of each row's candidates; it equals
    the masked computation with those selections (attention only among the selected, causal)."""
    model = _model().train()
    idx = _idx()
    out = model(idx, route="topk")
    capacities = model.config.capacities
    assert capacities == pytest.approx((1.0, 2 / 3, 1 / 3))
    kept = [int(took[0].sum()) for took in out.taken]
    assert kept == [math.ceil(c * T) for c in capacities] and all(int(t[1].sum()) == k for t, k in zip(out.taken, kept))
    for earlier, later in zip(out.taken, out.taken[1:]):  # hierarchical: a token kept at r was kept at r - 1
        assert not (later & ~earlier).any()
    selections = iter(out.taken)

    def chosen(r, h, alive):
        scores = model.router(norm(h))[..., r - 1]
        go = next(selections)
        top = torch.where(alive, scores, torch.full_like(scores, -torch.inf)).topk(int(go[0].sum()), dim=1).indices
        assert torch.equal(torch.zeros_like(go).scatter(1, top, True), go)  # the route's selection is the top-k
        return go, torch.sigmoid(scores)

    torch.testing.assert_close(out.logits, _by_hand(model, idx, chosen), **TOL)


def test_expert_choice_aux_loss_is_the_selection_bce():
    model = _model().train()
    idx = _idx()
    out = model(idx, route="topk")
    with torch.no_grad():  # recompute every recursion's scores from the states the route produced
        expected, alive = 0.0, torch.ones_like(out.taken[0])
        h = _prelude(model, idx)
        for r, took in enumerate(out.taken, start=1):
            scores = model.router(norm(h))[..., r - 1]
            expected += F.binary_cross_entropy_with_logits(scores[alive], took[alive].float())
            x = model.run_blocks(h, model.context_from_plan(AttentionPlan(torch.arange(T)[None].expand(2, T),
                attention_mask(torch.arange(T)[None].expand(2, T), torch.where(took, torch.arange(T), -1),
                               torch.arange(T), torch.arange(T)), False)), model.core)
            h = torch.where(took[..., None], h + torch.sigmoid(scores)[..., None] * (x - h), h)
            alive = took
    torch.testing.assert_close(out.aux_loss.detach(), torch.as_tensor(expected), **TOL)


@torch.no_grad()
def test_expert_choice_decodes_by_the_threshold_token_by_token():
    """Inference: a token goes on while its router's σ(score) exceeds the threshold (and it went on
    before); the model's path equals the masked computation with that rule."""
    model = _model().eval()
    idx = _idx()
    threshold = model.config.router_threshold

    def by_threshold(r, h, alive):
        gate = torch.sigmoid(model.router(norm(h))[..., r - 1])
        return alive & (gate > threshold), gate

    out = model(idx)
    torch.testing.assert_close(out.logits, _by_hand(model, idx, by_threshold), **TOL)
    shares = [float(s) for s in out.active_share()]
    assert shares[0] < 1.0 and shares == sorted(shares, reverse=True)  # the untrained router lets some go
    # a higher threshold lets fewer tokens on
    strict = dataclasses.replace(model.config, router_threshold=0.9)
    model.config = strict
    assert [float(s) for s in model(idx).active_share()] <= shares


@torch.no_grad()
def test_token_choice_routes_each_token_to_a_depth_in_training_and_decoding_alike():
    model = _model("token").eval()
    idx = _idx()
    h_pre = _prelude(model, idx)
    probs = torch.softmax(model.router(norm(h_pre)), dim=-1)
    depth, gate = probs.argmax(-1) + 1, probs.max(-1).values

    out = model(idx)
    torch.testing.assert_close(out.logits, _by_hand(model, idx, lambda r, h, alive: (depth >= r, gate)), **TOL)
    assert [int(t.sum()) for t in out.taken] == [int((depth >= r).sum()) for r in (1, 2, 3)][:len(out.taken)]
    model.train()
    assert torch.equal(model(idx).logits, out.logits)  # one route: training computes what decoding does
    # steps caps the depth
    capped = model.eval()(idx, steps=1)
    torch.testing.assert_close(capped.logits, _by_hand(model, idx, lambda r, h, alive: (
        (depth.clamp(max=1) >= r) & (r <= 1), gate)), **TOL)


def test_token_choice_balance_loss():
    model = _model("token").train()
    idx = _idx()
    out = model(idx)
    with torch.no_grad():
        probs = torch.softmax(model.router(norm(_prelude(model, idx))), dim=-1).flatten(0, 1)  # (B T, R)
        share = F.one_hot(probs.argmax(-1), 3).float().mean(0)
        expected = 3 * (share * probs.mean(0)).sum()
    torch.testing.assert_close(out.aux_loss.detach(), expected, **TOL)


@pytest.mark.parametrize("routing", ["expert", "token"])
@torch.no_grad()
def test_cached_decoding_attends_at_each_recursion_only_to_the_tokens_that_took_it(routing):
    """Recursion-wise caching: the cache marks exactly the tokens each recursion ran, its keys at a
    recursion are those tokens', and decoding token by token equals the whole-sequence forward."""
    model = _model(routing).eval()
    idx = _idx(rows=1)
    cache = model.new_cache(1, T)
    for t in range(T):  # one token at a time
        step = model.prefill(idx[:, :1], cache) if t == 0 else model.decode(idx[:, t:t + 1], cache)
        assert step.logits.shape == (1, 1, model.config.vocab_size)
    whole = model(idx)
    last = model.reference(idx).logits[:, -1]
    torch.testing.assert_close(step.logits[:, -1], last, **TOL)
    for r in range(1, model.config.recursions + 1):
        took = whole.taken[r - 1][0] if r <= len(whole.taken) else torch.zeros(T, dtype=torch.bool)
        marked = cache.key_positions(r, T)[0] >= 0
        assert torch.equal(marked, took), r


def test_fewer_recursions_and_bad_settings_are_one_line():
    model = _model().eval()
    with pytest.raises(ConfigError, match=r"steps must be in \[1, 3\]"):
        model(_idx(), steps=4)
    for bad, message in (({"capacity": (0.5, 1.0, 0.2)}, "must not increase"), ({"capacity": (1.0,)}, "one share"),
                         ({"routing": "random"}, "routing must be"), ({"router_threshold": 1.0}, "router_threshold"),
                         ({"recursions": 0}, "recursions must be")):
        with pytest.raises(ConfigError, match=message):
            model_config("mor", "test", **bad)
    with pytest.raises(ConfigError, match="top-k route"):  # training's route has no cache (a pad mask it takes)
        model.train()._run(_idx(), model.new_cache(2, T), None, None, "topk")


def test_objective_adds_the_weighted_router_loss_and_charges_the_kept_tokens():
    torch.manual_seed(0)
    config = model_config("mor", "test")
    model = ll.archs.build_model(config).train()
    objective = build_objective(config, TrainConfig(steps=1, log_every=1))
    x, y = _idx(3), _idx(4)
    result = objective(model, x, y, 0)
    out = model(x, route="topk")
    ce = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    torch.testing.assert_close(result.loss, ce + config.router_aux_weight * out.aux_loss, **TOL)
    assert result.reported_loss == pytest.approx(float(ce), rel=1e-5)
    assert result.metrics["router_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert [result.metrics[f"active_r{r}"] for r in (1, 2, 3)] == pytest.approx([1.0, 2 / 3, 1 / 3], abs=0.05)
    # FLOPs: the top-k route runs the core on fewer tokens than every recursion over every token
    routed = objective.flops_per_token(model)
    everything = ll.archs.build_model(dataclasses.replace(config, capacity=(1.0, 1.0, 1.0))).flops_per_token(
        route="topk")
    assert routed < everything


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_trains_resumes_and_generates_through_the_cli(routing, tmp_path, tiny_corpus, capsys):
    run = tmp_path / "run"
    argv = ["train", "--arch", "mor", "--preset", "test", "--data", f"text:{tiny_corpus}", "--steps", "4",
            "--batch-size", "2", "--set", f"routing={routing}", "--set", "sequence_len=32", "--set", "log_every=1",
            "--set", "eval_every=0", "--set", "eval_batches=1", "--out", str(run), "--no-progress"]
    assert main(argv) == 0
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"router_loss"' in line]
    assert len(rows) == 4 and all('"active_r1"' in row for row in rows)
    assert main(["generate", str(run), "--prompt", "the ", "--max-new-tokens", "4", "--steps", "2"]) == 0
    assert main(["generate", str(run), "--prompt", "the ", "--steps", "9"]) == 2
    assert "steps must be in [1, 3]" in capsys.readouterr().err


@pytest.mark.parametrize("length", [7, 10, 13])
def test_expert_choice_keeps_the_ceiling_of_capacity_times_T_in_each_row(length):
    """k_r = ceil(capacity_r · T) (the paper's rounding): at lengths where floor and ceil differ, a
    route that kept floor(capacity_r · T) tokens keeps one fewer at some recursion."""
    model = _model().train()
    capacities = model.config.capacities
    assert any(math.floor(c * length) != math.ceil(c * length) for c in capacities)  # the case this is about
    out = model(_idx(length=length), route="topk")
    kept = [took.sum(dim=1).tolist() for took in out.taken]
    assert kept == [[math.ceil(c * length)] * 2 for c in capacities]


# -- SFT: packed rows end in padding ---------------------------------------------------------------
PAD = 258  # the byte tokenizer's PAD: it appears only as padding here
REAL = (20, 37)  # each row's real tokens (whole conversations), then PAD; ceil(capacity · n) differs by row
ASSISTANT_FROM = 6  # the trained span: tokens ASSISTANT_FROM .. n - 1 of each row (as a chat row ends)


def _sft_batch(width: int):
    """(x, y, loss_mask) of two packed SFT rows of `width` inputs, through `PackedRows.batch` as SFT reads
    them: the same real tokens and trained span at every width, only the padding after them grows."""
    generator = torch.Generator().manual_seed(5)
    tokens = np.full((len(REAL), width + 1), PAD, dtype=np.int64)
    mask = np.zeros((len(REAL), width + 1), dtype=bool)
    for row, n in enumerate(REAL):
        tokens[row, :n] = torch.randint(0, 256, (n,), generator=generator).numpy()
        mask[row, ASSISTANT_FROM:n] = True
    return PackedRows(tokens, mask).batch(np.arange(len(REAL)))


def _sft_model(routing: str = "expert"):
    return _model(routing, n_layer=4, sequence_len=128).train()  # a prelude and a coda, which read the pad mask too


def _old_topk_forward(model, idx):
    """The top-k training route as it was before it took a pad mask (a copy of the old `run_stack` /
    `_topk_recursion`): every position a candidate, k_r = ceil(capacity_r · T). Returns (logits, aux)."""
    B, L = idx.shape
    plain = model.context_from_plan(AttentionPlan(torch.arange(L)[None], None, True))
    h = model.run_blocks(model.embed(idx), plain, model.prelude)
    alive, total = torch.ones(B, L, dtype=torch.bool), None
    for r in range(1, model.config.recursions + 1):
        D = h.shape[-1]
        k = math.ceil(model.config.capacities[r - 1] * L)
        scores = model.router(norm(h))[..., r - 1].float()
        top = torch.where(alive, scores, torch.full_like(scores, -torch.inf)).topk(k, dim=1).indices
        top = top.sort(dim=1).values
        selected = torch.zeros_like(alive).scatter(1, top, True)
        candidates = alive.to(scores.dtype)
        aux = (F.binary_cross_entropy_with_logits(scores, selected.to(scores.dtype), weight=candidates,
                                                  reduction="sum") / candidates.sum().clamp(min=1))
        total = aux if total is None else total + aux
        where = top[..., None].expand(B, k, D)
        x = h.gather(1, where)
        positions = plain.plan.positions.expand(B, L).gather(1, top)
        o = model.run_blocks(x, model.context_from_plan(AttentionPlan(positions, None, True)), model.core)
        gate = torch.sigmoid(scores.gather(1, top)).to(h.dtype)[..., None]
        h, alive = h.scatter(1, where, x + gate * (o - x)), selected
    return model.readout(model.run_blocks(h, plain, model.coda)), total


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_sft_real_tokens_training_logits_do_not_change_with_the_padding_after_them(routing):
    """A real token's training-forward logits (the objective's: expert choice's top-k route, the real
    tokens read off the loss mask) are the same whether 48 - n or 128 - n PAD follow its row's n real
    tokens, and the same as the row's real tokens alone (k_r = ceil(capacity_r · n) in each case); so
    are the objective's loss, router loss (token choice: the balance loss, over real tokens) and
    recursion shares. TOL: the same fp32 arithmetic over differently sized (masked) attention and gathers."""
    model = _sft_model(routing)
    objective = build_objective(model.config, TrainConfig(steps=1, log_every=1))
    with torch.no_grad():
        short, long = (objective(model, x, y, 0, loss_mask) for x, y, loss_mask in map(_sft_batch, (48, 128)))
        torch.testing.assert_close(short.loss, long.loss, **TOL)
        torch.testing.assert_close(short.next_token_loss, long.next_token_loss, **TOL)
        for name in ("router_loss", "active_r1", "active_r2", "active_r3"):
            torch.testing.assert_close(short.metrics[name], long.metrics[name], **TOL)
        logits = {}
        for width in (48, 128):
            x, _, loss_mask = _sft_batch(width)
            real = real_inputs(loss_mask)
            assert real.sum(dim=1).tolist() == list(REAL) and not (real & (x == PAD)).any()
            logits[width] = model(x, pad_mask=real, **objective.forward_options()).logits
        for row, n in enumerate(REAL):
            torch.testing.assert_close(logits[48][row, :n], logits[128][row, :n], **TOL)
            alone = model(_sft_batch(48)[0][row:row + 1, :n], route="topk").logits[0]  # no padding at all
            torch.testing.assert_close(logits[128][row, :n], alone, **TOL)


def test_sft_padding_is_never_selected_and_carries_no_router_loss():
    """The objective's loss on a packed SFT batch (next-token + router) gives PAD's embedding no gradient
    (PAD is only padding here: nothing real reads it, and it carries no router loss); on the top-k route
    with the pad mask no recursion selects padding, each row keeps ceil(capacity_r · its real tokens),
    and the router's loss is the selection BCE over the real candidates only."""
    model = _sft_model()
    x, y, loss_mask = _sft_batch(64)
    objective = build_objective(model.config, TrainConfig(steps=1, log_every=1))
    objective(model, x, y, 0, loss_mask).loss.backward()
    grad = model.wte.weight.grad
    assert float(grad[:256].abs().sum()) > 0  # the real tokens' embeddings are trained
    assert float(grad[PAD].abs().max()) == 0.0, "padding reached the loss"
    real = real_inputs(loss_mask)
    out = model(x, pad_mask=real, route="topk")
    for r, (took, capacity) in enumerate(zip(out.taken, model.config.capacities), start=1):
        assert not (took & ~real).any(), r
        assert took.sum(dim=1).tolist() == [math.ceil(capacity * n) for n in REAL], r
    with torch.no_grad():  # the BCE over the candidates (real, kept at r - 1), recomputed from the route's states
        B, L = x.shape
        plan = AttentionPlan(torch.arange(L)[None].expand(B, L), attention_mask(
            torch.arange(L)[None].expand(B, L), torch.where(real, torch.arange(L), -1), torch.arange(L),
            torch.arange(L)), False)
        h, alive, expected = model.run_blocks(model.embed(x), model.context_from_plan(plan), model.prelude), real, 0.0
        for r, took in enumerate(out.taken, start=1):
            scores = model.router(norm(h))[..., r - 1]
            expected += F.binary_cross_entropy_with_logits(scores[alive], took[alive].float())
            key_pos = torch.where(took, torch.arange(L), -1)
            o = model.run_blocks(h, model.context_from_plan(AttentionPlan(
                plan.positions, attention_mask(plan.positions, key_pos, torch.arange(L), torch.arange(L)), False)),
                model.core)
            h = torch.where(took[..., None], h + torch.sigmoid(scores)[..., None] * (o - h), h)
            alive = took
    torch.testing.assert_close(out.aux_loss.detach(), torch.as_tensor(expected), **TOL)


def test_unpadded_batches_train_as_before():
    """Pretraining (no pad mask): the top-k route's logits and router loss are bit-equal to the old
    computation (`_old_topk_forward`), and so is the objective's loss; a pad mask or loss mask with
    no padding computes the same to TOL (the prelude and coda then attend through a mask, not SDPA's
    causal flag)."""
    model = _sft_model()
    objective = build_objective(model.config, TrainConfig(steps=1, log_every=1))
    x, y = _idx(3, length=45), _idx(4, length=45)  # ceil(capacity · 45) = 45, 30, 15
    with torch.no_grad():
        old_logits, old_aux = _old_topk_forward(model, x)
        out = model(x, route="topk")
        assert torch.equal(out.logits, old_logits) and torch.equal(out.aux_loss, old_aux)
        result = objective(model, x, y, 0)
        ce = token_cross_entropy(old_logits, y)
        assert torch.equal(result.loss, ce + model.config.router_aux_weight * old_aux)
        assert torch.equal(result.next_token_loss, ce)
        whole = model(x, pad_mask=torch.ones_like(x, dtype=torch.bool), route="topk")
        torch.testing.assert_close(whole.logits, old_logits, **TOL)
        torch.testing.assert_close(whole.aux_loss, old_aux, **TOL)
        every = objective(model, x, y, 0, torch.ones_like(x, dtype=torch.bool))  # an SFT batch of no padding
        torch.testing.assert_close(every.loss, result.loss, **TOL)
