"""Engine: cached vs naive generation, batching, sampling controls, stop tokens, streaming."""

import pytest
import torch

import latentloop as ll
from latentloop.engine import PromptError, sample_next


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ll.build("gpt", preset="test", n_kv_head=2).eval()


PROMPTS = [[256, 5, 9, 12, 40, 41], [256, 7], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def test_cached_and_uncached_greedy_give_identical_tokens(model):
    cached = ll.generate(model, PROMPTS, 24, temperature=0.0)
    naive = ll.generate(model, PROMPTS, 24, temperature=0.0, use_cache=False)
    assert cached == naive
    assert all(len(row) == 24 for row in cached)


def test_batched_prompts_of_different_lengths_match_single_prompts(model):
    batched = ll.generate(model, PROMPTS, 16, temperature=0.0)
    assert batched == [ll.generate(model, p, 16, temperature=0.0) for p in PROMPTS]


def test_seeded_sampling_is_reproducible_and_cache_independent(model):
    kwargs = dict(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    first = ll.generate(model, PROMPTS, 12, **kwargs)
    assert first == ll.generate(model, PROMPTS, 12, **kwargs)
    assert first == ll.generate(model, PROMPTS, 12, use_cache=False, **kwargs)
    assert first != ll.generate(model, PROMPTS, 12, **{**kwargs, "seed": 8})


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, -5.0, -6.0]]).repeat(400, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=gen).tolist()) == {0, 1}
    # softmax mass of the first token is ~0.66: top_p=0.5 keeps only it, 0.8 keeps two
    assert set(sample_next(logits, 1.0, top_p=0.5, generator=gen).tolist()) == {0}
    assert set(sample_next(logits, 1.0, top_p=0.8, generator=gen).tolist()) == {0, 1}
    assert sample_next(logits[:1], 0.0).item() == 0


def test_stop_tokens_and_streaming(model):
    greedy = ll.generate(model, PROMPTS[0], 10, temperature=0.0)
    stop = greedy[3]
    first_stop = greedy.index(stop)
    out = ll.generate(model, PROMPTS[0], 10, temperature=0.0, stop_tokens=[stop])
    assert out == greedy[:first_stop]
    streamed = [step.tokens for step in ll.stream(model, PROMPTS[0], 10, temperature=0.0, stop_tokens=[stop])]
    assert [t[0] for t in streamed] == out  # the stream ends when the only row stops
    # with two rows, the stopped row reports None while the other goes on
    rows = [PROMPTS[0], PROMPTS[1]]
    both = list(ll.stream(model, rows, 10, temperature=0.0, stop_tokens=[stop]))
    other = ll.generate(model, PROMPTS[1], 10, temperature=0.0, stop_tokens=[stop])
    assert [s.tokens[0] for s in both[:first_stop]] == out and all(s.tokens[0] is None for s in both[first_stop:])
    assert [s.tokens[1] for s in both if s.tokens[1] is not None] == other


def test_prompt_errors(model):
    with pytest.raises(PromptError, match="context"):
        ll.generate(model, list(range(60)), 10)
    with pytest.raises(PromptError, match="at least one token"):
        ll.generate(model, [[1, 2], []], 4)
    with pytest.raises(ll.ConfigError, match="regime"):
        ll.generate(model, [1, 2], 4, regime="soft")


def test_logprobs_and_top_logprobs(model):
    steps = list(ll.stream(model, PROMPTS, 4, temperature=0.0, logprobs=True, top_logprobs=3))
    for step in steps:
        for token, logprob, top in zip(step.tokens, step.logprobs, step.top_logprobs):
            assert len(top) == 3 and top[0] == (token, logprob)  # greedy picks the most likely
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    with pytest.raises(PromptError, match="top_logprobs"):
        ll.stream(model, PROMPTS, 4, top_logprobs=-1)


def test_stream_leaves_the_callers_mode_between_steps_and_generate_matches_it(model):
    """`stream` runs each step in inference mode and gives the caller its own mode back between steps
    (a caller may train or build autograd graphs there); `generate`, which runs no caller code between
    steps, decodes under one inference mode, to the same tokens."""
    modes = []
    tokens = []
    for step in ll.stream(model, PROMPTS, 6, temperature=0.0):
        modes.append(torch.is_inference_mode_enabled())
        tokens.append(step.tokens)
        weight = torch.ones(2, requires_grad=True)
        assert (weight * 2).sum().requires_grad  # autograd records here as outside any decode
    assert modes == [False] * 6
    assert ll.generate(model, PROMPTS, 6, temperature=0.0) == [list(row) for row in zip(*tokens)]
    assert not torch.is_inference_mode_enabled()


def test_one_new_token_makes_no_decoder(model, monkeypatch):
    """The first new token comes from the prefill: with `compile=True` and one new token no decoder
    (nor its static cache) is made, and the token is the eager decode's."""
    import latentloop.engine as engine

    def no_decoder(*args, **kwargs):
        raise AssertionError("a FastDecoder was made for one new token")

    expected = ll.generate(model, PROMPTS, 1, temperature=0.0, compile=False)
    monkeypatch.setattr(engine, "FastDecoder", no_decoder)
    assert ll.generate(model, PROMPTS, 1, temperature=0.0, compile=True) == expected
    assert [len(row) for row in expected] == [1, 1, 1]
