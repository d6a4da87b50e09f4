"""The ``target:`` and ``drafter:`` sections of a recipe: the settings the models own.

They live here, below ``config.py``, because models/ names them in its signatures while
``config.py`` validates a recipe against the model presets: the imports then run one way,
config -> models. ``dflash_train.config`` re-exports both as part of the one config tree; the
cross-field checks stay in ``config.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_train.models.variant import DEFAULT_VARIANT, get_variant, registered_variants


@dataclass(kw_only=True)
class TargetConfig:
    """The frozen target model whose features the drafter learns from."""

    # Local directory or hub id of a transformers checkpoint, or "preset:<name>" for a
    # random-weight target of a known shape (benchmarks, tests).
    path: str
    # Weights dtype of the target: bfloat16 on GPU; float32 is allowed on CPU.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # 0-based decoder layers whose outputs are concatenated as features; empty = the DFlash
    # default round(1 + i*(N-4)/(n-1)) for i < num_target_features.
    target_layer_ids: list[int] = field(default_factory=list)
    # Number of feature layers when target_layer_ids is empty.
    num_target_features: int = 5
    # Allow the target's last layer among target_layer_ids. Off by default: serving engines differ
    # on whether they capture it before or after the final norm (training uses before).
    allow_last_layer: bool = False
    # GatedDeltaNet targets on CUDA must run the fla kernels; set true to accept the ~3x slower
    # PyTorch fallback (a loud warning is printed once).
    allow_slow_kernels: bool = False
    # Sharding the frozen target (FSDP2, forward only) is not implemented: true is refused with a
    # pointer to train.placement=split, which gives the target GPUs of its own.
    fsdp_shard: bool = False
    # torch.compile the target's MLPs, norms and full-attention blocks for the training feature
    # pass (CUDA only; GatedDeltaNet kernels stay fla's). Evaluation always runs it uncompiled.
    compile: bool = False
    # Run the target's decoder linears in FP8 (torchao float8, rowwise scales; CUDA sm89+, target.dtype
    # bfloat16, the `fp8` extra). Embedding and LM head stay bf16 (models/target_fp8.py).
    fp8: bool = False
    trust_remote_code: bool = False


@dataclass(kw_only=True)
class DrafterConfig:
    """Shape of the DFlash draft model. Fields left at 0/empty come from the preset or the target."""

    # "qwen3.6-27b", "qwen3-8b", "tiny", or "from-target" (width/heads copied from the target).
    preset: str = "from-target"
    num_hidden_layers: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 0.0
    rope_theta: float = 0.0
    max_position_embeddings: int = 0
    # Per layer "full_attention" (bidirectional in-block) or "sliding_attention" (causal in-block,
    # windowed context); empty = all full attention (or the preset's).
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0
    # Sliding layers are causal in-block by default; false makes them bidirectional in-block.
    is_causal: bool = True
    # Tokens per block: the anchor plus block_size - 1 predicted positions.
    block_size: int = 16
    # Row of the target embedding used for MASK tokens; -1 = the preset's or the tokenizer's
    # dedicated mask/unused token. Never pad or eos.
    mask_token_id: int = -1
    # Initialise from an exported drafter directory instead of random weights.
    init_from: str = ""
    # Architecture variant (docs/training.md "Variants"; one module each in models/variants/): dflash;
    # dflash2 (DFlash2: a grouped dynamic causal convolution around both sublayers of every layer, and
    # a candidate selector); dspark (DSpark: a Markov head and a confidence head; every block slot
    # predicts the next token, so a block of block_size drafts block_size tokens).
    variant: str = DEFAULT_VARIANT
    # dflash2: convolution taps and channels per dynamic group (0 = DFlash2's 2 and 16).
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    # dflash2: rank of the selector's predecessor/successor codebooks and candidates per position
    # (0 = DFlash2's 256 and 16).
    selector_rank: int = 0
    selector_top_k: int = 0
    # dflash2: weight of the selector's K-way cross-entropy, next to the parallel head's loss.
    selector_loss_weight: float = 1.0
    # dspark: rank of the Markov head (0 = DSpark's 256), and the confidence head (reads the
    # block hidden state and the Markov embedding of the previous token).
    markov_rank: int = 0
    confidence_head: bool = True
    # dspark loss, DeepSpec's: ce_weight * CE + tv_weight * TV(draft, target distribution) +
    # confidence_loss_weight * BCE(confidence, 1 - TV / 2). TV and the confidence target need the
    # target's own distribution (the target then runs to full depth, as for train.loss=kl).
    dspark_ce_weight: float = 0.1
    dspark_tv_weight: float = 0.9
    confidence_loss_weight: float = 1.0

    def __post_init__(self) -> None:
        check_variant_settings(self)

    @property
    def num_verify_tokens(self) -> int:
        """Tokens a round verifies: block_size (the last token and B-1 drafts), or block_size + 1 for
        DSpark (every slot drafts); ``DFlashDraftConfig.num_verify_tokens`` of the resolved drafter."""
        return self.block_size + 1 - get_variant(self.variant).first_scored_slot

    def variant_fields(self) -> dict:
        """The variant's fields of the resolved ``DFlashDraftConfig`` (defaults filled in)."""
        return {"variant": self.variant, **get_variant(self.variant).resolved_fields(self)}


def check_variant_settings(d: DrafterConfig) -> None:
    """Settings of another variant than ``drafter.variant`` are refused (they would be ignored)."""
    variant = get_variant(d.variant)
    others = [v for v in registered_variants() if v is not variant]
    # Sizes are set when not 0, loss weights when not their default (which is not 0).
    foreign = [f"drafter.{k}" for v in others for k in v.recipe_sizes if getattr(d, k)]
    foreign += [
        f"drafter.{k}" for v in others for k in v.recipe_weights if getattr(d, k) != getattr(DrafterConfig, k)
    ]
    if foreign:
        owners = "; ".join(
            f"{', '.join((*v.recipe_sizes, *v.recipe_weights))} are {v.name}'s"
            for v in others
            if v.recipe_sizes or v.recipe_weights
        )
        raise ValueError(
            f"{', '.join(foreign)} set with drafter.variant={d.variant}: they configure another variant "
            f"({owners}); remove them or set drafter.variant."
        )
    numeric = [k for v in registered_variants() for k in (*v.recipe_sizes, *v.recipe_weights)]
    negative = [k for k in numeric if getattr(d, k) < 0]
    if negative:
        raise ValueError(
            f"drafter.{negative[0]}={getattr(d, negative[0])}: must be >= 0 (0 = the default size)."
        )
    variant.check_settings(d)


def check_variant_placement(d: DrafterConfig, placement: str) -> None:
    """Split placement streams only features: a variant that needs the teacher must be colocated."""
    get_variant(d.variant).check_placement(d, placement)
