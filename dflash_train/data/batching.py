"""Fixed-shape micro-batches from length buckets.

A row goes to the smallest bucket ``L >= len(row)``. Every micro-batch of a bucket is
``[rows, L]`` with ``rows = token_budget // L`` (rounded down to ``batch_rows_multiple``), so
the whole run sees only ``len(seq_buckets)`` shapes: compiled kernels and CUDA graphs are reused
and the allocator does not churn. Rows are right-padded with the pad id; a bucket's last batch is
completed with filler rows (pad ids, all-false masks, ``sample_index = -1``) instead of shrinking.

Packing (``data.packing``) fills rows of the largest bucket with whole conversations instead
(``first_fit_decreasing``, ``assemble_packed_batch``): one shape for the whole run, per-conversation
position ids marking the boundaries that the target, the drafter's masks and the anchors respect.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

# Legend: R rows, L sequence (bucket length).


@dataclass
class Batch:
    """One fixed-shape micro-batch.

    input_ids [R, L] long (right-padded with the pad id), loss_mask [R, L] bool (response tokens),
    attention_mask [R, L] bool (real tokens), sample_index [R] long (global row index in the
    tokenized dataset, -1 for filler rows). ``epoch`` is the data epoch the batch belongs to (the
    anchor sampler needs it).

    Filler rows have an all-false attention mask: a causal target run with right padding does not
    need the mask at all (pad tokens come after every real token), which also avoids fully masked
    softmax rows.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    sample_index: torch.Tensor
    epoch: int = 0
    # Packed batches only (data.packing): position_ids [R, L] long restart at 0 at every
    # conversation (and at the padding tail); token_sample_index [R, L] long is the global row index
    # of the conversation each token belongs to (-1 for padding). None for bucketed batches.
    position_ids: torch.Tensor | None = None
    token_sample_index: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def pin(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def _map(self, fn) -> Batch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()})


def bucket_of(lengths: np.ndarray, seq_buckets: list[int]) -> np.ndarray:
    """Index of the smallest bucket >= each length (len(seq_buckets) for too-long rows)."""
    return np.searchsorted(np.asarray(seq_buckets), lengths, side="left")


def rows_per_batch(seq_buckets: list[int], token_budget: int, batch_rows_multiple: int = 1) -> list[int]:
    """Rows of every micro-batch per bucket: token_budget // L, a multiple of batch_rows_multiple."""
    rows = []
    for length in seq_buckets:
        fit = token_budget // length // batch_rows_multiple * batch_rows_multiple
        if fit < 1:
            raise ValueError(
                f"data.token_budget={token_budget} fits {token_budget // length} rows of bucket {length}, "
                f"but batches need a multiple of {batch_rows_multiple} rows; raise data.token_budget to at "
                f"least {length * batch_rows_multiple}."
            )
        rows.append(fit)
    return rows


def assemble_batch(
    rows: list[tuple[np.ndarray, np.ndarray]],
    sample_index: list[int],
    num_rows: int,
    length: int,
    pad_id: int,
) -> Batch:
    """Right-pad ``rows`` (ids, loss mask) to [num_rows, length]; missing rows become filler."""
    ids = np.full((num_rows, length), pad_id, dtype=np.int64)
    loss_mask = np.zeros((num_rows, length), dtype=bool)
    attention_mask = np.zeros((num_rows, length), dtype=bool)
    for r, (row_ids, row_mask) in enumerate(rows):
        n = min(len(row_ids), length)  # truncated rows are cut here (data.overlong=truncate)
        ids[r, :n] = row_ids[:n]
        loss_mask[r, :n] = row_mask[:n]
        attention_mask[r, :n] = True
    index = np.full(num_rows, -1, dtype=np.int64)
    index[: len(sample_index)] = sample_index
    return Batch(
        input_ids=torch.from_numpy(ids),
        loss_mask=torch.from_numpy(loss_mask),
        attention_mask=torch.from_numpy(attention_mask),
        sample_index=torch.from_numpy(index),
    )


def padding_waste(
    real_tokens: int, batches_per_bucket: list[int], rows: list[int], seq_buckets: list[int]
) -> float:
    """Fraction of batch tokens that are padding (pad columns, filler rows and filler batches)."""
    total = sum(n * r * length for n, r, length in zip(batches_per_bucket, rows, seq_buckets))
    return 1.0 - real_tokens / total if total else 0.0


