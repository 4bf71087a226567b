"""Latent Recurrent Transformer (arch `lrt`; Huang et al., "Latent Recurrent Transformer", 2026).

The previous token's hidden state at a source layer is the current token's recurrent memory
m_{t-1} (zeros at position 0 and at BOS). It enters every injected block two ways:

    residual:     x <- α_l · x + γ_l · m_{t-1}                  (α = 1, γ = 0.1 at init)
    keys/values:  k_fb = W_k m,  v_fb = W_v m,  (g_loc, g_fb) = 2σ(W_g · norm(x))  per head
                  k <- g_loc · k + g_fb · k_fb,   v <- g_loc · v + g_fb · v_fb   (before RoPE/QK-norm)

W_g starts at zero, so every gate starts at 1. W_k, W_v are shared by all layers (`shared`) or
per layer (`layerwise`). The cache keeps its standard shape; the memory rides in
`cache.state["lrt.memory"]`.

Notable features:
- source state: the normed output of block `source_layer` (default: an upper-middle block, the
  paper's best), or the top state after the final norm (`source_layer=-1`, the authors' released
  code; with learned norm gains, the final norm's gain included: exactly what the head reads)
- released-code options: the gate reads only the first `kv_gate_channels` channels of norm(x);
  `value_embeds` adds a per-layer token value embedding to the values through a third gate
- recurrence procedures over a whole sequence (`forward(idx, recurrence=...)`), which the objective
  turns into losses: `sequential` (exact token-by-token reference), `interleaved` (an init pass with
  zero memory fills a buffer of every layer's keys/values and source states; then each stride subset
  {t : t mod S = i} is recomputed in turn against the latest buffer and written back), `chunked`
  (memory crosses chunk boundaries only) and `multi_refine` (K full passes)
- inference: one ordinary forward per token (`step`, plugged into the backbone's token loop); the
  prompt prefill is exact (token by token through the cache) by default, or
  `prefill="interleaved"` (parallel, approximate)
- a BOS inside a sequence restarts the recurrence: its memory is zero, as at position 0

Parameters: the shared W_k, W_v (2 · d · kv_dim), the gates (d · 2 n_kv_head per block, or
`kv_gate_channels` · 2 n_kv_head) and two scalars per block: 0.79% of gpt's total at nanochat d20
(d 1280, 20 layers, vocabulary 32,768), 0.72% at d24, 0.69% and 0.61% with the released code's
32-channel gate. The paper's "about 0.3%" counts against nanochat's total with its value-embedding
tables (about half of it at that vocabulary), which our backbone does not have: the shared
projection with the 32-channel gate reads as 0.34-0.37% of that total. (The released code is a
heavier variant, per-layer projections and every-layer value embeddings: `layerwise` and
`value_embeds` here.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ...config import ModelConfig, require
from ...errors import ConfigError
from ...models.backbone import GPT, Attention, Block, ForwardContext, ModelOutput, last_column, norm, shift_right
from ...models.cache import KVBuffer, KVCache, plan_attention
from ...models.options import DecodeOption

# -- config ----------------------------------------------------------------------------------------

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
    # multi_refine: full passes, each using the previous pass's states, the first (zero memory) counted:
    # the official code's K counts the refinements after that pass, so its K is refine_passes - 1
    refine_passes: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source_layer is None:
            self.source_layer = upper_middle_layer(self.n_layer)
        require(-1 <= self.source_layer < self.n_layer,
                 f"source_layer must be -1 (top) or a block index below n_layer ({self.n_layer}), "
                 f"got {self.source_layer}")
        require(all(0 <= i < self.n_layer for i in self.inject_layers),
                 f"inject_layers must be block indices below n_layer ({self.n_layer}), got {list(self.inject_layers)}")
        require(self.injection in ("kv", "residual", "both"),
                 f"injection must be 'kv', 'residual' or 'both', got {self.injection!r}")
        require(self.kv_projection in ("shared", "layerwise"),
                 f"kv_projection must be 'shared' or 'layerwise', got {self.kv_projection!r}")
        require(self.residual_lr >= 0, f"residual_lr must be >= 0 (0: the run's lr), got {self.residual_lr}")
        require(0 <= self.kv_gate_channels <= self.n_embd,
                 f"kv_gate_channels must be in [0, n_embd={self.n_embd}] (0: all), got {self.kv_gate_channels}")
        require(not self.value_embeds or self.injection in ("kv", "both"),
                 "value_embeds enter through the keys/values gate: it needs injection 'kv' or 'both'")
        require(self.recurrence in LRT_RECURRENCES,
                 f"recurrence must be one of {', '.join(LRT_RECURRENCES)}, got {self.recurrence!r}")
        require(self.subsets >= 1, f"subsets must be >= 1, got {self.subsets}")
        require(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        require(self.refine_passes >= 1, f"refine_passes must be >= 1, got {self.refine_passes}")

    def injects(self, layer_idx: int) -> bool:
        return not self.inject_layers or layer_idx in self.inject_layers

    # the front-ends' questions (see ModelConfig): upcycled, the residual memory enters with weight 0,
    # so step 0 is the base model
    upcycle_defaults: ClassVar[dict[str, Any]] = {"residual_gamma_init": 0.0}


MEMORY_KEY = "lrt.memory"
BUFFERED_RECURRENCES = ("interleaved", "chunked")  # training passes that share one key/value buffer
UNPADDED_RECURRENCES = ("chunked", "multi_refine")  # cut by column: left-padded rows would differ from alone
PREFILLS = ("sequential", "interleaved")
RESIDUAL_ALPHA_INIT = 1.0

OPTIONS = (
    DecodeOption("prefill", str, "sequential", "prompt prefill: sequential (exact, token by token) or interleaved "
                 "(parallel, approximate; needs the cache)", choices=PREFILLS,
                 needs_cache=lambda value: value == "interleaved"),
)


@dataclass
class LRTContext(ForwardContext):
    memory: Tensor | None = None  # (B, T, D) m_{t-1} for each position
    memory_kv: Tensor | None = None  # shared [W_k m, W_v m] as (B, T, 2 Hkv hd)
    idx: Tensor | None = None  # (B, T) the tokens of this pass, for the value embeddings


@dataclass
class LRTOutput(ModelOutput):
    source: Tensor | None = None  # (B, T, D) source states (the next positions' memory)
    pass_logits: list[Tensor] = field(default_factory=list)  # logits of each pass / subset
    pass_columns: list[Tensor] = field(default_factory=list)  # the columns each of those covers


class LRTAttention(Attention):
    def __init__(self, config: LRTConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.inject = config.injects(layer_idx) and config.injection in ("kv", "both")
        self.layerwise = config.kv_projection == "layerwise"
        self.gate_channels = config.kv_gate_channels or config.n_embd
        self.value_embeds = self.inject and config.value_embeds
        if self.inject:  # (g_loc, g_fb[, g_ve]) per kv head
            gates = 3 if self.value_embeds else 2
            self.c_gate = nn.Linear(self.gate_channels, gates * self.n_kv_head, bias=False)
            if self.value_embeds:  # zeros: at init the option changes nothing
                self.value_embed = nn.Embedding(config.vocab_size, self.n_kv_head * self.head_dim)
                nn.init.zeros_(self.value_embed.weight)
            if self.layerwise:
                self.c_mem_kv = nn.Linear(config.n_embd, 2 * self.n_kv_head * self.head_dim, bias=False)

    def project_qkv(self, x: Tensor, ctx: LRTContext) -> tuple[Tensor, Tensor, Tensor]:
        q, kv = self.project_q_kv(x)  # kv (B, T, 2 Hkv, hd): keys and values are gated in one go
        if not self.inject:
            return q, *kv.chunk(2, dim=2)
        B, T, _ = x.shape
        kv_fb = ctx.memory_kv if not self.layerwise else self.c_mem_kv(ctx.memory)
        H, hd = self.n_kv_head, self.head_dim
        gates = (2 * torch.sigmoid(self.c_gate(x[..., :self.gate_channels]))).view(B, T, -1, 1, H, 1)
        g_loc, g_fb = gates[:, :, 0], gates[:, :, 1]  # (B, T, 1, Hkv, 1)
        # (B, T, 2, Hkv, hd): keys and values side by side, so one gate per head broadcasts over both
        kv = torch.addcmul(kv.view(B, T, 2, H, hd) * g_loc, g_fb, kv_fb.view(B, T, 2, H, hd))
        k, v = kv.view(B, T, 2 * H, hd).chunk(2, dim=2)
        if self.value_embeds:  # the third gate: the token's own value embedding, values only
            v = torch.addcmul(v, gates[:, :, 2, 0], self.value_embed(ctx.idx).view(B, T, H, hd))
        return q, k, v


class LRTBlock(Block):
    attention_class = LRTAttention

    def __init__(self, config: LRTConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.inject = config.injects(layer_idx) and config.injection in ("residual", "both")
        if self.inject:
            self.mem_alpha = nn.Parameter(torch.full((1,), RESIDUAL_ALPHA_INIT))
            self.mem_gamma = nn.Parameter(torch.full((1,), config.residual_gamma_init))

    def forward(self, x: Tensor, ctx: LRTContext) -> Tensor:
        if self.inject:
            x = torch.addcmul(self.mem_alpha * x, self.mem_gamma, ctx.memory)
        return super().forward(x, ctx)


class LRT(GPT):
    OPTIONS = OPTIONS
    CARRIED_STATE = (MEMORY_KEY,)
    # train.compile: the whole interleaved forward, one graph (a buffer built without a pad mask
    # plans its full pass without reading its positions), measured 1.18x the tok/s of compiling each
    # block under Muon + bf16 (experiments/logs/2026-12-03-compile-scope-defaults.md)
    COMPILES_WHOLE = True

    def __init__(self, config: LRTConfig):
        super().__init__(config)
        uses_kv = config.injection in ("kv", "both")
        self.mem_kv = None
        if uses_kv and config.kv_projection == "shared":  # W_k and W_v, applied once per token
            self.mem_kv = nn.Linear(config.n_embd, 2 * config.n_kv_head * config.head_dim, bias=False)
            nn.init.normal_(self.mem_kv.weight, std=config.n_embd ** -0.5)
        for block in self.blocks:
            if block.attn.inject:
                nn.init.zeros_(block.attn.c_gate.weight)  # every gate starts at 2σ(0) = 1

    def make_block(self, layer_idx: int) -> nn.Module:
        return LRTBlock(self.config, layer_idx)

    # -- one pass over some columns, given their memory ---------------------------------------
    def zero_memory(self, batch: int, columns: int) -> Tensor:
        return self.wte.weight.new_zeros(batch, columns, self.config.n_embd)  # (B, T, D)

    def _stitch(self, hidden: list[Tensor], sources: list[Tensor]) -> LRTOutput:
        """One output from passes over consecutive columns (chunks, or tokens stepped one by one)."""
        h = hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=1)
        source = sources[0] if len(sources) == 1 else torch.cat(sources, dim=1)
        # with the top state as source, it is the normed top state: the head can reuse it
        logits = self.head(source) if self.config.source_layer < 0 else self.readout(h)
        return LRTOutput(logits=logits, hidden=h, source=source)

    def memory_for(self, idx: Tensor, positions: Tensor, previous_source: Tensor) -> Tensor:
        """m_{t-1} for each column: the previous column's source state, zeros at position 0 / BOS."""
        restart = (positions == 0) | (idx == self.config.bos_id)  # (B, T)
        return previous_source.masked_fill(restart[..., None], 0.0)

    def run_pass(self, idx: Tensor, ctx: ForwardContext, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Blocks over idx with the given memory; returns top states and source states (B, T, D)."""
        # shared [W_k m, W_v m] (B, T, 2 Hkv hd), viewed per head by each layer
        memory_kv = self.mem_kv(memory) if self.mem_kv is not None else None
        lctx = LRTContext(**vars(ctx), memory=memory, memory_kv=memory_kv, idx=idx)
        # the source block's output is read here, not written into the context by the block: a
        # wrapped block (FSDP2, activation checkpointing, compile) may see a copy of its arguments
        source_layer = self.config.source_layer
        h = self.run_blocks(self.embed(idx), lctx, self.blocks[:source_layer + 1]) if source_layer >= 0 else None
        source = norm(h) if h is not None else None
        h = self.run_blocks(self.embed(idx) if h is None else h, lctx, self.blocks[source_layer + 1:])
        return h, (self.ln_f(h) if source_layer < 0 else source)

    # -- recurrence procedures over a whole sequence ---------------------------------------
    def forward(self, idx: Tensor, pad_mask: Tensor | None = None, recurrence: str | None = None,
                subsets: int | None = None) -> LRTOutput:
        """The whole sequence under `recurrence` (default: the configured training one). Left-padded
        rows (`pad_mask`) give the logits each gives alone under sequential and interleaved; chunked
        and multi_refine, baselines that cut the sequence by column, refuse them."""
        recurrence = recurrence or self.config.recurrence
        if pad_mask is not None and recurrence in UNPADDED_RECURRENCES:
            raise ValueError(f"recurrence {recurrence!r} takes no pad_mask: its passes cut the sequence by "
                             f"column, not by position (use 'sequential' or 'interleaved' for left-padded rows)")
        if recurrence == "sequential":
            return self.sequential(idx, pad_mask)
        if recurrence == "interleaved":
            return self._interleaved_by_padding(idx, subsets or self.config.subsets, pad_mask)
        if recurrence == "chunked":
            return self.chunked(idx, self.config.chunk_size)
        if recurrence == "multi_refine":
            return self.multi_refine(idx, self.config.refine_passes)
        raise ConfigError(f"unknown recurrence {recurrence!r}")

    def sequential(self, idx: Tensor, pad_mask: Tensor | None = None) -> LRTOutput:
        """The exact recurrence, naively: T passes over growing prefixes, no cache (a reference)."""
        T = idx.shape[1]
        ctx = self.context(idx, None, pad_mask)
        positions = ctx.plan.positions.expand(idx.shape[0], T)
        sources: list[Tensor] = []
        pad_column = self.zero_memory(idx.shape[0], 1)
        for t in range(T):
            prefix_mask = None if pad_mask is None else pad_mask[:, :t + 1]
            previous = shift_right(torch.cat(sources + [pad_column], dim=1))  # (B, t + 1, D)
            memory = self.memory_for(idx[:, :t + 1], positions[:, :t + 1], previous)
            h, source = self.run_pass(idx[:, :t + 1], self.context(idx[:, :t + 1], None, prefix_mask), memory)
            sources.append(source[:, t:t + 1])
        return LRTOutput(logits=self.readout(h), hidden=h, source=source)

    def _buffer(self, idx: Tensor, pad_mask: Tensor | None) -> KVBuffer:
        plan = plan_attention(pad_mask, idx.shape[1], idx.device)
        key_pos = plan.positions if pad_mask is None else plan.positions.masked_fill(~pad_mask, -1)
        return KVBuffer(self.cache_slots(), key_pos, padded=pad_mask is not None)

    def _buffered_pass(self, idx: Tensor, buffer: KVBuffer, columns: Tensor, memory: Tensor,
                       key: tuple | None = None) -> tuple[Tensor, Tensor]:
        """Blocks over the columns `columns` (described on the host by `key`, which keys their kept
        flex mask) with the given memory, through the buffer."""
        ctx = self.context_from_plan(buffer.begin_columns(columns, key), buffer.writer(columns))
        return self.run_pass(idx[:, columns], ctx, memory)

    def interleaved(self, idx: Tensor, subsets: int, pad_mask: Tensor | None = None,
                    pad_shift: int = 0) -> tuple[LRTOutput, KVBuffer]:
        """Init pass with zero memory, then each stride subset {t : position t mod S = i} refined in
        turn against the latest buffer. Rows left-padded by p columns (p mod S = `pad_shift` for
        every row) have position = column - p, so subset i is the columns = i + p mod S."""
        B, T = idx.shape
        buffer = self._buffer(idx, pad_mask)
        positions = buffer.key_pos.clamp(min=0).expand(B, T)
        everything = torch.arange(T, device=idx.device)
        hidden, source = self._buffered_pass(idx, buffer, everything, self.zero_memory(B, T))
        logits = self.readout(hidden)
        pass_logits, pass_columns = [logits], [everything]
        # the merged estimates are locals until the end, never an output's attributes rewritten pass by
        # pass: a compiled graph lost those writes once a flex_attention call had run (models/flex.py)
        for i in range(min(subsets, T)):
            first = (i + pad_shift) % subsets
            columns = everything[first::subsets]
            memory = self.memory_for(idx, positions, shift_right(source))[:, columns]
            h_sub, source_sub = self._buffered_pass(idx, buffer, columns, memory, ("stride", first, subsets))
            logits_sub = self.readout(h_sub)
            source = source.index_copy(1, columns, source_sub)
            hidden = hidden.index_copy(1, columns, h_sub)
            logits = logits.index_copy(1, columns, logits_sub)  # the merged estimate
            pass_logits.append(logits_sub)
            pass_columns.append(columns)
        return LRTOutput(logits=logits, hidden=hidden, source=source, pass_logits=pass_logits,
                         pass_columns=pass_columns), buffer

    def chunked(self, idx: Tensor, chunk_size: int) -> LRTOutput:
        """Chunks in order; inside a chunk the memory is zero except at its first token, which
        gets the previous chunk's last source state (the paper's weaker baseline)."""
        B, T = idx.shape
        buffer = self._buffer(idx, None)
        positions = buffer.key_pos.expand(B, T)
        hidden, sources = [], []
        for start in range(0, T, chunk_size):
            columns = torch.arange(start, min(T, start + chunk_size), device=idx.device)
            memory = self.zero_memory(B, len(columns))
            if start > 0:
                carried = torch.cat([sources[-1][:, -1:], memory[:, 1:]], dim=1)
                memory = self.memory_for(idx[:, columns], positions[:, columns], carried)
            h, source = self._buffered_pass(idx, buffer, columns, memory, ("range", start, start + len(columns)))
            hidden.append(h)
            sources.append(source)
        return self._stitch(hidden, sources)

    def multi_refine(self, idx: Tensor, passes: int) -> LRTOutput:
        """K full passes; pass k's memory is pass k-1's source states (pass 1: zeros)."""
        ctx = self.context(idx, None, None)
        positions = ctx.plan.positions.expand(idx.shape)
        source = self.zero_memory(*idx.shape)
        all_logits = []
        for k in range(passes):
            memory = self.memory_for(idx, positions, shift_right(source)) if k else source
            h, source = self.run_pass(idx, ctx, memory)
            all_logits.append(self.readout(h))
        return LRTOutput(logits=all_logits[-1], hidden=h, source=source, pass_logits=all_logits)

    # -- decoding protocol ----------------------------------------------------------------
    def step(self, token: Tensor, cache: KVCache, pad_mask: Tensor | None = None) -> LRTOutput:
        """One token (B, 1) through the cache, with the memory its predecessor left there."""
        ctx = self.context(token, cache, pad_mask)
        previous = cache.state.get(MEMORY_KEY)
        if previous is None:
            previous = self.zero_memory(token.shape[0], 1)
        h, source = self.run_pass(token, ctx, self.memory_for(token, ctx.plan.positions, previous))
        cache.advance()
        if pad_mask is None:
            cache.state[MEMORY_KEY] = source
        else:  # a padding step leaves the memory as it was
            cache.state[MEMORY_KEY] = torch.where(pad_mask[..., None], source, previous)
        return self._stitch([h], [source])

    def prefill(self, idx: Tensor, cache: KVCache, pad_mask: Tensor | None = None,
                prefill: str = "sequential", last_logits: bool = False) -> ModelOutput:
        """Each token's logits come from its own pass (sequential: one token at a time; interleaved:
        the last subset that refined it), so `last_logits` keeps the last column's and saves none of
        the head's work."""
        out = (self._interleaved_prefill(idx, cache, pad_mask) if prefill == "interleaved"
               else self.step_tokens(idx, cache, self.step, pad_mask))
        if last_logits:
            out.logits = last_column(out.logits)
        return out

    def decode(self, idx: Tensor, cache: KVCache, prefill: str = "sequential") -> ModelOutput:
        return self.step_tokens(idx, cache, self.step)

    def reference(self, idx: Tensor, pad_mask: Tensor | None = None, prompt_len: int = 0,
                  prefill: str = "sequential") -> LRTOutput:
        return self.sequential(idx, pad_mask)  # the engine refuses prefill="interleaved" without a cache

    def _interleaved_prefill(self, idx: Tensor, cache: KVCache, pad_mask: Tensor | None) -> LRTOutput:
        """Parallel prefill into the cache, each row refined exactly as it would be alone."""
        cache.begin(idx.shape[1], pad_mask)
        out = self._interleaved_by_padding(idx, self.config.subsets, pad_mask, cache)
        cache.advance()
        cache.state[MEMORY_KEY] = out.source[:, -1:]
        return LRTOutput(logits=out.logits, hidden=out.hidden, source=out.source)  # not each pass's (B, T, V)

    def _interleaved_by_padding(self, idx: Tensor, subsets: int, pad_mask: Tensor | None,
                                cache: KVCache | None = None) -> LRTOutput:
        """`interleaved` over the rows grouped by their padding mod S (a subset is a set of positions,
        and a row padded by p has position = column - p), so each row is refined exactly as it would
        be alone; with `cache`, each group's buffer written into its rows. Without padding, the pass's
        whole output (training's per-pass logits included); with it, the merged logits, hidden states
        and sources only, however many groups the padding made."""
        B = idx.shape[0]
        if pad_mask is None:
            out, buffer = self.interleaved(idx, subsets)
            if cache is not None:
                buffer.write_rows(cache, torch.arange(B, device=idx.device))
            return out
        shift_of_row = (~pad_mask).sum(1) % subsets  # (B,)
        merged = None
        for shift in sorted(set(shift_of_row.tolist())):
            rows = (shift_of_row == shift).nonzero().squeeze(1)
            out, buffer = self.interleaved(idx[rows], subsets, pad_mask[rows], shift)
            if cache is not None:
                buffer.write_rows(cache, rows)
            if merged is None:
                merged = [t.new_zeros(B, *t.shape[1:]) for t in (out.logits, out.hidden, out.source)]
            for whole, part in zip(merged, (out.logits, out.hidden, out.source)):
                whole[rows] = part
        logits, hidden, source = merged
        return LRTOutput(logits=logits, hidden=hidden, source=source)

    def recomputable_modules(self) -> list[nn.Module]:
        """The interleaved and chunked passes write one key/value buffer that later passes read and
        extend: attention recomputed in the backward would read the buffer as it is then, not as it
        was, so there only the MLPs are recomputed."""
        if self.config.recurrence in BUFFERED_RECURRENCES:
            return [block.mlp for block in self.blocks]
        return super().recomputable_modules()

    @torch.no_grad()
    def upcycle_from(self, weights: dict[str, Tensor], base_layers: int, load) -> dict:
        """Every pretrained tensor; the memory projections W_k, W_v start at zero (so the gated keys
        and values are g_loc · k = k, every gate being 2σ(0) = 1 at init) and the residual γ at
        `residual_gamma_init`, which upcycling sets to 0 (α = 1; LRTConfig.upcycle_defaults). Then
        every injected term vanishes and the logits equal the base model's exactly, in every
        recurrence and prefill; the gradients of W_k, W_v and γ are not zero, so the memory is
        learned from there."""
        fresh = load(weights)
        projections = [self.mem_kv] if self.mem_kv is not None else []
        projections += [b.attn.c_mem_kv for b in self.blocks if b.attn.inject and b.attn.layerwise]
        for linear in projections:
            nn.init.zeros_(linear.weight)  # W_k, W_v = 0: the memory adds nothing to keys and values yet
        gamma = self.config.residual_gamma_init
        return {"mapping": "same tensors; W_k = W_v = 0", "new": fresh,
                "exact_at_step0": "all recurrences" if gamma == 0 else f"no (residual_gamma_init={gamma})"}

    @classmethod
    def scoring_modes(cls, config: LRTConfig) -> dict[str, dict]:
        """sequential: exact memory (stepped through a cache); interleaved: the merged parallel
        estimate used in training (each position's logits from its latest refinement)."""
        return {"sequential": {"prefill": "sequential"}, "interleaved": {"prefill": "interleaved"}}
