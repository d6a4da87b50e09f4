"""Split placement: dedicated target ranks stream features to drafter ranks (DESIGN.md §2).

One torchrun job, one process per GPU, no threads doing device work. The first T ranks
(``train.target_ranks``) run only the frozen target; the other D ranks train the drafter exactly
as colocated training with world size D would: same data shards, same anchors, same loss
normalisation, the same step functions (``train/step.py``) and the same save / resume / export
(``train/saves.py``, ``train/run.py``), so the same per-step losses (bit-exact on CPU) and the same checkpoints. What
crosses between the two roles (layout, batches, features, back-pressure, reports) is
``train/split_stream.py``; this module holds what each role does.

Control. Every step ends with one all-reduce over ALL ranks (``any_rank_flags`` on the default
group): non-finite (drafters), stop requested (any rank). Target ranks join the vote of step s
after producing step s + lag, so stop/raise/save decisions are collective and nobody hangs; a
header-borne stop flag could only flow target -> drafter. On a stop the drafters drain what the
targets already sent. On log and save steps every rank reports to drafter rank 0, which checks the
target ranks' data positions against its own before writing the checkpoint (one folder, one
commit marker); the verdict is one more all-ranks vote, so on a mismatch every rank stops with the
same line before the save. Drafter rank 0 is also the rank that logs (``logging.set_main_rank``).
Start-up votes the same way: what only one role builds (the target; the drafter, its metrics log)
is voted on where the roles next meet (``split_stream.starting_up_together``).

Saves. Only the drafter ranks write (their votes run over the drafter group), but every rank learns
the outcome: after each save, and after the loop (the last save's background commit), one more
all-ranks vote (``share_save_outcome``), so on a failed save the target ranks raise the drafters'
one-line ``CheckpointWriteError`` with them instead of waiting in the next step's vote.

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
from dflash_train.models.dtypes import resolve_dtype
from dflash_train.train import builders
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.faults import GracefulStop, Watchdog, any_rank_flags, report_deferred_stop
from dflash_train.train.logging import log_main, set_main_rank
from dflash_train.train.loss import add_metrics
from dflash_train.train.parallel import DistInfo, init_distributed, use_expandable_segments
from dflash_train.train.run import (
    NonFiniteError,
    Run,
    TrainHooks,
    attempt,
    export_final,
    maybe_resume,
    open_logger,
    run_info_failure,
    run_result,
    save_due,
    save_due_at,
    total_steps,
    write_run_info,
)
from dflash_train.train.saves import close_after_failure
from dflash_train.train.split_saves import save_with_targets, settle_with_targets
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
    share_position_check,
    share_resume_outcome,
    share_save_outcome,
    share_startup_outcome,
    split_metrics,
    starting_up_together,
)
from dflash_train.train.step import (
    LogWindow,
    drafter_forward_backward,
    optimizer_update,
    prepare_micro_batch,
    step_denominator,
    step_flops,
    target_features,
)
from dflash_train.train.step_timer import PhaseTimer


@dataclass
class SplitHooks(TrainHooks):
    """``TrainHooks`` plus split-only seams: injected faults and stop votes."""

    # (global rank, step index) -> raise inside the target forward loop (tests a crashing rank).
    before_target_forward: Callable[[int, int], None] | None = None
    # (global rank, step index) -> True votes "stop" at that step, as a SIGTERM on that rank would.
    request_stop: Callable[[int, int], bool] | None = None


# ----------------------------------------------------------------------------- entry point


def train_split(cfg: RunConfig, hooks: TrainHooks | None = None) -> dict[str, Any]:
    """``train.placement: split``: target ranks stream features, drafter ranks train (one torchrun job)."""
    hooks = hooks if isinstance(hooks, SplitHooks) else SplitHooks(**vars(hooks or TrainHooks()))
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


def stop_vote(stop: GracefulStop, hooks: SplitHooks, rank: int, step: int) -> bool:
    """This rank's "stop" vote for ``step``: a SIGTERM received, or the test hook asking for one."""
    return stop.requested or bool(hooks.request_stop and hooks.request_stop(rank, step))


# ----------------------------------------------------------------------------- target ranks


