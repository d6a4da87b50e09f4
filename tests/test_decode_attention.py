"""The slot engine's decode attention: equal to a slow reference, no copy of the cache, and
captured graphs that read only the engine's own buffers.

- Both kernels (``flex`` with a BlockMask of each slot's live blocks, ``grouped`` matmuls) equal
  transformers' reference (K/V expanded to the query heads, softmax attention over indices <= each
  slot's position) on random GQA inputs, and the engine on either gives the padded engine's tokens.
- One decode step of a tiny target with a large cache copies a small fraction of the attended K/V
  (transformers' sdpa under a 4D mask expanded K/V to the query heads: a copy of the whole cache).
- A stand-in graph records the tensors a step reads that were allocated outside it; a replay must
  read the same ones (a real CUDA graph replays captured addresses, so a call's own tensors, freed
  when the call ends, would be read after free by the next call's replays).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import repeat_kv

from dflash_train.generate.decode_attention import FLEX_BLOCK, LiveBlockMask, slot_decode_attention
from dflash_train.generate.engine import SlotEngine
from dflash_train.generate.sampling import PaddedEngine, Sampling
from dflash_train.tiny import build_tiny_target, sharpen

pytestmark = pytest.mark.usefixtures("one_thread_module")

GREEDY, SAMPLED = Sampling(), Sampling(temperature=0.7, top_p=0.9, seed=3)


class Heads(torch.nn.Module):
    num_key_value_groups = 3


def reference_attention(query, key, value, positions, groups=3):
    """transformers' eager attention with K/V repeated to the query heads: [S, 1, Hq, D]."""
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = query @ key.transpose(-1, -2) * query.shape[-1] ** -0.5  # [S, Hq, 1, C]
    hidden = torch.arange(key.shape[2], device=key.device)[None, :] > positions[:, None]
    scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ value).transpose(1, 2)


def test_both_kernels_equal_the_reference_on_ragged_lengths():
    torch.manual_seed(0)
    slots, kv_heads, capacity, dim = 5, 2, 2 * FLEX_BLOCK, 16
    query = torch.randn(slots, 3 * kv_heads, 1, dim)
    key, value = torch.randn(2, slots, kv_heads, capacity, dim)
    positions = torch.tensor([0, 5, FLEX_BLOCK - 1, FLEX_BLOCK, capacity - 1])
    want = reference_attention(query, key, value, positions)
    bias = torch.zeros(slots, capacity).masked_fill(
        torch.arange(capacity)[None, :] > positions[:, None], torch.finfo(torch.float32).min
    )[:, None, None]
    grouped, _ = slot_decode_attention(Heads(), query, key, value, bias)
    flex, _ = slot_decode_attention(Heads(), query, key, value, LiveBlockMask(positions, capacity).build())
    torch.testing.assert_close(grouped, want)
    torch.testing.assert_close(flex, want)
    assert grouped.shape == (slots, 1, 3 * kv_heads, dim)


def test_flex_pads_a_group_to_a_power_of_two_and_drops_the_padding(monkeypatch):
    """Inductor's decoding kernel needs a power-of-two group: 3 query heads per key/value head reach
    FlexAttention as 4 (a zero query head), and the result is the reference's 3."""
    from dflash_train.generate import decode_attention

    seen = []

    def recording(device_type):
        def call(query, *args, **kwargs):
            seen.append(query.shape[1])
            return decode_attention.flex_attention(query, *args, **kwargs)

        return call

    monkeypatch.setattr(decode_attention, "flex_kernel", recording)
    torch.manual_seed(0)
    slots, kv_heads, capacity, dim = 3, 2, FLEX_BLOCK, 8
    positions = torch.tensor([0, 7, capacity - 1])
    key, value = torch.randn(2, slots, kv_heads, capacity, dim)
    for groups, flex_heads in ((3, 8), (2, 4), (1, 2)):
        query = torch.randn(slots, groups * kv_heads, 1, dim)
        mask = LiveBlockMask(positions, capacity).build()
        got, _ = slot_decode_attention(Heads(), query, key, value, mask)
        torch.testing.assert_close(got, reference_attention(query, key, value, positions, groups))
        assert seen.pop() == flex_heads


def test_the_live_block_mask_lists_only_each_slots_blocks():
    positions = torch.tensor([0, FLEX_BLOCK, 3 * FLEX_BLOCK - 1])
    mask = LiveBlockMask(positions, 4 * FLEX_BLOCK).build()
    assert mask.kv_num_blocks.flatten().tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="multiple of 128"):
        LiveBlockMask(positions, 100)


def mixed_prompts(vocab_size: int, num_rows: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (num_rows,), generator=gen).tolist()
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def generate(engine, prompts, sampling, max_new_tokens=20, stop_ids=frozenset({7})):
    keys = [100 + i for i in range(len(prompts))]
    return engine.generate(
        prompts, keys, max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=0, sampling=sampling
    )


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
@pytest.mark.parametrize("decode_attention", ["flex", "grouped"])
def test_the_engine_on_either_kernel_gives_the_padded_engines_tokens(kind, decode_attention):
    model = sharpen(build_tiny_target(kind, vocab_size=64, seed=1))
    prompts = mixed_prompts(64, num_rows=7, seed=0)
    engine = SlotEngine(model, num_slots=3, decode_attention=decode_attention)
    for sampling in (GREEDY, SAMPLED):
        assert generate(engine, prompts, sampling) == generate(
            PaddedEngine(model, num_slots=7), prompts, sampling
        )


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="use one of flex, grouped"):
        SlotEngine(build_tiny_target("qwen3", vocab_size=64), num_slots=2, decode_attention="paged")


