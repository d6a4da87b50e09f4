"""The stream between split placement's roles: who produces what, what crosses, in which order.

Split placement (``train/split.py``) runs the frozen target on the first T ranks and trains the
drafter on the other D. This module holds the contract between the two roles; ``split.py`` holds
what each role does with it.

Data. The data-parallel shards are the D drafter ranks' (``TrainData(rank=d, world_size=D)``);
the target ranks own and read them. Micro-batch ``m = step * M + k`` of drafter d is produced by
target rank ``(m * D + d) % T`` (round robin, so 1:2, 2:1 and 3:2 layouts all keep every rank busy).
Target rank 0 tokenizes and tells every rank the data shape; drafter ranks track their position
with ``StreamPosition`` so checkpoints keep the colocated format.

Stream (per target -> drafter pair, in this order, point-to-point isend/irecv):
  per step: for each of its micro-batches a header (int64 [HEADER_LEN]) and the packed batch
  (int64 [R, 3L+1]: ids | loss mask | attention mask | sample index); then the features
  (target dtype [R, L, n*H]) of each micro-batch. The drafter reads every batch of a step first
  (the loss denominator spans the whole step), then the features one by one, prefetching the next.
Back-pressure: a target rank keeps at most ``train.max_in_flight`` unreceived feature messages per
drafter rank, waiting on the oldest send before posting another; it runs at most
``max_in_flight // grad_accum`` steps ahead of the drafters.

Start-up. Each role builds what only it needs (the target; the drafter, its optimizer, its metrics
log) between the points where the two roles meet (the data preparation, the resume, the start of
the stream). Each such part runs in ``starting_up_together``: its error goes into one all-ranks vote
(``share_startup_outcome``) at the next meeting point, so every rank raises the same line at once
instead of the other role waiting for the failed one in its next collective.

Reports. On log and save steps every rank sends drafter rank 0 a report (``gather_object``):
timings, queue depth, bytes and, from the target ranks, their data positions; ``split_metrics``
turns them into busy fractions and the bottleneck. Before every save one all-ranks vote on whether
the data positions agree (``share_position_check``); after every save (and after the loop) one on
whether it failed, with drafter rank 0's message (``share_save_outcome``).

Legend: R rows, L sequence, F feature width (n*H), T target ranks, D drafter ranks, M micro-batches
per optimizer step (``train.grad_accum``).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dflash_train.config import RunConfig
from dflash_train.data.batching import Batch
from dflash_train.train import checkpoint_space as space
from dflash_train.train.faults import any_rank_flags, failing_together, raise_if_any_rank_failed

HEADER_LEN = 6  # step, micro, rows, seq_len, epoch, feature width


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class SplitLayout:
    """Which ranks run the target and which micro-batch each target rank produces."""

    num_target_ranks: int
    num_drafter_ranks: int
    rank: int

    @classmethod
    def create(cls, target_ranks: int, world_size: int, rank: int) -> SplitLayout:
        if not world_size > target_ranks >= 1:
            raise ValueError(
                f"train.placement=split with train.target_ranks={target_ranks} needs 1 <= target_ranks < world size "
                f"({world_size}): launch more processes (torchrun --nproc-per-node) or lower train.target_ranks."
            )
        return cls(target_ranks, world_size - target_ranks, rank)

    @property
    def is_target(self) -> bool:
        return self.rank < self.num_target_ranks

    @property
    def drafter_index(self) -> int:
        return self.rank - self.num_target_ranks

    @property
    def drafter_main(self) -> int:
        """Global rank of drafter rank 0: it logs and writes checkpoints."""
        return self.num_target_ranks

    def rank_name(self, rank: int) -> str:
        """How messages name global rank ``rank``: ``target rank i`` or ``drafter rank i``."""
        if rank < self.num_target_ranks:
            return f"target rank {rank}"
        return f"drafter rank {rank - self.num_target_ranks}"

    def producer(self, micro_index: int, drafter: int) -> int:
        """Target rank producing micro-batch ``micro_index`` (= step * M + k) of drafter ``drafter``."""
        return (micro_index * self.num_drafter_ranks + drafter) % self.num_target_ranks


def pipeline_depth(max_in_flight: int, grad_accum: int) -> int:
    """Whole steps a target rank may run ahead of the drafters without exceeding ``max_in_flight``."""
    if max_in_flight < 1:
        raise ValueError(
            f"train.max_in_flight={max_in_flight}: use >= 1 (2 overlaps target and drafter work)."
        )
    return max_in_flight // grad_accum


def data_state(micro_index: int, steps_per_epoch: int) -> dict[str, int]:
    """``TrainData.state_dict`` of a stream whose next micro-batch has absolute index ``micro_index``."""
    return {
        "epoch": micro_index // steps_per_epoch,
        "position": micro_index % steps_per_epoch,
        "steps_per_epoch": steps_per_epoch,
    }


# ----------------------------------------------------------------------------- the stream


def pack_batch(batch: Batch) -> torch.Tensor:
    """ids | loss mask | attention mask | sample index as one int64 [R, 3L+1] message."""
    return torch.cat(
        [batch.input_ids, batch.loss_mask.long(), batch.attention_mask.long(), batch.sample_index[:, None]],
        dim=1,
    )


def unpack_batch(packed: torch.Tensor, seq_len: int, epoch: int) -> Batch:
    ids, loss_mask, attention_mask, index = packed.split([seq_len, seq_len, seq_len, 1], dim=1)
    return Batch(
        input_ids=ids.contiguous(),
        loss_mask=loss_mask.bool(),
        attention_mask=attention_mask.bool(),
        sample_index=index[:, 0].contiguous(),
        epoch=epoch,
    )


def wait_work(work, device: torch.device) -> None:
    """Block the host until a p2p op is done (NCCL's ``wait`` only orders the CUDA stream)."""
    if device.type == "cuda":
        while not work.is_completed():
            time.sleep(1e-4)
    else:
        work.wait()


class FeatureSender:
    """Target side: posts isends, at most ``max_in_flight`` unreceived feature messages per drafter.

    Send buffers live in the queues until their send completes (bounded memory). ``isend`` is
    injectable for tests. Queue depth (outstanding feature messages to one drafter, the new one
    included) is sampled at every post.
    """

    def __init__(self, max_in_flight: int, device: torch.device, isend=dist.isend):
        self.max_in_flight, self.device, self.isend = max_in_flight, device, isend
        self.features: dict[int, deque] = {}
        self.small: deque = deque()
        self.reset_stats()

    def reset_stats(self) -> None:
        self.wait_s, self.bytes, self.depth_sum, self.depth_posts, self.depth_max = 0.0, 0, 0, 0, 0

    def take_stats(self) -> dict[str, float]:
        """The counters since the last report (a target report's send side), then reset them."""
        stats = {
            "send_wait_s": self.wait_s,
            "bytes": self.bytes,
            "depth_sum": self.depth_sum,
            "depth_posts": self.depth_posts,
            "depth_max": self.depth_max,
        }
        self.reset_stats()
        return stats

    def send_batch(self, dst: int, header: torch.Tensor, packed: torch.Tensor) -> None:
        for tensor in (header, packed):
            self.small.append((self.isend(tensor, dst), tensor))
        while self.small and self.small[0][0].is_completed():
            self.small.popleft()

    def send_features(self, dst: int, features: torch.Tensor) -> None:
        queue = self.features.setdefault(dst, deque())
        while queue and queue[0][0].is_completed():
            queue.popleft()
        t0 = time.perf_counter()
        while len(queue) >= self.max_in_flight:  # back-pressure: wait for the oldest to be received
            wait_work(queue.popleft()[0], self.device)
        self.wait_s += time.perf_counter() - t0
        queue.append((self.isend(features, dst), features))
        self.bytes += features.numel() * features.element_size()
        self.depth_sum, self.depth_posts = self.depth_sum + len(queue), self.depth_posts + 1
        self.depth_max = max(self.depth_max, len(queue))

    def drain(self) -> None:
        for queue in [self.small, *self.features.values()]:
            while queue:
                wait_work(queue.popleft()[0], self.device)


class FeatureReceiver:
    """Drafter side: receives headers and batches (blocking) and features (prefetched one ahead)."""

    def __init__(self, device: torch.device, feature_dtype: torch.dtype, feature_width: int, group=None):
        self.irecv = functools.partial(dist.irecv, group=group)
        self.device, self.dtype, self.width = device, feature_dtype, feature_width
        self.wait_s, self.bytes = 0.0, 0

    def recv_batch(self, src: int, step: int, micro: int) -> Batch:
        header = torch.empty(HEADER_LEN, dtype=torch.long, device=self.device)
        self.wait(self.irecv(header, src))
        h_step, h_micro, rows, seq_len, epoch, width = header.tolist()  # host sync: shapes come from it
        if (h_step, h_micro, width) != (step, micro, self.width):
            raise RuntimeError(
                f"split stream out of order: expected step {step} micro {micro} width {self.width} from rank {src}, got {h_step}/{h_micro}/{width}"
            )
        packed = torch.empty(rows, 3 * seq_len + 1, dtype=torch.long, device=self.device)
        self.wait(self.irecv(packed, src))
        return unpack_batch(packed, seq_len, epoch)

    def post_features(self, src: int, batch: Batch) -> tuple[Any, torch.Tensor]:
        buffer = torch.empty(*batch.input_ids.shape, self.width, dtype=self.dtype, device=self.device)
        self.bytes += buffer.numel() * buffer.element_size()
        return self.irecv(buffer, src), buffer

    def wait(self, work) -> None:
        t0 = time.perf_counter()
        wait_work(work, self.device)
        self.wait_s += time.perf_counter() - t0

    def take_stats(self) -> dict[str, float]:
        """The counters since the last report (a drafter report's receive side), then reset them."""
        stats = {"recv_wait_s": self.wait_s, "bytes": self.bytes}
        self.wait_s, self.bytes = 0.0, 0
        return stats


# ----------------------------------------------------------------------------- data


def share_data_info(cfg: RunConfig, layout: SplitLayout, target) -> dict[str, Any]:
    """Target rank 0 tokenizes and tells every rank the data shape and its target kernels (or the
    error, ``data.loader.tokenize_and_broadcast``); the other target ranks then load the cache."""
    from dflash_train.data.cache import load_or_build
    from dflash_train.data.fingerprint import check_every_rank_reads_the_same_data, data_fingerprint
    from dflash_train.data.loader import TrainData, pad_token_id, tokenize_and_broadcast
    from dflash_train.train.builders import check_data_inputs

    check_data_inputs(cfg, target)  # on every rank, before any collective: the same verdict everywhere

    def describe(tokenized) -> dict[str, Any]:
        shard0 = TrainData(
            tokenized,
            cfg.data,
            seed=cfg.train.seed,
            rank=0,
            world_size=layout.num_drafter_ranks,
            pad_id=pad_token_id(target.tokenizer),
        )
        stats = {
            "steps_per_epoch": shard0.steps_per_epoch,
            "batches_per_epoch": shard0.batches_per_epoch,
            "log_stats": shard0.log_stats(),
            "file_fingerprints": data_fingerprint(tokenized),
        }
        return {**stats, "target_kernels": target.kernels}

    tokenized, shared = tokenize_and_broadcast(
        cfg.data, target.tokenizer, is_source=layout.rank == 0, describe=describe
    )
    local = shared["file_fingerprints"] if tokenized is not None else None  # target rank 0: the source
    failure = None
    if layout.is_target and tokenized is None:
        try:
            tokenized = load_or_build(cfg.data, target.tokenizer)
            local = data_fingerprint(tokenized)
        except Exception as err:  # recovery boundary: the check below makes every rank raise it
            failure = err
    check_every_rank_reads_the_same_data(local, shared["file_fingerprints"], failure)  # drafters read none
    return {**shared, "tokenized": tokenized}


class StreamPosition:
    """The drafter's view of its data stream, which the target ranks read: position, epoch, stats.

    Stands in for ``TrainData`` in ``trainer.Run`` (``state_dict``/``load_state_dict``/``epoch``/
    ``log_stats``/``file_fingerprints``), so ``trainer.maybe_resume`` and checkpoints keep the colocated format: a split
    checkpoint resumes colocated with world size D and vice versa.
    """

    def __init__(
        self,
        steps_per_epoch: int,
        stats: dict[str, float],
        batches_per_epoch: list[int],
        file_fingerprints: list[dict[str, Any]] | None = None,
    ):
        self.steps_per_epoch, self.stats = steps_per_epoch, stats
        self.batches_per_epoch = batches_per_epoch  # ``TrainData.batches_per_epoch`` of the stream
        self.file_fingerprints = file_fingerprints  # ``TrainData.file_fingerprints``: target rank 0's
        self.micro, self.epoch = 0, 0

    def steps_per_epoch_at(self, world_size: int) -> int:
        from dflash_train.data.loader import steps_per_epoch_at

        return steps_per_epoch_at(self.batches_per_epoch, world_size)

    def advance(self, epoch: int) -> None:
        self.micro, self.epoch = self.micro + 1, epoch

    def state_dict(self) -> dict[str, int]:
        return data_state(self.micro, self.steps_per_epoch)

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("steps_per_epoch", self.steps_per_epoch) != self.steps_per_epoch:
            raise ValueError(
                f"the data changed since the checkpoint: {state['steps_per_epoch']} steps per epoch then, {self.steps_per_epoch} now; restore the same data or start a new run"
            )
        self.micro = int(state["epoch"]) * self.steps_per_epoch + int(state["position"])
        self.epoch = self.micro // self.steps_per_epoch

    def log_stats(self) -> dict[str, float]:
        return self.stats


# ----------------------------------------------------------------------------- reports


def report_step(cfg: RunConfig, done: int, total: int, stopping: bool) -> bool:
    """Steps on which every rank reports to drafter rank 0 (logging or checkpoint steps)."""
    return (
        stopping
        or done == total
        or done % cfg.logging.every_steps == 0
        or done % cfg.checkpoint.every_steps == 0
    )


def exchange_reports(layout: SplitLayout, report: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's report to drafter rank 0 (one ``gather_object`` over all ranks); None elsewhere."""
    gathered = (
        [None] * (layout.num_target_ranks + layout.num_drafter_ranks)
        if layout.rank == layout.drafter_main
        else None
    )
    dist.gather_object(report, gathered, dst=layout.drafter_main)
    return gathered


def position_mismatch(
    step: int, drafter_position: dict[str, int], reports: list[dict[str, Any]]
) -> str | None:
    """Drafter rank 0, before a save: the one-line error when a target rank's data position (in its
    report) is not the drafters' (its features would be of other rows than the checkpoint says)."""
    positions = [r["data"] for r in reports if r["role"] == "target"]
    if all(p == drafter_position for p in positions):
        return None
    return (
        f"split data positions disagree at step {step}: drafter {drafter_position}, target ranks "
        f"{positions}; no checkpoint of this step was written (a bug in the split stream: please report it)"
    )


def starting_up_together(layout: SplitLayout):
    """A part of the start-up only this rank's role does: its error is carried into the all-ranks
    vote of ``share_startup_outcome`` (``faults.failing_together``) instead of raised before it."""
    return failing_together(None, functools.partial(startup_failure, layout))


def share_startup_outcome(layout: SplitLayout, error: BaseException | None) -> None:
    """Every rank, where the two roles meet during start-up (``error``: this rank's failure in the
    part of the start-up only its role does, None if it went through): one all-ranks vote, so on a
    failure every rank raises the same one-line ``RuntimeError`` naming the first failed rank, at
    once, instead of the other role waiting for it in its next collective (until
    ``train.dist_timeout_s`` on NCCL; gloo reports the failed rank's closed connection instead)."""
    raise_if_any_rank_failed(error, None, functools.partial(startup_failure, layout))


def startup_failure(layout: SplitLayout, rank: int, message: str) -> str:
    return f"split start-up failed on {layout.rank_name(rank)}: {message}"


def share_resume_outcome(layout: SplitLayout, error: BaseException | None) -> None:
    """Every rank, once the drafter ranks tried to resume (``error``: this drafter rank's failure;
    None on target ranks): one ``all_gather_object`` of the failures, so that on any failure every
    rank raises the same line at once instead of the target ranks waiting for the resume point. A
    refused resume (a ``ValueError``: a changed recipe key, other data) stays that error; anything else
    (an unreadable checkpoint) is a ``RuntimeError`` naming the first drafter rank that failed. The
    target ranks add ``(target rank R stopped with the drafter ranks)``."""
    failure = None
    if error is not None:
        failure = {
            "message": str(error),
            "type": type(error).__name__,
            "refused": isinstance(error, ValueError),
        }
    gathered: list[dict[str, Any] | None] = [None] * (layout.num_target_ranks + layout.num_drafter_ranks)
    dist.all_gather_object(gathered, failure)
    failed = [(rank - layout.num_target_ranks, f) for rank, f in enumerate(gathered) if f is not None]
    if not failed:
        return
    drafter, first = failed[0]
    message = first["message"]
    if not first["refused"]:
        message = f"resuming failed on drafter rank {drafter}: {first['type']}: {message}"
    if layout.is_target:
        message = f"{message} (target rank {layout.rank} stopped with the drafter ranks)"
    raise (ValueError if first["refused"] else RuntimeError)(message) from error


def share_position_check(layout: SplitLayout, device: torch.device, mismatch: str | None) -> None:
    """Every rank, before a save: one all-ranks vote on drafter rank 0's comparison of the target
    ranks' data positions with its own (``mismatch``: its one-line message; None where they agree and
    on every other rank). On a mismatch every rank raises the same ``RuntimeError`` at once: the
    drafter ranks before the save's barriers, the target ranks before waiting on its outcome."""
    if not any_rank_flags([mismatch is not None], device)[0]:
        return
    message = [mismatch]
    dist.broadcast_object_list(message, src=layout.drafter_main)
    raise RuntimeError(message[0])


def share_save_outcome(layout: SplitLayout, device: torch.device, error: BaseException | None) -> None:
    """Every rank, at the same point after a save: one all-ranks vote on whether it failed (``error``:
    a drafter rank's ``CheckpointWriteError``, None on target ranks). On a failure drafter rank 0's
    one-line message reaches every rank and every rank raises: the drafters their own error, the target
    ranks the message, so they stop at once instead of in the next step's vote (at a peer's exit or
    ``train.dist_timeout_s``)."""
    if not any_rank_flags([error is not None], device)[0]:
        return
    message = [str(error) if error is not None else None]
    dist.broadcast_object_list(message, src=layout.drafter_main)
    if error is not None:
        raise error
    raise space.CheckpointWriteError(
        f"{message[0]} (target rank {layout.rank} stopped with the drafter ranks)"
    )


def split_metrics(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Busy fractions per group, queue depth, feature bytes/s and the bottleneck (1 target, 0 drafter).

    Target busy = target forward time / (forward + waiting on sends + waiting on the step vote);
    drafter busy = compute / (compute + waiting on receives). The side that waits less is the
    bottleneck. Target windows lag the drafters' by ``lag`` steps (they run ahead).
    """
    targets = [r for r in reports if r["role"] == "target"]
    drafters = [r for r in reports if r["role"] == "drafter"]
    t_busy = sum(r["busy_s"] for r in targets)
    t_total = t_busy + sum(r["send_wait_s"] + r["control_wait_s"] for r in targets)
    d_busy = sum(r["busy_s"] for r in drafters)
    d_total = d_busy + sum(r["recv_wait_s"] for r in drafters)
    target_frac, drafter_frac = t_busy / max(t_total, 1e-9), d_busy / max(d_total, 1e-9)
    posts = sum(r["depth_posts"] for r in targets)
    return {
        "split_target_busy_frac": target_frac,
        "split_drafter_busy_frac": drafter_frac,
        "split_target_send_wait_s": sum(r["send_wait_s"] for r in targets) / len(targets),
        "split_drafter_recv_wait_s": sum(r["recv_wait_s"] for r in drafters) / len(drafters),
        "split_queue_depth_mean": sum(r["depth_sum"] for r in targets) / max(posts, 1),
        "split_queue_depth_max": max(r["depth_max"] for r in targets),
        "split_feature_bytes_per_s": sum(r["bytes"] for r in drafters)
        / max(max(r["seconds"] for r in drafters), 1e-9),
        "split_bottleneck": 1.0 if target_frac >= drafter_frac else 0.0,
    }
