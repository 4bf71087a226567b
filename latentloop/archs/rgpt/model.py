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

f_gate's last bias starts at `gate_bias_init` (default 0: g = 0.5; the paper's +4 gives g ≈ 0.98);
ε_x, ε_g ~ N(0, noise_std²) in training only. "norm" is the backbone's parameter-free RMSNorm.
The paper's summary writes τ and ε_g inside f_gate's input; here they act on its output, as a
temperature does (docs/architectures.md, "Default recipes, against the papers").

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
- each core step writes the cache through a `CoreStepView` (which step, which rows still recur),
  handed to the core blocks in their context: nothing depends on call order
- a BOS inside a sequence needs no restart rule: rgpt carries no state from token to token, only
  depth (the recurrence is per token)
- self-speculative decoding (`draft_steps`, `draft_tokens`; the engine runs it): the same weights and
  cache at fewer steps draft tokens, one pass at the full depth verifies them, and the output is
  the full depth's (greedy: token for token); as LayerSkip drafts with early layers
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...config import ModelConfig, check_field_types, require
from ...errors import CheckpointError, ConfigError
from ...models.backbone import GPT, PER_ROW_INFO, Draft, ForwardContext, ModelOutput, last_column, norm
from ...models.cache import KVCache
from ...models.criteria import KLDivergence, RelativeChange
from ...models.options import DecodeOption, when_above

# -- config ----------------------------------------------------------------------------------------

# rgpt's training depth distributions (drawn per optimizer step by archs/rgpt/objective.py):
#   uniform:    r ~ Uniform{1..R}, the RecurrentGPT paper's own sampling.
#   heavy_tail: Huginn's log-normal Poisson (Geiping et al. 2025, arXiv 2502.05171), the baseline the
#               RecurrentGPT paper compares against: tau ~ N(log r̄ - σ²/2, σ), r = Poisson(e^tau) + 1,
#               so E[r - 1] = E[e^tau] = r̄. Huginn trains with r̄ = 32 and gradients through the last
#               k = 8 steps (depth_mean=32 backprop_steps=8 here); its σ = 1/2 is the default below.
DEPTH_SAMPLINGS = ("uniform", "heavy_tail")
HUGINN_DEPTH_SIGMA = 0.5
# The most recurrence steps one forward may run: a bound on asked-for work. It caps a heavy-tailed
# training draw (the tail is unbounded) and the depth decoding may ask for (archs/rgpt/model.py).
MAX_RECURRENCE_STEPS = 256


