"""Speculative decoding is lossless and measures acceptance exactly (tiny Qwen3 and Qwen3.5-hybrid targets).

Proposers with known behaviour pin the loop: the oracle (always right) must give tau == B, the
wrong proposer tau == 1, a scheduled partial oracle exactly the planned acceptance per round, and
every one of them the target's own greedy output token for token — on the hybrid target that
exercises the GatedDeltaNet state rollback at every acceptance count.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_train.eval.acceptance import accept_sampled
from dflash_train.eval.ddtree import build_tree, ddtree_generate, walk_tree
from dflash_train.eval.proposers import (
    Draft,
    NgramProposer,
    OracleProposer,
    RandomProposer,
    WrongProposer,
)
from dflash_train.eval.speculative import plain_generate, speculative_generate
from dflash_train.eval.target_session import TargetSession

BLOCK = 4
ROUNDS = 5
MAX_NEW = 1 + ROUNDS * BLOCK  # the prefill gives token 1, then every full round gives B tokens
LAYER_IDS = (0, 2)


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def targets(tiny_qwen3_dir, tiny_hybrid_dir):
    return {
        "qwen3": AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval(),
        "hybrid": AutoModelForCausalLM.from_pretrained(tiny_hybrid_dir).eval(),
    }


@pytest.fixture(scope="module")
def prompt(tiny_qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "def add(a, b): the quick brown fox"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reference(model, prompt, max_new_tokens=MAX_NEW):
    with TargetSession(model) as session:
        return plain_generate(session, prompt, max_new_tokens=max_new_tokens).tokens


def speculate(model, proposer, prompt, max_new_tokens=MAX_NEW, **kwargs):
    with TargetSession(model, LAYER_IDS) as session:
        return speculative_generate(
            session, proposer, prompt, block_size=BLOCK, max_new_tokens=max_new_tokens, **kwargs
        )


class ScheduledProposer(OracleProposer):
    """Right for exactly ``schedule[r]`` drafts in round r, then wrong: the acceptance is known in advance."""

    def __init__(self, reference_ids, vocab_size, schedule):
        super().__init__(reference_ids, vocab_size)
        self.schedule, self.round = list(schedule), 0

    def propose(self, accepted_ids, new_features, block_size):
        truth = super().propose(accepted_ids, new_features, block_size).tokens
        num_right = self.schedule[self.round % len(self.schedule)]
        self.round += 1
        return Draft(tokens=[t if k < num_right else (t + 1) % self.vocab_size for k, t in enumerate(truth)])


def test_plain_decoding_matches_hf_generate(targets, prompt):
    for model in targets.values():
        hf = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert reference(model, prompt) == hf[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_oracle_accepts_everything_and_wrong_nothing(targets, prompt, kind):
    model = targets[kind]
    ref = reference(model, prompt)
    vocab = model.config.vocab_size
    oracle = speculate(model, OracleProposer(prompt + ref, vocab), prompt)
    assert oracle.tokens == ref
    assert oracle.num_accepted == [BLOCK - 1] * ROUNDS and oracle.tau == BLOCK
    wrong = speculate(model, WrongProposer(prompt + ref, vocab), prompt)
    assert wrong.tokens == ref
    assert wrong.num_rounds == MAX_NEW - 1 and wrong.tau == 1.0


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_partial_acceptance_rolls_back_exactly(targets, prompt, kind):
    """Every acceptance count 0..B-1, in an order that alternates full and empty rounds."""
    model = targets[kind]
    schedule = [0, 3, 1, 3, 2, 0, 3, 0]
    ref = reference(model, prompt, max_new_tokens=40)
    gen = speculate(
        model, ScheduledProposer(prompt + ref, model.config.vocab_size, schedule), prompt, max_new_tokens=40
    )
    assert gen.tokens == ref
    rounds = len(gen.num_accepted)
    planned = [min(schedule[r % len(schedule)], gen.num_drafted[r]) for r in range(rounds)]
    assert gen.num_accepted == planned


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_ngram_and_random_proposers_are_lossless(targets, prompt, kind):
    model = targets[kind]
    ref = reference(model, prompt, max_new_tokens=30)
    for proposer in (NgramProposer(3), RandomProposer(model.config.vocab_size, seed=1)):
        gen = speculate(model, proposer, prompt, max_new_tokens=30)
        assert gen.tokens == ref
        assert 1.0 <= gen.tau <= BLOCK


def test_output_stops_at_eos_and_never_overshoots(targets, prompt):
    model = targets["qwen3"]
    ref = reference(model, prompt, max_new_tokens=30)
    eos = ref[7]  # pretend the 8th generated token is EOS
    gen = speculate(
        model,
        OracleProposer(prompt + ref, model.config.vocab_size),
        prompt,
        max_new_tokens=30,
        eos_token_ids={eos},
    )
    assert gen.tokens == ref[: ref.index(eos) + 1]
    for max_new in (1, 2, 6):
        gen = speculate(
            model, OracleProposer(prompt + ref, model.config.vocab_size), prompt, max_new_tokens=max_new
        )
        assert gen.tokens == ref[:max_new]


def test_features_match_a_full_forward(targets, prompt):
    """The features handed to the proposer are the target's layer outputs at exactly the committed positions."""
    model = targets["hybrid"]
    ref = reference(model, prompt, max_new_tokens=20)

    class Recorder(ScheduledProposer):
        def propose(self, accepted_ids, new_features, block_size):
            self.collected.append(new_features)
            return super().propose(accepted_ids, new_features, block_size)

    recorder = Recorder(prompt + ref, model.config.vocab_size, [2, 0, 3])
    recorder.collected = []
    speculate(model, recorder, prompt, max_new_tokens=20)
    features = torch.cat(recorder.collected)
    ids = torch.tensor([prompt + ref])[:, : features.shape[0]]
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1][0] for i in LAYER_IDS], dim=-1)
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)


