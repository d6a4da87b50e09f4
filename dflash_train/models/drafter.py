"""The DFlash block-diffusion draft model (architecture only; DESIGN.md section 1).

Qwen3-style decoder layers whose queries come only from block tokens and whose keys/values are
``[k_proj(ctx); k_proj(block)]`` / ``[v_proj(ctx); v_proj(block)]`` with ``ctx = hidden_norm(fc(features))``
computed once and never updated across layers. The drafter has no embedding or LM head: the
target's frozen ``embed_tokens`` is passed in, and its LM head is applied to the returned (finally
normed) hidden states by the caller.

Matching the serving implementations, so that exported weights serve correctly (checked against
z-lab/dflash ``dflash/model.py``, SGLang ``python/sglang/srt/models/dflash.py`` and vLLM
``vllm/model_executor/models/qwen3_dflash.py``):
- the context goes into k_proj/v_proj straight from ``hidden_norm(fc(features))``; the layer's
  ``input_layernorm`` is applied to the block hidden states only (z-lab passes ``target_hidden`` to
  the attention un-normed; SGLang's ``kv_proj_only`` and vLLM's ``precompute_and_store_context_kv``
  project ``hidden_norm`` output directly);
- k_norm then RoPE on both parts; RoPE is the plain default rotation (rotate-half / neox style)
  over the full head_dim with the drafter's rope_theta; context position p, block token k at a+k;
- the final ``norm`` is applied before the target's LM head (all three return normed hidden states).

Variants (``config.variant``, one module each in ``models/variants/``) choose the decoder layer,
add their heads, and say which slots are scored (DFlash2's convolutions and selector:
``models/dflash2.py``; DSpark's Markov and confidence heads: ``models/dspark.py``). ``forward_train(...,
heads=True)`` returns what the loss needs of them (``DraftOutput``); ``draft_tokens`` is each variant's drafting
procedure on the block hidden states (argmax / the selector's walk / the Markov chain).

Shapes: R rows, L sequence, A anchors, B block size, H hidden, n feature layers, P cached context
length, T query tokens, Hq/Hkv query/kv heads, D head dim (``DraftOutput``: D predicted slots), M blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn

from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.masks import (
    AttendFn,
    CachedBlockAttention,
    LayerMaskSpec,
    build_train_attention,
)
from dflash_train.models.variant import DrafterVariant, get_variant

Rope = tuple[Tensor, Tensor]  # (cos, sin), each [R|1, 1, T, D], in the activations' dtype


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale by ``weight`` in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> Rope:
    """Default RoPE tables for positions [R|1, T] -> cos, sin [R|1, 1, T, D].

    Computed from the positions each call (float32) rather than stored as a buffer, so casting the
    model to bf16 never degrades the frequencies and the model builds on the meta device.
    """
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[..., None] * inv_freq  # [R|1, T, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, rope: Rope) -> Tensor:
    """Rotate-half RoPE on x [R, heads, T, D]."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    """Qwen3 attention projections (per-head q_norm/k_norm, GQA, no bias); masking lives in masks.py."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def project_q(self, x: Tensor, rope: Rope) -> Tensor:
        """Block queries [R, T, H] -> [R, Hq, T, D], normed and roped."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (-1, self.head_dim))).transpose(1, 2)
        return apply_rotary(q, rope)

    def project_kv(self, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor]:
        """Context or block states [R, T, H] -> k, v [R, Hkv, T, D]; k normed and roped."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (-1, self.head_dim))).transpose(1, 2)
        return apply_rotary(k, rope), self.v_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)


class DFlashMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer; block tokens attend to [context ; own block] through ``attend``."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: Tensor, context: Tensor, block_rope: Rope, context_rope: Rope, attend: AttendFn
    ) -> Tensor:
        """Training step of one layer: hidden [R, T, H] block states, context [R, L, H] -> [R, T, H].

        The context K/V projection happens inside the layer so activation checkpointing around
        the layer also recomputes (instead of storing) the per-layer context keys and values.
        """
        k_ctx, v_ctx = self.self_attn.project_kv(context, context_rope)
        return self.forward_with_context_kv(hidden, k_ctx, v_ctx, block_rope, attend)

    def forward_with_context_kv(
        self, hidden: Tensor, k_ctx: Tensor, v_ctx: Tensor, block_rope: Rope, attend: AttendFn
    ) -> Tensor:
        """One layer given projected context keys/values k_ctx, v_ctx [R, Hkv, P, D]."""
        x = self.input_layernorm(hidden)  # block states only; the context is not re-normed
        q = self.self_attn.project_q(x, block_rope)
        k_blk, v_blk = self.self_attn.project_kv(x, block_rope)
        out = attend(q, k_ctx, v_ctx, k_blk, v_blk)  # [R, Hq, T, D]
        hidden = hidden + self.self_attn.o_proj(out.transpose(1, 2).flatten(2))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class DraftOutput:
    """What the loss needs of one training forward (``forward_train(..., heads=True)``).

    ``hidden`` [R, A, D, H]: the final-norm states of the D slots that predict ids[a+1] .. ids[a+D]
    (block slots 1..B-1, or 0..B-1 for DSpark). The other fields are the inputs of the loss library's
    variant terms (``train/variant_terms.py``), filled by the variants that use them
    (``DrafterVariant.head_outputs``): a candidate selector's ``selector_gate`` [R, A, D, r]
    (``predecessor_codebook[gold previous] * hidden_projection(h)``), its successor codebook
    ``selector_table`` [V, r] and ``selector_top_k`` (DFlash2); a previous-token logit bias's
    ``markov_latent`` [R, A, D, r] (the Markov embedding of the gold previous token) and
    ``markov_table`` [V, r] (``markov_w2.weight``), and an acceptance head's ``confidence`` logits
    [R, A, D] (DSpark). The tables are returned from the forward so that a sharded (FSDP2) drafter
    hands the loss its gathered weights.
    """

    hidden: Tensor
    selector_gate: Tensor | None = None
    selector_table: Tensor | None = None
    selector_top_k: int = 0
    markov_latent: Tensor | None = None
    markov_table: Tensor | None = None
    confidence: Tensor | None = None


# DDP and FSDP2 find the tensors of a forward's output with pytree (gradient hooks, backward unshard).
pytree.register_dataclass(DraftOutput)


@dataclass
class ContextCache:
    """Per-layer context keys/values [R, Hkv, P, D] for accepted positions 0..P-1 (normed, roped)."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


def block_token_ids(input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """Block tokens [R, A, B]: ``[ids[a], MASK, ..., MASK]`` for every anchor a (anchors [R, A])."""
    first = input_ids.gather(1, anchors)[..., None]  # [R, A, 1]
    return torch.cat([first, first.new_full((*anchors.shape, block_size - 1), mask_token_id)], dim=-1)


def gold_previous_tokens(input_ids: Tensor, anchors: Tensor, num_slots: int) -> Tensor:
    """The data's token before each scored slot's label [R, A, D]: slot j's label is ids[a+1+j], so its
    predecessor is ids[a+j] (the anchor for j = 0); clamped at the row's end (such slots are unscored)."""
    positions = (anchors[..., None] + torch.arange(num_slots, device=anchors.device)).clamp(
        max=input_ids.shape[1] - 1
    )
    return input_ids.gather(1, positions.flatten(1)).view_as(positions)


def block_positions(anchors: Tensor, block_size: int) -> Tensor:
    """Positions [R, A, B] of the block tokens: a, a+1, ..., a+B-1 (may run past L; RoPE does not care)."""
    return anchors[..., None] + torch.arange(block_size, device=anchors.device)


