"""Recurrent full-bandwidth transformer (arch `rfbt`): RecurrentGPT's depth with fbt's latent feedback.

latentloop's own fifth architecture; no paper or reference implementation has it. The two published
mechanisms widen the vertical channel along different axes: rgpt re-applies a shared core to one
token's state (depth), fbt feeds the previous position's top state into the next token's input
(time). They compose through one seam, the stack that one pass runs (`GPT.run_stack`):

    x_t   = norm(W_U s_{t-1} ⊙ σ(W_G e_t))                      (fbt's GLU fusion; plain at 0 and BOS)
    h_pre = prelude(x_t),   h^(r) = g ⊙ h^(r-1) + (1 - g) ⊙ core(W_proj [h^(r-1), h_pre]),  r = 1..R
    s_t   = ln_f(coda(h^(R)))                                     (the carried state: what the head reads)

Everything else is the parents' code, unchanged: fbt's passes, fusion, regimes and carried state
(`archs/fbt/model.py`), rgpt's prelude / gated core / coda, depth context and cache (`archs/rgpt/model.py`).

Notable features:
- training (`archs/rfbt/objective.py`): fbt's scheduled multi-pass objective (pass k fuses pass k-1's top
  states; a Jacobi iteration of the sequential recurrence, exact after T passes) with rgpt's depth
  drawn per optimizer step (`depth_sampling` uniform or heavy_tail), the same depth in every pass
- decoding: fbt's regimes (standard, soft, fused) at any depth `steps` (rgpt's early exit at a fixed
  depth, r above the trained R allowed); rgpt's cache (one slot per (step, core layer) in `full`
  mode, or a running `mean` / the `last` step), which also carries fbt's state
- exact as its parents: cached soft decoding == the multi-pass reference (the Jacobi fixed point at
  a fixed depth), cached == uncached at every depth, a ragged batch == each row alone
- self-speculative decoding (`draft_steps`, `draft_tokens`), rgpt's: exact in every regime; in the
  standard regime one full-depth pass verifies the drafts, in soft / fused each verified token needs
  its predecessor's full-depth state, so the verification steps token by token (no faster than
  plain decoding: the drafts are extra work there)
- not offered: rgpt's adaptive per-token exit (a token's exit step would also choose the state the
  next token is fused with; that coupling is not designed here, so the option is not declared)
- upcycling from a gpt run: rgpt's block mapping (prelude / core / coda from the pretrained blocks)
  plus fresh W_U, W_G; exact at step 0 with `regime=standard, steps=1` when rgpt's gate is
  saturated open
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ...models.backbone import ModelOutput
from ...models.cache import KVCache
from ..fbt.model import DEFAULT_FUSED_PASSES, FBT, STATE_KEY, FBTConfig, FBTOutput
from ..fbt.model import OPTIONS as FBT_OPTIONS
from ..rgpt.model import RGPT, RGPTConfig

# -- config ----------------------------------------------------------------------------------------


@dataclass
class RFBTConfig(FBTConfig, RGPTConfig):
    """fbt's knobs (fusion, jitter, the pass recipe) and rgpt's (prelude / core / coda split,
    recurrence steps R, gate, depth sampling), each validated by its parent."""

    arch: ClassVar[str] = "rfbt"


# rgpt's decoding options that apply: the depth, the cache layout and its draft (not its adaptive exit)
DEPTH_OPTIONS = tuple(option for option in RGPT.OPTIONS
                      if option.name in ("steps", "cache_mode", "draft_steps", "draft_tokens"))
OPTIONS = FBT_OPTIONS + DEPTH_OPTIONS


class RFBT(FBT, RGPT):
    """fbt's passes and decoding over rgpt's recurrent stack (the MRO puts FBT's methods first; the
    stack, its context and its cache come from RGPT)."""

    OPTIONS = OPTIONS
    # train.compile: the whole step, one graph per (passes, depth) drawn, compiled once each
    COMPILES_WHOLE = True

    def __init__(self, config: RFBTConfig):
        super().__init__(config)  # FBT, then RGPT, then the backbone

    # -- the whole sequence -------------------------------------------------------------------
    def forward(self, idx: Tensor, pad_mask: Tensor | None = None, passes: int = 1, fuse_from: int = 1,
                fuse_mask: Tensor | list[Tensor] | None = None, return_passes: bool = False,
                steps: int | None = None, no_grad_steps: int = 0) -> FBTOutput:
        """fbt's multi-pass forward; every pass runs the stack at depth `steps` (default: the
        trained R), its first `no_grad_steps` core steps without gradient (truncated backprop)."""
        out = super().forward(idx, pad_mask, passes, fuse_from, fuse_mask, return_passes,
                              steps=steps, no_grad_steps=no_grad_steps)
        out.info["steps"] = steps or self.config.recurrence_steps
        return out

    # -- decoding protocol: fbt's regimes at rgpt's depth -------------------------------------
    def prefill(self, idx: Tensor, cache: KVCache, pad_mask: Tensor | None = None, regime: str = "soft",
                passes: int | str = DEFAULT_FUSED_PASSES, steps: int | None = None,
                cache_mode: str = "full", draft_steps: int | None = None, draft_tokens: int | None = None,
                last_logits: bool = False, written: Tensor | None = None) -> FBTOutput:
        return super().prefill(idx, cache, pad_mask, regime, passes, last_logits, written, steps=steps)

    def decode(self, idx: Tensor, cache: KVCache, regime: str = "soft", passes: int | str = DEFAULT_FUSED_PASSES,
               steps: int | None = None, cache_mode: str = "full", draft_steps: int | None = None,
               draft_tokens: int | None = None) -> FBTOutput:
        return super().decode(idx, cache, regime, passes, steps=steps)

    def reference(self, idx: Tensor, pad_mask: Tensor | None = None, prompt_len: int = 0, regime: str = "soft",
                  passes: int | str = DEFAULT_FUSED_PASSES, steps: int | None = None,
                  cache_mode: str = "full", draft_steps: int | None = None,
                  draft_tokens: int | None = None, written: Tensor | None = None) -> FBTOutput:
        return super().reference(idx, pad_mask, prompt_len, regime, passes, written, steps=steps)

    def keep_verified(self, cache: KVCache, out: ModelOutput, kept: Tensor, state_before: dict[str, Tensor],
                      options: dict) -> None:
        """As rgpt, and fbt's carried state becomes the one the last kept token left (the state
        before the verification where a row keeps none). The standard regime carries none."""
        super().keep_verified(cache, out, kept, state_before, options)
        if options.get("regime", "soft") == "standard":
            return
        rows = torch.arange(kept.shape[0], device=kept.device)
        last = self.carried_state(out.hidden[rows, (kept - 1).clamp(min=0)][:, None])  # (B, 1, D)
        cache.state[STATE_KEY] = torch.where((kept > 0)[:, None, None], last, state_before[STATE_KEY])

    def upcycle_from(self, weights: dict[str, Tensor], base_layers: int, load) -> dict:
        """rgpt's mapping of the pretrained blocks (see `RGPT.upcycle_from`), then fbt's fresh
        fusion rescaled to the loaded embeddings. Standard decoding is rgpt's stack on plain
        inputs, so step 0 is exact where rgpt's is, in the standard regime."""
        report = RGPT.upcycle_from(self, weights, base_layers, load)
        self.reset_fuse_scale()
        if not report["exact_at_step0"].startswith("no"):
            report["exact_at_step0"] = f"regime=standard, {report['exact_at_step0']}"
        return report
