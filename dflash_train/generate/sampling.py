"""Per-row seeded token draws, and the padded-batch engine (``PaddedEngine``, the fallback of ``generate/engine.py``).

``generate/engine.py``'s slot engine is what synth, regen and the exact eval run; it draws every
token with ``choose_tokens`` / ``row_uniforms`` below and runs ``left_pad``'s prefill. The loop
here (``sample_batch``) is the simpler engine it replaced: the fallback for models the slot engine
cannot run, and the reference its tests and the generation benchmark compare against.

Prompts are LEFT-padded (the next token of every row sits in the last column) under an attention
mask, with position ids that restart at 0 on each row's first real token, so a row computes what it
would alone; the pad id never matters (tokenizers without a pad token pad with EOS). The model's own
cache is used (KV for attention layers, conv/recurrent state for GatedDeltaNet layers), and only the
last position's logits are computed. Generation stops as soon as every row has hit a stop id, and
once at most half of the rows are still running the finished ones are dropped from the batch (their
cache rows too), so a few long replies do not keep paying for a full batch.

Randomness is per row, not per batch: the uniform number that picks row r's token at step t is a
splitmix64 hash of (seed, key[r], t), mapped to a token by inverse-CDF sampling over the
temperature-shaped distribution restricted to its top-p nucleus, in token-id order
(``generate/nucleus.py``: the nucleus is found without sorting the vocabulary). A row's draw
therefore depends only on its own key and logits, not on the batch it lands in, its batch size or a
resumed run's position. Temperature 0 is greedy (argmax). Earlier versions walked the CDF in sorted
order (most likely token first): the same uniform generally picks another token now, from the same
distribution.

Shapes: R rows, L padded prompt length, V vocab.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import torch

from dflash_train.generate.loops import LoopStop, looping_rows
from dflash_train.generate.nucleus import nucleus_tokens
from dflash_train.hashing import shift_right_logical, splitmix64
from dflash_train.models.dtypes import parse_device

CHECK_EVERY = 4  # steps between host syncs that test "all rows done" and compact the batch
MIN_ROWS_TO_COMPACT = 8


@dataclass(frozen=True)
class Sampling:
    """How tokens are picked: greedy at ``temperature`` 0, else nucleus (``top_p``) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"temperature {self.temperature} / top_p {self.top_p}: use temperature >= 0 and 0 < top_p <= 1"
            )


@dataclass
class Generation:
    """One row's new tokens (stop token excluded), whether it ended on a stop token, and which;
    ``looped``: ended early because it repeated itself (``generate/loops.py``)."""

    token_ids: list[int]
    finished: bool
    stop_id: int | None = None
    looped: bool = False


def row_streams(seed: int, keys: torch.Tensor) -> torch.Tensor:
    """One int64 stream id per row from (seed, key): [R]."""
    return splitmix64(splitmix64(torch.full_like(keys, seed)) ^ keys)


def step_keys(num_steps: int, device) -> torch.Tensor:
    """Hashed step numbers [num_steps], made once so that no step copies anything to the device."""
    return splitmix64(torch.arange(num_steps, dtype=torch.int64, device=device))


def row_uniforms(streams: torch.Tensor, step_key: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) per row for one decoding step: [R] float32."""
    bits = shift_right_logical(splitmix64(streams ^ step_key), 11)  # 53 random bits
    return (bits.to(torch.float64) * 2.0**-53).to(torch.float32)


def choose_tokens(logits: torch.Tensor, uniforms: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Next token per row from ``logits`` [R, V] (float32): argmax, or an inverse-CDF draw from the
    top-p nucleus of the temperature-scaled softmax (``generate.nucleus``: no sort)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    return nucleus_tokens(probs, uniforms, sampling.top_p)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [R, L], attention_mask [R, L]) with every prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[r, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def sample_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    keys: Sequence[int],
    *,
    max_new_tokens: int,
    stop_ids: Collection[int],
    pad_id: int,
    sampling: Sampling,
    loop_stop: LoopStop | None = None,
) -> list[Generation]:
    """Continue every prompt until a stop id or ``max_new_tokens``; ``keys`` seed each row's draws;
    with ``loop_stop``, also until the row repeats itself (checked every ``CHECK_EVERY`` steps)."""
    check_request(prompts, keys, max_new_tokens)
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    streams = row_streams(sampling.seed, torch.as_tensor(list(keys), dtype=torch.int64, device=device))
    hashed_steps = step_keys(max_new_tokens, device)
    stops = torch.as_tensor(sorted(stop_ids), dtype=torch.long, device=device)
    rows = torch.arange(len(prompts), device=device)  # original row of each batch slot
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache, last_pos = out.past_key_values, positions[:, -1:]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    looped = torch.zeros_like(done)  # by original row
    history = (
        torch.zeros((len(prompts), max_new_tokens), dtype=torch.long, device=device) if loop_stop else None
    )
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, tokens, done before)
    for step in range(max_new_tokens):
        tokens = choose_tokens(out.logits[:, -1].float(), row_uniforms(streams, hashed_steps[step]), sampling)
        steps.append((rows, tokens, done))
        done = done | torch.isin(tokens, stops)
        if step == max_new_tokens - 1:
            break
        if loop_stop is not None:
            history[rows, step] = tokens
        if (step + 1) % CHECK_EVERY == 0:
            if loop_stop is not None:  # every row still running has step + 1 tokens
                looping = looping_rows(history[rows], torch.full_like(rows, step + 1), loop_stop) & ~done
                looped[rows] |= looping
                done = done | looping
            num_running = int((~done).sum())  # host sync: needed to stop early and to compact
            if num_running == 0:
                break
            if num_running <= len(done) // 2 and len(done) >= MIN_ROWS_TO_COMPACT:
                keep = (~done).nonzero().squeeze(-1)
                if compact_cache(cache, keep):
                    rows, streams, mask, last_pos, done, tokens = (
                        t[keep] for t in (rows, streams, mask, last_pos, done, tokens)
                    )
        tokens = torch.where(done, torch.full_like(tokens, pad_id), tokens)  # finished rows idle on pad
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        last_pos = last_pos + 1
        out = model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=last_pos,
            past_key_values=cache,
            use_cache=True,
        )
    generations = collect(steps, len(prompts), stops)
    if loop_stop is None:
        return generations
    return [replace(g, looped=bool(x)) for g, x in zip(generations, looped.tolist(), strict=True)]


def compact_cache(cache, keep: torch.Tensor) -> bool:
    """Keep only batch rows ``keep`` of the model's cache; False when the cache cannot reorder."""
    reorder = getattr(cache, "reorder_cache", None)
    if reorder is None:
        return False  # an exotic cache class: keep stepping the whole batch (slower, same result)
    reorder(keep)
    return True


