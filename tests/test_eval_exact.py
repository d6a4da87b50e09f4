"""Exact-mode acceptance equals real decoding (fp32, CPU) on a hybrid and a Qwen3 tiny target.

The drafter is fitted for a few steps to the targets' own continuations so that acceptance is
partial (neither 1 nor B): an off-by-one in anchors, context visibility or round bookkeeping then
changes tau. The targets' weights are sharpened so their greedy continuations vary instead of
repeating one token.
"""

from __future__ import annotations

import random

import pytest
import torch

from dflash_train.eval.exact import as_frozen_target, exact_acceptance, exact_generations
from dflash_train.eval.generate import greedy_continuations
from dflash_train.eval.proposers import DFlashProposer, Draft, NgramProposer, Proposer
from dflash_train.eval.runner import evaluate
from dflash_train.eval.simulate import NgramIndex
from dflash_train.eval.speculative import plain_generate
from dflash_train.eval.summary import summarize_rounds
from dflash_train.eval.target_session import TargetSession

BLOCK = 4
LAYER_IDS = [0, 2]
MAX_NEW = 25
TEXTS = [
    "def add(a, b): the quick brown fox",
    "for i in range(10):",
    "class Point:",
    "hi",
    "print(i * i)",
    "the lazy dog",
]


pytestmark = pytest.mark.usefixtures("one_thread_module")


def sharp_target(kind: str, vocab_size: int):
    """A tiny random target whose greedy continuations vary (``tiny.sharpen``)."""
    from dflash_train.tiny import build_tiny_target, sharpen

    return sharpen(build_tiny_target(kind, vocab_size=vocab_size))


@pytest.fixture(scope="module", params=["hybrid", "qwen3"])
def setup(request, tokenizer):
    """(kind, target, prompts, continuations, fitted drafter) for one target kind."""
    from dflash_train.eval.prompts import encode_prompt

    model = sharp_target(request.param, len(tokenizer))
    prompts = [encode_prompt(tokenizer, {"prompt": t}, None) for t in TEXTS]
    eos = {tokenizer.eos_token_id}
    continuations = greedy_continuations(
        model, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, pad_token_id=0, batch_size=4
    )
    drafter = fit_drafter(model, tokenizer, prompts, continuations)
    return request.param, model, prompts, continuations, drafter


def make_drafter(model, tokenizer, seed=0):
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter

    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=BLOCK),
        model.config,
        target_layer_ids=LAYER_IDS,
        mask_token_id=tokenizer.mask_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return DFlashDrafter(config)


def fit_drafter(model, tokenizer, prompts, continuations, steps=10, lr=1e-2):
    """A few Adam steps on every anchor of the continuations: a partially right drafter."""
    from dflash_train.tiny import fit_drafter_on_continuations

    drafter = make_drafter(model, tokenizer)
    return fit_drafter_on_continuations(
        drafter,
        as_frozen_target(model, LAYER_IDS),
        prompts,
        continuations,
        max_new_tokens=MAX_NEW,
        steps=steps,
        lr=lr,
    )


def test_batched_generation_equals_plain_decoding(setup):
    _, model, prompts, continuations, _ = setup
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    for prompt, continuation in zip(prompts, continuations, strict=True):
        with TargetSession(model) as session:
            assert plain_generate(session, prompt, max_new_tokens=MAX_NEW).tokens == continuation
    assert len({tuple(c) for c in continuations}) == len(continuations)


def methods_for(kind):
    # Real tree decoding refuses GatedDeltaNet targets; its exact mode is checked separately below.
    return ("dflash", "ngram") + (("ddtree",) if kind == "qwen3" else ())


