"""Packed rows at the Qwen3.6-27B GatedDeltaNet shape: fla varlen features == each conversation alone.

Builds the qwen3.6-27b preset target with random bf16 weights, only its first 4 decoder layers
(3 GatedDeltaNet + 1 full attention, feature layers [1, 2, 3]), packs 4 conversations into one
4,096-token row and compares ``FrozenTarget.features(position_ids=...)`` (fla's varlen chunk rule
and conv) with each conversation run alone, then times the varlen pass against the
per-conversation reference path. Prints one JSON line. Needs CUDA and fla-core.
"""

import argparse
import json
import statistics

import numpy as np
import torch

from dflash_train.bench.timing import time_calls_ms
from dflash_train.config import load_config
from dflash_train.data.batching import assemble_packed_batch
from dflash_train.models import target as target_module
from dflash_train.models.target import load_target

LENGTHS = [700, 1500, 1200, 696]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--preset", default="qwen3.6-27b", help="target preset (tiny-hybrid for a CPU dry run)"
    )
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    layers = "[0,1,2]" if args.preset.startswith("tiny") else "[1,2,3]"
    overrides = [
        f"target.path=preset:{args.preset}",
        f"target.dtype={dtype}",
        f"target.target_layer_ids={layers}",
    ]
    cfg = load_config("tiny-cpu", overrides)
    target = load_target(cfg.target, args.device, truncate_unused_layers=True)
    if args.device == "cuda":  # the point of the check: fla's varlen kernels, not the reference path
        assert target.kernels.get("chunk_gated_delta_rule") == "fla", target.kernels
        assert target.kernels.get("causal_conv1d_fn") == "fla", target.kernels
    g = np.random.default_rng(0)
    convs = [g.integers(0, target.vocab_size, size=n) for n in LENGTHS]
    batch = assemble_packed_batch([[(c, c >= 0) for c in convs]], [[0, 1, 2, 3]], 1, sum(LENGTHS), pad_id=0)
    ids, positions = batch.input_ids.to(args.device), batch.position_ids.to(args.device)
    packed = target.features(ids, position_ids=positions)
    errors, start = [], 0
    for conv in convs:
        alone = target.features(torch.as_tensor(conv, device=args.device)[None])[0].float()
        part = packed[0, start : start + len(conv)].float()
        errors.append(((part - alone).norm() / alone.norm()).item())
        start += len(conv)
    crossed = target.features(ids)[0, LENGTHS[0] :].float()
    crossing_error = ((crossed - packed[0, LENGTHS[0] :].float()).norm() / crossed.norm()).item()

    def varlen():
        return target_module.varlen_features(target, ids, positions, with_final_hidden=False)

    def reference():
        return target_module.per_conversation_features(target, ids, positions, with_final_hidden=False)

    result = {
        "relative_error_per_conversation": [round(e, 5) for e in errors],
        "relative_difference_if_boundaries_were_crossed": round(crossing_error, 4),
        # Random weights make context matter little; "ok" asks the packed error to be far below
        # what crossing the boundaries would change.
        "ok": max(errors) * 5 < crossing_error,
        "kernels": target.kernels,
    }
    if args.device == "cuda":  # on CPU "varlen" would be the torch fallback: nothing to time
        for name, fn in (("varlen_ms", varlen), ("per_conversation_ms", reference)):
            result[name] = round(statistics.mean(time_calls_ms(fn, 10, warmup=3, device=args.device)), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
