"""Full-Bandwidth Transformer (arch `fbt`; Wang et al., "Full-bandwidth transformer", 2026).

Standard decoding squeezes the D-dimensional top state into one sampled token and throws the rest
away. Here the previous position's top state re-enters the bottom of the stack, fused with the
next token's embedding by a GLU:

    u_t = (W_U s_{t-1}) ⊙ σ(W_G e_t),     x_t = norm(u_t)        (e_t = norm(wte(token_t)))

where s is the top state after the final norm (`state_source="post_norm"`, default: it is what the
tied head reads, so it lives in embedding space and has unit RMS whatever the depth) or before it
("pre_norm"). W_U and W_G are the only new parameters. Position 0, BOS tokens and every position
before `fuse_from` take the plain embedding.

Two backbone options change what "the embedding" and "the final norm" are (upcycled Llama-family
models, see `latentloop.interop`):
- learned norm gains: s = ln_f(h), the final norm *with* its gain, i.e. exactly what the head reads;
- an untied head: s is still what the head reads; W_U learns the map into the input space that
  tying gives for free;
- no embedding norm (`embed_norm=false`): e_t is the raw embedding, and the fused input
  norm(u_t) is rescaled by one learned scalar `fuse_scale`, initialised to the embedding table's
  RMS, so that a fused input enters the stack at the scale the pretrained layers expect.

Notable features:
- parallel multi-pass forward: pass 1 is plain; pass k fuses pass k-1's top states shifted right by
  one. This is a Jacobi iteration of the sequential recurrence and is exact after T passes
- training-only jitter Uniform[-σ, σ] on the carried state
- decoding regimes with the KV cache, the carried state in `cache.state["fbt.prev_top"]` (B, 1, D):
  `standard` (plain inputs: the same weights as an ordinary transformer), `soft` (plain prefill,
  then every generated token is fused with the previous step's state) and `fused` (K-pass prefill,
  the cache taken from the last pass, then soft); `passes="auto"` adds prefill passes until the top
  states stop moving (a `RelativeChange` criterion)
- a BOS inside a sequence restarts the recurrence: its input is the plain embedding, in every
  pass and every regime, so what follows it sees no state carried from before
- a prompt's tokens the model wrote itself (`written`: a conversation's earlier replies) are replayed
  fused by the soft prefill, each with the state before it, as when they were generated and as SFT
  trains them (`sft_fuse_mask`); prefilled plain, a second turn's reply read a history training never
  showed (+0.28 [0.17, 0.39] nats/token on held-out two-turn chats: experiments/fbt_second_turn.py)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ...config import ModelConfig, require
from ...errors import ConfigError
from ...models.backbone import GPT, ForwardContext, ModelOutput, last_column, norm, shift_right
from ...models.cache import KVCache
from ...models.criteria import RelativeChange
from ...models.options import DecodeOption, when_one_of

# -- config ----------------------------------------------------------------------------------------

# fbt training recipes: when latent feedback starts and which pass counts batches draw after it.
#
# The paper's schedule: "training starts single-pass; latent feedback is introduced late in
# pretraining (2-pass batches) and a small fraction (~3%) of deeper (3-pass) batches is mixed in".
# The supplied texts (../shared/papers) say no more: not whether the 3% is of the whole run or of the
# feedback phase, nor the 1- and 2-pass shares. `recipe=paper` reads it as 75/22/3 % of 1/2/3-pass
# batches over the *whole* run (200B tokens -> 256B token equivalents, 1.28x), from an earlier source
# that is not among the supplied texts; the public Haix02 reproduction reads 3% of the feedback phase
# (97/3 after the start). The reading stays open (experiments/logs/2026-12-06-seventeenth-session.md,
# section 6). With every batch after the start multi-pass, 75/22/3 puts the start at 75% of the run,
# after which batches are 88/12 two-/three-pass (see `per_batch_mix`).
#   paper: that late start, stated as the paper states it (the whole-run mix).
#   short: feedback from step 0, half of the batches two-pass and half three-pass: runs of a few
#          hundred to a few thousand steps have no long standard pretraining phase to start from, and
#          starting late leaves the feedback path barely trained (measured: 12% multi-pass steps ->
#          soft BPB 1.8x standard on the tiny preset). 50/50 rather than the paper's late 88/12: under
#          the default Muon + bf16 recipe, 88/12 left soft decoding 1.11x standard's BPB on every seed
#          (bound 1.0825), 50/50 passed every bound on every seed, at 1.18x the training FLOPs
#          (experiments/logs/2026-12-03-bf16-default.md, rule 3, written before the run). Its deeper
#          passes' loss weighted 1.5 (`loss_lambda`): at 1.0 seed 0's fused / standard BPB was 1.0178
#          against its bound of 1.0177; at 1.5 every seed passes every bound (fused / standard
#          0.996-1.003), at the same FLOPs, for 0.9% on standard BPB
#          (experiments/logs/2026-12-04-fbt-loss-lambda.md, rule written before the run).
PAPER_RUN_MIX = (0.75, 0.22, 0.03)  # P(K = 1, 2, 3) over the whole run (the paper)
PAPER_FEEDBACK_START = 0.75  # fraction of the run: K = 1 before, K >= 2 on every batch after
FBT_RECIPES: dict[str, dict[str, Any]] = {
    "short": dict(feedback_start=0.0, pass_mix=(0.0, 0.5, 0.5), loss_lambda=1.5),
    "paper": dict(feedback_start=PAPER_FEEDBACK_START, run_mix=PAPER_RUN_MIX, loss_lambda=1.0),
}


def per_batch_mix(run_mix: tuple[float, ...], start_fraction: float) -> tuple[float, ...]:
    """The per-batch pass mix after feedback starts that gives `run_mix` over the whole run.

    Before the start (a fraction f of the steps) every batch is single-pass, so over the run
    P_run(K=1) = f + (1 - f) P(K=1) and P_run(K=k) = (1 - f) P(K=k) for k > 1. Solved for the
    per-batch P: P(K=1) = (P_run(1) - f) / (1 - f), P(K=k) = P_run(k) / (1 - f). E.g. 75/22/3 with
    f = 0.75 -> 0/88/12. Needs f <= P_run(K=1) (the single-pass steps before the start already
    exceed the run's share otherwise) and f < 1.
    """
    require(0.0 <= start_fraction < 1.0, f"feedback_start as a fraction must be in [0, 1), got {start_fraction}")
    require(len(run_mix) >= 1 and all(p >= 0 for p in run_mix) and math.isclose(sum(run_mix), 1.0, abs_tol=1e-6),
             f"run_mix must be non-negative probabilities summing to 1, got {list(run_mix)}")
    require(run_mix[0] >= start_fraction - 1e-9,
             f"run_mix puts {run_mix[0]:.3f} of the run at K=1 but feedback_start={start_fraction:.3f} already "
             "spends more than that single-pass: start earlier or raise run_mix[0]")
    rest = 1.0 - start_fraction
    mix = [max(0.0, (run_mix[0] - start_fraction) / rest)] + [p / rest for p in run_mix[1:]]
    total = sum(mix)
    return tuple(p / total for p in mix)  # renormalised: the clamp above may drop a rounding residue


@dataclass
class FBTConfig(ModelConfig):
    """Full-bandwidth transformer: GLU fusion of the previous top state into the next input.

    The multi-pass training objective is configured by a recipe (see `FBT_RECIPES`):

    - `recipe`: "short" (default: feedback from step 0, then 50/50 two-/three-pass batches, the
      deeper passes' loss weighted 1.5; for
      runs of a few hundred to a few thousand steps) or "paper" (single-pass for the first 75% of
      the run, then feedback: 75/22/3 one-/two-/three-pass batches over the whole run, as the paper).
    - `feedback_start`: where feedback starts: a fraction of the run if in [0, 1] (1: never), else
      the optimizer step (a whole number > 1). None: the recipe's.
    - `pass_mix`: P(K = 1), P(K = 2), ... of each batch *after* the start. None: the recipe's (or
      derived from `run_mix`).
    - `run_mix`: the same mix stated over the whole run, as the paper states 75/22/3; converted to
      a per-batch mix after the start by `per_batch_mix`. Give `pass_mix` or `run_mix`, not both.
    - `plain_fraction`: deprecated alias of `feedback_start` (older configs); with it, `pass_mix`
      keeps its old meaning (the mix after the plain phase), so saved runs load and train as before.
    """

    arch: ClassVar[str] = "fbt"
    TRAINING_NOISE: ClassVar[tuple[str, ...]] = ("jitter",)
    # Tied by default (the paper): the post-norm top state then lives in embedding space by
    # construction. Untied is allowed (upcycling an untied pretrained model): the carried state is
    # still what the head reads, and W_U has to learn the map from there into the input space.
    tie_embeddings: bool = True
    state_source: str = "post_norm"  # carry the top state after ("post_norm") or before ("pre_norm") the final norm
    jitter: float = 0.02  # Uniform[-jitter, jitter] noise on the carried state, training only
    loss_lambda: float | None = None  # deeper passes' weight: L = L_1 + lambda/(K-1) sum_k L_k; None: the recipe's
    recipe: str = "short"  # "short" or "paper", see FBT_RECIPES
    feedback_start: float | None = None  # fraction of the run in [0, 1], or an optimizer step > 1; None: the recipe's
    pass_mix: tuple[float, ...] | None = None  # per-batch P(K = 1), P(K = 2), ... after the start; None: the recipe's
    run_mix: tuple[float, ...] | None = None  # the whole run's mix (the paper's 75/22/3); converted to pass_mix
    plain_fraction: float | None = None  # deprecated alias of feedback_start
    prefix_mixin: bool = True  # fused passes keep a random plain prefix per packed document, drawn afresh per pass

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.state_source in ("post_norm", "pre_norm"),
                 f"state_source must be 'post_norm' or 'pre_norm', got {self.state_source!r}")
        require(self.jitter >= 0, f"jitter must be >= 0, got {self.jitter}")
        require(self.recipe in FBT_RECIPES, f"recipe must be one of {', '.join(FBT_RECIPES)}, got {self.recipe!r}")
        if self.loss_lambda is None:
            self.loss_lambda = FBT_RECIPES[self.recipe]["loss_lambda"]
        require(self.loss_lambda >= 0, f"loss_lambda must be >= 0, got {self.loss_lambda}")
        if self.plain_fraction is not None:  # the old name: map it, so a saved config trains as before
            require(0.0 <= self.plain_fraction <= 1.0, f"plain_fraction must be in [0, 1], got {self.plain_fraction}")
            require(self.feedback_start is None or self.feedback_start == self.plain_fraction,
                     "give feedback_start or its deprecated alias plain_fraction, not both")
            self.feedback_start = self.plain_fraction  # 1.0 meant "never multi-pass", as feedback_start=1.0 does
            self.plain_fraction = None
            if self.pass_mix is None and self.run_mix is None:
                self.pass_mix = PAPER_RUN_MIX  # the old default mix after the plain phase
        require(self.pass_mix is None or self.run_mix is None,
                 "give pass_mix (per batch after feedback starts) or run_mix (over the whole run), not both")
        recipe = FBT_RECIPES[self.recipe]
        if self.pass_mix is None and self.run_mix is None:
            self.pass_mix, self.run_mix = recipe.get("pass_mix"), recipe.get("run_mix")
        if self.feedback_start is None:
            self.feedback_start = recipe["feedback_start"]
        start = self.feedback_start
        require(0 <= start <= 1 or float(start).is_integer(),
                 f"feedback_start must be a fraction in [0, 1] or a whole step number > 1, got {start}")
        for name in ("pass_mix", "run_mix"):
            mix = getattr(self, name)
            if mix is None:
                continue
            mix = tuple(float(p) for p in mix)
            setattr(self, name, mix)
            require(len(mix) >= 1 and all(math.isfinite(p) and p >= 0 for p in mix)
                     and math.isclose(sum(mix), 1.0, abs_tol=1e-6),
                     f"{name} must be non-negative probabilities summing to 1, got {list(mix)}")
        if self.run_mix is not None and start < 1:
            per_batch_mix(self.run_mix, start)  # checked now: a fractional start converts without the run length

    def batch_mix(self, total_steps: int) -> tuple[float, ...]:
        """The per-batch pass mix after feedback starts, for a run of `total_steps` steps."""
        if self.pass_mix is not None:
            return self.pass_mix
        fraction = min(self.start_step(total_steps) / max(1, total_steps), 1.0)
        return per_batch_mix(self.run_mix, fraction) if fraction < 1 else (1.0,)

    def start_step(self, total_steps: int) -> float:
        """The first optimizer step (0-based) that may draw K > 1."""
        start = self.feedback_start
        return start * total_steps if start <= 1 else start

    # the front-ends' questions (see ModelConfig): a base run already went through its plain
    # single-pass phase, so later stages mix passes from step 0
    stage_defaults: ClassVar[dict[str, dict[str, Any]]] = {"sft": {"feedback_start": 0.0},
                                                           "extend": {"feedback_start": 0.0}}

    def stage_fields(self, stage: str, base_steps: int, named: frozenset[str] = frozenset()) -> dict[str, Any]:
        """From step 0, a later stage mixes passes as the base did after its feedback started: a
        whole-run mix (`run_mix`, the paper recipe's 75/22/3) becomes that per-batch mix (0/88/12
        after a start at 75%). Kept as a whole-run mix with the start at 0, it trained 75% of the
        stage's batches single-pass. Where the user sets the mix or the start, theirs stands: a mix of
        theirs of one kind clears the base's of the other (the two are exclusive)."""
        fields = super().stage_fields(stage, base_steps, named)
        mixes = {"pass_mix", "run_mix"}
        theirs = named & mixes
        if len(theirs) == 1:  # theirs of one kind clears the base's of the other
            return fields | {other: None for other in mixes - theirs}
        if theirs or "feedback_start" in named:
            return fields
        if fields.get("feedback_start") == 0.0 and self.pass_mix is None and self.run_mix is not None:
            fields |= {"pass_mix": list(self.batch_mix(base_steps)), "run_mix": None}
        return fields


