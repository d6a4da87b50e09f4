"""Can a DFlash drafter learn to copy a repetition loop? A CPU experiment (docs/quality.md).

Synthetic rows on a tiny random Qwen3 target: a random prompt, then a response that repeats a
random pattern of period T (``--periods``), plus a share of non-loop rows (random responses) as a
control. The project's own drafter, anchors (``sample_anchors``), labels (``block_targets``) and
loss (``dflash_loss``, decay weights) train on fresh rows every step. Measured on held-out loop
rows, teacher forced, at anchors with at least two whole periods of context before them (every
label is then a copy of a token in the context at offset T, 2T, ...): top-1 accuracy per block
position k = 1..B-1 split by T, for each drafter depth; and the sequential exact tau of the
drafter and of prompt lookup on the same rows (``eval.exact.exact_acceptance``, the labels taken
as the continuation).

``--prev-token-features`` replaces the second feature layer's slice by the target's embedding of
the PREVIOUS token (position p carries ids[p-1]), as a trained target's previous-token heads do:
it tests whether copying is limited by what the fixed context keys encode.

    nice python scripts/copy_capacity_cpu.py --depths 1,2,4,6 --steps 1000 --json /tmp/copy.json
    python scripts/copy_capacity_cpu.py --tables /tmp/copy.json   # the markdown tables
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_train.data.anchors import sample_anchors
from dflash_train.eval.exact import as_frozen_target, exact_acceptance
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.tiny import build_tiny_target
from dflash_train.train.builders import lr_multiplier
from dflash_train.train.loss import block_targets, denominator_weights, dflash_loss

VOCAB = 320
FIRST_TOKEN = 6  # ids 0..5 are the tiny tokenizer's specials (3 is the mask token)
MASK_TOKEN_ID = 3
BLOCK = 16
GAMMA = 7.0
BUCKETS = ((2, 3), (4, 6), (7, 9), (10, 12))


def make_rows(gen: torch.Generator, num_rows: int, args) -> dict[str, torch.Tensor]:
    """Rows [R, L]: random prompt, then a loop (or, for the control share, random tokens)."""
    length = args.seq_len
    ids = torch.randint(FIRST_TOKEN, VOCAB, (num_rows, length), generator=gen)
    loss_mask = torch.zeros(num_rows, length, dtype=torch.bool)
    start = torch.randint(args.min_prompt, args.max_prompt + 1, (num_rows,), generator=gen)
    period = torch.randint(args.periods[0], args.periods[1] + 1, (num_rows,), generator=gen)
    is_loop = torch.rand(num_rows, generator=gen) < args.loop_share
    for r in range(num_rows):
        s, t = int(start[r]), int(period[r])
        loss_mask[r, s:] = True
        if is_loop[r]:
            # Distinct tokens in the pattern: the anchor's previous occurrence is unambiguous.
            pattern = FIRST_TOKEN + torch.randperm(VOCAB - FIRST_TOKEN, generator=gen)[:t]
            reps = (length - s + t - 1) // t
            ids[r, s:] = pattern.repeat(reps)[: length - s]
    return {"ids": ids, "loss_mask": loss_mask, "start": start, "period": period, "is_loop": is_loop}


def build_target(args):
    model = build_tiny_target("qwen3", vocab_size=VOCAB, seed=0)
    with torch.no_grad():
        # Tied embeddings at the 0.02 init give near-uniform logits; x25 makes the LM head as sharp
        # as a trained model's (as the training tests' confident target does) and the token
        # identity dominant in every layer's residual stream.
        model.get_input_embeddings().weight.mul_(25.0)
    return as_frozen_target(model, args.feature_layers)


def features(target, ids: torch.Tensor, prev_token: bool) -> torch.Tensor:
    feats = target.features(ids)
    if prev_token:
        hidden = target.hidden_size
        previous = torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], dim=1)
        emb = target.embed_tokens(previous) * (previous > 0)[..., None]
        feats = feats.clone()
        feats[..., hidden : 2 * hidden] = emb
    return feats


def build_drafter(depth: int, args) -> DFlashDrafter:
    config = DFlashDraftConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=depth,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=3,
        target_layer_ids=list(args.feature_layers),
        mask_token_id=MASK_TOKEN_ID,
        block_size=BLOCK,
        layer_types=["full_attention"] * depth,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    torch.manual_seed(args.seed)
    return DFlashDrafter(config)


def train(drafter, target, args) -> list[float]:
    gen = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, args.steps, 0.04, "cosine", 0.0)
    )
    losses = []
    for step in range(args.steps):
        rows = make_rows(gen, args.rows_per_step, args)
        ids, loss_mask = rows["ids"], rows["loss_mask"]
        sample_index = torch.arange(args.rows_per_step) + step * args.rows_per_step
        anchors, keep = sample_anchors(loss_mask, args.num_anchors, args.seed, 0, sample_index)
        labels, valid = block_targets(ids, loss_mask, anchors, BLOCK)
        denom = denominator_weights(keep, valid, GAMMA).sum()
        hidden = drafter(
            features(target, ids, args.prev_token_features), ids, anchors, keep, target.embed_tokens
        )
        loss, _ = dflash_loss(hidden, target.lm_head.weight, labels, valid, keep, gamma=GAMMA, denom=denom)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % 100 == 0 or step == args.steps - 1:
            losses.append(round(float(loss.detach()), 4))
    return losses


@torch.no_grad()
def teacher_forced(drafter, target, rows, args) -> dict[str, torch.Tensor]:
    """Per loop row: correct [A, B-1] at anchors a >= start + 2T whose labels all lie in the row."""
    ids, start, period = rows["ids"], rows["start"], rows["period"]
    length = ids.shape[1]
    feats = features(target, ids, args.prev_token_features)
    first = start + 2 * period
    offsets = torch.arange(args.eval_anchors)
    # Evenly spread anchors over [first, L - B] (clamped duplicates are masked out by keep).
    span = (length - BLOCK - first).clamp_min(0)
    anchors = first[:, None] + (offsets[None] * (span[:, None] + 1)) // args.eval_anchors
    keep = (anchors <= length - BLOCK) & torch.cat(
        [torch.ones_like(anchors[:, :1], dtype=torch.bool), anchors[:, 1:] != anchors[:, :-1]], dim=1
    )
    hidden = drafter(feats, ids, anchors, keep, target.embed_tokens)
    logits = hidden[:, :, 1:] @ target.lm_head.weight.t()
    labels, valid = block_targets(ids, rows["loss_mask"], anchors, BLOCK)
    correct = (logits.argmax(-1) == labels) & valid & keep[..., None]
    return {"correct": correct, "counted": valid & keep[..., None]}


def summarize(tf: dict[str, torch.Tensor], rows) -> dict:
    correct, counted, period = tf["correct"].float(), tf["counted"].float(), rows["period"]
    out = {"by_period": {}, "by_bucket": {}}
    for t in range(2, 13):
        sel = (period == t) & rows["is_loop"]
        if sel.any():
            acc = correct[sel].sum((0, 1)) / counted[sel].sum((0, 1)).clamp_min(1)
            k = torch.arange(1, BLOCK)
            out["by_period"][t] = {
                "acc": [round(float(a), 3) for a in acc],
                "k<T": round(float(acc[k < t].mean()), 3) if (k < t).any() else None,
                "k>=T": round(float(acc[k >= t].mean()), 3),
            }
    for lo, hi in BUCKETS:
        sel = (period >= lo) & (period <= hi) & rows["is_loop"]
        acc = correct[sel].sum((0, 1)) / counted[sel].sum((0, 1)).clamp_min(1)
        out["by_bucket"][f"{lo}-{hi}"] = [round(float(a), 3) for a in acc]
    loops = rows["is_loop"]
    accepted = (correct[loops] > 0).long().cumprod(-1).sum(-1)
    kept = counted[loops][..., 0] > 0
    out["tf_tau_loops"] = round(float((1 + accepted.float())[kept].mean()), 3)
    return out


def exact_tau(drafter, target, rows) -> dict:
    """Sequential tau of the drafter and of prompt lookup, the rows' responses as continuations."""
    ids, start = rows["ids"], rows["start"]
    out = {}
    for name, sel in (("loops", rows["is_loop"]), ("control", ~rows["is_loop"])):
        index = sel.nonzero().flatten().tolist()
        prompts = [ids[r, : int(start[r])].tolist() for r in index]
        conts = [ids[r, int(start[r]) :].tolist() for r in index]
        result = exact_acceptance(
            target, drafter, prompts, conts, max_new_tokens=ids.shape[1], eos_token_ids=set(),
            methods=("dflash", "ngram"), diagnose=False,
        )  # fmt: skip
        out[name] = {m: round(s["tau"], 3) for m, s in result["methods"].items()}
        out[name]["whole_block_rounds"] = {
            m: f"{s['accept_length_histogram'][-1]}/{s['rounds']}" for m, s in result["methods"].items()
        }
    return out


