"""A leaner GatedDeltaNet forward for the training feature pass (Qwen3.5/3.6 hybrids on fla).

transformers' ``Qwen3_5GatedDeltaNet.forward`` prepares fla's chunk rule the way its PyTorch
reference needs: it repeats the query and key heads up to the value heads (``repeat_interleave``,
3x for Qwen3.6-27B: 16 -> 48 heads), computes the decay ``g = -exp(A_log) * softplus(a + dt_bias)``
and ``beta = sigmoid(b)`` as separate fp32 kernels, and transposes the conv input and output.
fla's ``chunk_gated_delta_rule`` takes all of that natively: grouped value heads (value head j
reads key head ``j // (HV / H)``, the same mapping as ``repeat_interleave``), the gate and the
beta sigmoid inside its kernels (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``), and the
q/k L2 norm on the 16 key heads instead of 48 repeated ones. ``fused_feature_forward`` is the
same function of the weights written that way; it runs only when no cache is passed (the feature
pass, packed rows included), and the layer's own forward handles every cached call (evaluation,
regeneration).

``bind_fused_gated_delta_net`` installs it on a model's GatedDeltaNet layers when fla's chunk
rule and conv are bound, and ``bound_kernels`` then reports ``gated_delta_net: fla-fused``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# The attributes of the Qwen3.5/3.6 layout this forward is written for (Qwen3-Next interleaves
# q/k/v/z in one projection and keeps transformers' forward).
FUSED_LAYOUT = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "norm")


def fla_chunk_rule() -> Callable:
    """fla's ``chunk_gated_delta_rule`` (imported lazily: fla is a GPU-only optional package).

    Both fla entry points are made opaque to ``torch.compile`` (a graph break around a Triton
    launch with fla's own autotuning) should a caller compile the whole layer.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return torch.compiler.disable(chunk_gated_delta_rule)


def fla_conv() -> Callable:
    """fla's Triton ``causal_conv1d`` ([B, T, D] in and out)."""
    from fla.modules.causal_conv1d import causal_conv1d

    return torch.compiler.disable(causal_conv1d)


def fused_feature_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cache_params: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The layer's output for a cache-free forward: [B, T, hidden] -> [B, T, hidden].

    ``cu_seq_lens_q`` (packed rows flattened to [1, T]) restarts the conv and the recurrence at
    every boundary, as in transformers' forward. With a cache the layer's own forward runs.
    """
    if cache_params is not None:
        return self.dflash_original_forward(hidden_states, cache_params, attention_mask, **kwargs)
    if attention_mask is not None:  # zero the padded positions, as transformers does
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, seq_len, _ = hidden_states.shape
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    mixed_qkv, _ = self.dflash_conv(
        self.in_proj_qkv(hidden_states),
        weight=self.conv1d.weight.squeeze(1),
        bias=self.conv1d.bias,
        activation=self.activation,
        cu_seqlens=cu_seqlens,
    )
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    core, _ = self.dflash_chunk_rule(
        query.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim),
        key.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim),
        value.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim),
        g=self.in_proj_a(hidden_states),
        beta=self.in_proj_b(hidden_states),
        use_gate_in_kernel=True,
        A_log=self.A_log,
        dt_bias=self.dt_bias,
        use_beta_sigmoid_in_kernel=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
    )
    z = self.in_proj_z(hidden_states).reshape(-1, self.head_v_dim)
    core = self.norm(core.reshape(-1, self.head_v_dim), z)
    return self.out_proj(core.reshape(batch, seq_len, -1))


def has_fused_layout(module: nn.Module) -> bool:
    """True for a GatedDeltaNet with the separate q/k/v, z, a, b projections of Qwen3.5/3.6."""
    return (
        all(hasattr(module, name) for name in FUSED_LAYOUT) and module.num_v_heads % module.num_k_heads == 0
    )


def bind_fused_gated_delta_net(
    layers: list[nn.Module],
    *,
    chunk_rule: Callable | None = None,
    conv: Callable | None = None,
) -> int:
    """Install ``fused_feature_forward`` on every Qwen3.5-layout layer of ``layers``; returns how many.

    ``chunk_rule`` / ``conv`` default to fla's kernels; tests pass references with the same
    contract. Idempotent; ``unbind_fused_gated_delta_net`` restores transformers' forward.
    """
    chunk_rule = chunk_rule or fla_chunk_rule()
    conv = conv or fla_conv()
    bound = 0
    for module in layers:
        if not has_fused_layout(module):
            continue
        if "dflash_original_forward" not in module.__dict__:
            module.dflash_original_forward = module.forward
        module.dflash_chunk_rule = chunk_rule
        module.dflash_conv = conv
        module.forward = types.MethodType(fused_feature_forward, module)
        bound += 1
    return bound


def unbind_fused_gated_delta_net(layers: list[nn.Module]) -> None:
    """Put transformers' own forward back on ``layers`` (benchmarks compare the two)."""
    for module in layers:
        original = module.__dict__.pop("dflash_original_forward", None)
        if original is not None:
            module.forward = original
            del module.dflash_chunk_rule, module.dflash_conv


def is_fused(module: nn.Module) -> bool:
    """Whether ``module`` runs ``fused_feature_forward`` for cache-free calls."""
    return "dflash_original_forward" in module.__dict__
