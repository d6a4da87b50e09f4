"""Checkpoint cost at the qwen3.6-27b drafter shape on one process: training stall, wall time, host RAM.

Three ways to save the same fp32 drafter (about 1.7B parameters) and its AdamW state, each in its own
subprocess so that the peak host RSS of one does not hide another's:

- ``gather``: the path before sharded checkpoints (as ``train/run.py`` did it): the full model and
  optimizer state gathered to rank 0's CPU, then one ``drafter.safetensors`` and one ``torch.save``
  written on a background thread. The stall is the gather;
- ``dcp-sync``: ``torch.distributed.checkpoint`` through the trainer's own functions
  (``checkpoint.sharded_state`` / ``write_shards`` / ``save_checkpoint``), synchronous
  (``checkpoint.async_write: false``): the stall is the whole save;
- ``dcp-async``: the same with ``dcp.async_save`` (``checkpoint.async_write: true``): the stall is
  the staging copy to CPU; the write and the commit run on background threads.

Per save: ``stall_s`` (what the training loop waits for), ``wall_s`` (until the checkpoint is
committed), ``peak_rss_gib`` (the process's peak resident host memory during the save, from
``VmHWM`` after resetting it), ``checkpoint_gib`` (bytes on disk). The first save of each mode
warms the allocator and the page cache; both are reported.

    python scripts/gpu_checkpoint_bench.py --dir /tmp/ckpt-bench              # H200, all three modes
    python scripts/gpu_checkpoint_bench.py --device cpu --preset tiny --dir /tmp/ckpt-bench   # dry run

Needs disk for two checkpoints at once (about 2 x 21 GB at the 27B shape); each mode's folder is
deleted when it is done. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

MODES = ("gather", "dcp-sync", "dcp-async")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="scratch folder for the checkpoints (deleted per mode)")
    p.add_argument("--preset", default="qwen3.6-27b", choices=["qwen3.6-27b", "qwen3-8b", "tiny"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--saves", type=int, default=2, help="saves per mode")
    p.add_argument("--mode", default="all", choices=["all", *MODES], help="all: one subprocess per mode")
    return p.parse_args()


def build_state(preset: str, device: str):
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
    target = targets.get(preset, tiny_hybrid_target_config)()
    if preset in targets:
        config = resolve_drafter_config(DrafterConfig(preset=preset), target)
    else:  # the tiny window (8) needs a block of at most 8
        drafter = DrafterConfig(preset=preset, block_size=4)
        config = resolve_drafter_config(drafter, target, target_layer_ids=[0, 2], mask_token_id=3)
    with torch.device(device):
        model = DFlashDrafter(config).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.startswith("cuda"))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return config, model, optimizer


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def folder_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def save_gather(out: Path, step: int, model, optimizer, config) -> tuple[float, threading.Thread, Path]:
    """The pre-DCP path: gather to CPU (stall), then safetensors + torch.save + fsync on a thread."""
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
    """``train/run.py: save`` on one process: stage or write the shards, then commit (maybe async)."""
    from dflash_train.train import checkpoint as ckpt

    start = time.perf_counter()
    writer.wait()
    ckpt.clear_staging(out, step)
    state = ckpt.sharded_state(model, optimizer)
    shards = ckpt.write_shards(
        state, ckpt.staging_folder(out, step), group=None, asynchronous=writer.asynchronous
    )
    path = writer.submit(
        out,
        step,
        shards=shards,
        drafter_config=config.to_serving_dict(),
        train_state={"step": step},
        config_yaml="",
        keep_last=1,
    )
    return time.perf_counter() - start, path


def run_mode(args: argparse.Namespace) -> dict:
    from dflash_train.train import checkpoint as ckpt

    config, model, optimizer = build_state(args.preset, args.device)
    params = sum(p.numel() for p in model.parameters())
    out = Path(args.dir) / args.mode
    shutil.rmtree(out, ignore_errors=True)
    writer = ckpt.CheckpointWriter(asynchronous=args.mode == "dcp-async")
    saves = []
    for step in range(1, args.saves + 1):
        sync(args.device)
        reset_peak_rss()
        start = time.perf_counter()
        if args.mode == "gather":
            stall, thread, path = save_gather(out, step, model, optimizer, config)
            thread.join()
        else:
            stall, path = save_dcp(out, step, model, optimizer, config, writer)
            writer.wait()
        wall = time.perf_counter() - start
        saves.append(
            {
                "stall_s": round(stall, 3),
                "wall_s": round(wall, 3),
                "peak_rss_gib": round(peak_rss_gib(), 2),
                "checkpoint_gib": round(folder_gib(path), 2),
            }
        )
        print(f"{args.mode} save {step}: {saves[-1]}", flush=True)
        if args.mode == "gather" and step > 1:
            shutil.rmtree(ckpt.step_folder(out, step - 1))  # as keep_last would
    writer.close()
    shutil.rmtree(out, ignore_errors=True)
    return {"mode": args.mode, "preset": args.preset, "drafter_params": params, "saves": saves}


def main() -> None:
    args = parse_args()
    if args.mode != "all":
        print(json.dumps(run_mode(args)), flush=True)
        return
    results = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
    }
    for mode in MODES:
        command = [sys.executable, __file__, "--dir", args.dir, "--preset", args.preset]
        command += ["--device", args.device, "--saves", str(args.saves), "--mode", mode]
        done = subprocess.run(command, capture_output=True, text=True)
        print(done.stdout, end="", flush=True)
        if done.returncode != 0:
            results[mode] = {"error": done.stderr[-3000:]}
            continue
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