@pytest.mark.parametrize("stop_early", [False, True], ids=["max_new_tokens", "eos"])
def test_exact_mode_equals_decode_mode(setup, tokenizer, stop_early):
    kind, model, prompts, continuations, drafter = setup
    eos = {tokenizer.eos_token_id}
    if stop_early:
        # Make a token the continuations use an EOS: requests stop inside rounds, also after accepted drafts.
        eos = {continuations[0][6], continuations[2][9]}
        continuations = greedy_continuations(
            model, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, pad_token_id=0, batch_size=4
        )
        assert sum(len(c) < MAX_NEW for c in continuations) >= 2
    methods = methods_for(kind)
    common = dict(max_new_tokens=MAX_NEW, eos_token_ids=eos, methods=methods, ddtree_budget=6)
    exact = exact_acceptance(model, drafter, prompts, continuations, **common)
    decoded = evaluate(model, tokenizer, drafter, prompts, **common)
    for name in methods:
        got, want = exact["methods"][name], decoded["methods"][name]
        assert want["lossless"] is True, name
        assert got["tau"] == pytest.approx(want["tau"], abs=1e-9), name
        assert got["per_request_tau"] == pytest.approx(want["per_request_tau"], abs=1e-9), name
        assert got["per_position_acceptance"] == pytest.approx(want["per_position_acceptance"], abs=1e-9)
        assert got["accept_length_histogram"] == want["accept_length_histogram"], name
    # Partial acceptance: the comparison above would not notice a drafter that is always (never) right.
    assert 1.2 < exact["methods"]["dflash"]["tau"] < BLOCK - 0.5


def test_ddtree_exact_mode_works_on_hybrid_targets(setup, tokenizer):
    """With top-1 candidates the tree is the argmax chain, so DDTree tau must equal DFlash tau."""
    kind, model, prompts, continuations, drafter = setup
    eos = {tokenizer.eos_token_id}
    common = dict(max_new_tokens=MAX_NEW, eos_token_ids=eos, methods=("dflash", "ddtree"))
    chain = exact_acceptance(
        model, drafter, prompts, continuations, ddtree_budget=BLOCK, ddtree_topk=1, **common
    )
    assert chain["methods"]["ddtree"]["tau"] == pytest.approx(chain["methods"]["dflash"]["tau"], abs=1e-12)
    wide = exact_acceptance(model, drafter, prompts, continuations, ddtree_budget=12, ddtree_topk=4, **common)
    assert wide["methods"]["ddtree"]["tau"] >= chain["methods"]["dflash"]["tau"] - 1e-9


def test_exact_api_takes_a_frozen_target_and_precomputed_continuations(setup, tokenizer):
    kind, model, prompts, continuations, drafter = setup
    eos = {tokenizer.eos_token_id}
    target = as_frozen_target(model, LAYER_IDS)
    first = exact_acceptance(
        target, drafter, prompts, continuations, max_new_tokens=MAX_NEW, eos_token_ids=eos
    )
    # Small drafter batches (one row each) give the same numbers as one big batch.
    again = exact_acceptance(
        model,
        drafter,
        prompts,
        continuations,
        max_new_tokens=MAX_NEW,
        eos_token_ids=eos,
        drafter_batch_tokens=1,
    )
    assert first["methods"]["dflash"] == again["methods"]["dflash"]
    assert first["diagnosis"] == again["diagnosis"] and first["diagnosis"]["groups"]["anchors"]["blocks"] > 0
    assert set(first["timings"]) == {"features", "drafter", "simulation"}
    with pytest.raises(ValueError, match="target_layer_ids"):
        exact_acceptance(
            as_frozen_target(model, [0, 1]),
            drafter,
            prompts,
            continuations,
            max_new_tokens=MAX_NEW,
            eos_token_ids=eos,
        )


def test_a_shuffled_fc_drafter_loses_its_acceptance(setup, tokenizer):
    kind, model, prompts, continuations, drafter = setup
    eos = {tokenizer.eos_token_id}
    good = exact_acceptance(model, drafter, prompts, continuations, max_new_tokens=MAX_NEW, eos_token_ids=eos)
    wrong = shuffled_fc(drafter)
    bad = exact_acceptance(model, wrong, prompts, continuations, max_new_tokens=MAX_NEW, eos_token_ids=eos)
    assert bad["methods"]["dflash"]["tau"] < good["methods"]["dflash"]["tau"] - 0.2


def shuffled_fc(drafter):
    """A copy of the drafter whose fc input columns are permuted: it reads scrambled features."""
    import copy

    wrong = copy.deepcopy(drafter)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        columns = torch.randperm(wrong.fc.weight.shape[1], generator=generator)
        wrong.fc.weight.copy_(wrong.fc.weight[:, columns])
    return wrong


