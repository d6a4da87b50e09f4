"""The frozen target and the draft model. Importing the package registers the built-in drafter
variants (``models/variants/``), so ``models.variant.get_variant`` resolves every name wherever
it is called from."""

from dflash_train.models import variants  # noqa: F401
