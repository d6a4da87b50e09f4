"""Which kernels the target's layers run on: GatedDeltaNet kernel binding, the fast-kernel guard and
regional compilation.

transformers' GatedDeltaNet layers (Qwen3.5/3.6, Qwen3-Next) call module-level kernel functions
that fall back to readable PyTorch references when ``fla`` / ``causal-conv1d`` are missing. The
fallback chunk rule costs about 3x target throughput, the fallback conv 3.5-6.5x on the conv
itself: ``check_fast_kernels`` refuses the first and warns once, loudly, about the second on CUDA.
``bound_kernels`` reports the function that is really bound, never whether a package imports.
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Kernel name -> the module-level function name transformers' GatedDeltaNet layers call.
GDN_KERNEL_FUNCTIONS = {
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}
# Slow-path warnings already given in this process (warn once, not once per model load).
_WARNED: set[str] = set()


def gated_delta_net_layers(model: nn.Module) -> list[nn.Module]:
    """The GatedDeltaNet (linear attention) modules of ``model`` (Qwen3.5/3.6, Qwen3-Next)."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def bound_kernels(model: nn.Module) -> dict[str, str]:
    """Which implementation each GatedDeltaNet/conv kernel and the attention of ``model`` run on.

    Values are the implementing package (``fla``, ``causal_conv1d``, a hub kernel's module) or
    ``torch`` for transformers' reference fallback; ``attention`` is the attention implementation;
    ``gated_delta_net`` says whether the layers run ``models/gated_delta_net.py``'s fused forward.
    """
    config = getattr(model, "config", None)
    kernels = {"attention": str(getattr(config, "_attn_implementation", None) or "unknown")}
    layers = gated_delta_net_layers(model)
    if not layers:
        return kernels
    layer = layers[0]
    kernels["gated_delta_net"] = (
        "fla-fused" if "dflash_original_forward" in layer.__dict__ else "transformers"
    )
    modeling_module = sys.modules.get(type(layer).__module__)
    for kernel, function_name in GDN_KERNEL_FUNCTIONS.items():
        # transformers 4.x stored the chosen kernel on the layer; 5.x calls module-level wrappers.
        function = getattr(layer, kernel, None) or getattr(modeling_module, function_name, None)
        kernels[kernel] = kernel_source(function)
    return kernels


def kernel_source(function: Callable | None) -> str:
    """The package that really implements ``function``, or ``torch`` for transformers' reference code.

    transformers 5 wraps each kernel with ``use_kernel_func_from_hub_with_fallback``, whose closure
    holds the chosen ``implementation`` (e.g. fla's function) next to the reference ``torch_function``;
    we follow ``__wrapped__`` links to that closure. Anything else is judged by where the bound
    callable is defined (a partial by its function, a callable object by its class): an installed
    fast package says nothing about what this model calls.
    """
    if function is None:
        return "torch"
    if getattr(function, "dflash_kernel", None):
        return function.dflash_kernel
    bound = bound_implementation(function)
    implementation, reference = bound if bound is not None else (defining_callable(function), None)
    package = (getattr(implementation, "__module__", None) or "unknown").split(".")[0]
    return "torch" if implementation is reference or package == "transformers" else package


def defining_callable(function: Any) -> Any:
    """What runs behind an opaque callable: a partial's function, else the callable itself (whose
    ``__module__`` is its class's for a callable object)."""
    while isinstance(function, functools.partial):
        function = function.func
    return function


def bound_implementation(function: Callable) -> tuple[Callable, Callable | None] | None:
    """(what runs, the torch reference) behind a kernel wrapper; None for an opaque callable.

    A transformers fallback wrapper captures ``implementation`` and ``torch_function`` in its closure;
    without such a wrapper, the innermost ``__wrapped__`` function is what runs.
    """
    seen: set[int] = set()
    current: Any = function
    while id(current) not in seen and getattr(current, "__code__", None) is not None:
        seen.add(id(current))
        closure = dict(zip(current.__code__.co_freevars, current.__closure__ or ()))
        if "implementation" in closure:
            reference = closure.get("torch_function")
            return closure["implementation"].cell_contents, reference and reference.cell_contents
        if getattr(current, "__wrapped__", None) is None:
            return current, None
        current = current.__wrapped__
    return None


