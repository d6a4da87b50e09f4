"""Shared pieces of the drafter-variant tests: a tiny drafter of each variant and a short fit with
the project's own loss (``train.loss.draft_loss``), so acceptance is partial."""

from __future__ import annotations

import torch

from dflash_train.config import DrafterConfig
from dflash_train.models import presets
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.train.loss import LossOptions, block_targets, draft_loss


def variant_drafter(target_config, mask_token_id: int, variant: str, block_size: int, seed: int = 0, **extra):
    """A tiny (preset ``tiny``) fp32 drafter of ``variant`` for a tiny target."""
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=block_size, variant=variant, **extra),
        target_config,
        target_layer_ids=[0, 2],
        mask_token_id=mask_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return DFlashDrafter(config)


def continuation_batch(prompts, continuations, max_new_tokens: int):
    """Right-padded ids [R, L], every candidate anchor [R, A] and its keep mask."""
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
    anchors = torch.tensor([len(p) for p in prompts])[:, None] + torch.arange(max_new_tokens)
    keep = anchors + 1 < lengths[:, None]
    mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
    return ids, anchors, keep, mask


def fit_variant_drafter(
    drafter, target, prompts, continuations, *, max_new_tokens, steps, lr=1e-2, options=None
):
    """A few Adam steps of the training objective on every anchor of the target's continuations."""
    ids, anchors, keep, mask = continuation_batch(prompts, continuations, max_new_tokens)
    features = target.features(ids)
    labels, valid = block_targets(ids, mask, anchors, drafter.config.num_verify_tokens)
    options = options or LossOptions(selector_weight=1.0 if drafter.config.variant == "dflash2" else 0.0)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    for _ in range(steps):
        out = drafter(features, ids, anchors, keep, target.embed_tokens, heads=True)
        denom = (valid & keep[..., None]).float().sum()
        loss, _ = draft_loss(
            out, target.lm_head.weight, labels, valid, keep, gamma=4.0, denom=denom, options=options
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


def golden_block_batch(
    anchors: list[list[int]], rows: int = 2, length: int = 40, vocab: int = 320, mask_id: int = 300
):
    """The variants' golden-test batch, drawn in a fixed order from one seeded generator: features
    [R, L, 2 x 64], ids [R, L] below the mask id, anchors [R, A], a target embedding and LM head
    (and the generator, for a test that draws more from the same stream)."""
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(rows, length, 2 * 64, generator=gen)
    ids = torch.randint(0, mask_id, (rows, length), generator=gen)
    embed = torch.nn.Embedding(vocab, 64)
    torch.nn.init.normal_(embed.weight, generator=gen)
    lm_head = torch.nn.Linear(64, vocab, bias=False)
    torch.nn.init.normal_(lm_head.weight, std=0.5, generator=gen)
    return features, ids, torch.tensor(anchors), embed, lm_head, gen
