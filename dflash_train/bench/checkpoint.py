"""``dflash-train bench checkpoint``: what a save costs at a drafter preset's shape on one process:
the training stall, the wall time until committed, peak host RAM and bytes on disk.

Three ways to save the same fp32 drafter and its AdamW state (both moments filled):
- ``gather``: the path before sharded checkpoints: the full model and optimizer state gathered to
  rank 0's CPU (the stall), then one safetensors file and one ``torch.save`` written and committed
  on a background thread;
- ``dcp-sync``: ``torch.distributed.checkpoint`` through the trainer's own functions
  (``train/checkpoint.py``: ``sharded_state``, ``write_shards``, ``CheckpointWriter``) with
  ``checkpoint.async_write: false``: the stall is the whole save;
- ``dcp-async``: the same with ``dcp.async_save`` (the default): the stall is the staging copy to
  CPU; the write and the commit run on background threads;
- ``dcp-async-pinned``: the same with ``checkpoint.pinned_staging``: the copy goes into one pinned
  host buffer made at the first save and refilled by the later ones (CUDA only).
``--save-mode all`` runs each in its own process (``dflash-train bench checkpoint --save-mode M``),
so that one mode's peak host RSS cannot hide another's. Per save: ``stall_s``, ``wall_s``,
``peak_rss_gib`` (the process's VmHWM after resetting it, Linux) and ``checkpoint_bytes``. The first
save of each mode warms the allocator and the page cache; every save is reported. Needs scratch disk
for two checkpoints at once (~2 x 21 GB at the qwen3.6-27b shape); each mode's folder is deleted
when it is done.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_train.bench.progress import StepLimits, StepProgress

HELP = "Checkpoint saves at a drafter preset's shape: training stall, wall time, host RAM (gather, DCP, DCP async)."
SAVE_MODES = ("gather", "dcp-sync", "dcp-async", "dcp-async-pinned")
CUDA_MODES = ("dcp-async-pinned",)
PRESETS = ("qwen3.6-27b", "qwen3-8b", "tiny")
# Seconds a child process may take beyond its saves' limits (imports, building the state).
CHILD_START_S = 300.0


@dataclass(frozen=True, kw_only=True)
class CheckpointBenchOptions(StepLimits):
    """What ``dflash-train bench checkpoint`` measures; the defaults are the CLI's."""

    # Scratch folder for the checkpoints (each mode's subfolder is deleted when done).
    dir: str
    # Drafter preset whose shape is saved.
    preset: str = "tiny"
    saves: int = 2
    # gather, dcp-sync, dcp-async, dcp-async-pinned, or all (each in its own process).
    save_mode: str = "all"
    device: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r}: use one of {', '.join(PRESETS)}")
        if self.save_mode not in ("all", *SAVE_MODES):
            raise ValueError(f"--save-mode {self.save_mode!r}: use all or one of {', '.join(SAVE_MODES)}")
        if self.saves < 1:
            raise ValueError("--saves must be >= 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, help="scratch folder for the checkpoints")
    parser.add_argument("--preset", default="tiny", choices=PRESETS, help="drafter shape")
    parser.add_argument("--saves", type=int, default=2, help="saves per mode")
    parser.add_argument(
        "--save-mode", default="all", choices=["all", *SAVE_MODES], help="all: one process per mode"
    )
    parser.add_argument("--device", default="auto")


def run_checkpoint_bench(options: CheckpointBenchOptions) -> dict[str, Any]:
    """One save mode in this process, or every mode in a process of its own."""
    from dflash_train.train.parallel import pick_device

    device = pick_device(options.device)
    header = {
        "preset": options.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if options.save_mode in CUDA_MODES and device.type != "cuda":
        raise ValueError(f"--save-mode {options.save_mode} needs CUDA (pinned host memory); this is {device}")
    if options.save_mode != "all":
        return {**header, **run_save_mode(options, device)}
    modes: dict[str, Any] = {}
    skipped = [mode for mode in SAVE_MODES if mode in CUDA_MODES and device.type != "cuda"]
    bar_only = dataclasses.replace(options, step_timeout_s=0)  # each child enforces its own limits
    with StepProgress("checkpoint", len(SAVE_MODES) - len(skipped), bar_only) as progress:
        for mode in SAVE_MODES:
            if mode in skipped:
                modes[mode] = {"not_run": "needs CUDA (pinned host memory)"}
                continue
            with progress.step(mode):
                child = run_child(dataclasses.replace(options, save_mode=mode))
                modes[mode] = {key: value for key, value in child.items() if key not in header}
    return {**header, "modes": modes}


def run_child(options: CheckpointBenchOptions) -> dict[str, Any]:
    """``bench checkpoint --save-mode M`` in a fresh process: its JSON result, or the error."""
    command = [sys.executable, "-m", "dflash_train.cli", "bench", "checkpoint", "--json", "--no-progress"]
    command += ["--dir", options.dir, "--preset", options.preset, "--saves", str(options.saves)]
    command += ["--save-mode", options.save_mode, "--device", options.device]
    command += ["--step-timeout-s", str(options.step_timeout_s)]
    limit = CHILD_START_S + options.saves * options.step_timeout_s if options.step_timeout_s else None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"--save-mode {options.save_mode} ran past {limit:g} s"}
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr, end="")
        return {"error": f"exit code {done.returncode}: {done.stderr.strip()[-500:]}"}
    last = (done.stdout.strip().splitlines() or [""])[-1]
    try:
        result = json.loads(last)
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        print(done.stderr[-3000:], file=sys.stderr, end="")
        tail = done.stderr.strip()[-500:]
        return {"error": f"exit code 0 but no JSON result on stdout (last line: {last[-200:]!r}): {tail}"}
    return result


