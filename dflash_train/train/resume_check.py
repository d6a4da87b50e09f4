"""What a resume may change: the recipe keys and drafter settings a checkpoint is checked against.

A resume compares the checkpoint's recipe (``config.yaml``) and drafter (``drafter_config.json``)
with the ones resolved now. A change of a key that changes what is learned is refused with the
override that allows it; a change of ``data.paths`` only warns. A recipe written before a key
existed has that key's default. The data files themselves are compared by their fingerprints
(``data/fingerprint.py``): a changed file is refused unless ``checkpoint.allow_data_change``.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from typing import Any

from dflash_train.config import RunConfig

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
    "train.warmup_ratio",  # the schedule's shape: the LR of every remaining step
    "train.min_lr_ratio",
    "train.lr",  # the optimizer's settings: an allowed change applies from the resumed step on
    "train.betas",
    "train.weight_decay",
    "train.clip_grad_norm",
    "train.seed",
    "train.anchors_per_token",  # anchors of a packed row
    "train.lookup_anchor_weight",  # which anchors are drawn
    "train.lookup_anchor_ngram_n",
    "train.dtype",  # the drafter's compute dtype
    "target.dtype",  # the features the drafter learns from
    "target.fp8",
    "data.thinking",  # another chat-template rendering: other tokens
    "data.overlong",  # other rows and another epoch plan
    "data.packing",
    "data.pack_window",
)
# drafter.* keys that do not change the drafter a resume continues (its weights come from the
# checkpoint, not from init_from). Every other drafter.* key is architecture or semantics.
DRAFTER_KEYS_NOT_CHECKED = ("init_from",)
# Keys of drafter_config.json that may differ on resume: the compute dtype, not the architecture.
SERVING_KEYS_NOT_CHECKED = ("torch_dtype", "dtype")
# Recipe keys whose change is allowed with a warning.
RESUME_WARN_ONLY = ("data.paths",)
# Recipe keys that decide which rows an epoch holds and how they are batched.
DATA_LAYOUT_KEYS = (
    "data.paths",
    "data.format",
    "data.thinking",
    "data.seq_buckets",
    "data.token_budget",
    "data.overlong",
    "data.packing",
    "data.pack_window",
    "data.max_bad_rows",
)


_ABSENT = object()


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    """The value of a dotted key of a recipe dict; a key the recipe lacks (written before the key
    existed) has the key's default, which is how the options added since then keep the old behaviour."""
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
    return recipe_default(dotted) if node is _ABSENT else node


def recipe_default(dotted: str) -> Any:
    """The default of ``section.key`` in the recipe's dataclasses, or None for a required or unknown key."""
    section, _, name = dotted.partition(".")
    section_type = typing.get_type_hints(RunConfig).get(section)
    for f in dataclasses.fields(section_type) if dataclasses.is_dataclass(section_type) else ():
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
        if f.name == name and f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
    return None


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


def check_data_files(
    checkpoint, saved: list[dict[str, Any]] | None, now: list[dict[str, Any]] | None, allow: bool
) -> None:
    """Refuse to resume when a data file changed since the checkpoint (``data/fingerprint.py``): the
    saved data position would pick other rows. ``allow`` (``checkpoint.allow_data_change``) warns
    instead; a checkpoint written before fingerprints gets a one-line notice."""
    from dflash_train.data.fingerprint import fingerprint_changes
    from dflash_train.train.logging import log_main

    if saved is None:
        log_main(
            f"{checkpoint} records no data file fingerprints (written before they existed): the data "
            "files are not checked against it; the next checkpoint records them"
        )
        return
    changes = fingerprint_changes(saved, now) if now is not None else []  # None: data not read from files
    if not changes:
        return
    if allow:
        warnings.warn(
            f"resuming on changed data ({'; '.join(changes)}) with checkpoint.allow_data_change=true: the "
            "saved data position (epoch, batch) is applied to the new data.",
            stacklevel=2,
        )
        return
    raise ValueError(
        f"refusing to resume: {'; '.join(changes)}. The saved data position (epoch, batch) would now "
        "pick other rows: some seen twice, some never. Restore the file (or the tokenizer), start a new output_dir "
        "(drafter.init_from=<an export> starts from its weights), or resume on the changed data with "
        "checkpoint.allow_data_change=true."
    )


def describe_data_changes(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """The ``DATA_LAYOUT_KEYS`` that differ between two recipe dicts, as ``key: checkpoint old -> now
    new``; with none, that the files themselves changed."""
    changed = [
        f"{key}: checkpoint {_lookup(saved, key)!r} -> now {_lookup(current, key)!r}"
        for key in DATA_LAYOUT_KEYS
        if _lookup(saved, key) != _lookup(current, key)
    ]
    return "; ".join(changed) or "the same data.* keys, so the files' contents"
