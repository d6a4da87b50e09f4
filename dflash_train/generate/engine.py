"""The batched generation engine of synth, regen and the exact eval: fixed slots, refilled as rows end.

``SlotEngine`` keeps ``S`` batch slots. Every prompt waits in a queue (longest first); a free slot
takes the next one, so a batch never waits for its longest row: the moment a row stops (stop id or
``max_new_tokens``) its slot is refilled from the queue (continuous batching, as serving engines do).

- Admission: the admitted prompts are prefilled together (left padded, the same forward as the
  padded engine of ``generate.sampling``, in groups of at most ``max_prefill_tokens``), their first
  token is drawn from the prefill's logits, and their cache rows are copied into their slots of a
  preallocated ``SlotCache`` (``generate/slot_cache.py``): attention K/V per slot from index 0,
  GatedDeltaNet conv/recurrent states per slot (fixed size, updated in place).
- Decode step: one token for every slot, shape [S, 1] whatever the rows' lengths: position ids
  are each slot's own, K/V are written at each slot's own index, and the decode attention
  (``generate/decode_attention.py``: GQA-native, no copy of the cache) shows slot r the indices <=
  its position. The step reads and writes only preallocated buffers (last tokens, positions, step
  counts, done/stopped flags, the generated tokens [S, max_new_tokens], the stop ids, step hashes
  and token limit, refilled in place by each call), so on CUDA it is captured as a CUDA graph and replayed,
  also by later calls. The grouped attention attends the first ``kv_length`` cache indices, a
  bucket (multiple of ``kv_bucket``) above every running row's position, which the host knows
  without a sync (one graph per bucket); flex attends each slot's live blocks of the whole
  capacity (one graph). The graphs' lifetimes (one pool, a fresh one after a drop, warm-ups on the
  capture stream) are ``generate/step_graphs.py``'s; no graph keeps live tensors across replays:
  its results go to the engine's buffers.
- Host: every ``check_every`` steps one sync reads the done flags; finished rows' tokens are
  collected and their slots refilled once at least ``refill_fraction`` of the slots are free
  (or nothing is running), so small prefills do not interrupt decoding every step.

Finished rows keep stepping (frozen position, results discarded) until the next check.
The per-row contract is the padded engine's: the token of row r at step t is drawn with the
splitmix64 uniform of (seed, key[r], t), greedy at temperature 0, the stop token excluded from the
tokens and reported as ``Generation.stop_id``. A row therefore gets the same tokens in either engine
(in fp32 exactly, up to ties), in any slot, batch or admission order.

``build_generator`` picks this engine, or the padded engine where ``slot_engine_problem`` names a
reason (sliding-window attention, flash attention, sharded parameters), with a warning.

Shapes: S slots, G admitted rows, C cache capacity, N max new tokens, V vocab.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable, Collection, Sequence

import torch

from dflash_train.generate.compiled_step import CompiledStep, compile_report, default_compile_decode
from dflash_train.generate.decode_attention import (
    DECODE_ATTENTIONS,
    FLEX_BLOCK,
    LiveBlockMask,
    check_flex_compiles,
    decoding_with,
    default_decode_attention,
)
from dflash_train.generate.loops import LoopStop, looping_rows
from dflash_train.generate.sampling import (
    Generation,
    PaddedEngine,
    Sampling,
    check_request,
    choose_tokens,
    left_pad,
    row_streams,
    row_uniforms,
    step_keys,
)
from dflash_train.generate.slot_cache import SlotAttentionLayer, SlotCache, check_free_memory
from dflash_train.generate.step_graphs import GraphRuntime, StepGraphs

# on_rows(num_rows_finished, num_tokens_generated), called as rows finish (progress bars).
RowsCallback = Callable[[int, int], None]
SUPPORTED_LAYER_TYPES = {"full_attention", "linear_attention"}
# Callers with many rows (regen, synth) hand the engine this many rows per slot per call: slots
# freed early are refilled from the rest, and only the call's last rows run in a draining batch.
QUEUE_ROWS_PER_SLOT = 4
MIN_STOP_SLOTS = 2  # entries of the stop-id buffer (compiled step: no dimension of size 1)


def slot_engine_problem(model: torch.nn.Module) -> str | None:
    """Why ``SlotEngine`` cannot run ``model`` (then the padded engine does), or None."""
    config = model.config.get_text_config(decoder=True)
    attention = str(getattr(model.config, "_attn_implementation", None) or "eager")
    if attention not in ("sdpa", "eager"):
        return f"attention implementation {attention!r} cannot take the slot cache's 4D mask (load with sdpa)"
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        unsupported = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
        if unsupported:
            return f"layer types {unsupported} (only full attention and GatedDeltaNet layers are supported)"
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention (the slot cache's mask is full causal)"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "sharded (DTensor) parameters"
    return None


class SlotEngine:
    """Continuous batching over ``num_slots`` slots with a preallocated cache; see the module docstring.

    Reusable across calls: the cache and the captured graphs stay (the cache is reallocated, and the
    graphs dropped, when a call needs a longer capacity or more generated tokens per row).
    """

    name = "slots"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_slots: int,
        use_cuda_graphs: bool | None = None,
        check_every: int = 4,
        kv_bucket: int | None = None,
        refill_fraction: float = 1 / 16,
        max_prefill_tokens: int = 32768,
        decode_attention: str | None = None,
        graph_runtime: GraphRuntime | None = None,
        compile_decode: bool | None = None,
    ):
        problem = slot_engine_problem(model)
        if problem is not None:
            raise ValueError(f"the slot generation engine cannot run this model: {problem}")
        if num_slots < 1 or check_every < 1 or max_prefill_tokens < 1 or not 0 < refill_fraction <= 1:
            raise ValueError(
                f"num_slots={num_slots}, check_every={check_every}, max_prefill_tokens={max_prefill_tokens}: "
                f"use >= 1; refill_fraction={refill_fraction}: use 0 < fraction <= 1"
            )
        self.model = model
        self.device = next(model.parameters()).device
        layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()
        self.hybrid = "linear_attention" in layer_types
        self.decode_attention = decode_attention or default_decode_attention(self.device, self.hybrid)
        if self.decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(
                f"decode_attention={decode_attention!r}: use one of {', '.join(DECODE_ATTENTIONS)}"
            )
        if compile_decode is None:
            compile_decode = default_compile_decode(self.device, self.hybrid)
        self.compile_decode = compile_decode
        self.step_body = CompiledStep(self.forward_and_draw) if compile_decode else self.forward_and_draw
        self.dtype = next(model.parameters()).dtype
        self.num_slots = num_slots
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.check_every = check_every
        self.kv_bucket = kv_bucket or (256 if self.device.type == "cuda" else 64)
        if self.decode_attention == "flex":  # the capacity must be whole BlockMask blocks
            self.kv_bucket = math.lcm(self.kv_bucket, FLEX_BLOCK)
        self.refill_min = max(1, math.ceil(num_slots * refill_fraction))
        self.max_prefill_tokens = max_prefill_tokens
        self.cache: SlotCache | None = None
        self.live_mask: LiveBlockMask | None = None  # flex: the per-step BlockMask over the cache
        self.max_new_tokens = 0  # width of ``generated`` and ``hashed_steps``
        self.graphs = StepGraphs(graph_runtime)  # a graph per step key (CUDA, or a stand-in runtime)
        self.num_steps = 0  # decode steps run (tests and benchmarks)
        self.generated_tokens = 0  # tokens drawn over all calls, stop tokens included (progress)
        slots, device = num_slots, self.device
        self.slot_index = torch.arange(slots, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # where each slot's token goes
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # the token each slot feeds next
        self.steps = torch.zeros(slots, dtype=torch.long, device=device)  # tokens drawn by each slot's row
        self.streams = torch.zeros(slots, dtype=torch.long, device=device)
        self.done = torch.ones(slots, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self.generated = torch.zeros(slots, 0, dtype=torch.long, device=device)
        # Everything a captured graph reads is one of these engine buffers, refilled in place by each
        # call (a graph replays the addresses it captured; a call's own tensors would be freed).
        self.hashed_steps = step_keys(0, device)  # [N] the hash of each step index
        # Stop ids padded with -1; never a single entry: the compiled step specialises a dimension of
        # size 1 and would compile again when a call brings more ids (generate/compiled_step.py).
        self.stops = torch.full((MIN_STOP_SLOTS,), -1, dtype=torch.long, device=device)
        self.mark_dynamic(self.stops, 0)
        # The call's max_new_tokens as a tensor, not an int: read by the step, never compiled into it.
        self.token_limit = torch.zeros((), dtype=torch.long, device=device)
        self.kv_index = torch.arange(0, device=device)  # [C] 0..C-1, allocated with the cache

    # -- the public call ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        keys: Sequence[int],
        *,
        max_new_tokens: int,
        stop_ids: Collection[int],
        pad_id: int,
        sampling: Sampling,
        on_rows: RowsCallback | None = None,
        loop_stop: LoopStop | None = None,
    ) -> list[Generation]:
        """Continue every prompt until a stop id or ``max_new_tokens``; ``keys`` seed each row's draws;
        with ``loop_stop``, also until the row repeats itself (``generate/loops.py``; ``looped``)."""
        check_request(prompts, keys, max_new_tokens)
        check_flex_compiles(self.decode_attention, self.device, self.use_cuda_graphs)  # the stance of now
        self.set_stops(stop_ids)
        run = Run(self, prompts, keys, max_new_tokens, pad_id, sampling, on_rows, loop_stop)
        run.loop()
        return run.results

    # -- buffers --------------------------------------------------------------------------------------
    def set_stops(self, stop_ids: Collection[int]) -> None:
        """Refill the stop-id buffer in place (grown, and the graphs dropped, for more ids)."""
        stop_ids = sorted(stop_ids)
        if len(stop_ids) > self.stops.numel():
            self.graphs.drop()
            size = max(MIN_STOP_SLOTS, 1 << (len(stop_ids) - 1).bit_length())
            self.stops = torch.full((size,), -1, dtype=torch.long, device=self.device)
            self.mark_dynamic(self.stops, 0)
        self.stops.fill_(-1)
        if stop_ids:
            self.stops[: len(stop_ids)] = torch.as_tensor(stop_ids, dtype=torch.long, device=self.device)

    def reserve(self, prefill, capacity: int, max_new_tokens: int) -> None:
        """A slot cache of at least ``capacity`` and token buffers of ``max_new_tokens`` (nothing occupied)."""
        capacity = round_up(capacity, self.kv_bucket)
        if self.cache is None or self.cache.capacity < capacity:
            self.graphs.drop()
            self.cache = None  # free the old storage before allocating the new
            check_free_memory(prefill, self.num_slots, capacity, self.device)
            # compiled: one spare index, so the attended part is never the whole storage (compiled_step.py)
            self.cache = SlotCache(prefill, capacity, self.positions, spare_index=self.compile_decode)
            self.kv_index = torch.arange(capacity, device=self.device)  # a step attends kv_index[:kv_length]
            self.mark_dynamic(self.kv_index, 0)
            for layer in self.cache.layers:
                if isinstance(layer, SlotAttentionLayer):
                    self.mark_dynamic(layer.keys, 2)
                    self.mark_dynamic(layer.values, 2)
            if self.decode_attention == "flex":
                self.live_mask = LiveBlockMask(self.positions, capacity)
        if self.max_new_tokens < max_new_tokens:
            self.graphs.drop()
            self.generated = torch.zeros(self.num_slots, max_new_tokens, dtype=torch.long, device=self.device)
            self.hashed_steps = step_keys(max_new_tokens, self.device)
            self.mark_dynamic(self.generated, 1)
            self.mark_dynamic(self.hashed_steps, 0)
            self.max_new_tokens = max_new_tokens

    def mark_dynamic(self, tensor: torch.Tensor, dim: int) -> None:
        """Compiled step: ``dim`` of ``tensor`` is a symbol from the first compilation (it differs
        between calls), not a constant to compile again for (generate/compiled_step.py)."""
        if self.compile_decode:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)

    # -- one decode step --------------------------------------------------------------------------------
    def step(self, spec: StepSpec) -> None:
        """One token for every slot; with graphs, a captured graph per ``spec.key`` after its warm-up."""
        self.num_steps += 1
        if not self.use_cuda_graphs:
            return self.decode(spec)
        self.graphs.run(spec.key, lambda: self.decode(spec))

    def decode(self, spec: StepSpec) -> None:
        """The step itself: only tensor ops on preallocated buffers (capturable)."""
        assert 0 < spec.kv_length <= self.cache.capacity, (spec.kv_length, self.cache.capacity)
        # The attended length reaches the step as the size of this view (a symbol when compiled).
        attended = self.kv_index[: spec.kv_length]
        self.mark_dynamic(attended, 0)
        with decoding_with(self.model):
            self.step_body(attended, self.token_limit, spec.sampling)

    def forward_and_draw(self, attended: torch.Tensor, token_limit: torch.Tensor, sampling: Sampling) -> None:
        """One forward of every slot's token, its draw and the buffers' update (``compile_decode``
        compiles exactly this): the cache indices ``attended`` [kv], at most ``token_limit`` tokens."""
        self.cache.set_kv_length(attended.shape[0])
        out = self.model(
            input_ids=self.tokens[:, None],
            position_ids=self.positions[:, None],
            attention_mask=self.decode_mask(attended),
            past_key_values=self.cache,
            use_cache=True,
        )
        running = ~self.done
        token = self.draw(out.logits[:, -1].float(), self.steps, token_limit, sampling)
        column = self.steps.clamp(max=token_limit - 1)[:, None]
        kept = self.generated.gather(1, column).squeeze(1)
        self.generated.scatter_(1, column, torch.where(running, token, kept)[:, None])
        hit = running & is_stop(token, self.stops)
        self.stopped |= hit
        self.steps += running.long()
        self.done |= hit | (self.steps >= token_limit)
        self.tokens.copy_(torch.where(running, token, self.tokens))
        self.positions += (~self.done).long()

    def decode_mask(self, attended: torch.Tensor):
        """What the decode attention reads (slot r sees cache indices <= its position): flex, a
        BlockMask of each slot's live blocks; grouped, an additive bias [S, 1, 1, kv] over the cache
        indices ``attended`` [kv]. Hybrid models take a mask per layer type (their GatedDeltaNet
        layers need none in a decode step)."""
        if self.decode_attention == "flex":
            mask = self.live_mask.build()
        else:
            hidden = attended[None, :] > self.positions[:, None]  # [S, kv]
            bias = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device)
            mask = bias.masked_fill(hidden, torch.finfo(self.dtype).min)[:, None, None]
        return {"full_attention": mask, "linear_attention": None} if self.hybrid else mask

    def attended_length(self, bucket: int) -> int:
        """Cache indices a step hands the attention: flex reads live blocks of the whole capacity
        (one graph for every length); grouped reads the bucket above every running row."""
        return self.cache.capacity if self.decode_attention == "flex" else bucket

    def draw(self, logits, steps, max_new_tokens, sampling: Sampling, streams=None) -> torch.Tensor:
        """Each row's token for its step ``steps`` [rows] from ``logits`` [rows, V] (``max_new_tokens``
        an int, or the engine's ``token_limit``)."""
        streams = self.streams if streams is None else streams
        hashed = self.hashed_steps[steps.clamp(max=max_new_tokens - 1)]
        return choose_tokens(logits, row_uniforms(streams, hashed), sampling)