def run_target_rank(
    cfg: RunConfig, layout: SplitLayout, info: DistInfo, stream_group, hooks: SplitHooks
) -> dict[str, Any]:
    """Read the drafters' shards, run the truncated target forward, stream; vote every step."""
    producer = FeatureProducer(cfg, layout, info, stream_group, hooks)
    share_startup_outcome(layout, None)  # the drafter ranks opened their metrics log: the stream starts
    # A SIGTERM after the loop waits for the last save's outcome, as on the drafter ranks: killed
    # there, this rank would fail the drafters' commit and export on a lost peer.
    with GracefulStop() as late:
        step = run_target_loop(cfg, layout, info, producer, hooks)
        share_save_outcome(layout, info.device, None)  # the last save's commit (background) went through
    report_deferred_stop(late, "the drafter ranks' final checkpoint and export were written first")
    return {
        "role": "target",
        "step": min(step + 1, producer.total),
        "loss": float("nan"),
        "tau": None,
        "checkpoint": None,
        "export": None,
    }


def run_target_loop(
    cfg: RunConfig, layout: SplitLayout, info: DistInfo, producer: FeatureProducer, hooks: SplitHooks
) -> int:
    """Produce, vote and take part in each save until the last step or a stop; return the last step index."""
    step, total = producer.start_step, producer.total
    stacks = Path(cfg.output_dir) / f"watchdog-stacks-rank{layout.rank}.txt"
    with GracefulStop() as stop, Watchdog(cfg.train.watchdog_s, stacks) as watchdog:
        for step in range(producer.start_step, total):
            watchdog.beat(step)
            producer.run_ahead_of(step)
            t0 = time.perf_counter()
            vote = stop_vote(stop, hooks, layout.rank, step)
            nonfinite, stopping = any_rank_flags([False, vote], info.device)  # the step's collective decision
            producer.control_s += time.perf_counter() - t0
            if nonfinite and cfg.train.nonfinite == "stop":
                raise NonFiniteError(
                    f"step {step + 1}: a drafter rank saw a non-finite loss or gradient; stopping every rank (target rank {layout.rank})."
                )
            if report_step(cfg, step + 1, total, stopping):
                exchange_reports(layout, producer.report(step + 1))
            if save_due_at(cfg, step + 1, total, stopping):  # the drafters save after this step
                share_position_check(layout, info.device, None)
                share_save_outcome(layout, info.device, None)
            if stopping:
                break
        producer.sender.drain()  # the drafters drain what was sent beyond their last step
    return step


