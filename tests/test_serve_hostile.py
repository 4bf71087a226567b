"""`latentloop serve` against what a hostile or unlucky client sends (issue 49): a prompt far larger
than the context, a chunked body past the body cap that goes on arriving, requests in flight when
SIGTERM comes, and the schedulers' per-request sampling settings.

The prompt bound is checked without HTTP (a tokenizer that fails the test if it is called) and over
HTTP against a server whose BPE tokenizer took seconds to minutes on such prompts. Servers run as in
test_serve.py: `latentloop serve` processes on free loopback ports, every wait bounded in time; the
shutdown's handler check runs an app in this process over a model whose decode step is slowed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import SERVER_EXIT_S, ServeProcess, serving

import latentloop as ll
from latentloop.data import BPETokenizer, ByteTokenizer
from latentloop.runs import save_run
from latentloop.serve.limits import BODY_FIELDS_BYTES, MAX_TEXT_BYTES, Limits, prompt_text_limit, spells_its_text
from latentloop.serve.protocol import APIError, encode_text
from latentloop.serve.requests import parse_completion

httpx = pytest.importorskip("httpx")

CONTEXT = 128
CALL_TIMEOUT_S = 60
TOK = ByteTokenizer()
CORPUS = "def add(a, b):\n    return a + b\n" * 50
HOSTILE_CHARS = 4_000_000  # a one-word prompt: seconds of a BPE tokenizer's time before, refused unread now
LONG_PROMPT_CHARS = 100_000  # within the body's bound, past the context's: refused before tokenizing
HOSTILE_REFUSED_S = 10  # the most a hostile prompt's 400 may take (it was a 4 s tokenization each, GIL held)
NORMAL = {"prompt": "def add(a, b):\n    return", "max_tokens": 4, "temperature": 0}


def bpe() -> BPETokenizer:
    return BPETokenizer.train([CORPUS], 300)


# --------------------------------------------------------------------------------------------
# The prompt bound, without HTTP
# --------------------------------------------------------------------------------------------


class NoTokenizing:
    """A tokenizer that fails the test when a text reaches it."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __getattr__(self, name):
        if name in ("encode", "encode_batch"):
            pytest.fail("a text that can never fit the context was tokenized")
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return ll.build("gpt", preset="test", sequence_len=64).eval()


def test_a_prompt_larger_than_the_context_can_hold_is_refused_before_tokenizing(gpt):
    """context x longest token bytes is the most text that can fit: one byte more is refused with one
    line naming the bound, and the tokenizer never sees it; a list of prompts is refused by its
    longest one before any is tokenized; an id list longer than the context is refused unscanned."""
    tokenizer = bpe()
    longest = int(tokenizer.token_byte_lengths().max())
    limits = Limits.for_model(64, 32, 4, tokenizer)
    assert limits.prompt_bytes == 64 * longest
    quiet = NoTokenizing(tokenizer)
    for prompt in ("x" * (64 * longest + 1), ["ok", "é" * (32 * longest + 1)], "a" * 16_000_000):
        with pytest.raises(APIError) as caught:
            parse_completion({"prompt": prompt}, gpt, quiet, limits, "m")
        message = caught.value.message
        assert caught.value.status == 400 and "\n" not in message
        assert "more than the model's context of 64 tokens can hold" in message and f"x {longest} bytes" in message
    with pytest.raises(APIError, match="the prompt is 65 tokens"):
        parse_completion({"prompt": [[1] * 65]}, gpt, quiet, limits, "m")
    # at the bound, the prompt is tokenized (and refused, or not, by its tokens)
    fits = parse_completion({"prompt": "def add", "max_tokens": 2}, gpt, tokenizer, limits, "m")
    assert fits.prompts == [[tokenizer.bos_id] + tokenizer.encode("def add")]