def fla_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' ``causal_conv1d_fn`` contract ([B, D, T] in and out) on fla's Triton kernel.

    ``cu_seq_lens_q`` (packed rows, [1, T] input) restarts the convolution at every boundary.
    """
    from fla.modules.causal_conv1d import causal_conv1d

    out, _ = causal_conv1d(
        hidden_states.transpose(1, 2),
        weight=weight,
        bias=bias,
        activation=activation,
        cu_seqlens=kwargs.get("cu_seq_lens_q"),
    )
    return out.transpose(1, 2)


fla_causal_conv1d_fn.dflash_kernel = "fla"


def bind_fla_causal_conv(model: nn.Module, device: str | torch.device) -> bool:
    """On CUDA without the causal-conv1d package, run the GatedDeltaNet conv on fla's Triton kernel.

    transformers otherwise falls back to a depthwise ``F.conv1d``: measured on an H200 at the
    Qwen3.6-27B conv shape it is 3.5x (4K tokens) to 6.5x (32K) slower than fla's kernel
    (docs/performance.md). The module-level function is swapped, so every model of that type in the
    process uses it. Returns whether the fla conv is bound.
    """
    layers = gated_delta_net_layers(model)
    if torch.device(device).type != "cuda" or not layers:
        return False
    module = sys.modules[type(layers[0]).__module__]
    current = getattr(module, "causal_conv1d_fn", None)
    if current is None or kernel_source(current) != "torch":
        return getattr(current, "dflash_kernel", None) == "fla"
    if not package_importable("fla.modules.causal_conv1d"):
        return False
    module.causal_conv1d_fn = fla_causal_conv1d_fn
    return True


def package_importable(module_name: str) -> bool:
    """True when ``module_name`` imports (optional kernels are only ever imported lazily, here)."""
    try:
        importlib.import_module(module_name)
    except ImportError:
        return False
    return True


def check_fast_kernels(model: nn.Module, device: str | torch.device, allow_slow: bool) -> dict[str, str]:
    """Refuse a GatedDeltaNet target on CUDA that would run transformers' PyTorch fallback.

    Returns the ``bound_kernels`` dict (recorded in run metadata). On CUDA, a model with GatedDeltaNet
    layers whose ``chunk_gated_delta_rule`` is the torch reference raises RuntimeError, or warns when
    ``allow_slow``; a torch ``causal_conv1d_fn`` warns once per process (it is slower, not unusable).
    CPU runs (tests, the demo) neither raise nor warn.
    """
    kernels = bound_kernels(model)
    if torch.device(device).type != "cuda" or "chunk_gated_delta_rule" not in kernels:
        return kernels
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if kernels["chunk_gated_delta_rule"] == "torch":
        message = (
            f"target ({model_type}) has GatedDeltaNet layers but chunk_gated_delta_rule runs transformers' "
            "PyTorch fallback (about 3x lower target throughput). Install the fla kernels with "
            "`pip install fla-core` (flash-linear-attention), or set target.allow_slow_kernels=true to accept it."
        )
        if not allow_slow:
            raise RuntimeError(message)
        warnings.warn(f"SLOW TARGET: {message}", RuntimeWarning, stacklevel=2)
    if kernels["causal_conv1d_fn"] == "torch" and "causal_conv1d_fn" not in _WARNED:
        _WARNED.add("causal_conv1d_fn")
        warnings.warn(
            f"SLOW TARGET: the GatedDeltaNet conv of the target ({model_type}) runs transformers' F.conv1d "
            "fallback, 3.5-6.5x slower than a fused kernel (docs/performance.md). Install fla-core "
            "(its Triton conv is bound automatically) or causal-conv1d.",
            RuntimeWarning,
            stacklevel=2,
        )
    return kernels


def compile_target_layers(model: nn.Module) -> list[str]:
    """torch.compile every decoder layer's forward, in place; returns the layer names.

    Fuses what ``compile_target_regions`` cannot reach: each residual add with the RMSNorm after
    it, and (with the fused GatedDeltaNet forward) the layer's whole body around fla's two
    opaque kernels. ``target.fp8`` uses it: every float8 linear's activation quantization
    (amax, scale, cast) then fuses into the op before it instead of running as eager kernels
    around the GatedDeltaNet projections, which the regions leave uncompiled. On an H200 at the
    Qwen3.6-27B shape the FP8 feature pass at 4K takes 230 ms this way and 299 ms with regions;
    in bf16 the two are equal (342.6 vs 341.0 ms), so bf16 keeps the regions (docs/performance.md). The forward (not ``__call__``) is compiled, so the feature hooks that
    ``FrozenTarget`` registers per call stay outside the compiled code and never cause a recompile.
    """
    decoder = model.get_decoder()
    # One compiled entry per (layer type, row length): the default limit of 8 per code object
    # would send a target with 2 layer types and more than 4 bucket lengths back to eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = []
    for index, layer in enumerate(decoder.layers):
        layer.forward = torch.compile(layer.forward, dynamic=False)
        compiled.append(f"layers.{index}")
    return compiled


def compile_target_regions(model: nn.Module) -> list[str]:
    """torch.compile the pure-PyTorch regions of every decoder layer, in place; returns their names.

    Regional compilation: each layer's MLP, RMSNorms and (full) attention block is compiled on its
    own, so the layers of one class share a single compiled graph per input shape, and the
    GatedDeltaNet token mixer keeps calling fla's Triton kernels eagerly (only its gated output
    norm is compiled). What this fuses is the elementwise work around the matmuls (SwiGLU, fp32
    norms, q/k norms, RoPE, the attention output gate), which HF runs as separate kernels.
    """
    decoder = model.get_decoder()
    compiled = []
    for index, layer in enumerate(decoder.layers):
        for name, child in layer.named_children():
            if type(child).__name__.endswith("GatedDeltaNet"):
                regions = [
                    (f"{name}.{n}", c) for n, c in child.named_children() if "Norm" in type(c).__name__
                ]
            else:
                regions = [(name, child)]
            for region_name, region in regions:
                region.compile(dynamic=False)
                compiled.append(f"layers.{index}.{region_name}")
    return compiled


def compile_report(model: nn.Module) -> str:
    """What of the decoder is compiled, read from the layers themselves (``FrozenTarget.kernels``'s
    ``compile``, in run metadata and the bench JSON).

    ``whole layers (N of M)`` where layer forwards were replaced by ``torch.compile`` wrappers
    (``compile_target_layers``), ``regions (...)`` naming each compiled submodule kind with its count
    (``compile_target_regions``), ``none`` where nothing is. Wrapping is lazy (nothing compiles
    before the first forward), so this reports what will run compiled without compiling it.
    """
    layers = list(model.get_decoder().layers)
    whole = sum(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers)
    regions: dict[str, int] = {}
    layers_with_regions = 0
    for layer in layers:
        names = [n for n, m in layer.named_modules() if n and m._compiled_call_impl is not None]
        layers_with_regions += bool(names)
        for name in names:
            regions[name] = regions.get(name, 0) + 1
    parts = []
    if whole:
        parts.append(f"whole layers ({whole} of {len(layers)})")
    if regions:
        kinds = ", ".join(f"{name} x{count}" for name, count in regions.items())
        parts.append(f"regions ({kinds}; in {layers_with_regions} of {len(layers)} layers)")
    return " + ".join(parts) or "none"
