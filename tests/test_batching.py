"""Continuous batching (`latentloop.serve.batch`): requests that join a running batch at different
steps, with different prompts, lengths, sampling settings and seeds, each decode exactly as the
engine decodes them alone (tokens, every token's log-probabilities over the whole vocabulary, and
what the model reports per row), for every registered architecture under each of its option sets;
and the cache regrouping underneath."""

from __future__ import annotations

import pytest
import torch
from conftest import option_sets

import latentloop as ll
from latentloop.archs import ARCHS, get_arch
from latentloop.engine import model_options, row_info, stream
from latentloop.models.cache import regroup, row_span
from latentloop.serve.batch import DecodeBatch, Member, Sampling, couples_rows

# fp32: a row in a batch vs alone, absolute and relative (log-probabilities of ~-5 after many
# recurrent steps differ by ~1e-5 between batch shapes: summation order, not a different function)
TOL = 1e-5
BOS, EOS = 256, 257  # the byte tokenizer's
STOPS = (EOS, BOS)
# (prompts of the request, max new tokens, sampling settings, the batch step at which it joins)
REQUESTS = [
    ([[BOS, *b"def f(x):"]], 7, {"temperature": 0.0}, 0),
    ([[BOS, *b"hi"]], 5, {"temperature": 0.9, "top_k": 20, "seed": 11}, 0),
    ([[BOS, *b"a longer prompt, joining late"]], 6, {"temperature": 0.0}, 2),
    ([[BOS, *b"two rows"], [BOS, *b"of one request"]], 4, {"temperature": 1.2, "top_p": 0.8, "seed": 5}, 3),
    ([[BOS, *b"x"]] * 2, 5, {"temperature": 0.7, "seed": 2}, 3),  # n=2: two rows share one generator
    ([[BOS, *b"last"]], 3, {"temperature": 0.0}, 6),
]
# a row the caller drops (as the server does at a stop string) after this many tokens: (request, row, tokens);
# the other row of its request must still draw what it draws alone
DROPPED = (3, 0, 2)
CASES = [(arch, label, given) for arch in ARCHS for label, given in option_sets(get_arch(arch).options).items()]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread: at these sizes a second buys nothing, and on busy cores threads that wait
    for each other make every step many times slower (as in the contract suite)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    made = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        made[arch] = ll.build(arch, preset="test").eval()
    return made


def alone(model, prompts, new_tokens, sampling, given):
    """The engine's decode of one request by itself: per row, its tokens, the log-probabilities of
    every token at each step (T, V) and the last step's info for the row."""
    V = model.config.vocab_size
    steps = list(stream(model, prompts, new_tokens, stop_tokens=STOPS, top_logprobs=V, **sampling, **given))
    rows = []
    for r in range(len(prompts)):
        tokens = [s.tokens[r] for s in steps if s.tokens[r] is not None]
        logp = torch.full((len(tokens), V), float("nan"))
        for t, step in enumerate(steps[:len(tokens)]):
            ids, values = zip(*step.top_logprobs[r])
            logp[t, list(ids)] = torch.tensor(values)
        rows.append((tokens, logp, row_info(steps[len(tokens) - 1].info, r) if tokens else {}))
    return rows


def run_batch(model, given):
    """The requests through one DecodeBatch, each joining at its step; per row as `alone` gives it."""
    batch = DecodeBatch(model, model_options(model, given), STOPS, keep_logits=True,
                        coupled=couples_rows(model, model_options(model, given)))
    members: list[list[Member]] = []
    seen: dict[int, tuple[list, list]] = {}
    step = 0
    while step <= max(join for *_, join in REQUESTS) or len(batch):
        for prompts, new_tokens, sampling, join in REQUESTS:
            if join == step:
                seed = sampling.get("seed")
                generator = torch.Generator().manual_seed(seed) if seed is not None else None
                how = Sampling(sampling["temperature"], sampling.get("top_k"), sampling.get("top_p"), generator)
                members.append([Member(p, new_tokens, how) for p in prompts])
                batch.add(members[-1])
        for out in batch.step():
            tokens, logits = seen.setdefault(id(out.member), ([], []))
            if out.token is not None:
                tokens.append(out.token)
                logits.append(out.logits.float().log_softmax(-1))
            request, row, after = DROPPED
            if len(members) > request and out.member is members[request][row] and len(tokens) == after:
                batch.drop(out.member)
        step += 1
        assert step < 100, "the batch never emptied"
    return [[(seen[id(m)][0], torch.stack(seen[id(m)][1]) if seen[id(m)][1] else torch.empty(0), m.info)
             for m in request] for request in members], batch


@pytest.mark.parametrize("arch, label, given", CASES, ids=[f"{a}-{label}" for a, label, _ in CASES])
def test_rows_joining_a_running_batch_decode_as_alone(arch, label, given, models):
    model = models[arch]
    together, batch = run_batch(model, given)
    assert batch.regroups >= 4  # rows joined at four steps and left at others: the cache was rebuilt
    for r, ((prompts, new_tokens, sampling, _), rows) in enumerate(zip(REQUESTS, together)):
        for row, ((tokens, logp, info), (want_tokens, want_logp, want_info)) in enumerate(
                zip(rows, alone(model, prompts, new_tokens, sampling, given))):
            if (r, row) == DROPPED[:2]:  # dropped: what it got before is what it gets alone
                assert len(tokens) == DROPPED[2] and tokens == want_tokens[:len(tokens)]
                torch.testing.assert_close(logp, want_logp[:len(tokens)], rtol=TOL, atol=TOL)
                continue
            assert tokens == want_tokens, (prompts, sampling)
            torch.testing.assert_close(logp, want_logp, rtol=TOL, atol=TOL)
            assert info.keys() == want_info.keys()
            for name, value in want_info.items():
                assert info[name] == pytest.approx(value), name


def test_regroup_right_aligns_rows_and_keeps_their_positions():
    """Rows of two caches of different lengths in one: each keeps its keys, positions and state,
    the shorter is preceded by empty slots, and slots no selected row uses are dropped."""
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test").eval()
    long_idx = torch.randint(0, BOS, (2, 6))
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, :4] = False  # row 1 is a 2-token prompt, left-padded
    a = model.new_cache(2, 8)
    model.prefill(long_idx, a, pad)
    b = model.new_cache(1, 3)
    model.prefill(torch.randint(0, BOS, (1, 3)), b)
    assert row_span(a, torch.tensor([1])) == 2 and row_span(a, torch.tensor([0, 1])) == 6
    target = model.new_cache(2, 5)
    regroup(target, [(a, torch.tensor([1])), (b, torch.tensor([0]))])
    assert target.length == 3 and target.has_padding
    assert target.key_pos[:, :3].tolist() == [[-1, 0, 1], [0, 1, 2]]
    assert target.next_pos.tolist() == [2, 3]
    torch.testing.assert_close(target.k[:, 0, :, 1:3], a.k[:, 1, :, 4:6], rtol=0, atol=0)
    torch.testing.assert_close(target.v[:, 1, :, :3], b.v[:, 0, :, :3], rtol=0, atol=0)
    for name in a.state:
        torch.testing.assert_close(target.state[name], torch.cat([a.state[name][1:], b.state[name]]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not fit"):
        regroup(model.new_cache(2, 2), [(a, torch.tensor([0])), (b, torch.tensor([0]))])
