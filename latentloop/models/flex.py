"""flex_attention for attention patterns SDPA cannot skip: lrt's strided subset passes.

A subset pass recomputes the queries {t : t mod S = i} against every key of the sequence. Given as
SDPA's dense boolean mask, that costs the full (T/S) x T scores, although each query sees only the
keys up to its own position (about half of them). A flex_attention `BlockMask` of the same mask
lets the kernel skip every (query block, key block) tile that no query of the tile sees.

Used on CUDA only (compiled flex_attention, which is what makes it fast); on the CPU the dense mask
stays, unless `FORCE` is set (the tests compare both paths' numbers on the CPU, where torch 2.13
runs flex_attention too). Eagerly, masks of unpadded sequences (training) depend only on the
sequence length and the subset's columns, so they are built once and kept; inside a compiled
training step the mask is built in the graph (`block_mask`), so the step has no graph break.

A trap of torch 2.13's dynamo, found through lrt's second subset pass (its logits were 0.0126 off
the eager flex path's, 2026-12-04): in a compiled graph, an attribute written after a
flex_attention call to an object that existed before the call is lost, the later reads seeing the
old value (list items and dict entries are kept; torch.cond does the same, checkpoint does not).
Code that a compiled step traces through a flex pass therefore keeps what a pass changes in locals,
lists or new objects (`KVBuffer.writer`, `LRT.interleaved`), never in attributes rewritten from
pass to pass. `tests/test_parallel.py` compares a compiled step's numbers with the eager ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

FORCE = False  # use the flex path on any device (tests); otherwise CUDA only
MAX_CACHED_MASKS = 64  # distinct (device, T, columns) masks kept: S subsets x a few sequence lengths
_masks: dict[tuple, Any] = {}
_compiled: dict[str, Any] = {}
_suspended = [0]  # blocks of `suspended` open


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Dense masks inside the block, on every device. For torch's FlopCounterMode (the structural
    FLOP count): flex_attention, a higher-order operator, has no rule under it and raises (seen on
    an H200 with torch 2.11: lrt's training stopped at its setup), and the count needs the shapes
    only. Not thread-safe: for setup code."""
    _suspended[0] += 1
    try:
        yield
    finally:
        _suspended[0] -= 1


def available(device: torch.device) -> bool:
    """Whether subset passes on `device` use flex_attention."""
    if _suspended[0] or not (device.type == "cuda" or FORCE):
        return False
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:  # torch older than 2.5
        return False
    return True


def block_mask(query_pos: Tensor, key_pos: Tensor, index: Tensor, padded: bool = True,
               columns_key: tuple | None = None) -> Any:
    """The `attention_mask(query_pos, key_pos, index, arange)` of `models.cache` as a BlockMask:
    query q (at column index[q]) sees key column k when 0 <= key_pos[k] <= query_pos[q], and
    always its own column. query_pos (B|1, n), key_pos (B|1, T) with -1 for padding; `padded`
    False: the caller knows no column is padding (training's buffers), so nothing reads key_pos.
    `columns_key`: the columns described on the host (e.g. ("stride", i, S)), which keys the kept
    mask without reading `index` back from the device.

    Eagerly, a mask of unpadded sequences is built once per (device, T, columns) and kept. Inside a
    compiled graph it is built in the graph every time: the lookup reads tensors on the host (the
    columns as a key), which would break the graph at every subset pass."""
    from torch.nn.attention.flex_attention import create_block_mask

    n, T, device = index.shape[0], key_pos.shape[1], key_pos.device
    key = None
    if not torch.compiler.is_compiling():
        padded = padded and (key_pos.shape[0] > 1 or bool((key_pos < 0).any()))
        key = None if padded else (str(device), T, columns_key or tuple(index.tolist()))
    if key is not None and key in _masks:
        return _masks[key]
    batched = key_pos.shape[0] > 1 or query_pos.shape[0] > 1
    kp = key_pos.expand(max(key_pos.shape[0], query_pos.shape[0]), T) if batched else key_pos[0]
    qp = query_pos.expand(kp.shape[0], n) if batched else query_pos[0]

    def visible(b, h, q, k):
        key_at, query_at = (kp[b, k], qp[b, q]) if batched else (kp[k], qp[q])
        return ((key_at >= 0) & (key_at <= query_at)) | (k == index[q])

    mask = create_block_mask(visible, kp.shape[0] if batched else None, None, n, T, device=device)
    if key is not None:
        if len(_masks) >= MAX_CACHED_MASKS:
            _masks.pop(next(iter(_masks)))
        _masks[key] = mask
    return mask


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Any, enable_gqa: bool) -> Tensor:
    """flex_attention (compiled on CUDA) of (B, H, n, hd) queries over (B, Hkv, T, hd) keys/values."""
    from torch.nn.attention.flex_attention import flex_attention

    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):  # SDPA is autocast to bf16; flex_attention is not: cast here
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if device_type != "cuda":
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["fn"](q, k, v, block_mask=mask, enable_gqa=enable_gqa)
