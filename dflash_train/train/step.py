"""The pieces of one optimizer step, shared by colocated and split training.

A step reads as named phases: ``prepare_micro_batch`` (device, anchors, labels, loss weights) ->
``target_features`` (colocated) or received features (split) -> ``drafter_forward_backward``
(drafter, one-pass LM-head loss, backward) -> ``optimizer_update`` (clip, the collective vote,
step / skip / raise). ``LogWindow`` accumulates a logging interval and turns it into one metrics
row (``log_row``), with the only reductions and host syncs of the interval.

Shapes: R rows, L sequence, A anchors, n*H feature width.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from dflash_train.data.batching import same_segment
from dflash_train.models.dtypes import DTYPES
from dflash_train.models.variant import get_variant
from dflash_train.train.builders import resolve_backend
from dflash_train.train.faults import any_rank_flags
from dflash_train.train.flops import mfu, train_step_flops
from dflash_train.train.logging import log_main
from dflash_train.train.loss import (
    LossOptions,
    add_metrics,
    block_targets,
    denominator_weights,
    draft_loss,
    summarize_metrics,
    teacher_block_hidden,
)
from dflash_train.train.parallel import all_reduce_sum, uses_fsdp
from dflash_train.train.run import NonFiniteError, Run
from dflash_train.train.step_timer import PhaseTimer


def prepare_micro_batch(run: Run, batch, epoch: int) -> dict[str, torch.Tensor]:
    """Move a batch to the device, draw its anchors and build labels and loss weights."""
    from dflash_train.data.anchors import sample_anchors
    from dflash_train.data.lookup_anchors import lookup_anchor_weights

    dev = run.info.device
    input_ids = batch.input_ids.to(dev, non_blocking=True)
    loss_mask = batch.loss_mask.to(dev, non_blocking=True)
    attention_mask = batch.attention_mask.to(dev, non_blocking=True)
    position_ids = getattr(batch, "position_ids", None)
    position_ids = None if position_ids is None else position_ids.to(dev, non_blocking=True)
    # Labels ids[a+1 .. a+D] of the D scored slots: a round verifies D + 1 tokens.
    width = run.cfg.drafter.num_verify_tokens
    weight = lookup_anchor_weights(input_ids, loss_mask, position_ids, run.cfg.train, width)  # None: uniform
    if position_ids is None:
        anchors, keep = sample_anchors(
            loss_mask,
            run.cfg.train.num_anchors,
            run.cfg.train.seed,
            epoch,
            batch.sample_index.to(dev),
            weight,
        )
    else:  # packed rows: anchors budgeted per conversation, labels never past its end
        anchors, keep = packed_anchors(
            run, loss_mask, position_ids, batch.token_sample_index.to(dev), epoch, weight
        )
    labels, label_valid = block_targets(input_ids, loss_mask, anchors, width)
    if position_ids is not None:
        label_valid = label_valid & same_segment(position_ids, anchors, width)
    label_valid = get_variant(run.cfg.drafter.variant).scored_labels(label_valid)
    # What this micro-batch adds to the step's loss denominator (decay weights, or kept blocks).
    weights = denominator_weights(keep, label_valid, run.gamma, loss_options(run))
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "anchors": anchors,
        "keep": keep,
        "labels": labels,
        "label_valid": label_valid,
        "weights": weights,
        **({"position_ids": position_ids} if position_ids is not None else {}),
    }


def packed_anchors(run: Run, loss_mask, position_ids, token_sample_index, epoch: int, weight=None):
    """``sample_packed_anchors`` with ``train.anchors_per_token`` (0 = num_anchors per row length)."""
    from dflash_train.data.anchors import sample_packed_anchors

    t = run.cfg.train
    per_token = t.anchors_per_token or t.num_anchors / loss_mask.shape[1]
    return sample_packed_anchors(
        loss_mask, position_ids, token_sample_index, t.num_anchors, per_token, t.seed, epoch, weight
    )


def target_features(target, input_ids: torch.Tensor, **kwargs: Any):
    """The target's features [R, L, n*H] of a micro-batch; both placements run the target this way.

    No attention mask: right padding is invisible to a causal target at real tokens, and filler rows
    have an all-false mask that could produce fully masked softmax rows. Packed rows pass their
    ``position_ids`` (each conversation seen alone).
    """
    return target.features(input_ids, None, **kwargs)


def target_pass(run: Run, m: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's features of one micro-batch and, for a KL loss (or DSpark's TV / confidence
    terms), the teacher's hidden state of every block label (the target then runs to full depth;
    ``ce`` keeps the truncated pass)."""
    packed = {"position_ids": m["position_ids"]} if "position_ids" in m else {}
    if not loss_options(run).needs_teacher:
        return target_features(run.target, m["input_ids"], **packed), None
    features, final_hidden = target_features(run.target, m["input_ids"], with_final_hidden=True, **packed)
    return features, teacher_block_hidden(final_hidden, m["anchors"], run.cfg.drafter.num_verify_tokens)


