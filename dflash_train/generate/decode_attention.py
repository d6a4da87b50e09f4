"""Attention of one decode token per slot over that slot's cache: GQA-native, no cache copies.

transformers' sdpa path, given the slot cache's 4D mask, expands K and V from the key/value heads to
the query heads (``repeat_kv``): every layer copied every slot's whole attended cache every step,
73% of the slot engine's GPU time on one H200. The two kernels here read the cache where it lies,
[S, Hkv, C, D], and group the query heads of each key/value head instead (query head h reads
key/value head h // G, transformers' convention):

- ``grouped`` (the default without a compiled step: CPU, hybrid targets, a forced-eager stance): two
  batched matmuls over the attended indices (the engine's bucket, a multiple of 256 above the longest
  running row) with an additive mask [S, 1, 1, kv]. cuBLAS reads the bucket at near copy bandwidth.
  In bf16 the scores are rounded to bf16 before the fp32 softmax (sdpa keeps them in fp32); on
  SmolLM2-135M every resulting difference from the flex kernel's replies was a tie by the eval's
  verdict (docs/performance.md).
- ``flex`` (the default on CUDA for attention-only targets): PyTorch's FlexAttention with a
  ``BlockMask`` built from the slots' positions: slot r lists only the cache blocks up to its
  position, so the decoding kernel reads the blocks the slot really holds, whatever the capacity or
  the other slots' lengths. Compiled on CUDA (the flex decoding kernel, GQA heads packed per
  key/value head); uncompiled elsewhere (slow, for tests).
  Inductor lowers it to its split-KV decoding kernel only when the query heads per key/value head
  are a power of two (``flex_decoding._use_flex_decoding``); other groups (SmolLM2-135M's 3, the
  Qwen3.6-27B shape's 6) fell back to the general kernel, one 16-row query block per query head. So
  the group is padded with zero query heads to the next power of two, whose outputs are dropped.
  Measured on one H200 before that padding, it was slower than ``grouped`` at chat lengths
  (SmolLM2-135M, 1,024 slots: 11.3 vs 7.6 ms per step; the Qwen3.6-27B shape: equal). With it, and
  inside the compiled step, it is the faster (one H100: 632 vs 474 rows/s; per layer 0.08-0.21 ms
  against 0.09-0.32 ms at 256-1,024 cache indices), so it is the default where the step compiles.

Both are one function registered with transformers' attention interface (``SLOT_DECODE``) that
dispatches on the mask it is handed; the engine switches a model to it for its decode steps only
(``decoding_with``), prefill keeps the model's own implementation.

Shapes: S slots, Hq query heads, Hkv key/value heads, G = Hq / Hkv, C capacity, D head dim.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

from dflash_train.generate.compiled_step import eager_forced

SLOT_DECODE = "dflash_slot_decode"
DECODE_ATTENTIONS = ("flex", "grouped")
FLEX_BLOCK = 128  # cache indices per BlockMask block (FlexAttention's default block size)


def decode_attention_choice(value: str) -> str | None:
    """``SlotEngine(decode_attention=)`` for a ``--decode-attention`` value (auto = the engine's default)."""
    if value != "auto" and value not in DECODE_ATTENTIONS:
        raise ValueError(f"--decode-attention {value!r}: use auto, {' or '.join(DECODE_ATTENTIONS)}")
    return None if value == "auto" else value


def default_decode_attention(device: torch.device, hybrid: bool) -> str:
    """flex on CUDA for attention-only targets, whose decode step is compiled there: with the padded
    groups, the compiled step with flex ran 632 rows/s against grouped's 474 (SmolLM2-135M's shape,
    1,024 slots, 256 new tokens, one H100; docs/performance.md, "Flex padded, in the compiled step").
    grouped elsewhere: hybrid targets keep the eager step, where flex was the slower (module docstring),
    on a CPU flex runs uncompiled, and under a forced-eager stance flex would run uncompiled on CUDA
    too (``check_flex_compiles``)."""
    return "flex" if device.type == "cuda" and not hybrid and not eager_forced() else "grouped"


def check_flex_compiles(decode_attention: str, device: torch.device, use_cuda_graphs: bool) -> None:
    """Refuse flex in CUDA graphs under ``torch.compiler.set_stance("force_eager")``: FlexAttention's
    compiled kernel then runs uncompiled, as torch's unfused reference (``_math_attention_inner`` in
    torch/_higher_order_ops/flex_attention.py), which builds ``torch.tensor(-inf, device=cuda)``, a
    copy from unpinned host memory, in every call: a capture of the step fails on it ("Cannot copy
    between CPU and CUDA tensors during CUDA graph capture"). Such callers take grouped (the
    default there)."""
    if decode_attention == "flex" and device.type == "cuda" and use_cuda_graphs and eager_forced():
        raise ValueError(
            "decode_attention='flex' cannot be captured into CUDA graphs under "
            "torch.compiler.set_stance('force_eager') (uncompiled, FlexAttention copies a host scalar to "
            "the device in every call): use decode_attention='grouped', or leave the stance"
        )


def slot_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [S, Hq, 1, D] queries -> ([S, 1, Hq, D], None)."""
    assert query.shape[2] == 1, "the slot decode attention takes one query token per slot"
    assert dropout == 0.0 and kwargs.get("sliding_window") is None, "decode only, full attention only"
    if isinstance(attention_mask, BlockMask):
        out = flex_decode(query, key, value, attention_mask, scaling)
    elif isinstance(attention_mask, torch.Tensor):
        out = grouped_attention(query, key, value, attention_mask, scaling)
    else:
        raise TypeError("the slot decode attention needs the engine's mask (a BlockMask or a 4D bias)")
    return out.transpose(1, 2), None


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Softmax attention with the G query heads of a key/value head batched on it: [S, Hq, 1, D]."""
    slots, num_heads, _, head_dim = query.shape
    groups = key.shape[1]
    scale = head_dim**-0.5 if scaling is None else scaling
    grouped = query.view(slots, groups, num_heads // groups, head_dim)  # [S, Hkv, G, D]
    # key is a view of the slot storage; merging S and Hkv keeps it a view (no copy for the bmm).
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scale  # [S, Hkv, G, kv]
    probs = torch.softmax(scores + bias.float(), dim=-1).to(value.dtype)
    return torch.matmul(probs, value).view(slots, num_heads, 1, head_dim)


def flex_decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, scaling: float | None
) -> torch.Tensor:
    """FlexAttention over each slot's live blocks, the query heads of a key/value head padded with
    zeros to a power of two (the condition of inductor's decoding kernel): [S, Hq, 1, D]."""
    slots, num_heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = num_heads // kv_heads
    padded = padded_group(groups)
    if padded != groups:
        grouped = query.view(slots, kv_heads, groups, head_dim)
        query = F.pad(grouped, (0, 0, 0, padded - groups)).view(slots, kv_heads * padded, 1, head_dim)
    scale = head_dim**-0.5 if scaling is None else scaling
    out = flex_kernel(query.device.type)(
        query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True
    )
    if padded == groups:
        return out
    return out.view(slots, kv_heads, padded, head_dim)[:, :, :groups].reshape(slots, num_heads, 1, head_dim)


def padded_group(groups: int) -> int:
    """The power of two at or above ``groups`` query heads per key/value head."""
    return 1 << (groups - 1).bit_length()


@functools.cache
def flex_kernel(device_type: str):
    """FlexAttention, compiled on CUDA (one compilation per shape, reused by every captured graph)."""
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


class LiveBlockMask:
    """Builds, each step, the BlockMask that shows slot r its cache indices 0..positions[r].

    ``positions`` is the engine's own buffer (refilled in place), so the mask function reads live
    values in eager steps and in every replay of a captured graph. Only tensor ops, no host sync.
    """

    def __init__(self, positions: torch.Tensor, capacity: int):
        if capacity % FLEX_BLOCK:
            raise ValueError(
                f"flex decode needs a capacity that is a multiple of {FLEX_BLOCK}, got {capacity}"
            )
        self.positions, self.capacity = positions, capacity
        num_slots, num_blocks = positions.shape[0], capacity // FLEX_BLOCK
        # Block b of every slot is block b of the cache: the same list for all, materialised (the
        # kernels index the block tables as dense [S, 1, 1, blocks] tensors) and owned here, so a
        # captured graph's replays read it where it was.
        blocks = torch.arange(num_blocks, dtype=torch.int32, device=positions.device)
        self.kv_indices = blocks.repeat(num_slots, 1).view(num_slots, 1, 1, num_blocks).contiguous()
        self.extra = {"compute_q_blocks": False} if "compute_q_blocks" in FROM_KV_BLOCKS_PARAMETERS else {}

    def mask_mod(self, batch, head, q_index, kv_index):
        return kv_index <= self.positions[batch]

    def build(self) -> BlockMask:
        kv_num_blocks = (self.positions // FLEX_BLOCK + 1).to(torch.int32)[:, None, None]  # [S, 1, 1]
        return BlockMask.from_kv_blocks(
            kv_num_blocks.contiguous(),
            self.kv_indices,
            BLOCK_SIZE=FLEX_BLOCK,
            mask_mod=self.mask_mod,
            seq_lengths=(1, self.capacity),
            **self.extra,
        )


FROM_KV_BLOCKS_PARAMETERS = set(inspect.signature(BlockMask.from_kv_blocks).parameters)


@functools.cache
def register() -> None:
    """Make ``SLOT_DECODE`` a name transformers' attention layers resolve (once per process)."""
    AttentionInterface.register(SLOT_DECODE, slot_decode_attention)


@contextlib.contextmanager
def decoding_with(model: torch.nn.Module):
    """Inside: the model's attention layers call ``slot_decode_attention``; the old name is restored."""
    register()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = SLOT_DECODE
    try:
        yield
    finally:
        config._attn_implementation = previous
