"""A training step with nothing between the kernels, for every registered architecture (issue 51):

- compiled (`train.compile`, the whole step: model and loss in one graph, `train.step.ModelAndLoss`),
  several training steps with validation between them, twice over: no graph break, one graph per
  kind of forward the objective runs (fbt's pass count, rgpt's depth) and no recompilation after
  the first round (dynamo's counters; backend "eager", which traces exactly as inductor's front end
  does and runs the graphs with eager kernels, in seconds). lrt takes its flex_attention path.
- eager, no value read back from the device inside a step (every `.item()`, `float(t)`, `bool(t)`
  is the operator `aten._local_scalar_dense`, counted by a dispatch mode), the trainer's included;
- each check fails when a `.item()`, a branch on a tensor's value or a per-step Python number is
  planted in an objective.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import latentloop as ll
from latentloop.archs import ARCHS, build_objective, get_arch
from latentloop.config import TrainConfig
from latentloop.models import flex
from latentloop.objectives import NextTokenObjective
from latentloop.optim import Muon
from latentloop.parallel import wrap_model
from latentloop.train import FiniteGuard, train_step
from latentloop.train.step import ModelAndLoss, compiled_step_graphs

SEQ_LEN, BATCH = 32, 2
ROUNDS_OF_STEPS = 2  # optimizer steps per round, each followed by a validation forward
CPU = torch.device("cpu")


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """lrt's subset passes through flex_attention on the CPU, with gradients (torch 2.13's wrapper
    refuses inputs that require grad on the CPU; the operator's dense backward runs anywhere)."""
    import torch.nn.attention.flex_attention as flex_attention

    monkeypatch.setattr(flex_attention, "_validate_device", lambda *args: None)
    monkeypatch.setattr(flex, "FORCE", True)
    monkeypatch.setattr(flex, "_masks", {})


def _training(arch: str, compile_: bool, objective_class=None, masked: bool = False, **train):
    torch.manual_seed(0)
    model = ll.build(arch, preset="test", sequence_len=SEQ_LEN).train()
    config = TrainConfig(**{"steps": 100, "batch_size": BATCH, "device": "cpu", "dtype": "float32", "compile": compile_,
                            "compile_backend": "eager", "warmup_steps": 0, **train})
    objective = (objective_class or type(build_objective(model.config, config)))(model.config, config)
    forward = wrap_model(model, config, CPU, root=ModelAndLoss(model, objective),
                         graphs=compiled_step_graphs(objective))
    optimizers = get_arch(arch).build_optimizers(model, config)
    generator = torch.Generator().manual_seed(1)

    def batch():
        data = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
        if not masked:
            return data[:, :-1], data[:, 1:]
        reply_starts = torch.randint(1, SEQ_LEN, (BATCH, 1), generator=generator)  # SFT: each row's reply
        return data[:, :-1], data[:, 1:], torch.arange(SEQ_LEN) >= reply_starts

    return model, forward, objective, optimizers, config, batch


def _validate(model, batch) -> None:
    """Validation as `train.validate` runs it: the plain model, evaluation mode, no gradient."""
    model.eval()
    with torch.no_grad():
        model(batch()[0])
    model.train()


RECORDING = "latentloop_test_recording"  # dynamo's eager backend, keeping each graph it is handed
_recorded: list = []


@pytest.fixture
def recording_backend(monkeypatch):
    """`train.compile_backend` set to a backend that records the graphs (dynamo's "eager" otherwise)."""
    import latentloop.config

    if RECORDING not in torch._dynamo.list_backends():
        @torch._dynamo.register_backend(name=RECORDING)
        def _record(gm, example_inputs):
            _recorded.append(gm)
            return gm.forward

    monkeypatch.setattr(latentloop.config, "COMPILE_BACKENDS", (*latentloop.config.COMPILE_BACKENDS, RECORDING))
    _recorded.clear()
    return _recorded


