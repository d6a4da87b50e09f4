"""Throughput of exact-mode evaluation (``--tau-mode exact``) on one GPU, phase by phase.

Two workloads:

- a real checkpoint (``--target HF_DIR``, e.g. SmolLM2-135M-Instruct): ``--num-prompts`` chat
  prompts (from ``--prompts FILE`` or built in) x ``--max-new-tokens``, DFlash + n-gram, with a
  drafter from ``--drafter DIR`` or a random one of the target's shape (timing only: its tau is
  meaningless). Reports generate / features / drafter / simulation seconds and the total;
- a preset shape with random weights (``--preset qwen3.6-27b [--num-layers N]``): random prompt
  ids of ``--prompt-len`` tokens, no EOS (random weights never stop), the preset's drafter, and
  prompts/min, so a 27B evaluation can be planned.

    python scripts/gpu_eval_bench.py --target /path/smollm2 --num-prompts 164 --max-new-tokens 512 --ignore-eos
    python scripts/gpu_eval_bench.py --preset qwen3.6-27b --num-prompts 64 --max-new-tokens 512
    python scripts/gpu_eval_bench.py --preset tiny-hybrid --device cpu --num-prompts 8   # CPU dry run

A short untimed warm-up runs first (kernel selection, allocator growth). The last stdout line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from dflash_train.eval.exact import exact_generations
from dflash_train.eval.generate import greedy_continuations, pad_token_for
from dflash_train.eval.runner import default_eos_ids
from dflash_train.eval.summary import summarize_rounds
from dflash_train.models.target_kernels import bind_fla_causal_conv, bound_kernels


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HF checkpoint directory (with tokenizer)")
    where.add_argument("--preset", help="random-weight target preset, e.g. qwen3.6-27b")
    p.add_argument("--num-layers", type=int, default=None, help="preset: build only the first N layers")
    p.add_argument(
        "--drafter", default="", help="exported drafter dir (default: random of the target's shape)"
    )
    p.add_argument("--prompts", default="", help="JSONL prompt file (default: built-in prompts)")
    p.add_argument("--num-prompts", type=int, default=164)
    p.add_argument("--prompt-len", type=int, default=256, help="preset: prompt length in tokens")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--drafter-batch-tokens", type=int, default=65536)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--methods", default="dflash,ngram", help="comma list of dflash, ngram, ddtree")
    p.add_argument("--ddtree-budget", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16, help="block size of the random drafter")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda")
    return p.parse_args()


def build_target(args, device, dtype):
    """(model, tokenizer or None, prompts as token ids)."""
    from dflash_train.models.target import load_causal_lm

    if args.preset:
        model, _ = load_causal_lm(
            f"preset:{args.preset}", dtype=dtype, device=device, num_hidden_layers=args.num_layers
        )
        rng = random.Random(0)
        vocab = model.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        return model.eval(), None, prompts
    model, tokenizer = load_causal_lm(args.target, dtype=dtype, device=device)
    if args.prompts:
        from dflash_train.eval.prompts import load_prompts

        prompts = load_prompts(args.prompts, tokenizer, num_prompts=args.num_prompts)
    else:
        from dflash_train.eval.prompts import benchmark_prompts

        prompts = benchmark_prompts(tokenizer, args.num_prompts)
    return model.eval(), tokenizer, prompts


def build_drafter(args, model, tokenizer, device, dtype):
    """The exported drafter, or a random drafter of the preset's / target's shape."""
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.export import load_drafter

    if args.drafter:
        return load_drafter(args.drafter, device=str(device), dtype=dtype)[0].eval()
    num_layers = presets.text_config(model.config).num_hidden_layers
    name = args.preset if args.preset in presets.DRAFTER_PRESETS else "from-target"
    if args.preset and args.preset.startswith("tiny"):
        name = "tiny"
    layer_ids = presets.default_target_layer_ids(num_layers)
    special = default_eos_ids(model, tokenizer) | {getattr(tokenizer, "pad_token_id", None)}
    mask = next(i for i in range(model.config.vocab_size - 1, 0, -1) if i not in special)
    config = presets.resolve_drafter_config(
        DrafterConfig(preset=name, block_size=args.block_size), model.config, target_layer_ids=layer_ids, mask_token_id=mask,
        torch_dtype=str(dtype).removeprefix("torch."),
    )  # fmt: skip
    with torch.device(device):
        torch.manual_seed(0)
        return DFlashDrafter(config).to(dtype).eval()


def run(args, model, drafter, prompts, eos, pad, methods) -> dict:
    """Generate, then exact generations; phase seconds and acceptance."""
    sync = (
        torch.cuda.synchronize
        if torch.cuda.is_available() and args.device.startswith("cuda")
        else (lambda: None)
    )
    started = time.perf_counter()
    continuations = greedy_continuations(
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=eos,
        pad_token_id=pad,
        batch_size=args.batch_size,
    )
    sync()
    timings = {"generate": time.perf_counter() - started}
    generations, exact_timings = exact_generations(
        model, drafter, prompts, continuations, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
        methods=methods, ddtree_budget=args.ddtree_budget, drafter_batch_tokens=args.drafter_batch_tokens,
        pad_token_id=pad,
    )  # fmt: skip
    timings.update(exact_timings)
    timings["total"] = sum(timings.values())
    block = drafter.config.block_size
    taus = {m: summarize_rounds(g, block)["tau"] for m, g in generations.items()}
    tokens = sum(len(c) for c in continuations)
    return {"timings": timings, "tau": taus, "tokens": tokens}


def main() -> None:
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, tokenizer, prompts = build_target(args, device, dtype)
    if device.type == "cuda":  # the fla conv, as training binds it; reported below either way
        bind_fla_causal_conv(model, device)
    drafter = build_drafter(args, model, tokenizer, device, dtype)
    eos = set() if args.ignore_eos or tokenizer is None else default_eos_ids(model, tokenizer)
    pad = pad_token_for(tokenizer, eos)
    methods = [m for m in args.methods.split(",") if m]
    warm = argparse.Namespace(**{**vars(args), "max_new_tokens": 8})
    run(warm, model, drafter, prompts[: min(2, len(prompts))], eos, pad, methods)
    result = run(args, model, drafter, prompts, eos, pad, methods)
    minutes = result["timings"]["total"] / 60
    result.update(
        workload=args.preset or args.target,
        num_layers=model.config.num_hidden_layers,
        num_prompts=len(prompts),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        prompts_per_min=len(prompts) / minutes if minutes else None,
        new_tokens_per_s=result["tokens"] / result["timings"]["total"],
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        random_drafter=not args.drafter,
        kernels=bound_kernels(model),
    )
    for phase, seconds in result["timings"].items():
        print(f"{phase:<11} {seconds:8.2f} s")
    print(f"prompts/min {result['prompts_per_min']:.1f}; tau {result['tau']}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
