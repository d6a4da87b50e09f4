"""``dflash-train bench lengths FILE|DIST``: the full train step on a real length distribution,
with length buckets and with packing.

A fixed-shape synthetic row says how fast a full row trains; real chat data is mostly short, and
what a user gets is *real* (non-padding) tokens per second. This bench builds conversations with
the lengths of ``FILE`` (a JSONL whose rows carry ``length`` or ``num_tokens``, optionally
``response_tokens``; or a bare integer per line) or of a named distribution (``LENGTH_DISTRIBUTIONS``),
random ids and a prompt-then-response mask, feeds them through the trainer's own data pipeline
(``TrainData``) once with ``data.seq_buckets`` and once with ``data.packing``, and times full
optimizer steps of each. Reported per mode: real tokens/s, batch tokens/s, the measured padding
waste of the timed steps and of the whole epoch plan, and the warm-up apart (``warmup_s``,
``compiled_graphs_warmup``): compiled code is specialised per batch shape, so the warm-up serves one
batch of every shape first and the timed steps compile nothing (``compiled_graphs_timed`` 0).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.bench.progress import StepProgress
from dflash_train.bench.train_step import (
    BenchOptions,
    add_shape_arguments,
    bench_config,
    build_bench_run,
    result_header,
    time_train_steps,
)
from dflash_train.data.cache import TokenizedData
from dflash_train.data.loader import TrainData
from dflash_train.data.skips import SkipCounts
from dflash_train.train.parallel import pick_device, use_expandable_segments

# Named synthetic shapes (log-normal token counts, seeded): NOT measured datasets. "short-chat" is
# the single-turn mix the real-target run saw (nearly everything under ~1K tokens).
LENGTH_DISTRIBUTIONS = {
    "short-chat": [(1.0, 300, 0.6)],  # (weight, median tokens, sigma of log length)
    "mixed-chat": [(0.7, 400, 0.8), (0.3, 2000, 0.5)],
    "long-chat": [(1.0, 2500, 0.5)],
}
NUM_DRAWN = 4096  # conversations drawn from a named distribution
PROMPT_SHARE = 0.3  # of a drawn conversation's tokens, when the file gives no response count

HELP = "The full train step on a length distribution: length buckets against data.packing, real tokens/s."


@dataclass(frozen=True, kw_only=True)
class LengthsBenchOptions(BenchOptions):
    """What ``dflash-train bench lengths`` measures: the train mode's shape on real lengths."""

    # A JSONL of lengths, or a name in LENGTH_DISTRIBUTIONS.
    lengths: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.drafter_only or self.profile:
            raise ValueError(
                "bench lengths times the full step on real data shapes; drop --drafter-only/--profile"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The distribution, then the train mode's shape arguments."""
    parser.add_argument(
        "lengths",
        metavar="FILE|DIST",
        help="a JSONL of {'length': N} rows (e.g. from data-stats) or a named distribution: "
        + ", ".join(LENGTH_DISTRIBUTIONS),
    )
    add_shape_arguments(parser)
    parser.set_defaults(drafter_only=False, profile="")  # the train mode's, fixed here


def load_lengths(spec: str, max_length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, str]:
    """(lengths, response token counts, description) of ``spec``: a named distribution or a JSONL file.

    Lengths are clipped to [8, max_length] (the largest bucket: what the overlong policy would do).
    """
    if spec in LENGTH_DISTRIBUTIONS:
        rng = np.random.default_rng(seed)
        parts = LENGTH_DISTRIBUTIONS[spec]
        which = rng.choice(len(parts), size=NUM_DRAWN, p=[w for w, _, _ in parts])
        medians = np.array([m for _, m, _ in parts])[which]
        sigmas = np.array([s for _, _, s in parts])[which]
        lengths = np.rint(medians * np.exp(sigmas * rng.standard_normal(NUM_DRAWN))).astype(np.int64)
        responses = None
        description = f"distribution {spec} ({NUM_DRAWN} draws)"
    else:
        lengths, responses = read_length_file(Path(spec))
        description = f"file {spec}"
    lengths = lengths.clip(8, max_length)
    if responses is None:
        responses = lengths - np.maximum(1, np.rint(PROMPT_SHARE * lengths).astype(np.int64))
    return lengths, np.minimum(responses, lengths - 1).clip(min=2), description


def read_length_file(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """Lengths (and response counts, when every row has them) of a JSONL length file."""
    if not path.is_file():
        raise ValueError(
            f"bench lengths {path}: not a file nor one of {sorted(LENGTH_DISTRIBUTIONS)}; give a JSONL with "
            '{"length": N} (optionally "response_tokens") per line, or a distribution name.'
        )
    lengths, responses = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            length = int(row if isinstance(row, int) else row.get("length", row.get("num_tokens")))
        except (ValueError, TypeError, AttributeError) as err:
            raise ValueError(
                f"{path}:{number}: expected an integer or an object with 'length' (or 'num_tokens'); got {line[:80]!r}"
            ) from err
        lengths.append(length)
        responses.append(row.get("response_tokens") if isinstance(row, dict) else None)
    if not lengths:
        raise ValueError(f"bench lengths {path}: the file has no rows")
    known = None if any(r is None for r in responses) else np.asarray(responses, dtype=np.int64)
    return np.asarray(lengths, dtype=np.int64), known


def synthetic_tokenized(
    lengths: np.ndarray, responses: np.ndarray, vocab_size: int, seed: int = 0
) -> TokenizedData:
    """Conversations of these lengths: random ids, the prompt first, then ``responses`` response tokens."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, vocab_size, size=int(offsets[-1]), dtype=np.int32)
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    loss_mask = position >= np.repeat(lengths - responses, lengths)
    return TokenizedData(
        ids=ids,
        loss_mask=loss_mask,
        offsets=offsets,
        origins=np.stack([np.zeros_like(lengths), np.arange(len(lengths))], axis=1),
        response_counts=responses.astype(np.int64),
        files=["lengths"],
        skips=SkipCounts(),
    )


class CountingData:
    """``TrainData`` for the bench: first one batch of every shape (warm-up: each bucket compiles
    once), then the epoch plan in order; records (real tokens, batch tokens) of every batch."""

    def __init__(self, data: TrainData) -> None:
        self.data, self.served = data, []
        self.epoch, self.steps_per_epoch = 0, data.steps_per_epoch
        shapes: dict[tuple[int, int], int] = {}
        for step in range(data.steps_per_epoch):
            shapes.setdefault(data.batch_at(0, step).shape, step)
        self.warmup = [data.batch_at(0, step) for step in shapes.values()]

    def next_batch(self):
        batch, epoch = (self.warmup.pop(0), 0) if self.warmup else self.data.next_batch()
        self.served.append((int(batch.attention_mask.sum()), batch.input_ids.numel()))
        return batch, epoch

    def log_stats(self) -> dict[str, float]:
        return self.data.log_stats()


def bucket_lengths(seq_len: int) -> list[int]:
    """Buckets of the bench's bucketed mode: the default recipe's ratios (1/4, 1/2, 1) of seq_len."""
    return sorted({max(seq_len // 4, 8), max(seq_len // 2, 8), seq_len})


def run_lengths_bench(args: LengthsBenchOptions) -> dict[str, Any]:
    """``dflash-train bench lengths``: buckets against packing on ``args.lengths`` at the preset shape."""
    cfg, seq_len, anchors = bench_config(args)
    use_expandable_segments()  # the allocator configuration training uses
    device = pick_device(args.device)
    return {
        **result_header(args, device, seq_len, anchors),
        **run_length_bench(args, cfg, seq_len, device),
        "torch": torch.__version__,
    }


def run_length_bench(
    args, cfg, seq_len: int, device: torch.device, buckets: list[int] | None = None
) -> dict[str, Any]:
    """Time ``args.steps`` optimizer steps per mode (after warm-up) on ``args.lengths``, with
    ``buckets`` (default ``bucket_lengths(seq_len)``) in the bucketed mode.

    Each mode's run is built with that mode's data config, as training would be (the compiled
    drafter layers' recompile limit covers its bucket shapes, ``drafter_recompile_limit``); both
    modes share one process, hence one compile cache, so the limit covers the two together.
    """
    from dflash_train.train.builders import drafter_recompile_limit, ensure_recompile_limit

    lengths, responses, description = load_lengths(args.lengths, seq_len)
    buckets = buckets or bucket_lengths(seq_len)
    data_cfg = replace(cfg.data, seq_buckets=buckets, token_budget=seq_len * args.rows)
    modes, target, recompile_limit = {}, None, 0
    for mode in ("buckets", "packing"):
        mode_cfg = replace(cfg, data=replace(data_cfg, packing=mode == "packing"))
        run = build_bench_run(mode_cfg, args.rows, seq_len, device, target=target)
        target = run.target
        if cfg.train.compile:
            recompile_limit += drafter_recompile_limit(run.draft_config.layer_types, mode_cfg.data)
            ensure_recompile_limit(recompile_limit)
        tokenized = synthetic_tokenized(lengths, responses, target.vocab_size)
        data = TrainData(tokenized, mode_cfg.data, seed=0, rank=0, world_size=1, pad_id=0)
        run.data = CountingData(data)
        shapes = len(run.data.warmup)
        with StepProgress(f"lengths {mode}", args.warmup + shapes + args.steps, args) as progress:
            timing = time_train_steps(run, args.steps, args.warmup + shapes, progress)
        # The timed steps' batches are the last ``steps * grad_accum`` served.
        real, total = np.asarray(run.data.served[-args.steps * cfg.train.grad_accum :]).sum(axis=0)
        elapsed = timing["step_s"] * args.steps
        modes[mode] = {
            "batch_shapes": shapes,
            "real_tokens_per_s": float(real) / elapsed,
            "batch_tokens_per_s": float(total) / elapsed,
            "padding_waste_timed": 1.0 - float(real) / max(float(total), 1.0),
            "padding_waste_epoch": data.stats.padding_waste,
            "steps_per_epoch": data.steps_per_epoch,
            "conversations_per_row": data.stats.conversations_per_row,
            **timing,
        }
        del run
    return {
        "lengths": description,
        "conversations": len(lengths),
        "mean_length": float(lengths.mean()),
        "buckets": buckets,
        "modes": modes,
        "packing_speedup": modes["packing"]["real_tokens_per_s"]
        / max(modes["buckets"]["real_tokens_per_s"], 1e-9),
        "target_kernels": target.kernels,  # what the shared target runs on, its compilation included
    }


# The mode's entry points (bench/modes.py).
Options = LengthsBenchOptions
run = run_lengths_bench
