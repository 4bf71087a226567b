"""Continuous batching (`latentloop.serve.batch`): requests that join a running batch at different
steps, with different prompts, lengths, sampling settings and seeds, each decode exactly as the
engine decodes them alone (tokens, every token's log-probabilities over the whole vocabulary, and
what the model reports per row), for every registered architecture under each of its option sets;
and the cache regrouping underneath."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import needs_cxx, option_sets, round_stored_keys_and_values

import latentloop as ll
from latentloop.archs import ARCHS, get_arch
from latentloop.engine import model_options, row_info, stream
from latentloop.models.cache import regroup, row_span
from latentloop.serve.batch import DecodeBatch, Member, Sampling, SlotBatch, compiles, couples_rows, slot_rows

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


def run_batch(model, given, kind=DecodeBatch, **extra):
    """The requests through one batch (`kind`), each joining at its step; per row as `alone` gives it."""
    options = model_options(model, given)
    batch = kind(model, options, STOPS, keep_logits=True, coupled=couples_rows(model, options), **extra)
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
        if isinstance(batch, SlotBatch) and batch.cache is not None:
            sizes.add(batch.cache.batch_size)
    return [[(seen[id(m)][0], torch.stack(seen[id(m)][1]) if seen[id(m)][1] else torch.empty(0), m.info)
             for m in request] for request in members], batch


@pytest.mark.parametrize("arch, label, given", CASES, ids=[f"{a}-{label}" for a, label, _ in CASES])
def test_rows_joining_a_running_batch_decode_as_alone(arch, label, given, models):
    model = models[arch]
    together, batch = run_batch(model, given)
    assert batch.regroups >= 4  # rows joined at four steps and left at others: the cache was rebuilt
    assert_as_alone(model, given, together)


@needs_cxx
@pytest.mark.parametrize("arch, label, given", CASES, ids=[f"{a}-{label}" for a, label, _ in CASES])
def test_rows_joining_a_batch_on_the_compiled_path_decode_as_alone(arch, label, given, models):
    """The compiled path's batch (static cache, a row per request slot, each row at its own write
    position), its step run eagerly: every row exactly as alone, for every option set whose step
    compiles; the others stay on the eager path (`compiles` is False)."""
    model = models[arch]
    if not compiles(model, model_options(model, given), 8):
        assert arch == "mor" or given.get("exit_threshold"), "only options the fast path refuses stay eager"
        return
    sizes.clear()
    together, batch = run_batch(model, given, SlotBatch, compile=False)
    assert batch.regroups >= 4
    assert {1, 2, 4} <= sizes and all(size == slot_rows(size) for size in sizes), sizes  # grew, and shrank back
    assert_as_alone(model, given, together)


sizes: set[int] = set()  # the batch sizes a SlotBatch ran at in `run_batch`


def assert_as_alone(model, given, together):
    # a batch decodes without the options declared speed-only (self-speculative drafts): the same output
    # as alone with them (tests/test_speculative.py), and what the model reports is the plain decode's
    given = {name: value for name, value in given.items()
             if not next(o for o in model.OPTIONS if o.name == name).speed_only}
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


def test_a_free_row_of_the_compiled_path_never_writes_past_its_buffer(models):
    """A row that left decodes on unseen until a joiner takes it: it is vacated every step, so a
    neighbour that runs to the end of the context never pushes it past the buffer (the eager step
    would raise IndexError; the compiled one would write out of bounds)."""
    model = models["gpt"]
    context = model.config.sequence_len
    batch = SlotBatch(model, model_options(model, {}), (), compile=False)
    runners = [Member([BOS, token], context - 2, Sampling()) for token in (5, 6, 7)]
    short = Member([BOS, *range(1, context - 12)], 2, Sampling())
    batch.add([*runners, short])  # 4 rows; 3 live after `short` leaves: no smaller batch holds them
    produced = 0
    while len(batch):
        produced += sum(step.token is not None and step.member is runners[0] for step in batch.step())
        assert batch.cache is None or batch.cache.batch_size == 4
    assert produced == context - 2


@pytest.mark.parametrize("companion", [False, True], ids=["batch-empties", "batch-runs-on"])
def test_a_row_left_with_non_finite_keys_and_values_does_not_reach_its_next_request(companion, models):
    """A request whose float16 cache overflowed leaves infinities in its row's slots; the next request
    placed into that row attends over a window that covers them, masked, and a masked infinity still
    reaches the output through 0 x inf. Vacating a row zeroes what it stored: when the batch empties
    (the storage's rows are vacated as the next batch grows) and while another row runs on (the row
    is vacated at the next step, with the slots the batch counted for it)."""
    model = models["gpt"]
    batch = SlotBatch(model, model_options(model, {}), STOPS, keep_logits=True, compile=False)
    broken = Member([BOS, *range(40, 60)], 3, Sampling())  # 21 slots: past the next request's window
    batch.add([broken] + ([Member([BOS, 7], 12, Sampling())] if companion else []))
    batch.step()
    with torch.inference_mode():  # the batch's tensors are inference tensors
        for slots in (batch.cache.k_slots, batch.cache.v_slots):
            for slot in slots:
                slot[0, :, 4:21] = float("inf")
    while not broken.done:
        batch.step()
    batch.step()  # the row it left is vacated
    joiner = Member([BOS, *b"hi"], 4, Sampling())
    batch.add([joiner])
    logp = []
    while len(batch):
        logp += [step.logits.float().log_softmax(-1) for step in batch.step()
                 if step.token is not None and step.member is joiner]
    [(_, want, _)] = alone(model, [joiner.prompt], 4, {"temperature": 0.0}, {})
    torch.testing.assert_close(torch.stack(logp), want, rtol=TOL, atol=TOL)


def test_kept_logits_are_the_steps_own_when_the_decoder_writes_one_buffer_again(models):
    """A CPU package writes every step's logits into the same output buffer (`FastDecoder.step`: "copy
    what is kept past it"); `keep_logits` kept a view of it, so the logits kept at earlier steps became
    later steps'. The decoder's step here returns one buffer written again, as the package's does."""
    model = models["gpt"]
    batch = SlotBatch(model, model_options(model, {}), (), keep_logits=True, compile=False)
    step, buffer = batch.decoder.step, {}

    def one_buffer(tokens):
        logits, greedy, info = step(tokens)
        out = buffer.setdefault(logits.shape, torch.empty_like(logits))
        out.copy_(logits)
        return out, greedy, info

    batch.decoder.step = one_buffer
    batch.add([Member([BOS, 5, 9, 12], 5, Sampling())])
    kept, copies = [], []
    while len(batch):
        for out in batch.step():
            if out.token is not None:
                kept.append(out.logits)
                copies.append(out.logits.clone())
    assert len(kept) == 5
    for logits, copy in zip(kept, copies):
        torch.testing.assert_close(logits, copy, rtol=0, atol=0)  # what each step returned, still