class FeatureProducer:
    """A target rank's side of the stream: the drafters' data shards, the target and the sender.

    ``run_ahead_of(step)`` produces every step up to ``step + lag`` (the pipeline depth), so a
    target rank works ahead of the drafters by at most ``train.max_in_flight`` feature messages.
    """

    def __init__(self, cfg: RunConfig, layout: SplitLayout, info: DistInfo, stream_group, hooks: SplitHooks):
        from dflash_train.data.loader import TrainData, pad_token_id

        self.cfg, self.layout, self.info, self.hooks = cfg, layout, info, hooks
        with starting_up_together(layout):  # the drafter ranks load the target's head meanwhile
            self.target = builders.build_target(cfg, info)
        shared = share_data_info(cfg, layout, self.target)
        self.steps_per_epoch = shared["steps_per_epoch"]
        total_steps(cfg, self.steps_per_epoch)  # too little data fails here, as on the drafter ranks
        with starting_up_together(layout):  # the drafter ranks build the drafter meanwhile
            self.streams = [
                TrainData(
                    shared["tokenized"],
                    cfg.data,
                    seed=cfg.train.seed,
                    rank=d,
                    world_size=layout.num_drafter_ranks,
                    pad_id=pad_token_id(self.target.tokenizer),
                )
                for d in range(layout.num_drafter_ranks)
            ]
        share_resume_outcome(layout, None)  # raises with the drafter ranks if they could not resume
        start = [None]
        dist.broadcast_object_list(start, src=layout.drafter_main)  # resume point, decided by drafter rank 0
        if start[0]["run_info_error"] is not None:  # the drafter ranks raise the same
            raise run_info_failure(cfg.output_dir, start[0]["run_info_error"])
        self.start_step, self.start_micro = start[0]["step"], start[0]["micro"]
        self.total = start[0]["total"]  # a resume keeps the length the checkpoint's run planned
        self.produced = self.start_step
        self.lag = pipeline_depth(cfg.train.max_in_flight, cfg.train.grad_accum)
        self.sender = FeatureSender(
            cfg.train.max_in_flight, info.device, functools.partial(dist.isend, group=stream_group)
        )
        self.width = self.target.hidden_size * len(self.target.target_layer_ids)
        self.forward_s, self.control_s = 0.0, 0.0

    def run_ahead_of(self, step: int) -> None:
        """Produce every step not produced yet up to ``step + lag``."""
        while self.produced < min(step + self.lag + 1, self.total):
            self.forward_s += self.produce(self.produced)
            self.produced += 1

    def produce(self, step: int) -> float:
        """Send the batches of ``step`` this rank owns, then their features; returns the forward time."""
        grad_accum, jobs = self.cfg.train.grad_accum, []
        for k in range(grad_accum):
            m = step * grad_accum + k
            absolute = self.micro_index(step, k)
            for d in range(self.layout.num_drafter_ranks):
                if self.layout.producer(m, d) != self.layout.rank:
                    continue
                batch = self.streams[d].batch_at(
                    absolute // self.steps_per_epoch, absolute % self.steps_per_epoch
                )
                header = torch.tensor([step, k, *batch.shape, batch.epoch, self.width], dtype=torch.long)
                dst = self.layout.num_target_ranks + d
                self.sender.send_batch(
                    dst, header.to(self.info.device), pack_batch(batch).to(self.info.device)
                )
                jobs.append((dst, batch))
        forward = 0.0
        for dst, batch in jobs:
            if self.hooks.before_target_forward:
                self.hooks.before_target_forward(self.layout.rank, step)
            t0 = time.perf_counter()
            features = target_features(self.target, batch.input_ids.to(self.info.device))
            forward += time.perf_counter() - t0  # on CUDA this is launch time unless send waits sync it
            self.sender.send_features(dst, features.contiguous())
        return forward

    def micro_index(self, step: int, micro: int) -> int:
        """Absolute index (over epochs) of micro-batch ``micro`` of ``step`` in every drafter's stream."""
        return self.start_micro + (step - self.start_step) * self.cfg.train.grad_accum + micro

    def report(self, done: int) -> dict[str, Any]:
        """This rank's report after ``done`` steps: busy and waiting time, send stats, data position."""
        state = data_state(self.micro_index(done, 0), self.steps_per_epoch)
        report = {"role": "target", "busy_s": self.forward_s, "control_wait_s": self.control_s, "data": state}
        self.forward_s, self.control_s = 0.0, 0.0
        return {**report, **self.sender.take_stats()}


# ----------------------------------------------------------------------------- drafter ranks


@dataclass
class DrafterContext:
    """What a drafter rank holds besides ``Run``: layout, receiver, lag."""

    layout: SplitLayout
    receiver: FeatureReceiver
    lag: int