# -- n-gram proposer --------------------------------------------------------------------------------
def test_ngram_prefers_the_longest_then_most_recent_match():
    proposer = NgramProposer(3)
    # suffix [1, 2, 3] occurred at 0 (followed by 9) ; [2, 3] alone later (followed by 7)
    ids = [1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]
    assert proposer.propose(ids, None, 4).tokens == [9, 8, 2]
    # only a 1-gram match: the most recent earlier 5 was followed by 6, then 5
    assert NgramProposer(3).propose([5, 6, 4, 5, 6, 5], None, 4).tokens == [6, 5, 5]


def test_ngram_pads_short_continuations_and_handles_no_match():
    assert NgramProposer(2).propose([4, 7, 4], None, 5).tokens == [7, 4, 4, 4]
    assert NgramProposer(2).propose([1, 2, 3], None, 4).tokens == [3, 3, 3]
    with pytest.raises(ValueError):
        NgramProposer(0)


# -- DDTree -----------------------------------------------------------------------------------------
def test_build_tree_is_best_first():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]])
    tree = build_tree(7, torch.tensor([[1, 2, 3], [4, 5, 6]]), probs.log(), budget=5, max_depth=3)
    # path scores: 1 (.5), 1-4 (.45), 2 (.3), 2-4 (.27), 3 (.2); the next best, 1-5, is .025
    assert tree.tokens == [7, 1, 4, 2, 4, 3]
    assert tree.parents == [-1, 0, 1, 0, 3, 0]
    assert tree.depths == [0, 1, 2, 1, 2, 1]
    assert build_tree(7, torch.tensor([[1, 2, 3], [4, 5, 6]]), probs.log(), budget=5, max_depth=1).depths == [
        0,
        1,
        1,
        1,
    ]


def test_walk_tree_follows_the_target_and_returns_the_bonus():
    tree = build_tree(7, torch.tensor([[1, 2], [4, 5]]), torch.tensor([[-0.1, -2.0], [-0.1, -2.0]]), 6, 2)
    logits = torch.zeros(len(tree.tokens), 10)
    logits[0, 2] = 1  # root -> 2 (a rank-1 node)
    node_2 = tree.tokens.index(2)
    logits[node_2, 9] = 1  # 9 is not a child: bonus
    path, bonus = walk_tree(tree, logits)
    assert [tree.tokens[i] for i in path] == [2] and bonus == 9


