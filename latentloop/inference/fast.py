"""The fast decode path: a static-shape cache and one compiled decode step per architecture.

At batch 1 a decode step of a small model is almost all per-op and Python overhead. This module
removes it without a second copy of any model: the model's own eager decode (`decode`, with its
`soft_step` / `step` / fixed-depth `_run_depth`) runs inside `torch.compile`, over a cache whose
decode step has static shapes:

- `static_cache(cache)` turns the cache a model made (`new_cache`, any subclass: rgpt's
  `RecurrentKVCache` too, with the mixin its spec registers) into a `Static…` subclass of its own
  class. Prefill runs eagerly and unchanged (the parent's slicing by Python ints). Then `freeze()`
  switches it to the static mode: each slot's keys/values get a tensor of their own, a new token is written at the time
  slot held in the tensor `write_index` (`index_put_`, in place when compiled; one slot for all
  rows, or with `freeze(per_row=True)` one per row, for continuous batching), attention runs
  over the filled window (the first W slots, W the filled length rounded up to `WINDOW_BUCKET`)
  with a mask built from the `key_pos` tensor, RoPE reads its rows at the position tensor, and
  `advance` bumps the tensors in place. W reaches the compiled step as the size of a marker
  tensor whose dimension is marked dynamic, and nothing else it reads is a Python int that
  changes from step to step, so it compiles once per (batch, buffer length, options) and never
  recompiles as the sequence grows. The buffer is the whole context when that
  fits `FULL_CONTEXT_CACHE_BYTES` (one shape whatever the prompt), else the need bucketed.
- While frozen, `length` reads 0: the decode window is the whole buffer from slot 0 (masked by
  `key_pos`), so the models' "tokens seen + new <= context" checks, which read `length`, pass
  inside the compiled step; `FastDecoder` checks the real bound (`filled`) outside it instead.
- Recurrent state (`cache.state`: fbt's carried top state, lrt's memory) is copied into buffers
  allocated once, so every step reads and writes the same tensors (CUDA graphs need that). On CUDA
  a generation's frozen cache takes the tensors of an earlier one of its shape that nothing holds
  (`StaticBufferPool`), so a loop of generations keeps the addresses its graphs were recorded
  with, and the window grows in powers of two (`window_length`): few shapes, few graphs.
- On CPU the step's weight products (up to `REDUCTION_MAX_ROWS` rows) and its one-query attention
  are rewritten as reductions that inductor generates and fuses itself (`_cpu_decode_backend`):
  torch's matmul runs a one-row product far below the memory bandwidth on the machine this was
  built on, and one attention kernel call per layer cost more than the fused loops. A step's
  products of 5 to 64 rows (continuous batching, a self-speculative verification) call the rows
  kernel (`native.rows_linear_op`), as the eager path's do from 6.
- On CPU the step runs from an AOTInductor package (`inference/aot.py`: `torch.export` of the same
  rewritten step, a shared library on disk bound to the model's own weights), called from C++ with
  no dynamo frame, guards or AOT autograd wrappers in between (about as much time as the kernels
  themselves at batch 1 of a small model), and loaded by a later process in milliseconds without
  importing dynamo. A step that does not export falls back to dynamo's compiled step below. In a
  package the one-query attention over a float32 or float16 cache calls the attention kernel
  (`native.decode_attention_op`, `attention.c`), which streams a long cache faster than the
  reductions (`_attention_for_package`); a float16 cache reaches it as stored (`widened`).
- After a decoder's first call, dynamo's guards are evaluated only where they tell this step's graphs
  apart (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`): the full check cost 80-380 us a
  step at batch 1 (issue 26). Not once the window is the whole buffer: dynamo specialises that
  size, a second graph compiled with its guards checked.
- The compiled code is cached on disk across processes (inductor's FX graph and AOT autograd caches,
  under `compile_cache_dir()`), and each first call's time is recorded (`CompileRecord`), which the
  engine's automatic mode (`AutoCompile`) reads as the cost of compiling.
- `FastDecoder(model, **options)` compiles `step(token) -> (logits (B, V), greedy ids (B,))`:
  the greedy argmax runs inside the compiled region; sampling with a `torch.Generator` stays
  outside (in the engine's `sample_next`), since a generator is host state that dynamo does not
  trace. On CPU inductor emits a C++ wrapper around its kernels (`cpp_wrapper`): at batch 1 the
  Python wrapper was a fifth of the step. On CUDA the step is compiled with
  `mode="reduce-overhead"` (CUDA graphs), the cache tensors marked static; that path is written
  but was not run here (no GPU on the machine it was built on).

What does not compile, and falls back to eager (`FastDecoder.supports` says why):
- rgpt's adaptive exit (`exit_threshold > 0`): how many core steps run depends on the data (the
  exit test reads the device), so the whole step stays eager; fixed depth (`steps=`, every
  `cache_mode`) compiles;
- self-speculative decoding of several rows (they accept drafts of different lengths; the static
  cache's rows share one write position): one row's rounds compile (`inference/speculative.py`);
- prefill (every arch): run once per call, its shapes change with the prompt, so compiling it
  would cost more than it saves; it runs eagerly into the same cache.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import tempfile
import threading
import time
import types
import weakref
from pathlib import Path

import torch
from torch import Tensor

from ..models.backbone import GPT
from ..models.cache import AttentionPlan, KVCache, row_span, zeros_on_touch
from ..util import CACHE_ENV, default_cache_dir, first_line, warn_once
from . import native, quant, torch_internals
from .aot import AotDecodeStep, AotUnavailable, aot_enabled, cpu_vendor, model_code_digest
from .cache_trust import private_temporary_folder, untrusted_folder, unwritable_folder
from .huge_pages import weights_on_huge_pages
from .products import ROWS_KERNEL_MAX_ROWS

# The static cache's length is rounded up to a multiple of this when a whole context's buffer would be
# too large (`FULL_CONTEXT_CACHE_BYTES`), so prompts of nearby lengths share one compiled step (a new
# max_len is a new shape, hence a recompile).
LENGTH_BUCKET = 64
# Up to this many bytes of keys/values, the static cache holds the model's whole context: one shape per
# (batch, options) whatever the prompt and budget, so one compile (and one entry in the on-disk
# compile cache) serves every call, a chat's turns included. The buffer costs memory, not time: the
# step attends over the filled window only (`WINDOW_BUCKET`). 256 MiB: a 12-layer d=768 model's
# 1024-token context is 72 MiB per row.
FULL_CONTEXT_CACHE_BYTES = 256 * 2**20
# The compiled step attends over the first W slots of the buffer, W the filled length rounded up to
# this (a dynamic dimension of the one compiled graph: W changes without a recompile). Rounding up
# changes the marker tensor that carries W every 16 steps instead of every step; the masked slots
# past the filled length cost at most 15 keys per layer.
WINDOW_BUCKET = 16
# On CUDA the window is a power of two slots, at least CUDA_MIN_WINDOW: CUDA graph trees record a graph per
# distinct input shape (torch warns past `cudagraph_dynamic_shape_warn_limit`, 8), so steps of 16 would
# record up to max_len / 16 graphs (128 at 2,048 slots). Powers of two from 64, capped one bucket short of
# the buffer's end (past that, steps of 16 as on the CPU), record 7 up to 2,048 slots, the whole-buffer
# window included, and attend under twice the filled slots: reads a GPU streams in microseconds here.
CUDA_MIN_WINDOW = 64


def window_length(needed: int, max_len: int, device_type: str) -> int:
    """The attended window for `needed` slots in a buffer of `max_len`: `needed` rounded up to
    WINDOW_BUCKET, never past max_len; on CUDA a power of two of at least CUDA_MIN_WINDOW while that
    stays a bucket short of the buffer's end (the whole buffer is a graph of its own: a server's rows
    have a bucket more than their context, so they never reach it)."""
    bucketed = min(max_len, -(-needed // WINDOW_BUCKET) * WINDOW_BUCKET)
    top = (max_len - 1) // WINDOW_BUCKET * WINDOW_BUCKET  # the last bucket boundary short of the end
    if device_type != "cuda" or needed > top:
        return bucketed
    return min(top, max(CUDA_MIN_WINDOW, 1 << (needed - 1).bit_length()))


def bucketed_length(needed: int, context: int) -> int:
    """max_len for `needed` tokens: rounded up to LENGTH_BUCKET, never beyond the context."""
    return min(context, -(-needed // LENGTH_BUCKET) * LENGTH_BUCKET)


def static_length(model, batch_size: int, needed: int, **options) -> int:
    """The static cache's max_len: the whole context when its keys/values fit
    `FULL_CONTEXT_CACHE_BYTES`, else `needed` bucketed."""
    context = model.config.sequence_len
    per_token = model.new_cache(batch_size, 1, **options).memory_bytes()  # keys, values, positions of one token
    return context if per_token * context <= FULL_CONTEXT_CACHE_BYTES else bucketed_length(needed, context)


class StaticBuffers:
    """The tensors a frozen cache decodes through (keys and values, positions, write index, state), lent
    to the next frozen cache of the same shape once nothing holds the one that used them (`user`).

    Why (CUDA): CUDA graph trees record the addresses of a graph's static inputs (these tensors, marked in
    `FastDecoder.attach`) with the graph and record it again when they change (torch 2.13's
    `cudagraph_trees.py`: `StaticInputIdxMismatch`, re-recorded with no limit), keeping every recording:
    a call checks the earlier ones before the one that fits. With new tensors per generation, a loop of
    generations (an eval's prompts) would capture a graph per generation, with two device
    synchronisations, and each step would check one more stale graph per generation before it."""

    def __init__(self, cache: KVCache):
        self.k_slots, self.v_slots, self.state = list(cache.k_slots), list(cache.v_slots), dict(cache.state)
        self.key_pos, self.next_pos, self.write_index = cache.key_pos, cache.next_pos, cache.write_index
        self.user = weakref.ref(cache)

    def refill(self, cache: KVCache) -> None:
        """Make these tensors `cache`'s, holding what its prefill stored (zeros past it, as new ones)."""
        filled = cache._length
        for slots, stored in ((self.k_slots, cache.k), (self.v_slots, cache.v)):
            for slot, tensor in zip(slots, stored.unbind(0)):
                slot.zero_()
                slot[:, :, :filled] = tensor[:, :, :filled]
        for name, value in cache.state.items():
            self.state[name].copy_(value)
        self.key_pos.copy_(cache.key_pos)
        self.next_pos.copy_(cache.next_pos)
        self.write_index.fill_(filled)
        cache.k_slots, cache.v_slots, cache.state = list(self.k_slots), list(self.v_slots), dict(self.state)
        cache.key_pos, cache.next_pos, cache.write_index = self.key_pos, self.next_pos, self.write_index
        self.user = weakref.ref(cache)


# Sets of frozen-cache tensors a model's pool keeps (`StaticBufferPool`): the shapes a process decodes in
# turn (a batch size or two, a cache dtype); past it the least recently used set nothing holds is freed.
POOL_SETS = 4


class StaticBufferPool:
    """A model's `StaticBuffers` by the shape of the cache they fit, at most POOL_SETS of them (a set in
    use is never dropped: it is the caller's memory until the cache goes)."""

    def __init__(self) -> None:
        self._sets: collections.OrderedDict[tuple, StaticBuffers] = collections.OrderedDict()

    @staticmethod
    def shape_of(cache: KVCache, kv_dtype: torch.dtype | None) -> tuple:
        """What an unfrozen cache's tensors must match to take a set: its class, keys' shape and stored
        dtype, write positions, device, state, and inference mode (an inference tensor cannot be written
        outside it)."""
        return (type(cache), tuple(cache.k.shape), kv_dtype or cache.k.dtype, cache.per_row, cache.key_pos.device,
                torch.is_inference_mode_enabled(),
                tuple((name, tuple(value.shape), value.dtype) for name, value in sorted(cache.state.items())))

    def take(self, cache: KVCache, kv_dtype: torch.dtype | None) -> bool:
        """Make a free set of `cache`'s shape the cache's (`StaticBuffers.refill`); False where none is."""
        key = self.shape_of(cache, kv_dtype)
        buffers = self._sets.get(key)
        if buffers is None or buffers.user() is not None:
            return False
        buffers.refill(cache)
        self._sets.move_to_end(key)
        self._trim()
        return True

    def keep(self, cache: KVCache, kv_dtype: torch.dtype | None) -> None:
        """Keep a just-frozen cache's new tensors to lend on, unless its shape has a set (in use: the
        shape keeps that one)."""
        key = self.shape_of(cache, kv_dtype)
        if key in self._sets:
            return
        self._sets[key] = StaticBuffers(cache)
        self._trim()

    def _trim(self) -> None:
        """Down to POOL_SETS sets where sets nothing holds can go, the least recently used first."""
        free = [key for key, buffers in self._sets.items() if buffers.user() is None]
        for key in free[:max(0, len(self._sets) - POOL_SETS)]:
            del self._sets[key]

    def clear(self) -> None:
        """Drop every set (the memory of those no cache holds is freed)."""
        self._sets.clear()

    def __len__(self) -> int:
        return len(self._sets)


def static_buffers(model) -> StaticBufferPool:
    """`model`'s pool of frozen-cache tensors (`StaticBufferPool`), kept beside its compiled steps and
    dropped with them (`forget_compiled`)."""
    return compiled_steps(model).buffers


class StaticCacheMixin:
    """The static decode mode, mixed in front of a `KVCache` class (see the module docstring)."""

    static: bool
    write_index: Tensor  # (1,) long, or (B,) per row: the time slot the next decoded token is written to
    per_row: bool  # each row writes at its own slot (rows join and leave: `place`, `vacate`, `rows_view`)
    is_view: bool  # `rows_view` made it: its tensors are views of another cache's
    rows: Tensor  # (B,) long: 0..B-1, the row index that goes with a per-row `write_index`
    filled: int  # slots stored in the fullest row (the real length while frozen; checked outside compiled code)
    window: Tensor  # (W,) uninitialised: its size is the attended length W (a dynamic dimension)

    @property
    def length(self) -> int:
        return 0 if self.static else self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length = value

    def freeze(self, per_row: bool = False, kv_dtype: torch.dtype | None = None,
               pool: StaticBufferPool | None = None) -> None:
        """Switch to the static decode mode (after prefill). Each slot's keys/values move into a
        tensor of its own: a compiled step that writes into a view of one (S, ...) tensor is
        functionalised into a copy of the whole tensor per write (measured: every slot's cache
        copied twice per step), while a write into an input tensor of its own stays in place.
        State tensors become fixed buffers. `k` / `v` are dropped: the slots hold the data now.
        `per_row`: a write position per row (a scatter per write, which looked about a fifth slower
        for the compiled step at batch 1, timed under load on the project's machine, so a
        generation's rows share one). `kv_dtype`: the slots' dtype (default: the prefill's), e.g.
        float16 as llama.cpp's default cache stores them; the step computes in the model's dtype.
        `pool` (`static_buffers(model)`): take the tensors of an earlier frozen cache of this shape that
        nothing holds any more (`StaticBuffers`) instead of new ones, and lend these on when done."""
        self.filled = self._length
        self.per_row = per_row
        self.is_view = False
        self.rows = torch.arange(self.batch_size, device=self.key_pos.device)
        if pool is None or not pool.take(self, kv_dtype):
            self.write_index = torch.full((self.batch_size if per_row else 1,), self._length, dtype=torch.long,
                                          device=self.key_pos.device)
            self.k_slots = [self._slot_from(t, kv_dtype) for t in self.k.unbind(0)]  # S x (B, H, L, hd)
            self.v_slots = [self._slot_from(t, kv_dtype) for t in self.v.unbind(0)]
            self.state = {name: value.clone() for name, value in self.state.items()}
            if pool is not None:
                pool.keep(self, kv_dtype)
        self.k = self.v = None
        self.window = torch.empty(0, device=self.key_pos.device)
        self.static = True
        self.set_window()

    def _slot_from(self, stored: Tensor, kv_dtype: torch.dtype | None) -> Tensor:
        """A slot's buffer (B, H, L, hd) in `kv_dtype` holding `stored`'s filled slots, zeros after them
        (the operating system's, as the pages are touched: `zeros_on_touch`). Copying the whole buffer
        wrote the unfilled rest too, and touched every page of it."""
        slot = zeros_on_touch(tuple(stored.shape), kv_dtype or stored.dtype, stored.device)
        slot[:, :, :self._length] = stored[:, :, :self._length]
        return slot

    def set_window(self, new_tokens: int = 1) -> None:
        """Before each step, outside compiled code: the attended window covers the tokens about to be
        written (`filled + new_tokens` slots, rounded up as `window_length` says, at most max_len). Its
        length travels as the size of `window`, marked dynamic, so the compiled step slices by a
        symbolic length instead of recompiling for each."""
        if self.filled + new_tokens <= self.window.shape[0]:
            return
        W = window_length(self.filled + new_tokens, self.max_len, self.key_pos.device.type)
        self.window = torch.empty(W, device=self.key_pos.device)
        if "torch._dynamo" in sys.modules:  # else no dynamo step reads the mark, and importing it costs seconds
            torch._dynamo.maybe_mark_dynamic(self.window, 0)

    # -- rows that come and go (continuous batching, `serve.batch.SlotBatch`), outside compiled code:
    # `place` a prefilled row, `vacate` a row that left, `rows_view` / `move_row` to grow or shrink --
    def place(self, row: int, source: KVCache, source_row: int) -> int:
        """Put row `source_row` of an ordinary cache (a prefill's) into row `row` of this frozen one,
        its stored slots from slot 0 on, with its positions and state: it decodes on exactly as it
        would have in its own cache. Returns the slots it fills. Needs `freeze(per_row=True)`."""
        if not self.per_row:
            raise ValueError("place needs a write position per row: freeze(per_row=True)")
        index = torch.tensor([source_row], device=source.key_pos.device)
        span = row_span(source, index)
        if span >= self.max_len:
            raise ValueError(f"place: {span} slots do not fit a static cache of max_len {self.max_len}")
        stored = slice(source.length - span, source.length)
        for slot in range(len(self.k_slots)):
            self.k_slots[slot][row, :, :span] = source.k[slot, source_row, :, stored]
            self.v_slots[slot][row, :, :span] = source.v[slot, source_row, :, stored]
        self.key_pos[row] = -1
        self.key_pos[row, :span] = source.key_pos[source_row, stored]
        self.next_pos[row] = source.next_pos[source_row]
        self.write_index[row] = span
        for name, value in source.state.items():
            if name not in self.state:  # the first row placed brings the state's shape
                if self.is_view:  # a state of its own would not be its storage's
                    raise ValueError(f"place: the state {name!r} is not in the cache this one views: place a "
                                     f"row into that cache first")
                self.state[name] = value.new_zeros((self.batch_size, *value.shape[1:]))
            self.state[name][row] = value[source_row]
        return span

    def vacate(self, rows: Tensor, filled: int | None = None) -> None:
        """Rows no request uses: back to an empty row at position 0, so a free row that decodes on
        (unseen) never writes past its first slot. What they stored is zeroed: the next request in
        such a row attends over a window that covers those slots, masked, and a masked value that is
        not finite (a float16 cache that overflowed) would still reach its output through 0 x inf.
        `filled`: the most slots any of them filled, where the caller knows it (else read from the
        rows' write positions: a device sync)."""
        if filled is None:
            filled = int(self.write_index[rows].max()) if rows.numel() else 0
        if filled:  # a row already vacated filled nothing since: no writes on the step path
            for k_slot, v_slot in zip(self.k_slots, self.v_slots):
                k_slot[rows, :, :filled] = 0
                v_slot[rows, :, :filled] = 0
        self.key_pos[rows] = -1
        self.next_pos[rows] = 0
        self.write_index[rows] = 0

    def rows_view(self, batch_size: int) -> KVCache:
        """The first `batch_size` rows of this frozen per-row cache as a cache of their own that shares
        its storage (views: what either writes, both see). Continuous batching keeps one cache of
        the most rows it has held and decodes a view of a power-of-two prefix of it, so the batch
        grows and shrinks without copying the rows that stay (a copy of every row's whole buffer was
        a fifth of a loaded server's time). The view's window starts empty: set by the next step."""
        if not self.per_row or batch_size > self.batch_size:
            raise ValueError(f"rows_view needs a per-row frozen cache of at least {batch_size} rows")
        view = copy.copy(self)
        view.k_slots = [t[:batch_size] for t in self.k_slots]
        view.v_slots = [t[:batch_size] for t in self.v_slots]
        view.key_pos, view.next_pos = self.key_pos[:batch_size], self.next_pos[:batch_size]
        view.write_index, view.rows = self.write_index[:batch_size], self.rows[:batch_size]
        view.state = {name: value[:batch_size] for name, value in self.state.items()}
        view.stats = {name: list(values) for name, values in self.stats.items()}
        view.window = self.window.new_empty(0)
        view.is_view = True
        return view

    def move_row(self, source: int, target: int, span: int) -> None:
        """Row `source`'s first `span` slots, its positions, write position and state into row
        `target` (the source row is left as it was). Slots past `span` are not copied: `key_pos`
        marks them empty."""
        for k_slot, v_slot in zip(self.k_slots, self.v_slots):
            k_slot[target, :, :span] = k_slot[source, :, :span]
            v_slot[target, :, :span] = v_slot[source, :, :span]
        for tensor in (self.key_pos, self.next_pos, self.write_index, *self.state.values()):
            tensor[target] = tensor[source]

    def memory_bytes(self) -> int:
        if not self.static:
            return super().memory_bytes()
        tensors = [*self.k_slots, *self.v_slots, self.key_pos, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def begin(self, T: int, pad_mask: Tensor | None = None) -> AttentionPlan:
        if not self.static:
            return super().begin(T, pad_mask)
        if pad_mask is not None or (T != 1 and self.per_row):
            raise ValueError("a frozen static cache decodes unpadded tokens, one per row per step when each row "
                             "writes at its own slot")
        if T > 1:  # several tokens at once (self-speculative decoding's verification): `begin_tokens`
            return self.begin_tokens(T)
        positions = self.next_pos[:, None].clone()  # (B, 1); a copy, as next_pos moves on below
        if self.per_row:
            self.key_pos[self.rows, self.write_index] = positions[:, 0]  # index_put_: inductor keeps it in place
        else:
            self.key_pos[:, self.write_index] = positions
        self.next_pos.add_(1)
        self.pending = 1
        key_pos = self.key_pos[:, :self.window.shape[0]]  # (B, W): the filled part (and a few empty slots)
        visible = (key_pos >= 0) & (key_pos <= positions)  # (B, W): stored, not in the future
        return AttentionPlan(positions, visible[:, None, None, :], False)  # mask (B, 1, 1, W)

    def update(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if not self.static:
            return super().update(slot, k, v)
        self._write(self.k_slots[slot], self.v_slots[slot], k, v)
        k_slot, v_slot = self.k_slots[slot], self.v_slots[slot]
        W = self.window.shape[0]
        # (B, H, W, hd): attention over the window only, in the step's dtype; a narrower `kv_dtype` is
        # widened as it is read (compiled: in registers, inside the attention's loops)
        return widened(k_slot[:, :, :W], k.dtype), widened(v_slot[:, :, :W], v.dtype)

    def begin_tokens(self, T: int) -> AttentionPlan:
        """`begin` for T > 1 tokens per row, written at the T slots from the shared write position
        (`write_slots`), each seeing the stored keys and the new ones up to itself."""
        self.write_slots = self.write_index + torch.arange(T, device=self.key_pos.device)  # (T,)
        positions = self.next_pos[:, None] + torch.arange(T, device=self.key_pos.device)  # (B, T)
        self.key_pos[:, self.write_slots] = positions
        self.next_pos.add_(T)
        self.pending = T
        key_pos = self.key_pos[:, :self.window.shape[0]]  # (B, W)
        visible = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= positions[:, :, None])  # (B, T, W)
        return AttentionPlan(positions, visible[:, None], False)  # mask (B, 1, T, W)

    def _write(self, k_slot: Tensor, v_slot: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v (B, H, T, hd) into the slot's buffers at the write position (index_put_: in place
        when compiled); T > 1 only with a shared write position (`begin_tokens`)."""
        k, v = k.to(k_slot.dtype), v.to(v_slot.dtype)  # a `kv_dtype` of the slots' own (`freeze`)
        if self.pending > 1:
            k_slot[:, :, self.write_slots] = k
            v_slot[:, :, self.write_slots] = v
        elif self.per_row:
            k_slot[self.rows, :, self.write_index] = k[:, :, 0]
            v_slot[self.rows, :, self.write_index] = v[:, :, 0]
        else:
            k_slot[:, :, self.write_index] = k
            v_slot[:, :, self.write_index] = v

    def read(self, slot: int) -> tuple[Tensor, Tensor]:
        """The keys/values (B, H, T, hd) of the tokens being decoded in `slot` (as written so far)."""
        if self.pending > 1:
            return self.k_slots[slot][:, :, self.write_slots], self.v_slots[slot][:, :, self.write_slots]
        if self.per_row:
            return (self.k_slots[slot][self.rows, :, self.write_index][:, :, None],
                    self.v_slots[slot][self.rows, :, self.write_index][:, :, None])
        return self.k_slots[slot][:, :, self.write_index], self.v_slots[slot][:, :, self.write_index]

    def advance(self) -> None:
        if not self.static:
            return super().advance()
        self.write_index.add_(self.pending)
        if self.pending > 1:
            self.write_slots = None  # not a tensor: an ahead-of-time step's inputs are the cache's tensors
        self.pending = 0

    # -- taking tokens back (self-speculative decoding), outside compiled code --
    def keep_recent(self, kept: Tensor, n: int, clear: bool = True) -> None:
        """`KVCache.keep_recent` while frozen: of the last `n` slots written, keep the first
        `kept` (the same count for every row: the rows share one write position) and give the
        rest back, their keys/values zeroed (`clear`; not when the next step writes them all again)
        and positions emptied, as a fresh cache's."""
        if not self.static:
            return super().keep_recent(kept, n)
        counts = set(kept.tolist())
        if self.per_row or len(counts) != 1 or not 0 <= n <= self.filled or self.pending:
            raise ValueError(f"a frozen static cache takes back the same slots of every row: kept {sorted(counts)} "
                             f"of {n} (filled {self.filled}, pending {self.pending})")
        drop = n - min(counts.pop(), n)
        if drop == 0:
            return
        start, end = self.filled - drop, self.filled
        self.key_pos[:, start:end] = -1
        if clear:
            for slot in (*self.k_slots, *self.v_slots):
                slot[:, :, start:end] = 0
        self.next_pos.sub_(drop)
        self.write_index.sub_(drop)
        self.filled -= drop


_STATIC_CLASSES: dict[type, type] = {}
# cache class -> the mixin an architecture adds before `StaticCacheMixin` for its caches (its spec's
# `static_cache_mixins`, installed when the spec is registered): what its cache does besides storing
# keys and values (rgpt's core-step views), in the static mode
_STATIC_MIXINS: dict[type, type] = {}


def register_static_mixin(cache_class: type, mixin: type) -> None:
    """Caches of `cache_class` (and its subclasses) get `mixin` before the static mode's own methods."""
    _STATIC_MIXINS[cache_class] = mixin
    _STATIC_CLASSES.clear()  # made again with the mixin


def static_cache(cache: KVCache) -> KVCache:
    """`cache` (empty, as `model.new_cache` made it) given the static decode mode, not yet frozen."""
    cls = type(cache)
    if cls not in _STATIC_CLASSES:
        mixins = tuple(dict.fromkeys(_STATIC_MIXINS[base] for base in cls.__mro__ if base in _STATIC_MIXINS))
        _STATIC_CLASSES[cls] = type(f"Static{cls.__name__}", (*mixins, StaticCacheMixin, cls), {})
    length = cache.__dict__.pop("length")
    cache.__class__ = _STATIC_CLASSES[cls]
    cache.static = False
    cache.length = length
    return cache


def fallback_reason(model, options: dict) -> str | None:
    """Why this model with these options decodes eagerly, or None when its step compiles."""
    blocker = getattr(model, "fast_path_blocker", None)
    reason = None if blocker is None else blocker(options)
    if reason is None and model.wte.weight.device.type == "cpu" and native.cxx_compiler() is None:
        return native.NO_CXX
    return reason


# model -> step key -> why its compiled step failed (`FastDecoder._decode_eagerly_after`)
_FAILED_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_CACHE_POSITIONS = ("key_pos", "next_pos", "write_index")  # what a decode step advances besides its slots


def _positions_and_state(cache: KVCache) -> dict[str | tuple[str, str], Tensor]:
    """Copies of what a decode step advances (positions, the carried state), to put back where a
    compiled call failed part way: the eager retry then runs the step once, not on top of half of it
    (the key and value slots it wrote are written again at the same places)."""
    saved = {name: getattr(cache, name).clone() for name in _CACHE_POSITIONS
             if isinstance(getattr(cache, name, None), Tensor)}
    state = getattr(cache, "state", None) or {}
    saved.update({("state", name): value.clone() for name, value in state.items() if isinstance(value, Tensor)})
    return saved


def _put_back(cache: KVCache, saved: dict) -> None:
    for name, value in saved.items():
        (cache.state[name[1]] if isinstance(name, tuple) else getattr(cache, name)).copy_(value)


class FastDecoder:
    """A model's decode step, compiled once per (model, options, shapes): `new_cache`, then the
    model's eager `prefill`, then `begin_decoding(cache)`, then `step(token)` per new token.

    `adopt(cache)` takes over an ordinary cache (`model.new_cache(B, static_length(...))`) part way
    through a decode: the engine's automatic mode decodes its first steps eagerly through the
    ordinary cache, and switches here only when compiling pays (`AutoCompile`).
    `on_compile(message)` hears when the first call of a compiled step starts (it compiles, or loads
    the compiled code from the on-disk cache) and when it ends. `kv_dtype`: the dtype the frozen
    cache stores keys and values in (`StaticCacheMixin.freeze`; None: the model's)."""

    def __init__(self, model, compile: bool = True, on_compile=None, kv_dtype: torch.dtype | None = None,
                 **options):
        self.model, self.options, self.on_compile, self.kv_dtype = model, options, on_compile, kv_dtype
        self.reason = fallback_reason(model, options)
        device = model.wte.weight.device
        self.cuda = device.type == "cuda"
        self._compiled = bool(compile) and self.reason is None
        # a frozen cache takes the tensors of an earlier one of its shape (`StaticBuffers`): CUDA graphs
        self.stable_addresses = self.cuda and self._compiled
        self._step = self._eager_step
        self.skip_guards = True  # after the first call (see `step`); False checks them every call (benchmarks)
        self.aot: AotDecodeStep | None = None  # the ahead-of-time step (CPU), tried before dynamo's
        self.aot_reason: str | None = None  # why this decoder runs dynamo's step instead, once known
        self._key = step_key(device.type, options, kv_dtype)
        failed = _FAILED_STEPS.get(model, {}).get(self._key)
        if self._compiled and failed is not None:  # an earlier decoder's compile of this step failed
            self._compiled, self.reason = False, failed
            self.stable_addresses = False
        if self._compiled:
            use_compile_cache()
            if device.type == "cpu":  # before any compiled step binds the weights (`huge_pages`)
                weights_on_huge_pages(model)
            if device.type == "cpu" and aot_enabled():
                self.aot_reason = AotDecodeStep.refuses(model)
                if self.aot_reason is None:  # one per model and options: its packages load once a process
                    per_model = compiled_steps(model)
                    key = (*self._key, AOT_BACKEND)
                    if key not in per_model:
                        per_model[key] = AotDecodeStep(model, options, _decode_step)
                    self.aot = per_model[key]
            if self.aot is None:
                self._step = self._dynamo_step()
        self.cache: KVCache | None = None
        # (cache, its key_pos, torch's threads) of the last step, when its shape had run before (`step`):
        # new tensors (another cache, a view of other rows: a new key_pos) or thread count look the shape up again
        self._ran_with: tuple | None = None

    def __del__(self, _finalizing=sys.is_finalizing) -> None:  # bound here: globals may be gone at exit
        if not _finalizing():
            release_package_cache(self)

    def _dynamo_step(self):
        """Dynamo's compiled step, one per model and options (made on first need: `torch.compile`
        imports dynamo, seconds that a decoder running an ahead-of-time package never pays)."""
        per_model = compiled_steps(self.model)
        if self._key not in per_model:
            per_model[self._key] = _compiled_step(self._key[0])
        return per_model[self._key]

    def _fall_back_to_dynamo(self, error: AotUnavailable) -> None:
        """This decoder's step has no package (`error` says why): dynamo's compiled step from now on."""
        self.aot, self.aot_reason, self._step = None, str(error), self._dynamo_step()
        self._ran_with = None  # dynamo's graph is a shape of its own

    @property
    def compiled(self) -> bool:
        return self._compiled

    def new_cache(self, batch_size: int, needed: int) -> KVCache:
        max_len = static_length(self.model, batch_size, needed, **self.options)
        return static_cache(self.model.new_cache(batch_size, max_len, **self.options))

    def adopt(self, cache: KVCache) -> None:
        """Continue an ordinary cache's decode on this decoder's step (`static_cache` + `begin_decoding`)."""
        self.begin_decoding(static_cache(cache))

    def begin_decoding(self, cache: KVCache) -> None:
        """After the prefill: freeze the cache (static buffers, tensor positions), on the tensors of an
        earlier one of its shape where addresses must stay (`stable_addresses`)."""
        cache.freeze(kv_dtype=self.kv_dtype, pool=static_buffers(self.model) if self.stable_addresses else None)
        self.attach(cache)

    def attach(self, cache: KVCache) -> None:
        """Decode a frozen static cache from now on (again whenever its tensors change: another cache,
        or a view of other rows of the same storage)."""
        self.model.prepare_fast_decoding()  # e.g. fbt's gate table: computed here, read as is when compiled
        if self.aot is not None:
            self.aot.forget()
        if self.cuda and self.compiled:  # CUDA graphs may mutate these only as static inputs
            for tensor in (*cache.k_slots, *cache.v_slots, cache.key_pos, cache.next_pos, cache.write_index,
                           *cache.state.values()):
                torch._dynamo.mark_static_address(tensor)
        self.cache = cache

    def step(self, token: Tensor) -> tuple[Tensor, Tensor, dict]:
        """token (B,) -> logits (B, V), greedy next ids (B,), what the model reported. The logits and
        ids may be tensors the next step writes again (a CPU package's, as CUDA graphs' outputs are):
        copy what is kept past it. The ids may be passed back as the next token (on CUDA they are a
        copy, made here)."""
        cache = self.cache
        if cache.filled + 1 > cache.max_len:
            raise ValueError(f"cache overflow: {cache.filled} + 1 tokens > max_len {cache.max_len}")
        cache.set_window()
        # A window as long as the whole buffer slices every key: dynamo specialises that size (a graph
        # of its own, compiled once when a generation reaches the end of the buffer), so those steps
        # keep their guards; skipping them there raised "Recompilation triggered" (found generating up
        # to the context's end)
        threads, last = torch.get_num_threads(), self._ran_with
        inside = self.window_inside_buffer(cache)  # the full-length window is a graph / package of its own
        # as the last step: no key to build and look up (identities: `==` would compare tensors)
        ran = (last is not None and last[0] is cache and last[1] is cache.key_pos and last[2] == threads
               and last[3] == inside)
        if not ran:
            ran = self.compiled and self._shape(cache) in _RAN_SHAPES.get(self.model, ())
            self._ran_with = (cache, cache.key_pos, threads, inside) if ran else None
        packaged, skip_guards = None, self.skip_guards and inside
        if ran and self.aot is not None:  # a package: no guards, any window
            try:
                packaged = self.aot(self.model, token, cache, self.options)
            except AotUnavailable as error:  # this shape ran on dynamo's step in an earlier decoder
                self._fall_back_to_dynamo(error)
                skip_guards = False  # its first call here checks them
        if packaged is not None:
            logits, greedy, info = packaged
        elif not self.compiled:
            logits, greedy, info = self._step(self.model, token, cache, self.options)
        else:
            with DYNAMO_STEPS_LOCK:
                if not ran:
                    logits, greedy, info = self._first_compiled_step(token)
                elif skip_guards:
                    # Dynamo checks its guards before every call (80-380 us a step measured at batch 1, issue
                    # 26). This decoder's graph exists for these shapes and the window is a dynamic dimension,
                    # so the only guards that matter are those telling this graph from others of the same step
                    # (other batch sizes or lengths): `skip_guard_eval_unsafe` evaluates just those.
                    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                        logits, greedy, info = self._step(self.model, token, cache, self.options)
                else:
                    logits, greedy, info = self._step(self.model, token, cache, self.options)
        cache.filled += 1
        if self.cuda and self.compiled:
            # CUDA graph trees free a call's outputs when the next call begins (each call in inference is
            # a new iteration), and the engine passes these ids back as that call's input: B integers
            # copied out of the graph's pool, as gpt-fast copies its next token
            greedy = greedy.clone()
        return logits, greedy, info

    def _shape(self, cache: KVCache) -> tuple:
        """What tells this step's compiled graphs apart (`_RAN_SHAPES`): the package or dynamo's graph,
        options, rows, buffer length, one write position or one per row, and whether the window is the
        whole buffer (compiled on its own when a generation first reaches the buffer's last
        `WINDOW_BUCKET` slots: through `_first_compiled_step`, so announced and recorded, where it had
        stalled a generation for a whole compile without a word)."""
        key = (*self._key, AOT_BACKEND) if self.aot is not None else self._key
        if not self.window_inside_buffer(cache):
            key = (*key, FULL_WINDOW)
        return ran_shape(key, cache.batch_size, cache.max_len, cache.per_row)

    @staticmethod
    def window_inside_buffer(cache: KVCache) -> bool:
        """The attended window is shorter than the buffer (the one size the first graph covers)."""
        return cache.window.shape[0] < cache.max_len

    def _first_compiled_step(self, token: Tensor) -> tuple[Tensor, Tensor, dict]:
        """The first call: dynamo traces, inductor compiles or loads from its cache; timed, announced
        and recorded (`CompileRecord`), so the automatic mode knows what the next process pays."""
        full = not self.window_inside_buffer(self.cache)
        record = CompileRecord(self.model, self.options, self.cache, self.kv_dtype, full_window=full)
        expected = record.expected_seconds()
        if self.on_compile is not None:
            known = (f"its ahead-of-time package is gone from the cache, built again: {about_seconds(expected)}"
                     if record.package_gone() else f"{about_seconds(expected)}, as last time" if record.seen() else
                     f"the first time for this model and shape: {about_seconds(expected)} or more")
            which = "the decode step for the buffer's last tokens" if full else "the decode step"
            self.on_compile(f"compiling {which} ({known}; cached in {compile_cache_dir()}) ...")
        start = time.perf_counter()
        if self.aot is not None:
            try:
                self.aot.prepare(self.cache)  # load this shape's package, or export and compile it
            except AotUnavailable as error:
                self._fall_back_to_dynamo(error)
                if self.on_compile is not None:
                    self.on_compile(f"no ahead-of-time step ({error}); compiling with dynamo instead ...")
        prepared = time.perf_counter()
        if self.aot is not None:
            result = self.aot(self.model, token, self.cache, self.options)
        else:
            before = _positions_and_state(self.cache)  # what a failed call may have advanced already
            try:
                result = self._step(self.model, token, self.cache, self.options)
            except Exception as error:  # noqa: BLE001 - the compiler's failure, not the model's: see below
                _put_back(self.cache, before)
                return self._decode_eagerly_after(error, token)
        seconds = time.perf_counter() - start
        _RAN_SHAPES.setdefault(self.model, set()).add(self._shape(self.cache))
        if self.aot is not None and self.aot.compiled_now:  # the next process only loads the package
            record.add(self.aot.load_seconds + time.perf_counter() - prepared, package=self.aot.package_path,
                       compile_seconds=seconds)
        else:
            record.add(seconds)
        if self.on_compile is not None:
            loaded = self.aot is not None and not self.aot.compiled_now
            self.on_compile(f"decode step {'loaded, compiled ahead of time,' if loaded else 'compiled'} in "
                            f"{seconds:.1f} s")
        return result

    def _decode_eagerly_after(self, error: Exception, token: Tensor) -> tuple[Tensor, Tensor, dict]:
        """Dynamo's first call failed (a C++ compiler that is there but fails, a damaged file in
        inductor's own cache): this decoder decodes eagerly from now on, saying why once, instead of
        ending the generation in the compiler's traceback. The same step then runs eagerly: a fault
        of the model's own is raised there, as it would be without compiling."""
        self._compiled, self.stable_addresses, self._step = False, False, self._eager_step
        self.reason = f"compiling the decode step failed: {type(error).__name__}: {first_line(error)}"
        # remembered for the model: a later decoder of these options starts eager, not with another failed compile
        _FAILED_STEPS.setdefault(self.model, {})[self._key] = self.reason
        message = f"{self.reason}; decoding eagerly"
        if self.on_compile is not None:
            self.on_compile(message)
        else:
            warn_once(message)
        return self._step(self.model, token, self.cache, self.options)

    @staticmethod
    def _eager_step(model, token: Tensor, cache: KVCache, options: dict) -> tuple[Tensor, Tensor, dict]:
        return _decode_step(model, token, cache, options)


# --------------------------------------------------------------------------------------------
# Compile cost: the on-disk cache, and what the first call cost before
# --------------------------------------------------------------------------------------------

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor's own cache root (FX graph and AOT autograd caches)


INDUCTOR_DEFAULT_PREFIX = "torchinductor_"  # inductor's default cache: <temp dir>/torchinductor_<user>


def configured_compile_cache_dir() -> Path:
    """Where compiled decode steps are asked to be kept across processes: $TORCHINDUCTOR_CACHE_DIR when
    the user set it, else the latentloop cache's `inductor/` (so `LATENTLOOP_CACHE` moves it with the
    other caches). Importing dynamo writes inductor's default (a folder in the temp dir, lost at reboot)
    into the variable, and child processes inherit it, so a folder of that name counts as unset. It
    is recognised by its name, not by asking inductor: importing torch._inductor costs seconds, and
    the automatic mode reads its compile records here on every decision, compiling or not."""
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if not chosen:
        return default_cache_dir() / "inductor"
    path = Path(os.path.abspath(chosen))
    if path.parent == Path(os.path.abspath(tempfile.gettempdir())) and path.name.startswith(INDUCTOR_DEFAULT_PREFIX):
        return default_cache_dir() / "inductor"
    return path


_private_compile_dirs: dict[str, Path] = {}


def compile_cache_dir() -> Path:
    """`configured_compile_cache_dir()` where only this user can have written it (`cache_trust`:
    inductor and the ahead-of-time packages load compiled libraries from it). Elsewhere (a folder
    another user owns, one group or others may write, or one this process cannot make or write) nothing
    is read from it: this process compiles into a private temporary folder of its own, said once on stderr."""
    chosen = configured_compile_cache_dir()
    root = default_cache_dir()  # a folder of its own (a user's $TORCHINDUCTOR_CACHE_DIR) is its own root
    inside = Path(os.path.abspath(chosen)).is_relative_to(os.path.abspath(root))
    # made before it is judged: a folder someone else made first is then seen as theirs. One that cannot
    # be made or written is given up too: inductor writes its graphs there and fails with a traceback
    unwritable = unwritable_folder(chosen)
    reason = unwritable or untrusted_folder(chosen, root if inside else chosen)
    if reason is None:
        return chosen
    key = str(chosen)
    if key not in _private_compile_dirs:  # mode 0700, removed when the process exits
        _private_compile_dirs[key] = private_temporary_folder("latentloop-compiled-")
        verb = "not keeping compiled code in" if unwritable else "not loading compiled code from"
        warn_once(f"{verb} {chosen}: {reason}; compiling into "
                  f"{_private_compile_dirs[key]} for this process (set {CACHE_ENV} to a folder of your own)")
    return _private_compile_dirs[key]


def use_compile_cache() -> None:
    """Point inductor's on-disk caches at `compile_cache_dir()` before a compile (inductor reads the
    variable at each use, so this holds for every later compile of the process, training's too). Both
    caches are on by default in torch (`fx_graph_cache`: inductor's generated code per graph;
    `autograd_cache`: AOT autograd's traced graph), keyed by the graph and torch's version, so a second
    process with the same model shape and options skips inductor's work and pays only dynamo's trace
    and the load."""
    os.environ[INDUCTOR_CACHE_ENV] = str(compile_cache_dir())  # made by it, or a private temporary one


# A first call's cost when nothing is recorded for its (model shape, options, cache shape): the cold
# compile of the tiny/baseline shapes measured on the project's 2-core machine (16 s for 4 layers,
# d=256, quiet; tens of seconds under load, issue 26), so the automatic mode waits for that much
# saving before compiling something it never compiled.
COLD_COMPILE_S = 20.0
RECORDS_KEPT = 8  # first-call times kept per key (the minimum is the estimate: the warm load)


def _recorded_package_missing(data: dict) -> bool:
    """A compile record (`CompileRecord`, as read) names an ahead-of-time package that is not on disk."""
    package = data.get("package")
    return isinstance(package, str) and not os.path.exists(package)


class CompileRecord:
    """What the first call of a compiled step cost for one (torch version, model code, class and
    config, options, cache shape, CPU threads), kept as a small JSON file under
    `compile_cache_dir()/latentloop/`. The minimum over the recorded calls is what the next process
    expects to pay (a warm load, once one process compiled; for an ahead-of-time package the process
    that compiled it records what loading it cost, since that is all a later process pays). Beside it,
    the automatic mode banks the decode time that compiling would have saved in the calls that stayed
    eager (`banked_seconds`), in every process: a command-line user's many short `generate`
    processes add up to a compile as one long process's calls do."""

    def __init__(self, model, options: dict, cache: KVCache, kv_dtype: torch.dtype | None = None,
                 full_window: bool = False):
        config = model.config
        fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else vars(config)
        quantized = sorted({type(m).__name__ for m in model.modules() if getattr(m, "QUANTIZED", False)})
        key = json.dumps([torch.__version__, model_code_digest(), torch.get_num_threads(), type(model).__qualname__,
                          fields, sorted(options.items()), quantized,
                          cache.batch_size, cache.max_len, str(cache.key_pos.device.type)]
                         + (["per_row"] if getattr(cache, "per_row", False) else [])
                         + ([f"kv {kv_dtype}"] if kv_dtype is not None else [])  # its own step
                         + (["full window"] if full_window else []), default=str)
        self.path = compile_cache_dir() / "latentloop" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _seconds(self, data: dict | None = None) -> list[float]:
        """The first calls recorded (in `data`, the record as read; read here when not given): finite and
        not negative only (a NaN in the file made the minimum NaN for good, so the automatic mode never
        compiled that shape again; -5 made it always compile)."""
        try:
            seconds = [float(s) for s in (self._read() if data is None else data).get("first_call_s", [])]
        except (ValueError, TypeError):
            return []
        return [s for s in seconds if math.isfinite(s) and s >= 0]

    def _write(self, **fields) -> None:
        """The record with `fields` replaced, written whole (a reader in another process sees the old
        file or the new one); a read-only cache folder keeps nothing."""
        data = {**self._read(), **fields}
        temp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(suffix=".json", dir=self.path.parent)
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(data) + "\n")
            os.replace(temp, self.path)
        except OSError:
            if temp is not None:  # written part way (a full disk): no stray file left behind
                Path(temp).unlink(missing_ok=True)

    def seen(self) -> bool:
        return bool(self._seconds())

    def package_gone(self) -> bool:
        """The recorded first calls loaded an ahead-of-time package that is no longer on disk (a cleared
        or pruned cache, a package key that changed): the next first call compiles it again. Its
        recorded load time was announced ("under a second, as last time") and counted by the automatic
        mode before a compile of a minute."""
        data = self._read()
        return bool(self._seconds(data)) and _recorded_package_missing(data)

    def expected_seconds(self) -> float:
        data = self._read()  # once: the automatic mode asks before each call's decision
        seconds = self._seconds(data)
        if not seconds:
            return COLD_COMPILE_S
        if _recorded_package_missing(data):  # what compiling it took, when recorded
            compiled = data.get("compile_s")
            return float(compiled) if isinstance(compiled, (int, float)) and math.isfinite(compiled) \
                and compiled >= 0 else COLD_COMPILE_S
        return min(seconds)

    def add(self, seconds: float, package: Path | None = None, compile_seconds: float | None = None) -> None:
        """A first call took `seconds`. After compiling an ahead-of-time package (`package`, in
        `compile_seconds`), `seconds` is what loading it cost: all a later process pays while it is there."""
        fields = {} if package is None else {"package": str(package), "compile_s": round(compile_seconds or 0.0, 3)}
        self._write(first_call_s=(self._seconds() + [round(seconds, 3)])[-RECORDS_KEPT:], **fields)

    def banked_seconds(self) -> float:
        """The saving banked so far by eager calls of this shape, in this and earlier processes (this
        process's also in memory, for a cache folder it cannot write)."""
        try:
            on_disk = float(self._read().get("banked_s", 0.0))
        except (ValueError, TypeError):
            on_disk = 0.0
        return max(on_disk if math.isfinite(on_disk) else 0.0, _BANKED_SAVING.get(self.path, 0.0))

    def bank(self, seconds: float) -> None:
        _BANKED_SAVING[self.path] = seconds
        self._write(banked_s=round(seconds, 6))


# --------------------------------------------------------------------------------------------
# When compiling pays: the automatic mode's rule
# --------------------------------------------------------------------------------------------

# The compiled step's decode time over the eager step's at batch 1, the larger (the smaller saving) of
# `benchmarks.engines`' two shapes in the runs of 2026-12-04 12:32-12:58 (experiments/logs/
# 2026-12-04-engines-one-inference-mode-*): 0.41-0.44 / 3.2-3.4 ms a token (4 layers, d=256, 1 thread)
# and 10.6-12.5 / 33.1-35.6 ms (12 layers, d=768, 2 threads; at most 0.38). Compiling saves
# `1 - COMPILED_OVER_EAGER` of each eager step. (Before the ahead-of-time package: 0.56.)
COMPILED_OVER_EAGER = 0.38
# Eager steps timed before deciding: the first decode step of a call runs cold (allocator, caches),
# so the decision reads the fastest of these.
PROBE_STEPS = 4
# Beyond this batch the automatic mode stays eager: the compiled step's weight products stop being
# reductions past `REDUCTION_MAX_ROWS` rows, and each batch size is another graph to compile.
AUTO_MAX_BATCH = 4  # = REDUCTION_MAX_ROWS


class AutoCompile:
    """The rule of the engine's automatic mode (`stream(compile="auto")`), a ski-rental rule: compile a
    model's step once the decode time that compiling would have saved, in the earlier eager calls of
    this shape (in this process and in earlier ones: `CompileRecord.bank`) plus this call's
    remaining steps, reaches what the first
    compiled call is expected to cost (`CompileRecord`: the last warm load when recorded, else
    `COLD_COMPILE_S`; zero once compiled in this process). The saving per step is measured, not
    assumed: the fastest of the call's first `PROBE_STEPS` eager steps times
    `1 - COMPILED_OVER_EAGER`. Rows beyond `AUTO_MAX_BATCH` and options that do not compile stay eager.
    A call that stops early (a stop token) is counted at its budget."""

    def __init__(self, model, options: dict, kv_dtype: torch.dtype | None = None):
        self.model, self.options, self.kv_dtype = model, options, kv_dtype
        self.key = step_key(next(model.parameters()).device.type, options, kv_dtype)

    def applies(self, batch_size: int) -> bool:
        """The static cache is the backbone's (any other model, e.g. a test's scripted one, decodes as
        it always did), the batch small enough, the options compilable."""
        return (isinstance(self.model, GPT) and batch_size <= AUTO_MAX_BATCH
                and fallback_reason(self.model, self.options) is None)

    def compiled_already(self, cache: KVCache) -> bool:
        """This process compiled (and ran) the step for this model, options and cache shape: free."""
        ran = _RAN_SHAPES.get(self.model, set())
        return any(ran_shape(key, cache.batch_size, cache.max_len, False) in ran
                   for key in (self.key, (*self.key, AOT_BACKEND)))

    def note_compiled(self, cache: KVCache, seconds: float) -> None:
        """A compiled path other than `FastDecoder`'s (self-speculative rounds) ran for these options and
        this cache's shape; its first call took `seconds`: free from now on in this process, and what
        the next process expects to pay."""
        _RAN_SHAPES.setdefault(self.model, set()).add(ran_shape(self.key, cache.batch_size, cache.max_len, False))
        CompileRecord(self.model, self.options, cache, self.kv_dtype).add(seconds)

    def decide(self, eager_step_s: float, remaining_steps: int, cache: KVCache) -> bool:
        """After the probe steps: True to compile the rest of this call. Without compiling, the
        call's estimated saving is banked (`CompileRecord.bank`) for the next decision, in this
        process or a later one."""
        if self.compiled_already(cache):
            return True
        saving = eager_step_s * (1 - COMPILED_OVER_EAGER)
        record = CompileRecord(self.model, self.options, cache, self.kv_dtype)
        total = record.banked_seconds() + (remaining_steps + PROBE_STEPS) * saving
        if total >= record.expected_seconds():
            return True
        record.bank(total)
        return False


# Dynamo's compiled steps run one at a time in a process. `torch.compiler.set_stance` is the process's,
# and each use puts back the stance it found when it ends: two threads' steps that overlapped put back
# each other's, and the unsafe stance of one outlived both (every later compile in the process then
# failed, "Recompilation triggered with skip_guard_eval_unsafe stance"); a step checking its guards, or
# compiling, beside one that skips them was judged by the unsafe stance too. Packages (the CPU's
# ahead-of-time steps) and eager steps take no lock.
DYNAMO_STEPS_LOCK = threading.RLock()

# record path -> seconds of eager decode that compiling would have saved so far, in this process
# (what `CompileRecord.bank` also writes to disk; kept here for a cache folder it cannot write)
_BANKED_SAVING: dict[Path, float] = {}
# model -> {ran_shape(...)}: compiled steps that have run in this process
_RAN_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def release_package_cache(decoder) -> None:
    """A decoder is gone (`FastDecoder`, `speculative.CompiledDrafting`): the model's shared package step
    (`decoder.aot`) lets go of the decoder's cache (`AotDecodeStep.release`). Read with getattr: a
    constructor that raised leaves the object without them."""
    aot, cache = getattr(decoder, "aot", None), getattr(decoder, "cache", None)
    if aot is not None and cache is not None:
        aot.release(cache)


def about_seconds(seconds: float) -> str:
    """A compile's expected time as said before it: "~12 s", or "under a second" for a cached load (which
    read "~0 s")."""
    return "under a second" if seconds < 1 else f"~{seconds:.0f} s"


def step_key(device_type: str, options: dict, kv_dtype: torch.dtype | None = None) -> tuple:
    """What tells a model's compiled steps apart besides their shapes: the device, the options and a
    cache dtype of their own (each a graph of its own; (device type, options) without one)."""
    key = (device_type, tuple(sorted(options.items())))
    return key if kv_dtype is None else (*key, f"kv {kv_dtype}")


def ran_shape(key: tuple, batch_size: int, max_len: int, per_row: bool) -> tuple:
    """The entry of `_RAN_SHAPES` for a step: (device type, options), rows, buffer length, one
    write position or one per row, and torch's CPU threads (each a graph of its own: dynamo
    recompiles when the thread count changes, which under `skip_guard_eval_unsafe` raised
    "Recompilation triggered" in `benchmarks.engines --threads 1,2`)."""
    return key, batch_size, max_len, per_row, torch.get_num_threads()


def keep_state_buffers(cache: KVCache, buffers: dict[str, Tensor]) -> None:
    """After a call that may have replaced the cache's state tensors (`buffers`: `dict(cache.state)`
    before it): their values copied into the fixed buffers, which stay the state."""
    for name, buffer in buffers.items():
        if cache.state[name] is not buffer:
            buffer.copy_(cache.state[name])
            cache.state[name] = buffer


def _decode_step(model, token: Tensor, cache: KVCache, options: dict) -> tuple[Tensor, Tensor, dict]:
    """The model's own decode of one token per row, its state written back into the fixed buffers."""
    buffers = dict(cache.state)
    out = model.decode(token[:, None], cache, **options)
    keep_state_buffers(cache, buffers)
    logits = out.logits[:, -1]
    return logits, logits.argmax(dim=-1), out.info


def _compiled_step(device_type: str):
    """A compiled copy of `_decode_step` (`compiled_copy`)."""
    return compiled_copy(_decode_step, device_type)


def compiled_copy(fn, device_type: str, cuda_graphs: bool = True):
    """`fn` compiled for `device_type`, as a copy with a code object of its own: dynamo keeps its
    graphs and its recompile limit per code object, so each decoder (model, options) gets its own
    instead of every architecture and option sharing one function's limit of recompiles."""
    global _COPIES
    _COPIES += 1
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{_COPIES}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name)
    if device_type == "cuda" and cuda_graphs:  # CUDA graphs (written, not run here: no GPU)
        return torch.compile(copy, mode="reduce-overhead", dynamic=False)
    if device_type == "cpu":
        return compile_cpu_decode(copy)
    return torch.compile(copy, dynamic=False)  # e.g. mps: inductor as it is