class StepSpec:
    """What a decode step is specialised on (a graph per distinct ``key``). Values only: the tensors
    a step reads are the engine's buffers, never a call's."""

    def __init__(self, kv_length: int, max_new_tokens: int, num_stops: int, sampling: Sampling):
        self.kv_length = kv_length
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.key = (kv_length, max_new_tokens, num_stops, sampling.temperature, sampling.top_p)

    def with_kv_length(self, kv_length: int) -> StepSpec:
        spec = object.__new__(StepSpec)
        spec.__dict__.update(self.__dict__, kv_length=kv_length, key=(kv_length, *self.key[1:]))
        return spec


class Run:
    """One ``generate`` call: the queue, which row occupies which slot, and the collected results."""

    def __init__(
        self, engine: SlotEngine, prompts, keys, max_new_tokens, pad_id, sampling, on_rows, loop_stop
    ):
        self.engine = engine
        self.loop_stop = loop_stop
        self.looped = (
            torch.zeros(engine.num_slots, dtype=torch.bool, device=engine.device) if loop_stop else None
        )
        self.prompts = [list(p) for p in prompts]
        self.keys = list(keys)
        self.max_new_tokens = max_new_tokens
        self.pad_id = pad_id
        self.on_rows = on_rows
        self.spec = StepSpec(0, max_new_tokens, engine.stops.numel(), sampling)
        engine.token_limit.fill_(max_new_tokens)
        self.results: list[Generation | None] = [None] * len(self.prompts)
        self.queue = deque(sorted(range(len(self.prompts)), key=lambda i: -len(self.prompts[i])))
        self.occupant: dict[int, int] = {}  # slot -> row
        self.bound: dict[int, int] = {}  # slot -> an upper bound of the position it feeds next
        self.free = list(range(engine.num_slots))
        self.capacity = max(len(p) for p in self.prompts) + max_new_tokens

    def loop(self) -> None:
        engine = self.engine
        engine.done.fill_(True)
        while self.queue or self.occupant:
            if self.queue and self.wants_refill():
                self.admit()
            if self.max_new_tokens > 1:
                spec = self.spec.with_kv_length(engine.attended_length(self.kv_length(engine.check_every)))
                for _ in range(engine.check_every):
                    engine.step(spec)
                for slot in self.occupant:
                    self.bound[slot] += engine.check_every
            self.collect()

    def wants_refill(self) -> bool:
        needed = min(self.engine.refill_min, len(self.queue))
        return bool(self.free) and (len(self.free) >= needed or not self.occupant)

    def kv_length(self, num_steps: int) -> int:
        """A bucket above every position fed in the next ``num_steps`` steps (host arithmetic, no sync)."""
        cap = self.engine.cache.capacity
        highest = max(min(b + num_steps, cap) for b in self.bound.values())
        return min(round_up(highest, self.engine.kv_bucket), cap)

    # -- admission ------------------------------------------------------------------------------------
    def admit(self) -> None:
        rows = [self.queue.popleft() for _ in range(min(len(self.free), len(self.queue)))]
        for group in prefill_groups([len(self.prompts[r]) for r in rows], self.engine.max_prefill_tokens):
            group_rows = [rows[i] for i in group]
            slots = [self.free.pop(0) for _ in group_rows]
            self.prefill(group_rows, slots)

    def prefill(self, rows: list[int], slots: list[int]) -> None:
        """Prefill ``rows`` together, draw their first token and move them into ``slots``."""
        engine = self.engine
        prompts = [self.prompts[r] for r in rows]
        ids, mask = left_pad(prompts, self.pad_id, engine.device)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        out = engine.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        engine.reserve(out.past_key_values, self.capacity, self.max_new_tokens)
        index = torch.as_tensor(slots, dtype=torch.long, device=engine.device)
        lengths = [len(p) for p in prompts]
        engine.cache.admit(out.past_key_values, index, lengths)
        streams = row_streams(
            self.spec.sampling.seed, torch.as_tensor([self.keys[r] for r in rows], device=engine.device)
        )
        spec = self.spec
        first = engine.draw(
            out.logits[:, -1].float(), torch.zeros_like(index), spec.max_new_tokens, spec.sampling, streams
        )
        hit = is_stop(first, engine.stops)
        engine.streams[index] = streams
        engine.generated[index, 0] = first
        engine.tokens[index] = first
        engine.positions[index] = torch.as_tensor(lengths, device=engine.device)
        engine.steps[index] = 1
        engine.stopped[index] = hit
        engine.done[index] = hit | (self.max_new_tokens <= 1)
        for row, slot, length in zip(rows, slots, lengths):
            self.occupant[slot] = row
            self.bound[slot] = length

    # -- collection -----------------------------------------------------------------------------------
    def collect(self) -> None:
        """Finished rows' tokens into ``results``; their slots become free (one sync)."""
        engine = self.engine
        if self.loop_stop is not None:  # a looping row ends here, as if at its token limit
            looping = looping_rows(engine.generated, engine.steps, self.loop_stop) & ~engine.done
            self.looped |= looping
            engine.done |= looping
        done = engine.done.tolist()  # host sync: which rows ended (the loop's only regular sync)
        finished = [slot for slot in self.occupant if done[slot]]
        if not finished:
            return
        index = torch.as_tensor(finished, dtype=torch.long, device=engine.device)
        tokens = engine.generated[index, : self.max_new_tokens].tolist()
        counts, stopped = engine.steps[index].tolist(), engine.stopped[index].tolist()
        looped = [False] * len(finished)
        if self.looped is not None:  # one more small copy, only where loops are stopped
            looped = self.looped[index].tolist()
            self.looped[index] = False
        num_tokens = 0
        for slot, row_tokens, count, stop, loop in zip(finished, tokens, counts, stopped, looped):
            row_tokens = row_tokens[:count]
            stop_id = row_tokens.pop() if stop else None
            self.results[self.occupant.pop(slot)] = Generation(row_tokens, bool(stop), stop_id, loop)
            del self.bound[slot]
            self.free.append(slot)
            num_tokens += count
        self.free.sort()
        engine.generated_tokens += num_tokens
        if self.on_rows is not None:
            self.on_rows(len(finished), num_tokens)


