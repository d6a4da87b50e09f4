"""A run's checkpoint save, on every rank of the run's group: its phases and the vote after each.

Every rank writes its shards of the drafter and optimizer through DCP (``checkpoint.py``) and the
group's rank 0 commits. Each phase of a save ends with a vote over the run's ranks, so a save that
fails on any rank raises the same ``CheckpointWriteError`` on every rank (``checkpoint_space.py``)
and no rank waits at a barrier, or in DCP's write, that the others never reach.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dflash_train.train import checkpoint as ckpt
from dflash_train.train import checkpoint_space as space
from dflash_train.train.faults import any_rank_flags
from dflash_train.train.logging import log_main
from dflash_train.train.parallel import unwrap
from dflash_train.train.run import Run, attempt, checkpoint_group, train_state_dict


def save(run: Run, **extra: Any) -> Path:
    """Every rank writes its shards of the drafter and optimizer (DCP); the group's rank 0 commits.

    With ``checkpoint.async_write`` the loop waits only for the staging copy; the previous save is
    committed before a new one starts. ``extra`` joins the train state (read on rank 0 only). A save
    that fails on any rank raises ``CheckpointWriteError`` on every rank (``checkpoint_space.py``):
    each phase ends with a vote, so no rank is left waiting at a barrier the others never reach.
    """
    settle_saves(run)
    warn_if_no_space(run)
    group = checkpoint_group(run)  # made on the first save by every rank, before a phase can fail
    error = None
    if run.info.is_main:
        error = attempt(lambda: ckpt.clear_staging(run.cfg.output_dir, run.step))
    raise_if_failed(run, error, run.step)  # also the barrier: the staging folder exists for every rank
    staged: list[ckpt.StagedShards] = []
    error = attempt(lambda: staged.append(stage(run)))
    # Every rank staged, so every rank enters DCP's write (a collective) below; one that failed
    # alone would leave the others waiting inside it.
    raise_if_failed(run, error, run.step)
    error = attempt(lambda: write_and_commit(run, staged[0], group, extra))
    run.writer.pending_step = run.step
    raise_if_failed(run, error, run.step)  # also the barrier: no rank runs ahead of a synchronous commit
    return ckpt.step_folder(run.cfg.output_dir, run.step)


def stage(run: Run) -> ckpt.StagedShards:
    """This rank's state to write, staged (``ckpt.stage_shards``); no collective."""
    state = ckpt.sharded_state(run.model, run.optimizer)
    if run.writer.asynchronous and run.info.device.type == "cpu":
        # On CPU the state aliases the live tensors; the background write needs its own copy.
        state = ckpt.snapshot(state)
    staging = ckpt.staging_folder(run.cfg.output_dir, run.step)
    return ckpt.stage_shards(state, staging, run.writer)


def write_and_commit(run: Run, staged: ckpt.StagedShards, group: Any, extra: dict[str, Any]) -> None:
    """This rank's shards; then rank 0's commit (inline, or started on the writer's thread)."""
    shards = ckpt.write_shards(staged, group=group)
    if run.info.is_main:
        run.writer.submit(
            run.cfg.output_dir,
            run.step,
            shards=shards,
            drafter_config=run.draft_config.to_serving_dict(),
            train_state=train_state_dict(run, **extra),
            config_yaml=run.cfg.to_yaml(),
            keep_last=run.cfg.checkpoint.keep_last,
        )
    else:
        run.writer.hold(shards)


def settle_saves(run: Run) -> None:
    """Wait for the save in flight; every rank raises together if it failed on any. Called before
    each save and once the loop is done (every rank gets there together)."""
    raise_if_failed(run, attempt(run.writer.wait), run.writer.pending_step)
    run.writer.pending_step = None


def close_after_failure(run: Run) -> None:
    """The loop raised: wait for the save in flight (it may still commit this process's last
    checkpoint), and shut the writer down, without that save's own failure replacing the error that
    stopped the loop (the one the user must see); the save's failure is logged in one line."""
    step, error = run.writer.pending_step, attempt(run.writer.close)
    if error is not None:
        log_main(
            f"the save of step {step} in flight failed too: {type(error).__name__}: {error}; it is not "
            f"committed: checkpoint.resume: auto continues from the newest committed checkpoint in {run.cfg.output_dir}"
        )


def raise_if_failed(run: Run, error: BaseException | None, step: int | None) -> None:
    """The vote after a phase of a save: if it failed on any rank, rank 0 removes the step's staging
    folder and every rank raises the same one-line ``CheckpointWriteError`` (``failure_message``);
    without a failure, a barrier."""
    if not any_rank_flags([error is not None], run.info.device, group=run.group)[0]:
        return
    message = failure_message(run, error, step)
    if run.info.is_main:
        space.remove_staging(run.cfg.output_dir, step)
    run.writer.pending_step = None
    raise space.CheckpointWriteError(message) from error


def failure_message(run: Run, error: BaseException | None, step: int) -> str:
    """Every rank, once a phase of the save of ``step`` failed: the message of the first rank whose
    part failed (``error``: this rank's, None where it succeeded), naming that rank when there are
    several, so every rank stops with the same line."""
    message = None
    if error is not None:
        where = ""
        if run.info.distributed:
            ranks = space.failed_ranks(error, run.info.rank)
            where = f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
        message = describe_save_failure(run, error, step, where)
    if not run.info.distributed:
        return message
    found: list[str | None] = [None] * dist.get_world_size(run.group)
    dist.all_gather_object(found, message, group=run.group)
    return next(m for m in found if m is not None)


def describe_save_failure(run: Run, error: BaseException, step: int, where: str) -> str:
    """``checkpoint_space.describe_failure`` of this rank's ``error``; its probes of the disk (sizes,
    free space, the newest checkpoint) can fail on the storage that failed the save, and then the
    line says so instead of this rank raising alone before the other ranks' vote."""
    num_params = sum(p.numel() for p in unwrap(run.model).parameters())
    try:
        cause = space.failure_cause(run.cfg.output_dir, step, error, num_params)
        return space.describe_failure(run.cfg.output_dir, step, where + cause, num_params)
    except OSError as probe:
        return (
            f"checkpoint of step {step} not saved: {where}{type(error).__name__}: {error}; describing it "
            f"failed too ({type(probe).__name__}: {probe}); checkpoint.resume: auto continues from the newest "
            f"committed checkpoint in {run.cfg.output_dir}"
        )


def warn_if_no_space(run: Run) -> None:
    """Rank 0, once per run: warn when the checkpoint about to be written would not fit (or that its
    space could not be checked: a probe of the disk failing is no reason to stop rank 0 alone, before
    the save's votes, which stop every rank if the write itself fails)."""
    if not run.info.is_main or run.writer.warned_space:
        return
    num_params = sum(p.numel() for p in unwrap(run.model).parameters())
    try:
        warning = space.space_warning(run.cfg.output_dir, run.step, num_params)
    except OSError as err:
        warning = (
            f"checking the space for the checkpoint of step {run.step} in {run.cfg.output_dir} failed: "
            f"{type(err).__name__}: {err}"
        )
    if warning is not None:
        run.writer.warned_space = True
        warnings.warn(warning, stacklevel=2)
