"""The fully resolved shape of a DFlash draft model, and its serving ``config.json``.

``DFlashDraftConfig`` is what the model is built from and what ``export`` writes: the field names
are the ones SGLang (``--speculative-algorithm DFLASH``) and vLLM (``method: dflash``) read.

Three variants share the backbone (docs/training.md "Variants"), each in the layout its engines load:
- ``dflash``: ``DFlashDraftModel``, the block-diffusion drafter of the DFlash paper;
- ``dflash2``: ``DFlash2DraftModel`` (DFlash2, "Keep Drafting Parallel", Inco AI / z-lab), adding
  ``dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k}`` (keys as vLLM's
  ``qwen3_dflash2.py`` reads them; ``is_causal`` always written);
- ``dspark``: ``Qwen3DSparkModel`` (DSpark, arXiv 2607.05147, DeepSpec's export name; llama.cpp and
  vLLM also take ``DSparkDraftModel``), adding ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head``, ``confidence_head_with_markov`` and ``sample_from_anchor: true``
  (block slot k predicts the token after it: B draft tokens per block of B, verified as B + 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
VARIANTS = ("dflash", "dflash2", "dspark")
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}
# The architecture names a serving config.json is read as (export writes ARCHITECTURES[variant]).
READ_ARCHITECTURES = {
    "DFlashDraftModel": "dflash",
    "DFlash2DraftModel": "dflash2",
    "Qwen3DSparkModel": "dspark",
    "DSparkDraftModel": "dspark",
}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


@dataclass(kw_only=True)
class DFlashDraftConfig:
    """Architecture of a DFlash drafter (no embedding or LM head: the target's are used)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    # Sliding layers are causal in-block unless this is False.
    is_causal: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    torch_dtype: str = "bfloat16"
    # "dflash" | "dflash2" | "dspark"; the fields below are 0 / off unless the variant uses them.
    variant: str = "dflash"
    # DFlash2: taps of the grouped dynamic causal convolution, channels per dynamic group, rank of
    # the selector's predecessor/successor codebooks, candidates per position.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # DSpark: rank of the Markov head (only the "vanilla" head type), the confidence head, and
    # whether the confidence head also reads the Markov embedding of the previous token.
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers: give one per layer."
            )
        for lt in self.layer_types:
            if lt not in LAYER_TYPES:
                raise ValueError(f"layer type {lt!r} is not one of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError(
                "a 'sliding_attention' layer needs sliding_window > 0 (the preset for Qwen3.6-27B uses 2048)."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of num_key_value_heads={self.num_key_value_heads}."
            )
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be >= 2.")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad or not self.target_layer_ids:
            raise ValueError(
                f"target_layer_ids={self.target_layer_ids} must be non-empty and within [0, {self.num_target_layers - 1}] (the target has {self.num_target_layers} layers)."
            )
        check_ascending_layer_ids(self.target_layer_ids)
        check_variant_fields(self)

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def first_scored_slot(self) -> int:
        """The block slot that predicts the token after the anchor: 1 (DFlash, DFlash2: slot k
        predicts ``ids[a+k]``, the anchor slot is never scored) or 0 (DSpark: slot k predicts
        ``ids[a+k+1]``)."""
        return 0 if self.variant == "dspark" else 1

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per round: B-1, or B for DSpark (every slot predicts)."""
        return self.block_size - self.first_scored_slot

    @property
    def num_verify_tokens(self) -> int:
        """Tokens the target verifies per round (the last token plus the drafts): SGLang's
        ``--speculative-num-draft-tokens``; the eval's round width."""
        return self.num_draft_tokens + 1

    def to_serving_dict(self) -> dict[str, Any]:
        """The ``config.json`` of the serving layout (DESIGN.md section 3)."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.variant]],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
            "num_target_layers": self.num_target_layers,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": list(self.layer_types),
            "use_sliding_window": "sliding_attention" in self.layer_types,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
        }
        if not self.is_causal:
            out["is_causal"] = False
        if self.variant != "dflash":
            add_variant_fields(self, out)
        return out

    @classmethod
    def from_serving_dict(cls, raw: dict[str, Any]) -> DFlashDraftConfig:
        """Read a serving ``config.json`` back (the inverse of ``to_serving_dict``)."""
        dflash = raw.get("dflash_config") or {}
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        kwargs["target_layer_ids"] = list(dflash.get("target_layer_ids", raw.get("target_layer_ids", [])))
        kwargs["mask_token_id"] = dflash.get("mask_token_id", raw.get("mask_token_id"))
        kwargs["block_size"] = dflash.get("block_size", raw.get("block_size", 16))
        kwargs["torch_dtype"] = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        if kwargs["mask_token_id"] is None:
            raise ValueError("config.json has no dflash_config.mask_token_id: not a DFlash drafter export.")
        kwargs.update(read_variant_fields(raw))
        return cls(**kwargs)


def check_ascending_layer_ids(ids: list[int]) -> None:
    """Feature layer ids must be strictly increasing (hence distinct): see ``presets.check_serving_layer_ids``."""
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"target.target_layer_ids={list(ids)} must be strictly increasing and distinct: SGLang and "
            "vLLM capture each layer once in ascending order, so a repeated id crashes their fc layer and "
            f"an unsorted list silently permutes the features; use {sorted(set(ids))}."
        )


def check_variant_fields(config: DFlashDraftConfig) -> None:
    """The variant's own fields are set and valid, and no other variant's field is."""
    if config.variant not in VARIANTS:
        raise ValueError(f"drafter variant {config.variant!r} is not one of {list(VARIANTS)}.")
    own = {"dflash": (), "dflash2": DFLASH2_KEYS, "dspark": ("markov_rank",)}[config.variant]
    foreign = [k for k in (*DFLASH2_KEYS, "markov_rank") if k not in own and getattr(config, k)]
    if foreign or (config.variant != "dspark" and config.enable_confidence_head):
        raise ValueError(
            f"{foreign or ['enable_confidence_head']} belong to another drafter variant than {config.variant!r}: "
            "leave them at 0 / false or choose the variant they belong to."
        )
    bad = [k for k in own if getattr(config, k) < 1]
    if bad:
        raise ValueError(
            f"{config.variant} needs {bad} >= 1 (the drafter variant's defaults come from the recipe)."
        )
    if config.variant == "dflash2":
        if config.hidden_size % config.conv_group_size:
            raise ValueError(
                f"conv_group_size={config.conv_group_size} must divide hidden_size={config.hidden_size} "
                "(channels are convolved in groups of that size); use a divisor, e.g. 16 or 8."
            )
        if config.selector_top_k > config.vocab_size:
            raise ValueError(
                f"selector_top_k={config.selector_top_k} exceeds the vocabulary ({config.vocab_size})."
            )
    if config.variant == "dspark":
        if config.markov_head_type != "vanilla":
            raise NotImplementedError(
                f"markov_head_type={config.markov_head_type!r}: only DSpark's 'vanilla' Markov head is "
                "implemented (DeepSpec's 'gated' and 'rnn' heads are not); use 'vanilla'."
            )
        if config.confidence_head_with_markov and not config.enable_confidence_head:
            raise ValueError("confidence_head_with_markov=true needs enable_confidence_head=true.")


def add_variant_fields(config: DFlashDraftConfig, out: dict[str, Any]) -> None:
    """The serving keys of DFlash2 / DSpark, added to the DFlash layout ``out`` in place."""
    out["is_causal"] = config.is_causal  # explicit: engines disagree on the default without it
    dflash = out["dflash_config"]
    if config.variant == "dflash2":
        dflash.update({k: getattr(config, k) for k in DFLASH2_KEYS})
        return
    fields = {k: getattr(config, k) for k in DSPARK_KEYS}
    # DeepSpec's layout is top-level; SpecForge's and llama.cpp's DFlash converter read dflash_config.
    out.update(fields, mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids))
    out["sample_from_anchor"] = True
    dflash.update(fields, projector_type="dspark", sample_from_anchor=True)


def read_variant_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The variant and its fields of a serving ``config.json`` (``add_variant_fields`` inverted)."""
    names = raw.get("architectures") or ["DFlashDraftModel"]
    if names[0] not in READ_ARCHITECTURES:
        raise ValueError(
            f"config.json architecture {names[0]!r} is not a drafter this project loads; expected one of "
            f"{sorted(READ_ARCHITECTURES)}."
        )
    variant = READ_ARCHITECTURES[names[0]]
    dflash = raw.get("dflash_config") or {}

    def value(key: str, default: Any) -> Any:
        return dflash.get(key, raw.get(key, default))

    if variant == "dflash2":
        return {"variant": variant, **{k: int(value(k, 0)) for k in DFLASH2_KEYS}}
    if variant == "dspark":
        if not value("sample_from_anchor", True):
            raise NotImplementedError(
                "config.json has sample_from_anchor=false (the speculators DSpark convention: slot j predicts "
                "anchor+j, slot 0 unused): only DeepSpec's sample_from_anchor=true layout is implemented."
            )
        return {
            "variant": variant,
            "markov_rank": int(value("markov_rank", 0)),
            "markov_head_type": str(value("markov_head_type", "vanilla")),
            "enable_confidence_head": bool(value("enable_confidence_head", False)),
            "confidence_head_with_markov": bool(value("confidence_head_with_markov", False)),
        }
    return {"variant": variant}
