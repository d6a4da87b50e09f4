"""Stopping rows that repeat themselves (generate/loops.py): which rows count as looping, and both
engines ending exactly those rows early, with the tokens they would have generated up to there."""

from __future__ import annotations

import pytest
import torch

from dflash_train.generate.engine import SlotEngine
from dflash_train.generate.loops import LoopStop, looping_rows
from dflash_train.generate.sampling import PaddedEngine, Sampling
from dflash_train.tiny import build_tiny_target, sharpen

pytestmark = pytest.mark.usefixtures("one_thread_module")


def rows(*token_lists: list[int], width: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, width] tokens (stale values after each row's count) and the counts [S]."""
    generated = torch.full((len(token_lists), width), 7, dtype=torch.long)
    for r, tokens in enumerate(token_lists):
        generated[r, : len(tokens)] = torch.as_tensor(tokens)
    return generated, torch.as_tensor([len(t) for t in token_lists])


def test_a_row_loops_when_its_tail_repeats_one_block_three_times_over_the_minimum_span():
    stop = LoopStop(max_period=5, min_span=8)
    generated, counts = rows(
        [9, 1, 2, 3] * 3,  # period 4, three blocks (12 >= 8): loops
        [9] + [4] * 8,  # period 1 over 8 tokens: loops
        [4] * 7,  # period 1 over only 7 tokens: not yet
        [9, 1, 2, 3, 1, 2, 3],  # two blocks of 3 only (needs 9 tokens): not yet
        [5, 6, 7, 8, 9, 1] * 3,  # period 6 > max_period: not looked for
        [1, 2, 3, 1, 2, 3, 1, 2, 3, 4],  # a loop that was left again: the tail does not repeat
        [3, 1, 2] * 4,  # the stale 7s after the count are never read
    )
    assert looping_rows(generated, counts, stop).tolist() == [True, True, False, False, False, False, True]


def test_a_loop_stop_is_validated():
    with pytest.raises(ValueError, match="max_period"):
        LoopStop(max_period=0)


@pytest.mark.parametrize("engine", ["slots", "padded"])
def test_engines_end_looping_rows_early_with_the_tokens_they_would_have_made(engine):
    """Greedy rows of a sharpened random target (which loops soon): with the stop, every row's tokens
    are a prefix of its tokens without it; the rows ended early are flagged ``looped`` and end in a
    repeated block; the others are unchanged."""
    model = sharpen(build_tiny_target("qwen3", vocab_size=64, seed=1))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=gen).tolist() for n in (3, 9, 5, 14, 2, 7)]
    stop = LoopStop(max_period=6, min_span=12)

    def generate(loop_stop):
        runner = SlotEngine(model, num_slots=4) if engine == "slots" else PaddedEngine(model, num_slots=4)
        return runner.generate(
            prompts, list(range(len(prompts))), max_new_tokens=96, stop_ids=set(), pad_id=0,
            sampling=Sampling(), loop_stop=loop_stop,
        )  # fmt: skip

    full, stopped = generate(None), generate(stop)
    assert not any(g.looped for g in full)
    assert any(g.looped for g in stopped), "no row looped: the test shows nothing"
    for whole, cut in zip(full, stopped, strict=True):
        assert whole.token_ids[: len(cut.token_ids)] == cut.token_ids
        if cut.looped:
            assert len(cut.token_ids) < 96 and not cut.finished
            tokens = torch.as_tensor(cut.token_ids)[None]
            assert looping_rows(tokens, torch.as_tensor([tokens.shape[1]]), stop).item()
        else:
            assert cut == whole