@dataclass
class RGPTConfig(ModelConfig):
    """RecurrentGPT: prelude (n_pre blocks) -> shared core (n_rec blocks) applied R times with a
    projected, gated state update -> coda (n_coda blocks). `n_layer` is derived: the number of
    distinct blocks. When n_pre / n_rec / n_coda are not given they split a preset's n_layer as
    1 / n_layer - 2 / 1.

    `recurrence_steps` is the trained R (the default inference depth); `truncate_steps`,
    `depth_sampling`, `depth_mean`, `depth_sigma` and `backprop_steps` configure its training
    objective (see DEPTH_SAMPLINGS and archs/rgpt/objective.py).
    """

    arch: ClassVar[str] = "rgpt"
    TRAINING_NOISE: ClassVar[tuple[str, ...]] = ("noise_std",)
    n_pre: int | None = None
    n_rec: int | None = None
    n_coda: int | None = None
    recurrence_steps: int = 4  # R, the trained number of core applications (depth ~ Uniform{1..R})
    noise_std: float = 0.1  # std of the training-only noise on the state (eps_x) and the gate (eps_g)
    gate_temperature: float = 1.0  # tau in g = sigmoid(f_gate(...) / tau + eps_g)
    # f_gate's last bias at init. The paper's +4.0 (g = sigmoid(4) ~ 0.98: each step first passes the
    # state almost unchanged) suits its long runs; at this library's preset scales (hundreds to a few
    # thousand steps) the gates never leave it: sigmoid'(4) = 0.018 scales every gate gradient, and
    # a 300-step tiny run ends with mean gate 0.98. 0.0 (g = 0.5 at init) lets them learn (measured:
    # -0.05 BPB on tiny). Set gate_bias_init=4.0 for the paper's initialisation.
    gate_bias_init: float = 0.0
    truncate_steps: int = 0  # training: the first n recurrence steps run without gradient
    depth_sampling: str = "uniform"  # training depth distribution, one of DEPTH_SAMPLINGS
    # heavy_tail: r̄ = E[r - 1]; None: recurrence_steps, the depth the model decodes at by default
    # (as Huginn decodes at its r̄)
    depth_mean: float | None = None
    depth_sigma: float = HUGINN_DEPTH_SIGMA  # heavy_tail: σ of the log-normal rate
    # training: only the last k recurrence steps get gradients, the first r - k run without
    # (Huginn's truncated backprop); None: every step. Either sampling; excludes truncate_steps.
    backprop_steps: int | None = None

    def __post_init__(self) -> None:
        check_field_types(self)  # the split below does arithmetic on n_layer before the base class checks it
        if self.n_pre is None and self.n_rec is None and self.n_coda is None:
            edge = 1 if self.n_layer >= 3 else 0
            self.n_pre, self.n_coda, self.n_rec = edge, edge, self.n_layer - 2 * edge
        else:
            self.n_pre = 1 if self.n_pre is None else self.n_pre
            self.n_coda = 1 if self.n_coda is None else self.n_coda
            self.n_rec = max(1, self.n_layer - self.n_pre - self.n_coda) if self.n_rec is None else self.n_rec
        require(self.n_pre >= 0 and self.n_coda >= 0, "n_pre and n_coda must be >= 0")
        require(self.n_rec >= 1, f"n_rec must be >= 1, got {self.n_rec}")
        self.n_layer = self.n_pre + self.n_rec + self.n_coda
        super().__post_init__()
        # bounded as decoding's `steps` is: a larger trained depth could not be decoded at its own depth,
        # and 100,000 steps hung `train` and `plan` with no word
        require(1 <= self.recurrence_steps <= MAX_RECURRENCE_STEPS,
                f"recurrence_steps must be in [1, {MAX_RECURRENCE_STEPS}], got {self.recurrence_steps}")
        require(self.noise_std >= 0, f"noise_std must be >= 0, got {self.noise_std}")
        require(self.gate_temperature > 0, f"gate_temperature must be > 0, got {self.gate_temperature}")
        require(0 <= self.truncate_steps < self.recurrence_steps,
                 f"truncate_steps must be in [0, recurrence_steps), got {self.truncate_steps}")
        require(self.depth_sampling in DEPTH_SAMPLINGS,
                 f"depth_sampling must be one of {', '.join(DEPTH_SAMPLINGS)}, got {self.depth_sampling!r}")
        require(self.depth_mean is None or 1 <= self.depth_mean < MAX_RECURRENCE_STEPS,
                 f"depth_mean must be in [1, {MAX_RECURRENCE_STEPS}) or null, got {self.depth_mean}")
        require(self.depth_sigma > 0, f"depth_sigma must be > 0, got {self.depth_sigma}")
        require(self.backprop_steps is None or 1 <= self.backprop_steps <= MAX_RECURRENCE_STEPS,
                 f"backprop_steps must be in [1, {MAX_RECURRENCE_STEPS}] or null, got {self.backprop_steps}")
        require(self.backprop_steps is None or self.truncate_steps == 0,
                 "set one of truncate_steps (the first n steps without gradient) and backprop_steps "
                 "(the last k steps with it), not both")

    @property
    def effective_depth(self) -> int:
        return self.n_pre + self.n_rec * self.recurrence_steps + self.n_coda

    @property
    def heavy_tail_mean(self) -> float:
        """r̄ of the heavy_tail draw: depth_mean, or R when it is not set."""
        return float(self.recurrence_steps if self.depth_mean is None else self.depth_mean)

    # the front-ends' questions (see ModelConfig)
    upcycle_defaults: ClassVar[dict[str, Any]] = {
        "gate_bias_init": -4.0}  # each step starts as (almost) a replacement by the pretrained core, still trainable

    @classmethod
    def upcycle_shape(cls, base_layers: int) -> dict[str, int]:
        """Every pretrained block: 1 prelude, L-2 core, 1 coda (the default split); n_pre / n_rec /
        n_coda given by the user override it."""
        config = cls(n_layer=base_layers)
        return {"n_pre": config.n_pre, "n_rec": config.n_rec, "n_coda": config.n_coda}

    def iso_fields(self, iso: str) -> dict[str, Any]:
        return rgpt_shape_from_dense(self.n_layer, iso, self.recurrence_steps)

    def depth_summary(self) -> str:
        return f"{self.n_pre} + {self.n_rec} x {self.recurrence_steps} + {self.n_coda}"


