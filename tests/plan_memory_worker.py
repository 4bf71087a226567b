"""Measures the peak memory of a short CPU training run, for tests/test_plan.py.

Two measurements of the trainer's own optimizer step (`train_step`) on random tokens, with the model,
objective and optimizers built as `latentloop.train.setup` builds them:

- `peak_tensor_bytes` (in-process, fast): tracemalloc for tensors. A dispatch mode sees every tensor
  an op returns; each storage is counted from its first appearance until it is freed (a weak
  finalizer), parameters from the start; the peak is the most bytes alive at once during the steps.
  This is what `latentloop plan` models: the tensors a step holds.
- run as a script (`python tests/plan_memory_worker.py CONFIG_JSON STEPS`, one JSON line): also the
  process's peak resident memory (`VmHWM` of /proc/self/status, the high-water mark of this process's
  own memory map) minus its resident memory just before the model was built (/proc/self/statm),
  after a small warm-up step had loaded torch's kernels and thread pools, with glibc told to keep
  freed memory as `setup` does on the CPU. That adds what the allocator holds beyond the tensors
  (its slack).
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


class LiveTensors(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def track(self, value):
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.live:
                self.live[key] = storage.nbytes()
                self.current += self.live[key]
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return value

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map(self.track, out)
        return out


def _training(config):
    """The model, its step function and the device, built as `setup` builds them."""
    from latentloop.archs import build_model, build_objective, get_arch
    from latentloop.parallel import apply_activation_checkpointing
    from latentloop.runtime import resolve_dtype
    from latentloop.train.loop import FiniteGuard, train_step

    device = torch.device("cpu")
    model = build_model(config.model)
    objective = build_objective(config.model, config.train)
    optimizers = get_arch(config.model.arch).build_optimizers(model, config.train,
                                                              resolve_dtype(device, config.train.dtype))
    if config.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    generator = torch.Generator().manual_seed(1)
    shape = (config.train.batch_size, config.model.sequence_len)

    def next_batch():
        return (torch.randint(0, config.model.vocab_size, shape, generator=generator),
                torch.randint(0, config.model.vocab_size, shape, generator=generator))

    guard = FiniteGuard(device)

    def step(i: int) -> None:
        train_step(model, model, objective, next_batch, i, optimizers, config.train, device, guard)

    model.train()
    return model, step


def peak_tensor_bytes(config, steps: int) -> int:
    """The most tensor bytes alive at once over `steps` optimizer steps (the parameters included)."""
    config.train.steps = steps
    torch.manual_seed(0)
    model, step = _training(config)
    tracker = LiveTensors()
    for p in model.parameters():
        tracker.track(p)
    with tracker:
        for i in range(steps):
            step(i)
    return tracker.peak


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    """The high-water mark of this process's own address space (VmHWM). Not `getrusage`'s ru_maxrss:
    Linux carries that across exec from the process that started us, so a worker spawned by a test
    process that once held 1 GB reported 1 GB whatever it used."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's benchmarks/
    from benchmarks.rgpt import proc_status_bytes

    return proc_status_bytes("VmHWM")


def main() -> None:
    from latentloop.config import RunConfig
    from latentloop.runtime import keep_freed_memory

    config, steps = RunConfig.from_dict(json.loads(sys.argv[1])), int(sys.argv[2])
    config.train.steps = steps
    keep_freed_memory()
    torch.manual_seed(0)
    warm = RunConfig.from_dict({"model": {"arch": "gpt", "preset": "test"},
                                "train": {"batch_size": 1, "dtype": config.train.dtype}})
    _training(warm)[1](0)
    before = resident_bytes()
    _, step = _training(config)
    for i in range(steps):
        step(i)
    peak = peak_resident_bytes()
    print(json.dumps({"peak_rss_bytes": peak - before}))


if __name__ == "__main__":
    main()
