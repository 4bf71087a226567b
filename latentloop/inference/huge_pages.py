"""A model's weights moved onto transparent huge pages, for the CPU decode step that streams them.

    moved = weights_on_huge_pages(model)   # bytes moved (0: already done, too few, or not possible here)

Why: a decode step at batch 1 reads every weight once, in order; on 4 KiB pages the stream crosses a
page every 4 KiB, where the CPU's prefetcher stops and the TLB misses. On this project's machine (Intel
Xeon, 1 thread, 12 layers x d 768, 340 MB of float32 weights) the compiled step took 28.9-29.8 ms a
token with torch's usual allocation, 26.7-27.5 ms under torch's `THP_MEM_ALLOC_ENABLE=1` and 23.4-23.5
ms with the weights moved here (two runs each, alternated), where llama.cpp's took 26.4: the gap that
had kept it behind (experiments/logs/2026-12-05-issue54-fifth.md). Most Linux systems give huge pages
only to memory that asks for them (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise), and torch
asks only under that environment variable, read once at its first allocation; a checkpoint loaded
through a memory map sits on the file's pages. So the model's weights (each parameter or buffer of at
least `MIN_TENSOR_BYTES`) are copied into one anonymous mapping, a whole number of huge pages long and
advised `MADV_HUGEPAGE` before it is written, and each parameter (or buffer) pointed at its part
(`tensor.data`): the same Parameter objects, the same values. Each tensor is a storage of its own over
the mapping (no two share storage, so saving with safetensors still works); the mapping outlives the
model's last use of any of them, at most 2 MiB longer than the weights.

Done once per model (marked), by `FastDecoder` on the CPU before a compiled step binds the weights:
a step bound earlier would read the old storage. Only for what is made once: the static decode
cache's buffers, copied onto huge pages at each call's `freeze`, made 64 tokens after 2,048 at 12 x
768 slower (37 against 32 ms a token): with the kernel's `defrag` = madvise, a fault in a fresh
advised region compacts memory for its huge page. Nothing is done where the kernel gives no huge pages
(`enabled` = never), off Linux, or with `LATENTLOOP_HUGE_PAGES=0`; `huge_pages_status()` says why.
The copy costs one pass over the weights, and at most one tensor's size more in memory while it runs.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from torch import nn

HUGE_PAGES_ENV = "LATENTLOOP_HUGE_PAGES"  # "0": weights stay where torch put them
HUGE_PAGE_BYTES = 2 * 2**20  # x86's transparent huge page
# Tensors from this size are moved: the weights a step streams (a norm's few hundred floats are not
# worth a copy); a model whose such tensors do not fill one huge page is left as it is.
MIN_TENSOR_BYTES = 64 * 2**10
ALIGN_BYTES = 64  # each tensor starts on a cache line of the region
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MOVED_MARK = "_latentloop_huge_pages"  # set on a model whose weights were moved (the bytes moved)


def huge_pages_status() -> str | None:
    """None where weights can be moved onto huge pages here, else why not (one line)."""
    if os.environ.get(HUGE_PAGES_ENV, "1") == "0":
        return f"turned off ({HUGE_PAGES_ENV}=0)"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this platform has no transparent huge pages (madvise MADV_HUGEPAGE)"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"cannot read {THP_SETTING}"
    if "[never]" in setting:
        return f"transparent huge pages are off ({THP_SETTING}: never)"
    return None


def _weights(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers on the CPU of at least MIN_TENSOR_BYTES, contiguous, each
    once (a tied weight is one Parameter); tensors that share storage with another are left where
    they are (moving one would untie them)."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu" and tensor.nbytes >= MIN_TENSOR_BYTES and tensor.is_contiguous():
            seen.setdefault(id(tensor), tensor)
    storages: dict[int, int] = {}
    for tensor in seen.values():
        pointer = tensor.untyped_storage().data_ptr()
        storages[pointer] = storages.get(pointer, 0) + 1
    return [t for t in seen.values() if storages[t.untyped_storage().data_ptr()] == 1]


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _placed(tensors: list[torch.Tensor]):
    """(tensor, its place) for each of `tensors` (`_weights`: contiguous, on the CPU), the places in
    one mapping advised onto huge pages, each a storage of its own of the tensor's shape, for the
    caller to copy into one at a time as it iterates (a caller that drops each original as it goes
    holds the weights once, not twice); nothing where they do not fill one huge page."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end = _round_up(end + tensor.nbytes, ALIGN_BYTES)
    if end < HUGE_PAGE_BYTES:
        return
    # a whole number of huge pages: the kernel then starts the mapping on a huge page's boundary (a
    # mapping of 3 MiB was placed where no aligned 2 MiB fit, and got none); advised before it is written
    region = mmap.mmap(-1, _round_up(end, HUGE_PAGE_BYTES), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    for tensor, offset in zip(tensors, offsets):
        # a storage of its own over its part of the region (each keeps the region mapped), made in the
        # caller's mode when it asks for the next one (no context here: a suspended generator's would
        # leak into the caller)
        place = torch.frombuffer(memoryview(region), dtype=tensor.dtype, count=tensor.numel(), offset=offset)
        yield tensor, place.view(tensor.shape)


def weights_on_huge_pages(model: nn.Module) -> int:
    """Move `model`'s weights onto huge pages (see the module doc); the bytes moved, 0 when already
    done, when they do not fill a huge page, or when not possible here. Each weight's old storage is
    freed as it moves (where nothing else holds it): the weights are held once and one tensor more."""
    if getattr(model, MOVED_MARK, None) is not None or huge_pages_status() is not None:
        return 0
    moved = 0
    try:
        # the decoders are built inside the engine's inference mode: copies made there would be
        # inference tensors, and the model could no longer train after a compiled generate. A weight
        # made inside inference mode is an inference tensor: its copy must be one too (an inference
        # Parameter holding an ordinary tensor fails its first forward). Each copy is made as its
        # weight was (`_placed` makes it when asked for the next one)
        weights = _weights(model)
        placed = _placed(weights)
        for tensor in weights:
            with torch.inference_mode(tensor.is_inference()), torch.no_grad():
                pair = next(placed, None)
                if pair is None:  # nothing placed: too small to fill a huge page
                    break
                tensor.data = pair[1].copy_(tensor)
            moved += tensor.nbytes
    except OSError:  # the map or its advice refused (no memory, a kernel without the advice): both come
        return 0  # before the first weight moves, so the weights stay where they were
    setattr(model, MOVED_MARK, moved)
    return moved
