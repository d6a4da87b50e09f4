"""``train()``: the one entry point of training; it picks the placement and runs its loop.

Follow one ``cfg`` from ``dflash-train train`` to the optimizer step: ``config.load_config`` ->
``train`` here -> ``train/colocated.py`` (every rank runs target and drafter; the default) or
``train/split.py`` (target ranks stream features to drafter ranks) -> ``train/builders.py``
(target, drafter, optimizer, schedule, data), ``train/run.py`` (the ``Run``, resume, export) and
``train/saves.py`` (a checkpoint save) -> ``train/step.py`` (micro-batch, target features, drafter forward/backward, the
optimizer update with its collective vote, the metrics row).
"""

from __future__ import annotations

from typing import Any

from dflash_train.config import RunConfig, load_config
from dflash_train.train.run import NonFiniteError, TrainHooks

__all__ = ["NonFiniteError", "TrainHooks", "run_training", "train"]


def run_training(recipe: str, overrides: list[str]) -> dict[str, Any]:
    """CLI entry: ``dflash-train train RECIPE key=value ...``. A checkpoint that could not be written
    (e.g. a full disk) is not a bug: every rank exits 1 with its one-line message, no traceback."""
    from dflash_train.train.checkpoint_space import CheckpointWriteError
    from dflash_train.train.parallel import finish_distributed

    try:
        result = train(load_config(recipe, overrides))
    except CheckpointWriteError as err:
        raise SystemExit(f"dflash-train train: error: {err}") from None
    finish_distributed()  # a finished rank exits 0, not by SIGABRT in gloo's teardown
    return result


def train(cfg: RunConfig, hooks: TrainHooks | None = None) -> dict[str, Any]:
    """Train the drafter of ``cfg`` in its ``train.placement``; returns step, loss, tau, checkpoint, export."""
    if cfg.train.placement == "split":
        from dflash_train.train.split import train_split

        return train_split(cfg, hooks)
    from dflash_train.train.colocated import train_colocated

    return train_colocated(cfg, hooks or TrainHooks())
