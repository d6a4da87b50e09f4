"""Generation engines side by side (``generate/engine.py``): rows/s, generated tokens/s, peak memory,
and whether their greedy outputs agree (the eval's tie-aware verdict).

Engines: ``padded`` (the padded-batch loop synth and regen ran before, ``generate.sampling.sample_batch``,
run in waves of ``--batch-size`` rows), ``slots`` (the slot engine: continuous batching over
``--batch-size`` slots, preallocated cache, CUDA-graphed decode step on CUDA, its default decode
attention: FlexAttention over each slot's live blocks on CUDA), ``slots-grouped`` (the same with the
grouped-matmul decode attention over the attended bucket) and ``slots-eager`` (no graphs, to
separate the gains). Every engine runs the same prompts, greedy
(or ``--temperature``), after an untimed warm-up on one batch of them (CUDA graph captures, kernel
autotuning). The first engine's greedy outputs are the reference; each other engine's are compared
row by row and every first divergence is judged by ``eval.verdict`` (logits of one plain target
forward: a tie within bf16 rounding, or a clear margin / length difference = a bug).

    python3 -m dflash_train.bench.generation --target /path/smollm2 --batch-sizes 1024 \\
        --num-prompts 2048 --max-new-tokens 512 --profile
    python3 -m dflash_train.bench.generation --preset qwen3.6-27b --num-layers 8 \\
        --batch-sizes 64 256 --num-prompts 512 --max-new-tokens 256 --num-stop-ids 2
    python3 -m dflash_train.bench.generation --preset tiny-hybrid --device cpu \\
        --batch-sizes 4 --num-prompts 10 --max-new-tokens 16 --num-stop-ids 3 --profile   # dry run

``--profile`` adds, per batch size, a profile of the slot engine's decode step (``bench.decode_profile``):
the graphed step's time against its memory-traffic floor (weights + each slot's live K/V + the
recurrent states, at the measured 4.16 TB/s copy bandwidth of an H200), and an eager step's GPU time
by operator, with the share spent copying (written to ``decode_profile_<batch>.txt``).

Random-weight presets rarely emit EOS: ``--num-stop-ids K`` makes K random token ids stop ids so
rows end at different lengths (what continuous batching is for); a checkpoint stops at its EOS ids.
Each step runs under ``--timeout-s`` (a step past it is recorded as ``timeout``); ``--out`` (default
``$OUT/generation_bench.json``, else ./generation_bench.json) is rewritten after every step, and a
short table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import time
import traceback
from pathlib import Path

import torch

from dflash_train.bench.decode_profile import profile_decode
from dflash_train.eval.verdict import describe_divergence, verdict
from dflash_train.generate.engine import PaddedEngine, SlotEngine
from dflash_train.generate.sampling import Sampling


class StepTimeout(Exception):
    pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HF checkpoint directory (with tokenizer)")
    where.add_argument("--preset", help="random-weight target preset, e.g. qwen3.6-27b, tiny-hybrid")
    p.add_argument("--num-layers", type=int, default=None, help="preset: build only the first N layers")
    p.add_argument("--prompts", default="", help="JSONL prompt file (default: built-in chat prompts)")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256], help="preset: random length range")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    p.add_argument("--engines", nargs="+", default=["padded", "slots", "slots-grouped", "slots-eager"])
    p.add_argument("--profile", action="store_true", help="profile the slot engine's decode step")
    p.add_argument("--num-stop-ids", type=int, default=0, help="preset: random stop ids (0: none)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--check-every", type=int, default=4, help="slot engine: steps between host syncs")
    p.add_argument("--kv-bucket", type=int, default=None, help="slot engine: attended-length granularity")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per step (warm-up, timed run, verdict)")
    p.add_argument("--out", default="")
    return p.parse_args()


def build(args, device: torch.device, dtype: torch.dtype):
    """(model, prompts as token ids, stop ids)."""
    from dflash_train.models.target_loading import load_causal_lm

    rng = random.Random(0)
    if args.preset:
        model, _ = load_causal_lm(
            f"preset:{args.preset}", dtype=dtype, device=device, num_hidden_layers=args.num_layers
        )
        vocab = model.config.get_text_config(decoder=True).vocab_size
        low, high = args.prompt_len
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(args.num_prompts)
        ]
        stops = {rng.randrange(vocab) for _ in range(args.num_stop_ids)}
        return model.eval(), prompts, stops
    from dflash_train.eval.prompts import benchmark_prompts, load_prompts
    from dflash_train.eval.runner import default_eos_ids

    model, tokenizer = load_causal_lm(args.target, dtype=dtype, device=device)
    if args.prompts:
        prompts = load_prompts(args.prompts, tokenizer, num_prompts=args.num_prompts)
    else:
        prompts = benchmark_prompts(tokenizer, args.num_prompts)
    return model.eval(), prompts, set(default_eos_ids(model, tokenizer))


def make_engine(name: str, model, batch_size: int, args):
    if name == "padded":
        return PaddedEngine(model, num_slots=batch_size)
    if name in ("slots", "slots-grouped", "slots-eager"):
        graphs = None if name != "slots-eager" else False
        return SlotEngine(
            model, num_slots=batch_size, use_cuda_graphs=graphs, check_every=args.check_every,
            kv_bucket=args.kv_bucket, decode_attention="grouped" if name == "slots-grouped" else None,
        )  # fmt: skip
    raise ValueError(f"engine {name!r}: use padded, slots, slots-grouped or slots-eager")


def with_timeout(seconds: float, fn):
    """``fn()``, or StepTimeout after ``seconds`` (SIGALRM: the Python loop is interrupted between kernels)."""

    def expire(signum, frame):
        raise StepTimeout(f"over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(name, model, prompts, stops, batch_size, args, device) -> tuple[dict, list | None]:
    """Warm-up, then the timed run; (record, outputs with the stop token appended)."""
    engine = make_engine(name, model, batch_size, args)
    sampling = Sampling(temperature=args.temperature, seed=0)
    keys = list(range(len(prompts)))

    def generate(rows):
        return engine.generate(
            [prompts[i] for i in rows], [keys[i] for i in rows], max_new_tokens=args.max_new_tokens,
            stop_ids=stops, pad_id=0, sampling=sampling,
        )  # fmt: skip

    record: dict = {"engine": name, "batch_size": batch_size}
    try:
        warm = list(range(min(batch_size, len(prompts))))
        started = time.perf_counter()
        with_timeout(args.timeout_s, lambda: (generate(warm), synchronize(device)))
        record["warmup_s"] = round(time.perf_counter() - started, 2)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        steps_before = getattr(engine, "num_steps", 0)
        started = time.perf_counter()
        generations = with_timeout(args.timeout_s, lambda: generate(range(len(prompts))))
        synchronize(device)
        elapsed = time.perf_counter() - started
        if hasattr(engine, "num_steps"):
            record["decode_steps"] = engine.num_steps - steps_before
    except StepTimeout as err:
        return record | {"status": f"timeout ({err})"}, None
    except Exception as err:  # a benchmark records a failing engine and goes on with the next
        traceback.print_exc()
        return record | {"status": f"error: {type(err).__name__}: {err}"}, None
    tokens = sum(len(g.token_ids) + g.finished for g in generations)
    record |= {
        "status": "ok",
        "elapsed_s": round(elapsed, 3),
        "rows_per_s": round(len(prompts) / elapsed, 2),
        "generated_tokens_per_s": round(tokens / elapsed, 1),
        "generated_tokens": tokens,
        "rows_hit_limit": sum(not g.finished for g in generations),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
    }
    outputs = [g.token_ids + ([g.stop_id] if g.finished else []) for g in generations]
    return record, outputs


def agreement(model, prompts, reference, outputs, args) -> dict:
    """Rows identical to the reference, and the tie-aware verdict over the differing ones."""
    differing = [i for i, (a, b) in enumerate(zip(reference, outputs)) if a != b]
    divergences = with_timeout(
        args.timeout_s,
        lambda: [describe_divergence(model, prompts[i], reference[i], outputs[i], i) for i in differing],
    )
    result = verdict(divergences, len(prompts), args.temperature)
    ties = sum(d["is_tie"] for d in divergences)
    return {
        "rows_identical": len(prompts) - len(differing),
        "rows_differing": len(differing),
        "divergences_at_ties": ties,
        **result,
        "first_divergences": divergences[:5],
    }


def main() -> None:
    args = parse_args()
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "generation_bench.json")
    result: dict = {
        "args": vars(args),
        "device": str(device),
        "dtype": str(dtype),
        "runs": [],
        "agreement": [],
    }
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)

    def save() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    model, prompts, stops = build(args, device, dtype)
    result["num_prompts"], result["stop_ids"] = len(prompts), sorted(stops)
    result["prompt_tokens_mean"] = round(sum(map(len, prompts)) / len(prompts), 1)
    save()
    for batch_size in args.batch_sizes:
        if args.profile:
            try:
                record = with_timeout(
                    args.timeout_s,
                    lambda size=batch_size: profile_decode(model, prompts, stops, size, args, out.parent),
                )
            except StepTimeout as err:
                record = {"status": f"timeout ({err})"}
            except Exception as err:  # a benchmark records a failing step and goes on
                traceback.print_exc()
                record = {"status": f"error: {type(err).__name__}: {err}"}
            result.setdefault("profiles", []).append(record | {"batch_size": batch_size})
            print(json.dumps(record), flush=True)
            save()
        reference = None
        for name in args.engines:
            record, outputs = run_engine(name, model, prompts, stops, batch_size, args, device)
            gc.collect()  # the engine's cache and graphs go before the next engine allocates
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(json.dumps(record), flush=True)
            result["runs"].append(record)
            save()
            if outputs is None:
                continue
            if reference is None:
                reference = (name, outputs)
                continue
            try:
                agree = agreement(model, prompts, reference[1], outputs, args)
            except StepTimeout as err:
                agree = {"status": f"timeout ({err})"}
            agree |= {"batch_size": batch_size, "reference": reference[0], "engine": name}
            print(json.dumps({k: v for k, v in agree.items() if k != "first_divergences"}), flush=True)
            result["agreement"].append(agree)
            save()
    print_table(result)
    print(json.dumps({"out": str(out)}), flush=True)


def print_table(result: dict) -> None:
    print(
        f"\n{'batch':>6} {'engine':<12} {'status':<8} {'rows/s':>9} {'gen tok/s':>11} {'peak GiB':>9} {'hit limit':>9}"
    )
    for r in result["runs"]:
        ok = r["status"] == "ok"
        print(
            f"{r['batch_size']:>6} {r['engine']:<12} {r['status'][:8]:<8} "
            f"{r.get('rows_per_s', '-') if ok else '-':>9} {r.get('generated_tokens_per_s', '-') if ok else '-':>11} "
            f"{str(r.get('peak_memory_gib')) if ok else '-':>9} {r.get('rows_hit_limit', '-') if ok else '-':>9}"
        )
    for r in result.get("profiles", []):
        if "step_ms" in r:
            print(
                f"decode step at {r['batch_size']} slots: {r['step_ms']:.2f} ms graphed, floor {r['floor_ms']:.2f} ms "
                f"(x{r['step_over_floor']:.1f}); eager: {r['copy_share']:.1%} of GPU time in copies"
            )
    for a in result["agreement"]:
        if "rows_identical" not in a:
            print(f"agreement batch {a['batch_size']} {a['engine']} vs {a['reference']}: {a.get('status')}")
            continue
        print(
            f"agreement batch {a['batch_size']} {a['engine']} vs {a['reference']}: {a['rows_identical']} rows "
            f"identical, {a['rows_differing']} differ ({a['divergences_at_ties']} at ties, "
            f"{a['num_clear_divergences']} clear: {'BUG' if a['num_clear_divergences'] else 'ok'})"
        )


if __name__ == "__main__":
    main()
