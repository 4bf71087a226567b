"""Continuous batching: one running batch whose rows join at the next decode step and leave when done
(iteration-level scheduling, as vLLM and TGI do), each row decoding exactly as it would alone.

    batch = DecodeBatch(model, options, stop_tokens, pad_id)
    batch.add([Member(prompt, max_new_tokens, sampling)])      # prefilled at the next step
    for step in batch.step():                                  # one token per member (None: stopped)
        ...
    batch.drop(member)                                          # left at the next step

How rows at different positions share one step: every row's positions and masks come from the cache's
per-row `key_pos` / `next_pos` (as in a left-padded batch), so rows need not be aligned. Joining rows
are prefilled together in a cache of their own (left-padded, as `engine.stream` prefills a batch),
then `models.cache.regroup` copies the running rows and the new ones into one cache, each row's
tokens right-aligned at the batch's length; rows that left are not copied. The copy happens only
when rows join, or when half the rows have left (until then they decode on, unseen), and the cache
holds no more than the longest row's span plus the decode steps still owed, so a batch that runs
for ever never grows past the context.

Sampling is per request (`Sampling`: its settings and its own `torch.Generator`), so requests with
different temperatures, top_k, top_p and seeds share a batch: a request's rows draw together, in its
row order, from its generator, exactly the draws `engine.stream` makes for the request alone (a row
of the request that has stopped keeps its place with a placeholder row of logits: `multinomial`
draws each row from the generator in turn, whatever the values, so the other rows' draws are those
of the request alone). Greedy rows take the argmax. What couples rows lives in the architecture's
options (`DecodeOption.couples_rows`, e.g. fbt's `passes="auto"`, which settles a prefill for all
its rows): such a request is prefilled alone and then decodes with the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..engine import left_pad, left_pad_flags, row_info, sample_next, written_rows
from ..inference.fast import WINDOW_BUCKET, CompileRecord, FastDecoder, fallback_reason, static_cache
from ..models.backbone import GPT
from ..models.cache import regroup, row_span
from ..models.options import couples_rows as declared_coupling
from ..models.options import without_speed_only
from ..util import evaluating


@dataclass(eq=False)
class Sampling:
    """How one request samples: its settings and generator; its members in row order."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None
    logprobs: bool = False  # each new token's log-probability
    top_logprobs: int = 0  # and the k most likely tokens with theirs
    ignore_eos: bool = False  # the batch's stop tokens do not end this request's rows
    members: list[Member] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(eq=False)
