"""GPU check of ``target.fp8``: feature fidelity of the FP8 target against bf16 on a real checkpoint.

Loads a Hugging Face target directory in bf16, renders N prompts (default: the 32 first of
``evalsets/handwritten.jsonl``) with the target's chat template and lets the bf16 target write a
greedy reply of ``--min-new``..``--max-new`` tokens, so every row is the target's own text of a few
hundred tokens (what training data looks like after regeneration). It then runs every row
(teacher-forced, one row at a time, no padding) through the bf16 target and, after freeing it,
through the same target with ``target.fp8=true``, and reports per feature layer (the default
``target_layer_ids``) the cosine similarity and relative error ``||fp8 - bf16|| / ||bf16||`` of the
features over all tokens, the mean and minimum per-token cosine, and for the final logits the
top-1 agreement. A last section times ``features`` on one row of ``--time-tokens`` random ids
(at a 135M shape that says how much activation quantization costs, not what a 27B target gains:
for that run ``dflash-train bench --preset qwen3.6-27b --target-fp8``).

    python scripts/gpu_fp8_check.py --target /path/to/SmolLM2-135M-Instruct [--out fp8.json]

Needs torchao (``pip install torchao`` or the ``fp8`` extra) and a GPU of compute capability >= 8.9.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import time
from pathlib import Path

import torch

from dflash_train.config import TargetConfig
from dflash_train.models.target import FrozenTarget, load_target

REPO = Path(__file__).resolve().parent.parent


def read_prompts(path: Path, count: int) -> list[list[dict]]:
    """The first ``count`` conversations (their ``messages``) of a JSONL file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(rows) < count:
        raise SystemExit(f"{path}: {len(rows)} prompts, fewer than --num-prompts {count}")
    return [row["messages"] for row in rows[:count]]


@torch.no_grad()
def generate_rows(target: FrozenTarget, prompts: list[list[dict]], min_new: int, max_new: int) -> list:
    """Prompt + greedy reply token ids per row (CPU tensors), generated in one left-padded batch."""
    tokenizer = target.tokenizer
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
    out = target.model.generate(
        **batch,
        do_sample=False,
        min_new_tokens=min_new,
        max_new_tokens=max_new,
        pad_token_id=tokenizer.pad_token_id,
    )
    configured = target.model.generation_config.eos_token_id
    eos_ids = set(configured if isinstance(configured, list) else [configured]) | {tokenizer.eos_token_id}
    eos_ids = torch.tensor(sorted(i for i in eos_ids if i is not None), device=out.device)
    prompt_width = batch["input_ids"].shape[1]
    rows = []
    for row, mask in zip(out, batch["attention_mask"]):
        reply = row[prompt_width:]
        eos = torch.isin(reply, eos_ids).nonzero()
        end = int(eos[0]) + 1 if len(eos) else len(reply)  # keep the EOS, drop the padding after it
        rows.append(torch.cat([row[prompt_width - int(mask.sum()) : prompt_width], reply[:end]]).cpu())
    return rows


@torch.no_grad()
def run_rows(target: FrozenTarget, rows: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per row: the features [L, n*H] (bf16, CPU) and the top-1 ids of the full model's logits [L]."""
    features, top1 = [], []
    for ids in rows:
        ids = ids[None].to(target.device)
        features.append(target.features(ids)[0].cpu())
        top1.append(target.model(input_ids=ids).logits[0].argmax(-1).cpu())
    return features, top1


def layer_metrics(reference: list[torch.Tensor], fp8: list[torch.Tensor], hidden: int, k: int) -> dict:
    """Cosine and relative error of feature layer ``k`` over all tokens; per-token cosine mean/min."""
    # float64: the sums over ~10^7 elements with a few massive activations overflow fp32's precision
    # (a cosine of 1.0001 otherwise).
    ref = torch.cat([r[:, k * hidden : (k + 1) * hidden] for r in reference]).double()
    got = torch.cat([g[:, k * hidden : (k + 1) * hidden] for g in fp8]).double()
    per_token = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return {
        "cosine": torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item(),
        "rel_err": ((got - ref).norm() / ref.norm()).item(),
        "token_cosine_mean": per_token.mean().item(),
        "token_cosine_min": per_token.min().item(),
    }


@torch.no_grad()
def time_features(target: FrozenTarget, num_tokens: int, iters: int = 5) -> float:
    """Mean milliseconds of ``features`` on one row of random ids, after two warm-up calls."""
    ids = torch.randint(0, target.vocab_size, (1, num_tokens), device=target.device)
    for _ in range(2):
        target.features(ids)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        target.features(ids)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def free(target: FrozenTarget) -> None:
    del target.model, target.decoder, target.embed_tokens, target.lm_head
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a Hugging Face checkpoint directory")
    parser.add_argument("--prompts", default=str(REPO / "evalsets" / "handwritten.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-new", type=int, default=256, help="reply tokens at least (EOS suppressed)")
    parser.add_argument("--max-new", type=int, default=384)
    parser.add_argument("--time-tokens", type=int, default=4096)
    parser.add_argument("--out", default="", help="write the JSON summary here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    cfg = TargetConfig(path=args.target, dtype="bfloat16")

    reference = load_target(cfg, "cuda")
    rows = generate_rows(
        reference, read_prompts(Path(args.prompts), args.num_prompts), args.min_new, args.max_new
    )
    ref_features, ref_top1 = run_rows(reference, rows)
    ref_ms = time_features(reference, args.time_tokens)
    layer_ids, hidden = reference.target_layer_ids, reference.hidden_size
    free(reference)

    fp8 = load_target(TargetConfig(path=args.target, dtype="bfloat16", fp8=True), "cuda")
    fp8_features, fp8_top1 = run_rows(fp8, rows)
    fp8_ms = time_features(fp8, args.time_tokens)

    layers = {str(i): layer_metrics(ref_features, fp8_features, hidden, k) for k, i in enumerate(layer_ids)}
    agree = torch.cat([a == b for a, b in zip(fp8_top1, ref_top1)]).float().mean().item()
    lengths = [len(r) for r in rows]
    summary = {
        "check": "gpu_fp8_check",
        "target": args.target,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torchao": importlib.metadata.version("torchao"),
        "kernels": fp8.kernels,
        "rows": len(rows),
        "tokens": sum(lengths),
        "row_tokens_min_max": [min(lengths), max(lengths)],
        "target_layer_ids": layer_ids,
        "layers": layers,
        "logits_top1_agreement": agree,
        "features_ms": {"tokens": args.time_tokens, "bf16": ref_ms, "fp8": fp8_ms},
    }
    print(f"{summary['device']}  torch {summary['torch']}  torchao {summary['torchao']}")
    print(f"kernels: {fp8.kernels}")
    print(f"{len(rows)} rows, {sum(lengths)} tokens (row lengths {min(lengths)}..{max(lengths)})")
    print(f"{'layer':>6} {'cosine':>10} {'rel_err':>10} {'tok_cos_mean':>13} {'tok_cos_min':>12}")
    for layer, m in layers.items():
        print(
            f"{layer:>6} {m['cosine']:10.5f} {m['rel_err']:10.4f} "
            f"{m['token_cosine_mean']:13.5f} {m['token_cosine_min']:12.5f}"
        )
    print(f"final logits top-1 agreement: {agree:.4f}")
    print(f"features on 1x{args.time_tokens}: bf16 {ref_ms:.2f} ms, fp8 {fp8_ms:.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