def test_the_compiled_path_shrinks_to_a_batch_its_live_rows_do_not_fill(models):
    """16 rows, of which 3 live on in rows 6-8: the batch shrinks to 4 rows, one of them free, the
    live rows moved below the new size (`move_row`), and every row still decodes as alone (each
    step's tokens are one per row of the new batch: a shrink that kept only the live rows' tokens
    handed the compiled step 3 tokens for 4 rows, found under load)."""
    model = models["gpt"]
    batch = SlotBatch(model, model_options(model, {}), STOPS, keep_logits=True, compile=False)
    # prompts of other lengths than the leavers' whose rows they move into: their positions differ
    stayers = [Member([BOS, token, token + 1, token + 2], 8, Sampling()) for token in (5, 6, 7)]
    leavers = [Member([BOS, token], 2, Sampling()) for token in range(10, 16)]
    batch.add([*leavers, *stayers])  # 9 rows: a batch of 16
    got: dict[int, tuple[list, list]] = {id(m): ([], []) for m in stayers}
    seen_sizes = []
    while len(batch):
        for step in batch.step():
            if step.token is not None and id(step.member) in got:
                got[id(step.member)][0].append(step.token)
                got[id(step.member)][1].append(step.logits.float().log_softmax(-1))
        if batch.cache is not None:
            seen_sizes.append(batch.cache.batch_size)
    assert seen_sizes[0] == 16 and 4 in seen_sizes, seen_sizes
    for member in stayers:
        [(want_tokens, want_logp, _)] = alone(model, [member.prompt], 8, {"temperature": 0.0}, {})
        tokens, logp = got[id(member)]
        assert tokens == want_tokens
        torch.testing.assert_close(torch.stack(logp), want_logp, rtol=TOL, atol=TOL)


# `serve --kv-dtype float16`: requests joining one at a time (each row's prefill alone, as the
# reference's), decoding this many greedy steps each; past a few steps a last-bit difference between
# a batch row and the reference can round a stored value to the neighbouring float16, which a carried
# state feeds back (tests/test_fast_decode.py measures the drift), so only the first steps are compared
HALF_CACHE_REQUESTS = [([BOS, *b"def f(x):"], 0), ([BOS, *b"hi"], 1), ([BOS, *b"a longer prompt"], 3)]
HALF_CACHE_STEPS = 4
HALF_CACHE_TOL = 5e-4  # fp32 logits over a float16 cache, a batch row against its emulation alone


def rounded_alone(model, prompt: list[int], steps: int, options: dict, dtype: torch.dtype) -> torch.Tensor:
    """Greedy log-probabilities (steps, V) of one prompt decoded alone through an ordinary cache that
    stores keys and values in `dtype` (an emulation independent of the static cache's code)."""
    cache = model.new_cache(1, len(prompt) + steps, **options)
    logits = model.prefill(torch.tensor([prompt]), cache, **options).logits[:, -1]
    round_stored_keys_and_values(cache, dtype)
    out = []
    for _ in range(steps):
        out.append(logits[0].float().log_softmax(-1))
        logits = model.decode(logits.argmax(-1)[:, None], cache, **options).logits[:, -1]
    return torch.stack(out)


@pytest.mark.parametrize("arch, label, given", CASES, ids=[f"{a}-{label}" for a, label, _ in CASES])
def test_a_float16_cache_on_the_compiled_path_decodes_each_row_as_a_rounding_cache_alone(arch, label, given,
                                                                                        models):
    """`serve --kv-dtype float16`: the compiled path's batch stores every row's keys and values in
    float16 (a joining row's prefill rounded as it is placed), and each row's greedy steps equal its
    prompt decoded alone through an ordinary cache that rounds what it stores, for every option set
    whose step compiles (the step run eagerly)."""
    model = models[arch]
    options = model_options(model, given)
    if not compiles(model, options, 8):
        return  # eager batches keep the model's dtype (the compiled-path test above checks which)
    batch = SlotBatch(model, options, (), keep_logits=True, coupled=couples_rows(model, options), compile=False,
                      kv_dtype=torch.float16)
    members = [Member(prompt, HALF_CACHE_STEPS, Sampling()) for prompt, _ in HALF_CACHE_REQUESTS]
    got: dict[int, list[torch.Tensor]] = {id(m): [] for m in members}
    step = 0
    while step <= max(join for _, join in HALF_CACHE_REQUESTS) or len(batch):
        for member, (_, join) in zip(members, HALF_CACHE_REQUESTS):
            if join == step:
                batch.add([member])
        for out in batch.step():
            got[id(out.member)].append(out.logits.float().log_softmax(-1))
        step += 1
        assert step < 50, "the batch never emptied"
    assert {t.dtype for t in (*batch.storage.k_slots, *batch.storage.v_slots)} == {torch.float16}
    for member in members:
        want = rounded_alone(model, member.prompt, HALF_CACHE_STEPS, batch.options, torch.float16)
        torch.testing.assert_close(torch.stack(got[id(member)]), want, rtol=0, atol=HALF_CACHE_TOL)


