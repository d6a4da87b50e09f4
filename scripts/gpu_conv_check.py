"""Can fla's Triton causal conv replace transformers' PyTorch fallback (causal-conv1d absent)?

Times both on the Qwen3.6-27B GatedDeltaNet conv shape ([1, 10240 channels, L], kernel 4, SiLU)
and checks they agree. Prints one JSON line.
"""

import json
import statistics

import torch
import torch.nn.functional as F
from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

from dflash_train.bench.timing import time_calls_ms


def torch_fallback(x, weight):  # what transformers runs: depthwise conv1d in [B, D, T] layout
    return F.silu(
        F.conv1d(x, weight.unsqueeze(1), padding=weight.shape[-1] - 1, groups=x.shape[1])[..., : x.shape[-1]]
    )


def fla_path(x, weight):  # fla wants [B, T, D]
    out, _ = fla_causal_conv1d(x.transpose(1, 2), weight=weight, activation="silu")
    return out.transpose(1, 2)


def time_ms(fn, *args, iters=20):
    return statistics.mean(time_calls_ms(lambda: fn(*args), iters, warmup=3, device="cuda"))


results = {}
for seq_len in (4096, 32768):
    x = torch.randn(1, 10240, seq_len, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(10240, 4, device="cuda", dtype=torch.bfloat16) * 0.3
    ref, fast = torch_fallback(x, w), fla_path(x, w)
    err = ((ref.float() - fast.float()).norm() / ref.float().norm()).item()
    results[seq_len] = {
        "torch_ms": round(time_ms(torch_fallback, x, w), 3),
        "fla_ms": round(time_ms(fla_path, x, w), 3),
        "rel_err": err,
    }
print(json.dumps({"conv_check": results}))
