"""Engine: cached vs naive generation, batching, sampling controls, stop tokens, streaming."""

import re

import pytest
import torch

import latentloop as ll
from latentloop.archs import ARCHS
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


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_seed_per_row_draws_what_each_row_draws_alone(arch):
    """One generator for the batch made a row's samples depend on its batch (its position, the other
    rows); with a seed per row each row draws from its own."""
    torch.manual_seed(0)
    net = ll.build(arch, preset="test").eval()
    seeds = [11, 12, 13]
    kwargs = dict(temperature=1.0, top_k=50, compile=False)
    batched = ll.generate(net, PROMPTS, 8, seed=seeds, **kwargs)
    assert batched == [ll.generate(net, p, 8, seed=s, **kwargs) for p, s in zip(PROMPTS, seeds)]
    reordered = ll.generate(net, PROMPTS[::-1], 8, seed=seeds[::-1], **kwargs)
    assert reordered == batched[::-1]
    assert batched != ll.generate(net, PROMPTS, 8, seed=11, **kwargs)  # not one seed for all
    with pytest.raises(PromptError, match="2 seeds for 3 prompts"):
        ll.generate(net, PROMPTS, 8, seed=[1, 2], **kwargs)
    with pytest.raises(PromptError, match="seed must be"):
        ll.generate(net, PROMPTS, 8, seed=[1, -2, 3], **kwargs)


def test_row_seeds_replay_self_speculative_sampling():
    torch.manual_seed(0)
    net = ll.build("rgpt", preset="test").eval()
    kwargs = dict(temperature=1.0, seed=[3, 4, 5], draft_tokens=3, compile=False)
    first = ll.generate(net, PROMPTS, 10, **kwargs)
    assert first == ll.generate(net, PROMPTS, 10, **kwargs) and all(len(row) == 10 for row in first)


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


# --- found by a review of the decoding paths (2026-12-05) -------------------------------------


def test_interleaved_streams_of_a_training_model_each_decode_as_alone():
    """`ll.build` returns a model in training mode; each stream decodes in eval mode. The first stream
    to end put the model back into training while another still decoded: its later steps drew fbt's
    training jitter (other tokens). The model trains again only after the last one ends."""
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test")
    prompt, soft = [3, 4, 5], {"regime": "soft"}  # the review's case: B's tokens diverged from the 7th
    alone = ll.generate(model, prompt, 12, temperature=0, compile=False, **soft)
    assert model.training
    a = ll.stream(model, [1, 2], 2, temperature=0, compile=False, **soft)
    next(a)  # A opens first (it switched the model to eval mode), then B
    b = ll.stream(model, prompt, 12, temperature=0, compile=False, **soft)
    got = [next(b).tokens[0]]
    for _ in a:  # A ends while B is open: it put the model back into training under B
        pass
    got += [step.tokens[0] for step in b]
    assert got == alone and model.training


def test_teacher_forced_logits_score_in_eval_mode_and_refuse_unmasked_padding():
    """Twice on a training-mode fbt model the logits differed (its jitter was on); left padding past
    the prefilled columns was decoded as text (fbt soft prefills position 0 only)."""
    from latentloop.engine import PromptError, teacher_forced_logits

    torch.manual_seed(0)
    model = ll.build("fbt", preset="test")
    idx = torch.randint(0, 256, (2, 10))
    torch.testing.assert_close(teacher_forced_logits(model, idx), teacher_forced_logits(model, idx), rtol=0, atol=0)
    assert model.training
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :4] = False
    with pytest.raises(PromptError, match="left padding reaches past the prefilled 1 columns"):
        teacher_forced_logits(model, idx, mask)
    alone = teacher_forced_logits(model, idx[1:, 4:])  # the padded row scored from where it starts
    padded = teacher_forced_logits(model, idx, mask, prompt_len=5)[1:, 4:]
    torch.testing.assert_close(padded[:, 1:], alone[:, 1:], rtol=1e-4, atol=1e-4)  # float32 rounding


@pytest.mark.parametrize("arguments, words", [({"stop_tokens": 5}, "stop_tokens must be a collection of token ids"),
                                              ({"stop_tokens": ["a"]}, "stop_tokens must be"),
                                              ({"pad_id": -1}, "pad_id must be a token id"),
                                              ({"pad_id": 10**6}, "pad_id must be a token id"),
                                              ({"kv_dtype": "float16", "use_cache": False}, "use_cache=False")])
