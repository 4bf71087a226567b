"""Self-speculative decoding (`engine.stream` with an arch's `draft_steps` / `draft_tokens`): for every
architecture whose spec declares a draft of itself, greedy output equals full-depth decoding token for
token (one row, a ragged batch whose rows accept prefixes of different lengths, stop tokens, budgets),
the cache after rejected drafts is the one plain decoding builds, sampled output has the full depth's
distribution (a chi-square test against the exact joint of the first tokens, which catches a planted
acceptance bug), and options that cannot be drafted are refused in one line.

No architecture is named here: the kinds are those of the contract suite whose spec has a `draft`.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import contract_kinds, needs_cxx

import latentloop.engine as engine
from latentloop import build
from latentloop.archs import ARCHS, get_arch
from latentloop.cli import main
from latentloop.data.tokenizers import ByteTokenizer
from latentloop.engine import generate, model_options, sampling_probs, stream, teacher_forced_logits
from latentloop.errors import ConfigError
from latentloop.inference.speculative import CompiledDrafting, compiled_drafting_reason
from latentloop.models.backbone import PER_ROW_INFO
from latentloop.models.cache import KVCache
from latentloop.runs import save_run

KINDS = {kind: (arch, fields) for kind, (arch, fields) in contract_kinds().items() if get_arch(arch).draft is not None}
BOS = 256  # the byte tokenizer's
PROMPTS = ([BOS, *b"hello"], [BOS, *b"a latent"], [BOS, *b"hi"])  # of different lengths: a ragged batch
NEW_TOKENS = 16
LONG_DECODE = 40  # long enough for the holes of ragged rounds to fill a cache (measured: every kind compacts)
# A one-step draft of the random test models: it agrees with the full depth often enough to accept some
# drafts and disagrees often enough to reject some (measured: acceptance 0.06-0.7 across the kinds)
DRAFTS = [{"draft_steps": 1, "draft_tokens": 3}, {"draft_steps": 1, "draft_tokens": 1}, {"draft_tokens": 5}]
# fp32: the full depth over k + 1 tokens in one pass against k + 1 one-token passes (other product
# shapes, the same function): log-probabilities differ by rounding, ~1e-6 (measured)
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread: at these sizes a second buys nothing, and on busy cores OpenMP threads that
    wait for each other made the 4000-row batches below 7x slower (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(kind: str):
    arch, fields = KINDS[kind]
    torch.manual_seed(0)
    return build(arch, preset="test", **fields).eval()


@pytest.fixture(scope="module")
def models():
    return {kind: _build(kind) for kind in KINDS}


def test_the_drafting_archs_are_those_that_declare_the_draft_options():
    assert KINDS, "no registered architecture declares a draft of itself"
    for arch, spec in ARCHS.items():
        declared = {option.name for option in spec.options}
        assert (spec.draft is not None) == ({"draft_steps", "draft_tokens"} <= declared), arch


class _Spy:
    """Records what each verification kept per row (the `kept` of `keep_verified`)."""

    def __init__(self, model, monkeypatch):
        self.kept: list[list[int]] = []
        keep = model.keep_verified

        def spy(cache, out, kept, state_before, options):
            self.kept.append(kept.tolist())
            return keep(cache, out, kept, state_before, options)

        monkeypatch.setattr(model, "keep_verified", spy)


def _greedy(model, prompts, **options):
    steps = list(stream(model, prompts, NEW_TOKENS, temperature=0.0, logprobs=True, compile=False, **options))
    tokens = [[step.tokens[row] for step in steps] for row in range(len(prompts))]
    logprobs = torch.tensor([[step.logprobs[row] or 0.0 for step in steps] for row in range(len(prompts))])
    return tokens, logprobs, steps[-1].info


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_self_speculative_decoding_equals_the_full_depth(kind, models, monkeypatch):
    """One row and a ragged batch, every draft setting: the tokens are the full depth's and so are their
    log-probabilities; some drafts were accepted and some rejected, and in the batch rows kept
    prefixes of different lengths in one verification (the ragged rollback ran)."""
    model = models[kind]
    acceptance, ragged, fewer_passes = [], False, False
    for options in DRAFTS:
        for prompts in ([PROMPTS[0]], list(PROMPTS)):
            spy = _Spy(model, monkeypatch)
            tokens, logprobs, info = _greedy(model, prompts, **options)
            monkeypatch.undo()
            plain_tokens, plain_logprobs, _ = _greedy(model, prompts)
            assert tokens == plain_tokens, options
            torch.testing.assert_close(logprobs, plain_logprobs, rtol=TOL, atol=TOL)
            acceptance.append(info["draft_acceptance"])
            assert len(info[PER_ROW_INFO]["draft_acceptance"]) == len(prompts)
            ragged = ragged or any(len(set(kept)) > 1 for kept in spy.kept)
            assert info["full_passes"] == len(spy.kept)
            fewer_passes = fewer_passes or info["full_passes"] < NEW_TOKENS - 1  # plain: a pass per token
    assert min(acceptance) < 1 and max(acceptance) > 0, acceptance  # drafts were rejected, and accepted
    assert ragged, "no verification kept prefixes of different lengths in a batch"
    assert fewer_passes, "drafting never saved a full-depth pass"


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_token_reports_the_facts_plain_decoding_reports_for_it(kind, models):
    """A per-row fact of a token (mor's routing depth) is the one plain decoding reports at that step:
    the verification pass's column that made the token, not its last column (often a rejected
    draft's), nor the round's for every token it queued."""
    model = models[kind]

    def facts(options):
        steps = stream(model, list(PROMPTS), NEW_TOKENS, temperature=0.0, compile=False, **options)
        return [step.info.get(PER_ROW_INFO, {}) for step in steps]

    plain = facts({})
    names = {name for step in plain for name in step}
    for options in DRAFTS:
        drafted = facts(options)
        assert len(drafted) == len(plain) == NEW_TOKENS  # no stop token: every row to its budget
        for step, (want, got) in enumerate(zip(plain, drafted)):
            assert {name: got[name] for name in names} == {name: want[name] for name in names}, (options, step)


@pytest.mark.parametrize("kind", list(KINDS))
def test_stop_tokens_budgets_and_beyond_the_trained_depth(kind, models):
    """A stop token inside an accepted prefix ends its row there (the other rows go on); a budget that
    ends inside a round yields exactly the budget; a decoding depth beyond the trained one drafts too."""
    model = models[kind]
    rows = list(PROMPTS)
    plain = generate(model, rows, NEW_TOKENS, temperature=0.0, compile=False)
    stop = plain[0][5]
    expected = generate(model, rows, NEW_TOKENS, temperature=0.0, stop_tokens=[stop], compile=False)
    assert generate(model, rows, NEW_TOKENS, temperature=0.0, stop_tokens=[stop], draft_steps=1,
                    draft_tokens=4) == expected
    for budget in (1, 2, 3, 7):
        assert generate(model, rows, budget, temperature=0.0, draft_steps=1, draft_tokens=4) == \
            [row[:budget] for row in plain]
    trained = getattr(model.config, "recurrence_steps", None)
    if trained is not None:  # a depth past the trained one is allowed (rgpt's)
        deeper = trained + 2
        assert generate(model, rows, NEW_TOKENS, temperature=0.0, steps=deeper, draft_steps=2) == \
            generate(model, rows, NEW_TOKENS, temperature=0.0, steps=deeper, compile=False)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_long_ragged_decode_compacts_its_cache_and_stays_exact(kind, models, monkeypatch):
    """Rows that keep prefixes of different lengths leave holes that grow the cache faster than the
    rows grow; before the cache overflows the engine packs them away (`compact`), mid-decode, and the
    tokens stay the full depth's."""
    model = models[kind]
    compactions = []
    compact = KVCache.compact

    def counting(cache):
        compactions.append(cache.length)
        return compact(cache)

    monkeypatch.setattr(KVCache, "compact", counting)
    plain = generate(model, list(PROMPTS), LONG_DECODE, temperature=0.0, compile=False)
    for steps in (1, 2):
        assert generate(model, list(PROMPTS), LONG_DECODE, temperature=0.0, draft_steps=steps, draft_tokens=6) == plain
    assert compactions, "no decode needed its holes packed"


def _capture_caches(model, monkeypatch) -> list:
    made = []
    new_cache = model.new_cache

    def capture(*args, **kwargs):
        made.append(new_cache(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(model, "new_cache", capture)
    return made


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_cache_after_rejected_drafts_is_the_one_plain_decoding_builds(kind, models, monkeypatch):
    """One row: after a speculative decode (drafts rejected on the way), the engine's cache holds the
    positions plain decoding of the kept tokens gives, every slot past them as a fresh cache has it
    (a draft's keys left behind, or mor's route flags, would show), the same carried state, and
    decoding on through it gives the plain cache's logits token after token. (Keys and values of
    the kept tokens are compared through those logits: an arch may leave invisible entries that
    depend on how tokens were grouped into calls, mor's keys of recursions a token skipped.)"""
    model = models[kind]
    prompt = PROMPTS[0]
    made = _capture_caches(model, monkeypatch)
    spy = _Spy(model, monkeypatch)
    tokens = generate(model, prompt, NEW_TOKENS, temperature=0.0, draft_steps=1, draft_tokens=3, compile=False)
    monkeypatch.undo()
    assert any(kept[0] < 4 for kept in spy.kept), "no draft was rejected"
    (cache,) = made
    options = model_options(model, {})
    plain = model.new_cache(1, cache.max_len, **options)
    with torch.inference_mode():
        model.prefill(torch.tensor([prompt]), plain, **options)
        in_cache = cache.length - len(prompt)  # the generated tokens the speculative cache holds
        for token in tokens[:in_cache]:
            model.decode(torch.tensor([[token]]), plain, **options)
        assert (plain.length, plain.next_pos.tolist()) == (cache.length, cache.next_pos.tolist())
        assert torch.equal(plain.key_pos, cache.key_pos)
        assert not cache.k[:, :, :, cache.length:].any() and not cache.v[:, :, :, cache.length:].any()
        for name, value in plain.state.items():
            torch.testing.assert_close(cache.state[name], value, rtol=TOL, atol=TOL)
        onwards = (tokens[in_cache:] + [1, 2, 3])[:cache.max_len - cache.length]
        assert len(onwards) >= 3
        for token in onwards:
            torch.testing.assert_close(model.decode(torch.tensor([[token]]), cache, **options).logits,
                                       model.decode(torch.tensor([[token]]), plain, **options).logits,
                                       rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_ragged_rollback_and_compaction_leave_each_row_decoding_as_alone(kind, models):
    """Rows of a left-padded batch keep different numbers of the tokens of one decode call
    (`keep_verified`), then the cache is compacted: each row's next logits are those of the row
    decoded alone through a plain cache of its kept tokens."""
    model = models[kind]
    options = model_options(model, {})
    rows = list(PROMPTS)
    added = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]
    kept = [1, 4, 2]
    following = torch.tensor([[20], [21], [22]])
    with torch.inference_mode():
        idx, pad_mask = engine.left_pad(rows, 0, torch.device("cpu"))
        cache = model.new_cache(len(rows), 24, **options)
        model.prefill(idx, cache, pad_mask, **options)
        before = {name: value.clone() for name, value in cache.state.items()}
        out = model.decode(torch.tensor(added), cache, **options)
        model.keep_verified(cache, out, torch.tensor(kept), before, options)
        assert cache.length == idx.shape[1] + max(kept)
        kept_state = {name: value.clone() for name, value in cache.state.items()}
        together = model.decode(following, cache, **options).logits[:, -1]
        cache.rewind(1)  # and the state that token left (an arch's carried state) goes with it
        cache.state = kept_state
        cache.compact()
        assert cache.length == max(len(p) + n for p, n in zip(rows, kept))
        compacted = model.decode(following, cache, **options).logits[:, -1]
        for row, (prompt, extra, n) in enumerate(zip(rows, added, kept)):
            alone = model.new_cache(1, 24, **options)
            model.prefill(torch.tensor([prompt]), alone, **options)
            for token in extra[:n]:
                model.decode(torch.tensor([[token]]), alone, **options)
            expected = model.decode(following[row:row + 1], alone, **options).logits[0, -1]
            torch.testing.assert_close(together[row], expected, rtol=TOL, atol=TOL)
            torch.testing.assert_close(compacted[row], expected, rtol=TOL, atol=TOL)


# -- sampling: the full depth's distribution ---------------------------------------------------------
STAT_VOCAB = 4  # a tiny vocabulary: the exact joint of the first tokens has STAT_VOCAB ** STAT_TOKENS cells
STAT_TOKENS = 4  # the prefill's token, then one round: two drafts and the token after them
STAT_DRAWS = 4000  # rows of one batch, each an independent draw
STAT_PROMPT = [0, 3, 1]
STAT_SHAPE = dict(n_embd=32, n_head=2)  # the test preset, narrower: 4000 rows decode in a second
MIN_EXPECTED = 5  # the chi-square test's rule: cells expected fewer times are pooled into one
FALSE_ALARM = 1e-3  # a correct sampler fails this test for one seed in a thousand
PLANTED_P = 1e-9  # a planted acceptance bug must fail by far


def _stat_model(kind: str):
    arch, fields = KINDS[kind]
    torch.manual_seed(0)
    return build(arch, preset="test", vocab_size=STAT_VOCAB, bos_id=0, **STAT_SHAPE, **fields).eval()


def _temperature(model) -> float:
    """The spread of the full depth's next-token logits after the prompt: sampling at it gives
    distributions neither flat nor one-hot, whatever the random model's logit scale."""
    logits = teacher_forced_logits(model, torch.tensor([STAT_PROMPT]), prompt_len=len(STAT_PROMPT))[0, -1]
    return float(logits.std())


def _exact_joint(model, temperature: float, top_k: int | None, top_p: float | None = None) -> torch.Tensor:
    """P(t_1 .. t_STAT_TOKENS) under full-depth sampling, (V ** n,) flattened in row-major order of
    the tokens, from teacher-forced full-depth logits of every continuation."""
    V, n = STAT_VOCAB, STAT_TOKENS
    joint = torch.ones(1, dtype=torch.float64)
    for length in range(n):
        prefixes = torch.tensor(list(itertools.product(range(V), repeat=length)), dtype=torch.long)
        prefixes = prefixes.reshape(V ** length, length)  # (1, 0) for the empty prefix
        idx = torch.cat([torch.tensor(STAT_PROMPT).expand(prefixes.shape[0], -1), prefixes], dim=1)
        # the prompt prefilled and the rest decoded through the cache, as generation runs them (fbt's
        # soft regime scores a text otherwise by default)
        logits = teacher_forced_logits(model, idx, prompt_len=len(STAT_PROMPT))[:, -1]  # (V ** length, V)
        joint = (joint[:, None] * sampling_probs(logits, temperature, top_k, top_p).double()).reshape(-1)
    return joint


def _chi_square_p(draws: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of the chi-square goodness-of-fit of draws (N, n) token ids to the joint `expected`
    (cells expected fewer than MIN_EXPECTED times pooled into one)."""
    N = draws.shape[0]
    cells = (draws * STAT_VOCAB ** torch.arange(STAT_TOKENS - 1, -1, -1)).sum(dim=1)
    observed = torch.bincount(cells, minlength=expected.numel()).double()
    counts = expected * N
    big = counts >= MIN_EXPECTED
    observed = torch.cat([observed[big], observed[~big].sum()[None]])
    counts = torch.cat([counts[big], counts[~big].sum()[None]])
    statistic = ((observed - counts) ** 2 / counts.clamp(min=1e-12)).sum()
    freedom = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2, dtype=torch.float64), statistic / 2))


def _speculative_draws(model, temperature: float, top_k: int | None, seed: int,
                       top_p: float | None = None) -> torch.Tensor:
    rows = generate(model, [STAT_PROMPT] * STAT_DRAWS, STAT_TOKENS, temperature=temperature, top_k=top_k,
                    top_p=top_p, seed=seed, draft_steps=1, draft_tokens=STAT_TOKENS - 2)
    return torch.tensor(rows)


@pytest.mark.parametrize("kind", list(KINDS))
def test_sampled_self_speculative_decoding_has_the_full_depths_distribution(kind):
    """STAT_DRAWS independent rows of the first STAT_TOKENS tokens (the drafted and bonus positions
    of one round) against the exact full-depth joint: a chi-square test at FALSE_ALARM, plain, with
    top_k and with top_p (the acceptance must compare the distributions the sampler draws from)."""
    model = _stat_model(kind)
    temperature = _temperature(model)
    for top_k, top_p, seed in ((None, None, 0), (3, None, 1), (None, 0.8, 2)):
        draws = _speculative_draws(model, temperature, top_k, seed, top_p)
        p = _chi_square_p(draws, _exact_joint(model, temperature, top_k, top_p))
        assert p > FALSE_ALARM, (top_k, top_p, p)


def _always_accept(logits, drafts, draft_logits, temperature, top_k=None, top_p=None, generator=None):
    k = drafts.shape[1]
    accepted = torch.full((logits.shape[0],), k, dtype=torch.long)
    return accepted, engine.sample_next(logits[:, k], temperature, top_k, top_p, generator)


def _correct_from_p(logits, drafts, draft_logits, temperature, top_k=None, top_p=None, generator=None):
    """The acceptance test, but a rejected draft is replaced by a draw from p, not from the residual."""
    p = sampling_probs(logits, temperature, top_k, top_p)
    q = sampling_probs(draft_logits, temperature, top_k, top_p)
    ratio = p[:, :-1].gather(-1, drafts[..., None]) / q.gather(-1, drafts[..., None])
    u = torch.rand(ratio.shape[:2], generator=generator)
    accepted = (u < ratio[..., 0]).long().cumprod(dim=1).sum(dim=1)
    at = p[torch.arange(p.shape[0]), accepted]
    return accepted, torch.multinomial(at, 1, generator=generator).squeeze(1)


@pytest.mark.parametrize("planted", [_always_accept, _correct_from_p], ids=["always-accept", "correct-from-p"])
def test_the_distribution_test_catches_a_planted_acceptance_bug(planted, monkeypatch):
    """The test above has power: on the drafting kind whose draft differs most from its full depth,
    a sampler that keeps every draft, or that corrects a rejection from p instead of the residual,
    fails it by far."""
    def gap(kind: str) -> float:
        model = _stat_model(kind)
        idx = torch.tensor([STAT_PROMPT])
        temperature = _temperature(model)
        full = sampling_probs(teacher_forced_logits(model, idx, prompt_len=idx.shape[1])[0], temperature)
        draft = sampling_probs(teacher_forced_logits(model, idx, prompt_len=idx.shape[1], steps=1)[0], temperature)
        return float((full - draft).abs().sum(dim=-1).mean() / 2)  # mean total variation over the positions

    kind = max(KINDS, key=gap)
    assert gap(kind) > 0.2
    model = _stat_model(kind)
    temperature = _temperature(model)
    monkeypatch.setattr(engine, "accept_drafts", planted)
    draws = _speculative_draws(model, temperature, None, 0)
    assert _chi_square_p(draws, _exact_joint(model, temperature, None)) < PLANTED_P


# -- the fast path: the rounds over a static cache (CompiledDrafting) ------------------------------------
def _static_rounds(monkeypatch, compile: bool = False) -> list:
    """Route the engine's compiled drafting through `CompiledDrafting(compile=compile)` and record each
    instance (compile=False: the same static-cache work, eagerly: seconds instead of a compile)."""
    made = []

    def build_drafting(*args, **kwargs):
        made.append(CompiledDrafting(*args, **kwargs, compile=compile))
        return made[-1]

    monkeypatch.setattr(engine, "CompiledDrafting", build_drafting)
    return made


def _compiling_kind(models) -> str:
    """A drafting kind whose drafting compiles (a fixed-depth step)."""
    for kind, model in models.items():
        options = model_options(model, DRAFTS[0])
        if compiled_drafting_reason(model, options, model.draft_options(options), 1) is None:
            return kind
    raise AssertionError("no drafting kind compiles its rounds")


@pytest.mark.parametrize("kind", list(KINDS))
def test_rounds_over_the_static_cache_equal_the_full_depth(kind, models, monkeypatch):
    """One row on the fast path's static cache (`compile=True`; eager rounds where the arch's step does not
    compile, which is checked too): every draft setting gives the full
    depth's tokens and log-probabilities, with drafts accepted and rejected; budgets that end inside
    a round give exactly the budget; a decode up to the context's end (its last round drafts fewer
    tokens, verified eagerly) stays exact; after it the slots past the kept tokens are empty."""
    model = models[kind]
    made = _static_rounds(monkeypatch)
    prompt = [PROMPTS[0]]
    plain_tokens, plain_logprobs, _ = _greedy(model, prompt)
    reason = compiled_drafting_reason(model, model_options(model, DRAFTS[0]), model.draft_options(
        model_options(model, DRAFTS[0])), 1)
    acceptance = []
    for options in DRAFTS:
        steps = list(stream(model, prompt, NEW_TOKENS, temperature=0.0, logprobs=True, compile=True, **options))
        assert [step.tokens[0] for step in steps] == plain_tokens[0], options
        torch.testing.assert_close(torch.tensor([[step.logprobs[0] for step in steps]]), plain_logprobs,
                                   rtol=TOL, atol=TOL)
        acceptance.append(steps[-1].info["draft_acceptance"])
        if reason is not None:  # the arch's step does not compile (mor's routing): eager rounds, no static cache
            assert not made
            continue
        cache = made[-1].cache
        assert type(cache).__name__.startswith("Static") and cache.static
        assert (cache.key_pos[:, cache.filled:] == -1).all()
        assert not any(slot[:, :, cache.filled:].any() for slot in (*cache.k_slots, *cache.v_slots))
    assert min(acceptance) < 1 and max(acceptance) > 0, acceptance
    plain = generate(model, prompt, NEW_TOKENS, temperature=0.0, compile=False)
    for budget in (2, 3, 7):
        assert generate(model, prompt, budget, temperature=0.0, compile=True, draft_steps=1,
                        draft_tokens=4) == [row[:budget] for row in plain]
    near_the_end = (PROMPTS[0] * model.config.sequence_len)[:model.config.sequence_len - 9]  # 9 tokens of room
    assert generate(model, near_the_end, 9, temperature=0.0, compile=True, draft_steps=1, draft_tokens=6) == \
        generate(model, near_the_end, 9, temperature=0.0, compile=False)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_seed_samples_the_same_tokens_on_the_static_cache_as_eagerly(kind, models, monkeypatch):
    """The static cache's rounds draft their fixed k even where fewer tokens are wanted (a budget that
    ends inside a round); those drafts draw no random numbers and are not judged, so a seed gives the
    eager rounds' tokens (which draft only what is wanted): "auto" may switch paths mid-decode."""
    model = models[kind]
    _static_rounds(monkeypatch)
    for seed in range(3):
        for budget in (5, 6, 7):
            sampled = dict(temperature=1.0, top_k=50, top_p=0.9, seed=seed, draft_steps=1, draft_tokens=4)
            eager = generate(model, [PROMPTS[0]], budget, compile=False, **sampled)
            static = generate(model, [PROMPTS[0]], budget, compile=True, **sampled)
            assert static == eager, (seed, budget)


def test_the_automatic_mode_moves_a_speculative_decode_onto_the_static_cache(models, monkeypatch):
    """`compile="auto"` (the default) drafts eagerly first; once the rule says compiling pays, the rest
    of the decode adopts the cache on the fast path, and the tokens stay the full depth's. Several rows
    stay eager (rows accept drafts of different lengths; the static cache's share one write slot)."""
    model = models[_compiling_kind(models)]
    made = _static_rounds(monkeypatch)
    monkeypatch.setattr(engine.AutoCompile, "decide", lambda self, eager_step_s, remaining, cache: True)
    monkeypatch.setattr(engine.AutoCompile, "note_compiled", lambda self, cache, seconds: None)
    plain = generate(model, PROMPTS[0], NEW_TOKENS, temperature=0.0, compile=False)
    assert generate(model, PROMPTS[0], NEW_TOKENS, temperature=0.0, draft_steps=1, draft_tokens=2) == plain
    assert len(made) == 1 and made[0].cache.static
    batch = list(PROMPTS)
    assert generate(model, batch, NEW_TOKENS, temperature=0.0, draft_steps=1, draft_tokens=2) == \
        generate(model, batch, NEW_TOKENS, temperature=0.0, compile=False)
    assert len(made) == 1


def test_a_frozen_static_cache_takes_back_the_same_slots_of_every_row(models):
    """Its rows share one write position: keeping different counts per row is refused, not misread."""
    from latentloop.inference.fast import FastDecoder

    model = models[_compiling_kind(models)]
    decoder = FastDecoder(model, compile=False)
    cache = decoder.new_cache(2, 16)
    with torch.inference_mode():
        model.prefill(torch.tensor([PROMPTS[0][:4]] * 2), cache)
        decoder.begin_decoding(cache)
        decoder.step(torch.tensor([1, 2]))
        with pytest.raises(ValueError, match="the same slots of every row"):
            cache.keep_recent(torch.tensor([0, 1]), 1)
        cache.keep_recent(torch.tensor([0, 0]), 1)
    assert cache.filled == 4 and (cache.key_pos[:, 4:] == -1).all() and cache.next_pos.tolist() == [4, 4]


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("kind", list(KINDS))
def test_compiled_self_speculative_decoding_equals_the_full_depth(kind, models, monkeypatch):
    """The compiled rounds (the draft's compiled step, the compiled verification of k + 1 tokens):
    the full depth's tokens, and log-probabilities within the compiled step's rounding."""
    model = models[kind]
    options = model_options(model, DRAFTS[0])
    reason = compiled_drafting_reason(model, options, model.draft_options(options), 1)
    if reason is not None:
        pytest.skip(f"{kind}: {reason}")
    made = _static_rounds(monkeypatch, compile=True)
    plain_tokens, plain_logprobs, _ = _greedy(model, [PROMPTS[0]])
    steps = list(stream(model, [PROMPTS[0]], NEW_TOKENS, temperature=0.0, logprobs=True, compile=True,
                        draft_steps=1, draft_tokens=3))
    assert [step.tokens[0] for step in steps] == plain_tokens[0]
    torch.testing.assert_close(torch.tensor([[step.logprobs[0] for step in steps]]), plain_logprobs,
                               rtol=1e-4, atol=1e-4)  # reductions in another order than eager's products
    assert made[-1]._verified_once and made[-1].drafter.compiled


# -- refusals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
def test_options_that_cannot_be_drafted_are_refused_in_one_line(kind, models):
    model = models[kind]
    with pytest.raises(ConfigError, match=r"draft_steps must be below the decoding depth \(\d+ steps\), got 64"):
        generate(model, PROMPTS[0], 4, draft_steps=64)
    with pytest.raises(ConfigError, match="no shallower draft"):
        generate(model, PROMPTS[0], 4, steps=1, draft_tokens=2)
    with pytest.raises(ConfigError, match="draft_tokens=2 needs the cache"):
        generate(model, PROMPTS[0], 4, draft_tokens=2, use_cache=False)
    with pytest.raises(ConfigError, match="draft_tokens must be an integer in"):
        generate(model, PROMPTS[0], 4, draft_tokens=0)
    names = {option.name for option in model.OPTIONS}
    if "cache_mode" in names:
        with pytest.raises(ConfigError, match="needs cache_mode full"):
            generate(model, PROMPTS[0], 4, draft_tokens=2, cache_mode="mean")
    if "exit_threshold" in names:
        with pytest.raises(ConfigError, match="does not combine with exit_threshold"):
            generate(model, PROMPTS[0], 4, draft_tokens=2, exit_threshold=0.1)


def test_the_cli_refuses_an_impossible_draft_in_one_line(tmp_path, capsys):
    kind = next(iter(KINDS))
    run = tmp_path / "run"
    save_run(_build(kind), ByteTokenizer(), run)
    capsys.readouterr()
    code = main(["generate", str(run), "--prompt", "hi", "--max-new-tokens", "2", "--draft-steps", "200"])
    err = capsys.readouterr().err
    assert code != 0 and "draft_steps" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# -- the benchmark -------------------------------------------------------------------------------------
def test_the_speculative_benchmark_reports_every_drafting_arch_at_a_tiny_scale(tmp_path, corpus, capsys):
    """`benchmarks.speculative` on a random run of each drafting arch (the real measurement trains
    them first: its docstring): equal greedy tokens, an acceptance rate, tokens per full pass and a
    paired speedup per round for each draft that fits under the depth; one that does not is skipped
    with its reason; a run of an arch without a draft is one line."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from benchmarks.speculative import main as benchmark
    finally:
        sys.path.pop(0)
    runs = []
    for arch in dict.fromkeys(arch for arch, _ in KINDS.values()):
        torch.manual_seed(0)
        save_run(build(arch, preset="test"), ByteTokenizer(), tmp_path / arch)
        runs.append(str(tmp_path / arch))
    out = tmp_path / "speculative.json"
    assert benchmark([*runs, "--data", f"text:{corpus}", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "6",
                      "--rounds", "2", "--draft-steps", "1,64", "--draft-tokens", "2", "--no-compiled",
                      "--threads", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["runs"]
    assert [entry["arch"] for entry in results.values()] == list(dict.fromkeys(a for a, _ in KINDS.values()))
    for entry in results.values():
        (draft,) = entry["drafts"].values()
        assert draft["greedy_equal"] and 0 <= draft["acceptance"] <= 1 and draft["tokens_per_full_pass"] >= 1
        assert len(draft["speedup_vs_eager_all"]) == 2 and "speedup_vs_compiled_all" not in draft
        assert len(entry["skipped"]) == 1 and "draft_steps must be below the decoding depth" in entry["skipped"][0]
    assert "speedup over eager full depth" in capsys.readouterr().out
    gpt = tmp_path / "gpt"
    save_run(build("gpt", preset="test"), ByteTokenizer(), gpt)
    assert benchmark([str(gpt), "--data", f"text:{corpus}", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "declares no draft" in err and len(err.strip().splitlines()) == 1