def test_ngram_index_equals_the_proposer_at_every_prefix():
    rng = random.Random(0)
    proposer = NgramProposer(3)
    for _ in range(20):
        ids = [rng.randrange(5) for _ in range(rng.randint(2, 60))]
        index = NgramIndex(ids, 3)
        for length in range(1, len(ids) + 1):
            assert index.propose(length, BLOCK) == proposer.propose(ids[:length], None, BLOCK).tokens


def test_exact_generations_simulate_ngram_without_a_drafter_pass(setup, tokenizer):
    kind, model, prompts, continuations, drafter = setup
    generations, timings = exact_generations(
        model,
        drafter,
        prompts,
        continuations,
        max_new_tokens=MAX_NEW,
        eos_token_ids=set(),
        methods=("ngram",),
    )
    assert timings["features"] == 0.0 and timings["drafter"] == 0.0
    assert [g.tokens for g in generations["ngram"]] == [list(c) for c in continuations]


def test_padding_with_eos_gives_the_same_continuations(setup, tokenizer):
    """Pad-less tokenizers pad with EOS under the attention mask: the pad id must not matter."""
    from dflash_train.eval.generate import pad_token_for

    _, model, prompts, continuations, _ = setup
    eos = {tokenizer.eos_token_id}

    class PadLess:
        pad_token_id = None

    pad = pad_token_for(PadLess(), eos)
    assert pad == tokenizer.eos_token_id
    again = greedy_continuations(
        model, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, pad_token_id=pad, batch_size=4
    )
    assert again == continuations


def test_a_continuation_that_ends_early_at_eos_drafts_only_inside_itself(setup, tokenizer):
    """EOS after a few tokens with a large max_new_tokens: anchors exist only up to the token before
    EOS (no round starts after it), so the drafter pass never indexes past the row."""
    kind, model, prompts, continuations, drafter = setup
    eos = tokenizer.eos_token_id
    rows = [prompts[0], prompts[1]]
    conts = [[*continuations[0][:3], eos], [*continuations[1][:2], eos]]
    report = exact_acceptance(model, drafter, rows, conts, max_new_tokens=MAX_NEW, eos_token_ids={eos})
    dflash = report["methods"]["dflash"]
    assert dflash["tokens"] == 4 + 3
    assert 1.0 <= dflash["tau"] <= 4.0


# ----------------------------------------------------------------------------- diagnosis
# Hand-built continuations and drafts whose numbers are worked out in the comments: prompt [100]
# (a token the continuations never use), block 4 (3 drafts per round), n = 3, no EOS.

WRONG = 1_000_000  # a draft token no continuation contains (not -1: NO_DRAFT, a slot left empty)
PERIOD = list(range(1, 9))  # 1..8: no token repeats inside a period


def drafts_from(continuation, right_at, block=BLOCK):
    """drafts[j] (anchor j) = the continuation's next B-1 tokens where ``right_at(j, k)``, else WRONG."""
    return [
        [
            continuation[j + k] if j + k < len(continuation) and right_at(j, k) else WRONG
            for k in range(1, block)
        ]
        for j in range(len(continuation) - 1)
    ]


def diagnosed(continuation, drafts, prompt=(100,)):
    """The DFlash chain simulated on the drafts, and its diagnosis summary."""
    from dflash_train.eval.diagnosis import diagnose_request, summarize_diagnosis
    from dflash_train.eval.simulate import simulate_chain

    common = dict(block_size=BLOCK, max_new_tokens=len(continuation), eos_token_ids=set())
    generation = simulate_chain(continuation, lambda out: drafts[out - 1], **common)
    stats = diagnose_request(list(prompt), continuation, drafts, generation, ngram_n=3, **common)
    return generation, summarize_diagnosis([stats], BLOCK)


