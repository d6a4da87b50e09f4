"""Matmul FLOPs of one DFlash training step, the numerator of MFU.

Only matrix multiplies are counted (2 FLOPs per multiply-add); norms, RoPE, activations, softmax
and the causal conv of GatedDeltaNet are a few percent at most and are left out, as is usual for
MFU. The count is the *useful* work of the algorithm (DESIGN.md section 1), not what a kernel
happens to execute: masked-out attention tiles are not counted, and a backward pass is 2x its
forward for trainable parts (input grad + weight grad) and 1x where only one of the two exists.

Legend: L sequence length, A anchors per row, K block size, D hidden, V vocab, F FFN width,
h/g query/key-value heads, d head dim.

Target forward: the layers up to ``max(target_layer_ids)`` only (the target is truncated there).
Attention layers: q/k/v/o projections (Qwen3.5/Qwen3-Next gate their output, so their q_proj is
2x wide) plus causal scores and values ``4*h*d*L*(L+1)/2``. GatedDeltaNet layers: in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a, out_proj plus the chunked gated delta rule (see
``gated_delta_rule_flops``). MLP: SwiGLU (dense, or routed top-k + shared expert for MoE configs).

Drafter: every layer runs on the A*K block tokens (projections, MLP, attention of block queries
against their visible keys), and projects k/v of the L context features; ``fc`` maps the
n*D concatenated features to D on L tokens. Backward: 2x for block-token layers and context k/v
(their input grad flows into ``fc``), 1x for ``fc`` (weight grad only: its input is the frozen
target's features). LM head (frozen, the target's): forward on the A*(K-1) scored tokens and one
input-grad pass of the same size, no weight grad.

Attention of block queries (an approximation, documented because anchors are random): a query at
anchor ``a`` sees ``a`` context keys (``min(a, window)`` in a sliding layer) plus its block. We
take anchors spread uniformly over the row, so the expected visible context is L/2 in a full
layer and ``W - W^2/(2L)`` in a sliding layer of window W < L. Real anchors sit in responses,
usually in the second half of a row, so this slightly under-counts; the dense upper bound (every
query against all L) would over-count by 2x or more. At the 27B shape the drafter's attention is
~1 TFLOP of ~325 per row, so either choice moves MFU by well under 1%.
"""

from __future__ import annotations

from typing import Any

from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.presets import text_config
from dflash_train.models.variant import get_variant

# bf16 dense matmul peak of one H200, measured at 8192^3 (DESIGN.md section 4).
H200_PEAK_FLOPS = 798e12

# Model families whose full-attention q_proj also produces an output gate (2x wide).
GATED_ATTENTION_MODEL_TYPES = ("qwen3_5", "qwen3_next")

# Chunk length of the chunked gated delta rule (fla and the transformers fallback both use 64).
DELTA_RULE_CHUNK = 64


