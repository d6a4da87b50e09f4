"""Save and load the serving layout (DESIGN.md section 3): ``config.json`` + ``model.safetensors``.

This is the directory SGLang (``--speculative-algorithm DFLASH``) and vLLM (``method: dflash``) load:
drafter tensors only (no embedding, no LM head; the target's are used), named as the serving
implementations expect, which are exactly ``DFlashDrafter``'s parameter names. Next to them,
``SERVING.md`` holds the exact SGLang and vLLM flags for this export (``models/serving.py``): the
block size is a serving flag in both engines, not read from the config.

Training checkpoints (written by the trainer) are directories ``step-*`` holding
``drafter_config.json`` (the same serving dict), the fp32 drafter either as a
``torch.distributed.checkpoint`` folder ``model_optim/`` (sharded by rank, next to the optimizer
state) or, in the older layout, as ``drafter.safetensors``, plus a ``COMMITTED`` marker once complete;
``export_checkpoint`` turns either into the serving layout on one process (CPU is enough).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.dtypes import DTYPES
from dflash_train.models.serving import (
    EVAL_RECORD_NAME,
    SERVING_NOTES_NAME,
    TARGET_PLACEHOLDER,
    serving_notes,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CHECKPOINT_CONFIG_NAME = "drafter_config.json"
CHECKPOINT_WEIGHTS_NAME = "drafter.safetensors"
COMMIT_MARKER = "COMMITTED"
DCP_DIR_NAME = "model_optim"  # the DCP folder of a sharded checkpoint; the drafter's keys are "model.*"
MODEL_PREFIX = "model."


def _torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}.")
    return DTYPES[name]


def _write_atomically(out: Path, writers: dict[str, Callable[[Path], Any]]) -> None:
    """Write each file ``name`` of ``out`` through ``writers[name](tmp_path)`` and fsync it, then rename
    them all into place: a failure while writing (a full disk) leaves the previous files whole, never
    new weights beside an old config, and removes the temporary files."""
    staged: dict[Path, Path] = {}
    try:
        for name, write in writers.items():
            tmp = out / f".{name}.tmp"
            staged[tmp] = out / name
            write(tmp)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
    except BaseException:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, path in staged.items():
        os.replace(tmp, path)


def save_drafter(
    drafter: DFlashDrafter,
    config: DFlashDraftConfig,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    *,
    target: str = TARGET_PLACEHOLDER,
    served_from: str | Path | None = None,
    announce: bool = False,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` (drafter tensors in ``dtype``) and ``SERVING.md``
    (the exact SGLang/vLLM flags, with ``target`` as the target model and ``served_from`` as the
    drafter, default out_dir: a staging folder renamed afterwards names its final place) to out_dir;
    ``announce`` also prints the serving flags."""
    torch_dtype = _torch_dtype(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = serving_state(drafter, torch_dtype)
    serving = config.to_serving_dict()
    serving["torch_dtype"] = serving["dtype"] = dtype
    set_aside_other_weights_eval(out, tensors)
    notes = serving_notes(config, out, target, served_from)
    _write_atomically(
        out,
        {
            WEIGHTS_NAME: lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
            CONFIG_NAME: lambda p: p.write_text(json.dumps(serving, indent=2) + "\n"),
            SERVING_NOTES_NAME: lambda p: p.write_text(notes),
        },
    )
    if announce:
        print(notes, end="", flush=True)
    return out


def serving_state(drafter: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of the serving layout: the drafter's state dict in ``dtype`` (a meta-device drafter
    gives meta tensors: names and shapes without memory, for checking the 27B layout)."""
    device = "meta" if next(drafter.parameters()).is_meta else "cpu"
    return {
        name: tensor.detach().to(device=device, dtype=dtype).contiguous()
        for name, tensor in drafter.state_dict().items()
    }


def _read_tensors(path: Path, device: str) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device=device) as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def set_aside_other_weights_eval(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """An ``eval.json`` beside weights other than ``tensors`` (the eval of an earlier export into
    ``out``) is renamed ``eval.json.old``: SERVING.md must not state its numbers for these weights.
    Beside the same weights (a re-export) or without weights (the in-training best export writes its
    record first) it stays."""
    record, weights = out / EVAL_RECORD_NAME, out / WEIGHTS_NAME
    if not (record.is_file() and weights.is_file()):
        return
    with safe_open(str(weights), framework="pt") as old:
        same = set(old.keys()) == set(tensors) and all(
            same_tensor(old.get_tensor(name), tensor) for name, tensor in tensors.items()
        )
    if not same:
        os.replace(record, out / f"{EVAL_RECORD_NAME}.old")
        print(
            f"export: {record} measured the weights this export replaces: set aside as {EVAL_RECORD_NAME}.old "
            "(run `dflash-train eval --output-dir` on the new export for SERVING.md's numbers)",
            file=sys.stderr,
        )


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def build_drafter_from_tensors(
    config: DFlashDraftConfig, tensors: dict[str, torch.Tensor], source: Path, dtype: torch.dtype | None
) -> DFlashDrafter:
    """A drafter whose parameters are ``tensors`` (checked by name and shape), built without random init."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match its config ({config.num_hidden_layers} layers, "
            f"{config.num_target_features} target features): missing tensors {missing[:8]}, "
            f"unexpected tensors {unexpected[:8]}. Is it a DFlash drafter export of this shape?"
        )
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the config needs "
                f"{tuple(expected[name].shape)}."
            )
    if dtype is not None:
        tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    drafter.load_state_dict(tensors, strict=True, assign=True)
    return drafter


