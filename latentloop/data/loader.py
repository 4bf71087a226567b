"""Batches from a flat token stream: a resumable shuffling loader for training and an ordered
one for validation.

The stream is cut into windows of `seq_len + 1` tokens that start at multiples of `seq_len`
(consecutive windows share one token, so every token except the first is a target exactly once
per epoch). The trailing tokens that do not fill a window are not used.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from latentloop.errors import ConfigError, DataError


def _window_count(tokens: np.ndarray, seq_len: int) -> int:
    """Number of full windows of seq_len+1 tokens; raises DataError when there are none."""
    if seq_len < 1:
        raise ConfigError(f"seq_len must be at least 1, got {seq_len}")
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"data has {len(tokens)} tokens; need at least seq_len+1 = {seq_len + 1}; lower seq_len or add data"
        )
    return (len(tokens) - 1) // seq_len


def _make_batch(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int):
    """(x, y) int64 tensors for the given windows; y is x shifted left by one token."""
    offsets = window_ids[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    windows = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))
    return windows[:, :-1], windows[:, 1:]


class TokenLoader:
    """Endless training batches drawn from `tokens`, exactly resumable via `state_dict`.

    Each epoch visits every window once, in the order `np.random.default_rng([seed, epoch])`
    gives (or in stream order when `shuffle` is False). A batch that does not fit in what is
    left of an epoch continues into the next one.

    Data-parallel sharding: with `world_size` W, each call takes the next W x batch_size windows of
    that one global order and returns rank `rank`'s consecutive slice of batch_size. Every rank's
    loader walks the same global position, so the saved state is the same on every rank, and W
    ranks see exactly the windows that one process sees in W micro-batches (rank r's batch is that
    process's r-th). Resuming with another W continues from the same window.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1):
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        if seed < 0:
            raise ConfigError(f"seed must be non-negative, got {seed}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in a world of {world_size} processes")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.num_windows = _window_count(tokens, seq_len)
        self.epoch = 0
        self.index = 0  # position within the current epoch's visiting order
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self.epoch])
                self._order = rng.permutation(self.num_windows)
            else:
                self._order = np.arange(self.num_windows)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y) pair of this rank, each an int64 tensor of shape (batch_size, seq_len)."""
        return _make_batch(self.tokens, self._next_windows(), self.seq_len)

    def _next_windows(self) -> np.ndarray:
        """This rank's window ids of the next round (the loader's position moves by the whole round)."""
        window_ids = []
        wanted = self.batch_size * self.world_size  # every rank's batch of this round
        while len(window_ids) < wanted:
            if self.index >= self.num_windows:
                self.epoch += 1
                self.index = 0
            order = self._epoch_order()
            take = min(wanted - len(window_ids), self.num_windows - self.index)
            window_ids.extend(order[self.index : self.index + take].tolist())
            self.index += take
        mine = window_ids[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return np.asarray(mine, dtype=np.int64)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """Position in the stream, as plain JSON-serialisable values."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "shuffle": self.shuffle,
            "num_windows": self.num_windows,
            "world_size": self.world_size,  # the position is global: any rank's state is every rank's
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; the following batches match the original run's.

        The seed and shuffle flag are taken from `state`. seq_len and the data must be the same
        (else the saved position would mean other windows); batch_size and world_size may differ,
        in which case the run continues from the same window onwards in larger or smaller steps.
        """
        if state["seq_len"] != self.seq_len:
            raise ConfigError(
                f"loader state was saved with seq_len={state['seq_len']}, but this loader has seq_len={self.seq_len}"
            )
        saved_windows = state.get("num_windows", self.num_windows)
        if saved_windows != self.num_windows:
            raise DataError(
                f"loader state was saved for data with {saved_windows} windows, "
                f"but this data has {self.num_windows}: the token data changed"
            )
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order_epoch = -1  # the order depends on seed and epoch: draw it again


def eval_window_ids(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None,
                    spread: bool = False) -> np.ndarray:
    """The windows `eval_batches` takes, in order (window i holds tokens[i * seq_len : (i + 1) * seq_len + 1]),
    `batch_size` per batch: where in the stream each validation row comes from."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    num_windows = _window_count(tokens, seq_len)
    num_batches = -(-num_windows // batch_size)
    if max_batches is not None:
        num_batches = min(num_batches, max(0, max_batches))
    taken = min(num_windows, num_batches * batch_size)
    if spread and taken < num_windows:
        return np.linspace(0, num_windows - 1, taken).round().astype(np.int64)
    return np.arange(taken, dtype=np.int64)


def eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None, spread: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive windows in stream order, for validation; the last batch may have fewer rows.
    With `spread` and a `max_batches` that leaves windows out, the windows taken are spaced evenly
    over the whole split instead of its first ones (so a sample covers every part of it, not the
    first few documents).

    Checks its arguments at call time (not on first iteration), so errors surface early.
    """
    order = eval_window_ids(tokens, batch_size, seq_len, max_batches, spread)

    def generate() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for first in range(0, len(order), batch_size):
            yield _make_batch(tokens, order[first:first + batch_size], seq_len)

    return generate()