def print_tables(paths: list[str]) -> None:
    """Markdown tables from result files: accuracy per position by period bucket, and per period."""
    show = [1, 2, 4, 8, 11, 15]
    print("| run | depth | T | " + " | ".join(f"k={k}" for k in show) + " | tf tau | exact tau |")
    print("|---|---|---|" + "---|" * (len(show) + 2))
    for path in paths:
        results = json.load(open(path))
        a = results["args"]
        name = f"{a['steps']} steps" + (", prev-token features" if a["prev_token_features"] else "")
        for depth, run in results["runs"].items():
            exact = run.get("exact", {}).get("loops", {})
            for bucket, acc in run["by_bucket"].items():
                cells = " | ".join(f"{acc[k - 1]:.2f}" for k in show)
                taus = f"{run['tf_tau_loops']:.2f} | {exact.get('dflash', float('nan')):.2f}"
                print(f"| {name} | {depth} | {bucket} | {cells} | {taus} |")
    print("\n| run | depth | " + " | ".join(f"T={t}" for t in range(2, 13)) + " |")
    print("|---|---|" + "---|" * 11)
    for path in paths:
        results = json.load(open(path))
        a = results["args"]
        name = f"{a['steps']} steps" + (", prev-token features" if a["prev_token_features"] else "")
        for depth, run in results["runs"].items():
            cells = []
            for t in range(2, 13):
                v = run["by_period"].get(str(t))
                cells.append("-" if v is None else f"{v['k<T']:.2f} / {v['k>=T']:.2f}")
            print(f"| {name} | {depth} | " + " | ".join(cells) + " |")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="1,2,4,6")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rows-per-step", type=int, default=8)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=80)
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=16)
    p.add_argument("--periods", default="2,12", help="smallest,largest loop period")
    p.add_argument("--loop-share", type=float, default=0.75)
    p.add_argument("--feature-layers", default="0,1,2")
    p.add_argument("--prev-token-features", action="store_true")
    p.add_argument("--eval-rows", type=int, default=192)
    p.add_argument("--eval-anchors", type=int, default=12)
    p.add_argument("--no-exact", action="store_true", help="skip the sequential exact tau")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument(
        "--tables", nargs="+", default=None, help="print markdown tables of these result files, run nothing"
    )
    args = p.parse_args()
    args.periods = tuple(int(x) for x in args.periods.split(","))
    args.feature_layers = [int(x) for x in args.feature_layers.split(",")]
    if args.prev_token_features and len(args.feature_layers) < 2:
        raise ValueError("--prev-token-features replaces the second feature slice: give >= 2 feature layers")
    if (
        not 2 <= args.periods[0] <= args.periods[1]
        or args.seq_len < args.max_prompt + 2 * args.periods[1] + BLOCK
    ):
        raise ValueError("--periods lo,hi with 2 <= lo <= hi, and --seq-len >= max prompt + 2 * hi + 16")
    return args


