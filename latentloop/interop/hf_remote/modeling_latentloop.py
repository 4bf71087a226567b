"""latentloop's architectures (gpt, fbt, lrt, rgpt) as a self-contained transformers model.

Written by `latentloop export RUN --format hf` next to `configuration_latentloop.py`; loads with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and needs torch and
transformers (5.x), never latentloop. It mirrors the package's models operation for operation (its
tests compare the logits and greedy tokens of the two), and keeps the package's tensor names, so
the exported model.safetensors is the package's state dict.

Decoding. A token's latent state (fbt's carried top state, lrt's memory) must reach the next
token, and rgpt keeps one key/value slot per recurrence step, so the model keeps its own cache
(`LatentCache`: keys/values per slot, per-row positions, named state) instead of a transformers
`Cache`. `generate()` always decodes through it: the prompt is prefilled once, then each new token
is one step (the `use_cache` flag of generate is ignored: the latent state has nowhere else to
live). Options, as `generate(..., regime="soft")` / `forward(..., steps=2)` keyword arguments or
the config's `decoding` defaults:
- fbt `regime`: standard (plain inputs), soft (plain prompt, then each new token fused with the
  previous step's top state), fused (`passes`-pass prompt prefill, then soft);
- lrt: the exact sequential recurrence (one token per step, prompt included);
- rgpt `steps`: the recurrence depth, fixed for a whole generation.

`forward(input_ids)` without a cache scores a whole text the way decoding would produce it: the
first `prompt_len` tokens are prefilled (default: all of them; fbt soft: the first only, so that
every later position is fused), the rest stepped through the cache (teacher forcing).
Left-padded batches (attention_mask with zeros on the left) decode each row as it would alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_latentloop import LatentloopConfig

FBT_STATE = "fbt.prev_top"
LRT_MEMORY = "lrt.memory"
FBT_REGIMES = ("standard", "soft", "fused")
AUTO_TOLERANCE = 1e-3  # fbt passes="auto": stop once every position's relative change is below this
AUTO_MAX_PASSES = 16
NORM_FLOOR = 1e-12  # keeps a relative change finite for an all-zero state


# --------------------------------------------------------------------------------------------
# The package's config, read from the exported dict
# --------------------------------------------------------------------------------------------


class Settings:
    """Attribute access to the package's model config (config.latentloop), derived fields included."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.n_embd // self.n_head
        hidden = self.mlp_ratio * self.n_embd * (2 / 3 if self.mlp == "swiglu" else 1)
        self.mlp_hidden = self.intermediate_size or max(1, int(round(hidden)))
        self.inject_layers = tuple(getattr(self, "inject_layers", ()) or ())

    def injects(self, layer_idx: int) -> bool:
        return not self.inject_layers or layer_idx in self.inject_layers


# --------------------------------------------------------------------------------------------
# Norms and RoPE (latentloop's: a rotation the other way round than Llama's)
# --------------------------------------------------------------------------------------------


