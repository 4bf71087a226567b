"""The inference cache passed explicitly into `forward`.

`KVCache` holds, for every attention *slot*, the keys and values of all tokens seen so far, the
absolute position of every stored token, and named slots of recurrent state that variants carry
from one token to the next (nanochat's `KVCache.prev_embedding`, generalised):

- slots: normally one per layer; a recurrent-depth model asks for one per (step, core layer).
- `key_pos` (B, max_len): position of each stored token, -1 for empty slots and left padding.
  Masks are built from positions, so a left-padded batch of prompts of different lengths decodes
  exactly like each prompt alone.
- `state`: a dict of tensors, e.g. `state["fbt.prev_top"]` (B, 1, D), owned by the variant that
  writes it; every state tensor has the batch as its first dimension, so that its rows can move
  with their keys/values (`regroup`).

Usage inside a model forward: `plan = cache.begin(T, pad_mask)` once, `cache.update(slot, k, v)`
in every attention layer, `cache.advance()` once at the end. Attention layers see the cache only
through the `KVStore` protocol (`update`), which `KVBuffer` (training's differentiable stand-in) and
rgpt's per-step views implement too.

`keep_recent(kept, n)` takes tokens back (self-speculative decoding's rejected drafts: the cache is
left as if they had never been decoded, per row), `rewind(n)` for every row, `compact()` packs the
holes a ragged `keep_recent` leaves.

`regroup(target, parts)` fills an empty cache with rows of other caches, each row's tokens kept in
order and right-aligned: the continuous batching of `latentloop.serve` lets rows at different
positions share one decode step this way, each row decoding exactly as it would alone.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from . import flex

# A CPU buffer of this many bytes or more is zeroed by the operating system, page by page as it is
# first touched (`zeros_on_touch`), instead of by torch at allocation
ZEROED_ON_TOUCH_MIN_BYTES = 1 << 20


def zeros_on_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """`torch.zeros(shape)`, for a buffer mostly left unread: on the CPU, from
    `ZEROED_ON_TOUCH_MIN_BYTES` on, an anonymous memory map (its pages are the kernel's zero pages
    until written), where torch.zeros writes every byte before returning. A decode cache is sized for
    the whole context while a short prompt and generation touch its first slots: at 12 layers x
    d 768 and a 2,248-token context, zeroing the 166 MB of keys and values (and copying all of them
    into the compiled step's buffers at `freeze`) took half of a 16-token prompt's prefill and first
    decoded token, 179 against 90 ms (4 layers x d 256: 8.8 against 4.6 ms; one thread, medians of
    15 alternated rounds, the same tokens). Off the CPU, below the threshold, and where there are no
    private anonymous maps (Windows), `torch.zeros`. The map is freed with the tensor's storage."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (torch.device(device).type != "cpu" or nbytes < ZEROED_ON_TOUCH_MIN_BYTES
            or not hasattr(mmap, "MAP_ANONYMOUS")):
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # through a memoryview: the tensor then holds an export of the map, which cannot be closed under it
    return torch.frombuffer(memoryview(pages), dtype=dtype).view(shape)


@dataclass
class AttentionPlan:
    """How one forward's queries attend to keys: positions for RoPE and the mask for SDPA."""

    positions: Tensor  # (B or 1, T) absolute position of each query token
    mask: Tensor | None  # (B, 1, T, Tk) bool, True = may attend; None with is_causal as below
    is_causal: bool  # SDPA's causal flag, only valid when mask is None
    block_mask: Any = None  # the mask as a flex_attention BlockMask instead (strided subsets on GPU: models/flex.py)


class KVStore(Protocol):
    """What an attention layer needs of a cache: store this forward's keys/values of one slot and
    get back every key/value the queries may attend to."""

    def update(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


def attention_mask(query_pos: Tensor, key_pos: Tensor, query_slot: Tensor, key_slot: Tensor) -> Tensor:
    """Bool mask (B, 1, Tq, Tk): a query sees stored keys at positions <= its own.

    Empty or padded keys have position -1 and are never seen, except that each query always sees
    its own slot, so that a padding query has one valid key and SDPA never returns NaN (which would
    leak into real tokens through 0 * NaN in later layers).
    """
    visible = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= query_pos[:, :, None])  # (B, Tq, Tk)
    own_slot = key_slot[None, None, :] == query_slot[None, :, None]  # (1, Tq, Tk)
    return (visible | own_slot)[:, None]  # (B, 1, Tq, Tk)


