"""Typed configuration: model, training and data dataclasses, named presets, YAML and overrides.

Every config is a dataclass validated in `__post_init__`; an impossible value raises `ConfigError`
with a one-line message naming the field. Architecture variants subclass `ModelConfig` and add only
their own knobs (including the knobs of their training procedure, as Huginn keeps its mean
recurrence next to the model shape).

A run is described by `RunConfig(model, train, data)`; it serialises to YAML/JSON with the sections
`model:`, `train:`, `data:`. Overrides use `key=value` with either a dotted (`model.n_layer=4`) or a
bare field name (`n_layer=4`) when the bare name is unambiguous.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from .errors import ConfigError
from .util import write_json_atomic


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _require_finite(config: Any) -> None:
    """Every float field (and every float in a tuple field) of a config dataclass is finite: an
    infinite lr or softcap passes every range check and then silently trains on NaN."""
    for f in fields(config):
        value = getattr(config, f.name)
        values = value if isinstance(value, tuple) else (value,)
        for item in values:
            _require(not isinstance(item, float) or math.isfinite(item),
                     f"{f.name} must be a finite number, got {value!r}")


# --------------------------------------------------------------------------------------------
# Model configs
# --------------------------------------------------------------------------------------------


ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclass
class ModelConfig:
    """Shape and options of the shared backbone (arch `gpt`)."""

    arch: ClassVar[str] = "gpt"

    vocab_size: int = 259  # the byte tokenizer's 256 bytes + BOS/EOS/PAD; set from the tokenizer
    sequence_len: int = 256  # longest context the model is trained for (RoPE tables cover 2x)
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_kv_head: int | None = None  # None: same as n_head (no grouped-query attention)
    mlp: str = "relu2"  # "relu2" (nanochat) or "swiglu"
    mlp_ratio: float = 4.0  # hidden width / n_embd (SwiGLU uses 2/3 of it, to match params)
    tie_embeddings: bool = False
    logit_softcap: float = 0.0  # 0 disables; else logits = cap * tanh(logits / cap)
    rope_theta: float = 10000.0
    bos_id: int = 256  # the tokenizer's BOS id (set from the tokenizer): variants restart state there
    # Options that express the Llama family exactly (Llama, SmolLM, Qwen2, ...; see
    # `latentloop.interop`). The defaults are nanochat's; a new parameter exists only while its
    # option is on, so checkpoints written before these options load unchanged.
    embed_norm: bool = True  # RMSNorm on the token embedding (nanochat); Llama feeds the raw embedding
    qk_norm: bool = True  # RMSNorm on queries and keys after RoPE (nanochat); Llama has none
    learned_norms: bool = False  # a learned gain in every block norm and the final norm (Llama)
    norm_eps: float | None = None  # RMSNorm epsilon; None: torch's default (the dtype's machine epsilon)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2); the output projection never has one
    intermediate_size: int = 0  # MLP hidden width; 0: derived from mlp_ratio (see `mlp_hidden`)
    rope_scaling: str = "none"  # "none", "linear" (positions / factor) or "llama3" (Llama 3.1's per-frequency)
    rope_factor: float = 1.0  # linear and llama3: how much longer the context is than the trained one
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / low are scaled by 1 / factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / high are kept
    rope_original_max_positions: int = 8192  # llama3: the context the frequencies were trained for

    def __post_init__(self) -> None:
        _require_finite(self)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        _require(self.vocab_size >= 2, f"vocab_size must be >= 2, got {self.vocab_size}")
        _require(self.sequence_len >= 1, f"sequence_len must be >= 1, got {self.sequence_len}")
        _require(self.n_layer >= 1, f"n_layer must be >= 1, got {self.n_layer}")
        _require(self.n_head >= 1, f"n_head must be >= 1, got {self.n_head}")
        _require(self.n_embd % self.n_head == 0,
                 f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        _require(self.head_dim % 2 == 0, f"head_dim (n_embd / n_head = {self.head_dim}) must be even for RoPE")
        _require(1 <= self.n_kv_head <= self.n_head and self.n_head % self.n_kv_head == 0,
                 f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        _require(self.mlp in ("relu2", "swiglu"), f"mlp must be 'relu2' or 'swiglu', got {self.mlp!r}")
        _require(self.mlp_ratio > 0, f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        _require(self.logit_softcap >= 0, f"logit_softcap must be >= 0, got {self.logit_softcap}")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        _require(0 <= self.bos_id < self.vocab_size, f"bos_id ({self.bos_id}) must be a token id below vocab_size "
                 f"({self.vocab_size})")
        _require(self.norm_eps is None or 0 < self.norm_eps < 1,
                 f"norm_eps must be in (0, 1) or null, got {self.norm_eps}")
        _require(self.intermediate_size >= 0, f"intermediate_size must be >= 0 (0: from mlp_ratio), "
                 f"got {self.intermediate_size}")
        _require(self.rope_scaling in ROPE_SCALINGS,
                 f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
        _require(self.rope_factor > 0, f"rope_factor must be > 0, got {self.rope_factor}")
        _require(0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                 f"rope_low_freq_factor ({self.rope_low_freq_factor}) must be > 0 and below rope_high_freq_factor "
                 f"({self.rope_high_freq_factor})")
        _require(self.rope_original_max_positions >= 1,
                 f"rope_original_max_positions must be >= 1, got {self.rope_original_max_positions}")

    # derived fields ---------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        hidden = self.mlp_ratio * self.n_embd
        if self.mlp == "swiglu":  # three matrices instead of two: keep the parameter count
            hidden = hidden * 2 / 3
        return max(1, int(round(hidden)))

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, **dataclasses.asdict(self)}


# fbt training recipes: when latent feedback starts and which pass counts batches draw after it.
#
# The paper's schedule: "training starts single-pass; latent feedback is introduced late in
# pretraining (2-pass batches) and a small fraction (~3%) of deeper (3-pass) batches is mixed in";
# 75/22/3 % is the mix of 1/2/3-pass batches over the *whole* run (200B tokens -> 256B token
# equivalents, 1.28x). With every batch after the start multi-pass, that puts the start at 75% of
# the run, after which batches are 88/12 two-/three-pass (see `per_batch_mix`).
#   paper: that late start, stated as the paper states it (the whole-run mix).
#   short: the same per-batch mix after the start, but from step 0: runs of a few hundred to a few
#          thousand steps have no long standard pretraining phase to start from, and starting late
#          leaves the feedback path barely trained (measured: 12% multi-pass steps -> soft BPB 1.8x
#          standard on the tiny preset).
PAPER_RUN_MIX = (0.75, 0.22, 0.03)  # P(K = 1, 2, 3) over the whole run (the paper)
PAPER_FEEDBACK_START = 0.75  # fraction of the run: K = 1 before, K >= 2 on every batch after
FBT_RECIPES: dict[str, dict[str, Any]] = {
    "short": dict(feedback_start=0.0, pass_mix=(0.0, 0.88, 0.12)),
    "paper": dict(feedback_start=PAPER_FEEDBACK_START, run_mix=PAPER_RUN_MIX),
}


def per_batch_mix(run_mix: tuple[float, ...], start_fraction: float) -> tuple[float, ...]:
    """The per-batch pass mix after feedback starts that gives `run_mix` over the whole run.

    Before the start (a fraction f of the steps) every batch is single-pass, so over the run
    P_run(K=1) = f + (1 - f) P(K=1) and P_run(K=k) = (1 - f) P(K=k) for k > 1. Solved for the
    per-batch P: P(K=1) = (P_run(1) - f) / (1 - f), P(K=k) = P_run(k) / (1 - f). E.g. 75/22/3 with
    f = 0.75 -> 0/88/12. Needs f <= P_run(K=1) (the single-pass steps before the start already
    exceed the run's share otherwise) and f < 1.
    """
    _require(0.0 <= start_fraction < 1.0, f"feedback_start as a fraction must be in [0, 1), got {start_fraction}")
    _require(len(run_mix) >= 1 and all(p >= 0 for p in run_mix) and math.isclose(sum(run_mix), 1.0, abs_tol=1e-6),
             f"run_mix must be non-negative probabilities summing to 1, got {list(run_mix)}")
    _require(run_mix[0] >= start_fraction - 1e-9,
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

    - `recipe`: "short" (default: feedback from step 0, then 88/12 two-/three-pass batches; for
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
    # Tied by default (the paper): the post-norm top state then lives in embedding space by
    # construction. Untied is allowed (upcycling an untied pretrained model): the carried state is
    # still what the head reads, and W_U has to learn the map from there into the input space.
    tie_embeddings: bool = True
    state_source: str = "post_norm"  # carry the top state after ("post_norm") or before ("pre_norm") the final norm
    jitter: float = 0.02  # Uniform[-jitter, jitter] noise on the carried state, training only
    loss_lambda: float = 1.0  # weight of the deeper passes: L = L_1 + lambda/(K-1) sum_k L_k
    recipe: str = "short"  # "short" or "paper", see FBT_RECIPES
    feedback_start: float | None = None  # fraction of the run in [0, 1], or an optimizer step > 1; None: the recipe's
    pass_mix: tuple[float, ...] | None = None  # per-batch P(K = 1), P(K = 2), ... after the start; None: the recipe's
    run_mix: tuple[float, ...] | None = None  # the whole run's mix (the paper's 75/22/3); converted to pass_mix
    plain_fraction: float | None = None  # deprecated alias of feedback_start
    prefix_mixin: bool = True  # fused passes keep a random plain prefix per packed document, drawn afresh per pass

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.state_source in ("post_norm", "pre_norm"),
                 f"state_source must be 'post_norm' or 'pre_norm', got {self.state_source!r}")
        _require(self.jitter >= 0, f"jitter must be >= 0, got {self.jitter}")
        _require(self.loss_lambda >= 0, f"loss_lambda must be >= 0, got {self.loss_lambda}")
        _require(self.recipe in FBT_RECIPES, f"recipe must be one of {', '.join(FBT_RECIPES)}, got {self.recipe!r}")
        if self.plain_fraction is not None:  # the old name: map it, so a saved config trains as before
            _require(0.0 <= self.plain_fraction <= 1.0, f"plain_fraction must be in [0, 1], got {self.plain_fraction}")
            _require(self.feedback_start is None or self.feedback_start == self.plain_fraction,
                     "give feedback_start or its deprecated alias plain_fraction, not both")
            self.feedback_start = self.plain_fraction  # 1.0 meant "never multi-pass", as feedback_start=1.0 does
            self.plain_fraction = None
            if self.pass_mix is None and self.run_mix is None:
                self.pass_mix = PAPER_RUN_MIX  # the old default mix after the plain phase
        _require(self.pass_mix is None or self.run_mix is None,
                 "give pass_mix (per batch after feedback starts) or run_mix (over the whole run), not both")
        recipe = FBT_RECIPES[self.recipe]
        if self.pass_mix is None and self.run_mix is None:
            self.pass_mix, self.run_mix = recipe.get("pass_mix"), recipe.get("run_mix")
        if self.feedback_start is None:
            self.feedback_start = recipe["feedback_start"]
        start = self.feedback_start
        _require(0 <= start <= 1 or float(start).is_integer(),
                 f"feedback_start must be a fraction in [0, 1] or a whole step number > 1, got {start}")
        for name in ("pass_mix", "run_mix"):
            mix = getattr(self, name)
            if mix is None:
                continue
            mix = tuple(float(p) for p in mix)
            setattr(self, name, mix)
            _require(len(mix) >= 1 and all(math.isfinite(p) and p >= 0 for p in mix)
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


LRT_RECURRENCES = ("interleaved", "chunked", "sequential", "multi_refine")


def upper_middle_layer(n_layer: int) -> int:
    """The paper's best memory source, scaled to a depth: "an upper-middle layer (e.g. layer 12 of
    a 20-layer model)" -> block index round(0.6 L) - 1 (1-based layer 12 of 20 is block 11)."""
    return max(0, round(UPPER_MIDDLE_FRACTION * n_layer) - 1)


