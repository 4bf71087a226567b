"""Muon's orthogonalisation against an independent computation from the SVD."""

import pytest
import torch

from latentloop.optim import NEWTON_SCHULZ_COEFFS, Muon, orthogonalize

NS_STEPS = 5
# The quintic iteration is tuned for speed, not convergence: after 5 steps it leaves each singular
# value somewhere in roughly [0.7, 1.2] instead of at 1 (Keller Jordan's Muon notes), so U V^T itself
# is matched only to within that band.
POLAR_BAND = (0.6, 1.25)


def _iterated_polynomial(s: torch.Tensor, steps: int) -> torch.Tensor:
    """What `steps` quintic Newton-Schulz iterations do to each singular value: s <- a s + b s^3 + c s^5."""
    a, b, c = NEWTON_SCHULZ_COEFFS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.parametrize("shape", [(48, 48), (32, 80), (96, 40)])
def test_orthogonalize_is_the_polar_factor_up_to_the_iterations_band(shape):
    gen = torch.Generator().manual_seed(0)
    # a well-conditioned matrix: random orthogonal factors around singular values in [1, 2]
    rows, cols = shape
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    sigma = torch.linspace(1.0, 2.0, k, dtype=torch.float64)
    G = (u * sigma) @ v.T
    result = orthogonalize(G.float(), NS_STEPS).double()

    # 1. exactly what the iteration should produce, from the SVD (float64): U f(S / |G|_F) V^T
    expected = (u * _iterated_polynomial(sigma / torch.linalg.matrix_norm(G), NS_STEPS)) @ v.T
    torch.testing.assert_close(result, expected, rtol=0, atol=2e-5)  # float32 products of entries ~0.1

    # 2. the polar factor U V^T, within the band the quintic iteration leaves the singular values in
    polar = u @ v.T
    singular = torch.linalg.svdvals(result)
    assert POLAR_BAND[0] <= float(singular.min()) and float(singular.max()) <= POLAR_BAND[1], singular
    # U^T R V is diagonal (the same singular vectors as G): the off-diagonal part is float32 noise
    inner = u.T @ result @ v
    torch.testing.assert_close(inner - torch.diag(torch.diagonal(inner)), torch.zeros(k, k, dtype=torch.float64),
                               rtol=0, atol=1e-4)
    relative = torch.linalg.matrix_norm(result - polar) / torch.linalg.matrix_norm(polar)
    assert float(relative) <= max(1 - POLAR_BAND[0], POLAR_BAND[1] - 1)


def test_orthogonalize_keeps_the_dtype_and_shape():
    G = torch.randn(16, 24).bfloat16()
    out = orthogonalize(G)
    assert out.dtype == torch.bfloat16 and out.shape == G.shape


def test_muon_exclude_sends_the_named_matrices_to_adamw():
    """`train.muon_exclude`: matrices whose names contain a given part go to AdamW (no weight decay,
    as the embeddings); every other matrix stays on Muon, and no parameter is in both or neither."""
    import latentloop as ll
    from latentloop.config import TrainConfig
    from latentloop.optim import build_optimizers

    model = ll.build("fbt", preset="test")
    adamw, muon = build_optimizers(model, TrainConfig(optimizer="muon", muon_exclude=("fuse_",)))
    on_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    on_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    fusion = {id(model.fuse_value.weight), id(model.fuse_gate.weight)}
    assert fusion <= on_adamw and not fusion & on_muon
    assert not on_muon & on_adamw and len(on_muon | on_adamw) == sum(1 for _ in model.parameters())
    _, default_muon = build_optimizers(model, TrainConfig(optimizer="muon"))
    assert fusion <= {id(p) for g in default_muon.param_groups for p in g["params"]}  # by default, Muon's
    assert TrainConfig(muon_exclude=["fuse_"]).muon_exclude == ("fuse_",)  # a list from a config file too


# bf16 keeps 8 bits of each entry: five iterations of bf16 products leave the result a few percent
# (Frobenius, relative) from the float64 iteration's; measured 2.5% at 256 x 1024
BF16_ITERATION_RTOL = 0.05
# ... and far more than float32 products would (~1e-6): a result this close did not come from bf16
BF16_ITERATION_MIN_DISTANCE = 1e-3


