"""Training and inference attention for DFlash blocks: flex BlockMask and chunked SDPA, same semantics.

One visibility rule (DESIGN.md section 1), written once in ``visible`` and used by every backend.
A block token at block position k of anchor a sees
- context features at positions p < a (the anchor's own feature does not exist yet at inference);
  in a sliding layer only p >= a + k - (window - 1);
- tokens of its own block: all B in a full layer, j <= k in a causal sliding layer;
- nothing of any other block;
- in a packed row (several conversations, ``context_start`` given) only context of its own
  conversation: p >= the first position of the anchor's conversation (conversations are
  contiguous, so the document-id test is this one lower bound).
A block token always sees itself, so no softmax row is ever fully masked (padded anchors stay finite).
The flex BlockMask's 128 x 128 tiles are classified from the same rule read as key intervals per
query (``flex_tile_visibility``), not by evaluating it on every query-key pair.

Every backend is a callable ``attend(q, k_ctx, v_ctx, k_blk, v_blk) -> out`` with
q [R, Hq, A*B, D], k_ctx/v_ctx [R, Hkv, P, D] (context positions 0..P-1, already normed and roped),
k_blk/v_blk [R, Hkv, A*B, D], out [R, Hq, A*B, D]. Query/block index i is anchor i // B, block
position i % B. Flex attention's KV index space is [P context ; A*B block tokens].

Shapes: R rows, L sequence, A anchors, B block size, P cached context length, Hq/Hkv query/kv heads,
D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


@functools.cache
def compiled_flex_attention() -> Callable:
    """flex_attention compiled once per process (dynamic=False), used only for CUDA tensors.

    Eager flex materialises the full score matrix: fine for CPU tests, far too slow for training.
    Created on first use so importing this module does not pull in the compiler.
    """
    return torch.compile(flex_attention, dynamic=False)


AttendFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class LayerMaskSpec:
    """What a layer's visibility depends on: its context window and whether its block is causal."""

    window: int | None  # sliding window for the context (None = full attention)
    causal: bool  # block token k sees block tokens j <= k only

    @classmethod
    def for_layer(cls, layer_type: str, sliding_window: int | None, is_causal: bool) -> LayerMaskSpec:
        """The spec of a ``full_attention`` or ``sliding_attention`` layer."""
        if layer_type == "sliding_attention":
            return cls(window=sliding_window, causal=is_causal)
        return cls(window=None, causal=False)


def visible(
    spec: LayerMaskSpec,
    anchor: Tensor,
    q_slot: Tensor,
    q_k: Tensor,
    is_context: Tensor,
    ctx_pos: Tensor,
    kv_slot: Tensor,
    kv_k: Tensor,
    ctx_start: Tensor | None = None,
) -> Tensor:
    """The DESIGN.md visibility rule on broadcastable index tensors (the one place it is written).

    anchor: the query's anchor position a; q_slot/q_k: the query's anchor index and block position;
    is_context: whether the key is a context feature (at ctx_pos) or a block token (of anchor index
    kv_slot, block position kv_k); ctx_start: the first position of the anchor's conversation
    (packed rows only).
    """
    ctx_ok = is_context & (ctx_pos < anchor)
    if ctx_start is not None:
        ctx_ok = ctx_ok & (ctx_pos >= ctx_start)
    if spec.window is not None:
        ctx_ok = ctx_ok & (ctx_pos >= anchor + q_k - (spec.window - 1))
    block_ok = ~is_context & (kv_slot == q_slot)
    if spec.causal:
        block_ok = block_ok & (kv_k <= q_k)
    return ctx_ok | block_ok


def _repeat_kv(x: Tensor, num_groups: int) -> Tensor:
    """[R, Hkv, T, D] -> [R, Hkv*num_groups, T, D] (GQA as plain heads, so every SDPA kernel applies)."""
    if num_groups == 1:
        return x
    r, h, t, d = x.shape
    return x[:, :, None].expand(r, h, num_groups, t, d).reshape(r, h * num_groups, t, d)


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA with a boolean keep-mask [R|1, 1, Tq, Tk] and GQA by repeating kv heads."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=mask)


