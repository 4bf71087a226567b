"""Training speed paths: the hand-written RMSNorm backward (fast), and compiled training
(`train.compile`): every architecture's objective through the module `parallel.wrap_model` compiles
for training (the whole forward, or each block) gives the eager loss and gradients, and the fused
AdamW steps (slow: CPU inductor compiles of forward and backward take tens of seconds per
architecture). The one test of a compiled training step: `test_slow.py` runs `fit` with it."""

import pytest
import torch

import latentloop as ll
from latentloop.archs import ARCHS, build_objective
from latentloop.config import TrainConfig
from latentloop.models.backbone import norm, relu_squared
from latentloop.optim import build_optimizers
from latentloop.parallel import compiles_whole_model, wrap_model

# fp32: inductor fuses and reorders the elementwise work and the reductions, so losses and
# gradients agree to rounding, not bit for bit
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
SEQ_LEN, BATCH = 32, 2


def test_rms_norm_backward_is_the_derivative():
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: norm(t), (x,))
    assert torch.autograd.gradcheck(lambda t: norm(t, 1e-2), (x,))  # a large eps, so that it matters
    g = torch.randn(3, 5, 16, dtype=torch.float64)
    ours = torch.autograd.grad(norm(x), x, g)[0]
    theirs = torch.autograd.grad(torch.nn.functional.rms_norm(x, (16,)), x, g)[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)  # float64: the two differ by rounding only


def test_relu_squared_backward_is_the_derivative():
    x = torch.randn(4, 33, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(relu_squared, (x,))
    g = torch.randn(4, 33, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(relu_squared(x), x, g)[0],
                               torch.autograd.grad(torch.relu(x).square(), x, g)[0], rtol=0, atol=0)
    torch.testing.assert_close(relu_squared(x), torch.relu(x).square(), rtol=0, atol=0)  # the same forward


def loss_and_grads(forward, model, objective, x, y, step: int):
    """Loss and gradients of the objective through `forward` (the model, or its compiled wrapper)."""
    model.zero_grad(set_to_none=True)
    loss = objective(forward, x, y, step).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_compiled_training_step_matches_eager(arch):
    # inductor draws random numbers its own way unless told to call torch's RNG as eager does
    with torch._inductor.config.patch(fallback_random=True):
        _check_compiled_training(arch)


def _check_compiled_training(arch):
    torch.manual_seed(0)
    model = ll.build(arch, preset="test", sequence_len=SEQ_LEN).train()
    train = TrainConfig(batch_size=BATCH, device="cpu", dtype="float32", compile=True)
    objective = build_objective(model.config, train)
    data = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1], data[:, 1:]
    eager = []
    for step in range(2):  # the objectives sample a schedule per step (passes, depth, subsets) from the step
        torch.manual_seed(step)  # training noise (fbt jitter, rgpt eps) drawn identically on both paths
        eager.append(loss_and_grads(model, model, objective, x, y, step))
    # wrapped only now: compiling block by block changes `model`'s own blocks in place
    compiled = wrap_model(model, train, torch.device("cpu"))  # what `fit` calls the objective with
    if compiles_whole_model(model, train.strategy, train.compile_scope):
        assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    else:  # each block compiled in place: the parameter names stay
        assert compiled is model and all(block._compiled_call_impl is not None for block in model.blocks)
    from torch._dynamo.utils import counters

    counters.clear()
    for step, (eager_loss, eager_grads) in enumerate(eager):
        torch.manual_seed(step)
        compiled_loss, compiled_grads = loss_and_grads(compiled, model, objective, x, y, step)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=LOSS_TOL)
        assert compiled_grads.keys() == eager_grads.keys() and eager_grads
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=0, atol=GRAD_TOL, msg=name)
    if compiles_whole_model(model, train.strategy, train.compile_scope):  # one graph, not pieces between breaks
        assert not counters["graph_break"], dict(counters["graph_break"])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizers = build_optimizers(model, train)  # Muon for the matrices and AdamW for the rest (the default)
    adamw = [opt for opt in optimizers if isinstance(opt, torch.optim.AdamW)]
    assert adamw and all(opt.defaults["fused"] for opt in adamw)  # the fused kernel on CPU
    for optimizer in optimizers:
        optimizer.step()
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())