def test_random_anchor_tau_is_the_teacher_forced_metric_over_every_anchor():
    continuation = list(range(10, 18))  # 8 tokens: anchors j = 0..6, predicted positions j+k < 8
    # Always right: tau_j = 1 + min(3, 7 - j) = 4, 4, 4, 4, 4, 3, 2 -> 25 / 7.
    _, right = diagnosed(continuation, drafts_from(continuation, lambda j, k: True))
    anchors = right["groups"]["anchors"]
    assert right["random_anchor_tau"] == pytest.approx(25 / 7)
    assert anchors["blocks"] == 7 and anchors["accuracy_by_pos"] == [1.0, 1.0, 1.0]
    # Wrong at position 2 only: the product stops there (tau 2 at every anchor), accuracy [1, 0, 1].
    _, hole = diagnosed(continuation, drafts_from(continuation, lambda j, k: k != 2))
    assert hole["random_anchor_tau"] == pytest.approx(2.0)
    assert hole["groups"]["anchors"]["accuracy_by_pos"] == [1.0, 0.0, 1.0]
    # Wrong at position 1 only: nothing is accepted although positions 2 and 3 are right.
    _, first = diagnosed(continuation, drafts_from(continuation, lambda j, k: k != 1))
    assert first["random_anchor_tau"] == pytest.approx(1.0)
    assert first["groups"]["anchors"]["accuracy_by_pos"] == [0.0, 1.0, 1.0]


def test_loop_rounds_are_those_where_prompt_lookup_accepts_the_whole_block():
    continuation = PERIOD * 3  # 24 tokens: the second and third period repeat the first
    # Always right: rounds start at out = 1, 5, 9, 13, 17, 21 (the last drafts 2). Lookup has nothing
    # to copy at 1 and 5 (no token recurs yet); from 9 on, the most recent match is one period back,
    # whose continuation is the next block: loop rounds 9, 13, 17, 21, with tau 4, 4, 4, 3.
    generation, right = diagnosed(continuation, drafts_from(continuation, lambda j, k: True))
    assert generation.num_accepted == [3, 3, 3, 3, 3, 2]
    assert right["loop_round_fraction"] == pytest.approx(4 / 6)
    assert right["tau_in_loops"] == pytest.approx(15 / 4) and right["tau_outside_loops"] == pytest.approx(4.0)
    assert right["groups"]["loop"]["accuracy_by_pos"] == [1.0, 1.0, 1.0]
    # Always wrong: a round at every out = 1..23; out = 23 drafts nothing (in no split group);
    # lookup copies from out = 9 on (out = 9..22: 14 loop rounds of 22).
    generation, wrong = diagnosed(continuation, drafts_from(continuation, lambda j, k: False))
    assert generation.num_rounds == 23
    assert wrong["loop_round_fraction"] == pytest.approx(14 / 22)
    assert wrong["groups"]["loop"]["blocks"] == 14 and wrong["groups"]["outside_loops"]["blocks"] == 8
    assert wrong["tau_in_loops"] == wrong["tau_outside_loops"] == wrong["pooled_round_tau"] == 1.0
    assert wrong["groups"]["loop"]["accuracy_by_pos"] == [0.0, 0.0, 0.0]
    # Lookup accepting 2 of 3 is no loop: at out = 5 "1" recurs and proposes "2 3 4" for "2 3 9".
    partial = [1, 2, 3, 4, 1, 2, 3, 9, 10, 11, 12, 13]
    _, some = diagnosed(partial, drafts_from(partial, lambda j, k: True))
    assert some["groups"]["rounds"]["blocks"] == 3 and some["loop_round_fraction"] == 0.0
    # Text without repeats has no loop round.
    _, plain = diagnosed(list(range(1, 17)), drafts_from(list(range(1, 17)), lambda j, k: True))
    assert plain["loop_round_fraction"] == 0.0 and plain["tau_in_loops"] is None


def test_a_loop_shorter_than_the_block_is_a_loop():
    # Period 2 < B - 1 = 3: lookup's match lies 2 tokens back, so a copy that stops at the text's end
    # proposes 2 tokens and pads ("6 5 5" for "6 5 6"); the loop's next block is "6 5 6", which the
    # copy continued past the end proposes. Always-right drafts: rounds at out = 1, 5, 9, 13, 17 (the
    # last drafts 2 of the 20 tokens); from out = 5 on, the loop's whole block recurs.
    continuation = [5, 6] * 10
    _, right = diagnosed(continuation, drafts_from(continuation, lambda j, k: True))
    assert right["groups"]["rounds"]["blocks"] == 5
    assert right["groups"]["loop"]["blocks"] == 4 and right["loop_round_fraction"] == pytest.approx(4 / 5)


