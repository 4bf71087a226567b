"""The HTTP face of the server: FastAPI routes, server-sent events, the API key, limits and status
codes, and a uvicorn runner whose shutdown answers every request with 503 before it stops. What a
response says is built in `responses.py`; which rows decode together is the scheduler's.

Endpoints: GET /health (no key needed), GET /v1/models, POST /v1/completions, POST
/v1/chat/completions (models with a chat format: the conversation rendered as SFT trained it), GET
/v1/stats, and
vLLM's tokenizer endpoints GET /tokenizer_info, POST /tokenize, POST /detokenize (lm-eval's
`local-completions` model uses them as its tokenizer with `tokenizer_backend=remote`).

The event loop only moves bytes and events: decoding a JSON body, tokenizing and rendering a chat
template run in daemon threads (`_Threads`), so that one slow request (a chat template that loops,
a 16 MB prompt) never holds up /health or the other requests. Every request is bounded by
`--request-timeout` from its first byte: a body that does not arrive in time gets 408 (the client
was too slow to send it), work of the server's own that does not end in time gets 504 (as a
generation past its time always did). A body past MAX_BODY_BYTES gets 413 once the rest of it is
read and dropped (bounded): a client that sends its whole body before it reads would see a reset
connection instead.

SIGTERM: the requests running end with 503 at once (their handlers do not wait for the scheduler's
step to end), and requests that arrive while the server drains get 503 too, until none has been in
flight for SHUTDOWN_QUIET_S; only then does the server close its socket.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import math
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import LatentloopError
from .limits import MAX_BODY_BYTES
from .protocol import (
    APIError,
    Limits,
    bad_request,
    parse_completion,
    tokenize_text,
    tokenizer_info,
)
from .responses import SSE_DONE, ResponseBuilder, sse
from .scheduler import Done, Failed, Job, make_scheduler
from .settings import ServeSettings, check_settings

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client went away or the server stops
# A refused body is read and dropped (`_drain_body`) until it ends, its client pauses this long, or this
# many bytes are dropped: 1 GiB drains in about a second on loopback; a client that sends more is cut off
DRAIN_IDLE_S = 1.0
DRAIN_MAX_BYTES = 2**30
# JSON nesting a request may have: OpenAI's bodies nest 5 deep at most (body, messages, message, content
# parts, part); the limit keeps deep bodies from the recursion of the decoder and of the checks after it
MAX_JSON_DEPTH = 64
# Threads for blocking work at once, per kind; more requests wait for a slot (within their timeout).
# Chat rendering has its own slots: a template that never ends holds a slot till it does, and must not
# starve /v1/completions and the tokenizer endpoints, whose work always ends.
RENDER_THREADS = 4
PREPARE_THREADS = 4
# What serve allows the chat template to render its probe conversation at start (a real template takes
# milliseconds): longer means it loops, and serve stops with one line instead of never listening. A
# backstop: latentloop.data.chat bounds each render itself (and the start of its renderer process, on a
# loaded machine) and says so more precisely; this must stay above the sum of those limits.
CHAT_PROBE_TIMEOUT_S = 120.0
SHUTDOWN_GRACE_S = 5.0  # after a signal, uvicorn waits this long for open connections, then cancels them
# After SIGTERM the server goes on answering, every request with 503, until none has been in flight for
# SHUTDOWN_QUIET_S (at most SHUTDOWN_DRAIN_MAX_S): a client whose request crossed the signal reads a 503,
# not a refused or reset connection. A server with no connection open at the signal stops at once.
SHUTDOWN_QUIET_S = 0.5
SHUTDOWN_DRAIN_MAX_S = 5.0
SHUTTING_DOWN = "the server is shutting down"
# --------------------------------------------------------------------------------------------
# The application
# --------------------------------------------------------------------------------------------


def _declared(option) -> dict:
    return {"name": option.name, "type": option.kind.__name__, "default": option.default, "help": option.help,
            "choices": list(option.choices) or None, "minimum": option.minimum, "maximum": option.maximum,
            "keywords": list(option.keywords) or None}


class _BodyTooLarge(Exception):
    """The body passed its limit (by its Content-Length, or by the bytes read)."""


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (`_BodyTooLarge`) as soon as it is known to exceed `limit` bytes:
    by its Content-Length before any of it is read, else (a chunked body) once the bytes read pass
    the limit, so that no more than the limit is ever held."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain_body(request: Request, deadline: float) -> None:
    """Read and drop the rest of a body that is refused, so that its client reads the refusal:
    most clients send their whole body before they read a reply, and a server that closes its end
    while a body still arrives makes the kernel reset the connection (the client sees "connection
    reset", never the 413). Bounded: it ends when the body does, when the client pauses DRAIN_IDLE_S
    (it waits for the reply, having sent what it meant to), past DRAIN_MAX_BYTES, or at the request's
    deadline. A client that asked `Expect: 100-continue` sends nothing until told to: nothing to drain."""
    if request.headers.get("expect", "").lower() == "100-continue":
        return
    drained = 0
    while drained <= DRAIN_MAX_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(request.receive(), min(left, DRAIN_IDLE_S))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":  # the client went away
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels in `value` (without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for item in node.values() if isinstance(node, dict) else node:
            if isinstance(item, (list, dict)):
                stack.append((item, depth + 1))
    return False


def _decode_json(raw: bytes) -> Any:
    """The decoded body, or a 400 naming what is wrong with it (blocking: run it off the loop)."""
    too_deep = bad_request(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the decoder's recursion allows: far past the limit
        raise too_deep from None
    if isinstance(value, (list, dict)) and _nested_deeper(value, MAX_JSON_DEPTH):
        raise too_deep
    return value


class _Threads:
    """Blocking work off the event loop: each call in a daemon thread of its own, at most `limit`
    at once (more wait for a slot). Not an executor: asyncio.run joins its default executor at
    exit and the interpreter joins a ThreadPoolExecutor's threads, so a call that never returns (a
    chat template that loops) would keep the process from exiting on SIGTERM. A call keeps its slot
    until it returns, also when its request has given up on it: runaway calls cannot pile up threads."""

    def __init__(self, name: str, limit: int):
        self.name = name
        self.busy = 0  # calls running, those whose request has given up included
        self._slots = asyncio.Semaphore(limit)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:  # on the loop
            self.busy -= 1
            self._slots.release()
            if not future.done():  # else its request gave up on it (timeout, shutdown)
                future.set_result(value) if ok else future.set_exception(value)

        def work() -> None:  # in the thread
            try:
                outcome = (True, fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the request, which raises it
                outcome = (False, exc)
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(settle, *outcome)

        self.busy += 1
        try:
            threading.Thread(target=work, name=f"latentloop-{self.name}", daemon=True).start()
        except BaseException:
            self.busy -= 1
            self._slots.release()
            raise
        return await future


class _Traffic:
    """The requests in flight, for the shutdown: `_TrafficGate` counts them, and the uvicorn server
    asks `drained` before it closes its socket."""

    def __init__(self):
        self.in_flight = 0
        self.last = -math.inf  # when a request last began or ended (time.monotonic)
        self.stopped_at: float | None = None

    def stop(self, connections_open: bool) -> None:
        """The signal came: the drain starts now."""
        now = time.monotonic()
        self.stopped_at = now
        if connections_open:  # a request may be on its way on one of them
            self.last = now

    def drained(self) -> bool:
        """Whether the server may close its socket: no request in flight for SHUTDOWN_QUIET_S, or
        SHUTDOWN_DRAIN_MAX_S after the signal."""
        now = time.monotonic()
        if self.stopped_at is None or now - self.stopped_at >= SHUTDOWN_DRAIN_MAX_S:
            return True
        return self.in_flight == 0 and now - self.last >= SHUTDOWN_QUIET_S


class _TrafficGate:
    """ASGI middleware: counts the requests in flight (`_Traffic`) and, once the server stops,
    answers every new one with 503 (its body drained first, see `_drain_body`)."""

    def __init__(self, app, traffic: _Traffic, scheduler):
        self.app, self.traffic, self.scheduler = app, traffic, scheduler

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.traffic.in_flight += 1
        self.traffic.last = time.monotonic()
        try:
            if self.scheduler.stopping:
                await _drain_body(Request(scope, receive), time.monotonic() + SHUTDOWN_QUIET_S)
                error = APIError(503, SHUTTING_DOWN, type="server_error", code="shutting_down")
                await JSONResponse(error.body(), status_code=503, headers={"Connection": "close"})(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            self.traffic.in_flight -= 1
            self.traffic.last = time.monotonic()


class _Inbox:
    """A job's events, posted by the scheduler thread and read by its handler on the loop. Waking the
    loop costs both threads (a write to the loop's pipe, a callback, a task switch): the loop is woken
    once per burst of events rather than per event, and for a response sent whole (`whole`) only by
    the job's last event (Done or Failed); the deltas before it wait here, read when it comes (or when
    the handler looks between its disconnect checks): a plain response of 32 tokens wakes the loop
    once, not 33 times."""

    def __init__(self, loop: asyncio.AbstractEventLoop, whole: bool):
        self._loop, self._whole = loop, whole
        self._events: collections.deque = collections.deque()
        self._woken = asyncio.Event()
        # a wake-up is on its way (read and written by the scheduler's post and the loop's _wake)
        self._waking = False

    def post(self, event) -> None:
        """From the scheduler thread. The event is queued before `_waking` is read, so an event that
        skips the wake-up is seen by the wake-up already on its way."""
        self._events.append(event)
        if self._waking or (self._whole and not isinstance(event, (Done, Failed))):
            return
        self._waking = True
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:  # on the loop
        self._waking = False
        self._woken.set()

    async def get(self, timeout: float):
        """The next event, waiting up to `timeout` seconds for one (asyncio.TimeoutError past it). A
        wake-up may find nothing: its events were read before it came (the handler was busy)."""
        deadline = self._loop.time() + timeout
        while not self._events:
            self._woken.clear()
            left = deadline - self._loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait_for(self._woken.wait(), left)
        return self._events.popleft()


def create_app(model, tokenizer, name: str, settings: ServeSettings) -> FastAPI:
    """The FastAPI app over a loaded model; its lifespan starts and stops the scheduler thread."""
    scheduler = make_scheduler(settings.batching, model, tokenizer, settings.max_batch_size, settings.max_queue,
                               settings.batch_window_ms / 1000,
                               compiled={"eager": False, "compiled": True, "auto": "auto"}[settings.decode],
                               announce=lambda message: print(f"latentloop: {message}", file=sys.stderr, flush=True))
    context = int(model.config.sequence_len)
    limits = Limits.for_model(context, settings.max_tokens_cap, settings.max_batch_size, tokenizer)
    arch = model.config.arch
    created = int(time.time())
    counters = {"timeouts": 0, "disconnects": 0}
    renders = _Threads("render", RENDER_THREADS)  # chat requests: their checks and the chat template
    prepares = _Threads("prepare", PREPARE_THREADS)  # JSON decoding, completions' checks and tokenizing

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.join(SHUTDOWN_GRACE_S)

    app = FastAPI(title="latentloop", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.state.traffic = _Traffic()
    app.add_middleware(_TrafficGate, traffic=app.state.traffic, scheduler=scheduler)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        # a body refused before its end (413 once its bounded drain ends, 408) may still be arriving:
        # the connection closes rather than reading on for a next request
        headers = {"Connection": "close"} if exc.status in (408, 413) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code in (404, 405):
            message = (f"{request.method} {request.url.path} is not an endpoint of this server (it offers GET "
                       f"/v1/models, POST /v1/completions, POST /v1/chat/completions, GET /v1/stats, GET /health)")
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    def authorize(request: Request) -> None:
        if not settings.api_key:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key")

    router = APIRouter(dependencies=[Depends(authorize)])

    def timed_out() -> APIError:
        counters["timeouts"] += 1
        return APIError(504, f"the request took longer than {settings.request_timeout:g} s (--request-timeout)",
                        type="server_error", code="timeout")

    def body_timed_out() -> APIError:
        counters["timeouts"] += 1
        return APIError(408, f"the request body did not arrive within {settings.request_timeout:g} s "
                             f"(--request-timeout)", code="timeout")

    async def bounded(work: Awaitable, deadline: float, past_deadline: Callable[[], APIError]) -> Any:
        """The result of `work`; or `past_deadline()` once the deadline has passed, or 503 once the
        server begins to stop, whichever comes first. Given up, `work` is cancelled (work in a thread
        goes on until it returns, but nobody waits for it)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise past_deadline()
                if scheduler.stopping:
                    raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
                done, _ = await asyncio.wait({task}, timeout=min(left, DISCONNECT_POLL_S))
                if done:
                    return task.result()
        finally:
            task.cancel()  # a no-op once done

    async def read_json(request: Request, deadline: float, limit: int = MAX_BODY_BYTES,
                        why: str = "the most any request may have") -> Any:
        try:
            raw = await bounded(_read_body(request, limit), deadline, body_timed_out)
        except ClientDisconnect:  # gone before its body ended: nobody reads a reply, and no server error to log
            counters["disconnects"] += 1
            raise APIError(400, "the client disconnected before its request body arrived") from None
        except _BodyTooLarge:
            await _drain_body(request, deadline)
            raise APIError(413, f"the request body is larger than {limit:,} bytes, {why}") from None
        return await bounded(prepares.run(_decode_json, raw), deadline, timed_out)

    @app.get("/health")
    async def health() -> dict:
        snapshot = scheduler.snapshot()
        return {"status": "ok", "model": name, "arch": arch, "queued": snapshot["queued"],
                "active_rows": snapshot["active_rows"], "max_batch_rows": snapshot["max_batch_rows"]}

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "latentloop", "max_model_len": context,
            "latentloop": {"arch": arch, "options": [_declared(option) for option in model.OPTIONS]}}]}

    @router.get("/v1/stats")
    async def stats() -> dict:
        return {**scheduler.snapshot(), **counters, "rendering": renders.busy, "preparing": prepares.busy}

    @router.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict:
        return tokenizer_info(tokenizer, context)

    def tokenize_reply(body: Any) -> bytes:  # blocking: tokenizes, and writes the JSON of up to a text's ids
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise bad_request("tokenize takes {\"prompt\": TEXT, \"add_special_tokens\": true|false}", "prompt")
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise bad_request(f"add_special_tokens must be true or false, got {add!r}", "add_special_tokens")
        ids = tokenize_text(tokenizer, text, add)
        return json.dumps({"tokens": ids, "count": len(ids), "max_model_len": context}).encode()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        deadline = time.monotonic() + settings.request_timeout
        body = await read_json(request, deadline)
        reply = await bounded(prepares.run(tokenize_reply, body), deadline, timed_out)
        return Response(reply, media_type="application/json")

    def detokenize_ids(body: Any) -> str:  # blocking: checks and decodes up to a body's worth of ids
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < tokenizer.vocab_size for t in ids):
            raise bad_request(f"detokenize takes {{\"tokens\": [ids in [0, {tokenizer.vocab_size})]}}", "tokens")
        return tokenizer.decode(ids)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        deadline = time.monotonic() + settings.request_timeout
        body = await read_json(request, deadline)
        return {"prompt": await bounded(prepares.run(detokenize_ids, body), deadline, timed_out)}

    async def next_event(inbox: _Inbox, job: Job, request: Request, deadline: float):
        """The job's next event; None when the client went away; APIError 504 past the deadline.
        Either way the job is cancelled, so the scheduler drops its rows at the next step."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                job.cancel()
                raise timed_out()
            try:
                return await inbox.get(min(left, DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                if scheduler.stopping:  # at once, not at the scheduler's next step (which may be long)
                    job.cancel()
                    raise APIError(503, f"{SHUTTING_DOWN}: the request was stopped", type="server_error",
                                   code="shutting_down") from None
                if await request.is_disconnected():
                    job.cancel()
                    counters["disconnects"] += 1
                    return None

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    async def respond(request: Request, chat: bool):
        """One completions or chat-completions request, plain or streamed: the same parsing,
        scheduling and events; only the shape of a choice differs (`text` vs `message` / `delta`)."""
        deadline = time.monotonic() + settings.request_timeout  # the whole request, from its first byte
        # a completions body larger than any prompt the context can hold is refused by its size, unread
        body = await (read_json(request, deadline) if chat else
                      read_json(request, deadline, limits.completion_body_bytes, limits.completion_body_why()))
        # the checks tokenize the prompt, or render the conversation with the model's chat template
        parsed = await bounded((renders if chat else prepares).run(parse_completion, body, model, tokenizer, limits,
                                                                   name, chat), deadline, timed_out)
        inbox = _Inbox(asyncio.get_running_loop(), whole=not parsed.stream)
        job = Job(parsed, inbox.post, tokenizer)
        scheduler.submit(job)
        response = ResponseBuilder(parsed, chat, name, arch)

        if parsed.stream:
            async def events():
                try:
                    while True:
                        try:
                            event = await next_event(inbox, job, request, deadline)
                        except APIError as error:
                            event = Failed(error)
                        if event is None:
                            return
                        if isinstance(event, Failed):
                            yield sse(event.error.body())
                            yield SSE_DONE
                            return
                        if isinstance(event, Done):
                            usage = response.usage_chunk(event)
                            if usage is not None:
                                yield usage
                            yield SSE_DONE
                            return
                        yield response.chunk(event, job.batch_rows)
                finally:
                    job.cancel()  # a no-op once the job is done; frees the rows of a client that left

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        try:
            while True:
                event = await next_event(inbox, job, request, deadline)
                if event is None:
                    return Response(status_code=499)  # nginx's "client closed request": nobody reads it
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Done):
                    return response.completion(event, job.batch_rows)
                response.add(event)
        finally:
            job.cancel()

    app.include_router(router)
    return app


# --------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound now and listening only once uvicorn runs: a port in use is one
    line before the model is loaded, nothing can take the port while it loads, and `--port 0` gets
    a port that can be printed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise LatentloopError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _probe_chat_format(tokenizer, limit_s: float) -> None:
    """Settle the tokenizer's chat format before serving: with a Hugging Face chat template, the
    template renders a probe conversation to find its end-of-turn token. A template that fails
    it, or does not render it within `limit_s`, stops serve with one line (exit 2): every chat
    request would fail alike, and the scheduler stops generation at that token, so the server
    cannot run without it. The probe runs in a daemon thread, which is left behind if it loops."""
    outcome: dict[str, Any] = {}

    def probe() -> None:
        try:
            getattr(tokenizer, "chat_tokens", None)  # computed once and cached by the tokenizer
        except BaseException as exc:  # noqa: BLE001 - raised below, in the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=probe, name="latentloop-chat-probe", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise LatentloopError(f"the model's chat template did not render a two-turn probe conversation within "
                              f"{limit_s:g} s (it loops?): fix the chat_template in the run's tokenizer.json")
    error = outcome.get("error")
    if isinstance(error, LatentloopError):
        raise LatentloopError(f"the model's chat template fails its probe conversation: {error}") from None
    if error is not None:
        raise error


def serve(settings: ServeSettings) -> None:
    """Load the run and serve it until SIGINT / SIGTERM."""
    import uvicorn

    from ..runtime import load_run, resolve_device

    check_settings(settings)
    sock = _bind(settings.host, settings.port)
    try:
        device = resolve_device(settings.device)
        model, tokenizer, _, checkpoint = load_run(settings.run, device)
        run_dir = (checkpoint.parent.parent if Path(settings.run).resolve() == checkpoint.resolve()
                   else Path(settings.run))
        name = settings.model_name or run_dir.resolve().name  # the run's name, also when given a checkpoint folder
        _probe_chat_format(tokenizer, CHAT_PROBE_TIMEOUT_S)
        app = create_app(model, tokenizer, name, settings)
        app.state.scheduler.warm()  # --decode compiled: before anyone can connect

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                # running requests end with 503 now (those decoding, rendering or reading a body
                # alike), and new ones get 503 until the traffic is drained (`_Traffic`)
                app.state.scheduler.stop()
                app.state.traffic.stop(connections_open=bool(self.server_state.connections))
                super().handle_exit(sig, frame)

            async def on_tick(self, counter: int) -> bool:
                should_exit = await super().on_tick(counter)
                return should_exit and (self.force_exit or app.state.traffic.drained())

        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                access_log=settings.access_log, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        port = sock.getsockname()[1]
        import torch

        where = f"cpu, {torch.get_num_threads()} threads" if device.type == "cpu" else str(device)
        print(f"latentloop: serving {name!r} ({model.config.arch}, {checkpoint}) at http://{host}:{port}/v1 "
              f"on {where}; Ctrl+C stops", file=sys.stderr, flush=True)
        Server(config).run(sockets=[sock])
    finally:
        sock.close()