# -- the scheduler on the compiled path (in process, no HTTP) ----------------------------------

SERVED = [  # (request body, arrival delay in scheduler steps is not controlled: they arrive together)
    {"prompt": "def f(x):", "max_tokens": 7, "temperature": 0},
    {"prompt": "hi", "max_tokens": 5, "temperature": 0.9, "top_k": 20, "seed": 11},
    {"prompt": "a longer prompt", "max_tokens": 6, "temperature": 0, "n": 2},
    {"prompt": "x", "max_tokens": 9, "temperature": 1.2, "top_p": 0.8, "seed": 5},
    {"prompt": "last", "max_tokens": 3, "temperature": 0},
]
SCHEDULER_TIMEOUT_S = 60  # all requests of one scheduler run


def served(scheduler, model, tokenizer, bodies: list[dict]) -> list[tuple]:
    """Each body submitted to `scheduler` (before it starts) as a completion request; each request
    with its events (Delta, ..., then Done), once all finished: [(request, events), ...]."""
    import threading

    from latentloop.serve.limits import Limits
    from latentloop.serve.requests import parse_completion
    from latentloop.serve.scheduler import Done, Failed, Job

    limits = Limits(model.config.sequence_len, 64, 8)
    answers = []
    for body in bodies:
        request, events, finished = parse_completion(body, model, tokenizer, limits, "m"), [], threading.Event()

        def post(event, events: list = events, finished: threading.Event = finished):  # noqa: B008 - binds its own
            events.append(event)
            if isinstance(event, (Done, Failed)):
                finished.set()

        scheduler.submit(Job(request, post, tokenizer))
        answers.append((request, events, finished))
    scheduler.start()
    try:
        for _, _, finished in answers:
            assert finished.wait(SCHEDULER_TIMEOUT_S), "a request did not finish"
    finally:
        scheduler.join(SCHEDULER_TIMEOUT_S)
    assert all(isinstance(events[-1], Done) for _, events, _ in answers), [events[-1] for _, events, _ in answers]
    return [(request, events) for request, events, _ in answers]


def serve_in_process(model, compiled: bool) -> list[list[str]]:
    """SERVED through a ContinuousScheduler (the compiled path's step run eagerly): each request's
    choices' texts."""
    from latentloop.data import ByteTokenizer
    from latentloop.serve.scheduler import ContinuousScheduler, Delta

    tokenizer = ByteTokenizer()
    scheduler = ContinuousScheduler(model, tokenizer, 8, 16, 0.05, compiled=compiled, compile_steps=False)
    options = model_options(model, {})
    assert isinstance(scheduler._new_batch(options), SlotBatch) == (compiled and compiles(model, options, 8))
    texts = []
    for request, events in served(scheduler, model, tokenizer, SERVED):
        choices = [""] * request.rows
        for event in events:
            if isinstance(event, Delta):
                choices[event.choice] += event.text
        texts.append(choices)
    return texts


@needs_cxx
def test_the_warmed_batch_and_its_storage_serve_every_later_join(models):
    """`warm` reserves the storage of max_rows rows once; the default options' batch is that one
    again whenever a batch is made (it is dropped from the scheduler when it empties): allocating
    and freezing a new storage per join was a quarter of a loaded server's time."""
    from latentloop.data import ByteTokenizer
    from latentloop.serve.scheduler import ContinuousScheduler

    model = models["gpt"]
    scheduler = ContinuousScheduler(model, ByteTokenizer(), 8, 16, 0.05, compiled=True, compile_steps=False)
    warmed_on: list[str] = []
    real_warm = SlotBatch.warm

    def warm(batch, rows):
        warmed_on.append(threading.current_thread().name)
        real_warm(batch, rows)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SlotBatch, "warm", warm)
        scheduler.warm()
    try:
        # on the thread that decodes: CUDA graph trees are per thread, a capture elsewhere is redone
        assert warmed_on == ["latentloop-scheduler"] and scheduler._thread.is_alive()
        options = model_options(model, {})
        batch = scheduler._new_batch(options)
        storage = batch.storage
        assert storage.batch_size == 8 and batch.cache is None
        batch.add([Member([BOS, 5], 3, Sampling())])
        while len(batch):
            batch.step()
        assert scheduler._new_batch(options) is batch and batch.storage is storage
    finally:
        scheduler.join(SCHEDULER_TIMEOUT_S)
    assert not scheduler._thread.is_alive()


