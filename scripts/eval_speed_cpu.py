"""CPU comparison of exact-mode and decode-mode evaluation on the same prompts (docs/evaluation.md).

Builds a tiny Qwen3.5 hybrid target (the test suite's sharpened random one: varied greedy
continuations), fits a DFlash drafter for a few steps to the target's continuations of a set of
prompts (so acceptance is partial, like a trained drafter's on its own domain), then runs
``run_eval`` twice on those prompts: ``--tau-mode exact`` and ``--tau-mode decode``, DFlash + n-gram, and prints
both taus and the time of each (model loading excluded), and the time decode mode spends on its
plain reference decoding alone: a floor of decode mode's cost for any drafter, however good (a
better drafter shortens the speculative passes, never the reference). The last stdout line is one
JSON object.

    OMP_NUM_THREADS=1 python scripts/eval_speed_cpu.py [--num-prompts 21] [--max-new-tokens 121]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dflash_train.eval.command import run_eval
from dflash_train.eval.exact import as_frozen_target
from dflash_train.eval.generate import greedy_continuations
from dflash_train.eval.options import EvalOptions
from dflash_train.eval.prompts import encode_prompt
from dflash_train.tiny import fit_drafter_on_continuations

WORDS = [
    "def",
    "add",
    "return",
    "self",
    "print",
    "range",
    "class",
    "Point",
    "the",
    "quick",
    "fox",
    "lazy",
    "dog",
]


def sharp_target(tokenizer):
    from dflash_train.tiny import build_tiny_target, sharpen

    model = sharpen(build_tiny_target("hybrid", vocab_size=len(tokenizer)))
    model.config.eos_token_id = tokenizer.eos_token_id
    return model


def texts(count: int, seed: int) -> list[str]:
    rng = torch.Generator().manual_seed(seed)
    return [
        " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (6,), generator=rng)) for _ in range(count)
    ]


def fit_drafter(model, tokenizer, prompts, max_new_tokens, block_size=8, steps=30):
    """Adam on every anchor of the target's continuations of ``prompts``."""
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter

    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=block_size), model.config, target_layer_ids=[0, 2],
        mask_token_id=tokenizer.mask_token_id, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    eos = {tokenizer.eos_token_id}
    continuations = greedy_continuations(
        model, prompts, max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=0, batch_size=16
    )
    drafter = fit_drafter_on_continuations(
        drafter,
        as_frozen_target(model, [0, 2]),
        prompts,
        continuations,
        max_new_tokens=max_new_tokens,
        steps=steps,
    )
    return drafter, config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=21)
    p.add_argument("--max-new-tokens", type=int, default=121)
    args = p.parse_args()
    from dflash_train.models.export import save_drafter
    from dflash_train.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    model = sharp_target(tokenizer)
    train_prompts = [encode_prompt(tokenizer, {"prompt": t}, None) for t in texts(32, seed=1)]
    drafter, config = fit_drafter(model, tokenizer, train_prompts, args.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model.save_pretrained(root / "target")
        tokenizer.save_pretrained(root / "target")
        save_drafter(drafter, config, root / "drafter", dtype="float32")
        # The prompts the drafter was fitted to: acceptance like a trained drafter's on its domain
        # (decode mode's cost falls as tau rises, so a useless drafter would flatter exact mode).
        rows = "".join(json.dumps({"prompt": t}) + "\n" for t in texts(32, seed=1)[: args.num_prompts])
        (root / "prompts.jsonl").write_text(rows)
        results = {}
        for mode in ("exact", "decode"):
            options = EvalOptions(
                target=str(root / "target"), drafter=str(root / "drafter"), prompts=[str(root / "prompts.jsonl")],
                max_new_tokens=args.max_new_tokens, baseline="ngram", tau_mode=mode, device="cpu", progress=False,
            )  # fmt: skip
            started = time.perf_counter()
            result = run_eval(options)
            results[mode] = {
                "seconds": sum(result["timings"].values()),
                "wall_s": time.perf_counter() - started,
                "tau": result["tau"],
                "ngram_tau": result["ngram_tau"],
                "timings": result["timings"],
            }
            if mode == "decode":
                # Decode mode always pays for the plain reference decoding, whatever the drafter's tau.
                results[mode]["plain_reference_s"] = result["tokens"] / result["baseline_tokens_per_s"]
    exact_s, decode = results["exact"]["seconds"], results["decode"]
    ratio, floor = decode["seconds"] / exact_s, decode["plain_reference_s"] / exact_s
    print(
        f"exact {exact_s:.1f}s vs decode {decode['seconds']:.1f}s: {ratio:.1f}x "
        f"(the plain reference alone: {decode['plain_reference_s']:.1f}s, {floor:.1f}x)"
    )
    summary = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens}
    print(json.dumps({**summary, "speedup": ratio, "speedup_floor": floor, **results}))


if __name__ == "__main__":
    main()
