"""Responses in OpenAI's shapes, built from the scheduler's events (no HTTP here: `app.py` routes,
bounds and sends them).

One `ResponseBuilder` per request: for `stream=true` it turns each `Delta` into a server-sent-events
chunk (`text_completion` or `chat.completion.chunk`, the first chunk of a chat choice naming the
role), a `Done` into the usage chunk when `stream_options.include_usage` asked for it, and an error
into an error event; otherwise it collects the deltas and builds the whole `text_completion` or
`chat.completion` object. Either way the last event of a choice carries the response's `latentloop`
field: the architecture, the options resolved, the most rows decoded together with the request and
what the regime did for each choice (fbt's prefill passes, rgpt's mean exit depth).

Streamed, every chunk whose tokens the model reported on also carries `latentloop.tokens`: per
token, the piece of the chunk's text it gave and the numbers the model reported for it
(`scheduler.token_facts`: fbt's passes, rgpt's exit depth, mor's depth), which the chat page shades
its reply by. An extension field: OpenAI's clients ignore fields they do not know.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .protocol import CompletionRequest
from .scheduler import Delta, Done
from .text import TokenEntry

SSE_DONE = "data: [DONE]\n\n"  # the end of an event stream, as OpenAI ends it


def sse(payload: Any) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload)}\n\n"


class ResponseBuilder:
    """The payloads of one completions (`chat=False`) or chat-completions request."""

    def __init__(self, request: CompletionRequest, chat: bool, model_name: str, arch: str):
        self.request, self.chat, self.arch = request, chat, arch
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                     "model": model_name, "object": "chat.completion" if chat else "text_completion"}
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.choices = {i: {"text": "", "index": i, "logprobs": self.logprobs([]), "finish_reason": None}
                        for i in range(request.rows)}
        self.infos: dict[int, dict] = {}  # what the regime did, per finished choice
        self._started: set[int] = set()  # chat choices whose first chunk (with the role) went out

    # -- pieces -----------------------------------------------------------------------------------
    def logprobs(self, tokens: list[TokenEntry]) -> dict | None:
        """A choice's `logprobs` field for these tokens (None when the request did not ask)."""
        if self.request.logprobs is None:
            return None
        return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [t.top for t in tokens] if self.request.logprobs else None,
                "text_offset": [t.offset for t in tokens]}

    @staticmethod
    def usage(done: Done) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens}

    def extra(self, batch_rows: int, infos: dict[int, dict]) -> dict:
        """The response's `latentloop` field: what the regime did, per choice."""
        return {"arch": self.arch, "options": self.request.resolved, "batch_rows": batch_rows,
                "choices": [{"index": i, **info} for i, info in sorted(infos.items())]}

    # -- stream=true ------------------------------------------------------------------------------
    def chunk(self, event: Delta, batch_rows: int) -> str:
        """The event chunk of one delta; a choice's last one carries the `latentloop` field."""
        if self.chat:
            delta = {"content": event.text}
            if event.choice not in self._started:  # the first chunk of a choice names the role
                self._started.add(event.choice)
                delta = {"role": "assistant", **delta}
            choice = {"index": event.choice, "delta": delta, "finish_reason": event.finish_reason}
        else:
            choice = {"text": event.text, "index": event.choice, "logprobs": self.logprobs(event.tokens),
                      "finish_reason": event.finish_reason}
        chunk = {**self.head, "object": self.chunk_object, "choices": [choice]}
        tokens = [{"text": t.text, "info": t.info} for t in event.tokens if t.info]
        if tokens:  # what the model did for each token of this chunk (OpenAI's clients ignore the field)
            chunk["latentloop"] = {"choice": event.choice, "tokens": tokens}
        if event.finish_reason is not None:
            final = self.extra(batch_rows, {event.choice: event.info or {}})
            chunk["latentloop"] = {**chunk.get("latentloop", {}), **final}
        return sse(chunk)

    def usage_chunk(self, done: Done) -> str | None:
        """The usage chunk that ends a stream, when `stream_options.include_usage` asked for it."""
        if not self.request.include_usage:
            return None
        return sse({**self.head, "object": self.chunk_object, "choices": [], "usage": self.usage(done)})

    # -- stream=false -----------------------------------------------------------------------------
    def add(self, event: Delta) -> None:
        """Collect one delta into its choice."""
        choice = self.choices[event.choice]
        choice["text"] += event.text
        if choice["logprobs"] is not None:
            for key, values in self.logprobs(event.tokens).items():
                if values is not None:
                    choice["logprobs"][key].extend(values)
        if event.finish_reason is not None:
            choice["finish_reason"] = event.finish_reason
            self.infos[event.choice] = event.info or {}

    def completion(self, done: Done, batch_rows: int) -> dict:
        """The whole response, once every choice is done."""
        choices = self.choices
        if self.chat:
            choices = {i: {"index": i, "message": {"role": "assistant", "content": c["text"]},
                           "finish_reason": c["finish_reason"]} for i, c in choices.items()}
        return {**self.head, "choices": [choices[i] for i in range(self.request.rows)], "usage": self.usage(done),
                "latentloop": self.extra(batch_rows, self.infos)}
