"""GPU check of the DFlash drafter's training attention at the Qwen3.6-27B drafter shape.

Random bf16 weights and features at the real shape (5 layers [sliding x4, full], H 5120, 32/8 heads
x128, window 2048), one row of L=4096 tokens with A=512 anchors x B=16:
1. agreement: one sliding and one full layer's attention through flex, chunked SDPA and a dense
   float32 reference written from the DESIGN.md rules (on a subset of anchors: the full dense score
   matrix would be 8,192 x 12,288 x 32 heads), then flex vs SDPA on the whole 5-layer hidden states;
2. BlockMask construction time (uncompiled ``create_block_mask``, per layer type);
3. per backend, forward+backward of the 5 layers (loss = hidden.float().pow(2).mean() as a stand-in
   for the LM-head loss): median of 5 timed with CUDA events after warm-up, and peak memory above
   the weights. The first flex call compiles flex_attention (fwd+bwd) and is reported separately.
Prints a compact table and, last, one JSON line; with $OUT set the JSON is also written there.

    python scripts/gpu_check_drafter.py [--seq-len 4096] [--num-anchors 512] [--iters 5]
    python scripts/gpu_check_drafter.py --preset tiny --seq-len 64 --num-anchors 8   # CPU smoke run

Budget: well under 3 minutes of GPU time including the flex compilation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from dflash_train.bench.timing import time_calls_ms  # noqa: E402
from dflash_train.config import DrafterConfig  # noqa: E402
from dflash_train.models import presets  # noqa: E402
from dflash_train.models.drafter import DFlashDrafter, block_positions, block_token_ids  # noqa: E402
from dflash_train.models.masks import (  # noqa: E402
    ChunkedSdpaAttention,
    FlexBlockAttention,
    LayerMaskSpec,
    build_flex_block_mask,
)

GiB = 2**30
# bf16 inputs, fp32 accumulation: errors relative to the reference's RMS.
AGREEMENT_LIMIT = 2e-2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.6-27b", choices=["qwen3.6-27b", "tiny"])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--num-anchors", type=int, default=512)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sdpa-chunks", type=int, nargs="+", default=[64, 128])
    parser.add_argument(
        "--ref-anchors", type=int, default=48, help="anchors checked against the dense reference"
    )
    return parser.parse_args()


def build(args: argparse.Namespace, device: torch.device):
    """Drafter, embedding and one random micro-batch at the preset's shape."""
    if args.preset == "tiny":
        target = presets.tiny_hybrid_target_config()
        config = presets.resolve_drafter_config(
            DrafterConfig(preset="tiny", block_size=8), target, target_layer_ids=[0, 2], mask_token_id=300
        )
    else:
        target = presets.qwen36_27b_target_config()
        config = presets.resolve_drafter_config(DrafterConfig(preset="qwen3.6-27b"), target)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        drafter = DFlashDrafter(config).to(dtype)
        embed = torch.nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype).requires_grad_(False)
        length, num_anchors = args.seq_len, args.num_anchors
        features = torch.randn(1, length, config.num_target_features * config.hidden_size, dtype=dtype)
        ids = torch.randint(0, config.vocab_size - 1, (1, length))
        anchors = torch.randperm(length - 2)[:num_anchors].sort().values[None] + 1
        keep = torch.ones_like(anchors, dtype=torch.bool)
    return drafter, config, embed, (features, ids, anchors, keep)


def layer_inputs(drafter, config, embed, batch, layer_index: int):
    """q, k_ctx, v_ctx, k_blk, v_blk of one layer on the micro-batch (what the backends attend over)."""
    features, ids, anchors, _ = batch
    layer = drafter.layers[layer_index]
    size = config.block_size
    hidden = drafter.embed_block(block_token_ids(ids, anchors, size, config.mask_token_id).flatten(1), embed)
    x = layer.input_layernorm(hidden)
    block_rope = drafter.rope(block_positions(anchors, size).flatten(1))
    context_rope = drafter.rope(torch.arange(ids.shape[1], device=ids.device)[None])
    q = layer.self_attn.project_q(x, block_rope)
    k_blk, v_blk = layer.self_attn.project_kv(x, block_rope)
    k_ctx, v_ctx = layer.self_attn.project_kv(drafter.project_context(features), context_rope)
    return q, k_ctx, v_ctx, k_blk, v_blk


