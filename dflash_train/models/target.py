"""The frozen target: load it, capture its layer features, and refuse slow GatedDeltaNet kernels.

``load_causal_lm`` loads a transformers causal LM (text part only for multimodal Qwen3.5/3.6
checkpoints), builds random weights for ``preset:<name>`` shapes, or resolves ``builtin:<name>``.
``FrozenTarget`` wraps the full model (frozen, every layer, final norm and LM head intact for eval and
regeneration) and computes the DFlash features: the outputs of decoder layers ``target_layer_ids``
(HF's ``hidden_states[id + 1]``) concatenated along the hidden dim, running only layers
``0..max(target_layer_ids)``. ``check_fast_kernels`` inspects which GatedDeltaNet/conv kernels
transformers bound and refuses the PyTorch fallback on CUDA unless allowed.

Shapes: R rows, L sequence, H hidden, n feature layers.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from dflash_train.config import TargetConfig
from dflash_train.models import presets
from dflash_train.models.drafter_config import DFlashDraftConfig

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Kernel name -> the module-level function name transformers' GatedDeltaNet layers call.
GDN_KERNEL_FUNCTIONS = {
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}
# Where the fast implementation lives when the transformers wrapper cannot be inspected.
GDN_KERNEL_PACKAGES = {
    "chunk_gated_delta_rule": "fla.ops.gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Multimodal Qwen3.5/3.6 checkpoints store the text stack under this prefix.
LANGUAGE_MODEL_KEY_MAPPING = {r"^model\.language_model\.": "model."}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its recipe name (``bfloat16``, ``float16``, ``float32``) or itself."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"target dtype {dtype!r} is not supported; use one of {list(DTYPES)}.")
    return DTYPES[dtype]


# ----------------------------------------------------------------------------- loading


def load_causal_lm(
    path: str,
    *,
    dtype: str | torch.dtype,
    device: str | torch.device,
    trust_remote_code: bool = False,
    num_hidden_layers: int | None = None,
) -> tuple[PreTrainedModel, Any]:
    """Load the text causal LM at ``path`` and its tokenizer (None when there is none).

    ``path`` is a local directory, a hub id (the local cache is used when offline), ``preset:<name>``
    (random weights of a known shape, built directly on ``device``; ``num_hidden_layers`` builds only
    the first layers) or ``builtin:<name>`` (a checkpoint shipped with the demo). Multimodal Qwen3.5/3.6
    checkpoints load as their text-only ``ForCausalLM``: the vision tower is neither built nor read.
    """
    torch_dtype = resolve_dtype(dtype)
    if path.startswith("preset:"):
        model = build_preset_target(
            path.removeprefix("preset:"),
            dtype=torch_dtype,
            device=device,
            num_hidden_layers=num_hidden_layers,
        )
        return model, None
    if num_hidden_layers is not None:
        raise ValueError(
            f"num_hidden_layers={num_hidden_layers} only applies to preset:<name> targets; a checkpoint is loaded whole."
        )
    if path.startswith("builtin:"):
        path = str(resolve_builtin_target(path.removeprefix("builtin:")))
    check_local_path(path)
    model = load_pretrained_text_model(path, torch_dtype, device, trust_remote_code)
    return model, load_tokenizer(path, trust_remote_code)


def build_preset_target(
    name: str,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    num_hidden_layers: int | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """Random weights of preset ``name``, allocated and initialised directly on ``device``.

    Building inside a ``torch.device`` context means a 27B model never exists on the CPU first. The
    global RNG is forked so that building a preset does not perturb the caller's random stream.
    """
    config = preset_config(name, num_hidden_layers)
    device = torch.device(device)
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def preset_config(name: str, num_hidden_layers: int | None = None) -> PretrainedConfig:
    """The transformers config of target preset ``name``, optionally with fewer layers."""
    if name not in presets.TARGET_PRESETS:
        raise ValueError(f"target preset {name!r} is unknown; use one of {sorted(presets.TARGET_PRESETS)}.")
    config_fn = presets.TARGET_PRESETS[name]
    return config_fn() if num_hidden_layers is None else config_fn(num_hidden_layers=num_hidden_layers)


def resolve_builtin_target(name: str) -> Path:
    """The local directory of the demo's built-in target ``name``."""
    try:
        from dflash_train.demo.target_build import builtin_target_path
    except ImportError as err:
        raise ValueError(
            f"target path 'builtin:{name}' needs dflash_train.demo.target_build, which is not available ({err}); "
            "use a checkpoint directory or preset:<name> instead."
        ) from err
    return Path(builtin_target_path(name))


