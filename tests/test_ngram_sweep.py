"""The key-size sweep of ``ngram+dflash`` (``--ngram-min-match 1,2,3``): each further key size K is
the method ``ngram+dflash@K``, equal to what a separate eval with that one key size reports; one
key size leaves the eval's output as it was; the option is refused where it would measure nothing.
The exact-only lookup methods beside the baseline (``ngram-simple``, ``ngram-overlap``) are checked
round for round against direct-search references on the same continuations.

The target is a sharpened tiny Qwen3 (varied continuations with short loops) and the drafter is
fitted a few steps to its continuations, so that key sizes 1, 2 and 3 pick lookup in different
rounds and give three different taus: a sweep that ignored K would fail the comparison.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from dflash_train.cli import main
from dflash_train.eval.exact import exact_measure
from dflash_train.eval.ngram_simple import combined_methods, swept_key_size
from dflash_train.eval.options import EvalOptions, parse_key_sizes
from dflash_train.eval.plots import method_label, method_styles
from tests.test_eval_exact import TEXTS  # the exact eval's prompts: short code and prose, some looping

MAX_NEW = 60
SWEPT = ("ngram+dflash@2", "ngram+dflash@3")

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def sweep_setup(tmp_path_factory):
    """{target, export, prompts}: a sharpened tiny Qwen3 target directory, a drafter fitted to its
    continuations and exported, and the prompt file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_train.eval.exact import as_frozen_target
    from dflash_train.eval.generate import greedy_continuations
    from dflash_train.eval.prompts import encode_prompt
    from dflash_train.models.export import save_drafter
    from dflash_train.tiny import fit_drafter_on_continuations, save_tiny_target, sharpen
    from tests.test_eval_runner import make_drafter

    root = tmp_path_factory.mktemp("ngram_sweep")
    target = save_tiny_target(root / "target", kind="qwen3", seed=0)
    model = sharpen(AutoModelForCausalLM.from_pretrained(target).eval())
    model.save_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    rows = [{"prompt": text} for text in TEXTS]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = [encode_prompt(tokenizer, row, None) for row in rows]
    eos = {tokenizer.eos_token_id}
    continuations = greedy_continuations(
        model, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, pad_token_id=0, batch_size=8
    )
    drafter, config = make_drafter(model, tokenizer)
    frozen = as_frozen_target(model, config.target_layer_ids)
    fit_drafter_on_continuations(drafter, frozen, prompts, continuations, max_new_tokens=MAX_NEW, steps=10)
    save_drafter(drafter, config, root / "export", dtype="float32")
    return {
        "target": str(target),
        "export": root / "export",
        "prompts": str(root / "prompts.jsonl"),
        "encoded": (prompts, continuations, eos),
    }


def run_eval(capsys, setup, key_sizes: str, *extra: str, export=None) -> tuple[dict, str]:
    """``dflash-train eval --baseline ngram --ngram-min-match KEY_SIZES --json``: (result, stdout)."""
    args = [
        "eval", "--target", setup["target"], "--drafter", str(export or setup["export"]),
        "--prompts", setup["prompts"], "--max-new-tokens", str(MAX_NEW), "--device", "cpu",
        "--no-progress", "--json", "--baseline", "ngram", "--ngram-min-match", key_sizes, *extra,
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1]), out


def without_sweep(result: dict) -> dict:
    """The result without what a sweep adds, overall and per file, and without the wall-clock timings."""

    def unswept(numbers: dict) -> dict:
        return {**numbers, "methods": {m: n for m, n in numbers["methods"].items() if m not in SWEPT}}

    kept = {k: v for k, v in result.items() if k not in ("ngram_dflash_key_sizes", "timings")}
    return {**unswept(kept), "per_file": [unswept(f) for f in result["per_file"]]}


