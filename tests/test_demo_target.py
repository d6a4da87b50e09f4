"""The embedded demo target: stdlib corpus split, a tiny build, loading it back, atomic publishing."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_train.demo import corpus, target_build
from dflash_train.demo.builtin_targets import BUILTIN_TARGET_MAX_SECONDS, builtin_target_path
from dflash_train.demo.target_build import DemoTargetSettings, build_demo_target

TINY = DemoTargetSettings(
    vocab_size=300,
    hidden_size=32,
    num_attention_heads=2,
    seq_len=64,
    batch_size=2,
    max_steps=3,
    warmup_steps=1,
    num_eval_rows=2,
    log_every_steps=1,
)


@pytest.fixture(scope="module")
def two_files():
    files = corpus.stdlib_files("train")
    by_name = {p.name: p for p in files}
    return [by_name["bisect.py"], by_name["colorsys.py"]]


def test_split_is_disjoint_deterministic_and_excludes_tests():
    train, held_out = corpus.stdlib_files("train"), corpus.stdlib_files("eval")
    assert len(train) > 100 and len(held_out) >= 5
    assert not set(train) & set(held_out)
    assert train == corpus.stdlib_files("train") and held_out == corpus.stdlib_files("eval")
    root = corpus.stdlib_root()
    relative = [p.relative_to(root).as_posix() for p in train + held_out]
    assert relative[: len(train)] == sorted(relative[: len(train)])
    assert not [r for r in relative if "/test/" in f"/{r}" or r.startswith(("idlelib/", "encodings/"))]
    assert all(corpus.is_eval_file(r) for r in relative[len(train) :])
    with pytest.raises(ValueError, match="split"):
        corpus.stdlib_files("validation")


def test_file_chunks_are_line_aligned_and_lossless():
    text = "a = 1\n" * 30 + "x" * 50 + "\nend\n"
    pieces = list(corpus.file_chunks(text, max_chars=40))
    assert "".join(pieces) == text
    assert all(len(p) <= 40 for p in pieces)
    assert all(p.endswith("\n") for p in pieces[:5])


def test_tiny_build_loads_back_with_chat_template(tmp_path, two_files):
    out = build_demo_target(
        tmp_path / "target",
        seconds_budget=60,
        settings=TINY,
        train_files=two_files,
        eval_files=two_files[:1],
        progress=False,
    )
    info = json.loads((out / "build_info.json").read_text())
    assert info["steps"] == TINY.max_steps and info["held_out_loss"] > 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (
        model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config.max_position_embeddings >= 2048
    assert "full_attention" in model.config.layer_types and "linear_attention" in model.config.layer_types
    messages = [{"role": "user", "content": corpus.continuation_prompt("import os\n")}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>user\nContinue this Python file.\nimport os\n<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    with pytest.raises(FileExistsError):
        build_demo_target(out, settings=TINY, train_files=two_files, eval_files=two_files, progress=False)


def test_failed_build_leaves_nothing_behind(tmp_path, two_files, monkeypatch):
    def fail_midway(*args, **kwargs):
        raise RuntimeError("killed during training")

    monkeypatch.setattr(target_build, "train_target", fail_midway)
    with pytest.raises(RuntimeError, match="killed"):
        build_demo_target(
            tmp_path / "target", settings=TINY, train_files=two_files, eval_files=two_files, progress=False
        )
    assert list(tmp_path.iterdir()) == []


def test_builtin_path_is_cached_and_rejects_unknown_names(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path))
    calls = []

    def fake_build(path, **kwargs):
        calls.append((path, kwargs["seconds_budget"]))
        path.mkdir(parents=True)
        (path / "build_info.json").write_text(
            json.dumps({"steps": target_build.DemoTargetSettings().max_steps})
        )
        return path

    monkeypatch.setattr(target_build, "build_demo_target", fake_build)
    first = builtin_target_path("demo-target", progress=False)
    assert first.parent == tmp_path
    assert first.name.startswith(f"demo-target-{target_build.CACHE_VERSION}-py3.")
    assert builtin_target_path("demo-target", progress=False) == first
    # Built once, with the full schedule: the wall-clock budget is only a backstop.
    assert calls == [(first, BUILTIN_TARGET_MAX_SECONDS)] and BUILTIN_TARGET_MAX_SECONDS >= 1800
    with pytest.raises(ValueError, match="unknown built-in target"):
        builtin_target_path("gpt-5")


def test_a_builtin_target_cut_short_by_the_backstop_warns_at_every_use(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path))

    def fake_build(path, **kwargs):
        path.mkdir(parents=True)
        (path / "build_info.json").write_text(json.dumps({"steps": 10}))
        return path

    monkeypatch.setattr(target_build, "build_demo_target", fake_build)
    for _ in range(2):
        path = builtin_target_path("demo-target", progress=False)
        assert "trained only 10 of" in capsys.readouterr().err
    assert (path / "build_info.json").exists()
