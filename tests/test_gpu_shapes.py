"""GPU checks at the Qwen3.6-27B shapes (random bf16 weights, ``pytest -m gpu``).

What scripts/gpu_check_target.py, gpu_check_drafter.py and gpu_packing_check.py checked by hand
(their measurements are in docs/performance.md): the target's fla kernels at the real GatedDeltaNet
width (16 QK / 48 V heads x 128) against transformers' PyTorch reference, right padding, no
activation left alive after a feature pass; the drafter's flex attention against chunked SDPA at
the real drafter shape (L 4096, 512 anchors x 16); a packed row through fla's varlen kernels. The
CPU tests pin the same rules at tiny shapes; these pin the kernels at the shapes that train.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

MiB = 2**20
QWEN36 = "preset:qwen3.6-27b"
# bf16 inputs with fp32 accumulation, 4 target layers or 5 drafter layers deep.
BF16_TOLERANCE = 5e-2


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def qwen36_slice(layer_ids: list[int]):
    """The qwen3.6-27b target built only up to ``max(layer_ids)`` (layers 0-3: 3 GatedDeltaNet + 1 full)."""
    pytest.importorskip("fla")
    from dflash_train.config import TargetConfig
    from dflash_train.models.target import load_target

    torch.manual_seed(0)
    cfg = TargetConfig(path=QWEN36, dtype="bfloat16", target_layer_ids=layer_ids)
    target = load_target(cfg, "cuda", truncate_unused_layers=True)  # refuses the PyTorch fallback
    assert target.config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert target.kernels["gated_delta_net"] == "fla-fused", target.kernels
    return target


def transformers_reference_features(target, ids: torch.Tensor) -> torch.Tensor:
    """The same features through transformers' own forward and PyTorch chunk rule (no fla rule)."""
    from dflash_train.models.gated_delta_net import bind_fused_gated_delta_net, unbind_fused_gated_delta_net
    from dflash_train.models.target_kernels import gated_delta_net_layers

    layers = gated_delta_net_layers(target.model)
    modeling = sys.modules[type(layers[0]).__module__]
    dispatching = modeling.torch_chunk_gated_delta_rule
    unbind_fused_gated_delta_net(layers)
    modeling.torch_chunk_gated_delta_rule = dispatching.__wrapped__  # the reference, not fla
    try:
        return target.features(ids)
    finally:
        modeling.torch_chunk_gated_delta_rule = dispatching
        bind_fused_gated_delta_net(layers)


@pytest.mark.gpu
def test_qwen36_width_features_on_fla_match_the_reference_and_right_padding():
    target = qwen36_slice([0, 1, 2, 3])
    ids = torch.randint(0, target.vocab_size, (2, 1024), device="cuda")
    fast = target.features(ids)
    assert relative_error(fast, transformers_reference_features(target, ids)) < BF16_TOLERANCE
    real = 640  # row 1 right-padded after 640 tokens: its real tokens' features as if alone
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, real:] = False
    padded = target.features(ids.masked_fill(~mask, 0), mask)
    alone = target.features(ids[1:, :real])
    assert relative_error(padded[1, :real], alone[0]) < BF16_TOLERANCE


@pytest.mark.gpu
def test_a_qwen36_feature_pass_leaves_only_its_features_allocated():
    target = qwen36_slice([0, 1, 2, 3])
    ids = torch.randint(0, target.vocab_size, (1, 4096), device="cuda")
    target.features(ids)  # warm-up: Triton compilation and autotuning
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    features = target.features(ids)
    torch.cuda.synchronize()
    assert features.shape == (1, 4096, 4 * target.hidden_size) and features.dtype == torch.bfloat16
    assert features.is_contiguous()
    leftover = torch.cuda.memory_allocated() - before - features.numel() * features.element_size()
    assert leftover < 64 * MiB, f"{leftover / MiB:.1f} MiB of activations stayed alive after features()"


@pytest.mark.gpu
def test_qwen36_packed_row_on_fla_varlen_equals_each_conversation_alone():
    from dflash_train.data.batching import assemble_packed_batch

    target = qwen36_slice([1, 2, 3])
    assert target.kernels["chunk_gated_delta_rule"] == target.kernels["causal_conv1d_fn"] == "fla"
    rng = np.random.default_rng(0)
    lengths = [700, 1500, 1200, 696]  # four conversations in one 4,096-token row
    conversations = [rng.integers(0, target.vocab_size, size=n) for n in lengths]
    rows = [[(c, c >= 0) for c in conversations]]
    batch = assemble_packed_batch(rows, [list(range(len(lengths)))], 1, sum(lengths), pad_id=0)
    ids, positions = batch.input_ids.cuda(), batch.position_ids.cuda()
    packed = target.features(ids, position_ids=positions)
    errors, start = [], 0
    for conversation in conversations:
        alone = target.features(torch.as_tensor(conversation, device="cuda")[None])[0]
        errors.append(relative_error(packed[0, start : start + len(conversation)], alone))
        start += len(conversation)
    # Random weights make context matter little: the packed error must be far below what crossing
    # the conversation boundaries changes.
    crossed = relative_error(packed[0, lengths[0] :], target.features(ids)[0, lengths[0] :])
    assert max(errors) * 5 < crossed, (errors, crossed)


@pytest.mark.gpu
def test_flex_attention_agrees_with_chunked_sdpa_at_the_qwen36_drafter_shape():
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter

    config = presets.resolve_drafter_config(
        DrafterConfig(preset="qwen3.6-27b"), presets.qwen36_27b_target_config()
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        drafter = DFlashDrafter(config).to(torch.bfloat16)
        embed = torch.nn.Embedding(config.vocab_size, config.hidden_size, dtype=torch.bfloat16)
        embed.requires_grad_(False)
        length, num_anchors = 4096, 512
        features = torch.randn(
            1, length, config.num_target_features * config.hidden_size, dtype=torch.bfloat16
        )
        ids = torch.randint(0, config.vocab_size - 1, (1, length))
        anchors = torch.randperm(length - 2)[:num_anchors].sort().values[None] + 1
        keep = torch.ones_like(anchors, dtype=torch.bool)
    assert config.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    batch = (features, ids, anchors, keep)
    flex = drafter.forward_train(*batch, embed, backend="flex")
    sdpa = drafter.forward_train(*batch, embed, backend="sdpa", sdpa_anchor_chunk=64)
    assert relative_error(flex.detach(), sdpa.detach()) < BF16_TOLERANCE  # measured 1.2e-2
    flex.float().pow(2).mean().backward()  # flex's compiled backward runs at this shape
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in drafter.parameters())
