"""The frozen target: its DFlash features, and the entry points that load it for training.

``FrozenTarget`` wraps the full model (frozen, every layer, final norm and LM head intact for eval and
regeneration) and computes the DFlash features: the outputs of decoder layers ``target_layer_ids``
(HF's ``hidden_states[id + 1]``) concatenated along the hidden dim, running only layers
``0..max(target_layer_ids)``. ``load_target`` loads it (``models/target_loading.py``), binds and
checks its kernels (``models/target_kernels.py``) and resolves the feature layers;
``load_target_head`` loads only what split placement's drafter ranks need.
``validate_target_for_drafter`` checks that a drafter can run on it.

Shapes: R rows, L sequence, H hidden, n feature layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from dflash_train.models import presets
from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.dtypes import resolve_dtype
from dflash_train.models.gated_delta_net import bind_fused_gated_delta_net
from dflash_train.models.recipe_config import TargetConfig
from dflash_train.models.target_fp8 import check_fp8_support, quantize_target_linears
from dflash_train.models.target_kernels import (
    bind_fla_causal_conv,
    bound_kernels,
    check_fast_kernels,
    compile_report,
    compile_target_layers,
    compile_target_regions,
    gated_delta_net_layers,
)
from dflash_train.models.target_loading import (
    load_causal_lm,
    load_head_tensors,
    load_tokenizer,
    meta_text_model,
    preset_config,
)

__all__ = [
    "FrozenTarget",
    "check_layer_ids",
    "load_causal_lm",
    "load_target",
    "load_target_head",
    "resolve_target_layer_ids",
    "validate_target_for_drafter",
]


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
        # True when only the layers up to max(target_layer_ids) were built (benchmarks): the model
        # then has no real final layers, so it cannot serve as a KL teacher.
        self.built_truncated = False

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.no_grad()
    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        with_final_hidden: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Outputs of layers ``target_layer_ids`` concatenated in that order: [R, L] ids -> [R, L, n*H].

        Runs the model's own decoder forward (its masks, rotary embedding and padding handling for
        linear-attention layers) with the layer list cut after ``max(target_layer_ids)`` and the final
        norm skipped, so no later layer, final norm or LM head runs and no KV/recurrent cache is
        built. ``no_grad`` rather than ``inference_mode``: the drafter saves these features for its
        backward, which inference tensors forbid. Only the returned tensor outlives the call.

        ``with_final_hidden`` (a KL teacher) runs every layer and the final norm instead and returns
        ``(features, final_hidden [R, L, H])``: the decoder output after its final norm, which the LM
        head turns into the target's own next-token logits.

        ``position_ids`` [R, L] (packed rows, restarting at 0 at every conversation) make the target
        see each conversation as if alone: ``packed_features`` (then ``attention_mask`` must be None).
        """
        if position_ids is not None:
            if attention_mask is not None:
                raise ValueError("packed rows take position_ids without an attention_mask")
            return packed_features(self, input_ids, position_ids, with_final_hidden=with_final_hidden)
        return self.run_decoder(input_ids, attention_mask, with_final_hidden=with_final_hidden)

    def run_decoder(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        with_final_hidden: bool = False,
        **decoder_kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One decoder forward of ``features`` (``decoder_kwargs``: position ids, varlen lengths)."""
        if with_final_hidden and self.built_truncated:
            raise ValueError(
                "this target was built only up to its feature layers (truncate_unused_layers); a KL teacher "
                "needs the final layers and norm: load it whole."
            )
        captured: dict[int, torch.Tensor] = {}
        handles = [
            self.decoder.layers[i].register_forward_hook(capture_output_into(captured, i))
            for i in set(self.target_layer_ids)
        ]
        depth = (
            contextlib.nullcontext()
            if with_final_hidden
            else run_only_first_layers(self.decoder, max(self.target_layer_ids) + 1)
        )
        try:
            with depth:
                output = self.decoder(
                    input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **decoder_kwargs
                )
        finally:
            for handle in handles:
                handle.remove()
        features = torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)
        return (features, output.last_hidden_state) if with_final_hidden else features


# ----------------------------------------------------------------------------- packed rows

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


def packed_features(
    target: FrozenTarget, input_ids: torch.Tensor, position_ids: torch.Tensor, *, with_final_hidden: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``FrozenTarget.features`` of packed rows, every conversation as if it ran alone.

    - Pure-attention targets: one forward with the per-conversation ``position_ids`` and no mask;
      transformers' mask code reads the restarts as packed sequences (block-diagonal causal mask
      for eager/sdpa/flex, varlen lengths for flash attention) and RoPE uses the same positions.
    - GatedDeltaNet hybrids with fla's chunk rule and conv bound: the rows flattened to [1, R*L]
      with ``cu_seq_lens_q`` so the recurrent and conv states restart at every boundary (fla's
      varlen kernels); the attention layers get the packed mask from the position ids.
    - GatedDeltaNet hybrids on transformers' torch fallback (CPU): the fallback ignores
      ``cu_seqlens`` and would carry state across boundaries, so every conversation runs alone
      (correct and slower: the CPU reference).
    Any other layer type (Mamba, ...) is refused rather than risk crossing a boundary.
    """
    layer_types = set(getattr(target.config, "layer_types", None) or ["full_attention"])
    if not type(target.model).__module__.startswith("transformers."):
        # Remote code builds its own masks: nothing says it reads the restarting position ids.
        raise ValueError(
            f"data.packing: the target class {type(target.model).__name__} is not transformers' own "
            "(trust_remote_code), so packed rows could cross conversations; set data.packing=false."
        )
    if not gated_delta_net_layers(target.model):
        if not layer_types <= ATTENTION_LAYER_TYPES:
            raise ValueError(
                f"data.packing: target layer types {sorted(layer_types)} are not supported in packed rows "
                "(only attention and GatedDeltaNet layers are); set data.packing=false."
            )
        return target.run_decoder(input_ids, position_ids=position_ids, with_final_hidden=with_final_hidden)
    if not layer_types <= ATTENTION_LAYER_TYPES | {"linear_attention"}:
        raise ValueError(
            f"data.packing: target layer types {sorted(layer_types)} are not supported; set data.packing=false."
        )
    kernels = target.kernels
    if kernels.get("chunk_gated_delta_rule") == "fla" and kernels.get("causal_conv1d_fn") == "fla":
        return varlen_features(target, input_ids, position_ids, with_final_hidden=with_final_hidden)
    if input_ids.is_cuda:
        warnings.warn(
            "data.packing on a GatedDeltaNet target without fla's varlen kernels (chunk rule "
            f"{kernels.get('chunk_gated_delta_rule')}, conv {kernels.get('causal_conv1d_fn')}): every "
            "conversation runs separately, correct but slow; install fla-core.",
            RuntimeWarning,
            stacklevel=3,
        )
    return per_conversation_features(target, input_ids, position_ids, with_final_hidden=with_final_hidden)


def varlen_features(
    target: FrozenTarget, input_ids: torch.Tensor, position_ids: torch.Tensor, *, with_final_hidden: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Packed rows as one [1, R*L] varlen sequence through fla's kernels; outputs back to [R, L, ...]."""
    num_rows, seq_len = input_ids.shape
    flat_positions = position_ids.reshape(1, -1)
    starts = torch.nonzero(flat_positions[0] == 0).flatten()
    total = torch.tensor([flat_positions.numel()], device=starts.device)
    cu_seqlens = torch.cat([starts, total])  # the one host sync: the number of segments
    # Only the GatedDeltaNet layers take cu_seq_lens_q (the chunk rule pops it, our fla conv reads
    # it); attention layers build their packed mask (eager/sdpa/flex) or varlen lengths (flash)
    # from the restarting position ids, as transformers does for packed sequences.
    out = target.run_decoder(
        input_ids.reshape(1, -1),
        position_ids=flat_positions,
        cu_seq_lens_q=cu_seqlens,
        with_final_hidden=with_final_hidden,
    )
    if with_final_hidden:
        return tuple(t.reshape(num_rows, seq_len, -1) for t in out)
    return out.reshape(num_rows, seq_len, -1)


def per_conversation_features(
    target: FrozenTarget, input_ids: torch.Tensor, position_ids: torch.Tensor, *, with_final_hidden: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every conversation (and padding tail) of every row through the decoder alone (reference path)."""
    outputs: list[torch.Tensor] | None = None
    for row, bounds in enumerate(segment_bounds(position_ids)):
        for start, end in bounds:
            out = target.run_decoder(input_ids[row : row + 1, start:end], with_final_hidden=with_final_hidden)
            parts = out if with_final_hidden else (out,)
            if outputs is None:
                shape = input_ids.shape
                outputs = [p.new_zeros(*shape, p.shape[-1]) for p in parts]
            for full, part in zip(outputs, parts):
                full[row, start:end] = part[0]
    return tuple(outputs) if with_final_hidden else outputs[0]


def segment_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) of every segment (conversation or padding tail): host-side."""
    starts = (position_ids == 0).cpu()
    bounds = []
    for row in starts:
        first = torch.nonzero(row).flatten().tolist()
        bounds.append(list(zip(first, first[1:] + [row.numel()])))
    return bounds


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
    training feature pass, ``target.compile``) applies ``compile_target_regions`` on CUDA
    (``compile_target_layers`` for an FP8 target); ``kernels["compile"]`` says what was compiled.
    ``cfg.fp8`` is checked before any weight loads and converts the decoder linears to FP8 before
    that compilation (``models/target_fp8.py``).
    """
    device = torch.device(device)
    dtype = resolve_dtype(cfg.dtype)
    if cfg.fp8:  # refuse before any weight is loaded
        check_fp8_support(device, dtype)
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
    if kernels.get("chunk_gated_delta_rule") == "fla" and kernels.get("causal_conv1d_fn") == "fla":
        bind_fused_gated_delta_net(gated_delta_net_layers(model))
        kernels = bound_kernels(model)
    if layer_ids is None:
        num_layers = presets.text_config(model.config).num_hidden_layers
        layer_ids = resolve_target_layer_ids(cfg, num_layers, num_target_features)
    if cfg.fp8:  # before compiling, so the compiled regions trace the float8 linears
        kernels.update(quantize_target_linears(model).kernel_entries())
    if compile_regions and device.type == "cuda":
        # FP8 linears need their activation quantization fused: whole layers (compile_target_layers).
        (compile_target_layers if cfg.fp8 else compile_target_regions)(model)
        kernels["compile"] = compile_report(model)
    elif compile_regions:
        kernels["compile"] = "none (target.compile applies on CUDA only)"
    else:
        kernels["compile"] = "none (target.compile off)"
    target = FrozenTarget(model, tokenizer, layer_ids, kernels=kernels)
    target.built_truncated = num_hidden_layers is not None
    return target


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
        # Embedding and LM head stay bf16 under target.fp8, and FP8 cannot load on the CPU.
        target = load_target(dataclasses.replace(cfg, fp8=False), "cpu")
    else:
        model = meta_text_model(cfg)
        load_head_tensors(path, model, resolve_dtype(cfg.dtype))
        layer_ids = resolve_target_layer_ids(cfg, presets.text_config(model.config).num_hidden_layers, None)
        target = FrozenTarget(model, load_tokenizer(cfg.path, cfg.trust_remote_code), layer_ids, kernels={})
    target.decoder.layers = nn.ModuleList()
    target.built_truncated = True  # no decoder layers here: never a KL teacher
    target.embed_tokens.to(device)
    target.lm_head.to(device)
    return target
