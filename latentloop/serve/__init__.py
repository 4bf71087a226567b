"""`latentloop serve`: an OpenAI-compatible completions server with batching, streaming and
per-request decoding regimes (`pip install 'latentloop[serve]'` for FastAPI and uvicorn).

    from latentloop.serve import ServeSettings, serve
    serve(ServeSettings("runs/fbt", port=8000))

Layers, HTTP-free first: `limits` (what a request may ask, and how much text a context can hold),
`protocol` (errors, the `CompletionRequest` the scheduler decodes, prompts as token ids, token
strings), `requests` (the request bodies as pydantic models and their one-line refusals), `text`
(incremental text and stop strings), `batch` (continuous batching: rows join and leave a running
batch over the model's cache), `scheduler` (the batching thread: continuous over `batch`, or rounds
over `engine.stream`), `responses` (OpenAI's response and streaming-chunk shapes, built from the
scheduler's events); then `transport` (bodies read within limits, worker threads, the scheduler's
events to the event loop, the shutdown's drain), `serving` (one class per endpoint family) and `app`
(thin FastAPI routes, error bodies, and the uvicorn runner). This package imports engine, models,
archs, data and runtime, never train or the CLI.
"""

from __future__ import annotations

from ..errors import LatentloopError
from .settings import API_KEY_ENV, ServeSettings, check_settings


def require_extra() -> None:
    """A one-line error when FastAPI or uvicorn is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise LatentloopError(f"serve needs the serve extra ({exc.name} is missing): "
                              f"pip install 'latentloop[serve]'") from None


def serve(settings: ServeSettings) -> None:
    """Load the run and serve it until SIGINT / SIGTERM."""
    check_settings(settings)
    require_extra()
    from .app import serve as run

    run(settings)


__all__ = ["API_KEY_ENV", "ServeSettings", "check_settings", "require_extra", "serve"]
