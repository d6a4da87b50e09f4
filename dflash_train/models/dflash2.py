"""DFlash2's additions to the DFlash drafter (architecture only): a grouped dynamic causal
convolution around both sublayers of every layer, and the candidate selector.

DFlash2 ("Keep Drafting Parallel", Inco AI / z-lab). The facts below are read from vLLM's
``model_executor/models/qwen3_dflash2.py`` and ``v1/worker/gpu/spec_decode/dflash2/speculator.py``
(the serving side) and checked against the public training implementations (TorchSpec's DFlash2
wrapper, speculators' ``dflash2``); the code here is written for this project.

Convolution (``attention_conv``, ``mlp_conv`` in every layer). Around a sublayer f with normed
input x: ``y = finish(f(prepare(x)), coefficients)``. Both convolutions are depthwise over the
block positions with ``conv_kernel_size`` taps (tap t reads block position k - t; positions before
the block's start read zero, so no block ever sees another), and their per-channel kernels are a
static ``base_kernel[side, t, H]`` plus a dynamic correction shared by each group of
``conv_group_size`` channels, predicted from x by ``kernel_projection`` (H -> 2 * taps * groups):
side 0 for the convolution before the sublayer, side 1 for the one after it. The context K/V
(``hidden_norm(fc(features))``) is not convolved. Initialised as the identity (tap 0 = 1, no
dynamic part), so an untrained DFlash2 layer is a DFlash layer.

Selector (``candidate_selector``). Per predicted position k the target's LM head over the final
hidden state h_k gives the parallel logits; their top ``selector_top_k`` are the candidates, scored
``unary(c) + <predecessor_codebook[p] * hidden_projection(h_k), successor_codebook[c]>`` for a
predecessor token p. Drafting walks left to right: p is the anchor at the first position, then the
candidate picked at the previous position; the pick is the best-scored candidate (ties to the
higher-ranked one). Training scores candidates against the gold predecessor (``train/variant_terms.py``).

Shapes: R rows, T block tokens (a multiple of B), B block size, H hidden, G groups, M blocks,
D predicted positions per block, K candidates, r selector rank, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.models.drafter import DFlashDecoderLayer
from dflash_train.models.drafter_config import DFlashDraftConfig


def grouped_causal_conv(x: Tensor, dynamic: Tensor, base: Tensor, block_size: int, group_size: int) -> Tensor:
    """x [R, T, H], dynamic [R, T, taps, G], base [taps, H] -> [R, T, H], convolved inside each block.

    ``y[k] = sum_t (base[t] + dynamic[k, t, group]) * x[k - t]`` with x[k - t] = 0 for k < t."""
    rows, tokens, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    blocks = x.view(rows, tokens // block_size, block_size, groups, group_size)
    dynamic = dynamic.to(x.dtype).view(rows, tokens // block_size, block_size, taps, groups, 1)
    kernel = base.to(x.dtype).view(taps, groups, group_size)
    out = None
    for tap in range(taps):
        shifted = blocks if tap == 0 else F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
        term = (kernel[tap] + dynamic[:, :, :, tap]) * shifted
        out = term if out is None else out + term
    return out.view(rows, tokens, hidden)


class GroupedDynamicConv(nn.Module):
    """The two convolutions around one sublayer; the dynamic kernels of both come from its input."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        self.taps, self.group_size = config.conv_kernel_size, config.conv_group_size
        self.block_size = config.block_size
        groups = config.hidden_size // self.group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, config.hidden_size))
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * self.taps * groups, bias=False)

    def reset_variant_parameters(self) -> None:
        """Identity: tap 0 passes x through, no dynamic part (DFlash2's initialisation)."""
        nn.init.zeros_(self.kernel_projection.weight)
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The sublayer's input x [R, T, H] convolved, and the dynamic kernel of ``finish``."""
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.taps, -1))  # [R, T, 2, taps, G]
        before = grouped_causal_conv(
            x, dynamic[:, :, 0], self.base_kernel[0], self.block_size, self.group_size
        )
        return before, dynamic[:, :, 1]

    def finish(self, y: Tensor, dynamic: Tensor) -> Tensor:
        """The sublayer's output y [R, T, H] convolved with the kernel ``prepare`` predicted."""
        return grouped_causal_conv(y, dynamic, self.base_kernel[1], self.block_size, self.group_size)


