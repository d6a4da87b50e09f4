"""Builders of a training run: target, drafter (compile, activation checkpointing, data parallelism),
optimizer, learning-rate schedule and data. Each takes the resolved config and returns one part."""

from __future__ import annotations

import math
import random

import torch
from torch import nn

from dflash_train.config import RunConfig
from dflash_train.models.dtypes import DTYPES
from dflash_train.train.parallel import DistInfo, wrap_drafter


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def build_target(cfg: RunConfig, info: DistInfo):
    from dflash_train.models.target import load_target

    return load_target(cfg.target, info.device, compile_regions=cfg.target.compile)


def build_drafter(cfg: RunConfig, target, info: DistInfo):
    """``new_drafter``, wrapped for data parallelism over every rank."""
    draft_config, drafter = new_drafter(cfg, target, info)
    return draft_config, wrap_for_training(cfg, drafter, info)


def wrap_for_training(cfg: RunConfig, drafter: nn.Module, info: DistInfo, group=None) -> nn.Module:
    """``wrap_drafter`` with the recipe's strategy and dtype over ``group`` (default: every rank), and
    the one line saying which attention backend trains it (``announce_backend``)."""
    model = wrap_drafter(drafter, cfg.train.parallel, DTYPES[cfg.train.dtype], info, group=group)
    announce_backend(cfg, info)
    return model


def new_drafter(cfg: RunConfig, target, info: DistInfo):
    """Resolve the drafter shape against the target and build it in fp32 (master weights), loaded from
    ``drafter.init_from`` if set, compiled and checkpointed as the recipe says; not yet wrapped (the
    wrap is a collective: ``wrap_drafter``)."""
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.presets import check_serving_layer_ids, resolve_drafter_config
    from dflash_train.models.target import validate_target_for_drafter

    check_serving_layer_ids(target.target_layer_ids, target.num_layers, cfg.target.allow_last_layer)
    mask = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id >= 0 else None
    if mask is None and cfg.drafter.preset in ("from-target", "tiny"):
        from dflash_train.data.special_tokens import auto_mask_token_id
        from dflash_train.train.logging import log_main

        mask, described = auto_mask_token_id(target)
        log_main(f"drafter.mask_token_id not set: chose {described} (set it in the recipe to override)")
    draft_config = resolve_drafter_config(
        cfg.drafter,
        target.config,
        target_layer_ids=target.target_layer_ids,
        mask_token_id=mask,
        torch_dtype=cfg.train.dtype,
    )
    validate_target_for_drafter(target, draft_config)
    torch.manual_seed(cfg.train.seed)
    drafter = DFlashDrafter(draft_config).to(info.device, torch.float32)
    if cfg.drafter.init_from:
        init_from_export(drafter, draft_config, cfg.drafter.init_from)
    apply_compile_and_checkpointing(drafter, cfg)
    return draft_config, drafter


# Devices on which PyTorch's flex attention has a forward but no backward (torch 2.5-2.13 refuse
# them in ``flex_attention._validate_device``): training there needs the chunked SDPA path.
FLEX_CANNOT_TRAIN_ON = ("cpu", "mps")


def resolve_backend(cfg: RunConfig, info: DistInfo) -> str:
    """The drafter's training attention on this device: ``train.attention_backend``, with ``auto`` =
    flex on CUDA and chunked SDPA elsewhere, and flex = chunked SDPA where flex cannot train
    (``FLEX_CANNOT_TRAIN_ON``). The two compute the same masked attention (tests/test_masks.py), so
    a GPU recipe trains unchanged on a CPU; ``announce_backend`` says so once."""
    backend = cfg.train.attention_backend
    if backend == "auto":
        return "flex" if info.device.type == "cuda" else "sdpa"
    if backend == "flex" and info.device.type in FLEX_CANNOT_TRAIN_ON:
        return "sdpa"
    return backend


def announce_backend(cfg: RunConfig, info: DistInfo) -> None:
    """One line (the logging rank) when ``resolve_backend`` trains with another backend than the
    recipe names."""
    from dflash_train.train.logging import log_main

    backend = resolve_backend(cfg, info)
    if cfg.train.attention_backend not in ("auto", backend):
        log_main(
            f"train.attention_backend={cfg.train.attention_backend}: PyTorch cannot train it on "
            f"{info.device.type}; training with {backend}, the same masked attention "
            f"(set train.attention_backend={backend} to say so in the recipe)"
        )