def test_compile_scope_chooses_whole_or_blocks_and_fsdp2_keeps_blocks(capsys):
    from latentloop.errors import ConfigError

    for arch in ARCHS:  # "auto": the whole step for every architecture (issue 51), unless fsdp2 or asked
        model = ll.build(arch, preset="test")
        assert compiles_whole_model(model, "none") and compiles_whole_model(model, "ddp", "whole")
        assert not compiles_whole_model(model, "none", "blocks") and not compiles_whole_model(model, "fsdp2", "whole")
    with pytest.raises(ConfigError, match="compile_scope must be one of auto, whole, blocks"):
        TrainConfig(compile_scope="layers")
    # asking for the whole model under fsdp2 is refused for a new run, not passed over; a run saved so
    # still loads (the config is valid) and resumes, with a warning (blocks and auto stand)
    from latentloop.train.start import _check_compile_scope

    whole = TrainConfig(compile=True, strategy="fsdp2", compile_scope="whole")  # a saved run's config: loads
    with pytest.raises(ConfigError, match="under strategy fsdp2 every architecture compiles block by block"):
        _check_compile_scope(whole, resume=False)
    _check_compile_scope(whole, resume=True)
    assert "this run resumes so, as it ran" in capsys.readouterr().err
    _check_compile_scope(TrainConfig(compile=True, strategy="fsdp2", compile_scope="blocks"), resume=False)
    _check_compile_scope(TrainConfig(strategy="fsdp2", compile_scope="whole"), resume=False)  # no compile


# the fewest linear layers one block's graph holds: the attention's input and output projections and
# the MLP's two (more where q, k, v are separate or a variant adds its own)
BLOCK_LINEARS = 4


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch before 2.6: the count cannot "
                    "run compiled blocks eagerly, so only counting before compiling (train.setup) avoids it")
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_counting_flops_leaves_blocks_compiled(arch):
    """A FLOP count over blocks compiled in place (train.compile block by block) must not stop them
    compiling: under the counter (a dispatch mode) dynamo marks the code it reaches "skip" for good,
    and every later step ran the blocks eagerly. The backend here only records each graph dynamo
    hands it (no inductor), so the test sees what would have been compiled."""
    from latentloop.train.state import FlopsMemo

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()  # no skip marks or graphs left from other tests
    try:
        torch.manual_seed(0)
        model = ll.build(arch, preset="test", sequence_len=SEQ_LEN).train()
        train = TrainConfig(batch_size=BATCH, device="cpu", dtype="float32")
        objective = build_objective(model.config, train)
        for block in model.blocks:
            block.compile(backend=recording_backend)  # as wrap_model does, with the recording backend
        objective.flops_per_token(FlopsMemo(model))  # as the trainer and the benchmarks count, compiled or not
        x = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN))
        objective(model, x, x, 0).loss.backward()
    finally:
        torch._dynamo.reset()
    # a block's graph holds its attention's and MLP's linear layers; the skipped blocks' leftovers
    # (the norm's and ReLU²'s own forwards) hold none
    linears = [sum("linear" in str(node.target) for node in gm.graph.nodes) for gm in graphs]
    assert linears and max(linears) >= BLOCK_LINEARS, linears


@pytest.mark.slow
def test_blocks_compiled_one_by_one_never_fall_back_to_eager_through_training_and_validation():
    """lrt's interleaved training, compiled block by block (as under fsdp2) with its MLPs recomputed:
    every layer and kind of pass, validation's too, is a graph of its own; none may pass dynamo's
    recompile limit, past which the block runs eagerly for good (an H200 run did, under fsdp2)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ll.build("lrt", preset="test", sequence_len=SEQ_LEN, n_layer=6, recurrence="interleaved",
                     subsets=2).train()
    train = TrainConfig(batch_size=BATCH, device="cpu", dtype="float32", compile=True, compile_scope="blocks",
                        activation_checkpointing=True)
    objective = build_objective(model.config, train)
    compiled = wrap_model(model, train, torch.device("cpu"))
    data = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    counters.clear()
    for step in range(2):
        objective(compiled, data[:, :-1], data[:, 1:], step).loss.backward()
        model.eval()  # validation, as `fit` runs it
        with torch.no_grad():
            objective(compiled, data[:, :-1], data[:, 1:], step)
        model.train()
    assert counters["frames"]["total"] == counters["frames"]["ok"] > 0, dict(counters["frames"])