def test_the_bound_never_refuses_a_text_that_fits():
    """The bound's premise: a text of B bytes is at least B / (longest token) tokens, for texts that
    a BPE merges as far as it can (its training corpus, its longest token repeated) and for bytes."""
    tokenizer = bpe()
    longest = int(tokenizer.token_byte_lengths().max())
    longest_token = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.token_to_bytes(i)))
    text = tokenizer.token_to_bytes(longest_token).decode("utf-8", "replace")
    for sample in (CORPUS, text * 40, "é€😀 mixed " * 20):
        assert len(tokenizer.encode(sample)) * longest >= len(sample.encode("utf-8"))
    assert prompt_text_limit(TOK, 100)[0] == 100  # one byte per token
    # the largest body a completions request can need fits the body's bound: as many prompts as rows,
    # each the most text the context holds in control characters (6 bytes each, JSON-escaped), or as
    # many ids as the context holds, pretty-printed
    for tokenizer in (TOK, bpe()):
        limits = Limits.for_model(CONTEXT, 16, 4, tokenizer)
        texts = json.dumps({"prompt": ["\x01" * limits.prompt_bytes] * 4, "max_tokens": 16, "stop": ["x"] * 4})
        ids = json.dumps({"prompt": [[tokenizer.vocab_size - 1] * CONTEXT] * 4}, indent=8)
        assert max(len(texts), len(ids)) <= limits.completion_body_bytes - BODY_FIELDS_BYTES // 2