def plan_attention(pad_mask: Tensor | None, T: int, device: torch.device) -> AttentionPlan:
    """The uncached case: one full sequence, optionally left-padded (pad_mask True = real token)."""
    if pad_mask is None:
        return AttentionPlan(torch.arange(T, device=device)[None], None, True)
    positions = (pad_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    key_pos = torch.where(pad_mask, positions, torch.full_like(positions, -1))
    slots = torch.arange(T, device=device)
    return AttentionPlan(positions, attention_mask(positions, key_pos, slots, slots), False)


class KVCache:
    """Preallocated keys/values for `n_slots` attention slots plus recurrent-state slots."""

    def __init__(self, batch_size: int, max_len: int, n_slots: int, n_kv_head: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        shape = (n_slots, batch_size, n_kv_head, max_len, head_dim)
        self.k = zeros_on_touch(shape, dtype, device)  # (S, B, H, L, hd)
        self.v = zeros_on_touch(shape, dtype, device)
        self.key_pos = torch.full((batch_size, max_len), -1, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # next position per row
        self.length = 0  # slots used along the time axis
        self.has_padding = False
        self.state: dict[str, Tensor] = {}
        self.stats: dict[str, list] = {}  # plain-Python bookkeeping (e.g. exit depths), not model state
        self.pending = 0  # tokens registered by `begin` and not yet committed by `advance`

    @property
    def batch_size(self) -> int:
        return self.key_pos.shape[0]  # key_pos, not k: a frozen static cache (inference/fast.py) drops k

    @property
    def max_len(self) -> int:
        return self.key_pos.shape[1]

    def begin(self, T: int, pad_mask: Tensor | None = None) -> AttentionPlan:
        """Register T new tokens (left-padded where pad_mask is False) and plan their attention."""
        if self.length + T > self.max_len:
            raise ValueError(f"cache overflow: {self.length} + {T} tokens > max_len {self.max_len}")
        device = self.key_pos.device
        if pad_mask is None:
            positions = self.next_pos[:, None] + (torch.arange(T, device=device)[None] if T > 1 else 0)  # (B, T)
            key_pos = positions
        else:
            offsets = pad_mask.long().cumsum(dim=1) - 1  # (B, T)
            positions = self.next_pos[:, None] + offsets.clamp(min=0)
            key_pos = torch.where(pad_mask, positions, torch.full_like(positions, -1))
            self.has_padding = self.has_padding or bool((~pad_mask).any())
        self.key_pos[:, self.length:self.length + T] = key_pos
        self.next_pos = self.next_pos + (T if pad_mask is None else pad_mask.long().sum(dim=1))
        self.pending = T
        if not self.has_padding and self.length == 0:
            return AttentionPlan(positions, None, True)
        if not self.has_padding and T == 1:  # one new token sees everything stored: no mask needed
            return AttentionPlan(positions, None, False)
        end = self.length + T
        mask = attention_mask(positions, self.key_pos[:, :end],
                              torch.arange(self.length, end, device=device), torch.arange(end, device=device))
        return AttentionPlan(positions, mask, False)

    def update(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this forward's k, v (B, H, T, hd) in `slot`; return all keys/values so far."""
        start, end = self.length, self.length + k.shape[2]
        self.k[slot, :, :, start:end] = k
        self.v[slot, :, :, start:end] = v
        return self.k[slot, :, :, :end], self.v[slot, :, :, :end]

    def advance(self) -> None:
        """Commit the tokens registered by `begin` (call once, after every layer ran)."""
        self.length += self.pending
        self.pending = 0

    # -- taking tokens back (self-speculative decoding: drafts rejected by the full model) ---------
    def keep_recent(self, kept: Tensor, n: int) -> None:
        """Of the last `n` time slots (the tokens of the latest forwards), row b keeps its first
        `kept[b]` (B,); the others leave the cache as if they had never been decoded: their
        keys/values zeroed (a fresh cache's: an arch may keep flags in them, mor's route slot) and
        their positions empty (-1), the row's next position moved back. Slots that no row keeps are
        given back (`length` shrinks); a row that keeps fewer than another leaves a hole, which
        every mask hides as it hides left padding, and decodes on exactly as alone (`compact`
        reclaims holes). `state` is the caller's (what a model carries from token to token)."""
        if not 0 <= n <= self.length or self.pending:
            raise ValueError(f"keep_recent: {n} slots of {self.length} (pending {self.pending})")
        if n == 0:
            return
        start, end = self.length - n, self.length
        drop = torch.arange(n, device=kept.device)[None] >= kept[:, None]  # (B, n)
        stored = self.key_pos[:, start:end]
        self.next_pos = self.next_pos - (drop & (stored >= 0)).sum(dim=1)
        self.key_pos[:, start:end] = stored.masked_fill(drop, -1)
        gone = drop[None, :, None, :, None]  # (1, B, 1, n, 1) over (S, B, H, n, hd)
        self.k[:, :, :, start:end].masked_fill_(gone, 0)
        self.v[:, :, :, start:end].masked_fill_(gone, 0)
        kept_slots = int(kept.max())
        self.length = start + kept_slots
        if bool(drop[:, :kept_slots].any()):  # a row keeps fewer than another: a hole before the end
            self.has_padding = True

    def rewind(self, n: int) -> None:
        """Drop the last `n` time slots of every row (`keep_recent` keeping none)."""
        self.keep_recent(torch.zeros(self.batch_size, dtype=torch.long, device=self.key_pos.device), n)

    def compact(self) -> None:
        """Pack each row's stored tokens to the end of the used slots, in order, so that the holes
        `keep_recent` left (and left padding) come first and the slots no row needs are given back:
        the layout `regroup` makes. Positions travel with the tokens, so each row decodes on as
        before."""
        L = self.length
        if self.pending or L == 0:
            return
        stored = self.key_pos[:, :L] >= 0  # (B, L)
        needed = int(stored.sum(dim=1).max())
        if needed == L:
            return
        # a stable sort of "stored" puts each row's empty slots first and its tokens after them, in order
        order = torch.sort(stored.to(torch.uint8), dim=1, stable=True).indices[:, L - needed:]  # (B, needed)
        S, B, H, _, hd = self.k.shape
        index = order[None, :, None, :, None].expand(S, B, H, needed, hd)
        empty = ~stored.gather(1, order)[None, :, None, :, None]
        for tensor in (self.k, self.v):
            packed = tensor[:, :, :, :L].gather(3, index).masked_fill_(empty, 0)
            tensor[:, :, :, :needed] = packed
            tensor[:, :, :, needed:L] = 0
        self.key_pos[:, :needed] = self.key_pos[:, :L].gather(1, order)
        self.key_pos[:, needed:L] = -1
        self.length = needed
        self.has_padding = bool((self.key_pos[:, :needed] < 0).any())

    def memory_bytes(self) -> int:
        tensors = [self.k, self.v, self.key_pos, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


class KVBuffer:
    """A differentiable stand-in for `KVCache`, for training procedures that recompute subsets of
    one sequence against the keys/values of the rest (interleaved and chunked recurrence).

    Column t of the buffer always holds token t. A pass over the columns `index` takes its plan from
    `begin_columns(index)` and writes through `writer(index)`: its fresh keys/values go into the
    buffer *out of place* (gradients flow through the buffer) and every layer gets the whole buffer
    back; each query sees every column whose position is <= its own. Columns never written hold
    zeros and sit at later positions, so causality hides them.

    The buffer keeps no per-pass state in its attributes (the columns live in the pass's writer):
    inside a compiled graph, dynamo (torch 2.13) drops attribute writes made after a flex_attention
    call to objects that existed before it (see `models/flex.py`), so a `self._index = index` for the
    second subset pass was lost and that pass wrote its keys into the first subset's columns.
    """

    def __init__(self, n_slots: int, key_pos: Tensor, padded: bool = True):
        self.key_pos = key_pos  # (B|1, T) position of each column, -1 for padding
        # False: no column is padding, known without reading `key_pos` (reading it is a data-dependent
        # branch, which splits a compiled training step's graph in two)
        self.padded = padded
        self.k: list[Tensor | None] = [None] * n_slots  # replaced item by item (a list's writes survive)
        self.v: list[Tensor | None] = [None] * n_slots

    @property
    def columns(self) -> int:
        return self.key_pos.shape[1]

    def begin_columns(self, index: Tensor, key: tuple | None = None) -> AttentionPlan:
        """The plan of a pass over the columns `index` (a long tensor, in order); `key` describes
        them on the host (flex.block_mask's `columns_key`)."""
        device = self.key_pos.device
        query_pos = self.key_pos[:, index].clamp(min=0)  # (B|1, n)
        full = len(index) == self.columns and (not self.padded or bool((self.key_pos >= 0).all()))
        if full:  # a plain full causal pass
            return AttentionPlan(query_pos, None, True)
        if flex.available(device):  # a subset of the columns: let the kernel skip what no query sees
            return AttentionPlan(query_pos, None, False,
                                 block_mask=flex.block_mask(query_pos, self.key_pos, index, self.padded, key))
        mask = attention_mask(query_pos, self.key_pos, index, torch.arange(self.columns, device=device))
        return AttentionPlan(query_pos, mask, False)

    def writer(self, index: Tensor) -> BufferColumns:
        """The `KVStore` through which a pass over the columns `index` writes into this buffer."""
        return BufferColumns(self, index)

    def write_rows(self, cache: KVCache, rows: Tensor) -> None:
        """Copy this buffer (computed for `rows` of a batch) into the first columns of an inference
        cache whose tokens were registered with `cache.begin` (a parallel prefill)."""
        T = self.columns
        for slot, (k, v) in enumerate(zip(self.k, self.v)):
            cache.k[slot, rows, :, :T] = k
            cache.v[slot, rows, :, :T] = v


@dataclass(frozen=True)
class BufferColumns:
    """One pass's writes into a `KVBuffer`: the keys/values of the columns `index`."""

    buffer: KVBuffer
    index: Tensor

    def update(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        buffer = self.buffer
        if len(self.index) == buffer.columns:
            buffer.k[slot], buffer.v[slot] = k, v
        else:
            if buffer.k[slot] is None:
                shape = (*k.shape[:2], buffer.columns, k.shape[3])
                buffer.k[slot], buffer.v[slot] = k.new_zeros(shape), v.new_zeros(shape)
            buffer.k[slot] = buffer.k[slot].index_copy(2, self.index, k)
            buffer.v[slot] = buffer.v[slot].index_copy(2, self.index, v)
        return buffer.k[slot], buffer.v[slot]


def row_span(cache: KVCache, index: Tensor) -> int:
    """How many time slots the rows `index` of `cache` occupy: from the first slot any of them uses
    to the end of what the cache holds (slots empty for all of them before that are not counted)."""
    used = (cache.key_pos[index, :cache.length] >= 0).any(dim=0)  # (length,)
    if not bool(used.any()):
        return 0
    return cache.length - int(used.int().argmax())


def regroup(target: KVCache, parts: list[tuple[KVCache, Tensor]]) -> None:
    """Fill the empty cache `target` with rows of other caches: part i's rows `index` (a long
    tensor) become the next rows of `target`, in order. Each part's stored slots keep their order
    and positions and end at the target's new length, the longest span among the parts
    (`row_span`); what lies before a shorter part is empty (key_pos -1), which every mask hides as
    it hides left padding, and positions come from `key_pos` / `next_pos`, so each row decodes on
    exactly as it would have in its own cache. Every state tensor follows its rows (batch first);
    a state a part lacks starts at zeros for its rows (a counter no step has touched yet).
    `stats` (bookkeeping of a whole batch) start empty. The caches must come from the same model
    and decoding options (the same slots and state shapes)."""
    if target.length or target.pending:
        raise ValueError("regroup fills an empty cache")
    rows = sum(len(index) for _, index in parts)
    if rows != target.batch_size:
        raise ValueError(f"regroup: the parts hold {rows} rows, the target has {target.batch_size}")
    spans = [row_span(cache, index) for cache, index in parts]
    length = max(spans, default=0)
    if length > target.max_len:
        raise ValueError(f"regroup: {length} slots do not fit a cache of max_len {target.max_len}")
    first = 0
    for (cache, index), span in zip(parts, spans):
        rows = slice(first, first + len(index))
        source = slice(cache.length - span, cache.length)
        destination = slice(length - span, length)
        whole = len(index) == cache.batch_size and bool((index == torch.arange(len(index), device=index.device)).all())
        k, v = cache.k[:, :, :, source], cache.v[:, :, :, source]  # (S, B, H, span, hd) views
        target.k[:, rows, :, destination] = k if whole else k.index_select(1, index)  # copied once
        target.v[:, rows, :, destination] = v if whole else v.index_select(1, index)
        target.key_pos[rows, destination] = cache.key_pos[index][:, source]
        target.next_pos[rows] = cache.next_pos[index]
        first += len(index)
    for name in {name for cache, _ in parts for name in cache.state}:
        like = next(cache.state[name] for cache, _ in parts if name in cache.state)
        merged = like.new_zeros((target.batch_size, *like.shape[1:]))
        first = 0
        for cache, index in parts:
            if name in cache.state:
                merged[first:first + len(index)] = cache.state[name][index]
            first += len(index)
        target.state[name] = merged
    target.length = length
    target.has_padding = bool((target.key_pos[:, :length] < 0).any())