def test_rounds_after_a_rejection_are_reported_apart():
    continuation = list(range(1, 17))  # 16 distinct tokens: no loops
    right = {0: (1, 2), 3: (1, 2, 3), 7: (1, 2, 3), 11: (1, 3)}  # anchor -> positions drafted right
    drafts = drafts_from(continuation, lambda j, k: k in right.get(j, ()))
    generation, d = diagnosed(continuation, drafts)
    # Rounds (out, drafted, accepted): (1,3,2) (4,3,3) (8,3,3) (12,3,1) (14,1,0) (15,0,0).
    assert generation.num_drafted == [3, 3, 3, 3, 1, 0] and generation.num_accepted == [2, 3, 3, 1, 0, 0]
    groups = d["groups"]
    # After a rejection: out = 4 (all right) and 14 (its one draft wrong); 15 drafts nothing.
    assert groups["after_rejection"]["blocks"] == 2 and groups["after_rejection"]["tau"] == pytest.approx(2.5)
    assert groups["after_rejection"]["accuracy_by_pos"] == [0.5, 1.0, 1.0]
    # Others: out = 1 (right, right, wrong), 8 (all right), 12 (right, wrong, right).
    assert groups["other_rounds"]["blocks"] == 3 and groups["other_rounds"]["tau"] == pytest.approx(3.0)
    assert groups["other_rounds"]["accuracy_by_pos"] == pytest.approx([1.0, 2 / 3, 2 / 3])
    assert d["pooled_round_tau"] == pytest.approx(15 / 6)
    assert groups["rounds"]["accuracy_by_pos"] == pytest.approx([0.8, 0.75, 0.75])
    # Every anchor: 3 + 4 + 4 + 2 at anchors 0, 3, 7, 11 and 1 at the 11 others -> 24 / 15.
    assert d["random_anchor_tau"] == pytest.approx(24 / 15)


def combined_tau(continuation, drafts, key_size, prompt=(100,), max_draft=0):
    from dflash_train.eval.simulate import simulate_ngram_then_dflash

    common = dict(block_size=BLOCK, max_new_tokens=len(continuation), eos_token_ids=set())
    return simulate_ngram_then_dflash(
        list(prompt), continuation, lambda out: drafts[out - 1], key_size=key_size, max_draft=max_draft,
        **common,
    )  # fmt: skip


def test_ngram_simple_drafts_by_llama_cpps_rule():
    """llama.cpp's ngram-simple (common/ngram-map.cpp): the latest earlier occurrence (start >= 1)
    of the last n tokens, then min(m, tokens of the history after it), none below n."""
    from dflash_train.eval.ngram_simple import ngram_simple_draft

    ids = [7, 1, 2, 3, 4, 5, 6, 1, 2]  # key [1, 2]; history 8 tokens > 2 + 3 + 1
    assert ngram_simple_draft(ids, len(ids), 2, 3) == [3, 4, 5]
    assert ngram_simple_draft(ids, len(ids), 2, 5) == []  # history 8 <= 2 + 5 + 1
    assert ngram_simple_draft([1, 2, 3, 4, 5, 6, 7, 1, 2], 9, 2, 3) == []  # position 0 never matches
    # The latest occurrence [1, 2, 3] at 7 leaves 2 < 3 history tokens after it: no draft, although
    # the one at 1 is followed by 4 5 6 (older occurrences are not tried). A loop of period <= n.
    assert ngram_simple_draft([7, 1, 2, 3, 4, 5, 6, 1, 2, 3, 1, 2, 3], 13, 3, 3) == []
    # An occurrence ending right before the key's last token is not searched; the draft never
    # includes the just-sampled token.
    assert ngram_simple_draft([7, 8, 9, 4, 6, 1, 5, 5], 8, 1, 2) == []
    assert ngram_simple_draft([7, 8, 9, 4, 5, 1, 6, 5], 8, 1, 2) == [1, 6]
    assert ngram_simple_draft([7, 8, 9, 4, 6, 5, 1, 5], 8, 1, 2) == [1]


