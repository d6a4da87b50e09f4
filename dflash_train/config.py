"""The typed configuration tree: a YAML recipe plus dotted ``key=value`` overrides.

Every component owns a small dataclass documented field by field. ``load_config`` reads a recipe,
applies overrides, rejects unknown keys and wrong types with an error that names the key and says
how to fix it, and validates cross-field constraints. ``RunConfig.to_yaml`` writes the resolved
config, which is stored in the run folder and in every checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# The target: and drafter: sections live with the models that use them (models/ names them in
# signatures); re-exported here as part of the one config tree.
from dflash_train.config_parsing import apply_override, from_dict
from dflash_train.models.recipe_config import DrafterConfig, TargetConfig, check_variant_placement

PACKAGED_RECIPES = Path(__file__).parent / "recipes"


@dataclass(kw_only=True)
class DataConfig:
    """Chat data and how it becomes fixed-shape micro-batches."""

    # JSONL files, directories of them, or anything datasets.load_dataset reads.
    paths: list[str] = field(default_factory=list)
    format: Literal["auto", "messages", "sharegpt"] = "auto"
    # Chat-template thinking switch for templates that have one; null = template default.
    thinking: bool | None = None
    # Sequence-length buckets; each micro-batch is [rows, bucket] with rows*bucket <= token_budget.
    seq_buckets: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    token_budget: int = 4096
    # Rows longer than the largest bucket: "drop" (counted) or "truncate" (counted).
    overlong: Literal["drop", "truncate"] = "truncate"
    # Pack whole conversations into rows of the largest bucket (first-fit decreasing within a
    # shuffle window) instead of padding each to its bucket; docs/data.md "Packing".
    packing: bool = False
    # Conversations per first-fit-decreasing window when packing (larger packs tighter).
    pack_window: int = 4096
    # Bad rows (malformed JSON, no assistant turn, ...) skipped and counted before failing.
    max_bad_rows: int = 0
    # Tokenization processes when the cache is built (one rank builds it); 0 = the CPUs this process
    # may run on, at most MAX_TOKENIZE_WORKERS.
    num_workers: int = 0
    cache_dir: str = ""
    streaming: bool = False


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation, the DFlash loss and the execution strategy."""

    num_anchors: int = 512
    # Packed rows: at most ceil(anchors_per_token * length) anchors per conversation (the row still
    # has num_anchors slots); 0 = num_anchors / row length.
    anchors_per_token: float = 0.0
    # Draw weight of anchors whose whole block the eval's n-gram lookup (n = lookup_anchor_ngram_n)
    # would copy, relative to the others: 1 = uniform, 0 = never (docs/quality.md, "The long tail").
    lookup_anchor_weight: float = 1.0
    lookup_anchor_ngram_n: int = 3
    # Loss decay exp(-(k-1)/gamma) over block position k; 0 = 7/5/4 for block 16/10/8.
    gamma: float = 0.0
    # Objective (docs/training.md "Loss options"): "ce" on the data's tokens, "kl" to the target's
    # own distribution (runs the target to full depth), or "ce+kl" (their sum).
    loss: Literal["ce", "kl", "ce+kl"] = "ce"
    # Factor of the KL term (> 0 when train.loss has kl).
    kl_weight: float = 1.0
    # Teacher restricted to its top k tokens, renormalised; 0 = the full vocabulary.
    kl_topk: int = 0
    # Position weights: "decay" (exp(-(k-1)/gamma)) or "dpace" (D-PACE, arXiv 2605.18810).
    loss_weighting: Literal["decay", "dpace"] = "decay"
    # D-PACE smoothing: acceptance of a position estimated as alpha + (1 - alpha) * p(label).
    dpace_alpha: float = 0.5
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    clip_grad_norm: float = 1.0
    num_epochs: int = 1
    # Stop after this many optimizer steps; 0 = run num_epochs.
    max_steps: int = 0
    # Training in several sittings (docs/training.md): end this process at a step boundary, with a
    # checkpoint, before this many seconds since training started (0 = no limit), or after this many
    # steps of it (0 = no limit); the run is not finished and the same command continues it.
    time_limit_s: float = 0.0
    steps_per_process: int = 0
    grad_accum: int = 1
    seed: int = 0
    # Parameters/compute dtype of the drafter (master weights and optimizer state stay fp32).
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    compile: bool = False
    activation_checkpointing: bool = False
    attention_backend: Literal["auto", "flex", "sdpa"] = "auto"
    # Anchor blocks per chunk of the SDPA attention path.
    sdpa_anchor_chunk: int = 64
    # Block tokens per LM-head chunk of the loss (the [tokens, V] logits never exist whole).
    loss_chunk_tokens: int = 2048
    parallel: Literal["ddp", "fsdp"] = "fsdp"
    placement: Literal["colocated", "split"] = "colocated"
    target_ranks: int = 0
    max_in_flight: int = 2
    # Non-finite loss or grad norm: "stop" every rank, or "skip" the step (counted).
    nonfinite: Literal["stop", "skip"] = "stop"
    # Dump all stacks when one step takes longer than this many seconds (0 = off).
    watchdog_s: float = 1800.0
    # Process-group timeout: a rank left waiting this long on a collective (a peer died) fails the
    # job instead of hanging.
    dist_timeout_s: float = 1800.0
    device: str = "auto"


