"""What a training run holds and what it leaves on disk: ``Run``, the run folder's metadata, and the
resume / export of a run, shared by colocated and split placement (its saves: ``saves.py``).

A ``Run`` trains the drafter over a process group: every rank of the job (colocated, ``group`` None)
or the drafter ranks only (split placement). Reductions, checkpoint gathers and barriers go over
that group; every rank of it writes its checkpoint shards and its rank 0 commits. The checkpoint
format is the same for both placements, so a split checkpoint resumes colocated, and vice versa, on
any number of ranks. A changed world size keeps the run's length and LR schedule (both planned with
the steps per epoch of the world size the run started on, which every checkpoint keeps) and remaps
the data position to the same fraction of the current epoch; it is logged.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash_train.config import RunConfig
from dflash_train.train import checkpoint as ckpt
from dflash_train.train import resume_check
from dflash_train.train.builders import build_scheduler
from dflash_train.train.faults import any_rank_error, any_rank_flags, raise_if_any_rank_failed
from dflash_train.train.logging import MetricsLogger, log_main
from dflash_train.train.parallel import DistInfo, full_model_state, unwrap


class NonFiniteError(RuntimeError):
    """Raised on every rank when any rank saw a non-finite loss or gradient norm."""


@dataclass
class TrainHooks:
    """Test seams: called after backward (e.g. to inject a NaN) and after each optimizer step;
    ``clock`` replaces ``time.monotonic`` for the sitting's time limit (``train/sitting.py``)."""

    after_backward: Callable[[Run], None] | None = None
    after_step: Callable[[Run], None] | None = None
    clock: Callable[[], float] | None = None


