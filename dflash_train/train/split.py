"""Split placement: dedicated target ranks stream features to drafter ranks (DESIGN.md §2).

One torchrun job, one process per GPU, no threads doing device work. The first T ranks
(``train.target_ranks``) run only the frozen target; the other D ranks train the drafter exactly
as colocated training with world size D would: same data shards, same anchors, same loss
normalisation, so the same per-step losses (bit-exact on CPU). What crosses between the two roles
(layout, batches, features, back-pressure, reports) is ``train/split_stream.py``; this module
holds what each role does.

Control. Every step ends with one all-reduce over ALL ranks (``any_rank_flags`` on the default
group): non-finite (drafters), stop requested (any rank). Target ranks join the vote of step s
after producing step s + lag, so stop/raise/save decisions are collective and nobody hangs; a
header-borne stop flag could only flow target -> drafter. On a stop the drafters drain what the
targets already sent. On log and save steps every rank reports to drafter rank 0, which checks the
target ranks' data positions against its own before writing the checkpoint (one folder, one
commit marker). Drafter rank 0 is also the rank that logs (``logging.set_main_rank``).

Legend: T target ranks, D drafter ranks, M micro-batches per optimizer step (``train.grad_accum``).
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_train.config import RunConfig
from dflash_train.data.batching import Batch
from dflash_train.models.target import resolve_dtype
from dflash_train.train import builders, trainer
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.faults import GracefulStop, Watchdog, any_rank_flags
from dflash_train.train.logging import MetricsLogger, log_main, set_main_rank
from dflash_train.train.loss import add_metrics
from dflash_train.train.parallel import (
    DistInfo,
    full_model_state,
    full_optimizer_state,
    init_distributed,
    use_expandable_segments,
    wrap_drafter,
)
from dflash_train.train.split_stream import (
    FeatureReceiver,
    FeatureSender,
    SplitLayout,
    StreamPosition,
    data_state,
    exchange_reports,
    pack_batch,
    pipeline_depth,
    report_step,
    share_data_info,
    split_metrics,
    total_steps,
)
from dflash_train.train.step_timer import PhaseTimer


@dataclass
class SplitHooks(trainer.TrainHooks):
    """``TrainHooks`` plus split-only seams: injected faults and stop votes."""

    # (global rank, step index) -> raise inside the target forward loop (tests a crashing rank).
    before_target_forward: Callable[[int, int], None] | None = None
    # (global rank, step index) -> True votes "stop" at that step, as a SIGTERM on that rank would.
    request_stop: Callable[[int, int], bool] | None = None


# ----------------------------------------------------------------------------- entry point


def train_split(cfg: RunConfig, hooks: trainer.TrainHooks | None = None) -> dict[str, Any]:
    """``train.placement: split``: target ranks stream features, drafter ranks train (one torchrun job)."""
    hooks = hooks if isinstance(hooks, SplitHooks) else SplitHooks(**vars(hooks or trainer.TrainHooks()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    SplitLayout.create(cfg.train.target_ranks, world, int(os.environ.get("RANK", "0")))  # fail before joining
    pipeline_depth(cfg.train.max_in_flight, cfg.train.grad_accum)
    use_expandable_segments()
    info = init_distributed(cfg.train.device, timeout_s=cfg.train.dist_timeout_s)
    layout = SplitLayout.create(cfg.train.target_ranks, info.world_size, info.rank)
    timeout = datetime.timedelta(seconds=cfg.train.dist_timeout_s)
    # new_group is collective: every rank calls it, target ranks included.
    drafter_group = dist.new_group(list(range(layout.num_target_ranks, info.world_size)), timeout=timeout)
    # The stream gets its own communicator: on NCCL a pending send would otherwise sit in front of
    # the step vote on the default group's stream, and the vote is what lets the receiver progress.
    stream_group = dist.new_group(list(range(info.world_size)), timeout=timeout)
    builders.seed_everything(cfg.train.seed)
    previous = set_main_rank(layout.drafter_main)  # global rank 0 is a target rank: it has no metrics
    try:
        if layout.is_target:
            return run_target_rank(cfg, layout, info, stream_group, hooks)
        return run_drafter_rank(cfg, layout, info, drafter_group, stream_group, hooks)
    finally:
        set_main_rank(previous)


# ----------------------------------------------------------------------------- target ranks


def run_target_rank(
    cfg: RunConfig, layout: SplitLayout, info: DistInfo, stream_group, hooks: SplitHooks
) -> dict[str, Any]:
    """Read the drafters' shards, run the truncated target forward, stream; vote every step."""
    from dflash_train.data.loader import TrainData, pad_token_id

    target = builders.build_target(cfg, info)
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
                report = {"role": "target", "busy_s": forward_s, "control_wait_s": control_s, "data": state}
                exchange_reports(layout, {**report, **sender.take_stats()})
                forward_s, control_s = 0.0, 0.0
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


@dataclass(frozen=True)
class _UnwrappedInfo(DistInfo):
    """``DistInfo`` that makes ``builders.build_drafter`` return the bare module (wrapped per group later)."""

    @property
    def distributed(self) -> bool:
        return False