def loss_options(run: Run) -> LossOptions:
    """The run's objective: ``train.*`` and the drafter variant's loss weights."""
    return LossOptions.from_train_config(run.cfg.train, run.cfg.drafter)


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
    teacher_hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Drafter forward, one-pass LM-head loss and backward for one micro-batch; (loss, stats).

    ``teacher_hidden`` ([R,A,K,H], ``target_pass``) is the KL teacher when ``train.loss`` has kl."""
    cfg = run.cfg
    with timer.phase("drafter"), no_sync_unless_last(run.model, last), compute_precision(run):
        out = run.model(
            features,
            m["input_ids"],
            m["anchors"],
            m["keep"],
            run.target.embed_tokens,
            backend=resolve_backend(cfg, run.info),
            sdpa_anchor_chunk=cfg.train.sdpa_anchor_chunk,
            heads=True,
            **({"position_ids": m["position_ids"]} if "position_ids" in m else {}),
        )
        out.hidden = out.hidden.to(run.target.lm_head.weight.dtype)
        loss, stats = draft_loss(
            out,
            run.target.lm_head.weight,
            m["labels"],
            m["label_valid"],
            m["keep"],
            gamma=run.gamma,
            denom=denom,
            chunk_tokens=cfg.train.loss_chunk_tokens,
            fused=cfg.train.compile and run.info.device.type == "cuda",
            options=loss_options(run),
            teacher_hidden=teacher_hidden,
        )
        # DDP/FSDP average gradients over ranks; the loss is already a global sum, so undo the mean.
        (loss * run.info.world_size).backward()
    stats["real_tokens"] = m["attention_mask"].sum()
    return loss.detach(), stats


def optimizer_update(
    run: Run, timer: PhaseTimer, loss_total: torch.Tensor, stop_requested: bool, denom: torch.Tensor
) -> dict[str, Any]:
    """Clip, agree on every rank (non-finite? stop?), then step, skip or raise; advances ``run.step``.

    The loss is reduced over the run's group (split: the drafter ranks); the vote is always over
    every rank of the job, so target ranks stop and raise together with the drafters. A step whose
    loss weight ``denom`` (``step_denominator``) is 0 has nothing to learn from (a packed epoch's
    all-filler step): the optimizer is not stepped, since AdamW would still move the weights.
    """
    with timer.phase("optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.train.clip_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor norm over the sharded gradients
            grad_norm = grad_norm.full_tensor()
        loss_total = all_reduce_sum(loss_total, run.group)
        bad = ~torch.isfinite(loss_total) | ~torch.isfinite(grad_norm)
        # The one host sync of a step: every rank must agree before the update.
        nonfinite, stop = any_rank_flags([bad, stop_requested], run.info.device)
        # The denominator is already summed over the group's ranks and micro-batches, so every rank
        # reads the same value; the vote above has synced the device, so this read waits for nothing.
        empty = not nonfinite and bool(denom == 0)
        if nonfinite:
            run.optimizer.zero_grad(set_to_none=True)
            handle_nonfinite(run, float(loss_total), float(grad_norm))
        else:
            if empty:
                run.counters["empty_steps"] += 1
                log_main(
                    f"step {run.step + 1}: no label token on any rank (all filler); optimizer not stepped"
                )
            else:
                run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.scheduler.step()  # the schedule counts planned steps, empty ones included
    run.step += 1
    return {"loss": loss_total, "grad_norm": grad_norm, "stop": stop, "skipped": nonfinite or empty}


def handle_nonfinite(run: Run, loss: float, grad_norm: float) -> None:
    """Stop every rank before the update (default) or skip the step and count it. The step is named
    as the progress line and metrics.jsonl number it (1-based: ``run.step`` steps are done)."""
    if run.cfg.train.nonfinite == "skip":
        run.counters["skipped_steps"] += 1
        log_main(
            f"step {run.step + 1}: non-finite loss {loss} or grad norm {grad_norm} on some rank; step skipped (train.nonfinite=skip)"
        )
        return
    raise NonFiniteError(
        f"step {run.step + 1}: non-finite loss ({loss}) or gradient norm ({grad_norm}) on at least one rank; stopped before the optimizer step, "
        "no checkpoint written after it. Lower train.lr, check the data, or set train.nonfinite=skip to skip such steps."
    )


def compute_precision(run: Run):
    """bf16 compute over fp32 master weights: FSDP2's mixed-precision policy casts the parameters
    itself; a single process or DDP gets autocast."""
    dtype = DTYPES[run.cfg.train.dtype]
    if dtype == torch.float32 or uses_fsdp(run.model):
        return contextlib.nullcontext()
    return torch.autocast(run.info.device.type, dtype=dtype)


class no_sync_unless_last:
    """Skip DDP's gradient all-reduce on all but the last micro-batch of a step."""

    def __init__(self, model: nn.Module, last: bool):
        self.ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else None

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx else False


