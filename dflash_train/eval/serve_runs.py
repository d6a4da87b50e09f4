"""The llama-server runs of ``serve-check``: which configurations, with which flags, and running them.

Per prompt set: the target alone (``plain``); the drafter, named by its variant's ``--spec-type``
(``draft-dflash``, or ``draft-dspark`` for a DSpark export); each n-gram type alone; and each n-gram
type first with the drafter after it (``ngram-simple+draft-dflash``: one ``--spec-type`` list, where llama.cpp
asks the n-gram type first and the drafter only when lookup proposed nothing). The drafter's flags
and the ngram-simple sizes come from ``models/serving.py``, so SERVING.md prints what is run here;
``ngram-simple`` runs with the key size and draft limit the exact eval's ``ngram+dflash`` simulates.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_train.eval import llama_cpp
from dflash_train.eval.serve_prompts import ServePrompt
from dflash_train.models.serving import llama_cpp_drafter_args, llama_cpp_lookup_args


def combined_run(ngram_type: str, spec_type: str) -> str:
    """The name of the run with ``ngram_type`` first and the drafter after it: "ngram-simple+draft-dflash"."""
    return f"{ngram_type}+{spec_type}"


def engine_configurations(
    spec_type: str,
    draft_gguf: Path,
    num_draft_tokens: int,
    ngram_types: Sequence[str],
    lookup: tuple[int, int],
) -> dict[str, list[str]]:
    """Run name -> llama-server's speculative arguments; ``lookup`` is ngram-simple's (key size,
    draft limit)."""
    drafter = ["-md", str(draft_gguf)]

    def sizes(ngram_type: str) -> list[str]:
        return llama_cpp_lookup_args(*lookup) if ngram_type == "ngram-simple" else []

    alone = {t: ["--spec-type", t, *sizes(t)] for t in ngram_types}
    combined = {
        combined_run(t, spec_type): [
            *drafter,
            *llama_cpp_drafter_args(f"{t},{spec_type}", num_draft_tokens),
            *sizes(t),
        ]
        for t in ngram_types
    }
    return {
        "plain": [],
        spec_type: [*drafter, *llama_cpp_drafter_args(spec_type, num_draft_tokens)],
        **alone,
        **combined,
    }


def engine_runs(
    options, server: Path, target_gguf: Path, configurations: dict[str, list[str]],
    prompts: Sequence[ServePrompt], workdir: Path, record,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per configuration its completions, recorded (``record.add_run``) as the run finishes; the
    plain run also reads the engine's prompt tokens."""
    common = ["-m", str(target_gguf), "--jinja", "--ctx-size", str(options.ctx_size)]
    common += ["--threads", str(options.threads), "--parallel", "1"]
    runs = {}
    for name, extra in configurations.items():
        print(f"serve-check: llama-server {name} on {len(prompts)} prompts", file=sys.stderr)
        log = workdir / f"llama-server-{name}.log"
        with llama_cpp.LlamaServer(server, [*common, *extra], log, options.startup_timeout_s) as running:
            completions = [
                llama_cpp.chat_completion(
                    running, p.messages, options.max_new_tokens, options.request_timeout_s
                )
                for p in prompts
            ]
            tokens = (
                [llama_cpp.prompt_token_ids(running, p.messages, options.request_timeout_s) for p in prompts]
                if name == "plain"
                else None
            )
        runs[name] = {
            "completions": completions,
            "prompt_tokens": tokens,
            "command": running.command,
            "log": log,
        }
        record.add_run(name, runs[name])
    return runs
