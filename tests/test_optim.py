"""Muon's orthogonalisation against an independent computation from the SVD."""

import pytest
import torch

from latentloop.optim import NEWTON_SCHULZ_COEFFS, orthogonalize

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