def rgpt_shape_from_dense(dense_layers: int, iso: str, steps: int) -> dict[str, int]:
    """Split a dense model's depth into (n_pre, n_rec, n_coda) for an isoFLOPs or isoparams RGPT,
    exactly or not at all.

    iso="flops": the effective depth n_pre + n_rec * R + n_coda equals the dense depth: each token
    goes through as many block applications as in the dense model (the recurrence's input
    projection and gate add a little on top: `--iso` prints both counts); a prelude and a coda of
    at least one block each when the core still fits R times, else none. A dense depth below R
    cannot be matched (the core runs at least one block R times): a ConfigError names the nearest
    exact shapes. iso="params": the distinct blocks n_pre + n_rec + n_coda equal the dense depth
    (the same blocks, R times the core's compute).
    """
    require(iso in ("flops", "params"), f"iso must be 'flops' or 'params', got {iso!r}")
    require(dense_layers >= 1 and steps >= 1, "dense depth and steps must be >= 1")
    edge = 1 if dense_layers >= 3 else 0
    if iso == "params":
        return dict(n_pre=edge, n_rec=dense_layers - 2 * edge, n_coda=edge, recurrence_steps=steps)
    if dense_layers - 2 * edge < steps:  # the core does not fit R times between a prelude and a coda
        edge = 0
    require(dense_layers >= steps,
            f"--iso flops cannot match a dense depth of {dense_layers} with recurrence_steps={steps} (the core "
            f"runs at least one block {steps} times); the nearest exact shapes: --set recurrence_steps="
            f"{dense_layers} (0 + 1 x {dense_layers} + 0), or --set n_layer={steps} (0 + 1 x {steps} + 0)")
    n_rec = (dense_layers - 2 * edge) // steps
    leftover = dense_layers - 2 * edge - n_rec * steps  # depth the core cannot fill evenly: to prelude and coda
    return dict(n_pre=edge + leftover // 2, n_rec=n_rec, n_coda=edge + leftover - leftover // 2,
                recurrence_steps=steps)


CACHE_MODES = ("full", "mean", "last")
BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.*)$")  # a block tensor's name: (index, rest)
EXIT_TOTAL_KEY = "rgpt.exit_step_total"  # cache.state: (B,) each row's exit steps summed over its decoded tokens
EXIT_TOKENS_KEY = "rgpt.exit_tokens"  # cache.state: (B,) how many tokens each row decoded with adaptive exit
EXIT_CRITERIA = ("kl", "state")
MAX_STEPS = MAX_RECURRENCE_STEPS  # a bound on asked-for work: a full-mode cache grows by n_rec slots per step
# Self-speculative decoding: tokens drafted per round when only draft_steps is given. Each round costs
# this many shallow steps and one full-depth pass over one token more; measured on trained runs by
# benchmarks/speculative.py, which sweeps it.
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 32  # a bound on asked-for work: the cache holds this many slots beyond the generation

# The options of self-speculative decoding, declared by every arch whose depth is a decoding option
# (rgpt, rfbt, mor): `draft_steps` shallower than the decoding depth draft, the full depth verifies.
DRAFT_OPTIONS = (
    DecodeOption("draft_steps", int, None, "self-speculative decoding: draft tokens at this many recurrence steps "
                 "(below the decoding depth) and keep what one full-depth pass agrees with, so the output is the "
                 "full depth's (default with draft_tokens alone: half the depth; needs the cache)",
                 minimum=1, maximum=MAX_STEPS, needs_cache=lambda value: value is not None, speed_only=True),
    DecodeOption("draft_tokens", int, None, "self-speculative decoding: tokens drafted per full-depth pass "
                 f"(default with draft_steps alone: {DEFAULT_DRAFT_TOKENS}; needs the cache)",
                 minimum=1, maximum=MAX_DRAFT_TOKENS, needs_cache=lambda value: value is not None,
                 speed_only=True),
)

ADAPTIVE_EXIT = when_above("exit_threshold", 0.0, example=0.01)  # the exit's own options mean nothing without it

