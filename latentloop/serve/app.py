"""The HTTP face of the server: FastAPI routes in OpenAI's shapes, server-sent events, the API
key, and a uvicorn runner whose shutdown first ends the running requests with an error.

Endpoints: GET /health (no key needed), GET /v1/models, POST /v1/completions, POST
/v1/chat/completions (models with a chat format: the conversation rendered as SFT trained it), GET
/v1/stats, and
vLLM's tokenizer endpoints GET /tokenizer_info, POST /tokenize, POST /detokenize (lm-eval's
`local-completions` model uses them as its tokenizer with `tokenizer_backend=remote`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import LatentloopError
from .protocol import (
    APIError,
    Limits,
    bad_request,
    parse_completion,
    tokenize_text,
    tokenizer_info,
)
from .scheduler import Done, Failed, Job, Scheduler
from .settings import ServeSettings, check_settings

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client went away
MAX_BODY_BYTES = 16 * 2**20  # larger request bodies are refused (413) before they are read
SHUTDOWN_GRACE_S = 5.0  # after a signal, uvicorn waits this long for open connections, then cancels them
# --------------------------------------------------------------------------------------------
# The application
# --------------------------------------------------------------------------------------------


def _declared(option) -> dict:
    return {"name": option.name, "type": option.kind.__name__, "default": option.default, "help": option.help,
            "choices": list(option.choices) or None, "minimum": option.minimum, "maximum": option.maximum,
            "keywords": list(option.keywords) or None}


async def _json_body(request: Request) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def create_app(model, tokenizer, name: str, settings: ServeSettings) -> FastAPI:
    """The FastAPI app over a loaded model; its lifespan starts and stops the scheduler thread."""
    scheduler = Scheduler(model, tokenizer, settings.max_batch_size, settings.max_queue,
                          settings.batch_window_ms / 1000)
    context = int(model.config.sequence_len)
    limits = Limits(context, settings.max_tokens_cap, settings.max_batch_size)
    arch = model.config.arch
    created = int(time.time())
    counters = {"timeouts": 0, "disconnects": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.join(SHUTDOWN_GRACE_S)

    app = FastAPI(title="latentloop", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

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
        return {**scheduler.snapshot(), **counters}

    @router.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict:
        return tokenizer_info(tokenizer, context)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await _json_body(request)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise bad_request("tokenize takes {\"prompt\": TEXT, \"add_special_tokens\": true|false}", "prompt")
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise bad_request(f"add_special_tokens must be true or false, got {add!r}", "add_special_tokens")
        try:
            ids = tokenize_text(tokenizer, text, add)
        except UnicodeEncodeError:
            raise bad_request("prompt is not valid UTF-8 text", "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": context}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await _json_body(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < tokenizer.vocab_size for t in ids):
            raise bad_request(f"detokenize takes {{\"tokens\": [ids in [0, {tokenizer.vocab_size})]}}", "tokens")
        return {"prompt": tokenizer.decode(ids)}

    async def next_event(queue: asyncio.Queue, job: Job, request: Request, deadline: float):
        """The job's next event; None when the client went away; APIError 504 past the deadline.
        Either way the job is cancelled, so the scheduler drops its rows at the next step."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                job.cancel()
                counters["timeouts"] += 1
                raise APIError(504, f"the request took longer than {settings.request_timeout:g} s "
                                    f"(--request-timeout)", type="server_error", code="timeout")
            try:
                return await asyncio.wait_for(queue.get(), min(left, DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    counters["disconnects"] += 1
                    return None

    def extra(request_options: dict, job: Job, infos: dict[int, dict]) -> dict:
        """The response's `latentloop` field: what the regime did, per choice."""
        return {"arch": arch, "options": request_options, "batch_rows": job.batch_rows,
                "choices": [{"index": i, **info} for i, info in sorted(infos.items())]}

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    async def respond(request: Request, chat: bool):
        """One completions or chat-completions request, plain or streamed: the same parsing,
        scheduling and events; only the shape of a choice differs (`text` vs `message` / `delta`)."""
        body = await _json_body(request)
        parsed = parse_completion(body, model, tokenizer, limits, name, chat=chat)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def post(event) -> None:  # called from the scheduler thread
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(queue.put_nowait, event)

        job = Job(parsed, post, tokenizer)
        scheduler.submit(job)
        deadline = time.monotonic() + settings.request_timeout
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": name, "object": "chat.completion" if chat else "text_completion"}
        chunk_object = "chat.completion.chunk" if chat else "text_completion"

        def logprobs_of(tokens) -> dict | None:
            if parsed.logprobs is None:
                return None
            return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                    "top_logprobs": [t.top for t in tokens] if parsed.logprobs else None,
                    "text_offset": [t.offset for t in tokens]}

        def usage(done: Done) -> dict:
            return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                    "total_tokens": done.prompt_tokens + done.completion_tokens}

        if parsed.stream:
            async def events():
                infos: dict[int, dict] = {}
                started: set[int] = set()
                try:
                    while True:
                        try:
                            event = await next_event(queue, job, request, deadline)
                        except APIError as error:
                            event = Failed(error)
                        if event is None:
                            return
                        if isinstance(event, Failed):
                            yield _sse(event.error.body())
                            yield "data: [DONE]\n\n"
                            return
                        if isinstance(event, Done):
                            if parsed.include_usage:
                                yield _sse({**head, "object": chunk_object, "choices": [], "usage": usage(event)})
                            yield "data: [DONE]\n\n"
                            return
                        if chat:
                            delta = {"content": event.text}
                            if event.choice not in started:  # the first chunk of a choice names the role
                                started.add(event.choice)
                                delta = {"role": "assistant", **delta}
                            choice = {"index": event.choice, "delta": delta, "finish_reason": event.finish_reason}
                        else:
                            choice = {"text": event.text, "index": event.choice, "logprobs": logprobs_of(event.tokens),
                                      "finish_reason": event.finish_reason}
                        chunk = {**head, "object": chunk_object, "choices": [choice]}
                        if event.finish_reason is not None:
                            infos = {event.choice: event.info or {}}
                            chunk["latentloop"] = extra(parsed.resolved, job, infos)
                        yield _sse(chunk)
                finally:
                    job.cancel()  # a no-op once the job is done; frees the rows of a client that left

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        choices = {i: {"text": "", "index": i, "logprobs": logprobs_of([]), "finish_reason": None}
                   for i in range(parsed.rows)}
        infos: dict[int, dict] = {}
        try:
            while True:
                event = await next_event(queue, job, request, deadline)
                if event is None:
                    return Response(status_code=499)  # nginx's "client closed request": nobody reads it
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Done):
                    break
                choice = choices[event.choice]
                choice["text"] += event.text
                if choice["logprobs"] is not None:
                    for key, values in logprobs_of(event.tokens).items():
                        if values is not None:
                            choice["logprobs"][key].extend(values)
                if event.finish_reason is not None:
                    choice["finish_reason"] = event.finish_reason
                    infos[event.choice] = event.info or {}
        finally:
            job.cancel()
        if chat:
            choices = {i: {"index": i, "message": {"role": "assistant", "content": c["text"]},
                           "finish_reason": c["finish_reason"]} for i, c in choices.items()}
        return {**head, "choices": [choices[i] for i in range(parsed.rows)], "usage": usage(event),
                "latentloop": extra(parsed.resolved, job, infos)}

    app.include_router(router)
    return app


# --------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------


def _check_port(host: str, port: int) -> None:
    """A one-line error now rather than uvicorn's log line and exit 1 after the model is loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise LatentloopError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve(settings: ServeSettings) -> None:
    """Load the run and serve it until SIGINT / SIGTERM."""
    import uvicorn

    from ..runtime import load_run, resolve_device

    check_settings(settings)
    _check_port(settings.host, settings.port)
    device = resolve_device(settings.device)
    model, tokenizer, _, checkpoint = load_run(settings.run, device)
    run_dir = checkpoint.parent.parent if Path(settings.run).resolve() == checkpoint.resolve() else Path(settings.run)
    name = settings.model_name or run_dir.resolve().name  # the run's name, also when given a checkpoint folder
    app = create_app(model, tokenizer, name, settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.scheduler.stop()  # running requests end with an error now, so their connections close
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            access_log=settings.access_log, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    print(f"latentloop: serving {name!r} ({model.config.arch}, {checkpoint}) at http://{host}:{settings.port}/v1 "
          f"on {device}; Ctrl+C stops", file=sys.stderr, flush=True)
    Server(config).run()
