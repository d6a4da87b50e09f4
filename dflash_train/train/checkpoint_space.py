"""A checkpoint that cannot be written: the free-space warning before a save, and the one-line
error every rank raises when a save fails (a full disk, a quota, any error of the DCP shard write,
the train-state write or the commit).

What training does then (docs/training.md, "Checkpoints, resume and faults"): it stops on every
rank together with ``CheckpointWriteError`` (``dflash-train train`` exits 1 with its message); the
failed step's staging folder is removed, and the newest committed checkpoint, untouched, is what
``resume: auto`` continues from once there is space again.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from dflash_train.train import checkpoint as ckpt

# Bytes per drafter parameter in a checkpoint: fp32 weights and AdamW's two fp32 moments. Only the
# estimate of the first save (later ones compare with the last checkpoint's size on disk).
CHECKPOINT_BYTES_PER_PARAM = 12
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written on some rank; raised on every rank of the run together."""


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def free_bytes(output_dir: str | Path) -> int:
    """Free bytes on the file system the checkpoints go to (the nearest folder that exists)."""
    path = ckpt.checkpoints_root(output_dir)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def expected_bytes(output_dir: str | Path, num_params: int) -> tuple[int, str]:
    """What the next checkpoint needs: the last committed one's size, or an estimate before the first."""
    last = ckpt.latest_checkpoint(output_dir)
    if last is not None:
        return folder_bytes(last), f"the size of {last.name}"
    return CHECKPOINT_BYTES_PER_PARAM * num_params, "an estimate: fp32 weights and AdamW moments"


def fmt_bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"


def space_warning(output_dir: str | Path, step: int, num_params: int) -> str | None:
    """The warning to give (once per run) when the checkpoint of ``step`` would not fit, else None."""
    needed, source = expected_bytes(output_dir, num_params)
    free = free_bytes(output_dir)
    if free >= needed:
        return None
    return (
        f"the checkpoint of step {step} may not fit: it needs about {fmt_bytes(needed)} ({source}) "
        f"and {ckpt.checkpoints_root(output_dir)} has {fmt_bytes(free)} free. Free space, lower "
        "checkpoint.keep_last or point output_dir at a larger disk; a save that fails stops training."
    )


def root_error(error: BaseException) -> BaseException:
    """The OSError behind ``error`` if there is one (DCP wraps each rank's error in a
    ``CheckpointException`` whose ``failures`` map ranks to (exception, traceback)), else ``error``."""
    seen, queue = set(), [error]
    while queue:
        err = queue.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):
            queue += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        queue += [err.__cause__, err.__context__]
    return error


def failure_cause(output_dir: str | Path, step: int, error: BaseException, num_params: int) -> str:
    """What failed where, in a few words, from the error of a rank whose part of the save of ``step``
    failed (the cause a full disk hides behind is named as such)."""
    cause = root_error(error)
    where = getattr(cause, "filename", None) or ckpt.staging_folder(output_dir, step)
    if isinstance(cause, OSError) and cause.errno in NO_SPACE:
        return f"no space left on the device ({type(cause).__name__}) writing {where}"
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    what = f"{reason} ({type(cause).__name__}) writing {where}"
    if free_bytes(output_dir) < expected_bytes(output_dir, num_params)[0]:
        what += (
            ", most likely because the disk is full"  # it can surface as another error (torch's zip writer)
        )
    return what


def failed_ranks(error: BaseException, rank: int) -> list[int]:
    """The ranks whose failure ``error`` reports: those of DCP's ``CheckpointException`` (which every
    rank of the write raises alike), else ``rank``, the rank that raised it."""
    failures = getattr(error, "failures", None)
    return sorted(failures) if isinstance(failures, dict) and failures else [rank]


def describe_failure(output_dir: str | Path, step: int, cause: str, num_params: int) -> str:
    """The one-line message of a failed save of ``step``: what failed where (``cause``, from
    ``failure_cause``), bytes needed and free, and the newest committed checkpoint that is intact."""
    needed, source = expected_bytes(output_dir, num_params)
    free = free_bytes(output_dir)
    last = ckpt.latest_checkpoint(output_dir)
    intact = (
        f"the newest committed checkpoint, step {int(last.name.removeprefix('step-'))} ({last}), is intact and "
        "checkpoint.resume: auto (the default) continues from it"
        if last is not None
        else "there is no committed checkpoint yet: a restart begins at step 0"
    )
    return (
        f"checkpoint of step {step} not saved: {cause}; it needs about {fmt_bytes(needed)} ({source}), "
        f"{fmt_bytes(free)} free; {intact}. Training stopped: free space or point "
        "output_dir at a larger disk, then rerun."
    )


def remove_staging(output_dir: str | Path, step: int) -> None:
    """Rank 0, after a failed save: the partial folder of ``step`` goes (it holds no usable state)."""
    shutil.rmtree(ckpt.staging_folder(output_dir, step), ignore_errors=True)
