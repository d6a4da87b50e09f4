"""Split placement: dedicated target ranks stream features to drafter ranks (DESIGN.md §2).

One torchrun job, one process per GPU, no threads doing device work. The first T ranks
(``train.target_ranks``) run only the frozen target; the other D ranks train the drafter exactly
as colocated training with world size D would: same data shards, same anchors, same loss
normalisation, so the same per-step losses (bit-exact on CPU).

Data. The data-parallel shards are the D drafter ranks' (``TrainData(rank=d, world_size=D)``);
the target ranks own and read them. Micro-batch ``m = step * M + k`` of drafter d is produced by
target rank ``(m * D + d) % T`` (round robin, so 1:2, 2:1 and 3:2 layouts all keep every rank busy).

Stream (per target -> drafter pair, in this order, point-to-point isend/irecv):
  per step: for each of its micro-batches a header (int64 [HEADER_LEN]) and the packed batch
  (int64 [R, 3L+1]: ids | loss mask | attention mask | sample index); then the features
  (target dtype [R, L, n*H]) of each micro-batch. The drafter reads every batch of a step first
  (the loss denominator spans the whole step), then the features one by one, prefetching the next.
Back-pressure: a target rank keeps at most ``train.max_in_flight`` unreceived feature messages per
drafter rank, waiting on the oldest send before posting another; it runs at most
``max_in_flight // grad_accum`` steps ahead of the drafters.

Control. Every step ends with one all-reduce over ALL ranks (``any_rank_flags`` on the default
group): non-finite (drafters), stop requested (any rank). Target ranks join the vote of step s
after producing step s + lag, so stop/raise/save decisions are collective and nobody hangs; a
header-borne stop flag could only flow target -> drafter. On a stop the drafters drain what the
targets already sent. On log and save steps every rank reports (``gather_object`` to drafter rank
0): timings, queue depth, bytes, and the target ranks' data positions, which drafter rank 0 checks
against its own before writing the checkpoint (one folder, one commit marker).

Legend: R rows, L sequence, F feature width (n*H), T target ranks, D drafter ranks, M micro-batches
per optimizer step (``train.grad_accum``).
"""

from __future__ import annotations

import datetime
import functools
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from dflash_train.config import RunConfig, default_gamma
from dflash_train.data.batching import Batch
from dflash_train.models.target import resolve_dtype
from dflash_train.train import checkpoint as ckpt
from dflash_train.train import trainer
from dflash_train.train.faults import GracefulStop, Watchdog, any_rank_flags
from dflash_train.train.flops import mfu
from dflash_train.train.logging import MetricsLogger
from dflash_train.train.loss import add_metrics, dflash_loss, summarize_metrics
from dflash_train.train.parallel import DistInfo, init_distributed, unwrap, uses_fsdp
from dflash_train.train.step_timer import PhaseTimer

HEADER_LEN = 6  # step, micro, rows, seq_len, epoch, feature width
DEFAULT_DIST_TIMEOUT_S = 1800.0


@dataclass
class SplitHooks(trainer.TrainHooks):
    """``TrainHooks`` plus split-only seams: process-group timeout, injected faults and stop votes."""

    dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S
    # (global rank, step index) -> raise inside the target forward loop (tests a crashing rank).
    before_target_forward: Callable[[int, int], None] | None = None
    # (global rank, step index) -> True votes "stop" at that step, as a SIGTERM on that rank would.
    request_stop: Callable[[int, int], bool] | None = None


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


def report_step(cfg: RunConfig, done: int, total: int, stopping: bool) -> bool:
    """Steps on which every rank reports to drafter rank 0 (logging or checkpoint steps)."""
    return (
        stopping
        or done == total
        or done % cfg.logging.every_steps == 0
        or done % cfg.checkpoint.every_steps == 0
    )


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


# ----------------------------------------------------------------------------- entry point


