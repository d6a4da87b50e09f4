"""Torch dtypes by their recipe names: the one table every part of the package uses."""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its recipe name (``bfloat16``, ``float16``, ``float32``) or itself."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {list(DTYPES)}.")
    return DTYPES[dtype]
