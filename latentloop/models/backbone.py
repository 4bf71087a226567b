"""The shared backbone: a nanochat-style decoder-only transformer (arch `gpt`).

Notable features:
- token embedding followed by a parameter-free RMSNorm (`embed_norm`); pre-norm blocks; a final norm
- by default no biases and no learnable norm gains anywhere
- causal self-attention through `F.scaled_dot_product_attention`, with rotary position embeddings
  (RoPE), QK-norm and optional grouped-query attention (`n_kv_head < n_head`); a CPU bf16-autocast
  training step runs it in float32 where torch's bf16 backward is the slower one (`attend`)
- ReLU² MLP (nanochat) or SwiGLU
- lm_head tied to the embedding or separate; optional logit soft-cap
- options for the Llama family (off by default, see `ModelConfig`): learned norm gains and their
  epsilon, no QK-norm, no embedding norm, q/k/v biases, an explicit MLP width, Llama 3 RoPE
  scaling; a parameter exists only while its option is on, so the state-dict keys of the default
  model never change
- two faces: `forward` (the whole sequence, for training and scoring) and the decoding protocol
  `prefill` / `decode` / `reference` with an explicit `KVCache`; per-row positions so that
  left-padded batches of prompts of different lengths give exactly the logits of each prompt alone
- `forward` returns logits *and* the top-layer states; losses live in `latentloop.objectives`
- every product is torch's own (`nn.Linear`, `F.linear`): faster CPU kernels are applied to a built
  model from outside, as a module swap (`latentloop.inference.accelerate`), and never travel with it

Init (documented because the variants rely on it):
- embedding ~ N(0, 1/D): its input use is normed anyway, and with a tied head the initial logits
  then have unit scale; an untied head ~ N(0, 0.001²) starts near the uniform distribution;
- input projections (q, k, v, MLP up/gate) ~ N(0, 1/fan_in), so each keeps unit RMS;
- output projections (attention and MLP out) ~ N(0, 1/(fan_in · 2L)): the 2L residual branches of
  an L-layer stack add O(1) variance in total, so the top state's RMS stays O(1) at any depth (the
  full-bandwidth variant feeds that state back in and needs it bounded).

Extension points for the variants (each a thin subclass in its own file):
`make_block` (which block class each layer uses), `Attention.project_qkv` (e.g. extra keys/values),
`embed`, `run_blocks`, `readout`, `new_cache` (how many cache slots), and the decoding protocol:

- `prefill(idx, cache, pad_mask, **options)`: the prompt into an empty cache;
- `decode(idx, cache, **options)`: new tokens after what the cache holds (several teacher-forced
  tokens allowed); variants that feed a token's state to the next one plug a one-token step into
  `step_tokens`, the one loop that steps tokens through a cache;
- `reference(idx, pad_mask, prompt_len, **options)`: the naive uncached path over the whole
  sequence so far, whose first `prompt_len` columns are the prompt;
- `OPTIONS`: the declared inference options (`latentloop.models.options`); the engine checks them
  once per call and passes every one, defaults filled in, to these methods.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from . import flex
from .cache import AttentionPlan, KVCache, KVStore, plan_attention
from .flops import count_flops_per_token
from .options import DecodeOption

# In `ModelOutput.info`, the key whose value maps names to lists with one entry per batch row: the
# row's own value of a fact that is otherwise reported for the whole batch (rgpt's mean exit depth)
PER_ROW_INFO = "per_row"
# ... and the key whose value maps names to one list per row with one entry per column of the call: a
# fact of each new token (mor's routing depth), read by a caller that keeps only some of a call's
# columns (self-speculative decoding's verification pass); the engine passes it on to no one
PER_TOKEN_INFO = "per_token"
UNTIED_HEAD_INIT_STD = 0.001  # small enough that the initial next-token distribution is ~uniform

class _RMSNormFunction(torch.autograd.Function):
    """Parameter-free RMSNorm with a hand-written backward, for eager training.

    On CPU, `F.rms_norm` under autograd runs its decomposition (pow, mean, add, rsqrt, mul, and
    each op's backward: ~13 passes over the activations, 18 norms per step of a 4-layer model);
    here the forward is torch's one fused kernel, which also returns the 1/rms it used, and the
    backward is dx = (g - y · mean(g · y)) / rms in four passes. Measured 1.5x faster on a
    (16, 256, 256) activation, fp32, gradients equal to rounding."""

    @staticmethod
    def forward(ctx, x: Tensor, eps: float | None) -> Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        y, rstd = ctx.saved_tensors
        return torch.addcmul(grad, y, (grad * y).mean(-1, keepdim=True), value=-1).mul_(rstd), None


class _ReLUSquaredFunction(torch.autograd.Function):
    """ReLU² with a hand-written backward for eager training: autograd's relu-then-square keeps
    both and runs pow's backward and relu's threshold backward (four passes over the MLP's widest
    activation); here the backward is one fused multiply-add on the saved relu, 2 · relu(x) · g."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        r = F.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        r, = ctx.saved_tensors
        return (r * grad).mul_(2)


def relu_squared(x: Tensor) -> Tensor:
    """ReLU(x)², nanochat's MLP activation."""
    if _fast_norm_applies(x):
        return _ReLUSquaredFunction.apply(x)
    return F.relu(x).square()


def _fast_norm_applies(x: Tensor) -> bool:
    """The hand-written backwards (RMSNorm, ReLU²) pay off in eager autograd only: without gradients torch already
    runs the fused kernel, and a compiled graph fuses the decomposition itself."""
    return x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()


# torch's CPU flash attention runs its bfloat16 backward several times slower than its float32 one
# when the sequence is short or the heads are small (torch 2.13 on an AMX Xeon, forward + backward
# over 2,048 tokens x width 256, 1 thread, float32's time over bf16's: 0.22 at 128 keys x head dim
# 16, 0.56 at 128 x 64, 0.87 at 128 x 128, 0.71 at 256 x 32, 0.88 at 512 x 32, 0.72 at 2,048 x 16;
# bf16 ahead at 256 x 64 (1.02), 1,024 x 32 (1.07), 2,048 x 64 (1.52); experiments/logs/
# 2026-12-05-cpu-attention.md). In that region a CPU bf16-autocast training step runs attention in
# float32 instead: faster, and never less precise. `python -m benchmarks.cpu_attention` measures
# the rule, cell by cell and on whole steps.
CPU_FP32_ATTENTION_MAX_HEAD_DIM = 16  # heads this small: float32 at every length measured
CPU_FP32_ATTENTION_MAX_KEYS = 128  # sequences this short: float32 at every head dim measured
CPU_FP32_ATTENTION_MODERATE = (32, 512)  # head dim and keys both at most these: float32 too


def cpu_training_attention_in_fp32(head_dim: int, keys: int) -> bool:
    """The rule above: whether a CPU bf16-autocast training step attends over `keys` keys in float32."""
    moderate_head_dim, moderate_keys = CPU_FP32_ATTENTION_MODERATE
    return (head_dim <= CPU_FP32_ATTENTION_MAX_HEAD_DIM or keys <= CPU_FP32_ATTENTION_MAX_KEYS
            or (head_dim <= moderate_head_dim and keys <= moderate_keys))


def fp32_attention_wins(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether this attention runs in float32: on the CPU under bf16 autocast (where the autocast
    would run it in bf16), with gradients on (without them bf16's forward is the faster one,
    1.2-3x), at a shape the rule picks."""
    if q.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return False
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return False
    if torch.get_autocast_dtype("cpu") != torch.bfloat16:
        return False
    return cpu_training_attention_in_fp32(q.shape[-1], k.shape[-2])


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, enable_gqa: bool) -> Tensor:
    """SDPA of q (B, H, T, hd) over k, v (B, Hkv, Tk, hd) -> (B, H, T, hd); in float32 where
    `fp32_attention_wins` (the output then stays float32: the next product's autocast casts it)."""
    if fp32_attention_wins(q, k, v):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                  is_causal=is_causal, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa)


def norm(x: Tensor, eps: float | None = None) -> Tensor:
    """Parameter-free RMSNorm over the last dimension."""
    if _fast_norm_applies(x):
        return _RMSNormFunction.apply(x, eps)
    return F.rms_norm(x, (x.size(-1),), eps=eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned gain when `learned` (Llama's norms), else
    parameter-free (nanochat's) and without any state-dict entry."""

    def __init__(self, dim: int, eps: float | None = None, learned: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if learned else None

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is None:
            return norm(x, self.eps)
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def shift_right(s: Tensor) -> Tensor:
    """(B, T, D) -> (B, T, D): position t receives the state of position t-1; position 0 zeros.
    How the recurrent variants hand a token's state to the next one in a parallel pass."""
    return torch.cat([torch.zeros_like(s[:, :1]), s[:, :-1]], dim=1)


def last_column(s: Tensor) -> Tensor:
    """(B, T, ...) -> (B, 1, ...): the newest column, what a prefill asked for `last_logits` reads out
    (a left-padded row's last column is its last real token)."""
    return s[:, -1:]


# --------------------------------------------------------------------------------------------
# Rotary position embeddings
# --------------------------------------------------------------------------------------------


def plain_rope_frequencies(head_dim: int, theta: float) -> Tensor:
    """theta^(-2i / head_dim) for i < head_dim / 2, (head_dim / 2,). Like the tables, computed on the
    CPU whatever the default device: a model built on the meta device for its shapes would otherwise
    run this as Python decompositions, whose first call imports torch._dynamo (seconds)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))


def rope_frequencies(config: ModelConfig) -> Tensor:
    """The (head_dim / 2,) rotation frequencies, scaled as `config.rope_scaling` says (the same
    arithmetic as Hugging Face's `linear` and `llama3` RoPE types, so imported models match)."""
    inv_freq = plain_rope_frequencies(config.head_dim, config.rope_theta)
    if config.rope_scaling == "linear":
        return inv_freq / config.rope_factor
    if config.rope_scaling == "llama3":  # long wavelengths / factor, short ones kept, a smooth blend between
        factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
        original = config.rope_original_max_positions
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


def rope_tables(max_positions: int, head_dim: int, theta: float,
                inv_freq: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos and signed-sin tables (max_positions, head_dim) laid out for `apply_rope`; `inv_freq`
    overrides the plain frequencies of `theta` (see `rope_frequencies`)."""
    if inv_freq is None:
        inv_freq = plain_rope_frequencies(head_dim, theta)
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)  # (P,)
    angles = torch.outer(positions, inv_freq)  # (P, hd/2)
    return torch.cat([angles.cos(), angles.cos()], dim=-1), torch.cat([angles.sin(), -angles.sin()], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (x1_i, x2_i) of the two head-dim halves by their position's angles:
    (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin). x: (B, T, H, hd); cos, sin: (B|1, T, 1, hd).
    Rolling by half a head swaps the halves, so this is three elementwise ops. (Hugging Face's
    Llama rotates the other way; `latentloop.interop` negates the second half of every q and k
    row on import and export, which makes the two attention scores identical.)"""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


@dataclass
class ForwardContext:
    """What every layer of one forward needs besides its input. Variants may subclass it."""

    plan: AttentionPlan
    cos: Tensor  # (B|1, T, 1, hd)
    sin: Tensor
    cache: KVStore | None = None  # a KVCache, a training KVBuffer or a per-step view of one
    slot_offset: int = 0  # cache slot of layer 0 (recurrent-depth models use several per layer)


# --------------------------------------------------------------------------------------------
# Attention, MLP, block
# --------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        D = config.n_embd
        qkv_width = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.c_qkv = nn.Linear(D, qkv_width, bias=config.qkv_bias)  # q, k and v in one matmul
        self.c_proj = nn.Linear(D, D, bias=False)
        self.qk_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None

    def project_q_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, T, H, hd) and keys-then-values kv (B, T, 2 Hkv, hd) from one matmul."""
        B, T, _ = x.shape
        qkv = self.c_qkv(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim)
        return qkv.split([self.n_head, 2 * self.n_kv_head], dim=2)

    def project_qkv(self, x: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, T, H, hd), k and v (B, T, Hkv, hd), before RoPE and QK-norm."""
        q, kv = self.project_q_kv(x)
        return q, *kv.chunk(2, dim=2)

    def project_qk_v(self, x: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """q and k side by side (B, T, H + Hkv, hd), and v (B, T, Hkv, hd). The plain projection
        lays q, k, v out in that order in one matmul's output, so q-and-k is a view of it (no
        copy); a subclass that changes `project_qkv` pays one concatenation."""
        if type(self).project_qkv is Attention.project_qkv:
            B, T, _ = x.shape
            qkv = self.c_qkv(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim)
            qk, v = qkv.split([self.n_head + self.n_kv_head, self.n_kv_head], dim=2)
            return qk, v
        q, k, v = self.project_qkv(x, ctx)
        return torch.cat([q, k], dim=2), v

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        B, T, D = x.shape
        qk, v = self.project_qk_v(x, ctx)
        qk = apply_rope(qk, ctx.cos, ctx.sin)  # RoPE (+ QK-norm) on q and k in one go
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        q, k = qk.split([self.n_head, self.n_kv_head], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        if ctx.cache is not None:
            k, v = ctx.cache.update(ctx.slot_offset + self.layer_idx, k, v)  # (B, Hkv, Tk, hd)
        if ctx.plan.block_mask is not None:  # a strided subset pass on GPU (models/flex.py)
            y = flex.attend(q, k, v, ctx.plan.block_mask, enable_gqa=self.n_kv_head != self.n_head)
        else:
            y = attend(q, k, v, ctx.plan.mask, ctx.plan.is_causal, self.n_kv_head != self.n_head)  # (B, H, T, hd)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        hidden = config.mlp_hidden
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_gate = nn.Linear(config.n_embd, hidden, bias=False) if self.swiglu else None
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            h = F.silu(self.c_gate(x)) * self.c_fc(x)
        else:
            h = relu_squared(self.c_fc(x))
        return self.c_proj(h)


class Block(nn.Module):
    attention_class = Attention  # variants swap in a subclass

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn = self.attention_class(config, layer_idx)
        self.mlp = MLP(config)
        self.ln_1 = RMSNorm(config.n_embd, config.norm_eps, config.learned_norms)  # before attention
        self.ln_2 = RMSNorm(config.n_embd, config.norm_eps, config.learned_norms)  # before the MLP

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        x = x + self.attn(self.ln_1(x), ctx)
        x = x + self.mlp(self.ln_2(x))
        return x


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@dataclass
class ModelOutput:
    logits: Tensor  # (B, T, V)
    hidden: Tensor  # (B, T, D) top-layer residual state, before the final norm
    info: dict = field(default_factory=dict)  # variant facts worth reporting (e.g. prefill passes used);
    # info[PER_ROW_INFO] (optional): {name: [value per row]} for facts that differ between rows


@dataclass(frozen=True)
class Draft:
    """A cheaper draft of a model, for self-speculative decoding (`engine.stream`): the decoding
    options that make it from the same weights and cache (fewer recurrence steps, say), and how
    many tokens it drafts per round before one pass of the full model verifies them."""

    options: dict
    tokens: int


# Class attributes a subclass must state for itself (not inherited): each says that the model's
# forward is simple in a way that lets the system take a shortcut, and a new architecture that
# forgot to think about it gets the safe answer (False).
OPT_IN_FLAGS = (
    "STEP_USES_EVERY_PARAMETER",  # every parameter gets a gradient in every training step (DDP need not search)
    "COMPILES_WHOLE",  # `train.compile` compiles the whole forward, not block by block (measured faster)
    "EXPORTS_AS_LLAMA",  # with the Llama family's options, the weights are a plain Llama / Qwen2 model
)


class GPT(nn.Module):
    OPTIONS: ClassVar[tuple[DecodeOption, ...]] = ()  # the baseline decodes one way
    context_class: ClassVar[type[ForwardContext]] = ForwardContext  # a variant's may carry more (its depth)
    # What the rest of the system asks of an architecture (defaults here; a variant overrides):
    SCORING_NOTES: ClassVar[dict[str, str]] = {}  # scoring-mode label -> a caveat printed beside its figure
    STEP_USES_EVERY_PARAMETER: ClassVar[bool] = True  # see OPT_IN_FLAGS
    COMPILES_WHOLE: ClassVar[bool] = True
    EXPORTS_AS_LLAMA: ClassVar[bool] = True
    # prefill / reference take `written` (B, P), the prompt's tokens the model wrote itself (a
    # conversation's earlier replies), and compute them as they were generated (fbt's feedback);
    # a model that reads every token alike is not handed it
    REPLAYS_WRITTEN: ClassVar[bool] = False
    # the `cache.state` keys the next token's decode reads (fbt's top state, lrt's memory): a model
    # that carries any and drafts itself must restore them in `keep_verified` (the registry checks)
    CARRIED_STATE: ClassVar[tuple[str, ...]] = ()

    # The tied head's product (no module holds it: its weight is the embedding's). A model computes
    # `F.linear`; `inference.accelerate` gives an instance the kernels' product, as it swaps the modules.
    tied_head_product = staticmethod(F.linear)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for flag in OPT_IN_FLAGS:
            setattr(cls, flag, cls.__dict__.get(flag, False))

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        D, V = config.n_embd, config.vocab_size
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([self.make_block(i) for i in range(config.n_layer)])
        self.lm_head = None if config.tie_embeddings else nn.Linear(D, V, bias=False)
        self.embed_norm = RMSNorm(D, config.norm_eps) if config.embed_norm else nn.Identity()
        self.ln_f = RMSNorm(D, config.norm_eps, config.learned_norms)  # the final norm, where the head reads
        self.reset_rope()
        self.reset_parameters()

    @torch.no_grad()
    def reset_rope(self) -> None:
        """(Re)compute the RoPE tables from the config, on the embedding's device. They are computed,
        never stored, so a model built on the meta device and then loaded (transformers' loading of
        an export) gets real tables by calling this."""
        c = self.config
        device = self.wte.weight.device
        if device.type == "meta":
            # a model built for its shapes (`plan`'s probe) needs only the tables' shapes: computing them
            # on the CPU first held sequence_len x head_dim floats there (GBs at a long planned context)
            shape = (c.sequence_len, c.head_dim)
            self.register_buffer("rope_cos", torch.empty(shape, dtype=torch.float32, device=device), persistent=False)
            self.register_buffer("rope_sin", torch.empty(shape, dtype=torch.float32, device=device), persistent=False)
            return
        cos, sin = rope_tables(c.sequence_len, c.head_dim, c.rope_theta, rope_frequencies(c))
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def make_block(self, layer_idx: int) -> nn.Module:
        return Block(self.config, layer_idx)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        D, L = self.config.n_embd, self.config.n_layer
        nn.init.normal_(self.wte.weight, std=D ** -0.5)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=UNTIED_HEAD_INIT_STD)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and module is not self.lm_head:
                fan_in = module.in_features
                depth_scale = (2 * L) ** -0.5 if name.endswith("c_proj") else 1.0
                nn.init.normal_(module.weight, std=fan_in ** -0.5 * depth_scale)
                if name.endswith("c_qkv") and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm) and module.weight is not None:
                nn.init.ones_(module.weight)

    # -- pieces of the forward pass, reused by the variants ----------------------------------
    def embed(self, idx: Tensor) -> Tensor:
        return self.embed_norm(self.wte(idx))  # (B, T, D)

    def context(self, idx: Tensor, cache: KVCache | None, pad_mask: Tensor | None, **fields) -> ForwardContext:
        """The context of a forward over idx (B, T); `fields`: what the arch's `context_class` adds."""
        T = idx.shape[1]
        seen = cache.length if cache is not None else 0
        if seen + T > self.config.sequence_len:  # positions never exceed slots, so this bounds them
            raise ValueError(f"{seen + T} tokens are beyond the context of {self.config.sequence_len} tokens")
        plan = cache.begin(T, pad_mask) if cache is not None else plan_attention(pad_mask, T, idx.device)
        return self.context_from_plan(plan, cache, **fields)

    def context_from_plan(self, plan: AttentionPlan, cache: KVStore | None = None, **fields) -> ForwardContext:
        cos = self.rope_cos[plan.positions][:, :, None, :]  # (B|1, T, 1, hd)
        sin = self.rope_sin[plan.positions][:, :, None, :]
        return self.context_class(plan=plan, cos=cos, sin=sin, cache=cache, **fields)

    def run_blocks(self, x: Tensor, ctx: ForwardContext, blocks: nn.ModuleList | None = None) -> Tensor:
        """x through `blocks` (default: all of them) in order."""
        for block in self.blocks if blocks is None else blocks:
            x = block(x, ctx)
        return x

    def run_stack(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        """One pass of the whole stack: inputs x (B, T, D) -> top states (B, T, D). The blocks in
        order here; an arch with a recurrent depth overrides it, and what feeds the stack its inputs
        (fbt's passes and fused tokens) composes with any stack."""
        return self.run_blocks(x, ctx)

    def readout(self, h: Tensor) -> Tensor:
        """Final norm, head and soft-cap: (B, T, D) -> (B, T, V)."""
        return self.head(self.ln_f(h))

    def head(self, h_normed: Tensor) -> Tensor:
        """Head and soft-cap of an already normed top state."""
        logits = self.tied_head_product(h_normed, self.wte.weight) if self.lm_head is None else self.lm_head(h_normed)
        cap = self.config.logit_softcap
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def run(self, idx: Tensor, cache: KVCache | None = None, pad_mask: Tensor | None = None,
            last_logits: bool = False, **fields) -> ModelOutput:
        """The plain stack over idx (B, T), through the cache when one is given; `fields` go to the
        context (e.g. a recurrent stack's depth); `last_logits` as in `prefill`."""
        ctx = self.context(idx, cache, pad_mask, **fields)
        h = self.run_stack(self.embed(idx), ctx)  # (B, T, D)
        if cache is not None:
            cache.advance()
        return ModelOutput(logits=self.readout(last_column(h) if last_logits else h), hidden=h)

    # -- the two faces ------------------------------------------------------------------------
    def forward(self, idx: Tensor, pad_mask: Tensor | None = None) -> ModelOutput:
        """The whole sequence: idx (B, T) token ids; pad_mask (B, T) True for real tokens of
        left-padded rows."""
        return self.run(idx, None, pad_mask)

    def prefill(self, idx: Tensor, cache: KVCache, pad_mask: Tensor | None = None, last_logits: bool = False,
                **options) -> ModelOutput:
        """The prompt idx (B, P) into an empty cache. `last_logits`: the logits of the last column only,
        (B, 1, V), all that decoding reads; a scorer reads every column's. At a real vocabulary the head
        over every position was the prefill's largest product: time to the first token after 2,048
        tokens at 4 x 256 with 32k tokens is 0.414x llama.cpp's (which reads out the last position
        only) with it, where an earlier run had 1.035x (experiments/logs/2026-12-05-issue54-third.md)."""
        return self.run(idx, cache, pad_mask, last_logits)

    def decode(self, idx: Tensor, cache: KVCache, **options) -> ModelOutput:
        """New tokens idx (B, n) after what the cache holds: one sampled token, or several
        teacher-forced ones (scoring)."""
        return self.run(idx, cache)

    def reference(self, idx: Tensor, pad_mask: Tensor | None = None, prompt_len: int = 0, **options) -> ModelOutput:
        """The naive path: the whole sequence so far, no cache; columns >= prompt_len were generated."""
        return self.forward(idx, pad_mask)

    def step_tokens(self, idx: Tensor, cache: KVCache, step: Callable[..., ModelOutput],
                    pad_mask: Tensor | None = None) -> ModelOutput:
        """The one loop that steps tokens through a cache, for variants whose token t needs a state
        that token t-1 leaves in the cache: `step(token (B, 1), cache, pad_mask (B, 1) | None)`."""
        outputs = [step(idx[:, t:t + 1], cache, None if pad_mask is None else pad_mask[:, t:t + 1])
                   for t in range(idx.shape[1])]
        if len(outputs) == 1:
            return outputs[0]
        return ModelOutput(logits=torch.cat([o.logits for o in outputs], dim=1),
                           hidden=torch.cat([o.hidden for o in outputs], dim=1), info=outputs[-1].info)

    def teacher_forced_prompt_len(self, seq_len: int, options: dict) -> int:
        """How much of a scored text is prefilled before the rest is decoded teacher-forced:
        the whole of it, unless the options make decoding differ from prefilling (fbt soft)."""
        return seq_len

    @classmethod
    def scoring_modes(cls, config: ModelConfig) -> dict[str, dict]:
        """The ways worth scoring a model by default (label -> options)."""
        return {"plain": {}}

    # -- what the rest of the system asks of an architecture -----------------------------------
    def fast_path_blocker(self, options: dict) -> str | None:
        """Why decoding with `options` cannot run as one compiled static-shape step (inference/fast.py),
        or None when it can."""
        return None

    def draft_options(self, options: dict) -> Draft | None:
        """The cheaper draft of this model that `options` (complete, checked) ask for, or None: no
        drafting (self-speculative decoding is off). An arch that offers a draft of itself declares
        options that turn it on (rgpt's `draft_steps`, `draft_tokens`) and overrides this; it raises
        a one-line ConfigError for options that cannot be drafted (`engine.model_options` asks)."""
        return None

    def keep_verified(self, cache: KVCache, out: ModelOutput, kept: Tensor, state_before: dict[str, Tensor],
                      options: dict) -> None:
        """Self-speculative decoding: of the tokens the last `decode(..., **options)` call added
        (`out`), row b keeps its first kept[b] (B,) and the rest leave the cache as if never decoded
        (`KVCache.keep_recent`). `state_before`: `cache.state` before that call; an arch that carries
        state from token to token (its CARRIED_STATE, fbt's top state) overrides this to set it to
        what the last kept token left (rfbt does; the registry refuses a drafting arch that does not)."""
        cache.keep_recent(kept, out.logits.shape[1])

    def prepare_fast_decoding(self) -> None:
        """Compute, eagerly, what the compiled decode step reads as a constant (before compiling)."""

    def recomputable_modules(self) -> list[nn.Module]:
        """The modules whose activations training may recompute in the backward (activation
        checkpointing, latentloop.parallel): every block, unless a forward reads state a block's
        recomputation would see changed."""
        return list(self.blocks)

    def upcycle_from(self, weights: dict[str, Tensor], base_layers: int,
                     load: Callable[[dict[str, Tensor]], list[str]]) -> dict | None:
        """Start this model from a gpt run's `weights` (`base_layers` pretrained blocks): map them,
        `load(tensors)` (every tensor must fit; returns the parameters left at their init), set
        what must start exactly, and return a report: {"mapping", "new", "exact_at_step0", ...}.
        None: this arch cannot start from a gpt run (`latentloop.interop.upcycle` says so)."""
        return None

    # -- utilities ---------------------------------------------------------------------------
    def cache_slots(self) -> int:
        return self.config.n_layer

    def new_cache(self, batch_size: int, max_len: int | None = None, **options) -> KVCache:
        """An empty cache for `batch_size` rows of up to `max_len` tokens; `options` are the
        decoding options (some variants size their cache by them)."""
        weight = self.wte.weight
        return KVCache(batch_size, max_len or self.config.sequence_len, self.cache_slots(), self.config.n_kv_head,
                       self.config.head_dim, device=weight.device, dtype=weight.dtype)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int | None = None, **forward_options) -> float:
        """Training FLOPs per token (forward + backward) of `forward(idx, **forward_options)`,
        counted structurally: see `latentloop.models.flops`."""
        seq_len = seq_len or self.config.sequence_len
        return count_flops_per_token(self, lambda idx: self(idx, **forward_options), seq_len)
