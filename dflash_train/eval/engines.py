"""Decode engines: which target session and drafter step the real-decoding eval runs on.

- ``dynamic`` (reported ``eager-dynamic``): a fresh ``TargetSession`` per request (HF dynamic cache,
  crop on rejection, GatedDeltaNet snapshot + replay) and the drafter's growing context cache.
  Runs every target and DDTree; on a GPU its speed is mostly Python and kernel-launch overhead.
- ``static`` (reported ``static-cudagraph`` on CUDA, ``static-eager`` elsewhere): one
  ``StaticTargetSession`` (static KV cache, graphed T = 1 and T = B steps) and one
  ``StaticDFlashProposer`` (static drafter context, graphed block step), reused by every request.
  Pure-attention targets only; DDTree still runs on the dynamic engine (said in its report).
- ``auto``: static where the target supports it, else dynamic with a printed note.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from dflash_train.eval.options import DECODE_ENGINES
from dflash_train.eval.proposers import DFlashProposer, Proposer
from dflash_train.eval.static_drafter import StaticDFlashProposer
from dflash_train.eval.static_session import StaticTargetSession, static_engine_problem
from dflash_train.eval.target_session import TargetSession

DYNAMIC_NAME = "eager-dynamic"


def resolve_decode_engine(
    model: torch.nn.Module, requested: str, target_layer_ids: Sequence[int] = ()
) -> str:
    """``static`` or ``dynamic`` for ``requested`` in DECODE_ENGINES; ``static`` on an unsupported
    target is a ValueError naming the reason, ``auto`` falls back to dynamic and prints why."""
    if requested not in DECODE_ENGINES:
        raise ValueError(f"decode_engine={requested!r}: use one of {list(DECODE_ENGINES)}")
    if requested == "dynamic":
        return "dynamic"
    problem = static_engine_problem(model, target_layer_ids)
    if problem is None:
        return "static"
    if requested == "static":
        raise ValueError(
            f"--decode-engine static cannot run this target: {problem}. Use --decode-engine auto or dynamic."
        )
    print(
        f"eval: decode engine eager-dynamic (the static engine cannot run this target: {problem})",
        file=sys.stderr,
    )
    return "dynamic"


class DynamicEngine:
    """A fresh TargetSession per request; proposers as given."""

    name = DYNAMIC_NAME

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def session(self, target_layer_ids: Sequence[int] = (), *, tree: bool = False) -> TargetSession:
        return TargetSession(self.model, target_layer_ids)

    def proposer(self, proposer: Proposer, *, tree: bool = False) -> Proposer:
        return proposer

    def method_engine(self, tree: bool) -> str:
        return self.name


class StaticEngine:
    """One StaticTargetSession (features of ``target_layer_ids``) and one StaticDFlashProposer per
    drafter, built for requests of at most ``max_length`` tokens (prompt + output + block)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_length: int,
        block_sizes: Sequence[int],
        target_layer_ids: Sequence[int] = (),
        use_cuda_graphs: bool | None = None,
    ):
        self.model = model
        # A multiple of 64 slots keeps the attention mask's rows aligned for the fused SDPA kernels.
        max_length = -(-max_length // 64) * 64
        self.max_length = max_length
        self.target_layer_ids = tuple(target_layer_ids)
        self.use_cuda_graphs = use_cuda_graphs
        self.target = StaticTargetSession(
            model,
            self.target_layer_ids,
            max_length=max_length,
            graph_sizes=(1, *block_sizes),
            use_cuda_graphs=use_cuda_graphs,
        )
        self.name = self.target.engine_name
        self._proposers: dict[int, StaticDFlashProposer] = {}

    def session(self, target_layer_ids: Sequence[int] = (), *, tree: bool = False):
        """The shared static session (its features are ignored by requests that need none); a tree
        method gets a dynamic TargetSession."""
        if tree:
            return TargetSession(self.model, target_layer_ids)
        if target_layer_ids and tuple(target_layer_ids) != self.target_layer_ids:
            raise ValueError(
                f"static engine built for feature layers {list(self.target_layer_ids)}, "
                f"asked for {list(target_layer_ids)}"
            )
        return self.target

    def proposer(self, proposer: Proposer, *, tree: bool = False) -> Proposer:
        """The static twin of a DFlashProposer (one per drafter, reused); other proposers as given."""
        if tree or not isinstance(proposer, DFlashProposer):
            return proposer
        key = id(proposer.drafter)
        if key not in self._proposers:
            self._proposers[key] = StaticDFlashProposer(
                proposer, max_length=self.max_length, use_cuda_graphs=self.use_cuda_graphs
            )
        return self._proposers[key]

    def method_engine(self, tree: bool) -> str:
        return DYNAMIC_NAME if tree else self.name


def build_decode_engine(
    model: torch.nn.Module,
    requested: str,
    *,
    max_length: int,
    block_sizes: Sequence[int],
    target_layer_ids: Sequence[int] = (),
    use_cuda_graphs: bool | None = None,
) -> DynamicEngine | StaticEngine:
    """The engine ``requested`` resolves to (see ``resolve_decode_engine``)."""
    if resolve_decode_engine(model, requested, target_layer_ids) == "dynamic":
        return DynamicEngine(model)
    return StaticEngine(
        model,
        max_length=max_length,
        block_sizes=block_sizes,
        target_layer_ids=target_layer_ids,
        use_cuda_graphs=use_cuda_graphs,
    )
