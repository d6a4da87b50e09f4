"""Tokenizers as they are: EOS ids from the generation config, a safe mask token chosen automatically."""

import json
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from dflash_train.data.special_tokens import choose_mask_token, pad_id, resolve_eos_ids
from dflash_train.tiny import build_tokenizer
from tests.chat_families import family_tokenizer, save_family_target


@pytest.mark.parametrize(
    "family, expected",
    [("smollm2", "<empty_output>"), ("llama3", "<|reserved_special_token_0|>"), ("qwen35", "<|vision_pad|>")],
)
def test_mask_token_choice_per_family(family, expected):
    tok = family_tokenizer(family)
    assert tok.mask_token is None
    chosen = choose_mask_token(tok, len(tok))
    assert tok.convert_ids_to_tokens(chosen) == expected
    assert chosen not in {tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id}


def test_mask_token_prefers_the_tokenizers_own_then_a_spare_embedding_row():
    tiny = build_tokenizer()
    assert choose_mask_token(tiny, len(tiny)) == tiny.mask_token_id
    qwen = family_tokenizer("qwen35")
    assert choose_mask_token(qwen, len(qwen) + 8) == len(qwen)  # like Qwen3's 151669


def test_mask_token_refuses_template_and_config_tokens_and_lists_candidates():
    tok = family_tokenizer("qwen35")
    vision_pad = tok.convert_tokens_to_ids("<|vision_pad|>")
    with pytest.raises(ValueError, match=r"drafter.mask_token_id.*") as err:
        choose_mask_token(tok, len(tok), {vision_pad: "eos"})
    message = str(err.value)
    assert "emitted by the chat template" in message and f"{vision_pad} '<|vision_pad|>' (eos)" in message


def test_eos_ids_from_the_generation_config_and_a_warning_when_they_disagree():
    tok = family_tokenizer("llama3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        both = resolve_eos_ids(tok, SimpleNamespace(eos_token_id=[1, tok.eos_token_id]))
    assert both == [1, tok.eos_token_id]
    with pytest.warns(UserWarning, match="not in the generation config's eos_token_id"):
        assert resolve_eos_ids(tok, SimpleNamespace(eos_token_id=1)) == [1]
    assert resolve_eos_ids(tok, None) == [tok.eos_token_id]
    assert tok.pad_token_id is None and pad_id(tok, [1, 6]) == 1


def test_training_chooses_logs_and_exports_the_mask_token(tmp_path, capsys):
    from dflash_train.config import load_config
    from dflash_train.train.builders import build_drafter, build_target
    from dflash_train.train.parallel import DistInfo

    target_dir = save_family_target(tmp_path / "smol", "smollm2")
    cfg = load_config("tiny-cpu", [f"target.path={target_dir}", "target.target_layer_ids=[0,1]"])
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    target = build_target(cfg, info)
    draft_config, _ = build_drafter(cfg, target, info)
    assert draft_config.mask_token_id == 5  # <empty_output>: unused, not pad/eos/bos/unk, not in the template
    assert "chose 5 '<empty_output>'" in capsys.readouterr().out
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.export import save_drafter

    export = tmp_path / "export"
    save_drafter(DFlashDrafter(draft_config), draft_config, export)
    assert json.loads((export / "config.json").read_text())["dflash_config"]["mask_token_id"] == 5
    assert os.path.exists(export / "model.safetensors")
