"""The typed configuration tree: a YAML recipe plus dotted ``key=value`` overrides.

Every component owns a small dataclass documented field by field. ``load_config`` reads a recipe,
applies overrides, rejects unknown keys and wrong types with an error that names the key and says
how to fix it, and validates cross-field constraints (``config_checks``). ``RunConfig.to_yaml``
writes the resolved config, which is stored in the run folder and in every checkpoint.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# The target: and drafter: sections live with the models that use them (models/ names them in
# signatures); re-exported here as part of the one config tree.
from dflash_train.config_checks import validate
from dflash_train.models.recipe_config import DrafterConfig, TargetConfig

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


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML (``[1,2]``, ``true``, ``3e-4``)."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is not of the form key.sub=value, e.g. train.lr=3e-4")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {item!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""


def from_dict(cls: type, raw: Any, prefix: str, source: str) -> Any:
    """Recursively build dataclass ``cls`` from a mapping, checking keys and types."""
    where = prefix.rstrip(".") or "the recipe root"
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: {where} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
        raise ValueError(
            f"{source}: unknown key '{prefix}{key}'; {hint}known keys of {where}: {sorted(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(
                    f"{source}: required key '{prefix}{name}' is missing; add it to the recipe or pass {prefix}{name}=..."
                )
            continue
        kwargs[name] = coerce(hints[name], raw[name], f"{prefix}{name}", source)
    return cls(**kwargs)


def coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".", source)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return coerce(option, value, key, source)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[-1] if errors else f"{source}: '{key}' has an invalid value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):
            value = "on" if value else "off"  # YAML 1.1 reads bare on/off as booleans
        if value not in allowed:
            raise ValueError(f"{source}: '{key}' = {value!r} is not allowed; use one of {list(allowed)}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(
                f"{source}: '{key}' must be a list, got {type(value).__name__} {value!r}; write e.g. {key}=[1,2]"
            )
        return [coerce(item_tp, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads "3e-4" (no dot) as a string; accept any float literal.
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if isinstance(value, bool) and tp is not bool or not isinstance(value, tp):
            raise ValueError(f"{source}: '{key}' must be {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for '{key}'")