def run_drafter_rank(
    cfg: RunConfig, layout: SplitLayout, info: DistInfo, group, stream_group, hooks: SplitHooks
) -> dict[str, Any]:
    """Colocated training over the drafter group, with features received instead of computed."""
    run, ctx = build_drafter_run(cfg, layout, info, group, stream_group)
    if run.owed_eval_step is not None:  # a colocated checkpoint's; split evaluates nothing (no eval.prompts)
        log_main(
            f"split placement runs no held-out evaluation: the one owed at step {run.owed_eval_step} is not run"
        )
        run.owed_eval_step = None  # else the run never counts as finished, and every checkpoint owes it
    with starting_up_together(layout):  # else the target ranks would wait for it in their first step
        logger = open_logger(run)
    timer, window = PhaseTimer(info.device), LogWindow(run.step)
    last_loss, saved, busy_s = float("nan"), None, 0.0
    stacks = Path(cfg.output_dir) / "watchdog-stacks.txt"
    # The logger is closed on the way out, also when the run fails. A SIGTERM after the loop must not
    # cut the last checkpoint's commit or the export in half: it is deferred until both are written.
    with logger, GracefulStop() as late:
        try:
            with GracefulStop() as stop, Watchdog(cfg.train.watchdog_s, stacks) as watchdog:
                while run.step < run.total_steps:
                    watchdog.beat(run.step)
                    t0, wait0 = time.perf_counter(), ctx.receiver.wait_s
                    vote = stop_vote(stop, hooks, layout.rank, run.step)
                    result = drafter_step(run, ctx, timer, hooks, stop_requested=vote)
                    busy_s += time.perf_counter() - t0 - (ctx.receiver.wait_s - wait0)
                    window.add(result)
                    stopping, reports = result["stop"], None
                    if report_step(cfg, run.step, run.total_steps, stopping):
                        report = {"role": "drafter", "busy_s": busy_s, "seconds": window.seconds()}
                        reports, busy_s = (
                            exchange_reports(layout, {**report, **ctx.receiver.take_stats()}),
                            0.0,
                        )
                    if window.due(run, stopping):
                        row = split_log_row(run, result, window, timer, reports)
                        last_loss = row["loss"]
                        logger.log(run.step, row)
                    logger.advance(run.step)
                    if save_due(run, stopping):
                        saved = save_with_targets(run, ctx.layout, reports)
                    if stopping:
                        drain(run, ctx)
                        log_main(f"stop requested: saved {saved} at step {run.step}; exiting")
                        break
            settle_with_targets(run, ctx.layout)  # the last save's failure, if any, stops every rank here
        except BaseException:
            close_after_failure(run)  # the loop's error stays the one raised
            raise
        run.writer.close()  # the last checkpoint is committed before the export and the exit
        export = export_final(run) if run.step >= run.total_steps else None
    report_deferred_stop(late)
    return {"role": "drafter", **run_result(run, logger, last_loss, saved, export)}


def build_drafter_run(
    cfg: RunConfig, layout: SplitLayout, info: DistInfo, group, stream_group
) -> tuple[Run, DrafterContext]:
    """The drafter rank's ``Run`` over the drafter group (resumed if a checkpoint exists) and its stream."""
    from dflash_train.models.target import load_target_head

    with starting_up_together(layout):  # the target ranks build the target meanwhile
        head = load_target_head(cfg.target, info.device)  # the embedding, LM head and config only
    shared = share_data_info(cfg, layout, head)
    total = total_steps(cfg, shared["steps_per_epoch"])  # too little data fails here, as on the target ranks
    with starting_up_together(layout):  # the target ranks open the drafters' data streams meanwhile
        run = new_drafter_run(cfg, layout, info, group, head, shared, total)
    error = None
    try:
        maybe_resume(run)  # may keep another length: the one the checkpoint's run was planned with
    except Exception as err:  # recovery boundary: every rank must learn that the resume failed
        error = err
    share_resume_outcome(layout, error)
    error = None
    if run.info.is_main:
        error = attempt(
            lambda: write_run_info(
                run,
                placement="split",
                target_kernels=shared["target_kernels"],  # what target rank 0 bound, not the head's
                world_size=info.world_size,
                target_ranks=layout.num_target_ranks,
                drafter_ranks=layout.num_drafter_ranks,
            )
        )
    start = {"step": run.step, "micro": run.data.micro, "total": run.total_steps}
    start["run_info_error"] = None if error is None else f"{type(error).__name__}: {error}"
    box = [start]
    dist.broadcast_object_list(box, src=layout.drafter_main)  # every rank learns whether it was written
    if box[0]["run_info_error"] is not None:
        raise run_info_failure(cfg.output_dir, box[0]["run_info_error"]) from error
    width = head.hidden_size * len(head.target_layer_ids)
    receiver = FeatureReceiver(info.device, resolve_dtype(cfg.target.dtype), width, stream_group)
    log_main(
        f"split training: {run.total_steps} steps, {layout.num_target_ranks} target : {layout.num_drafter_ranks} drafter ranks, device {info.device}",
    )
    return run, DrafterContext(
        layout, receiver, pipeline_depth(cfg.train.max_in_flight, cfg.train.grad_accum)
    )


