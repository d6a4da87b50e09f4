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
import warnings
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
    "train.loss",
    "train.kl_weight",
    "train.kl_topk",
    "train.loss_weighting",
    "train.dpace_alpha",
    "target.path",
    "target.target_layer_ids",
    "target.num_target_features",
    "data.seq_buckets",
    "data.token_budget",
    "train.max_steps",
    "train.num_epochs",
    "train.grad_accum",
    "train.lr_schedule",
    "train.seed",
)
# drafter.* keys that do not change the drafter a resume continues (its weights come from the
# checkpoint, not from init_from). Every other drafter.* key is architecture or semantics.
DRAFTER_KEYS_NOT_CHECKED = ("init_from",)
# Keys of drafter_config.json that may differ on resume: the compute dtype, not the architecture.
SERVING_KEYS_NOT_CHECKED = ("torch_dtype", "dtype")
# Recipe keys whose change is allowed with a warning.
RESUME_WARN_ONLY = ("data.paths",)


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


def resume_checked_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """RESUME_CRITICAL plus every ``drafter.*`` key of either recipe (but init_from)."""
    names = set(saved.get("drafter") or {}) | set(current.get("drafter") or {})
    drafter = [f"drafter.{n}" for n in sorted(names) if n not in DRAFTER_KEYS_NOT_CHECKED]
    return [*RESUME_CRITICAL, *(k for k in drafter if k not in RESUME_CRITICAL)]


def _flatten(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_drafter_config(
    saved: dict[str, Any], current: dict[str, Any], prefix: str = "drafter_config."
) -> dict[str, tuple[Any, Any]]:
    """Keys of two drafter serving configs (``drafter_config.json``) that differ, as
    ``<prefix><key>`` -> (saved, current); nested keys are dotted, the dtype keys are skipped."""
    old, new = _flatten(saved, prefix), _flatten(current, prefix)
    skip = tuple(f"{prefix}{k}" for k in SERVING_KEYS_NOT_CHECKED)
    return {
        key: (old.get(key), new.get(key))
        for key in sorted(set(old) | set(new))
        if key not in skip and old.get(key) != new.get(key)
    }


def check_resume_compatible(
    saved: dict[str, Any],
    current: dict[str, Any],
    allow_changed: list[str],
    *,
    saved_drafter: dict[str, Any] | None = None,
    current_drafter: dict[str, Any] | None = None,
) -> None:
    """Refuse to resume when a result-changing recipe knob, or the resolved drafter, differs.

    ``saved``/``current`` are recipe dicts; ``saved_drafter``/``current_drafter`` the drafter's serving
    config as saved in the checkpoint and as resolved now (it catches changes that come from the
    target or a preset, not from the recipe). A changed ``data.paths`` only warns.
    """
    changed = {
        key: (_lookup(saved, key), _lookup(current, key))
        for key in resume_checked_keys(saved, current)
        if _lookup(saved, key) != _lookup(current, key)
    }
    if saved_drafter is not None and current_drafter is not None:
        changed.update(changed_drafter_config(saved_drafter, current_drafter))
    refused = {k: v for k, v in changed.items() if k not in allow_changed}
    if refused:
        keys = ",".join(refused)  # no spaces: the override is pasted into a shell as one word
        details = "; ".join(f"{k}: checkpoint {old!r} -> now {new!r}" for k, (old, new) in refused.items())
        raise ValueError(
            f"refusing to resume: {details}. The checkpoint holds a drafter trained with the old values. "
            f"Restore them, start a new output_dir (drafter.init_from=<an export> starts from its weights), "
            f"or allow the change with checkpoint.allow_changed=[{keys}] (a change of shape still cannot load)."
        )
    for key in RESUME_WARN_ONLY:
        if _lookup(saved, key) != _lookup(current, key):
            warnings.warn(
                f"resuming with a changed {key}: checkpoint {_lookup(saved, key)!r} -> now "
                f"{_lookup(current, key)!r}; the saved data position (epoch, batch) is applied to the new data.",
                stacklevel=2,
            )


def load_model_state(
    model: torch.nn.Module,
    drafter_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    optim_state: dict[str, Any],
    source: str | Path,
) -> None:
    """Load a checkpoint's drafter and optimizer state into the (possibly wrapped) drafter.

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