# ---------------------------------------------------------------------------------------------
# flex attention


FLEX_TILE = 128  # flex attention's sparse block size, in queries and in keys
FlexMaskMethod = Literal["analytic", "create_block_mask", "create_block_mask_compiled"]


def _flex_mask_mod(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    spec: LayerMaskSpec,
    context_start: Tensor | None = None,
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """``visible`` in flex's (b, h, q_idx, kv_idx) form, over the [P context ; A*B block tokens] keys."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_slot = q_idx // block_size
        block_idx = kv_idx - context_len  # negative for context keys; masked by is_context
        return visible(
            spec,
            anchor=anchors[b, q_slot],
            q_slot=q_slot,
            q_k=q_idx % block_size,
            is_context=kv_idx < context_len,
            ctx_pos=kv_idx,
            kv_slot=block_idx // block_size,
            kv_k=block_idx % block_size,
            ctx_start=None if context_start is None else context_start[b, q_slot],
        )

    return mask_mod


def flex_tile_visibility(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    spec: LayerMaskSpec,
    context_start: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(any, full) [R, nq, nk] bool: whether some / every query of each 128 x 128 tile sees its keys.

    ``visible`` read as intervals of the KV index space: query i (slot s = i // B, block position
    k = i % B, anchor a in [0, P]) sees the context [lo, a) with lo = max(0, a + k -
    (window - 1)) in a sliding layer (else 0), and the block tokens [P + s*B, P + s*B + (k + 1 if
    causal else B)); in a packed row lo is also at least the anchor's ``context_start``. The tiles are classified from these 2 intervals per query, never from the
    Q x KV pairs: O(R * A*B + R * nq * nk) memory and time, static shapes, no host sync.
    - any: the KV tiles [lo // 128, ceil(hi / 128)) of every non-empty interval, marked per Q tile
      in a difference array (+1 at the first tile, -1 past the last) whose running sum is > 0.
    - full: the tile is 128 x 128 and every query's context interval covers the tile's context
      keys [ks, min(ke, P)) and its block interval the tile's block keys [max(ks, P), ke); over a
      Q tile that is max(lo) <= start and min(hi) >= end. Past Q_LEN / KV_LEN nothing is visible,
      as in ``create_block_mask`` (which pads the dense mask with False), so edge tiles are never
      full: short KV tiles fail the size test, padded queries' empty [0, 0) covers nothing.

    nq = ceil(A*B / 128) query tiles, nk = ceil((P + A*B) / 128) key tiles.
    """
    num_rows, num_anchors = anchors.shape
    num_queries = num_anchors * block_size
    num_keys = context_len + num_queries
    num_q_tiles, num_kv_tiles = -(-num_queries // FLEX_TILE), -(-num_keys // FLEX_TILE)
    device = anchors.device

    q_idx = torch.arange(num_queries, device=device)
    q_slot, q_k = q_idx // block_size, q_idx % block_size
    ctx_hi = anchors.long().repeat_interleave(block_size, dim=1)  # [R, A*B]: the anchor a
    if spec.window is None:
        ctx_lo = torch.zeros_like(ctx_hi)
    else:
        ctx_lo = (ctx_hi + q_k - (spec.window - 1)).clamp(min=0)
    if context_start is not None:
        ctx_lo = torch.maximum(ctx_lo, context_start.long().repeat_interleave(block_size, dim=1))
    blk_lo = (context_len + q_slot * block_size).expand_as(ctx_lo)
    blk_hi = blk_lo + (q_k + 1 if spec.causal else block_size)

    def by_q_tile(x: Tensor) -> Tensor:  # [R, A*B] -> [R, nq, 128], padded queries see [0, 0)
        return F.pad(x, (0, num_q_tiles * FLEX_TILE - num_queries)).unflatten(1, (num_q_tiles, FLEX_TILE))

    lo = torch.stack([by_q_tile(ctx_lo), by_q_tile(blk_lo)], dim=2)  # [R, nq, 2 (context, block), 128]
    hi = torch.stack([by_q_tile(ctx_hi), by_q_tile(blk_hi)], dim=2)

    used = (lo < hi).long().flatten(2)  # [R, nq, 2*128]
    diff = torch.zeros(num_rows, num_q_tiles, num_kv_tiles + 1, dtype=torch.long, device=device)
    diff.scatter_add_(2, (lo // FLEX_TILE).flatten(2), used)
    diff.scatter_add_(2, (-(-hi // FLEX_TILE)).flatten(2), -used)
    any_tile = diff.cumsum(dim=2)[..., :num_kv_tiles] > 0

    key_start = torch.arange(0, num_keys, FLEX_TILE, device=device)  # [nk]
    key_end = (key_start + FLEX_TILE).clamp(max=num_keys)
    need_lo = torch.stack([key_start, key_start.clamp(min=context_len)])  # [2, nk]: context, block keys
    need_hi = torch.stack([key_end.clamp(max=context_len), key_end])
    covered = (need_lo >= need_hi) | (  # [R, nq, 2, nk]
        (lo.amax(dim=3, keepdim=True) <= need_lo) & (hi.amin(dim=3, keepdim=True) >= need_hi)
    )
    full_tile = covered.all(dim=2) & (key_end - key_start == FLEX_TILE)
    return any_tile, full_tile


def _ordered_tiles(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """[R, nq, nk] bool -> flex's (num_blocks [R, 1, nq], indices [R, 1, nq, nk]) int32.

    Set tiles first in ascending order, then the unset ones (valid but unused), as
    ``create_block_mask`` orders them (a stable descending argsort of the dense tile mask).
    """
    num_blocks = tiles.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(~tiles, dim=-1, stable=True).to(torch.int32)
    return num_blocks[:, None], indices[:, None]


def build_flex_block_mask(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    spec: LayerMaskSpec,
    *,
    method: FlexMaskMethod = "analytic",
    context_start: Tensor | None = None,
) -> BlockMask:
    """BlockMask over [A*B block queries] x [context_len context ; A*B block tokens] for anchors [R, A].

    Built once per micro-batch and layer type, shared by all layers of that type. B=R, H=None
    (broadcast over heads); ``mask_mod`` is ``visible`` and runs on the partial tiles.
    ``"analytic"`` (default) classifies the tiles with ``flex_tile_visibility``: a few small tensor
    ops, no compilation and no host sync. ``create_block_mask`` evaluates the rule on all Q x KV
    pairs instead: 7 + 5 ms per micro-batch on an H200 at 4,096 tokens and 512 anchors x 16
    (full + sliding layer) uncompiled, and 0.33 ms compiled but after 234 s of first compilation
    (DESIGN.md section 4). It stays as the reference (``"create_block_mask"``, and
    ``"create_block_mask_compiled"``); all three give the same BlockMask. ``context_start`` [R, A]
    (packed rows) is the first position of each anchor's conversation.
    """
    num_queries = anchors.shape[1] * block_size
    mask_mod = _flex_mask_mod(anchors, context_len, block_size, spec, context_start)
    if method == "analytic":
        any_tile, full_tile = flex_tile_visibility(anchors, context_len, block_size, spec, context_start)
        return BlockMask.from_kv_blocks(
            *_ordered_tiles(any_tile & ~full_tile),
            *_ordered_tiles(full_tile),
            BLOCK_SIZE=FLEX_TILE,
            mask_mod=mask_mod,
            seq_lengths=(num_queries, context_len + num_queries),
        )
    if method in ("create_block_mask", "create_block_mask_compiled"):
        return create_block_mask(
            mask_mod,
            B=anchors.shape[0],
            H=None,
            Q_LEN=num_queries,
            KV_LEN=context_len + num_queries,
            device=anchors.device,
            BLOCK_SIZE=FLEX_TILE,
            _compile=method == "create_block_mask_compiled",
        )
    raise ValueError(f"BlockMask method {method!r} is not one of {get_args(FlexMaskMethod)}.")


class FlexBlockAttention:
    """Training attention through flex_attention with a prebuilt BlockMask (compiled on CUDA)."""

    def __init__(self, block_mask: BlockMask) -> None:
        self.block_mask = block_mask

    def __call__(self, q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor) -> Tensor:
        k = torch.cat([k_ctx, k_blk], dim=2)  # [R, Hkv, P + A*B, D]
        v = torch.cat([v_ctx, v_blk], dim=2)
        attention = compiled_flex_attention() if q.is_cuda else flex_attention
        return attention(q, k, v, block_mask=self.block_mask, enable_gqa=q.shape[1] != k.shape[1])


# ---------------------------------------------------------------------------------------------
# chunked SDPA


def sdpa_context_bounds(
    anchors: Tensor, context_len: int, chunk: int, window: int | None, *, quantum: int = 128
) -> list[tuple[int, int]]:
    """Per anchor chunk, the context range [lo, hi) any of its queries can see, over all rows.

    hi = max anchor of the chunk (keys at p >= a are never visible); for a sliding layer also
    lo = min anchor - (window - 1). Rounded outwards to ``quantum``: a compiled layer then sees few
    distinct shapes, and the key length stays a multiple of 128 (chunk*B is one too), which keeps
    CUDA's memory-efficient SDPA kernel eligible for the masked call. One host sync for the whole
    forward (shared by all layers); under torch.compile tracing the full range is used instead,
    keeping shapes static and the graph sync-free.
    """
    num_anchors = anchors.shape[1]
    starts = range(0, num_anchors, chunk)
    if torch.compiler.is_compiling():
        return [(0, context_len)] * len(starts)
    chunks = [anchors[:, s : s + chunk] for s in starts]
    # One transfer for all chunks: the only host sync of the SDPA path.
    stats = torch.stack([torch.stack([c.min(), c.max()]) for c in chunks]).tolist()
    bounds = []
    for lo_anchor, hi_anchor in stats:
        hi = min(context_len, -(-hi_anchor // quantum) * quantum)
        lo = 0 if window is None else max(0, (lo_anchor - (window - 1)) // quantum * quantum)
        bounds.append((min(lo, hi), hi))
    return bounds


class ChunkedSdpaAttention:
    """Training attention as SDPA over chunks of anchors with an explicit boolean mask.

    Each chunk's queries (its blocks' tokens) attend to the context plus the chunk's own block
    tokens, so the dense score matrix is chunk x (context + chunk), never A*B x (L + A*B). Works
    under activation checkpointing and torch.compile (pure tensor ops).

    ``trim_context=True`` cuts each chunk's context to [lo, hi) of ``sdpa_context_bounds`` (keys
    past the chunk's last anchor or before its window are masked anyway): ~1/3 fewer attention
    FLOPs, at the price of one host sync per forward and key lengths that change with every
    micro-batch, which would recompile a compiled layer (dynamic=False) on every new batch. So the
    default keeps the full context: fixed shapes, no sync, as DESIGN.md asks of the train step.
    """

    def __init__(
        self,
        anchors: Tensor,
        context_len: int,
        block_size: int,
        spec: LayerMaskSpec,
        chunk: int,
        *,
        trim_context: bool = False,
        context_quantum: int = 128,
        context_start: Tensor | None = None,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"sdpa_anchor_chunk={chunk} must be >= 1.")
        self.anchors = anchors
        self.context_start = context_start  # [R, A], packed rows only
        self.block_size = block_size
        self.spec = spec
        self.chunk = chunk
        if trim_context:
            self.bounds = sdpa_context_bounds(
                anchors, context_len, chunk, spec.window, quantum=context_quantum
            )
        else:
            self.bounds = [(0, context_len)] * len(range(0, anchors.shape[1], chunk))
        # Built once per forward and reused by every layer of this type (and by recomputation).
        self.masks = [self.chunk_mask(i * chunk, lo, hi) for i, (lo, hi) in enumerate(self.bounds)]

    def chunk_mask(self, start: int, lo: int, hi: int) -> Tensor:
        """Keep-mask [R, 1, n*B, (hi - lo) + n*B] for anchors start..start+n-1, context [lo, hi)."""
        anchors = self.anchors[:, start : start + self.chunk]  # [R, n]
        device, size = anchors.device, self.block_size
        ctx_start = None
        if self.context_start is not None:
            ctx_start = self.context_start[:, start : start + self.chunk].repeat_interleave(size, dim=1)[
                ..., None
            ]
        q_idx = torch.arange(anchors.shape[1] * size, device=device)
        q_slot, q_k = q_idx // size, q_idx % size
        ctx_pos = torch.arange(lo, hi, device=device)
        kv_slot = torch.cat([torch.full_like(ctx_pos, -1), q_slot])
        kv_k = torch.cat([torch.zeros_like(ctx_pos), q_k])
        pos = torch.cat([ctx_pos, torch.zeros_like(q_idx)])
        is_context = torch.arange(pos.numel(), device=device) < ctx_pos.numel()
        mask = visible(
            self.spec,
            anchor=anchors.repeat_interleave(size, dim=1)[..., None],  # [R, n*B, 1]
            q_slot=q_slot[:, None],
            q_k=q_k[:, None],
            is_context=is_context,
            ctx_pos=pos,
            kv_slot=kv_slot,
            kv_k=kv_k,
            ctx_start=ctx_start,
        )
        return mask[:, None]

    def __call__(self, q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor) -> Tensor:
        outputs = []
        span = self.chunk * self.block_size
        for index, (lo, hi) in enumerate(self.bounds):
            start = index * self.chunk
            tokens = slice(start * self.block_size, start * self.block_size + span)
            k = torch.cat([k_ctx[:, :, lo:hi], k_blk[:, :, tokens]], dim=2)
            v = torch.cat([v_ctx[:, :, lo:hi], v_blk[:, :, tokens]], dim=2)
            outputs.append(masked_sdpa(q[:, :, tokens], k, v, self.masks[index]))
        return torch.cat(outputs, dim=2)


def build_train_attention(
    backend: str,
    anchors: Tensor,
    context_len: int,
    block_size: int,
    specs: dict[str, LayerMaskSpec],
    *,
    sdpa_anchor_chunk: int = 64,
    sdpa_trim_context: bool = False,
    context_start: Tensor | None = None,
) -> dict[str, AttendFn]:
    """One attention callable per layer type, built once per forward and shared by its layers.

    ``context_start`` [R, A] (packed rows): the first position of each anchor's conversation."""
    if backend == "flex":
        return {
            name: FlexBlockAttention(
                build_flex_block_mask(anchors, context_len, block_size, spec, context_start=context_start)
            )
            for name, spec in specs.items()
        }
    if backend == "sdpa":
        return {
            name: ChunkedSdpaAttention(
                anchors,
                context_len,
                block_size,
                spec,
                sdpa_anchor_chunk,
                trim_context=sdpa_trim_context,
                context_start=context_start,
            )
            for name, spec in specs.items()
        }
    raise ValueError(f"attention backend {backend!r} is not one of 'sdpa', 'flex'.")


# ---------------------------------------------------------------------------------------------
# inference


class CachedBlockAttention:
    """Inference attention: one block at positions start..start+B-1 over a context cache of length start."""

    def __init__(self, start: int, block_size: int, spec: LayerMaskSpec, device: torch.device) -> None:
        k = torch.arange(block_size, device=device)
        ctx_pos = torch.arange(start, device=device)
        self.mask = visible(
            spec,
            anchor=torch.tensor(start, device=device),
            q_slot=torch.zeros(1, device=device, dtype=torch.long),
            q_k=k[:, None],
            is_context=torch.arange(start + block_size, device=device) < start,
            ctx_pos=torch.cat([ctx_pos, torch.zeros_like(k)]),
            kv_slot=torch.cat([torch.full_like(ctx_pos, -1), torch.zeros_like(k)]),
            kv_k=torch.cat([torch.zeros_like(ctx_pos), k]),
        )[None, None]  # [1, 1, B, start + B]

    def __call__(self, q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor) -> Tensor:
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        return masked_sdpa(q, k, v, self.mask)
