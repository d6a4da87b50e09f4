"""Atomic, sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

Layout of ``<output_dir>/checkpoints/step-000123/``:
  model_optim/          a DCP checkpoint: ``.metadata`` plus ``__<rank>_<n>.distcp`` files. It holds
                        the drafter (``model.<name>``, fp32, serving names) and the AdamW state
                        (``optim.state.<name>.exp_avg`` ...). Each rank writes its own FSDP2 shards, no
                        gather; under DDP each replicated tensor is written once, spread over the ranks.
  state.pt              step, scheduler, data position, RNG, counters, world size (no model tensors)
  drafter_config.json   the drafter's serving config.json
  config.yaml           the resolved recipe
  COMMITTED             written last; a folder without it is ignored (a crash mid-save)

Commit protocol: the group's rank 0 creates ``.tmp-step-N``; barrier; every rank stages (its DCP
writer and, asynchronous, the CPU copy) and the ranks vote on it, since DCP's write is a collective
that would wait for a rank that failed before it; every rank writes its shards (DCP fsyncs each
file); DCP's coordinator writes ``.metadata`` only after it has gathered every rank's write result,
so once the save returns (or its future resolves) on rank 0 every shard is durable. Only then does
rank 0 write ``state.pt`` and the configs, fsync the tree, write the marker and rename the folder. A
SIGKILL of any rank before that rename leaves a ``.tmp-*`` folder that is ignored. With
``checkpoint.async_write`` the shards are written by ``dcp.async_save`` from the staged CPU copy and
the commit runs on a background thread; the next save and the exit wait.

Older checkpoints (``drafter.safetensors`` with the full optimizer inside ``state.pt``, written by
rank 0 alone) still resume and export; ``load_checkpoint`` tells the two apart. What a resume may
change of the recipe and the drafter is checked in ``resume_check.py``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file

from dflash_train.config import missing_resume_path
from dflash_train.models.export import DCP_DIR_NAME, checkpoint_tensor_shapes, quiet_single_process_dcp

COMMIT_MARKER = "COMMITTED"
STATE_NAME = "state.pt"
LEGACY_WEIGHTS_NAME = "drafter.safetensors"
STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_folder(output_dir: str | Path, step: int) -> Path:
    """Where step ``step`` lives once committed."""
    return checkpoints_root(output_dir) / f"step-{step:08d}"


def staging_folder(output_dir: str | Path, step: int) -> Path:
    """Where every rank writes step ``step`` before the commit (one name all ranks agree on)."""
    return checkpoints_root(output_dir) / f".tmp-step-{step:08d}"


def committed_checkpoints(output_dir: str | Path) -> list[Path]:
    """Committed step folders, oldest first; partial folders (no marker) are ignored."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / COMMIT_MARKER).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = committed_checkpoints(output_dir)
    return found[-1] if found else None


