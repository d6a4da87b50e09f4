"""Known shapes: targets (for random-weight benchmarks and tests) and the drafters trained for them.

A target preset is a transformers config (random weights are built from it with ``preset:<name>``);
a drafter preset fixes the drafter's width, heads, layer types, window, RoPE, feature layers and
mask token. ``resolve_drafter_config`` turns the user's ``DrafterConfig`` plus the target's config
into the complete ``DFlashDraftConfig``.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers import LlamaConfig, PretrainedConfig, Qwen3_5TextConfig, Qwen3Config

from dflash_train.models.drafter_config import DFlashDraftConfig, check_ascending_layer_ids
from dflash_train.models.recipe_config import DrafterConfig


def qwen36_27b_target_config(num_hidden_layers: int = 64) -> Qwen3_5TextConfig:
    """Qwen3.6-27B text stack: [3 GatedDeltaNet, 1 full attention] x 16, hidden 5120, vocab 248,320."""
    return Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_hidden_layers)
        ],
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        eos_token_id=248044,
        pad_token_id=248044,
    )


def qwen3_8b_target_config(num_hidden_layers: int = 36) -> Qwen3Config:
    """Qwen3-8B: 36 layers, hidden 4096, 32/8 heads x 128, vocab 151,936, untied."""
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
        eos_token_id=151645,
        pad_token_id=151643,
    )


def tiny_hybrid_target_config(
    vocab_size: int = 320, num_hidden_layers: int = 4, hidden_size: int = 64
) -> Qwen3_5TextConfig:
    """A 4-layer Qwen3.5 hybrid (3 GatedDeltaNet + 1 full attention) that runs in milliseconds on CPU."""
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_hidden_layers)
        ],
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    )


def tiny_qwen3_target_config(
    vocab_size: int = 320, num_hidden_layers: int = 3, hidden_size: int = 64
) -> Qwen3Config:
    """A 3-layer Qwen3 (pure attention, tied embeddings) for CPU tests."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
    )


def smollm2_135m_target_config(num_hidden_layers: int = 30) -> LlamaConfig:
    """SmolLM2-135M-Instruct's shape (the real target of docs/quality.md), for random-weight benchmarks
    of generation at that shape: Llama, hidden 576, 9 query / 3 key-value heads of 64, FFN 1536."""
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
    )


TARGET_PRESETS = {
    "qwen3.6-27b": qwen36_27b_target_config,
    "smollm2-135m": smollm2_135m_target_config,
    "qwen3-8b": qwen3_8b_target_config,
    "tiny-hybrid": tiny_hybrid_target_config,
    "tiny-qwen3": tiny_qwen3_target_config,
}

