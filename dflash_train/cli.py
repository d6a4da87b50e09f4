"""The ``dflash-train`` command line: train, demo, eval, bench, plot, regen, synth, export,
data-stats, serve-check.

Each subcommand's work lives in its own module and is imported only when that subcommand runs, so
``--help`` is instant. With ``--json`` the last line of stdout is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any


def emit_result(result: dict[str, Any], as_json: bool) -> None:
    """Print a command's result: a readable summary, or one JSON object as the last stdout line."""
    if as_json:
        print(json.dumps(result, sort_keys=False, default=str), flush=True)
    else:
        width = max((len(k) for k in result), default=0)
        for key, value in result.items():
            print(f"{key:<{width}}  {value}")


def options_from_args(options_class: type, args: argparse.Namespace) -> Any:
    """An options dataclass from the parsed arguments of the same names (``--seq-len`` -> seq_len).

    Every field must have an argument: a field the parser lacks is a bug, not a silent default.
    """
    names = [f.name for f in dataclasses.fields(options_class)]
    missing = [name for name in names if not hasattr(args, name)]
    if missing:
        raise TypeError(f"{options_class.__name__} fields without a command-line argument: {missing}")
    return options_class(**{name: getattr(args, name) for name in names})


def cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.train.trainer import run_training

    return run_training(args.recipe, args.overrides)