@pytest.mark.parametrize("shape", [(48, 48), (32, 80), (96, 40)])
def test_orthogonalize_in_bf16_stays_near_the_exact_iteration_and_in_the_band(shape):
    """`dtype=bfloat16` (Muon on CUDA, and on a CPU in a bf16 run): the products in bf16, the result in
    the input's dtype, a few percent from the float64 iteration, singular values still in the band."""
    gen = torch.Generator().manual_seed(1)
    G = torch.randn(*shape, generator=gen, dtype=torch.float64)
    exact = orthogonalize(G, NS_STEPS, torch.float64)
    result = orthogonalize(G.float(), NS_STEPS, torch.bfloat16)
    assert result.dtype == torch.float32 and result.shape == G.shape
    relative = torch.linalg.matrix_norm(result.double() - exact) / torch.linalg.matrix_norm(exact)
    assert BF16_ITERATION_MIN_DISTANCE <= float(relative) <= BF16_ITERATION_RTOL
    singular = torch.linalg.svdvals(result.double())
    assert POLAR_BAND[0] <= float(singular.min()) and float(singular.max()) <= POLAR_BAND[1], singular


def test_newton_schulz_runs_in_bf16_where_the_runs_products_do():
    from latentloop.optim import newton_schulz_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert newton_schulz_dtype(cpu, "float32") == torch.float32
    assert newton_schulz_dtype(cpu, "bfloat16") == torch.bfloat16
    assert newton_schulz_dtype(cuda, "float32") == torch.bfloat16  # as Muon on GPUs always did


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_trainers_muon_iterates_in_the_runs_products_dtype(dtype, corpus, tmp_path):
    """`train.setup` hands Muon the run's resolved dtype (an explicit one here; auto follows the CPU)."""
    from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
    from latentloop.train import setup

    config = RunConfig(model=model_config("gpt", "test", sequence_len=32),
                       train=TrainConfig(steps=1, batch_size=2, optimizer="muon", dtype=dtype, device="cpu",
                                         eval_every=0),
                       data=DataConfig(source=f"text:{corpus}"))
    state = setup(config, tmp_path / "run", progress=False)
    muon = next(opt for opt in state.optimizers if isinstance(opt, Muon))
    assert muon.ns_dtype == getattr(torch, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_muon_steps_with_the_runs_newton_schulz_dtype(dtype):
    """One Muon step is p - lr * aspect * orthogonalize(Nesterov momentum, in the run's dtype), exactly:
    a Muon that ignored its dtype would take the other iteration's step, which differs."""
    import latentloop as ll
    from latentloop.config import TrainConfig
    from latentloop.optim import MUON_MOMENTUM, build_optimizers

    model = ll.build("gpt", preset="test")
    config = TrainConfig(optimizer="muon", dtype=dtype, weight_decay=0.0)
    _, muon = build_optimizers(model, config, dtype)
    p = muon.param_groups[0]["params"][0]
    before = p.detach().clone()
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(0))
    muon.step()
    momentum = torch.zeros_like(p.grad).lerp_(p.grad, 1 - MUON_MOMENTUM)  # the buffer after its first update
    nesterov = p.grad.lerp(momentum, MUON_MOMENTUM)
    aspect = max(1.0, p.size(0) / p.size(1)) ** 0.5
    ns, other = (torch.bfloat16, torch.float32) if dtype == "bfloat16" else (torch.float32, torch.bfloat16)

    # bf16 without bf16 instructions (the suite hides them, tests/conftest.py): emulated products
    assert muon.ns_emulate_bf16 == (dtype == "bfloat16")

    def stepped(ns_dtype):  # the update applied as Muon applies it (`add_` with alpha: one rounding)
        update = orthogonalize(nesterov, NS_STEPS, ns_dtype, emulate_bf16=muon.ns_emulate_bf16)
        return before.clone().add_(update, alpha=-config.muon_lr * aspect)

    torch.testing.assert_close(p.detach(), stepped(ns), rtol=0, atol=0)
    assert not torch.equal(p.detach(), stepped(other))


@pytest.mark.parametrize("arch", __import__("latentloop").archs.ARCHS)
def test_the_head_and_the_embeddings_are_adamws_and_every_other_matrix_is_muons(arch):
    """Which optimizer owns each parameter under Muon, for every registered architecture: the token
    embedding, an untied lm_head and lookup tables on AdamW without weight decay (Muon's
    orthogonalised update is meant for hidden matrices, and the head diverged under it), every other
    matrix on Muon, every parameter on exactly one."""
    import latentloop as ll
    from latentloop.config import TrainConfig
    from latentloop.optim import build_optimizers

    model = ll.build(arch, preset="test", tie_embeddings=False)  # the head a matrix of its own (fbt ties by default)
    adamw, muon = build_optimizers(model, TrainConfig(optimizer="muon", weight_decay=0.1))
    on_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    decay = {id(p): g["weight_decay"] for g in adamw.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    for name in ("lm_head.weight", "wte.weight"):
        assert id(names[name]) in decay and decay[id(names[name])] == 0.0 and id(names[name]) not in on_muon, name
    for name, p in names.items():
        lookup = name.startswith(("wte", "lm_head")) or ".value_embed." in name
        assert (id(p) in on_muon) == (p.dim() >= 2 and not lookup), name
        assert (id(p) in on_muon) != (id(p) in decay), name