# ------------------------------------------------------------------------------------- packing


def first_fit_decreasing(
    lengths: np.ndarray, order: np.ndarray, capacity: int, window: int
) -> list[np.ndarray]:
    """Bins of at most ``capacity`` tokens, each an array of indices into ``lengths``.

    ``order`` (a shuffled permutation) is cut into windows of ``window`` items; within a window the
    items go longest first into the first open bin with room (first-fit decreasing), and a window's
    bins are closed before the next window starts, so a bin only mixes items of one window. Every
    length must be <= capacity (the overlong policy runs first).
    """
    bins: list[np.ndarray] = []
    for start in range(0, len(order), window):
        items = order[start : start + window]
        items = items[np.argsort(-lengths[items], kind="stable")]
        need = lengths[items].astype(np.int64)
        # Unopened bins hold ``capacity`` free tokens, so the first bin with room among the opened
        # ones plus the next unopened one is exactly first fit: one vector compare per item.
        free = np.full(len(items) + 1, capacity, dtype=np.int64)
        slots = np.empty(len(items), dtype=np.int64)
        opened = 0
        for i, n in enumerate(need.tolist()):
            slot = int(np.argmax(free[: opened + 1] >= n))
            free[slot] -= n
            slots[i] = slot
            opened = max(opened, slot + 1)
        order_in_bins = np.argsort(slots, kind="stable")
        cuts = np.flatnonzero(np.diff(slots[order_in_bins])) + 1
        bins += np.split(items[order_in_bins], cuts)
    return bins


def assemble_packed_batch(
    rows: list[list[tuple[np.ndarray, np.ndarray]]],
    sample_index: list[list[int]],
    num_rows: int,
    length: int,
    pad_id: int,
) -> Batch:
    """Packed rows [num_rows, length]: row r holds the conversations ``rows[r]`` back to back.

    Each conversation gets positions 0..n-1 (truncated to ``length``); the padding tail is one more
    segment with positions from 0, so a boundary is wherever the position does not grow by one.
    ``sample_index`` [R] is the first conversation's index (-1 for filler rows); the per-token
    index is ``token_sample_index``.
    """
    ids = np.full((num_rows, length), pad_id, dtype=np.int64)
    loss_mask = np.zeros((num_rows, length), dtype=bool)
    attention_mask = np.zeros((num_rows, length), dtype=bool)
    positions = np.tile(np.arange(length, dtype=np.int64), (num_rows, 1))
    token_index = np.full((num_rows, length), -1, dtype=np.int64)
    for r, (conversations, indices) in enumerate(zip(rows, sample_index)):
        start = 0
        for (row_ids, row_mask), index in zip(conversations, indices):
            n = min(len(row_ids), length - start)
            ids[r, start : start + n] = row_ids[:n]
            loss_mask[r, start : start + n] = row_mask[:n]
            positions[r, start : start + n] = np.arange(n)
            token_index[r, start : start + n] = index
            start += n
        attention_mask[r, :start] = True
        positions[r, start:] = np.arange(length - start)
    first = np.full(num_rows, -1, dtype=np.int64)
    for r, indices in enumerate(sample_index):
        first[r] = indices[0] if len(indices) else -1
    return Batch(
        input_ids=torch.from_numpy(ids),
        loss_mask=torch.from_numpy(loss_mask),
        attention_mask=torch.from_numpy(attention_mask),
        sample_index=torch.from_numpy(first),
        position_ids=torch.from_numpy(positions),
        token_sample_index=torch.from_numpy(token_index),
    )


def same_segment(position_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, A, B-1] bool: whether a + k (k = 1..B-1) is in the same conversation as anchor a.

    Within a segment the position grows by one per token, and every segment starts at 0, so
    ``position[a + k] == position[a] + k`` holds exactly when no boundary lies in (a, a + k].
    """
    seq_len = position_ids.shape[1]
    offsets = torch.arange(1, block_size, device=anchors.device)
    at = (anchors[..., None] + offsets).clamp(max=seq_len - 1)  # [R, A, K]
    start = position_ids.gather(1, anchors)[..., None]
    return position_ids.gather(1, at.flatten(1)).view_as(at) == start + offsets