def check_local_path(path: str) -> None:
    """Raise a ValueError naming ``path`` when it looks like a local path but does not exist.

    A hub id has the form ``org/name``; anything absolute, relative (``./``, ``../``), home-based or
    with more than one ``/`` is a local path, and a typo there must not become a hub download attempt.
    """
    if Path(path).expanduser().exists():
        return
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path
    if looks_local:
        raise ValueError(
            f"target.path {path!r} does not exist: give an existing checkpoint directory, a hub id "
            f"(org/name), or preset:<name> with one of {sorted(presets.TARGET_PRESETS)}."
        )


def load_pretrained_text_model(
    path: str, dtype: torch.dtype, device: str | torch.device, trust_remote_code: bool
) -> PreTrainedModel:
    """The text causal LM of a checkpoint, placed on ``device`` while loading."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise ValueError(
            f"target.path {path!r} is not a local directory and could not be resolved as a hub id "
            f"(offline? download it first or point to a local copy): {err}"
        ) from err
    kwargs: dict[str, Any] = {}
    device = torch.device(device)
    # Without accelerate, transformers refuses device_map: load on the CPU and move the weights.
    direct = device.type != "cpu" and package_importable("accelerate")
    if direct:
        kwargs["device_map"] = device
    elif device.type != "cpu":
        warnings.warn(
            "accelerate is not installed: the target is loaded on the CPU first, then moved to "
            f"{device} (slower, needs host memory for all weights); `pip install accelerate` avoids it.",
            stacklevel=3,
        )
    if config.model_type.startswith("qwen3_5") and getattr(config, "text_config", None) is not None:
        config, kwargs["key_mapping"] = qwen35_text_only(config), LANGUAGE_MODEL_KEY_MAPPING
    model, info = AutoModelForCausalLM.from_pretrained(
        path,
        config=config,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
        **kwargs,
    )
    # A missing tensor would be silently random-initialised (e.g. an untied LM head): refuse it.
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ValueError(
            f"checkpoint {path!r} lacks {len(missing)} weights of the text model, e.g. {missing[:5]}."
        )
    return model.eval() if direct else model.to(device).eval()


def qwen35_text_only(config: PretrainedConfig) -> PretrainedConfig:
    """The text config of a ``Qwen3_5(Moe)ForConditionalGeneration`` checkpoint, ready for ``ForCausalLM``.

    The multimodal model ties its LM head according to the top-level ``tie_word_embeddings``; the text
    config must agree, or a tied checkpoint (no ``lm_head.weight`` on disk) would get a random head.
    """
    text = config.text_config
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    if getattr(config, "quantization_config", None) is not None:
        text.quantization_config = config.quantization_config
    return text


def load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    """The checkpoint's tokenizer, or None for a local directory that ships none."""
    local = Path(path).expanduser()
    if local.is_dir() and not any((local / name).exists() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


# ----------------------------------------------------------------------------- the frozen target


class FrozenTarget:
    """A frozen target LM and the DFlash features of its ``target_layer_ids`` layers.

    ``model`` is the whole causal LM in eval mode with no parameter requiring grad; ``embed_tokens``
    and ``lm_head`` are the model's own modules (the drafter shares them, tied or untied). ``features``
    runs only the layers it needs; everything else stays usable for evaluation and regeneration.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        target_layer_ids: list[int],
        kernels: dict[str, str] | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = presets.text_config(model.config)
        self.decoder = model.get_decoder()
        if not isinstance(getattr(self.decoder, "layers", None), nn.ModuleList):
            raise ValueError(
                f"{type(model).__name__}: cannot find its decoder layers (expected a .layers list)."
            )
        self.num_layers = len(self.decoder.layers)
        self.target_layer_ids = check_layer_ids(target_layer_ids, self.num_layers)
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        self.kernels = dict(kernels) if kernels is not None else bound_kernels(model)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Outputs of layers ``target_layer_ids`` concatenated in that order: [R, L] ids -> [R, L, n*H].

        Runs the model's own decoder forward (its masks, rotary embedding and padding handling for
        linear-attention layers) with the layer list cut after ``max(target_layer_ids)`` and the final
        norm skipped, so no later layer, final norm or LM head runs and no KV/recurrent cache is
        built. ``no_grad`` rather than ``inference_mode``: the drafter saves these features for its
        backward, which inference tensors forbid. Only the returned tensor outlives the call.
        """
        captured: dict[int, torch.Tensor] = {}
        handles = [
            self.decoder.layers[i].register_forward_hook(capture_output_into(captured, i))
            for i in set(self.target_layer_ids)
        ]
        try:
            with run_only_first_layers(self.decoder, max(self.target_layer_ids) + 1):
                self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)