def set_aside_abandoned(
    output_dir: str | Path, resumed: str | Path | None, step: int, also: tuple[Path, ...] = ()
) -> tuple[list[str], Path | None]:
    """Rank 0, on a resume from ``resumed`` (step ``step``) named by path: move output_dir's committed
    checkpoints of later steps (and of the same step, unless it is ``resumed``) into
    ``checkpoints/abandoned-<time>/``. They belong to the run that was abandoned; left in place,
    ``keep_last`` would keep them over the new run's and ``resume: auto`` would jump back onto them.
    A fresh start (``resumed`` None, ``step`` 0) abandons every committed checkpoint. ``also``: other
    paths of the abandoned run moved with them where they exist (a fresh start's earlier export-best).

    Returns the names moved and the folder they are in (None when nothing was moved).
    """
    resumed = None if resumed is None else Path(resumed).resolve()
    later = [
        p
        for p in committed_checkpoints(output_dir)
        if (found := int(STEP_DIR.match(p.name).group(1))) > step
        or (found == step and p.resolve() != resumed)
    ] + [p for p in also if os.path.lexists(p)]
    if not later:
        return [], None
    root = checkpoints_root(output_dir)
    stamp = time.strftime("abandoned-%Y%m%d-%H%M%S")
    aside, n = root / stamp, 1
    while aside.exists():  # two resumes within a second
        aside, n = root / f"{stamp}.{n}", n + 1
    aside.mkdir(parents=True)  # a run may leave an export-best and no checkpoint
    for p in later:
        os.replace(p, aside / p.name)
    _fsync_dir(aside)
    _fsync_dir(root)
    return [p.name for p in later], aside


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` (the shards of other ranks included: on a
    shared file system this is cheap when DCP already synced them, and a guarantee when not)."""
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(path) if path.is_dir() else _fsync_file(path)


# ----------------------------------------------------------------------------- writing


def clear_staging(output_dir: str | Path, step: int) -> Path:
    """Rank 0, before the save's barrier: an empty staging folder (a crashed earlier try is removed)."""
    tmp = staging_folder(output_dir, step)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model", "optim"}`` as DCP saves and loads them: each rank's own FSDP2 shards (DTensors),
    or the plain tensors of a DDP replica or single process, keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dflash_train.train.parallel import unwrap, uses_fsdp

    module = model if uses_fsdp(model) else unwrap(model)
    model_state, optim_state = get_state_dict(module, optimizer)
    return {"model": model_state, "optim": optim_state}


def _storage_writer(path: Path):
    """DCP's file writer, fsyncing every shard file (a seam for the fault tests)."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path), sync_files=True)


@dataclass
class StagedShards:
    """What one rank's DCP write reads: its writer of the staging folder, and the state, for an
    asynchronous write a CPU copy that later training steps no longer change."""

    writer: Any
    state: dict[str, Any]
    asynchronous: bool


def stage_shards(state: dict[str, Any], staging: Path, writer: CheckpointWriter) -> StagedShards:
    """Every rank, before any rank starts the write: the DCP writer of ``staging/model_optim`` and,
    when ``writer`` is asynchronous, the staged CPU copy (the only part of the write the training loop
    waits for): into the writer's pinned buffer (``CheckpointWriter.stager``), else new host memory.

    No collective runs here. A rank that fails here (host memory, the staging folder) must be
    outvoted before ``write_shards``: DCP's write is a collective over the checkpoint group, so the
    ranks inside it would wait for the failed one until ``train.dist_timeout_s``.
    """
    storage = _storage_writer(staging / DCP_DIR_NAME)
    if not writer.asynchronous:
        return StagedShards(storage, state, False)
    # The storage writer's own staging is the copy ``dcp.async_save`` would make inside the write.
    return StagedShards(storage, (writer.stager or storage).stage(state), True)


class _AlreadyStaged:
    """The stager of an ``async_save`` whose state ``stage_shards`` copied already: nothing to copy."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def write_shards(shards: StagedShards, *, group) -> Future | None:
    """Every rank, once every rank staged: write this rank's part into ``staging/model_optim``.

    Synchronous: returns None once every rank's shards and the metadata are on disk. Asynchronous:
    returns the future of the background write, which resolves on the coordinator only after every
    rank has written. A rank's error inside DCP's write reaches every rank (DCP gathers them).
    """
    import torch.distributed.checkpoint as dcp

    if not (dist.is_available() and dist.is_initialized()):
        quiet_single_process_dcp()
    # No ``no_dist``: without a process group DCP runs on one process by itself, and not every torch
    # this runs on takes ``no_dist`` in ``async_save``.
    kwargs = dict(storage_writer=shards.writer, process_group=group)
    if shards.asynchronous:
        return dcp.async_save(shards.state, async_stager=_AlreadyStaged(), **kwargs)
    dcp.save(shards.state, **kwargs)
    return None


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    shards: Future | None,
    drafter_config: dict[str, Any],
    train_state: dict[str, Any],
    config_yaml: str,
    keep_last: int,
) -> Path:
    """Rank 0: commit step ``step`` once its shards are durable (``shards``: the pending async write,
    None when already written), then prune all but the newest ``keep_last`` checkpoints."""
    if shards is not None:
        shards.result()  # every rank's shards and the metadata are on disk after this
    root, tmp, final = (
        checkpoints_root(output_dir),
        staging_folder(output_dir, step),
        step_folder(output_dir, step),
    )
    (tmp / "drafter_config.json").write_text(json.dumps(drafter_config, indent=2))
    (tmp / "config.yaml").write_text(config_yaml)
    torch.save(train_state, tmp / STATE_NAME)
    _fsync_file(tmp / STATE_NAME)
    _fsync_tree(tmp)
    (tmp / COMMIT_MARKER).write_text(f"{step}\n")
    _fsync_file(tmp / COMMIT_MARKER)
    _fsync_dir(tmp)
    if final.exists():  # an earlier, superseded save of the same step
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in committed_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointWriter:
    """At most one checkpoint in flight per rank, and the errors of a background write surface in
    the training thread (at the next ``submit``/``hold``, ``wait`` or ``close``).

    Rank 0 commits each checkpoint (``save_checkpoint``) inline or, when ``asynchronous``, on one
    background thread that first waits for the DCP write; the other ranks ``hold`` the future of their
    own async write. ``group`` is the gloo process group DCP coordinates over (made by the run on its
    first save): the async write's collectives run on a background thread, so they must not share a
    group with the training collectives.
    """

    def __init__(self, asynchronous: bool = True, pinned_staging: bool = False):
        self.asynchronous = asynchronous
        self.pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if asynchronous else None
        )
        # ``checkpoint.pinned_staging``: one pinned host copy of this rank's state, made at the first
        # save and refilled by each later one (DCP's cached stager). Safe with one buffer: a save
        # waits for the previous write before it stages (``wait`` in ``saves.save``). Without it,
        # each save copies into freshly allocated pageable memory (~1.5 GB/s on an H100 host).
        self.stager = None
        if asynchronous and pinned_staging:
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            self.stager = BlockingAsyncStager(cache_staged_state_dict=True)
        self.pending: Future | None = None
        self.group: Any = None
        # The step of the save in flight (asynchronous), which a failure found later names.
        self.pending_step: int | None = None
        # The free-space warning is given once per run.
        self.warned_space = False

    @classmethod
    def for_run(cls, cfg, device: torch.device) -> CheckpointWriter:
        """The writer of a run's ``checkpoint`` config on ``device`` (pinned memory needs CUDA)."""
        if cfg.pinned_staging and device.type != "cuda":
            raise ValueError(
                f"checkpoint.pinned_staging=true needs CUDA (pinned host memory); this run is on {device}: "
                "set checkpoint.pinned_staging=false"
            )
        return cls(asynchronous=cfg.async_write, pinned_staging=cfg.pinned_staging)

    def submit(self, output_dir: str | Path, step: int, **state: Any) -> Path:
        """Commit (or start committing) step ``step``; returns the folder it will have once committed."""
        self.wait()
        if self.pool is None:
            return save_checkpoint(output_dir, step, **state)
        self.pending = self.pool.submit(save_checkpoint, output_dir, step, **state)
        return step_folder(output_dir, step)

    def hold(self, shards: Future | None) -> None:
        """A rank other than 0: remember its own async write, waited for like a commit."""
        self.wait()
        self.pending = shards

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self.pool is not None:
            self.pool.shutdown()


def snapshot(tree: Any) -> Any:
    """A deep copy of a state tree whose tensors no longer alias live parameters or optimizer state."""
    return copy.deepcopy(tree)


# ----------------------------------------------------------------------------- reading


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a DCP checkpoint (else the older single-file layout)."""
    return (Path(path) / DCP_DIR_NAME / ".metadata").is_file()


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a committed checkpoint's drafter config, train state and recipe (and, in the older
    single-file layout, the full drafter state); the DCP shards are read by ``load_sharded_state``."""
    path = Path(path)
    if not path.is_dir():
        raise missing_resume_path(path)
    if latest_checkpoint(path) is not None:
        raise ValueError(
            f"checkpoint.resume={path} is a run's output_dir, not one of its checkpoints: give {latest_checkpoint(path)} "
            f"(its newest), or checkpoint.resume=auto with output_dir={path}."
        )
    if not (path / COMMIT_MARKER).is_file():
        raise ValueError(
            f"{path} is not a committed checkpoint (no {COMMIT_MARKER} marker): it was interrupted while saving; resume from an older one."
        )
    sharded = is_sharded(path)
    if not sharded and not (path / LEGACY_WEIGHTS_NAME).is_file():
        raise ValueError(
            f"{path} holds neither {DCP_DIR_NAME}/.metadata (a sharded checkpoint) nor {LEGACY_WEIGHTS_NAME} "
            "(the older single-file layout): it is not a dflash-train checkpoint, or it was copied incompletely."
        )
    return {
        "path": path,
        "sharded": sharded,
        "drafter_state": None if sharded else load_file(path / LEGACY_WEIGHTS_NAME),
        "drafter_config": json.loads((path / "drafter_config.json").read_text()),
        "train_state": torch.load(path / STATE_NAME, weights_only=False),
        "config": yaml.safe_load((path / "config.yaml").read_text()),
    }


def load_sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, group=None
) -> None:
    """Every rank: read a DCP checkpoint into the (possibly sharded) drafter and its optimizer, at
    any world size (DCP reads the pieces of the saved tensors each rank's shards need).

    Names and shapes are checked against the checkpoint's metadata first, so a drafter of another
    architecture is the same clear ``ValueError`` as with the single-file layout.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from dflash_train.train.parallel import unwrap, uses_fsdp

    source = Path(path)
    expected = {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()}
    raise_on_mismatch(state_mismatches(expected, checkpoint_tensor_shapes(source / DCP_DIR_NAME)), source)
    state = sharded_state(model, optimizer)
    single = not (dist.is_available() and dist.is_initialized())
    if single:
        quiet_single_process_dcp()
    dcp.load(state, checkpoint_id=str(source / DCP_DIR_NAME), process_group=group, no_dist=single)
    module = model if uses_fsdp(model) else unwrap(model)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_model_state(
    model: torch.nn.Module,
    drafter_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    optim_state: dict[str, Any],
    source: str | Path,
) -> None:
    """Load a single-file checkpoint's full drafter and optimizer state into the (possibly wrapped) drafter.

    A tensor the model lacks, or of another shape, is a drafter of another architecture: it becomes a
    ``ValueError`` that names the tensors and says how to proceed, not a raw state-dict RuntimeError.
    """
    from dflash_train.train.parallel import load_full_state, unwrap

    expected = {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()}
    problems = state_mismatches(expected, {k: tuple(v.shape) for k, v in drafter_state.items()})
    try:
        if not problems:
            load_full_state(model, optimizer, drafter_state, optim_state)
    except RuntimeError as err:  # what the name/shape pre-check cannot see (e.g. optimizer state)
        if not any(sign in str(err) for sign in ("size mismatch", "Missing key", "Unexpected key", "shape")):
            raise
        problems = [str(err).splitlines()[0]]
    raise_on_mismatch(problems, source)


def raise_on_mismatch(problems: list[str], source: str | Path) -> None:
    """The ``ValueError`` for a checkpoint whose drafter has another architecture (no-op if none)."""
    if problems:
        raise ValueError(
            f"cannot resume from {source}: its drafter has another architecture than the one configured now "
            f"({'; '.join(problems[:6])}). Restore the drafter.* / target.* settings of that run "
            "(they are in its config.yaml and drafter_config.json), or start a new output_dir."
        )


def state_mismatches(expected: dict[str, tuple], found: dict[str, tuple]) -> list[str]:
    """Human-readable differences between two {tensor name: shape} maps."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [
        f"{k}: checkpoint {list(found[k])} vs now {list(expected[k])}"
        for k in sorted(set(expected) & set(found))
        if expected[k] != found[k]
    ]
    out = shapes
    if missing:
        out.append(f"missing from the checkpoint: {missing[:4]}")
    if unexpected:
        out.append(f"not in the model: {unexpected[:4]}")
    return out