def cmd_demo(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.demo.pipeline import run_demo

    return run_demo(quick=args.quick, workdir=args.workdir)


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.eval.command import run_eval
    from dflash_train.eval.options import EvalOptions, parse_key_sizes

    options = EvalOptions(
        target=args.target,
        drafter=args.drafter,
        prompts=list(args.prompts),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        num_prompts=args.num_prompts,
        thinking=args.thinking,
        baseline=args.baseline,
        ngram_n=args.ngram_n,
        ngram_min_match=parse_key_sizes(args.ngram_min_match),
        ngram_max_draft=args.ngram_max_draft,
        ngram_simple=args.ngram_simple,
        ddtree_budget=args.ddtree_budget,
        ddtree_topk=args.ddtree_topk,
        draft_p_min=args.draft_p_min,
        tau_mode=args.tau_mode,
        decode_prompts=args.decode_prompts,
        decode_engine=args.decode_engine,
        generation_engine=args.generation_engine,
        dtype=args.dtype,
        batch_size=args.batch_size,
        drafter_batch_tokens=args.drafter_batch_tokens,
        max_bad_rows=args.max_bad_rows,
        output_dir=args.output_dir,
        progress=not args.no_progress,
        allow_slow_kernels=args.allow_slow_kernels,
        device=args.device,
        seed=args.seed,
    )
    return run_eval(options)


def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.bench.modes import MODES
    from dflash_train.bench.progress import StepTimeout

    mode = MODES[args.bench_mode]
    try:
        return mode.run(options_from_args(mode.Options, args))
    except StepTimeout as err:  # the limit is a setting: exit 1 with one line, as for a refused one
        raise ValueError(f"{err} (raise it, or 0 for no limit)") from err


def cmd_plot(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.eval.plots import redraw_acceptance
    from dflash_train.train.plots import redraw_curves

    drawn: dict[str, Any] = {}
    for directory in args.directories:
        files = [path for path in (redraw_curves(directory), redraw_acceptance(directory)) if path]
        if not files:
            raise ValueError(
                f"{directory}: no metrics.jsonl (a training run) nor eval.json (eval --output-dir)"
            )
        drawn[directory] = files
    return drawn


def cmd_regen(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.data.regen import options_from_args, run_regen

    return run_regen(options_from_args(args))


def cmd_synth(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.data.synth import options_from_args, run_synth

    return run_synth(options_from_args(args))


def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.models.export import export_checkpoint

    return export_checkpoint(args.checkpoint, args.output, dtype=args.dtype)


def cmd_data_stats(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.data.stats import run_data_stats

    return run_data_stats(args.recipe, args.overrides)


def cmd_serve_check(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_train.eval.serve_check import ServeCheckOptions, run_serve_check

    return run_serve_check(options_from_args(ServeCheckOptions, args))


class CommandParser(argparse.ArgumentParser):
    """The top-level parser: ``bench``'s modes are added only when ``bench`` runs (mode modules import
    torch, which would make every ``--help`` slow), and ``bench`` without a mode is ``bench train``
    (the commands of earlier versions, ``dflash-train bench --preset ...``)."""

    bench_parser: argparse.ArgumentParser | None = None

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if self.bench_parser is not None and args[:1] == ["bench"]:
            from dflash_train.bench.modes import add_mode_parsers, with_default_mode

            if self.bench_parser._subparsers is None:  # not yet added
                add_mode_parsers(self.bench_parser)
            args = with_default_mode(args)
        return super().parse_known_args(args, namespace)


def add_decode_step_args(p: argparse.ArgumentParser) -> None:
    """regen's and synth's choices of the in-process slot engine's decode step."""
    p.add_argument(
        "--compile-decode",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.compile the in-process decode step (auto: on for attention-only targets on CUDA)",
    )
    p.add_argument(
        "--decode-attention",
        choices=["auto", "flex", "grouped"],
        default="auto",
        help="the in-process decode step's attention (auto: flex on CUDA for attention-only targets, else grouped)",
    )


def build_parser() -> argparse.ArgumentParser:
    from dflash_train.models.serving import LOOKUP_KEY_SIZE, LOOKUP_MAX_DRAFT  # light: no torch

    parser = CommandParser(
        prog="dflash-train",
        description="Train DFlash block-diffusion draft models against a frozen target LLM.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: Callable, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "--json", action="store_true", help="make the last stdout line one JSON object with the results"
        )
        p.set_defaults(handler=handler)
        return p

    p = add("train", cmd_train, "Train a drafter from a recipe (single process or under torchrun).")
    p.add_argument(
        "recipe", help="recipe YAML file or packaged recipe name (qwen3.6-27b, qwen3-8b, tiny-cpu)"
    )
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 data.paths=[chat.jsonl]"
    )

    p = add(
        "demo",
        cmd_demo,
        "Build the embedded tiny target, then regenerate, train, export and evaluate on CPU.",
    )
    p.add_argument("--quick", action="store_true", help="a short smoke version (used by the tests)")
    p.add_argument(
        "--workdir", default="runs/demo", help="where the demo writes its target, data, run and export"
    )

    p = add("eval", cmd_eval, "Speculative decoding with target + drafter: tau, lossless check, tokens/s.")
    p.add_argument("--target", required=True, help="target checkpoint directory or hub id")
    p.add_argument("--drafter", required=True, help="exported drafter directory or training checkpoint")
    p.add_argument(
        "--prompts",
        required=True,
        nargs="+",
        help="JSONL files of chat rows (messages / ShareGPT) or {'prompt': ...} rows; one table each",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--num-prompts", type=int, default=0, help="use only the first N prompts of each file (0 = all)"
    )
    p.add_argument("--thinking", choices=["on", "off", "default"], default="default")
    p.add_argument(
        "--baseline",
        choices=["none", "ngram"],
        default="none",
        help="ngram: also report prompt lookup (the method ngram; in exact mode also ngram-overlap, its "
        "copy continued past the text's end, and ngram+dflash)",
    )
    p.add_argument("--ngram-n", type=int, default=3)
    p.add_argument(
        "--ngram-min-match",
        default=str(LOOKUP_KEY_SIZE),
        help="exact mode, ngram+dflash (llama.cpp's ngram-simple rule): draft by prompt lookup when the "
        "last M tokens occurred earlier (--spec-ngram-simple-size-n M); a comma list (3,4,6,8) sweeps "
        "it in one run, each further key size K as the method ngram+dflash@K",
    )
    p.add_argument(
        "--ngram-max-draft",
        type=int,
        default=LOOKUP_MAX_DRAFT,
        help="exact mode, ngram+dflash: copy at most N tokens per lookup round "
        f"(--spec-ngram-simple-size-m N; default {LOOKUP_MAX_DRAFT}, llama.cpp's); 0 = the drafter's B-1",
    )
    p.add_argument(
        "--ngram-simple",
        action="store_true",
        help="exact mode with --baseline ngram: also report the method ngram-simple, ngram+dflash's "
        "lookup alone (llama.cpp --spec-type ngram-simple, the first key size, the same draft limit)",
    )
    p.add_argument(
        "--ddtree-budget", type=int, default=0, help="tree drafting with this many nodes (0 = chain)"
    )
    p.add_argument("--ddtree-topk", type=int, default=8, help="candidates per draft position in the tree")
    p.add_argument(
        "--draft-p-min",
        type=float,
        default=0.0,
        help="llama.cpp's --spec-draft-p-min: a DSpark drafter stops its block at the first slot whose "
        "confidence is below it (0 = full blocks, the engines' default)",
    )
    p.add_argument(
        "--tau-mode",
        choices=["auto", "exact", "decode"],
        default="auto",
        help="exact: batched greedy continuation + simulated rounds (auto at T=0); decode: real decoding",
    )
    p.add_argument(
        "--decode-prompts",
        type=int,
        default=0,
        help="exact mode: also decode the first N prompts of each file (lossless check, tokens/s)",
    )
    p.add_argument(
        "--decode-engine",
        choices=["auto", "static", "dynamic"],
        default="auto",
        help="real decoding: static KV cache + CUDA graphs (pure-attention targets), dynamic HF cache "
        "(any target), auto = static where supported",
    )
    p.add_argument(
        "--generation-engine",
        choices=["auto", "slots", "padded"],
        default="auto",
        help="exact mode's greedy continuations: slots (refilled slots, preallocated cache, CUDA-graphed "
        "decode), padded (one padded batch at a time), auto = slots where the target supports it",
    )
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    p.add_argument(
        "--batch-size", type=int, default=0, help="prompts per batched generation (0 = 32 on GPU, 8 on CPU)"
    )
    p.add_argument(
        "--drafter-batch-tokens",
        type=int,
        default=65536,
        help="exact mode: block tokens (anchors x block size) per feature + drafter pass",
    )
    p.add_argument("--max-bad-rows", type=int, default=0, help="skip up to N bad prompt rows")
    p.add_argument("--output-dir", default="", help="write eval.json and acceptance.png here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.add_argument(
        "--allow-slow-kernels",
        action="store_true",
        help="run a GPU GatedDeltaNet target on the PyTorch fallback kernels instead of refusing",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)

    # The modes (bench/modes.py) are added when ``bench`` runs: they import torch (CommandParser).
    parser.bench_parser = add(
        "bench",
        cmd_bench,
        "Measure the product: train step (the default mode), lengths, eval, checkpoint, decode. "
        "`dflash-train bench MODE --help` lists a mode's options.",
    )

    p = add(
        "plot", cmd_plot, "Redraw curves.png (metrics.jsonl) and acceptance.png (eval.json) of a directory."
    )
    p.add_argument(
        "directories", nargs="+", metavar="DIR", help="a training run directory or an eval --output-dir"
    )

    p = add("regen", cmd_regen, "Regenerate the assistant turns of a chat dataset with the target.")
    p.add_argument("--target", required=True, help="target checkpoint directory or hub id")
    p.add_argument(
        "--data", required=True, nargs="+", help="input chat data (JSONL, directory, or datasets-readable)"
    )
    p.add_argument("--output", required=True, help="output JSONL (appended; rows already done are skipped)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--thinking", choices=["on", "off", "default"], default="default")
    p.add_argument("--max-rows", type=int, default=0, help="stop after this many input rows (0 = all)")
    p.add_argument("--max-bad-rows", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    p.add_argument("--engine", choices=["auto", "vllm", "transformers", "endpoint"], default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    add_decode_step_args(p)
    p.add_argument("--endpoint", default="", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="", help="model name on the server (default: the one it serves)")
    p.add_argument("--api-key-env", default="", help="environment variable holding the server's API key")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight with --endpoint")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="with --endpoint: per network step (connect, each read)",
    )
    p.add_argument("--retries", type=int, default=4, help="per request with --endpoint (exponential backoff)")

    p = add("synth", cmd_synth, "Synthesize user prompts with the target's own chat template (Magpie).")
    p.add_argument("--target", required=True, help="target checkpoint directory or hub id")
    p.add_argument("--output", required=True, help="output JSONL (resumed when it exists)")
    p.add_argument("--num-rows", type=int, required=True, help="rows to keep after the filters")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.99)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--turns", type=int, default=1, help="user turns per row (greedy replies between)")
    p.add_argument("--max-reply-tokens", type=int, default=512, help="limit of the replies between turns")
    p.add_argument(
        "--stop-loops",
        action="store_true",
        help="end a generated turn once it repeats one block of tokens and drop its sample (counted as "
        "looped / reply_looped) instead of generating it to its token limit (greedy loops of small targets)",
    )
    p.add_argument("--system", default="", help="system prompt rendered before the user turn")
    p.add_argument("--thinking", choices=["on", "off", "default"], default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64, help="rows per generation batch (256-512 on a GPU)")
    p.add_argument("--device", default="auto")
    add_decode_step_args(p)
    p.add_argument("--min-prompt-chars", type=int, default=10)
    p.add_argument(
        "--near-dup-threshold", type=float, default=0.8, help="character 5-gram Jaccard similarity"
    )
    p.add_argument(
        "--max-samples", type=int, default=0, help="give up after this many samples (0 = 20 per row)"
    )
    p.add_argument(
        "--task-file",
        default="",
        help="YAML/JSON/JSONL tasks (name, share, system, seeds, turns) the prompts are steered to, or a "
        "packaged name (chat-tasks); docs/data.md 'Steering synth to tasks'",
    )
    p.add_argument(
        "--heldout-per-task", type=int, default=0, help="hold out each task's first N prompts (own file)"
    )
    p.add_argument("--heldout-dir", default="", help="held-out files <task>.jsonl (default: OUTPUT.heldout/)")

    p = add(
        "export",
        cmd_export,
        "Write a training checkpoint in the serving layout (config.json + model.safetensors).",
    )
    p.add_argument(
        "checkpoint", help="a checkpoint directory (step-*) or a run directory (newest checkpoint)"
    )
    p.add_argument("output", help="output directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])

    p = add(
        "data-stats",
        cmd_data_stats,
        "Rows, tokens, length buckets, padding waste and skips of a recipe's data.",
    )
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")

    p = add(
        "serve-check",
        cmd_serve_check,
        "Decode the export with llama.cpp's DFlash speculative decoding; engine tau next to the exact eval's.",
    )
    p.add_argument(
        "--target", required=True, help="target GGUF file, or an HF directory (converted to f32 GGUF)"
    )
    p.add_argument(
        "--target-hf", default="", help="HF directory of the same weights (exact eval; default: --target)"
    )
    p.add_argument("--drafter", required=True, help="exported drafter directory or training checkpoint")
    p.add_argument(
        "--prompts", required=True, nargs="+", help="JSONL prompt files (chat rows or {'prompt': ...})"
    )
    p.add_argument("--num-prompts", type=int, default=8, help="the first N prompts of each file")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--ngram-types",
        nargs="*",
        default=["ngram-simple", "ngram-mod"],
        help="llama.cpp n-gram types to run too, alone and before the drafter",
    )
    p.add_argument(
        "--ngram-min-match",
        type=int,
        default=LOOKUP_KEY_SIZE,
        help="ngram-simple's key size in the engine (--spec-ngram-simple-size-n) and in the eval's ngram+dflash",
    )
    p.add_argument(
        "--ngram-max-draft",
        type=int,
        default=LOOKUP_MAX_DRAFT,
        help=f"ngram-simple's draft limit (--spec-ngram-simple-size-m) in both (default {LOOKUP_MAX_DRAFT}, "
        "llama.cpp's); 0 = the drafter's B-1",
    )
    p.add_argument(
        "--llama-server", default="", help="llama-server binary (default: $DFLASH_LLAMA_SERVER, PATH)"
    )
    p.add_argument(
        "--llama-convert", default="", help="llama.cpp's convert_hf_to_gguf.py ($DFLASH_LLAMA_CONVERT)"
    )
    p.add_argument("--workdir", default="", help="keep the GGUF files, server logs and serve_check.json here")
    p.add_argument("--threads", type=int, default=2, help="llama-server --threads")
    p.add_argument("--ctx-size", type=int, default=4096, help="llama-server --ctx-size")
    p.add_argument(
        "--startup-timeout-s", type=float, default=300.0, help="until llama-server's /health answers"
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="per network step of a request to llama-server; no answer within it ends the run",
    )
    p.add_argument("--device", default="cpu", help="device of the exact eval (fp32)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the subcommand and print its result; a ValueError (or NotImplementedError,
    a refused combination of settings) exits 1 with its message.

    Any other exception, an ImportError included, propagates with its traceback: it is a bug or a
    broken install, not a user error.
    """
    from dflash_train.demo.builtin_targets import register

    args = build_parser().parse_args(argv)
    register()  # builtin:<name> target paths resolve in every subcommand
    try:
        result = args.handler(args)
    except (ValueError, NotImplementedError) as err:  # a refused setting is a user error too
        print(f"dflash-train {args.command}: error: {err}", file=sys.stderr)
        return 1
    if result is not None:
        emit_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
