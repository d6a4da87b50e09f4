"""``dflash-train data-stats``: what a recipe's data becomes before any GPU time is spent.

Tokenizes (or loads the cache of) the recipe's data with the target's tokenizer and reports rows,
tokens, response tokens, the length histogram by bucket, padding waste and skips by reason.
"""

from __future__ import annotations

from typing import Any

from dflash_train.config import TargetConfig, load_config
from dflash_train.data.loader import build_train_data


def load_target_tokenizer(target: TargetConfig):
    """The target's tokenizer (with its chat template) from a checkpoint directory or hub id."""
    if target.path.startswith(("builtin:", "preset:")):
        raise ValueError(
            f"target.path={target.path!r} is a built-in/random-weight target without a saved tokenizer; "
            "point target.path at a checkpoint directory or hub id that has tokenizer files "
            "(e.g. a directory written by the demo), or pass target.path=... on the command line"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target.path, trust_remote_code=target.trust_remote_code)


def run_data_stats(recipe: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Print a readable summary of the recipe's data and return the numbers as a dict."""
    cfg = load_config(recipe, overrides)
    tokenizer = load_target_tokenizer(cfg.target)
    data = build_train_data(cfg.data, tokenizer, seed=cfg.train.seed, rank=0, world_size=1)
    stats = data.stats
    print_histogram(stats.rows_per_bucket, stats.rows_per_batch, stats.batches_per_bucket)
    for reason, example in sorted(data.skips.examples.items()):
        print(f"skipped {reason}: {stats.skips.get(reason, 0)} (first: {example})")
    result = {
        "rows": stats.num_rows,
        "tokens": stats.num_tokens,
        "response_tokens": stats.num_response_tokens,
        "rows_per_bucket": stats.rows_per_bucket,
        "steps_per_epoch": stats.steps_per_epoch,
        "padding_waste": round(stats.padding_waste, 4),
        "skips": stats.skips,
        "cache": str(data.tokenized.directory),
    }
    return result


def print_histogram(rows: dict[int, int], rows_per_batch: dict[int, int], batches: dict[int, int]) -> None:
    total = max(sum(rows.values()), 1)
    print(f"{'bucket':>8} {'rows':>9} {'share':>6} {'rows/batch':>10} {'batches':>8}")
    for length, count in rows.items():
        bar = "#" * round(40 * count / total)
        print(
            f"{length:>8} {count:>9} {count / total:>6.1%} {rows_per_batch[length]:>10} {batches[length]:>8} {bar}"
        )