def test_each_swept_key_size_equals_a_single_key_eval_with_it(sweep_setup, capsys):
    sweep, out = run_eval(capsys, sweep_setup, "1,2,3")
    assert list(sweep["methods"]) == ["dflash", "ngram", "ngram-overlap", "ngram+dflash", *SWEPT]
    assert sweep["ngram_dflash_key_sizes"] == {"ngram+dflash": 1, "ngram+dflash@2": 2, "ngram+dflash@3": 3}
    assert sweep["ngram_min_match"] == 1 and sweep["ngram_max_draft"] == 48
    for key_size, method in zip((2, 3), SWEPT, strict=True):
        single, _ = run_eval(capsys, sweep_setup, str(key_size))
        # Every per-method number: tau, acceptance by position, accepted lengths, rounds, tokens.
        assert sweep["methods"][method] == single["methods"]["ngram+dflash"], method
        assert sweep["per_file"][0]["methods"][method] == single["per_file"][0]["methods"]["ngram+dflash"]
    taus = [sweep["methods"][m]["tau"] for m in ("ngram+dflash", *SWEPT)]
    assert len({round(t, 9) for t in taus}) == 3, taus  # the key size changed which rounds used lookup
    for text in ("n-gram+DFlash@2 tau", "n-gram+DFlash@3 tau", "n-gram+DFlash 1, n-gram+DFlash@2 2"):
        assert text in out, text
    accept = " ".join(f"{a:.2f}" for a in sweep["methods"]["ngram+dflash@3"]["per_position_acceptance"])
    assert re.search(rf"\n  overall +n-gram\+DFlash@3 {accept}\n", out)  # its acceptance by position


def test_one_key_size_leaves_the_output_unchanged(sweep_setup, capsys):
    """The first key size of a sweep is ``ngram+dflash`` with every number a one-key eval reports,
    and a one-key eval adds no method, field or line."""
    single, out = run_eval(capsys, sweep_setup, "1")
    sweep, _ = run_eval(capsys, sweep_setup, "1,2,3")
    assert list(single["methods"]) == ["dflash", "ngram", "ngram-overlap", "ngram+dflash"]
    assert "ngram_dflash_key_sizes" not in single and single["ngram_min_match"] == 1
    assert without_sweep(sweep) == without_sweep(single)
    assert "n-gram+DFlash@" not in out and "ngram-simple key size" not in out


def test_serving_md_serves_the_best_measured_key_size(sweep_setup, capsys, tmp_path):
    """``--output-dir`` the export: SERVING.md's combined line carries the key size whose method
    measured the highest tau, and states that tau and every other key size's."""
    export = tmp_path / "export"
    shutil.copytree(sweep_setup["export"], export)
    sweep, _ = run_eval(capsys, sweep_setup, "1,2,3", "--output-dir", str(export), export=export)
    taus = {k: sweep["methods"][m]["tau"] for m, k in sweep["ngram_dflash_key_sizes"].items()}
    best = max(taus, key=taus.__getitem__)
    notes = (export / "SERVING.md").read_text()
    assert f"--spec-ngram-simple-size-n {best} --spec-ngram-simple-size-m 48" in notes
    assert f"{taus[best]:.3f} with ngram-simple first (key size {best}, the flags above" in notes
    assert ", ".join(f"{k}: {t:.3f}" for k, t in taus.items()) in notes
    assert (export / "acceptance.png").is_file()


def test_key_sizes_are_validated_with_the_flag_named():
    base = {"target": "t", "drafter": "d", "prompts": ["p.jsonl"], "baseline": "ngram"}
    assert EvalOptions(**base).ngram_min_match == (3,)
    options = EvalOptions(**base, ngram_min_match=(3, 4, 6), ddtree_budget=4)
    assert options.exact_methods == [
        "dflash",
        "ngram",
        "ngram-overlap",
        "ngram+dflash",
        "ngram+dflash@4",
        "ngram+dflash@6",
        "ddtree",
    ]
    assert parse_key_sizes("3") == (3,) and parse_key_sizes("3, 4,6") == (3, 4, 6)
    for text in ("3,x", "3,,4", "", "3.5"):
        with pytest.raises(ValueError, match="--ngram-min-match .*integer key sizes separated by commas"):
            parse_key_sizes(text)
    with pytest.raises(ValueError, match="--ngram-min-match 3,4,3 gives key size 3 more than once"):
        EvalOptions(**base, ngram_min_match=(3, 4, 3))
    with pytest.raises(ValueError, match="ngram_min_match=0: use >= 1 for every key size"):
        EvalOptions(**base, ngram_min_match=(3, 0))
    for wrong in (3, (), (3.0,), (True,), [3, 4]):
        with pytest.raises(TypeError, match="ngram_min_match=.*non-empty tuple of ints"):
            EvalOptions(**base, ngram_min_match=wrong)
    # A sweep where ngram+dflash does not run would measure nothing: refused, one key size is not.
    with pytest.raises(ValueError, match="add --baseline ngram"):
        EvalOptions(**{**base, "baseline": "none"}, ngram_min_match=(3, 4))
    with pytest.raises(ValueError, match="--ngram-min-match 3,4 sweeps"):
        EvalOptions(**base, ngram_min_match=(3, 4), temperature=0.5)
    assert EvalOptions(**{**base, "baseline": "none"}, ngram_min_match=(4,)).exact_methods == ["dflash"]