@pytest.mark.parametrize("truth_ranks,budget,topk", [((0,), BLOCK - 1, 4), ((1, 0, 2), 12, 4), ((2,), 39, 3)])
def test_ddtree_is_lossless_on_attention_targets(targets, prompt, truth_ranks, budget, topk):
    model = targets["qwen3"]
    ref = reference(model, prompt)
    proposer = OracleProposer(prompt + ref, model.config.vocab_size, truth_ranks=truth_ranks)
    with TargetSession(model, LAYER_IDS) as session:
        gen = ddtree_generate(
            session, proposer, prompt, block_size=BLOCK, budget=budget, max_new_tokens=MAX_NEW, topk=topk
        )
    assert gen.tokens == ref
    if truth_ranks == (1, 0, 2):
        assert gen.tau > 1.5  # the budget covers some rank-1 branches but not every rank-2 one
    else:
        # rank 0: the rank-0 chain is grown first; rank 2 with 3+9+27 = 39 nodes: the full tree
        assert gen.tau == BLOCK


def test_ddtree_random_proposer_is_lossless(targets, prompt):
    model = targets["qwen3"]
    ref = reference(model, prompt, max_new_tokens=25)
    with TargetSession(model, LAYER_IDS) as session:
        gen = ddtree_generate(
            session,
            RandomProposer(model.config.vocab_size, seed=3),
            prompt,
            block_size=BLOCK,
            budget=10,
            max_new_tokens=25,
        )
    assert gen.tokens == ref


def test_ddtree_refuses_hybrid_targets_clearly(targets, prompt):
    with (
        TargetSession(targets["hybrid"]) as session,
        pytest.raises(NotImplementedError, match="GatedDeltaNet"),
    ):
        ddtree_generate(session, RandomProposer(10), prompt, block_size=BLOCK, budget=4, max_new_tokens=5)


# -- sampling (T > 0) -------------------------------------------------------------------------------
def total_variation(samples: list[int], probs: torch.Tensor) -> float:
    empirical = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double() / len(samples)
    return 0.5 * float((empirical - probs.double()).abs().sum())


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_reproduces_the_target_distribution(with_q):
    """The first emitted token of a round is distributed as p, whatever the drafter proposes."""
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]]))
    p = torch.softmax(logits[0], -1)
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])
    gen = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(6000):
        draft = int(torch.multinomial(q, 1, generator=gen)) if with_q else 0  # 0: a token p rarely picks
        num_accepted, bonus = accept_sampled([draft], logits, 1.0, gen, q[None] if with_q else None)
        samples.append(draft if num_accepted == 1 else bonus)
    assert total_variation(samples, p) < 0.03
    # the test can fail: taking every draft gives q (or a point mass), far from p
    assert total_variation([0] * 100, p) > 0.5


def test_sampled_speculative_decoding_matches_target_sampling(targets, prompt):
    """End to end on the tiny target: the 2nd token (the first one that goes through rejection
    sampling) has the target's marginal distribution sum_t1 p(t1) p(t2 | t1). The tiny random model's
    distribution has a long flat tail, so the comparison is over its top tokens plus "the rest"."""
    model, temperature, vocab = targets["qwen3"], 0.1, targets["qwen3"].config.vocab_size
    ids = torch.tensor([prompt])
    with torch.no_grad():
        p1 = torch.softmax(model(ids).logits[0, -1] / temperature, -1)
        both = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p2_given_1 = torch.softmax(model(both).logits[:, -1] / temperature, -1)
    p2 = (p1[:, None] * p2_given_1).sum(0)
    top = p2.topk(4).indices.tolist()
    bucket = {token: i for i, token in enumerate(top)}
    p2_buckets = torch.cat([p2[top], (1 - p2[top].sum()).view(1)])
    assert 0.2 < float(p2.max()) < 0.9  # the greedy draft is neither certain nor hopeless

    greedy = reference(model, prompt, max_new_tokens=3)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(600):
        # max_new_tokens=3: token 1 from the prefill, then one round with one draft for token 2
        out = speculate(
            model,
            OracleProposer(prompt + greedy, vocab),
            prompt,
            max_new_tokens=3,
            temperature=temperature,
            generator=gen,
        )
        assert out.num_drafted[0] == 1
        samples.append(bucket.get(out.tokens[1], len(top)))
    assert total_variation(samples, p2_buckets) < 0.08
