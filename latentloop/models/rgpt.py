"""RecurrentGPT, a.k.a. Gated Recurrent Transformer (arch `rgpt`; Hegazy et al., 2026).

Depth is decoupled from parameters: a prelude runs once, a shared core of n_rec blocks is applied
R times with a projected, gated state update, and a coda reads the final state:

    h_pre = prelude(x),   h^(0) = h_pre
    for r = 1..R:
        h̃     = W_proj [h^(r-1) + ε_x, h_pre]                          (Linear 2D -> D)
        o     = core(h̃)                                                  (the n_rec shared blocks)
        g     = σ(f_gate([norm(h^(r-1)), norm(h_pre)]) / τ + ε_g)        (Linear 2D->D, SiLU, Linear D->D)
        h^(r) = g ⊙ h^(r-1) + (1 - g) ⊙ o
    logits = head(coda(h^(R)))

f_gate's last bias starts at +4 (g ≈ 0.98: each step first passes the state almost unchanged);
ε_x, ε_g ~ N(0, noise_std²) in training only. "norm" is the backbone's parameter-free RMSNorm.

Notable features:
- one checkpoint, many operating points: `forward(idx, steps=r)` for any r (early exit at a fixed
  depth; r above the trained R is allowed and reported)
- adaptive per-token exit while decoding: stop when the KL divergence between successive steps'
  next-token distributions (or the relative change of the state) falls under a threshold, after
  `min_steps`
- a KV cache with one slot per (recurrence step, core layer) in mode `full` (exact), or one per core
  layer: `mean` (running mean of a token's keys/values over its steps) or `last` (its latest step).
  Rule for early exits: a token that stopped at step e has no keys/values of its own for later
  steps, so its entries for steps > e repeat those of step e (the latest step it computed); in
  `mean` its running mean simply stops. The prompt prefill always runs at a fixed depth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import RGPTConfig
from ..errors import ConfigError
from .backbone import GPT, ForwardContext, ModelOutput, norm
from .cache import KVCache

CACHE_MODES = ("full", "mean", "last")
EXIT_CRITERIA = ("kl", "state")
OPTIONS = ("steps", "cache_mode", "exit_threshold", "exit_criterion", "min_steps")


@dataclass
class RGPTOutput(ModelOutput):
    steps: int = 0
    step_logits: list[Tensor] = field(default_factory=list)  # (B, T, V) after each step, when requested
    gate_means: list[float] = field(default_factory=list)  # mean gate value of each step, when requested


class RecurrentKVCache(KVCache):
    """KV cache whose core-layer slots follow `mode` (see the module docstring).

    The model sets `step` (1-based) and `active` (B,) before each core step; `core_slot` tells
    whether a slot belongs to the core, and in `full` mode `slot - n_rec` is the previous step's.
    """

    def __init__(self, batch_size: int, max_len: int, config: RGPTConfig, mode: str, max_steps: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        c = config
        core_slots = c.n_rec * (max_steps if mode == "full" else 1)
        super().__init__(batch_size, max_len, c.n_pre + core_slots + c.n_coda, c.n_kv_head, c.head_dim,
                         device=device, dtype=dtype)
        self.mode, self.n_rec, self.max_steps = mode, c.n_rec, max_steps
        self.first_core_slot, self.last_core_slot = c.n_pre, c.n_pre + core_slots - 1
        self.step = 1
        self.active: Tensor | None = None  # (B,) rows still recurring; None = all

    def update(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if not self.first_core_slot <= slot <= self.last_core_slot:  # prelude / coda: a plain slot
            return super().update(slot, k, v)
        start, end = self.length, self.length + k.shape[2]
        if self.mode == "full":
            previous = slot - self.n_rec if self.step > 1 else None
        else:
            previous = slot
        if self.mode == "mean" and self.step > 1:  # running mean over this token's steps
            k = self.k[slot, :, :, start:end] + (k - self.k[slot, :, :, start:end]) / self.step
            v = self.v[slot, :, :, start:end] + (v - self.v[slot, :, :, start:end]) / self.step
        if self.active is not None and previous is not None:  # stopped rows keep their latest step
            keep = ~self.active[:, None, None, None]
            k = torch.where(keep, self.k[previous, :, :, start:end], k)
            v = torch.where(keep, self.v[previous, :, :, start:end], v)
        return super().update(slot, k, v)

    def fill_later_steps(self, last_step: int) -> None:
        """Full mode: steps after `last_step` repeat its keys/values for the tokens just added."""
        if self.mode != "full":
            return
        start, end = self.length, self.length + self._pending
        first = self.first_core_slot
        for step in range(last_step + 1, self.max_steps + 1):
            for j in range(self.n_rec):
                src, dst = first + (last_step - 1) * self.n_rec + j, first + (step - 1) * self.n_rec + j
                self.k[dst, :, :, start:end] = self.k[src, :, :, start:end]
                self.v[dst, :, :, start:end] = self.v[src, :, :, start:end]


class RGPT(GPT):
    config_class = RGPTConfig

    def __init__(self, config: RGPTConfig):
        super().__init__(config)
        D = config.n_embd
        self.proj = nn.Linear(2 * D, D, bias=False)  # W_proj [h + eps_x, h_pre]
        self.gate_in = nn.Linear(2 * D, D)  # f_gate, first layer
        self.gate_out = nn.Linear(D, D)  # f_gate, last layer
        for linear in (self.proj, self.gate_in, self.gate_out):
            nn.init.normal_(linear.weight, std=linear.in_features ** -0.5)
        nn.init.zeros_(self.gate_in.bias)
        nn.init.constant_(self.gate_out.bias, config.gate_bias_init)

    @property
    def prelude(self) -> nn.ModuleList:
        return self.blocks[:self.config.n_pre]

    @property
    def core(self) -> nn.ModuleList:
        return self.blocks[self.config.n_pre:self.config.n_pre + self.config.n_rec]

    @property
    def coda(self) -> nn.ModuleList:
        return self.blocks[self.config.n_pre + self.config.n_rec:]

    # -- the mechanism ------------------------------------------------------------------------
    def recur(self, h: Tensor, h_pre: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """One step: (h^(r-1), h_pre) -> (h^(r), g)."""
        noisy = self.training and self.config.noise_std > 0
        h_in = h + self.config.noise_std * torch.randn_like(h) if noisy else h
        o = self.run_blocks(self.proj(torch.cat([h_in, h_pre], dim=-1)), ctx, self.core)  # core(h̃)
        gate_logits = self.gate_out(F.silu(self.gate_in(torch.cat([norm(h), norm(h_pre)], dim=-1))))
        gate_logits = gate_logits / self.config.gate_temperature
        if noisy:
            gate_logits = gate_logits + self.config.noise_std * torch.randn_like(gate_logits)
        g = torch.sigmoid(gate_logits)
        return torch.lerp(o, h, g), g  # g * h + (1 - g) * o

    def _slot_ctx(self, ctx: ForwardContext, step: int | None) -> ForwardContext:
        """Context whose cache slots are those of core step `step` (None: the coda, after all steps)."""
        cache = ctx.cache
        if not isinstance(cache, RecurrentKVCache) or cache.mode != "full":
            return ctx
        last = cache.max_steps if step is None else step
        return dataclasses.replace(ctx, slot_offset=(last - 1) * self.config.n_rec)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, idx: Tensor, cache: KVCache | None = None, pad_mask: Tensor | None = None,
                steps: int | None = None, return_steps: bool = False, no_grad_steps: int = 0) -> RGPTOutput:
        """Prelude -> `steps` core applications (default: the trained R) -> coda.

        return_steps: also the logits after every step (coda + head applied to each h^(r)).
        no_grad_steps: the first n steps run without gradient (truncated backprop).
        """
        steps = steps or self.config.recurrence_steps
        if steps < 1:
            raise ConfigError(f"steps must be >= 1, got {steps}")
        max_steps = cache.max_steps if isinstance(cache, RecurrentKVCache) and cache.mode == "full" else steps
        if steps > max_steps:
            raise ConfigError(f"this cache holds {max_steps} recurrence steps; {steps} were asked for")
        ctx = self.context(idx, cache, pad_mask)
        h_pre = self.run_blocks(self.embed(idx), ctx, self.prelude)  # (B, T, D)
        h, out = h_pre, RGPTOutput(logits=None, hidden=None, steps=steps)
        for r in range(1, steps + 1):
            if isinstance(cache, RecurrentKVCache):
                cache.step, cache.active = r, None
            with torch.set_grad_enabled(torch.is_grad_enabled() and r > no_grad_steps):
                h, g = self.recur(h, h_pre, self._slot_ctx(ctx, r))
            if return_steps:  # reading the gate syncs with the device: only when asked
                out.gate_means.append(float(g.detach().mean()))
            if return_steps and r < steps:
                out.step_logits.append(self.readout(self.run_blocks(h, self._slot_ctx(ctx, None), self.coda)))
        if isinstance(cache, RecurrentKVCache):
            cache.fill_later_steps(steps)
        top = self.run_blocks(h, self._slot_ctx(ctx, None), self.coda)
        if cache is not None:
            cache.advance()
        out.logits, out.hidden = self.readout(top), top
        if return_steps:
            out.step_logits.append(out.logits)
        return out

    def decode_adaptive(self, idx: Tensor, cache: RecurrentKVCache, max_steps: int, threshold: float,
                        criterion: str, min_steps: int) -> RGPTOutput:
        """One token per row with per-row early exit (rows stop independently)."""
        ctx = self.context(idx, cache, None)
        coda_ctx = self._slot_ctx(ctx, None)
        h_pre = self.run_blocks(self.embed(idx), ctx, self.prelude)
        h = h_pre
        active = torch.ones(idx.shape[0], dtype=torch.bool, device=idx.device)
        exit_step = torch.full_like(active, max_steps, dtype=torch.long)
        previous_logp = None
        for r in range(1, max_steps + 1):
            cache.step, cache.active = r, (None if bool(active.all()) else active)
            h_new, _ = self.recur(h, h_pre, self._slot_ctx(ctx, r))
            if criterion == "state":
                change = (h_new - h).norm(dim=-1) / h_new.norm(dim=-1).clamp_min(1e-12)  # (B, 1)
                settled = change[:, -1] < threshold
            else:
                logp = F.log_softmax(self.readout(self.run_blocks(h_new, coda_ctx, self.coda))[:, -1].float(), dim=-1)
                settled = torch.zeros_like(active)
                if previous_logp is not None:
                    settled = (logp.exp() * (logp - previous_logp)).sum(-1) < threshold  # KL(p_r || p_{r-1})
                previous_logp = logp
            h = torch.where(active[:, None, None], h_new, h)
            stopping = active & settled & (r >= min_steps)
            exit_step = torch.where(stopping, torch.full_like(exit_step, r), exit_step)
            active = active & ~stopping
            if not bool(active.any()):
                break
        cache.active = None
        cache.fill_later_steps(r)
        top = self.run_blocks(h, coda_ctx, self.coda)
        cache.advance()
        exits = cache.stats.setdefault("rgpt.exit_steps", [])
        exits.extend(exit_step.tolist())
        return RGPTOutput(logits=self.readout(top), hidden=top, steps=r,
                          info={"mean_exit_steps": sum(exits) / len(exits)})

    # -- cache, options, generation ------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int | None = None, steps: int | None = None,
                  cache_mode: str = "full", **options) -> KVCache:
        c = self.config
        max_steps = max(steps or c.recurrence_steps, c.recurrence_steps)
        weight = self.wte.weight
        return RecurrentKVCache(batch_size, max_len or c.sequence_len, c, cache_mode, max_steps,
                                device=weight.device, dtype=weight.dtype)

    def cache_slots(self) -> int:
        return self.config.n_pre + self.config.n_rec * self.config.recurrence_steps + self.config.n_coda

    def check_options(self, options: dict) -> None:
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise ConfigError(f"arch 'rgpt' does not support option(s): {', '.join(sorted(unknown))}")
        steps = options.get("steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"steps must be an integer >= 1, got {steps!r}")
        if options.get("cache_mode", "full") not in CACHE_MODES:
            raise ConfigError(f"unknown cache_mode {options['cache_mode']!r}: choose from {', '.join(CACHE_MODES)}")
        if options.get("exit_criterion", "kl") not in EXIT_CRITERIA:
            raise ConfigError(f"unknown exit_criterion {options['exit_criterion']!r}: choose from "
                              f"{', '.join(EXIT_CRITERIA)}")
        if options.get("exit_threshold", 0.0) < 0:
            raise ConfigError(f"exit_threshold must be >= 0, got {options['exit_threshold']}")
        if options.get("min_steps", 1) < 1:
            raise ConfigError(f"min_steps must be >= 1, got {options['min_steps']}")

    def generate_step(self, idx: Tensor, cache: KVCache | None = None, pad_mask: Tensor | None = None,
                      prompt_len: int = 0, steps: int | None = None, cache_mode: str = "full",
                      exit_threshold: float = 0.0, exit_criterion: str = "kl", min_steps: int = 1) -> RGPTOutput:
        self.check_options(dict(steps=steps, cache_mode=cache_mode, exit_threshold=exit_threshold,
                                exit_criterion=exit_criterion, min_steps=min_steps))
        steps = steps or self.config.recurrence_steps
        adaptive = exit_threshold > 0
        if cache is None:
            if adaptive:
                raise ConfigError("adaptive exit needs the cache (the uncached reference runs a fixed depth)")
            return self(idx, pad_mask=pad_mask, steps=steps)
        if adaptive and cache.length > 0:
            out = self.decode_adaptive(idx, cache, steps, exit_threshold, exit_criterion, min_steps)
        else:
            out = self(idx, cache=cache, pad_mask=pad_mask, steps=steps)
        out.info.update(steps=steps, trained_steps=self.config.recurrence_steps,
                        beyond_trained=steps > self.config.recurrence_steps)
        return out

    def evaluation_options(self) -> dict[str, dict]:
        R = self.config.recurrence_steps
        return {f"r={r}": {"steps": r} for r in sorted({max(1, R // 2), R})}

    def eval_logits(self, idx: Tensor, steps: int | None = None) -> Tensor:
        self.check_options({"steps": steps})
        return self(idx, steps=steps).logits

    # -- accounting --------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int | None = None, steps: float | None = None) -> int:
        """Forward + backward FLOPs per token at `steps` core applications (default: trained R)."""
        c = self.config
        steps = c.recurrence_steps if steps is None else steps
        T = seq_len or c.sequence_len
        block_params = sum(p.numel() for p in self.blocks[0].parameters())
        step_params = sum(p.numel() for m in (self.proj, self.gate_in, self.gate_out) for p in m.parameters())
        head = c.vocab_size * c.n_embd
        depth = c.n_pre + c.n_coda + c.n_rec * steps
        matmul = depth * block_params + steps * step_params + head
        attention = depth * 2 * 2 * c.n_embd * (T / 2)
        return int(3 * (2 * matmul + attention))