def dflash2_layer_step(layer, hidden: Tensor, k_ctx: Tensor, v_ctx: Tensor, block_rope, attend) -> Tensor:
    """One DFlash2 decoder layer: DFlash's pre-norm attention and SwiGLU, each between the two
    convolutions of its ``GroupedDynamicConv`` (``layer`` is a ``DFlashDecoderLayer`` with
    ``attention_conv`` and ``mlp_conv``)."""
    x, dynamic = layer.attention_conv.prepare(layer.input_layernorm(hidden))
    q = layer.self_attn.project_q(x, block_rope)
    k_blk, v_blk = layer.self_attn.project_kv(x, block_rope)
    out = layer.self_attn.o_proj(attend(q, k_ctx, v_ctx, k_blk, v_blk).transpose(1, 2).flatten(2))
    hidden = hidden + layer.attention_conv.finish(out, dynamic)
    x, dynamic = layer.mlp_conv.prepare(layer.post_attention_layernorm(hidden))
    return hidden + layer.mlp_conv.finish(layer.mlp(x), dynamic)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer whose attention and MLP each sit between two grouped dynamic convolutions."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__(config)
        self.attention_conv = GroupedDynamicConv(config)
        self.mlp_conv = GroupedDynamicConv(config)

    def forward_with_context_kv(
        self, hidden: Tensor, k_ctx: Tensor, v_ctx: Tensor, block_rope, attend
    ) -> Tensor:
        return dflash2_layer_step(self, hidden, k_ctx, v_ctx, block_rope, attend)


class CandidateSelector(nn.Module):
    """Low-rank predecessor/successor rescoring of the parallel head's top-K candidates."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        self.top_k = config.selector_top_k
        rank = config.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def reset_variant_parameters(self, std: float = 0.02) -> None:
        """Successors start at zero: an untrained selector picks the parallel head's argmax."""
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.zeros_(self.successor_codebook)

    def gate(self, hidden: Tensor, predecessor_ids: Tensor) -> Tensor:
        """``predecessor_codebook[p] * hidden_projection(h)``: hidden [..., H], ids [...] -> [..., r]."""
        return F.embedding(predecessor_ids, self.predecessor_codebook) * self.hidden_projection(hidden)

    def walk(self, candidate_ids: Tensor, unary: Tensor, hidden: Tensor, anchor_ids: Tensor) -> Tensor:
        """The drafts [M, D]: left to right, the best candidate given the previous pick.

        candidate_ids / unary [M, D, K] (the parallel head's top-K, best first, and their logits),
        hidden [M, D, H] (final-norm states of the predicted positions), anchor_ids [M]. Scores are
        computed in float32 (a bf16 rank-r dot product can reorder near-tied candidates)."""
        projected = self.hidden_projection(hidden).float()  # [M, D, r]
        predecessor = anchor_ids
        picks = []
        for k in range(candidate_ids.shape[1]):
            gate = self.predecessor_codebook[predecessor].float() * projected[:, k]  # [M, r]
            successors = self.successor_codebook[candidate_ids[:, k]].float()  # [M, K, r]
            scores = unary[:, k].float() + (successors * gate[:, None]).sum(-1)
            best = scores.argmax(-1, keepdim=True)  # the first maximum: ties go to the higher rank
            predecessor = candidate_ids[:, k].gather(1, best)[:, 0]
            picks.append(predecessor)
        return torch.stack(picks, dim=1)
