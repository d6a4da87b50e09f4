"""The serving flags of an exported drafter, written next to it as ``SERVING.md``.

The block length is not read from the export by either engine: it is a serving flag (SGLang
``--speculative-num-draft-tokens B``, vLLM ``num_speculative_tokens: B-1``), so a drafter served
with another value silently drafts a different block than it was trained on. This module states
the exact flags for one export, and the engine differences that matter for it:
- vLLM runs drafters with mixed sliding/full layers only on its V2 model runner
  (``VLLM_USE_V2_MODEL_RUNNER=1``); the V1 runner refuses them;
- SGLang ignores ``is_causal`` (sliding layers are always causal in-block there);
- engines differ on the last target layer's feature (before or after the final norm).

Each variant names its engines' entry points in its module (``models/variants/``: SGLang's
``--speculative-algorithm``, vLLM's method and V2-runner need, llama.cpp's ``--spec-type``); a
round verifies ``num_verify_tokens`` (B, or B + 1 for DSpark, whose every slot drafts). The DFlash2
and DSpark flags come from the engines' sources as read, not from a served run here (docs/training.md,
"Serving the export").
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.variant import get_variant

SERVING_NOTES_NAME = "SERVING.md"


def serving_flags(
    config: DFlashDraftConfig, export_dir: str | Path, target: str = "<target>"
) -> dict[str, str]:
    """The launch commands of SGLang, vLLM and llama.cpp for this export: ``{"sglang": ..., "vllm":
    ..., "llama_cpp": ...}`` (llama.cpp: its converter, then llama-server; docs/training.md)."""
    draft = str(Path(export_dir).resolve())
    variant = get_variant(config.variant)
    vllm_config = json.dumps(
        {"method": variant.vllm_method, "model": draft, "num_speculative_tokens": config.num_draft_tokens}
    )
    vllm_env = "VLLM_USE_V2_MODEL_RUNNER=1 " if needs_vllm_v2_runner(config) else ""
    return {
        "sglang": (
            f"python -m sglang.launch_server --model-path {target} "
            f"--speculative-algorithm {variant.sglang_algorithm} --speculative-draft-model-path {draft} "
            f"--speculative-num-draft-tokens {config.num_verify_tokens}"
        ),
        "vllm": f"{vllm_env}vllm serve {target} --speculative-config '{vllm_config}'",
        "llama_cpp": (
            f"python convert_hf_to_gguf.py {draft} --target-model-dir {target} --outtype f32 --outfile draft.gguf"
            f" && llama-server -m TARGET.gguf -md draft.gguf --spec-type {variant.llama_cpp_spec_type} "
            f"--spec-draft-n-max {config.num_draft_tokens} --jinja"
        ),
    }


def needs_vllm_v2_runner(config: DFlashDraftConfig) -> bool:
    """Mixed sliding/full layers need several KV-cache groups, which only vLLM's V2 runner has; the
    DFlash2 and DSpark speculators exist only there."""
    return len(set(config.layer_types)) > 1 or get_variant(config.variant).needs_vllm_v2_runner


def serving_warnings(config: DFlashDraftConfig) -> list[str]:
    """Engine differences that apply to this drafter (empty when it serves the same everywhere)."""
    notes = []
    if get_variant(config.variant).needs_vllm_v2_runner:
        notes.append(
            f"A {config.variant} drafter: vLLM runs it only on its V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`, "
            "included above), and SGLang and vLLM need versions with its speculator; llama.cpp loads it too "
            '(docs/training.md, "Serving the export").'
        )
    elif needs_vllm_v2_runner(config):
        notes.append(
            "The drafter mixes sliding and full attention layers: vLLM serves it only with its V2 model "
            "runner (`VLLM_USE_V2_MODEL_RUNNER=1`, included above); without it vLLM refuses to start."
        )
    if not config.is_causal and "sliding_attention" in config.layer_types:
        notes.append(
            "`is_causal: false` with sliding layers: vLLM honours it, SGLang ignores it and runs sliding "
            "layers causal in-block, so SGLang would not serve the drafter as it was trained."
        )
    notes += llama_cpp_causality_warnings(config)
    notes += get_variant(config.variant).serving_warnings(config)
    if config.num_target_layers - 1 in config.target_layer_ids:
        notes.append(
            f"target_layer_ids {config.target_layer_ids} include the target's last layer "
            f"{config.num_target_layers - 1} (trained on its output before the final norm): check that "
            "your engine captures it before the final norm too, or acceptance drops."
        )
    return notes


def llama_cpp_causality_warnings(config: DFlashDraftConfig) -> list[str]:
    """llama.cpp runs the block attention of every layer one way, causal iff the export's ``is_causal``
    is true (its ``dflash.attention.causal``); here a full layer is bidirectional in-block and a
    sliding layer causal unless ``is_causal`` is false. A drafter whose layers differ from that one
    way does not serve through llama.cpp as trained."""
    served_causal = bool(config.to_serving_dict().get("is_causal", False))
    trained_causal = {"full_attention": False, "sliding_attention": config.is_causal}
    differ = sorted({kind for kind in config.layer_types if trained_causal[kind] != served_causal})
    if not differ:
        return []
    mode = "causal" if served_causal else "bidirectional"
    return [
        f"llama.cpp runs every layer's in-block attention {mode} here (one flag, from `is_causal`), so "
        f"its {' and '.join(differ)} layers would not run as trained (acceptance drops); serve it with "
        "SGLang or vLLM, or train a drafter llama.cpp reproduces (full attention layers only, or "
        "drafter.is_causal=false)."
    ]


def serving_notes(config: DFlashDraftConfig, export_dir: str | Path, target: str = "<target>") -> str:
    """The text of ``SERVING.md``: block length, the engines' launch commands and the applicable warnings."""
    flags = serving_flags(config, export_dir, target)
    block, drafts, verify = config.block_size, config.num_draft_tokens, config.num_verify_tokens
    name = get_variant(config.variant).label
    lines = [
        f"# Serving this {name} drafter",
        "",
        f"Block size {block}: each round drafts {drafts} tokens. Serve it against the target it was "
        f"trained for ({config.num_target_layers} layers, hidden {config.hidden_size}, vocab "
        f"{config.vocab_size}; feature layers {config.target_layer_ids}, mask token {config.mask_token_id}).",
        "",
        f"SGLang (`--speculative-num-draft-tokens {verify}`):",
        "",
        f"    {flags['sglang']}",
        "",
        f"vLLM (`num_speculative_tokens: {drafts}`):",
        "",
        f"    {flags['vllm']}",
        "",
        f"llama.cpp (`--spec-draft-n-max {drafts}`; the converter needs the target's HF directory):",
        "",
        f"    {flags['llama_cpp']}",
    ]
    warnings = serving_warnings(config)
    if warnings:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in warnings]
    return "\n".join(lines) + "\n"


def write_serving_notes(config: DFlashDraftConfig, export_dir: str | Path, target: str = "<target>") -> str:
    """Write ``export_dir/SERVING.md`` and return its text."""
    text = serving_notes(config, export_dir, target)
    (Path(export_dir) / SERVING_NOTES_NAME).write_text(text)
    return text