def test_only_tokenizers_that_spell_their_text_get_the_context_bound():
    """A normalizer may shrink text, a pre-tokenizer may drop it, an unknown token may stand for a
    whole word: those tokenizers get only MAX_TEXT_BYTES."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from latentloop.data import HFTokenizer

    assert spells_its_text(TOK) and spells_its_text(bpe())

    def hf(model, normalizer=None, pre_tokenizer=None) -> HFTokenizer:
        inner = Tokenizer(model)
        if normalizer is not None:
            inner.normalizer = normalizer
        if pre_tokenizer is not None:
            inner.pre_tokenizer = pre_tokenizer
        return HFTokenizer(inner.to_str(), 0, 0, 0)

    vocab = {"<unk>": 0, "a": 1}
    assert spells_its_text(hf(models.BPE(vocab, [], byte_fallback=True), pre_tokenizer=pre_tokenizers.ByteLevel()))
    assert spells_its_text(hf(models.BPE(vocab, [], byte_fallback=True),
                              normalizer=normalizers.Sequence([normalizers.Prepend("▁"),
                                                               normalizers.Replace(" ", "▁")])))
    shrinking = [hf(models.BPE(vocab, [], byte_fallback=True), normalizer=normalizers.NFC()),
                 hf(models.BPE(vocab, [], byte_fallback=True), normalizer=normalizers.Replace(" ", "")),
                 hf(models.BPE(vocab, [], byte_fallback=True), pre_tokenizer=pre_tokenizers.Whitespace()),
                 hf(models.BPE(vocab, [], unk_token="<unk>")),
                 hf(models.WordPiece(vocab, unk_token="<unk>"))]
    for tokenizer in shrinking:
        assert not spells_its_text(tokenizer)
        limits = Limits.for_model(64, 32, 4, tokenizer)
        assert limits.prompt_bytes is None
        assert limits.text_problem("a" * MAX_TEXT_BYTES) is None
        assert "one text may have" in limits.text_problem("a" * (MAX_TEXT_BYTES + 1))


@pytest.mark.parametrize("path", ["text", "chat markup"])
def test_tokenizing_releases_the_gil(path):
    """A long tokenization in a server thread leaves the event loop running: the tokenizer's batch
    call releases the GIL, where its one-text encode held it (~1 s here: the loop stood still). The
    same for a rendered chat template's text (`encode_markup`, a Hugging Face tokenizer's own)."""
    from latentloop.data.tokenizers import HFTokenizer

    tokenizer = bpe()
    text = "a" * 2_000_000
    if path == "chat markup":
        markup = HFTokenizer(tokenizer.to_json(), tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
        encode = markup.encode_markup
    else:
        encode = partial(encode_text, tokenizer)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (encode(text), done.set()))
    start = time.perf_counter()
    ticks = [start]  # (a thread that holds the GIL from its start keeps the first tick from coming)
    worker.start()
    while not done.is_set() and time.perf_counter() - start < CALL_TIMEOUT_S:
        ticks.append(time.perf_counter())
        time.sleep(0.005)
    ticks.append(time.perf_counter())  # a sleep that could not end while the GIL was held ends here
    worker.join(CALL_TIMEOUT_S)
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    took = time.perf_counter() - start
    assert took > 0.2, "the tokenization was too quick to tell"  # else the text is too short for the machine
    assert max(gaps) < took / 2, (max(gaps), took)


# --------------------------------------------------------------------------------------------
# Over HTTP
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile_runs")
    tokenizer = bpe()
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", sequence_len=CONTEXT, vocab_size=tokenizer.vocab_size,
                     bos_id=tokenizer.bos_id)
    torch.manual_seed(1)
    rgpt = ll.build("rgpt", preset="test", sequence_len=CONTEXT)
    return {"bpe": save_run(model, tokenizer, folder / "bpe").parents[1],
            "rgpt": save_run(rgpt, TOK, folder / "rgpt").parents[1]}


@pytest.fixture(scope="module")
def server(runs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("hostile_logs")
    with serving({"bpe": ServeProcess(runs["bpe"], logs / "bpe.log")}) as started:
        yield started["bpe"]


def post(url: str, body: bytes | dict, path: str = "/v1/completions") -> tuple[int, dict, float]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.monotonic()
    reply = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"},
                       timeout=CALL_TIMEOUT_S)
    return reply.status_code, reply.json(), time.monotonic() - start


def test_huge_prompts_are_refused_quickly_and_a_normal_request_goes_through(server, runs):
    """Four one-word prompts of millions of characters and a normal request at once: the four get
    413 by their body's size, past what any completions request of this context can need (each was
    tokenized, a tokenizer thread each, GIL held); a prompt within that size but past what the
    context holds gets 400 before it is tokenized; the normal one gets the engine's tokens.
    /tokenize refuses a text past MAX_TEXT_BYTES alike."""
    tokenizer = BPETokenizer.load(runs["bpe"] / "tokenizer.json")
    hostile = json.dumps({"prompt": "a" * HOSTILE_CHARS, "max_tokens": 4}).encode()
    with ThreadPoolExecutor(6) as pool:
        refused = [pool.submit(post, server.url, hostile) for _ in range(4)]
        too_long = pool.submit(post, server.url, {"prompt": "a" * LONG_PROMPT_CHARS})
        normal = pool.submit(post, server.url, NORMAL)
        replies = [future.result() for future in refused]
        status, body, _ = normal.result()
    for code, reply, seconds in replies:
        assert code == 413, reply
        assert "the most a completions request to this model can need" in reply["error"]["message"]
        assert seconds < HOSTILE_REFUSED_S
    code, reply, _ = too_long.result()
    assert code == 400 and f"the prompt is {LONG_PROMPT_CHARS:,} characters of text: more than the model's " \
                           f"context of {CONTEXT} tokens can hold" in reply["error"]["message"], reply
    assert status == 200, body
    model = ll.load(runs["bpe"])[0]
    ids = [tokenizer.bos_id] + tokenizer.encode(NORMAL["prompt"])
    expected = ll.generate(model, ids, 4, temperature=0.0, stop_tokens=[tokenizer.eos_id, tokenizer.bos_id])
    assert body["choices"][0]["text"] == tokenizer.decode(expected)
    code, reply, _ = post(server.url, json.dumps({"prompt": "a" * (MAX_TEXT_BYTES + 1)}).encode(), "/tokenize")
    assert code == 400 and "/tokenize takes" in reply["error"]["message"]
    code, reply, _ = post(server.url, {"prompt": "def add"}, "/tokenize")
    assert code == 200 and reply["tokens"] == [tokenizer.bos_id] + tokenizer.encode("def add")


def test_a_chunked_body_past_the_cap_that_goes_on_arriving_gets_413(server):
    """A chunked body of 48 MiB with no Content-Length, sent whole before the reply is read (as
    http.client sends): the server drops what passes the cap and answers 413 (the connection was
    reset at ~21 MiB: the server closed while the body arrived)."""
    from latentloop.serve.limits import MAX_BODY_BYTES

    piece = 2**20

    def body():
        for _ in range(3 * MAX_BODY_BYTES // piece):
            yield b"[" * piece

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CALL_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", body=body(), encode_chunked=True,
                           headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        status, payload = reply.status, json.loads(reply.read())
    finally:
        connection.close()
    assert status == 413 and payload["error"]["message"].startswith("the request body is larger than")
    assert httpx.get(server.url + "/health", timeout=CALL_TIMEOUT_S).status_code == 200


def test_a_chunked_body_past_the_cap_sent_after_100_continue_gets_its_413(server):
    """curl sends a large body chunked with `Expect: 100-continue`: the server's first read tells it
    to go on, so the whole body comes. The refusal did not drain it (a client that asks sends nothing
    until told), and curl read "connection reset" after the 413's headers (12-07 review)."""
    from latentloop.serve.limits import MAX_BODY_BYTES

    piece = 2**20
    chunk = f"{piece:x}\r\n".encode() + b"[" * piece + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=CALL_TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n")
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(4096)
        head, _, received = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 100"), head  # told to go on before the server reads
        for _ in range(2 * MAX_BODY_BYTES // piece):
            sock.sendall(chunk)
        sock.sendall(b"0\r\n\r\n")
        while part := sock.recv(65536):
            received += part
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(payload)["error"]["message"].startswith("the request body is larger than")


# --------------------------------------------------------------------------------------------
# SIGTERM
# --------------------------------------------------------------------------------------------


SHUTDOWN_STEPS = 32  # rgpt recurrence steps: each request decodes for seconds, still running at SIGTERM
IN_FLIGHT = 8
AFTER_SIGNAL_S = 1.0  # how long new requests are sent after SIGTERM (the server drains up to 5 s)


def test_sigterm_answers_requests_in_flight_and_new_ones_with_503(runs, tmp_path):
    """8 requests decoding at SIGTERM each get a 503 with one message (or their completion), never a
    dropped connection; requests sent after the signal get 503 while the server drains (they were
    refused at once: the socket closed with the signal)."""
    with serving({"rgpt": ServeProcess(runs["rgpt"], tmp_path / "log")}) as started:
        server = started["rgpt"]
        results: list[tuple] = []
        body = {"prompt": "x", "max_tokens": 100, "temperature": 0, "steps": SHUTDOWN_STEPS}

        def send(_: int) -> tuple:
            try:
                reply = httpx.post(server.url + "/v1/completions", json=body, timeout=CALL_TIMEOUT_S)
                return reply.status_code, reply.json()
            except httpx.TransportError as error:
                return "dropped", repr(error)

        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            in_flight = [pool.submit(send, i) for i in range(IN_FLIGHT)]
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while time.monotonic() < deadline:  # every request is decoding or queued
                stats = httpx.get(server.url + "/v1/stats", timeout=CALL_TIMEOUT_S).json()
                if stats["active_rows"] + stats["queued"] >= IN_FLIGHT:
                    break
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            after = []
            # new requests for a while (the drain goes on while they come), or until the server stops
            # listening (a stall of this test's past SHUTDOWN_QUIET_S lets it)
            while time.monotonic() - signalled < AFTER_SIGNAL_S:
                try:
                    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=CALL_TIMEOUT_S)
                except httpx.TransportError:
                    break
                after.append((reply.status_code, reply.json()))
            results = [future.result(CALL_TIMEOUT_S) for future in in_flight]
        server.proc.wait(SERVER_EXIT_S)
    for status, reply in results:
        assert status in (200, 503), reply
        if status == 503:
            assert reply["error"]["message"].startswith("the server is shutting down"), reply
    assert after, "no request was answered after the signal"
    assert all(status == 503 and reply["error"]["code"] == "shutting_down" for status, reply in after), after