def step_graph_report(arch: str, objective_class=None, backend: str = "eager", masked: bool = False, **train) -> dict:
    """Two rounds of the same optimizer steps, compiled, each step followed by validation: the
    graph breaks, the frames dynamo compiled and the graphs it made in each round, and how many
    kinds of forward (objective.forward_mix) the steps ran."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, forward, objective, optimizers, config, batch = _training(arch, True, objective_class, masked,
                                                                     compile_backend=backend, **train)
    guard = FiniteGuard(CPU)
    graphs, in_steps = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention on the CPU warns that it is unfused
        for _ in range(2):
            for step in range(ROUNDS_OF_STEPS):
                before = counters["stats"]["unique_graphs"]
                train_step(model, forward, objective, batch, step, optimizers, config, CPU, guard)
                in_steps += counters["stats"]["unique_graphs"] - before
                # eager, as train.validate runs it (torch's eager flex_attention compiles a graph of its own)
                _validate(model, batch)
            graphs.append(counters["stats"]["unique_graphs"])
    kinds = {repr(objective.forward_mix(step)) for step in range(ROUNDS_OF_STEPS)}
    # Muon's Newton-Schulz iteration, compiled too: one graph per shape of matrix it updates
    shapes = {tuple(p.shape) for opt in optimizers if isinstance(opt, Muon) for g in opt.param_groups
              for p in g["params"]}
    return {"breaks": sum(counters["graph_break"].values()), "reasons": list(counters["graph_break"]),
            "frames": dict(counters["frames"]), "graphs_per_round": graphs, "graphs_in_steps": in_steps,
            "kinds": len(kinds),
            "optimizer_graphs": len(shapes)}


def _assert_one_graph_per_kind(report: dict) -> None:
    assert report["breaks"] == 0, report["reasons"]
    assert report["frames"]["total"] == report["frames"]["ok"], report
    # the steps: one graph per kind of forward and per shape Muon updates, no graph for anything else
    assert report["graphs_in_steps"] == report["kinds"] + report["optimizer_graphs"], report
    first, second = report["graphs_per_round"]
    assert second == first, report  # the second round, validation's included, compiled nothing


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_compiled_step_is_one_graph_per_kind_of_forward_and_never_recompiles(arch, flex_on_cpu, recording_backend):
    """...and its attention is SDPA with `is_causal` and no mask (what lets a GPU take the flash /
    cuDNN kernels; a dense boolean mask falls back to the math or memory-efficient ones), lrt's
    subset passes flex_attention with the block mask built in the same graph."""
    report = step_graph_report(arch, backend=RECORDING)
    _assert_one_graph_per_kind(report)
    calls = [node for gm in recording_backend for node in gm.graph.nodes if node.op == "call_function"]
    sdpa = [node for node in calls if "scaled_dot_product_attention" in str(node.target)]
    assert sdpa
    for node in sdpa:
        assert node.kwargs.get("attn_mask") is None and node.kwargs.get("is_causal") is True, node.format_node()
    assert any("flex_attention" in str(node.target) for node in calls) == (arch == "lrt")


class _Reads(TorchDispatchMode):
    """Counts the operator behind every read of a tensor's value on the host."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting_reads():
    mode = _Reads()
    with mode:
        yield mode