UPPER_MIDDLE_FRACTION = 0.6  # the paper's 12 of 20 layers
OFFICIAL_GATE_CHANNELS = 32  # the official code's gate reads the first 32 channels of norm(x)


@dataclass
class LRTConfig(ModelConfig):
    """Latent recurrent transformer: the previous token's source-layer state injected into the
    keys/values and the residual stream of the current token.

    Defaults against the paper (Huang et al.) and the authors' released code (OoDBag/
    Latent_recurrent_transformer):

    - `source_layer`: None (default) = the paper's best source, an upper-middle block
      (`upper_middle_layer`: 60% of the depth; the paper's ablation: layer 12 of 20 beats the top).
      -1 = the normed top state, the released code's choice. l >= 0: the normed output of block l.
    - `injection` "both" and `kv_projection` "shared": the paper's default LRT-shared variant.
    - `residual_lr`: the learning rate of the residual scalars α_l, γ_l, in a param group of their
      own as the released code trains them (with AdamW here); 0 (default) = the run's lr. The
      paper does not give a value, and none was tuned at this scale.
    - `kv_gate_channels`: the gate W_g reads the first n channels of norm(x); 0 (default) = all of
      them, as the paper's "input-dependent gate"; 32 = the released code.
    - `value_embeds`: the released code's third gate channel: a per-layer token value embedding
      (nn.Embedding(V, n_kv_head * head_dim), zeros at init) added to the values through a third
      gate, v <- g_loc v + g_fb v_fb + g_ve ve(token). Off by default (not in the paper).

    `recurrence`, `subsets`, `chunk_size` and `refine_passes` configure its training procedure.
    """

    arch: ClassVar[str] = "lrt"
    source_layer: int | None = None  # None: upper_middle_layer(n_layer) (paper); -1: the normed top (released code)
    inject_layers: tuple[int, ...] = ()  # blocks that receive the memory; () = every block
    injection: str = "both"  # "kv", "residual" or "both"
    kv_projection: str = "shared"  # "shared" (one W_k, W_v for all layers) or "layerwise"
    residual_gamma_init: float = 0.1  # x <- alpha_l x + gamma_l m with alpha_l = 1 at init
    residual_lr: float = 0.0  # lr of alpha_l, gamma_l (their own param group); 0: the run's lr
    kv_gate_channels: int = 0  # the gate reads norm(x)[..., :n]; 0: all channels (released code: 32)
    value_embeds: bool = False  # per-layer token value embeddings through a third gate (released code)
    recurrence: str = "interleaved"  # training procedure, see LRT_RECURRENCES
    subsets: int = 2  # interleaved: stride subsets refined after the init pass
    chunk_size: int = 64  # chunked: memory crosses chunk boundaries only
    refine_passes: int = 2  # multi_refine: full passes, each using the previous pass's states

    def __post_init__(self) -> None:
        super().__post_init__()
        self.inject_layers = tuple(int(i) for i in self.inject_layers)
        if self.source_layer is None:
            self.source_layer = upper_middle_layer(self.n_layer)
        _require(-1 <= self.source_layer < self.n_layer,
                 f"source_layer must be -1 (top) or a block index below n_layer ({self.n_layer}), "
                 f"got {self.source_layer}")
        _require(all(0 <= i < self.n_layer for i in self.inject_layers),
                 f"inject_layers must be block indices below n_layer ({self.n_layer}), got {list(self.inject_layers)}")
        _require(self.injection in ("kv", "residual", "both"),
                 f"injection must be 'kv', 'residual' or 'both', got {self.injection!r}")
        _require(self.kv_projection in ("shared", "layerwise"),
                 f"kv_projection must be 'shared' or 'layerwise', got {self.kv_projection!r}")
        _require(self.residual_lr >= 0, f"residual_lr must be >= 0 (0: the run's lr), got {self.residual_lr}")
        _require(0 <= self.kv_gate_channels <= self.n_embd,
                 f"kv_gate_channels must be in [0, n_embd={self.n_embd}] (0: all), got {self.kv_gate_channels}")
        _require(not self.value_embeds or self.injection in ("kv", "both"),
                 "value_embeds enter through the keys/values gate: it needs injection 'kv' or 'both'")
        _require(self.recurrence in LRT_RECURRENCES,
                 f"recurrence must be one of {', '.join(LRT_RECURRENCES)}, got {self.recurrence!r}")
        _require(self.subsets >= 1, f"subsets must be >= 1, got {self.subsets}")
        _require(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        _require(self.refine_passes >= 1, f"refine_passes must be >= 1, got {self.refine_passes}")

    def injects(self, layer_idx: int) -> bool:
        return not self.inject_layers or layer_idx in self.inject_layers


# rgpt's training depth distributions (drawn per optimizer step by objectives/rgpt.py):
#   uniform:    r ~ Uniform{1..R}, the RecurrentGPT paper's own sampling.
#   heavy_tail: Huginn's log-normal Poisson (Geiping et al. 2025, arXiv 2502.05171), the baseline the
#               RecurrentGPT paper compares against: tau ~ N(log r̄ - σ²/2, σ), r = Poisson(e^tau) + 1,
#               so E[r - 1] = E[e^tau] = r̄. Huginn trains with r̄ = 32 and gradients through the last
#               k = 8 steps (depth_mean=32 backprop_steps=8 here); its σ = 1/2 is the default below.
DEPTH_SAMPLINGS = ("uniform", "heavy_tail")
HUGINN_DEPTH_SIGMA = 0.5
# The most recurrence steps one forward may run: a bound on asked-for work. It caps a heavy-tailed
# training draw (the tail is unbounded) and the depth decoding may ask for (models/rgpt.py).
MAX_RECURRENCE_STEPS = 256


@dataclass
class RGPTConfig(ModelConfig):
    """RecurrentGPT: prelude (n_pre blocks) -> shared core (n_rec blocks) applied R times with a
    projected, gated state update -> coda (n_coda blocks). `n_layer` is derived: the number of
    distinct blocks. When n_pre / n_rec / n_coda are not given they split a preset's n_layer as
    1 / n_layer - 2 / 1.

    `recurrence_steps` is the trained R (the default inference depth); `truncate_steps`,
    `depth_sampling`, `depth_mean`, `depth_sigma` and `backprop_steps` configure its training
    objective (see DEPTH_SAMPLINGS and objectives/rgpt.py).
    """

    arch: ClassVar[str] = "rgpt"
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
        if self.n_pre is None and self.n_rec is None and self.n_coda is None:
            edge = 1 if self.n_layer >= 3 else 0
            self.n_pre, self.n_coda, self.n_rec = edge, edge, self.n_layer - 2 * edge
        else:
            self.n_pre = 1 if self.n_pre is None else self.n_pre
            self.n_coda = 1 if self.n_coda is None else self.n_coda
            self.n_rec = max(1, self.n_layer - self.n_pre - self.n_coda) if self.n_rec is None else self.n_rec
        _require(self.n_pre >= 0 and self.n_coda >= 0, "n_pre and n_coda must be >= 0")
        _require(self.n_rec >= 1, f"n_rec must be >= 1, got {self.n_rec}")
        self.n_layer = self.n_pre + self.n_rec + self.n_coda
        super().__post_init__()
        _require(self.recurrence_steps >= 1, f"recurrence_steps must be >= 1, got {self.recurrence_steps}")
        _require(self.noise_std >= 0, f"noise_std must be >= 0, got {self.noise_std}")
        _require(self.gate_temperature > 0, f"gate_temperature must be > 0, got {self.gate_temperature}")
        _require(0 <= self.truncate_steps < self.recurrence_steps,
                 f"truncate_steps must be in [0, recurrence_steps), got {self.truncate_steps}")
        _require(self.depth_sampling in DEPTH_SAMPLINGS,
                 f"depth_sampling must be one of {', '.join(DEPTH_SAMPLINGS)}, got {self.depth_sampling!r}")
        _require(self.depth_mean is None or 1 <= self.depth_mean < MAX_RECURRENCE_STEPS,
                 f"depth_mean must be in [1, {MAX_RECURRENCE_STEPS}) or null, got {self.depth_mean}")
        _require(self.depth_sigma > 0, f"depth_sigma must be > 0, got {self.depth_sigma}")
        _require(self.backprop_steps is None or 1 <= self.backprop_steps <= MAX_RECURRENCE_STEPS,
                 f"backprop_steps must be in [1, {MAX_RECURRENCE_STEPS}] or null, got {self.backprop_steps}")
        _require(self.backprop_steps is None or self.truncate_steps == 0,
                 "set one of truncate_steps (the first n steps without gradient) and backprop_steps "
                 "(the last k steps with it), not both")

    @property
    def effective_depth(self) -> int:
        return self.n_pre + self.n_rec * self.recurrence_steps + self.n_coda

    @property
    def heavy_tail_mean(self) -> float:
        """r̄ of the heavy_tail draw: depth_mean, or R when it is not set."""
        return float(self.recurrence_steps if self.depth_mean is None else self.depth_mean)


def rgpt_shape_from_dense(dense_layers: int, iso: str, steps: int) -> dict[str, int]:
    """Split a dense model's depth into (n_pre, n_rec, n_coda) for an isoFLOPs or isoparams RGPT.

    iso="flops": the effective depth n_pre + n_rec * R + n_coda equals the dense depth (fewer
    parameters, about the same compute); iso="params": the distinct blocks n_pre + n_rec + n_coda
    equal the dense depth (about the same parameters, more compute).
    """
    _require(iso in ("flops", "params"), f"iso must be 'flops' or 'params', got {iso!r}")
    _require(dense_layers >= 1 and steps >= 1, "dense depth and steps must be >= 1")
    edge = 1 if dense_layers >= 3 else 0
    if iso == "params":
        return dict(n_pre=edge, n_rec=dense_layers - 2 * edge, n_coda=edge, recurrence_steps=steps)
    n_rec = max(1, (dense_layers - 2 * edge) // steps)
    leftover = max(0, dense_layers - 2 * edge - n_rec * steps)  # depth the core cannot fill evenly
    return dict(n_pre=edge + leftover // 2, n_rec=n_rec, n_coda=edge + leftover - leftover // 2,
                recurrence_steps=steps)


def config_classes() -> dict[str, type[ModelConfig]]:
    """Every model config class by its `arch` name: ModelConfig and its subclasses (an
    architecture's spec in `latentloop.archs` names the same class)."""
    found, pending = {}, [ModelConfig]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.arch, cls)
        pending.extend(cls.__subclasses__())
    return found


# Presets: shapes only; they apply to every architecture. Parameter counts are for the byte
# tokenizer (vocab 259) except gpt2/1b, which assume a GPT-2-sized BPE vocabulary.
PRESETS: dict[str, dict[str, Any]] = {
    "test": dict(n_layer=2, n_embd=64, n_head=4, sequence_len=64),  # ~0.1M params, unit tests
    "tiny": dict(n_layer=4, n_embd=128, n_head=4, sequence_len=256),  # ~0.8M, CPU demo
    "small": dict(n_layer=6, n_embd=384, n_head=6, sequence_len=512),  # ~10.7M
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, sequence_len=1024, vocab_size=50304,
                 tie_embeddings=True),  # ~124M
    "1b": dict(n_layer=18, n_embd=2048, n_head=16, n_kv_head=8, sequence_len=2048,
               vocab_size=50304, tie_embeddings=True),  # ~0.85B with GQA, a single-GPU run
}


