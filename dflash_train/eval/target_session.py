"""Incremental verification against a HF causal-LM target: prefill, verify a block, commit a prefix.

Speculative decoding needs the target to score a block of candidate tokens in ONE forward and then
forget the rejected ones. ``TargetSession`` owns the target's cache and does exactly that:

- ``prefill(prompt)`` runs the prompt and returns its logits and target features;
- ``verify(tokens)`` appends T candidate tokens after the committed prefix, returns the target's
  logits for each of them and the hidden-state features of ``target_layer_ids`` (captured with
  forward hooks on the decoder layers: feature at position p = concat of those layers' outputs at p,
  exactly what training uses);
- ``commit(n)`` keeps the first n verified tokens and rolls the cache back to them.

Rolling back. Attention K/V is cropped. A GatedDeltaNet layer's conv and recurrent states summarise
the whole prefix and cannot be cropped, so before a multi-token verify we snapshot them (a copy of
a few MB per layer) and on partial acceptance restore the snapshot and *replay only the
GatedDeltaNet token mixers* on the accepted tokens: their inputs (the normed hidden states entering
``linear_attn``) were recorded by a hook during the verify pass, and a causal layer's inputs at the
accepted positions do not depend on the rejected ones. The replay therefore costs the GatedDeltaNet
mixers on <= T-1 tokens (no MLPs, no attention layers, no LM head); full acceptance costs nothing.

Tree verification (DDTree) uses ``verify_tree`` / ``commit_path``: an ancestor-only 4D mask and
position = start + depth; committing a root-to-leaf path gathers the path's K/V entries, which were
computed seeing exactly the path's ancestors, so no re-run is needed. Pure-attention targets only.

Shapes: T verified tokens, V vocab, H hidden, n feature layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, LinearAttentionCacheLayerMixin

HYBRID_TREE_ERROR = (
    "DDTree tree verification is not supported for GatedDeltaNet targets yet: their recurrent state "
    "follows one sequence, so each tree branch would need its own state (per-branch replay). "
    "Use chain drafting (--ddtree-budget 0) for hybrid targets."
)


@dataclass
class Verified:
    """The target's view of the tokens just run: ``logits[T, V]`` (float32), ``features[T, n*H]`` or None."""

    logits: torch.Tensor
    features: torch.Tensor | None


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a (possibly multimodal) HF causal LM."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    inner = getattr(inner, "language_model", inner)
    if not hasattr(inner, "layers"):
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")
    return inner.layers


