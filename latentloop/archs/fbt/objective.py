"""The full-bandwidth transformer's scheduled multi-pass objective.

    L = L_1 + λ/(K-1) Σ_{k=2..K} L_k        (L_k: next-token loss of pass k; no detach between passes)

- Schedule (the config's recipe, see `FBT_RECIPES`): steps before `feedback_start` train
  single-pass; after it each batch draws its pass count K from the per-batch mix (`pass_mix`, or the
  whole-run `run_mix` converted by `per_batch_mix`). Default recipe "short": feedback from step 0,
  50% K=2 / 50% K=3 with the deeper passes' loss weighted 1.5; recipe "paper": 75/22/3 over the
  whole run with feedback from 75% of it (88% K=2 / 12% K=3 from there on). The
  draw is seeded by (seed, step) so every data-parallel rank draws the same K, and a resumed run the
  same sequence. The rare deeper batches are what keeps the learned map contractive.
- Prefix mix-in: every fused pass (2..K) keeps, per packed document, a random plain prefix of
  p = 1 + floor(U · length) tokens, as a prompt is plain before generation starts. The prefix is
  drawn afresh for each pass (as the public reproduction does; the paper randomises "the prefix
  length where fused inputs start" without tying it across passes), so a deeper pass also sees
  positions fused whose predecessor was plain in the pass before.
- SFT (a `loss_mask` is given): the plain prefix ends where the assistant's turn begins, as at
  inference, where the conversation up to `<|assistant|>` is the (plain) prompt and the assistant's
  tokens are generated (fused): exactly the assistant tokens are fused in every pass (`sft_fuse_mask`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from ...models.backbone import shift_right
from ...objectives.base import LossResult, Objective, token_cross_entropy


def document_prefix_mask(idx: Tensor, bos_id: int, generator: torch.Generator) -> Tensor:
    """(B, T) True where a position is past its document's random plain prefix.

    Documents start at BOS tokens (a row's first token starts a document too, possibly a cut one).
    Each document of length n keeps p = 1 + floor(U · n) plain positions, U ~ Uniform[0, 1).
    """
    B, T = idx.shape
    starts = idx == bos_id
    starts[:, 0] = True
    doc_id = starts.long().cumsum(dim=1) - 1  # (B, T) index of the document within its row
    columns = torch.arange(T, device=idx.device).expand(B, T)
    doc_start = torch.zeros(B, T, dtype=torch.long, device=idx.device).scatter_reduce(
        1, doc_id, columns, reduce="amin", include_self=False)  # first column of each document
    doc_len = torch.zeros(B, T, dtype=torch.long, device=idx.device).scatter_add(1, doc_id, torch.ones_like(columns))
    # one draw per (row, document), on the generator's device: a draw made on the host and copied to
    # a GPU would wait for the kernels queued before it
    u = torch.rand(B, T, generator=generator, device=generator.device).to(idx.device)
    prefix = 1 + (u * doc_len.float()).floor().long()  # (B, T) per document
    offset = columns - doc_start.gather(1, doc_id)
    return offset >= prefix.gather(1, doc_id)


def sft_fuse_mask(loss_mask: Tensor) -> Tensor:
    """(B, T) True where the input token is one the assistant wrote: target t-1 counts exactly when
    input t is an assistant token, so the fused positions are the loss mask shifted right by one."""
    return shift_right(loss_mask)


class MultiPassObjective(Objective):
    name = "fbt_multipass"

    # read from the train config on use, not cached: a caller may set the run's length after building
    # the objective (the demo sizes its runs by timing a few steps)
    @property
    def pass_mix(self) -> np.ndarray:
        return np.asarray(self.model_config.batch_mix(self.train_config.steps), dtype=np.float64)

    @property
    def start(self) -> float:
        return self.model_config.start_step(self.train_config.steps)

    def _rng(self, step: int, draw: int = 0) -> np.random.Generator:
        """The host's generator of step `step`'s batch `draw` (the first batch: the step's own seed,
        which a one-batch step has always drawn from)."""
        return np.random.default_rng([self.train_config.seed, step] + ([draw] if draw else []))

    def forward_options(self, step: int) -> dict:
        """Keyword arguments every forward of optimizer step `step` adds (none here; a variant whose
        stack takes its own per-step draw, such as a recurrent depth, returns it)."""
        return {}

    def passes_for_step(self, step: int) -> int:
        if step < self.start:
            return 1
        return 1 + int(self._rng(step).choice(len(self.pass_mix), p=self.pass_mix))

    def plan(self, step: int, x: Tensor, loss_mask: Tensor | None = None, draw: int = 0) -> dict:
        """The pass count K of step `step` (one for all its batches: one graph), the forward options it
        adds (a recurrent depth) and, for K > 1, the positions fused in each pass (`fuse_mask`: drawn
        here, on the host's generator, and passed to the compiled step as inputs), fresh for each of
        the step's batches (`draw`): with one seed per step every micro-batch and process drew the
        same prefixes row for row."""
        K = self.passes_for_step(step)
        plan = {"passes": K, "options": self.forward_options(step)}
        if K == 1:
            return plan
        masks = None
        not_bos = x != self.model_config.bos_id
        if loss_mask is not None:  # SFT: the assistant's tokens are fused, in every pass
            masks = sft_fuse_mask(loss_mask) & not_bos
        elif self.model_config.prefix_mixin:  # one fresh prefix per fused pass (passes 2..K)
            # on x's device (a CUDA generator's draws differ from the CPU's)
            generator = torch.Generator(device=x.device).manual_seed(int(self._rng(step, draw).integers(2**62)))
            masks = [document_prefix_mask(x, self.model_config.bos_id, generator) & not_bos for _ in range(K - 1)]
        return {**plan, "fuse_mask": masks}

    def loss(self, model: nn.Module, x: Tensor, y: Tensor, loss_mask: Tensor | None = None, passes: int = 1,
             options: dict | None = None, fuse_mask: Tensor | list[Tensor] | None = None) -> LossResult:
        K, extra = passes, options or {}
        if K == 1:
            return LossResult(token_cross_entropy(model(x, **extra).logits, y, mask=loss_mask), {"passes": 1, **extra})
        out = model(x, passes=K, fuse_mask=fuse_mask, return_passes=True, **extra)
        losses = [token_cross_entropy(logits, y, mask=loss_mask) for logits in out.pass_logits]
        loss = losses[0] + self.model_config.loss_lambda / (K - 1) * sum(losses[1:])
        return LossResult(loss, {"passes": K, **extra, "objective": loss.detach(),
                                 "loss_last_pass": losses[-1].detach()},
                          next_token_loss=losses[0].detach())  # pass 1 is the plain model

    def plain_share(self) -> float:
        """The fraction of the run's steps before feedback starts."""
        return min(1.0, self.start / max(1, self.train_config.steps))

    def expected_passes(self) -> float:
        deep = float(np.dot(np.arange(1, len(self.pass_mix) + 1), self.pass_mix))
        plain = self.plain_share()
        return plain + (1 - plain) * deep

    def forward_mix(self, step: int | None = None) -> list[tuple[float, dict]]:
        def forward(K: int) -> dict:
            return {"passes": K, "return_passes": K > 1}  # deeper batches read out every pass

        if step is not None:
            return [(1.0, forward(self.passes_for_step(step)))]
        plain = self.plain_share()
        return [(plain, forward(1))] + [((1 - plain) * float(p), forward(K))
                                        for K, p in enumerate(self.pass_mix, start=1) if p > 0]