def check_layer_ids(target_layer_ids: list[int], num_layers: int) -> list[int]:
    """Validated feature layer ids: non-empty, 0-based and below ``num_layers``.

    Repeats are allowed: the DFlash default repeats ids on targets with fewer layers than features
    (the tiny test targets), and a repeated feature is merely redundant.
    """
    ids = [int(i) for i in target_layer_ids]
    if not ids or not all(0 <= i < num_layers for i in ids):
        raise ValueError(
            f"target.target_layer_ids={ids}: give 0-based layer ids within [0, {num_layers - 1}] "
            f"(the target has {num_layers} decoder layers), or leave it empty for the DFlash default "
            f"{presets.default_target_layer_ids(num_layers)}."
        )
    return ids


def capture_output_into(captured: dict[int, torch.Tensor], layer_id: int) -> Callable:
    """A forward hook storing a decoder layer's output hidden states in ``captured[layer_id]``."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        # transformers 5 layers return the tensor; older ones a tuple whose first item it is.
        captured[layer_id] = output[0] if isinstance(output, tuple) else output

    return hook


@contextlib.contextmanager
def run_only_first_layers(decoder: nn.Module, num_layers: int) -> Iterator[None]:
    """Temporarily cut ``decoder.layers`` to its first ``num_layers`` and make the final norm a no-op.

    Swapping the module list (rather than re-implementing the decoder loop) keeps the model's own mask
    creation, position handling and per-layer-type masks, which differ between Qwen3.5 hybrids,
    Qwen3-Next, Qwen3 and Llama. The original modules are always restored.
    """
    layers, norm = decoder.layers, getattr(decoder, "norm", None)
    decoder.layers = layers[:num_layers]
    if norm is not None:
        decoder.norm = nn.Identity()
    try:
        yield
    finally:
        decoder.layers = layers
        if norm is not None:
            decoder.norm = norm


# ----------------------------------------------------------------------------- kernel guard


def gated_delta_net_layers(model: nn.Module) -> list[nn.Module]:
    """The GatedDeltaNet (linear attention) modules of ``model`` (Qwen3.5/3.6, Qwen3-Next)."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def bound_kernels(model: nn.Module) -> dict[str, str]:
    """Which implementation each GatedDeltaNet/conv kernel and the attention of ``model`` run on.

    Values are the implementing package (``fla``, ``causal_conv1d``, a hub kernel's module) or
    ``torch`` for transformers' reference fallback; ``attention`` is the attention implementation.
    """
    config = getattr(model, "config", None)
    kernels = {"attention": str(getattr(config, "_attn_implementation", None) or "unknown")}
    layers = gated_delta_net_layers(model)
    if not layers:
        return kernels
    layer = layers[0]
    modeling_module = sys.modules.get(type(layer).__module__)
    for kernel, function_name in GDN_KERNEL_FUNCTIONS.items():
        # transformers 4.x stored the chosen kernel on the layer; 5.x calls module-level wrappers.
        function = getattr(layer, kernel, None) or getattr(modeling_module, function_name, None)
        kernels[kernel] = kernel_source(function, GDN_KERNEL_PACKAGES[kernel])
    return kernels


