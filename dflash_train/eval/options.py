"""``EvalOptions``: everything ``dflash-train eval`` takes, typed and validated (the CLI builds it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dflash_train.data.readers import repeated_paths
from dflash_train.eval.ngram_simple import LOOKUP_ALONE_METHOD, combined_methods
from dflash_train.models.serving import LOOKUP_KEY_SIZE, LOOKUP_MAX_DRAFT

TAU_MODES = ("auto", "exact", "decode")
DECODE_ENGINES = ("auto", "static", "dynamic")  # eval/engines.py
DTYPE_NAMES = ("auto", "bfloat16", "float32")
THINKING = {"on": True, "off": False, "default": None}


@dataclass(kw_only=True)
class EvalOptions:
    """Options of one evaluation run, field by field."""

    # Target checkpoint directory, hub id, builtin:<name> or preset:<name> (random weights).
    target: str
    # Exported drafter directory, or a training checkpoint / run directory.
    drafter: str
    # JSONL prompt files; each gets its own table, plus an overall row.
    prompts: list[str] = field(default_factory=list)
    # New tokens per request (the greedy continuation's length cap).
    max_new_tokens: int = 256
    # 0 = greedy (exact mode available); > 0 = speculative rejection sampling (decode mode only).
    temperature: float = 0.0
    # Use only the first N usable prompts of each file (0 = all).
    num_prompts: int = 0
    # Chat template thinking switch: on, off or the template's default.
    thinking: str = "default"
    # "ngram" adds prompt-lookup drafting as a baseline (exact mode: also ``ngram-overlap`` and
    # ``ngram+dflash``, see ``exact_methods``); "none" does not.
    baseline: str = "none"
    # n of the n-gram baseline (and of the loop test of the exact-mode diagnosis).
    ngram_n: int = 3
    # Exact mode with --baseline ngram also reports ``ngram+dflash``, by llama.cpp's rule for
    # ``--spec-type ngram-simple,draft-dflash`` (docs/evaluation.md): a round drafts by prompt lookup
    # when the last this-many tokens occurred earlier (``--spec-ngram-simple-size-n``), else with the
    # drafter. The first key size is ``ngram+dflash``; each further K adds ``ngram+dflash@K``, the
    # same simulation with key size K (one eval, the drafts computed once: ``--ngram-min-match 3,4,6``).
    ngram_min_match: tuple[int, ...] = (LOOKUP_KEY_SIZE,)
    # ... and copies at most this many tokens per lookup round (``--spec-ngram-simple-size-m``;
    # default llama.cpp's 48); 0 = the drafter's B-1.
    ngram_max_draft: int = LOOKUP_MAX_DRAFT
    # Exact mode with --baseline ngram: also report ``ngram-simple``, llama.cpp's lookup alone
    # (``--spec-type ngram-simple``) with the first key size and the draft limit above: the baseline
    # that ``ngram+dflash`` is measured against when the limit is not the eval's own lookup's B-1.
    ngram_simple: bool = False
    # Tree drafting (DDTree) with this many nodes; 0 = chain only.
    ddtree_budget: int = 0
    # Candidates per draft position when growing the DDTree.
    ddtree_topk: int = 8
    # llama.cpp's --spec-draft-p-min: a DSpark drafter stops its block at the first slot whose
    # confidence head scores below it, as the engine does; 0 = full blocks (the engines' default).
    draft_p_min: float = 0.0
    # exact: batched greedy continuation + one feature pass + one drafter pass, simulated rounds;
    # decode: real round-by-round decoding of every prompt; auto: exact at T = 0, decode otherwise.
    tau_mode: str = "auto"
    # Exact mode: also decode the first N prompts of each file for real (lossless check, tokens/s).
    decode_prompts: int = 0
    # Real decoding engine: static = static KV cache + CUDA graphs on GPU (pure-attention targets;
    # tokens/s as a serving engine sees them), dynamic = HF dynamic cache (every target, slow on GPU),
    # auto = static where the target supports it, else dynamic (printed and in the report).
    decode_engine: str = "auto"
    # Exact mode's greedy continuations (generate/engine.py): slots, padded, or auto (slots where the
    # target supports it).
    generation_engine: str = "auto"
    # Target and drafter dtype; auto = bfloat16 on GPU, float32 on CPU.
    dtype: str = "auto"
    # Prompts per batched greedy generation; 0 = 32 on GPU, 8 on CPU.
    batch_size: int = 0
    # Block tokens (anchors x block size, summed over rows) per feature + drafter pass.
    drafter_batch_tokens: int = 65536
    # Bad prompt rows skipped (and counted) before the run stops with file:line.
    max_bad_rows: int = 0
    # Where to write eval.json and acceptance.png (nothing is written when empty).
    output_dir: str = ""
    # tqdm progress bars on stderr.
    progress: bool = True
    # Run a GPU GatedDeltaNet target on the slow PyTorch kernels instead of refusing.
    allow_slow_kernels: bool = False
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("no prompt files: give --prompts FILE [FILE ...]")
        repeated = repeated_paths(self.prompts)
        if repeated:
            raise ValueError(
                f"--prompts names {self.prompts[repeated[0]]} twice: list each file once (its prompts "
                "would count twice overall)"
            )
        if self.tau_mode not in TAU_MODES:
            raise ValueError(f"tau_mode={self.tau_mode!r}: use one of {list(TAU_MODES)}")
        if self.tau_mode == "exact" and self.temperature > 0:
            raise ValueError(
                "--tau-mode exact needs --temperature 0 (sampled outputs are not the greedy continuation); "
                "use --tau-mode decode for T > 0"
            )
        if self.decode_engine not in DECODE_ENGINES:
            raise ValueError(f"decode_engine={self.decode_engine!r}: use one of {list(DECODE_ENGINES)}")
        if self.generation_engine not in ("auto", "slots", "padded"):
            raise ValueError(f"generation_engine={self.generation_engine!r}: use auto, slots or padded")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {list(DTYPE_NAMES)}")
        if self.thinking not in THINKING:
            raise ValueError(f"thinking={self.thinking!r}: use one of {list(THINKING)}")
        if self.baseline not in ("none", "ngram"):
            raise ValueError(f"baseline={self.baseline!r}: use 'none' or 'ngram'")
        for name in ("max_new_tokens", "ngram_n", "ddtree_topk", "drafter_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: use >= 1")
        non_negative = ("num_prompts", "ddtree_budget", "decode_prompts", "batch_size", "max_bad_rows")
        for name in (*non_negative, "ngram_max_draft"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: use >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: use >= 0")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"draft_p_min={self.draft_p_min}: use a probability in [0, 1] (0 = full blocks)")
        if self.ddtree_budget > 0 and self.temperature > 0:
            raise ValueError("DDTree is greedy only: use --temperature 0 with --ddtree-budget")
        self._check_key_sizes()
        if self.ngram_simple and (self.baseline != "ngram" or self.resolved_tau_mode != "exact"):
            raise ValueError(
                "--ngram-simple reports llama.cpp's ngram-simple lookup beside ngram+dflash, which only "
                "exact mode with --baseline ngram runs: add --baseline ngram (at --temperature 0), or drop it"
            )

    def _check_key_sizes(self) -> None:
        """``ngram_min_match``: a non-empty tuple of distinct ints >= 1; several only where
        ``ngram+dflash`` runs (elsewhere the sweep would be dropped without a word)."""
        sizes = self.ngram_min_match
        if not isinstance(sizes, tuple) or not sizes or any(type(k) is not int for k in sizes):
            raise TypeError(
                f"ngram_min_match={sizes!r}: give a non-empty tuple of ints, e.g. (3,) or (3, 4, 6, 8) "
                "(--ngram-min-match 3 or 3,4,6,8)"
            )
        for size in sizes:
            if size < 1:
                raise ValueError(
                    f"ngram_min_match={size}: use >= 1 for every key size (--ngram-min-match 3,4,6)"
                )
        repeated = sorted({k for k in sizes if sizes.count(k) > 1})
        if repeated:
            raise ValueError(
                f"--ngram-min-match {format_key_sizes(sizes)} gives key size {format_key_sizes(repeated)} more "
                "than once: list each key size once"
            )
        if len(sizes) > 1 and (self.baseline != "ngram" or self.resolved_tau_mode != "exact"):
            raise ValueError(
                f"--ngram-min-match {format_key_sizes(sizes)} sweeps the key size of ngram+dflash, which "
                "only exact mode with --baseline ngram reports: add --baseline ngram (at --temperature 0, "
                "--tau-mode exact or auto), or give one key size"
            )

    @property
    def resolved_tau_mode(self) -> str:
        """``exact`` or ``decode``."""
        if self.tau_mode == "auto":
            return "exact" if self.temperature <= 0 else "decode"
        return self.tau_mode

    @property
    def methods(self) -> list[str]:
        """The drafting methods to evaluate, DFlash chain first."""
        return (
            ["dflash"]
            + (["ngram"] if self.baseline == "ngram" else [])
            + (["ddtree"] if self.ddtree_budget > 0 else [])
        )

    @property
    def exact_methods(self) -> list[str]:
        """The methods exact mode simulates: ``methods`` plus, beside the n-gram baseline,
        ``ngram-overlap`` (the same lookup with its copy continued past the end of the text instead
        of padded: the stronger free lookup), ``ngram+dflash`` (prompt lookup first, the drafter
        otherwise) and the further key sizes' ``ngram+dflash@K``. Exact mode only: no real decoding
        of them."""
        if self.baseline != "ngram":
            return self.methods
        at = self.methods.index("ngram") + 1
        lookups = ["ngram-overlap", *([LOOKUP_ALONE_METHOD] if self.ngram_simple else [])]
        return [*self.methods[:at], *lookups, *self.combined_key_sizes, *self.methods[at:]]

    @property
    def combined_key_sizes(self) -> dict[str, int]:
        """The lookup-first methods, name -> ngram-simple key size (``ngram_simple.combined_methods``)."""
        return combined_methods(self.ngram_min_match)

    @property
    def thinking_flag(self) -> bool | None:
        return THINKING[self.thinking]


def parse_key_sizes(text: str) -> tuple[int, ...]:
    """``--ngram-min-match``'s value, one key size or a comma-separated list ("3" or "3,4,6,8")."""
    parts = [part.strip() for part in text.split(",")]
    if not all(re.fullmatch(r"-?[0-9]+", part) for part in parts):
        raise ValueError(
            f"--ngram-min-match {text!r}: give integer key sizes separated by commas, e.g. "
            "--ngram-min-match 3 or --ngram-min-match 3,4,6,8"
        )
    return tuple(int(part) for part in parts)


def format_key_sizes(sizes) -> str:
    """Key sizes as ``--ngram-min-match`` takes them: "3,4,6"."""
    return ",".join(str(k) for k in sizes)