@dataclass
class Run:
    """Everything a training run holds. ``info`` is this rank's place in ``group``, the process group
    the drafter trains over (None: every rank of the job)."""

    cfg: RunConfig
    info: DistInfo
    target: Any
    draft_config: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data: Any
    total_steps: int
    group: Any = None
    step: int = 0
    counters: dict[str, float] = field(default_factory=lambda: {"skipped_steps": 0, "empty_steps": 0})
    writer: ckpt.CheckpointWriter | None = None
    # The steps per epoch that ``total_steps`` and the LR schedule were planned with: this run's
    # own (``data.steps_per_epoch``) unless it resumed a checkpoint of another world size.
    schedule_steps_per_epoch: int = 0
    # The step whose held-out evaluation is still owed: a process that stops on an evaluation step
    # saves it in the checkpoint, and the next process runs it first (``train/colocated.py``).
    owed_eval_step: int | None = None

    def __post_init__(self) -> None:
        self.schedule_steps_per_epoch = self.schedule_steps_per_epoch or self.data.steps_per_epoch

    @property
    def finished(self) -> bool:
        """Every step trained and the last step's held-out evaluation done: time for the export."""
        return self.step >= self.total_steps and self.owed_eval_step is None

    @property
    def gamma(self) -> float:
        return self.cfg.loss_gamma


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: ``train.max_steps``, or whole epochs of ``steps_per_epoch``
    micro-batches per rank, ``train.grad_accum`` to a step. The loader's stream crosses epoch
    boundaries, so a step may take micro-batches of two epochs and only the last epoch's remainder
    (fewer than ``grad_accum``) goes untrained, not one remainder per epoch."""
    total = cfg.train.max_steps or cfg.train.num_epochs * steps_per_epoch // cfg.train.grad_accum
    if total < 1:
        raise ValueError(
            f"the data gives {steps_per_epoch} micro-batches per epoch per rank, {cfg.train.num_epochs} epoch(s) of them fewer than train.grad_accum={cfg.train.grad_accum}: add data, lower grad_accum or set train.max_steps."
        )
    return total


def write_run_info(run: Run, **extra: Any) -> None:
    """The resolved recipe and the run's metadata (kernels bound, versions, world) in output_dir.

    ``extra`` adds or replaces entries (split placement: the target ranks' kernels and the layout).
    """
    import transformers

    out = Path(run.cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run.cfg.to_yaml(out / "config.yaml")
    info = {
        "target_kernels": run.target.kernels,
        "target_layer_ids": run.target.target_layer_ids,
        "drafter": run.draft_config.to_serving_dict(),
        "drafter_params": sum(p.numel() for p in unwrap(run.model).parameters()),
        "world_size": run.info.world_size,
        "device": str(run.info.device),
        "launch_dir": os.getcwd(),  # the recipe's relative paths (target.path, data.path) resolve here
        "total_steps": run.total_steps,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        **extra,
    }
    (out / "run_info.json").write_text(json.dumps(info, indent=2, default=str))


def record_run_info(run: Run, writer: bool, **extra: Any) -> None:
    """Every rank of the run's group: ``write_run_info`` on the ``writer`` rank, then its outcome. A
    write that fails (a full disk, a read-only output_dir) raises the same ``RuntimeError`` on every
    rank, which would otherwise wait for the writer in the first step's collective."""
    error = attempt(lambda: write_run_info(run, **extra)) if writer else None
    message = any_rank_error(error, group=run.group)
    if message is not None:
        raise run_info_failure(run.cfg.output_dir, message) from error


def run_info_failure(output_dir: str | Path, message: str) -> RuntimeError:
    """The one error every rank raises when ``write_run_info`` failed on its writer (``message``)."""
    return RuntimeError(
        f"writing config.yaml and run_info.json to {output_dir} failed: {message}; make output_dir "
        "writable (or free space there) and run the same command again"
    )


def open_logger(run: Run) -> MetricsLogger:
    """The run's metrics logger (rank 0 of the run's group writes; a failure stops every rank), from
    ``run.step``: rows an earlier process logged after it, and the owed evaluation's, are dropped."""
    opened = []
    error = attempt(lambda: opened.append(MetricsLogger(
        Path(run.cfg.output_dir), run.cfg.logging, total_steps=run.total_steps, is_main=run.info.is_main,
        config_dict=run.cfg.to_dict(), start_step=run.step, redo_eval_at_start=run.owed_eval_step is not None,
    )))  # fmt: skip
    message = any_rank_error(error, group=run.group)
    if message is None:
        return opened[0]
    for logger in opened:
        logger.close()
    raise RuntimeError(
        f"opening the metrics log in {run.cfg.output_dir} failed: {message}; make output_dir writable (or free "
        "space there, or fix the logging settings) and run the same command again"
    ) from error


def save_due(run: Run, stopping: bool) -> bool:
    """Whether this step ends with a checkpoint: every ``checkpoint.every_steps``, the last, a stop."""
    return save_due_at(run.cfg, run.step, run.total_steps, stopping)


def save_due_at(cfg: RunConfig, step: int, total: int, stopping: bool) -> bool:
    """``save_due`` after step ``step`` of ``total`` (split placement's target ranks have no ``Run``)."""
    return stopping or step % cfg.checkpoint.every_steps == 0 or step == total


def run_result(
    run: Run,
    logger: MetricsLogger,
    last_loss: float,
    saved: Path | None,
    export: Path | None,
    stopped: str | None = None,
) -> dict[str, Any]:
    """What ``train()`` returns: the step reached of the run's total, whether the run is finished (an
    unfinished one continues with the same command), why this process stopped early (``stopped``:
    ``time_limit``, ``steps_per_process``, ``signal``; None otherwise), the last logged loss and tau,
    checkpoint, export."""
    return {
        "step": run.step,
        "total_steps": run.total_steps,
        "finished": run.finished,
        "stopped": stopped,
        "loss": last_loss,
        "tau": logger.last.get("tau"),
        "checkpoint": str(saved) if saved else None,
        "export": str(export) if export else None,
    }


# ----------------------------------------------------------------------------- checkpoints


def train_state_dict(run: Run, **extra: Any) -> dict[str, Any]:
    """Everything but the model and optimizer tensors that a resume needs (``extra``: placement-specific
    parts); the world size tells a resume on another number of ranks to remap the data position, and
    ``schedule_steps_per_epoch`` to keep the run's length and LR schedule."""
    return {
        "step": run.step,
        "world_size": run.info.world_size,
        "total_steps": run.total_steps,
        "schedule_steps_per_epoch": run.schedule_steps_per_epoch,
        "scheduler": run.scheduler.state_dict(),
        "data": run.data.state_dict(),
        "data_files": run.data.file_fingerprints,
        "owed_eval_step": run.owed_eval_step,
        **extra,
        "counters": dict(run.counters),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }


def checkpoint_group(run: Run) -> Any:
    """The gloo group DCP coordinates saves and loads over (None alone), made on first use.

    Its own group, not the training one: an async save runs DCP's collectives on a background thread
    while the training thread runs its own, and gloo is what DCP needs for an async save on GPU.
    ``use_local_synchronization``: only the run's ranks make it (split placement's target ranks never save).
    """
    if not run.info.distributed:
        return None
    if run.writer.group is None:
        import datetime

        ranks = (
            dist.get_process_group_ranks(run.group)
            if run.group is not None
            else list(range(dist.get_world_size()))
        )
        timeout = datetime.timedelta(seconds=run.cfg.train.dist_timeout_s)
        run.writer.group = dist.new_group(
            ranks, timeout=timeout, backend="gloo", use_local_synchronization=True
        )
    return run.writer.group


def attempt(write: Callable[[], Any]) -> BaseException | None:
    """Run a part of a save; its error, if any, is returned for the vote instead of raised here.

    A deliberate recovery boundary (any error, not only OSError): a full disk surfaces from the
    shard writer as a RuntimeError of torch's zip writer, and a rank that raised before the vote
    would leave the others waiting in it. DCP's ``CheckpointException`` derives from BaseException.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        write()
    except (Exception, CheckpointException) as err:  # see the docstring
        return err
    return None


def maybe_resume(run: Run) -> None:
    """``resume: auto`` continues from the newest committed checkpoint of output_dir; ``never``
    starts fresh, setting aside the checkpoints an earlier run left there."""
    mode = run.cfg.checkpoint.resume
    path = (
        None
        if mode == "never"
        else (ckpt.latest_checkpoint(run.cfg.output_dir) if mode == "auto" else Path(mode))
    )
    if mode == "never":
        # Left in place, an earlier run's later steps would outrank this run's: keep_last would prune
        # each new checkpoint as it commits, and a later ``resume: auto`` would continue the old run.
        set_aside_abandoned(run, None, 0)
    if mode == "auto":
        check_same_checkpoint(run, path)
    if path is None:
        return
    loaded = read_checkpoint(run, path)
    resume_check.check_resume_compatible(
        loaded["config"],
        run.cfg.to_dict(),
        run.cfg.checkpoint.allow_changed,
        saved_drafter=type(run.draft_config).from_serving_dict(loaded["drafter_config"]).to_serving_dict(),
        current_drafter=run.draft_config.to_serving_dict(),
    )
    state = loaded["train_state"]
    resume_check.check_data_files(
        path, state.get("data_files"), run.data.file_fingerprints, run.cfg.checkpoint.allow_data_change
    )
    if mode != "auto":
        set_aside_abandoned(run, path, state["step"])
    keep_schedule(run, state)  # before the optimizer state loads: a new scheduler resets the LR
    if loaded["sharded"]:
        ckpt.load_sharded_state(run.model, run.optimizer, path, group=checkpoint_group(run))
    else:  # the older single-file layout: full state, loaded on every rank
        ckpt.load_model_state(run.model, loaded["drafter_state"], run.optimizer, state["optimizer"], path)
    run.scheduler.load_state_dict(state["scheduler"])
    apply_optimizer_settings(run)
    run.data.load_state_dict(data_position(run, state, loaded["config"]))
    run.counters.update(state["counters"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    run.step = state["step"]
    run.owed_eval_step = state.get("owed_eval_step")  # older checkpoints: none
    log_main(f"resumed from {path} at step {run.step}")


def apply_optimizer_settings(run: Run) -> None:
    """The recipe's ``train.lr``, ``train.betas`` and ``train.weight_decay`` over the checkpoint's:
    the optimizer and scheduler states restore the values they were saved with, so a change the
    resume check allowed (``checkpoint.allow_changed``) would otherwise be ignored. Unchanged, they
    are the same values."""
    t = run.cfg.train
    run.scheduler.base_lrs = [t.lr] * len(run.optimizer.param_groups)
    for group, multiplier in zip(run.optimizer.param_groups, run.scheduler.lr_lambdas, strict=True):
        lr = t.lr * multiplier(run.scheduler.last_epoch)
        group.update(initial_lr=t.lr, lr=lr, betas=tuple(t.betas), weight_decay=t.weight_decay)


def read_checkpoint(run: Run, path: Path) -> dict[str, Any]:
    """``ckpt.load_checkpoint`` on every rank, then a vote: a rank that cannot read it (a file its
    node cannot open) would leave the others waiting in the sharded load's collectives until it
    exits; every rank raises the same line naming that rank instead. One process raises as is."""
    loaded: dict[str, Any] = {}
    error = attempt(lambda: loaded.update(ckpt.load_checkpoint(path)))
    if not run.info.distributed:
        if error is not None:
            raise error
        return loaded
    raise_if_any_rank_failed(
        error,
        run.group,
        lambda rank, message: (
            f"resume: reading {path} failed on rank {rank}: {message}; every rank must be able to read "
            "output_dir's checkpoints: fix that rank's access (or set that checkpoint aside), then run the "
            "same command again"
        ),
    )
    return loaded


def check_same_checkpoint(run: Run, path: Path | None) -> None:
    """Every rank of the run's group, before ``resume: auto`` loads anything: the checkpoint each rank
    found must be rank 0's. A rank that lists another one (a stale listing of a shared file system)
    or none (output_dir on a disk of its own node) would resume other weights, step and data position,
    and the ranks would train apart until one waited for the others; every rank raises the same line."""
    if not run.info.distributed:
        return
    found: list[str | None] = [None] * dist.get_world_size(run.group)
    dist.all_gather_object(found, None if path is None else str(path), group=run.group)
    if len(set(found)) == 1:
        return
    seen = ", ".join(f"rank {rank} {p or 'no checkpoint'}" for rank, p in enumerate(found))
    raise ValueError(
        f"checkpoint.resume=auto: the ranks see different checkpoints in {run.cfg.output_dir}: {seen}; "
        "output_dir must be one folder that every rank shares and sees alike (a shared file system): "
        "fix that, or name the checkpoint (checkpoint.resume=<path>), and run the same command again"
    )


def set_aside_abandoned(run: Run, path: Path | None, step: int) -> None:
    """A resume from a named checkpoint abandons the output_dir's later ones, and a fresh start
    (``path`` None, ``step`` 0) every one: rank 0 moves them aside (``ckpt.set_aside_abandoned``)
    and says so; every rank fails together if it cannot."""
    from dflash_train.train.heldout_eval import BEST_DIR
    from dflash_train.train.sitting import SITTINGS_LOG

    # A fresh start's earlier export-best and sittings log too: a resume before this run's first
    # evaluation would take that tau (of a step it may precede) for this run's best so far, and the
    # first sitting would budget its saves by the earlier run's (maybe of another drafter).
    out = Path(run.cfg.output_dir)
    earlier = (out / BEST_DIR, out / f".{BEST_DIR}.old", out / SITTINGS_LOG) if path is None else ()
    moved, aside, error = [], None, None
    if run.info.is_main:
        try:
            moved, aside = ckpt.set_aside_abandoned(out, path, step, also=earlier)
        except OSError as err:
            error = err
    if any_rank_flags([error is not None], run.info.device, group=run.group)[0]:
        raise RuntimeError(
            f"checkpoint.resume={path or 'never'}: could not move the later checkpoints of {run.cfg.output_dir} "
            f"aside ({error or 'see rank 0'}); move them out of {ckpt.checkpoints_root(run.cfg.output_dir)} "
            "yourself or resume into a new output_dir."
        ) from error
    if moved and path is None:
        log_main(
            f"checkpoint.resume=never: set aside the earlier run's {', '.join(moved)} in {aside}, so "
            "checkpoint.keep_last and a later resume: auto cannot pick its checkpoints, nor this run "
            "take its export-best or sittings for its own"
        )
    elif moved:
        log_main(
            f"checkpoint.resume={path} (step {step}): moved the abandoned run's later checkpoints "
            f"{', '.join(moved)} to {aside}, so checkpoint.keep_last and a later resume: auto cannot pick them"
        )


def keep_schedule(run: Run, state: dict[str, Any]) -> None:
    """Continue the checkpoint's run length and LR schedule, whatever the world size is now.

    Without ``train.max_steps`` the length is ``num_epochs`` epochs of steps per epoch, which
    depend on the world size: recomputing it on another number of ranks would end the run early or
    late on a rebuilt schedule. The epoch length it was planned with comes from the checkpoint
    (older ones: their saved data position's, the epoch length of the world size they were written
    on), and the recipe keys still apply, so an allowed change of ``train.num_epochs`` counts.
    """
    planned = state.get("schedule_steps_per_epoch", state["data"].get("steps_per_epoch"))
    if planned is None or planned == run.schedule_steps_per_epoch:
        return
    run.schedule_steps_per_epoch = planned
    run.total_steps = total_steps(run.cfg, planned)
    run.scheduler = build_scheduler(run.optimizer, run.cfg, run.total_steps)


def data_position(run: Run, state: dict[str, Any], saved_recipe: dict[str, Any]) -> dict[str, int]:
    """The saved data position, remapped when the run resumes on another number of ranks.

    An epoch's batch order depends on the world size (batches are grouped one per rank), so there
    is no exact match: the run continues in the same epoch at the same fraction of it, rounded down
    (at most part of one step's worth of the epoch is read again; none is skipped), and rows of that
    epoch may be seen twice or not at all until the next epoch starts. The length and LR schedule
    stay the run's (``keep_schedule``): a step now reads ``world_size`` batches, so the remaining
    steps cover more (more ranks) or fewer (fewer ranks) epochs than planned. Logged, not refused,
    unless the data is not the checkpoint's (``check_same_epoch``).
    """
    data = dict(state["data"])
    saved_world = state.get("world_size", run.info.world_size)  # older checkpoints: not recorded
    if saved_world == run.info.world_size:
        return data  # the loader checks the steps per epoch itself
    old_steps, new_steps = data["steps_per_epoch"], run.data.steps_per_epoch
    check_same_epoch(run, saved_world, old_steps, saved_recipe)
    position = data["position"] * new_steps // old_steps
    log_main(
        f"resuming a {saved_world}-rank checkpoint on {run.info.world_size} ranks: data position "
        f"epoch {data['epoch']} step {data['position']}/{old_steps} -> step {position}/{new_steps} "
        "(the same fraction of the epoch; its batch order depends on the world size); the run keeps "
        f"its length ({run.total_steps} steps) and LR schedule"
    )
    return {**data, "position": position, "steps_per_epoch": new_steps}


def check_same_epoch(run: Run, saved_world: int, saved_steps: int, saved_recipe: dict[str, Any]) -> None:
    """Refuse a resume on another number of ranks whose data would not give the checkpoint's epoch.

    The remapped position is a fraction of the checkpoint's epoch, which only means something on the
    same data: the data now must give the checkpoint's steps per epoch at the checkpoint's world size
    (the test the loader makes when the world size is unchanged; a changed ``data.paths`` that keeps
    the epoch only warns). Every rank has the same data, so every rank raises together.
    """
    now_at_saved = run.data.steps_per_epoch_at(saved_world)
    if now_at_saved == saved_steps:
        return
    changes = resume_check.describe_data_changes(saved_recipe, run.cfg.to_dict())
    raise ValueError(
        f"refusing to resume: the data changed since the checkpoint ({changes}). The checkpoint's run "
        f"had {saved_steps} steps per epoch on its {saved_world} ranks; the data now gives {now_at_saved} "
        f"on {saved_world} ranks ({run.data.steps_per_epoch} on the {run.info.world_size} ranks of this "
        "run), so the saved data position cannot be carried over. Restore the checkpoint's data, or start "
        "a new output_dir (drafter.init_from=<an export> starts from its weights)."
    )


def export_final(run: Run) -> Path:
    """Write the trained drafter in the serving layout to ``output_dir/export`` (the group's rank 0).

    A write that fails (a full disk) raises the same ``RuntimeError`` on every rank of the group,
    which would otherwise wait for rank 0 at the barrier after it; the last checkpoint is committed,
    so a resume from it writes the export once the cause is fixed."""
    from dflash_train.train.sitting import continue_advice

    state = full_model_state(run.model, group=run.group)
    out = Path(run.cfg.output_dir) / "export"
    error = attempt(lambda: write_export(run, state, out)) if run.info.is_main else None
    message = any_rank_error(error, group=run.group)  # also the barrier: rank 0 has written it
    if message is not None:
        raise RuntimeError(
            f"writing the export of step {run.step} failed on rank 0: {message}; the checkpoint of step "
            f"{run.step} is committed: fix the cause (free space in {out.parent}) and "
            f"{continue_advice(run.cfg.checkpoint.resume, 'to write the export')}"
        ) from error
    return out


def write_export(run: Run, state: dict[str, Any], out: Path) -> None:
    """Rank 0: the full drafter ``state`` in the serving layout at ``out``."""
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.export import save_drafter

    drafter = DFlashDrafter(run.draft_config)
    drafter.load_state_dict(state)
    save_drafter(
        drafter, run.draft_config, out, dtype=run.cfg.train.dtype, target=run.cfg.target.path, announce=True
    )