def run_save_mode(options: CheckpointBenchOptions, device: torch.device) -> dict[str, Any]:
    """``options.saves`` saves of one mode, each timed and measured, then the folder is removed."""
    from dflash_train.train import checkpoint as ckpt

    config, model, optimizer = build_state(options.preset, device)
    out = Path(options.dir) / options.save_mode
    shutil.rmtree(out, ignore_errors=True)
    asynchronous = options.save_mode.startswith("dcp-async")
    writer = ckpt.CheckpointWriter(asynchronous, pinned_staging=options.save_mode == "dcp-async-pinned")
    saves = []
    with StepProgress(f"checkpoint {options.save_mode}", options.saves, options) as progress:
        for step in range(1, options.saves + 1):
            with progress.step(f"save {step}/{options.saves}"):
                saves.append(measure_save(options.save_mode, out, step, model, optimizer, config, writer))
            if options.save_mode == "gather" and step > 1:
                shutil.rmtree(ckpt.step_folder(out, step - 1))  # as keep_last would
    writer.close()
    shutil.rmtree(out, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    return {"save_mode": options.save_mode, "drafter_params": params, "saves": saves}


def measure_save(mode: str, out: Path, step: int, model, optimizer, config, writer) -> dict[str, float]:
    """One save until committed: its stall, wall time, peak host RSS and size on disk."""
    synchronize(model)
    reset_peak_rss()
    start = time.perf_counter()
    if mode == "gather":
        stall, thread, path = save_gather(out, step, model, optimizer, config)
        thread.join()
    else:
        stall, path = save_dcp(out, step, model, optimizer, config, writer)
        writer.wait()
    return {
        "stall_s": round(stall, 3),
        "wall_s": round(time.perf_counter() - start, 3),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "checkpoint_bytes": folder_bytes(path),
        "checkpoint_gib": round(folder_bytes(path) / 2**30, 2),
    }


def build_state(preset: str, device: torch.device):
    """The preset drafter in fp32 and an AdamW whose moments exist (one step on random gradients)."""
    from dflash_train.config import DrafterConfig
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.presets import (
        qwen3_8b_target_config,
        qwen36_27b_target_config,
        resolve_drafter_config,
        tiny_hybrid_target_config,
    )

    targets = {"qwen3.6-27b": qwen36_27b_target_config, "qwen3-8b": qwen3_8b_target_config}
    if preset in targets:
        config = resolve_drafter_config(DrafterConfig(preset=preset), targets[preset]())
    else:  # the tiny window (8) needs a block of at most 8
        drafter = DrafterConfig(preset=preset, block_size=4)
        target = tiny_hybrid_target_config()
        config = resolve_drafter_config(drafter, target, target_layer_ids=[0, 2], mask_token_id=3)
    with torch.device(device):
        model = DFlashDrafter(config).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return config, model, optimizer


def save_gather(out: Path, step: int, model, optimizer, config) -> tuple[float, threading.Thread, Path]:
    """The pre-DCP path: gather to CPU (the stall), then safetensors + torch.save + fsync on a thread."""
    from safetensors.torch import save_file

    from dflash_train.train import checkpoint as ckpt
    from dflash_train.train.parallel import full_model_state, full_optimizer_state

    start = time.perf_counter()
    model_state = full_model_state(model)
    optim_state = full_optimizer_state(model, optimizer)
    stall = time.perf_counter() - start
    folder = ckpt.staging_folder(out, step)

    def write() -> None:
        ckpt.clear_staging(out, step)
        save_file({k: v.contiguous() for k, v in model_state.items()}, folder / "drafter.safetensors")
        torch.save({"step": step, "optimizer": optim_state}, folder / "state.pt")
        (folder / "drafter_config.json").write_text(json.dumps(config.to_serving_dict()))
        ckpt._fsync_tree(folder)
        (folder / ckpt.COMMIT_MARKER).write_text(f"{step}\n")
        os.replace(folder, ckpt.step_folder(out, step))

    thread = threading.Thread(target=write, name="checkpoint")
    thread.start()
    return stall, thread, ckpt.step_folder(out, step)


def save_dcp(out: Path, step: int, model, optimizer, config, writer) -> tuple[float, Path]:
    """The trainer's save on one process: stage or write the shards, then commit (maybe async)."""
    from dflash_train.train import checkpoint as ckpt

    start = time.perf_counter()
    writer.wait()
    ckpt.clear_staging(out, step)
    state = ckpt.sharded_state(model, optimizer)
    staged = ckpt.stage_shards(state, ckpt.staging_folder(out, step), writer)
    shards = ckpt.write_shards(staged, group=None)
    path = writer.submit(
        out, step, shards=shards, drafter_config=config.to_serving_dict(), train_state={"step": step},
        config_yaml="", keep_last=1,
    )  # fmt: skip
    return time.perf_counter() - start, path


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def synchronize(model: torch.nn.Module) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The mode's entry points (bench/modes.py).
Options = CheckpointBenchOptions
run = run_checkpoint_bench