# Drafter shapes; "hidden_size": None means "the target's".
DRAFTER_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.6-27b": dict(
        num_hidden_layers=5,
        hidden_size=5120,
        intermediate_size=17408,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048,
        rope_theta=1e7,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        target_layer_ids=[1, 16, 31, 46, 61],
        mask_token_id=248070,
    ),
    "qwen3-8b": dict(
        num_hidden_layers=5,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        layer_types=["full_attention"] * 5,
        sliding_window=None,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        target_layer_ids=[1, 9, 17, 25, 33],
        mask_token_id=151669,
    ),
    "tiny": dict(
        num_hidden_layers=2,
        hidden_size=None,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    ),
}


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """DFlash default feature layers: round(1 + i*(N-4)/(n-1)), e.g. N=64 -> [1,16,31,46,61].

    The formula repeats ids on shallow targets (N < n + 3, e.g. the 4-layer test targets would get
    [1,1,1,1,1]), and serving engines capture each layer once: there the default is min(n, N-1)
    distinct ids spread evenly over layers 0..N-2 (the last layer is avoided, see
    ``check_serving_layer_ids``), so a 4-layer target gets [0, 1, 2] (3 features, not 5).
    """
    n, last = num_features, num_target_layers - 1
    if n >= 2 and num_target_layers >= n + 3:
        return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]
    count = max(1, min(n, last))
    if count == 1:
        return [max(0, min(num_target_layers // 2, last - 1))]
    return [round(i * (last - 1) / (count - 1)) for i in range(count)]


def check_serving_layer_ids(
    ids: list[int], num_target_layers: int, allow_last_layer: bool = False
) -> list[int]:
    """``target.target_layer_ids`` as SGLang and vLLM can serve them; a ValueError says what to change.

    Engines capture each feature layer once, in ascending order: a repeated id crashes their ``fc``
    (it expects n distinct captures) and unsorted ids silently permute the features the drafter was
    trained on. Engines also take layer l's output as the input of layer l+1, before the final norm;
    for the last layer there is no layer l+1, and engines differ on whether they capture it before
    or after the final norm (HF's ``hidden_states[N]`` is after it), so it is refused unless
    ``allow_last_layer`` (``target.allow_last_layer=true``).
    """
    ids = [int(i) for i in ids]
    default = default_target_layer_ids(num_target_layers)
    if not ids or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"target.target_layer_ids={ids}: give 0-based layer ids within [0, {num_target_layers - 1}] "
            f"(the target has {num_target_layers} decoder layers), or leave it empty for the default {default}."
        )
    check_ascending_layer_ids(ids)
    if num_target_layers - 1 in ids and not allow_last_layer:
        raise ValueError(
            f"target.target_layer_ids={ids} uses the target's last layer {num_target_layers - 1}: serving "
            "engines take a layer's output as the next layer's input (before the final norm), and for "
            "the last layer they differ on whether the feature is taken before or after the final norm, "
            f"so the served drafter may see other features than in training. Use lower layers (default "
            f"{default}), or set target.allow_last_layer=true if you know how your engine captures it."
        )
    return ids


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of a (possibly multimodal) transformers config."""
    return getattr(config, "text_config", None) or config


def check_drafter_preset(name: str) -> None:
    """``drafter.preset`` names a preset of ``DRAFTER_PRESETS`` or ``from-target``."""
    if name != "from-target" and name not in DRAFTER_PRESETS:
        raise ValueError(
            f"drafter.preset={name!r} is unknown; use one of {['from-target', *DRAFTER_PRESETS]}."
        )


def resolve_drafter_config(
    drafter: DrafterConfig,
    target_config: PretrainedConfig,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    torch_dtype: str = "bfloat16",
) -> DFlashDraftConfig:
    """Complete drafter shape: explicit recipe fields > preset > the target's own shape."""
    tc = text_config(target_config)
    check_drafter_preset(drafter.preset)
    preset = dict(DRAFTER_PRESETS.get(drafter.preset, {}))
    rope = getattr(tc, "rope_parameters", None) or {}
    from_target = dict(
        num_hidden_layers=5,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        layer_types=[],
        sliding_window=None,
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 1e6) or 1e6)),
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
    )
    shape = {**from_target, **{k: v for k, v in preset.items() if v is not None}}
    explicit = {
        k: getattr(drafter, k)
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
            "sliding_window",
        )
        if getattr(drafter, k)
    }
    if drafter.layer_types:
        explicit["layer_types"] = list(drafter.layer_types)
    shape.update(explicit)
    ids = (
        target_layer_ids
        or shape.pop("target_layer_ids", None)
        or default_target_layer_ids(tc.num_hidden_layers)
    )
    shape.pop("target_layer_ids", None)
    mask = (
        mask_token_id
        if mask_token_id is not None
        else (drafter.mask_token_id if drafter.mask_token_id >= 0 else shape.pop("mask_token_id", None))
    )
    shape.pop("mask_token_id", None)
    if mask is None:
        raise ValueError(
            "no mask token: set drafter.mask_token_id to an unused row of the target's embedding (not pad/eos)."
        )
    if shape["hidden_size"] != tc.hidden_size:
        raise ValueError(
            f"drafter hidden_size {shape['hidden_size']} != target hidden_size {tc.hidden_size}: the drafter shares the target's embedding and LM head, so they must match; pick the preset for your target or drafter.preset=from-target."
        )
    if not drafter.is_causal and "sliding_attention" in shape["layer_types"]:
        warnings.warn(
            "drafter.is_causal=false with sliding_attention layers: vLLM honours it (bidirectional "
            "in-block), but SGLang ignores is_causal and runs sliding layers causal in-block, so "
            "the drafter served by SGLang would not match training. Keep is_causal=true to serve with SGLang.",
            stacklevel=2,
        )
    return DFlashDraftConfig(
        **shape,
        vocab_size=tc.vocab_size,
        num_target_layers=tc.num_hidden_layers,
        target_layer_ids=list(ids),
        mask_token_id=int(mask),
        block_size=drafter.block_size,
        is_causal=drafter.is_causal,
        torch_dtype=torch_dtype,
        **drafter.variant_fields(),
    )