def new_drafter_run(
    cfg: RunConfig, layout: SplitLayout, info: DistInfo, group, head, shared: dict[str, Any], total: int
) -> Run:
    """The drafter rank's ``Run`` at step 0: drafter, optimizer and schedule over the drafter group."""
    local = DistInfo(
        rank=layout.drafter_index,
        world_size=layout.num_drafter_ranks,
        local_rank=info.local_rank,
        device=info.device,
    )
    draft_config, drafter = builders.new_drafter(cfg, head, local)
    model = builders.wrap_for_training(cfg, drafter, local, group=group)
    optimizer = builders.build_optimizer(model, cfg, local)
    data = StreamPosition(
        shared["steps_per_epoch"],
        shared["log_stats"],
        shared["batches_per_epoch"],
        shared["file_fingerprints"],
    )
    return Run(
        cfg=cfg,
        info=local,
        target=head,
        draft_config=draft_config,
        model=model,
        optimizer=optimizer,
        scheduler=builders.build_scheduler(optimizer, cfg, total),
        data=data,
        total_steps=total,
        group=group,
        writer=ckpt.CheckpointWriter.for_run(cfg.checkpoint, local.device),
    )


def receive_step(run: Run, ctx: DrafterContext, step: int) -> list[tuple[int, Batch]]:
    """(source rank, batch) of every micro-batch of ``step``, in micro order."""
    grad_accum, d = run.cfg.train.grad_accum, ctx.layout.drafter_index
    sources = [ctx.layout.producer(step * grad_accum + k, d) for k in range(grad_accum)]
    return [(src, ctx.receiver.recv_batch(src, step, k)) for k, src in enumerate(sources)]


def drafter_step(
    run: Run, ctx: DrafterContext, timer: PhaseTimer, hooks: SplitHooks, stop_requested: bool
) -> dict[str, Any]:
    """The colocated ``train_step`` with received features and drafter-group reductions; same numbers."""
    received = receive_step(run, ctx, run.step)
    micro = []
    for _, batch in received:
        micro.append(prepare_micro_batch(run, batch, batch.epoch))
        run.data.advance(batch.epoch)
    denom = step_denominator(micro, run.group)
    loss_total, stats_sum, flops = torch.zeros((), device=run.info.device), None, 0
    pending = ctx.receiver.post_features(*received[0])
    for i, m in enumerate(micro):
        with timer.phase("target"):  # here: waiting for the features, not computing them
            ctx.receiver.wait(pending[0])
            features = pending[1]
        if i + 1 < len(micro):
            pending = ctx.receiver.post_features(*received[i + 1])  # prefetch while this one trains
        loss, stats = drafter_forward_backward(run, timer, m, features, denom, last=i == len(micro) - 1)
        loss_total += loss
        stats_sum = add_metrics(stats_sum, stats)
        flops += step_flops(run, m)
        del features
    if hooks.after_backward:
        hooks.after_backward(run)
    # The vote inside covers ALL ranks (the target ranks vote too); the loss sums over drafters only.
    result = optimizer_update(run, timer, loss_total, stop_requested, denom)
    if hooks.after_step:
        hooks.after_step(run)
    return {**result, "stats": stats_sum, "flops": flops}


def drain(run: Run, ctx: DrafterContext) -> None:
    """After a stop at step s, receive and drop what the targets had already sent (steps s..s+lag-1)."""
    for step in range(run.step, min(run.step + ctx.lag, run.total_steps)):
        for src, batch in receive_step(run, ctx, step):
            work, _ = ctx.receiver.post_features(src, batch)
            ctx.receiver.wait(work)


# ----------------------------------------------------------------------------- logging


def split_log_row(run: Run, result: dict, window: LogWindow, timer: PhaseTimer, reports) -> dict[str, Any]:
    """The colocated log row reduced over the drafter group, plus the split metrics."""
    row = window.row(run, result, timer)
    # A drafter rank's "target" phase is waiting for the features, not computing them.
    row = {("time_recv_wait_s" if k == "time_target_s" else k): v for k, v in row.items()}
    if reports is not None:
        row.update(split_metrics(reports))
        side = "target" if row["split_bottleneck"] else "drafter"
        log_main(
            f"split step {run.step}: bottleneck {side} (target busy {row['split_target_busy_frac']:.0%}, drafter busy {row['split_drafter_busy_frac']:.0%}, queue depth max {row['split_queue_depth_max']})",
        )
    return row