def norm(x: Tensor, eps: float | None = None) -> Tensor:
    return F.rms_norm(x, (x.size(-1),), eps=eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float | None = None, learned: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if learned else None

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def shift_right(s: Tensor) -> Tensor:
    return torch.cat([torch.zeros_like(s[:, :1]), s[:, :-1]], dim=1)


def rope_frequencies(s: Settings) -> Tensor:
    hd = s.head_dim
    inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    if s.rope_scaling == "linear":
        return inv_freq / s.rope_factor
    if s.rope_scaling == "llama3":
        factor, low, high = s.rope_factor, s.rope_low_freq_factor, s.rope_high_freq_factor
        original = s.rope_original_max_positions
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


def rope_tables(s: Settings) -> tuple[Tensor, Tensor]:
    angles = torch.outer(torch.arange(s.sequence_len, dtype=torch.float32), rope_frequencies(s))
    return torch.cat([angles.cos(), angles.cos()], dim=-1), torch.cat([angles.sin(), -angles.sin()], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


# --------------------------------------------------------------------------------------------
# The cache: keys/values per slot, positions per row, named latent state
# --------------------------------------------------------------------------------------------


def attention_mask(query_pos: Tensor, key_pos: Tensor, query_slot: Tensor, key_slot: Tensor) -> Tensor:
    """(B, 1, Tq, Tk): a query sees stored keys at positions <= its own; padding (-1) never, except
    its own slot (so a padding query never has an empty row)."""
    visible = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= query_pos[:, :, None])
    own_slot = key_slot[None, None, :] == query_slot[None, :, None]
    return (visible | own_slot)[:, None]


@dataclass
class Plan:
    positions: Tensor  # (B|1, T)
    mask: Tensor | None
    is_causal: bool


class LatentCache:
    """Keys/values of every attention slot (grown as tokens arrive), the position of every stored
    token per row (-1: padding), and the latent state a token leaves for the next one."""

    def __init__(self, n_slots: int, batch_size: int, device: torch.device, depth: int | None = None):
        self.k: list[Tensor | None] = [None] * n_slots
        self.v: list[Tensor | None] = [None] * n_slots
        self.key_pos = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0  # columns stored (padding included)
        self.pending = 0
        self.has_padding = False
        self.depth = depth  # rgpt: the recurrence depth this cache was built for
        self.state: dict[str, Tensor] = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def begin(self, T: int, pad_mask: Tensor | None) -> Plan:
        device = self.key_pos.device
        if pad_mask is None:
            positions = self.next_pos[:, None] + torch.arange(T, device=device)[None]
            key_pos = positions
        else:
            offsets = pad_mask.long().cumsum(dim=1) - 1
            positions = self.next_pos[:, None] + offsets.clamp(min=0)
            key_pos = torch.where(pad_mask, positions, torch.full_like(positions, -1))
            self.has_padding = self.has_padding or bool((~pad_mask).any())
        self.key_pos = torch.cat([self.key_pos[:, :self.length], key_pos], dim=1)
        self.next_pos = self.next_pos + (T if pad_mask is None else pad_mask.long().sum(dim=1))
        self.pending = T
        if not self.has_padding and self.length == 0:
            return Plan(positions, None, True)
        if not self.has_padding and T == 1:
            return Plan(positions, None, False)
        end = self.length + T
        mask = attention_mask(positions, self.key_pos, torch.arange(self.length, end, device=device),
                              torch.arange(end, device=device))
        return Plan(positions, mask, False)

    def update(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this forward's k, v (B, H, T, hd) in `slot` (a repeated pass over the same tokens
        replaces them); return every key/value of the slot so far."""
        if self.k[slot] is None or self.length == 0:
            self.k[slot], self.v[slot] = k, v
        else:
            self.k[slot] = torch.cat([self.k[slot][:, :, :self.length], k], dim=2)
            self.v[slot] = torch.cat([self.v[slot][:, :, :self.length], v], dim=2)
        return self.k[slot], self.v[slot]

    def advance(self) -> None:
        self.length += self.pending
        self.pending = 0


@dataclass
class Context:
    plan: Plan
    cos: Tensor
    sin: Tensor
    cache: LatentCache | None = None
    slot_offset: int = 0
    memory: Tensor | None = None  # lrt: m_{t-1} per position
    memory_kv: Tensor | None = None  # lrt: shared [W_k m, W_v m]
    source: Tensor | None = None  # lrt: written by the source block


def plan_uncached(pad_mask: Tensor | None, T: int, device: torch.device) -> Plan:
    if pad_mask is None:
        return Plan(torch.arange(T, device=device)[None], None, True)
    positions = (pad_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    key_pos = torch.where(pad_mask, positions, torch.full_like(positions, -1))
    slots = torch.arange(T, device=device)
    return Plan(positions, attention_mask(positions, key_pos, slots, slots), False)


# --------------------------------------------------------------------------------------------
# Layers (with lrt's memory injection when the arch is lrt)
# --------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, s: Settings, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = s.n_head, s.n_kv_head, s.head_dim
        D = s.n_embd
        self.c_qkv = nn.Linear(D, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=s.qkv_bias)
        self.c_proj = nn.Linear(D, D, bias=False)
        self.qk_norm = RMSNorm(self.head_dim, s.norm_eps) if s.qk_norm else None
        self.inject = s.arch == "lrt" and s.injects(layer_idx) and s.injection in ("kv", "both")
        self.layerwise = s.arch == "lrt" and s.kv_projection == "layerwise"
        if self.inject:
            self.c_gate = nn.Linear(D, 2 * self.n_kv_head, bias=False)
            if self.layerwise:
                self.c_mem_kv = nn.Linear(D, 2 * self.n_kv_head * self.head_dim, bias=False)

    def project_qkv(self, x: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        qkv = self.c_qkv(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim)
        q, kv = qkv.split([self.n_head, 2 * self.n_kv_head], dim=2)
        if not self.inject:
            return q, *kv.chunk(2, dim=2)
        kv_fb = ctx.memory_kv if not self.layerwise else self.c_mem_kv(ctx.memory)
        H, hd = self.n_kv_head, self.head_dim
        g_loc, g_fb = (2 * torch.sigmoid(self.c_gate(x))).view(B, T, 2, 1, H, 1).unbind(2)
        kv = torch.addcmul(kv.view(B, T, 2, H, hd) * g_loc, g_fb, kv_fb.view(B, T, 2, H, hd))
        return q, *kv.view(B, T, 2 * H, hd).chunk(2, dim=2)

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.project_qkv(x, ctx)
        qk = apply_rope(torch.cat([q, k], dim=2), ctx.cos, ctx.sin)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        q, k = qk.split([self.n_head, self.n_kv_head], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if ctx.cache is not None:
            k, v = ctx.cache.update(ctx.slot_offset + self.layer_idx, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.plan.mask, is_causal=ctx.plan.is_causal,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.swiglu = s.mlp == "swiglu"
        self.c_fc = nn.Linear(s.n_embd, s.mlp_hidden, bias=False)
        self.c_gate = nn.Linear(s.n_embd, s.mlp_hidden, bias=False) if self.swiglu else None
        self.c_proj = nn.Linear(s.mlp_hidden, s.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.c_gate(x)) * self.c_fc(x) if self.swiglu else F.relu(self.c_fc(x)).square()
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, s: Settings, layer_idx: int):
        super().__init__()
        self.attn = Attention(s, layer_idx)
        self.mlp = MLP(s)
        self.ln_1 = RMSNorm(s.n_embd, s.norm_eps, s.learned_norms)
        self.ln_2 = RMSNorm(s.n_embd, s.norm_eps, s.learned_norms)
        self.inject = s.arch == "lrt" and s.injects(layer_idx) and s.injection in ("residual", "both")
        self.is_source = s.arch == "lrt" and layer_idx == s.source_layer
        if self.inject:
            self.mem_alpha = nn.Parameter(torch.ones(1))
            self.mem_gamma = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        if self.inject:
            x = torch.addcmul(self.mem_alpha * x, self.mem_gamma, ctx.memory)
        x = x + self.attn(self.ln_1(x), ctx)
        x = x + self.mlp(self.ln_2(x))
        if self.is_source:
            ctx.source = norm(x)
        return x


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@dataclass
class LatentloopOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None
    cache: Any = None


class LatentloopForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LatentloopConfig
    base_model_prefix = "latentloop"
    _no_split_modules = ["Block"]

    def __init__(self, config: LatentloopConfig):
        super().__init__(config)
        s = self.s = Settings(config.latentloop)
        D, V = s.n_embd, s.vocab_size
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(s, i) for i in range(s.n_layer)])
        self.lm_head = None if s.tie_embeddings else nn.Linear(D, V, bias=False)
        self.embed_norm = RMSNorm(D, s.norm_eps) if s.embed_norm else nn.Identity()
        self.ln_f = RMSNorm(D, s.norm_eps, s.learned_norms)
        if s.arch == "fbt":
            self.fuse_value = nn.Linear(D, D, bias=False)
            self.fuse_gate = nn.Linear(D, D, bias=False)
            self.fuse_scale = None if s.embed_norm else nn.Parameter(torch.ones(1))
        if s.arch == "lrt":
            uses_shared = s.injection in ("kv", "both") and s.kv_projection == "shared"
            self.mem_kv = nn.Linear(D, 2 * s.n_kv_head * s.head_dim, bias=False) if uses_shared else None
        if s.arch == "rgpt":
            self.proj = nn.Linear(2 * D, D, bias=False)
            self.gate_in = nn.Linear(2 * D, D)
            self.gate_out = nn.Linear(D, D)
        self._rope: dict[tuple, tuple[Tensor, Tensor]] = {}  # computed on use: never a (meta-initialised) buffer
        self.post_init()

    # -- transformers plumbing ---------------------------------------------------------------
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model keeps its own LatentCache (see the module docstring)

    def _init_weights(self, module: nn.Module) -> None:
        """Only for tensors a checkpoint lacks (every export has them all)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=module.in_features ** -0.5)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=module.embedding_dim ** -0.5)
        elif isinstance(module, RMSNorm) and module.weight is not None:
            nn.init.ones_(module.weight)

    def get_input_embeddings(self) -> nn.Module:
        return self.wte

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: LatentCache | None = None,
                                      attention_mask: Tensor | None = None, **kwargs) -> dict[str, Any]:
        """The tokens the cache has not seen; the first call prefills the whole prompt."""
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        inputs = {"attention_mask": attention_mask, "use_cache": True, "cache": cache}
        if cache is None:
            inputs.update(input_ids=input_ids, prompt_len=input_ids.shape[1])
        else:
            inputs["input_ids"] = input_ids[:, cache.length:]
        for name in ("regime", "passes", "steps"):
            if kwargs.get(name) is not None:
                inputs[name] = kwargs[name]
        return inputs

    # -- shared pieces ------------------------------------------------------------------------
    def options(self, regime: str | None, passes: int | str | None, steps: int | None) -> dict[str, Any]:
        d, arch = self.config.decoding, self.s.arch
        given = {"regime": regime, "passes": passes, "steps": steps}
        allowed = {"fbt": ("regime", "passes"), "rgpt": ("steps",)}.get(arch, ())
        stray = [name for name, value in given.items() if value is not None and name not in allowed]
        if stray:
            raise ValueError(f"arch {arch!r} has no option {', '.join(stray)}")
        if arch == "fbt":
            out = {"regime": regime or d.get("regime", "soft"), "passes": passes or d.get("passes", 2)}
            if out["regime"] not in FBT_REGIMES:
                raise ValueError(f"regime must be one of {', '.join(FBT_REGIMES)}, got {out['regime']!r}")
            if not (out["passes"] == "auto" or (isinstance(out["passes"], int) and out["passes"] >= 1)):
                raise ValueError(f"passes must be an integer >= 1 or 'auto', got {out['passes']!r}")
            return out
        if arch == "rgpt":
            out = {"steps": steps or d.get("steps") or self.s.recurrence_steps}
            if not isinstance(out["steps"], int) or out["steps"] < 1:
                raise ValueError(f"steps must be an integer >= 1, got {out['steps']!r}")
            return out
        return {}

    def rope(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        key = (device, dtype)
        if key not in self._rope:
            cos, sin = rope_tables(self.s)
            self._rope[key] = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
        return self._rope[key]

    def context(self, idx: Tensor, cache: LatentCache | None, pad_mask: Tensor | None) -> Context:
        T = idx.shape[1]
        seen = cache.length if cache is not None else 0
        if seen + T > self.s.sequence_len:
            raise ValueError(f"{seen + T} tokens are beyond the context of {self.s.sequence_len} tokens")
        plan = cache.begin(T, pad_mask) if cache is not None else plan_uncached(pad_mask, T, idx.device)
        cos_table, sin_table = self.rope(idx.device, self.wte.weight.dtype)
        cos = cos_table[plan.positions][:, :, None, :]
        sin = sin_table[plan.positions][:, :, None, :]
        return Context(plan=plan, cos=cos, sin=sin, cache=cache)

    def embed(self, idx: Tensor) -> Tensor:
        return self.embed_norm(self.wte(idx))

    def run_blocks(self, x: Tensor, ctx: Context, blocks=None) -> Tensor:
        for block in self.blocks if blocks is None else blocks:
            x = block(x, ctx)
        return x

    def head(self, h_normed: Tensor) -> Tensor:
        logits = F.linear(h_normed, self.wte.weight) if self.lm_head is None else self.lm_head(h_normed)
        cap = self.s.logit_softcap
        return cap * torch.tanh(logits / cap) if cap > 0 else logits

    def readout(self, h: Tensor) -> Tensor:
        return self.head(self.ln_f(h))

    def step_tokens(self, idx: Tensor, cache: LatentCache, step, pad_mask: Tensor | None = None) -> Tensor:
        """Logits (B, T, V) of tokens stepped one by one through the cache."""
        return torch.cat([step(idx[:, t:t + 1], cache, None if pad_mask is None else pad_mask[:, t:t + 1])
                          for t in range(idx.shape[1])], dim=1)

    def new_cache(self, batch_size: int, device: torch.device, opts: dict[str, Any]) -> LatentCache:
        s = self.s
        if s.arch == "rgpt":
            return LatentCache(s.n_pre + s.n_rec * opts["steps"] + s.n_coda, batch_size, device, opts["steps"])
        return LatentCache(s.n_layer, batch_size, device)

    # -- gpt ---------------------------------------------------------------------------------
    def run(self, idx: Tensor, cache: LatentCache, pad_mask: Tensor | None) -> Tensor:
        h = self.run_blocks(self.embed(idx), self.context(idx, cache, pad_mask))
        cache.advance()
        return self.readout(h)

    # -- fbt ---------------------------------------------------------------------------------
    def carried_state(self, h: Tensor) -> Tensor:
        return self.ln_f(h) if self.s.state_source == "post_norm" else h

    def fuse(self, e: Tensor, s_prev: Tensor, gate: Tensor | None = None) -> Tensor:
        gate = torch.sigmoid(self.fuse_gate(e)) if gate is None else gate
        fused = norm(self.fuse_value(s_prev) * gate)
        return fused if self.fuse_scale is None else fused * self.fuse_scale

    def fuse_mask(self, idx: Tensor, positions: Tensor, fuse_from: int) -> Tensor:
        return (positions >= max(1, fuse_from)) & (idx != self.s.bos_id)

    def fbt_prefill(self, idx: Tensor, cache: LatentCache, pad_mask: Tensor | None, opts: dict) -> Tensor:
        """One plain pass (standard, soft) or `passes` passes (fused), each rewriting the cache."""
        passes = 1 if opts["regime"] != "fused" else (AUTO_MAX_PASSES if opts["passes"] == "auto" else opts["passes"])
        auto = opts["regime"] == "fused" and opts["passes"] == "auto"
        ctx = self.context(idx, cache, pad_mask)
        mask = self.fuse_mask(idx, ctx.plan.positions, 1)[..., None]
        e = self.embed(idx)
        x, states = e, []
        for k in range(passes):
            h = self.run_blocks(x, ctx)
            states.append(h)
            if auto and k > 0:
                change = (h - states[-2]).norm(dim=-1) / h.norm(dim=-1).clamp_min(NORM_FLOOR)
                if bool((change < AUTO_TOLERANCE).all()):
                    break
            if k < passes - 1:
                x = torch.where(mask, self.fuse(e, shift_right(self.carried_state(h))), e)
        cache.advance()
        cache.state[FBT_STATE] = self.carried_state(states[-1][:, -1:])
        return self.readout(states[-1])

    def soft_step(self, token: Tensor, cache: LatentCache, pad_mask: Tensor | None = None) -> Tensor:
        e = self.embed(token)
        gate = None
        if not torch.is_grad_enabled():  # the token gate from a per-token table, as the package decodes
            if "fbt.gates" not in cache.state:
                cache.state["fbt.gates"] = torch.sigmoid(self.fuse_gate(self.embed_norm(self.wte.weight)))
            gate = cache.state["fbt.gates"][token]
        fused = self.fuse(e, cache.state[FBT_STATE], gate)
        x = torch.where((token != self.s.bos_id)[..., None], fused, e)
        h = self.run_blocks(x, self.context(token, cache, None))
        cache.advance()
        h_normed = self.ln_f(h)
        cache.state[FBT_STATE] = h_normed if self.s.state_source == "post_norm" else h
        return self.head(h_normed)

    # -- lrt ---------------------------------------------------------------------------------
    def lrt_step(self, token: Tensor, cache: LatentCache, pad_mask: Tensor | None = None) -> Tensor:
        ctx = self.context(token, cache, pad_mask)
        previous = cache.state.get(LRT_MEMORY)
        if previous is None:
            previous = self.wte.weight.new_zeros(token.shape[0], 1, self.s.n_embd)
        restart = (ctx.plan.positions == 0) | (token == self.s.bos_id)
        ctx.memory = previous.masked_fill(restart[..., None], 0.0)
        if self.mem_kv is not None:
            ctx.memory_kv = self.mem_kv(ctx.memory)
        h = self.run_blocks(self.embed(token), ctx)
        source = self.ln_f(h) if self.s.source_layer < 0 else ctx.source
        cache.advance()
        cache.state[LRT_MEMORY] = source if pad_mask is None else torch.where(pad_mask[..., None], source, previous)
        return self.head(source) if self.s.source_layer < 0 else self.readout(h)

    # -- rgpt --------------------------------------------------------------------------------
    def rgpt_run(self, idx: Tensor, cache: LatentCache, pad_mask: Tensor | None, steps: int) -> Tensor:
        s = self.s
        if cache.depth != steps:
            raise ValueError(f"this cache was built for {cache.depth} recurrence steps; {steps} were asked for")
        ctx = self.context(idx, cache, pad_mask)
        prelude, core = self.blocks[:s.n_pre], self.blocks[s.n_pre:s.n_pre + s.n_rec]
        coda = self.blocks[s.n_pre + s.n_rec:]
        h_pre = self.run_blocks(self.embed(idx), ctx, prelude)
        h = h_pre
        for r in range(1, steps + 1):
            ctx.slot_offset = (r - 1) * s.n_rec
            o = self.run_blocks(self.proj(torch.cat([h, h_pre], dim=-1)), ctx, core)
            g = torch.sigmoid(self.gate_out(F.silu(self.gate_in(torch.cat([norm(h), norm(h_pre)], dim=-1))))
                              / s.gate_temperature)
            h = torch.lerp(o, h, g)
        ctx.slot_offset = (steps - 1) * s.n_rec
        top = self.run_blocks(h, ctx, coda)
        cache.advance()
        return self.readout(top)

    # -- prefill / decode / forward ---------------------------------------------------------
    def prefill(self, idx: Tensor, cache: LatentCache, pad_mask: Tensor | None, opts: dict) -> Tensor:
        arch = self.s.arch
        if arch == "fbt":
            return self.fbt_prefill(idx, cache, pad_mask, opts)
        if arch == "lrt":
            return self.step_tokens(idx, cache, self.lrt_step, pad_mask)
        if arch == "rgpt":
            return self.rgpt_run(idx, cache, pad_mask, opts["steps"])
        return self.run(idx, cache, pad_mask)

    def decode(self, idx: Tensor, cache: LatentCache, opts: dict) -> Tensor:
        arch = self.s.arch
        if arch == "fbt":
            if opts["regime"] == "standard":
                return self.run(idx, cache, None)
            return self.step_tokens(idx, cache, self.soft_step)
        if arch == "lrt":
            return self.step_tokens(idx, cache, self.lrt_step)
        if arch == "rgpt":
            return self.rgpt_run(idx, cache, None, opts["steps"])
        return self.run(idx, cache, None)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: LatentCache | None = None, use_cache: bool | None = None, labels: Tensor | None = None,
                prompt_len: int | None = None, regime: str | None = None, passes: int | str | None = None,
                steps: int | None = None, return_dict: bool | None = None, **kwargs) -> LatentloopOutput:
        """Logits of input_ids (B, T). Without a cache: prefill the first `prompt_len` tokens (default:
        all, fbt soft: 1), step the rest; with one: the new tokens after what it holds."""
        cache = cache if cache is not None else kwargs.get("past_key_values")
        if cache is not None and not isinstance(cache, LatentCache):
            raise ValueError(f"this model decodes with its own LatentCache, not {type(cache).__name__}")
        opts = self.options(regime, passes, steps)
        T = input_ids.shape[1]
        pad_mask = None
        if attention_mask is not None:
            new_columns = attention_mask[:, -T:].bool()
            if not bool(new_columns.all()):
                if cache is not None and cache.length > 0:
                    raise ValueError("padding is supported on the left of the prompt only")
                pad_mask = new_columns
        if cache is None:
            cache = self.new_cache(input_ids.shape[0], input_ids.device, opts)
            if prompt_len is None:
                prompt_len = 1 if self.s.arch == "fbt" and opts["regime"] == "soft" else T
            P = max(1, min(prompt_len, T))
            logits = self.prefill(input_ids[:, :P], cache, None if pad_mask is None else pad_mask[:, :P], opts)
            if P < T:
                if pad_mask is not None and not bool(pad_mask[:, P:].all()):
                    raise ValueError("padding is supported on the left of the prompt only")
                logits = torch.cat([logits, self.decode(input_ids[:, P:], cache, opts)], dim=1)
        else:
            logits = self.decode(input_ids, cache, opts)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return LatentloopOutput(loss=loss, logits=logits, cache=cache if use_cache else None)
