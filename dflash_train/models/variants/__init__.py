"""The built-in drafter variants, one module each; importing the package registers them
(``models/variant.py`` is the interface and the registry; docs/CONTRACTS.md "Drafter variants")."""

from dflash_train.models.variant import register_variant
from dflash_train.models.variants.dflash import DFlash
from dflash_train.models.variants.dflash2 import DFlash2
from dflash_train.models.variants.dspark import DSpark

for _variant in (DFlash(), DFlash2(), DSpark()):
    register_variant(_variant)