def collect(steps, num_rows: int, stops: torch.Tensor) -> list[Generation]:
    """Per-row token lists up to (excluding) the first stop id, from the per-step records."""
    tokens_per_row: list[list[int]] = [[] for _ in range(num_rows)]
    stopped_at: list[int | None] = [None] * num_rows
    stop_set = set(stops.tolist())
    for rows, tokens, done_before in steps:
        for r, t, d in zip(rows.tolist(), tokens.tolist(), done_before.tolist()):
            if d:
                continue
            if t in stop_set:
                stopped_at[r] = t
            else:
                tokens_per_row[r].append(t)
    return [Generation(ids, stop is not None, stop) for ids, stop in zip(tokens_per_row, stopped_at)]


def check_request(prompts, keys, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: use >= 1")
    if not prompts or any(len(p) == 0 for p in prompts) or len(keys) != len(prompts):
        raise ValueError("generation needs non-empty prompts and one key per prompt")


class PaddedEngine:
    """The padded-batch loop of ``generate.sampling.sample_batch`` behind the engine interface (the fallback
    for models the slot engine cannot run, and the baseline of the generation benchmark)."""

    name = "padded"

    def __init__(self, model: torch.nn.Module, *, num_slots: int):
        self.model = model
        self.num_slots = num_slots
        self.generated_tokens = 0

    @torch.no_grad()
    def generate(
        self, prompts, keys, *, max_new_tokens, stop_ids, pad_id, sampling, on_rows=None, loop_stop=None
    ):
        check_request(prompts, keys, max_new_tokens)
        results: list[Generation | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        for start in range(0, len(order), self.num_slots):
            batch = order[start : start + self.num_slots]
            generations = sample_batch(
                self.model,
                [prompts[i] for i in batch],
                [keys[i] for i in batch],
                max_new_tokens=max_new_tokens,
                stop_ids=stop_ids,
                pad_id=pad_id,
                sampling=sampling,
                loop_stop=loop_stop,
            )
            for i, generation in zip(batch, generations, strict=True):
                results[i] = generation
            num_tokens = sum(len(g.token_ids) + g.finished for g in generations)
            self.generated_tokens += num_tokens
            if on_rows is not None:
                on_rows(len(batch), num_tokens)
        return results


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when available, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    parse_device(device, "--device")  # a name torch does not know fails here, not in the model's load
    return device


def load_generator(path: str, device: str):
    """(model, tokenizer) of a target for generation: bf16 on CUDA, fp32 on CPU, guarded loading.

    The project's target loader refuses a checkpoint with missing weights (which transformers would
    silently random-initialise) and loads multimodal Qwen3.5/3.6 checkpoints as text models.
    GatedDeltaNet targets get the training loader's kernel binding and check (``models.target_kernels``).
    """
    from dflash_train.models.target_kernels import bind_fla_causal_conv, check_fast_kernels
    from dflash_train.models.target_loading import load_causal_lm

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, tokenizer = load_causal_lm(path, dtype=dtype, device=device)
    # GatedDeltaNet targets on CUDA: fla's conv kernel where causal-conv1d is absent, and a loud
    # warning (not a silent slow run) where the fla kernels are missing.
    bind_fla_causal_conv(model, device)
    check_fast_kernels(model, device, allow_slow=True)
    if tokenizer is None:
        raise ValueError(
            f"--target {path} has no tokenizer; generation needs the target's tokenizer and chat template"
        )
    return model.eval(), tokenizer
