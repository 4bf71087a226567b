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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..config import LRTConfig
from ..errors import ConfigError
from .backbone import GPT, Attention, Block, ForwardContext, ModelOutput, norm, shift_right
from .cache import KVBuffer, KVCache, plan_attention
from .options import DecodeOption

MEMORY_KEY = "lrt.memory"
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
        lctx = LRTContext(**vars(ctx), memory=memory, idx=idx)
        if self.mem_kv is not None:
            lctx.memory_kv = self.mem_kv(memory)  # (B, T, 2 Hkv hd); viewed per head by each layer
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
        """The whole sequence under `recurrence` (default: the configured training one)."""
        recurrence = recurrence or self.config.recurrence
        if recurrence == "sequential":
            return self.sequential(idx, pad_mask)
        if recurrence == "interleaved":
            return self.interleaved(idx, subsets or self.config.subsets, pad_mask)[0]
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
        return KVBuffer(self.cache_slots(), key_pos)

    def _buffered_pass(self, idx: Tensor, buffer: KVBuffer, columns: Tensor, memory: Tensor) -> tuple[Tensor, Tensor]:
        ctx = self.context_from_plan(buffer.begin_columns(columns), buffer)
        h, source = self.run_pass(idx[:, columns], ctx, memory)
        buffer.advance()
        return h, source

    def interleaved(self, idx: Tensor, subsets: int, pad_mask: Tensor | None = None,
                    pad_shift: int = 0) -> tuple[LRTOutput, KVBuffer]:
        """Init pass with zero memory, then each stride subset {t : position t mod S = i} refined in
        turn against the latest buffer. Rows left-padded by p columns (p mod S = `pad_shift` for
        every row) have position = column - p, so subset i is the columns = i + p mod S."""
        B, T = idx.shape
        buffer = self._buffer(idx, pad_mask)
        positions = buffer.key_pos.clamp(min=0).expand(B, T)
        everything = torch.arange(T, device=idx.device)
        h, source = self._buffered_pass(idx, buffer, everything, self.zero_memory(B, T))
        logits = self.readout(h)
        out = LRTOutput(logits=logits, hidden=h, source=source, pass_logits=[logits], pass_columns=[everything])
        for i in range(min(subsets, T)):
            columns = everything[(i + pad_shift) % subsets::subsets]
            memory = self.memory_for(idx, positions, shift_right(out.source))[:, columns]
            h_sub, source_sub = self._buffered_pass(idx, buffer, columns, memory)
            logits_sub = self.readout(h_sub)
            out.source = out.source.index_copy(1, columns, source_sub)
            out.hidden = out.hidden.index_copy(1, columns, h_sub)
            out.logits = out.logits.index_copy(1, columns, logits_sub)  # the merged estimate
            out.pass_logits.append(logits_sub)
            out.pass_columns.append(columns)
        return out, buffer

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
            h, source = self._buffered_pass(idx, buffer, columns, memory)
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
                prefill: str = "sequential") -> ModelOutput:
        if prefill == "interleaved":
            return self._interleaved_prefill(idx, cache, pad_mask)
        return self.step_tokens(idx, cache, self.step, pad_mask)

    def decode(self, idx: Tensor, cache: KVCache, prefill: str = "sequential") -> ModelOutput:
        return self.step_tokens(idx, cache, self.step)

    def reference(self, idx: Tensor, pad_mask: Tensor | None = None, prompt_len: int = 0,
                  prefill: str = "sequential") -> LRTOutput:
        return self.sequential(idx, pad_mask)  # the engine refuses prefill="interleaved" without a cache

    def _interleaved_prefill(self, idx: Tensor, cache: KVCache, pad_mask: Tensor | None) -> LRTOutput:
        """Parallel prefill into the cache; rows are grouped by their padding mod S so that each row
        is refined exactly as it would be alone."""
        S, B = self.config.subsets, idx.shape[0]
        pad = torch.zeros(B, dtype=torch.long, device=idx.device) if pad_mask is None else (~pad_mask).sum(1)
        cache.begin(idx.shape[1], pad_mask)
        logits = hidden = source = None
        for shift in sorted(set((pad % S).tolist())):
            rows = ((pad % S) == shift).nonzero().squeeze(1)
            out, buffer = self.interleaved(idx[rows], S, None if pad_mask is None else pad_mask[rows], shift)
            buffer.write_rows(cache, rows)
            if logits is None:
                logits, hidden, source = (t.new_zeros(B, *t.shape[1:]) for t in (out.logits, out.hidden, out.source))
            logits[rows], hidden[rows], source[rows] = out.logits, out.hidden, out.source
        cache.advance()
        cache.state[MEMORY_KEY] = source[:, -1:]
        return LRTOutput(logits=logits, hidden=hidden, source=source)

    @classmethod
    def scoring_modes(cls, config: LRTConfig) -> dict[str, dict]:
        """sequential: exact memory (stepped through a cache); interleaved: the merged parallel
        estimate used in training (each position's logits from its latest refinement)."""
        return {"sequential": {"prefill": "sequential"}, "interleaved": {"prefill": "interleaved"}}