def main() -> None:
    args = parse_args()
    if args.tables:
        print_tables(args.tables)
        return
    torch.set_num_threads(args.threads)
    target = build_target(args)
    held_out = make_rows(torch.Generator().manual_seed(10_000 + args.seed), args.eval_rows, args)
    results = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "runs": {}}
    show = [1, 2, 3, 4, 6, 8, 11, 15]
    for depth in [int(d) for d in args.depths.split(",")]:
        started = time.perf_counter()
        drafter = build_drafter(depth, args)
        losses = train(drafter, target, args)
        drafter.eval()
        run = {"train_seconds": round(time.perf_counter() - started, 1), "losses": losses}
        run.update(summarize(teacher_forced(drafter, target, held_out, args), held_out))
        if not args.no_exact:
            run["exact"] = exact_tau(drafter, target, held_out)
        results["runs"][depth] = run
        print(f"depth {depth}: {run['train_seconds']} s, loss {losses[0]} -> {losses[-1]}, "
              f"tf tau (loops) {run['tf_tau_loops']}, exact {run.get('exact')}", flush=True)  # fmt: skip
        for bucket, acc in run["by_bucket"].items():
            print(f"  T {bucket:>5}: " + " ".join(f"k{k}={acc[k - 1]:.2f}" for k in show), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