def prefill_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices (already longest first) cut into groups of at most ``max_tokens`` padded tokens."""
    groups: list[list[int]] = []
    for i, length in enumerate(lengths):
        if groups and max(lengths[groups[-1][0]], length) * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def is_stop(tokens: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """[rows] bool; a broadcast compare rather than ``isin`` (no data-dependent kernels in a graph)."""
    return (tokens[:, None] == stops[None, :]).any(dim=-1)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ----------------------------------------------------------------------------- engine choice


def decode_step_report(generator) -> dict:
    """What regen and synth report of a generator's decode step: its attention (``decode_attention``;
    None for an engine without one: the padded engine, an endpoint) and its compilations
    (``compiled_step.compile_report``)."""
    return {"decode_attention": getattr(generator, "decode_attention", None), **compile_report(generator)}


def build_generator(model: torch.nn.Module, *, num_slots: int, engine: str = "auto", **options):
    """``SlotEngine`` (``engine`` auto or slots) or ``PaddedEngine`` (padded, or auto where the slot
    engine cannot run the model: warned). ``options`` go to ``SlotEngine``."""
    if engine not in ("auto", "slots", "padded"):
        raise ValueError(f"generation engine {engine!r}: use auto, slots or padded")
    if engine == "padded":
        return PaddedEngine(model, num_slots=num_slots)
    problem = slot_engine_problem(model)
    if problem is not None and engine == "auto":
        warnings.warn(
            f"generation runs on the padded-batch engine (slower): the slot engine cannot run this model: {problem}",
            stacklevel=2,
        )
        return PaddedEngine(model, num_slots=num_slots)
    return SlotEngine(model, num_slots=num_slots, **options)
