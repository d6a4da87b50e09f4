"""DSpark (arXiv 2607.05147; DeepSpec is the authors' code): every block slot predicts the token
after it, a Markov head biases each slot's logits by the previous token (drafting walks the slots
left to right), and a confidence head predicts each draft's acceptance (architecture:
``models/dspark.py``; loss terms: ``train/variant_terms.py``; docs/training.md "Variants").

Export ``Qwen3DSparkModel`` (DeepSpec's name, which SGLang registers; vLLM and llama.cpp also read
``DSparkDraftModel``) with ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
``confidence_head_with_markov`` and ``sample_from_anchor: true`` both at the top level (DeepSpec's
layout) and in ``dflash_config`` (with ``projector_type: "dspark"``, SpecForge's and llama.cpp's).
Served by SGLang's ``DSPARK`` algorithm (``--speculative-num-draft-tokens B + 1``), vLLM's ``dspark``
method (``num_speculative_tokens: B``, V2 model runner) and llama.cpp's ``draft-dspark``.
"""

from __future__ import annotations

from typing import Any

from dflash_train.models.variant import NO_DRAFT, DrafterVariant, serving_value, write_sliding_causality

FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
DEFAULT_MARKOV_RANK = 256


class DSpark(DrafterVariant):
    name = "dspark"
    label = "DSpark"
    architecture = "Qwen3DSparkModel"
    read_architectures = ("DSparkDraftModel",)
    drafting_procedure = "the Markov chain over the block's slots"
    first_scored_slot = 0
    drafts_by_head_argmax = False
    recipe_sizes = ("markov_rank",)
    recipe_weights = ("dspark_ce_weight", "dspark_tv_weight", "confidence_loss_weight")
    config_fields = {
        "markov_rank": 0,
        "markov_head_type": "vanilla",
        "enable_confidence_head": False,
        "confidence_head_with_markov": False,
    }
    sglang_algorithm = "DSPARK"
    vllm_method = "dspark"
    llama_cpp_spec_type = "draft-dspark"
    needs_vllm_v2_runner = True

    def resolved_fields(self, recipe) -> dict[str, Any]:
        return {
            "markov_rank": recipe.markov_rank or DEFAULT_MARKOV_RANK,
            "enable_confidence_head": recipe.confidence_head,
            "confidence_head_with_markov": recipe.confidence_head,
        }

    def check_settings(self, recipe) -> None:
        if recipe.dspark_ce_weight + recipe.dspark_tv_weight <= 0:
            raise ValueError(
                "drafter.dspark_ce_weight + drafter.dspark_tv_weight must be > 0: the block needs a token loss "
                "(DeepSpec uses 0.1 and 0.9)."
            )

    def check_config(self, config) -> None:
        self.require_sizes(config, ("markov_rank",))
        if config.markov_head_type != "vanilla":
            raise NotImplementedError(
                f"markov_head_type={config.markov_head_type!r}: only DSpark's 'vanilla' Markov head is "
                "implemented (DeepSpec's 'gated' and 'rnn' heads are not); use 'vanilla'."
            )
        if config.confidence_head_with_markov and not config.enable_confidence_head:
            raise ValueError("confidence_head_with_markov=true needs enable_confidence_head=true.")

    # -- training --------------------------------------------------------------------------------
    def loss_weights(self, recipe) -> dict[str, float]:
        """DeepSpec's loss: ce_weight * CE + tv_weight * TV + confidence_weight * BCE."""
        return {
            "ce_weight": recipe.dspark_ce_weight,
            "tv_weight": recipe.dspark_tv_weight,
            "confidence_weight": recipe.confidence_loss_weight if recipe.confidence_head else 0.0,
        }

    def needs_teacher(self, recipe) -> bool:
        """The TV term and the confidence target use the target's own next-token distribution."""
        return recipe.dspark_tv_weight > 0 or (recipe.confidence_head and recipe.confidence_loss_weight > 0)

    def check_placement(self, recipe, placement: str) -> None:
        if placement == "split" and self.needs_teacher(recipe):
            raise NotImplementedError(
                "drafter.variant=dspark with its TV term or confidence head needs the target's final hidden "
                "states, which train.placement=split does not stream; use train.placement=colocated, or set "
                "drafter.dspark_tv_weight=0 and drafter.confidence_head=false."
            )

    def scored_labels(self, label_valid):
        """DeepSpec scores a block's contiguous valid prefix only."""
        return label_valid.long().cumprod(-1).bool()

    # -- model -----------------------------------------------------------------------------------
    def add_heads(self, drafter) -> None:
        from dflash_train.models.dspark import ConfidenceHead, MarkovHead

        drafter.markov_head = MarkovHead(drafter.config)
        if drafter.config.enable_confidence_head:
            drafter.confidence_head = ConfidenceHead(drafter.config)

    def head_outputs(self, drafter, scored, input_ids, anchors) -> dict[str, Any]:
        """The Markov embedding of the gold previous token, ``markov_w2``'s weight and the confidence."""
        from dflash_train.models.drafter import gold_previous_tokens

        previous = gold_previous_tokens(input_ids, anchors, scored.shape[2])
        latent = drafter.markov_head.markov_w1(previous)
        enabled = drafter.config.enable_confidence_head
        return dict(
            markov_latent=latent,
            markov_table=drafter.markov_head.markov_w2.weight,
            confidence=drafter.confidence_head(scored, latent) if enabled else None,
        )

    def drafts_from_logits(self, drafter, logits, scored, anchor_ids):
        """The greedy Markov chain; with ``draft_p_min`` > 0 cut at the first slot whose confidence
        ``sigmoid(confidence_head([h_k; markov_w1[prev_k]]))`` is below it, prev_k the chain's previous
        pick, as llama.cpp's ``draft-dspark`` with ``--spec-draft-p-min`` stops a block."""
        import torch

        drafts = drafter.markov_head.greedy_chain(logits, anchor_ids)
        if drafter.draft_p_min <= 0:
            return drafts
        previous = torch.cat([anchor_ids[:, None], drafts[:, :-1]], dim=1)
        latent = drafter.markov_head.markov_w1(previous)
        confidence = drafter.confidence_head(scored, latent).float().sigmoid()  # [M, D]
        kept = (confidence >= drafter.draft_p_min).long().cumprod(-1).bool()
        return drafts.masked_fill(~kept, NO_DRAFT)

    def check_draft_p_min(self, config, p_min: float) -> None:
        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"draft_p_min={p_min}: use a probability in [0, 1] (0 = full blocks).")
        if p_min > 0 and not config.enable_confidence_head:
            raise ValueError(
                f"draft_p_min={p_min}: this DSpark drafter has no confidence head to stop a block with "
                "(llama.cpp refuses it too); use 0, or train with drafter.confidence_head=true."
            )

    # -- export ----------------------------------------------------------------------------------
    def add_serving_fields(self, config, out: dict[str, Any]) -> None:
        write_sliding_causality(config, out)
        fields = {k: getattr(config, k) for k in FIELDS}
        # DeepSpec's layout is top-level; SpecForge's and llama.cpp's DFlash converter read dflash_config.
        out.update(fields, mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids))
        out["sample_from_anchor"] = True
        out["dflash_config"].update(fields, projector_type="dspark", sample_from_anchor=True)

    def read_serving_fields(self, raw: dict[str, Any]) -> dict[str, Any]:
        if not serving_value(raw, "sample_from_anchor", True):
            raise NotImplementedError(
                "config.json has sample_from_anchor=false (the speculators DSpark convention: slot j predicts "
                "anchor+j, slot 0 unused): only DeepSpec's sample_from_anchor=true layout is implemented."
            )
        return {
            "markov_rank": int(serving_value(raw, "markov_rank", 0)),
            "markov_head_type": str(serving_value(raw, "markov_head_type", "vanilla")),
            "enable_confidence_head": bool(serving_value(raw, "enable_confidence_head", False)),
            "confidence_head_with_markov": bool(serving_value(raw, "confidence_head_with_markov", False)),
        }

    # -- cost --------------------------------------------------------------------------------------
    def head_flops(self, config, num_tokens: int) -> float:
        """The Markov bias over the vocabulary (rank r x V per slot, next to the LM head's H x V) and
        the confidence head."""
        rank = config.markov_rank
        return 2.0 * num_tokens * (rank * config.vocab_size + config.hidden_size + rank)
