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
from dflash_train.eval.proposers import NgramProposer
from dflash_train.eval.runner import evaluate
from dflash_train.eval.simulate import NgramIndex
from dflash_train.eval.speculative import plain_generate
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
