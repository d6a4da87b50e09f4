"""DDTree: tree drafting from one drafter pass, verified in one target forward (no retraining).

The drafter scores all B-1 block positions at once, so its per-position top-K tokens define a tree
whose depth-d nodes are the top-K candidates of draft position d. ``build_tree`` keeps the
``budget`` best root-to-node paths, best first: score = sum of log-probs along the path; a heap
pops the best frontier node, then pushes its next sibling (same parent, next rank) and its first
child (next depth, rank 0). Because ranks are sorted, that frontier always holds the next best
node, and the kept set is closed under taking prefixes (every node's parent is kept).

Verification runs ``[last token, tree nodes...]`` in one forward with an ancestor-only mask and
position = start + depth. Walking down from the root, the target's greedy choice at the current
node either matches a child (accepted, descend) or not (that choice is the bonus token). The cache
keeps exactly the accepted path (``TargetSession.commit_path``), so the output is the target's own
greedy decoding (lossless at T = 0). GatedDeltaNet targets are refused: one recurrent state
cannot represent several branches.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from dflash_train.eval.acceptance import stop_after_eos
from dflash_train.eval.proposers import Proposer
from dflash_train.eval.speculative import Generation, Round, decode
from dflash_train.eval.target_session import HYBRID_TREE_ERROR, TargetSession
from dflash_train.models.variant import get_variant


@dataclass
class Tree:
    """Node 0 is the root (the last accepted token); ``parents[i] < i`` for every other node."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    def children(self) -> list[dict[int, int]]:
        """Per node: token -> child index (top-k tokens are distinct, so the map is exact)."""
        kids: list[dict[int, int]] = [{} for _ in self.tokens]
        for i, parent in enumerate(self.parents[1:], start=1):
            kids[parent][self.tokens[i]] = i
        return kids


def build_tree(
    root_token: int, topk_tokens: torch.Tensor, topk_logprobs: torch.Tensor, budget: int, max_depth: int
) -> Tree:
    """Best-first tree of up to ``budget`` non-root nodes from per-position top-K ``[D, K]`` tensors."""
    tokens, logprobs = topk_tokens.tolist(), topk_logprobs.tolist()
    depth_limit = min(max_depth, len(tokens))
    num_ranks = len(tokens[0]) if tokens else 0
    tree = Tree(tokens=[root_token], parents=[-1], depths=[0])
    scores = [0.0]
    # heap entries: (-score, tie-break, draft position d, rank, parent node)
    frontier: list[tuple[float, int, int, int, int]] = []
    if depth_limit > 0 and num_ranks > 0:
        frontier.append((-logprobs[0][0], 0, 0, 0, 0))
    pushes = 1
    while frontier and len(tree.tokens) - 1 < budget:
        neg_score, _, d, rank, parent = heapq.heappop(frontier)
        node = len(tree.tokens)
        tree.tokens.append(tokens[d][rank])
        tree.parents.append(parent)
        tree.depths.append(d + 1)
        scores.append(-neg_score)
        if rank + 1 < num_ranks:
            heapq.heappush(frontier, (-(scores[parent] + logprobs[d][rank + 1]), pushes, d, rank + 1, parent))
            pushes += 1
        if d + 1 < depth_limit:
            heapq.heappush(frontier, (-(scores[node] + logprobs[d + 1][0]), pushes, d + 1, 0, node))
            pushes += 1
    return tree


def walk_tree(tree: Tree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Follow the target's greedy choices from the root: (accepted node indices, bonus token)."""
    choices = target_logits.argmax(dim=-1).tolist()  # host sync: the walk branches on it
    kids = tree.children()
    path, node = [], 0
    while choices[node] in kids[node]:
        node = kids[node][choices[node]]
        path.append(node)
    return path, choices[node]


def tree_round(
    session: TargetSession,
    proposer: Proposer,
    ids: list[int],
    new_features: torch.Tensor | None,
    remaining: int,
    *,
    block_size: int,
    budget: int,
    topk: int,
    eos_token_ids: Collection[int] = (),
) -> Round:
    """One DDTree round: top-k draft pass -> tree -> one tree forward -> walk -> commit the path."""
    topk_tokens, topk_logprobs = proposer.propose_topk(ids, new_features, block_size, topk)
    tree = build_tree(ids[-1], topk_tokens, topk_logprobs, budget, max_depth=remaining - 1)
    verified = session.verify_tree(torch.tensor(tree.tokens, dtype=torch.long), tree.parents, tree.depths)
    path, bonus = walk_tree(tree, verified.logits)
    # A request ends at EOS: nodes below an accepted EOS are never emitted (the bonus is then past it).
    path = path[: stop_after_eos([tree.tokens[i] for i in path], len(path), eos_token_ids)]
    session.commit_path([0, *path])
    features = None if verified.features is None else verified.features[[0, *path]]
    # Drafted positions = tree depth, so per-position acceptance compares like with the chain.
    return Round([tree.tokens[i] for i in path] + [bonus], max(tree.depths), len(path), features)


def ddtree_generate(
    session: TargetSession,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    *,
    block_size: int,
    budget: int,
    max_new_tokens: int,
    topk: int = 8,
    temperature: float = 0.0,
    eos_token_ids: Collection[int] = (),
) -> Generation:
    """Tree speculative decoding of one request (greedy only). ``num_drafted`` per round = tree depth."""
    if temperature > 0:
        raise ValueError("DDTree verification is greedy only: use --temperature 0 with --ddtree-budget")
    if session.is_hybrid:
        raise NotImplementedError(HYBRID_TREE_ERROR)
    if budget < 1:
        raise ValueError(f"ddtree budget={budget}: use >= 1 node")

    def run_round(session, proposer, ids, new_features, remaining):
        return tree_round(
            session,
            proposer,
            ids,
            new_features,
            remaining,
            block_size=block_size,
            budget=budget,
            topk=topk,
            eos_token_ids=eos_token_ids,
        )

    return decode(
        session,
        prompt_ids,
        run_round,
        proposer=proposer,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
    )


def check_tree_variant(tree: bool, config) -> None:
    """DDTree grows its tree from the parallel head's top-K: only for variants that draft its argmax."""
    variant = get_variant(config.variant)
    if tree and not variant.drafts_by_head_argmax:
        raise NotImplementedError(
            f"DDTree with a {config.variant} drafter: a tree from the parallel head's top-K would skip the "
            f"{config.variant} drafting procedure ({variant.drafting_procedure}); drop ddtree."
        )
