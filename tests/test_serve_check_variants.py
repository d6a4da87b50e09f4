"""serve-check with the drafter variants: the export step hands llama.cpp's converter the variant's
export and starts llama-server with its speculative type and draft length (a stand-in server
here); with a llama.cpp build and the real target, the engine accepts what the exact eval accepts."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dflash_train.eval import llama_cpp
from dflash_train.eval.serve_check import MIN_ACCEPTED_TO_JUDGE, ServeCheckOptions, run_serve_check
from tests.test_serve_check import (
    FAKE_CONVERTER,
    FAKE_HELP,
    FAKE_SERVER,
    LAYER_IDS,
    LLAMA,
    PROMPTS,
    REAL,
    REAL_GGUF,
    fake_options,
    servers_started,
    train_on_own_replies,
)

pytestmark = pytest.mark.usefixtures("one_thread_module")

BLOCK = 4
# variant -> (architecture, llama-server --spec-type, drafts per round)
SERVED = {
    "dflash2": ("DFlash2DraftModel", "draft-dflash", BLOCK - 1),
    "dspark": ("Qwen3DSparkModel", "draft-dspark", BLOCK),
}


@pytest.fixture
def fake_llama(tmp_path, monkeypatch):
    """``test_serve_check``'s stand-in llama-server and converter, also answering ``draft-dspark``."""
    record = tmp_path / "record"
    record.mkdir()
    server = tmp_path / "llama-server"
    server.write_text(
        f"#!{sys.executable}\n"
        + FAKE_SERVER.replace('"draft-dflash": 4,', '"draft-dflash": 4, "draft-dspark": 4,')
    )
    server.chmod(0o755)
    converter = tmp_path / "convert_hf_to_gguf.py"
    converter.write_text(FAKE_CONVERTER)
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("FAKE_HELP", FAKE_HELP.replace("draft-dflash|", "draft-dflash|draft-dspark|"))
    return {"server": str(server), "converter": str(converter), "record": record}


def variant_export(target_dir, tmp_path, variant: str) -> dict[str, str]:
    from transformers import AutoConfig, AutoTokenizer

    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.export import save_drafter

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=BLOCK, variant=variant),
        AutoConfig.from_pretrained(target_dir),
        target_layer_ids=LAYER_IDS,
        mask_token_id=tokenizer.mask_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(config).eval(), config, tmp_path / "export", dtype="float32")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the quick brown fox"}) + "\n")
    return {"target": str(target_dir), "export": str(tmp_path / "export"), "prompts": str(prompts)}


@pytest.mark.parametrize("variant", sorted(SERVED))
def test_serve_check_converts_and_serves_the_variant_export(fake_llama, tiny_qwen3_dir, tmp_path, variant):
    architecture, spec_type, drafts = SERVED[variant]
    export = variant_export(tiny_qwen3_dir, tmp_path, variant)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == [architecture]
    result = run_serve_check(fake_options(fake_llama, export, tmp_path))
    started = servers_started(fake_llama["record"])
    assert spec_type in started
    argv = started[spec_type]["argv"]
    assert argv[argv.index("--spec-draft-n-max") + 1] == str(drafts)
    convert = json.loads((fake_llama["record"] / "convert-draft-f32.gguf.json").read_text())
    assert (
        convert[0] == export["export"]
        and convert[convert.index("--target-model-dir") + 1] == export["target"]
    )
    assert result["block_size"] == drafts + 1  # the round: the last token and the drafts
    assert 1.0 <= result["eval_tau"] <= drafts + 1
    # The drafter's run is named by the spec type it ran with, alone and after each lookup type.
    assert result["drafter_run"] == spec_type and set(result["engine"]) == {
        spec_type,
        "ngram-simple",
        "ngram-mod",
        f"ngram-simple+{spec_type}",
        f"ngram-mod+{spec_type}",
    }
    assert result["engine_tau"] == result["engine"][spec_type]["tau"]


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(
    not (REAL and REAL_GGUF and LLAMA),
    reason=f"set DFLASH_REAL_TARGET(_GGUF) and {llama_cpp.SERVER_ENV} + {llama_cpp.CONVERT_ENV} (a llama.cpp build)",
)
@pytest.mark.parametrize("variant", sorted(SERVED))
def test_llama_cpp_accepts_what_the_eval_accepts_for_the_variant(tmp_path, variant):
    """As ``test_serve_check.test_llama_cpp_accepts_what_the_eval_accepts``, with a CPU-trained
    drafter of ``variant``: the engine's acceptance must not be far below the exact eval's."""

    prompts, _ = train_on_own_replies(tmp_path, f"smollm2-135m-{variant}")
    result = run_serve_check(
        ServeCheckOptions(
            target=REAL_GGUF, target_hf=REAL, drafter=str(tmp_path / "run" / "export"),
            prompts=[str(prompts)], num_prompts=len(PROMPTS), max_new_tokens=32, ngram_types=[],
            workdir=str(tmp_path / "serve"),
        )
    )  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "engine_commands"}, default=str))
    assert result["eval"]["dflash"]["accepted"] >= MIN_ACCEPTED_TO_JUDGE
    assert result["engine_lossless"][SERVED[variant][1]] == f"{len(PROMPTS)}/{len(PROMPTS)}"
    assert result["engine_far_from_eval"] is False
