"""The HTTP face of the server: thin FastAPI routes that parse a request and hand it to its serving
class (`serving.py`), the API key, error bodies and status codes, and a uvicorn runner whose shutdown
answers every request with 503 before it stops. What a response says is built in `responses.py`;
which rows decode together is the scheduler's; the bytes and events in between are `transport.py`'s.

Endpoints: GET / (the chat page: static/, no key needed; GET /page/config, its model's options),
GET /health (no key needed), GET /v1/models, POST /v1/completions, POST
/v1/chat/completions (models with a chat format: the conversation rendered as SFT trained it), GET
/v1/stats, and vLLM's tokenizer endpoints GET /tokenizer_info, POST /tokenize, POST /detokenize
(lm-eval's `local-completions` model uses them as its tokenizer with `tokenizer_backend=remote`).

A route's body is parsed by a dependency, not by FastAPI's own body reading: that reads any size of
body, on the event loop, with no deadline. `ServerState.parse` reads it within the endpoint's limit
(413, the rest drained: a client that sends its whole body before it reads would see a reset
connection instead) and --request-timeout (408), and decodes and validates it against its pydantic
model (`requests.py`) in a worker thread, so that one large body never holds up /health or the other
requests. A completions body larger than any prompt the context can hold is refused by its size.

SIGTERM: the requests running end with 503 at once (their handlers do not wait for the scheduler's
step to end), and requests that arrive while the server drains get 503 too, until none has been in
flight for `transport.SHUTDOWN_QUIET_S`; only then does the server close its socket.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import LatentloopError
from ..util import first_line
from .protocol import APIError
from .requests import DetokenizeBody, TokenizeBody, chat_body, completion_body
from .serving import ServerState, ServingChat, ServingCompletions, ServingModels, ServingPage, ServingTokenization
from .settings import ServeSettings, check_settings
from .transport import Traffic, TrafficGate, http_protocol

# What serve allows the chat template to render its probe conversation at start (a real template takes
# milliseconds): longer means it loops, and serve stops with one line instead of never listening. A
# backstop: latentloop.data.chat bounds each render itself (and the start of its renderer process, on a
# loaded machine) and says so more precisely; this must stay above the sum of those limits.
CHAT_PROBE_TIMEOUT_S = 120.0
SHUTDOWN_GRACE_S = 5.0  # after the drain, uvicorn waits this long for open connections, then cancels them
ENDPOINTS = ("GET / (the chat page), GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /v1/stats, "
             "GET /health, GET /tokenizer_info, POST /tokenize, POST /detokenize, GET /page/config")
SHOWN_PATH_CHARS = 200  # of a path that is no endpoint, in its error (a 100 KB path came back whole)


# --------------------------------------------------------------------------------------------
# Routes: parse, then delegate to the app's serving classes
# --------------------------------------------------------------------------------------------


def _state(request: Request) -> ServerState:
    return request.app.state.serving


def _authorized(request: Request) -> None:
    api_key = _state(request).settings.api_key
    if not api_key:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                       type="authentication_error", code="invalid_api_key")


async def _completion_body(request: Request) -> Any:
    limits = _state(request).limits
    return await _state(request).parse(request, completion_body(), limits.completion_body_bytes,
                                       limits.completion_body_why())


async def _chat_body(request: Request) -> Any:
    return await _state(request).parse(request, chat_body())


async def _tokenize_body(request: Request) -> TokenizeBody:
    return await _state(request).parse(request, TokenizeBody)


async def _detokenize_body(request: Request) -> DetokenizeBody:
    return await _state(request).parse(request, DetokenizeBody)


open_routes = APIRouter()  # for probes: no key
routes = APIRouter(dependencies=[Depends(_authorized)])


@open_routes.get("/health")
async def health(request: Request) -> dict:
    return request.app.state.models.health()


@open_routes.get("/")
async def chat_page(request: Request) -> Response:
    return request.app.state.page.file("index.html")


@open_routes.get("/page/chat.js")
async def chat_page_script(request: Request) -> Response:
    return request.app.state.page.file("chat.js")


@open_routes.get("/page/chat.css")
async def chat_page_style(request: Request) -> Response:
    return request.app.state.page.file("chat.css")


@routes.get("/page/config")
async def chat_page_config(request: Request) -> dict:
    return request.app.state.page.config()


@routes.get("/v1/models")
async def list_models(request: Request) -> dict:
    return request.app.state.models.models()


@routes.get("/v1/stats")
async def stats(request: Request) -> dict:
    return request.app.state.models.stats()


@routes.post("/v1/completions")
async def create_completion(request: Request, body: Annotated[Any, Depends(_completion_body)]) -> Response:
    return await request.app.state.completions.create(body, request)


@routes.post("/v1/chat/completions")
async def create_chat_completion(request: Request, body: Annotated[Any, Depends(_chat_body)]) -> Response:
    return await request.app.state.chat.create(body, request)


@routes.get("/tokenizer_info")
async def get_tokenizer_info(request: Request) -> dict:
    return request.app.state.tokenization.info()


@routes.post("/tokenize")
async def tokenize(request: Request, body: Annotated[TokenizeBody, Depends(_tokenize_body)]) -> Response:
    return await request.app.state.tokenization.tokenize(body, request)


@routes.post("/detokenize")
async def detokenize(request: Request, body: Annotated[DetokenizeBody, Depends(_detokenize_body)]) -> dict:
    return await request.app.state.tokenization.detokenize(body, request)


# --------------------------------------------------------------------------------------------
# The application
# --------------------------------------------------------------------------------------------


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    # a body refused before its end (413 once its bounded drain ends, 408) may still be arriving:
    # the connection closes rather than reading on for a next request
    headers = {"Connection": "close"} if exc.status in (408, 413) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = str(exc.detail)
    if exc.status_code in (404, 405):
        path = request.url.path
        shown = path if len(path) <= SHOWN_PATH_CHARS else f"{path[:SHOWN_PATH_CHARS]}... ({len(path):,} characters)"
        message = f"{request.method} {shown} is not an endpoint of this server (it offers {ENDPOINTS})"
    return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    error = APIError(500, f"internal error: {type(exc).__name__}: {first_line(exc)}", type="server_error")
    return JSONResponse(error.body(), status_code=500)


def create_app(model, tokenizer, name: str, settings: ServeSettings) -> FastAPI:
    """The FastAPI app over a loaded model: its state and serving classes on `app.state`, the
    routes, and a lifespan that starts and stops the scheduler thread."""
    state = ServerState.build(model, tokenizer, name, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        yield
        state.scheduler.join(SHUTDOWN_GRACE_S)

    # redirect_slashes off: `/v1/completions/` got a 307 with an empty body, which clients do not follow with the body
    app = FastAPI(title="latentloop", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.serving, app.state.scheduler = state, state.scheduler
    app.state.completions, app.state.chat = ServingCompletions(state), ServingChat(state)
    app.state.tokenization, app.state.models = ServingTokenization(state), ServingModels(state)
    app.state.page = ServingPage(state)
    app.state.traffic = Traffic()
    app.add_middleware(TrafficGate, traffic=app.state.traffic, scheduler=state.scheduler)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(open_routes)
    app.include_router(routes)
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


def server_config(app: FastAPI, settings: ServeSettings):
    """uvicorn's configuration for `app`: the host and port of `settings`, its h11 protocol with the
    headers bounded by --request-timeout (`transport.http_protocol`)."""
    import uvicorn

    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                          access_log=settings.access_log, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                          http=http_protocol(settings.request_timeout))


def serve(settings: ServeSettings) -> None:
    """Load the run and serve it until SIGINT / SIGTERM."""
    import uvicorn

    from ..runs import load_run
    from ..runtime import resolve_device

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

        config = server_config(app, settings)
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        port = sock.getsockname()[1]
        import torch

        where = f"cpu, {torch.get_num_threads()} threads" if device.type == "cpu" else str(device)
        print(f"latentloop: serving {name!r} ({model.config.arch}, {checkpoint}) at http://{host}:{port}/v1 "
              f"on {where}; Ctrl+C stops", file=sys.stderr, flush=True)
        Server(config).run(sockets=[sock])
    finally:
        sock.close()