def test_a_failed_warm_up_is_raised_where_warm_was_called(models, monkeypatch):
    """The warm-up runs on the scheduler's thread; its error reaches the caller (the server's start),
    and the thread ends without taking requests."""
    from latentloop.data import ByteTokenizer
    from latentloop.serve.scheduler import ContinuousScheduler

    scheduler = ContinuousScheduler(models["gpt"], ByteTokenizer(), 2, 4, 0.05, compiled=True, compile_steps=False)

    def fail():
        raise RuntimeError("the compiler ran out of memory")

    monkeypatch.setattr(scheduler, "_warm_steps", fail)
    with pytest.raises(RuntimeError, match="ran out of memory"):
        scheduler.warm()
    scheduler._thread.join(SCHEDULER_TIMEOUT_S)
    assert not scheduler._thread.is_alive()
    started = ContinuousScheduler(models["gpt"], ByteTokenizer(), 2, 4, 0.05, compiled=True, compile_steps=False)
    started.start()
    try:  # its loop never looks back at a warm-up: refused, where it had waited forever
        with pytest.raises(RuntimeError, match=r"warm\(\) must come before start\(\)"):
            started.warm()
    finally:
        started.join(SCHEDULER_TIMEOUT_S)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_scheduler_on_the_compiled_path_gives_what_the_engine_gives_alone(arch, models):
    """Every registered architecture, with its default options: the continuous scheduler with
    `compiled=True` (a `SlotBatch` where the options compile, the eager batch where not) answers
    each request, greedy or seeded, with the engine's own text for it alone."""
    from latentloop.data import ByteTokenizer

    model, tokenizer = models[arch], ByteTokenizer()
    got = serve_in_process(model, compiled=True)
    for body, choices in zip(SERVED, got):
        ids = [BOS, *tokenizer.encode(body["prompt"])]
        want = ll.generate(model, [ids] * body.get("n", 1), body["max_tokens"], temperature=body["temperature"],
                           top_k=body.get("top_k"), top_p=body.get("top_p"), seed=body.get("seed"), stop_tokens=STOPS)
        assert choices == [tokenizer.decode(row) for row in want], body


@pytest.mark.parametrize("arch", ARCHS)
def test_the_servers_kv_dtype_reaches_every_compiled_batch_and_no_eager_one(arch, models):
    """`serve --kv-dtype float16` for every registered architecture: the settings reach the
    scheduler (`ServerState.build`), whose compiled-path batches store their cache in float16 from
    the warmed storage on; a batch whose options stay eager is the ordinary batch (the model's dtype)."""
    from latentloop.data import ByteTokenizer
    from latentloop.serve.scheduler import ContinuousScheduler
    from latentloop.serve.serving import ServerState
    from latentloop.serve.settings import ServeSettings

    model = models[arch]
    state = ServerState.build(model, ByteTokenizer(), "m",
                              ServeSettings("unused", decode="eager", max_batch_size=4, kv_dtype=None))
    assert state.scheduler.kv_dtype is None
    scheduler = ServerState.build(model, ByteTokenizer(), "m", ServeSettings(
        "unused", decode="compiled", max_batch_size=4, kv_dtype="float16")).scheduler
    assert scheduler.kv_dtype is torch.float16
    heard: list[str] = []
    ContinuousScheduler(model, ByteTokenizer(), 4, 16, 0.05, compiled="auto", announce=heard.append,
                        kv_dtype=torch.float16)
    options = model_options(model, {})
    # --decode auto without the float16 steps on disk (this test session's own cache): eager, saying that
    # the cache keeps the model's dtype until they are compiled (silent where no step compiles)
    assert len(heard) == compiles(model, options, 4)
    assert not heard or ("decoding eagerly" in heard[0] and "not --kv-dtype's torch.float16" in heard[0])
    scheduler.compile_steps = False  # the step run eagerly: what is checked here is where the dtype goes
    scheduler.warm()
    try:
        batch = scheduler._new_batch(options)
        assert isinstance(batch, SlotBatch) == compiles(model, options, 4)
        if isinstance(batch, SlotBatch):
            assert batch.decoder.kv_dtype is torch.float16
            assert {t.dtype for t in (*batch.storage.k_slots, *batch.storage.v_slots)} == {torch.float16}
    finally:
        scheduler.join(SCHEDULER_TIMEOUT_S)


@needs_cxx
def test_auto_takes_the_compiled_path_only_when_every_size_is_in_the_compile_cache(models, tmp_path, monkeypatch):
    """`serve --decode auto`: eager with an empty compile cache (saying how to compile once); the
    compiled path once every batch size's step has a record of a fast first call; eager again when
    loading them is expected past the start budget (a record of slow first calls, a compile)."""
    from latentloop.data import ByteTokenizer
    from latentloop.inference.fast import CompileRecord
    from latentloop.serve.batch import AUTO_START_BUDGET_S, _CacheShape, slot_length
    from latentloop.serve.scheduler import ContinuousScheduler

    model = models["gpt"]
    options = model_options(model, {})
    heard: list[str] = []

    def scheduler() -> ContinuousScheduler:
        return ContinuousScheduler(model, ByteTokenizer(), 4, 16, 0.05, compiled="auto", announce=heard.append,
                                   compile_steps=False)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert not scheduler().compiled and "decoding eagerly" in heard[-1] and "--decode compiled" in heard[-1]

    def record(sizes, seconds: float) -> None:
        for size in sizes:
            CompileRecord(model, options, _CacheShape(size, slot_length(model), torch.empty(0))).add(seconds)

    record([1, 2], 0.5)  # 4 rows not yet
    assert not scheduler().compiled
    record([4], 0.5)
    auto = scheduler()
    assert auto.compiled and "in the on-disk cache" in heard[-1]
    assert isinstance(auto._new_batch(options), SlotBatch)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "slow"))
    record([1, 2, 4], AUTO_START_BUDGET_S)  # three sizes: past the budget
    assert not scheduler().compiled


def _record_steps(model, options: dict, rows: int, seconds: float = 0.5) -> None:
    """Records of a fast first call for every batch size's step, under the key the compiled batch's
    own decoder records with (what a real compile leaves in the on-disk cache)."""
    from latentloop.inference.fast import CompileRecord
    from latentloop.serve.batch import _CacheShape, slot_length, slot_sizes

    decoder_options = SlotBatch(model, options, compile=False).decoder.options
    for size in slot_sizes(rows):
        CompileRecord(model, decoder_options, _CacheShape(size, slot_length(model), torch.empty(0))).add(seconds)


def _other_compiled_options(model) -> dict | None:
    """A set of the architecture's options other than the defaults whose step compiles (None: none)."""
    defaults = model_options(model, {})
    for given in option_sets(model.OPTIONS).values():
        options = model_options(model, given)
        if options != defaults and compiles(model, options, 4):
            return given
    return None


