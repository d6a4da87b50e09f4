"""Torch dtypes by their recipe names: the one table every part of the package uses; devices by name."""

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


def parse_device(name: str, setting: str) -> torch.device:
    """The torch device ``name`` (``cpu``, ``cuda``, ``cuda:1``); ``setting`` (the recipe key or flag
    that gave it) is named in the error for a name torch does not know (``gpu``)."""
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(f"{setting}={name!r} is not a device name: use auto, cpu, cuda or cuda:N.") from None
