"""Fixed-shape micro-batches from length buckets.

A row goes to the smallest bucket ``L >= len(row)``. Every micro-batch of a bucket is
``[rows, L]`` with ``rows = token_budget // L`` (rounded down to ``batch_rows_multiple``), so
the whole run sees only ``len(seq_buckets)`` shapes: compiled kernels and CUDA graphs are reused
and the allocator does not churn. Rows are right-padded with the pad id; a bucket's last batch is
completed with filler rows (pad ids, all-false masks, ``sample_index = -1``) instead of shrinking.
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