def _with_other_compiled_options(models, arch: str, monkeypatch, tmp_path) -> tuple:
    """(the arch's model, a set of its options other than the defaults whose step compiles) over an
    empty compile cache of the test's own; a skip where the arch has no such set."""
    model = models[arch]
    given = _other_compiled_options(model)
    if given is None:
        pytest.skip(f"{arch} has no other option set whose step compiles")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    return model, given


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_finds_the_steps_every_architecture_recorded(arch, models, tmp_path, monkeypatch):
    """`cached_start_seconds` looks a step up by the key its decoder records under: rgpt's and rfbt's
    draft options (speed-only, left out of a batch's options) were in the looked-up key, so their
    records were never found and `--decode auto` decoded them eagerly for good."""
    from latentloop.serve.batch import cached_start_seconds

    model = models[arch]
    options = model_options(model, {})
    if not compiles(model, options, 4):
        pytest.skip(f"{arch}'s default options do not compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert cached_start_seconds(model, options, 4) is None
    _record_steps(model, options, 4)
    assert cached_start_seconds(model, options, 4) is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_a_request_never_makes_the_server_compile(arch, models, tmp_path, monkeypatch):
    """Options other than the warmed ones: a compiled batch only where the on-disk cache holds every
    size's step, else an eager batch, said once with the flag that compiles them at start (a
    request's first use compiled there, holding every stream for minutes)."""
    from latentloop.data import ByteTokenizer
    from latentloop.serve.scheduler import ContinuousScheduler

    model, given = _with_other_compiled_options(models, arch, monkeypatch, tmp_path)
    heard: list[str] = []
    scheduler = ContinuousScheduler(model, ByteTokenizer(), 4, 16, 0.05, compiled=True, announce=heard.append)
    options = model_options(model, given)
    batch = scheduler._new_batch(options)
    assert type(batch) is DecodeBatch
    assert len(heard) == 1 and "decode eagerly" in heard[0] and "--warm-options" in heard[0], heard
    name, value = next(iter(given.items()))
    assert f'"{name}": {json.dumps(value)}' in heard[0]
    assert type(scheduler._new_batch(options)) is DecodeBatch and len(heard) == 1  # said once
    _record_steps(model, options, 4)
    assert isinstance(scheduler._new_batch(options), SlotBatch)


@pytest.mark.parametrize("arch", ARCHS)
def test_warm_options_are_made_ready_at_start(arch, models, tmp_path, monkeypatch):
    """`--warm-options`: with `compiled=True` each set's steps are warmed beside the default options'
    (once each), and its batch is that warmed one at every later join; with "auto" only the sets
    whose steps the cache holds are (loading, never compiling)."""
    from latentloop.data import ByteTokenizer
    from latentloop.serve.scheduler import ContinuousScheduler

    model, given = _with_other_compiled_options(models, arch, monkeypatch, tmp_path)
    warmed: list[dict] = []
    monkeypatch.setattr(SlotBatch, "warm", lambda batch, rows: warmed.append(dict(batch.options)))
    defaults, options = model_options(model, {}), model_options(model, given)
    scheduler = ContinuousScheduler(model, ByteTokenizer(), 4, 16, 0.05, compiled=True, warm_options=[given, given])
    scheduler.warm()
    try:
        assert warmed == [SlotBatch(model, o, compile=False).options for o in (defaults, options)]
        assert scheduler._new_batch(options) is scheduler._new_batch(options)
    finally:
        scheduler.join(SCHEDULER_TIMEOUT_S)
    warmed.clear()
    _record_steps(model, defaults, 4)  # auto: the defaults' steps cached, the other set's not
    auto = ContinuousScheduler(model, ByteTokenizer(), 4, 16, 0.05, compiled="auto", warm_options=[given])
    assert auto.compiled
    auto.warm()
    try:
        assert warmed == [SlotBatch(model, defaults, compile=False).options]
        assert type(auto._new_batch(options)) is DecodeBatch
    finally:
        auto.join(SCHEDULER_TIMEOUT_S)
    # "auto" decides per set of options: the defaults' steps not cached, the other set's cached (all of
    # them went eager once the defaults' were missing)
    warmed.clear()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "other-cache"))
    _record_steps(model, options, 4)
    auto = ContinuousScheduler(model, ByteTokenizer(), 4, 16, 0.05, compiled="auto", warm_options=[given])
    assert not auto.compiled
    auto.warm()
    try:
        assert warmed == [SlotBatch(model, options, compile=False).options]
        assert isinstance(auto._new_batch(options), SlotBatch) and type(auto._new_batch(defaults)) is DecodeBatch
    finally:
        auto.join(SCHEDULER_TIMEOUT_S)


def test_a_warm_option_set_that_cannot_compile_is_said(models, monkeypatch):
    """--warm-options naming options whose step does not compile (rgpt's adaptive exit): said at
    start, with the reason, and they decode eagerly (skipped without a word before)."""
    from latentloop.data import ByteTokenizer
    from latentloop.serve.scheduler import ContinuousScheduler

    monkeypatch.setattr(SlotBatch, "warm", lambda batch, rows: None)
    heard: list[str] = []
    scheduler = ContinuousScheduler(models["rgpt"], ByteTokenizer(), 4, 16, 0.05, compiled=True, compile_steps=False,
                                    announce=heard.append, warm_options=[{"exit_threshold": 0.5}])
    scheduler.warm()
    try:
        said = [line for line in heard if line.startswith("--warm-options")]
        assert len(said) == 1 and '"exit_threshold": 0.5' in said[0] and "does not compile (" in said[0], heard
    finally:
        scheduler.join(SCHEDULER_TIMEOUT_S)