def test_the_command_refuses_a_bad_sweep_before_loading_anything(capsys):
    base = [
        "eval",
        "--target",
        "no-target",
        "--drafter",
        "no-drafter",
        "--prompts",
        "p.jsonl",
        "--baseline",
        "ngram",
    ]
    assert main([*base, "--ngram-min-match", "3,3"]) == 1
    assert "--ngram-min-match 3,3 gives key size 3 more than once" in capsys.readouterr().err
    assert main([*base, "--ngram-min-match", "3;4"]) == 1
    assert "--ngram-min-match '3;4': give integer key sizes separated by commas" in capsys.readouterr().err


def test_method_names_labels_and_styles_of_a_sweep():
    assert combined_methods((3,)) == {"ngram+dflash": 3}
    assert combined_methods((3, 6, 8)) == {"ngram+dflash": 3, "ngram+dflash@6": 6, "ngram+dflash@8": 8}
    assert [swept_key_size(m) for m in ("ngram+dflash@6", "ngram+dflash", "ngram@6", "ngram+dflash@06")] == [
        6, None, None, None,
    ]  # fmt: skip
    assert swept_key_size("ngram+dflash@0") is None and method_label("ngram+dflash@6") == "n-gram+DFlash@6"
    methods = ["dflash", "ngram", "ngram+dflash", "ngram+dflash@6", "ngram+dflash@8", "ddtree"]
    styles = method_styles(methods)
    assert len({s["color"] for s in styles.values()}) == len(methods)  # every key size its own color
    assert styles["ngram+dflash@6"]["linestyle"] == styles["ngram+dflash"]["linestyle"]
    for bad in ("ngram+dflash@0", "ngram+dflash@x"):
        with pytest.raises(ValueError, match="unknown eval methods"):
            exact_measure(None, None, [], [], max_new_tokens=4, eos_token_ids=(), methods=(bad,))


def lookup_alone_rounds(prompt, continuation, eos, key_size: int, max_draft: int) -> list[int]:
    """Accepted tokens per round of llama.cpp's ngram-simple alone, from the direct-search reference
    ``ngram_simple_draft``: a round drafts its proposal (none: the round emits the target's token
    alone), cut to the tokens the request has left, minus one."""
    from dflash_train.eval.ngram_simple import ngram_simple_draft
    from dflash_train.eval.simulate import matched_prefix, request_limit

    ids, limit, out, accepted = [*prompt, *continuation], request_limit(continuation, MAX_NEW, eos), 1, []
    while out < limit and continuation[out - 1] not in eos:
        draft = ngram_simple_draft(ids, len(prompt) + out, key_size, max_draft)[: limit - out - 1]
        accepted.append(matched_prefix(draft, continuation, out, eos))
        out += accepted[-1] + 1
    return accepted


@pytest.mark.parametrize("max_draft", [0, 6])
def test_ngram_simple_is_the_combination_s_lookup_alone(sweep_setup, capsys, max_draft):
    """``--ngram-simple``: the method ``ngram-simple`` is llama.cpp's lookup alone at the first key size
    and the same draft limit (0 = B-1 = 3 here; 6 drafts past the block), round for round as the
    direct-search reference gives it, beside an unchanged ``ngram+dflash``."""
    extra = ("--ngram-max-draft", str(max_draft))
    plain, _ = run_eval(capsys, sweep_setup, "2", *extra)
    result, out = run_eval(capsys, sweep_setup, "2", "--ngram-simple", *extra)
    assert list(result["methods"]) == ["dflash", "ngram", "ngram-overlap", "ngram-simple", "ngram+dflash"]
    assert result["methods"]["ngram+dflash"] == plain["methods"]["ngram+dflash"]
    prompts, continuations, eos = sweep_setup["encoded"]
    want = [
        a
        for prompt, continuation in zip(prompts, continuations, strict=True)
        for a in lookup_alone_rounds(prompt, continuation, eos, 2, max_draft or 3)
    ]
    got = result["methods"]["ngram-simple"]
    histogram = got["accept_length_histogram"]
    assert got["rounds"] == len(want) == sum(histogram)
    assert histogram == [want.count(accepted) for accepted in range(len(histogram))]
    assert got["tokens"] == plain["methods"]["ngram+dflash"]["tokens"]  # the same continuations
    assert max(want) > 3 if max_draft == 6 else max(want) <= 3  # the limit reached past the block
    assert "ngram-simple tau" in out


