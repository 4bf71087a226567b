"""Attention precision under CPU bf16 autocast (`backbone.attend`): a training step attends in float32
where torch's bf16 flash backward is the slower one, everything else as the autocast runs it."""

import pytest
import torch
import torch.nn.functional as F

import latentloop as ll
from latentloop.archs import ARCHS, build_objective
from latentloop.config import TrainConfig
from latentloop.models import backbone
from latentloop.models.backbone import (
    CPU_FP32_ATTENTION_MAX_HEAD_DIM,
    CPU_FP32_ATTENTION_MAX_KEYS,
    CPU_FP32_ATTENTION_MODERATE,
    attend,
    cpu_training_attention_in_fp32,
)


def qkv(batch: int, heads: int, tokens: int, head_dim: int, requires_grad: bool = True) -> list[torch.Tensor]:
    """q and k in float32 (QK-norm's output under autocast), v in bf16 (a product's output)."""
    torch.manual_seed(0)
    q, k = (torch.randn(batch, heads, tokens, head_dim, requires_grad=requires_grad) for _ in range(2))
    v = torch.randn(batch, heads, tokens, head_dim).bfloat16().requires_grad_(requires_grad)
    return [q, k, v]


def test_the_rule_at_its_boundaries():
    small_head, short, (moderate_head, moderate_keys) = (CPU_FP32_ATTENTION_MAX_HEAD_DIM, CPU_FP32_ATTENTION_MAX_KEYS,
                                                         CPU_FP32_ATTENTION_MODERATE)
    assert cpu_training_attention_in_fp32(small_head, 1 << 20)  # small heads: any length
    assert cpu_training_attention_in_fp32(256, short)  # short sequences: any head
    assert cpu_training_attention_in_fp32(moderate_head, moderate_keys)
    assert not cpu_training_attention_in_fp32(moderate_head, moderate_keys + 1)
    assert not cpu_training_attention_in_fp32(moderate_head + 1, short + 1)
    assert not cpu_training_attention_in_fp32(2 * moderate_head, moderate_keys)


def test_a_training_step_in_the_rule_attends_in_float32_exactly():
    q, k, v = qkv(2, 3, 32, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attend(q, k, v, None, True, False)
    want = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach().float(), is_causal=True)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.detach(), want, rtol=0, atol=0)  # the same float32 kernel on the same inputs
    y.square().sum().backward()
    assert [t.grad.dtype for t in (q, k, v)] == [torch.float32, torch.float32, torch.bfloat16]  # each its own


@pytest.mark.parametrize("case", ["no gradients", "inputs without gradients", "large heads, long keys",
                                  "no autocast", "float16 autocast"])
def test_outside_the_rule_attention_runs_as_the_autocast_runs_it(case):
    large = case == "large heads, long keys"
    q, k, v = qkv(1, 2, 256 if large else 32, 64 if large else 16, requires_grad=case != "inputs without gradients")
    if case == "no autocast":
        v = v.detach().float().requires_grad_()
    autocast = {"no autocast": torch.autocast("cpu", enabled=False),
                "float16 autocast": torch.autocast("cpu", dtype=torch.float16)}.get(
        case, torch.autocast("cpu", dtype=torch.bfloat16))
    with torch.set_grad_enabled(case != "no gradients"), autocast:
        y = attend(q, k, v, None, True, False)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert y.dtype == want.dtype == (torch.float32 if case == "no autocast" else autocast.fast_dtype)
    torch.testing.assert_close(y, want, rtol=0, atol=0)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_arch_trains_with_float32_attention_under_cpu_bf16_autocast(arch, monkeypatch):
    """Every attention of a bf16-autocast training step at the test preset (head dim <= 16) gets
    float32 values; the same model scoring without gradients keeps bf16's."""
    model = ll.build(arch, preset="test")
    assert model.config.head_dim <= CPU_FP32_ATTENTION_MAX_HEAD_DIM
    seen: list[torch.dtype] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append(v.dtype)
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(backbone.F, "scaled_dot_product_attention", recording)
    objective = build_objective(model.config, TrainConfig())
    x = torch.randint(0, model.config.vocab_size, (2, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = objective(model, x[:, :-1], x[:, 1:], step=0)
    result.loss.backward()
    assert seen and set(seen) == {torch.float32}, seen
    seen.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x[:, :-1])
    assert seen and set(seen) == {torch.bfloat16}, seen