@contextlib.contextmanager
def in_process(model, tokenizer, **settings):
    """An app over `model` served by uvicorn in a thread of this process on a free loopback port:
    (app, url); stopped on leaving."""
    import asyncio

    import uvicorn

    from latentloop.serve.app import create_app, server_config
    from latentloop.serve.settings import ServeSettings

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve_settings = ServeSettings("unused", port=port, decode="eager", batch_window_ms=0, **settings)
    app = create_app(model, tokenizer, "m", serve_settings)
    server = uvicorn.Server(server_config(app, serve_settings))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(CALL_TIMEOUT_S)


def test_a_request_gets_its_503_at_once_while_a_long_decode_step_runs(monkeypatch):
    """The scheduler reads the stop between steps: a handler waiting on it answers 503 within a poll
    of the stop, not when a step of many seconds ends (a step past uvicorn's grace had its
    connection cut, no reply)."""
    from latentloop.serve.serving import DISCONNECT_POLL_S

    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", sequence_len=CONTEXT).eval()
    step_started, release = threading.Event(), threading.Event()
    real_decode = model.decode

    def slow_decode(*args, **kwargs):
        step_started.set()
        release.wait(CALL_TIMEOUT_S)  # a step that lasts until the test ends it
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(model, "decode", slow_decode)
    try:
        with in_process(model, TOK) as (app, url), ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, url + "/v1/completions", timeout=CALL_TIMEOUT_S,
                                json={"prompt": "x", "max_tokens": 8, "temperature": 0})
            assert step_started.wait(CALL_TIMEOUT_S)
            stopped = time.monotonic()
            app.state.scheduler.stop()
            answer = reply.result(CALL_TIMEOUT_S)
            answered = time.monotonic() - stopped
            release.set()  # the step ends, so that the scheduler thread ends with the server
    finally:
        release.set()
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
    assert answered < DISCONNECT_POLL_S + 2.0, answered


