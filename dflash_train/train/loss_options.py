"""Which objective the chunked loss computes (``LossOptions``): the loss kind, its weights and the
position weighting, from ``train.*`` and the drafter variant's ``drafter.*`` loss weights."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_train.models.variant import get_variant

LOSS_KINDS = ("ce", "kl", "ce+kl")
WEIGHTINGS = ("decay", "dpace")


@dataclass(frozen=True)
class LossOptions:
    """Which objective and which position weights the chunked loss computes.

    ``loss``: "ce" (weighted cross-entropy on the data's tokens), "kl" (``kl_weight`` x forward KL
    from the target's distribution, full vocabulary or its renormalised top ``kl_topk``) or "ce+kl"
    (their sum). ``weighting``: "decay" (exp(-(k-1)/gamma)) or "dpace" (D-PACE, smoothing
    ``dpace_alpha``). ``ce_weight`` scales the CE term, ``selector_weight`` weighs DFlash2's
    selector cross-entropy, ``tv_weight`` DSpark's total-variation term and ``confidence_weight``
    its confidence head's BCE (``train/variant_terms.py``). Built from ``train.*`` (and the variant's
    ``drafter.*`` weights) by ``from_train_config``.
    """

    loss: str = "ce"
    kl_weight: float = 1.0
    kl_topk: int = 0
    weighting: str = "decay"
    dpace_alpha: float = 0.5
    # Drafter variants (``drafter.*``): the factor of the CE term, DFlash2's selector term, and
    # DSpark's total-variation term and confidence-head BCE.
    ce_weight: float = 1.0
    selector_weight: float = 0.0
    tv_weight: float = 0.0
    confidence_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in LOSS_KINDS or self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"loss {self.loss!r} / weighting {self.weighting!r}: use train.loss in {list(LOSS_KINDS)} "
                f"and train.loss_weighting in {list(WEIGHTINGS)}."
            )
        if self.kl_topk < 0 or (self.uses_kl and self.kl_weight <= 0) or not 0 <= self.dpace_alpha <= 1:
            raise ValueError(
                f"kl_topk={self.kl_topk}, kl_weight={self.kl_weight}, dpace_alpha={self.dpace_alpha}: "
                "need train.kl_topk >= 0, train.kl_weight > 0 with a KL loss, train.dpace_alpha in [0, 1]."
            )

    @classmethod
    def from_train_config(cls, train, drafter=None) -> LossOptions:
        """The options of a ``TrainConfig`` (``train.loss``, ``kl_weight``, ``kl_topk``, ...) and, with
        the recipe's ``DrafterConfig``, its variant's loss weights."""
        variant = {} if drafter is None else get_variant(drafter.variant).loss_weights(drafter)
        return cls(
            loss=train.loss,
            kl_weight=train.kl_weight,
            kl_topk=train.kl_topk,
            weighting=train.loss_weighting,
            dpace_alpha=train.dpace_alpha,
            **variant,
        )

    @property
    def uses_kl(self) -> bool:
        return "kl" in self.loss.split("+")

    @property
    def uses_tv(self) -> bool:
        return self.tv_weight > 0

    @property
    def needs_accept_rate(self) -> bool:
        """DSpark's TV term and its confidence target (``1 - TV / 2``) compare with the teacher."""
        return self.uses_tv or self.confidence_weight > 0

    @property
    def needs_teacher(self) -> bool:
        """Whether the target's own distribution (its final hidden states) is needed."""
        return self.uses_kl or self.needs_accept_rate

    @property
    def ce_coef(self) -> float:
        return self.ce_weight if "ce" in self.loss.split("+") else 0.0

    @property
    def kl_coef(self) -> float:
        return self.kl_weight if self.uses_kl else 0.0


DEFAULT_OPTIONS = LossOptions()
