"""The target, drafter and prompts of the eval and decode benchmarks.

Two kinds of workload:
- a real checkpoint (``--target DIR``, with its tokenizer): chat prompts from ``--prompts FILE`` or
  the built-in benchmark requests (``eval.prompts.benchmark_prompts``);
- a preset shape with random weights (``--preset qwen3.6-27b [--num-layers N]``): random prompt ids
  of ``--prompt-len`` tokens and no EOS (random weights never stop), so a 27B evaluation can be
  planned without the checkpoint.
The drafter is ``--drafter DIR`` (an export or a training checkpoint) or, without it, a random
drafter of the target's shape: its timings are real, its tau means nothing.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.bench.progress import StepLimits


@dataclass(frozen=True, kw_only=True)
class WorkloadOptions(StepLimits):
    """Which target, drafter and prompts (exactly one of ``target`` and ``preset``)."""

    # An HF checkpoint directory (with tokenizer) or hub id, or "".
    target: str = ""
    # A random-weight target preset (models/presets.py), e.g. qwen3.6-27b, tiny-qwen3; or "".
    preset: str = ""
    # Preset only: build the first N decoder layers (0 = all).
    num_layers: int = 0
    # An exported drafter or a training checkpoint ("" = random drafter of the target's shape).
    drafter: str = ""
    # A JSONL prompt file ("" = the built-in benchmark requests); checkpoint targets only.
    prompts: str = ""
    num_prompts: int = 8
    # Preset only: tokens per random prompt.
    prompt_len: int = 256
    max_new_tokens: int = 256
    # Block size of the random drafter.
    block_size: int = 16
    # Always generate max_new_tokens tokens (no EOS stop).
    ignore_eos: bool = False
    dtype: str = "auto"
    device: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.target) == bool(self.preset):
            raise ValueError("give exactly one of --target DIR and --preset NAME")
        if self.num_layers and not self.preset:
            raise ValueError("--num-layers applies to --preset targets; a checkpoint is loaded whole")
        if self.prompts and self.preset:
            raise ValueError("--prompts needs a tokenizer: use it with --target, not --preset")
        if min(self.num_prompts, self.prompt_len, self.max_new_tokens, self.block_size) < 1:
            raise ValueError("--num-prompts, --prompt-len, --max-new-tokens and --block-size must be >= 1")


def add_workload_arguments(parser: argparse.ArgumentParser, *, num_prompts: int, max_new_tokens: int) -> None:
    """The workload's arguments, with the mode's defaults for the prompt count and length."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", default="", help="HF checkpoint directory (with tokenizer) or hub id")
    where.add_argument("--preset", default="", help="random-weight target preset, e.g. qwen3.6-27b")
    parser.add_argument("--num-layers", type=int, default=0, help="preset: build only the first N layers")
    parser.add_argument(
        "--drafter", default="", help="exported drafter or checkpoint (default: random, timing only)"
    )
    parser.add_argument("--prompts", default="", help="JSONL prompt file (default: built-in chat requests)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--prompt-len", type=int, default=256, help="preset: random prompt length")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--block-size", type=int, default=16, help="block size of the random drafter")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument("--device", default="auto")


@dataclass
class Workload:
    """A loaded workload: target model (eval mode), tokenizer (None for presets), prompt ids,
    drafter, stop ids and pad id."""

    model: Any
    tokenizer: Any
    prompts: list[list[int]]
    drafter: Any
    eos: set[int]
    pad: int
    device: torch.device
    dtype: torch.dtype

    def header(self, options: WorkloadOptions) -> dict[str, Any]:
        """The fields every result of this workload starts with."""
        device = self.device
        return {
            "workload": options.target or f"preset:{options.preset}",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_layers": self.model.config.num_hidden_layers,
            "num_prompts": len(self.prompts),
            "max_new_tokens": options.max_new_tokens,
            "block_size": self.drafter.config.block_size,
            "random_drafter": not options.drafter,
            "torch": torch.__version__,
        }


def load_workload(options: WorkloadOptions) -> Workload:
    """Target, prompts and drafter of ``options`` on its device, in its dtype."""
    from dflash_train.eval.command import load_eval_drafter, resolve_device, resolve_eval_dtype
    from dflash_train.eval.generate import pad_token_for
    from dflash_train.eval.runner import default_eos_ids

    device = resolve_device(options.device)
    dtype = resolve_eval_dtype(options.dtype, device)
    model, tokenizer, prompts = load_target_and_prompts(options, device, dtype)
    if options.drafter:
        drafter = load_eval_drafter(options.drafter, device, dtype)
    else:
        drafter = random_drafter(options, model, tokenizer, device, dtype)
    eos = set() if options.ignore_eos or tokenizer is None else default_eos_ids(model, tokenizer)
    return Workload(model, tokenizer, prompts, drafter, eos, pad_token_for(tokenizer, eos), device, dtype)


def load_target_and_prompts(options: WorkloadOptions, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer or None, prompts as token ids); GatedDeltaNet targets on fla on a GPU."""
    from dflash_train.eval.command import load_eval_target
    from dflash_train.eval.prompts import benchmark_prompts, load_prompts
    from dflash_train.models.target import bind_fla_causal_conv, check_fast_kernels, load_causal_lm

    if options.target:
        model, tokenizer = load_eval_target(options.target, dtype, device)
        if options.prompts:
            return model, tokenizer, load_prompts(options.prompts, tokenizer, num_prompts=options.num_prompts)
        return model, tokenizer, benchmark_prompts(tokenizer, options.num_prompts)
    model, _ = load_causal_lm(
        f"preset:{options.preset}", dtype=dtype, device=device, num_hidden_layers=options.num_layers or None
    )
    if device.type == "cuda":  # the guard training and eval apply: no silent PyTorch fallback
        bind_fla_causal_conv(model, device)
        check_fast_kernels(model, device, False)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(options.prompt_len)] for _ in range(options.num_prompts)]
    return model.eval(), None, prompts


def random_drafter(options: WorkloadOptions, model, tokenizer, device: torch.device, dtype: torch.dtype):
    """A seeded random drafter of the preset's shape (or the target's), in eval mode."""
    from dflash_train.config import DrafterConfig
    from dflash_train.eval.runner import default_eos_ids
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter

    if options.preset.startswith("tiny"):
        name = "tiny"
    else:
        name = options.preset if options.preset in presets.DRAFTER_PRESETS else "from-target"
    num_layers = presets.text_config(model.config).num_hidden_layers
    special = default_eos_ids(model, tokenizer) | {getattr(tokenizer, "pad_token_id", None)}
    mask = next(i for i in range(model.config.vocab_size - 1, 0, -1) if i not in special)
    config = presets.resolve_drafter_config(
        DrafterConfig(preset=name, block_size=options.block_size),
        model.config,
        target_layer_ids=presets.default_target_layer_ids(num_layers),
        mask_token_id=mask,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    with torch.device(device):
        torch.manual_seed(0)
        return DFlashDrafter(config).to(dtype).eval()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (host timings of GPU work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