OPTIONS = (
    DecodeOption("steps", int, None, "recurrence steps at inference (default: the trained R; early exit at a "
                 "fixed depth below it)", minimum=1, maximum=MAX_STEPS),
    DecodeOption("cache_mode", str, "full", "KV cache of the core: one slot per (step, core layer) (full, exact), "
                 "or a running mean / the latest step per core layer (less memory)", choices=CACHE_MODES,
                 approximates=lambda mode: mode != "full", needs_cache=lambda mode: mode != "full"),
    DecodeOption("exit_threshold", float, 0.0, "adaptive exit while decoding: stop a token's recurrence once the "
                 "criterion falls below this (0: off; needs the cache)", minimum=0.0,
                 needs_cache=lambda value: value > 0),
    DecodeOption("exit_criterion", str, "kl", "exit criterion: KL between successive steps' next-token "
                 "distributions (kl), or the relative change of the state (state)", choices=EXIT_CRITERIA,
                 applies_if=ADAPTIVE_EXIT),
    DecodeOption("min_steps", int, 1, "recurrence steps before any exit (at most the decoding depth)",
                 minimum=1, maximum=MAX_STEPS, applies_if=ADAPTIVE_EXIT),
    *DRAFT_OPTIONS,
)


def drafting(options: dict) -> bool:
    """Whether the options ask for self-speculative decoding."""
    return options.get("draft_steps") is not None or options.get("draft_tokens") is not None


