"""Mixture-of-Recursions (arch `mor`; Bae et al., 2025, arXiv 2507.10524): a shared stack applied up
to N_r times, a light router choosing which tokens go on at each recursion.

The RecurrentGPT paper's second baseline for spending recurrent depth (the first, heavy-tailed depth
sampling, is rgpt's `depth_sampling=heavy_tail`). Parameters are shared as in the MoR paper's
"middle-cycle" layout, which is rgpt's split: unique first and last blocks, the middle ones shared:

    h^(0) = prelude(x)
    for r = 1..N_r, for the tokens A_r still active:  h^(r) = h^(r-1) + g^(r) ⊙ (core(h^(r-1)) - h^(r-1))
    (every other token keeps h^(r) = h^(r-1))
    logits = head(coda(h^(N_r)))

`core` is the n_rec shared blocks; each block keeps its own residual connection, so the update is
the gated change the shared stack makes (with g = 1 a token goes through the stack exactly). Two
routings (`routing`, a property of the trained model):

- expert: at recursion r a router reads each token's state, s_r = w_r · norm(h^(r-1)) + b_r, and
  g^(r) = σ(s_r). Training keeps the top k_r of the tokens active at r-1 in each row (hierarchical
  filtering; k_r = ceil(capacity_r · n), n the row's real tokens (T without padding), capacities
  non-increasing, by default (N_r - r + 1) / N_r: every token at the first recursion, a third of
  them at the third of three). Top-k over a row reads later tokens' scores, which decoding cannot:
  the router is also trained with the MoR paper's auxiliary loss, a binary cross-entropy of σ(s_r)
  against "selected" over the candidates, and at inference a token goes on while σ(s_r) >
  `router_threshold` (0.5), decided token by token. Padding (`pad_mask` False; SFT's packed rows end
  in it) is never a candidate, counts for no k_r and carries no router loss, so a real token's
  training logits do not depend on how much padding follows it.
- token: one router at the start, p = softmax(W · norm(h^(0))) over depths 1..N_r; the token runs
  argmax(p) + 1 recursions with g = max(p) (causal by construction: training and decoding route
  alike). The objective adds the MoR paper's load-balancing loss N_r Σ_j f_j P_j (f_j: share of
  tokens routed to depth j, P_j: their mean probability).

Recursion-wise KV caching (the MoR paper's default): at recursion r a query attends only to the
tokens that were active at r (and itself), in training, scoring and decoding alike; a token writes
keys/values at recursion r only if it took it. The cache has one slot per (recursion, core layer);
which recursions each token took is kept in one extra slot of the key tensor (`ROUTE_SLOT`), so it
travels with the token's keys wherever a cache moves them (continuous batching's `regroup`). The
columns of tokens that skipped a recursion stay in the buffer, masked: the layout keeps one column
per token, so memory is that of a full cache (what the MoR paper saves there is not saved here).

Notable features:
- exact: cached decoding == the reference path (the same routing decisions, token by token), and a
  ragged left-padded batch == each row alone (padding takes no recursion)
- `steps`: decode with at most that many recursions (early exit at a fixed depth; the routers exist
  for the trained N_r only)
- self-speculative decoding (`draft_steps`, `draft_tokens`, rgpt's options): at most `draft_steps`
  recursions draft, the full depth verifies in one pass; the output is the full depth's
- FLOPs: expert-choice training is charged for the tokens the top-k keeps (the probe forward takes
  the training route); token-choice trains with every token computed at every recursion and the
  inactive ones masked, and is charged for that (what it runs, more than the tokens routed need)
- not offered: upcycling from a gpt run (no exact mapping), the compiled decode step (routing decides
  per token which recursions run)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...config import ModelConfig, check_field_types, require
from ...errors import ConfigError
from ...models.backbone import GPT, PER_ROW_INFO, PER_TOKEN_INFO, Draft, ForwardContext, ModelOutput, last_column, norm
from ...models.cache import AttentionPlan, KVCache, attention_mask
from ...models.flops import count_flops_per_token
from ...models.options import DecodeOption
from ..rgpt.model import DRAFT_OPTIONS, RGPT, depth_draft, rgpt_shape_from_dense

# -- config ----------------------------------------------------------------------------------------

ROUTINGS = ("expert", "token")
DEFAULT_THRESHOLD = 0.5  # expert-choice at inference: go on while σ(score) > this (the BCE's decision boundary)
DEFAULT_AUX_WEIGHT = 0.1  # the router's auxiliary loss beside the next-token loss


@dataclass
class MoRConfig(ModelConfig):
    """Mixture-of-Recursions: prelude (n_pre blocks) -> a shared core of n_rec blocks applied up to
    `recursions` times to the tokens its router keeps -> coda (n_coda blocks). `n_layer` is derived
    (the distinct blocks); unset n_pre / n_rec / n_coda split a preset's n_layer as 1 / n_layer - 2 / 1."""

    arch: ClassVar[str] = "mor"
    VARIANTS: ClassVar[dict[str, dict]] = {"token": {"routing": "token"}}  # beside expert choice, the default
    n_pre: int | None = None
    n_rec: int | None = None
    n_coda: int | None = None
    recursions: int = 3  # N_r, the most times a token goes through the core
    routing: str = "expert"  # expert (top-k per recursion in training) or token (a depth per token), see ROUTINGS
    # expert: the share of a row's tokens kept at each recursion (non-increasing); None: (N_r - r + 1) / N_r
    capacity: tuple[float, ...] | None = None
    router_threshold: float = DEFAULT_THRESHOLD  # expert, inference: go on while σ(score) exceeds it
    router_aux_weight: float = DEFAULT_AUX_WEIGHT  # expert: the selection BCE's weight; token: the balance loss's

    def __post_init__(self) -> None:
        check_field_types(self)  # the split below does arithmetic on n_layer before the base class checks it
        if self.n_pre is None and self.n_rec is None and self.n_coda is None:
            edge = 1 if self.n_layer >= 3 else 0
            self.n_pre, self.n_rec, self.n_coda = edge, self.n_layer - 2 * edge, edge
        else:
            self.n_pre = 1 if self.n_pre is None else self.n_pre
            self.n_coda = 1 if self.n_coda is None else self.n_coda
            self.n_rec = max(1, self.n_layer - self.n_pre - self.n_coda) if self.n_rec is None else self.n_rec
        require(self.n_pre >= 0 and self.n_coda >= 0 and self.n_rec >= 1,
                f"n_pre and n_coda must be >= 0 and n_rec >= 1, got {self.n_pre}, {self.n_coda}, {self.n_rec}")
        self.n_layer = self.n_pre + self.n_rec + self.n_coda
        super().__post_init__()
        require(1 <= self.recursions <= self.head_dim * self.n_kv_head,
                f"recursions must be in [1, {self.head_dim * self.n_kv_head}] (the route slot holds one flag per "
                f"recursion), got {self.recursions}")
        require(self.routing in ROUTINGS, f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.capacity is not None:
            self.capacity = tuple(float(c) for c in self.capacity)
            require(len(self.capacity) == self.recursions,
                    f"capacity needs one share per recursion ({self.recursions}), got {len(self.capacity)}")
            require(all(0 < c <= 1 for c in self.capacity), f"capacity shares must be in (0, 1], got {self.capacity}")
            require(all(a >= b for a, b in zip(self.capacity, self.capacity[1:])),
                    f"capacity must not increase from one recursion to the next, got {self.capacity}")
        require(0 < self.router_threshold < 1, f"router_threshold must be in (0, 1), got {self.router_threshold}")
        require(self.router_aux_weight >= 0, f"router_aux_weight must be >= 0, got {self.router_aux_weight}")

    @property
    def capacities(self) -> tuple[float, ...]:
        R = self.recursions
        return self.capacity if self.capacity is not None else tuple((R - r + 1) / R for r in range(1, R + 1))

    def router_loss_counts(self, real_count: int) -> list[int]:
        """The tokens each term of the router loss (`MoROutput.aux_terms`) is a mean over, in a training
        row of `real_count` real inputs: expert choice's recursion 1 reads every real token and
        recursion r > 1 the ceil(capacity_(r-1) · count) that recursion r - 1 kept (the quota of
        `MoR._topk_recursion`, the same float64 product); token choice's balance loss reads every real
        token. The trainer weighs the terms of an SFT step's micro-batches by them, on the host."""
        if self.routing == "token":
            return [real_count]
        return [real_count] + [math.ceil(real_count * capacity) for capacity in self.capacities[:-1]]

    # the front-ends' questions (see ModelConfig)
    def iso_fields(self, iso: str) -> dict:
        shape = rgpt_shape_from_dense(self.n_layer, iso, self.recursions)  # the same middle-cycle split
        return {**{k: shape[k] for k in ("n_pre", "n_rec", "n_coda")}, "recursions": shape["recurrence_steps"]}

    def depth_summary(self) -> str:
        return f"{self.n_pre} + {self.n_rec} x (up to {self.recursions}, {self.routing}-routed) + {self.n_coda}"


OPTIONS = (
    DecodeOption("steps", int, None, "recursions at most (default: all the trained ones; fewer: early exit at a "
                 "fixed depth)", minimum=1),
    *DRAFT_OPTIONS,
)


@dataclass
class MoROutput(ModelOutput):
    # the router's auxiliary loss (while training), unweighted, by term: expert choice's BCE per
    # recursion (each a mean over that recursion's candidates), token choice's one balance loss
    aux_terms: list[Tensor] = field(default_factory=list)
    taken: list[Tensor] = field(default_factory=list)  # per recursion run: (B, T) bool, the tokens that took it

    @property
    def aux_loss(self) -> Tensor | None:
        """The router's auxiliary loss, unweighted: the sum of its terms (None when it has none)."""
        return sum(self.aux_terms[1:], self.aux_terms[0]) if self.aux_terms else None

    def active_share(self, real: Tensor | None = None) -> list[Tensor]:
        """Per recursion run, the share of the (real) tokens that took it, as device scalars."""
        count = real.sum().clamp(min=1) if real is not None else None
        return [took.float().mean() if count is None else (took & real).sum() / count for took in self.taken]


@dataclass
class RecursionContext(ForwardContext):
    """A forward's context with its routing: at most `steps` recursions; `route` "topk" (expert
    choice's training selection) or "threshold" (the causal rule); `real` (B, T): the tokens that
    are not padding; readings into `record`."""

    steps: int | None = None
    route: str = "threshold"
    every_recursion: bool = False  # run a recursion even when no token takes it (a step's cost fixed)
    real: Tensor | None = None
    record: MoROutput | None = None


# -- the cache -------------------------------------------------------------------------------------


class RecursionKVCache(KVCache):
    """One slot per prelude layer, per (recursion, core layer) and per coda layer, then the route
    slot (`route_slot`): its key element [head, t, column] with head * head_dim + column = r - 1 is
    1 where token t took recursion r, else 0 (kept in the key tensor so that it moves with the
    token's keys)."""

    def __init__(self, batch_size: int, max_len: int, config: MoRConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        c = config
        self.route_slot = c.n_pre + c.n_rec * c.recursions + c.n_coda
        super().__init__(batch_size, max_len, self.route_slot + 1, c.n_kv_head, c.head_dim, device=device, dtype=dtype)

    def mark(self, recursion: int, took: Tensor) -> None:
        """The tokens this forward adds (B, T): which took `recursion`."""
        start, end = self.length, self.length + took.shape[1]
        head, column = divmod(recursion - 1, self.k.shape[-1])
        self.k[self.route_slot, :, head, start:end, column] = took.to(self.k.dtype)

    def key_positions(self, recursion: int, end: int) -> Tensor:
        """(B, end) positions of the stored tokens that took `recursion`, -1 elsewhere."""
        head, column = divmod(recursion - 1, self.k.shape[-1])
        took = self.k[self.route_slot, :, head, :end, column] > 0.5  # the flags are exactly 0 or 1
        return torch.where(took, self.key_pos[:, :end], torch.full_like(self.key_pos[:, :end], -1))


# -- the model -------------------------------------------------------------------------------------


class MoR(GPT):
    OPTIONS = OPTIONS
    # train.compile: the whole step, model and loss, one graph (the top-k route has static shapes)
    COMPILES_WHOLE = True
    context_class = RecursionContext

    def __init__(self, config: MoRConfig):
        super().__init__(config)
        # expert: column r - 1 scores recursion r; token: the logits over depths 1..N_r
        self.router = nn.Linear(config.n_embd, config.recursions)
        nn.init.normal_(self.router.weight, std=config.n_embd ** -0.5)
        nn.init.zeros_(self.router.bias)

    # the middle-cycle split's three parts, as rgpt reads them from the same config fields
    prelude, core, coda = RGPT.prelude, RGPT.core, RGPT.coda

    # -- routing ------------------------------------------------------------------------------
    def token_depths(self, h_pre: Tensor, steps: int) -> tuple[Tensor, Tensor, Tensor]:
        """Token choice: each token's depth (B, T) in 1..steps, its gate (B, T) and the router's
        probabilities (B, T, N_r)."""
        probs = torch.softmax(self.router(norm(h_pre)).float(), dim=-1)  # (B, T, N_r)
        gate, choice = probs.max(dim=-1)
        return (choice + 1).clamp(max=steps), gate.to(h_pre.dtype), probs

    @staticmethod
    def _record(ctx: RecursionContext, took: Tensor, aux: Tensor | None = None) -> None:
        """Note which tokens took a recursion (nothing syncs) and its auxiliary loss."""
        out = ctx.record
        if out is None:
            return
        if aux is not None:
            out.aux_terms.append(aux)
        out.taken.append(took.detach())

    # -- recursions ---------------------------------------------------------------------------
    def _masked_recursion(self, h: Tensor, go: Tensor, gate: Tensor, r: int, ctx: RecursionContext) -> Tensor:
        """Recursion r over every token, attention restricted to the tokens taking it (`go`), the
        others' states kept: the causal route (decoding, scoring, token-choice training)."""
        cache = ctx.cache
        if isinstance(cache, RecursionKVCache):
            cache.mark(r, go)
            end = cache.length + h.shape[1]
            key_pos = cache.key_positions(r, end)
            query_slots = torch.arange(cache.length, end, device=h.device)
            mask = attention_mask(ctx.plan.positions.expand(h.shape[0], -1), key_pos, query_slots,
                                  torch.arange(end, device=h.device))
            step_ctx = dataclasses.replace(ctx, plan=AttentionPlan(ctx.plan.positions, mask, False),
                                           slot_offset=(r - 1) * self.config.n_rec)
        else:
            positions = ctx.plan.positions.expand(h.shape[0], -1)  # (B, T)
            key_pos = torch.where(go, positions, torch.full_like(positions, -1))
            slots = torch.arange(h.shape[1], device=h.device)
            step_ctx = dataclasses.replace(ctx, plan=AttentionPlan(ctx.plan.positions,
                                                                   attention_mask(positions, key_pos, slots, slots),
                                                                   False))
        o = self.run_blocks(h, step_ctx, self.core)
        return torch.where(go[..., None], h + gate[..., None] * (o - h), h)

    def _topk_recursion(self, h: Tensor, alive: Tensor, r: int, ctx: RecursionContext,
                        real_count: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Expert choice's training route at recursion r: the top k_r of each row's candidates
        (`alive`) go through the core, gathered in position order (so plain causal attention is
        attention among them); returns the new states, the selection and the BCE of the scores.
        `real_count` (B,): each row's real tokens, whose ceil(capacity_r · count) is the row's k_r
        (None: every row is whole, k_r = ceil(capacity_r · T))."""
        B, T, D = h.shape
        capacity = self.config.capacities[r - 1]
        k = math.ceil(capacity * T)  # a whole row's k_r: the gather's width, the same for every batch (static shapes)
        scores = self.router(norm(h))[..., r - 1].float()  # (B, T)
        ranked = torch.where(alive, scores, torch.full_like(scores, -torch.inf)).topk(k, dim=1).indices  # best first
        keep = None
        if real_count is None:
            top = ranked.sort(dim=1).values  # (B, k) in position order
        else:
            # a padded row keeps its best ceil(capacity · count): in float64, the k_r a whole row of that
            # length gets (float32 would round some products across an integer). Built where h is: a table
            # copied from the host would be a blocking copy, a GPU stall, at every recursion of every SFT step.
            # The rest of the k gathered (non-candidates among them) are moved after the kept ones: causal
            # attention then never lets a kept token see them, and their states are not updated
            on = "cpu" if h.device.type == "mps" else h.device  # MPS has no float64: the host there
            counts = torch.arange(T + 1, dtype=torch.float64, device=on)
            quota = torch.ceil(counts * capacity).long().to(h.device)[real_count]  # (B,)
            chosen = torch.arange(k, device=h.device)[None] < quota[:, None]  # (B, k), by rank
            order = torch.where(chosen, ranked, ranked + T).sort(dim=1).values  # kept (in position order), then rest
            keep = order < T
            top = torch.where(keep, order, order - T)
            keep = keep & alive.gather(1, top)  # (never false for a kept one: quota <= the candidates)
        selected = torch.zeros_like(alive).scatter(1, top, True if keep is None else keep)
        # the mean over the candidates, as a weighted sum: selecting them (`scores[alive]`) has a
        # data-dependent shape, which breaks a compiled training step's graph
        candidates = alive.to(scores.dtype)
        aux = (F.binary_cross_entropy_with_logits(scores, selected.to(scores.dtype), weight=candidates,
                                                  reduction="sum") / candidates.sum().clamp(min=1))
        where = top[..., None].expand(B, k, D)
        x = h.gather(1, where)  # (B, k, D)
        positions = ctx.plan.positions.expand(B, T).gather(1, top)
        step_ctx = self.context_from_plan(AttentionPlan(positions, None, True))
        o = self.run_blocks(x, step_ctx, self.core)
        gate = torch.sigmoid(scores.gather(1, top)).to(h.dtype)[..., None]  # (B, k, 1)
        update = x + gate * (o - x)
        if keep is not None:
            update = torch.where(keep[..., None], update, x)
        return h.scatter(1, where, update), selected, aux

    def run_stack(self, x: Tensor, ctx: RecursionContext) -> Tensor:
        """prelude -> up to `ctx.steps` routed recursions of the core -> coda: inputs x (B, T, D) ->
        top states (B, T, D); through the cache when the context holds one."""
        c = self.config
        steps = ctx.steps or c.recursions
        if not 1 <= steps <= c.recursions:
            raise ConfigError(f"steps must be in [1, {c.recursions}] (the trained recursions), got {steps}")
        if ctx.route == "topk" and ctx.cache is not None:
            raise ConfigError("expert choice's top-k route trains on whole rows, without a cache")
        B, T, _ = x.shape
        real = ctx.real if ctx.real is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
        # top-k: a padded row's k_r comes from its real tokens (the MoR paper's capacity is per sequence)
        real_count = ctx.real.sum(dim=1) if ctx.real is not None else None
        h = self.run_blocks(x, ctx, self.prelude)  # (B, T, D)
        alive = real  # padding is never a candidate
        if c.routing == "token":
            depth, token_gate, probs = self.token_depths(h, steps)
            if ctx.record is not None and self.training:
                ctx.record.aux_terms.append(self.balance_loss(depth, probs, real))
        for r in range(1, steps + 1):
            if ctx.route == "topk":
                h, alive, aux = self._topk_recursion(h, alive, r, ctx, real_count)
                self._record(ctx, alive, aux)
                continue
            if c.routing == "expert":
                gate = torch.sigmoid(self.router(norm(h))[..., r - 1].float()).to(h.dtype)  # (B, T)
                go = alive & (gate > c.router_threshold)
            else:
                gate, go = token_gate, alive & (depth >= r)
            self._record(ctx, go)
            if not ctx.every_recursion and not torch.compiler.is_compiling() and not bool(go.any()):
                break  # no token goes on: the later recursions' flags stay 0 (not taken)
            h, alive = self._masked_recursion(h, go, gate, r, ctx), go
        coda_ctx = ctx if not isinstance(ctx.cache, RecursionKVCache) else dataclasses.replace(
            ctx, slot_offset=(c.recursions - 1) * c.n_rec)
        return self.run_blocks(h, coda_ctx, self.coda)

    def balance_loss(self, depth: Tensor, probs: Tensor, real: Tensor) -> Tensor:
        """Token choice's load balance, N_r Σ_j f_j P_j over the real tokens (f_j: the share routed to
        depth j, without gradient; P_j: the mean router probability of j)."""
        R = self.config.recursions
        weights = real.to(probs.dtype)[..., None]  # (B, T, 1)
        count = weights.sum().clamp(min=1)
        share = (F.one_hot(depth - 1, R).to(probs.dtype) * weights).sum(dim=(0, 1)) / count  # f_j
        mean_prob = (probs * weights).sum(dim=(0, 1)) / count  # P_j
        return R * (share.detach() * mean_prob).sum()

    # -- the two faces ------------------------------------------------------------------------
    def _run(self, idx: Tensor, cache: KVCache | None, pad_mask: Tensor | None, steps: int | None,
             route: str, every_recursion: bool = False, last_logits: bool = False) -> MoROutput:
        out = MoROutput(logits=None, hidden=None)
        ctx = self.context(idx, cache, pad_mask, steps=steps, route=route, every_recursion=every_recursion,
                           real=pad_mask, record=out)
        top = self.run_stack(self.embed(idx), ctx)
        if cache is not None:
            cache.advance()
        out.logits, out.hidden = self.readout(last_column(top) if last_logits else top), top
        out.info["steps"] = steps or self.config.recursions
        if cache is not None and out.taken and not torch.compiler.is_compiling():
            # decoding: how many recursions each new token took (its routing depth), and each row's newest's
            depth = torch.stack(out.taken).sum(0).tolist()  # (B, T)
            out.info[PER_TOKEN_INFO] = {"depth": depth}
            out.info[PER_ROW_INFO] = {"depth": [columns[-1] for columns in depth]}
        return out

    def forward(self, idx: Tensor, pad_mask: Tensor | None = None, steps: int | None = None,
                route: str | None = None, every_recursion: bool | None = None) -> MoROutput:
        """The whole sequence. `route`: "topk" (expert choice's training selection) or "threshold"
        (the causal rule decoding uses); None: top-k while training an expert-choice model, else
        the threshold. Token choice routes one way. `every_recursion`: run each recursion even
        when no token takes it (None: while training, so that a step's cost, and the FLOPs it is
        charged, do not depend on the batch). `pad_mask` (B, T) True on real tokens, on either route:
        padding takes no recursion, is no top-k candidate and carries no router loss."""
        if every_recursion is None:
            every_recursion = self.training
        if route is None:
            route = "topk" if self.training and self.config.routing == "expert" else "threshold"
        if route not in ("topk", "threshold"):
            raise ConfigError(f"route must be 'topk' or 'threshold', got {route!r}")
        if route == "topk" and self.config.routing != "expert":
            route = "threshold"  # token choice has one route
        return self._run(idx, None, pad_mask, steps, route, every_recursion)

    def prefill(self, idx: Tensor, cache: KVCache, pad_mask: Tensor | None = None,
                steps: int | None = None, draft_steps: int | None = None, draft_tokens: int | None = None,
                last_logits: bool = False) -> MoROutput:
        return self._run(idx, cache, pad_mask, steps, "threshold", last_logits=last_logits)

    def decode(self, idx: Tensor, cache: KVCache, steps: int | None = None, draft_steps: int | None = None,
               draft_tokens: int | None = None) -> MoROutput:
        return self._run(idx, cache, None, steps, "threshold")

    def reference(self, idx: Tensor, pad_mask: Tensor | None = None, prompt_len: int = 0,
                  steps: int | None = None, draft_steps: int | None = None,
                  draft_tokens: int | None = None) -> MoROutput:
        return self.forward(idx, pad_mask, steps=steps, route="threshold")

    def fast_path_blocker(self, options: dict) -> str | None:
        return "MoR's routers decide per token which recursions run"

    def draft_options(self, options: dict) -> Draft | None:
        """The same model at most `draft_steps` recursions (rgpt's `depth_draft`): a token's routing
        at each recursion it takes is the full depth's, so the draft is the full model cut short.
        `model_options` runs this for every set of options, so it also refuses `steps` past the trained
        recursions there, before any work (the stack's own check came at the first step)."""
        steps = options.get("steps")
        if steps is not None and steps > self.config.recursions:
            raise ConfigError(f"steps must be in [1, {self.config.recursions}] (the trained recursions), got {steps}")
        return depth_draft(options, steps or self.config.recursions)

    def new_cache(self, batch_size: int, max_len: int | None = None, **options) -> KVCache:
        weight = self.wte.weight
        return RecursionKVCache(batch_size, max_len or self.config.sequence_len, self.config, device=weight.device,
                                dtype=weight.dtype)

    def cache_slots(self) -> int:
        c = self.config
        return c.n_pre + c.n_rec * c.recursions + c.n_coda + 1

    def flops_per_token(self, seq_len: int | None = None, **forward_options) -> float:
        """As the backbone counts, but on a probe of the whole context: the top-k route keeps
        ceil(capacity · T) tokens per recursion, which a short probe would not scale."""
        seq_len = seq_len or self.config.sequence_len
        return count_flops_per_token(self, lambda idx: self(idx, **forward_options), seq_len, probe=seq_len)

    @classmethod
    def scoring_modes(cls, config: MoRConfig) -> dict[str, dict]:
        return {f"r<={config.recursions}": {}}
