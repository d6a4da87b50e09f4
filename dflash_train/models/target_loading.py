"""Locating and loading a target checkpoint: local directory, hub id, ``preset:`` or ``builtin:``.

``load_causal_lm`` returns the text causal LM and its tokenizer. Multimodal Qwen3.5/3.6
checkpoints load as their text-only ``ForCausalLM`` (the vision tower is neither built nor read),
and a checkpoint that lacks weights of the text model is refused instead of silently
random-initialised. ``meta_text_model`` and ``load_head_tensors`` build a model without memory and
read only its embedding and LM head (split placement's drafter ranks).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from dflash_train.models import presets
from dflash_train.models.builtin_targets import resolve_builtin_target
from dflash_train.models.dtypes import resolve_dtype
from dflash_train.models.recipe_config import TargetConfig
from dflash_train.models.target_kernels import package_importable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Multimodal Qwen3.5/3.6 checkpoints store the text stack under this prefix.
LANGUAGE_MODEL_KEY_MAPPING = {r"^model\.language_model\.": "model."}
EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_KEYS = ("lm_head.weight",)


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
    the first layers) or ``builtin:<name>`` (a registered checkpoint, ``models/builtin_targets.py``).
    Multimodal Qwen3.5/3.6 checkpoints load as their text-only ``ForCausalLM``.
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
    path = resolve_target_path(path)
    check_local_path(path)
    model = load_pretrained_text_model(path, torch_dtype, device, trust_remote_code)
    return model, load_tokenizer(path, trust_remote_code)


def resolve_target_path(path: str) -> str:
    """``builtin:<name>`` as its registered directory; any other path unchanged."""
    if path.startswith("builtin:"):
        return str(resolve_builtin_target(path.removeprefix("builtin:")))
    return path


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


# ----------------------------------------------------------------------------- head only


def meta_text_model(cfg: TargetConfig) -> PreTrainedModel:
    """The text causal LM of ``cfg.path`` with every parameter on the meta device (no memory)."""
    config = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    if config.model_type.startswith("qwen3_5") and getattr(config, "text_config", None) is not None:
        config = qwen35_text_only(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=resolve_dtype(cfg.dtype), trust_remote_code=cfg.trust_remote_code
        )


def load_head_tensors(path: Path, model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Read only the embedding and LM-head tensors of ``model`` from the checkpoint's safetensors files."""
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

    embed_tokens, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    embed = read(EMBED_KEYS)
    if embed is None:
        raise ValueError(f"{path}: no input embedding among {EMBED_KEYS} in its safetensors files.")
    embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
    head = read(LM_HEAD_KEYS)
    if head is None and not presets.text_config(model.config).tie_word_embeddings:
        raise ValueError(f"{path}: untied target without {LM_HEAD_KEYS[0]} in its safetensors files.")
    lm_head.weight = embed_tokens.weight if head is None else nn.Parameter(head, requires_grad=False)