def test_bad_warm_options_are_refused_before_the_server_starts(models):
    """--warm-options: not a JSON object, with eager decoding, or an option the model does not
    have or a bad value: one error naming it (the scheduler resolves them before any compile)."""
    from latentloop.data import ByteTokenizer
    from latentloop.errors import ConfigError, LatentloopError
    from latentloop.serve.serving import ServerState
    from latentloop.serve.settings import ServeSettings, check_settings

    for text in ("[1]", "steps=4", "{"):
        with pytest.raises(LatentloopError, match="JSON object"):
            check_settings(ServeSettings("run", warm_options=(text,)))
    with pytest.raises(LatentloopError, match="--decode compiled or auto"):
        check_settings(ServeSettings("run", decode="eager", warm_options=("{}",)))
    check_settings(ServeSettings("run", warm_options=('{"steps": 4}',)))
    for text, named in (('{"nope": 1}', "nope"), ('{"steps": -3}', "steps")):
        with pytest.raises(ConfigError, match=named):
            ServerState.build(models["rgpt"], ByteTokenizer(), "m",
                              ServeSettings("unused", decode="compiled", max_batch_size=4, warm_options=(text,)))


def _scheduler_run(model, bodies: list[dict], before_start=None, cancel_after_first: bool = False):
    """The bodies' jobs through a continuous scheduler (eager batches): (scheduler, jobs, events per job).
    `cancel_after_first`: each job is cancelled at its first token, as a client hanging up."""
    import threading

    from latentloop.data import ByteTokenizer
    from latentloop.serve.limits import Limits
    from latentloop.serve.requests import parse_completion
    from latentloop.serve.scheduler import ContinuousScheduler, Delta, Done, Failed, Job

    tokenizer = ByteTokenizer()
    limits = Limits(model.config.sequence_len, 64, 8)
    scheduler = ContinuousScheduler(model, tokenizer, 8, 16, 0.05, compiled=False, compile_steps=False)
    jobs, events, ended = [], [], []
    for body in bodies:
        request = parse_completion(body, model, tokenizer, limits, "m")
        events.append([])
        ended.append(threading.Event())

        def post(event, i: int = len(events) - 1):  # noqa: B008 - binds this request's index
            events[i].append(event)
            if isinstance(event, (Done, Failed)) or (cancel_after_first and isinstance(event, Delta)):
                if cancel_after_first:
                    jobs[i].cancel()
                ended[i].set()

        jobs.append(Job(request, post, tokenizer))
    if before_start is not None:
        before_start(scheduler)
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    for event in ended:
        assert event.wait(SCHEDULER_TIMEOUT_S), "a request did not end"
    return scheduler, jobs, events


def _idle(scheduler, settled) -> None:
    """Waits (bounded) until `settled(snapshot)`: the scheduler's thread ends its passes on its own."""
    import time

    deadline = time.monotonic() + SCHEDULER_TIMEOUT_S
    while not settled(scheduler.snapshot()):
        assert time.monotonic() < deadline, scheduler.snapshot()
        time.sleep(0.01)


def test_a_cancelled_request_leaves_the_scheduler_which_then_idles(models):
    """A client that hangs up mid-decode: its rows are freed, its job counted cancelled and dropped.
    It was kept for good (never marked finished), so the loop never waited for work again: one core
    spun while the server was idle."""
    scheduler, jobs, _ = _scheduler_run(models["gpt"], [{"prompt": "ab", "max_tokens": 50, "temperature": 0}],
                                        cancel_after_first=True)
    try:
        _idle(scheduler, lambda snap: snap["cancelled"] == 1)
        assert scheduler.snapshot()["active_rows"] == 0 and jobs[0].finished
        _idle(scheduler, lambda snap: not scheduler._jobs)  # the loop is back to waiting for work
    finally:
        scheduler.join(SCHEDULER_TIMEOUT_S)


def test_a_failed_batch_frees_its_rows_for_the_requests_after_it(models, monkeypatch):
    """A step that raises fails its batch's requests (500) and frees their rows: the room for new
    rows came back short by the failed rows (their job marked them done as it failed, before the
    count was lowered), until none was left and every later request timed out."""
    from latentloop.serve.scheduler import Done, Failed

    model = models["gpt"]
    failing = {"prompt": "ab", "max_tokens": 4, "n": 8, "temperature": 0.5, "seed": 3}

    def plant(scheduler):
        real = DecodeBatch.step

        def step(batch):
            if any(member.sampling.temperature == 0.5 for member in batch.members):
                raise RuntimeError("planted")
            return real(batch)

        monkeypatch.setattr(DecodeBatch, "step", step)

    scheduler, _, events = _scheduler_run(model, [failing], before_start=plant)
    try:
        assert isinstance(events[0][-1], Failed) and events[0][-1].error.status == 500
        _idle(scheduler, lambda snap: snap["active_rows"] == 0)
    finally:
        scheduler.join(SCHEDULER_TIMEOUT_S)
    monkeypatch.undo()
    bodies = [{"prompt": "abc", "max_tokens": 3, "temperature": 0}] * 4
    scheduler, _, events = _scheduler_run(model, [failing, *bodies], before_start=plant)
    try:
        assert all(isinstance(e[-1], Done) for e in events[1:])
        assert max(e[-1].batch_rows for e in events[1:]) > 1  # they still share a batch
    finally:
        scheduler.join(SCHEDULER_TIMEOUT_S)


# sampling fields whose draw is greedy in the limit
TINY_SAMPLING = {
    # temperature 1e-300 divided every logit into +-inf; shifted to a maximum of 0 first, it is greedy
    "temperature": {"temperature": 1e-300},
    # top_p 1e-300 ((0, 1] admits it) is 0 in float32 and dropped every token (12-07 review); the most
    # likely token always stays
    "top_p": {"temperature": 1.0, "top_p": 1e-300},
}


