"""The decoding protocol, restart rules, cache modes, exit criteria and sampling boundaries, each
checked against an independent reference written here (not against the code path it tests)."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import latentloop as ll
from latentloop.archs import ARCHS, get_arch
from latentloop.archs.fbt import model as fbt_module
from latentloop.archs.rgpt import model as rgpt_module
from latentloop.engine import PromptError, model_options, sample_next, teacher_forced_logits
from latentloop.models.criteria import KLDivergence, RelativeChange
from latentloop.models.options import DecodeOption, check_options

TOL = 1e-5  # fp32 max abs logit difference between two paths that compute the same function
BOS = 256


def close(actual, expected, atol=TOL):
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


# --------------------------------------------------------------------------------------------
# An independent reference for the backbone (as litgpt checks against Hugging Face's Llama)
# --------------------------------------------------------------------------------------------


def reference_gpt_logits(model, idx):
    """The nanochat-style decoder written out with einsum: rotate-half RoPE, QK-norm, causal
    softmax attention with GQA by repeating keys/values, ReLU² or SwiGLU, parameter-free
    RMSNorms, tied or untied head, soft-cap. Shares only the weights with the model."""
    c = model.config
    B, T = idx.shape
    H, Hkv, hd = c.n_head, c.n_kv_head, c.head_dim
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)  # noqa: E731
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angle = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None]  # (T, hd/2)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)  # (T, hd)

    def rope(x):  # (B, T, h, hd): rotate each (x_i, x_{i+hd/2}) pair by position * inv_freq_i
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        rotated = torch.cat([x2, -x1], dim=-1)
        return x * cos[None, :, None] + rotated * sin[None, :, None]

    x = rms(model.wte.weight[idx])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for block in model.blocks:
        h = rms(x)
        q, k, v = (h @ block.attn.c_qkv.weight.T).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q, k = rms(rope(q.view(B, T, H, hd))), rms(rope(k.view(B, T, Hkv, hd)))
        v = v.view(B, T, Hkv, hd)
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        attention = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        y = torch.einsum("bhqk,bkhd->bqhd", attention, v).reshape(B, T, H * hd)
        x = x + y @ block.attn.c_proj.weight.T
        h = rms(x)
        up = h @ block.mlp.c_fc.weight.T
        act = F.silu(h @ block.mlp.c_gate.weight.T) * up if block.mlp.c_gate is not None else F.relu(up).square()
        x = x + act @ block.mlp.c_proj.weight.T
    head = model.wte.weight if model.lm_head is None else model.lm_head.weight
    logits = rms(x) @ head.T
    return c.logit_softcap * torch.tanh(logits / c.logit_softcap) if c.logit_softcap > 0 else logits


@torch.no_grad()
@pytest.mark.parametrize("overrides", [{}, {"n_kv_head": 2}, {"mlp": "swiglu", "tie_embeddings": True},
                                       {"logit_softcap": 10.0, "rope_theta": 500.0}])
def test_backbone_matches_an_independent_reference(overrides):
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", **overrides).eval()
    idx = torch.randint(0, 259, (2, 23))
    close(model(idx).logits, reference_gpt_logits(model, idx), atol=2e-5)
    cache = model.new_cache(2, 23)
    cached = torch.cat([model.prefill(idx[:, :9], cache).logits, model.decode(idx[:, 9:], cache).logits], dim=1)
    close(cached, reference_gpt_logits(model, idx), atol=2e-5)


# --------------------------------------------------------------------------------------------
# BOS inside a sequence: the restart rule each architecture documents
# --------------------------------------------------------------------------------------------


def _with_bos_inside(T=14, at=(5, 9), seed=1):
    idx = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(seed))
    idx[:, 0] = BOS
    for column in at:
        idx[:, column] = BOS
    return idx


def fbt_sequential_reference(model, idx, fuse_from=1):
    """fbt token by token without a cache; the input at BOS (and before fuse_from) is plain."""
    e = model.embed(idx)
    inputs = e[:, :1]
    for t in range(1, idx.shape[1]):
        h = model.run_blocks(inputs, model.context(idx[:, :t], None, None))
        fused = model.fuse(e[:, t:t + 1], model.carried_state(h[:, -1:]))
        restart = (idx[:, t:t + 1] == BOS)[..., None] | (t < fuse_from)
        inputs = torch.cat([inputs, torch.where(restart, e[:, t:t + 1], fused)], dim=1)
    return model.readout(model.run_blocks(inputs, model.context(idx, None, None)))


@torch.no_grad()
def test_fbt_restarts_at_bos_in_every_path():
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test").eval()
    idx = _with_bos_inside()
    reference = fbt_sequential_reference(model, idx)
    close(teacher_forced_logits(model, idx, regime="soft"), reference)  # cached soft decode
    close(model(idx, passes=idx.shape[1]).logits, reference)  # parallel passes
    # and the restart matters: fusing at BOS would give other logits
    ignoring = fbt_sequential_reference(model, torch.where(idx == BOS, torch.full_like(idx, 7), idx))
    assert (reference[:, 6] - ignoring[:, 6]).abs().max() > 1e-3


def lrt_sequential_reference(model, idx):
    """lrt token by token without a cache: the memory of token t is the source state of token
    t-1, zero at position 0 and at every BOS."""
    B, T = idx.shape
    sources, logits = [], []
    for t in range(T):
        prefix = idx[:, :t + 1]
        memory = torch.zeros(B, t + 1, model.config.n_embd)
        for j in range(1, t + 1):
            memory[:, j] = torch.where((idx[:, j] == BOS)[:, None], torch.zeros_like(sources[j - 1]), sources[j - 1])
        h, source = model.run_pass(prefix, model.context(prefix, None, None), memory)
        sources.append(source[:, t])
        logits.append(model.readout(h[:, t:t + 1]))
    return torch.cat(logits, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("prefill", ["sequential"])
def test_lrt_memory_restarts_at_bos(prefill):
    torch.manual_seed(0)
    model = ll.build("lrt", preset="test", residual_gamma_init=0.5).eval()
    idx = _with_bos_inside()
    reference = lrt_sequential_reference(model, idx)
    close(model(idx, recurrence="sequential").logits, reference)
    close(teacher_forced_logits(model, idx, prefill=prefill), reference)
    cache = model.new_cache(2, idx.shape[1])
    stepped = torch.cat([model.prefill(idx[:, :4], cache).logits, model.decode(idx[:, 4:], cache).logits], dim=1)
    close(stepped, reference)


@torch.no_grad()
def test_rgpt_has_no_token_state_so_bos_is_an_ordinary_token():
    torch.manual_seed(0)
    model = ll.build("rgpt", preset="test", n_layer=4, recurrence_steps=3).eval()
    idx = _with_bos_inside()
    close(teacher_forced_logits(model, idx, prompt_len=4), model(idx).logits)


# --------------------------------------------------------------------------------------------
# rgpt's cache modes against a reference computed from what each core step wrote
# --------------------------------------------------------------------------------------------


def _record_core_writes(monkeypatch):
    writes = []  # (slot, step, k, v) exactly as each core step handed them to the cache
    original = rgpt_module.CoreStepView.update

    def recording(self, slot, k, v):
        writes.append((slot, self.step, k.clone(), v.clone()))
        return original(self, slot, k, v)

    monkeypatch.setattr(rgpt_module.CoreStepView, "update", recording)
    return writes


@torch.no_grad()
@pytest.mark.parametrize("mode", ["mean", "last", "full"])
@pytest.mark.parametrize("early_exit", [False, True])
def test_rgpt_cache_modes_store_the_mean_or_the_last_step(mode, early_exit, monkeypatch):
    torch.manual_seed(0)
    model = ll.build("rgpt", preset="test", n_layer=4, recurrence_steps=4, gate_bias_init=0.0).eval()
    c = model.config
    prompt, token = torch.tensor([[BOS, 4, 5, 6], [BOS, 7, 8, 9], [BOS, 1, 2, 3]]), torch.tensor([[11], [12], [13]])
    threshold = 0.0
    if early_exit:  # a threshold between the rows' state changes, so rows stop at different steps
        values = _record_criterion(monkeypatch, _independent_value)
        probe = model.new_cache(3, 12, cache_mode=mode)
        model.prefill(prompt, probe, cache_mode=mode)
        model.decode(token, probe, cache_mode=mode, exit_threshold=1e-12, exit_criterion="state")
        threshold = float(torch.stack(values).median())
    cache = model.new_cache(3, 12, cache_mode=mode)
    model.prefill(prompt, cache, cache_mode=mode)
    writes = _record_core_writes(monkeypatch)
    position = cache.length
    model.decode(token, cache, cache_mode=mode, exit_threshold=threshold, exit_criterion="state")
    exits = cache.stats.get("rgpt.exit_steps", [c.recurrence_steps] * 3)
    if early_exit:
        assert len(set(exits)) > 1, exits  # rows stopped at different steps
    for j in range(c.n_rec):
        for row in range(3):
            raw = [(step, k[row, :, 0], v[row, :, 0]) for slot, step, k, v in writes
                   if (slot - c.n_pre) % c.n_rec == j and step <= exits[row]]  # what the row computed
            if mode == "full":  # each step in its own slot; later steps repeat the exit step's
                for step in range(1, c.recurrence_steps + 1):
                    kept = raw[min(step, exits[row]) - 1]
                    slot = c.n_pre + (step - 1) * c.n_rec + j
                    close(cache.k[slot, row, :, position], kept[1], atol=0)
                    close(cache.v[slot, row, :, position], kept[2], atol=0)
                continue
            expected_k = torch.stack([k for _, k, _ in raw]).mean(0) if mode == "mean" else raw[-1][1]
            expected_v = torch.stack([v for _, _, v in raw]).mean(0) if mode == "mean" else raw[-1][2]
            close(cache.k[c.n_pre + j, row, :, position], expected_k, atol=1e-6)
            close(cache.v[c.n_pre + j, row, :, position], expected_v, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Exit and convergence criteria
# --------------------------------------------------------------------------------------------


def test_criteria_values_match_their_definitions():
    generator = torch.Generator().manual_seed(0)
    new, old = torch.randn(5, 7, generator=generator), torch.randn(5, 7, generator=generator)
    close(RelativeChange(0.1).value(new, old), torch.linalg.vector_norm(new - old, dim=-1)
          / torch.linalg.vector_norm(new, dim=-1), atol=1e-6)
    p_new, p_old = new.log_softmax(-1), old.log_softmax(-1)
    kl = F.kl_div(p_old, p_new, log_target=True, reduction="none").sum(-1)  # KL(p_new || p_old)
    close(KLDivergence(0.1).value(p_new, p_old), kl, atol=1e-6)
    assert (KLDivergence(0.0).value(p_new, p_old) > 0).all()
    threshold = float(kl.median())
    assert KLDivergence(threshold).settled(p_new, p_old).tolist() == (kl < threshold).tolist()


def _record_criterion(monkeypatch, independent):
    """Wrap rgpt's criteria so each step's independently computed value is recorded."""
    values = []
    original = rgpt_module.make_exit_criterion

    def recording(name, threshold):
        criterion = original(name, threshold)

        class Recorded:
            compares = criterion.compares

            def settled(self, new, old):
                values.append(independent(name, new, old))
                return criterion.settled(new, old)

        return Recorded()

    monkeypatch.setattr(rgpt_module, "make_exit_criterion", recording)
    return values


def _independent_value(name, new, old):
    if name == "kl":
        return F.kl_div(old, new, log_target=True, reduction="none").sum(-1)
    return torch.linalg.vector_norm(new - old, dim=-1) / torch.linalg.vector_norm(new, dim=-1)


def _expected_exits(per_step, threshold, min_steps, first_comparable, max_steps):
    """Per row: the first step r >= min_steps whose criterion value is under the threshold."""
    exits = []
    for row in range(per_step.shape[1]):
        stop = max_steps
        for r in range(max(first_comparable, min_steps), max_steps + 1):
            if float(per_step[r - first_comparable, row]) < threshold:
                stop = r
                break
        exits.append(stop)
    return exits


@torch.no_grad()
@pytest.mark.parametrize("criterion", ["kl", "state"])
def test_exit_stops_at_the_first_step_under_the_threshold(criterion, monkeypatch):
    torch.manual_seed(0)
    model = ll.build("rgpt", preset="test", n_layer=4, recurrence_steps=6, gate_bias_init=0.0).eval()
    R = model.config.recurrence_steps
    prompt, token = torch.tensor([[BOS, 4, 5, 6], [BOS, 7, 8, 9], [BOS, 10, 2, 3]]), torch.tensor([[11], [12], [13]])
    probe_values = _record_criterion(monkeypatch, _independent_value)

    def exits(threshold, min_steps=1):
        cache = model.new_cache(3, 8)
        model.prefill(prompt, cache)
        model.decode(token, cache, exit_threshold=threshold, exit_criterion=criterion, min_steps=min_steps)
        return cache.stats["rgpt.exit_steps"]

    assert exits(1e-12) == [R] * 3
    per_step = torch.stack(probe_values)  # (steps compared, rows): the criterion at each step, computed apart
    first_comparable = 2 if criterion == "kl" else 1  # KL needs a previous distribution
    threshold = float(per_step.median())  # some rows settle early, others late
    expected = _expected_exits(per_step, threshold, 1, first_comparable, R)
    assert exits(threshold) == expected
    assert len(set(expected)) > 1  # the test exercises different exit steps
    later = min(expected) + 1  # min_steps past the earliest exit moves that row's exit
    assert exits(threshold, later) == _expected_exits(per_step, threshold, later, first_comparable, R) != expected


@torch.no_grad()
def test_fbt_auto_passes_stop_when_and_only_when_the_change_is_under_tolerance(monkeypatch):
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test").eval()
    prompt = torch.tensor([[BOS, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    states = model(prompt, passes=fbt_module.AUTO_MAX_PASSES, return_passes=True).pass_hidden
    changes = [float(_independent_value("state", new, old).max()) for old, new in zip(states, states[1:])]
    for tolerance in sorted(set(changes))[1:4] + [1e-30]:
        monkeypatch.setattr(fbt_module, "AUTO_TOLERANCE", tolerance)
        expected = next((k + 2 for k, change in enumerate(changes) if change < tolerance), len(states))
        out = model.prefill(prompt, model.new_cache(1, 12), regime="fused", passes="auto")
        assert out.info["prefill_passes"] == expected, (tolerance, changes)


# --------------------------------------------------------------------------------------------
# Sampling boundaries on hand-made logits
# --------------------------------------------------------------------------------------------


def _support(logits, **kwargs):
    generator = torch.Generator().manual_seed(0)
    return set(sample_next(logits.repeat(2000, 1), 1.0, generator=generator, **kwargs).tolist())


def test_top_p_keeps_the_token_that_reaches_p_and_no_more():
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()  # exact binary fractions
    assert _support(logits, top_p=0.5) == {0}  # the first token alone reaches 0.5
    assert _support(logits, top_p=0.5 + 1e-6) == {0, 1}
    assert _support(logits, top_p=0.75) == {0, 1}
    assert _support(logits, top_p=0.76) == {0, 1, 2}
    assert _support(logits, top_p=1.0) == {0, 1, 2, 3}
    assert _support(logits, top_p=0.1) == {0}
    tied = torch.zeros(1, 64)  # 64 equal tokens: those that reach p are the lowest ids (a stable sort)
    assert _support(tied, top_p=0.1) == set(range(7))


def test_top_k_keeps_k_tokens_and_ties_at_the_kth():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    assert _support(logits, top_k=1) == {0}
    assert _support(logits, top_k=2) == {0, 1, 2}  # a tie at the k-th value keeps both
    assert _support(logits, top_k=4) == {0, 1, 2, 3}
    assert _support(logits, top_k=50) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=2.0), "top_p"), (dict(top_p=0.0), "top_p"), (dict(top_k=-5), "top_k"), (dict(top_k=0), "top_k"),
    (dict(seed=2**64), "seed"), (dict(max_new_tokens=2.5), "max_new_tokens"), (dict(max_new_tokens=-1), "max_new"),
])
def test_sampling_arguments_are_checked(kwargs, words):
    model = ll.build("gpt", preset="test")
    call = dict(max_new_tokens=4) | kwargs
    with pytest.raises(PromptError, match=words):
        ll.generate(model, [BOS, 1, 2], call.pop("max_new_tokens"), **call)


@pytest.mark.parametrize("prompts, words", [
    ([BOS, 300], "token ids"), ([BOS, -1], "token ids"), ("hello", "encode text"), ([1.5, 2.0], "token ids"),
    (torch.zeros(1, 2, 3, dtype=torch.long), "1-D or 2-D"), (torch.zeros(4), "integer"), ([[1], []], "at least one"),
    ([], "no prompt"),
])
def test_prompt_ids_are_checked(prompts, words):
    model = ll.build("gpt", preset="test")
    with pytest.raises(PromptError, match=words):
        ll.generate(model, prompts, 2)


# --------------------------------------------------------------------------------------------
# Options: declared once, checked once
# --------------------------------------------------------------------------------------------


def test_every_arch_declares_its_options_and_the_engine_checks_them():
    assert {o.name for o in get_arch("fbt").options} == {"regime", "passes"}
    assert {o.name for o in get_arch("lrt").options} == {"prefill"}
    assert {o.name for o in get_arch("rgpt").options} == {"steps", "cache_mode", "exit_threshold", "exit_criterion",
                                                          "min_steps", "draft_steps", "draft_tokens"}
    assert get_arch("gpt").options == ()
    rgpt = get_arch("rgpt").options
    with pytest.raises(ll.ConfigError, match="exit_threshold"):
        check_options(rgpt, {"exit_threshold": float("nan")}, "rgpt")
    with pytest.raises(ll.ConfigError, match="steps"):
        check_options(rgpt, {"steps": 10**9}, "rgpt")
    with pytest.raises(ll.ConfigError, match="passes"):
        check_options(get_arch("fbt").options, {"regime": "fused", "passes": 10**9}, "fbt")
    assert check_options(get_arch("fbt").options, {"passes": "auto", "regime": "fused"}, "fbt") == \
        {"regime": "fused", "passes": "auto"}
    option = DecodeOption("passes", int, 2, "", minimum=1, keywords=("auto",))
    assert option.parse("3") == 3 and option.parse("auto") == "auto"
    with pytest.raises(ll.ConfigError, match="integer"):
        option.parse("2.5")


@pytest.mark.parametrize("given, words", [
    ({"min_steps": 2}, "min_steps applies to exit_threshold > 0 only (exit_threshold is 0.0)"),
    ({"exit_criterion": "state"}, "exit_criterion applies to exit_threshold > 0 only"),
    ({"exit_threshold": 0.1, "steps": 3, "min_steps": 4}, "min_steps must be at most the decoding depth (3 steps)"),
    ({"exit_threshold": 0.1, "min_steps": 7}, "min_steps must be at most the decoding depth (6 steps)"),
])
def test_an_adaptive_exits_options_that_could_change_nothing_are_refused(given, words):
    """`--min-steps` without an exit threshold, or above the depth (no step could exit before it),
    decoded as if it had not been given, without a word."""
    model = ll.build("rgpt", preset="test", n_layer=4, recurrence_steps=6).eval()
    with pytest.raises(ll.ConfigError, match=re.escape(words)):
        model_options(model, given)
    assert model_options(model, {"exit_threshold": 0.1, "steps": 3, "min_steps": 3})["min_steps"] == 3
    assert model_options(model, {"exit_threshold": 0.1, "min_steps": 6, "exit_criterion": "state"})["min_steps"] == 6


def test_options_are_checked_once_per_call_not_per_token(monkeypatch):
    calls = []
    import latentloop.engine as engine

    original = engine.check_options
    monkeypatch.setattr(engine, "check_options", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = ll.build("fbt", preset="test")
    ll.generate(model, [BOS, 1, 2], 12, temperature=0.0, regime="soft")
    assert len(calls) == 1


def test_scoring_modes_come_from_the_spec():
    for name, spec in ARCHS.items():
        config = ll.model_config(name, "test")
        modes = spec.scoring_modes(config)
        assert modes, name
        for options in modes.values():
            check_options(spec.options, options, name)


@pytest.mark.parametrize("name, label, options", [(name, label, options) for name, spec in ARCHS.items()
                                                   for label, options in spec.scoring_modes(
                                                       ll.model_config(name, "test")).items()])
def test_a_prefill_for_decoding_reads_out_the_last_column_and_fills_the_same_cache(name, label, options):
    """`prefill(last_logits=True)`, the engine's and the server's: (B, 1, V) logits equal to the last
    column of the scorer's prefill, left-padded rows included, and a cache the next decode step reads
    the same from."""
    torch.manual_seed(0)
    model = ll.build(name, preset="test").eval()
    prompts = [[BOS, 5, 9, 2, 7, 11, 3], [BOS, 4, 8]]
    idx = torch.tensor([prompts[0], [0] * 4 + prompts[1]])
    pad_mask = torch.tensor([[True] * 7, [False] * 4 + [True] * 3])
    outputs = []
    with torch.no_grad():
        for last in (False, True):
            cache = model.new_cache(2, 12, **options)
            out = model.prefill(idx, cache, pad_mask, last_logits=last, **options)
            step = model.decode(torch.tensor([[6], [6]]), cache, **options)
            outputs.append((out, step))
    (every, every_step), (newest, newest_step) = outputs
    assert every.logits.shape == (2, 7, model.config.vocab_size)
    assert newest.logits.shape == (2, 1, model.config.vocab_size)
    close(newest.logits, every.logits[:, -1:])
    close(newest.hidden, every.hidden)
    close(newest_step.logits, every_step.logits)


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_gpt():
    torch.manual_seed(0)
    return ll.build("gpt", preset="test", n_kv_head=2).eval()


@settings(max_examples=12, deadline=None)
@given(st.lists(st.lists(st.integers(0, 255), min_size=0, max_size=12), min_size=1, max_size=4))
def test_left_padding_never_changes_a_row(small_gpt, bodies):
    prompts = [[BOS] + body for body in bodies]
    batched = ll.generate(small_gpt, prompts, 5, temperature=0.0)
    assert batched == [ll.generate(small_gpt, p, 5, temperature=0.0) for p in prompts]


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=60))
def test_byte_tokenizer_round_trips(text):
    from latentloop.data import ByteTokenizer

    tokenizer = ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert b"".join(tokenizer.token_to_bytes(t) for t in tokenizer.encode(text)) == text.encode("utf-8")


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=8), st.lists(st.floats(allow_nan=True), max_size=4))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(ARCHS)), st.dictionaries(st.sampled_from(
    ["vocab_size", "sequence_len", "n_layer", "n_embd", "n_head", "n_kv_head", "mlp", "mlp_ratio", "logit_softcap",
     "rope_theta", "bos_id", "jitter", "pass_mix", "plain_fraction", "source_layer", "inject_layers", "subsets",
     "recurrence_steps", "n_rec", "gate_temperature", "tie_embeddings", "unknown_field", "recipe", "feedback_start",
     "run_mix", "residual_lr", "kv_gate_channels", "value_embeds", "gate_bias_init"]), _VALUES, max_size=4))
def test_config_validation_raises_only_config_errors(arch, fields):
    try:
        ll.model_config(arch, "test", **fields)
    except ll.ConfigError:
        pass
