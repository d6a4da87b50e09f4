"""``target.fp8``: the frozen target's decoder linears in FP8 through torchao's float8 inference path.

Weights are quantized once to float8 e4m3 with one scale per output row; activations are quantized
per token at every call, and the matmul runs on the FP8 tensor cores (``torch._scaled_mm`` rowwise,
or torchao's own kernel where installed). This is how serving engines run FP8 checkpoints, so
features from an FP8 target match what an FP8 server computes, and the target forward is faster.

What stays in bf16, and why:
- the embedding and the LM head: the drafter shares both, and the LM head is part of the loss
  (and of the KL teacher);
- linears whose in or out features are not multiples of 16 (the FP8 GEMM's layout constraint);
- the GatedDeltaNet per-head gate projections (``in_proj_a`` / ``in_proj_b``, Qwen3-Next's
  ``in_proj_ba``): one output per value head, far too small for FP8 to pay for quantizing its
  input, and they set the recurrent decay, which compounds over the whole sequence;
- mixture-of-experts routers (``gate``): routing is a discrete choice a small error can flip.

``check_fp8_support`` refuses a setup that cannot run it (CPU, a GPU before sm89, no torchao, a
dtype other than bfloat16) before any weight is loaded; ``quantize_target_linears`` converts a
loaded model in place and returns what it did. Quantize before compiling: ``load_target`` then
compiles an FP8 target's whole decoder layers (``compile_target_layers``), so every float8 linear's
activation quantization fuses into the op before it instead of running as separate eager kernels.
"""

from __future__ import annotations

import importlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "Fp8Summary",
    "check_fp8_support",
    "plan_fp8_linears",
    "quantize_target_linears",
]

# The FP8 GEMM needs both matrix dimensions in multiples of 16.
FP8_DIM_MULTIPLE = 16
# FP8 tensor cores first appear on Ada / Hopper (compute capability 8.9).
MIN_FP8_CAPABILITY = (8, 9)
MOE_ROUTER_NAMES = {"gate", "router"}
# A weight still of these types after quantize_ was not converted (torchao's are tensor subclasses).
PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)

SKIP_GDN_GATE = "GatedDeltaNet per-head gate projection"
SKIP_ROUTER = "mixture-of-experts router"
SKIP_SHAPE = f"in/out features not multiples of {FP8_DIM_MULTIPLE}"


@dataclass
class Fp8Summary:
    """Which decoder linears run in FP8 (``converted``) and which stay bf16 (``skipped``: name -> reason).

    Names are relative to the decoder (``layers.3.mlp.up_proj``).
    """

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def num_linears(self) -> int:
        return len(self.converted) + len(self.skipped)

    def skip_counts(self) -> dict[str, int]:
        """Number of skipped linears per reason."""
        return dict(Counter(self.skipped.values()))

    def kernel_entries(self) -> dict[str, str]:
        """What ``FrozenTarget.kernels`` records (run metadata, bench output)."""
        entries = {
            "linear": f"fp8-torchao rowwise ({len(self.converted)} of {self.num_linears} decoder linears)"
        }
        if self.skipped:
            entries["linear_bf16"] = "; ".join(f"{reason} x{n}" for reason, n in self.skip_counts().items())
        return entries


def check_fp8_support(device: str | torch.device, dtype: torch.dtype) -> None:
    """Raise a ValueError/RuntimeError saying what to change when ``target.fp8`` cannot run here.

    Called by ``load_target`` before any weight is loaded: CPU or a GPU without FP8 tensor cores,
    a dtype other than bfloat16 (rowwise FP8 quantizes bf16 weights), or torchao not installed.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(
            f"target.fp8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9), but the target "
            f"loads on {device.type}; set target.fp8=false."
        )
    capability = cuda_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        raise RuntimeError(
            f"target.fp8 needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell); this GPU "
            f"({torch.cuda.get_device_name(device)}) is sm{capability[0]}{capability[1]}; set target.fp8=false."
        )
    if dtype != torch.bfloat16:
        raise ValueError(f"target.fp8 quantizes bfloat16 weights; set target.dtype=bfloat16 (got {dtype}).")
    import_torchao()


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of ``device`` (a function of its own so tests can stand in a GPU)."""
    return tuple(torch.cuda.get_device_capability(device))


def import_torchao():
    """``torchao.quantization``, imported lazily (an optional extra), or a RuntimeError saying how to get it."""
    try:
        return importlib.import_module("torchao.quantization")
    except ImportError as error:
        raise RuntimeError(
            "target.fp8 needs torchao (>= 0.18), which is not installed: `pip install torchao` or "
            "`pip install 'dflash-train[fp8]'`; or set target.fp8=false."
        ) from error


def plan_fp8_linears(model: nn.Module) -> Fp8Summary:
    """Which ``nn.Linear`` of ``model``'s decoder layers become FP8, and why each other one does not.

    Only modules under ``decoder.layers`` are considered: the embedding, the final norm, the LM head
    and anything outside the text decoder (a vision tower) are never touched.
    """
    plan = Fp8Summary()
    for parent_name, parent in model.get_decoder().named_modules():
        if not parent_name.startswith("layers."):
            continue
        for child_name, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            name = f"{parent_name}.{child_name}"
            reason = skip_reason(child_name, child, parent)
            if reason is None:
                plan.converted.append(name)
            else:
                plan.skipped[name] = reason
    return plan


def skip_reason(child_name: str, linear: nn.Linear, parent: nn.Module) -> str | None:
    """Why ``parent.<child_name>`` stays bf16, or None when it becomes FP8 (rules: module docstring)."""
    if type(parent).__name__.endswith("GatedDeltaNet"):
        # in_proj_a / in_proj_b: num_v_heads outputs each; Qwen3-Next's in_proj_ba: both in one.
        num_heads = int(getattr(parent, "num_v_heads", 0))
        if num_heads and linear.out_features <= 2 * num_heads:
            return SKIP_GDN_GATE
    if child_name in MOE_ROUTER_NAMES:
        return SKIP_ROUTER
    if linear.in_features % FP8_DIM_MULTIPLE or linear.out_features % FP8_DIM_MULTIPLE:
        return SKIP_SHAPE
    return None


def quantize_target_linears(model: nn.Module) -> Fp8Summary:
    """Convert the planned decoder linears of ``model`` to torchao float8 (rowwise) in place.

    ``set_inductor_config=False``: torchao would otherwise switch on process-wide inductor options
    (coordinate-descent tuning) that slow every later compilation, the drafter's included.
    """
    quantization = import_torchao()
    plan = plan_fp8_linears(model)
    chosen = set(plan.converted)
    config = quantization.Float8DynamicActivationFloat8WeightConfig(
        granularity=quantization.PerRow(), set_inductor_config=False
    )
    decoder = model.get_decoder()
    quantization.quantize_(decoder, config, filter_fn=lambda module, fqn: fqn in chosen)
    # torchao leaves a weight it cannot quantize as it is, silently: say so instead.
    unconverted = [n for n in plan.converted if type(decoder.get_submodule(n).weight) in PLAIN_TENSOR_TYPES]
    if unconverted:
        raise RuntimeError(
            f"target.fp8: torchao left {len(unconverted)} planned linears in bf16 (first: {unconverted[0]}); "
            "check the torchao version (>= 0.18), or set target.fp8=false."
        )
    return plan
