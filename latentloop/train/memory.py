"""The memory of a training step, estimated before any data or weight exists: what `latentloop
plan` reports per device, and what `setup` checks so that a run that cannot fit is refused with
the estimate instead of being killed by the kernel's out-of-memory killer without a word.

- The probes run on the meta device (shapes only, no memory, no time), where bf16 autocast is
  emulated (`_MetaProbe`: the matrix products in bf16, as autocast runs them); an architecture
  whose forward needs data (a token router's `nonzero`) is probed on the CPU instead, one sequence
  at a time (the plan only: `setup` does not run a forward to decide whether it may run one).
- The peak, over the kinds of step the run takes: the weights, the optimizer's states (from the
  second step on: they are made by the first) and the most activations and gradients the
  backward holds at once (`SavedTensors.held_with_gradients`), or the optimizer's step over every
  gradient with what it makes while it runs, whichever is larger (latentloop/plan.py says more).
- `check_step_fits` (setup) probes only a micro-batch whose one layer of activations and logits
  (`batch x sequence_len x (n_embd + vocab_size)` in fp32) is at least 1/`PROBE_FRACTION` of the
  device's memory: a smaller one would need more than that many such layers to not fit, and the
  probe costs seconds (on this project's CPU, at the gpt2 shape: 1.9-4.0 s, rfbt's eight kinds
  of forward 14 s; `setup_probe_steps` finds the kinds in a few thousand steps at most). It refuses
  a step planned past the memory by more than `PLAN_TOLERANCE`, the bound tests/test_plan.py holds
  the plan to against measured steps.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..archs import build_model, build_objective, get_arch
from ..config import RunConfig
from ..errors import ConfigError
from ..inference.torch_internals import TorchDispatchMode
from ..models.backbone import cpu_training_attention_in_fp32
from ..precision import bf16_linear
from ..runtime import autocast_for, emulates_bf16, resolve_dtype
from ..util import memory_limit_bytes
from .step import accumulation

# up to this many steps every step's kind of forward is looked at (~1 s per 100k steps: the objective's
# own draw, no model); past it, windows of KIND_WINDOW steps at the start, from 3/4 of the run (where
# late recipes such as fbt's paper schedule start) and at the end
ALL_KIND_STEPS = 2_000_000
KIND_WINDOW = 100_000
BYTES = {"float32": 4, "bfloat16": 2}
# Lower-precision ops of bf16 autocast (the matrix products): what the meta probe runs in bf16.
AUTOCAST_LOWERED = frozenset({F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                              torch.Tensor.matmul, torch.Tensor.__matmul__, F.scaled_dot_product_attention})
PLAN_TOLERANCE = 0.15  # a planned peak within this of the memory may still fit (tests/test_plan.py's bound)
PROBE_FRACTION = 256  # setup probes a micro-batch whose one layer takes at least 1/PROBE_FRACTION of the memory
SETUP_KIND_WINDOW = 1_000  # setup's scan for the run's kinds of forward: windows of this many steps


_GENERATOR = torch.Generator


def _host_generator(device="cpu"):
    return _GENERATOR("cpu" if torch.device(device).type == "meta" else device)


class _MetaProbe(TorchFunctionMode):
    """Runs a training forward on meta tensors: a value read off a tensor (a metric logged as a
    float) reads 0, and with `bf16` the matrix products run in bf16 as autocast runs them (the
    weights cast once per forward, as autocast caches them). `on_cpu`: the step planned runs on the
    CPU, whose bf16 training attention runs in float32 at the shapes `backbone.attend`'s rule picks
    (its inputs and output float32 copies, which the step holds: lrt's in bf16 with checkpointing was
    planned 8% under without it). On a CPU without bf16 instructions the linear layers run as the
    trainer emulates them (`precision.bf16_linear`: float32 copies of their inputs and outputs while they
    run; without them the checkpointed bf16 steps of gpt, rgpt and mor were planned 7-11% under), unless
    `emulate` is False: a compiled step (train.compile) is left to torch's autocast, which holds no such
    copies (`runtime.autocast_for`), and counting them planned it 7-11% over."""

    def __init__(self, bf16: bool, on_cpu: bool = False, emulate: bool = True):
        super().__init__()
        self.bf16, self.on_cpu = bf16, on_cpu
        self.emulated = emulate and bf16 and on_cpu and emulates_bf16(torch.device("cpu"), "bfloat16")
        self.casts: dict[int, Tensor] = {}

    def _lowered(self, value):
        if not (isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.bfloat16):
            return value
        if isinstance(value, nn.Parameter):
            if id(value) not in self.casts:
                self.casts[id(value)] = value.to(torch.bfloat16)
            return self.casts[id(value)]
        return value.to(torch.bfloat16)

    def __enter__(self):
        # An objective's random draws (fbt's prefixes) made on a generator "of the input's device"
        # come from the CPU's here: the meta device has none, and a draw's values never matter.
        self._generator = torch.Generator
        torch.Generator = _host_generator
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Generator = self._generator
        return super().__exit__(*exc)

    def _attention_inputs(self, args, kwargs) -> tuple:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args)) | kwargs
        q, k, v = (self._lowered(bound[n]) if self.bf16 else bound[n] for n in names[:3])
        if self.bf16 and self.on_cpu and torch.is_grad_enabled() and cpu_training_attention_in_fp32(q.shape[-1],
                                                                                                    k.shape[-2]):
            q, k, v = q.float(), k.float(), v.float()  # as backbone.attend runs it there
        return q, k, v, bound.get("attn_mask"), bound.get("is_causal", False), bound.get("enable_gqa", False)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = (torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
                 torch.Tensor.tolist)
        if func in reads and isinstance(args[0], Tensor) and args[0].device.type == "meta":
            return 0.0 if func is torch.Tensor.__float__ else 0
        if func is F.scaled_dot_product_attention:
            return _FlashSaves.apply(*self._attention_inputs(args, kwargs))
        if self.bf16 and func in AUTOCAST_LOWERED:
            args = tuple(self._lowered(a) for a in args)
            kwargs = {k: self._lowered(v) for k, v in kwargs.items()}
            if func is F.linear and self.emulated:
                return bf16_linear(*args, **kwargs)
        return func(*args, **kwargs)


class _FlashSaves(torch.autograd.Function):
    """Attention on the meta device as a fused kernel runs it (flash or memory-efficient attention,
    on the GPU and the CPU): the output, computed without keeping the (T, T) weights that the meta
    device's reference attention would save, and saved as those kernels save it: the query, key,
    value, mask, output and the fp32 log-sum-exp of each query's row."""

    reference = False  # while the meta device's reference attention runs (see _LiveInside)

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, gqa):
        _FlashSaves.reference = True
        try:
            with torch.no_grad():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
        finally:
            _FlashSaves.reference = False
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(*(t for t in (q, k, v, mask, out, lse) if t is not None))
        return out

    @staticmethod
    def backward(ctx, grad):  # the probe never runs a backward
        raise NotImplementedError