class Member:
    """One row of a request in a batch. `owner`: whatever the caller ties to the row."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    owner: Any = None
    written: list[bool] | None = None  # per prompt token: the model wrote it (`engine.stream`'s `written`)
    generated: int = 0  # tokens handed out so far
    done: bool = False  # stopped (stop token, max_new_tokens) or dropped: decodes no more
    info: dict = field(default_factory=dict)  # what the model reported for this row (prefill, last step)

    def __post_init__(self) -> None:
        self.sampling.members.append(self)


@dataclass
class MemberStep:
    member: Member
    token: int | None  # None: the member stopped on a stop token (not handed out)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    logits: Tensor | None = None  # (V,) the logits it was drawn from, when the batch keeps them


class DecodeBatch:
    """Rows decoding together with one model and one set of architecture options (see the module
    docstring). Not thread-safe: one thread steps it."""

    def __init__(self, model, options: dict, stop_tokens: Sequence[int] = (), pad_id: int = 0,
                 coupled: bool = False, keep_logits: bool = False):
        self.model, self.options = model, batch_options(model, options)
        self.stop_tokens = frozenset(stop_tokens)
        self.pad_id = pad_id
        self.coupled = coupled  # the options couple the rows of a prefill: each request prefills alone
        self.keep_logits = keep_logits
        self.device = next(model.parameters()).device
        self.members: list[Member] = []  # the rows of `cache`, in order
        self.cache = None
        self.last: Tensor | None = None  # (B, V) logits of each member's next token, None once decoded past
        self._pending_tokens: Tensor | None = None  # (B,) each row's last draw, fed to the next decode step
        self.waiting: list[list[Member]] = []  # joiners, by the `add` call that brought them
        self.regroups = 0  # times the cache was rebuilt (rows joined or left)

    def __len__(self) -> int:
        """Rows decoding or about to join (a dropped joiner no longer counts)."""
        return sum(not m.done for m in self.members) + sum(not m.done for group in self.waiting for m in group)

    def add(self, members: list[Member]) -> None:
        """Members (one request's rows, or several requests') to prefill and join at the next step."""
        if members:
            self.waiting.append(list(members))

    def drop(self, member: Member) -> None:
        """The member decodes no more; its row leaves the batch at the next step."""
        member.done = True

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[MemberStep]:
        """Decode the members that go on, prefill and join the waiting ones, then draw each live
        member's next token. Returns one entry per live member, in batch order."""
        was_training = self.model.training
        if was_training:  # (walking the modules every step costs a few % of a small model's step)
            self.model.eval()
        try:
            self._decode_running()
            self._join_waiting()
            if not self.members:
                return []
            return self._sample()
        finally:
            if was_training:
                self.model.train()

    def _remaining(self, member: Member) -> int:
        return member.max_new_tokens - member.generated

    def _capacity(self, length: int, members: list[Member]) -> int:
        """Slots for `length` stored tokens and every decode step still owed to the members."""
        return length + max((self._remaining(m) for m in members), default=0) + 1

    def _keep(self, keep: list[int]) -> None:
        """Rebuild the cache with the members at positions `keep` only."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        members = [self.members[i] for i in keep]
        cache = self.model.new_cache(len(keep), self._capacity(row_span(self.cache, index), members), **self.options)
        regroup(cache, [(self.cache, index)])
        self.cache, self.members = cache, members
        self.regroups += 1

    def _decode_running(self) -> None:
        if self.cache is None:
            return
        keep = [i for i, m in enumerate(self.members) if not m.done]
        if not keep:
            self.cache, self.members, self.last = None, [], None
            return
        tokens = self._pending_tokens
        # Rows that left are copied out with the next join (one rebuild for both), or once half the
        # batch has left; until then they decode on unseen (each copy costs about a decode step).
        if not self.waiting and 2 * (len(self.members) - len(keep)) > len(self.members):
            self._keep(keep)
            tokens = tokens[keep]
        out = self.model.decode(tokens[:, None], self.cache, **self.options)
        self.last = out.logits[:, -1]  # (B, V)
        for i, member in enumerate(self.members):
            if not member.done:  # a row that left decodes on unseen: what it reports is not the row's
                member.info.update(row_info(out.info, i))

    def _joinable(self, length: int, members: list[Member]) -> int:
        """How many of the waiting groups, in arrival order, can join now. Every row of the batch
        shares its length, `length` for the running rows (0 with none): a group joins at the longest
        of that and its prompts, and each row then decodes as many steps as it still owes (its first
        token comes from the logits at hand), so rows that fit the context alone could overflow it
        together (a 500 for every request in the batch). A group that would waits, and so does every
        group after it (else a stream of short joiners could keep it waiting for ever); the first
        group of an empty batch always joins (the server admits only requests that fit alone)."""
        context = self.model.config.sequence_len
        owed = max((self._remaining(m) for m in members), default=0)
        for joined, group in enumerate(self.waiting):
            length = max(length, *(len(m.prompt) for m in group))
            owed = max(owed, *(self._remaining(m) for m in group))
            if length + owed - 1 > context and (joined or members):
                return joined
        return len(self.waiting)

    def _prefill_waiting(self, joining: list[list[Member]]) -> list[tuple[list[Member], object, Tensor]]:
        """The joining members prefilled, each group in a left-padded cache of its own (together, in
        groups of like lengths, `by_length`; or each request alone when the options couple rows):
        (members, cache, last logits (n, V))."""
        groups = joining if self.coupled else by_length([m for group in joining for m in group])
        prefilled = []
        for group in groups:
            idx, pad_mask = left_pad([m.prompt for m in group], self.pad_id, self.device)
            cache = self.model.new_cache(len(group), idx.shape[1], **self.options)
            written = written_rows([(m.prompt, m.written) for m in group])
            replay = {} if written is None else {"written": left_pad_flags(written, self.device)}  # (n, P)
            out = self.model.prefill(idx, cache, pad_mask, last_logits=True, **replay, **self.options)
            for j, member in enumerate(group):
                member.info = row_info(out.info, j)
            prefilled.append((group, cache, out.logits[:, -1]))
        return prefilled

    def _forget_dropped_joiners(self) -> None:
        """Joiners dropped while they waited (a client that hung up) neither join nor hold up the rest."""
        self.waiting = [kept for group in self.waiting if (kept := [m for m in group if not m.done])]

    def _join_waiting(self) -> None:
        self._forget_dropped_joiners()
        if not self.waiting:
            return
        parts, logits, members = [], [], []
        if self.cache is not None:  # the running rows, without those that left
            live = [i for i, m in enumerate(self.members) if not m.done]
            parts.append((self.cache, torch.tensor(live, dtype=torch.long, device=self.device)))
            logits.append(self.last[live])
            members.extend(self.members[i] for i in live)
        joining = self._joinable(max((row_span(c, i) for c, i in parts), default=0), members)
        if not joining:  # the waiting groups wait; the rows that left go now (the span may shrink)
            if len(members) < len(self.members):
                self._keep(live)
                self.last = self.last[live]
            return
        groups, self.waiting = self.waiting[:joining], self.waiting[joining:]
        for group, cache, last in self._prefill_waiting(groups):
            parts.append((cache, torch.arange(len(group), device=self.device)))
            logits.append(last)
            members.extend(group)
        length = max(row_span(cache, index) for cache, index in parts)
        cache = self.model.new_cache(len(members), self._capacity(length, members), **self.options)
        regroup(cache, parts)
        self.cache, self.members, self.last = cache, members, torch.cat(logits)
        self.regroups += 1

    # -- drawing the next tokens ----------------------------------------------------------------
    def _sample(self) -> list[MemberStep]:
        last = self.last  # (B, V)
        row_of = {id(m): i for i, m in enumerate(self.members)}
        tokens = last.argmax(dim=-1)  # (B,) the greedy rows' tokens; sampled rows are overwritten
        for sampling in {id(m.sampling): m.sampling for m in self.members}.values():
            if sampling.greedy:
                continue
            # the request's rows in its own order; a stopped row keeps its place (see the docstring)
            rows = [row_of.get(id(m)) for m in sampling.members]
            stacked = torch.stack([last[i] if i is not None else torch.zeros_like(last[0]) for i in rows])
            drawn = sample_next(stacked, sampling.temperature, sampling.top_k, sampling.top_p, sampling.generator)
            live = [(i, j) for j, i in enumerate(rows) if i is not None]
            tokens[[i for i, _ in live]] = drawn[[j for _, j in live]]
        want_logp = any(m.sampling.logprobs or m.sampling.top_logprobs for m in self.members)
        logp = last.float().log_softmax(dim=-1) if want_logp else None
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1).tolist() if logp is not None else None
        k = max((m.sampling.top_logprobs for m in self.members), default=0)
        top_values, top_ids = logp.topk(k, dim=-1) if k else (None, None)
        top_values = top_values.tolist() if k else None
        top_ids = top_ids.tolist() if k else None
        self._pending_tokens = tokens
        steps = []
        for i, (member, token) in enumerate(zip(self.members, tokens.tolist())):
            if member.done:
                continue
            if token in self.stop_tokens and not member.sampling.ignore_eos:
                member.done = True
                steps.append(MemberStep(member, None))
                continue
            member.generated += 1
            if member.generated >= member.max_new_tokens:
                member.done = True
            n = member.sampling.top_logprobs
            steps.append(MemberStep(member, token, chosen[i] if member.sampling.logprobs else None,
                                    list(zip(top_ids[i][:n], top_values[i][:n])) if n else None,
                                    last[i].clone() if self.keep_logits else None))  # the next step writes `last`
        return steps


# Joiners prefilled together are left-padded to the longest of them: one whose prompt is shorter than this
# share of the longest goes into another prefill. At concurrency 32 with prompts of 32 and 352 tokens
# alternating, the rows finish together and join together: one prefill padded 30,720 prompt tokens to 56,320,
# half of the server's time (a 6 x 384 model, one thread).
PREFILL_PADDING_KEPT = 0.75


def by_length(members: list[Member]) -> list[list[Member]]:
    """Members in groups to prefill together, longest prompts first, each no shorter than
    `PREFILL_PADDING_KEPT` of its group's longest (a group's padding under a quarter of its width)."""
    groups: list[list[Member]] = []
    for member in sorted(members, key=lambda m: -len(m.prompt)):
        if groups and len(member.prompt) >= PREFILL_PADDING_KEPT * len(groups[-1][0].prompt):
            groups[-1].append(member)
        else:
            groups.append([member])
    return groups


def couples_rows(model, options: dict) -> bool:
    """Whether the architecture declares that these options couple the rows of a prefill (each
    request is then prefilled alone)."""
    return declared_coupling(model.OPTIONS, options)


# -- on the compiled path ----------------------------------------------------------------------

# A batch of the compiled path holds a power of two rows at most (1, 2, 4, ...): each size is one
# compiled graph, and a batch grows to the next size when joiners do not fit its free rows, so a
# server compiles at most log2(max rows) + 1 graphs per set of options.
def slot_rows(rows: int) -> int:
    """The batch size (a power of two) that holds `rows` rows."""
    return 1 << max(0, rows - 1).bit_length()


# Past this many bytes of keys/values (rows x the whole context), a batch stays on the eager path:
# the compiled path holds every row's whole context. 2 GiB: 32 rows of a 12-layer d=768 model at
# 1024 tokens take 2.4 GiB, 32 of the `small` preset 0.3 GiB.
SLOT_CACHE_BYTES = 2 * 2**30


# A batch on the compiled path shrinks once its live rows fit a batch this many times smaller: not at
# half, so that a load hovering around a power of two does not copy the rows back and forth.
SHRINK_FACTOR = 4


def slot_sizes(rows: int) -> list[int]:
    """Every batch size a batch of up to `rows` rows may take (1, 2, 4, ... slot_rows(rows))."""
    return sorted({slot_rows(n) for n in range(1, rows + 1)})


def slot_length(model) -> int:
    """The slots of a row: the whole context, plus one window bucket so that the attended window
    never spans the whole buffer (a graph of its own, see `FastDecoder.step`; `window_length`)."""
    context = model.config.sequence_len
    return -(-context // WINDOW_BUCKET) * WINDOW_BUCKET + WINDOW_BUCKET


# `serve --decode auto` takes the compiled path when loading every batch size's step from the on-disk
# caches is expected to take at most this long (the compile records' fastest first calls). Measured on
# the project's 2-core machine: a warm start of 1 to 32 rows of `tiny` in 6.9 s, a cold one in minutes.
AUTO_START_BUDGET_S = 30.0


@dataclass
class _CacheShape:
    """What `CompileRecord` reads of a cache: the shapes that tell compiled steps apart."""

    batch_size: int
    max_len: int
    key_pos: Tensor  # only its device is read
    per_row: bool = True


def cached_start_seconds(model, options: dict, rows: int, kv_dtype: torch.dtype | None = None) -> float | None:
    """What loading the compiled path's step for every batch size up to `rows` (its cache in
    `kv_dtype`) is expected to cost, by the compile records (`CompileRecord`: the fastest first call
    recorded per shape); None when some size was never compiled on this machine (its first start
    would compile it). Looked up by the options the batch's decoder records under (`batch_options`:
    with rgpt's draft options in the key, no record was ever found and `--decode auto` stayed eager)."""
    options = batch_options(model, options)
    marker = torch.empty(0, device=next(model.parameters()).device)
    total = 0.0
    for size in slot_sizes(rows):
        record = CompileRecord(model, options, _CacheShape(size, slot_length(model), marker), kv_dtype)
        if not record.seen():
            return None
        total += record.expected_seconds()
    return total


