"""A preallocated per-slot cache for the generation engine: one row of every cache tensor per batch slot.

The engine (``generate/engine.py``) keeps ``S`` batch slots busy; a slot holds one prompt's row
from its admission until it stops, then the next queued prompt takes it over. This cache gives every
slot fixed storage, allocated once, so a decode step has one shape and can run as a CUDA graph:

- attention layers: K and V of shape [S, Hkv, C, D] (C = capacity in tokens; one index more, never
  attended, for the compiled step: ``spare_index``). A slot's row starts at cache index 0 whatever
  the other slots hold (no padding in the cache), so its token at position p sits at index p.
  ``update`` writes the step's K/V at each slot's own index (``write_positions``, one device tensor
  shared by every layer) and returns the first ``kv_length`` indices; the engine's mask shows slot
  r the indices <= its position only, so stale entries of a slot's previous occupant (and of
  finished rows still stepping) are never seen.
- GatedDeltaNet layers: transformers' own ``LinearAttentionLayer`` with conv [S, C_conv, K] and
  recurrent [S, H, Dk, Dv] states preallocated and ``has_previous_state`` set, so the layer runs its
  single-token update in place (it already keeps these states at a fixed size).

Admission copies a left-padded prefill's ``DynamicCache`` rows into slots (``admit``): attention
rows are shifted left so the prompt starts at index 0, conv/recurrent states are copied as they are.

Shapes: S slots, G admitted rows, L padded prompt length, C capacity, Hkv kv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, LinearAttentionLayer

FREE_MEMORY_FRACTION = 0.9  # of the free GPU memory the slot cache may take


class SlotAttentionLayer(CacheLayerMixin):
    """K/V storage of one attention layer: [S, Hkv, C, D], written at per-slot positions."""

    is_compileable = True

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, write_positions: torch.Tensor, capacity: int
    ):
        super().__init__()
        self.keys, self.values = keys, values  # [S, Hkv, >= capacity, D]
        self.write_positions = write_positions  # [S], shared with the cache and the engine
        self.slot_index = torch.arange(keys.shape[0], device=keys.device)
        self.capacity = capacity
        self.kv_length = capacity  # how many indices a step attends (the engine's bucket)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        raise AssertionError("a SlotAttentionLayer is allocated by SlotCache, never lazily")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """One decode step's K/V [S, Hkv, 1, D] written at ``write_positions``; returns the attended part."""
        assert key_states.shape[2] == 1, "the slot cache takes single-token decode steps only"
        self.keys[self.slot_index, :, self.write_positions] = key_states[:, :, 0]
        self.values[self.slot_index, :, self.write_positions] = value_states[:, :, 0]
        return self.keys[:, :, : self.kv_length], self.values[:, :, : self.kv_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv_length, 0

    def get_seq_length(self) -> int:
        raise NotImplementedError("slot rows have different lengths: the engine passes position ids")

    def get_max_length(self) -> int:
        return self.capacity


class SlotCache(Cache):
    """The per-slot cache of a model, allocated from the layout of a first prefill cache."""

    def __init__(
        self, prefill: Cache, capacity: int, write_positions: torch.Tensor, *, spare_index: bool = False
    ):
        num_slots = write_positions.shape[0]
        self.write_positions = write_positions  # [S] the index each slot's next token is written at
        # spare_index: K/V storage of capacity + 1 indices, the last never written nor attended, so the
        # attended part (<= capacity) is never the whole storage: a contiguous slice at
        # kv_length == capacity would make the compiled step branch, and compile twice
        # (generate/compiled_step.py).
        storage = capacity + int(spare_index)
        layers: list = []
        for layer in prefill.layers:
            if type(layer) is DynamicLayer:
                shape = (num_slots, layer.keys.shape[1], storage, layer.keys.shape[3])
                keys = torch.zeros(shape, dtype=layer.keys.dtype, device=layer.keys.device)
                values = torch.zeros(
                    (*shape[:3], layer.values.shape[3]), dtype=layer.values.dtype, device=layer.values.device
                )
                layers.append(SlotAttentionLayer(keys, values, self.write_positions, capacity))
            elif type(layer) is LinearAttentionLayer:
                layers.append(preallocated_linear_layer(layer, num_slots))
            else:
                raise TypeError(f"the slot cache has no storage for {type(layer).__name__} layers")
        super().__init__(layers=layers)
        self.num_slots, self.capacity = num_slots, capacity

    def set_kv_length(self, kv_length: int) -> None:
        """How many cache indices the next steps attend (<= capacity; every position fed must be
        below). Set inside the decode step (an int, or the compiled step's symbol): the engine
        checks the bound before."""
        for layer in self.layers:
            if isinstance(layer, SlotAttentionLayer):
                layer.kv_length = kv_length

    def admit(self, prefill: Cache, slots: torch.Tensor, lengths: Sequence[int]) -> None:
        """Copy the G rows of a left-padded prefill cache into ``slots`` [G] (prompt lengths ``lengths``)."""
        num_rows = len(lengths)
        for mine, theirs in zip(self.layers, prefill.layers, strict=True):
            if isinstance(mine, SlotAttentionLayer):
                width = theirs.keys.shape[2]
                assert width <= self.capacity, (width, self.capacity)
                # Row g's prompt occupies columns width-len..width-1; move it to indices 0..len-1.
                # Columns past a row's length get other columns' entries: masked until overwritten.
                pad = width - torch.as_tensor(list(lengths), device=slots.device)
                source = (torch.arange(width, device=slots.device)[None] + pad[:, None]).clamp(max=width - 1)
                for store, new in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                    index = source[:, None, :, None].expand(num_rows, new.shape[1], width, new.shape[3])
                    store[:, :, :width].index_copy_(0, slots, new.gather(2, index))
            else:
                pairs = (
                    (mine.conv_states, theirs.conv_states),
                    (mine.recurrent_states, theirs.recurrent_states),
                )
                for states, new in pairs:
                    for key, tensor in new.items():
                        if tensor is not None:
                            states[key].index_copy_(0, slots, tensor.to(states[key].dtype))


def preallocated_linear_layer(layer: LinearAttentionLayer, num_slots: int) -> LinearAttentionLayer:
    """A ``LinearAttentionLayer`` with the states of ``layer`` at ``num_slots`` rows, zeroed, marked as
    having a previous state (so the model takes its single-token path and updates them in place)."""
    slot_layer = LinearAttentionLayer(number_of_states=layer.number_of_states)
    slot_layer.device, slot_layer.dtype = layer.device, layer.dtype
    for key in range(layer.number_of_states):
        for name in ("conv_states", "recurrent_states"):
            tensor = getattr(layer, name)[key]
            if tensor is not None:
                getattr(slot_layer, name)[key] = tensor.new_zeros((num_slots, *tensor.shape[1:]))
        slot_layer.is_conv_states_initialized[key] = layer.conv_states[key] is not None
        slot_layer.is_recurrent_states_initialized[key] = layer.recurrent_states[key] is not None
        slot_layer.conv_kernel_size[key] = layer.conv_kernel_size[key]
        slot_layer.has_previous_state[key] = True
    return slot_layer


def check_free_memory(prefill, num_slots: int, capacity: int, device: torch.device) -> None:
    """Refuse a slot cache that would not fit, saying what to lower (CUDA only)."""
    if device.type != "cuda":
        return
    per_slot = 0
    for layer in prefill.layers:
        if hasattr(layer, "conv_states"):
            tensors = [*layer.conv_states.values(), *layer.recurrent_states.values()]
            per_slot += sum(t[0].numel() * t.element_size() for t in tensors if t is not None)
        else:
            per_slot += capacity * (layer.keys[0, :, 0].numel() * 2) * layer.keys.element_size()
    need = per_slot * num_slots
    free = free_device_memory(device)
    if need > FREE_MEMORY_FRACTION * free:
        raise ValueError(
            f"the generation cache needs {need / 2**30:.1f} GiB ({num_slots} slots x {capacity} tokens) but "
            f"{free / 2**30:.1f} GiB are free: lower the batch size or the maximum new tokens"
        )


def free_device_memory(device: torch.device) -> int:
    """Bytes a new allocation can take: the device's free memory plus what PyTorch's allocator holds
    unused (a slot cache dropped to grow keeps its blocks reserved, and the allocator hands them back
    before it fails; the device alone would count them as taken)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