COPIES = {"copy_", "clone", "_to_copy", "cat", "index", "index_select", "_reshape_copy", "contiguous"}


class CountCopies(TorchDispatchMode):
    """Bytes written by copying ops (K/V expansion shows up as a clone or a copy)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in COPIES:
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    self.bytes += tensor.numel() * tensor.element_size()
        return out


def test_a_decode_step_copies_a_small_fraction_of_the_cache(monkeypatch):
    """Tiny qwen3 target (4 query / 2 key-value heads), 16 slots, 300-token prompts: each decode
    step attends ~16 x 320 cache indices per layer; it must copy < 5% of that K/V."""
    model = build_tiny_target("qwen3", vocab_size=64, seed=1)
    prompts = [list(range(1, 61)) * 5] * 16
    engine = SlotEngine(model, num_slots=16)
    counted = []
    real_decode = engine.decode

    def counting_decode(spec):
        with CountCopies() as counter:
            real_decode(spec)
        attention_layers = [layer for layer in engine.cache.layers if hasattr(layer, "keys")]
        attended = sum(2 * layer.keys[:, :, : spec.kv_length].numel() * 4 for layer in attention_layers)
        counted.append(counter.bytes / attended)

    monkeypatch.setattr(engine, "decode", counting_decode)
    generate(engine, prompts, GREEDY, max_new_tokens=8, stop_ids=frozenset())
    assert counted and max(counted) < 0.05, counted


class RecordReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.made: set[int] = set()
        self.read: set[tuple] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        flat = [t for item in flat for t in (item if isinstance(item, (list, tuple)) else [item])]
        for tensor in flat:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.made:
                self.read.add((tensor.untyped_storage().data_ptr(), tuple(tensor.shape)))
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.made.add(tensor.untyped_storage().data_ptr())
        return out


class ReadRecordingRuntime:
    """A stand-in graph runtime: a capture runs the step once and records the tensors it read that
    it did not allocate (their addresses); a replay runs it again and notes whether it read the same."""

    def __init__(self):
        self.replays: list[bool] = []

    def new_pool(self):
        return object()

    def new_stream(self):
        return object()

    def run_on(self, stream, fn):
        fn()

    def capture(self, fn, pool, stream):
        with RecordReads() as recorder:
            fn()
        return ReadRecordingGraph(self, fn, recorder.read)


class ReadRecordingGraph:
    def __init__(self, runtime, fn, read):
        self.runtime, self.fn, self.read = runtime, fn, read

    def replay(self):
        with RecordReads() as recorder:
            self.fn()
        self.runtime.replays.append(recorder.read == self.read)


def test_captured_graphs_read_only_buffers_that_outlive_the_call():
    model = sharpen(build_tiny_target("hybrid", vocab_size=64, seed=1))
    prompts = mixed_prompts(64, num_rows=5, seed=1)
    runtime = ReadRecordingRuntime()
    engine = SlotEngine(model, num_slots=2, use_cuda_graphs=True, graph_runtime=runtime)
    for _ in range(2):  # the second call replays the first call's graphs
        generate(engine, prompts, SAMPLED, stop_ids=frozenset({7, 9}))
    replays = runtime.replays
    assert replays and all(replays), f"{replays.count(False)} of {len(replays)} replays read other tensors"


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads, groups, dim", [(3, 3, 64), (4, 6, 256)], ids=["smollm2", "qwen3.6-27b"])
def test_compiled_flex_in_bf16_is_close_to_the_reference(kv_heads, groups, dim):
    torch.manual_seed(0)
    slots, capacity = 64, 8 * FLEX_BLOCK
    query = torch.randn(slots, groups * kv_heads, 1, dim, device="cuda")
    key, value = torch.randn(2, slots, kv_heads, capacity, dim, device="cuda")
    positions = torch.randint(0, capacity, (slots,), device="cuda")
    want = reference_attention(query, key, value, positions, groups)
    mask = LiveBlockMask(positions, capacity).build()
    got, _ = slot_decode_attention(Heads(), query.bfloat16(), key.bfloat16(), value.bfloat16(), mask)
    torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_defaults_follow_where_the_step_compiles():
    """flex and a compiled step on CUDA for attention-only targets (measured the faster there), the
    eager grouped step for hybrid targets and on CPU."""
    from dflash_train.generate.compiled_step import default_compile_decode
    from dflash_train.generate.decode_attention import default_decode_attention

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_decode_attention(cuda, hybrid=False) == "flex"
    assert default_compile_decode(cuda, hybrid=False)
    assert default_decode_attention(cuda, hybrid=True) == "grouped"
    assert not default_compile_decode(cuda, hybrid=True)
    assert default_decode_attention(cpu, hybrid=False) == "grouped"
    assert not default_compile_decode(cpu, hybrid=False)
