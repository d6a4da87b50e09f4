"""``dflash-train data-stats``: what a recipe's data becomes before any GPU time is spent.

Tokenizes (or loads the cache of) the recipe's data with the target's tokenizer and reports rows,
tokens, response tokens, the length histogram by bucket, padding waste, skips by reason, how many
rows train from the generated token ids they store (``data.stored_ids``) and how many replies were
cut at regen's ``--max-new-tokens`` (trained without their end-of-turn label, ``data.tokenize``).
The padding waste is reported for both batching modes (length buckets and ``data.packing``), so
the choice can be made before training (docs/data.md, "Packing").
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dflash_train.config import RunConfig, load_config
from dflash_train.data.loader import TrainData, build_train_data, check_data_and_tokenizer


def load_target_tokenizer(cfg: RunConfig):
    """The tokenizer ``train`` would use, with the target path resolved exactly as ``train`` resolves it.

    ``builtin:<name>`` through the registry, a local path checked for existence, a hub id as is; a
    ``preset:`` target or a directory without tokenizer files has none, which is refused with the
    same error as ``train``'s. Only the tokenizer is loaded, never the model.
    """
    from dflash_train.models.target_loading import check_local_path, load_tokenizer, resolve_target_path

    tokenizer = None
    if not cfg.target.path.startswith("preset:"):
        path = resolve_target_path(cfg.target.path)
        check_local_path(path)
        tokenizer = load_tokenizer(path, cfg.target.trust_remote_code)
    check_data_and_tokenizer(cfg, tokenizer)
    return tokenizer


def run_data_stats(recipe: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Print a readable summary of the recipe's data and return the numbers as a dict."""
    cfg = load_config(recipe, overrides)
    tokenizer = load_target_tokenizer(cfg)
    data = build_train_data(cfg.data, tokenizer, seed=cfg.train.seed, rank=0, world_size=1)
    stats = data.stats
    print_histogram(stats.rows_per_bucket, stats.rows_per_batch, stats.batches_per_bucket)
    for reason, example in sorted(data.skips.examples.items()):
        print(f"skipped {reason}: {stats.skips.get(reason, 0)} (first: {example})")
    print_token_id_sources(data)
    print(
        f"replies cut at regen's --max-new-tokens (trained without their end-of-turn label): "
        f"{stats.replies_cut}, in {stats.rows_with_cut_reply} of {stats.num_rows} rows"
    )
    waste = waste_by_mode(data)
    print(
        f"padding waste: buckets {waste['buckets']:.1%}, packing {waste['packing']:.1%} "
        f"({waste['conversations_per_row']:.2f} conversations per packed row of {data.buckets[-1]}); "
        f"this recipe uses {'packing' if data.pack is not None else 'buckets'}"
    )
    result = {
        "rows": stats.num_rows,
        "tokens": stats.num_tokens,
        "response_tokens": stats.num_response_tokens,
        "rows_per_bucket": stats.rows_per_bucket,
        "steps_per_epoch": stats.steps_per_epoch,
        "padding_waste": round(stats.padding_waste, 4),
        "packing": data.pack is not None,
        "padding_waste_buckets": round(waste["buckets"], 4),
        "padding_waste_packed": round(waste["packing"], 4),
        "conversations_per_row": round(waste["conversations_per_row"], 3),
        "skips": stats.skips,
        "rows_from_token_ids": stats.rows_from_token_ids,
        "rows_not_round_trip": stats.rows_not_round_trip,
        "token_ids_fallback": stats.token_ids_fallback,
        "replies_cut": stats.replies_cut,
        "rows_with_cut_reply": stats.rows_with_cut_reply,
        "cache": str(data.tokenized.directory),
    }
    return result


def print_token_id_sources(data: TrainData) -> None:
    """Rows trained from stored generated ids, and the rows whose stored ids fell back to their text."""
    stats = data.stats
    print(
        f"rows from stored token ids: {stats.rows_from_token_ids} of {stats.num_rows} "
        f"({stats.rows_not_round_trip} of them would re-tokenize from their text to other ids)"
    )
    for reason, count in stats.token_ids_fallback.items():
        first = data.tokenized.id_fallback_examples.get(reason, "")
        print(f"stored token ids not used, trained from text, {reason}: {count} (first: {first})")


def waste_by_mode(data: TrainData) -> dict[str, float]:
    """Padding waste of ``data``'s rows with length buckets and with packing (same tokens, one rank)."""
    packing = not data.cfg.packing
    other = TrainData(
        data.tokenized,
        replace(data.cfg, packing=packing),
        seed=data.seed,
        rank=0,
        world_size=1,
        pad_id=data.pad_id,
    )
    packed, bucketed = (other, data) if packing else (data, other)
    return {
        "buckets": bucketed.stats.padding_waste,
        "packing": packed.stats.padding_waste,
        "conversations_per_row": packed.stats.conversations_per_row,
    }


def print_histogram(rows: dict[int, int], rows_per_batch: dict[int, int], batches: dict[int, int]) -> None:
    total = max(sum(rows.values()), 1)
    print(f"{'bucket':>8} {'rows':>9} {'share':>6} {'rows/batch':>10} {'batches':>8}")
    for length, count in rows.items():
        bar = "#" * round(40 * count / total)
        print(
            f"{length:>8} {count:>9} {count / total:>6.1%} {rows_per_batch[length]:>10} {batches[length]:>8} {bar}"
        )