def host_reads_per_step(arch: str, objective_class=None) -> int:
    """Host reads of device values in an eager optimizer step after the first (which builds what it
    keeps, e.g. lrt's flex masks), the guard deferred as on an accelerator."""
    model, forward, objective, optimizers, config, batch = _training(arch, False, objective_class)
    guard = FiniteGuard(CPU, deferred=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_step(model, forward, objective, batch, 0, optimizers, config, CPU, guard)
        with _counting_reads() as counted:
            train_step(model, forward, objective, batch, 1, optimizers, config, CPU, guard)
    return counted.reads


def _weighs_loss_terms(arch: str) -> bool:
    """Whether the arch's objective weighs loss terms of its own under SFT's masks (lrt's column
    subsets, mor's router terms), by overriding `Objective.target_terms`."""
    objective = type(build_objective(ll.build(arch, preset="test").config, TrainConfig()))
    return objective.target_terms is not NextTokenObjective.target_terms


@pytest.mark.parametrize("arch", [arch for arch in sorted(ARCHS) if _weighs_loss_terms(arch)])
def test_a_compiled_sft_step_weighs_its_loss_terms_in_the_same_graphs(arch, flex_on_cpu):
    """Under SFT's loss masks (another reply length every step) lrt's and mor's loss terms are weighed
    by the step's shares (`Objective.target_terms`), handed to the compiled step as a tensor: no graph
    break, and no step compiles anything a step before it did (a share as a number would recompile)."""
    _assert_one_graph_per_kind(step_graph_report(arch, masked=True, grad_accum=2))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_an_eager_step_reads_nothing_back_from_the_device(arch):
    """lrt on its dense masks here: torch's eager flex_attention compiles a graph of its own, which
    cannot run under a dispatch mode (the compiled step above has no graph break, so no read, on
    the flex path)."""
    assert host_reads_per_step(arch) == 0


class _ReadsTheLoss(NextTokenObjective):
    def loss(self, model, x, y, loss_mask=None, **plan):
        result = super().loss(model, x, y, loss_mask)
        result.metrics["loss_now"] = result.loss.item()  # a planted host read
        return result


class _BranchesOnAValue(NextTokenObjective):
    def loss(self, model, x, y, loss_mask=None, **plan):
        result = super().loss(model, x, y, loss_mask)
        if result.loss > 100:  # a planted branch on a tensor's value
            result.loss = result.loss / 2
        return result


class _NumberPerStep(NextTokenObjective):
    def plan(self, step, x, loss_mask=None, draw=0):
        return {"scale": 1.0 + step}  # a planted Python number that changes every step: a graph each

    def loss(self, model, x, y, loss_mask=None, scale=1.0):
        result = super().loss(model, x, y, loss_mask)
        result.loss = result.loss * scale
        return result


@pytest.mark.parametrize("planted", [_ReadsTheLoss, _BranchesOnAValue, _NumberPerStep])
def test_the_checks_fail_when_a_read_a_value_branch_or_a_per_step_number_is_planted(planted):
    report = step_graph_report("gpt", planted, optimizer="adamw")
    with pytest.raises(AssertionError):
        _assert_one_graph_per_kind(report)
    if planted is not _NumberPerStep:
        assert host_reads_per_step("gpt", planted) > 0


def _block_graphs(arch: str, layers: int, recompute: bool) -> int:
    """Graphs dynamo makes for three steps with validation, blocks compiled one by one (fsdp2's way),
    activation checkpointing on or off."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = ll.build(arch, preset="test", sequence_len=SEQ_LEN, n_layer=layers).train()
    config = TrainConfig(batch_size=BATCH, device="cpu", dtype="float32", compile=True, compile_backend="eager",
                         compile_scope="blocks", activation_checkpointing=recompute, optimizer="adamw")
    objective = build_objective(model.config, config)
    forward = wrap_model(model, config, CPU, root=ModelAndLoss(model, objective))
    optimizers = get_arch(arch).build_optimizers(model, config)
    generator = torch.Generator().manual_seed(1)

    def batch():
        data = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
        return data[:, :-1], data[:, 1:]

    for step in range(ROUNDS_OF_STEPS):
        train_step(model, forward, objective, batch, step, optimizers, config, CPU, FiniteGuard(CPU))
        _validate(model, batch)
    assert counters["frames"]["total"] == counters["frames"]["ok"]
    return counters["stats"]["unique_graphs"]


def test_blocks_compiled_one_by_one_share_their_graphs_with_activation_checkpointing_on():
    """Block by block (fsdp2), gpt's blocks share one training and one validation graph whatever the
    depth, with activation checkpointing as without. A forward replaced by a `functools.partial`
    (the checkpoint wrapper as it was) left every block uncompiled: 0 graphs."""
    plain = _block_graphs("gpt", 2, recompute=False)
    assert plain == 2 == _block_graphs("gpt", 2, recompute=True) == _block_graphs("gpt", 4, recompute=True)



class _HostCopies(TorchDispatchMode):
    """Counts ops that take a host tensor into a computation on another device: on an accelerator a
    blocking copy, which waits for every kernel queued before it. A 0-d host tensor is a scalar
    argument (no copy) and is not counted."""

    def __init__(self):
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [t for t in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        out = func(*args, **(kwargs or {}))
        devices = {t.device.type for t in flat} | {t.device.type for t in torch.utils._pytree.tree_leaves(out)
                                                    if isinstance(t, torch.Tensor)}
        if any(t.device.type == "cpu" and t.dim() > 0 for t in flat) and devices - {"cpu"}:
            self.copies.append(str(func))
        return out


@pytest.mark.parametrize("masked", [False, True], ids=["pretraining", "sft"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_training_loss_copies_nothing_from_the_host(arch, masked):
    """The model on the meta device stands in for an accelerator: a tensor built on the host inside
    the loss (mor's quota table under SFT's masks did, once per recursion) shows as an op reading a
    host tensor into a meta one. On CUDA each is a stall of the whole step."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = ll.build(arch, preset="test", sequence_len=SEQ_LEN).train()
    objective = build_objective(model.config, TrainConfig(steps=10))
    data = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN + 1))
    mask = (torch.arange(SEQ_LEN) >= torch.tensor([[3], [9]])) if masked else None
    # the plan drawn on the host's batch (meta has no generator), its tensors then where the trainer's
    # plan makes them: on the batch's device. The batch's own copy comes before the step too
    plan = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                             objective.plan(1, data[:, :-1], mask))
    x, y = data[:, :-1].to("meta"), data[:, 1:].to("meta")
    mask = None if mask is None else mask.to("meta")
    with _HostCopies() as counted:
        objective.loss(model, x, y, mask, **plan)
    assert counted.copies == []