def test_bodies_held_at_once_are_bounded_together_and_given_back():
    """Each body was bounded alone (16 MiB), none together: 300 clients sending large bodies held
    gigabytes. Past the budget a body gets 503 (drained first, so its client reads it); a body read
    and decoded gives its bytes back (12-07 review)."""
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", sequence_len=CONTEXT).eval()
    budget = 4096
    with in_process(model, TOK) as (app, url), socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])),
                                                                        timeout=CALL_TIMEOUT_S) as slow:
        bodies = app.state.serving.bodies
        bodies.capacity = budget
        # one client sends 3 KiB of its body and pauses: the server holds them while it waits for the rest
        opening = b'{"prompt": "' + b"a" * 3072
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(opening):x}\r\n".encode() + opening + b"\r\n")
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while bodies.held < len(opening) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bodies.held == len(opening)
        refused = httpx.post(url + "/v1/completions", content=json.dumps({"prompt": "b" * 2000}).encode(),
                             headers={"Content-Type": "application/json"}, timeout=CALL_TIMEOUT_S)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "bodies_busy", refused.text
        assert "retry later" in refused.json()["error"]["message"]
        ending = b'", "max_tokens": 1}'
        slow.sendall(f"{len(ending):x}\r\n".encode() + ending + b"\r\n0\r\n\r\n")
        assert slow.recv(65536).split(b"\r\n", 1)[0] in (b"HTTP/1.1 200 OK", b"HTTP/1.1 400 Bad Request")
        assert bodies.held == 0  # given back
        answer = httpx.post(url + "/v1/completions", json={"prompt": "b" * 2000, "max_tokens": 1},
                            timeout=CALL_TIMEOUT_S)
        assert answer.status_code in (200, 400) and answer.json().get("error", {}).get("code") != "bodies_busy"
        assert bodies.held == 0


SLOW_TOKENIZER_S = 30.0  # a tokenization that would outlast the request's timeout many times
SHORT_TIMEOUT_S = 1.0


class SlowTokenizer:
    """The byte tokenizer, whose batch encoding takes SLOW_TOKENIZER_S (releasing the GIL, as the
    Hugging Face tokenizers' batch call does) or until released."""

    def __init__(self):
        self.inner, self.release = ByteTokenizer(), threading.Event()

    def encode_batch(self, texts):
        self.release.wait(SLOW_TOKENIZER_S)
        return self.inner.encode_batch(texts)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_tokenization_past_the_request_timeout_ends_the_request_with_504():
    """--request-timeout bounds tokenizing too: the request gets 504 at its timeout, not when the
    tokenizer returns (the worker thread is left to finish), and /health answers meanwhile."""
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", sequence_len=CONTEXT).eval()
    tokenizer = SlowTokenizer()
    try:
        with in_process(model, tokenizer, request_timeout=SHORT_TIMEOUT_S) as (_, url), \
                ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            reply = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                timeout=CALL_TIMEOUT_S)
            time.sleep(SHORT_TIMEOUT_S / 4)
            assert httpx.get(url + "/health", timeout=SHORT_TIMEOUT_S).status_code == 200
            answer = reply.result(CALL_TIMEOUT_S)
            took = time.monotonic() - start
            preparing = httpx.get(url + "/v1/stats", timeout=CALL_TIMEOUT_S).json()["preparing"]
            tokenizer.release.set()
    finally:
        tokenizer.release.set()
    assert answer.status_code == 504 and "--request-timeout" in answer.json()["error"]["message"]
    assert SHORT_TIMEOUT_S <= took < SHORT_TIMEOUT_S + 5, took
    assert preparing == 1  # the abandoned tokenization still holds its thread's slot, until it returns


