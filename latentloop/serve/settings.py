"""What `latentloop serve` is told: the settings, their defaults and their checks (no FastAPI needed)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ..errors import LatentloopError

DEFAULT_MAX_TOKENS_CAP = 1024  # bounds one request's decode steps, and so how long it holds a batch
DEFAULT_MAX_BATCH_SIZE = 32  # rows decoded together (1: no batching)
DEFAULT_MAX_QUEUE = 256  # requests waiting for a round before 429
DEFAULT_BATCH_WINDOW_MS = 5.0  # how long an idle server waits for more requests before a round
DEFAULT_REQUEST_TIMEOUT_S = 300.0  # a request (queue wait included) running longer ends with 504
BATCHING = ("continuous", "rounds")  # --batching: the schedulers of serve/scheduler.py, the default first
# --decode: continuous batching's steps on the compiled path (`serve.batch.SlotBatch`; every batch
# size compiled, or loaded from the on-disk cache, before the server starts listening) or each step
# eagerly; "auto" (the default) takes the compiled path when the on-disk cache holds every size's
# step (`serve.batch.cached_start_seconds`), so a start costs seconds, not the minutes of a compile
SERVE_DECODE = ("auto", "eager", "compiled")
API_KEY_ENV = "LATENTLOOP_API_KEY"
MAX_PORT = 2**16 - 1  # TCP ports are 16 bits (0: any free port)
MAX_BATCH_WINDOW_MS = 60_000.0  # a window longer than a minute only delays every request
MAX_REQUEST_TIMEOUT_S = 7 * 24 * 3600.0  # a week: as good as none, and within the clock's range


@dataclass
class ServeSettings:
    run: str
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    api_key: str | None = None
    model_name: str | None = None
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_queue: int = DEFAULT_MAX_QUEUE
    batch_window_ms: float = DEFAULT_BATCH_WINDOW_MS
    batching: str = BATCHING[0]
    decode: str = SERVE_DECODE[0]
    kv_dtype: str | None = None  # --kv-dtype: the compiled path's cache (`engine.KV_DTYPES`; None: the model's)
    # --warm-options: JSON objects of the architecture's options (a request's fields) whose compiled steps
    # are compiled at start beside the default options' (`ContinuousScheduler`: requests never compile)
    warm_options: tuple[str, ...] = ()
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    access_log: bool = False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


PRINTABLE_ASCII = (" ", "~")  # the characters of a header value every client sends as they are


def check_api_key(api_key: str | None) -> None:
    """A key a client can send: not blank (" " started a server that asked for a key nobody could
    give), and without surrounding whitespace, which HTTP drops from a header's value and the server
    strips from the key it is sent: a configured " abc" refused every request, `Bearer abc` included."""
    if not api_key:  # none given (an empty $LATENTLOOP_API_KEY included): serve without a key, as before
        return
    where = f"--api-key (or ${API_KEY_ENV})"
    if not api_key.strip():
        raise LatentloopError(f"{where} is blank: give a key clients can send ('Authorization: Bearer KEY'), "
                              "or none to serve without one")
    if api_key != api_key.strip():
        # the key itself is not echoed: it is a secret, and error output ends up in logs
        raise LatentloopError(f"{where} begins or ends with whitespace, which no client can send in "
                              "'Authorization: Bearer KEY': give the key without it")
    if not all(PRINTABLE_ASCII[0] <= char <= PRINTABLE_ASCII[1] for char in api_key):
        # browsers and http.client refuse to send such a header; curl sends UTF-8, which the server
        # reads as Latin-1: 'ключ' started a server that refused every request
        raise LatentloopError(f"{where} holds a character outside printable ASCII, which clients cannot send "
                              "in 'Authorization: Bearer KEY' alike: give a key of printable ASCII")


def check_settings(settings: ServeSettings) -> None:
    """One-line errors for settings that cannot work, before anything is loaded."""
    check_api_key(settings.api_key)
    if not is_loopback(settings.host) and not settings.api_key:
        raise LatentloopError(f"--host {settings.host} makes the server reachable from other machines: give an API "
                              f"key with --api-key or ${API_KEY_ENV} (clients send 'Authorization: Bearer KEY')")
    for name, value, minimum in (("--max-tokens-cap", settings.max_tokens_cap, 1),
                                 ("--max-batch-size", settings.max_batch_size, 1),
                                 ("--max-queue", settings.max_queue, 1)):
        if value < minimum:
            raise LatentloopError(f"{name} must be >= {minimum}, got {value}")
    if not 0 <= settings.port <= MAX_PORT:
        raise LatentloopError(f"--port must be in [0, {MAX_PORT}] (0: any free port), got {settings.port}")
    if settings.batching not in BATCHING:
        raise LatentloopError(f"--batching must be one of {', '.join(BATCHING)}, got {settings.batching!r}")
    if settings.decode not in SERVE_DECODE:
        raise LatentloopError(f"--decode must be one of {', '.join(SERVE_DECODE)}, got {settings.decode!r}")
    if settings.decode == "compiled" and settings.batching != "continuous":
        raise LatentloopError("--decode compiled runs continuous batching's steps: use it with --batching continuous")
    if settings.kv_dtype is not None:
        from ..engine import KV_DTYPES

        if settings.kv_dtype not in KV_DTYPES:
            raise LatentloopError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {settings.kv_dtype!r}")
        if settings.decode == "eager" or settings.batching != "continuous":
            raise LatentloopError("--kv-dtype is the compiled path's cache: use it with --decode compiled or auto "
                                  "and --batching continuous")
    if settings.warm_options and (settings.decode == "eager" or settings.batching != "continuous"):
        raise LatentloopError("--warm-options names compiled steps to load or compile at start: use it with "
                              "--decode compiled or auto and --batching continuous")
    warm_options_dicts(settings)  # each one a JSON object, named where it is not
    # finite and bounded: inf or 1e300 overflowed the scheduler's timed wait at the first request
    # (its thread died and every request got 503); nan passed every comparison and turned them off
    if not 0 <= settings.batch_window_ms <= MAX_BATCH_WINDOW_MS:
        raise LatentloopError(f"--batch-window-ms must be in [0, {MAX_BATCH_WINDOW_MS:g}], got "
                              f"{settings.batch_window_ms:g}")
    if not 0 < settings.request_timeout <= MAX_REQUEST_TIMEOUT_S:
        raise LatentloopError(f"--request-timeout must be in (0, {MAX_REQUEST_TIMEOUT_S:g}] seconds, got "
                              f"{settings.request_timeout:g}")


def warm_options_dicts(settings: ServeSettings) -> list[dict]:
    """--warm-options as dicts: each value a JSON object of option names (checked against the model
    where the scheduler resolves them)."""
    import json

    parsed = []
    for text in settings.warm_options:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise LatentloopError(f"--warm-options takes a JSON object of the architecture's options, as a request "
                                  f"gives them (e.g. '{{\"steps\": 4}}'), got {text!r}")
        parsed.append(value)
    return parsed