@pytest.mark.parametrize("knob", list(TINY_SAMPLING))
def test_a_tiny_temperature_or_top_p_samples_the_greedy_token_and_fails_no_neighbour(models, knob):
    """NaN probabilities: a 500 for the request and for every request sharing its batch."""
    from latentloop.engine import sampling_probs
    from latentloop.serve.scheduler import Delta, Done

    fields = TINY_SAMPLING[knob]
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.25]])
    for tiny in (1e-300, 1e-30, 1e-8):
        torch.testing.assert_close(sampling_probs(logits, **{**fields, knob: tiny}), torch.eye(3)[[1, 0]],
                                   rtol=0, atol=0)
    bodies = [{"prompt": "ab", "max_tokens": 6, **fields, "seed": 1},
              {"prompt": "ab", "max_tokens": 6, "temperature": 0.7, "seed": 2},
              {"prompt": "ab", "max_tokens": 6, "temperature": 0}]
    scheduler, _, events = _scheduler_run(models["gpt"], bodies)
    scheduler.join(SCHEDULER_TIMEOUT_S)
    assert all(isinstance(e[-1], Done) for e in events), [e[-1] for e in events]
    texts = ["".join(event.text for event in e if isinstance(event, Delta)) for e in events]
    assert texts[0] == texts[2]  # the tiny draw is the greedy text


def test_top_k_and_top_p_keep_the_most_likely_tokens_at_a_temperature_past_float32s_range(models):
    """A temperature of 1e39 is a finite number the checks admit, but divided every float32 logit to 0:
    top_k=1 and a tiny top_p then kept every token, a uniform draw where the greedy token was asked
    (12-07 review). The tokens they keep are read off the logits before the temperature now."""
    from latentloop.engine import sampling_probs

    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.25, 0.4]])
    for temperature in (1e39, 1e300, 1.0):
        torch.testing.assert_close(sampling_probs(logits, temperature, top_k=1), torch.eye(4)[[1, 0]], rtol=0, atol=0)
        torch.testing.assert_close(sampling_probs(logits, temperature, top_p=1e-9), torch.eye(4)[[1, 0]],
                                   rtol=0, atol=0)
    # two kept of four, evenly at a temperature so high the logits' differences vanish
    torch.testing.assert_close(sampling_probs(logits, 1e39, top_k=2), torch.tensor([[0, .5, .5, 0], [.5, 0, 0, .5]]),
                               rtol=0, atol=0)
    prompt = [BOS, *b"ab"]
    greedy = _greedy_alone(models["gpt"], prompt, 6)
    assert ll.generate(models["gpt"], prompt, 6, temperature=1e39, top_k=1, seed=0, stop_tokens=()) == greedy


def _greedy_alone(model, prompt: list[int], new_tokens: int) -> list[int]:
    return [s.tokens[0] for s in stream(model, [prompt], new_tokens, stop_tokens=(), temperature=0.0)]


