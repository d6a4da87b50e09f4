"""The exact eval's generation bar counts prompts and shows generated tokens/s (the engine reports
both as rows finish)."""

from __future__ import annotations

from dflash_train.eval.report import ProgressBars


def test_the_generation_bar_shows_prompts_and_generated_tokens_per_second():
    bars = ProgressBars(enabled=True)
    on_rows = bars.generation_counter("generate", total=5)
    on_rows(2, 300)
    bar = bars.bars["generate"]
    assert bar.n == 2 and "tok_s=" in bar.postfix
    on_rows(3, 100)
    assert bar.n == 5  # a finished bar closes itself
    bars.close()
