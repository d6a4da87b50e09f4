"""GPU check of the frozen target at the Qwen3.6-27B width: a 4-layer slice (3 GatedDeltaNet + 1 full).

Builds ``preset:qwen3.6-27b`` truncated to 4 layers in bf16 on the current CUDA device, asserts that
the fla GatedDeltaNet kernels are bound, checks fla features against the PyTorch reference on a short
row and right padding against unpadded rows, then times ``FrozenTarget.features`` at 1x4096 and
1x16384 tokens and checks that after the call only the weights and the returned features stay
allocated. Prints a table and, last, one JSON line.

    python scripts/gpu_check_target.py [--lengths 4096 16384] [--iters 5]

The first call at each length includes Triton compilation/autotuning of the fla kernels (warm-up,
not timed); the whole script needs well under a minute of GPU time once compiled kernels are cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from dflash_train.config import TargetConfig
from dflash_train.models.target import FrozenTarget, load_target
from dflash_train.models.target_kernels import gated_delta_net_layers

MiB = 2**20
# Leftover allowed after features() beyond weights + features: rotary/mask caches, allocator rounding.
LEFTOVER_LIMIT = 64 * MiB


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fla_vs_torch_reference(target: FrozenTarget, length: int) -> float:
    """Relative error of the features with fla's chunk kernel against transformers' torch reference."""
    modeling = sys.modules[type(gated_delta_net_layers(target.model)[0]).__module__]
    wrapped = modeling.torch_chunk_gated_delta_rule
    ids = torch.randint(0, target.vocab_size, (1, length), device=target.device)
    fast = target.features(ids)
    modeling.torch_chunk_gated_delta_rule = wrapped.__wrapped__  # the reference implementation
    try:
        reference = target.features(ids)
    finally:
        modeling.torch_chunk_gated_delta_rule = wrapped
    return relative_error(fast, reference)


def padding_error(target: FrozenTarget, length: int) -> float:
    """Relative error of a right-padded row's real-token features against the row run alone."""
    ids = torch.randint(0, target.vocab_size, (2, length), device=target.device)
    real = length * 5 // 8
    mask = torch.ones(2, length, dtype=torch.bool, device=target.device)
    mask[1, real:] = False
    padded = target.features(ids.masked_fill(~mask, 0), mask)
    alone = target.features(ids[1:, :real])
    return relative_error(padded[1, :real], alone[0])


def approx_matmul_flops(target: FrozenTarget, tokens: int) -> float:
    """2 * (decoder weights run) * tokens plus the causal QK^T and PV of the full-attention layers."""
    run = target.decoder.layers[: max(target.target_layer_ids) + 1]
    layer_params = sum(p.numel() for layer in run for p in layer.parameters())
    cfg = target.config
    num_full = sum(1 for layer in run if hasattr(layer, "self_attn"))
    attention = num_full * 2 * 2 * (tokens * tokens / 2) * cfg.num_attention_heads * cfg.head_dim
    return 2 * layer_params * tokens + attention


def measure(target: FrozenTarget, length: int, iters: int, weights: int) -> dict:
    """Time features() on one row of ``length`` tokens and check what stays allocated afterwards."""
    ids = torch.randint(0, target.vocab_size, (1, length), device=target.device)
    target.features(ids)  # warm-up: Triton compilation and autotuning happen here
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        target.features(ids)  # the result is dropped at once, as a trainer would after the drafter step
        torch.cuda.synchronize()  # host sync: time the GPU work, not the launch
        times.append(time.perf_counter() - start)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    features = target.features(ids)
    torch.cuda.synchronize()
    feature_bytes = tensor_bytes([features])
    leftover = torch.cuda.memory_allocated() - before - feature_bytes
    seconds = statistics.median(times)
    result = {
        "tokens": length,
        "ms": round(seconds * 1e3, 2),
        "tok_per_s": round(length / seconds),
        "tflops": round(approx_matmul_flops(target, length) / seconds / 1e12, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "activation_peak_gib": round((torch.cuda.max_memory_allocated() - before) / 2**30, 2),
        "weights_gib": round(weights / 2**30, 2),
        "features_mib": round(feature_bytes / MiB, 1),
        "leftover_mib": round(leftover / MiB, 1),
    }
    assert features.shape == (1, length, len(target.target_layer_ids) * target.hidden_size)
    assert features.dtype == torch.bfloat16 and features.is_contiguous()
    assert leftover < LEFTOVER_LIMIT, f"{leftover / MiB:.1f} MiB of activations stayed alive after features()"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    cfg = TargetConfig(path="preset:qwen3.6-27b", dtype="bfloat16", target_layer_ids=[0, 1, 2, 3])
    start = time.perf_counter()
    target = load_target(cfg, "cuda", truncate_unused_layers=True)  # raises if fla is not bound
    build_s = time.perf_counter() - start
    layer_types = target.config.layer_types[: target.num_layers]
    assert layer_types == ["linear_attention"] * 3 + ["full_attention"], layer_types
    assert target.kernels["chunk_gated_delta_rule"] == "fla", target.kernels
    weights = tensor_bytes(list(target.model.parameters()) + list(target.model.buffers()))

    checks = {"fla_vs_torch_rel_err": fla_vs_torch_reference(target, 1024)}
    checks["padding_rel_err"] = padding_error(target, 1024)
    assert checks["fla_vs_torch_rel_err"] < 5e-2 and checks["padding_rel_err"] < 5e-2, checks
    rows = [measure(target, length, args.iters, weights) for length in args.lengths]

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  build {build_s:.1f}s")
    print(f"kernels: {target.kernels}")
    print("checks: " + "  ".join(f"{k}={v:.2e}" for k, v in checks.items()))
    columns = list(rows[0])
    print("  ".join(f"{c:>19}" for c in columns))
    for row in rows:
        print("  ".join(f"{row[c]:>19}" for c in columns))
    summary = {
        "check": "gpu_check_target",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernels": target.kernels,
        "build_s": round(build_s, 1),
        **{k: float(f"{v:.3e}") for k, v in checks.items()},
        "rows": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
