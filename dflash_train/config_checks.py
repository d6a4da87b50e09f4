"""Cross-field checks of the config tree (``RunConfig`` runs ``validate`` when it is built): each
failure names the key to change and says how."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_train.models.recipe_config import check_variant_placement

if TYPE_CHECKING:
    from dflash_train.config import EvalConfig, RunConfig, TrainConfig
    from dflash_train.models.recipe_config import TargetConfig


def validate(cfg: RunConfig) -> None:
    """Cross-field checks; each failure says which key to change and how."""
    d, t, dt = cfg.drafter, cfg.train, cfg.data
    if d.block_size < 2:
        raise ValueError(
            f"drafter.block_size={d.block_size}: a block needs the anchor plus at least one predicted token; use 16 (or 8/10)."
        )
    if t.num_anchors < 1:
        raise ValueError(
            f"train.num_anchors={t.num_anchors}: must be >= 1 (the paper uses 512 for 4K-token rows)."
        )
    bad_types = [x for x in d.layer_types if x not in ("full_attention", "sliding_attention")]
    if bad_types:
        raise ValueError(
            f"drafter.layer_types contains {bad_types}: use 'full_attention' or 'sliding_attention'."
        )
    if d.layer_types and d.num_hidden_layers and len(d.layer_types) != d.num_hidden_layers:
        raise ValueError(
            f"drafter.layer_types has {len(d.layer_types)} entries but drafter.num_hidden_layers={d.num_hidden_layers}: give one type per layer."
        )
    if "sliding_attention" in d.layer_types and d.sliding_window < 0:
        raise ValueError("drafter.sliding_window must be > 0 when a layer is 'sliding_attention'.")
    if sorted(dt.seq_buckets) != dt.seq_buckets or not dt.seq_buckets or dt.seq_buckets[0] < 2:
        raise ValueError(
            f"data.seq_buckets={dt.seq_buckets}: give a non-empty ascending list of lengths >= 2, e.g. [1024, 2048, 4096]."
        )
    if dt.token_budget < dt.seq_buckets[-1]:
        raise ValueError(
            f"data.token_budget={dt.token_budget} is smaller than the largest bucket {dt.seq_buckets[-1]}: raise it to at least {dt.seq_buckets[-1]} so a longest row fits."
        )
    if dt.num_workers < 0:
        raise ValueError(
            f"data.num_workers={dt.num_workers}: give the tokenization processes, or 0 for the CPUs this process may use."
        )
    validate_packing(cfg)
    if t.lr <= 0 or not 0 <= t.warmup_ratio < 1 or not 0 <= t.min_lr_ratio <= 1:
        raise ValueError("train.lr must be > 0, train.warmup_ratio in [0, 1), train.min_lr_ratio in [0, 1].")
    if len(t.betas) != 2:
        raise ValueError(f"train.betas={t.betas}: give two numbers, e.g. [0.9, 0.95].")
    if t.grad_accum < 1 or t.num_epochs < 1 or t.max_steps < 0:
        raise ValueError("train.grad_accum and train.num_epochs must be >= 1, train.max_steps >= 0.")
    validate_target_layer_ids(cfg.target)
    if cfg.target.fsdp_shard:
        raise ValueError(
            "target.fsdp_shard=true: sharding the target is not implemented. A 27B bf16 target (54 GB) fits "
            "next to the drafter's training state on one 141 GB GPU; for a larger target use "
            "train.placement=split with train.target_ranks=N so the target gets GPUs of its own."
        )
    if cfg.target.fp8 and cfg.target.dtype != "bfloat16":
        raise ValueError(
            f"target.fp8=true quantizes bfloat16 weights, but target.dtype={cfg.target.dtype}: set "
            "target.dtype=bfloat16, or target.fp8=false."
        )
    if t.placement == "split" and t.target_ranks < 1:
        raise ValueError(
            "train.placement=split needs train.target_ranks >= 1 (the number of ranks that run only the target)."
        )
    if cfg.checkpoint.keep_last < 2:
        raise ValueError(
            f"checkpoint.keep_last={cfg.checkpoint.keep_last}: keep at least 2 so a crash during a save leaves a good one."
        )
    validate_loss_options(t)
    check_variant_placement(d, t.placement)
    validate_eval(cfg.eval, t)
    validate_sittings(cfg)
    if t.gamma < 0 or t.loss_chunk_tokens < 1 or t.sdpa_anchor_chunk < 1:
        raise ValueError(
            "train.gamma must be >= 0 (0 = default), train.loss_chunk_tokens and train.sdpa_anchor_chunk >= 1."
        )


def validate_packing(cfg: RunConfig) -> None:
    """Packing and anchor-draw knobs, and the placement that does not carry packed rows yet."""
    dt, t = cfg.data, cfg.train
    if dt.pack_window < 1 or t.anchors_per_token < 0:
        raise ValueError(
            "data.pack_window must be >= 1 and train.anchors_per_token >= 0 (0 = num_anchors / row)."
        )
    if not 0 <= t.lookup_anchor_weight < float("inf") or t.lookup_anchor_ngram_n < 1:
        raise ValueError(
            "train.lookup_anchor_weight must be finite and >= 0 (1 = uniform), lookup_anchor_ngram_n >= 1."
        )
    if dt.packing and t.placement == "split":
        raise ValueError(
            "data.packing=true is not supported with train.placement=split yet (the feature stream does not "
            "carry conversation boundaries); use train.placement=colocated or data.packing=false."
        )


def validate_sittings(cfg: RunConfig) -> None:
    """train.time_limit_s / steps_per_process: a run in several processes continues its checkpoints."""
    t, limited = cfg.train, bool(cfg.train.time_limit_s or cfg.train.steps_per_process)
    if t.time_limit_s < 0 or t.steps_per_process < 0:
        raise ValueError("train.time_limit_s and train.steps_per_process must be >= 0 (0 = no limit).")
    if limited and (t.placement == "split" or cfg.checkpoint.resume == "never"):
        raise (NotImplementedError if t.placement == "split" else ValueError)(
            "train.time_limit_s / train.steps_per_process need train.placement=colocated (split placement: end "
            "a sitting with SIGTERM) and checkpoint.resume=auto (the next sitting must continue the run)."
        )


def validate_target_layer_ids(target: TargetConfig) -> None:
    """Feature layer ids serving engines can use: strictly increasing, and within a ``preset:`` target's
    layers and off its last one (every target is checked again on load: ``check_serving_layer_ids``)."""
    from dflash_train.models import drafter_config, presets  # lazy: presets imports transformers

    ids = target.target_layer_ids
    if any(i < 0 for i in ids):
        raise ValueError(f"target.target_layer_ids={ids}: layer ids are 0-based and >= 0.")
    drafter_config.check_ascending_layer_ids(ids)
    name = target.path.removeprefix("preset:")
    if ids and target.path.startswith("preset:") and name in presets.TARGET_PRESETS:
        num_layers = presets.TARGET_PRESETS[name]().num_hidden_layers
        presets.check_serving_layer_ids(ids, num_layers, target.allow_last_layer)


def validate_loss_options(t: TrainConfig) -> None:
    """train.loss / kl_weight / kl_topk / loss_weighting / dpace_alpha, each with its remedy."""
    uses_kl = "kl" in t.loss.split("+")
    if t.kl_topk < 0:
        raise ValueError(f"train.kl_topk={t.kl_topk}: use 0 (the full vocabulary) or a k >= 1, e.g. 64.")
    if uses_kl and t.kl_weight <= 0:
        raise ValueError(
            f"train.kl_weight={t.kl_weight} with train.loss={t.loss}: the KL term needs a weight > 0 (e.g. 1.0); "
            "for no KL use train.loss=ce."
        )
    if not 0 <= t.dpace_alpha <= 1:
        raise ValueError(
            f"train.dpace_alpha={t.dpace_alpha}: use a value in [0, 1] (the paper's default is 0.5)."
        )
    unused = {
        "train.gamma": t.loss_weighting == "dpace" and t.gamma != 0,
        "train.kl_topk": not uses_kl and t.kl_topk != 0,
    }
    ignored = [key for key, is_unused in unused.items() if is_unused]
    if ignored:
        warnings.warn(
            f"{', '.join(ignored)} set but unused with train.loss={t.loss}, train.loss_weighting={t.loss_weighting}",
            stacklevel=3,
        )
    if uses_kl and t.placement == "split":
        raise NotImplementedError(
            f"train.loss={t.loss} with train.placement=split: streaming the target's final hidden states to the "
            "drafter ranks is not implemented; use train.placement=colocated for a KL loss, or train.loss=ce."
        )


def validate_eval(e: EvalConfig, t: TrainConfig) -> None:
    """eval.* : counts in range, distinct file names, and no split placement (not implemented)."""
    if e.every_steps < 0 or e.num_prompts < 0 or e.batch_size < 0:
        raise ValueError(
            "eval.every_steps, eval.num_prompts and eval.batch_size must be >= 0 (0 = at the end only / all / auto)."
        )
    if e.max_new_tokens < 2 or e.drafter_batch_tokens < 1 or e.ngram_n < 1:
        raise ValueError(
            f"eval.max_new_tokens={e.max_new_tokens} must be >= 2 (a draft round needs an emitted token), "
            f"eval.drafter_batch_tokens={e.drafter_batch_tokens} and eval.ngram_n={e.ngram_n} >= 1."
        )
    stems = [Path(p).stem for p in e.prompts]
    repeated = sorted({s for s in stems if stems.count(s) > 1})
    if repeated:
        raise ValueError(
            f"eval.prompts has several files named {repeated}: per-file metrics are keyed by file name "
            "(eval_tau/<name>), so rename or merge them."
        )
    if e.best_by and e.best_by not in stems:
        raise ValueError(
            f"eval.best_by={e.best_by!r} names no file of eval.prompts (their names: {stems}); give one of "
            "those names, or '' to choose export-best by eval_tau over all files."
        )
    if e.prompts and t.placement == "split":
        raise NotImplementedError(
            "eval.prompts with train.placement=split: acceptance during training is implemented for colocated "
            "training only. Use train.placement=colocated, or drop eval.prompts and run `dflash-train eval` on "
            "the exports of the split run."
        )