@dataclass
class SavedTensors:
    """What one forward saves for its backward, each storage counted once (parameters excluded),
    and per call of a recomputable module (in forward order): the bytes saved inside it, and, when
    it ends, the bytes saved outside every such call so far and its and the earlier calls' inputs."""

    total: int = 0
    inside: list[int] = field(default_factory=list)
    outside_before: list[int] = field(default_factory=list)
    inputs_upto: list[int] = field(default_factory=list)
    outside: int = 0  # saved outside every recomputable call, over the whole forward
    inputs: int = 0  # the recomputable calls' tensor inputs, which checkpointing keeps
    gradients_after: list[int] = field(default_factory=list)  # per call: bytes of the gradients the
    # backward has made by the time it reaches that call (parameters of later calls and outside them)
    gradients: int = 0  # every trained parameter's gradient
    largest: int = 0  # the largest tensor saved (with a large vocabulary, the loss's fp32 log-softmax)
    # per call: the most bytes its forward made and held at once (what it saves and, while it runs, the
    # intermediates it does not save: an MLP's pre-activation beside its activation), and the bytes of
    # its outputs that take a gradient. Both matter with checkpointing only (see held_with_gradients).
    peak_inside: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)

    def _recomputed(self, i: int) -> int:
        """What the backward holds of call i while it recomputes it: the recompute runs the call's
        forward again, so it holds what that forward held at its peak, not only what it saved."""
        return max(self.inside[i], self.peak_inside[i] if i < len(self.peak_inside) else 0)

    def checkpointed(self) -> int:
        """The most activations held with activation checkpointing: at the end of the forward (what
        was saved outside the recomputed modules, and their inputs), or while the backward
        recomputes a module (its own activations at its forward's peak, beside what was saved
        before it ended: the backward has consumed everything saved after it)."""
        recomputing = [before + inputs + self._recomputed(i) for i, (before, inputs) in
                       enumerate(zip(self.outside_before, self.inputs_upto))]
        return max([self.outside + self.inputs, *recomputing])

    def held_with_gradients(self, checkpointing: bool, shards: int = 1, accumulating: bool = False) -> float:
        """The most activations and gradients held at once in the backward: the gradients appear as
        it goes back through the calls and frees (or, checkpointed, recomputes) their activations.
        Without checkpointing, at call i everything saved up to its end is still held; with it,
        the inputs and outside savings up to it, its recomputed forward at its peak and the gradient
        of its output (measured on the CPU, 2026-12-06: without these two, the recompute of fbt's and
        rgpt's blocks peaked 8% over the plan, by an MLP's pre-activation and the output's gradient,
        the intermediate the recompute makes but does not save and the gradient its backward waits
        on; fbt's later passes hold up to two more gradients of that size, not counted). `shards`: the
        gradients are sharded over that many devices (fsdp2), the activations are not.
        `accumulating`: several micro-batches a step, so from the second one on every gradient is
        held from the backward's start (they add up), not made as it goes."""
        # the backward's first op, beside everything saved: the gradient of the largest saved tensor and
        # of its input (the loss's: the logits' gradient in fp32, then in the products' dtype)
        first_op = 2 * self.largest
        already = self.gradients / shards if accumulating else 0.0
        held = [(self.outside + self.inputs if checkpointing else self.total) + first_op + already,
                self.gradients / shards]
        inside_upto = 0
        for i, own in enumerate(self.inside):
            inside_upto += own
            # checkpointed: the call is recomputed (its forward's peak, `_recomputed`) while the
            # gradient of its output, made by the backward of what came after it, waits for it
            flowing = self.outputs[i] if i < len(self.outputs) else 0
            saved = self.inputs_upto[i] + self._recomputed(i) + flowing if checkpointing else inside_upto
            made = self.gradients if accumulating else self.gradients_after[i]
            held.append(self.outside_before[i] + saved + made / shards)
        return max(held)

    def scaled(self, factor: int) -> SavedTensors:
        """The saving of `factor` times the batch (a probe of one sequence scaled to the micro-batch)."""
        return SavedTensors(self.total * factor, [b * factor for b in self.inside],
                            [b * factor for b in self.outside_before], [b * factor for b in self.inputs_upto],
                            self.outside * factor, self.inputs * factor, self.gradients_after, self.gradients,
                            self.largest * factor, [b * factor for b in self.peak_inside],
                            [b * factor for b in self.outputs])


