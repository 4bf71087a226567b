"""The process that renders chat templates (see "Chat templates" in `latentloop.data.chat`).

A chat template is a program that comes with a model: it can loop for hours or build a string of
gigabytes, and a thread running it cannot be stopped. So templates run here, in a child process
the caller can kill when its time is up, under an address-space limit (a template that allocates
too much gets a MemoryError here, not the caller), and with a CPU-time limit per request as a
last stop should the caller be gone. The cheap checks below (`*`, `**`, `str.format` widths,
`lipsum`, `tojson`'s indent) only give clearer messages earlier; the hard limits do not depend on
them.

This file runs as a script, by path, with only the standard library and jinja2: importing the
`latentloop` package would load torch into every worker.

Protocol, over stdin (requests) and stdout (replies): frames of a 4-byte big-endian length and
that many bytes of JSON, ASCII-escaped (so that any Python string travels, lone surrogates too).
    started:  {"ready": true} | {"error": "import", "message": str}
    request:  {"source": str, "context": {...}, "max_output": int, "time_limit": float, "spans": bool}
    reply:    {"text": str[, "cuts": [int, ...]]} | {"error": KIND, "message": str[, "index": int]}
A request renders `context` once; with "spans" (training) it renders the whole conversation and,
for every assistant message, the prompt before it and the conversation through it, and replies
with the whole text and the offsets where its trained spans start and end (see `_spans`).
KIND is "compile" (the template does not compile), "refused" (it called raise_exception),
"failed" (any other error of the template), "output" (a text passed max_output characters; the
message says where the worker stopped it, or which check found it before it was built), "memory"
(it ran out of the address space) or
"prefix" (the conversation does not render as a growing prefix at message "index").
"""

import json
import os
import struct
import sys

# Run by path, Python puts this folder first on sys.path, where latentloop's own modules (such as
# tokenizers.py) would shadow the libraries of those names.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

FRAME_HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 1 << 30  # a request holds a conversation the caller already capped: far less
MAX_MESSAGE_CHARS = 300  # an error's message is one line of this many characters at most
MAX_TEMPLATES = 8  # compiled templates kept (a process renders one model's template, rarely more)
MAX_POWER_BITS = 1 << 20  # `a ** b` of integers: a result of a million bits is already absurd for a template
MAX_TOJSON_INDENT = 64  # `tojson(indent=...)`: wider is no format a model was trained on
# '%' formatting: the width and precision of a conversion ('%99999999d', '%.99999999f')
PERCENT_WIDTHS_PATTERN = r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?"
LIPSUM_CHARS_PER_WORD = 16  # an upper bound on lipsum's words, spaces and punctuation, to size its text


class LimitBroken(Exception):
    """The template's text would pass the output limit (found before it is built)."""


class TemplateRefused(Exception):
    """The template called raise_exception (it refuses the conversation)."""


def _one_line(text) -> str:
    lines = str(text).strip().splitlines() or [""]
    line = lines[0]
    return line if len(line) <= MAX_MESSAGE_CHARS else line[:MAX_MESSAGE_CHARS] + "..."


def _flat(groups):
    return [number for group in groups for number in group if number]


def _raise_exception(message):
    raise TemplateRefused(_one_line(message))


class _Limits:
    max_output = 0  # set for each request