def model_config(arch: str = "gpt", preset: str | None = None, **overrides: Any) -> ModelConfig:
    """Build a validated model config from an arch name, an optional preset and field overrides."""
    classes = config_classes()
    if arch not in classes:
        raise ConfigError(f"unknown arch {arch!r}: choose from {', '.join(sorted(classes))}")
    values: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
        values.update(PRESETS[preset])
    values.update(overrides)
    return _construct(classes[arch], values, f"{arch} model")


# --------------------------------------------------------------------------------------------
# Training and data configs
# --------------------------------------------------------------------------------------------


# Training stages: pretraining from scratch, supervised fine-tuning on conversations, and
# long-context extension; sft and extend start from another run (`setup(init_from=...)`).
STAGES = ("pretrain", "sft", "extend")


def extended_rope_theta(theta: float, head_dim: int, old_len: int, new_len: int) -> float:
    """RoPE base for a context stretched from `old_len` to `new_len` ("NTK-aware" base scaling):
    theta * s^(d / (d - 2)) with s = new_len / old_len, d = head_dim. The slowest rotary pair then
    turns at the new length by exactly the angle it reached at the old one (it is interpolated, so
    no position looks farther away than training ever showed), while the fastest pair keeps its
    frequency (local word order stays as sharp as before). Positions stay integers, so the cached
    and uncached paths stay the same code and stay exact."""
    scale = new_len / old_len
    if scale <= 1:
        return theta
    exponent = head_dim / (head_dim - 2) if head_dim > 2 else 1.0  # one rotary pair: plain base scaling
    return theta * scale ** exponent