class _LiveInside(TorchDispatchMode):
    """Per recomputable call (`start` .. `stop`), the most bytes of the storages its ops made that
    are alive at once: a storage counts from the op that makes it until the last tensor on it (a view
    included) is freed; the weights' and the inputs' storages never count. Works on meta tensors.
    The reference attention that `_FlashSaves` runs on the meta device is left out: the fused kernels
    it stands for never hold its (T, T) weights."""

    def __init__(self, result: SavedTensors):
        super().__init__()
        self.result, self.call, self.current = result, -1, 0
        self.refs: dict[int, int] = {}  # storage -> tensors on it alive, for the storages made in this call
        self.sizes: dict[int, int] = {}

    def start(self) -> None:
        self.call, self.current, self.refs, self.sizes = len(self.result.peak_inside), 0, {}, {}
        self.result.peak_inside.append(0)

    def stop(self) -> None:
        self.call = -1

    def _free(self, call: int, key: int) -> None:
        if call != self.call or key not in self.refs:
            return
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.current -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.call < 0 or _FlashSaves.reference:
            return out
        for t in _tensors(out):
            key = t.untyped_storage()._cdata
            if key not in self.refs:
                if any(a.untyped_storage()._cdata == key for a in _tensors((args, kwargs))):
                    continue  # a view of, or written into, an input made before the call (or a weight)
                self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                self.current += self.sizes[key]
                self.result.peak_inside[self.call] = max(self.result.peak_inside[self.call], self.current)
            self.refs[key] += 1
            weakref.finalize(t, self._free, self.call, key)
        return out