class DFlashDrafter(nn.Module):
    """DFlash draft model; parameter names are exactly the serving tensor names (DESIGN.md section 3)."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(
                f"rope_scaling {config.rope_scaling} is not supported by the drafter; set rope_scaling: null."
            )
        if "sliding_attention" in config.layer_types and config.sliding_window < config.block_size:
            raise ValueError(
                f"sliding_window={config.sliding_window} < block_size={config.block_size}: serving engines "
                "would then window the block itself, which training does not model; use a window >= block."
            )
        self.config = config
        hidden = config.hidden_size
        layer_class = self.variant.decoder_layer(DFlashDecoderLayer)
        self.layers = nn.ModuleList(layer_class(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_target_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.variant.add_heads(self)
        # An engine's early stop of a block (llama.cpp --spec-draft-p-min): 0 drafts full blocks, as
        # engines do by default; set it with ``set_draft_p_min``.
        self.draft_p_min = 0.0
        self.mask_specs = {
            name: LayerMaskSpec.for_layer(name, config.sliding_window, config.is_causal)
            for name in dict.fromkeys(config.layer_types)
        }
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """HF-style init: linear weights N(0, std), norms 1, then each variant module's own
        (``reset_variant_parameters``); a no-op on the meta device."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for module in self.modules():
            if hasattr(module, "reset_variant_parameters"):
                module.reset_variant_parameters()

    @property
    def variant(self) -> DrafterVariant:
        """The config's variant (``models/variant.py``): its layers, heads and drafting procedure."""
        return get_variant(self.config.variant)

    def set_draft_p_min(self, p_min: float) -> None:
        """Draft as an engine run with ``--spec-draft-p-min p_min`` does (DSpark: stop the block at the
        first slot whose confidence is below it); refused for a variant whose stop is not reproduced."""
        self.variant.check_draft_p_min(self.config, p_min)
        self.draft_p_min = float(p_min)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, positions: Tensor) -> Rope:
        """RoPE tables for positions [R|1, T] in the drafter's dtype."""
        return rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.dtype)

    def embed_block(self, ids: Tensor, embed_tokens: nn.Embedding) -> Tensor:
        """Block token ids [R, T] -> [R, T, H] through the target's embedding, in the drafter's dtype."""
        # The target's embedding is frozen: detach so no gradient can ever reach it.
        return F.embedding(ids, embed_tokens.weight.detach()).to(self.dtype)

    def project_context(self, features: Tensor) -> Tensor:
        """Target features [R, L, n*H] -> ctx [R, L, H] = hidden_norm(fc(features)).

        Under autocast ``fc`` takes the bf16 features as they are (casting them to the fp32 master
        dtype first would only write an fp32 copy that autocast casts straight back).
        """
        if not torch.is_autocast_enabled(features.device.type):
            features = features.to(self.dtype)
        return self.hidden_norm(self.fc(features))

    # -- training ---------------------------------------------------------------------------------

    def forward(self, *args, drafts_with: nn.Module | None = None, **kwargs) -> Tensor | DraftOutput:
        """``forward_train``; call the module itself under DDP/FSDP so their forward hooks run.

        ``drafts_with=lm_head`` returns every block's drafts [R, A, num_draft_tokens] instead
        (``draft_tokens`` inside the forward, so a sharded drafter's heads are gathered)."""
        if drafts_with is None:
            return self.forward_train(*args, **kwargs)
        hidden = self.forward_train(*args, **kwargs)
        input_ids, anchors, keep = args[1], args[2], args[3]
        first = input_ids.gather(1, torch.where(keep, anchors, torch.zeros_like(anchors)))
        drafts = self.draft_tokens(hidden.flatten(0, 1), first.flatten(), drafts_with)
        return drafts.view(*anchors.shape, -1)

    def forward_train(
        self,
        features: Tensor,
        input_ids: Tensor,
        anchors: Tensor,
        keep: Tensor,
        embed_tokens: nn.Embedding,
        backend: str = "sdpa",
        sdpa_anchor_chunk: int = 64,
        *,
        sdpa_trim_context: bool = False,
        position_ids: Tensor | None = None,
        heads: bool = False,
    ) -> Tensor | DraftOutput:
        """All blocks of a micro-batch at once -> hidden [R, A, B, H] after the final norm
        (``heads``: the ``DraftOutput`` the loss needs instead).

        features [R, L, n*H], input_ids [R, L], anchors [R, A] (0 <= a < L where keep), keep [R, A].
        Padded anchors (keep=0) are moved to position 0: their outputs are don't-care but finite.
        ``backend`` "flex" or "sdpa" (chunks of ``sdpa_anchor_chunk`` anchors; ``sdpa_trim_context``
        trades fixed shapes for fewer FLOPs, see masks.ChunkedSdpaAttention).
        ``position_ids`` [R, L] (packed rows) restart at 0 at every conversation: RoPE uses them, and
        a block sees only the context of its anchor's conversation.
        """
        num_rows, seq_len = input_ids.shape
        size = self.config.block_size
        anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
        ids = block_token_ids(input_ids, anchors, size, self.config.mask_token_id)
        hidden = self.embed_block(ids.flatten(1), embed_tokens)  # [R, A*B, H]
        context = self.project_context(features)  # [R, L, H]
        context_start = None
        if position_ids is None:
            block_rope = self.rope(block_positions(anchors, size).flatten(1))
            context_rope = self.rope(torch.arange(seq_len, device=input_ids.device)[None])
        else:
            anchor_positions = position_ids.gather(1, anchors)  # [R, A]: positions in the conversation
            context_start = anchors - anchor_positions
            block_rope = self.rope(block_positions(anchor_positions, size).flatten(1))
            context_rope = self.rope(position_ids)
        attends = build_train_attention(
            backend,
            anchors,
            seq_len,
            size,
            self.mask_specs,
            sdpa_anchor_chunk=sdpa_anchor_chunk,
            sdpa_trim_context=sdpa_trim_context,
            context_start=context_start,
        )
        for layer, layer_type in zip(self.layers, self.config.layer_types, strict=True):
            hidden = layer(hidden, context, block_rope, context_rope, attends[layer_type])
        hidden = self.norm(hidden).view(num_rows, -1, size, hidden.shape[-1])
        return self.draft_output(hidden, input_ids, anchors) if heads else hidden

    def draft_output(self, hidden: Tensor, input_ids: Tensor, anchors: Tensor) -> DraftOutput:
        """hidden [R, A, B, H] -> the scored slots and, per variant, its heads' training inputs."""
        scored = hidden[:, :, self.config.first_scored_slot :]
        return DraftOutput(hidden=scored, **self.variant.head_outputs(self, scored, input_ids, anchors))

    @torch.no_grad()
    def draft_tokens(
        self, hidden: Tensor, anchor_ids: Tensor, lm_head: nn.Module, chunk_tokens: int = 2048
    ) -> Tensor:
        """The variant's drafts [M, num_draft_tokens] from block hidden states [M, B, H] (final norm
        applied) and the blocks' first tokens [M]: the argmax of the target's LM head (DFlash), the
        selector's left-to-right walk over its top-K (DFlash2), or the Markov chain (DSpark), cut at
        ``draft_p_min`` where the variant stops a block early (``NO_DRAFT`` after the cut).
        Blocks go through the LM head ``chunk_tokens`` tokens at a time ([M, D, V] never exists)."""
        step = max(1, chunk_tokens // hidden.shape[1])
        if hidden.shape[0] <= step:
            return self._block_drafts(hidden, anchor_ids, lm_head)
        parts = [
            self._block_drafts(hidden[i : i + step], anchor_ids[i : i + step], lm_head)
            for i in range(0, hidden.shape[0], step)
        ]
        return torch.cat(parts)

    def _block_drafts(self, hidden: Tensor, anchor_ids: Tensor, lm_head: nn.Module) -> Tensor:
        scored = hidden[:, self.config.first_scored_slot :]
        logits = lm_head(scored.to(lm_head.weight.dtype)).float()  # [M, D, V]
        return self.variant.drafts_from_logits(self, logits, scored, anchor_ids)

    # -- inference --------------------------------------------------------------------------------

    def new_context_cache(self, batch: int = 1) -> ContextCache:
        """An empty context cache for ``batch`` sequences."""
        cfg, weight = self.config, self.fc.weight
        empty = weight.new_zeros(batch, cfg.num_key_value_heads, 0, cfg.head_dim)
        return ContextCache(keys=[empty] * len(self.layers), values=[empty] * len(self.layers))

    def extend_context(self, cache: ContextCache, features: Tensor) -> ContextCache:
        """Append accepted positions P..P+P_new-1 from target features [R, P_new, n*H] (in place)."""
        start = cache.length
        positions = torch.arange(start, start + features.shape[1], device=features.device)[None]
        context, rope = self.project_context(features), self.rope(positions)
        for index, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(context, rope)
            cache.keys[index] = torch.cat([cache.keys[index], k], dim=2)
            cache.values[index] = torch.cat([cache.values[index], v], dim=2)
        return cache

    def crop_context(self, cache: ContextCache, length: int) -> ContextCache:
        """Keep only positions < length (rollback after rejected drafts), in place."""
        cache.keys = [k[:, :, :length] for k in cache.keys]
        cache.values = [v[:, :, :length] for v in cache.values]
        return cache

    def forward_block(
        self, block_ids: Tensor, start: int, cache: ContextCache, embed_tokens: nn.Embedding
    ) -> Tensor:
        """One block [R, B] at positions start..start+B-1 over cached context positions < start -> [R, B, H]."""
        assert cache.length == start, f"context cache holds {cache.length} positions, block starts at {start}"
        size = block_ids.shape[1]
        hidden = self.embed_block(block_ids, embed_tokens)
        rope = self.rope(torch.arange(start, start + size, device=block_ids.device)[None])
        attends = {
            name: CachedBlockAttention(start, size, spec, block_ids.device)
            for name, spec in self.mask_specs.items()
        }
        for index, layer in enumerate(self.layers):
            attend = attends[self.config.layer_types[index]]
            hidden = layer.forward_with_context_kv(
                hidden, cache.keys[index], cache.values[index], rope, attend
            )
        return self.norm(hidden)
