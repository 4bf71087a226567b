"""rgpt's cache in the fast decode path's static mode (`latentloop.inference.fast`): its spec registers
`StaticRecurrentCache` for `RecurrentKVCache`, put before the static mode's own methods, so the
compiled step writes each core step's keys and values as the eager cache does."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...models.cache import KVCache


class StaticRecurrentCache:
    """The core steps' view and the full mode's "later steps" rule, for a frozen static cache."""

    def step_view(self, step: int, active: Tensor | None = None):
        view = super().step_view(step, active)
        return StaticCoreStepView(view.cache, view.step, view.active) if self.static else view

    def fill_later_steps(self, last_step: int) -> None:
        if not self.static:
            return super().fill_later_steps(last_step)
        if self.mode != "full":
            return
        first = self.first_core_slot
        for step in range(last_step + 1, self.max_steps + 1):
            for j in range(self.n_rec):
                src, dst = first + (last_step - 1) * self.n_rec + j, first + (step - 1) * self.n_rec + j
                self._write(self.k_slots[dst], self.v_slots[dst], *self.read(src))


@dataclass
class StaticCoreStepView:
    """rgpt's `CoreStepView` for a frozen static cache (fixed depth: every row recurs, so no
    `active` rows to keep): `mean` mode's running mean reads this token's entry at the tensor
    write position instead of a Python slice."""

    cache: KVCache
    step: int
    active: Tensor | None = None

    def update(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.active is not None:
            raise ValueError("the static cache runs fixed-depth steps only (adaptive exit decodes eagerly)")
        if self.cache.mode == "mean" and self.step > 1:  # running mean over this token's steps
            k_old, v_old = self.cache.read(slot)
            k = k_old + (k - k_old) / self.step
            v = v_old + (v - v_old) / self.step
        return self.cache.update(slot, k, v)