def count_saved(model: nn.Module, run) -> SavedTensors:
    """Run `run()` (a training forward) counting the tensors autograd saves for the backward."""
    keep = [p.untyped_storage() for p in model.parameters()]
    params = {id(s) for s in keep}
    seen: dict[int, Any] = {}  # id(storage) -> storage (kept alive, so the id stays its own)
    result = SavedTensors()
    depth = [0]
    trained = {id(p): p.numel() * p.element_size() for p in model.parameters() if p.requires_grad}
    last_call: dict[int, int] = {}  # parameter -> the last recomputable call that uses it
    live = _LiveInside(result)

    def storage_bytes(t: Tensor) -> int:
        storage = t.untyped_storage()
        if id(storage) in params or id(storage) in seen:
            return 0
        seen[id(storage)] = storage
        return storage.nbytes()

    def pack(t: Tensor) -> Tensor:
        added = storage_bytes(t)
        result.total += added
        result.largest = max(result.largest, added)
        if depth[0] and result.inside:
            result.inside[-1] += added
        else:
            result.outside += added
        return t

    def before(module, args):
        if depth[0] == 0 and torch.is_grad_enabled():  # a call without gradient keeps nothing
            result.inside.append(0)
            live.start()
            result.inputs += sum(storage_bytes(a) for a in args if isinstance(a, Tensor) and a.requires_grad)
            last_call.update({id(p): len(result.inside) - 1 for p in module.parameters() if id(p) in trained})
            depth[0] += 1
        elif depth[0]:
            depth[0] += 1

    def after(module, args, output):
        if depth[0]:
            depth[0] -= 1
            if depth[0] == 0:
                live.stop()
                result.outputs.append(sum(t.numel() * t.element_size() for t in _tensors(output) if t.requires_grad))
                result.outside_before.append(result.outside)
                result.inputs_upto.append(result.inputs)

    hooks = [h for m in model.recomputable_modules()
             for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live:
            run()
    finally:
        for hook in hooks:
            hook.remove()
    result.gradients = sum(trained.values())
    # parameters outside the calls count as made first (the head's, used after the last block)
    result.gradients_after = [sum(size for pid, size in trained.items() if last_call.get(pid, len(result.inside)) > i)
                              for i in range(len(result.inside))]
    return result


def meta_model(config) -> nn.Module:
    with torch.device("meta"):
        return build_model(config)


def tensor_bytes(value, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable from `value` (a cache: its attributes, dicts and lists)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return sum(tensor_bytes(v, seen) for v in vars(value).values())
    return 0


def _tensors(value) -> Iterator[Tensor]:
    """The tensors in an op's arguments or outputs (nested tuples, lists and dicts)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class _LiveBytes(TorchDispatchMode):
    """The most bytes that the ops run under it make and hold at once: each new tensor an op returns
    (not a view, not one of its inputs written in place) counts until its Python object is freed.
    Works on meta tensors, which have no storage to watch."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0

    def _free(self, size: int) -> None:
        self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a) for a in _tensors((args, kwargs))}
        for t in _tensors(out):
            if id(t) not in inputs and not t._is_view():
                size = t.numel() * t.element_size()
                self.current += size
                self.peak = max(self.peak, self.current)
                weakref.finalize(t, self._free, size)
        return out