def _environment():
    """A sandboxed environment as `transformers` sets one up for chat templates, with size checks."""
    import re
    import string
    from datetime import datetime

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import generate_lorem_ipsum

    percent_widths = re.compile(PERCENT_WIDTHS_PATTERN)

    def check_size(size, what):
        if size > _Limits.max_output:
            raise LimitBroken(f"{what} would make {size:,} characters")

    def check_widths(numbers, what):
        for number in numbers:
            check_size(int(number), what)

    def check_format(text):
        # a width or precision in a field's spec is a length of its text ('{:>99999999}', '{:.99999999f}')
        for _, _, spec, _ in string.Formatter().parse(text):
            check_widths(re.findall(r"\d+", spec or ""), "a format width")

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                        check_size(len(seq) * times, "'*'")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise LimitBroken(f"'**' would make an integer of over {MAX_POWER_BITS:,} bits")
            elif operator == "%" and isinstance(left, str):
                check_widths(_flat(percent_widths.findall(left)), "a format width")
            return super().call_binop(context, operator, left, right)

        # `str.format` in a template goes through one of these (jinja2 >= 3.1.5, before it)
        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            text = value.__self__

            def checked(*args, **kwargs):
                check_format(text)
                return wrapped(*args, **kwargs)

            return checked

        def format_string(self, s, *args, **kwargs):
            check_format(s)
            return super().format_string(s, *args, **kwargs)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        width = len(indent) if isinstance(indent, str) else indent
        if isinstance(width, int) and width > MAX_TOJSON_INDENT:
            raise LimitBroken(f"tojson indent {width:,} is over {MAX_TOJSON_INDENT}")
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def lipsum(n=5, html=True, min=20, max=100):
        if isinstance(n, int) and isinstance(max, int):
            check_size(n * max * LIPSUM_CHARS_PER_WORD, "lipsum")
        return generate_lorem_ipsum(n, html, min, max)

    class GenerationTag(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (its AssistantTracker marks the
        assistant's tokens with it for `return_assistant_tokens_mask`): accepted and rendered as its
        body alone. The trained spans come from rendering prefixes (`_spans`), not from this tag; its
        body keeps a scope of its own, as transformers' call block gives it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTag],
                      undefined=jinja2.Undefined)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["lipsum"] = lipsum
    return env


def _text(template, context: dict) -> str:
    """The template's text, stopped as soon as it passes the output limit: counted in characters,
    as written (a template's pieces can be of any length)."""
    pieces, size = [], 0
    for piece in template.generate(**context):
        size += len(piece)
        if size > _Limits.max_output:  # stop here: what it would write next is not needed
            raise LimitBroken(f"the renderer stopped it at {size:,} characters")
        pieces.append(piece)
    return "".join(pieces)


def _spans(template, context: dict) -> dict:
    """The conversation's text and its cuts [0, prompt_1, through_1, ..., len(text)]: the text
    between prompt_i (what the template writes for `messages[:i]` with add_generation_prompt) and
    through_i (`messages[:i + 1]`) is the i-th assistant turn's reply and whatever closes it."""
    messages = context["messages"]
    full = _text(template, dict(context, add_generation_prompt=False))
    cuts = [0]
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _text(template, dict(context, messages=messages[:index], add_generation_prompt=True))
        through = _text(template, dict(context, messages=messages[:index + 1], add_generation_prompt=False))
        if not (through.startswith(prompt) and full.startswith(through) and len(prompt) >= cuts[-1]):
            return {"error": "prefix", "message": "", "index": index}
        cuts += [len(prompt), len(through)]
    return {"text": full, "cuts": cuts + [len(full)]}


def _handle(env, templates: dict, request: dict) -> dict:
    import jinja2

    source = request["source"]
    template = templates.get(source)
    if template is None:
        try:
            template = env.from_string(source)
        except (jinja2.TemplateError, RecursionError, MemoryError) as exc:
            return {"error": "compile", "message": _one_line(exc)}
        if len(templates) >= MAX_TEMPLATES:
            templates.pop(next(iter(templates)))
        templates[source] = template
    _Limits.max_output = request["max_output"]
    try:
        if request.get("spans"):
            return _spans(template, request["context"])
        return {"text": _text(template, request["context"])}
    except LimitBroken as exc:
        return {"error": "output", "message": str(exc)}
    except TemplateRefused as exc:
        return {"error": "refused", "message": str(exc)}
    except MemoryError:
        return {"error": "memory", "message": "out of memory"}
    except RecursionError:
        return {"error": "failed", "message": "recursion too deep"}
    except jinja2.TemplateError as exc:
        return {"error": "failed", "message": _one_line(exc)}
    except Exception as exc:  # noqa: BLE001 (any error of the template's own code: 1/0, 'a' + 1, ...)
        return {"error": "failed", "message": _one_line(f"{type(exc).__name__}: {exc}")}


def _read_exact(stream, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _send(stream, reply: dict) -> None:
    data = json.dumps(reply).encode("ascii")  # escaped: a lone surrogate in the text travels too
    stream.write(FRAME_HEADER.pack(len(data)) + data)
    stream.flush()


def _limit_cpu(seconds: float) -> None:
    """Stop this process (SIGXCPU) once it spends `seconds` more of CPU time: what ends a template
    still looping after its caller is gone (the caller kills it long before otherwise)."""
    import math
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard == resource.RLIM_INFINITY or soft <= hard:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _limit_memory(extra_bytes: int) -> None:
    """Cap the address space at what the process holds now plus `extra_bytes`."""
    import resource

    try:
        with open("/proc/self/statm") as statm:
            held = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return  # not Linux: the caller's time and output limits still hold
    limit = held + extra_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or limit <= hard:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main() -> int:
    import signal

    # Ctrl-C in a terminal reaches the whole process group: the caller handles it and stops this
    # worker itself (a worker killed mid-request is replaced).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the replies
    try:
        env = _environment()
    except ImportError:
        _send(replies, {"error": "import", "message": "jinja2 is not installed"})
        return 1
    _limit_memory(int(sys.argv[1]))
    _send(replies, {"ready": True})
    templates: dict = {}
    while True:
        header = _read_exact(requests, FRAME_HEADER.size)
        if header is None:
            return 0  # the caller closed the pipe (or exited)
        (size,) = FRAME_HEADER.unpack(header)
        if size > MAX_REQUEST_BYTES:
            return 1
        body = _read_exact(requests, size)
        if body is None:
            return 0
        request = json.loads(body)
        _limit_cpu(request["time_limit"])
        try:
            reply = _handle(env, templates, request)
        except MemoryError:
            reply = {"error": "memory", "message": "out of memory"}
        _send(replies, reply)


if __name__ == "__main__":
    sys.exit(main())