def depth_draft(options: dict, depth: int) -> Draft | None:
    """The draft `options` ask for, of a model decoding at `depth` recurrence steps: the same options
    at `draft_steps` (default: half the depth), `draft_tokens` a round; None when not drafting."""
    if not drafting(options):
        return None
    if depth < 2:
        raise ConfigError(f"self-speculative decoding drafts at fewer recurrence steps than the decoding depth, "
                          f"which is {depth} here: there is no shallower draft")
    steps = options.get("draft_steps") or max(1, depth // 2)
    if steps >= depth:
        raise ConfigError(f"draft_steps must be below the decoding depth ({depth} steps), got {steps}")
    tokens = options.get("draft_tokens") or DEFAULT_DRAFT_TOKENS
    return Draft({**options, "steps": steps}, tokens)


def make_exit_criterion(name: str, threshold: float) -> KLDivergence | RelativeChange:
    return KLDivergence(threshold) if name == "kl" else RelativeChange(threshold)


@dataclass
class RGPTOutput(ModelOutput):
    steps: int = 0
    step_logits: list[Tensor] = field(default_factory=list)  # (B, T, V) after each step, when requested
    # per step, when requested, as 0-d tensors: whoever reports them reads them (`float`, a device sync),
    # so a compiled forward records them inside its graph instead of breaking it at every step
    gate_means: list[Tensor] = field(default_factory=list)  # mean gate value
    openness: list[Tensor] = field(default_factory=list)  # ||h^(r) - h^(r-1)|| / ||o||


@dataclass
class DepthContext(ForwardContext):
    """A forward's context with its recurrent depth: `steps` core steps (None: the trained R), the
    first `no_grad_steps` of them without gradient, per-step readings recorded into `record` (None:
    none; with `return_steps`, the logits after every step too)."""

    steps: int | None = None
    no_grad_steps: int = 0
    record: RGPTOutput | None = None
    return_steps: bool = False


class RecurrentKVCache(KVCache):
    """KV cache whose core-layer slots follow `mode` (see the module docstring). The core blocks
    write through `step_view(step, active)`; prelude and coda write the cache directly."""

    def __init__(self, batch_size: int, max_len: int, config: RGPTConfig, mode: str, max_steps: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        c = config
        core_slots = c.n_rec * (max_steps if mode == "full" else 1)
        super().__init__(batch_size, max_len, c.n_pre + core_slots + c.n_coda, c.n_kv_head, c.head_dim,
                         device=device, dtype=dtype)
        self.mode, self.n_rec, self.max_steps = mode, c.n_rec, max_steps
        self.first_core_slot = c.n_pre

    def step_view(self, step: int, active: Tensor | None = None) -> CoreStepView:
        return CoreStepView(self, step, active)

    def fill_later_steps(self, last_step: int) -> None:
        """Full mode: steps after `last_step` repeat its keys/values for the tokens just added."""
        if self.mode != "full":
            return
        start, end = self.length, self.length + self.pending
        first = self.first_core_slot
        for step in range(last_step + 1, self.max_steps + 1):
            for j in range(self.n_rec):
                src, dst = first + (last_step - 1) * self.n_rec + j, first + (step - 1) * self.n_rec + j
                self.k[dst, :, :, start:end] = self.k[src, :, :, start:end]
                self.v[dst, :, :, start:end] = self.v[src, :, :, start:end]


@dataclass
class CoreStepView:
    """The cache as core step `step` (1-based) writes it; `active` (B,) marks rows still recurring
    (None: all). Stopped rows keep their latest step's entries; `mean` keeps a running mean."""

    cache: RecurrentKVCache
    step: int
    active: Tensor | None = None

    def update(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        cache = self.cache
        start, end = cache.length, cache.length + k.shape[2]
        if cache.mode == "full":
            previous = slot - cache.n_rec if self.step > 1 else None  # the same layer, one step earlier
        else:
            previous = slot
        if cache.mode == "mean" and self.step > 1:  # running mean over this token's steps
            k = cache.k[slot, :, :, start:end] + (k - cache.k[slot, :, :, start:end]) / self.step
            v = cache.v[slot, :, :, start:end] + (v - cache.v[slot, :, :, start:end]) / self.step
        if self.active is not None and previous is not None:  # stopped rows keep their latest step
            keep = ~self.active[:, None, None, None]
            k = torch.where(keep, cache.k[previous, :, :, start:end], k)
            v = torch.where(keep, cache.v[previous, :, :, start:end], v)
        return cache.update(slot, k, v)


class RGPT(GPT):
    OPTIONS = OPTIONS
    # train.compile: the whole step, model and loss, one graph per depth drawn (compiled once each);
    # compile_scope=blocks keeps one graph per block kind whatever the depth (issue 51)
    COMPILES_WHOLE = True
    context_class = DepthContext

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
    def recur(self, h: Tensor, h_pre: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor, Tensor]:
        """One step: (h^(r-1), h_pre) -> (h^(r), g, o)."""
        noisy = self.training and self.config.noise_std > 0
        h_in = h + self.config.noise_std * torch.randn_like(h) if noisy else h
        # under autocast the projection comes out in bf16: the core's residual stream stays in h's dtype
        o = self.run_blocks(self.proj(torch.cat([h_in, h_pre], dim=-1)).type_as(h), ctx, self.core)  # core(h̃)
        gate_logits = self.gate_out(F.silu(self.gate_in(torch.cat([norm(h), norm(h_pre)], dim=-1))))
        gate_logits = gate_logits / self.config.gate_temperature
        if noisy:
            gate_logits = gate_logits + self.config.noise_std * torch.randn_like(gate_logits)
        g = torch.sigmoid(gate_logits).type_as(h)
        return torch.lerp(o, h, g), g, o  # g * h + (1 - g) * o

    def _step_ctx(self, ctx: ForwardContext, step: int, active: Tensor | None = None) -> ForwardContext:
        """Context of core step `step`: its cache view and, in full mode, its slots."""
        cache = ctx.cache
        if not isinstance(cache, RecurrentKVCache):
            return ctx
        offset = (step - 1) * self.config.n_rec if cache.mode == "full" else 0
        return dataclasses.replace(ctx, cache=cache.step_view(step, active), slot_offset=offset)

    def _coda_ctx(self, ctx: ForwardContext) -> ForwardContext:
        """Context of the coda: its slots follow all core steps the cache holds."""
        cache = ctx.cache
        if not isinstance(cache, RecurrentKVCache) or cache.mode != "full":
            return ctx
        return dataclasses.replace(ctx, slot_offset=(cache.max_steps - 1) * self.config.n_rec)

    # -- the whole sequence, or a fixed depth through the cache ------------------------------
    def forward(self, idx: Tensor, pad_mask: Tensor | None = None, steps: int | None = None,
                return_steps: bool = False, no_grad_steps: int = 0, record_gates: bool = False) -> RGPTOutput:
        """Prelude -> `steps` core applications (default: the trained R) -> coda.

        return_steps: also the logits, mean gate and openness after every step (coda + head
        applied to each h^(r)). record_gates: only the mean gate and openness per step (no extra
        readouts; training records them every step, on the device). no_grad_steps: the first n steps run
        without gradient (truncated backprop).
        """
        return self._run_depth(idx, None, pad_mask, steps, return_steps, no_grad_steps, record_gates)

    def run_stack(self, x: Tensor, ctx: DepthContext) -> Tensor:
        """prelude -> `ctx.steps` core steps (default: the trained R) -> coda, over inputs x (B, T, D);
        returns the top states (B, T, D). Through the cache when the context holds one."""
        steps = ctx.steps or self.config.recurrence_steps
        if steps < 1:
            raise ConfigError(f"steps must be >= 1, got {steps}")
        cache = ctx.cache
        max_steps = cache.max_steps if isinstance(cache, RecurrentKVCache) and cache.mode == "full" else steps
        if steps > max_steps:
            raise ConfigError(f"this cache holds {max_steps} recurrence steps; {steps} were asked for")
        record = ctx.record
        h_pre = self.run_blocks(x, ctx, self.prelude)  # (B, T, D)
        h = h_pre
        for r in range(1, steps + 1):
            with torch.set_grad_enabled(torch.is_grad_enabled() and r > ctx.no_grad_steps):
                h_new, g, o = self.recur(h, h_pre, self._step_ctx(ctx, r))
            if record is not None:  # only when asked: two reductions over the step's states
                record.gate_means.append(g.detach().mean())
                record.openness.append((h_new - h).detach().norm() / o.detach().norm().clamp_min(1e-12))
            h = h_new
            if ctx.return_steps and r < steps:
                record.step_logits.append(self.readout(self.run_blocks(h, self._coda_ctx(ctx), self.coda)))
        if isinstance(cache, RecurrentKVCache):
            cache.fill_later_steps(steps)
        return self.run_blocks(h, self._coda_ctx(ctx), self.coda)

    def _run_depth(self, idx: Tensor, cache: KVCache | None, pad_mask: Tensor | None, steps: int | None,
                   return_steps: bool = False, no_grad_steps: int = 0, record_gates: bool = False,
                   last_logits: bool = False) -> RGPTOutput:
        steps = steps or self.config.recurrence_steps
        out = RGPTOutput(logits=None, hidden=None, steps=steps)
        ctx = self.context(idx, cache, pad_mask, steps=steps, no_grad_steps=no_grad_steps,
                           record=out if return_steps or record_gates else None, return_steps=return_steps)
        top = self.run_stack(self.embed(idx), ctx)
        if cache is not None:
            cache.advance()
        out.logits, out.hidden = self.readout(last_column(top) if last_logits else top), top
        if return_steps:
            out.step_logits.append(out.logits)
        return out

    def adaptive_step(self, token: Tensor, cache: RecurrentKVCache, max_steps: int,
                      criterion: KLDivergence | RelativeChange, min_steps: int) -> RGPTOutput:
        """One token per row with per-row early exit (rows stop independently): a row stops at the
        first step r >= min_steps where `criterion` says step r settled against step r-1 (KL of
        the next-token distributions, or the state's relative change)."""
        ctx = self.context(token, cache, None)
        coda_ctx = self._coda_ctx(ctx)
        h_pre = self.run_blocks(self.embed(token), ctx, self.prelude)
        h = h_pre
        active = torch.ones(token.shape[0], dtype=torch.bool, device=token.device)
        exit_step = torch.full_like(active, max_steps, dtype=torch.long)
        previous_logp = None
        for r in range(1, max_steps + 1):
            h_new, _, _ = self.recur(h, h_pre, self._step_ctx(ctx, r, None if bool(active.all()) else active))
            if criterion.compares == "state":
                settled = criterion.settled(h_new[:, -1], h[:, -1])  # (B,)
            else:
                logp = F.log_softmax(self.readout(self.run_blocks(h_new, coda_ctx, self.coda))[:, -1].float(), dim=-1)
                settled = torch.zeros_like(active) if previous_logp is None else criterion.settled(logp, previous_logp)
                previous_logp = logp
            h = torch.where(active[:, None, None], h_new, h)
            stopping = active & settled & (r >= min_steps)
            exit_step = torch.where(stopping, torch.full_like(exit_step, r), exit_step)
            active = active & ~stopping
            if not bool(active.any()):
                break
        cache.fill_later_steps(r)
        top = self.run_blocks(h, coda_ctx, self.coda)
        cache.advance()
        exits = cache.stats.setdefault("rgpt.exit_steps", [])
        exits.extend(exit_step.tolist())
        # each row's own exit total and token count: a row's mean over its tokens, whatever the other
        # rows did; batch-first state, so they move with the row when a server regroups its batch
        totals = cache.state.get(EXIT_TOTAL_KEY, torch.zeros_like(exit_step)) + exit_step  # (B,)
        tokens = cache.state.get(EXIT_TOKENS_KEY, torch.zeros_like(exit_step)) + 1  # (B,)
        cache.state[EXIT_TOTAL_KEY], cache.state[EXIT_TOKENS_KEY] = totals, tokens
        return RGPTOutput(logits=self.readout(top), hidden=top, steps=r,
                          info={"mean_exit_steps": sum(exits) / len(exits),
                                PER_ROW_INFO: {"mean_exit_steps": (totals.double() / tokens).tolist(),
                                               "exit_steps": exit_step.tolist()}})  # this token's own

    # -- decoding protocol --------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int | None = None, steps: int | None = None,
                  cache_mode: str = "full", **options) -> KVCache:
        c = self.config
        max_steps = max(steps or c.recurrence_steps, c.recurrence_steps)
        weight = self.wte.weight
        return RecurrentKVCache(batch_size, max_len or c.sequence_len, c, cache_mode, max_steps,
                                device=weight.device, dtype=weight.dtype)

    def cache_slots(self) -> int:
        return self.config.n_pre + self.config.n_rec * self.config.recurrence_steps + self.config.n_coda

    def _depth_info(self, out: RGPTOutput, steps: int) -> RGPTOutput:
        out.info.update(steps=steps, trained_steps=self.config.recurrence_steps,
                        beyond_trained=steps > self.config.recurrence_steps)
        return out

    def prefill(self, idx: Tensor, cache: KVCache, pad_mask: Tensor | None = None, steps: int | None = None,
                cache_mode: str = "full", exit_threshold: float = 0.0, exit_criterion: str = "kl",
                min_steps: int = 1, draft_steps: int | None = None, draft_tokens: int | None = None,
                last_logits: bool = False) -> RGPTOutput:
        """The prompt at a fixed depth (adaptive exit is per decoded token)."""
        steps = steps or self.config.recurrence_steps
        return self._depth_info(self._run_depth(idx, cache, pad_mask, steps, last_logits=last_logits), steps)

    def decode(self, idx: Tensor, cache: KVCache, steps: int | None = None, cache_mode: str = "full",
               exit_threshold: float = 0.0, exit_criterion: str = "kl", min_steps: int = 1,
               draft_steps: int | None = None, draft_tokens: int | None = None) -> ModelOutput:
        """New tokens at depth `steps`. The draft options are the engine's: it drafts (at draft_steps)
        and verifies (at `steps`) through here."""
        steps = steps or self.config.recurrence_steps
        if exit_threshold > 0:
            criterion = make_exit_criterion(exit_criterion, exit_threshold)
            out = self.step_tokens(idx, cache, lambda token, c, pad: self.adaptive_step(token, c, steps, criterion,
                                                                                         min_steps))
        else:
            out = self._run_depth(idx, cache, None, steps)
        return self._depth_info(out, steps)

    def fast_path_blocker(self, options: dict) -> str | None:
        if options.get("exit_threshold", 0.0) > 0:
            return "rgpt's adaptive exit runs a data-dependent number of core steps (the exit test reads the device)"
        if drafting(options):
            return ("self-speculative decoding (draft_steps / draft_tokens) drafts, verifies several tokens in one "
                    "pass and takes rejected ones back: its rounds are not this one-token step (the engine runs "
                    "them, compiled for one row: inference.speculative)")
        return None

    def draft_options(self, options: dict) -> Draft | None:
        """The same model at `draft_steps` (see `depth_draft`). Not with an adaptive exit (the full
        depth must be fixed to be verified in one pass) nor a `mean` / `last` cache: there one pass
        over several tokens computes another function than token-by-token decoding (a token's
        predecessors in the same pass are seen at the current step, not their last)."""
        depth = options.get("steps") or self.config.recurrence_steps
        if options.get("exit_threshold", 0.0) > 0 and options.get("min_steps", 1) > depth:
            # `model_options` runs this for every set of options (as mor's does): the one place that
            # knows the depth, so a min_steps no step could reach is refused here, before any work
            raise ConfigError(f"min_steps must be at most the decoding depth ({depth} step{'s' * (depth != 1)}), got "
                              f"{options['min_steps']}: no step could exit")
        if not drafting(options):
            return None
        if options.get("exit_threshold", 0.0) > 0:
            raise ConfigError("self-speculative decoding (draft_steps / draft_tokens) verifies at a fixed depth: "
                              "it does not combine with exit_threshold")
        if options.get("cache_mode", "full") != "full":
            raise ConfigError(f"self-speculative decoding (draft_steps / draft_tokens) needs cache_mode full: with "
                              f"{options['cache_mode']!r} a pass over several tokens differs from one token at a time")
        return depth_draft(options, depth)

    def reference(self, idx: Tensor, pad_mask: Tensor | None = None, prompt_len: int = 0, steps: int | None = None,
                  cache_mode: str = "full", exit_threshold: float = 0.0, exit_criterion: str = "kl",
                  min_steps: int = 1, draft_steps: int | None = None, draft_tokens: int | None = None) -> RGPTOutput:
        return self.forward(idx, pad_mask, steps=steps)  # the engine refuses an adaptive exit without a cache

    @torch.no_grad()
    def upcycle_from(self, weights: dict[str, Tensor], base_layers: int, load) -> dict:
        """prelude = the first n_pre pretrained blocks, core = the next n_rec, coda = the last n_coda
        (the blocks between core and coda, if any, are dropped); W_proj = [I, 0] (the core reads the
        state, not the prelude output); the gate's last layer has zero weights and bias
        `gate_bias_init`, which upcycling sets to -4 (RGPTConfig.upcycle_defaults). Exact: with R = 1
        and a gate saturated open (σ(bias) below fp32 resolution, bias <= -17), prelude -> core ->
        coda *is* the pretrained stack restricted to those blocks (all of it when n_pre + n_rec +
        n_coda = n_layer, the default split 1 / L-2 / 1). The default bias -4 (σ ≈ 0.018, the mirror
        image of the paper's +4) keeps the gate trainable (a saturated one has no gradient) at the
        price of mixing 1.8% of the previous state into each step; further steps (r > 1) re-apply
        the core, which no pretrained model did."""
        c = self.config
        if c.n_pre + c.n_rec + c.n_coda > base_layers:
            raise CheckpointError(f"--init-from: rgpt {c.n_pre} + {c.n_rec} + {c.n_coda} blocks need more than the "
                                  f"{base_layers} pretrained blocks")
        coda_start = base_layers - c.n_coda
        chosen = [*range(c.n_pre + c.n_rec), *range(coda_start, base_layers)]  # new block i <- base block chosen[i]
        renumber = {old: new for new, old in enumerate(chosen)}
        mapped = {}
        for name, tensor in weights.items():
            match = BLOCK_KEY.match(name)
            if match is None:
                mapped[name] = tensor
            elif int(match.group(1)) in renumber:
                mapped[f"blocks.{renumber[int(match.group(1))]}.{match.group(2)}"] = tensor
        fresh = load(mapped)
        D = c.n_embd
        self.proj.weight.copy_(torch.cat([torch.eye(D), torch.zeros(D, D)], dim=1))  # W_proj = [I, 0]
        nn.init.zeros_(self.gate_out.weight)  # the gate is its bias alone until it learns
        nn.init.constant_(self.gate_out.bias, c.gate_bias_init)
        gate = torch.sigmoid(torch.tensor(c.gate_bias_init)).item()
        exact = c.recurrence_steps == 1 and gate < torch.finfo(torch.float32).eps / 2
        return {"new": fresh, "gate_at_init": gate,
                "mapping": f"prelude = {_span(0, c.n_pre)}, core = {_span(c.n_pre, c.n_pre + c.n_rec)}, "
                           f"coda = {_span(coda_start, base_layers)} of the {base_layers} pretrained blocks",
                "exact_at_step0": "steps=1" if exact else  # the gate saturated open: every step is the core
                                  f"no (r=1 mixes σ(gate_bias_init) = {gate:.3g} of the previous state in)"}

    @classmethod
    def scoring_modes(cls, config: RGPTConfig) -> dict[str, dict]:
        R = config.recurrence_steps
        return {f"r={r}": {"steps": r} for r in sorted({max(1, R // 2), R})}


def _span(start: int, stop: int) -> str:
    """Pretrained blocks start..stop-1 in words."""
    if stop <= start:
        return "none"
    return f"block {start}" if stop == start + 1 else f"blocks {start}-{stop - 1}"