def read_drafter_config(path: Path) -> DFlashDraftConfig:
    """The drafter config of a serving ``config.json`` (or a checkpoint's ``drafter_config.json``);
    a file that is not one is a ``ValueError`` naming it."""
    try:
        raw = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): re-export the drafter.") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a {type(raw).__name__}, not a config object: re-export the drafter.")
    try:
        return DFlashDraftConfig.from_serving_dict(raw)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def load_drafter(
    path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None
) -> tuple[DFlashDrafter, DFlashDraftConfig]:
    """Load a serving-layout directory; ``dtype=None`` keeps the saved dtype."""
    root = Path(path)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (root / name).is_file():
            raise ValueError(f"{root} has no {name}: not an exported DFlash drafter directory.")
    config = read_drafter_config(root / CONFIG_NAME)
    if isinstance(dtype, str):
        dtype = _torch_dtype(dtype)
    tensors = _read_tensors(root / WEIGHTS_NAME, str(device))
    return build_drafter_from_tensors(config, tensors, root / WEIGHTS_NAME, dtype), config


def quiet_single_process_dcp() -> None:
    """Silence DCP's warning that it runs without a process group: one process is what we mean.
    A process-wide filter, as an async save warns on its own thread."""
    import warnings

    warnings.filterwarnings(
        "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
    )