def compile_cpu_decode(fn):
    """`fn` compiled for decoding on CPU: static shapes, `_cpu_decode_backend` (stock inductor on a torch
    whose internals it was not tested with: `torch_internals`)."""
    return torch.compile(fn, backend=_cpu_decode_backend if torch_internals.tested() else "inductor", dynamic=False)


# Up to this many rows (batch size x new tokens), a decode step's weight products are rewritten as
# reductions (see `_cpu_decode_backend`). The reduction reads each weight once per row, the matmul
# library once per product, so the rows it may take depend on where the weights live. Measured on the
# project's 2-core machine, every product of a model compiled both ways: the baseline benchmark's
# 12.8 MB of weights (in L3): 1 row 151 vs 478 us, 4 rows 426 vs 1162 us, 16 rows 1464 vs 1880 us;
# 340 MB (12 layers, d=768, from memory): 1 row 11.2 vs 23.7 ms, 2 rows 15.4 vs 41.9, 4 rows 27.1 vs
# 35.5, 8 rows 53.6 vs 32.2 ms. Four rows win in both.
REDUCTION_MAX_ROWS = 4
# A product with more outputs than this (a real vocabulary's head) keeps the library's product where
# that library is MKL on an Intel CPU (`_library_streams_wide_products`): there MKL's one-row product
# streams a 32,000 x 768 head at 16.6 GB/s against the reduction's 12.0 (5.9 vs 8.2 ms, 1 thread, Intel
# Xeon), while the layers' own products (3,072 outputs and fewer) stay faster as reductions inside the
# step (every product on MKL: 37.4 vs 34.9 ms a token at 12 x 768 with the byte vocabulary, 0.91-0.98
# vs 0.74-0.81 ms at 4 x 256). The wide head alone on MKL, 12 x 768 with a 32k head, paired: 45.7 /
# 51.2 / 52.6 vs 53.0 / 57.5 / 59.9 ms (experiments/logs/2026-12-05-issue54-third.md). On the AMD
# EPYC of the figures above, MKL took twice the reduction's time for every product.
REDUCTION_MAX_OUTPUTS = 16_384