def test_ngram_simple_index_equals_the_direct_search():
    from dflash_train.eval.ngram_simple import NgramSimpleIndex, ngram_simple_draft

    rng = random.Random(0)
    for _ in range(40):
        ids = [rng.randrange(3) for _ in range(rng.randrange(1, 70))]
        key_size, max_draft = rng.randrange(1, 5), rng.randrange(1, 9)
        index = NgramSimpleIndex(ids, key_size, max_draft)
        for length in range(1, len(ids) + 1):
            assert index.draft(length) == ngram_simple_draft(ids, length, key_size, max_draft)
    with pytest.raises(ValueError, match="key size 0"):
        NgramSimpleIndex([1, 2], 0, 3)


def test_ngram_then_dflash_copies_loops_and_drafts_the_rest():
    from dflash_train.eval.simulate import simulate_chain, simulate_ngram

    continuation = PERIOD * 3
    common = dict(block_size=BLOCK, max_new_tokens=len(continuation), eos_token_ids=set())
    drafts = drafts_from(continuation, lambda j, k: j < 8)  # right in the first period only
    dflash = simulate_chain(continuation, lambda out: drafts[out - 1], **common)
    ngram = simulate_ngram([100], continuation, n=3, **common)
    # DFlash: 4 + 4, then 15 rounds of 1 (out = 9..23) -> 23 / 17; n-gram: 8 rounds of 1, then
    # 4 + 4 + 4 + 3 -> 23 / 12.
    assert dflash.tau == pytest.approx(23 / 17) and ngram.tau == pytest.approx(23 / 12)
    # Key 1, at most B-1 = 3: the history is too short for lookup (<= 1 + 3 + 1) at out = 1 and 5,
    # DFlash copies 4 + 4; from out = 9 the last token recurs and lookup copies 4 + 4 + 4 + 3.
    both = combined_tau(continuation, drafts, key_size=1)
    assert both.num_accepted == [3, 3, 3, 3, 3, 2] and both.tau == pytest.approx(23 / 6)
    # Key 3: at out = 9, 10 the last 3 tokens (7 8 1, 8 1 2) never occurred -> DFlash (wrong);
    # from out = 11 lookup copies: 4 + 4 + 1 + 1 + 4 + 4 + 4 + 1 over 8 rounds.
    strict = combined_tau(continuation, drafts, key_size=3)
    assert strict.num_accepted == [3, 3, 0, 0, 3, 3, 3, 0] and strict.tau == pytest.approx(23 / 8)
    # Up to 8 tokens per lookup round: lookup needs 1 + 8 + 1 < history, so DFlash drafts (wrong)
    # at out = 9, 10; at out = 11 lookup copies the 7 tokens after the latest "3" (4 5 6 7 8 1 2),
    # longer than a block, and at out = 19 the 4 the request has left.
    long = combined_tau(continuation, drafts, key_size=1, max_draft=8)
    assert long.num_drafted == [3, 3, 3, 3, 7, 4] and long.num_accepted == [3, 3, 0, 0, 7, 4]
    summary = summarize_rounds([long], BLOCK)
    assert summary["accept_length_histogram"] == [2, 0, 0, 2, 1, 0, 0, 1]
    assert len(summary["per_position_acceptance"]) == 7


def test_ngram_then_dflash_drafts_by_lookup_whenever_lookup_proposes():
    continuation = [1, 2, 1, 3, 1, 4, 1, 5, 1, 6, 1, 7]  # "1" recurs, what follows it never does
    drafts = drafts_from(continuation, lambda j, k: True)
    alone = combined_tau(continuation, drafts, key_size=99)  # never a lookup draft: DFlash only
    assert alone.num_accepted == [3, 3, 2] and alone.tau == pytest.approx(11 / 3)
    # Key 1: at out = 9 the latest earlier "1" (at 7) is followed by "5" only: lookup drafts that one
    # token, which is wrong, although the drafter was right; the pick does not look at the drafter.
    misled = combined_tau(continuation, drafts, key_size=1)
    assert misled.num_drafted == [3, 3, 1, 1] and misled.num_accepted == [3, 3, 0, 1]
    assert misled.tau == pytest.approx(11 / 4)
    assert combined_tau(continuation, drafts, key_size=2).tau == pytest.approx(11 / 3)
    with pytest.raises(ValueError, match="key size 0"):
        combined_tau(continuation, drafts, key_size=0)


