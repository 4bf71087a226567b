"""The single-process pieces of scaling out: per-rank data sharding, activation checkpointing,
flex_attention for lrt's subsets, the strategy setting, a ddp run without torchrun, and
`export-dcp`'s refusals. (Several processes: test_distributed.py; a compiled training step:
test_compiled_training.py.)"""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch

import latentloop as ll
from latentloop.archs import build_objective
from latentloop.cli import main
from latentloop.config import STRATEGIES, DataConfig, RunConfig, TrainConfig, model_config
from latentloop.data import TokenLoader
from latentloop.distributed import current_dist, init_distributed, resolve_strategy
from latentloop.errors import ConfigError
from latentloop.models import flex
from latentloop.parallel import _checkpointed, apply_activation_checkpointing
from latentloop.train import fit, setup

# Every registered architecture, with its spec's settings under which a training forward draws nothing
# from the global RNG in the step tested (fbt: multi-pass forced, no jitter; rgpt: no noise), so two
# forwards can be compared exactly.
QUIET = {name: dict(spec.deterministic) for name, spec in ll.archs.ARCHS.items()}


def _loss_and_grads(model, objective, x, y, step=3, forward=None):
    """Loss and gradients (by parameter name of `model`) of one objective call through `forward`."""
    model.zero_grad(set_to_none=True)
    loss = objective(model if forward is None else forward, x, y, step).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(model, objective, x, y) -> int:
    """Bytes of activations the forward saves for the backward."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        objective(model, x, y, 3).loss.backward()
    return total[0]


def test_loader_shards_the_global_order_by_rank():
    tokens = np.arange(10_000, dtype=np.uint16)
    one = TokenLoader(tokens, 3, 16, seed=7)
    ranks = [TokenLoader(tokens, 3, 16, seed=7, rank=r, world_size=2) for r in range(2)]
    for _ in range(40):  # past an epoch boundary (624 windows / 6 per round)
        whole = torch.cat([one.next_batch()[0], one.next_batch()[0]])  # one process, two micro-batches
        assert torch.equal(torch.cat([r.next_batch()[0] for r in ranks]), whole)
    assert ranks[0].state_dict() == ranks[1].state_dict()  # the position is global
    assert {k: v for k, v in ranks[0].state_dict().items() if k != "world_size"} == {
        k: v for k, v in one.state_dict().items() if k != "world_size"}
    four = TokenLoader(tokens, 3, 16, seed=7, rank=3, world_size=4)  # resumed on four processes
    four.load_state_dict(ranks[0].state_dict())
    for _ in range(3):  # rank 3 of 4 takes the 4th of four micro-batches from the same place
        one.next_batch(), one.next_batch(), one.next_batch()
        assert torch.equal(four.next_batch()[0], one.next_batch()[0])
    with pytest.raises(ConfigError, match="rank 2 is not in a world of 2"):
        TokenLoader(tokens, 3, 16, seed=7, rank=2, world_size=2)


@pytest.mark.parametrize("arch", list(QUIET))
def test_activation_checkpointing_keeps_the_gradients_and_saves_less(arch):
    torch.manual_seed(0)
    model = ll.build(arch, preset="test", sequence_len=32, **QUIET[arch])
    objective = build_objective(model.config, TrainConfig(steps=10))
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    loss, grads = _loss_and_grads(model, objective, x, y)
    recomputed = copy.deepcopy(model)
    apply_activation_checkpointing(recomputed)
    assert set(recomputed.state_dict()) == set(model.state_dict())  # checkpoints keep their names
    loss_ac, grads_ac = _loss_and_grads(recomputed, objective, x, y)
    torch.testing.assert_close(loss_ac, loss, rtol=0, atol=0)
    assert grads_ac.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], rtol=1e-6, atol=1e-7)
    assert _saved_bytes(recomputed, objective, x, y) < 0.8 * _saved_bytes(model, objective, x, y)


def test_lrt_interleaved_recomputes_only_mlps_because_whole_blocks_would_read_a_moved_buffer():
    """Why `apply_activation_checkpointing` recomputes only the MLPs of lrt's buffered passes:
    recomputing a whole block in the backward replays its attention against the shared key/value
    buffer as it is by then, after every later subset pass wrote into it."""
    torch.manual_seed(0)
    model = ll.build("lrt", preset="test", sequence_len=32, recurrence="interleaved")
    objective = build_objective(model.config, TrainConfig(steps=10))
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    loss, grads = _loss_and_grads(model, objective, x, y)
    whole = copy.deepcopy(model)
    for block in whole.blocks:
        _checkpointed(block)
    loss_whole, grads_whole = _loss_and_grads(whole, objective, x, y)
    torch.testing.assert_close(loss_whole, loss, rtol=0, atol=0)  # the forward is the same
    # the backward's replay read later passes' keys: wrong gradients, and nothing raises
    assert max(float((grads_whole[name] - grads[name]).abs().max()) for name in grads) > 1e-5  # 1.2e-4 seen
    mlps = copy.deepcopy(model)
    apply_activation_checkpointing(mlps)  # the MLPs only: the gradients are the plain ones
    for name, grad in _loss_and_grads(mlps, objective, x, y)[1].items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-6, atol=1e-7)


def test_flex_attention_subsets_match_the_dense_mask_on_cpu(monkeypatch):
    """The GPU path of lrt's strided subset passes, run on the CPU: the same numbers as SDPA's dense
    mask, unpadded (training) and left-padded (interleaved prefill). torch 2.13 runs flex_attention's
    forward on the CPU but not its backward, so the gradients are compared on a GPU only."""
    pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no flex_attention")
    torch.manual_seed(0)
    model = ll.build("lrt", preset="test", sequence_len=32, subsets=2, n_kv_head=2).eval()
    x = torch.randint(0, 256, (2, 32))
    pad = torch.ones(2, 32, dtype=torch.bool)
    pad[0, :5] = False
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention on the CPU warns that it is unfused
        dense, dense_padded = model(x), model.interleaved(x, 2, pad, 5 % 2)[0]
        monkeypatch.setattr(flex, "FORCE", True)
        monkeypatch.setattr(flex, "_masks", {})
        sparse, sparse_padded = model(x), model.interleaved(x, 2, pad, 5 % 2)[0]
    assert flex._masks  # the flex path ran (and kept the unpadded masks)
    for a, b in zip(dense.pass_logits, sparse.pass_logits, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse_padded.logits[pad], dense_padded.logits[pad], rtol=1e-5, atol=1e-5)


def _cpu_flex_backward(monkeypatch) -> None:
    """Let flex_attention take gradients on the CPU: torch 2.13's wrapper refuses inputs that require
    grad there (`_validate_device`), though the operator's backward (its dense reference) runs on any
    device. Tests only: the package never trains flex on the CPU."""
    import torch.nn.attention.flex_attention as flex_attention

    monkeypatch.setattr(flex_attention, "_validate_device", lambda *args: None)


# flex_attention inside the graph against the eager flex path, fp32 on the CPU: the same kernels in
# the same order (dynamo without inductor), so the logits agree exactly and the gradients to rounding
FLEX_GRAPH_TOL = 1e-5


# interleaved (lrt's default) in the default suite; chunked, whose loop dynamo traces for ~18 s, slow
@pytest.mark.parametrize("recurrence", ["interleaved", pytest.param("chunked", marks=pytest.mark.slow)])
def test_a_whole_model_compile_gives_the_eager_flex_paths_numbers(monkeypatch, recurrence):
    """lrt's subset passes with flex_attention, the whole training forward and loss compiled (lrt's
    default scope), the block mask built inside the graph: no graph break, and every pass's logits,
    the merged logits, the loss and every gradient as the eager flex path's. Built in the graph,
    the second subset pass was once 0.0126 off (12-04): dynamo (torch 2.13) drops attribute writes
    made after a flex_attention call to objects from before it, and the buffer's columns and the
    merged estimates were such attributes (models/flex.py). Traced by dynamo without inductor, whose
    CPU flex_attention template does not take this mask."""
    pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no flex_attention")
    from torch._dynamo.utils import counters

    _cpu_flex_backward(monkeypatch)
    torch.manual_seed(0)
    model = ll.build("lrt", preset="test", sequence_len=32, subsets=2, recurrence=recurrence, chunk_size=8)
    objective = build_objective(model.config, TrainConfig(steps=10))
    data = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1], data[:, 1:]
    monkeypatch.setattr(flex, "FORCE", True)
    monkeypatch.setattr(flex, "_masks", {})
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention on the CPU warns that it is unfused
        eager_loss, eager_grads = _loss_and_grads(model, objective, x, y)
        assert flex._masks  # the eager run took the flex path
        compiled = torch.compile(model, backend="eager")
        traced_loss, traced_grads = _loss_and_grads(model, objective, x, y, forward=compiled)
        with torch.no_grad():
            eager, traced = model(x), compiled(x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(eager.pass_logits) == len(traced.pass_logits) > 1 or recurrence == "chunked"
    for a, b in zip([eager.logits, *eager.pass_logits], [traced.logits, *traced.pass_logits], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=FLEX_GRAPH_TOL)
    torch.testing.assert_close(traced_loss, eager_loss, rtol=0, atol=FLEX_GRAPH_TOL)
    assert traced_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(traced_grads[name], grad, rtol=0, atol=FLEX_GRAPH_TOL, msg=name)


def test_strategy_is_validated_and_a_multi_process_launch_needs_one(monkeypatch):
    with pytest.raises(ConfigError, match="strategy must be one of auto, none, ddp, fsdp2"):
        TrainConfig(strategy="zero3")
    TrainConfig(strategy="fsdp2", optimizer="muon")  # Muon gathers each sharded matrix (latentloop/optim.py)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="started as 4 processes"):
        init_distributed("none", "cpu")
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        init_distributed("ddp", "cpu")


def test_the_default_strategy_is_ddp_under_torchrun_and_none_alone(monkeypatch):
    """auto (TrainConfig's default) follows the launch, as nanoGPT / nanochat / torchtitan do; an
    explicit strategy stands as given."""
    assert TrainConfig().strategy == "auto"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert [resolve_strategy(s) for s in STRATEGIES] == ["none", "none", "ddp", "fsdp2"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert [resolve_strategy(s) for s in STRATEGIES] == ["ddp", "none", "ddp", "fsdp2"]
    # auto under a launch of 2 takes the ddp path: without torchrun's rendezvous it asks for one
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="WORLD_SIZE=2 but MASTER_ADDR / MASTER_PORT are not set"):
        init_distributed("auto", "cpu")


def _run(corpus, strategy: str) -> RunConfig:
    return RunConfig(model=model_config("fbt", "test", sequence_len=32, **QUIET["fbt"]),
                     train=TrainConfig(steps=3, batch_size=2, grad_accum=2, eval_every=0, eval_batches=1,
                                       log_every=1, warmup_steps=1, strategy=strategy, device="cpu"),
                     data=DataConfig(source=f"text:{corpus}"))


def test_ddp_without_torchrun_is_a_group_of_one_that_trains_as_one_process(corpus, tmp_path):
    plain = fit(setup(_run(corpus, "none"), tmp_path / "plain", progress=False), progress=False)
    try:
        state = setup(_run(corpus, "ddp"), tmp_path / "ddp", progress=False)
        assert (current_dist().world_size, current_dist().backend) == (1, "gloo")
        assert type(state.forward_model).__name__ == "DistributedDataParallel"
        summary = fit(state, progress=False)
    finally:
        torch.distributed.destroy_process_group()
    assert summary["world_size"] == 1 and summary["global_batch"] == 4
    a = ll.load(tmp_path / "plain")[0].state_dict()
    b = ll.load(tmp_path / "ddp")[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a) and plain["train_loss"] == summary["train_loss"]


def test_an_unsharded_checkpoint_resumes_under_fsdp2(corpus, tmp_path):
    """A checkpoint of a one-process run (weights and optimizer states by parameter index) resumed
    under fsdp2: the weights and states are renamed by parameter and sharded (here over a group of
    one), and the run continues as the unsharded one does."""
    straight = setup(_run(corpus, "none"), tmp_path / "straight", progress=False)
    fit(straight, progress=False)
    half = _run(corpus, "none")
    half.train.steps, half.train.save_every = 3, 2
    fit(setup(half, tmp_path / "run", progress=False), progress=False)
    (tmp_path / "run" / "checkpoints" / "step_00000003").rename(tmp_path / "step3-set-aside")
    try:
        state = setup(_run(corpus, "fsdp2"), tmp_path / "run", resume=True, progress=False)
        assert state.step == 2 and hasattr(state.model, "set_requires_gradient_sync")  # sharded, from step 2
        fit(state, progress=False)
    finally:
        torch.distributed.destroy_process_group()
    a = ll.load(tmp_path / "straight")[0].state_dict()
    b = ll.load(tmp_path / "run")[0].state_dict()
    for name in a:  # DTensor norms sum in another order: fp32 rounding only
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


def test_export_dcp_refuses_what_it_cannot_or_need_not_do(corpus, tmp_path, capsys):
    fit(setup(_run(corpus, "none"), tmp_path / "run", progress=False), progress=False)
    capsys.readouterr()
    assert main(["export-dcp", str(tmp_path / "run")]) == 2
    assert "holds no sharded weights (dcp/): it needs no export" in capsys.readouterr().err
    assert main(["export-dcp", str(tmp_path / "missing")]) == 2
    state = json.loads(next((tmp_path / "run" / "checkpoints").iterdir()).joinpath("state.json").read_text())
    assert (state["world_size"], state["strategy"]) == (1, "none")
