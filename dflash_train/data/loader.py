"""Training order, data-parallel sharding and resume.

Epoch plan, a pure function of (seed, epoch): within every bucket the rows are shuffled and cut
into fixed-shape batches; each bucket's batches are grouped ``world_size`` at a time (one per rank,
so every rank runs the same shape at the same step and no rank waits on a longer bucket); the
groups of all buckets are then shuffled together. Step ``s`` of rank ``r`` is member ``r`` of group
``s``, so every rank has exactly ``steps_per_epoch`` steps. A bucket whose batch count is not a
multiple of ``world_size`` gets filler batches (all rows filler: zero masks, ``sample_index`` -1)
rather than dropping data: dropping would starve rare buckets (the longest rows) on many ranks.

``state_dict()`` is (epoch, position): the next batch to hand out. Resuming from it replays
exactly the batches an uninterrupted run would have seen, on any rank.

With ``data.packing`` the plan comes from ``data.packing.PackingPlan`` instead: rows of the largest
bucket filled with whole conversations, one shape for every step, the same (epoch, position) state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dflash_train.config import DataConfig, RunConfig
from dflash_train.data.batching import (
    Batch,
    assemble_batch,
    assemble_packed_batch,
    bucket_of,
    padding_waste,
    rows_per_batch,
)
from dflash_train.data.cache import ID_FROM_TEXT, ID_STORED_NOT_ROUND_TRIP, TokenizedData, load_or_build
from dflash_train.data.fingerprint import check_every_rank_reads_the_same_data, data_fingerprint
from dflash_train.data.packing import PackingPlan
from dflash_train.data.skips import SkipCounts


@dataclass
class DataStats:
    """What the data looks like after filtering; logged by the trainer and saved with the run."""

    num_rows: int
    num_tokens: int
    num_response_tokens: int
    rows_per_bucket: dict[int, int]
    batches_per_bucket: dict[int, int]
    rows_per_batch: dict[int, int]
    steps_per_epoch: int
    padding_waste: float
    skips: dict[str, int]
    num_skipped: int
    # data.packing: rows of the largest bucket filled with whole conversations.
    packing: bool = False
    conversations_per_row: float = 1.0
    # Rows whose replies are the generated ids they store (data.stored_ids), how many of those would
    # have re-tokenized from their text to other ids (regen.round_trip false), and the rows that store
    # ids but were tokenized from their text, by reason.
    rows_from_token_ids: int = 0
    rows_not_round_trip: int = 0
    token_ids_fallback: dict[str, int] = field(default_factory=dict)
    # Replies that regen cut at --max-new-tokens (regen.finished false), trained without their
    # end-of-turn label, and the rows holding at least one.
    replies_cut: int = 0
    rows_with_cut_reply: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TrainData:
    """Iterable of fixed-shape ``Batch`` for one data-parallel rank, resumable at any step.

    Iterating yields the rest of the current epoch, then advances ``epoch``; loop with
    ``while data.epoch < num_epochs: for batch in data: ...``. Step-based loops call
    ``next_batch()``, which crosses epoch boundaries by itself. Both share one position.
    """

    def __init__(
        self,
        tokenized: TokenizedData,
        cfg: DataConfig,
        *,
        seed: int,
        rank: int,
        world_size: int,
        pad_id: int,
        batch_rows_multiple: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.tokenized, self.cfg = tokenized, cfg
        self.seed, self.rank, self.world_size, self.pad_id = seed, rank, world_size, pad_id
        self.buckets = list(cfg.seq_buckets)
        self.rows_per_batch = rows_per_batch(self.buckets, cfg.token_budget, batch_rows_multiple)
        self.skips = SkipCounts(max_bad_rows=cfg.max_bad_rows)
        self.skips.merge(tokenized.skips)
        self.row_index, self.row_length, self.row_response = self._apply_overlong_policy()
        self.row_bucket = bucket_of(self.row_length, self.buckets)
        # Real batches of an epoch per bucket, whatever the world size; each bucket's are grouped
        # ``world_size`` at a time (filler batches complete the last group).
        self.batches_per_epoch = [self._num_batches(b) for b in range(len(self.buckets))]
        self.groups_per_bucket = [-(-n // world_size) for n in self.batches_per_epoch]
        self.steps_per_epoch = sum(self.groups_per_bucket)
        self.pack: PackingPlan | None = None
        if cfg.packing:
            self.pack = PackingPlan(
                self.row_length,
                seed=seed,
                capacity=self.buckets[-1],
                rows=rows_per_batch(self.buckets[-1:], cfg.token_budget, batch_rows_multiple)[0],
                window=cfg.pack_window,
                world_size=world_size,
            )
            self.steps_per_epoch = self.pack.steps_per_epoch
            self.batches_per_epoch = [self.pack.num_batches]
        self.epoch, self.position = 0, 0
        self._plan_epoch, self._plan = -1, []
        self.stats = self._compute_stats()
        # What the data files are (``data.fingerprint``), saved in checkpoints; set by ``build_train_data``.
        self.file_fingerprints: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ filtering

    def _apply_overlong_policy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Kept rows (global indices), their lengths after truncation and response token counts."""
        data, max_len = self.tokenized, self.buckets[-1]
        lengths, response = data.lengths.copy(), data.response_counts.copy()
        keep = np.ones(data.num_rows, dtype=bool)
        for i in np.flatnonzero(lengths > max_len):
            if self.cfg.overlong == "drop":
                self.skips.record("overlong_dropped", data.where(i), f"{lengths[i]} tokens > {max_len}")
                keep[i] = False
                continue
            mask = np.asarray(data.row(i)[1][:max_len])
            if not (mask[:-1] & mask[1:]).any():  # the whole response was beyond the cut
                self.skips.record(
                    "truncated_without_anchor", data.where(i), f"no response in first {max_len}"
                )
                keep[i] = False
                continue
            self.skips.record("overlong_truncated", data.where(i), f"{lengths[i]} tokens cut to {max_len}")
            lengths[i], response[i] = max_len, int(mask.sum())
        if not keep.any():
            raise ValueError(
                f"no usable rows in data.paths={self.cfg.paths} (skipped by reason: {self.skips.to_dict()}); "
                "check the data format and data.seq_buckets"
            )
        return np.flatnonzero(keep), lengths[keep], response[keep]

    def _num_batches(self, bucket: int) -> int:
        return -(-int((self.row_bucket == bucket).sum()) // self.rows_per_batch[bucket])

    def _compute_stats(self) -> DataStats:
        if self.pack is not None:
            return self._packed_stats()
        counts = np.bincount(self.row_bucket, minlength=len(self.buckets))
        batches = [g * self.world_size for g in self.groups_per_bucket]
        return DataStats(
            num_rows=len(self.row_index),
            num_tokens=int(self.row_length.sum()),
            num_response_tokens=int(self.row_response.sum()),
            rows_per_bucket={L: int(n) for L, n in zip(self.buckets, counts)},
            batches_per_bucket=dict(zip(self.buckets, batches)),
            rows_per_batch=dict(zip(self.buckets, self.rows_per_batch)),
            steps_per_epoch=self.steps_per_epoch,
            padding_waste=padding_waste(
                int(self.row_length.sum()), batches, self.rows_per_batch, self.buckets
            ),
            skips=self.skips.to_dict(),
            num_skipped=self.skips.num_skipped,
            **self._token_id_stats(),
        )

    def _packed_stats(self) -> DataStats:
        counts = np.bincount(self.row_bucket, minlength=len(self.buckets))
        length, total = self.buckets[-1], self.pack.steps_per_epoch * self.world_size
        return DataStats(
            num_rows=len(self.row_index),
            num_tokens=int(self.row_length.sum()),
            num_response_tokens=int(self.row_response.sum()),
            rows_per_bucket={L: int(n) for L, n in zip(self.buckets, counts)},
            batches_per_bucket={L: total if L == length else 0 for L in self.buckets},
            rows_per_batch={L: self.pack.rows if L == length else 0 for L in self.buckets},
            steps_per_epoch=self.steps_per_epoch,
            padding_waste=self.pack.padding_waste(int(self.row_length.sum())),
            skips=self.skips.to_dict(),
            num_skipped=self.skips.num_skipped,
            packing=True,
            conversations_per_row=self.pack.conversations_per_row(),
            **self._token_id_stats(),
        )

    def _token_id_stats(self) -> dict[str, Any]:
        sources = self.tokenized.id_sources[self.row_index]
        cut = self.tokenized.cut_replies[self.row_index]
        return {
            "rows_from_token_ids": int((sources != ID_FROM_TEXT).sum()),
            "rows_not_round_trip": int((sources == ID_STORED_NOT_ROUND_TRIP).sum()),
            "token_ids_fallback": dict(sorted(self.tokenized.id_fallbacks.items())),
            "replies_cut": int(cut.sum()),
            "rows_with_cut_reply": int((cut > 0).sum()),
        }

    # ------------------------------------------------------------------ order

    def epoch_plan(self, epoch: int) -> list[list[np.ndarray]]:
        """Groups of one epoch in step order; each group has ``world_size`` arrays of row indices
        (positions into the kept rows), one per rank; an empty array is a filler batch."""
        if epoch != self._plan_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            groups: list[list[np.ndarray]] = []
            for b, rows in enumerate(self.rows_per_batch):
                members = rng.permutation(np.flatnonzero(self.row_bucket == b))
                batches = [members[i : i + rows] for i in range(0, len(members), rows)]
                batches += [members[:0]] * (self.groups_per_bucket[b] * self.world_size - len(batches))
                ws = self.world_size
                groups += [batches[i : i + ws] for i in range(0, len(batches), ws)]
            self._plan = [groups[i] for i in rng.permutation(len(groups))]
            self._plan_epoch = epoch
        return self._plan

    def batch_at(self, epoch: int, step: int) -> Batch:
        """This rank's batch at ``step`` of ``epoch`` (random access, no state change)."""
        if self.pack is not None:
            return self._packed_batch_at(epoch, step)
        group = self.epoch_plan(epoch)[step]
        bucket = self._group_bucket(group)
        indices = [int(self.row_index[m]) for m in group[self.rank]]
        rows = [self.tokenized.row(i) for i in indices]
        batch = assemble_batch(rows, indices, self.rows_per_batch[bucket], self.buckets[bucket], self.pad_id)
        batch.epoch = epoch
        return batch

    def _packed_batch_at(self, epoch: int, step: int) -> Batch:
        packed_rows = self.pack.groups(epoch)[step][self.rank]
        indices = [[int(self.row_index[m]) for m in members] for members in packed_rows]
        rows = [[self.tokenized.row(i) for i in row] for row in indices]
        batch = assemble_packed_batch(rows, indices, self.pack.rows, self.buckets[-1], self.pad_id)
        batch.epoch = epoch
        return batch

    def _group_bucket(self, group: list[np.ndarray]) -> int:
        members = next(m for m in group if len(m))  # a group always holds at least one real batch
        return int(self.row_bucket[members[0]])

    def __len__(self) -> int:
        return self.steps_per_epoch

    def steps_per_epoch_at(self, world_size: int) -> int:
        """The steps per epoch this data gives on ``world_size`` ranks (a resume on another number of
        ranks checks it against the checkpoint's at the checkpoint's world size)."""
        return steps_per_epoch_at(self.batches_per_epoch, world_size)

    def __iter__(self):
        self._normalize()
        while self.position < self.steps_per_epoch:
            batch = self.batch_at(self.epoch, self.position)
            self.position += 1
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def next_batch(self) -> tuple[Batch, int]:
        """The next batch and its epoch, rolling over epoch boundaries (for step-based loops)."""
        self._normalize()
        epoch = self.epoch
        batch = self.batch_at(epoch, self.position)
        self.position += 1
        return batch, epoch

    def log_stats(self) -> dict[str, float]:
        """Scalar stats for the trainer's logger (the full ``stats`` go into the run folder)."""
        s = self.stats
        packed = {"conversations_per_row": s.conversations_per_row} if s.packing else {}
        return packed | {
            "rows": s.num_rows,
            "tokens": s.num_tokens,
            "response_tokens": s.num_response_tokens,
            "padding_waste": s.padding_waste,
            "skipped_rows": s.num_skipped,
            "steps_per_epoch": s.steps_per_epoch,
            "rows_from_token_ids": s.rows_from_token_ids,
            "replies_cut": s.replies_cut,
        }

    # ------------------------------------------------------------------ resume

    def _normalize(self) -> None:
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The next batch to hand out: ``{"epoch", "position"}`` (plus a shape check)."""
        epoch, position = self.epoch, self.position
        if position >= self.steps_per_epoch:
            epoch, position = epoch + 1, 0
        return {"epoch": epoch, "position": position, "steps_per_epoch": self.steps_per_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("steps_per_epoch", self.steps_per_epoch) != self.steps_per_epoch:
            raise ValueError(
                f"the data changed since the checkpoint: {state['steps_per_epoch']} steps per epoch then, "
                f"{self.steps_per_epoch} now; restore the same data.paths/seq_buckets/token_budget "
                "or start a new run"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._normalize()


def steps_per_epoch_at(batches_per_epoch: list[int], world_size: int) -> int:
    """Steps per epoch per rank of an epoch with ``batches_per_epoch`` real batches per bucket (one
    entry when packed): each bucket's batches are grouped ``world_size`` at a time."""
    return sum(-(-n // world_size) for n in batches_per_epoch)


def pad_token_id(tokenizer) -> int:
    """Pad id for batches; its value never matters (masked), but it must be a real vocab row."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def check_data_and_tokenizer(cfg: RunConfig, tokenizer) -> None:
    """Training (and ``data-stats``) need chat data and the target's tokenizer (for its chat template)."""
    if not cfg.data.paths:
        raise ValueError("data.paths is empty: pass your chat data, e.g. data.paths=[regenerated.jsonl]")
    if tokenizer is None:
        raise ValueError(
            f"target {cfg.target.path} has no tokenizer; training needs one to apply the chat template."
        )


def build_train_data(
    cfg: DataConfig, tokenizer, *, seed: int, rank: int = 0, world_size: int = 1, batch_rows_multiple: int = 1
) -> TrainData:
    """Tokenize (or load the cache of) ``cfg.paths`` and return this rank's ``TrainData``, with the
    fingerprints of its files (rank 0's, the same on every rank)."""
    tokenized, fingerprints = load_tokenized(cfg, tokenizer, rank, world_size)
    data = TrainData(
        tokenized,
        cfg,
        seed=seed,
        rank=rank,
        world_size=world_size,
        pad_id=pad_token_id(tokenizer),
        batch_rows_multiple=batch_rows_multiple,
    )
    data.file_fingerprints = fingerprints
    return data


def load_tokenized(
    cfg: DataConfig, tokenizer, rank: int, world_size: int
) -> tuple[TokenizedData, list[dict[str, Any]]]:
    """Rank 0 tokenizes while the others wait; every rank then loads the cache. Also rank 0's
    fingerprints of the data files: one verdict on whether they changed since a checkpoint; every
    rank's own must match them (``check_every_rank_reads_the_same_data``).

    A node without a shared cache directory simply tokenizes again (same key, same result); a rank
    that fails to load its copy stops every rank with its error.
    """
    tokenized, fingerprints = tokenize_and_broadcast(
        cfg, tokenizer, is_source=rank == 0, describe=data_fingerprint
    )
    local, failure = fingerprints, None
    if tokenized is None:
        try:
            tokenized = load_or_build(cfg, tokenizer)
            local = data_fingerprint(tokenized)
        except Exception as err:  # recovery boundary: the check below makes every rank raise it
            failure = err
    check_every_rank_reads_the_same_data(local, fingerprints, failure)
    return tokenized, fingerprints


def tokenize_and_broadcast(
    cfg: DataConfig, tokenizer, *, is_source: bool, describe: Callable[[TokenizedData], Any] | None = None
) -> tuple[TokenizedData | None, Any]:
    """The source rank (global rank 0) tokenizes and tells every rank the outcome, success or failure.

    Colocated and split training both prepare their data through this one function. The source
    rank builds (or loads) the token cache and returns ``(tokenized, describe(tokenized))``; every
    other rank gets ``(None, description)`` from one ``broadcast_object_list``. ANY exception on the
    source is caught and broadcast instead, so every rank raises the same error at once rather than
    waiting in the collective for ``train.dist_timeout_s``: a ValueError for bad data or config (an
    OSError included), a RuntimeError for anything else (a bug; the source chains the original).
    Without a process group, errors propagate unchanged.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed:
        tokenized = load_or_build(cfg, tokenizer)
        return tokenized, describe(tokenized) if describe else None
    tokenized, failure, message = None, None, [None]
    if is_source:
        try:
            tokenized = load_or_build(cfg, tokenizer)
            message[0] = {"description": describe(tokenized) if describe else None}
        except Exception as err:  # recovery boundary: every rank must learn about the failure
            failure = err
            message[0] = {
                "error": f"{type(err).__name__}: {err}",
                "user": isinstance(err, ValueError | OSError),
            }
    dist.broadcast_object_list(message, src=0)
    if "error" in message[0]:
        kind = ValueError if message[0]["user"] else RuntimeError
        raise kind(f"data preparation failed on rank 0: {message[0]['error']}") from failure
    return tokenized, message[0]["description"]
