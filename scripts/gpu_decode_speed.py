"""Real decoding speed at batch 1 (``dflash-train eval --tau-mode decode``): plain decoding and DFlash
tokens/s with the dynamic engine (HF dynamic cache, eager) and the static engine (static KV cache,
CUDA graphs for the T = 1 / T = B target steps and the drafter's block step), and whether the two
engines produce the same tokens.

Each engine runs ``runner.evaluate`` (untimed warm-up first: kernel selection and the graph
captures), so the numbers are exactly what ``eval`` reports. Without ``--drafter`` a random drafter
of the target's shape times the block step (its tau is ~1 and means nothing). In bf16 the engines
can differ at exact logit ties (a T = B verify and a T = 1 step round differently, and so do the
two engines' attention kernels): the identical-output counts say how often, and each engine's
DFlash output is judged against its plain output by the eval's tie-aware verdict (a divergence where
the two tokens' logits lie within bf16 rounding is a tie; a wider margin or a length difference is
a bug).

    PYTHONPATH=. python3 scripts/gpu_decode_speed.py --target /path/smollm2 --num-prompts 8 --max-new-tokens 256
    PYTHONPATH=. python3 scripts/gpu_decode_speed.py --preset tiny-qwen3 --device cpu --num-prompts 2 --max-new-tokens 16

Writes ``--out`` (default ``$OUT/decode_speed.json``, else ./decode_speed.json); the last stdout
line is the same JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from dflash_train.eval.command import resolve_device, resolve_eval_dtype
from dflash_train.eval.runner import default_eos_ids, evaluate
from dflash_train.eval.verdict import verdict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_eval_bench import build_drafter, build_target  # noqa: E402  (the same target/drafter setup)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HF checkpoint directory (with tokenizer)")
    where.add_argument("--preset", help="random-weight target preset (dry runs), e.g. tiny-qwen3")
    p.add_argument("--num-layers", type=int, default=None, help="preset: build only the first N layers")
    p.add_argument("--drafter", default="", help="exported drafter dir (default: random, for timing only)")
    p.add_argument("--prompts", default="", help="JSONL prompt file (default: built-in chat prompts)")
    p.add_argument("--prompt-len", type=int, default=64, help="preset: random prompt length")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16, help="random drafter's block size")
    p.add_argument("--ignore-eos", action="store_true", help="always decode max-new-tokens")
    p.add_argument("--engines", default="dynamic,static", help="comma-separated decode engines")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="")
    return p.parse_args()


def run_engine(model, tokenizer, drafter, prompts, eos, args, engine: str) -> dict:
    """One engine: plain and DFlash tokens/s, speedup, tau, lossless, and the generations."""
    started = time.perf_counter()
    report = evaluate(
        model, tokenizer, drafter, prompts, max_new_tokens=args.max_new_tokens, methods=("dflash",),
        eos_token_ids=eos, decode_engine=engine,
    )  # fmt: skip
    total = time.perf_counter() - started
    dflash = report["methods"]["dflash"]
    # Tie-aware: two tokens whose logits lie within bf16 rounding are a tie, anything else a bug.
    checked = verdict(dflash["divergences"], len(prompts), 0.0)
    return {
        "decode_engine": report["decode_engine"],
        "dflash_decode_engine": dflash["decode_engine"],
        "plain_tokens": report["baseline"]["tokens"],
        "plain_tokens_per_s": report["baseline"]["tokens_per_s"],
        "dflash_tokens": dflash["tokens"],
        "dflash_tokens_per_s": dflash["tokens_per_s"],
        "speedup": dflash["speedup"],
        "tau": dflash["tau"],
        "lossless": dflash["lossless"],
        "lossless_up_to_ties": checked["lossless_up_to_ties"],
        "clear_divergences": checked["num_clear_divergences"],
        "mismatched_prompts": dflash["mismatched_prompts"],
        "wall_with_warm_up_s": total,  # includes the warm-up and (static) the graph captures
        "_outputs": {name: [g.tokens for g in gens] for name, gens in report["generations"].items()},
    }


def compare(rows: dict[str, dict]) -> dict:
    """Prompts whose outputs are identical between the first engine and each other engine."""
    names = [n for n in rows if "_outputs" in rows[n]]
    if len(names) < 2:
        return {}
    first = rows[names[0]]["_outputs"]
    return {
        f"{names[0]}_vs_{other}": {
            method: sum(a == b for a, b in zip(first[method], rows[other]["_outputs"][method], strict=True))
            for method in first
        }
        for other in names[1:]
    }


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    dtype = resolve_eval_dtype(args.dtype, device)
    model, tokenizer, prompts = build_target(args, device, dtype)
    drafter = build_drafter(args, model, tokenizer, device, dtype)
    eos = set() if args.ignore_eos else default_eos_ids(model, tokenizer)
    rows: dict[str, dict] = {}
    for engine in args.engines.split(","):
        try:
            rows[engine] = run_engine(model, tokenizer, drafter, prompts, eos, args, engine)
        except (
            Exception
        ) as err:  # one engine failing (e.g. a capture error) must not hide the other's numbers
            traceback.print_exc()
            rows[engine] = {"error": f"{type(err).__name__}: {err}"}
        print(
            f"{engine}: " + json.dumps({k: v for k, v in rows[engine].items() if k != "_outputs"}), flush=True
        )
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "target": args.target or f"preset:{args.preset}",
        "drafter": args.drafter or "random (timing only)",
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "block_size": drafter.config.block_size,
        "torch": torch.__version__,
        "identical_outputs": compare(rows),
        "engines": {k: {f: v for f, v in row.items() if f != "_outputs"} for k, row in rows.items()},
    }
    print_table(result)
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "decode_speed.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


def print_table(result: dict) -> None:
    print(
        f"\n{'engine':<18} {'plain tok/s':>12} {'dflash tok/s':>13} {'speedup':>8} {'tau':>6} "
        "lossless (up to ties, clear divergences)"
    )
    for name, row in result["engines"].items():
        if "error" in row:
            print(f"{name:<18} error: {row['error']}")
            continue
        print(
            f"{row['decode_engine']:<18} {row['plain_tokens_per_s']:>12.1f} {row['dflash_tokens_per_s']:>13.1f} "
            f"{row['speedup']:>7.2f}x {row['tau']:>6.2f} {row['lossless']} "
            f"({row['lossless_up_to_ties']}, {row['clear_divergences']})"
        )
    for pair, counts in result["identical_outputs"].items():
        print(
            f"identical outputs {pair}: "
            + ", ".join(f"{m} {c}/{result['num_prompts']}" for m, c in counts.items())
        )


if __name__ == "__main__":
    main()
