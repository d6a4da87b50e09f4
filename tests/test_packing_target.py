"""Packed rows through the frozen target: every conversation's features as if it ran alone.

Golden test of issue "Packing": the features of a packed row equal the features of each of its
conversations run alone, for the Qwen3 (pure attention, packed mask from position ids) and the
Qwen3.5 hybrid (GatedDeltaNet: per-conversation reference on CPU, fla varlen kernels on CUDA).
"""

from __future__ import annotations

import os

import pytest
import torch

from dflash_train.data.batching import assemble_packed_batch
from dflash_train.models.target import FrozenTarget
from dflash_train.tiny import build_tiny_target

LENGTHS = [[9, 14, 5], [20, 7], [3]]  # conversations per packed row
ROW_LENGTH = 32


def packed_batch(vocab: int = 300, seed: int = 0):
    """A packed batch of random conversations and the conversations themselves."""
    g = torch.Generator().manual_seed(seed)
    rows, indices, conversations = [], [], []
    for r, lengths in enumerate(LENGTHS):
        row = []
        for c, n in enumerate(lengths):
            ids = torch.randint(0, vocab, (n,), generator=g).numpy()
            row.append((ids, ids >= 0))
            conversations.append((r, sum(lengths[:c]), ids))
        rows.append(row)
        indices.append([10 * r + c for c in range(len(lengths))])
    return assemble_packed_batch(rows, indices, len(LENGTHS), ROW_LENGTH, pad_id=0), conversations


def check_packed_equals_alone(
    target: FrozenTarget, device: str = "cpu", atol: float = 1e-5, rtol: float = 1e-4
) -> None:
    batch, conversations = packed_batch()
    ids, positions = batch.input_ids.to(device), batch.position_ids.to(device)
    packed, packed_final = target.features(ids, position_ids=positions, with_final_hidden=True)
    unpacked_row = target.features(ids)  # the same rows without packing: boundaries crossed
    crossed = False
    for row, start, conv in conversations:
        alone, alone_final = target.features(
            torch.as_tensor(conv, device=device)[None], with_final_hidden=True
        )
        span = slice(start, start + len(conv))
        torch.testing.assert_close(packed[row, span], alone[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(packed_final[row, span], alone_final[0], atol=atol, rtol=rtol)
        crossed |= start > 0 and not torch.allclose(unpacked_row[row, span], alone[0], atol=1e-3)
    assert crossed, "without position ids the later conversations must differ (the test can fail)"


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_packed_features_equal_each_conversation_alone(kind):
    model = build_tiny_target(kind, vocab_size=320)
    check_packed_equals_alone(FrozenTarget(model, None, [0, 1, 2]))


def test_hybrid_on_torch_fallback_runs_each_conversation_alone(monkeypatch):
    """The torch GatedDeltaNet fallback ignores cu_seqlens, so the CPU path must never use varlen."""
    import dflash_train.models.target as target_module

    model = build_tiny_target("hybrid", vocab_size=320)
    target = FrozenTarget(model, None, [0, 2])
    assert target.kernels["chunk_gated_delta_rule"] == "torch"
    monkeypatch.setattr(
        target_module, "varlen_features", lambda *a, **k: pytest.fail("varlen path on the torch fallback")
    )
    batch, _ = packed_batch()
    target.features(batch.input_ids, position_ids=batch.position_ids)


def test_packed_rows_refuse_an_attention_mask():
    target = FrozenTarget(build_tiny_target("qwen3", vocab_size=320), None, [0, 2])
    batch, _ = packed_batch()
    with pytest.raises(ValueError, match="without an attention_mask"):
        target.features(batch.input_ids, batch.attention_mask, position_ids=batch.position_ids)


@pytest.mark.gpu
def test_packed_features_on_cuda_with_fla_varlen():
    """On CUDA with fla bound, the hybrid runs the varlen kernels and still matches each conversation."""
    pytest.importorskip("fla")
    from dflash_train.models.target_kernels import bind_fla_causal_conv, bound_kernels

    model = build_tiny_target("hybrid", vocab_size=320).to("cuda")
    assert bind_fla_causal_conv(model, "cuda")
    target = FrozenTarget(model, None, [0, 1, 2], kernels=bound_kernels(model))
    assert target.kernels["chunk_gated_delta_rule"] == "fla" and target.kernels["causal_conv1d_fn"] == "fla"
    calls = []
    import dflash_train.models.target as target_module

    original = target_module.varlen_features
    target_module.varlen_features = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        check_packed_equals_alone(target, device="cuda", atol=5e-3, rtol=5e-3)  # fla: tf32 dots
    finally:
        target_module.varlen_features = original
    assert calls, "the varlen path was not used"


def test_remote_code_targets_are_refused(monkeypatch):
    model = build_tiny_target("qwen3", vocab_size=320)
    target = FrozenTarget(model, None, [0, 2])
    monkeypatch.setattr(type(model), "__module__", "transformers_modules.someone.modeling_custom")
    batch, _ = packed_batch()
    with pytest.raises(ValueError, match="could cross conversations"):
        target.features(batch.input_ids, position_ids=batch.position_ids)


@pytest.mark.real
@pytest.mark.skipif(
    not os.environ.get("DFLASH_REAL_TARGET"), reason="set DFLASH_REAL_TARGET to the real target"
)
def test_real_llama_target_packed_features_equal_each_conversation_alone():
    """SmolLM2-135M (Llama arch, sdpa): the packed mask from position ids on real weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.environ["DFLASH_REAL_TARGET"], dtype=torch.float32)
    # Summation order differs in a few of its very large activations: 1e-3 relative.
    check_packed_equals_alone(FrozenTarget(model, None, [1, 8, 15, 22, 28]), atol=1e-3, rtol=1e-3)