def kernel_source(function: Callable | None, fast_package: str) -> str:
    """The package that really implements ``function``, or ``torch`` for transformers' reference code.

    transformers 5 wraps each kernel with ``use_kernel_func_from_hub_with_fallback``, whose closure
    holds the chosen ``implementation`` (e.g. fla's function) next to the reference ``torch_function``;
    we follow ``__wrapped__`` links to that closure. When no wrapper is recognisable we fall back to
    whether the fast package imports, which is the test transformers itself applies.
    """
    if function is None:
        return "torch"
    if getattr(function, "dflash_kernel", None):
        return function.dflash_kernel
    bound = bound_implementation(function)
    if bound is None:
        return fast_package.split(".")[0] if package_importable(fast_package) else "torch"
    implementation, reference = bound
    package = (getattr(implementation, "__module__", None) or "unknown").split(".")[0]
    return "torch" if implementation is reference or package == "transformers" else package


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
    """transformers' ``causal_conv1d_fn`` contract ([B, D, T] in and out) on fla's Triton kernel."""
    from fla.modules.causal_conv1d import causal_conv1d

    out, _ = causal_conv1d(hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation)
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
    if current is None or kernel_source(current, "causal_conv1d") != "torch":
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
    ``allow_slow``. The conv1d fallback is only recorded: it is a cheap depthwise ``F.conv1d``. CPU runs
    (tests, the demo) never raise.
    """
    kernels = bound_kernels(model)
    if torch.device(device).type != "cuda" or kernels.get("chunk_gated_delta_rule", "absent") != "torch":
        return kernels
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    message = (
        f"target ({model_type}) has GatedDeltaNet layers but chunk_gated_delta_rule runs transformers' "
        "PyTorch fallback (about 3x lower target throughput). Install the fla kernels with "
        "`pip install fla-core` (flash-linear-attention), or set target.allow_slow_kernels=true to accept it."
    )
    if not allow_slow:
        raise RuntimeError(message)
    warnings.warn(f"SLOW TARGET: {message}", RuntimeWarning, stacklevel=2)
    return kernels


# ----------------------------------------------------------------------------- drafter compatibility


def special_token_ids(target: FrozenTarget) -> dict[int, str]:
    """pad/eos ids of the target, from its config, generation config and tokenizer."""
    sources = [
        target.config,
        getattr(target.model, "config", None),
        getattr(target.model, "generation_config", None),
        target.tokenizer,
    ]
    found: dict[int, str] = {}
    for source in sources:
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None) if source is not None else None
            for token_id in value if isinstance(value, (list, tuple)) else [value]:
                if token_id is not None:
                    found.setdefault(int(token_id), name.removesuffix("_token_id"))
    return found


def validate_target_for_drafter(target: FrozenTarget, draft: DFlashDraftConfig) -> None:
    """Raise a ValueError that says what to change when ``draft`` cannot run on ``target``.

    Checks the hidden size, the feature layer ids, the vocabulary (the drafter scores with the target's
    LM head) and the mask token (a real embedding row that is neither pad nor eos).
    """
    if draft.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter hidden_size {draft.hidden_size} != target hidden_size {target.hidden_size}: the drafter "
            "uses the target's embedding and LM head; use drafter.preset=from-target or the preset of this target."
        )
    if list(draft.target_layer_ids) != list(target.target_layer_ids):
        raise ValueError(
            f"drafter target_layer_ids {draft.target_layer_ids} != target's {target.target_layer_ids}: "
            "set target.target_layer_ids to the drafter's (its fc layer expects exactly those features)."
        )
    check_layer_ids(draft.target_layer_ids, target.num_layers)
    head_rows = target.lm_head.weight.shape[0]
    if draft.vocab_size != head_rows:
        raise ValueError(
            f"drafter vocab_size {draft.vocab_size} != the target LM head's {head_rows} rows: the drafter "
            "scores with the target's LM head; rebuild the drafter config from this target."
        )
    embed_rows = target.embed_tokens.weight.shape[0]
    if not 0 <= draft.mask_token_id < embed_rows:
        raise ValueError(
            f"mask_token_id {draft.mask_token_id} is not a row of the target embedding (0..{embed_rows - 1}): "
            "set drafter.mask_token_id to an unused/reserved token of the target's vocabulary."
        )
    special = special_token_ids(target)
    if draft.mask_token_id in special:
        raise ValueError(
            f"mask_token_id {draft.mask_token_id} is the target's {special[draft.mask_token_id]} token: "
            "MASK must be a token that never appears in data; set drafter.mask_token_id to a reserved token."
        )


# ----------------------------------------------------------------------------- entry point


def resolve_target_layer_ids(
    cfg: TargetConfig, num_layers: int, num_target_features: int | None
) -> list[int]:
    """``cfg.target_layer_ids``, or the DFlash default for ``num_target_features`` over ``num_layers``."""
    num_features = num_target_features or cfg.num_target_features
    if not cfg.target_layer_ids:
        return presets.default_target_layer_ids(num_layers, num_features)
    if num_target_features is not None and len(cfg.target_layer_ids) != num_target_features:
        raise ValueError(
            f"target.target_layer_ids={cfg.target_layer_ids} has {len(cfg.target_layer_ids)} ids but the drafter "
            f"expects {num_target_features} features: give {num_target_features} ids or leave the list empty."
        )
    return check_layer_ids(cfg.target_layer_ids, num_layers)


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


def load_target(
    cfg: TargetConfig,
    device: str | torch.device,
    *,
    num_target_features: int | None = None,
    truncate_unused_layers: bool = False,
    compile_regions: bool = False,
) -> FrozenTarget:
    """Load, freeze and check the target of ``cfg`` on ``device``.

    Feature layers are ``cfg.target_layer_ids`` or the DFlash default. ``truncate_unused_layers``
    (benchmarks) builds a ``preset:`` target only up to ``max(target_layer_ids)``; a checkpoint is
    always loaded whole because eval and regeneration need every layer. ``compile_regions`` (the
    training feature pass, ``target.compile``) applies ``compile_target_regions`` on CUDA.
    """
    device = torch.device(device)
    dtype = resolve_dtype(cfg.dtype)
    if device.type == "cuda" and dtype == torch.float32:
        warnings.warn("target.dtype=float32 on CUDA is slow and uses 2x memory; use bfloat16.", stacklevel=2)
    layer_ids, num_hidden_layers = None, None
    if truncate_unused_layers and cfg.path.startswith("preset:"):
        full_depth = preset_config(cfg.path.removeprefix("preset:")).num_hidden_layers
        layer_ids = resolve_target_layer_ids(cfg, full_depth, num_target_features)
        num_hidden_layers = max(layer_ids) + 1
    elif truncate_unused_layers:
        warnings.warn(
            "truncate_unused_layers applies to preset: targets only; loading the whole checkpoint.",
            stacklevel=2,
        )
    model, tokenizer = load_causal_lm(
        cfg.path,
        dtype=dtype,
        device=device,
        trust_remote_code=cfg.trust_remote_code,
        num_hidden_layers=num_hidden_layers,
    )
    bind_fla_causal_conv(model, device)
    kernels = check_fast_kernels(model, device, cfg.allow_slow_kernels)
    if layer_ids is None:
        num_layers = presets.text_config(model.config).num_hidden_layers
        layer_ids = resolve_target_layer_ids(cfg, num_layers, num_target_features)
    if compile_regions and device.type == "cuda":
        compile_target_regions(model)
    return FrozenTarget(model, tokenizer, layer_ids, kernels=kernels)


# ----------------------------------------------------------------------------- head only

EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_KEYS = ("lm_head.weight",)


def load_target_head(cfg: TargetConfig, device: str | torch.device) -> FrozenTarget:
    """The target's config, tokenizer, input embedding and LM head, without its decoder weights.

    Split placement's drafter ranks need only these; loading a 27B checkpoint whole would cost
    ~54 GB of host memory per rank. For a local safetensors checkpoint the model is built on the
    meta device and only the embedding and LM-head tensors are read; ``preset:``/``builtin:``
    targets and other formats are loaded whole on the CPU first. The decoder's layer list is
    emptied either way (``num_layers`` and ``target_layer_ids`` keep the real depth).
    """
    path = Path(cfg.path)
    if cfg.path.startswith(("preset:", "builtin:")) or not any(path.glob("*.safetensors")):
        target = load_target(cfg, "cpu")
    else:
        model = meta_text_model(cfg)
        layer_ids = resolve_target_layer_ids(cfg, presets.text_config(model.config).num_hidden_layers, None)
        target = FrozenTarget(model, load_tokenizer(cfg.path, cfg.trust_remote_code), layer_ids, kernels={})
        load_head_tensors(path, target, resolve_dtype(cfg.dtype))
    target.decoder.layers = nn.ModuleList()
    target.embed_tokens.to(device)
    target.lm_head.to(device)
    return target


def meta_text_model(cfg: TargetConfig) -> PreTrainedModel:
    """The text causal LM of ``cfg.path`` with every parameter on the meta device (no memory)."""
    config = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    if config.model_type.startswith("qwen3_5") and getattr(config, "text_config", None) is not None:
        config = qwen35_text_only(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=resolve_dtype(cfg.dtype), trust_remote_code=cfg.trust_remote_code
        )


def load_head_tensors(path: Path, target: FrozenTarget, dtype: torch.dtype) -> None:
    """Read only the embedding and LM-head tensors from the checkpoint's safetensors files."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            where.update({key: file for key in f.keys() if key in EMBED_KEYS + LM_HEAD_KEYS})

    def read(keys: tuple[str, ...]) -> torch.Tensor | None:
        key = next((k for k in keys if k in where), None)
        if key is None:
            return None
        with safe_open(where[key], framework="pt") as f:
            return f.get_tensor(key).to(dtype)

    embed = read(EMBED_KEYS)
    if embed is None:
        raise ValueError(f"{path}: no input embedding among {EMBED_KEYS} in its safetensors files.")
    target.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
    head = read(LM_HEAD_KEYS)
    if head is None and not target.config.tie_word_embeddings:
        raise ValueError(f"{path}: untied target without {LM_HEAD_KEYS[0]} in its safetensors files.")
    target.lm_head.weight = (
        target.embed_tokens.weight if head is None else nn.Parameter(head, requires_grad=False)
    )