def step_flops(run: Run, m: dict[str, torch.Tensor]) -> float:
    """Model FLOPs of one micro-batch (target forward + drafter forward/backward + LM head)."""
    rows, seq_len = m["input_ids"].shape
    return train_step_flops(
        run.target.config, run.draft_config, seq_len=seq_len, num_anchors=m["anchors"].shape[1], rows=rows
    )["total"]


# ----------------------------------------------------------------------------- logging


class LogWindow:
    """The steps since the last log row: summed metrics, the summed loss, and the wall clock.

    The loss of a row is the mean over the window's applied steps (skipped non-finite steps and
    empty steps are left out, NaN when every step was), like tau and accuracy; ``loss_last`` is the last
    step's. Nothing leaves the device until ``row``.
    """

    def __init__(self, step: int):
        self.reset(step)

    def reset(self, step: int) -> None:
        self.metrics: dict[str, torch.Tensor] | None = None
        self.loss_sum: torch.Tensor | float = 0.0
        self.loss_steps = 0
        self.start, self.start_step = time.perf_counter(), step

    def add(self, result: dict[str, Any]) -> None:
        """Accumulate one step's ``optimizer_update`` result and its ``stats``."""
        self.metrics = add_metrics(self.metrics, result["stats"])
        if not result["skipped"]:
            self.loss_sum = self.loss_sum + result["loss"].detach()
            self.loss_steps = self.loss_steps + 1

    def due(self, run: Run, stopping: bool) -> bool:
        """Whether this step ends a logging interval."""
        return run.step % run.cfg.logging.every_steps == 0 or run.step == run.total_steps or stopping

    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def row(self, run: Run, result: dict[str, Any], timer: PhaseTimer) -> dict[str, Any]:
        """The interval's metrics row (reduced over the run's group), then a fresh window."""
        steps = run.step - self.start_step
        row = log_row(run, result, self, timer, self.seconds(), steps)
        self.reset(run.step)
        return row


def log_row(
    run: Run, result: dict, window: LogWindow, timer: PhaseTimer, seconds: float, steps: int
) -> dict[str, Any]:
    """Reduce the window's summed metrics over the run's group into one log row (log steps only)."""
    info, metrics_sum = run.info, window.metrics
    for value in metrics_sum.values():
        all_reduce_sum(value, run.group)
    phases = timer.collect()
    summary = summarize_metrics({k: v for k, v in metrics_sum.items() if k != "real_tokens"})
    real_tokens = float(metrics_sum["real_tokens"])
    step_s = seconds / max(steps, 1)
    # The loss is already the global per-step value on every rank; only its window mean is new.
    loss_mean = float(window.loss_sum) / window.loss_steps if window.loss_steps else float("nan")
    row = {
        "loss": loss_mean,
        "loss_last": float(result["loss"]),
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
        "empty_steps": run.counters["empty_steps"],
        "epoch": run.data.epoch,
        **{f"data_{k}": v for k, v in run.data.log_stats().items()},
    }
    if info.device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(info.device) / 1e9
    return row