STATE_KEY = "fbt.prev_top"
# fbt's teacher-forced "soft" score feeds the latent state back at every position of a text the
# model did not generate; the paper reports no such number (its SOFT regime is a decoding regime,
# judged by task accuracy). Reports label it so.
SOFT_BPB_NOTE = ("fbt soft = teacher-forced latent feedback at every position: latentloop's own metric, "
                 "not one the paper reports")
REGIMES = ("standard", "soft", "fused")
DEFAULT_FUSED_PASSES = 2
AUTO_TOLERANCE = 1e-3  # passes="auto" stops once every position's relative change of its top state is below this
AUTO_MAX_PASSES = 16
MAX_PASSES = 4096  # a bound on asked-for work; the Jacobi iteration is exact after sequence_len passes anyway

OPTIONS = (
    DecodeOption("regime", str, "soft", "decoding regime: standard (plain inputs), soft (latent feedback while "
                 "decoding) or fused (multi-pass prefill, then soft)", choices=REGIMES),
    DecodeOption("passes", int, DEFAULT_FUSED_PASSES, "prefill passes of the fused regime: an integer or 'auto' "
                 f"(until the top states settle, at most {AUTO_MAX_PASSES})", minimum=1, maximum=MAX_PASSES,
                 keywords=("auto",), applies_if=when_one_of("regime", ("fused",)),
                 couples_rows=lambda value: value == "auto"),  # "auto" runs until *every* row settled
)


