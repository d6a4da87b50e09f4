"""DFlash, the block-diffusion drafter of the DFlash paper: the backbone as it is.

Block ``[anchor, MASK x (B-1)]``, slots 1..B-1 predict ``ids[a+1 .. a+B-1]`` in one pass, drafts are
the argmax of the target's LM head; the export is ``DFlashDraftModel`` (DESIGN.md section 3). Every
default of ``DrafterVariant`` is DFlash's, so this module only names it.
"""

from __future__ import annotations

from dflash_train.models.variant import DEFAULT_VARIANT, DrafterVariant


class DFlash(DrafterVariant):
    name = DEFAULT_VARIANT
    label = "DFlash"
    architecture = "DFlashDraftModel"
