"""The analytic flex BlockMask equals create_block_mask's and attends as the dense ``visible`` rule."""

import itertools
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_train.models.masks import LayerMaskSpec, build_flex_block_mask, visible

SPECS = [
    LayerMaskSpec(window=None, causal=False),
    *(LayerMaskSpec(window=w, causal=c) for w in (4, 64, 1000) for c in (True, False)),
]
SHAPES = list(itertools.product((1, 2), (1, 5, 20), (50, 128, 300)))  # (R, A, context_len)


def make_anchors(num_rows: int, num_anchors: int, context_len: int, seed: int) -> torch.Tensor:
    """Random anchors [R, A] in [1, context_len) with a duplicate and a padded (0) anchor."""
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randint(1, context_len, (num_rows, num_anchors), generator=generator)
    if num_anchors > 1:
        anchors[:, 1] = anchors[:, 0]
        anchors[-1, -1] = 0
    return anchors


def tile_sets(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Dense tiles [R, H, rows, cols] bool from flex's (num_blocks, indices): the per-row index sets."""
    used = torch.arange(indices.shape[-1]) < num_blocks[..., None]
    dense = torch.zeros(*indices.shape[:-1], indices.shape[-1] + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(used, indices.long(), indices.shape[-1]), True)
    return dense[..., :-1]


def assert_ordered_like(mask: BlockMask, ref: BlockMask, prefix: str) -> None:
    """Same int32 counts and index sets as ``ref``; used indices ascending, unused ones still valid."""
    num, idx = getattr(mask, f"{prefix}_num_blocks"), getattr(mask, f"{prefix}_indices")
    ref_num, ref_idx = getattr(ref, f"{prefix}_num_blocks"), getattr(ref, f"{prefix}_indices")
    assert num.dtype == idx.dtype == torch.int32
    assert num.shape == ref_num.shape and idx.shape == ref_idx.shape
    assert torch.equal(num, ref_num)
    assert torch.equal(tile_sets(num, idx), tile_sets(ref_num, ref_idx))
    assert ((idx >= 0) & (idx < idx.shape[-1])).all()
    used = torch.arange(idx.shape[-1] - 1) + 1 < num[..., None]
    assert (idx[..., 1:] > idx[..., :-1])[used].all()  # ascending within a tile row


@pytest.mark.parametrize("block_size", [3, 8, 16])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_analytic_block_mask_equals_create_block_mask(spec: LayerMaskSpec, block_size: int) -> None:
    for seed, (num_rows, num_anchors, context_len) in enumerate(SHAPES):
        anchors = make_anchors(num_rows, num_anchors, context_len, seed)
        mask = build_flex_block_mask(anchors, context_len, block_size, spec)
        ref = build_flex_block_mask(anchors, context_len, block_size, spec, method="create_block_mask")
        assert mask.seq_lengths == ref.seq_lengths and mask.BLOCK_SIZE == ref.BLOCK_SIZE
        for prefix in ("kv", "full_kv", "q", "full_q"):
            assert_ordered_like(mask, ref, prefix)
        assert torch.equal(mask.to_dense(), ref.to_dense())


@pytest.mark.parametrize(("block_size", "context_len"), [(16, 300), (300, 200)])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_analytic_block_mask_at_every_anchor_position(
    spec: LayerMaskSpec, block_size: int, context_len: int
) -> None:
    """One row per anchor position: every window edge meets every tile boundary. A block over 128
    tokens makes block-token tiles full, the only case where the block's causality shows in tiles."""
    anchors = torch.arange(context_len)[:, None]  # [R = context_len, A = 1]
    mask = build_flex_block_mask(anchors, context_len, block_size, spec)
    ref = build_flex_block_mask(anchors, context_len, block_size, spec, method="create_block_mask")
    for prefix in ("kv", "full_kv"):
        assert_ordered_like(mask, ref, prefix)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_flex_with_analytic_mask_matches_dense_rule(spec: LayerMaskSpec) -> None:
    num_rows, num_anchors, block_size, context_len, heads, dim = 2, 20, 8, 300, 2, 8
    anchors = make_anchors(num_rows, num_anchors, context_len, seed=7)
    num_queries = num_anchors * block_size
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(num_rows, heads, num_queries, dim, generator=generator)
    k = torch.randn(num_rows, heads, context_len + num_queries, dim, generator=generator)
    v = torch.randn(num_rows, heads, context_len + num_queries, dim, generator=generator)

    q_idx = torch.arange(num_queries)[:, None]
    kv_idx = torch.arange(context_len + num_queries)
    block_idx = kv_idx - context_len
    keep = visible(
        spec,
        anchor=anchors[:, q_idx // block_size],  # [R, Q, 1]
        q_slot=q_idx // block_size,
        q_k=q_idx % block_size,
        is_context=kv_idx < context_len,
        ctx_pos=kv_idx,
        kv_slot=block_idx // block_size,
        kv_k=block_idx % block_size,
    )[:, None]  # [R, 1, Q, KV]
    scores = (q @ k.transpose(-1, -2) / dim**0.5).masked_fill(~keep, float("-inf"))
    expected = scores.softmax(dim=-1) @ v

    mask = build_flex_block_mask(anchors, context_len, block_size, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is not compiled
        out = flex_attention(q, k, v, block_mask=mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_unknown_method_is_rejected() -> None:
    with pytest.raises(ValueError, match="not one of"):
        build_flex_block_mask(torch.zeros(1, 1, dtype=torch.long), 4, 4, SPECS[0], method="dense")


@pytest.mark.gpu
def test_analytic_block_mask_on_cuda_without_host_sync() -> None:
    spec = LayerMaskSpec(window=64, causal=True)
    anchors = make_anchors(2, 64, 1000, seed=0).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = build_flex_block_mask(anchors, 1000, 16, spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = build_flex_block_mask(anchors, 1000, 16, spec, method="create_block_mask")
    assert torch.equal(mask.to_dense(), ref.to_dense())