@dataclass
class FBTOutput(ModelOutput):
    pass_logits: list[Tensor] = field(default_factory=list)  # (B, T, V) per pass, when requested
    pass_hidden: list[Tensor] = field(default_factory=list)  # (B, T, D) top states per pass, when requested


class FBT(GPT):
    OPTIONS = OPTIONS
    SCORING_NOTES = {"soft": SOFT_BPB_NOTE}
    CARRIED_STATE = (STATE_KEY,)
    REPLAYS_WRITTEN = True  # prefill / reference take `written` (see the module docstring)
    # train.compile: the whole multi-pass forward (one graph per pass count), measured 1.048x the
    # tok/s of compiling each block (experiments/logs/2026-12-02-compile-scope.md)
    COMPILES_WHOLE = True

    def __init__(self, config: FBTConfig):
        super().__init__(config)
        D = config.n_embd
        self.fuse_value = nn.Linear(D, D, bias=False)  # W_U: the carried state, on the value path
        self.fuse_gate = nn.Linear(D, D, bias=False)  # W_G: the token embedding, on the gate
        for linear in (self.fuse_value, self.fuse_gate):
            nn.init.normal_(linear.weight, std=D ** -0.5)
        self.fuse_scale = None  # only without the embedding norm (see the module docstring)
        if not config.embed_norm:
            self.fuse_scale = nn.Parameter(torch.ones(1))
            self.reset_fuse_scale()

    @torch.no_grad()
    def reset_fuse_scale(self) -> None:
        """fuse_scale <- the RMS of the embedding table (call again after loading other embeddings)."""
        if self.fuse_scale is not None and not self.wte.weight.is_meta:  # meta: built to be loaded (transformers)
            self.fuse_scale.fill_(float(self.wte.weight.float().pow(2).mean().sqrt()))

    # -- the mechanism ------------------------------------------------------------------------
    def carried_state(self, h: Tensor) -> Tensor:
        """The top state that is fed back: after or before the final norm, jittered in training."""
        s = self.ln_f(h) if self.config.state_source == "post_norm" else h
        if self.training and self.config.jitter > 0:
            s = s + torch.empty_like(s).uniform_(-self.config.jitter, self.config.jitter)
        return s

    def fuse(self, e: Tensor, s_prev: Tensor, gate: Tensor | None = None) -> Tensor:
        """GLU fusion of token embeddings e with previous states s_prev, both (B, T, D).
        `gate` = σ(W_G e), when already known (see `token_gates`)."""
        gate = torch.sigmoid(self.fuse_gate(e)) if gate is None else gate
        fused = norm(self.fuse_value(s_prev) * gate)
        return fused if self.fuse_scale is None else fused * self.fuse_scale

    def token_gates(self) -> Tensor:
        """σ(W_G e) for every token id (V, D), e the embedding as `embed` gives it. The gate
        depends on the token alone, so decoding looks it up instead of paying a D×D matmul per
        token; recomputed whenever the weights change: written in place (their version counters move)
        or replaced (other tensors: a module swap such as `quantize_int8`, whose new weight may reuse
        the old one's memory at the same version; the table's own weights are held, so their
        identities stay theirs)."""
        if torch.compiler.is_compiling():  # compiled decode (inference.fast) refreshes the table eagerly first
            return self._gate_table
        weights = (self.wte.weight, self.fuse_gate.weight)
        versions = tuple((weight._version, weight.data_ptr()) for weight in weights)  # `.data =` moves the latter
        held = getattr(self, "_gate_table_of", None)  # (weights, versions) the table was made from
        if held is None or any(a is not b for a, b in zip(held[0], weights)) or held[1] != versions:
            with torch.no_grad():
                self._gate_table = torch.sigmoid(self.fuse_gate(self.embed_norm(self.wte.weight)))
            self._gate_table_of = (weights, versions)
        return self._gate_table

    def fuse_mask(self, idx: Tensor, positions: Tensor, fuse_from: int) -> Tensor:
        """(B, T) True where the input is fused: positions >= max(1, fuse_from), never at BOS."""
        return (positions >= max(1, fuse_from)) & (idx != self.config.bos_id)

    def pass_states(self, idx: Tensor, ctx: ForwardContext, mask: Tensor | list[Tensor] | None = None,
                    base: Tensor | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """The one pass loop: (top states (B, T, D), the input it ran on) of pass 1, 2, ... for as
        long as the caller iterates; stopping is the caller's (a count, a settling criterion, the
        K's of a curve), and nothing of a pass it does not ask for is computed.

        Pass 1 runs on `base` (default: the plain embeddings); pass k + 1 fuses pass k's top states,
        shifted right by one, where `mask` (B, T) says (default: every position from 1, never at
        BOS), or where `mask[k - 1]` says when `mask` is a list (one per fused pass); unfused
        positions keep `base`. Each pass runs the whole stack (`run_stack`), whatever it is.
        """
        e = self.embed(idx)  # (B, T, D)
        base = e if base is None else base
        mask = self.fuse_mask(idx, ctx.plan.positions, 1) if mask is None else mask
        x = base
        for k in itertools.count():
            h = self.run_stack(x, ctx)  # (B, T, D)
            yield h, x
            fused = mask if isinstance(mask, Tensor) else mask[k]
            x = torch.where(fused[..., None], self.fuse(e, shift_right(self.carried_state(h))), base)

    def multipass(self, idx: Tensor, ctx: ForwardContext, passes: int, mask: Tensor | list[Tensor],
                  base: Tensor | None = None, until: RelativeChange | None = None) -> tuple[list[Tensor], Tensor]:
        """Run up to `passes` passes (`pass_states`); returns the top states of every pass and the
        input of the last one. `mask`: (B, T), the same in every pass, or a list of passes - 1
        masks, one per fused pass 2..K (training draws a fresh prefix per pass). With `until`, stops
        early once every position's top state has settled under that criterion."""
        masks = self._pass_masks(mask, passes)
        states: list[Tensor] = []
        for h, x in self.pass_states(idx, ctx, masks if isinstance(mask, list) else mask, base):
            states.append(h)
            settled = until is not None and len(states) > 1 and bool(until.settled(h, states[-2]).all())
            if len(states) == passes or settled:
                return states, x
        raise AssertionError("pass_states never ends")  # unreachable: the loop above returns

    @staticmethod
    def _pass_masks(mask: Tensor | list[Tensor], passes: int) -> list[Tensor]:
        """One (B, T) mask per fused pass (the input of pass k + 2 uses masks[k])."""
        if isinstance(mask, Tensor):
            return [mask] * max(0, passes - 1)
        if len(mask) != passes - 1:
            raise ConfigError(f"a per-pass fuse mask list needs passes - 1 = {passes - 1} masks, got {len(mask)}")
        return list(mask)

    # -- the whole sequence -------------------------------------------------------------------
    def forward(self, idx: Tensor, pad_mask: Tensor | None = None, passes: int = 1, fuse_from: int = 1,
                fuse_mask: Tensor | list[Tensor] | None = None, return_passes: bool = False,
                **stack) -> FBTOutput:
        """Multi-pass forward over a whole sequence (pass 1 plain); pass k fuses pass k-1's top
        states. `fuse_mask` (B, T), or a list of passes - 1 of them (one per fused pass), overrides
        `fuse_from` (training's per-document prefixes). `stack`: context fields of the stack each
        pass runs (a recurrent stack's depth; none for fbt's own)."""
        if passes < 1:
            raise ConfigError(f"passes must be >= 1, got {passes}")
        states, _ = self._passes(idx, None, pad_mask, passes, fuse_from=fuse_from, mask=fuse_mask, **stack)
        return self._output(states, return_passes)

    def _passes(self, idx: Tensor, cache: KVCache | None, pad_mask: Tensor | None, passes: int,
                fuse_from: int = 1, mask: Tensor | list[Tensor] | None = None, base: Tensor | None = None,
                until: RelativeChange | None = None, **stack) -> tuple[list[Tensor], Tensor]:
        """`multipass` over idx; with a cache (empty), every pass rewrites its slots, so the
        keys/values left there are those of the last pass, and the carried state is stored."""
        ctx = self.context(idx, cache, pad_mask, **stack)
        if mask is None:
            mask = self.fuse_mask(idx, ctx.plan.positions, fuse_from)
        states, x_last = self.multipass(idx, ctx, passes, mask, base=base, until=until)
        if cache is not None:
            cache.advance()
            cache.state[STATE_KEY] = self.carried_state(states[-1][:, -1:])  # (B, 1, D)
        return states, x_last

    def _output(self, states: list[Tensor], return_passes: bool, last_logits: bool = False) -> FBTOutput:
        top = last_column(states[-1]) if last_logits else states[-1]
        out = FBTOutput(logits=self.readout(top), hidden=states[-1], info={"passes": len(states)})
        if return_passes:
            out.pass_hidden = states
            out.pass_logits = [self.readout(h) for h in states[:-1]] + [out.logits]
        return out

    # -- decoding protocol --------------------------------------------------------------------
    # `stack` below: context fields of the stack (see `forward`), passed through by a variant
    def prefill(self, idx: Tensor, cache: KVCache, pad_mask: Tensor | None = None, regime: str = "soft",
                passes: int | str = DEFAULT_FUSED_PASSES, last_logits: bool = False, written: Tensor | None = None,
                **stack) -> FBTOutput:
        """`written` (B, P): True on prompt tokens the model wrote (earlier replies), which the soft
        regime replays fused (`_replayed_prefill`); standard reads plain inputs, fused fuses them all."""
        if regime == "fused":
            return self._fused_prefill(idx, cache, pad_mask, passes, last_logits, **stack)[0]
        if regime == "soft" and written is not None and bool(written.any()):
            return self._replayed_prefill(idx, cache, pad_mask, written, last_logits, **stack)
        return self._output(self._passes(idx, cache, pad_mask, 1, **stack)[0], False, last_logits)  # plain

    def _replayed_prefill(self, idx: Tensor, cache: KVCache, pad_mask: Tensor | None, written: Tensor,
                          last_logits: bool, **stack) -> FBTOutput:
        """The soft prefill of a prompt part of which the model wrote: a written token is fused with
        the state its predecessor left, exactly as `soft_step` fused it when it was generated; the
        rest is plain. The recurrence is sequential where tokens are written, so a column some row
        wrote runs as one step, and the columns between run as plain chunks."""
        T = idx.shape[1]
        # as `fuse_mask`: never a row's first real token (there is no state before it) nor a BOS
        positions = torch.arange(T, device=idx.device)[None] if pad_mask is None else pad_mask.long().cumsum(1) - 1
        written = written & self.fuse_mask(idx, positions, 1)
        replayed = written.any(dim=0).tolist()  # per column: does any row fuse
        tops: list[Tensor] = []  # (B, t, D) top states of each piece
        start = 0
        while start < T:
            end = start + 1 if replayed[start] else next((c for c in range(start, T) if replayed[c]), T)
            piece = idx[:, start:end]  # (B, t)
            x = self.embed(piece)
            if replayed[start]:  # never the first column: no row's first real token is fused
                fused = self.fuse(x, cache.state[STATE_KEY])
                x = torch.where(written[:, start:end, None], fused, x)
            ctx = self.context(piece, cache, None if pad_mask is None else pad_mask[:, start:end], **stack)
            h = self.run_stack(x, ctx)  # (B, t, D)
            cache.advance()
            cache.state[STATE_KEY] = self.carried_state(h[:, -1:])  # (B, 1, D)
            tops.append(h)
            start = end
        return self._output([tops[-1] if last_logits else torch.cat(tops, dim=1)], False, last_logits)

    def decode(self, idx: Tensor, cache: KVCache, regime: str = "soft",
               passes: int | str = DEFAULT_FUSED_PASSES, **stack) -> ModelOutput:
        if regime == "standard":
            return self.run(idx, cache, **stack)
        return self.step_tokens(idx, cache, functools.partial(self.soft_step, **stack) if stack else self.soft_step)

    def soft_step(self, token: Tensor, cache: KVCache, pad_mask: Tensor | None = None, **stack) -> ModelOutput:
        """One token (B, 1) fused with the state its predecessor left in the cache (plain at BOS)."""
        e = self.embed(token)
        gate = None if torch.is_grad_enabled() else self.token_gates()[token]  # (B, 1, D)
        fused = self.fuse(e, cache.state[STATE_KEY], gate)
        x = torch.where((token != self.config.bos_id)[..., None], fused, e)  # BOS restarts the recurrence
        h = self.run_stack(x, self.context(token, cache, None, **stack))  # (B, 1, D)
        cache.advance()
        h_normed = self.ln_f(h)  # shared by the head and the carried state
        reuse_norm = self.config.state_source == "post_norm" and not (self.training and self.config.jitter > 0)
        cache.state[STATE_KEY] = h_normed if reuse_norm else self.carried_state(h)
        return ModelOutput(logits=self.head(h_normed), hidden=h, info={"passes": 1})

    def reference(self, idx: Tensor, pad_mask: Tensor | None = None, prompt_len: int = 0, regime: str = "soft",
                  passes: int | str = DEFAULT_FUSED_PASSES, written: Tensor | None = None, **stack) -> FBTOutput:
        """The whole sequence, whose columns >= prompt_len were generated, without a cache; in the soft
        regime the prompt's `written` tokens (B, prompt_len) are fused as generated ones are."""
        if regime == "standard":
            return self._output([self.run(idx, None, pad_mask, **stack).hidden], False)
        base = None
        if regime == "fused":  # the prompt's inputs stay those of its last prefill pass
            prompt_mask = None if pad_mask is None else pad_mask[:, :prompt_len]
            _, prompt_input = self._fused_prefill(idx[:, :prompt_len], None, prompt_mask, passes, **stack)
            base = torch.cat([prompt_input, self.embed(idx[:, prompt_len:])], dim=1)
        ctx = self.context(idx, None, pad_mask, **stack)
        columns = torch.arange(idx.shape[1], device=idx.device)
        generated = self.fuse_mask(idx, ctx.plan.positions, 1) & (columns >= prompt_len)
        first = prompt_len  # the first fused column
        if regime == "soft" and written is not None and bool(written.any()):
            written_columns = torch.cat([written, written.new_zeros(written.shape[0], idx.shape[1] - prompt_len)], 1)
            generated = generated | (self.fuse_mask(idx, ctx.plan.positions, 1) & written_columns)
            first = int(written.any(dim=0).nonzero()[0])
        # fused column j is exact after j - first + 1 passes (Jacobi)
        states, _ = self.multipass(idx, ctx, idx.shape[1] - first + 1, generated, base=base)
        return self._output(states, False)

    def _fused_prefill(self, idx: Tensor, cache: KVCache | None, pad_mask: Tensor | None,
                       passes: int | str, last_logits: bool = False, **stack) -> tuple[FBTOutput, Tensor]:
        """K-pass (or "auto") prefill; also returns the input of the last pass."""
        auto = passes == "auto"
        until = RelativeChange(AUTO_TOLERANCE) if auto else None
        states, x_last = self._passes(idx, cache, pad_mask, AUTO_MAX_PASSES if auto else passes, until=until,
                                      **stack)
        out = self._output(states, False, last_logits)
        out.info["prefill_passes"] = len(states)
        return out, x_last

    @torch.no_grad()
    def prepare_fast_decoding(self) -> None:
        self.token_gates()

    def upcycle_from(self, weights: dict[str, Tensor], base_layers: int, load) -> dict:
        """Every pretrained tensor; W_U, W_G fresh. Decoding with `regime=standard` is the pretrained
        model exactly (plain inputs); the fused inputs are new and are learned by the multi-pass
        objective from its `feedback_start` on (the paper introduces the feedback late in
        pretraining: a pretrained base has had its single-pass phase, so the default recipe's start
        at step 0 fits). An untied head is allowed: the carried state is still what the head reads
        (after the final norm and its gain), and W_U learns the map into the input space that tying
        gives for free; without an embedding norm the fused input is rescaled to the embedding
        table's RMS (`fuse_scale`, re-measured here on the loaded embeddings)."""
        fresh = load(weights)
        self.reset_fuse_scale()
        return {"mapping": "same tensors", "new": fresh, "exact_at_step0": "regime=standard"}

    def teacher_forced_prompt_len(self, seq_len: int, options: dict) -> int:
        """soft scores latent feedback at every position: only position 0 (always plain) is
        prefilled. standard and fused score one (multi-pass) forward over the whole text."""
        return 1 if options.get("regime", "soft") == "soft" else seq_len

    @classmethod
    def scoring_modes(cls, config: FBTConfig) -> dict[str, dict]:
        return {"standard": {"regime": "standard"}, "soft": {"regime": "soft"},
                "fused": {"regime": "fused", "passes": DEFAULT_FUSED_PASSES}}