class TargetSession:
    """One request's incremental state on a frozen target (batch size 1). Use as a context manager
    (or call ``close``) so the feature hooks are removed afterwards."""

    def __init__(self, model: torch.nn.Module, target_layer_ids: Sequence[int] = ()):
        self.model = model
        self.device = next(model.parameters()).device
        self.target_layer_ids = list(target_layer_ids)
        self.cache = None
        self.length = 0  # committed tokens in the cache
        self._pending = 0  # tokens of the last verify not yet committed or rolled back
        self._captured: dict[int, torch.Tensor] = {}
        self._mixer_inputs: dict[int, torch.Tensor] = {}
        self._snapshot: dict[int, tuple[dict, dict]] | None = None
        layers = decoder_layers(model)
        self._mixers = {
            i: layer.linear_attn for i, layer in enumerate(layers) if hasattr(layer, "linear_attn")
        }
        self._hooks = [layers[i].register_forward_hook(self._feature_hook(i)) for i in self.target_layer_ids]
        self._hooks += [
            mixer.register_forward_pre_hook(self._mixer_hook(i), with_kwargs=True)
            for i, mixer in self._mixers.items()
        ]
        self._recording_mixers = False

    @property
    def is_hybrid(self) -> bool:
        """True when the target has GatedDeltaNet (linear-attention) layers with uncroppable state."""
        return bool(self._mixers)

    # -- hooks ------------------------------------------------------------------------------------
    def _feature_hook(self, layer_idx: int):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[layer_idx] = hidden[0]

        return hook

    def _mixer_hook(self, layer_idx: int):
        def hook(module, args, kwargs):
            if self._recording_mixers:
                self._mixer_inputs[layer_idx] = (
                    kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                )

        return hook

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __enter__(self) -> TargetSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- forward passes ---------------------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, tokens: torch.Tensor, **kwargs) -> Verified:
        self._captured.clear()
        out = self.model(
            input_ids=tokens.view(1, -1).to(self.device), past_key_values=self.cache, use_cache=True, **kwargs
        )
        self.cache = out.past_key_values
        features = None
        if self.target_layer_ids:
            features = torch.cat([self._captured[i] for i in self.target_layer_ids], dim=-1)
        return Verified(logits=out.logits[0].float(), features=features)

    def prefill(self, prompt_ids: torch.Tensor) -> Verified:
        """Run the prompt from scratch; the whole prompt is committed."""
        if prompt_ids.numel() == 0:
            raise ValueError("empty prompt: speculative decoding needs at least one prompt token")
        self.cache, self.length, self._pending = None, 0, 0
        result = self._forward(prompt_ids)
        self.length = prompt_ids.numel()
        return result

    def verify(self, tokens: torch.Tensor) -> Verified:
        """Run T tokens after the committed prefix in one forward; call ``commit`` next."""
        assert self._pending == 0, "verify() called twice without commit()"
        multi = tokens.numel() > 1
        if self.is_hybrid and multi:
            self._snapshot = self._snapshot_states()
        self._recording_mixers = self.is_hybrid and multi
        try:
            result = self._forward(tokens)
        finally:
            self._recording_mixers = False
        self._pending = tokens.numel()
        return result

    def commit(self, num_accepted: int) -> None:
        """Keep the first ``num_accepted`` tokens of the last ``verify`` and drop the rest."""
        num_rejected = self._pending - num_accepted
        assert 1 <= num_accepted <= self._pending, (num_accepted, self._pending)
        if num_rejected > 0:
            self._crop_attention(num_rejected)
            if self.is_hybrid:
                self._replay_mixers(num_accepted)
        self.length += num_accepted
        self._pending = 0
        self._snapshot = None
        self._mixer_inputs.clear()

    # -- hybrid state rollback --------------------------------------------------------------------
    def _linear_cache_layers(self) -> dict[int, LinearAttentionCacheLayerMixin]:
        return {i: self.cache.layers[i] for i in self._mixers}

    def _snapshot_states(self) -> dict[int, tuple[dict, dict]]:
        # The cache updates these tensors in place (copy_), so the snapshot must be a real copy.
        return {
            i: (
                {k: v.clone() for k, v in layer.conv_states.items() if v is not None},
                {k: v.clone() for k, v in layer.recurrent_states.items() if v is not None},
            )
            for i, layer in self._linear_cache_layers().items()
        }

    def _replay_mixers(self, num_accepted: int) -> None:
        """Restore the pre-verify GatedDeltaNet states and advance them over the accepted tokens only."""
        assert self._snapshot is not None
        for i, layer in self._linear_cache_layers().items():
            conv, recurrent = self._snapshot[i]
            for k, saved in conv.items():
                layer.conv_states[k].copy_(saved)
            for k, saved in recurrent.items():
                layer.recurrent_states[k].copy_(saved)
            hidden = self._mixer_inputs[i][:, :num_accepted]
            with torch.no_grad():
                self._mixers[i](hidden_states=hidden, cache_params=self.cache, attention_mask=None)

    def _crop_attention(self, num_tokens: int) -> None:
        for layer in self.cache.layers:
            if isinstance(layer, CacheLayerMixin):
                layer.crop(-num_tokens)

    # -- tree verification (DDTree) ---------------------------------------------------------------
    def verify_tree(self, tokens: torch.Tensor, parents: Sequence[int], depths: Sequence[int]) -> Verified:
        """Run a token tree in one forward: node i sees the committed prefix and its own ancestors.

        ``parents[i]`` is the index of node i's parent (-1 for the root, node 0); parents come
        before children. Positions are ``length + depth``.
        """
        if self.is_hybrid:
            raise NotImplementedError(HYBRID_TREE_ERROR)
        assert self._pending == 0, "verify_tree() called twice without commit_path()"
        if "flash" in str(getattr(self.model.config, "_attn_implementation", "")):
            raise NotImplementedError(
                "tree verification needs a 4D attention mask: load the target with sdpa or eager"
            )
        num_nodes = tokens.numel()
        dtype = next(self.model.parameters()).dtype
        mask = torch.full((num_nodes, self.length + num_nodes), torch.finfo(dtype).min, dtype=dtype)
        mask[:, : self.length] = 0
        for i, ancestors in enumerate(ancestor_sets(parents)):
            mask[i, [self.length + a for a in ancestors]] = 0
        positions = torch.tensor(depths, dtype=torch.long).view(1, -1) + self.length
        result = self._forward(
            tokens, attention_mask=mask[None, None].to(self.device), position_ids=positions.to(self.device)
        )
        self._pending = num_nodes
        return result

    def commit_path(self, node_indices: Sequence[int]) -> None:
        """Keep the tree nodes on one root-to-node path (in order) and drop every other node."""
        keep = torch.tensor(
            list(range(self.length)) + [self.length + i for i in node_indices], device=self.device
        )
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError(
                    f"tree commit needs plain full-attention caches, got {type(layer).__name__}"
                )
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
        self.length += len(node_indices)
        self._pending = 0


def ancestor_sets(parents: Sequence[int]) -> list[list[int]]:
    """For each node, itself and all its ancestors (root included), from a parents-before-children list."""
    sets: list[list[int]] = []
    for i, parent in enumerate(parents):
        assert parent < i, "parents must come before their children"
        sets.append(([] if parent < 0 else sets[parent]) + [i])
    return sets
