"""Colocated training (the default placement): every rank runs the frozen target and the drafter.

One process per GPU (or one CPU process), one thread doing all device work. ``train_colocated``
builds the run, then loops over optimizer steps: step, log, save. Every decision that changes
control flow (stop on SIGTERM, stop on a non-finite loss) is taken by all ranks together through
one small all-reduce per step (``step.optimizer_update``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_train.config import RunConfig
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.builders import (
    build_data,
    build_optimizer,
    build_scheduler,
    build_target,
    new_drafter,
    seed_everything,
    wrap_for_training,
)
from dflash_train.train.faults import GracefulStop, Watchdog, failing_together, report_deferred_stop
from dflash_train.train.heldout_eval import build_heldout_eval
from dflash_train.train.heldout_eval import evaluate as evaluate_heldout
from dflash_train.train.logging import MetricsLogger, log_main
from dflash_train.train.loss import add_metrics
from dflash_train.train.parallel import DistInfo, init_distributed, unwrap, use_expandable_segments
from dflash_train.train.run import (
    Run,
    TrainHooks,
    export_final,
    maybe_resume,
    open_logger,
    record_run_info,
    run_result,
    save_due,
    total_steps,
)
from dflash_train.train.saves import close_after_failure, save, settle_saves
from dflash_train.train.sitting import Sitting, append_sitting, stop_message
from dflash_train.train.step import (
    LogWindow,
    drafter_forward_backward,
    optimizer_update,
    prepare_micro_batch,
    step_denominator,
    step_flops,
    target_pass,
)
from dflash_train.train.step_timer import PhaseTimer


def train_colocated(cfg: RunConfig, hooks: TrainHooks) -> dict[str, Any]:
    """Build the run, then loop over optimizer steps until done, stopped or failed."""
    clock = hooks.clock or time.monotonic
    started = clock()  # the sitting's time limit counts the build and the resume too
    use_expandable_segments()
    info = init_distributed(cfg.train.device, timeout_s=cfg.train.dist_timeout_s)
    run = build_run(cfg, info)
    logger = open_logger(run)
    with logger:  # closed on the way out, also when the run fails
        sitting = Sitting.begin(run, started, clock)
        # A SIGTERM after the loop (the run's last step done) must not cut the last checkpoint's commit
        # or the export in half: it is deferred until both are written, then the run exits as usual.
        with GracefulStop() as late:
            try:
                last_loss, saved = train_loop(run, hooks, logger, sitting)
            except BaseException:
                close_after_failure(run)  # the loop's error stays the one raised
                raise
            run.writer.close()  # the last checkpoint is committed before the export and the exit
            export_started = clock()
            export = export_final(run) if run.finished else None
        report_deferred_stop(late)
    end_sitting(run, sitting, clock() - export_started if export else None)
    return run_result(run, logger, last_loss, saved, export, stopped=sitting.stopped)


def train_loop(
    run: Run, hooks: TrainHooks, logger: MetricsLogger, sitting: Sitting
) -> tuple[float, Path | None]:
    """Optimizer steps until done or a collective stop: step, (eval,) log, save."""
    timer, window = PhaseTimer(run.info.device), LogWindow(run.step)
    last_loss, saved = float("nan"), None
    # Entered before the held-out setup (the target's continuations: minutes on a large target): a
    # SIGTERM during it, or during an owed evaluation, stops the process at the first step boundary.
    with GracefulStop() as stop:
        heldout = sitting.timed("eval_setup_s", lambda: build_heldout_eval(run))  # None without eval.prompts
        run_owed_evaluation(run, heldout, logger, sitting)
        vote = sitting_vote(run, sitting, heldout)
        stacks = Path(run.cfg.output_dir) / "watchdog-stacks.txt"
        with Watchdog(run.cfg.train.watchdog_s, stacks) as watchdog:
            while run.step < run.total_steps:
                watchdog.beat(run.step)
                sitting.begin_step()
                result = train_step(run, timer, hooks, stop_requested=lambda: stop.requested or vote())
                window.add(result)
                stopping = result["stop"]  # agreed by all ranks inside the step
                eval_due = heldout is not None and heldout.due(run)  # same on every rank
                if eval_due and stopping:  # carried in the stop's checkpoint, run first by the next process
                    run.owed_eval_step = run.step
                evaluating = eval_due and not stopping
                if window.due(run, stopping) or evaluating:
                    row = window.row(run, result, timer)
                    if evaluating:
                        row.update(sitting.timed("eval_s", lambda: evaluate_heldout(run, heldout)))
                        window.reset(run.step)  # the evaluation's time is not training throughput
                    last_loss = row["loss"]
                    logger.log(run.step, row)
                logger.advance(run.step)
                if save_due(run, stopping):
                    save_started = sitting.clock()
                    saved = sitting.timed("save_s", lambda: save(run))
                if stopping:
                    sitting.stopped = sitting.stopped or ("signal" if stop.requested else "another_rank")
                    owed = run.owed_eval_step is not None
                    resume = run.cfg.checkpoint.resume
                    log_main(stop_message(sitting.stopped, saved, run.step, run.total_steps, owed, resume))
                    break
                sitting.end_step()
    settle_saves(run)  # the last save's failure, if any, stops every rank here, before the export
    if sitting.stopped:  # the final save, waited for: what the next sitting reserves for its own
        sitting.measured["save_s"] = sitting.clock() - save_started
    return last_loss, saved


def run_owed_evaluation(run: Run, heldout, logger: MetricsLogger, sitting: Sitting) -> None:
    """The held-out evaluation the previous process owes (it stopped on an evaluation step and saved
    without it): run on the checkpoint's weights before the first step, logged at that step."""
    owed, run.owed_eval_step = run.owed_eval_step, None
    if owed is None:
        return
    if heldout is None:
        log_main(f"eval.prompts is empty now: the held-out evaluation owed at step {owed} is not run")
        return
    log_main(f"eval: running the held-out evaluation of step {owed}, owed by the process that stopped there")
    logger.log(run.step, sitting.timed("eval_s", lambda: evaluate_heldout(run, heldout)))


