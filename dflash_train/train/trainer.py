"""The training loop: frozen target features -> drafter forward/backward -> optimizer step.

One process per GPU (or one CPU process), one thread doing all device work. ``train()`` builds
the run, then loops over optimizer steps: step, log, save. Every decision that changes control
flow (stop on SIGTERM, stop on a non-finite loss) is taken by all ranks together through one
small all-reduce per step.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_train.config import RunConfig, load_config
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.builders import (
    DTYPES,
    build_data,
    build_drafter,
    build_optimizer,
    build_scheduler,
    build_target,
    seed_everything,
)
from dflash_train.train.faults import GracefulStop, Watchdog, any_rank_flags
from dflash_train.train.flops import mfu, train_step_flops
from dflash_train.train.logging import MetricsLogger, log_main
from dflash_train.train.loss import add_metrics, block_targets, dflash_loss, loss_weights, summarize_metrics
from dflash_train.train.parallel import (
    DistInfo,
    all_reduce_sum,
    full_model_state,
    full_optimizer_state,
    init_distributed,
    unwrap,
    use_expandable_segments,
    uses_fsdp,
)
from dflash_train.train.step_timer import PhaseTimer


class NonFiniteError(RuntimeError):
    """Raised on every rank when any rank saw a non-finite loss or gradient norm."""


@dataclass
class TrainHooks:
    """Test seams: called after backward (e.g. to inject a NaN) and after each optimizer step."""

    after_backward: Any = None
    after_step: Any = None


@dataclass
class Run:
    """Everything a training run holds."""

    cfg: RunConfig
    info: DistInfo
    target: Any
    draft_config: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data: Any
    total_steps: int
    step: int = 0
    counters: dict[str, float] = field(default_factory=lambda: {"skipped_steps": 0})
    writer: ckpt.CheckpointWriter | None = None

    @property
    def gamma(self) -> float:
        return self.cfg.loss_gamma


def run_training(recipe: str, overrides: list[str]) -> dict[str, Any]:
    """CLI entry: ``dflash-train train RECIPE key=value ...``."""
    return train(load_config(recipe, overrides))


def train(cfg: RunConfig, hooks: TrainHooks | None = None) -> dict[str, Any]:
    """Build the run, then loop over optimizer steps until done, stopped or failed."""
    if cfg.train.placement == "split":
        from dflash_train.train.split import train_split  # lazy: split.py imports this module

        return train_split(cfg, hooks)
    hooks = hooks or TrainHooks()
    use_expandable_segments()
    info = init_distributed(cfg.train.device, timeout_s=cfg.train.dist_timeout_s)
    run = build_run(cfg, info)
    logger = MetricsLogger(
        Path(cfg.output_dir),
        cfg.logging,
        total_steps=run.total_steps,
        is_main=info.is_main,
        config_dict=cfg.to_dict(),
        start_step=run.step,
    )
    try:
        last_loss, saved = train_loop(run, hooks, logger)
    finally:
        run.writer.close()  # the last checkpoint is committed before the export and the exit
    export = export_final(run) if run.step >= run.total_steps else None
    logger.close()
    return {
        "step": run.step,
        "loss": last_loss,
        "tau": logger.last.get("tau"),
        "checkpoint": str(saved) if saved else None,
        "export": str(export) if export else None,
    }


def train_loop(run: Run, hooks: TrainHooks, logger: MetricsLogger) -> tuple[float, Path | None]:
    """Optimizer steps until done or a collective stop: step, log, save."""
    cfg = run.cfg
    timer = PhaseTimer(run.info.device)
    metrics_sum, last_loss, saved = None, float("nan"), None
    log_t0, log_step0 = time.perf_counter(), run.step
    stacks = Path(cfg.output_dir) / "watchdog-stacks.txt"
    with GracefulStop() as stop, Watchdog(cfg.train.watchdog_s, stacks) as watchdog:
        while run.step < run.total_steps:
            watchdog.beat(run.step)
            result = train_step(run, timer, hooks, stop_requested=lambda: stop.requested)
            metrics_sum = add_metrics(metrics_sum, result["stats"])
            stopping = result["stop"]  # agreed by all ranks inside the step
            if run.step % cfg.logging.every_steps == 0 or run.step == run.total_steps or stopping:
                seconds = time.perf_counter() - log_t0
                row = log_metrics(run, result, metrics_sum, timer, seconds, run.step - log_step0)
                last_loss = row["loss"]
                logger.log(run.step, row)
                metrics_sum, log_t0, log_step0 = None, time.perf_counter(), run.step
            logger.advance(run.step)
            if stopping or run.step % cfg.checkpoint.every_steps == 0 or run.step == run.total_steps:
                saved = save(run)
            if stopping:
                log_main(f"SIGTERM: saved {saved} at step {run.step}; exiting")
                break
    return last_loss, saved


# ----------------------------------------------------------------------------- building


def build_run(cfg: RunConfig, info: DistInfo) -> Run:
    """Target, drafter, optimizer, schedule and data; then resume if a checkpoint exists."""
    seed_everything(cfg.train.seed)
    target = build_target(cfg, info)
    draft_config, model = build_drafter(cfg, target, info)
    optimizer = build_optimizer(model, cfg, info)
    data = build_data(cfg, target, info)
    total = cfg.train.max_steps or cfg.train.num_epochs * (data.steps_per_epoch // cfg.train.grad_accum)
    if total < 1:
        raise ValueError(
            f"the data gives {data.steps_per_epoch} micro-batches per epoch per rank, fewer than train.grad_accum={cfg.train.grad_accum}: add data, lower grad_accum or set train.max_steps."
        )
    scheduler = build_scheduler(optimizer, cfg, total)
    run = Run(
        cfg=cfg,
        info=info,
        target=target,
        draft_config=draft_config,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        total_steps=total,
    )
    run.writer = ckpt.CheckpointWriter(asynchronous=cfg.checkpoint.async_write)
    if info.is_main:
        write_run_info(run)
    maybe_resume(run)
    log_main(
        f"training: {total} steps, {sum(p.numel() for p in unwrap(model).parameters()) / 1e6:.1f}M drafter params, "
        f"world {info.world_size}, device {info.device}, target kernels {target.kernels}"
    )
    return run


def write_run_info(run: Run) -> None:
    """The resolved recipe and the run's metadata (kernels bound, versions, world) in output_dir."""
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
        "total_steps": run.total_steps,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / "run_info.json").write_text(json.dumps(info, indent=2, default=str))


