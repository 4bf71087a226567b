"""The serving classes behind the routes, one per endpoint family (as vLLM splits its entrypoints
from its serving classes): `ServingCompletions` (/v1/completions) and `ServingChat`
(/v1/chat/completions) turn a validated body into a scheduled job and its answer, plain or
streamed; `ServingTokenization` answers /tokenize, /detokenize and /tokenizer_info;
`ServingModels` answers /v1/models, /health and /v1/stats; `ServingPage` serves the chat page
and the options it builds its controls from. The routes (`app.py`) only parse and
delegate: `ServerState.parse` reads a body within its limits and validates it (`requests.py`).

Everything they share is a `ServerState`: the model and its tokenizer, the scheduler, the limits,
the worker threads and the counters, and how a request is bounded in time. Every request is bounded
by --request-timeout from its first byte: a body that does not arrive in time gets 408 (the client
was too slow to send it), work of the server's own that does not end in time gets 504, and once
the server stops, 503.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from ..engine import KV_DTYPES
from .limits import MAX_BODY_BYTES, Limits
from .protocol import APIError, tokenize_text, tokenizer_info
from .requests import DetokenizeBody, TokenizeBody, body_context, completion_request, validate
from .responses import SSE_DONE, ResponseBuilder, sse
from .scheduler import Done, Failed, Job, Scheduler, make_scheduler
from .settings import ServeSettings, warm_options_dicts
from .transport import (
    BodiesBusy,
    BodyBudget,
    BodyTooLarge,
    Inbox,
    WorkerThreads,
    decode_json,
    drain_body,
    read_body,
    shutting_down,
)

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client went away or the server stops
# Threads for blocking work at once, per kind; more requests wait for a slot (within their timeout).
# Chat rendering has its own slots: a template that never ends holds a slot till it does, and must not
# starve /v1/completions and the tokenizer endpoints, whose work always ends.
RENDER_THREADS = 4
PREPARE_THREADS = 4
ANY_BODY = "the most any request may have"  # why a body past MAX_BODY_BYTES is refused
# The bytes of request bodies held at once, all requests together (each body bounded by its own limit):
# sixteen of the largest; a body that would pass it is refused with 503 (retry), its bytes drained
MAX_BODIES_HELD_BYTES = 16 * MAX_BODY_BYTES


@dataclass
class ServerState:
    """What every serving class shares (one per app)."""

    model: Any
    tokenizer: Any
    name: str  # the model's id, as clients send it
    settings: ServeSettings
    limits: Limits
    scheduler: Scheduler
    created: int = field(default_factory=lambda: int(time.time()))
    counters: dict = field(default_factory=lambda: {"timeouts": 0, "disconnects": 0})
    renders: WorkerThreads = field(default_factory=lambda: WorkerThreads("render", RENDER_THREADS))  # chat templates
    prepares: WorkerThreads = field(default_factory=lambda: WorkerThreads("prepare", PREPARE_THREADS))  # the rest
    bodies: BodyBudget = field(default_factory=lambda: BodyBudget(MAX_BODIES_HELD_BYTES))

    @classmethod
    def build(cls, model, tokenizer, name: str, settings: ServeSettings) -> ServerState:
        """The state of a server over a loaded model: its scheduler made (not started) and its
        limits computed (the tokenizer's text bound once)."""
        scheduler = make_scheduler(settings.batching, model, tokenizer, settings.max_batch_size, settings.max_queue,
                                   settings.batch_window_ms / 1000,
                                   compiled={"eager": False, "compiled": True, "auto": "auto"}[settings.decode],
                                   kv_dtype=None if settings.kv_dtype is None else KV_DTYPES[settings.kv_dtype],
                                   warm_options=warm_options_dicts(settings),
                                   announce=lambda message: print(f"latentloop: {message}", file=sys.stderr,
                                                                  flush=True))
        limits = Limits.for_model(int(model.config.sequence_len), settings.max_tokens_cap, settings.max_batch_size,
                                  tokenizer)
        return cls(model, tokenizer, name, settings, limits, scheduler)

    @property
    def arch(self) -> str:
        return self.model.config.arch

    @property
    def context(self) -> int:
        return self.limits.context

    # -- time -----------------------------------------------------------------------------------
    def deadline(self, request: Request) -> float:
        """The request's deadline: --request-timeout after it began (set at its first use)."""
        if not hasattr(request.state, "deadline"):
            request.state.deadline = time.monotonic() + self.settings.request_timeout
        return request.state.deadline

    def timed_out(self) -> APIError:
        self.counters["timeouts"] += 1
        return APIError(504, f"the request took longer than {self.settings.request_timeout:g} s (--request-timeout)",
                        type="server_error", code="timeout")

    def body_timed_out(self) -> APIError:
        self.counters["timeouts"] += 1
        return APIError(408, f"the request body did not arrive within {self.settings.request_timeout:g} s "
                             f"(--request-timeout)", code="timeout")

    async def bounded(self, work: Awaitable, deadline: float,
                      past_deadline: Callable[[], APIError] | None = None) -> Any:
        """The result of `work`; or `past_deadline()` (default: 504) once the deadline has passed, or
        503 once the server begins to stop, whichever comes first. Given up, `work` is cancelled (work
        in a thread goes on until it returns, but nobody waits for it)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise (past_deadline or self.timed_out)()
                if self.scheduler.stopping:
                    raise shutting_down()
                done, _ = await asyncio.wait({task}, timeout=min(left, DISCONNECT_POLL_S))
                if done:
                    return task.result()
        finally:
            task.cancel()  # a no-op once done

    # -- bodies ---------------------------------------------------------------------------------
    async def parse(self, request: Request, body_class, limit: int = MAX_BODY_BYTES, why: str = ANY_BODY) -> Any:
        """The request's body as `body_class` (a pydantic model of `requests.py`): read within `limit`
        bytes and the deadline (413, 408), then decoded and validated in a worker thread (400)."""
        deadline = self.deadline(request)
        with self.bodies.holding() as take:
            try:
                raw = await self.bounded(read_body(request, limit, take), deadline, self.body_timed_out)
            except ClientDisconnect:  # gone before its body ended: nobody reads a reply, and no server error to log
                self.counters["disconnects"] += 1
                raise APIError(400, "the client disconnected before its request body arrived") from None
            except BodyTooLarge as refused:
                await drain_body(request, deadline, reading=refused.reading)
                raise APIError(413, f"the request body is larger than {limit:,} bytes, {why}") from None
            except BodiesBusy:
                await drain_body(request, deadline, reading=True)
                raise APIError(503, f"the server holds {self.bodies.capacity:,} bytes of request bodies being read "
                                    f"already, the most it holds at once; retry later", type="server_error",
                               code="bodies_busy") from None
            context = body_context(self.model, self.limits, self.name)
            return await self.bounded(self.prepares.run(_decoded_as, body_class, raw, context), deadline)


def _decoded_as(body_class, raw: bytes, context: dict) -> Any:  # blocking: in a worker thread
    return validate(body_class, decode_json(raw), context)


# --------------------------------------------------------------------------------------------
# The endpoint families
# --------------------------------------------------------------------------------------------


class ServingCompletions:
    """/v1/completions: a validated body's prompts tokenized (in a worker thread), its job
    scheduled, and the job's events sent whole or as server-sent events."""

    chat = False

    def __init__(self, state: ServerState):
        self.state = state

    def threads(self) -> WorkerThreads:
        """Where a request's prompts are made (tokenized; rendered, for chat)."""
        return self.state.prepares

    async def create(self, body, request: Request) -> Response:
        """One request, plain or streamed: the same scheduling and events for completions and chat;
        only the shape of a choice differs (`text` vs `message` / `delta`)."""
        state = self.state
        deadline = state.deadline(request)
        parsed = await state.bounded(self.threads().run(completion_request, body, state.model, state.tokenizer,
                                                        state.limits), deadline)
        inbox = Inbox(asyncio.get_running_loop(), whole=not parsed.stream)
        job = Job(parsed, inbox.post, state.tokenizer)
        state.scheduler.submit(job)
        response = ResponseBuilder(parsed, self.chat, state.name, state.arch)
        if parsed.stream:
            return StreamingResponse(self._stream(inbox, job, request, deadline, response),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while True:
                event = await self._next_event(inbox, job, request, deadline)
                if event is None:
                    return Response(status_code=499)  # nginx's "client closed request": nobody reads it
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Done):
                    return response.completion(event, job.batch_rows)
                response.add(event)
        finally:
            job.cancel()

    async def _stream(self, inbox: Inbox, job: Job, request: Request, deadline: float, response: ResponseBuilder):
        ended = False  # the stream's own end (done, failed, or a disconnect _next_event counted)
        try:
            while True:
                try:
                    event = await self._next_event(inbox, job, request, deadline)
                except APIError as error:
                    event = Failed(error)
                if event is None:
                    ended = True
                    return
                if isinstance(event, Failed):
                    ended = True
                    yield sse(event.error.body())
                    yield SSE_DONE
                    return
                if isinstance(event, Done):
                    ended = True
                    usage = response.usage_chunk(event)
                    if usage is not None:
                        yield usage
                    yield SSE_DONE
                    return
                yield response.chunk(event, job.batch_rows)
        finally:
            if not ended:  # the response was closed under it: the client hung up mid-stream
                self.state.counters["disconnects"] += 1
            job.cancel()  # a no-op once the job is done; frees the rows of a client that left

    async def _next_event(self, inbox: Inbox, job: Job, request: Request, deadline: float):
        """The job's next event; None when the client went away; APIError 504 past the deadline, 503
        once the server stops. Either way the job is cancelled, so the scheduler drops its rows at
        the next step."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                job.cancel()
                raise self.state.timed_out()
            try:
                return await inbox.get(min(left, DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                if self.state.scheduler.stopping:  # at once, not at the scheduler's next step (which may be long)
                    job.cancel()
                    raise shutting_down(f"{shutting_down().message}: the request was stopped") from None
                if await request.is_disconnected():
                    job.cancel()
                    self.state.counters["disconnects"] += 1
                    return None


class ServingChat(ServingCompletions):
    """/v1/chat/completions: as completions, the conversation rendered in the model's chat format
    (in the render threads: a model's own template may run long) instead of a prompt tokenized."""

    chat = True

    def threads(self) -> WorkerThreads:
        return self.state.renders


class ServingTokenization:
    """vLLM's tokenizer endpoints, which lm-eval's `local-completions` model uses as its tokenizer
    (`tokenizer_backend=remote`)."""

    def __init__(self, state: ServerState):
        self.state = state

    def info(self) -> dict:
        return tokenizer_info(self.state.tokenizer, self.state.context)

    async def tokenize(self, body: TokenizeBody, request: Request) -> Response:
        """The ids as JSON bytes, written in the worker thread too: a long text's ids are many."""
        reply = await self.state.bounded(self.state.prepares.run(self._tokenized, body), self.state.deadline(request))
        return Response(reply, media_type="application/json")

    def _tokenized(self, body: TokenizeBody) -> bytes:  # blocking: in a worker thread
        ids = tokenize_text(self.state.tokenizer, body.prompt, body.add_special_tokens)
        return json.dumps({"tokens": ids, "count": len(ids), "max_model_len": self.state.context}).encode()

    async def detokenize(self, body: DetokenizeBody, request: Request) -> dict:
        text = await self.state.bounded(self.state.prepares.run(self.state.tokenizer.decode, body.tokens),
                                        self.state.deadline(request))
        return {"prompt": text}


class ServingModels:
    """What the server serves and how it is doing: /v1/models, /health (no key needed), /v1/stats."""

    def __init__(self, state: ServerState):
        self.state = state

    def models(self) -> dict:
        state = self.state
        return {"object": "list", "data": [{
            "id": state.name, "object": "model", "created": state.created, "owned_by": "latentloop",
            "max_model_len": state.context,
            "latentloop": {"arch": state.arch, "options": [_declared(option) for option in state.model.OPTIONS]}}]}

    def health(self) -> dict:
        snapshot = self.state.scheduler.snapshot()
        return {"status": "ok", "model": self.state.name, "arch": self.state.arch, "queued": snapshot["queued"],
                "active_rows": snapshot["active_rows"], "max_batch_rows": snapshot["max_batch_rows"]}

    def stats(self) -> dict:
        state = self.state
        return {**state.scheduler.snapshot(), **state.counters, "rendering": state.renders.busy,
                "preparing": state.prepares.busy}


class ServingPage:
    """The chat page (GET /, its script and style: files of the package, `static/`, fixed names only)
    and the JSON it builds its controls from: the loaded model's declared decoding options."""

    FILES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
             "chat.css": "text/css; charset=utf-8"}

    def __init__(self, state: ServerState):
        self.state = state
        self.files = {name: resources.files(__package__).joinpath("static", name).read_bytes() for name in self.FILES}

    def file(self, name: str) -> Response:
        if name not in self.FILES:
            raise APIError(404, f"the page has no file {name!r}")
        return Response(self.files[name], media_type=self.FILES[name], headers={"Cache-Control": "no-cache"})

    def config(self) -> dict:
        state = self.state
        return {"model": state.name, "arch": state.arch, "context": state.context,
                "max_tokens_cap": state.settings.max_tokens_cap,
                "chat": getattr(state.tokenizer, "chat_tokens", None) is not None,
                "options": [_declared(option) for option in state.model.OPTIONS]}


def _declared(option) -> dict:
    return {"name": option.name, "type": option.kind.__name__, "default": option.default, "help": option.help_text,
            "choices": list(option.choices) or None, "minimum": option.minimum, "maximum": option.maximum,
            "keywords": list(option.keywords) or None}
