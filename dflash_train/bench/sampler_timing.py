"""Top-p draw timing for ``dflash-train bench generation --sampler-shapes``, per ROWSxVOCAB shape, on
random logits at temperature 0.7, top-p 0.9: three draws, each keyed by its name in the record.

- ``sort``: the sort-based draw the engines ran before (float32 sums in sorted order);
- ``exact``: ``generate.sampling.choose_tokens`` eagerly, what an uncompiled decode step (hybrid
  targets, ``--compile-decode off``) and the prefill draws run: ``generate/nucleus.py``'s exact
  integer nucleus, its threshold read off one sort;
- ``exact_compiled``: the same draw under ``torch.compile`` (full graph, this shape static), what the
  compiled decode step traces into its graph: the threshold searched without a sort.

On CUDA each draw is timed as the decode step runs it: two eager warm-ups on a side stream (the
first one's wall time is ``first_call_s``, compilation included), then captured in a CUDA graph and
replayed ``repeats`` times between CUDA events. On CPU (dry runs) the draws are timed eagerly. A draw
that fails is recorded as ``NAME_error`` and the others still run. The record also counts the rows
whose nucleus differs between the sort and the exact draw (the sorted draw sums float32, the exact
one integers: only a boundary within float32 rounding of top-p can differ).

Shapes: R rows, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_train.bench.timing import time_graphed
from dflash_train.generate.nucleus import nucleus_mask
from dflash_train.generate.sampling import Sampling, choose_tokens

TIMED = Sampling(temperature=0.7, top_p=0.9)
LOGIT_SCALE = 4.0  # random logits this spread give nuclei of a few to a few thousand tokens


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities sorted descending, stably, with the nucleus kept and the rest zeroed [R, V], their
    token ids [R, V], the nucleus mask in sorted order [R, V]): the sort-based definition."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    inside = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
    if top_p >= 1:
        inside = torch.ones_like(inside)
    return sorted_probs.masked_fill(~inside, 0.0), order, inside


def sorted_draw(logits: torch.Tensor, uniforms: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The previous sampler: softmax, full sort, nucleus mask, inverse CDF in sorted order: [R]."""
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    kept, order, _ = sorted_nucleus(probs, sampling.top_p)
    cdf = kept.cumsum(dim=-1)
    pick = (cdf < uniforms[:, None] * cdf[:, -1:]).sum(dim=-1).clamp(max=logits.shape[-1] - 1)
    return order.gather(-1, pick[:, None]).squeeze(-1)


def time_draw(draw: Callable, logits: torch.Tensor, uniforms: torch.Tensor, repeats: int) -> dict:
    """{"ms": per draw, "first_call_s"}: graphed on CUDA (as in the decode step), eager on CPU."""
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    return time_graphed(lambda: tokens.copy_(draw(logits, uniforms, TIMED)), logits.device, repeats)


def time_samplers(num_rows: int, vocab: int, device: torch.device, repeats: int = 50) -> dict:
    """One shape's record: both draws' times, the speed-up, and the rows whose nucleus differs."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_rows, vocab, device=device, generator=generator) * LOGIT_SCALE
    uniforms = torch.rand(num_rows, device=device, generator=generator)
    record: dict = {"rows": num_rows, "vocab": vocab, "temperature": TIMED.temperature, "top_p": TIMED.top_p}
    torch._dynamo.reset()  # the compiled draw compiles for this shape, not on an earlier one's entry
    compiled = torch.compile(choose_tokens, fullgraph=True, dynamic=False)
    for name, draw in (("sort", sorted_draw), ("exact", choose_tokens), ("exact_compiled", compiled)):
        try:
            timing = time_draw(draw, logits, uniforms, repeats)
        except Exception as err:  # noqa: BLE001 (recorded: the other draws still run)
            record[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
            continue
        record |= {
            f"{name}_ms": round(timing["ms"], 4),
            f"{name}_first_call_s": round(timing["first_call_s"], 2),
        }
    if "exact_ms" in record:
        record["speedup"] = round(record["sort_ms"] / max(record["exact_ms"], 1e-9), 2)
    probs = torch.softmax(logits / TIMED.temperature, dim=-1)
    _, order, inside = sorted_nucleus(probs, TIMED.top_p)
    sorted_mask = torch.zeros_like(inside).scatter(-1, order, inside)
    differing = (sorted_mask != nucleus_mask(probs, TIMED.top_p)).any(dim=-1)
    record |= {
        "nucleus_rows_differing": int(differing.sum()),  # host sync: a reported count
        "nucleus_size_median": int(inside.sum(dim=-1).median()),
    }
    return record | {"status": "ok"}
