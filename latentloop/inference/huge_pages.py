"""A model's large weights moved onto transparent huge pages, for the CPU decode step that streams them.

    moved = weights_on_huge_pages(model)   # bytes moved (0: already done, or not possible here)

Why: a decode step at batch 1 reads every weight once, in order; on 4 KiB pages the stream crosses a
page every 4 KiB, where the CPU's prefetcher stops and the TLB misses. On this project's machine (Intel
Xeon, 1 thread, 12 layers x d 768, 340 MB of float32 weights) the compiled step took 29.0-30.2 ms a
token with torch's usual allocation and 26.7-27.5 ms with the weights on 2 MiB pages (torch's
`THP_MEM_ALLOC_ENABLE=1`, two runs each, alternated), the difference that had kept it behind
llama.cpp's 26.4 ms. Most Linux systems give huge pages only to memory that asks for them
(`/sys/kernel/mm/transparent_hugepage/enabled` = madvise), and torch asks only under that environment
variable, read once at its first allocation; a checkpoint loaded through a memory map sits on the
file's pages. So each weight of at least `MIN_BYTES` gets an anonymous mapping of its own, advised
`MADV_HUGEPAGE` before it is written, its values copied in, and the parameter (or buffer) pointed at
it (`tensor.data`): the same Parameter objects, the same values, one mapping per tensor (no two
tensors share storage, so saving with safetensors still works), a whole number of huge pages long (at
most 2 MiB more than the tensor, in its last page).

Done once per model (marked), by `FastDecoder` on the CPU before a compiled step binds the weights:
a step bound earlier would read the old storage. Nothing is done where the kernel gives no huge pages
(`enabled` = never), off Linux, or with `LATENTLOOP_HUGE_PAGES=0`; `huge_pages_status()` says why.
The copy costs a pass over the weights once (about 0.1 s for 340 MB) and, while it runs, their size
again in memory.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from torch import nn

HUGE_PAGES_ENV = "LATENTLOOP_HUGE_PAGES"  # "0": weights stay where torch put them
HUGE_PAGE_BYTES = 2 * 2**20  # x86's transparent huge page
MIN_BYTES = HUGE_PAGE_BYTES  # a smaller tensor cannot fill one huge page
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


def _large_cpu_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers on the CPU of at least MIN_BYTES, contiguous, each once (a
    tied weight is one Parameter); tensors that share storage with another are left where they are."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu" and tensor.nbytes >= MIN_BYTES and tensor.is_contiguous():
            seen.setdefault(id(tensor), tensor)
    pointers: dict[int, int] = {}
    for tensor in seen.values():
        pointers[tensor.untyped_storage().data_ptr()] = pointers.get(tensor.untyped_storage().data_ptr(), 0) + 1
    return [t for t in seen.values() if pointers[t.untyped_storage().data_ptr()] == 1]


def _on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in an anonymous mapping of its own, advised onto huge pages before it is written."""
    # a whole number of huge pages: the kernel then starts the mapping on a huge page's boundary (a
    # mapping of 3 MiB was placed where no aligned 2 MiB fit, and got none)
    length = -(-tensor.nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    copy = torch.frombuffer(region, dtype=tensor.dtype, count=tensor.numel()).view(tensor.shape)  # keeps `region`
    copy.copy_(tensor)
    return copy


def weights_on_huge_pages(model: nn.Module) -> int:
    """Move `model`'s large CPU weights onto huge pages (see the module doc); the bytes moved, 0 when
    already done or not possible here."""
    if getattr(model, MOVED_MARK, None) is not None or huge_pages_status() is not None:
        return 0
    moved = 0
    with torch.no_grad():
        for tensor in _large_cpu_tensors(model):
            tensor.data = _on_huge_pages(tensor)
            moved += tensor.nbytes
    setattr(model, MOVED_MARK, moved)
    return moved