@dataclass(kw_only=True)
class CheckpointConfig:
    """Atomic checkpoints and resume."""

    every_steps: int = 1000
    keep_last: int = 2
    # Write checkpoints on a background thread (the state is snapshotted first); false = inline.
    async_write: bool = True
    # With async_write on CUDA: snapshot into one pinned host buffer kept for the run (DCP's cached
    # stager, as torchtitan's async_with_pinned_mem) instead of fresh pageable memory at every save.
    # Holds a second copy of this rank's drafter and optimizer state in page-locked host memory.
    pinned_staging: bool = False
    # "auto" resumes from the newest committed checkpoint of output_dir, "never", or a path.
    resume: str = "auto"
    # Recipe knobs allowed to differ from the checkpoint's on resume (e.g. ["train.num_anchors"]).
    allow_changed: list[str] = field(default_factory=list)
    # Resume although a data file's fingerprint (size, rows, contents) changed since the checkpoint.
    allow_data_change: bool = False


@dataclass(kw_only=True)
class LoggingConfig:
    every_steps: int = 10
    progress_bar: Literal["auto", "on", "off"] = "auto"
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "dflash-train"


@dataclass(kw_only=True)
class EvalConfig:
    """Exact greedy acceptance (tau) of the drafter on held-out prompts during training
    (docs/training.md, "Acceptance during training"). Off while ``prompts`` is empty."""

    # JSONL prompt files (as `dflash-train eval --prompts` reads); each also logs eval_tau/<file stem>.
    prompts: list[str] = field(default_factory=list)
    # Evaluate every this many optimizer steps and at the last step; 0 = only at the last step.
    every_steps: int = 500
    # First prompts of each file to use; 0 = all of them.
    num_prompts: int = 0
    # Greedy continuation length per prompt (generated once at the start: the target is frozen).
    max_new_tokens: int = 256
    # Prompts per batched greedy-generation forward; 0 = 32 on CUDA, 8 on CPU.
    batch_size: int = 0
    # Block tokens per batched drafter pass.
    drafter_batch_tokens: int = 65536
    # Also log the n-gram prompt-lookup baseline (eval_ngram_tau, once: it does not train).
    ngram: bool = True
    ngram_n: int = 3
    # The prompt file stem whose tau picks export-best (e.g. "heldout_synth"); "" = over all files.
    best_by: str = ""

    def best_metric(self) -> str:
        """The metric export-best maximises: ``eval_tau`` or ``eval_tau/<best_by>``."""
        return f"eval_tau/{self.best_by}" if self.best_by else "eval_tau"


