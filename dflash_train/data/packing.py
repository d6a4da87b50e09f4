"""The epoch plan of packed training (``data.packing``): which conversations share a row, per epoch.

Every epoch shuffles the conversations with ``rng([seed, epoch, attempt])``, packs them with
``first_fit_decreasing`` into rows of ``capacity`` tokens within windows of ``window``
conversations, and shuffles the rows. Rows are cut into batches of ``rows`` and the batches into
groups of ``world_size`` (one per rank, all the same shape).

The number of steps per epoch must not change between epochs (the schedule, resume and split
streaming assume it), but a different shuffle packs into a slightly different number of rows. So
epoch 0's row count fixes the capacity of every epoch; a later epoch whose pack needs more rows is
re-drawn with the next ``attempt`` (a pure function of seed and epoch as well) and, if none of
``MAX_ATTEMPTS`` fits, reuses epoch 0's rows in a fresh order. Unused capacity becomes filler
batches (all rows filler), never dropped data.
"""

from __future__ import annotations

import numpy as np

from dflash_train.data.batching import first_fit_decreasing

MAX_ATTEMPTS = 4


class PackingPlan:
    """Packed rows of every epoch for ``lengths`` (the kept conversations' token counts)."""

    def __init__(
        self, lengths: np.ndarray, *, seed: int, capacity: int, rows: int, window: int, world_size: int
    ) -> None:
        if lengths.max(initial=0) > capacity:
            raise ValueError(f"a conversation of {lengths.max()} tokens exceeds the packed row of {capacity}")
        self.lengths, self.seed, self.capacity = lengths, seed, capacity
        self.rows, self.window, self.world_size = rows, window, world_size
        self.base = self._draw(0, 0)
        self.num_batches = -(-len(self.base) // rows)  # epoch 0's; later epochs fit in as many steps
        self.steps_per_epoch = -(-self.num_batches // world_size)
        self.max_rows = self.steps_per_epoch * world_size * rows
        self._cache: dict[int, list[list[list[np.ndarray]]]] = {}

    def _draw(self, epoch: int, attempt: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch, attempt])
        order = rng.permutation(len(self.lengths))
        bins = first_fit_decreasing(self.lengths, order, self.capacity, self.window)
        return [bins[i] for i in rng.permutation(len(bins))]

    def packed_rows(self, epoch: int) -> list[np.ndarray]:
        """The rows of ``epoch``: arrays of conversation positions (into the kept rows)."""
        if epoch == 0:
            return self.base
        for attempt in range(MAX_ATTEMPTS):
            bins = self._draw(epoch, attempt)
            if len(bins) <= self.max_rows:
                return bins
        rng = np.random.default_rng([self.seed, epoch, MAX_ATTEMPTS])
        return [self.base[i] for i in rng.permutation(len(self.base))]

    def groups(self, epoch: int) -> list[list[list[np.ndarray]]]:
        """Step -> rank -> the packed rows of that rank's batch (an empty list is a filler batch)."""
        if epoch not in self._cache:
            bins = self.packed_rows(epoch)
            batches = [bins[i : i + self.rows] for i in range(0, len(bins), self.rows)]
            batches += [[]] * (self.steps_per_epoch * self.world_size - len(batches))
            ws = self.world_size
            self._cache = {epoch: [batches[i : i + ws] for i in range(0, len(batches), ws)]}
        return self._cache[epoch]

    def padding_waste(self, real_tokens: int) -> float:
        """Fraction of the batch tokens of an epoch that are padding (tails, filler rows/batches)."""
        total = self.max_rows * self.capacity
        return 1.0 - real_tokens / total if total else 0.0

    def conversations_per_row(self) -> float:
        """Mean conversations per packed row of epoch 0."""
        return len(self.lengths) / max(len(self.base), 1)
