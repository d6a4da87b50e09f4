"""A static-cache target session for fast batch-1 decoding: the same prefill / verify / commit
interface as ``TargetSession``, with no per-step allocation, so the fixed-shape steps can run as
CUDA graphs (what a serving engine does; without it a small target is pure launch overhead).

- The K/V cache is transformers' ``StaticCache`` of ``max_length`` slots, allocated once and
  reused by every request. Each step writes at the slots given by one device tensor, the
  committed length (copied into every cache layer's write counter inside the step), and builds
  its own 4D mask: query at position p sees slots <= p. Rolling back after a rejection is just
  setting the committed length: slots past it are masked and get overwritten by the next step.
- ``verify`` runs T tokens; T is padded up to the next captured size (1 for plain decoding,
  ``block_size`` for a chain verify) with copies of the last token. The padded positions lie after
  the real ones, so causal attention keeps them out of the real tokens' results.
- Features: forward hooks on the ``target_layer_ids`` decoder layers (the same capture as
  TargetSession: the output of decoder layer l), registered only while the step runs. Under a CUDA
  graph they run once, at capture, and the concatenation is part of the graph, so a replay runs no
  Python. (HF's ``output_hidden_states`` is hook-based too, and its last entry is post-norm, so it
  would differ from training's features when a feature layer is the last layer.)
- On CUDA each padded size is captured once as a ``torch.cuda.CUDAGraph`` (after two eager warm-up
  runs on a side stream) and replayed; elsewhere the same step runs eagerly, which is how CPU tests
  check it against ``TargetSession``. Prefill is always eager (variable length).

Not supported (``static_engine_problem`` says why, and the eval reports the dynamic engine):
GatedDeltaNet hybrids (uncroppable recurrent state), sliding-window attention, flash attention
(needs the 4D mask), and tree verification.

Shapes: T verified tokens, S cache slots (max_length), V vocab, n*H concatenated features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from dflash_train.eval.target_session import Verified, decoder_layers


def static_engine_problem(model: torch.nn.Module, target_layer_ids: Sequence[int] = ()) -> str | None:
    """Why ``StaticTargetSession`` cannot run this target, or None when it can."""
    layers = decoder_layers(model)
    if any(hasattr(layer, "linear_attn") for layer in layers):
        return "GatedDeltaNet (linear-attention) layers keep a recurrent state that a static KV cache cannot roll back"
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}: only full-attention layers are supported"
    if "flash" in str(getattr(model.config, "_attn_implementation", "")):
        return (
            "flash attention cannot take the 4D mask of the static cache: load the target with sdpa or eager"
        )
    if target_layer_ids and max(target_layer_ids) >= len(layers):
        return f"feature layer {max(target_layer_ids)} does not exist: the target has {len(layers)} layers"
    return None


class StaticTargetSession:
    """One target, one static cache, reused across requests (batch size 1).

    ``graph_sizes``: the verify lengths that get a fixed-shape step (and a CUDA graph when
    ``use_cuda_graphs``, default: the model is on CUDA); a verify of T tokens runs at the smallest
    size >= T, or eagerly at T when there is none. Results of a graphed step are views of its static
    output buffers: valid until the next ``verify``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        target_layer_ids: Sequence[int] = (),
        *,
        max_length: int,
        graph_sizes: Sequence[int] = (1,),
        use_cuda_graphs: bool | None = None,
    ):
        problem = static_engine_problem(model, target_layer_ids)
        if problem is not None:
            raise ValueError(
                f"the static decode engine cannot run this target: {problem}. Use --decode-engine dynamic."
            )
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.target_layer_ids = list(target_layer_ids)
        self.max_length = max_length
        self.graph_sizes = sorted(set(graph_sizes))
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.cache = StaticCache(config=model.config, max_cache_len=max_length)
        if not all(type(layer) is StaticLayer for layer in self.cache.layers):
            raise ValueError("the static decode engine needs plain StaticLayer caches (full attention only)")
        self.length = 0  # committed tokens
        self._pending = 0
        self._length_t = torch.zeros(
            (), dtype=torch.long, device=self.device
        )  # the committed length, on device
        self._slots = torch.arange(max_length, device=self.device)
        self._steps: dict[int, GraphedStep] = {}

    @property
    def is_hybrid(self) -> bool:
        return False

    @property
    def engine_name(self) -> str:
        """``static-cudagraph`` or ``static-eager`` (CPU, or graphs switched off)."""
        return "static-cudagraph" if self.use_cuda_graphs else "static-eager"

    # TargetSession is a context manager; this session outlives requests, so there is nothing to close.
    def close(self) -> None:
        return None

    def __enter__(self) -> StaticTargetSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the step -----------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [1, T] written at slots length..length+T-1 -> logits [T, V] float32, features [T, n*H].

        Only tensor ops on static buffers, so the whole function can be captured as a CUDA graph.
        """
        num_tokens = ids.shape[1]
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(self._length_t)  # where StaticLayer.update writes
        positions = self._length_t + torch.arange(num_tokens, device=self.device)  # [T]
        visible = self._slots[None, :] <= positions[:, None]  # [T, S]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[None, None]
        captured: dict[int, torch.Tensor] = {}
        layers = decoder_layers(self.model)
        hooks = [layers[i].register_forward_hook(_capture_into(captured, i)) for i in self.target_layer_ids]
        try:
            out = self.model(
                input_ids=ids,
                position_ids=positions[None],
                attention_mask=mask,
                past_key_values=self.cache,
                use_cache=True,
            )
        finally:
            for hook in hooks:
                hook.remove()
        features = None
        if self.target_layer_ids:
            features = torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)
        return out.logits[0].float(), features

    def _check_room(self, num_tokens: int) -> None:
        if self.length + num_tokens > self.max_length:
            raise ValueError(
                f"static KV cache of {self.max_length} slots is full ({self.length} committed + {num_tokens} "
                "new): build the session with max_length >= prompt + max_new_tokens + block_size"
            )

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> Verified:
        """Run the prompt from slot 0 (eagerly); the whole prompt is committed."""
        if prompt_ids.numel() == 0:
            raise ValueError("empty prompt: speculative decoding needs at least one prompt token")
        self.length, self._pending = 0, 0
        self._check_room(prompt_ids.numel())
        self._length_t.fill_(0)
        logits, features = self._forward(prompt_ids.view(1, -1).to(self.device))
        self.length = prompt_ids.numel()
        return Verified(logits=logits, features=features)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor) -> Verified:
        """Run T tokens after the committed prefix in one forward; call ``commit`` next."""
        assert self._pending == 0, "verify() called twice without commit()"
        num_tokens = tokens.numel()
        size = next((s for s in self.graph_sizes if s >= num_tokens), num_tokens)
        self._check_room(size)
        self._length_t.fill_(self.length)
        if size not in self.graph_sizes:
            logits, features = self._forward(tokens.view(1, -1).to(self.device))
        else:
            # Padding with the last token: the padded positions come after the real ones, so causal
            # attention keeps them out of the real tokens' results; their slots are past the commit.
            padded = torch.cat([tokens.view(-1), tokens.view(-1)[-1:].expand(size - num_tokens)])
            logits, features = self._step(size).run(padded.view(1, -1))
        self._pending = num_tokens
        return Verified(
            logits=logits[:num_tokens], features=None if features is None else features[:num_tokens]
        )

    def commit(self, num_accepted: int) -> None:
        """Keep the first ``num_accepted`` tokens of the last ``verify``: move the committed length."""
        assert 1 <= num_accepted <= self._pending, (num_accepted, self._pending)
        self.length += num_accepted
        self._pending = 0

    def verify_tree(self, *args, **kwargs):
        raise NotImplementedError(
            "the static decode engine has no tree verification; DDTree runs on TargetSession"
        )

    def _step(self, size: int) -> GraphedStep:
        if size not in self._steps:
            self._steps[size] = GraphedStep(self._forward, size, self.device, self.use_cuda_graphs)
        return self._steps[size]


def _capture_into(captured: dict[int, torch.Tensor], layer_idx: int):
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        captured[layer_idx] = hidden[0]

    return hook


class GraphedStep:
    """A fixed-shape ``forward(ids[1, size])`` with a static input buffer; with ``use_graph`` (CUDA)
    captured as a graph on first use and replayed afterwards. Each graph has its own memory pool:
    graphs sharing a pool must replay in capture order, and the decode loop mixes T = 1 and T = B."""

    def __init__(self, forward, size: int, device: torch.device, use_graph: bool) -> None:
        self.forward = forward
        self.ids = torch.zeros(1, size, dtype=torch.long, device=device)
        self.use_graph = use_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None

    def run(self, ids: torch.Tensor):
        self.ids.copy_(ids, non_blocking=True)
        if not self.use_graph:
            return self.forward(self.ids)
        if self.graph is None:
            self.graph, self.outputs = capture_graph(lambda: self.forward(self.ids))
        self.graph.replay()
        return self.outputs


def capture_graph(fn):
    """Capture ``fn()`` as a CUDA graph: two eager warm-up runs on a side stream (kernel selection,
    lazy allocations stay out of the graph), then the capture. Returns (graph, static outputs).
    The warm-up runs really execute: ``fn`` must only write state that the replay rewrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
