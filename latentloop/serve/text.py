"""One choice's text as it is generated: token ids in, text and logprob entries out, released
only when final.

The text is decoded incrementally (whole UTF-8 characters only), and nothing that could be the
beginning of a stop string is released until the next tokens decide it; at the first stop string
the text is cut before it and the row is done. The tokens reported with the text are the fewest
whose text covers it (as the evaluation code cuts generations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..util import TokenText
from .protocol import token_string


@dataclass
class TokenEntry:
    """One token of a choice, as logprobs report it."""

    token: str
    logprob: float | None
    top: dict[str, float] | None  # the k most likely tokens of that position, by their strings
    offset: int  # character offset into the choice's text (echoed prompt included)
    # the stream's extension (responses.py): the piece of the released text this token gave (the
    # pieces of one release join to its text) and what the model reported for it (DecodeStep.info)
    text: str = ""
    info: dict | None = None


def top_dict(tokenizer, specials: dict[int, str], pairs: Sequence[tuple[int, float]] | None) -> dict[str, float] | None:
    """{token string: logprob} from (id, logprob) pairs, most likely first; of two ids with the same
    string (rare: invalid bytes), the more likely one is kept."""
    if pairs is None:
        return None
    top: dict[str, float] = {}
    for token_id, logprob in pairs:
        top.setdefault(token_string(tokenizer, token_id, specials), logprob)
    return top


class RowText:
    def __init__(self, tokenizer, specials: dict[int, str], stops: Sequence[str] = (), base_offset: int = 0,
                 message_start: bool = False):
        self.tokenizer, self.specials, self.stops = tokenizer, specials, tuple(stops)
        self.base_offset = base_offset  # characters before the generated text (the echoed prompt)
        self._decoder = TokenText(tokenizer, message_start)  # a chat reply: its text as `decode` gives it
        self.text = ""  # generated so far; cut before the stop string once one appeared
        self.stopped = False  # a stop string appeared
        self._released = 0  # characters of `text` already handed out
        # (start, id, logprob, top, info) of the tokens not yet out
        self._pending: list[tuple[int, int, float | None, list | None, dict | None]] = []
        # a stop string can begin this many characters before the newest text
        self._reach = max((len(s) for s in self.stops), default=1) - 1

    def add(self, token_id: int, logprob: float | None = None, top: list | None = None,
            info: dict | None = None) -> bool:
        """One generated token (`info`: what the model reported for it); True once the text holds a
        stop string (the row is done)."""
        if self.stopped:
            return True
        new_from = len(self.text)
        earlier, own = self._decoder.add_split(token_id)
        self.text += earlier  # an earlier token's open character, replaced: its place comes first
        start = len(self.text)
        self.text += own
        self._pending.append((start, token_id, logprob, top, info))
        if self.stops:
            search_from = max(self._released, new_from - self._reach)
            found = [p for p in (self.text.find(stop, search_from) for stop in self.stops) if p >= 0]
            if found:
                self.text = self.text[:min(found)]
                self.stopped = True
        return self.stopped

    def _held(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        tail = self.text[self._released:]
        return max((k for stop in self.stops for k in range(1, min(len(stop), len(tail) + 1))
                    if tail.endswith(stop[:k]) and k < len(stop)), default=0)

    def release(self, final: bool = False) -> tuple[str, list[TokenEntry]]:
        """The text and tokens that are final now; `final`: the row ended, everything left."""
        if final and not self.stopped:
            self.text += self._decoder.finish()
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        begin = self._released
        text = self.text[begin:end]
        self._released = max(self._released, end)
        if final and not self.stopped:
            out, self._pending = self._pending, []
        else:
            cut = next((i for i, (start, *_) in enumerate(self._pending) if start >= end), len(self._pending))
            out, self._pending = self._pending[:cut], ([] if self.stopped else self._pending[cut:])
        # each token's piece of `text`: from its start (the first from the release's start) to the next's
        bounds = [begin] + [min(max(start, begin), end) for start, *_ in out[1:]] + [max(end, begin)]
        return text, [TokenEntry(token_string(self.tokenizer, token_id, self.specials), logprob,
                                 top_dict(self.tokenizer, self.specials, top), self.base_offset + start,
                                 self.text[bounds[k]:bounds[k + 1]], info)
                      for k, (start, token_id, logprob, top, info) in enumerate(out)]
