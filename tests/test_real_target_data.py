"""Data tools on the real pretrained chat target (SmolLM2-135M-Instruct), when its directory is given.

Run with ``DFLASH_REAL_TARGET=/work/smollm2 pytest -m real tests/test_real_target_data.py``.
"""

import json
import os

import pytest

REAL = os.environ.get("DFLASH_REAL_TARGET", "")
pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(not REAL, reason="set DFLASH_REAL_TARGET to the real target's HF directory"),
]


def test_real_target_special_tokens():
    from transformers import AutoTokenizer, GenerationConfig

    from dflash_train.data.special_tokens import choose_mask_token, end_of_turn_id, resolve_eos_ids
    from dflash_train.data.synth import magpie_prefix

    tok = AutoTokenizer.from_pretrained(REAL)
    eos = resolve_eos_ids(tok, GenerationConfig.from_pretrained(REAL))
    mask = choose_mask_token(tok, len(tok), {i: "eos" for i in eos})
    assert mask not in eos and mask != tok.pad_token_id and mask != tok.bos_token_id
    assert (mask, tok.convert_ids_to_tokens(mask)) == (16, "<empty_output>")  # as recipes/smollm2-135m.yaml
    prefix = magpie_prefix(tok, [], {})
    assert prefix.endswith("<|im_start|>user\n")
    assert tok.convert_ids_to_tokens(end_of_turn_id(tok, "user")) == "<|im_end|>"


def test_real_target_synth_then_regen(tmp_path):
    from dflash_train.data.regen import RegenOptions, run_regen
    from dflash_train.data.synth import SynthOptions, run_synth

    prompts = tmp_path / "prompts.jsonl"
    result = run_synth(
        SynthOptions(target=REAL, output=str(prompts), num_rows=8, batch_size=8, max_prompt_tokens=64)
    )
    assert result["complete"] and result["rows"] == 8
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert all(len(r["messages"][0]["content"]) >= 10 for r in rows)
    regen = run_regen(
        RegenOptions(target=REAL, data=[str(prompts)], output=str(tmp_path / "r.jsonl"), max_new_tokens=32)
    )
    assert regen["rows_done"] == 8 and regen["rows_failed"] == 0
