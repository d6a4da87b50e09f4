"""Batched greedy generation: the target's own continuation of many prompts at once.

Exact-mode acceptance (``eval/exact.py``) needs the target's greedy continuation of every prompt.
They come from the project's one generation engine (``generate/engine.py``, the same one synth and
regen use): ``batch_size`` slots refilled from a queue as rows end, a preallocated cache and, on
CUDA, a graph-captured decode step. A row stops at its first EOS token (kept) or at
``max_new_tokens``. GatedDeltaNet (hybrid) targets run there too; models that engine cannot run
(sliding-window or flash attention) fall back to its padded-batch engine, with a warning.

Tokenizers without a pad token (Llama-3 style) pad with EOS: the padded positions are masked, so
their id never matters.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from dflash_train.generate.engine import RowsCallback, build_generator
from dflash_train.generate.sampling import Sampling


def pad_token_for(tokenizer, eos_token_ids: Collection[int]) -> int:
    """The id used for padding: the tokenizer's pad token, else an EOS id, else 0 (always masked)."""
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is not None:
        return int(pad)
    return min(eos_token_ids) if eos_token_ids else 0


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first, so memory peaks early)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: use >= 1")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def greedy_continuations(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    pad_token_id: int,
    batch_size: int,
    on_rows: RowsCallback | None = None,
    engine: str = "auto",
) -> list[list[int]]:
    """Greedy continuations of every prompt (EOS included when reached), in input order, with
    ``batch_size`` rows decoding at a time. ``on_rows(num_prompts, num_tokens)`` is called as rows
    finish. ``engine``: ``build_generator``'s auto, slots or padded."""
    if not prompts:
        return []  # a rank with no held-out prompts
    generator = build_generator(model, num_slots=batch_size, engine=engine)
    generations = generator.generate(
        prompts,
        list(range(len(prompts))),  # greedy: the draw keys are never used
        max_new_tokens=max_new_tokens,
        stop_ids=eos_token_ids,
        pad_id=pad_token_id,
        sampling=Sampling(),
        on_rows=on_rows,
    )
    return [g.token_ids + ([g.stop_id] if g.finished else []) for g in generations]
