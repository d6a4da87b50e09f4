"""dflash-train: train DFlash block-diffusion draft models for speculative decoding."""

__version__ = "0.1.0"