def test_bad_decoding_arguments_are_one_prompt_error(arguments, words):
    """They were a TypeError, an IndexError from the embedding, or (kv_dtype without a cache) ignored."""
    from latentloop.engine import PromptError

    model = ll.build("gpt", preset="test")
    with pytest.raises(PromptError, match=re.escape(words)):
        ll.generate(model, [256, 5], 2, **arguments)


def test_quantizing_drops_the_models_compiled_steps():
    """A step compiled over the float layers went on running after `quantize_int8`, binding to each
    Int8Linear's dequantised float copy (float products, and the float weights held again)."""
    from latentloop.engine import quantize_int8
    from latentloop.inference import fast

    model = ll.build("gpt", preset="test")
    fast.compiled_steps(model)[("cpu", (), "aot")] = object()  # what a compiled decode leaves on the model
    fast._RAN_SHAPES[model] = {("cpu", ())}
    quantize_int8(model)
    assert not fast.compiled_steps(model) and model not in fast._RAN_SHAPES


def test_mor_steps_past_its_recursions_are_refused_before_any_work():
    """The stack's own check came at the first step: `stream` returned, the CLI printed the prompt,
    then the error."""
    from latentloop.errors import ConfigError

    model = ll.build("mor", preset="test")
    with pytest.raises(ConfigError, match="the trained recursions"):
        ll.stream(model, [256, 5], 2, steps=model.config.recursions + 1)  # no step taken


@pytest.mark.parametrize("arch, options", [*((name, {}) for name in ARCHS), ("fbt", {"regime": "soft"})])
def test_a_text_past_the_context_is_refused_by_teacher_forcing_naming_its_length(arch, options):
    """fbt's soft regime decodes token by token from position 0, and its cache said "65 tokens are
    beyond the context of 64" (a ValueError) whatever the text's length."""
    from latentloop.archs import build_model
    from latentloop.config import model_config
    from latentloop.engine import teacher_forced_logits

    model = build_model(model_config(arch, "test", sequence_len=16))
    with pytest.raises(PromptError, match="the text is 40 tokens, beyond the model's context of 16 tokens"):
        teacher_forced_logits(model, torch.zeros(1, 40, dtype=torch.long), **options)


def test_teacher_forced_scoring_builds_no_autograd_graph(model):
    """Scoring is inference: with its no_grad lost (moved onto a helper above it), fbt's soft steps
    computed their gates another way (the export contract caught the rounding) and every score kept
    a graph."""
    from latentloop.engine import teacher_forced_logits

    assert torch.is_grad_enabled()
    assert not teacher_forced_logits(model, torch.tensor([PROMPTS[0]])).requires_grad


def test_a_stream_dropped_unfinished_at_exit_says_nothing_and_its_steps_run_in_inference_mode(model, tmp_path):
    """A `stream` held in a variable, one step taken, when the interpreter exits: torch's generator
    decorator entered inference mode again to close it, found torch half torn down and printed a
    traceback; a compiled decoder's `__del__` called a module global already gone, another (review).
    The steps still run in inference mode."""
    import subprocess
    import sys

    from latentloop.inference import fast
    from latentloop.inference.fast import FastDecoder

    modes = []
    handle = model.blocks[0].register_forward_hook(lambda *args: modes.append(torch.is_inference_mode_enabled()))
    try:
        steps = ll.stream(model, [1, 2, 3], 3, temperature=0.0)
        next(steps)
        steps.close()
        list(ll.stream(model, [1, 2, 3], 3, temperature=0.0))
    finally:
        handle.remove()
    assert modes and all(modes)
    script = ("import torch\nimport latentloop as ll\ntorch.manual_seed(0)\n"
              "model = ll.build('gpt', preset='test')\n"
              "steps = ll.stream(model, [1, 2, 3], 8, temperature=0.0)\nprint(next(steps).tokens)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    decoder = FastDecoder(model, compile=False)
    real = fast.release_package_cache
    try:
        fast.release_package_cache = None  # as module globals are at the interpreter's exit
        decoder.__del__(_finalizing=lambda: True)
    finally:
        fast.release_package_cache = real
