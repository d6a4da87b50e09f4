"""The fused GatedDeltaNet feature forward computes transformers' layer, on CPU reference kernels
with fla's contract (grouped value heads, gate and beta sigmoid in the kernel, [B, T, D] conv), and
on fla's real kernels on CUDA (gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5

from dflash_train.models.gated_delta_net import (
    bind_fused_gated_delta_net,
    is_fused,
    unbind_fused_gated_delta_net,
)
from dflash_train.models.target_kernels import bound_kernels, gated_delta_net_layers
from dflash_train.tiny import build_tiny_target


def reference_chunk_rule(
    q, k, v, g, beta, *, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
    use_qk_l2norm_in_kernel, cu_seqlens=None,
):  # fmt: skip
    """fla's chunk_gated_delta_rule contract on transformers' PyTorch reference (no varlen)."""
    assert use_gate_in_kernel and use_beta_sigmoid_in_kernel and use_qk_l2norm_in_kernel
    assert cu_seqlens is None
    ratio = v.shape[2] // q.shape[2]
    decay = -A_log.float().exp() * F.softplus(g.float() + dt_bias)
    return modeling_qwen3_5.torch_chunk_gated_delta_rule(
        q.repeat_interleave(ratio, dim=2),
        k.repeat_interleave(ratio, dim=2),
        v,
        g=decay,
        beta=beta.sigmoid(),
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )


def reference_conv(x, weight, bias=None, activation=None, cu_seqlens=None):
    """fla's causal_conv1d contract ([B, T, D] in and out, (out, state)) on a depthwise conv."""
    assert cu_seqlens is None and activation == "silu"
    width, length = weight.shape[-1], x.shape[1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[-1])
    return F.silu(out[..., :length]).transpose(1, 2), None


@pytest.fixture
def hybrid():
    torch.manual_seed(0)
    model = build_tiny_target("hybrid", seed=3).float().eval()
    # Non-trivial gates and decays: the defaults would hide a swapped A_log / dt_bias.
    for layer in gated_delta_net_layers(model):
        layer.A_log.data.uniform_(-1.0, 1.0)
        layer.dt_bias.data.uniform_(-1.0, 1.0)
    return model


def features(model, ids, mask=None):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    return torch.stack(out.hidden_states)


def test_fused_forward_equals_transformers_layer(hybrid):
    layers = gated_delta_net_layers(hybrid)
    assert layers[0].num_v_heads > layers[0].num_k_heads  # grouped value heads are exercised
    ids = torch.randint(0, 320, (2, 37))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # right padding: the padded positions are zeroed before the mixer
    expected = features(hybrid, ids, mask)
    assert bind_fused_gated_delta_net(layers, chunk_rule=reference_chunk_rule, conv=reference_conv) == len(
        layers
    )
    assert all(is_fused(layer) for layer in layers)
    assert bound_kernels(hybrid)["gated_delta_net"] == "fla-fused"
    torch.testing.assert_close(features(hybrid, ids, mask), expected, rtol=1e-5, atol=1e-5)
    unbind_fused_gated_delta_net(layers)
    assert bound_kernels(hybrid)["gated_delta_net"] == "transformers"
    torch.testing.assert_close(features(hybrid, ids, mask), expected, rtol=0, atol=0)


def test_a_wrong_head_mapping_is_caught(hybrid):
    """The comparison above can fail: pairing value heads with key heads cyclically (repeat instead
    of repeat_interleave) changes the features."""

    def cyclic_heads(q, k, v, g, beta, **kw):
        ratio = v.shape[2] // q.shape[2]
        # Value head j paired with key head j % H: what a wrong GVA convention would compute.
        wide_q, wide_k = q.repeat(1, 1, ratio, 1), k.repeat(1, 1, ratio, 1)
        return reference_chunk_rule(wide_q, wide_k, v, g, beta, **kw)

    layers = gated_delta_net_layers(hybrid)
    ids = torch.randint(0, 320, (1, 21))
    expected = features(hybrid, ids)
    bind_fused_gated_delta_net(layers, chunk_rule=cyclic_heads, conv=reference_conv)
    assert not torch.allclose(features(hybrid, ids), expected, atol=1e-3)


def test_cached_calls_keep_transformers_forward(hybrid):
    """Evaluation and regeneration pass a cache: the fused forward hands those to the layer's own."""
    ids = torch.randint(0, 320, (1, 12))
    with torch.no_grad():
        expected = hybrid.generate(ids, max_new_tokens=6, do_sample=False)
    bind_fused_gated_delta_net(gated_delta_net_layers(hybrid), chunk_rule=_must_not_run, conv=_must_not_run)
    with torch.no_grad():
        assert torch.equal(hybrid.generate(ids, max_new_tokens=6, do_sample=False), expected)


def _must_not_run(*args, **kwargs):
    raise AssertionError("the fused kernels ran for a cached call")


@pytest.mark.gpu
def test_fused_forward_matches_transformers_on_fla():
    pytest.importorskip("fla")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dflash_train.models.target_kernels import bind_fla_causal_conv

    torch.manual_seed(0)
    model = build_tiny_target("hybrid", seed=3).to("cuda", torch.bfloat16).eval()
    bind_fla_causal_conv(model, "cuda")
    ids = torch.randint(0, 320, (2, 300), device="cuda")
    expected = features(model, ids).float()
    bind_fused_gated_delta_net(gated_delta_net_layers(model))
    got = features(model, ids).float()
    rel = (got - expected).norm() / expected.norm()
    assert rel < 2e-2, rel


def test_compiled_layers_give_the_same_features_and_compile_once(hybrid):
    """``target.compile_layers``: every decoder layer's forward compiled around the (opaque) kernels;
    the layers of one type share their graphs, and a second forward compiles nothing new."""
    from torch._dynamo.utils import counters

    from dflash_train.models.target_kernels import compile_target_layers

    torch._dynamo.reset()
    layers = gated_delta_net_layers(hybrid)
    bind_fused_gated_delta_net(
        layers,
        chunk_rule=torch.compiler.disable(reference_chunk_rule),
        conv=torch.compiler.disable(reference_conv),
    )
    ids = torch.randint(0, 320, (1, 24))
    expected = features(hybrid, ids)
    assert len(compile_target_layers(hybrid)) == len(hybrid.model.layers)
    counters.clear()
    torch.testing.assert_close(features(hybrid, ids), expected, rtol=1e-5, atol=1e-5)
    first = counters["stats"]["unique_graphs"]
    torch.testing.assert_close(features(hybrid, ids), expected, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == first  # no recompile on the second call
    # One compiled entry per layer type (3 GatedDeltaNet layers share one, the attention layer
    # has its own), not one per layer: 62 layers of the 27B target compile twice, not 62 times.
    code = type(hybrid.model.layers[0]).forward.__code__
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) == 2