def batch_options(model, options: dict) -> dict:
    """The options a batch decodes with: without those the architecture declares speed-only
    (`DecodeOption.speed_only`, self-speculative decoding's draft), which a batch's one token a step
    cannot use: the output is the same function without them."""
    return without_speed_only(getattr(model, "OPTIONS", ()), options)


def compiles(model, options: dict, rows: int) -> bool:
    """Whether a batch of up to `rows` rows with these options can run on the compiled path: the
    backbone's static cache, options whose step compiles, and every row's context within
    `SLOT_CACHE_BYTES`."""
    return why_not_compiled(model, options, rows) is None


def why_not_compiled(model, options: dict, rows: int) -> str | None:
    """Why a batch of up to `rows` rows with these options cannot run on the compiled path (None: it can)."""
    options = batch_options(model, options)
    if not isinstance(model, GPT):
        return "the model has no static cache"
    reason = fallback_reason(model, options)
    if reason is not None:
        return reason
    per_row = model.new_cache(1, 1, **options).memory_bytes() * slot_length(model)
    if slot_rows(rows) * per_row > SLOT_CACHE_BYTES:
        return (f"{slot_rows(rows)} rows of a whole context are {slot_rows(rows) * per_row / 2**30:.1f} GiB of cache, "
                f"past the compiled path's {SLOT_CACHE_BYTES / 2**30:g} GiB")
    return None