def overlapping_copy_rounds(prompt, continuation, eos, block_size: int) -> list[int]:
    """Accepted tokens per round of the n-gram lookup copied on past the text's end, from the
    direct-search ``NgramProposer.lookup``: what followed its match (everything up to the end of
    the text), cycled to B-1 tokens; no match: the last token, padded."""
    from dflash_train.eval.proposers import NgramProposer
    from dflash_train.eval.simulate import matched_prefix, request_limit

    ids, limit, out, accepted = [*prompt, *continuation], request_limit(continuation, MAX_NEW, eos), 1, []
    while out < limit and continuation[out - 1] not in eos:
        context = ids[: len(prompt) + out]
        span = NgramProposer(3).lookup(context, len(context)) or context[-1:]
        draft = [span[k % len(span)] for k in range(block_size - 1)][: limit - out - 1]
        accepted.append(matched_prefix(draft, continuation, out, eos))
        out += accepted[-1] + 1
    return accepted


def test_the_eval_reports_the_overlapping_copy_beside_the_ngram_baseline(sweep_setup, capsys, tmp_path):
    """``--baseline ngram`` in exact mode also reports ``ngram-overlap`` (overall, per file, in the
    table, the figure and eval.json), round for round the direct-search reference on the same
    continuations; the ``ngram`` baseline is what it was."""
    result, out = run_eval(capsys, sweep_setup, "2", "--output-dir", str(tmp_path))
    assert list(result["methods"]) == ["dflash", "ngram", "ngram-overlap", "ngram+dflash"]
    prompts, continuations, eos = sweep_setup["encoded"]
    block_size = len(result["per_position_acceptance"]) + 1
    want = [
        a
        for prompt, continuation in zip(prompts, continuations, strict=True)
        for a in overlapping_copy_rounds(prompt, continuation, eos, block_size)
    ]
    got, ngram = result["methods"]["ngram-overlap"], result["methods"]["ngram"]
    assert got["rounds"] == len(want) == sum(got["accept_length_histogram"])
    assert got["accept_length_histogram"] == [want.count(n) for n in range(block_size)]
    assert got["tokens"] == ngram["tokens"]  # the same continuations
    assert got["accept_length_histogram"] != ngram["accept_length_histogram"]  # loops shorter than B-1
    assert result["ngram_overlap_tau"] == got["tau"] and result["ngram_tau"] == ngram["tau"]
    assert result["per_file"][0]["methods"]["ngram-overlap"] == got  # one file: the same numbers
    assert "n-gram-overlap tau" in out
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["methods"]["ngram-overlap"] == got and saved["ngram_overlap_tau"] == got["tau"]


def test_ngram_simple_is_refused_where_the_combination_does_not_run():
    base = {"target": "t", "drafter": "d", "prompts": ["p.jsonl"]}
    with pytest.raises(ValueError, match="--ngram-simple .*--baseline ngram"):
        EvalOptions(**base, ngram_simple=True)
    assert EvalOptions(**base, baseline="ngram", ngram_simple=True).exact_methods[:4] == [
        "dflash",
        "ngram",
        "ngram-overlap",
        "ngram-simple",
    ]


def test_the_lookup_fields_are_null_where_the_combination_did_not_run():
    """eval.json's ngram_min_match / ngram_max_draft describe ngram+dflash, which decode mode never runs."""
    from dflash_train.eval.command import lookup_fields

    base = {"target": "t", "drafter": "d", "prompts": ["p.jsonl"], "baseline": "ngram"}
    assert lookup_fields(EvalOptions(**base), 4) == {"ngram_min_match": 3, "ngram_max_draft": 48}
    assert lookup_fields(EvalOptions(**base, ngram_max_draft=0), 4)["ngram_max_draft"] == 3
    none = {"ngram_min_match": None, "ngram_max_draft": None}
    assert lookup_fields(EvalOptions(**{**base, "baseline": "none"}), 4) == none
    for decode in ({"tau_mode": "decode"}, {"temperature": 0.5}):
        assert lookup_fields(EvalOptions(**base, **decode), 4) == none