def train_split(cfg: RunConfig, hooks: trainer.TrainHooks | None = None) -> dict[str, Any]:
    """``train.placement: split``: target ranks stream features, drafter ranks train (one torchrun job)."""
    hooks = hooks if isinstance(hooks, SplitHooks) else SplitHooks(**vars(hooks or trainer.TrainHooks()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    SplitLayout.create(cfg.train.target_ranks, world, int(os.environ.get("RANK", "0")))  # fail before joining
    pipeline_depth(cfg.train.max_in_flight, cfg.train.grad_accum)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    info = init_distributed(cfg.train.device, timeout_s=hooks.dist_timeout_s)
    layout = SplitLayout.create(cfg.train.target_ranks, info.world_size, info.rank)
    timeout = datetime.timedelta(seconds=hooks.dist_timeout_s)
    # new_group is collective: every rank calls it, target ranks included.
    drafter_group = dist.new_group(list(range(layout.num_target_ranks, info.world_size)), timeout=timeout)
    # The stream gets its own communicator: on NCCL a pending send would otherwise sit in front of
    # the step vote on the default group's stream, and the vote is what lets the receiver progress.
    stream_group = dist.new_group(list(range(info.world_size)), timeout=timeout)
    trainer.seed_everything(cfg.train.seed)
    if layout.is_target:
        return run_target_rank(cfg, layout, info, stream_group, hooks)
    return run_drafter_rank(cfg, layout, info, drafter_group, stream_group, hooks)


def share_data_info(cfg: RunConfig, layout: SplitLayout, target) -> dict[str, Any]:
    """Target rank 0 tokenizes and tells every rank the data shape (or the error), then targets load it."""
    from dflash_train.data.cache import load_or_build

    message: list[Any] = [None]
    tokenized = None
    if layout.rank == 0:
        try:
            tokenized, message[0] = _tokenize_and_describe(cfg, target, layout)
        except (ValueError, OSError) as err:  # recovery boundary: every rank must raise together
            message[0] = {"error": f"{type(err).__name__}: {err}"}
    dist.broadcast_object_list(message, src=0)
    if "error" in message[0]:
        raise ValueError(f"data preparation failed on target rank 0: {message[0]['error']}")
    if layout.is_target and tokenized is None:
        tokenized = load_or_build(cfg.data, target.tokenizer)
    return {**message[0], "tokenized": tokenized}


def _tokenize_and_describe(cfg: RunConfig, target, layout: SplitLayout):
    from dflash_train.data.cache import load_or_build
    from dflash_train.data.loader import TrainData, pad_token_id

    if not cfg.data.paths:
        raise ValueError("data.paths is empty: pass your chat data, e.g. data.paths=[regenerated.jsonl]")
    if target.tokenizer is None:
        raise ValueError(
            f"target {cfg.target.path} has no tokenizer; training needs one to apply the chat template."
        )
    tokenized = load_or_build(cfg.data, target.tokenizer)
    shard0 = TrainData(
        tokenized,
        cfg.data,
        seed=cfg.train.seed,
        rank=0,
        world_size=layout.num_drafter_ranks,
        pad_id=pad_token_id(target.tokenizer),
    )
    return tokenized, {"steps_per_epoch": shard0.steps_per_epoch, "log_stats": shard0.log_stats()}


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    total = cfg.train.max_steps or cfg.train.num_epochs * (steps_per_epoch // cfg.train.grad_accum)
    if total < 1:
        raise ValueError(
            f"the data gives {steps_per_epoch} micro-batches per epoch per drafter rank, fewer than train.grad_accum={cfg.train.grad_accum}: add data, lower grad_accum or set train.max_steps."
        )
    return total


def exchange_reports(layout: SplitLayout, report: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's report to drafter rank 0 (one ``gather_object`` over all ranks); None elsewhere."""
    gathered = (
        [None] * (layout.num_target_ranks + layout.num_drafter_ranks)
        if layout.rank == layout.drafter_main
        else None
    )
    dist.gather_object(report, gathered, dst=layout.drafter_main)
    return gathered


# ----------------------------------------------------------------------------- target ranks


def run_target_rank(
    cfg: RunConfig, layout: SplitLayout, info: DistInfo, stream_group, hooks: SplitHooks
) -> dict[str, Any]:
    """Read the drafters' shards, run the truncated target forward, stream; vote every step."""
    from dflash_train.data.loader import TrainData, pad_token_id

    target = trainer.build_target(cfg, info)
    shared = share_data_info(cfg, layout, target)
    spe, total = shared["steps_per_epoch"], total_steps(cfg, shared["steps_per_epoch"])
    streams = [
        TrainData(
            shared["tokenized"],
            cfg.data,
            seed=cfg.train.seed,
            rank=d,
            world_size=layout.num_drafter_ranks,
            pad_id=pad_token_id(target.tokenizer),
        )
        for d in range(layout.num_drafter_ranks)
    ]
    start = [None]
    dist.broadcast_object_list(start, src=layout.drafter_main)  # resume point, decided by drafter rank 0
    start_step, start_micro = start[0]["step"], start[0]["micro"]
    grad_accum, lag = cfg.train.grad_accum, pipeline_depth(cfg.train.max_in_flight, cfg.train.grad_accum)
    sender = FeatureSender(
        cfg.train.max_in_flight, info.device, functools.partial(dist.isend, group=stream_group)
    )
    width = target.hidden_size * len(target.target_layer_ids)
    forward_s, control_s, produced, step = 0.0, 0.0, start_step, start_step

    def produce(step: int) -> float:
        jobs = []
        for k in range(grad_accum):
            m = step * grad_accum + k
            absolute = start_micro + (step - start_step) * grad_accum + k
            for d in (d for d in range(layout.num_drafter_ranks) if layout.producer(m, d) == layout.rank):
                batch = streams[d].batch_at(absolute // spe, absolute % spe)
                header = torch.tensor([step, k, *batch.shape, batch.epoch, width], dtype=torch.long)
                sender.send_batch(
                    layout.num_target_ranks + d, header.to(info.device), pack_batch(batch).to(info.device)
                )
                jobs.append((d, batch))
        forward = 0.0
        for d, batch in jobs:
            if hooks.before_target_forward:
                hooks.before_target_forward(layout.rank, step)
            t0 = time.perf_counter()
            features = target.features(batch.input_ids.to(info.device), batch.attention_mask.to(info.device))
            forward += time.perf_counter() - t0  # on CUDA this is launch time unless send waits sync it
            sender.send_features(layout.num_target_ranks + d, features.contiguous())
        return forward

    with (
        GracefulStop() as stop,
        Watchdog(
            cfg.train.watchdog_s, Path(cfg.output_dir) / f"watchdog-stacks-rank{layout.rank}.txt"
        ) as watchdog,
    ):
        for step in range(start_step, total):
            watchdog.beat(step)
            while produced < min(step + lag + 1, total):
                forward_s += produce(produced)
                produced += 1
            t0 = time.perf_counter()
            vote = stop.requested or bool(hooks.request_stop and hooks.request_stop(layout.rank, step))
            nonfinite, stopping = any_rank_flags([False, vote], info.device)  # the step's collective decision
            control_s += time.perf_counter() - t0
            if nonfinite and cfg.train.nonfinite == "stop":
                raise trainer.NonFiniteError(
                    f"step {step + 1}: a drafter rank saw a non-finite loss or gradient; stopping every rank (target rank {layout.rank})."
                )
            done = step + 1
            if report_step(cfg, done, total, stopping):
                state = data_state(start_micro + (done - start_step) * grad_accum, spe)
                exchange_reports(
                    layout,
                    {
                        "role": "target",
                        "busy_s": forward_s,
                        "send_wait_s": sender.wait_s,
                        "control_wait_s": control_s,
                        "bytes": sender.bytes,
                        "depth_sum": sender.depth_sum,
                        "depth_posts": sender.depth_posts,
                        "depth_max": sender.depth_max,
                        "data": state,
                    },
                )
                forward_s, control_s = 0.0, 0.0
                sender.reset_stats()
            if stopping:
                break
        sender.drain()  # the drafters drain what was sent beyond their last step
    return {
        "role": "target",
        "step": min(step + 1, total),
        "loss": float("nan"),
        "tau": None,
        "checkpoint": None,
        "export": None,
    }


# ----------------------------------------------------------------------------- drafter ranks


class StreamPosition:
    """The drafter's view of its data stream, which the target ranks read: position, epoch, stats.

    Stands in for ``TrainData`` in ``trainer.Run`` (``state_dict``/``load_state_dict``/``epoch``/
    ``log_stats``), so ``trainer.maybe_resume`` and checkpoints keep the colocated format: a split
    checkpoint resumes colocated with world size D and vice versa.
    """

    def __init__(self, steps_per_epoch: int, stats: dict[str, float]):
        self.steps_per_epoch, self.stats = steps_per_epoch, stats
        self.micro, self.epoch = 0, 0

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


@dataclass(frozen=True)
class _UnwrappedInfo(DistInfo):
    """``DistInfo`` that makes ``trainer.build_drafter`` return the bare module (we wrap it per group)."""

    @property
    def distributed(self) -> bool:
        return False


def build_target_head(cfg: RunConfig, info: DistInfo):
    """The frozen target without decoder layers: drafter ranks need its embedding, LM head, config."""
    from dflash_train.models.target import load_target

    target = load_target(cfg.target, "cpu")
    target.decoder.layers = nn.ModuleList()  # only the decoder's layers are dropped; num_layers is kept
    target.model.to(info.device)
    return target


def wrap_drafter_in_group(
    drafter: nn.Module, cfg: RunConfig, device: torch.device, group, group_size: int
) -> nn.Module:
    """``parallel.wrap_drafter`` over the drafter ranks only (DDP process group / FSDP2 mesh)."""
    if group_size == 1:
        return drafter  # as colocated with one process
    if cfg.train.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            drafter, device_ids=[device.index] if device.type == "cuda" else None, process_group=group
        )
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=trainer.DTYPES[cfg.train.dtype], reduce_dtype=torch.float32)
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(drafter, mesh=mesh, mp_policy=policy)
    return drafter


@dataclass
class DrafterContext:
    """What a drafter rank holds besides ``trainer.Run``: layout, group, receiver, lag."""

    layout: SplitLayout
    group: Any
    receiver: FeatureReceiver
    lag: int


def build_drafter_run(
    cfg: RunConfig, layout: SplitLayout, info: DistInfo, group, stream_group
) -> tuple[trainer.Run, DrafterContext]:
    head = build_target_head(cfg, info)
    shared = share_data_info(cfg, layout, head)
    local = DistInfo(
        rank=layout.drafter_index,
        world_size=layout.num_drafter_ranks,
        local_rank=info.local_rank,
        device=info.device,
    )
    draft_config, drafter = trainer.build_drafter(cfg, head, _UnwrappedInfo(**vars(local)))
    model = wrap_drafter_in_group(drafter, cfg, info.device, group, layout.num_drafter_ranks)
    optimizer = trainer.build_optimizer(model, cfg, local)
    total = total_steps(cfg, shared["steps_per_epoch"])
    scheduler = trainer.build_scheduler(optimizer, cfg, total)
    data = StreamPosition(shared["steps_per_epoch"], shared["log_stats"])
    gamma = cfg.train.gamma or default_gamma(cfg.drafter.block_size)
    run = trainer.Run(
        cfg=cfg,
        info=local,
        target=head,
        draft_config=draft_config,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        total_steps=total,
        gamma=gamma,
    )
    if local.is_main:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        cfg.to_yaml(Path(cfg.output_dir) / "config.yaml")
    trainer.maybe_resume(run)
    dist.broadcast_object_list([{"step": run.step, "micro": data.micro}], src=layout.drafter_main)
    receiver = FeatureReceiver(
        info.device,
        resolve_dtype(cfg.target.dtype),
        head.hidden_size * len(head.target_layer_ids),
        stream_group,
    )
    log_drafter(
        layout,
        f"split training: {total} steps, {layout.num_target_ranks} target : {layout.num_drafter_ranks} drafter ranks, device {info.device}",
    )
    return run, DrafterContext(
        layout, group, receiver, pipeline_depth(cfg.train.max_in_flight, cfg.train.grad_accum)
    )


def run_drafter_rank(
    cfg: RunConfig, layout: SplitLayout, info: DistInfo, group, stream_group, hooks: SplitHooks
) -> dict[str, Any]:
    """``trainer.train`` over the drafter group, with features received instead of computed."""
    run, ctx = build_drafter_run(cfg, layout, info, group, stream_group)
    out_dir = Path(cfg.output_dir)
    logger = MetricsLogger(
        out_dir,
        cfg.logging,
        total_steps=run.total_steps,
        is_main=run.info.is_main,
        config_dict=cfg.to_dict(),
        start_step=run.step,
    )
    timer = PhaseTimer(info.device)
    metrics_sum, last_loss, saved = None, float("nan"), None
    log_t0, log_step0, busy_s = time.perf_counter(), run.step, 0.0
    with GracefulStop() as stop, Watchdog(cfg.train.watchdog_s, out_dir / "watchdog-stacks.txt") as watchdog:
        while run.step < run.total_steps:
            watchdog.beat(run.step)
            t0, wait0 = time.perf_counter(), ctx.receiver.wait_s
            vote = stop.requested or bool(hooks.request_stop and hooks.request_stop(layout.rank, run.step))
            result = drafter_step(run, ctx, timer, hooks, stop_requested=vote)
            busy_s += time.perf_counter() - t0 - (ctx.receiver.wait_s - wait0)
            metrics_sum = add_metrics(metrics_sum, result["stats"])
            stopping = result["stop"]
            reports = None
            if report_step(cfg, run.step, run.total_steps, stopping):
                seconds = time.perf_counter() - log_t0
                reports = exchange_reports(
                    layout,
                    {
                        "role": "drafter",
                        "busy_s": busy_s,
                        "recv_wait_s": ctx.receiver.wait_s,
                        "bytes": ctx.receiver.bytes,
                        "seconds": seconds,
                    },
                )
                busy_s, ctx.receiver.wait_s, ctx.receiver.bytes = 0.0, 0.0, 0
            if run.step % cfg.logging.every_steps == 0 or run.step == run.total_steps or stopping:
                row = split_log_row(
                    run,
                    ctx,
                    result,
                    metrics_sum,
                    timer,
                    time.perf_counter() - log_t0,
                    run.step - log_step0,
                    reports,
                )
                last_loss = row["loss"]
                logger.log(run.step, row)
                metrics_sum, log_t0, log_step0 = None, time.perf_counter(), run.step
            logger.advance(run.step)
            if stopping or run.step % cfg.checkpoint.every_steps == 0 or run.step == run.total_steps:
                saved = save_split(run, ctx, reports)
            if stopping:
                drain(run, ctx)
                log_drafter(layout, f"stop requested: saved {saved} at step {run.step}; exiting")
                break
    export = export_split(run, ctx) if run.step >= run.total_steps else None
    logger.close()
    return {
        "role": "drafter",
        "step": run.step,
        "loss": last_loss,
        "tau": logger.last.get("tau"),
        "checkpoint": str(saved) if saved else None,
        "export": str(export) if export else None,
    }


def group_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over the drafter ranks (``parallel.all_reduce_sum`` over one group)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def receive_step(run: trainer.Run, ctx: DrafterContext, step: int) -> list[tuple[int, Batch]]:
    """(source rank, batch) of every micro-batch of ``step``, in micro order."""
    grad_accum, d = run.cfg.train.grad_accum, ctx.layout.drafter_index
    sources = [ctx.layout.producer(step * grad_accum + k, d) for k in range(grad_accum)]
    return [(src, ctx.receiver.recv_batch(src, step, k)) for k, src in enumerate(sources)]


def drafter_step(
    run: trainer.Run, ctx: DrafterContext, timer: PhaseTimer, hooks: SplitHooks, stop_requested: bool
) -> dict[str, Any]:
    """``trainer.train_step`` with received features and drafter-group reductions; same numbers."""
    cfg, info = run.cfg, run.info
    received = receive_step(run, ctx, run.step)
    micro = []
    for _, batch in received:
        micro.append(trainer.prepare_micro_batch(run, batch, batch.epoch))
        run.data.advance(batch.epoch)
    # The loss normalises by the weight of the whole optimizer step on every drafter rank.
    denom = group_sum(torch.stack([m["weights"].sum() for m in micro]).sum(), ctx.group)
    loss_total = torch.zeros((), device=info.device)
    stats_sum, flops = None, 0
    pending = ctx.receiver.post_features(*received[0])
    for i, m in enumerate(micro):
        with timer.phase("target"):  # here: waiting for the features, not computing them
            ctx.receiver.wait(pending[0])
            features = pending[1]
        if i + 1 < len(micro):
            pending = ctx.receiver.post_features(*received[i + 1])  # prefetch while this one trains
        with timer.phase("drafter"), trainer.no_sync_unless_last(run.model, i == len(micro) - 1):
            hidden = run.model(
                features,
                m["input_ids"],
                m["anchors"],
                m["keep"],
                run.target.embed_tokens,
                backend=trainer.resolve_backend(cfg, info),
                sdpa_anchor_chunk=cfg.train.sdpa_anchor_chunk,
            )
            loss, stats = dflash_loss(
                hidden.to(run.target.lm_head.weight.dtype),
                run.target.lm_head.weight,
                m["labels"],
                m["label_valid"],
                m["keep"],
                gamma=run.gamma,
                denom=denom,
                chunk_tokens=cfg.train.loss_chunk_tokens,
            )
            (
                loss * info.world_size
            ).backward()  # DDP/FSDP average over drafter ranks; the loss is a global sum
        loss_total += loss.detach()
        stats_sum = add_metrics(stats_sum, stats)
        stats_sum["real_tokens"] = stats_sum.get("real_tokens", 0) + m["attention_mask"].sum()
        flops += trainer.step_flops(run, m)
        del features, hidden
    if hooks.after_backward:
        hooks.after_backward(run)
    with timer.phase("optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.train.clip_grad_norm)
        if isinstance(grad_norm, DTensor):  # FSDP2: a replicated DTensor over the drafter mesh only
            grad_norm = grad_norm.full_tensor()
        loss_total = group_sum(loss_total, ctx.group)
        bad = ~torch.isfinite(loss_total) | ~torch.isfinite(grad_norm)
        # The one host sync of a step, over ALL ranks (targets vote too): non-finite, stop.
        nonfinite, stop = any_rank_flags([bad, stop_requested], info.device)
        if nonfinite:
            run.optimizer.zero_grad(set_to_none=True)
            trainer.handle_nonfinite(run, float(loss_total), float(grad_norm))
        else:
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.scheduler.step()
    run.step += 1
    if hooks.after_step:
        hooks.after_step(run)
    return {"loss": loss_total, "grad_norm": grad_norm, "stats": stats_sum, "flops": flops, "stop": stop}


def drain(run: trainer.Run, ctx: DrafterContext) -> None:
    """After a stop at step s, receive and drop what the targets had already sent (steps s..s+lag-1)."""
    for step in range(run.step, min(run.step + ctx.lag, run.total_steps)):
        for src, batch in receive_step(run, ctx, step):
            work, _ = ctx.receiver.post_features(src, batch)
            ctx.receiver.wait(work)


# ----------------------------------------------------------------------------- logging


def log_drafter(layout: SplitLayout, msg: str) -> None:
    """Print on drafter rank 0 (``log_main`` prints on global rank 0, a target rank here)."""
    if layout.rank == layout.drafter_main:
        print(msg, file=sys.stdout, flush=True)


def split_log_row(
    run: trainer.Run,
    ctx: DrafterContext,
    result: dict,
    metrics_sum: dict,
    timer: PhaseTimer,
    seconds: float,
    steps: int,
    reports,
) -> dict[str, Any]:
    """``trainer.log_metrics`` reduced over the drafter group, plus the split metrics."""
    for value in metrics_sum.values():
        group_sum(value, ctx.group)
    phases = timer.collect()
    real_tokens = float(metrics_sum["real_tokens"])
    steps = max(steps, 1)
    step_s = seconds / steps
    row = {
        "loss": float(result["loss"]),
        "lr": run.scheduler.get_last_lr()[0],
        "grad_norm": float(result["grad_norm"]),
        **summarize_metrics({k: v for k, v in metrics_sum.items() if k != "real_tokens"}),
        "tokens_per_s": real_tokens / max(seconds, 1e-9),
        "tokens_per_s_per_rank": real_tokens / max(seconds, 1e-9) / run.info.world_size,
        "step_s": step_s,
        "mfu": mfu(result["flops"], step_s) if run.info.device.type == "cuda" else 0.0,
        "time_recv_wait_s": phases.get("target", 0.0) / steps,
        "time_drafter_s": phases.get("drafter", 0.0) / steps,
        "time_optimizer_s": phases.get("optimizer", 0.0) / steps,
        "skipped_steps": run.counters["skipped_steps"],
        "epoch": run.data.epoch,
        **{f"data_{k}": v for k, v in run.data.log_stats().items()},
    }
    if reports is not None:
        row.update(split_metrics(reports))
        side = "target" if row["split_bottleneck"] else "drafter"
        log_drafter(
            ctx.layout,
            f"split step {run.step}: bottleneck {side} (target busy {row['split_target_busy_frac']:.0%}, drafter busy {row['split_drafter_busy_frac']:.0%}, queue depth max {row['split_queue_depth_max']})",
        )
    if run.info.device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(run.info.device) / 1e9
    return row


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


# ----------------------------------------------------------------------------- checkpoints


def full_drafter_state(model: nn.Module, optimizer, keep: bool) -> tuple[dict, dict]:
    """Full drafter (and optimizer) state on the CPU of the ranks with ``keep``; every drafter rank calls.

    ``parallel.full_model_state`` offloads to the CPU of *global* rank 0, a target rank here, so the
    drafter ranks gather on the device (FSDP2 all-gathers over the drafter mesh) and copy themselves.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    module = model if uses_fsdp(model) else unwrap(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model_state = get_model_state_dict(module, options=options)
    optim_state = (
        get_optimizer_state_dict(module, optimizer, options=options) if optimizer is not None else {}
    )
    if not keep:
        return {}, {}
    to_cpu = lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return tree_map(to_cpu, model_state), tree_map(to_cpu, optim_state)


def save_split(run: trainer.Run, ctx: DrafterContext, reports) -> Path:
    """``trainer.save`` over the drafter group; the target ranks' data positions must agree with ours."""
    model_state, optim_state = full_drafter_state(run.model, run.optimizer, keep=run.info.is_main)
    path = ckpt.checkpoints_root(run.cfg.output_dir) / f"step-{run.step:08d}"
    if run.info.is_main:
        positions = [r["data"] for r in reports if r["role"] == "target"]
        if any(p != run.data.state_dict() for p in positions):
            raise RuntimeError(
                f"split data positions disagree at step {run.step}: drafter {run.data.state_dict()}, target ranks {positions}"
            )
        train_state = {
            "step": run.step,
            "optimizer": optim_state,
            "scheduler": run.scheduler.state_dict(),
            "data": run.data.state_dict(),
            "split": {
                "target_ranks": ctx.layout.num_target_ranks,
                "drafter_ranks": ctx.layout.num_drafter_ranks,
                "target_data": positions,
            },
            "counters": dict(run.counters),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        path = ckpt.save_checkpoint(
            run.cfg.output_dir,
            run.step,
            drafter_state=model_state,
            drafter_config=run.draft_config.to_serving_dict(),
            train_state=train_state,
            config_yaml=run.cfg.to_yaml(),
            keep_last=run.cfg.checkpoint.keep_last,
        )
    dist.barrier(group=ctx.group)
    return path


def export_split(run: trainer.Run, ctx: DrafterContext) -> Path:
    """``trainer.export_final`` with a drafter-group barrier."""
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.export import save_drafter

    state, _ = full_drafter_state(run.model, None, keep=run.info.is_main)
    out = Path(run.cfg.output_dir) / "export"
    if run.info.is_main:
        drafter = DFlashDrafter(run.draft_config)
        drafter.load_state_dict(state)
        save_drafter(drafter, run.draft_config, out, dtype=run.cfg.train.dtype)
    dist.barrier(group=ctx.group)
    return out
