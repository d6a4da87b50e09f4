"""The exact-eval side of ``dflash-train serve-check`` (``eval/serve_check.py``).

``check_pair_and_read_prompts`` runs before llama.cpp's converter (minutes for a real model): the
drafter is checked against the target as the eval checks it (``check_drafter_fits``, the same
errors), on the target built from its config on the meta device, so no weight is read twice and
none is held in memory while the converter runs; the prompt files are read and tokenized, which
needs only the tokenizer. ``exact_eval`` then loads the weights once and measures those prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_train.eval.prompts import PromptFile
from dflash_train.eval.serve_prompts import ServePrompt, load_serve_prompts
from dflash_train.models.dtypes import parse_device


def check_pair_and_read_prompts(options, export: Path) -> list[list[ServePrompt]]:
    """Refuse a drafter that does not fit ``options.target_hf`` (``check_drafter_fits``) and a bad
    prompt row, without loading the target's weights; the prompts of each file otherwise.
    ``options`` is serve-check's ``ServeCheckOptions`` (not imported: that module imports this one)."""
    from dflash_train.eval.command import check_drafter_fits
    from dflash_train.models.export import CONFIG_NAME, read_drafter_config
    from dflash_train.models.target_loading import load_tokenizer

    tokenizer = load_tokenizer(options.target_hf, trust_remote_code=False)
    if tokenizer is None:
        raise ValueError(
            f"target {options.target_hf!r} has no tokenizer: serve-check needs one to encode the prompts"
        )
    config = read_drafter_config(export / CONFIG_NAME)
    check_drafter_fits(config, target_on_meta(options.target_hf), tokenizer)
    return load_serve_prompts(options.prompts, tokenizer, options.num_prompts)


def target_on_meta(path: str):
    """The causal LM at ``path`` built from its config on the meta device (no weights read), with
    the generation config ``from_pretrained`` would give it: the pad/eos ids the mask token is
    checked against come from both configs."""
    from dflash_train.data.regen import target_generation_config
    from dflash_train.models.recipe_config import TargetConfig
    from dflash_train.models.target_loading import meta_text_model

    model = meta_text_model(TargetConfig(path=path, dtype="float32"))
    generation_config = target_generation_config(path)
    if generation_config is not None:
        model.generation_config = generation_config
    return model


def exact_eval(options, export: Path, prompt_files: list[list[ServePrompt]]) -> dict[str, Any]:
    """The project's exact eval (fp32) on the prompts serve-check sends: DFlash, n-gram and
    ngram+dflash generations, and the prompts themselves."""
    from dflash_train.eval.command import check_drafter_fits, load_eval_drafter, load_eval_target, measure
    from dflash_train.eval.options import EvalOptions
    from dflash_train.eval.target_session import decoder_layers

    device = parse_device(options.device, "--device")
    target_model, tokenizer = load_eval_target(options.target_hf, torch.float32, device)
    drafter = load_eval_drafter(str(export), device, torch.float32)
    frozen = check_drafter_fits(drafter.config, target_model, tokenizer)
    files = [PromptFile(path, [p.ids for p in ps]) for path, ps in zip(options.prompts, prompt_files)]
    eval_options = EvalOptions(
        target=options.target_hf, drafter=str(export), prompts=list(options.prompts),
        max_new_tokens=options.max_new_tokens, baseline="ngram", dtype="float32",
        ngram_min_match=(options.ngram_min_match,), ngram_max_draft=options.ngram_max_draft,
        device=options.device, progress=False,
    )  # fmt: skip
    generations = measure(target_model, frozen, tokenizer, drafter, files, eval_options)["generations"]
    return {
        "target_recurrent": any(hasattr(layer, "linear_attn") for layer in decoder_layers(target_model)),
        "prompts": [p for ps in prompt_files for p in ps],
        "dflash": generations["dflash"],
        "ngram": generations["ngram"],
        "ngram+dflash": generations["ngram+dflash"],
        "greedy_texts": [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in generations["dflash"]],
    }