def _linear_by_reduction(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` (its parameter names, so keyword calls map too) for a few rows as a multiply-and-sum
    over the input dimension: inductor emits one vectorised loop that streams each weight row once
    per input row, where torch's CPU matmul runs a (1, in) x (in, out) product at a fraction of the
    memory bandwidth. Rows past `REDUCTION_MAX_ROWS` take the rows kernel's product up to 64 rows of
    float32 (`native.rows_linear_op`, a bias added after it), else the library's. Same products,
    another summation order (rounding differs in the last bits)."""
    rows = input.numel() // input.shape[-1]
    if rows <= REDUCTION_MAX_ROWS and weight.shape[0] > REDUCTION_MAX_OUTPUTS and _library_streams_wide_products():
        return torch.ops.aten.linear.default(input, weight, bias)  # a large vocabulary's head
    if rows > REDUCTION_MAX_ROWS:
        if (rows <= ROWS_KERNEL_MAX_ROWS and input.dtype == weight.dtype == torch.float32
                and (bias is None or bias.dtype == torch.float32) and native.rows_package_kernel() is not None):
            # a batch's rows (continuous batching's 8 to 32) or a verification's k + 1 tokens through the
            # rows kernel, as an eager batch's products run (`products.accelerated_linear`): a package calls
            # its C function. From REDUCTION_MAX_ROWS + 1 rows (the eager path's choice starts at 6) and with
            # a bias added after, since the alternative here is torch's op, MKL, slow on an AMD CPU: the
            # self-speculative verification of 5 tokens (rgpt d 512, R = 8, its biased gates included)
            # took 34 instead of 42 ms (median), 9.3 instead of 11.2 ms a token at k = 4 (AMD EPYC, 1 thread,
            # experiments/logs/2026-12-08-twenty-seventh-session.md).
            y = torch.ops.latentloop.rows_linear(input.contiguous(), weight)
            return y if bias is None else y + bias
        return torch.ops.aten.linear.default(input, weight, bias)  # torch's own op: `F.linear` is this function
    input = _stored(input)  # computed once, not in every output row's loop (`_stored`)
    y = (input[..., None, :] * weight).sum(-1)  # (..., out, in) -> (..., out): one fused loop, never materialised
    return y if bias is None else y + bias


def _attention_by_reduction(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                            dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                            enable_gqa: bool = False) -> Tensor:
    """`F.scaled_dot_product_attention` (its parameter names) for one query per row, a decode step,
    written out as products, masking and a softmax, which inductor fuses into loops around the
    step's other work instead of calling the attention kernel once per layer (measured at batch 1:
    0.49 -> 0.43 ms per token, interleaved in one process). It takes 4-d q, k, v (B, H|Hkv, 1|L, hd)
    and a mask of SDPA's kinds, bool (True = may attend) or additive, shaped (B | 1, H | 1, 1, L);
    anything else keeps SDPA. A row whose keys are all masked gets zeros, as SDPA gives. The query
    is stored before the loop over keys (`_stored`)."""
    B, H = query.shape[:2] if query.dim() == 4 else (0, 0)
    Hkv = key.shape[1] if key.dim() == 4 else 0
    fits = (query.dim() == key.dim() == value.dim() == 4 and query.shape[-2] == 1 and not is_causal
            and dropout_p == 0 and (Hkv == H or (enable_gqa and Hkv and H % Hkv == 0))
            and (attn_mask is None or (attn_mask.dim() == 4 and attn_mask.shape[1] in (1, H)
                                       and attn_mask.shape[2] == 1)))
    if not fits:  # torch's own op, as in `_linear_by_reduction`
        return torch.ops.aten.scaled_dot_product_attention.default(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    hd = query.shape[-1]
    group = H // Hkv  # query heads per key/value head; SDPA pairs query head h with key head h // group
    q = _stored(query).reshape(B, Hkv, group, 1, hd)
    scores = (q * key[:, :, None]).sum(-1) * (hd ** -0.5 if scale is None else scale)  # (B, Hkv, G, L)
    if attn_mask is not None:
        mask = attn_mask.reshape(attn_mask.shape[0], *((1, 1) if attn_mask.shape[1] == 1 else (Hkv, group)), -1)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(
            scores.dtype)
    # A softmax whose division comes after the sum over the keys: the exponentials are stored once and
    # each output divided once, where dividing the weights first put a division (and a NaN check) per
    # key inside the loop over the values, again for every vector of the head (8.5% of the small
    # float32 package's step in `perf`; the step 0.938x and 0.945x the time, paired, 11 of 15 rounds
    # below 1 in each of two runs, int8's 0.98x).
    top = scores.amax(-1, keepdim=True)
    exps = _stored((scores - top).exp())  # (B, Hkv, G, L)
    out = (exps[..., None] * value[:, :, None]).sum(-2) / exps.sum(-1)[..., None]  # (B, Hkv, G, hd_v)
    return out.nan_to_num(0.0).reshape(B, H, 1, value.shape[-1])  # all keys masked: NaN here, SDPA's zeros


@functools.cache
def _library_streams_wide_products() -> bool:
    """torch's CPU products are MKL's and this CPU is Intel's: MKL's one-row product streams a wide
    weight faster than the reduction there (`REDUCTION_MAX_OUTPUTS`); elsewhere it is the slower."""
    return torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"


def _stored(tensor: Tensor) -> Tensor:
    """`tensor`, contiguous, as a buffer of its own in inductor's code (`prims.inductor_force_stride_order`
    makes inductor store its input; eagerly it is `contiguous()`). Without it inductor inlines a cheap
    pointwise producer into each consumer's loop and computes it again at every iteration:
    - the query's RoPE (a gather of the other half, scalar by scalar) ran again for every key of the
      attention's loop over the window; stored, the step took 0.83x the time;
    - a product's input (the residual sum and its RMSNorm, whose square root and division compilers
      keep inside the loop) ran again for every 16 inputs of every output row; stored, the step took
      0.93x the time with float32 weights and 0.76x with int8 ones, whose widening loop it had bound.
    (Medians of 15 rounds paired in one process, 14 or 15 below 1: 4 layers x d 256, 1 thread; tokens
    200/200 the same.)"""
    return torch_internals.force_stride_order(tensor.contiguous())  # where that is not here: the values as they are


def _int8_linear_by_reduction(x: Tensor, weight_int8: Tensor, scale: Tensor, packed: Tensor | None = None) -> Tensor:
    """`quant.int8_linear` (x (..., K) float @ (weight_int8 (N, K) * scale (N,)[:, None]).T) for a few
    rows as a multiply-and-sum that inductor writes itself: each weight read as one byte and widened
    in registers, so the step streams a quarter of the float weights' bytes. An ahead-of-time package
    calls the native kernel instead where its build for packages loads (`quant.package_kernel`); this
    is the package's product elsewhere. Rows past `REDUCTION_MAX_ROWS` take the product over the
    converted weight, as eager decoding does. `packed` (the kernel's copy) is not read."""
    rows = x.numel() // x.shape[-1]
    if rows > REDUCTION_MAX_ROWS:  # its `F.linear` is `_linear_by_reduction` here: the rows kernel up to 64 rows
        return quant._converted_product(x, weight_int8, scale)
    x = _stored(x)  # as in `_linear_by_reduction`
    return (x[..., None, :] * weight_int8).sum(-1) * scale  # (..., N, K) -> (..., N), never materialised


def widened(window: Tensor, dtype: torch.dtype) -> Tensor:
    """A static cache's window of keys or values (`update`) in the step's dtype. While a package's
    step is traced this is `_window_as_stored` instead (`EXPORT_SWAPS`)."""
    return window.to(dtype)


def _window_as_stored(window: Tensor, dtype: torch.dtype) -> Tensor:
    """`widened` in a package's step: the window as the cache stores it (a `kv_dtype` of float16 stays
    float16), which `_attention_for_package`, the only reader of the window in the step (backbone's
    `Attention`), widens where it reads it: the kernel element by element, instead of a float32 copy
    of the whole window written and read again each layer (three times the bytes of the float16
    window)."""
    return window


def _attention_for_package(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                           enable_gqa: bool = False) -> Tensor:
    """`F.scaled_dot_product_attention` in an ahead-of-time package: one query per row over a float32
    or float16 cache calls the attention kernel (`native.decode_attention_op`; the package calls its C
    function), which streams the cache once, in order, with its next lines asked for ahead; anything
    else is `_attention_by_reduction`, over keys and values widened to the query's dtype (the window
    reaches this as stored: `_window_as_stored`). Inductor's reductions read each head's values once
    per vector of the head, 256 bytes apart: 12 layers x d 768 of cache after 2,048 keys, one thread,
    took the kernel 0.836 [0.815, 0.857] of their time (9.05 against 10.89 ms;
    `benchmarks/decode_attention.py`)."""
    if (dropout_p == 0 and not is_causal and native.decode_attention_fits(query, key, value, attn_mask)
            and (key.shape[1] == query.shape[1] or enable_gqa) and native.attention_package_kernel() is not None):
        return torch.ops.latentloop.decode_attention(query, key, value, attn_mask,
                                                     query.shape[-1] ** -0.5 if scale is None else scale)
    key, value = key.to(query.dtype), value.to(query.dtype)  # a float16 cache's window (no copy when equal)
    return _attention_by_reduction(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# the dynamo graph's call -> what the CPU decode step computes instead (`F.linear` is
# `torch._C._nn.linear`, and the same for SDPA)
_BY_REDUCTION = {torch.nn.functional.linear: _linear_by_reduction,
                 torch.nn.functional.scaled_dot_product_attention: _attention_by_reduction}
# What the ahead-of-time step swaps while `torch.export` traces the model's code: the module
# attributes `nn.Linear`, the backbone and `Int8Linear` call (the latter `quant.int8_linear` while
# compiling), and the static cache's widening of its window (`widened`: the package's attention reads
# a float16 cache as stored). Dynamo's graph keeps the native int8 kernel (an opaque operator, 10%
# faster than the reduction there, A/B in one process at `benchmarks.decode_profile`'s shapes: 0.61
# vs 0.68 ms a step at 4 x 256, 1 thread; 7.1 vs 7.9 ms at 12 x 768 with a 32000-token head, 2
# threads); a package cannot call it.
EXPORT_SWAPS = ((torch.nn.functional, "linear", _linear_by_reduction),
                (torch.nn.functional, "scaled_dot_product_attention", _attention_for_package),
                (sys.modules[__name__], "widened", _window_as_stored),
                (quant, "int8_linear", _int8_linear_by_reduction))


def _cpu_decode_backend(gm: torch.fx.GraphModule, example_inputs):
    """Inductor for the CPU decode step, with the changes measured at batch 1 (the baseline
    benchmark's shape): the step's weight products of up to `REDUCTION_MAX_ROWS` rows and its
    one-query attention become reductions that inductor writes itself (`rewrite_as_reductions`:
    0.80 -> 0.43 ms per token), and inductor's wrapper that calls the kernels is C++ instead of
    Python (`cpp_wrapper`: the Python wrapper was a fifth of the step; 1.21 -> 0.83 ms before the
    reductions), for a longer first compile (~4 s with inductor's defaults; ~16 s now, measured with
    an empty inductor cache)."""
    patches = {"cpp_wrapper": True, "unsafe_marked_cacheable_functions": _reduction_cache_keys()}
    return torch_internals.compile_fx(rewrite_as_reductions(gm), example_inputs, patches)


def _reduction_cache_keys() -> dict[str, str]:
    """The rewritten graph calls `_BY_REDUCTION`'s functions, which AOT autograd's on-disk cache
    refuses unless they are marked cacheable ('Unsupported call_function target'): the whole graph
    was then traced again in every process, 1.7 s of a warm 7.8 s `generate --decode compiled`
    on the tiny preset. Marked with a key made of their source (and of `_stored`, which they call) and
    the row limit, so that a change to any misses the cache instead of loading a graph built from the
    old code."""
    import inspect

    source = "".join(inspect.getsource(fn) for fn in (*_BY_REDUCTION.values(), _stored)) + str(REDUCTION_MAX_ROWS)
    source += f"{REDUCTION_MAX_OUTPUTS} {_library_streams_wide_products()}"  # this machine's choice of product
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    return {f"{fn.__module__}.{fn.__name__}": key for fn in _BY_REDUCTION.values()}


def rewrite_as_reductions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` (a dynamo graph) with every `F.linear` call (nn.Linear's included) and every
    `F.scaled_dot_product_attention` call replaced in place by `_linear_by_reduction` /
    `_attention_by_reduction`, which decide per call (by its static shapes) whether to reduce."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _BY_REDUCTION:
            node.target = _BY_REDUCTION[node.target]
    gm.recompile()
    return gm


_COPIES = 0
FULL_WINDOW = "full window"  # in a key of `_RAN_SHAPES`: the step whose window is the whole buffer
AOT_BACKEND = "aot"  # in a key of `compiled_steps` / `_RAN_SHAPES`: the ahead-of-time package, not dynamo's graph
STEPS_ATTRIBUTE = "_latentloop_compiled_steps"  # where a model keeps its compiled steps (`compiled_steps`)


class _CompiledSteps(dict):
    """A model's compiled steps, {(device type, options[, backend]): step}: one compile per model and
    options, reused by every call; and `buffers`, the frozen caches' tensors its steps ran on that a
    later frozen cache of the same shape may take (`StaticBuffers`, on CUDA). Kept on the model
    itself: a step holds its model (a package resolves its weights from it), so a global map weakly
    keyed by the model was kept alive by its own values and never freed a model (nor its weights); on
    the model they make a cycle that the garbage collector frees with it. A copy or a pickle of the
    model starts with none: they are bound to this model's tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers = StaticBufferPool()

    def __deepcopy__(self, memo) -> _CompiledSteps:
        return _CompiledSteps()

    def __reduce__(self):
        return _CompiledSteps, ()


def forget_compiled(model) -> None:
    """Drop `model`'s compiled steps and what they ran: after its layers were swapped (int8), a step
    built on the old ones would go on binding to them (float products on dequantised copies)."""
    model.__dict__.pop(STEPS_ATTRIBUTE, None)
    _RAN_SHAPES.pop(model, None)


def compiled_steps(model) -> dict:
    """`model`'s compiled steps (`_CompiledSteps`), made empty on first use."""
    steps = model.__dict__.get(STEPS_ATTRIBUTE)
    if steps is None:
        steps = _CompiledSteps()
        object.__setattr__(model, STEPS_ATTRIBUTE, steps)  # past nn.Module's: no submodule, no state entry
    return steps