@dataclass(kw_only=True)
class RunConfig:
    """The whole recipe."""

    output_dir: str
    target: TargetConfig
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def loss_gamma(self) -> float:
        """train.gamma, or the paper's value for drafter.block_size when it is 0."""
        return self.train.gamma or default_gamma(self.drafter.block_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text


def default_gamma(block_size: int) -> float:
    """Loss decay of the DFlash paper: 7 for block 16, 5 for 10, 4 for 8 (interpolated otherwise)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


def validate(cfg: RunConfig) -> None:
    """Cross-field checks; each failure says which key to change and how."""
    d, t, dt = cfg.drafter, cfg.train, cfg.data
    if d.block_size < 2:
        raise ValueError(
            f"drafter.block_size={d.block_size}: a block needs the anchor plus at least one predicted token; use 16 (or 8/10)."
        )
    # The shape fields whose 0 means "the preset's or the target's" (presets.resolve_drafter_config).
    shape = "num_hidden_layers hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim"
    shape += " rms_norm_eps rope_theta max_position_embeddings sliding_window"
    negative = [k for k in shape.split() if getattr(d, k) < 0]
    if negative:
        raise ValueError(
            f"drafter.{negative[0]}={getattr(d, negative[0])}: must be > 0, or 0 for the preset's (or the target's) value."
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
    if not 0 < t.lr < math.inf:
        raise ValueError(f"train.lr={t.lr}: give a finite learning rate > 0, e.g. 6e-4.")
    if not 0 <= t.warmup_ratio < 1 or not 0 <= t.min_lr_ratio <= 1:
        raise ValueError("train.warmup_ratio must be in [0, 1), train.min_lr_ratio in [0, 1].")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ValueError(f"train.betas={t.betas}: give two numbers in [0, 1) (AdamW's), e.g. [0.9, 0.95].")
    if not t.weight_decay >= 0:
        raise ValueError(f"train.weight_decay={t.weight_decay}: give a decay >= 0 (0: none).")
    if not t.clip_grad_norm > 0:  # gradients are scaled by clip_grad_norm / norm: 0 zeroes them
        raise ValueError(
            f"train.clip_grad_norm={t.clip_grad_norm}: the gradient-norm limit must be > 0 (e.g. 1.0; 0 would "
            "zero every gradient, a negative one reverse it); for no clipping give .inf."
        )
    if t.grad_accum < 1 or t.num_epochs < 1 or t.max_steps < 0:
        raise ValueError("train.grad_accum and train.num_epochs must be >= 1, train.max_steps >= 0.")
    if not t.dist_timeout_s > 0:  # a collective's timeout: 0 is not "none", every wait fails at once
        raise ValueError(
            f"train.dist_timeout_s={t.dist_timeout_s}: give the seconds a rank waits on a collective, > 0 "
            "(1800 by default; there is no 'no timeout')."
        )
    if t.seed < 0:
        raise ValueError(
            f"train.seed={t.seed}: give a seed >= 0 (a run is reproducible from it; there is no random one)."
        )
    validate_target_layer_ids(cfg.target)
    from dflash_train.models.presets import check_drafter_preset  # lazy: presets imports transformers

    check_drafter_preset(d.preset)
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
    if t.placement != "split" and t.target_ranks:
        raise ValueError(
            f"train.target_ranks={t.target_ranks} with train.placement={t.placement}: every rank runs the "
            "target there; set train.placement=split, or remove train.target_ranks."
        )
    if dt.max_bad_rows < 0:
        raise ValueError(f"data.max_bad_rows={dt.max_bad_rows}: give the bad rows to skip, >= 0 (0: none).")
    if cfg.checkpoint.keep_last < 2:
        raise ValueError(
            f"checkpoint.keep_last={cfg.checkpoint.keep_last}: keep at least 2 so a crash during a save leaves a good one."
        )
    if cfg.checkpoint.pinned_staging and not cfg.checkpoint.async_write:
        raise ValueError(
            "checkpoint.pinned_staging=true stages the asynchronous write, but checkpoint.async_write=false: "
            "set checkpoint.async_write=true, or checkpoint.pinned_staging=false."
        )
    for key, every in (("checkpoint", cfg.checkpoint.every_steps), ("logging", cfg.logging.every_steps)):
        if every < 1:  # unlike eval.every_steps, no "0 = at the end only": a step count >= 1
            raise ValueError(
                f"{key}.every_steps={every}: use a step count >= 1 (a run also {'saves' if key == 'checkpoint' else 'logs'} "
                "at its last step, so a count above train.max_steps means only there)."
            )
    validate_loss_options(t)
    check_variant_placement(d, t.placement)
    validate_eval(cfg.eval, t)
    validate_sittings(cfg)
    if t.gamma < 0 or t.loss_chunk_tokens < 1 or t.sdpa_anchor_chunk < 1:
        raise ValueError(
            "train.gamma must be >= 0 (0 = default), train.loss_chunk_tokens and train.sdpa_anchor_chunk >= 1."
        )
    resume = cfg.checkpoint.resume  # last: a setting's own error first, then the file system's
    if resume not in ("auto", "never") and not Path(resume).is_dir():
        raise missing_resume_path(resume)


def missing_resume_path(path: str | Path) -> ValueError:
    """The error of a ``checkpoint.resume`` path that is no directory (at load, and when resuming)."""
    return ValueError(
        f"checkpoint.resume={path}: no such directory; give auto, never, or a checkpoint "
        "(<output_dir>/checkpoints/step-N)."
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
    # resume=never starts over; a named checkpoint is resumed by every sitting (the same command), which
    # sets the later sittings' checkpoints aside as abandoned: both would repeat one sitting for ever.
    if limited and (t.placement == "split" or cfg.checkpoint.resume != "auto"):
        raise (NotImplementedError if t.placement == "split" else ValueError)(
            "train.time_limit_s / train.steps_per_process need train.placement=colocated (split placement: end "
            "a sitting with SIGTERM) and checkpoint.resume=auto (the next sitting must continue the run; "
            f"resume={cfg.checkpoint.resume!r} would make every sitting start from the same place: to continue "
            "from a given checkpoint, run it once without the sitting keys, or copy it into output_dir)."
        )


def validate_target_layer_ids(target: TargetConfig) -> None:
    """Feature layer ids serving engines can use: strictly increasing, and within a ``preset:`` target's
    layers and off its last one (every target is checked again on load: ``check_serving_layer_ids``)."""
    from dflash_train.models import drafter_config, presets  # lazy: presets imports transformers

    ids, count = target.target_layer_ids, target.num_target_features
    if any(i < 0 for i in ids):
        raise ValueError(f"target.target_layer_ids={ids}: layer ids are 0-based and >= 0.")
    if count < 1:
        raise ValueError(f"target.num_target_features={count}: give a count >= 1 (DFlash uses 5).")
    if ids and count not in (len(ids), TargetConfig.num_target_features):  # the count is the ids' then
        raise ValueError(
            f"target.num_target_features={count} but target.target_layer_ids={ids} has {len(ids)} ids, which "
            f"decide the features: give {count} ids, or target.target_layer_ids=[] for the default {count} layers."
        )
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


# ----------------------------------------------------------------------------- loading


def resolve_recipe_path(recipe: str | Path) -> Path:
    """A recipe file path, or the name of a packaged recipe (e.g. ``qwen3.6-27b``)."""
    path = Path(recipe)
    if path.is_file():
        return path
    packaged = PACKAGED_RECIPES / f"{recipe}.yaml"
    if packaged.is_file():
        return packaged
    names = sorted(p.stem for p in PACKAGED_RECIPES.glob("*.yaml"))
    raise ValueError(f"recipe {recipe!r} is neither a file nor a packaged recipe; packaged recipes: {names}")


def load_config(
    recipe: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None
) -> RunConfig:
    """Build a RunConfig from a YAML recipe (or a dict) plus ``key.sub=value`` overrides."""
    raw: dict[str, Any] = dict(base or {})
    source = "config"
    if recipe is not None:
        path = resolve_recipe_path(recipe)
        source = str(path)
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a recipe must be a YAML mapping of sections (target:, drafter:, ...)")
        raw = loaded
    for item in overrides or []:
        apply_override(raw, item)
    return from_dict(RunConfig, raw, prefix="", source=source)
