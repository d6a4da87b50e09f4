"""Split placement's checkpoints: the drafter ranks save, after every rank agreed that the target
ranks' data positions match theirs, and the target ranks learn each save's outcome, so a failed
write stops every rank together (``split_stream``'s ``share_*`` votes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_train.train import checkpoint_space as space
from dflash_train.train.run import Run
from dflash_train.train.saves import save, settle_saves
from dflash_train.train.split_stream import (
    SplitLayout,
    position_mismatch,
    share_position_check,
    share_save_outcome,
)


def save_with_targets(run: Run, layout: SplitLayout, reports) -> Path:
    """Drafter ranks: ``saves.save``, whose outcome the target ranks learn (``share_save_outcome``),
    once every rank agreed that the data positions match (``share_position_check``)."""
    mismatch = position_mismatch(run.step, run.data.state_dict(), reports) if run.info.is_main else None
    share_position_check(layout, run.info.device, mismatch)
    error = None
    try:
        path = save(run, **split_train_state(run, layout, reports))
    except space.CheckpointWriteError as err:  # raised on every drafter rank together (the save's votes)
        error = err
    share_save_outcome(layout, run.info.device, error)
    return path


def settle_with_targets(run: Run, layout: SplitLayout) -> None:
    """Drafter ranks, after the loop: wait for the last save's commit; every rank learns its outcome."""
    error = None
    try:
        settle_saves(run)
    except space.CheckpointWriteError as err:  # raised on every drafter rank together
        error = err
    share_save_outcome(layout, run.info.device, error)


def split_train_state(run: Run, layout: SplitLayout, reports) -> dict[str, Any]:
    """The split part of a checkpoint's train state (drafter rank 0; {} elsewhere); the positions
    were checked by every rank together (``share_position_check``)."""
    if not run.info.is_main:
        return {}
    positions = [r["data"] for r in reports if r["role"] == "target"]
    split = {
        "target_ranks": layout.num_target_ranks,
        "drafter_ranks": layout.num_drafter_ranks,
        "target_data": positions,
    }
    return {"split": split}