def sitting_vote(run: Run, sitting: Sitting, heldout) -> Callable[[], bool]:
    """This rank's vote on ending the sitting after the step in progress (``train.time_limit_s``,
    ``train.steps_per_process``); read at the end of the step, like SIGTERM."""
    every_eval, every_save = run.cfg.eval.every_steps, run.cfg.checkpoint.every_steps

    def eval_due(step: int) -> bool:
        return heldout is not None and (
            step == run.total_steps or (every_eval > 0 and step % every_eval == 0)
        )

    return lambda: sitting.wants_stop(run.step + 1, eval_due, lambda step: step % every_save == 0)


def end_sitting(run: Run, sitting: Sitting, export_s: float | None) -> None:
    """Rank 0 appends this process's row to ``sittings.jsonl``."""
    row = sitting.record(run, export_s)
    if run.info.is_main:
        append_sitting(run.cfg.output_dir, row)


def train_step(
    run: Run, timer: PhaseTimer, hooks: TrainHooks, stop_requested=lambda: False
) -> dict[str, Any]:
    """One optimizer step over ``grad_accum`` micro-batches: features -> drafter fwd/bwd -> update."""
    micro = [
        prepare_micro_batch(run, batch, epoch)
        for batch, epoch in (run.data.next_batch() for _ in range(run.cfg.train.grad_accum))
    ]
    denom = step_denominator(micro, run.group)
    loss_total, stats_sum, flops = torch.zeros((), device=run.info.device), None, 0
    for i, m in enumerate(micro):
        with timer.phase("target"):
            features, teacher_hidden = target_pass(run, m)
        loss, stats = drafter_forward_backward(
            run, timer, m, features, denom, last=i == len(micro) - 1, teacher_hidden=teacher_hidden
        )
        loss_total += loss
        stats_sum = add_metrics(stats_sum, stats)
        flops += step_flops(run, m)
        del features, teacher_hidden
    if hooks.after_backward:
        hooks.after_backward(run)
    # SIGTERM is read here, at the end of the step, so a signal during step k stops after step k.
    result = optimizer_update(run, timer, loss_total, stop_requested(), denom)
    if hooks.after_step:
        hooks.after_step(run)
    return {**result, "stats": stats_sum, "flops": flops}


# ----------------------------------------------------------------------------- building


def build_run(cfg: RunConfig, info: DistInfo) -> Run:
    """Target, drafter, optimizer, schedule and data; then resume if a checkpoint exists.

    Each rank builds its target, drafter and optimizer alone, between the collectives of the
    drafter's wrapper and of the data: a failure there is voted on (``failing_together``), so that
    every rank raises it at once instead of waiting for the failed rank in the next collective."""
    seed_everything(cfg.train.seed)
    with failing_together(None, startup_failure):
        target = build_target(cfg, info)
        draft_config, drafter = new_drafter(cfg, target, info)
    model = wrap_for_training(cfg, drafter, info)  # a collective: every rank got here
    with failing_together(None, startup_failure):
        optimizer = build_optimizer(model, cfg, info)
    data = build_data(cfg, target, info)
    total = total_steps(cfg, data.steps_per_epoch)
    run = Run(
        cfg=cfg,
        info=info,
        target=target,
        draft_config=draft_config,
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg, total),
        data=data,
        total_steps=total,
        writer=ckpt.CheckpointWriter.for_run(cfg.checkpoint, info.device),
    )
    maybe_resume(run)  # may keep another length: the one the checkpoint's run was planned with
    record_run_info(run, info.is_main, placement="colocated")
    log_main(
        f"training: {run.total_steps} steps, {sum(p.numel() for p in unwrap(model).parameters()) / 1e6:.1f}M drafter params, "
        f"world {info.world_size}, device {info.device}, target kernels {target.kernels}"
    )
    return run


def startup_failure(rank: int, message: str) -> str:
    return f"start-up failed on rank {rank}: {message}"