def optimizer_step_bytes(model: nn.Module, config: RunConfig, products_dtype: str) -> tuple[int, int]:
    """(states, workspace): the states the run's optimizers keep, as they allocate them in their
    first step, and the most bytes a later step makes beside them while it runs (Muon's stacks of
    gradients and its Newton-Schulz products; AdamW's foreach temporaries), on a meta model: shapes
    only."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    # eager: with train.compile, Muon's step went through torch.compile, whose first import inside the
    # probe (torch.Generator swapped, `_MetaProbe`) raised, and `plan` and train's setup check ended in a
    # traceback; the compiled step keeps the same tensors, so the count is the same
    eager = dataclasses.replace(config.train, compile=False)
    optimizers = get_arch(config.model.arch).build_optimizers(model, eager, products_dtype)
    with _MetaProbe(bf16=False):
        for opt in optimizers:
            opt.step()
    states = sum(tensor_bytes(state) for opt in optimizers for state in opt.state.values())
    live = _LiveBytes()
    with _MetaProbe(bf16=False), live:
        for opt in optimizers:
            opt.step()
    for p in model.parameters():
        p.grad = None
    return states, live.peak
@dataclass
class Forward:
    """One kind of forward the run takes (the objective's `forward_mix` of a step), what it saves,
    and whether a step after the first takes it (the optimizer's states exist from the first step on)."""

    saved: SavedTensors
    after_first_step: bool


def kind_steps(steps: int, every_step_up_to: int | None = None, window: int | None = None) -> list[int] | range:
    """The steps whose kinds of forward the memory probe looks at (see ALL_KIND_STEPS): a recipe that
    starts late, or draws a rare kind now and then (fbt's 3-pass steps), is probed too. Every step
    up to `every_step_up_to` steps (ALL_KIND_STEPS), else windows of `window` steps (KIND_WINDOW)."""
    every_step_up_to = ALL_KIND_STEPS if every_step_up_to is None else every_step_up_to
    window = KIND_WINDOW if window is None else window
    if steps <= every_step_up_to:
        return range(steps)
    late = 3 * steps // 4
    windows = (range(min(steps, window)), range(late, min(steps, late + window)), range(max(0, steps - window), steps))
    return sorted({step for window in windows for step in window})


def setup_probe_steps(objective, steps: int) -> list[int]:
    """For setup's check, a few steps that take every kind of forward the run takes: scanned over
    windows of SETUP_KIND_WINDOW steps (at the start, from 3/4 and at the end, as `kind_steps` looks
    at a long run), keeping each kind's first step and its first after step 0 (the optimizer's states
    exist from then on), and stopping once every kind of the run's average mix (`forward_mix()`) has
    been seen after step 0. A scan of every step (what `plan` does) took a minute for a 2M-step fbt
    run, on every rank and every resume."""
    wanted = {repr(kwargs) for weight, kwargs in objective.forward_mix() if weight > 0}
    chosen: dict[str, int] = {}  # a step's kind (as probe_forwards names it) -> its step, and its later one
    later: set[str] = set()  # the average mix's kinds seen at a step after the first
    for step in kind_steps(steps, every_step_up_to=0, window=SETUP_KIND_WINDOW):
        mix = objective.forward_mix(step)
        kind = repr(mix)
        if kind not in chosen:
            chosen[kind] = step
        elif step > 0 and chosen[kind] == 0:
            chosen.setdefault(kind + "@later", step)
        if step > 0:
            later |= {repr(kwargs) for _, kwargs in mix}
        if wanted <= later:
            break
    return sorted(set(chosen.values()))


def probe_forwards(config: RunConfig, model: nn.Module, objective, forward_steps: Sequence[int], batch: int,
                    bf16: bool, device: str, on_cpu: bool = False) -> list[Forward]:
    """Each distinct kind of forward among the given steps', probed once; `on_cpu`: for a step on
    the CPU (`_MetaProbe`; a probe on the CPU runs the CPU's rules anyway)."""
    T = config.model.sequence_len
    kinds: dict[str, Forward] = {}
    emulate = not config.train.compile  # as the trainer's autocast does (`runtime.autocast_for`)
    for step in forward_steps:
        kind = repr(objective.forward_mix(step))
        if kind in kinds:
            kinds[kind].after_first_step = True
            continue
        x = torch.zeros(batch, T, dtype=torch.long, device=device)
        if device == "meta":
            def run(step=step, x=x):
                with _MetaProbe(bf16, on_cpu, emulate):
                    objective(model, x, x, step)
        else:
            def run(step=step, x=x):
                with autocast_for(torch.device("cpu"), "bfloat16" if bf16 else "float32", emulate):
                    objective(model, x, x, step)
        model.train()
        kinds[kind] = Forward(count_saved(model, run), after_first_step=step > 0)
    return list(kinds.values())


class ProbeNeedsData(Exception):
    """The meta device cannot run this architecture's training forward (it reads its data)."""


def step_memory(config: RunConfig, objective, forward_steps: Sequence[int], devices: int = 1,
                strategy: str = "none", precision: str = "float32",
                cpu_probe: bool = True, on_cpu: bool = False) -> tuple[dict[str, float], str]:
    """(bytes per device by part, where the forward was probed: "meta" or "cpu") for one training
    step of `config` on `devices` devices under `strategy`, its products in `precision`, over the
    kinds of forward `objective` takes at `forward_steps`. Without `cpu_probe`, a forward the meta
    device cannot run raises ProbeNeedsData instead of running one sequence on the CPU. `on_cpu`:
    the step planned runs on the CPU (its attention's rule in bf16, `_MetaProbe`)."""
    train, T = config.train, config.model.sequence_len
    model, probe = meta_model(config.model), "meta"
    shard = devices if strategy == "fsdp2" else 1
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / shard
    buffers = float(sum(b.numel() * b.element_size() for b in model.buffers()))  # RoPE tables: every device
    states, workspace = optimizer_step_bytes(meta_model(config.model), config, precision)
    # fsdp2: each device keeps its shard of the states and steps its own shards (Muon gathers one
    # matrix at a time): the whole model's workspace over the devices, as the states
    states, workspace = states / shard, workspace / shard
    bf16 = precision == "bfloat16"
    try:
        forwards = probe_forwards(config, model, objective, forward_steps, train.batch_size, bf16, "meta", on_cpu)
    except (RuntimeError, NotImplementedError) as exc:
        if not cpu_probe:
            raise ProbeNeedsData(str(exc)) from None
        model, probe = build_model(config.model), "cpu"  # one sequence, scaled to the micro-batch
        forwards = probe_forwards(config, model, objective, forward_steps, 1, bf16, "cpu")
        forwards = [Forward(f.saved.scaled(train.batch_size), f.after_first_step) for f in forwards]
    activations = float(max(f.saved.total for f in forwards))
    checkpointed = float(max(f.saved.checkpointed() for f in forwards))
    gathered = 0.0
    if strategy == "fsdp2":  # the block being computed is gathered whole (bf16 under mixed precision), and the next
        block = max((sum(p.numel() for p in b.parameters()) for b in model.blocks), default=0)
        gathered = 2 * block * (BYTES["bfloat16"] if bf16 else BYTES["float32"])
    # the largest step: a forward's activations and the gradients its backward makes, beside the
    # weights, and the optimizer's states after the first step
    accumulating = accumulation(train, T, devices) > 1
    backward = max((states if f.after_first_step else 0.0)
                   + f.saved.held_with_gradients(train.activation_checkpointing, shard, accumulating)
                   for f in forwards)
    # the optimizer's step, the activations gone: every gradient, the states and what the step makes
    gradients = weights  # fp32 gradients of fp32 weights, sharded as they are
    optimizer_step = gradients + states + workspace
    peak = weights + buffers + gathered + max(backward, optimizer_step)
    cache = tensor_bytes(meta_model(config.model).new_cache(1, T))
    return {"weights": weights, "buffers": buffers, "gradients": gradients, "optimizer_states": states,
            "optimizer_workspace": workspace, "activations": activations,
            "activations_checkpointed": checkpointed, "fsdp2_gathered_blocks": gathered, "peak": peak,
            "kv_cache_per_sequence": float(cache)}, probe


FP32_BYTES, TOKEN_ID_BYTES = 4, 8


def check_micro_batch_fits(config: RunConfig, device: torch.device, limit: int | None = None,
                           where: str | None = None) -> None:
    """Refuse a micro-batch whose token ids and embeddings alone (a strict lower bound of its
    memory) exceed the device's (`limit` bytes, default the device's own; `where`: how to name it):
    `--batch-size 1e11` built window ids for minutes, then failed, and `plan` probed such a step
    for minutes (its time grows with the batch) before it said anything."""
    batch, seq_len, width = config.train.batch_size, config.model.sequence_len, config.model.n_embd
    least = batch * ((seq_len + 1) * TOKEN_ID_BYTES + seq_len * width * FP32_BYTES)
    limit = device_memory_bytes(device) if limit is None else limit
    if limit is not None and least > limit:
        raise ConfigError(f"train.batch_size={batch:,}: one micro-batch's token ids and embeddings alone take "
                          f"{least / 2 ** 30:,.1f} GiB, more than the {limit / 2 ** 30:,.1f} GiB "
                          f"{where or f'this {device.type} has'}; lower the batch size (grad_accum or batch_tokens "
                          f"make a larger batch from micro-batches)")


def device_memory_bytes(device: torch.device) -> int | None:
    """What one process can hold on `device`: the GPU's memory, or the machine's (its cgroup's) for
    the CPU; None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return memory_limit_bytes() if device.type == "cpu" else None


def check_step_fits(config: RunConfig, device: torch.device, devices: int = 1) -> None:
    """Refuse a run whose planned step needs more memory than `device` has (by more than
    PLAN_TOLERANCE): such a run was killed by the kernel in its first step, without a message.
    Only a micro-batch large enough to matter is probed (see the module's docstring)."""
    limit = device_memory_bytes(device)
    model, train = config.model, config.train
    one_layer = train.batch_size * model.sequence_len * (model.n_embd + model.vocab_size) * BYTES["float32"]
    if limit is None or one_layer * PROBE_FRACTION < limit:
        return
    precision = resolve_dtype(device, train.dtype)
    objective = build_objective(model, train)
    try:
        memory, _ = step_memory(config, objective, setup_probe_steps(objective, train.steps), devices,
                                train.strategy, precision, cpu_probe=False, on_cpu=device.type == "cpu")
    except ProbeNeedsData:
        return  # no estimate without running a forward: the run finds out as before
    if memory["peak"] > limit * (1 + PLAN_TOLERANCE):
        gib = 2 ** 30
        raise ConfigError(
            f"one training step is planned to hold {memory['peak'] / gib:,.1f} GiB on this {device.type} "
            f"(activations {memory['activations'] / gib:,.1f} GiB at batch_size={train.batch_size:,}, "
            f"sequence_len={model.sequence_len:,}), more than the {limit / gib:,.1f} GiB it has: lower "
            f"train.batch_size or model.sequence_len, or set train.activation_checkpointing "
            f"(`latentloop plan` sizes a run before it starts)")


__all__ = ["ALL_KIND_STEPS", "KIND_WINDOW", "PLAN_TOLERANCE", "Forward", "ProbeNeedsData", "SavedTensors",
           "check_micro_batch_fits", "check_step_fits", "count_saved", "device_memory_bytes", "kind_steps",
           "meta_model", "setup_probe_steps", "optimizer_step_bytes", "probe_forwards", "step_memory", "tensor_bytes"]