def test_a_row_that_would_pass_the_context_beside_longer_rows_waits_and_one_at_the_bound_joins(models):
    """Every row of an eager batch shares its length: a short prompt owing many tokens, joining
    beside a long one, took the batch past the context, and every request in it failed (a 500 from
    the server, 12-06 review). It waits now until it fits (here, until the long row is done); a row
    that fits exactly joins at once. Each decodes as alone."""
    model = models["gpt"]
    context = model.config.sequence_len
    long_prompt = [BOS, *[ord("q")] * (context // 2)]
    greedy = Sampling(0.0, None, None, None)
    batch = DecodeBatch(model, model_options(model, {}), stop_tokens=())
    first = Member(long_prompt, context // 4, greedy)
    batch.add([first])
    made: dict[int, list[int]] = {}
    for _ in range(3):
        for out in batch.step():
            made.setdefault(id(out.member), []).append(out.token)
    span = len(long_prompt) + 3  # the long row's stored tokens at the join: its prompt and three decode steps
    at_bound = Member([BOS], context - span + 1, Sampling(0.0, None, None, None))  # span + owed - 1 == context
    past = Member([BOS, ord("z")], context - 2, Sampling(0.0, None, None, None))  # fits alone, not beside it
    batch.add([at_bound])
    batch.add([past])
    steps = 0
    while len(batch):
        joined_before = {id(m) for m in batch.members}
        for out in batch.step():
            made.setdefault(id(out.member), []).append(out.token)
        if steps == 0:
            assert id(at_bound) in {id(m) for m in batch.members} and id(past) not in {id(m) for m in batch.members}
        if id(past) in {id(m) for m in batch.members} and id(past) not in joined_before:
            assert first.done and at_bound.done  # it joined an empty batch
        steps += 1
        assert steps < 4 * context, "the batch never emptied"
    for member in (first, at_bound, past):
        assert made[id(member)] == _greedy_alone(model, member.prompt, member.max_new_tokens)


def test_a_joiner_dropped_while_it_waits_neither_counts_nor_holds_up_the_rest(models):
    """A held joiner whose client hung up stayed in the waiting groups: it was still counted, kept
    every group behind it waiting until the running rows drained, and was prefilled for nothing."""
    model = models["gpt"]
    context = model.config.sequence_len
    batch = DecodeBatch(model, model_options(model, {}), stop_tokens=())
    running = Member([BOS, *[ord("q")] * (context // 2)], context // 4, Sampling(0.0, None, None, None))
    batch.add([running])
    batch.step()
    held = Member([BOS, ord("z")], context - 2, Sampling(0.0, None, None, None))  # cannot join beside it
    short = Member([BOS, ord("a")], 2, Sampling(0.0, None, None, None))  # could, but waits behind `held`
    batch.add([held])
    batch.add([short])
    batch.step()
    assert {id(m) for m in batch.members} == {id(running)} and len(batch) == 3
    batch.drop(held)  # the scheduler's drop when the client hangs up
    assert len(batch) == 2
    batch.step()
    assert id(short) in {id(m) for m in batch.members} and id(held) not in {id(m) for m in batch.members}
    assert not running.done


def test_auto_keeps_its_start_budget_for_every_set_of_options(models, tmp_path, monkeypatch):
    """Records of slow first calls (past AUTO_START_BUDGET_S to load): "auto" decodes the defaults
    eagerly as it said, without loading them anyway at start, and says nothing more of them when the
    first request of the defaults comes (a second notice advised --warm-options '{}')."""
    from latentloop.data import ByteTokenizer
    from latentloop.serve.batch import AUTO_START_BUDGET_S
    from latentloop.serve.scheduler import ContinuousScheduler

    model = models["gpt"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "slow"))
    defaults = model_options(model, {})
    _record_steps(model, defaults, 4, seconds=AUTO_START_BUDGET_S)  # 3 sizes: 3 x the budget
    warmed: list[dict] = []
    monkeypatch.setattr(SlotBatch, "warm", lambda batch, rows: warmed.append(dict(batch.options)))
    heard: list[str] = []
    auto = ContinuousScheduler(model, ByteTokenizer(), 4, 16, 0.05, compiled="auto", announce=heard.append)
    assert not auto.compiled and len(heard) == 1 and "decoding eagerly" in heard[0]
    auto.warm()
    try:
        assert warmed == [] and type(auto._new_batch(defaults)) is DecodeBatch and len(heard) == 1
    finally:
        auto.join(SCHEDULER_TIMEOUT_S)


@pytest.mark.parametrize("scheduler_kind", ["continuous", "rounds"])
@pytest.mark.parametrize("arch", ARCHS)
def test_ignore_eos_decodes_past_the_end_tokens_to_max_tokens_and_stop_strings_still_cut(arch, scheduler_kind, models):
    """`ignore_eos` (vLLM's and llama.cpp's field): the server's end tokens do not end the reply, which
    has max_tokens tokens, the engine's without stop tokens; beside it in the same batch a request
    without it stops there; a `stop` string still cuts. The server's end tokens are set here to a
    token the model writes (random weights rarely write EOS): every architecture, both schedulers."""
    from latentloop.data import ByteTokenizer
    from latentloop.serve.scheduler import ContinuousScheduler, Delta, RoundScheduler

    model, tokenizer = models[arch], ByteTokenizer()
    prompt, budget = "def f(x):", 8
    ids = [BOS, *tokenizer.encode(prompt)]
    free = ll.generate(model, ids, budget, temperature=0.0)
    end = free[2]  # the server's end token for this test: one the model writes third
    stopped = ll.generate(model, ids, budget, temperature=0.0, stop_tokens=[end])
    assert len(stopped) < budget
    if scheduler_kind == "continuous":
        scheduler = ContinuousScheduler(model, tokenizer, 8, 16, 0.05, compiled=False, compile_steps=False)
    else:
        scheduler = RoundScheduler(model, tokenizer, 8, 16, 0.05)
    scheduler.stop_tokens = (end,)
    cut = tokenizer.decode(free[4:5])  # a stop string: the text is cut before it
    bodies = [{"prompt": prompt, "max_tokens": budget, "temperature": 0, "ignore_eos": True},
              {"prompt": prompt, "max_tokens": budget, "temperature": 0},
              {"prompt": prompt, "max_tokens": budget, "temperature": 0, "ignore_eos": True, "stop": cut}]
    events = [got for _, got in served(scheduler, model, tokenizer, bodies)]
    texts = ["".join(e.text for e in got if isinstance(e, Delta)) for got in events]
    assert texts[0] == tokenizer.decode(free) and events[0][-1].completion_tokens == budget
    assert texts[1] == tokenizer.decode(stopped) and events[1][-1].completion_tokens == len(stopped) + 1  # its end
    assert texts[2] == tokenizer.decode(free).split(cut)[0] and cut


def test_joiners_of_unlike_lengths_are_prefilled_apart_and_decode_as_alone(models):
    """Joiners were prefilled in one left-padded batch: rows of 32 and 352 tokens joining together (as rows
    that finish together do) each cost 352, half the server's time at concurrency 32. Now in groups of
    like lengths (each at least `PREFILL_PADDING_KEPT` of its group's longest); every row still decodes
    as it does alone."""
    from latentloop.serve.batch import PREFILL_PADDING_KEPT, by_length

    model = models["gpt"]
    prompts = [[BOS, *range(1, 40)], [BOS, 5, 6], [BOS, *range(7, 37)], [BOS, 9, 9, 9]]
    groups = by_length([Member(p, 4, Sampling()) for p in prompts])
    assert [[len(m.prompt) for m in group] for group in groups] == [[40, 31], [4, 3]]
    assert all(len(m.prompt) >= PREFILL_PADDING_KEPT * len(group[0].prompt) for group in groups for m in group)
    widths = []
    real_prefill = type(model).prefill

    def recorded(self, idx, *args, **kwargs):
        widths.append(tuple(idx.shape))
        return real_prefill(self, idx, *args, **kwargs)

    batch = DecodeBatch(model, model_options(model, {}), STOPS)
    members = [Member(p, 4, Sampling()) for p in prompts]
    batch.add(members)
    seen = {id(m): [] for m in members}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(model), "prefill", recorded)
        while len(batch) or batch.waiting:
            for out in batch.step():
                if out.token is not None:
                    seen[id(out.member)].append(out.token)
    assert sorted(widths) == [(2, 4), (2, 40)]
    for member in members:
        assert seen[id(member)] == ll.generate(model, member.prompt, 4, temperature=0.0, stop_tokens=STOPS)