def training_metric_over_every_anchor(model, drafter, prompts, continuations):
    """The training tau and acc_by_pos (``train.loss.block_metrics``) of the drafter's training
    forward with an anchor at every position of the continuations (the rows' response tokens)."""
    from dflash_train.train.loss import block_metrics, summarize_metrics

    target = as_frozen_target(model, LAYER_IDS)
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
    anchors = torch.tensor([len(p) for p in prompts])[:, None] + torch.arange(MAX_NEW)
    keep = anchors + 1 < lengths[:, None]  # loss_mask[a] and loss_mask[a + 1]
    positions = anchors[..., None] + torch.arange(1, BLOCK)
    labels = ids.gather(1, positions.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(positions)
    valid = keep[..., None] & (positions < lengths[:, None, None])
    with torch.no_grad():
        hidden = drafter(target.features(ids), ids, anchors, keep, target.embed_tokens)
        rank = (target.lm_head(hidden[:, :, 1:]).argmax(-1) != labels).long()  # 0 = top-1 hit
    stats = block_metrics(valid.float(), valid, rank, torch.zeros(valid.shape), keep)
    return summarize_metrics(stats)


def test_random_anchor_tau_equals_the_training_metric_on_the_same_rows(setup, tokenizer):
    kind, model, prompts, continuations, drafter = setup
    report = exact_acceptance(
        model, drafter, prompts, continuations, max_new_tokens=MAX_NEW, eos_token_ids={tokenizer.eos_token_id}
    )
    training = training_metric_over_every_anchor(model, drafter, prompts, continuations)
    diagnosis = report["diagnosis"]
    assert 1.2 < training["tau"] < BLOCK - 0.5  # partial: an off-by-one would change it
    assert diagnosis["random_anchor_tau"] == pytest.approx(training["tau"], abs=1e-9)
    accuracy = diagnosis["groups"]["anchors"]["accuracy_by_pos"]
    assert accuracy == pytest.approx(training["acc_by_pos"], abs=1e-5)  # the training log rounds to 5 digits
    # The rounds are a subset of the anchors: the sequential simulation's own numbers.
    assert diagnosis["groups"]["rounds"]["blocks"] == report["methods"]["dflash"]["rounds"]
    groups = diagnosis["groups"]
    assert groups["loop"]["blocks"] + groups["outside_loops"]["blocks"] == (
        groups["after_rejection"]["blocks"] + groups["other_rounds"]["blocks"]
    )


class LookupThenDrafter(Proposer):
    """Real-decoding twin of ``ngram+dflash``, written out independently: llama.cpp's ngram-simple
    with key size ``key_size`` and at most B-1 tokens (the latest occurrence of the last key_size
    tokens that starts at 1 or later and ends before the previous token; what follows it in the
    history, kept when it has at least key_size tokens), otherwise the DFlash proposer's block. The
    drafter runs every round so that its context cache takes every committed position's features."""

    def __init__(self, dflash, key_size):
        self.dflash, self.key_size = dflash, key_size

    def start(self, prompt_ids):
        self.dflash.start(prompt_ids)

    def propose(self, accepted_ids, new_features, block_size):
        drafted = self.dflash.propose(accepted_ids, new_features, block_size)
        ids, n, limit = list(accepted_ids), self.key_size, block_size - 1
        history = ids[:-1]
        if len(history) <= n + limit + 1:
            return drafted
        starts = [j for j in range(1, len(ids) - n - 1) if ids[j : j + n] == ids[-n:]]
        span = history[starts[-1] + n :][:limit] if starts else []
        return Draft(tokens=span) if len(span) >= n else drafted


def test_ngram_then_dflash_exact_equals_real_decoding(setup, tokenizer):
    from dflash_train.eval.runner import Method

    kind, model, prompts, continuations, drafter = setup
    eos = {tokenizer.eos_token_id}
    min_match = 1  # these continuations rarely repeat 2-grams: lookup must be in play to be tested
    config = drafter.config
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()

    def make_proposer(prompt, reference):
        dflash = DFlashProposer(drafter, embed, head, config.block_size, config.mask_token_id)
        return LookupThenDrafter(dflash, min_match)

    method = Method("ngram+dflash", make_proposer, block_size=BLOCK, target_layer_ids=tuple(LAYER_IDS))
    common = dict(max_new_tokens=MAX_NEW, eos_token_ids=eos)
    exact = exact_acceptance(
        model, drafter, prompts, continuations, methods=("dflash", "ngram", "ngram+dflash"),
        ngram_min_match=min_match, **common,
    )  # fmt: skip
    decoded = evaluate(
        model, tokenizer, drafter, prompts, methods=[method], decode_engine="dynamic", **common
    )
    got, want = exact["methods"]["ngram+dflash"], decoded["methods"]["ngram+dflash"]
    assert want["lossless"] is True
    assert got["per_request_tau"] == pytest.approx(want["per_request_tau"], abs=1e-9)
    assert got["accept_length_histogram"] == want["accept_length_histogram"]
    assert got["per_position_acceptance"] == pytest.approx(want["per_position_acceptance"], abs=1e-12)
    # The three methods differ here, so the comparison above checks which proposal each round used.
    taus = {name: exact["methods"][name]["tau"] for name in ("dflash", "ngram", "ngram+dflash")}
    assert len({round(t, 9) for t in taus.values()}) == 3, taus


def test_eval_command_reports_the_diagnosis_and_the_combination(tiny_qwen3_dir, tmp_path, capsys):
    import json

    from dflash_train.cli import main
    from dflash_train.models.export import save_drafter
    from tests.test_eval_runner import load
    from tests.test_eval_runner import make_drafter as make_untrained_drafter

    model, tokenizer = load(tiny_qwen3_dir)
    drafter, config = make_untrained_drafter(model, tokenizer)
    save_drafter(drafter, config, tmp_path / "drafter", dtype="float32")
    rows = [{"prompt": "The quick brown fox"}, {"prompt": "class Point:"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["eval", "--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "drafter"),
            "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", "30", "--device", "cpu",
            "--no-progress", "--json"]  # fmt: skip
    export = ["--output-dir", str(tmp_path / "drafter")]  # the export itself: its SERVING.md is rewritten
    assert (
        main([*base, "--baseline", "ngram", "--ngram-min-match", "2", "--ngram-max-draft", "5", *export]) == 0
    )
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    notes = (tmp_path / "drafter" / "SERVING.md").read_text()
    assert f"{result['ngram_dflash_tau']:.3f} with ngram-simple first" in notes
    assert "--spec-ngram-simple-size-n 2 --spec-ngram-simple-size-m 5" in notes
    assert list(result["methods"]) == ["dflash", "ngram", "ngram-overlap", "ngram+dflash"]
    assert result["ngram_dflash_tau"] == result["methods"]["ngram+dflash"]["tau"]
    assert result["ngram_min_match"] == 2 and result["ngram_n"] == 3 and result["ngram_max_draft"] == 5
    diagnosis = result["diagnosis"]
    assert result["random_anchor_tau"] == diagnosis["random_anchor_tau"] >= 1.0
    assert diagnosis["groups"]["rounds"]["blocks"] == result["methods"]["dflash"]["rounds"]
    assert result["per_file"][0]["diagnosis"] == diagnosis  # one file: the same numbers
    for text in ("n-gram+DFlash tau", "random-anchor tau", "tau in loops", "after a rejected round"):
        assert text in out, text
    # Without the baseline: no combination, the diagnosis stays; decode mode has none.
    assert main(base) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(result["methods"]) == ["dflash"] and result["diagnosis"] is not None
    assert main([*base, "--tau-mode", "decode", "--max-new-tokens", "6"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["diagnosis"] is None and result["random_anchor_tau"] is None
    assert main([*base, "--baseline", "ngram", "--ngram-min-match", "0"]) == 1
    assert "ngram_min_match=0: use >= 1" in capsys.readouterr().err
    assert main([*base, "--baseline", "ngram", "--ngram-max-draft", "-1"]) == 1
    assert "ngram_max_draft=-1: use >= 0" in capsys.readouterr().err
