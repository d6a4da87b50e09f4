"""Batched greedy generation: the target's own continuation of many prompts at once.

Exact-mode acceptance (``eval/exact.py``) needs the target's greedy continuation of every prompt.
This runs them in batches: prompts sorted by length (less padding), LEFT-padded so every row's
next token sits in the last column, an attention mask that hides the padding, position ids that
restart at 0 on each row's first real token (so a row computes what it would alone), the model's
own KV / recurrent cache, and one argmax per step. A row stops at its first EOS token (kept) or at
``max_new_tokens``; finished rows keep stepping on a pad token until the batch is done (their
outputs are discarded), which keeps the cache layout trivial.

Left padding is exact for GatedDeltaNet (hybrid) targets too: transformers zeroes the padded
positions' mixer inputs, and a zero input leaves a zero conv / recurrent state at zero.

Tokenizers without a pad token (Llama-3 style) pad with EOS: the padded positions are masked, so
their id never matters.

Shapes: R rows, L padded prompt length, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch


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


@torch.no_grad()
def greedy_generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    pad_token_id: int,
) -> list[list[int]]:
    """Greedy continuations of one batch of prompts (EOS included when reached)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: use >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: greedy generation needs at least one prompt token")
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=device)
    outputs: list[torch.Tensor] = []
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    cache, step_ids = None, ids
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        token = out.logits[:, -1].argmax(-1)
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        outputs.append(token)
        done = done | torch.isin(token, eos)
        # One host sync per step: stop as soon as every row has finished.
        if bool(done.all()):
            break
        step_ids = token[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    generated = torch.stack(outputs, dim=1).tolist()
    return [cut_at_eos(row, eos_token_ids) for row in generated]


def cut_at_eos(tokens: list[int], eos_token_ids: Collection[int]) -> list[int]:
    """Tokens up to and including the first EOS (all of them when there is none)."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens


def greedy_continuations(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    pad_token_id: int,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Greedy continuations of every prompt, in input order, ``batch_size`` prompts per forward.

    ``on_batch(num_prompts)`` is called after each batch (progress bars).
    """
    results: list[list[int] | None] = [None] * len(prompts)
    for batch in length_sorted_batches([len(p) for p in prompts], batch_size):
        tokens = greedy_generate_batch(
            model,
            [prompts[i] for i in batch],
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
        )
        for i, row in zip(batch, tokens, strict=True):
            results[i] = row
        if on_batch is not None:
            on_batch(len(batch))
    return [r for r in results if r is not None]