def train_step_flops(
    target_config: Any,
    draft_config: DFlashDraftConfig,
    *,
    seq_len: int,
    num_anchors: int,
    rows: int = 1,
) -> dict[str, float]:
    """Matmul FLOPs of one micro-batch of ``rows`` x ``seq_len`` tokens with ``num_anchors`` blocks per row.

    Returns ``target``, ``drafter_fwd``, ``drafter_bwd``, ``lm_head_fwd``, ``lm_head_bwd`` and
    their sum ``total``. ``num_anchors`` is the padded anchor count (padded blocks are computed
    too, so they cost FLOPs even though they carry no loss).
    """
    if seq_len < 1 or num_anchors < 1 or rows < 1:
        raise ValueError(f"seq_len={seq_len}, num_anchors={num_anchors}, rows={rows} must all be >= 1")
    tc = text_config(target_config)
    dc = draft_config
    num_target_layers = max(dc.target_layer_ids) + 1
    target = sum(target_layer_flops(tc, i, seq_len) for i in range(num_target_layers))

    block_layers = sum(drafter_layer_flops(dc, i, seq_len, num_anchors) for i in range(dc.num_hidden_layers))
    context_kv = (
        dc.num_hidden_layers * 2.0 * seq_len * dc.hidden_size * 2 * dc.num_key_value_heads * dc.head_dim
    )
    fc = 2.0 * seq_len * dc.num_target_features * dc.hidden_size * dc.hidden_size
    lm_head = 2.0 * num_anchors * dc.num_draft_tokens * dc.hidden_size * dc.vocab_size
    heads = variant_head_flops(dc, num_anchors)

    out = {
        "target": target,
        "drafter_fwd": block_layers + context_kv + fc + heads,
        "drafter_bwd": 2 * block_layers + 2 * context_kv + fc + 2 * heads,
        "lm_head_fwd": lm_head,
        "lm_head_bwd": lm_head,
    }
    out = {k: v * rows for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def mfu(flops: float, seconds: float, peak_flops: float = H200_PEAK_FLOPS) -> float:
    """Model FLOPs utilisation: ``flops`` done by one device in ``seconds``, as a fraction of its peak.

    Returns 0.0 for a non-positive duration (nothing measured yet) rather than raising, because it
    is only ever used for logging.
    """
    if seconds <= 0:
        return 0.0
    return flops / (seconds * peak_flops)


# ----------------------------------------------------------------------------- target


def target_layer_flops(tc: Any, layer_idx: int, seq_len: int) -> float:
    """Forward FLOPs of decoder layer ``layer_idx`` of a transformers text config on ``seq_len`` tokens."""
    layer_types = getattr(tc, "layer_types", None) or []
    layer_type = layer_types[layer_idx] if layer_types else "full_attention"
    if layer_type == "linear_attention":
        mixer = gated_delta_net_flops(tc, seq_len)
    else:
        window = getattr(tc, "sliding_window", None) if layer_type == "sliding_attention" else None
        mixer = target_attention_flops(tc, seq_len, window)
    return mixer + mlp_flops(tc, layer_idx, seq_len)


def head_dim_of(tc: Any) -> int:
    return getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads


def target_attention_flops(tc: Any, seq_len: int, window: int | None = None) -> float:
    """q/k/v/o projections plus causal (optionally sliding-window) QK^T and PV."""
    d = head_dim_of(tc)
    h, g, hidden = tc.num_attention_heads, tc.num_key_value_heads, tc.hidden_size
    gated = str(getattr(tc, "model_type", "")).startswith(GATED_ATTENTION_MODEL_TYPES)
    q_width = h * d * (2 if gated else 1)
    projections = 2.0 * seq_len * hidden * (q_width + 2 * g * d + h * d)
    return projections + 4.0 * h * d * causal_key_count(seq_len, window)


def causal_key_count(seq_len: int, window: int | None = None) -> float:
    """Sum over queries of the keys each one sees under a causal (sliding-window) mask."""
    if not window or window >= seq_len:
        return seq_len * (seq_len + 1) / 2
    return window * (window + 1) / 2 + (seq_len - window) * window


def gated_delta_net_flops(tc: Any, seq_len: int) -> float:
    """A Qwen3.5 / Qwen3-Next GatedDeltaNet mixer: its five projections plus the delta rule."""
    key_dim = tc.linear_num_key_heads * tc.linear_key_head_dim
    value_dim = tc.linear_num_value_heads * tc.linear_value_head_dim
    hidden = tc.hidden_size
    in_width = 2 * key_dim + value_dim + value_dim + 2 * tc.linear_num_value_heads  # qkv, z, b, a
    projections = 2.0 * seq_len * hidden * in_width + 2.0 * seq_len * value_dim * hidden  # + out_proj
    rule = gated_delta_rule_flops(
        seq_len, tc.linear_num_value_heads, tc.linear_key_head_dim, tc.linear_value_head_dim
    )
    return projections + rule


def gated_delta_rule_flops(
    seq_len: int, num_heads: int, dk: int, dv: int, chunk: int = DELTA_RULE_CHUNK
) -> float:
    """The chunked gated delta rule (q/k are repeated to the value heads before it runs).

    Per chunk of C tokens and head: k_beta K^T and Q K^T (2 x 2C^2 dk), the two unit-triangular
    solves (C^2 dv + C^2 dk), the state read for the new values and for the output and the state
    update (3 x 2C dk dv), and the intra-chunk attention times values (2C^2 dv). Per token that is
    ``6 dk dv + C (5 dk + 3 dv)`` -- about 3% of a 27B-width GatedDeltaNet layer's projections.
    """
    per_token = 6.0 * dk * dv + chunk * (5 * dk + 3 * dv)
    return seq_len * num_heads * per_token


def mlp_flops(tc: Any, layer_idx: int, seq_len: int) -> float:
    """SwiGLU MLP: dense, or (MoE configs) router + top-k experts + an optional shared expert."""
    hidden = tc.hidden_size
    if not is_sparse_layer(tc, layer_idx):
        return 2.0 * seq_len * 3 * hidden * tc.intermediate_size
    routed = tc.num_experts_per_tok * 3 * hidden * tc.moe_intermediate_size
    shared = 3 * hidden * (getattr(tc, "shared_expert_intermediate_size", 0) or 0)
    router = hidden * tc.num_experts
    return 2.0 * seq_len * (routed + shared + router)


def is_sparse_layer(tc: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of a (Qwen-style) MoE config has a routed-expert MLP."""
    if not (getattr(tc, "num_experts", 0) and getattr(tc, "moe_intermediate_size", 0)):
        return False
    if layer_idx in (getattr(tc, "mlp_only_layers", None) or []):
        return False
    step = getattr(tc, "decoder_sparse_step", 1) or 1
    return (layer_idx + 1) % step == 0


# ----------------------------------------------------------------------------- drafter


def drafter_layer_flops(dc: DFlashDraftConfig, layer_idx: int, seq_len: int, num_anchors: int) -> float:
    """Forward FLOPs of one drafter layer on the A*K block tokens (context k/v projections excluded)."""
    d, h, g, hidden = dc.head_dim, dc.num_attention_heads, dc.num_key_value_heads, dc.hidden_size
    block, tokens = dc.block_size, num_anchors * dc.block_size
    projections = 2.0 * tokens * hidden * (2 * h * d + 2 * g * d)  # q, o + k, v
    mlp = 2.0 * tokens * 3 * hidden * dc.intermediate_size
    sliding = dc.layer_types[layer_idx] == "sliding_attention"
    context = mean_visible_context(seq_len, dc.sliding_window if sliding else None)
    # In-block keys: all K (bidirectional), or (K+1)/2 on average for a causal sliding layer.
    in_block = (block + 1) / 2 if sliding and dc.is_causal else block
    scores = 4.0 * h * d * tokens * (context + in_block)
    return projections + mlp + scores + get_variant(dc.variant).layer_flops(dc, tokens)


def variant_head_flops(dc: DFlashDraftConfig, num_anchors: int) -> float:
    """Forward FLOPs of the variant's heads on the scored block tokens (``head_flops`` of its module:
    DFlash2's selector, DSpark's Markov bias and confidence head; its per-layer additions, such as
    DFlash2's convolutions, are in ``drafter_layer_flops``)."""
    return get_variant(dc.variant).head_flops(dc, num_anchors * dc.num_draft_tokens)


def mean_visible_context(seq_len: int, window: int | None = None) -> float:
    """Expected context keys of a block query when the anchor is uniform over [0, L) (module docstring)."""
    if not window or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)
