"""The DFlash drafter's block step with a static context cache, for CUDA graphs (batch 1).

``DFlashProposer`` grows the drafter's context K/V with ``torch.cat`` every round; that changes
shapes, so it cannot be captured. ``StaticDFlashProposer`` keeps, per drafter layer, a
preallocated K/V buffer of ``capacity`` slots (``max_length + block_size``) and runs one
fixed-shape step per round that

1. projects the round's new target features (the committed positions: at most B, or B + 1 for
   DSpark, padded to that many rows) into context K/V and writes them at slots ``num_context ..``
   (``index_copy_``); padded rows land on slots at or after the block's start, which no query
   sees and the next round overwrites;
2. runs the block ``[last token, MASK * (B-1)]`` at positions start..start+B-1 through the drafter's
   layers (``forward_with_context_kv``) with a mask over the whole buffer built from the start
   tensor by the same visibility rule as training (``masks.visible``): context slot p is visible
   iff p < start (and inside the window for sliding layers);
3. applies the final norm and the drafter's ``draft_tokens`` (the target's LM head, then argmax,
   DFlash2's selector walk or DSpark's Markov chain): the round's draft tokens.

The prompt's features (more than B rows) are written eagerly before the first step. On CUDA the
step is captured once as a CUDA graph and replayed; on CPU it runs eagerly on the same buffers.
This is the static drafter cache (not a padded context bucket): models/drafter.py is not changed for it,
only its layers and projections are called.

Shapes: B block size, C capacity (slots), n*H features, Hkv kv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_train.eval.proposers import DFlashProposer, Draft, Proposer
from dflash_train.eval.static_session import GraphedStep
from dflash_train.models.masks import masked_sdpa, visible
from dflash_train.models.variant import drafted_tokens


class StaticDFlashProposer(Proposer):
    """A ``DFlashProposer`` with a static context cache and a graphed block step; reusable across
    requests (``start`` resets it). ``max_length`` bounds prompt + output + block."""

    def __init__(self, proposer: DFlashProposer, *, max_length: int, use_cuda_graphs: bool | None = None):
        self.drafter = proposer.drafter
        self.embed = proposer.embed
        self.lm_head = proposer.lm_head
        self.block_size = proposer.block_size
        self.mask_token_id = proposer.mask_token_id
        config = self.drafter.config
        self.device = self.embed.weight.device
        self.dtype = self.drafter.dtype
        self.capacity = max_length + self.block_size
        shape = (1, config.num_key_value_heads, self.capacity, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.drafter.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.drafter.layers]
        self.num_context = 0
        num_features = config.num_target_features * config.hidden_size
        # Static inputs of the step: new feature rows, where they go, where the block starts, its first token.
        # A round commits at most the previous bonus and its drafts: num_verify_tokens rows (B; B + 1 for DSpark).
        self.feature_rows = config.num_verify_tokens
        self._features = torch.zeros(self.feature_rows, num_features, dtype=self.dtype, device=self.device)
        self._write_start = torch.zeros((), dtype=torch.long, device=self.device)
        self._block_start = torch.zeros((), dtype=torch.long, device=self.device)
        self._offsets = torch.arange(self.block_size, device=self.device)
        use_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.use_cuda_graphs = use_graphs
        self._step = GraphedStep(self._forward, self.block_size, self.device, use_graphs)

    def start(self, prompt_ids: Sequence[int]) -> None:
        self.num_context = 0

    # -- context ------------------------------------------------------------------------------------
    def _write_context(self, features: torch.Tensor, start: torch.Tensor) -> None:
        """Context K/V of features [P, n*H] written at slots start..start+P-1 of every layer."""
        positions = start + torch.arange(features.shape[0], device=self.device)
        context = self.drafter.project_context(features[None])
        rope = self.drafter.rope(positions[None])
        for index, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.project_kv(context, rope)
            self.keys[index].index_copy_(2, positions, k)
            self.values[index].index_copy_(2, positions, v)

    # -- the step -----------------------------------------------------------------------------------
    def _attend(self, layer_type: str):
        spec = self.drafter.mask_specs[layer_type]
        slots = torch.arange(self.capacity, device=self.device)
        k = self._offsets
        keep = visible(
            spec,
            anchor=self._block_start,
            q_slot=torch.zeros(1, device=self.device, dtype=torch.long),
            q_k=k[:, None],
            is_context=torch.cat(
                [torch.ones_like(slots, dtype=torch.bool), torch.zeros_like(k, dtype=torch.bool)]
            ),
            ctx_pos=torch.cat([slots, torch.zeros_like(k)]),
            kv_slot=torch.cat([torch.full_like(slots, -1), torch.zeros_like(k)]),
            kv_k=torch.cat([torch.zeros_like(slots), k]),
        )[None, None]  # [1, 1, B, C + B]

        def attend(q, k_ctx, v_ctx, k_blk, v_blk):
            return masked_sdpa(q, torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2), keep)

        return attend

    def _forward(self, block_ids: torch.Tensor) -> torch.Tensor:
        """block_ids [1, B] -> draft tokens [D]; only tensor ops on static buffers (capturable)."""
        self._write_context(self._features, self._write_start)
        hidden = self.drafter.embed_block(block_ids, self.embed)
        rope = self.drafter.rope((self._block_start + self._offsets)[None])
        attends = {name: self._attend(name) for name in self.drafter.mask_specs}
        for index, layer in enumerate(self.drafter.layers):
            attend = attends[self.drafter.config.layer_types[index]]
            hidden = layer.forward_with_context_kv(hidden, self.keys[index], self.values[index], rope, attend)
        hidden = self.drafter.norm(hidden)
        return self.drafter.draft_tokens(hidden, block_ids[:, 0], self.lm_head)[0]

    @torch.no_grad()
    def propose(self, accepted_ids, new_features, block_size):
        if block_size != self.drafter.config.num_verify_tokens:
            raise ValueError(
                f"the drafter was trained with block size {self.block_size} "
                f"({self.drafter.config.num_draft_tokens} drafts per round), the loop asked for rounds of {block_size}"
            )
        num_new = 0 if new_features is None else new_features.shape[0]
        start = len(accepted_ids) - 1
        if self.num_context + num_new != start:
            raise AssertionError(
                f"drafter context has {self.num_context + num_new} positions, block starts at {start}"
            )
        if start + self.block_size > self.capacity:
            raise ValueError(
                f"static drafter context of {self.capacity} slots is too short for position {start}"
            )
        self._write_start.fill_(self.num_context)
        if num_new > self.feature_rows:  # the prompt: written eagerly, the step then writes only padding
            self._write_context(new_features.to(self.device, self.dtype), self._write_start)
            self._write_start.fill_(start)
            num_new = 0
        if num_new > 0:
            self._features[:num_new].copy_(new_features.to(self.dtype), non_blocking=True)
        self._features[num_new:].zero_()
        self._block_start.fill_(start)
        self.num_context = start
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long)
        block[0, 0] = accepted_ids[-1]
        # host sync: the loop needs the tokens; a block stopped early drafts fewer
        return Draft(tokens=drafted_tokens(self._step.run(block).tolist()))

    def propose_topk(self, accepted_ids, new_features, block_size, k):
        raise NotImplementedError("the static drafter step has no top-k; DDTree uses DFlashProposer")
