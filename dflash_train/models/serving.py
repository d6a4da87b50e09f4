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

llama.cpp gets two lines, built by the functions ``serve-check`` runs them with: the drafter alone
(``--spec-draft-p-min 0``: a block is never cut where the eval scores it whole), and its
``ngram-simple`` prompt lookup first (``--spec-type ngram-simple,<the variant's spec type>``), the configuration
the eval's ``ngram+dflash`` simulates. Which one to serve depends on the prompts: SERVING.md states
the eval's numbers and the pick where ``eval.json`` in the export has them, else how to measure.
Where that eval swept the lookup's key size (``--ngram-min-match 3,4,6``), SERVING.md serves the key
size with the highest measured tau, and says so (``measured_lookup``).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.variant import get_variant

SERVING_NOTES_NAME = "SERVING.md"
# llama.cpp's ngram-simple key size in the served combination: the eval's ``--ngram-min-match``
# default, so that SERVING.md serves what the eval's ``ngram+dflash`` measured by default.
LOOKUP_KEY_SIZE = 3
# ... and its draft limit per lookup round: llama.cpp's own ngram-simple default (48), which let lookup
# copy whole repetition loops (SmolLM2-135M: ngram+dflash 1.45x -> 1.71x n-gram at 15 -> 48 tokens,
# docs/quality.md); the eval's ``--ngram-max-draft`` default too.
LOOKUP_MAX_DRAFT = 48
TARGET_PLACEHOLDER = "<target>"  # SERVING.md's target where the recipe names none
EVAL_RECORD_NAME = "eval.json"  # what ``dflash-train eval --output-dir EXPORT_DIR`` writes there


def llama_cpp_drafter_args(spec_type: str, num_draft_tokens: int) -> list[str]:
    """llama-server's arguments for the drafter after ``-md``: its type, the full block, and
    ``--spec-draft-p-min 0`` so no block is cut at a low-probability position (the eval never cuts;
    llama.cpp's default has been 0.75 in earlier builds)."""
    return ["--spec-type", spec_type, "--spec-draft-n-max", str(num_draft_tokens), "--spec-draft-p-min", "0"]


def llama_cpp_lookup_args(key_size: int, max_draft: int) -> list[str]:
    """llama-server's ``ngram-simple`` sizes: the key of ``key_size`` tokens must recur, and a lookup
    round drafts at most ``max_draft`` tokens (the eval's ``--ngram-min-match`` / ``--ngram-max-draft``)."""
    return ["--spec-ngram-simple-size-n", str(key_size), "--spec-ngram-simple-size-m", str(max_draft)]


def llama_cpp_combined_args(
    spec_type: str, num_draft_tokens: int, key_size: int, max_draft: int
) -> list[str]:
    """``ngram-simple`` before the drafter in one ``--spec-type`` list (llama.cpp asks the draftless
    type first and the drafter only when lookup proposed nothing: docs/evaluation.md)."""
    drafter = llama_cpp_drafter_args(f"ngram-simple,{spec_type}", num_draft_tokens)
    return [*drafter, *llama_cpp_lookup_args(key_size, max_draft)]


def serving_flags(
    config: DFlashDraftConfig,
    export_dir: str | Path,
    target: str = TARGET_PLACEHOLDER,
    lookup: tuple[int, int] | None = None,
) -> dict[str, str]:
    """The launch commands of SGLang, vLLM and llama.cpp for this export: ``{"sglang": ..., "vllm":
    ..., "llama_cpp": ..., "llama_cpp_combined": ...}`` (llama.cpp: its converter, then llama-server
    with the drafter alone, or with ngram-simple first; docs/training.md). The export and a local
    target are named by absolute paths (``served_target``). ``lookup`` is ngram-simple's (key size,
    draft limit); default (``LOOKUP_KEY_SIZE``, ``LOOKUP_MAX_DRAFT``)."""
    draft_path = str(Path(export_dir).resolve())
    draft, target = shell_word(draft_path), shell_word(served_target(target))
    variant = get_variant(config.variant)
    drafts = config.num_draft_tokens
    key_size, max_draft = lookup or (LOOKUP_KEY_SIZE, LOOKUP_MAX_DRAFT)
    vllm_config = json.dumps(
        {"method": variant.vllm_method, "model": draft_path, "num_speculative_tokens": drafts}
    )
    vllm_env = "VLLM_USE_V2_MODEL_RUNNER=1 " if needs_vllm_v2_runner(config) else ""
    convert = (
        f"python convert_hf_to_gguf.py {draft} --target-model-dir {target} --outtype f32 --outfile draft.gguf"
    )
    server = "llama-server -m TARGET.gguf -md draft.gguf"
    alone = llama_cpp_drafter_args(variant.llama_cpp_spec_type, drafts)
    combined = llama_cpp_combined_args(variant.llama_cpp_spec_type, drafts, key_size, max_draft)
    return {
        "sglang": (
            f"python -m sglang.launch_server --model-path {target} "
            f"--speculative-algorithm {variant.sglang_algorithm} --speculative-draft-model-path {draft} "
            f"--speculative-num-draft-tokens {config.num_verify_tokens}"
        ),
        "vllm": f"{vllm_env}vllm serve {target} --speculative-config {shlex.quote(vllm_config)}",
        "llama_cpp": f"{convert} && {server} {' '.join(alone)} --jinja",
        "llama_cpp_combined": f"{server} {' '.join(combined)} --jinja",
    }


def served_target(target: str) -> str:
    """``target`` as the export's serving notes name it: an existing local directory by its absolute
    path (a relative one, such as ``target.path=../models/smol``, means nothing where SERVING.md is
    read, often on another machine); a hub id (``Qwen/Qwen3-8B``), a ``preset:``/``builtin:`` name
    or the placeholder as written. A relative path resolves against this process's directory, the
    one the writer (training, ``dflash-train eval``, ``dflash-train export``) runs in."""
    if target == TARGET_PLACEHOLDER or not Path(target).is_dir():
        return target
    return str(Path(target).resolve())


def shell_word(text: str) -> str:
    """``text`` as one shell word (a path with spaces or quotes); the target placeholder as it reads."""
    return text if text == TARGET_PLACEHOLDER else shlex.quote(text)


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


def measured_lookup(export_dir: str | Path) -> dict | None:
    """The eval's numbers for the choice between the drafter alone and ngram-simple first, from
    ``export_dir/eval.json`` as ``dflash-train eval --baseline ngram --output-dir`` writes it: ``{tau,
    ngram_tau, ngram_dflash_tau, num_prompts, lookup: (key size, draft limit), key_size_taus}``; None
    without them.

    With a key-size sweep (``ngram_dflash_key_sizes`` in the record) the lookup served is the key
    size whose ``ngram+dflash`` method measured the highest tau (the first listed on a tie), and
    ``ngram_dflash_tau`` is that method's tau: the flags SERVING.md writes are then always a
    configuration the eval measured, with its own number. The choice is made on the eval's prompts,
    so that number is the best of several measured on the same prompts (slightly optimistic for new
    ones); SERVING.md lists every key size's tau so the margin is visible. ``key_size_taus`` is key
    size -> tau, one entry without a sweep."""
    path = Path(export_dir) / EVAL_RECORD_NAME
    try:
        record = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return None  # not the eval's record: SERVING.md then says how to measure
    needed = ("tau", "ngram_dflash_tau", "ngram_min_match", "ngram_max_draft")
    if not isinstance(record, dict) or any(not isinstance(record.get(k), (int, float)) for k in needed):
        return None
    if record.get("draft_p_min"):
        return None  # blocks cut short (eval --draft-p-min): not what the flags, --spec-draft-p-min 0, serve
    key_size_taus = swept_lookup_taus(record)
    if key_size_taus is None:
        return None
    best = max(key_size_taus, key=key_size_taus.__getitem__)  # max keeps the first of equal taus
    return {
        "tau": record["tau"],
        "ngram_tau": record.get("ngram_tau"),
        "ngram_dflash_tau": key_size_taus[best],
        "num_prompts": record.get("num_prompts"),
        "lookup": (best, int(record["ngram_max_draft"])),
        "key_size_taus": key_size_taus,
    }


def swept_lookup_taus(record: dict) -> dict[int, float] | None:
    """Key size -> tau of every lookup-first method the eval record holds, in the eval's order:
    ``ngram_min_match`` alone without a sweep; with one, every method of ``ngram_dflash_key_sizes``
    (method name -> key size) read from ``methods``. None when the sweep is not readable."""
    first = {int(record["ngram_min_match"]): record["ngram_dflash_tau"]}
    names, methods = record.get("ngram_dflash_key_sizes"), record.get("methods")
    if names is None:
        return first
    if not isinstance(names, dict) or not isinstance(methods, dict):
        return None
    taus = {}
    for name, key_size in names.items():
        entry = methods.get(name)
        tau = entry.get("tau") if isinstance(entry, dict) else None
        if not isinstance(key_size, int) or not isinstance(tau, (int, float)):
            return None
        taus[key_size] = tau
    return taus


def lookup_advice(measured: dict | None, export_dir: str | Path, target: str) -> list[str]:
    """Whether to serve llama.cpp's lookup-first combination: the eval's numbers and the pick, or how
    to get them."""
    if measured is None:
        target, export = shell_word(served_target(target)), shell_word(str(export_dir))
        return [
            "Whether it beats the drafter alone depends on the prompts (lookup wins in repetition, the "
            "drafter elsewhere). Measure it on yours: `dflash-train eval --target "
            f"{target} --drafter {export} --prompts PROMPTS.jsonl --baseline ngram --tau-mode exact "
            f"--output-dir {export}` reports `ngram_dflash_tau` (this line, simulated by llama.cpp's "
            "rule) beside `tau` (the drafter alone) and rewrites this file with the numbers; "
            "`dflash-train serve-check` runs both in llama.cpp (engine tau and tokens/s)."
        ]
    tau, combined = measured["tau"], measured["ngram_dflash_tau"]
    ngram = measured["ngram_tau"]
    numbers = (
        f"The eval in eval.json ({measured['num_prompts']} prompts, exact mode): tau {tau:.3f} with the "
        f"drafter alone, {combined:.3f} with ngram-simple first"
        + sweep_note(measured)
        + ("" if ngram is None else f", {ngram:.3f} with the eval's n-gram lookup alone")
        + "."
    )
    if combined > tau:
        pick = f"Serve the combination: {combined / tau:.2f}x the drafter's tau."
    else:
        pick = "Serve the drafter alone: lookup first does not raise tau on these prompts."
    return [f"{numbers} {pick} tau is not tokens/s: `dflash-train serve-check` measures both in llama.cpp."]


def sweep_note(measured: dict) -> str:
    """After the combination's tau, where the eval swept the key size: which one the flags above
    use, and every key size's tau (empty without a sweep)."""
    taus = measured["key_size_taus"]
    if len(taus) < 2:
        return ""
    listed = ", ".join(f"{k}: {t:.3f}" for k, t in taus.items())
    return (
        f" (key size {measured['lookup'][0]}, the flags above: the best of the key sizes the eval "
        f"measured on these prompts, {listed})"
    )


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


def serving_notes(
    config: DFlashDraftConfig,
    export_dir: str | Path,
    target: str = TARGET_PLACEHOLDER,
    served_from: str | Path | None = None,
) -> str:
    """The text of ``SERVING.md``: block length, the engines' launch commands (``target`` as
    ``served_target`` names it), llama.cpp's lookup-first combination with the eval's numbers where
    ``export_dir/eval.json`` has them, and the applicable warnings. The commands name
    ``served_from``, the folder the export is served from once written (default ``export_dir``;
    ``export-best`` is written in a staging folder and renamed)."""
    measured = measured_lookup(export_dir)
    export_dir = export_dir if served_from is None else served_from
    flags = serving_flags(config, export_dir, target, None if measured is None else measured["lookup"])
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
        "",
        "llama.cpp with its prompt lookup first (llama-server asks `ngram-simple` each round and the "
        "drafter only when lookup proposed nothing; the eval's `ngram+dflash` simulates exactly this):",
        "",
        f"    {flags['llama_cpp_combined']}",
        "",
        *lookup_advice(measured, Path(export_dir).resolve(), target),
    ]
    warnings = serving_warnings(config)
    if warnings:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in warnings]
    return "\n".join(lines) + "\n"


def write_serving_notes(
    config: DFlashDraftConfig, export_dir: str | Path, target: str = TARGET_PLACEHOLDER
) -> str:
    """Write ``export_dir/SERVING.md`` and return its text."""
    text = serving_notes(config, export_dir, target)
    (Path(export_dir) / SERVING_NOTES_NAME).write_text(text)
    return text
