"""The fully resolved shape of a DFlash draft model, and its serving ``config.json``.

``DFlashDraftConfig`` is what the model is built from and what ``export`` writes: the field names
are the ones SGLang (``--speculative-algorithm DFLASH``) and vLLM (``method: dflash``) read.

The variant (``variant``, docs/training.md "Variants") decides the architecture name and adds its
own keys to the layout its engines load (``add_serving_fields`` / ``read_serving_fields`` of its
module in ``models/variants/``); its fields below stay 0 / off for every other variant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflash_train.models.variant import (
    DEFAULT_VARIANT,
    get_variant,
    registered_variants,
    variant_for_architecture,
)

LAYER_TYPES = ("full_attention", "sliding_attention")


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
    # A registered variant's name (models/variant.py); the fields below are 0 / off unless it uses them.
    variant: str = DEFAULT_VARIANT
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
        ``ids[a+k+1]``): the variant's."""
        return get_variant(self.variant).first_scored_slot

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
            "architectures": [get_variant(self.variant).architecture],
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
        get_variant(self.variant).add_serving_fields(self, out)
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
        unset = dataclasses.MISSING
        required = [
            f.name for f in dataclasses.fields(cls) if f.default is unset and f.default_factory is unset
        ]
        missing = [name for name in required if name not in kwargs]
        if missing:
            raise ValueError(
                f"config.json has no {missing}: not a complete DFlash drafter export; re-export it."
            )
        names = raw.get("architectures") or [get_variant(DEFAULT_VARIANT).architecture]
        variant = variant_for_architecture(names[0])
        kwargs.update(variant=variant.name, **variant.read_serving_fields(raw))
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
    variant = get_variant(config.variant)
    foreign = [
        key
        for other in registered_variants()
        if other is not variant
        for key, unused in other.config_fields.items()
        if key not in variant.config_fields and getattr(config, key) != unused
    ]
    if foreign:
        raise ValueError(
            f"{foreign} belong to another drafter variant than {config.variant!r}: "
            "leave them at 0 / false or choose the variant they belong to."
        )
    variant.check_config(config)