def dense_reference(inputs, anchors, config, spec: LayerMaskSpec, slots: list[int]) -> torch.Tensor:
    """float32 attention of the chosen anchors' blocks, mask written from DESIGN.md (not masks.py)."""
    q, k_ctx, v_ctx, k_blk, v_blk = (t.float() for t in inputs)
    size, groups = config.block_size, q.shape[1] // k_ctx.shape[1]
    outs = []
    for slot in slots:
        a = int(anchors[0, slot])
        tokens = slice(slot * size, (slot + 1) * size)
        k = torch.cat([k_ctx[0], k_blk[0, :, tokens]], 1).repeat_interleave(groups, 0)
        v = torch.cat([v_ctx[0], v_blk[0, :, tokens]], 1).repeat_interleave(groups, 0)
        kpos = torch.arange(k_ctx.shape[2], device=q.device)
        blk = torch.arange(size, device=q.device)
        ctx_ok = kpos[None] < a
        if spec.window is not None:
            ctx_ok = ctx_ok & (kpos[None] >= a + blk[:, None] - (spec.window - 1))
        blk_ok = (
            (blk[None] <= blk[:, None])
            if spec.causal
            else torch.ones(size, size, dtype=torch.bool, device=q.device)
        )
        mask = torch.cat([ctx_ok.expand(size, -1), blk_ok], 1)
        scores = q[0, :, tokens] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        outs.append(scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v)
    return torch.cat(outs, 1)  # [Hq, len(slots)*B, D]


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def check_agreement(drafter, config, embed, batch, args, device) -> dict:
    """Per layer type: flex / SDPA vs the dense reference on a subset of anchors."""
    _, ids, anchors, _ = batch
    num_anchors, size = anchors.shape[1], config.block_size
    step = max(1, num_anchors // args.ref_anchors)
    slots = list(range(0, num_anchors, step))[: args.ref_anchors] + [num_anchors - 1]
    token_index = torch.cat([torch.arange(s * size, (s + 1) * size) for s in slots]).to(device)
    results = {}
    for layer_type in sorted(set(config.layer_types)):
        index = config.layer_types.index(layer_type)
        spec = drafter.mask_specs[layer_type]
        # Grad stays enabled on GPU: compiled flex is traced once, for forward+backward, as in
        # training. CPU flex has no backward, so the CPU smoke run goes without grad.
        with torch.set_grad_enabled(device.type == "cuda"):
            inputs = layer_inputs(drafter, config, embed, batch, index)
            mask = build_flex_block_mask(anchors, ids.shape[1], size, spec)
            flex = FlexBlockAttention(mask)(*inputs)[0][:, token_index].detach()
            chunked = ChunkedSdpaAttention(anchors, ids.shape[1], size, spec, args.sdpa_chunks[0])
            sdpa = chunked(*inputs)[0][:, token_index].detach()
        with torch.no_grad():
            ref = dense_reference([t.detach() for t in inputs], anchors, config, spec, slots)
        results[layer_type] = {
            "flex_vs_ref": relative_error(flex, ref),
            "sdpa_vs_ref": relative_error(sdpa, ref),
        }
    return results


def check_model_agreement(drafter, embed, batch, args, device) -> float:
    with torch.set_grad_enabled(device.type == "cuda"):  # as in check_agreement
        flex = drafter.forward_train(*batch, embed, backend="flex").detach()
        sdpa = drafter.forward_train(*batch, embed, backend="sdpa", sdpa_anchor_chunk=args.sdpa_chunks[0])
    return relative_error(flex, sdpa.detach())


def time_block_mask(drafter, config, batch, args, device) -> dict:
    """Per layer type: median build ms and transient peak GiB of the uncompiled BlockMask builder."""
    _, ids, anchors, _ = batch
    out = {}
    for layer_type, spec in sorted(drafter.mask_specs.items()):
        build = lambda spec=spec: build_flex_block_mask(anchors, ids.shape[1], config.block_size, spec)  # noqa: E731
        build()
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            build()
            peak = (torch.cuda.max_memory_allocated() - base) / GiB
        out[layer_type] = {
            "median_ms": statistics.median(time_calls_ms(build, args.iters, device=device)),
            "peak_gib": peak,
        }
    return out


def time_train_step(drafter, embed, batch, backend: str, chunk: int, trim: bool, args, device) -> dict:
    """Forward+backward of the 5 layers: first-call ms, median ms, peak GiB above the weights."""

    def step():
        drafter.zero_grad(set_to_none=True)
        hidden = drafter.forward_train(
            *batch, embed, backend=backend, sdpa_anchor_chunk=chunk, sdpa_trim_context=trim
        )
        hidden.float().pow(2).mean().backward()

    began = time.perf_counter()
    step()  # flex: compiles flex_attention fwd+bwd here
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_ms = (time.perf_counter() - began) * 1e3
    step()
    drafter.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = time_calls_ms(step, args.iters, device=device)
    peak = (torch.cuda.max_memory_allocated() - base) / GiB if device.type == "cuda" else None
    return {"first_ms": first_ms, "median_ms": statistics.median(times), "peak_gib": peak}


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> int:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    began = time.perf_counter()
    drafter, config, embed, batch = build(args, device)
    layer_errors = check_agreement(drafter, config, embed, batch, args, device)
    model_error = check_model_agreement(drafter, embed, batch, args, device)
    mask_ms = time_block_mask(drafter, config, batch, args, device)
    runs = {}
    # Flex has no backward on CPU (torch 2.13): the CPU smoke run times SDPA only.
    backends = [("flex", 0, False)] if device.type == "cuda" else []
    backends += [("sdpa", chunk, False) for chunk in args.sdpa_chunks]
    backends += [("sdpa", args.sdpa_chunks[0], True)]  # trimmed context: fewer FLOPs, varying shapes
    for backend, chunk, trim in backends:
        name = backend if backend == "flex" else f"sdpa/{chunk}" + ("/trim" if trim else "")
        runs[name] = time_train_step(drafter, embed, batch, backend, chunk, trim, args, device)

    print(
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}  torch {torch.__version__}"
    )
    print(f"shape {args.preset}: L={args.seq_len} A={args.num_anchors} B={config.block_size}")
    for layer_type, errs in layer_errors.items():
        print(
            f"{layer_type:<18} rel.err vs dense ref: flex {errs['flex_vs_ref']:.2e}  sdpa {errs['sdpa_vs_ref']:.2e}"
        )
    print(f"{len(drafter.layers)}-layer hidden rel.err flex vs sdpa: {model_error:.2e}")
    for layer_type, built in mask_ms.items():
        print(
            f"BlockMask build ({layer_type}): {built['median_ms']:.2f} ms, peak {gib(built['peak_gib'])} GiB"
        )
    print(f"{'backend':<14} {'first ms':>10} {'fwd+bwd ms':>11} {'peak GiB':>9}")
    for name, run in runs.items():
        print(f"{name:<14} {run['first_ms']:>10.0f} {run['median_ms']:>11.1f} {gib(run['peak_gib']):>9}")

    errors = [e for errs in layer_errors.values() for e in errs.values()] + [model_error]
    result = {
        "ok": all(e < AGREEMENT_LIMIT for e in errors),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"preset": args.preset, "L": args.seq_len, "A": args.num_anchors, "B": config.block_size},
        "layer_rel_err": layer_errors,
        "model_rel_err_flex_vs_sdpa": model_error,
        "block_mask_ms": mask_ms,
        "train_step": runs,
        "wall_s": time.perf_counter() - began,
    }
    line = json.dumps(result)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check_drafter.json").write_text(line + "\n")
    print(line)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
