"""DFlash2 ("Keep Drafting Parallel", Inco AI / z-lab): the DFlash backbone with a grouped dynamic
causal convolution around both sublayers of every layer, and a candidate selector that rescores the
LM head's top-K left to right (architecture: ``models/dflash2.py``; its loss term:
``train/variant_terms.py``; docs/training.md "Variants").

Export ``DFlash2DraftModel`` with ``dflash_config.{conv_kernel_size, conv_group_size, selector_rank,
selector_top_k}`` (keys as vLLM's ``qwen3_dflash2.py`` reads them; ``is_causal`` written when the
drafter has sliding layers, ``write_sliding_causality``);
served by SGLang's ``DFLASH`` algorithm, vLLM's ``dflash`` method on its V2 model runner and
llama.cpp's ``draft-dflash`` (a selector top-k above 0 switches it to the selector's walk).
"""

from __future__ import annotations

from typing import Any

from dflash_train.models.variant import DrafterVariant, serving_value, write_sliding_causality

SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DFlash2's defaults: 2 taps, 16 channels per dynamic group, rank-256 codebooks, 16 candidates.
DEFAULT_SIZES = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


class DFlash2(DrafterVariant):
    name = "dflash2"
    label = "DFlash2"
    architecture = "DFlash2DraftModel"
    drafting_procedure = "the selector's left-to-right walk over the LM head's top-K"
    drafts_by_head_argmax = False
    recipe_sizes = SIZES
    recipe_weights = ("selector_loss_weight",)
    config_fields = dict.fromkeys(SIZES, 0)
    needs_vllm_v2_runner = True

    def resolved_fields(self, recipe) -> dict[str, Any]:
        return {k: getattr(recipe, k) or DEFAULT_SIZES[k] for k in SIZES}

    def check_config(self, config) -> None:
        self.require_sizes(config, SIZES)
        if config.hidden_size % config.conv_group_size:
            raise ValueError(
                f"conv_group_size={config.conv_group_size} must divide hidden_size={config.hidden_size} "
                "(channels are convolved in groups of that size); use a divisor, e.g. 16 or 8."
            )
        if config.selector_top_k > config.vocab_size:
            raise ValueError(
                f"selector_top_k={config.selector_top_k} exceeds the vocabulary ({config.vocab_size})."
            )

    def loss_weights(self, recipe) -> dict[str, float]:
        return {"selector_weight": recipe.selector_loss_weight}

    def decoder_layer(self, backbone_layer):
        from dflash_train.models.dflash2 import DFlash2DecoderLayer

        return DFlash2DecoderLayer

    def add_heads(self, drafter) -> None:
        from dflash_train.models.dflash2 import CandidateSelector

        drafter.candidate_selector = CandidateSelector(drafter.config)

    def head_outputs(self, drafter, scored, input_ids, anchors) -> dict[str, Any]:
        """The selector's gate against the gold previous token, and its successor codebook."""
        from dflash_train.models.drafter import gold_previous_tokens

        selector = drafter.candidate_selector
        previous = gold_previous_tokens(input_ids, anchors, scored.shape[2])
        return dict(
            selector_gate=selector.gate(scored, previous),
            selector_table=selector.successor_codebook,
            selector_top_k=selector.top_k,
        )

    def drafts_from_logits(self, drafter, logits, scored, anchor_ids):
        selector = drafter.candidate_selector
        unary, candidates = logits.topk(selector.top_k, dim=-1)
        return selector.walk(candidates, unary, scored, anchor_ids)

    def add_serving_fields(self, config, out: dict[str, Any]) -> None:
        write_sliding_causality(config, out)
        out["dflash_config"].update({k: getattr(config, k) for k in SIZES})

    def read_serving_fields(self, raw: dict[str, Any]) -> dict[str, Any]:
        return {k: int(serving_value(raw, k, 0)) for k in SIZES}

    def serving_warnings(self, config) -> list[str]:
        """llama.cpp packs each position's candidates and their K x K transition scores into one
        hidden-size row (``build_dflash2_selector``) and refuses a drafter whose row is too narrow."""
        lattice = config.selector_top_k * (config.selector_top_k + 1)
        if config.hidden_size >= lattice:
            return []
        return [
            f"llama.cpp refuses this DFlash2 drafter: its selector lattice needs hidden_size >= selector_top_k x "
            f"(selector_top_k + 1) = {lattice}, the drafter has {config.hidden_size}; train a smaller "
            "drafter.selector_top_k to serve it there."
        ]

    def layer_flops(self, config, num_tokens: int) -> float:
        """Each sublayer's kernel projection (H -> 2 * taps * groups) and its two convolutions."""
        hidden, taps = config.hidden_size, config.conv_kernel_size
        groups = hidden // config.conv_group_size
        return 2 * (2.0 * num_tokens * hidden * 2 * taps * groups + 4.0 * num_tokens * hidden * taps)

    def head_flops(self, config, num_tokens: int) -> float:
        """The selector's hidden projection and candidate scores."""
        return 2.0 * num_tokens * config.selector_rank * (config.hidden_size + config.selector_top_k)