def test_a_steps_loss_shares_reach_the_device_without_a_blocking_copy(monkeypatch):
    """lrt's and mor's SFT steps made their loss terms' shares with `torch.tensor(counts, device=)`:
    from pageable memory on CUDA, a copy that waits for every queued kernel, each step. They are
    made on the host and queued (`runtime.to_device_async`). `torch.tensor` with a device passes no
    dispatch mode, so the call itself is watched."""
    import latentloop.parallel as parallel

    made_on: list[str] = []
    real = torch.tensor

    def watched(*args, **kwargs):
        made_on.append(torch.device(kwargs.get("device") or "cpu").type)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", watched)
    shares = parallel.micro_batch_term_shares([[4, 2], [6, 3]], torch.device("meta"))
    assert shares.device.type == "meta" and shares.shape == (2, 2)
    assert made_on and set(made_on) == {"cpu"}


def test_muon_makes_its_momentum_buffers_once():
    """`setdefault(key, torch.zeros_like(...))` made (and dropped) a zeroed copy of every matrix each step."""
    model = ll.build("gpt", preset="test", sequence_len=SEQ_LEN)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    optimizer = Muon(matrices, lr=0.01)
    for p in matrices:
        p.grad = torch.randn_like(p)
    optimizer.step()
    buffers = [optimizer.state[p]["momentum_buffer"] for p in matrices]
    calls = []
    real = torch.zeros_like
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "zeros_like", lambda *a, **k: calls.append(1) or real(*a, **k))
        optimizer.step()
    assert calls == [] and all(optimizer.state[p]["momentum_buffer"] is b for p, b in zip(matrices, buffers))


def test_validation_batches_reach_the_device_through_the_queued_copy(monkeypatch):
    """Each validation batch went `x.to(device)`: from pageable memory on CUDA, a copy that waits for
    the previous batch's forward. Its inputs, targets and mask go through `runtime.to_device_async`."""
    import latentloop.eval.loss as loss

    copied = []
    real = loss.to_device_async
    monkeypatch.setattr(loss, "to_device_async", lambda t, device: copied.append(t.shape) or real(t, device))
    model = ll.build("gpt", preset="test", sequence_len=SEQ_LEN).eval()
    x = torch.randint(0, 256, (BATCH, SEQ_LEN))
    mask = torch.ones(BATCH, SEQ_LEN, dtype=torch.bool)
    table = torch.ones(model.config.vocab_size, dtype=torch.long).numpy()
    loss.evaluate_batches(model, [(x, x), (x, x, mask)], table)
    assert copied == [x.shape] * 5  # x, y; then x, y and the mask