class SlotBatch(DecodeBatch):
    """`DecodeBatch` on the compiled path (`inference.fast`): each decode step is the compiled step of
    `FastDecoder` over a frozen static cache of `slot_rows(n)` rows, each row holding a whole
    context. Rows do not share a write position: each row writes at its own slot (`write_index`),
    so a joining row is copied into a free row (`place`) with no copy of the others, and a row that
    leaves frees its row for the next joiner (`vacate`).

    The batch's cache is a view of the first rows of one larger cache (`storage`: as many rows as
    the batch has ever held, `rows_view`), so the batch grows to the next power of two when joiners
    do not fit without copying anything, and shrinks, once its live rows fit a batch
    `SHRINK_FACTOR` times smaller and nobody waits, by moving only the live rows past the new size
    into its free rows (`move_row`). Each row decodes exactly as it would alone, as in `DecodeBatch`
    (up to the compiled step's summation order, as with `generate(compile=True)`).

    `compile=False` runs the same static-cache step eagerly (what the tests check exactly);
    `on_compile(message)` hears when a first call for a batch size compiles. `kv_dtype`: the frozen
    cache's keys and values are stored in it (`StaticCacheMixin.freeze`), a row's prefill rounded to
    it as the row is placed."""

    def __init__(self, model, options: dict, stop_tokens: Sequence[int] = (), pad_id: int = 0,
                 coupled: bool = False, keep_logits: bool = False, compile: bool = True, on_compile=None,
                 kv_dtype: torch.dtype | None = None):
        super().__init__(model, options, stop_tokens, pad_id, coupled, keep_logits)
        self.on_compile = on_compile
        self.decoder = FastDecoder(model, compile=compile, on_compile=on_compile and self._announce,
                                   kv_dtype=kv_dtype, **self.options)
        self.storage = None  # the frozen cache whose first rows `cache` views (None until the first join)
        self.filled: list[int] = []  # slots each row of the cache holds
        self._free = Member([], 0, Sampling())  # the placeholder of every free row
        self._free.done = True

    def _announce(self, message: str) -> None:
        self.on_compile(f"{self.decoder.cache.batch_size} rows: {message}")

    def warm(self, rows: int) -> None:
        """Run (so compile, or load from the on-disk cache) the step for every batch size up to
        `rows`, on placeholder rows, before serving: no request then waits for a compile, and the
        storage for `rows` rows is allocated now, not while serving."""
        sizes = slot_sizes(rows)
        # inference mode as `step` runs: a graph compiled outside it would not be reused
        with evaluating(self.model), torch.inference_mode():
            self._reserve(sizes[-1])
            for size in sizes:
                self._warm(size)
        self.cache, self.members, self.last, self.filled, self._pending_tokens = None, [], None, [], None

    def _placeholder(self):
        """A one-token prefill's cache: what warming decodes, and what brings the state's shapes."""
        source = self.model.new_cache(1, 1, **self.options)
        self.model.prefill(torch.full((1, 1), self.pad_id, device=self.device), source, **self.options)
        return source

    def _warm(self, size: int) -> None:
        cache = self.storage.rows_view(size)
        source = self._placeholder()
        for row in range(size):
            cache.place(row, source, 0)
        self.decoder.attach(cache)
        self.decoder.step(torch.full((size,), self.pad_id, device=self.device))

    def _reserve(self, rows: int) -> None:
        """A storage of at least `rows` rows; the rows of the current batch are copied into a new
        one (at most once per power of two in a server's life: `warm` reserves them all at once)."""
        if self.storage is not None and self.storage.batch_size >= rows:
            return
        storage = static_cache(self.model.new_cache(rows, slot_length(self.model), **self.options))
        storage.freeze(per_row=True, kv_dtype=self.decoder.kv_dtype)
        storage.place(0, self._placeholder(), 0)  # every state tensor exists in the storage, for its views
        storage.vacate(torch.zeros(1, dtype=torch.long, device=self.device))
        if self.cache is not None:
            span = max(self.filled, default=0)
            n = self.cache.batch_size
            for old, new in ((self.cache.k_slots, storage.k_slots), (self.cache.v_slots, storage.v_slots)):
                for a, b in zip(old, new):
                    b[:n, :, :span] = a[:, :, :span]
            for name in ("key_pos", "next_pos", "write_index"):
                getattr(storage, name)[:n] = getattr(self.cache, name)
            for name, value in self.cache.state.items():
                storage.state[name][:n] = value
        self.storage = storage

    def _regrow(self, rows: int) -> None:
        """The batch becomes the first `rows` rows of the storage: more rows are vacated and added
        free; fewer (the live rows fit them) move the live rows past `rows` into free rows below."""
        n = len(self.members)
        self._reserve(rows)
        order = list(range(min(n, rows)))  # row i of the new batch holds row order[i] of the old one
        if rows < n:
            outside = [i for i in range(rows, n) if not self.members[i].done]
            free_inside = [i for i in range(rows) if self.members[i].done]
            for source, target in zip(outside, free_inside):
                self.storage.move_row(source, target, self.filled[source])
                order[target] = source
        self.cache = self.storage.rows_view(rows)
        if rows > n:
            self.cache.vacate(torch.arange(n, rows, device=self.device))
        self.decoder.attach(self.cache)
        added = rows - len(order)
        self.members = [self.members[i] for i in order] + [self._free] * added
        self.filled = [self.filled[i] for i in order] + [0] * added
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        if self.last is not None:
            last = self.last.new_zeros((rows, self.last.shape[1]))
            last[:len(order)] = self.last[index]
            self.last = last
        if self._pending_tokens is not None:  # one token per row, free rows' too
            tokens = self._pending_tokens.new_full((rows,), self.pad_id)
            tokens[:len(order)] = self._pending_tokens[index]
            self._pending_tokens = tokens
        self.regroups += 1

    def _decode_running(self) -> None:
        if self.cache is None:
            return
        live = [i for i, m in enumerate(self.members) if not m.done]
        if not live:  # the storage stays for the next join
            self.cache, self.members, self.last, self.filled, self._pending_tokens = None, [], None, [], None
            return
        if not self.waiting and slot_rows(len(live)) * SHRINK_FACTOR <= len(self.members):
            self._regrow(slot_rows(len(live)))
            live = [i for i, m in enumerate(self.members) if not m.done]
        tokens = self._pending_tokens  # (B,): each row's last draw (`_sample`), free rows' included
        free = [i for i, m in enumerate(self.members) if m.done]
        if free:  # the slots a row that just left filled are known here: no sync to find them
            self.cache.vacate(torch.tensor(free, dtype=torch.long, device=self.device),
                              filled=max(self.filled[i] for i in free))
        self.cache.filled = max(self.filled[i] for i in live)
        logits, _, info = self.decoder.step(tokens)
        self.last = logits  # (B, V)
        for i in live:
            self.filled[i] += 1
            self.members[i].info.update(row_info(info, i))
        for i in free:
            self.filled[i] = 0

    def _join_waiting(self) -> None:
        self._forget_dropped_joiners()
        if not self.waiting:
            return
        # every row keeps its own slots of the whole context here: a joiner never moves another's length
        groups, self.waiting = self.waiting, []
        prefilled = self._prefill_waiting(groups)
        joining = sum(len(group) for group, _, _ in prefilled)
        live = sum(not m.done for m in self.members)
        if live + joining > len(self.members):  # grow: the live rows stay where they are
            self._regrow(slot_rows(live + joining))
        if self.last is None:
            self.last = prefilled[0][2].new_zeros((len(self.members), prefilled[0][2].shape[1]))
        rows = iter([i for i, m in enumerate(self.members) if m.done])
        for group, cache, last in prefilled:
            for j, member in enumerate(group):
                row = next(rows)
                self.filled[row] = self.cache.place(row, cache, j)
                self.members[row] = member
                self.last[row] = last[j]
        self.regroups += 1