def read_reply(connection: socket.socket, timeout_s: float) -> bytes:
    """What the server sends on `connection` until it closes it, or `timeout_s` passes."""
    connection.settimeout(timeout_s)
    received = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := connection.recv(65536):
            received += chunk
    return received


def test_headers_that_never_end_get_408_at_the_request_timeout_and_bad_bytes_a_json_400():
    """A client that sends a header line now and then and never ends its headers: the app never sees the
    request, so --request-timeout did not bound it, and uvicorn times only idle connections (the
    connection stayed open as long as the lines came). It gets 408 at the timeout now, its connection
    closed; /health answers meanwhile. Bytes that are not HTTP get a 400 in the API's JSON shape (was
    uvicorn's plain text)."""
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", sequence_len=CONTEXT).eval()
    with in_process(model, TOK, request_timeout=SHORT_TIMEOUT_S) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            start = time.monotonic()
            closed_at = None
            while time.monotonic() - start < SHORT_TIMEOUT_S + 10:
                try:
                    slow.sendall(b"X-Drip: 1\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    closed_at = time.monotonic() - start
                    break
                slow.settimeout(0.25)
                try:
                    if reply := slow.recv(65536):
                        closed_at = time.monotonic() - start
                        reply += read_reply(slow, CALL_TIMEOUT_S)
                        break
                except TimeoutError:
                    pass
            assert httpx.get(url + "/health", timeout=CALL_TIMEOUT_S).status_code == 200
        assert closed_at is not None and closed_at < SHORT_TIMEOUT_S + 5, closed_at
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply
        assert "--request-timeout" in json.loads(body)["error"]["message"]
        with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as garbage:
            garbage.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            head, _, body = read_reply(garbage, CALL_TIMEOUT_S).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, head
        assert json.loads(body)["error"]["message"] == "the request is not valid HTTP/1.1"
        # a request that arrives whole on a connection that waited is served as before
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          timeout=CALL_TIMEOUT_S).status_code == 200
        # an idle keep-alive connection after its response gets no unasked 408 (uvicorn closes it quietly
        # at its keep-alive of 5 s), and one that never sends is closed at the deadline without a reply
        with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            kept.settimeout(CALL_TIMEOUT_S)
            first = b""
            while b"\r\n\r\n" not in first:  # the head, then the body by its length (two writes, maybe two reads)
                first += kept.recv(65536)
            head, _, body = first.partition(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
            while len(body) < length:
                body += kept.recv(65536)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert read_reply(kept, SHORT_TIMEOUT_S * 3) == b""  # nothing more within three deadlines
        with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as silent:
            start = time.monotonic()
            assert read_reply(silent, SHORT_TIMEOUT_S + 10) == b""
            assert time.monotonic() - start < SHORT_TIMEOUT_S + 5  # closed, not left open


# --------------------------------------------------------------------------------------------
# Per-request sampling settings in a batch
# --------------------------------------------------------------------------------------------


# Unseeded sampled requests that differ in one setting each, seeded ones, and greedy ones
SAMPLING = [{"temperature": 0.8, "top_p": 0.5}, {"temperature": 0.8, "top_p": 0.9}, {"temperature": 0.8},
            {"temperature": 0.8, "top_k": 3}, {"temperature": 0.8, "top_k": 7}, {"temperature": 1.3},
            {"temperature": 0.8, "top_p": 0.9, "seed": 5}, {"temperature": 0.8, "top_p": 0.5, "seed": 5},
            {"temperature": 0}, {"temperature": 0, "top_p": 0.5}]


def sampled_jobs(model, scheduler_module):
    """One Job per SAMPLING entry (prompts that tell the requests apart), and their events."""
    events: dict[int, list] = {}
    jobs = []
    for i, sampling in enumerate(SAMPLING):
        request = parse_completion({"prompt": f"{i:02d}:", "max_tokens": 3, **sampling}, model, TOK,
                                   Limits(CONTEXT, 16, 16), "m")
        events[i] = []
        jobs.append(scheduler_module.Job(request, events[i].append, TOK))
    return jobs, events


def test_the_round_scheduler_calls_the_engine_with_each_rows_own_sampling(monkeypatch):
    """Every engine call of a round samples with the settings of each of its rows' requests: rows of
    requests that differ in temperature, top_k, top_p or seed never share a call (a call takes one
    setting: a grouping that left top_p out sampled some requests with another's top_p, unseen by
    tests that compare only seeded or greedy requests with their result alone)."""
    from latentloop.serve import scheduler as scheduler_module

    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", sequence_len=CONTEXT).eval()
    scheduler = scheduler_module.RoundScheduler(model, TOK, max_rows=16, max_queue=16, batch_window=0)
    calls = []
    real_stream = scheduler_module.stream

    def recording(model, prompts, max_new_tokens, **kwargs):
        calls.append(([list(p) for p in prompts], kwargs))
        return real_stream(model, prompts, max_new_tokens, **kwargs)

    monkeypatch.setattr(scheduler_module, "stream", recording)
    jobs, events = sampled_jobs(model, scheduler_module)
    scheduler._run_round(jobs)
    by_prompt = {tuple(job.request.prompts[0]): job.request for job in jobs}
    assert sum(len(prompts) for prompts, _ in calls) == len(jobs)
    for prompts, kwargs in calls:
        for prompt in prompts:
            request = by_prompt[tuple(prompt)]
            if request.greedy:
                assert kwargs["temperature"] == 0
                continue
            assert (kwargs["temperature"], kwargs["top_k"], kwargs["top_p"], kwargs["seed"]) == \
                (request.temperature, request.top_k, request.top_p, request.seed), (request, kwargs)
    assert len(calls) < len(jobs)  # the greedy rows share a call: the test sees batching at all
    for i, job_events in events.items():
        assert type(job_events[-1]).__name__ == "Done", (SAMPLING[i], job_events[-1])


def test_the_continuous_scheduler_draws_each_request_with_its_own_sampling(monkeypatch):
    """The same for continuous batching: each draw of a batch step uses the settings and the
    generator of the request whose rows it draws."""
    from latentloop.serve import batch as batch_module
    from latentloop.serve import scheduler as scheduler_module

    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", sequence_len=CONTEXT).eval()
    scheduler = scheduler_module.ContinuousScheduler(model, TOK, max_rows=16, max_queue=16, batch_window=0)
    draws = []
    real_sample = batch_module.sample_next

    def recording(logits, temperature, top_k, top_p, generator):
        draws.append((temperature, top_k, top_p, generator))
        return real_sample(logits, temperature, top_k, top_p, generator)

    monkeypatch.setattr(batch_module, "sample_next", recording)
    jobs, events = sampled_jobs(model, scheduler_module)
    for job in jobs:
        scheduler._admit(job)
    by_generator = {}
    for batch in scheduler._batches.values():
        for group in batch.waiting:
            for member in group:
                by_generator[id(member.sampling.generator)] = member.owner.job.request
    for _ in range(8):
        for batch in list(scheduler._batches.values()):
            scheduler._step(batch)
    sampled = [job.request for job in jobs if not job.request.greedy]
    assert len(by_generator) == len(sampled) + 1  # a generator per sampled request; the greedy ones: None
    assert {id(generator) for *_, generator in draws} == set(by_generator) - {id(None)}  # each drew
    for temperature, top_k, top_p, generator in draws:
        request = by_generator[id(generator)]
        assert (temperature, top_k, top_p) == (request.temperature, request.top_k, request.top_p), request
    for i, job_events in events.items():
        assert type(job_events[-1]).__name__ == "Done", (SAMPLING[i], job_events[-1])