# ----------------------------------------------------------------------------- the step


def train_step(
    run: Run, timer: PhaseTimer, hooks: TrainHooks, stop_requested=lambda: False
) -> dict[str, Any]:
    """One optimizer step over ``grad_accum`` micro-batches: features -> drafter fwd/bwd -> update."""
    cfg = run.cfg
    micro = [
        prepare_micro_batch(run, batch, epoch)
        for batch, epoch in (run.data.next_batch() for _ in range(cfg.train.grad_accum))
    ]
    denom = step_denominator(micro)
    loss_total, stats_sum, flops = torch.zeros((), device=run.info.device), None, 0
    for i, m in enumerate(micro):
        with timer.phase("target"):
            # Right padding is invisible to a causal target at real tokens, and filler rows have an
            # all-false mask that could produce fully masked softmax rows: run without a mask.
            features = run.target.features(m["input_ids"], None)
        loss, stats = drafter_forward_backward(run, timer, m, features, denom, last=i == len(micro) - 1)
        loss_total += loss
        stats_sum = add_metrics(stats_sum, stats)
        flops += step_flops(run, m)
        del features
    if hooks.after_backward:
        hooks.after_backward(run)
    # SIGTERM is read here, at the end of the step, so a signal during step k stops after step k.
    result = optimizer_update(run, timer, loss_total, stop_requested())
    if hooks.after_step:
        hooks.after_step(run)
    return {**result, "stats": stats_sum, "flops": flops}


def step_denominator(micro: list[dict[str, torch.Tensor]], group=None) -> torch.Tensor:
    """Total loss weight of the optimizer step over every rank and micro-batch (stays on device)."""
    return all_reduce_sum(torch.stack([m["weights"].sum() for m in micro]).sum(), group)