def build_target_head(cfg: RunConfig, info: DistInfo):
    """The frozen target without decoder layers: drafter ranks need its embedding, LM head, config."""
    from dflash_train.models.target import load_target_head

    return load_target_head(cfg.target, info.device)


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
    draft_config, drafter = builders.build_drafter(cfg, head, _UnwrappedInfo(**vars(local)))
    model = wrap_drafter(drafter, cfg.train.parallel, trainer.DTYPES[cfg.train.dtype], local, group=group)
    optimizer = builders.build_optimizer(model, cfg, local)
    total = total_steps(cfg, shared["steps_per_epoch"])
    scheduler = builders.build_scheduler(optimizer, cfg, total)
    data = StreamPosition(shared["steps_per_epoch"], shared["log_stats"])
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
    log_main(
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
                report = {"role": "drafter", "busy_s": busy_s, "seconds": time.perf_counter() - log_t0}
                reports = exchange_reports(layout, {**report, **ctx.receiver.take_stats()})
                busy_s = 0.0
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
                log_main(f"stop requested: saved {saved} at step {run.step}; exiting")
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


def receive_step(run: trainer.Run, ctx: DrafterContext, step: int) -> list[tuple[int, Batch]]:
    """(source rank, batch) of every micro-batch of ``step``, in micro order."""
    grad_accum, d = run.cfg.train.grad_accum, ctx.layout.drafter_index
    sources = [ctx.layout.producer(step * grad_accum + k, d) for k in range(grad_accum)]
    return [(src, ctx.receiver.recv_batch(src, step, k)) for k, src in enumerate(sources)]


def drafter_step(
    run: trainer.Run, ctx: DrafterContext, timer: PhaseTimer, hooks: SplitHooks, stop_requested: bool
) -> dict[str, Any]:
    """``trainer.train_step`` with received features and drafter-group reductions; same numbers."""
    received = receive_step(run, ctx, run.step)
    micro = []
    for _, batch in received:
        micro.append(trainer.prepare_micro_batch(run, batch, batch.epoch))
        run.data.advance(batch.epoch)
    denom = trainer.step_denominator(micro, ctx.group)
    loss_total, stats_sum, flops = torch.zeros((), device=run.info.device), None, 0
    pending = ctx.receiver.post_features(*received[0])
    for i, m in enumerate(micro):
        with timer.phase("target"):  # here: waiting for the features, not computing them
            ctx.receiver.wait(pending[0])
            features = pending[1]
        if i + 1 < len(micro):
            pending = ctx.receiver.post_features(*received[i + 1])  # prefetch while this one trains
        last = i == len(micro) - 1
        loss, stats = trainer.drafter_forward_backward(run, timer, m, features, denom, last)
        loss_total += loss
        stats_sum = add_metrics(stats_sum, stats)
        flops += trainer.step_flops(run, m)
        del features
    if hooks.after_backward:
        hooks.after_backward(run)
    # The vote inside covers ALL ranks (the target ranks vote too); the loss sums over drafters only.
    result = trainer.optimizer_update(run, timer, loss_total, stop_requested, group=ctx.group)
    if hooks.after_step:
        hooks.after_step(run)
    return {**result, "stats": stats_sum, "flops": flops}


def drain(run: trainer.Run, ctx: DrafterContext) -> None:
    """After a stop at step s, receive and drop what the targets had already sent (steps s..s+lag-1)."""
    for step in range(run.step, min(run.step + ctx.lag, run.total_steps)):
        for src, batch in receive_step(run, ctx, step):
            work, _ = ctx.receiver.post_features(src, batch)
            ctx.receiver.wait(work)


# ----------------------------------------------------------------------------- logging and checkpoints


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
    row = trainer.log_metrics(run, result, metrics_sum, timer, seconds, steps, group=ctx.group)
    # A drafter rank's "target" phase is waiting for the features, not computing them.
    row = {("time_recv_wait_s" if k == "time_target_s" else k): v for k, v in row.items()}
    if reports is not None:
        row.update(split_metrics(reports))
        side = "target" if row["split_bottleneck"] else "drafter"
        log_main(
            f"split step {run.step}: bottleneck {side} (target busy {row['split_target_busy_frac']:.0%}, drafter busy {row['split_drafter_busy_frac']:.0%}, queue depth max {row['split_queue_depth_max']})",
        )
    return row


def save_split(run: trainer.Run, ctx: DrafterContext, reports) -> Path:
    """``trainer.save`` over the drafter group; the target ranks' data positions must agree with ours."""
    model_state = full_model_state(run.model, group=ctx.group)  # on drafter rank 0's CPU, {} elsewhere
    optim_state = full_optimizer_state(run.model, run.optimizer, group=ctx.group)
    path = ckpt.checkpoints_root(run.cfg.output_dir) / f"step-{run.step:08d}"
    if run.info.is_main:
        positions = [r["data"] for r in reports if r["role"] == "target"]
        if any(p != run.data.state_dict() for p in positions):
            raise RuntimeError(
                f"split data positions disagree at step {run.step}: drafter {run.data.state_dict()}, target ranks {positions}"
            )
        split = {
            "target_ranks": ctx.layout.num_target_ranks,
            "drafter_ranks": ctx.layout.num_drafter_ranks,
            "target_data": positions,
        }
        train_state = trainer.train_state_dict(run, optim_state, split=split)
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

    state = full_model_state(run.model, group=ctx.group)
    out = Path(run.cfg.output_dir) / "export"
    if run.info.is_main:
        drafter = DFlashDrafter(run.draft_config)
        drafter.load_state_dict(state)
        save_drafter(
            drafter,
            run.draft_config,
            out,
            dtype=run.cfg.train.dtype,
            target=run.cfg.target.path,
            announce=True,
        )
    dist.barrier(group=ctx.group)
    return out
