"""DSpark's additions to the DFlash drafter (architecture only): the Markov head and the confidence head.

DSpark (arXiv 2607.05147). Facts read from DeepSpec (``deepspec/modeling/dspark/``: the authors'
code), SpecForge's ``dspark.py`` and SGLang's / vLLM's DSpark servers; written for this project.

Block layout (DeepSpec's ``sample_from_anchor``): the block is ``[anchor, MASK x (B-1)]`` at
positions a..a+B-1 as in DFlash, but slot k predicts the token AFTER it, ``ids[a+k+1]``, so every
slot drafts: B draft tokens per block, verified as B + 1 tokens (SGLang's
``--speculative-num-draft-tokens``, vLLM's ``num_speculative_tokens`` is B).

Markov head (``markov_head``, DeepSpec's "vanilla" head): a low-rank bigram bias on each slot's
logits from the token before the slot's label, ``logits_k += markov_w2(markov_w1[prev_k])``
(``markov_w1`` an embedding [V, r], ``markov_w2`` a linear r -> V). Drafting is semi-autoregressive:
one parallel backbone pass, then left to right ``prev_0 = anchor``, ``prev_k`` = the token drafted
at slot k-1 (greedy here). Training conditions on the gold previous token.

Confidence head (``confidence_head.proj``, a linear [H + r] -> 1 with bias): predicts per slot the
probability that the target accepts the draft, from the slot's hidden state and (DeepSpec's
``confidence_head_with_markov``) ``markov_w1[prev_k]``. Trained against ``1 - TV(p_draft, p_target)``
(``train/variant_terms.py``); engines use it to stop a block early (llama.cpp ``--spec-draft-p-min``),
which the drafter reproduces with ``set_draft_p_min`` (the eval's ``--draft-p-min``; 0, full blocks,
by default, as the engines).

Shapes: M blocks, D = B slots, H hidden, r Markov rank, V vocab.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash_train.models.drafter_config import DFlashDraftConfig


class MarkovHead(nn.Module):
    """``bias(prev) = markov_w2(markov_w1[prev])``: a rank-r bigram correction of the draft logits."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.vocab_size, bias=False)

    def reset_variant_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.markov_w1.weight, std=std)

    def bias(self, previous_ids: Tensor) -> Tensor:
        """Logit bias [..., V] for the slots whose previous token is ``previous_ids`` [...]."""
        return self.markov_w2(self.markov_w1(previous_ids))

    def greedy_chain(self, base_logits: Tensor, anchor_ids: Tensor) -> Tensor:
        """The drafts [M, D]: slot k takes argmax(base_logits[:, k] + bias(previous draft)), the
        previous draft of slot 0 being the anchor. base_logits [M, D, V] (float32)."""
        previous = anchor_ids
        picks = []
        for k in range(base_logits.shape[1]):
            previous = (base_logits[:, k] + self.bias(previous).float()).argmax(-1)
            picks.append(previous)
        return torch.stack(picks, dim=1)


class ConfidenceHead(nn.Module):
    """Per slot the logit of the target accepting its draft, from ``[h_k ; markov_w1[prev_k]]``."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        self.with_markov = config.confidence_head_with_markov
        extra = config.markov_rank if self.with_markov else 0
        self.proj = nn.Linear(config.hidden_size + extra, 1)

    def reset_variant_parameters(self) -> None:
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor, markov_embedding: Tensor | None) -> Tensor:
        """hidden [..., H], markov_embedding [..., r] (or None without the Markov input) -> [...]."""
        if self.with_markov:
            hidden = torch.cat([hidden, markov_embedding.to(hidden.dtype)], dim=-1)
        return self.proj(hidden).squeeze(-1)