def drafter_forward_backward(
    run: Run,
    timer: PhaseTimer,
    m: dict[str, torch.Tensor],
    features: torch.Tensor,
    denom: torch.Tensor,
    last: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Drafter forward, one-pass LM-head loss and backward for one micro-batch; (loss, stats)."""
    cfg = run.cfg
    with timer.phase("drafter"), no_sync_unless_last(run.model, last), compute_precision(run):
        hidden = run.model(
            features,
            m["input_ids"],
            m["anchors"],
            m["keep"],
            run.target.embed_tokens,
            backend=resolve_backend(cfg, run.info),
            sdpa_anchor_chunk=cfg.train.sdpa_anchor_chunk,
        )
        loss, stats = dflash_loss(
            hidden.to(run.target.lm_head.weight.dtype),
            run.target.lm_head.weight,
            m["labels"],
            m["label_valid"],
            m["keep"],
            gamma=run.gamma,
            denom=denom,
            chunk_tokens=cfg.train.loss_chunk_tokens,
            fused=cfg.train.compile and run.info.device.type == "cuda",
        )
        # DDP/FSDP average gradients over ranks; the loss is already a global sum, so undo the mean.
        (loss * run.info.world_size).backward()
    stats["real_tokens"] = m["attention_mask"].sum()
    return loss.detach(), stats


def optimizer_update(
    run: Run, timer: PhaseTimer, loss_total: torch.Tensor, stop_requested: bool, group=None
) -> dict[str, Any]:
    """Clip, agree on every rank (non-finite? stop?), then step, skip or raise; advances ``run.step``.

    ``group`` reduces the loss over the drafter ranks only (split placement); the vote is always
    over every rank of the job.
    """
    with timer.phase("optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.train.clip_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor norm over the sharded gradients
            grad_norm = grad_norm.full_tensor()
        loss_total = all_reduce_sum(loss_total, group)
        bad = ~torch.isfinite(loss_total) | ~torch.isfinite(grad_norm)
        # The one host sync of a step: every rank must agree before the update.
        nonfinite, stop = any_rank_flags([bad, stop_requested], run.info.device)
        if nonfinite:
            run.optimizer.zero_grad(set_to_none=True)
            handle_nonfinite(run, float(loss_total), float(grad_norm))
        else:
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.scheduler.step()
    run.step += 1
    return {"loss": loss_total, "grad_norm": grad_norm, "stop": stop}


def handle_nonfinite(run: Run, loss: float, grad_norm: float) -> None:
    """Stop every rank before the update (default) or skip the step and count it."""
    if run.cfg.train.nonfinite == "skip":
        run.counters["skipped_steps"] += 1
        log_main(
            f"step {run.step}: non-finite loss {loss} or grad norm {grad_norm} on some rank; step skipped (train.nonfinite=skip)"
        )
        return
    raise NonFiniteError(
        f"step {run.step}: non-finite loss ({loss}) or gradient norm ({grad_norm}) on at least one rank; stopped before the optimizer step, "
        "no checkpoint written after it. Lower train.lr, check the data, or set train.nonfinite=skip to skip such steps."
    )


def prepare_micro_batch(run: Run, batch, epoch: int) -> dict[str, torch.Tensor]:
    """Move a batch to the device, draw its anchors and build labels and loss weights."""
    from dflash_train.data.anchors import sample_anchors

    dev = run.info.device
    input_ids = batch.input_ids.to(dev, non_blocking=True)
    loss_mask = batch.loss_mask.to(dev, non_blocking=True)
    attention_mask = batch.attention_mask.to(dev, non_blocking=True)
    anchors, keep = sample_anchors(
        loss_mask, run.cfg.train.num_anchors, run.cfg.train.seed, epoch, batch.sample_index.to(dev)
    )
    labels, label_valid = block_targets(input_ids, loss_mask, anchors, run.cfg.drafter.block_size)
    weights = loss_weights(keep, label_valid, run.gamma)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "anchors": anchors,
        "keep": keep,
        "labels": labels,
        "label_valid": label_valid,
        "weights": weights,
    }


def compute_precision(run: Run):
    """bf16 compute over fp32 master weights: FSDP2's mixed-precision policy casts the parameters
    itself; a single process or DDP gets autocast."""
    dtype = DTYPES[run.cfg.train.dtype]
    if dtype == torch.float32 or uses_fsdp(run.model):
        return contextlib.nullcontext()
    return torch.autocast(run.info.device.type, dtype=dtype)


def resolve_backend(cfg: RunConfig, info: DistInfo) -> str:
    if cfg.train.attention_backend != "auto":
        return cfg.train.attention_backend
    return "flex" if info.device.type == "cuda" else "sdpa"


class no_sync_unless_last:
    """Skip DDP's gradient all-reduce on all but the last micro-batch of a step."""

    def __init__(self, model: nn.Module, last: bool):
        self.ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else None

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx else False


def step_flops(run: Run, m: dict[str, torch.Tensor]) -> float:
    rows, seq_len = m["input_ids"].shape
    return train_step_flops(
        run.target.config, run.draft_config, seq_len=seq_len, num_anchors=m["anchors"].shape[1], rows=rows
    )["total"]


# ----------------------------------------------------------------------------- logging


def log_metrics(
    run: Run,
    result: dict,
    metrics_sum: dict,
    timer: PhaseTimer,
    seconds: float,
    steps: int,
    group=None,
) -> dict[str, Any]:
    """Reduce the summed metrics over ``group`` (default: all ranks) into one log row (log steps only)."""
    info = run.info
    for value in metrics_sum.values():
        all_reduce_sum(value, group)
    phases = timer.collect()
    summary = summarize_metrics({k: v for k, v in metrics_sum.items() if k != "real_tokens"})
    real_tokens = float(metrics_sum["real_tokens"])
    step_s = seconds / max(steps, 1)
    row = {
        "loss": float(result["loss"]),
        "lr": run.scheduler.get_last_lr()[0],
        "grad_norm": float(result["grad_norm"]),
        **summary,
        "tokens_per_s": real_tokens / max(seconds, 1e-9),
        "tokens_per_s_per_rank": real_tokens / max(seconds, 1e-9) / info.world_size,
        "step_s": step_s,
        "mfu": mfu(result["flops"], step_s) if info.device.type == "cuda" else 0.0,
        "time_target_s": phases.get("target", 0.0) / max(steps, 1),
        "time_drafter_s": phases.get("drafter", 0.0) / max(steps, 1),
        "time_optimizer_s": phases.get("optimizer", 0.0) / max(steps, 1),
        "skipped_steps": run.counters["skipped_steps"],
        "epoch": run.data.epoch,
        **{f"data_{k}": v for k, v in run.data.log_stats().items()},
    }
    if info.device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(info.device) / 1e9
    return row


# ----------------------------------------------------------------------------- checkpoints


def train_state_dict(run: Run, optim_state: dict, **extra: Any) -> dict[str, Any]:
    """Everything but the drafter weights that a resume needs (``extra``: placement-specific parts)."""
    return {
        "step": run.step,
        "optimizer": optim_state,
        "scheduler": run.scheduler.state_dict(),
        "data": run.data.state_dict(),
        **extra,
        "counters": dict(run.counters),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }


def save(run: Run) -> Path | None:
    """Gather the full state from every rank; rank 0 writes it atomically (in the background)."""
    model_state = full_model_state(run.model)
    optim_state = full_optimizer_state(run.model, run.optimizer)
    path = None
    if run.info.is_main:
        train_state = train_state_dict(run, optim_state)
        if run.writer.pool is not None and run.info.device.type == "cpu":
            # On CPU the gathered state aliases the live tensors; the writer thread needs a copy.
            model_state, train_state = ckpt.snapshot(model_state), ckpt.snapshot(train_state)
        path = run.writer.submit(
            run.cfg.output_dir,
            run.step,
            drafter_state=model_state,
            drafter_config=run.draft_config.to_serving_dict(),
            train_state=train_state,
            config_yaml=run.cfg.to_yaml(),
            keep_last=run.cfg.checkpoint.keep_last,
        )
    _barrier(run.info)
    return path or ckpt.checkpoints_root(run.cfg.output_dir) / f"step-{run.step:08d}"


def _barrier(info: DistInfo) -> None:
    if info.distributed:
        torch.distributed.barrier()


def maybe_resume(run: Run) -> None:
    """``resume: auto`` continues from the newest committed checkpoint of output_dir."""
    mode = run.cfg.checkpoint.resume
    path = (
        None
        if mode == "never"
        else (ckpt.latest_checkpoint(run.cfg.output_dir) if mode == "auto" else Path(mode))
    )
    if path is None:
        return
    loaded = ckpt.load_checkpoint(path)
    ckpt.check_resume_compatible(
        loaded["config"],
        run.cfg.to_dict(),
        run.cfg.checkpoint.allow_changed,
        saved_drafter=loaded["drafter_config"],
        current_drafter=run.draft_config.to_serving_dict(),
    )
    state = loaded["train_state"]
    ckpt.load_model_state(run.model, loaded["drafter_state"], run.optimizer, state["optimizer"], path)
    run.scheduler.load_state_dict(state["scheduler"])
    run.data.load_state_dict(state["data"])
    run.counters.update(state["counters"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    run.step = state["step"]
    log_main(f"resumed from {path} at step {run.step}")


def export_final(run: Run) -> Path | None:
    """Write the trained drafter in the serving layout to ``output_dir/export`` (rank 0)."""
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.export import save_drafter

    state = full_model_state(run.model)
    out = Path(run.cfg.output_dir) / "export"
    if run.info.is_main:
        drafter = DFlashDrafter(run.draft_config)
        drafter.load_state_dict(state)
        save_drafter(
            drafter,
            run.draft_config,
            out,
            dtype=run.cfg.train.dtype,
            target=run.cfg.target.path,
            announce=True,
        )
    _barrier(run.info)
    return out
