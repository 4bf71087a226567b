"""Bytes and events between the event loop and everything that must not run on it: request bodies
read within their limits (and a refused one drained, so that its client reads the refusal), JSON
decoded in worker threads, the scheduler's events handed to the loop, and the requests in flight
counted for the shutdown. No routes here (`app.py`), and no OpenAI shapes (`responses.py`).

A worker thread is the one place blocking work runs (`WorkerThreads`): decoding a body, validating
it, tokenizing, rendering a chat template. Each kind has a few slots; a request waits for a slot
within its deadline, and gives up on a call that outlives it (the call runs on to its end: work in
a thread cannot be stopped, and the limits on bodies and texts bound how long it can run).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .protocol import APIError, bad_request
from .scheduler import Done, Failed

# A refused body is read and dropped (`drain_body`) until it ends, its client pauses this long, or this
# many bytes are dropped: 1 GiB drains in about a second on loopback; a client that sends more is cut off
DRAIN_IDLE_S = 1.0
DRAIN_MAX_BYTES = 2**30
# JSON nesting a request may have: OpenAI's bodies nest 5 deep at most (body, messages, message, content
# parts, part); the limit keeps deep bodies from the recursion of the decoder and of the checks after it
MAX_JSON_DEPTH = 64
# After SIGTERM the server goes on answering, every request with 503, until none has been in flight for
# SHUTDOWN_QUIET_S (at most SHUTDOWN_DRAIN_MAX_S): a client whose request crossed the signal reads a 503,
# not a refused or reset connection. A server with no connection open at the signal stops at once.
SHUTDOWN_QUIET_S = 0.5
SHUTDOWN_DRAIN_MAX_S = 5.0
SHUTTING_DOWN = "the server is shutting down"
NOT_HTTP = "the request is not valid HTTP/1.1"  # uvicorn's 400 for bytes h11 cannot parse, as JSON


def shutting_down(message: str = SHUTTING_DOWN) -> APIError:
    return APIError(503, message, type="server_error", code="shutting_down")


# --------------------------------------------------------------------------------------------
# Bodies
# --------------------------------------------------------------------------------------------


class BodyTooLarge(Exception):
    """The body passed its limit (by its Content-Length, or by the bytes read: `reading` is then
    True, and a client that asked `Expect: 100-continue` was told to send it all)."""

    def __init__(self, reading: bool):
        super().__init__()
        self.reading = reading


class BodiesBusy(Exception):
    """The bodies held at once, across requests, would pass their budget (`BodyBudget`)."""


class BodyBudget:
    """The bytes of request bodies the server holds at once, read and not yet decoded: each body is
    bounded by its own limit, and this bounds them together (300 clients sending 16 MiB bodies could hold
    4.7 GiB). Used on the event loop only: no lock."""

    def __init__(self, capacity: int):
        self.capacity, self.held = capacity, 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[Callable[[int], None]]:
        """A `take(n)` that adds n bytes to what this body holds (`BodiesBusy` past the budget); all of
        it is given back at the end."""
        taken = 0

        def take(size: int) -> None:
            nonlocal taken
            if self.held + size > self.capacity:
                raise BodiesBusy
            self.held += size
            taken += size

        try:
            yield take
        finally:
            self.held -= taken


async def read_body(request: Request, limit: int, take: Callable[[int], None] = lambda size: None) -> bytes:
    """The request body, refused (`BodyTooLarge`) as soon as it is known to exceed `limit` bytes:
    by its Content-Length before any of it is read, else (a chunked body) once the bytes read pass
    the limit, so that no more than the limit is ever held. Each chunk is `take`n from a budget first."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(reading=False)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(reading=True)
        take(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


async def drain_body(request: Request, deadline: float, reading: bool = False) -> None:
    """Read and drop the rest of a body that is refused, so that its client reads the refusal:
    most clients send their whole body before they read a reply, and a server that closes its end
    while a body still arrives makes the kernel reset the connection (the client sees "connection
    reset", never the 413). Bounded: it ends when the body does, when the client pauses DRAIN_IDLE_S
    (it waits for the reply, having sent what it meant to), past DRAIN_MAX_BYTES, or at the request's
    deadline. A client that asked `Expect: 100-continue` sends nothing until told to: nothing to drain,
    unless the server was `reading` the body already (the first read tells it to go on: curl sends a
    large chunked body so)."""
    if not reading and request.headers.get("expect", "").lower() == "100-continue":
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


def decode_json(raw: bytes) -> Any:
    """The decoded body, or a 400 naming what is wrong with it (blocking: run it off the loop)."""
    too_deep = bad_request(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # an integer past Python's conversion limit: no field takes one that long
        raise bad_request(f"the request body holds a number of more than {sys.get_int_max_str_digits():,} "
                          f"digits") from None
    except RecursionError:  # deeper than the decoder's recursion allows: far past the limit
        raise too_deep from None
    if isinstance(value, (list, dict)) and _nested_deeper(value, MAX_JSON_DEPTH):
        raise too_deep
    return value


# --------------------------------------------------------------------------------------------
# Worker threads, the scheduler's events, the shutdown
# --------------------------------------------------------------------------------------------


class WorkerThreads:
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


class Inbox:
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


class Traffic:
    """The requests in flight, for the shutdown: `TrafficGate` counts them, and the uvicorn server
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


class TrafficGate:
    """ASGI middleware: counts the requests in flight (`Traffic`) and, once the server stops,
    answers every new one with 503 (its body drained first, see `drain_body`)."""

    def __init__(self, app, traffic: Traffic, scheduler):
        self.app, self.traffic, self.scheduler = app, traffic, scheduler

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.traffic.in_flight += 1
        self.traffic.last = time.monotonic()
        try:
            if self.scheduler.stopping:
                await drain_body(Request(scope, receive), time.monotonic() + SHUTDOWN_QUIET_S)
                body = shutting_down().body()
                await JSONResponse(body, status_code=503, headers={"Connection": "close"})(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            self.traffic.in_flight -= 1
            self.traffic.last = time.monotonic()


# --------------------------------------------------------------------------------------------
# The connection: headers within --request-timeout, errors before the app in the API's shape
# --------------------------------------------------------------------------------------------


def write_error_and_close(transport: asyncio.Transport, error: APIError) -> None:
    """`error` as a whole HTTP/1.1 response written straight to the connection, which then closes: for
    the answers given before a request reaches the app (its bytes cannot be parsed, its headers are
    late), where h11 has no request to answer."""
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    transport.write(head.encode() + body)
    transport.close()


def http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, with a request's headers bounded in time and its pre-app errors in the
    API's JSON shape. uvicorn times only an idle connection (keep-alive): one whose client sends a
    header line now and then, never ending its headers, stayed open for ever, past --request-timeout,
    which counts from when the app sees the request. Here a request's headers must be complete within
    `header_timeout_s` of its first byte, else 408 and the connection closes; a connection that sends
    nothing at all is closed at that deadline without a reply. And bytes h11 cannot parse got uvicorn's
    plain-text 400: now the error body every other refusal has."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        _headers_timer: asyncio.TimerHandle | None = None
        _between_requests = True  # no request's headers read since the last response (or the connection's start)
        _silent = False  # the timer running is a new connection's, which has sent nothing yet

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._between_requests = True
            self._start_timer(silent=True)  # a connection that never sends is closed at the deadline, no reply

        def data_received(self, data: bytes) -> None:
            # a request's first bytes start its headers' deadline (an idle keep-alive connection is uvicorn's
            # to close: a timer from the last response sent an unasked 408 when --request-timeout was short)
            if self._between_requests and (self._headers_timer is None or self._silent):
                self._start_timer(silent=False)
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers were read: the app's deadline takes over
                self._between_requests = False
                self._stop_timer()

        def on_response_complete(self) -> None:
            self._between_requests = True  # before: a pipelined request already read starts in super()'s call
            self._stop_timer()
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self._stop_timer()
            write_error_and_close(self.transport, bad_request(NOT_HTTP))

        def _start_timer(self, silent: bool) -> None:
            self._stop_timer()
            if not self.transport.is_closing():
                self._silent = silent
                self._headers_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _stop_timer(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_late(self) -> None:
            self._headers_timer = None
            if self.transport.is_closing():
                return
            if self._silent:  # nothing was ever sent: nobody to answer
                self.transport.close()
                return
            write_error_and_close(self.transport, APIError(
                408, f"the request's headers did not arrive within {header_timeout_s:g} s (--request-timeout)",
                code="timeout"))

    return DeadlineH11Protocol