def _dcp_metadata(dcp_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    if not (dcp_dir / ".metadata").is_file():
        raise ValueError(f"{dcp_dir} has no .metadata: not a complete torch.distributed.checkpoint folder.")
    return FileSystemReader(str(dcp_dir)).read_metadata()


def checkpoint_tensor_shapes(dcp_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """The drafter's tensor names and full shapes in a sharded checkpoint (from metadata only)."""
    entries = _dcp_metadata(Path(dcp_dir)).state_dict_metadata
    return {
        key.removeprefix(MODEL_PREFIX): tuple(entry.size)
        for key, entry in entries.items()
        if key.startswith(MODEL_PREFIX) and hasattr(entry, "size")
    }


def read_dcp_model_state(dcp_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full fp32 drafter of a sharded checkpoint on this process's CPU, without a process group.

    Only the ``model.*`` entries are read (not the optimizer state, twice their size); the shards of
    every saved rank are put together by DCP, whatever the world size of the run that wrote them.
    """
    import torch.distributed.checkpoint as dcp

    dcp_dir = Path(dcp_dir)
    entries = _dcp_metadata(dcp_dir).state_dict_metadata
    tensors = {
        key.removeprefix(MODEL_PREFIX): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith(MODEL_PREFIX) and hasattr(entry, "size")
    }
    state = {"model": tensors}
    quiet_single_process_dcp()
    dcp.load(state, checkpoint_id=str(dcp_dir), no_dist=True)
    return state["model"]


def _is_checkpoint(root: Path) -> bool:
    return (root / CHECKPOINT_WEIGHTS_NAME).is_file() or (root / DCP_DIR_NAME).is_dir()


def _checkpoint_tensors(source: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The drafter tensors of a checkpoint in either layout, and the file or folder they came from."""
    if (source / DCP_DIR_NAME).is_dir():
        return read_dcp_model_state(source / DCP_DIR_NAME), source / DCP_DIR_NAME
    return _read_tensors(source / CHECKPOINT_WEIGHTS_NAME, "cpu"), source / CHECKPOINT_WEIGHTS_NAME


def _step_number(path: Path) -> int:
    match = re.fullmatch(r"step-(\d+)", path.name)
    return int(match.group(1)) if match else -1


def resolve_checkpoint(path: str | Path) -> Path:
    """A committed checkpoint dir itself, or the newest committed ``checkpoints/step-*`` of a run dir."""
    root = Path(path)
    if _is_checkpoint(root):
        if not (root / COMMIT_MARKER).is_file():
            raise ValueError(f"{root} has no {COMMIT_MARKER} marker: the checkpoint is incomplete.")
        return root
    candidates = [
        step
        for step in (root / "checkpoints").glob("step-*")
        if (step / COMMIT_MARKER).is_file() and _step_number(step) >= 0
    ]
    if not candidates:
        raise ValueError(
            f"{root} is neither a committed checkpoint (step-* with {DCP_DIR_NAME}/ or {CHECKPOINT_WEIGHTS_NAME}, "
            f"and {COMMIT_MARKER}) nor a run directory with committed checkpoints/step-*."
        )
    return max(candidates, key=_step_number)


def export_checkpoint(checkpoint: str | Path, output: str | Path, dtype: str = "bfloat16") -> dict[str, Any]:
    """``dflash-train export``: a training checkpoint (or run dir) -> serving layout in ``output``."""
    _torch_dtype(dtype)
    source = resolve_checkpoint(checkpoint)
    if not (source / CHECKPOINT_CONFIG_NAME).is_file():
        raise ValueError(f"{source} has no {CHECKPOINT_CONFIG_NAME}: cannot tell the drafter's shape.")
    config = read_drafter_config(source / CHECKPOINT_CONFIG_NAME)
    tensors, origin = _checkpoint_tensors(source)
    drafter = build_drafter_from_tensors(config, tensors, origin, None)
    out = save_drafter(drafter, config, output, dtype=dtype, target=recipe_target(source), announce=True)
    return {
        "export": str(out),
        "checkpoint": str(source),
        "tensors": len(tensors),
        "dtype": dtype,
        "serving": str(out / SERVING_NOTES_NAME),
    }


def recipe_target(checkpoint: Path) -> str:
    """``target.path`` of the recipe saved in a checkpoint (``config.yaml``), for the serving flags.

    A relative path names a folder under the directory the run was launched from (``launch_dir`` in
    the run's ``run_info.json``, two levels above ``checkpoints/step-N``), which need not be the one
    this export runs in; a path that is no folder there either (a hub id) stays as written."""
    import yaml

    recipe = checkpoint / "config.yaml"
    if not recipe.is_file():
        return TARGET_PLACEHOLDER
    raw = yaml.safe_load(recipe.read_text()) or {}
    target = str((raw.get("target") or {}).get("path") or TARGET_PLACEHOLDER)
    info = checkpoint.parent.parent / "run_info.json"
    if Path(target).is_absolute() or Path(target).is_dir() or not info.is_file():
        return target
    launched = Path(json.loads(info.read_text()).get("launch_dir") or ".") / target
    return str(launched.resolve()) if launched.is_dir() else target
