"""Decode-attention timing for ``dflash-train bench generation --attention-shapes``: one layer's
attention of one token per slot over the slot cache, per SLOTSxKV shape, for the kernels the decode
step could run (the question of "attention over what slots hold"):

- ``grouped``: the engine's default without a compiled step
  (``generate.decode_attention.grouped_attention``), eager;
- ``grouped_compiled``: the same function under ``torch.compile``, as the compiled decode step runs it;
- ``flex``: FlexAttention over each slot's live blocks (``LiveBlockMask``), compiled on CUDA, as the
  engine calls it (``flex_decode``: query heads per key/value head padded to a power of two);
- ``flex_unpadded``: the same without the padding (the general kernel where the group is not a power
  of two);
- ``sdpa_gqa``: ``scaled_dot_product_attention(..., enable_gqa=True)`` with the same additive bias.

The cache is laid out as the engine's ([S, Hkv, C + 1, D], attended through a view of its first KV
indices), the head layout is the model's, and the slots' live lengths are spread evenly over
(KV/4, KV], as ragged as regen's rows. On CUDA each kernel is timed as the decode step runs it: two
eager warm-ups on a side stream, then captured in a CUDA graph and replayed between CUDA events; on CPU
(dry runs) eagerly. Each record also holds the bytes a kernel must read (the bucket's K/V, and the live
tokens' K/V, the floor of a kernel that follows live lengths) and each kernel's largest difference from
an fp32 reference.

Shapes: S slots, Hq query heads, Hkv key/value heads, C capacity, KV attended indices, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash_train.bench.timing import time_graphed
from dflash_train.generate.decode_attention import (
    FLEX_BLOCK,
    LiveBlockMask,
    flex_decode,
    flex_kernel,
    grouped_attention,
)

ATTENTION_KERNELS = ("grouped", "grouped_compiled", "flex", "flex_unpadded", "sdpa_gqa")


def decode_inputs(slots: int, kv: int, heads: int, kv_heads: int, head_dim: int, dtype, device) -> dict:
    """Query [S, Hq, 1, D], the cache's K/V views [S, Hkv, KV, D], positions [S], the bias [S, 1, 1, KV]."""
    generator = torch.Generator(device=device).manual_seed(0)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    capacity = kv + FLEX_BLOCK  # a spare block past the attended window, as the engine's cache has one
    key_storage = normal(slots, kv_heads, capacity, head_dim)
    value_storage = normal(slots, kv_heads, capacity, head_dim)
    positions = torch.linspace(kv // 4, kv - 1, slots, device=device).long()  # each slot's last index
    hidden = torch.arange(kv, device=device)[None, :] > positions[:, None]  # [S, KV]
    bias = torch.zeros(hidden.shape, dtype=dtype, device=device)
    bias = bias.masked_fill(hidden, torch.finfo(dtype).min)[:, None, None]
    return {
        "query": normal(slots, heads, 1, head_dim),
        "key": key_storage[:, :, :kv],
        "value": value_storage[:, :, :kv],
        "positions": positions,
        "bias": bias,
        "capacity": capacity,
    }


def kernels(inputs: dict) -> dict[str, Callable[[], torch.Tensor]]:
    """Each candidate as a call with no arguments that returns [S, Hq, 1, D]."""
    q, k, v, bias = inputs["query"], inputs["key"], inputs["value"], inputs["bias"]
    live = LiveBlockMask(inputs["positions"], inputs["capacity"])
    # flex reads blocks of the whole storage; its mask hides what lies past each slot's position
    k_all = k.as_strided((*k.shape[:2], inputs["capacity"], k.shape[3]), k.stride())
    v_all = v.as_strided((*v.shape[:2], inputs["capacity"], v.shape[3]), v.stride())
    flex = flex_kernel(q.device.type)
    compiled = torch.compile(grouped_attention) if q.device.type == "cuda" else grouped_attention
    calls = {
        "grouped": lambda: grouped_attention(q, k, v, bias, None),
        "grouped_compiled": lambda: compiled(q, k, v, bias, None),
        "flex": lambda: flex_decode(q, k_all, v_all, live.build(), None),
        "flex_unpadded": lambda: flex(q, k_all, v_all, block_mask=live.build(), enable_gqa=True),
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True),
    }
    assert tuple(calls) == ATTENTION_KERNELS
    return calls


def time_attentions(
    slots: int, kv: int, config, device: torch.device, dtype: torch.dtype, repeats: int = 50
) -> dict:
    """One shape's record: each kernel's time and largest difference from the fp32 reference."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inputs = decode_inputs(slots, kv, heads, kv_heads, head_dim, dtype, device)
    live_tokens = int(inputs["positions"].sum()) + slots  # host sync: a reported count
    token_bytes = 2 * kv_heads * head_dim * inputs["key"].element_size()  # K and V of one index
    record: dict = {
        "slots": slots, "kv": kv, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "dtype": str(dtype).removeprefix("torch."),
        "bucket_mb": round(slots * kv * token_bytes / 1e6, 2),
        "live_mb": round(live_tokens * token_bytes / 1e6, 2),
    }  # fmt: skip
    fp32 = {
        name: t.float() if torch.is_tensor(t) and t.is_floating_point() else t for name, t in inputs.items()
    }
    reference = F.scaled_dot_product_attention(
        fp32["query"], fp32["key"], fp32["value"], attn_mask=fp32["bias"], enable_gqa=True
    )
    for name, call in kernels(inputs).items():
        try:
            timing = time_graphed(call, device, repeats)
            error = (call().float() - reference).abs().max().item()  # host sync: a reported number
        except Exception as exc:  # a kernel this torch cannot build is a result, not the end of the run
            record[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        record |= {
            f"{name}_ms": round(timing["ms"], 4),
            f"{name}_first_call_s": round(timing["first_call_s"], 2),
            f"{name}_max_abs_diff": round(error, 5),
        }
    return record | {"status": "ok"}