def init_from_export(drafter: nn.Module, draft_config, path: str) -> None:
    """Copy the weights of an exported drafter, refusing one whose config differs from this run's.

    Equal tensor shapes are not enough: a drafter of another block size, mask token, feature layers
    or layer types would load and then silently learn (and serve) something else.
    """
    from dflash_train.models.export import load_drafter
    from dflash_train.train.resume_check import changed_drafter_config

    loaded, loaded_config = load_drafter(path, device="cpu", dtype=torch.float32)
    changed = changed_drafter_config(loaded_config.to_serving_dict(), draft_config.to_serving_dict(), "")
    if changed:
        details = "; ".join(f"{k}: export {old!r} -> this run {new!r}" for k, (old, new) in changed.items())
        raise ValueError(
            f"drafter.init_from={path}: its config.json differs from the drafter resolved for this run "
            f"({details}). Set the recipe to the export's values (drafter.*, target.target_layer_ids) "
            "or drop drafter.init_from."
        )
    drafter.load_state_dict(loaded.state_dict())


def apply_compile_and_checkpointing(drafter: nn.Module, cfg: RunConfig) -> None:
    """Per-layer activation checkpointing and torch.compile (main thread only, fixed shapes)."""
    from torch.utils.checkpoint import checkpoint

    for layer in drafter.layers:
        if cfg.train.activation_checkpointing:
            layer.forward = _checkpointed(layer.forward, checkpoint)
        if cfg.train.compile:
            layer.compile(dynamic=False)  # in place: keeps the serving tensor names
    if cfg.train.compile:
        ensure_recompile_limit(drafter_recompile_limit(drafter.config.layer_types, cfg.data))


def drafter_recompile_limit(layer_types: list[str], data_cfg) -> int:
    """Compiled graphs the drafter layers' shared code object may need in a run of ``data_cfg``.

    One per (batch shape, layer type, whether the layer's input needs a gradient): a run sees one
    shape per bucket (one when packed); the first layer's input, the frozen embedding of the block
    tokens, needs none, which compiles the first layer apart; flex attention guards on each layer
    type's mask rule (chunked SDPA does not, so there this overcounts). Qwen3.6-27B's [sliding x4,
    full] with 3 buckets: 9, past dynamo's default limit of 8. Doubled for guards this count does not
    model (a distributed wrapper's state); a per-length recompile would still exceed it.
    """
    shapes = 1 if data_cfg.packing else len(data_cfg.seq_buckets)
    return 2 * shapes * len({(kind, index == 0) for index, kind in enumerate(layer_types)})


def ensure_recompile_limit(entries: int) -> None:
    """Raise dynamo's per-code-object recompile limit to ``entries``: past it dynamo would run the
    code eagerly for the rest of the process, with one log warning and no error."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, entries)


def _checkpointed(fn, checkpoint):
    def wrapped(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return wrapped


def build_optimizer(model: nn.Module, cfg: RunConfig, info: DistInfo) -> torch.optim.Optimizer:
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    fused = info.device.type == "cuda"
    return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, fused=fused)


def lr_multiplier(step: int, total: int, warmup_ratio: float, schedule: str, min_ratio: float) -> float:
    """Linear warm-up, then cosine / linear decay to ``min_ratio`` (or constant)."""
    warmup = max(1, round(warmup_ratio * total)) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


def build_scheduler(optimizer, cfg: RunConfig, total: int):
    t = cfg.train
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, total, t.warmup_ratio, t.lr_schedule, t.min_lr_ratio)
    )


def check_data_inputs(cfg: RunConfig, target) -> None:
    """Training needs chat data and the target's tokenizer (for its chat template)."""
    from dflash_train.data.loader import check_data_and_tokenizer

    check_data_and_tokenizer(cfg, target.tokenizer)


def build_data(cfg: RunConfig, target, info: DistInfo):
    from dflash_train.data.loader import build_train_data

    check_data_inputs(cfg, target)
    return build_train_data(
        cfg.data, target.tokenizer, seed=cfg.train.seed, rank=info.rank, world_size=info.world_size
    )