# Seeds feed torch.manual_seed, which takes a signed 64-bit integer (larger ones overflow inside torch).
SEED_LIMIT = 2**63
# How training spreads over processes (one per GPU, launched by torchrun): none (one process), ddp
# (replicated model, all-reduced gradients) or fsdp2 (parameters, gradients and optimizer states
# sharded per block with torch.distributed.fsdp.fully_shard). auto, the default, is what nanoGPT,
# nanochat and torchtitan do: ddp when torchrun started more than one process, else none; training
# resolves it when it starts (runtime.resolve_strategy) and records the strategy it ran.
STRATEGIES = ("auto", "none", "ddp", "fsdp2")


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    optimizer: str = "adamw"  # "adamw" or "muon" (Muon for matrices, AdamW for the rest)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    warmup_steps: int = 20
    schedule: str = "cosine"  # "cosine" or "wsd" (warmup-stable-decay)
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    muon_lr: float = 0.02
    grad_clip: float = 1.0  # 0 disables
    seed: int = 1337
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 8
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2  # checkpoints kept on disk
    log_every: int = 10
    compile: bool = False
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", "mps"
    dtype: str = "auto"  # autocast dtype: "auto" (bf16 on cuda, fp32 on cpu), "float32", "bfloat16"
    stage: str = "pretrain"  # see STAGES: sft trains on chat data with the assistant-only loss
    strategy: str = "auto"  # auto | none | ddp | fsdp2 (see STRATEGIES); launch with torchrun for more than one process
    activation_checkpointing: bool = False  # recompute each block's activations in the backward (less memory)
    keep_freed_memory: bool = True  # on CPU with glibc: freed tensors' memory stays in the process (runtime.py)
    full_weights: bool = True  # fsdp2: every checkpoint also gets model.safetensors, gathered on rank 0's CPU

    def __post_init__(self) -> None:
        _require(self.stage in STAGES, f"stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        self.betas = tuple(float(b) for b in self.betas)
        _require_finite(self)
        _require(isinstance(self.seed, int) and 0 <= self.seed < SEED_LIMIT,
                 f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("steps", "batch_size", "grad_accum", "log_every"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every", "eval_batches"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _require(self.keep_last >= 1, f"keep_last must be >= 1, got {self.keep_last}")
        _require(self.optimizer in ("adamw", "muon"), f"optimizer must be 'adamw' or 'muon', got {self.optimizer!r}")
        _require(self.schedule in ("cosine", "wsd"), f"schedule must be 'cosine' or 'wsd', got {self.schedule!r}")
        _require(self.lr > 0 and self.muon_lr > 0, "lr and muon_lr must be > 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _require(0.0 < self.decay_fraction <= 1.0, f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        _require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 f"betas must be two values in [0, 1), got {self.betas}")
        _require(self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip}")
        _require(self.dtype in ("auto", "float32", "bfloat16"),
                 f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        _require(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"),
                 f"device must be auto, cpu, cuda[:N] or mps, got {self.device!r}")
        _require(self.strategy in STRATEGIES, f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | text:PATH | hf:NAME[:CONFIG] | task:NAME
    tokenizer: str = "byte"  # "byte" or a path to a tokenizer.json (see `latentloop tokenizer train`)
    val_fraction: float = 0.05
    max_bytes: int = 0  # cap on UTF-8 bytes read per split; 0 = no cap
    cache_dir: str = ""  # "" = $LATENTLOOP_CACHE or ~/.cache/latentloop

    def __post_init__(self) -> None:
        _require_finite(self)
        _require(bool(self.source), "data source must not be empty")
        _require(0.0 < self.val_fraction < 1.0, f"val_fraction must be in (0, 1), got {self.val_fraction}")
        _require(self.max_bytes >= 0, f"max_bytes must be >= 0, got {self.max_bytes}")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "train": dataclasses.asdict(self.train),
                "data": dataclasses.asdict(self.data)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        if not isinstance(raw, dict):
            raise ConfigError("a run config must be a mapping with sections model/train/data")
        unknown = set(raw) - {"model", "train", "data"}
        _require(not unknown, f"unknown config section(s): {', '.join(sorted(unknown))} (use model, train, data)")
        model_raw = dict(raw.get("model") or {})
        arch = model_raw.pop("arch", "gpt")
        preset = model_raw.pop("preset", None)
        return cls(model=model_config(arch, preset, **model_raw),
                   train=_construct(TrainConfig, dict(raw.get("train") or {}), "train"),
                   data=_construct(DataConfig, dict(raw.get("data") or {}), "data"))

    def save_json(self, path: str | Path) -> None:
        """Written atomically (and fsynced): a crash never leaves a half-written config behind."""

        write_json_atomic(Path(path), self.to_dict())


def _construct(cls: type, values: dict[str, Any], what: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {what} field(s): {', '.join(unknown)}")
    for f in fields(cls):  # reject wrong types early with a clear message (YAML/CLI give strings)
        if f.name in values:
            values[f.name] = _coerce(values[f.name], f.type, f"{what}.{f.name}")
    try:
        return cls(**values)
    except TypeError as exc:  # pragma: no cover - defensive: dataclass signature mismatch
        raise ConfigError(f"invalid {what} config: {exc}") from None


def _coerce(value: Any, type_name: Any, name: str) -> Any:
    """Convert YAML/CLI values to the annotated type (annotations are strings here)."""
    t = str(type_name)
    optional = "None" in t
    if value is None:
        _require(optional, f"{name} must not be null")
        return None
    try:
        if t.startswith("bool"):
            if isinstance(value, str):
                _require(value.lower() in ("true", "false", "1", "0", "yes", "no"),
                         f"{name} must be true or false, got {value!r}")
                return value.lower() in ("true", "1", "yes")
            _require(isinstance(value, (bool, int)), f"{name} must be true or false, got {value!r}")
            return bool(value)
        if t.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            _require(not isinstance(value, bool), f"{name} must be an integer, got {value!r}")
            return int(value)
        if t.startswith("float"):
            _require(not isinstance(value, bool), f"{name} must be a number, got {value!r}")
            number = float(value)
            _require(math.isfinite(number), f"{name} must be a finite number, got {value!r}")
            return number
        if t.startswith("tuple"):
            if isinstance(value, str):
                value = [v for v in value.strip("[]() ").split(",") if v.strip()]
            if isinstance(value, (int, float)):
                value = [value]
            cast = int if "int" in t else float
            items = tuple(cast(v) for v in value)
            _require(all(math.isfinite(v) for v in items), f"{name} must hold finite numbers, got {value!r}")
            return items
        if t.startswith("str"):
            _require(isinstance(value, (str, int, float)), f"{name} must be a string, got {value!r}")
            return str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"{name} has an invalid value {value!r} (expected {t})") from None
    return value


# --------------------------------------------------------------------------------------------
# YAML files and key=value overrides
# --------------------------------------------------------------------------------------------


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if raw is None:
        return {}
    _require(isinstance(raw, dict), f"config file {path} must hold a mapping with sections model/train/data")
    return raw


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key=value` strings (value parsed as YAML) to a raw run-config mapping."""
    raw = {section: dict(raw.get(section) or {}) for section in ("model", "train", "data")} | {
        k: v for k, v in raw.items() if k not in ("model", "train", "data")}
    arch = raw["model"].get("arch", "gpt")
    model_cls = config_classes().get(arch, ModelConfig)
    section_fields = {"model": {f.name for f in fields(model_cls)} | {"arch", "preset"},
                      "train": {f.name for f in fields(TrainConfig)},
                      "data": {f.name for f in fields(DataConfig)}}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        if "." in key:
            section, name = key.split(".", 1)
            _require(section in section_fields, f"unknown config section {section!r} in override {item!r}")
        else:
            owners = [s for s, names in section_fields.items() if key in names]
            _require(len(owners) >= 1, f"unknown config field {key!r} in override {item!r}")
            _require(len(owners) == 1, f"config field {key!r} is ambiguous: write {owners[0]}.{key}")
            section, name = owners[0], key
        _require(name in section_fields[section], f"unknown {section} field {name!r} in override {item!r}")
        raw[section][name] = value
    return raw
