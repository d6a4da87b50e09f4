"""Atomic checkpoints: write to a temporary folder, fsync, drop a commit marker, rename.

Layout of ``<output_dir>/checkpoints/step-000123/``:
  drafter.safetensors   full fp32 drafter state (serving tensor names), readable by ``export``
  drafter_config.json   the drafter's serving config.json
  state.pt              optimizer, scheduler, data position, RNG, metric counters, step
  config.yaml           the resolved recipe
  COMMITTED             written last; a folder without it is ignored (a crash mid-save)
Only rank 0 writes; the state it writes is gathered from every rank beforehand.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file

COMMIT_MARKER = "COMMITTED"
STEP_DIR = re.compile(r"^step-(\d+)$")
# Recipe keys that change what is learned; a resume with a different value is refused unless allowed.
RESUME_CRITICAL = (
    "drafter.block_size",
    "train.num_anchors",
    "train.gamma",
    "target.path",
    "target.target_layer_ids",
    "data.seq_buckets",
    "data.token_budget",
    "train.max_steps",
    "train.num_epochs",
    "train.grad_accum",
    "train.lr_schedule",
    "train.seed",
)


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    drafter_state: dict[str, torch.Tensor],
    drafter_config: dict[str, Any],
    train_state: dict[str, Any],
    config_yaml: str,
    keep_last: int,
) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``keep_last`` (rank 0 only)."""
    root = checkpoints_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in drafter_state.items()}
    save_file(state, tmp / "drafter.safetensors")
    (tmp / "drafter_config.json").write_text(json.dumps(drafter_config, indent=2))
    torch.save(train_state, tmp / "state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    for f in tmp.iterdir():
        _fsync_file(f)
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
    """Writes checkpoints on one background thread so training goes on during the disk I/O.

    At 27B scale a checkpoint is ~20 GB (fp32 drafter + AdamW state) and takes tens of seconds to
    write and fsync. The state is snapshotted on the training thread first (``snapshot``); at most
    one write is in flight, so submitting the next one, ``wait`` and ``close`` block on the previous
    write and raise its error in the training thread. The thread only does file I/O.
    """

    def __init__(self, asynchronous: bool = True):
        self.pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if asynchronous else None
        )
        self.pending: Future | None = None

    def submit(self, output_dir: str | Path, step: int, **state: Any) -> Path:
        """Write (or start writing) step ``step``; returns the folder it will have once committed."""
        self.wait()
        if self.pool is None:
            return save_checkpoint(output_dir, step, **state)
        self.pending = self.pool.submit(save_checkpoint, output_dir, step, **state)
        return checkpoints_root(output_dir) / f"step-{step:08d}"

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


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a committed checkpoint: drafter state, drafter config, train state and recipe."""
    path = Path(path)
    if not (path / COMMIT_MARKER).is_file():
        raise ValueError(
            f"{path} is not a committed checkpoint (no {COMMIT_MARKER} marker): it was interrupted while saving; resume from an older one."
        )
    return {
        "path": path,
        "drafter_state": load_file(path / "drafter.safetensors"),
        "drafter_config": json.loads((path / "drafter_config.json").read_text()),
        "train_state": torch.load(path / "state.pt", weights_only=False),
        "config": yaml.safe_load((path / "config.yaml").read_text()),
    }


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any], allow_changed: list[str]) -> None:
    """Refuse to resume when a result-changing recipe knob differs from the checkpoint's."""
    changed = [
        f"{key}: checkpoint {_lookup(saved, key)!r} -> now {_lookup(current, key)!r}"
        for key in RESUME_CRITICAL
        if key not in allow_changed and _lookup(saved, key) != _lookup(current, key)
    ]
    if changed:
        keys = ", ".join(c.split(":")[0] for c in changed)
        raise ValueError(
            "refusing to resume: "
            + "; ".join(changed)
            + f". Restore the original values, start a new output_dir, "
            f"or allow the change with checkpoint.allow_changed=[{keys}]."
        )
