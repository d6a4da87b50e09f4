"""Acceptance measured during training: exact greedy tau of the current drafter on held-out prompts.

``eval.prompts`` (JSONL files) are read once at the start; the frozen target's greedy continuations
are generated once too (the target never changes) and reused at every evaluation. Every
``eval.every_steps`` steps and at the last step the drafter's exact-mode tau (``eval/exact.py``:
one batched feature pass, one batched drafter pass, a host simulation of the rounds) is logged as
``eval_tau`` (all files) and ``eval_tau/<file stem>``, with ``eval_acc_by_pos`` and the cost
``time_eval_s``; the n-gram baseline (``eval_ngram_tau``, and ``eval_ngram_overlap_tau``: its copy
continued past the text's end) is logged once, with the first evaluation.
The diagnosis of the same drafts (``eval/diagnosis.py``) is logged beside: the training metric over
every anchor (``eval_random_anchor_tau``), tau inside / outside repetition loops and the accuracy
after a rejected round; with ``eval.ngram`` also ``eval_ngram_dflash_tau`` (prompt lookup first,
the drafter otherwise, lookup when a suffix of ``eval.ngram_n`` tokens recurs).
The drafter with the best ``eval_tau`` so far (or ``eval_tau/<eval.best_by>``, one file's) is written
to ``output_dir/export-best``. A process that stops on an evaluation step (a sitting's end, SIGTERM)
saves without evaluating; its checkpoint owes the evaluation and the next process runs it first, on
the same weights, so no evaluation of the run is lost.

Ranks. The prompts are sharded over the run's ranks (prompt i on rank i % world). Each rank
evaluates its shard with a plain, uncompiled copy of the drafter in the training dtype (what the
export holds): under DDP the copy is filled from the rank's own replica, under FSDP2 from the full
state that every rank gathers together (a rank that fails inside that gather stops at once with its
own error: it cannot vote while the others are still in the gather). Nothing in the evaluation after
it is a collective, so ranks with more or fewer prompts cannot mismatch; all ranks then meet to
learn whether every rank's evaluation
(and, at the start, its continuations) succeeded: a failure on one (out of memory) stops every rank
with that rank's error. The per-prompt results are then all-gathered, every rank computes the same
metrics and the same best-so-far decision, rank 0 writes ``export-best`` and all ranks meet to
learn whether it was written (a failure stops every rank with rank 0's error).

The training run is left as it was: the copy is built inside a forked RNG (CPU, CUDA and Python
``random``), so the losses after an evaluation are those of a run without it and resume stays
bit-exact; the training module's mode, parameters and compiled graphs are never touched.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_train.eval.diagnosis import BlockStats, summarize_diagnosis
from dflash_train.eval.speculative import Generation
from dflash_train.eval.summary import summarize_rounds
from dflash_train.models.serving import LOOKUP_MAX_DRAFT
from dflash_train.train.faults import any_rank_error, raise_if_any_rank_failed
from dflash_train.train.logging import log_main
from dflash_train.train.parallel import unwrap, uses_fsdp
from dflash_train.train.sitting import continue_advice

BEST_DIR = "export-best"
BEST_RECORD = "eval.json"


@dataclass
class HeldoutEval:
    """The held-out prompts of this rank, their greedy continuations and the best tau so far."""

    names: list[str]  # one per prompt file (its stem): the per-file metric suffix
    indices: list[int]  # global index of each local prompt
    file_of: list[int]  # file of each local prompt
    prompts: list[list[int]]
    continuations: list[list[int]]
    eos_token_ids: set[int]
    pad_token_id: int
    best_tau: float = -math.inf
    pending: dict[str, Any] = field(default_factory=dict)  # logged with the next evaluation (once)

    def due(self, run) -> bool:
        """Evaluate every ``eval.every_steps`` steps and at the last step. A process that stops on such
        a step (a sitting's end, SIGTERM) saves first and leaves the evaluation to the next process,
        which runs it before its first step (``train/colocated.py``)."""
        every = run.cfg.eval.every_steps
        return run.step == run.total_steps or (every > 0 and run.step % every == 0)


def build_heldout_eval(run) -> HeldoutEval | None:
    """Read ``eval.prompts`` and generate the target's greedy continuations once (this rank's shard);
    None when ``eval.prompts`` is empty. Every rank must call it."""
    cfg = run.cfg.eval
    if not cfg.prompts:
        return None
    from dflash_train.eval.generate import greedy_continuations, pad_token_for
    from dflash_train.eval.prompts import BadPromptRows, load_prompt_file, target_context
    from dflash_train.eval.runner import default_eos_ids

    check_prompt_files(run, [path for path in cfg.prompts if not Path(path).is_file()])
    started = time.perf_counter()
    target, tokenizer = run.target, run.target.tokenizer
    bad_rows = BadPromptRows(0)
    files = [
        load_prompt_file(
            path,
            tokenizer,
            thinking=run.cfg.data.thinking,
            num_prompts=cfg.num_prompts,
            bad_rows=bad_rows,
            context=target_context(target.model, cfg.max_new_tokens),
        )  # fmt: skip
        for path in cfg.prompts
    ]
    every = [(f, p) for f, loaded in enumerate(files) for p in loaded.prompts]
    rank, world = group_rank_and_size(run)
    mine = list(range(rank, len(every), world))
    eos = default_eos_ids(target.model, tokenizer)
    pad = pad_token_for(tokenizer, eos)
    prompts = [every[i][1] for i in mine]
    batch_size = cfg.batch_size or (32 if run.info.device.type == "cuda" else 8)
    continuations, error = [], None
    with untouched_training_state(run.info.device):
        try:
            continuations = greedy_continuations(
                target.model, prompts, max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos,
                pad_token_id=pad, batch_size=batch_size,
            )  # fmt: skip
        except Exception as err:  # recovery boundary: every rank learns of it just below
            error = err
    share_local_outcome(run, error, "generating the held-out continuations")
    heldout = HeldoutEval(
        names=[Path(p).stem for p in cfg.prompts],
        indices=mine,
        file_of=[every[i][0] for i in mine],
        prompts=prompts,
        continuations=continuations,
        eos_token_ids=eos,
        pad_token_id=pad,
    )
    if cfg.ngram:
        heldout.pending.update(ngram_metrics(run, heldout))
    heldout.pending["time_eval_setup_s"] = time.perf_counter() - started
    heldout.best_tau = previous_best_tau(run)
    counts = ", ".join(f"{len(f.prompts)} from {f.path}" for f in files)
    log_main(f"eval: {len(every)} held-out prompts ({counts}); greedy continuations generated once")
    return heldout


def check_prompt_files(run, missing: list[str]) -> None:
    """Every rank of the run's group: the prompt files missing on any rank (a node without them) stop
    every rank with the same ``ValueError``, naming the ranks; alone, a rank that raised would leave
    the others waiting in the evaluation's first gather."""
    found = [missing]
    if run.info.distributed:
        found = [None] * dist.get_world_size(run.group)
        dist.all_gather_object(found, missing, group=run.group)
    where = "; ".join(f"{paths} not found on rank {rank}" for rank, paths in enumerate(found) if paths)
    if where:
        raise ValueError(
            f"eval.prompts: {where}; fix the paths (every rank reads them) or drop them from eval.prompts."
        )


def evaluate(run, heldout: HeldoutEval) -> dict[str, Any]:
    """Exact greedy tau of the current drafter on the held-out prompts (every rank must call);
    writes ``export-best`` when ``eval_tau`` beats the best so far. Returns the metrics to log."""
    from dflash_train.eval.exact import exact_measure

    started = time.perf_counter()
    cfg = run.cfg.eval
    block_size = run.draft_config.num_verify_tokens  # the round: the last token and the drafts
    methods = ("dflash", "ngram+dflash") if cfg.ngram else ("dflash",)
    drafter, result, error = None, None, None
    with untouched_training_state(run.info.device):
        state = drafter_state(run)  # FSDP2: a collective, outside the recovery boundary below
        try:
            drafter = drafter_copy(run, state)
            del state
            result = exact_measure(
                run.target, drafter, heldout.prompts, heldout.continuations,
                max_new_tokens=cfg.max_new_tokens, eos_token_ids=heldout.eos_token_ids, methods=methods,
                ngram_n=cfg.ngram_n, ngram_min_match=cfg.ngram_n, ngram_max_draft=LOOKUP_MAX_DRAFT,
                drafter_batch_tokens=cfg.drafter_batch_tokens, pad_token_id=heldout.pad_token_id,
            )  # fmt: skip
        except Exception as err:  # recovery boundary: every rank learns of it just below
            error = err
    share_local_outcome(run, error, f"the held-out evaluation of step {run.step}")  # before the gather
    local = list(zip(*(result.generations[m] for m in methods), result.diagnoses, strict=True))
    ordered, file_of = gather_generations(run, heldout, local)
    metrics, overall = acceptance_metrics(
        "eval_tau", [item[0] for item in ordered], file_of, heldout.names, block_size
    )
    metrics["eval_acc_by_pos"] = [float(x) for x in overall["per_position_acceptance"]]
    if cfg.ngram:
        combined, _ = acceptance_metrics(
            "eval_ngram_dflash_tau", [item[1] for item in ordered], file_of, heldout.names, block_size
        )
        metrics.update(combined)
    metrics.update(diagnosis_metrics([item[-1] for item in ordered], file_of, heldout.names, block_size))
    tau = metrics[cfg.best_metric()]
    error = None
    if tau > heldout.best_tau:  # the same numbers on every rank: the same decision
        heldout.best_tau = tau
        if run.info.is_main:
            try:
                write_export_best(run, drafter, {"step": run.step, **metrics})
            except Exception as err:  # recovery boundary: every rank learns of it just below
                error = err
    del drafter
    share_export_best_outcome(run, error)  # no rank runs ahead while rank 0 writes export-best
    metrics["eval_tau_best"] = heldout.best_tau
    metrics.update(heldout.pending)
    heldout.pending = {}
    metrics["time_eval_s"] = time.perf_counter() - started
    return metrics


# ----------------------------------------------------------------------------- pieces


def share_export_best_outcome(run, error: BaseException | None) -> None:
    """Every rank of the run's group, once rank 0 wrote ``export-best`` (or had nothing to write): the
    barrier after it, and its outcome. A failure (``error``, rank 0's) raises the same one-line
    ``RuntimeError`` on every rank, so no rank waits at a barrier that rank 0 left by raising."""
    message = any_rank_error(error, group=run.group)
    if message is not None:
        raise RuntimeError(
            f"eval: writing export-best of step {run.step} failed on rank 0: {message}; free space in "
            f"{run.cfg.output_dir} (or fix what the error names) and "
            f"{continue_advice(run.cfg.checkpoint.resume, 'to resume')}"
        ) from error


def share_local_outcome(run, error: BaseException | None, what: str) -> None:
    """Every rank of the run's group, after the held-out work each rank does alone on its prompts
    (``what``; ``error``: this rank's, None if it succeeded): a failure on any rank raises the same
    one-line ``RuntimeError`` naming the first failed rank on every rank, so no rank waits in the
    gather of results (or the next step's collective) for a rank that raised alone."""
    raise_if_any_rank_failed(
        error,
        run.group,
        lambda rank, message: (
            f"eval: {what} failed on rank {rank}: {message}; if it ran out of memory, lower eval.batch_size "
            "(the continuations) or eval.drafter_batch_tokens (the evaluation), otherwise fix what the "
            f"error names; then {continue_advice(run.cfg.checkpoint.resume, 'to resume')}"
        ),
    )


def group_rank_and_size(run) -> tuple[int, int]:
    """This rank's place in the run's group (0 of 1 without torch.distributed)."""
    if not run.info.distributed:
        return 0, 1
    return dist.get_rank(run.group), dist.get_world_size(run.group)


@contextlib.contextmanager
def untouched_training_state(device: torch.device):
    """No grad, eager execution (compiled target regions would recompile for every eval shape and
    could exhaust the cache the training shapes need), and the RNG streams restored afterwards.
    Under it the generation engine of the continuations takes its eager step and grouped decode
    attention: flex, uncompiled, cannot be captured into the step's CUDA graphs
    (``generate/decode_attention.check_flex_compiles``)."""
    python_state = random.getstate()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), torch.compiler.set_stance("force_eager"):
        try:
            yield
        finally:
            random.setstate(python_state)


def drafter_state(run) -> dict[str, torch.Tensor]:
    """The drafter's current weights for the evaluation's copy: under FSDP2 the full state, gathered by
    every rank together (a collective); otherwise this rank's own replica.

    A rank that fails inside the gather (out of memory for the full weights) raises at once, naming
    itself: the other ranks are still inside the gather, so any other collective it entered (the
    evaluation's outcome vote) would be paired with theirs (gloo aborts the process on the mismatch;
    NCCL waits until ``train.dist_timeout_s``). They stop when they find it gone.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not uses_fsdp(run.model):
        return unwrap(run.model).state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    try:
        return get_model_state_dict(run.model, options=options)
    except Exception as err:  # no vote possible here (see the docstring): this rank's one line
        raise RuntimeError(
            f"eval: gathering the drafter's full state for the held-out evaluation of step {run.step} failed "
            f"on rank {group_rank_and_size(run)[0]}: {type(err).__name__}: {err}; the other ranks stop when they "
            "find this one gone (such a rank names its peer's exit: the cause is the rank that names another). "
            "If it ran out of memory, the full drafter did not fit beside training: lower "
            "data.token_budget (or train without eval.prompts); otherwise fix what the error names; then "
            f"{continue_advice(run.cfg.checkpoint.resume, 'to resume')}"
        ) from err


def drafter_copy(run, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """A plain drafter in eval mode and the training dtype holding the current weights: ``state``, or
    ``drafter_state(run)`` (a collective under FSDP2: every rank must call)."""
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.dtypes import DTYPES

    if state is None:
        state = drafter_state(run)
    with torch.device(run.info.device):
        drafter = DFlashDrafter(run.draft_config)
    drafter.to(DTYPES[run.cfg.train.dtype]).load_state_dict(state)
    del state
    return drafter.eval().requires_grad_(False)


def gather_generations(run, heldout: HeldoutEval, local: list[Any]) -> tuple[list[Any], list[int]]:
    """Every rank's per-prompt results (a ``Generation``, or a tuple of them and the diagnosis) in
    global prompt order, and the file of each."""
    payload = list(zip(heldout.indices, heldout.file_of, local, strict=True))
    if run.info.distributed:
        parts: list[Any] = [None] * dist.get_world_size(run.group)
        dist.all_gather_object(parts, payload, group=run.group)
        payload = [item for part in parts for item in part]
    payload.sort(key=lambda item: item[0])
    return [g for _, _, g in payload], [f for _, f, _ in payload]


def acceptance_metrics(
    name: str, generations: list[Generation], file_of: list[int], files: list[str], block_size: int
) -> tuple[dict[str, float], dict[str, Any]]:
    """``{name: tau over every prompt, name/<file>: tau of that file}`` (NaN when no prompt had a
    draft round) and the overall ``summarize_rounds``."""
    overall = summarize_rounds(generations, block_size)
    metrics = {name: nan_if_none(overall["tau"])}
    for index, file_name in enumerate(files):
        subset = [g for g, f in zip(generations, file_of, strict=True) if f == index]
        metrics[f"{name}/{file_name}"] = nan_if_none(summarize_rounds(subset, block_size)["tau"])
    return metrics, overall


def nan_if_none(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def diagnosis_metrics(
    diagnoses: list[dict[str, BlockStats]], file_of: list[int], files: list[str], block_size: int
) -> dict[str, float | list[float]]:
    """The diagnosis as metrics (``eval/diagnosis.py``; NaN where a group has no block):
    ``eval_random_anchor_tau`` (and ``/<file>``), ``eval_random_anchor_acc_by_pos``,
    ``eval_loop_round_frac``, ``eval_tau_in_loops``, ``eval_tau_outside_loops``,
    ``eval_acc_by_pos_after_reject`` and ``eval_acc_by_pos_other_rounds``."""
    overall = summarize_diagnosis(diagnoses, block_size)
    groups = overall["groups"]

    def by_pos(group: str) -> list[float]:
        return [nan_if_none(a) for a in groups[group]["accuracy_by_pos"]]

    metrics: dict[str, float | list[float]] = {
        "eval_random_anchor_tau": nan_if_none(overall["random_anchor_tau"])
    }
    for index, file_name in enumerate(files):
        subset = [d for d, f in zip(diagnoses, file_of, strict=True) if f == index]
        tau = summarize_diagnosis(subset, block_size)["random_anchor_tau"]
        metrics[f"eval_random_anchor_tau/{file_name}"] = nan_if_none(tau)
    metrics.update(
        {
            "eval_random_anchor_acc_by_pos": by_pos("anchors"),
            "eval_loop_round_frac": nan_if_none(overall["loop_round_fraction"]),
            "eval_tau_in_loops": nan_if_none(overall["tau_in_loops"]),
            "eval_tau_outside_loops": nan_if_none(overall["tau_outside_loops"]),
            "eval_acc_by_pos_after_reject": by_pos("after_rejection"),
            "eval_acc_by_pos_other_rounds": by_pos("other_rounds"),
        }
    )
    return metrics


def ngram_metrics(run, heldout: HeldoutEval) -> dict[str, Any]:
    """``eval_ngram_tau`` (and per file) of prompt-lookup drafting, and ``eval_ngram_overlap_tau`` of
    the same lookup copied on past the text's end (the eval's ``ngram-overlap``): host simulations,
    no drafter. Each rank simulates its own prompts; a failure on one stops every rank before the
    gather."""
    from dflash_train.eval import simulate

    cfg, block_size = run.cfg.eval, run.draft_config.num_verify_tokens
    names = {"eval_ngram_tau": False, "eval_ngram_overlap_tau": True}  # metric -> overlapping copy
    local, error = {}, None
    try:
        local = {
            name: [
                simulate.simulate_ngram(
                    prompt,
                    continuation,
                    n=cfg.ngram_n,
                    block_size=block_size,
                    max_new_tokens=cfg.max_new_tokens,
                    eos_token_ids=heldout.eos_token_ids,
                    overlap=overlap,
                )
                for prompt, continuation in zip(heldout.prompts, heldout.continuations, strict=True)
            ]
            for name, overlap in names.items()
        }
    except Exception as err:  # recovery boundary: every rank learns of it just below
        error = err
    share_local_outcome(run, error, "the n-gram baseline of the held-out prompts")  # before the gathers
    metrics = {}
    for name in names:
        ordered, file_of = gather_generations(run, heldout, local[name])
        metrics.update(acceptance_metrics(name, ordered, file_of, heldout.names, block_size)[0])
    return metrics


def previous_best_tau(run) -> float:
    """The tau (``eval.best_by``'s metric) of ``export-best`` left by this run before a resume; a run
    that starts at step 0 replaces whatever an earlier run in the folder left (its first evaluation is
    the best)."""
    best = recover_export_best(Path(run.cfg.output_dir))
    if run.step == 0 or not (best / BEST_RECORD).is_file():
        return -math.inf
    record = json.loads((best / BEST_RECORD).read_text())
    if record.get("step", math.inf) > run.step:
        return -math.inf  # from steps this resumed run is about to redo: they will be evaluated again
    metric = run.cfg.eval.best_metric()
    value = record.get(metric)
    return -math.inf if value is None else float(value)  # chosen by another metric before: re-decide


def recover_export_best(output_dir: Path) -> Path:
    """``export-best``, moved back from its ``.old`` copy if a writer died between the two renames.
    Every rank of a run may find it so at once: the ranks that lose the race find it moved back."""
    best, old = output_dir / BEST_DIR, output_dir / f".{BEST_DIR}.old"
    if not best.exists() and old.exists():
        try:
            old.rename(best)
        except FileNotFoundError:
            if not best.exists():  # not another rank's rename: gone for another reason
                raise
    return best


def write_export_best(run, drafter: torch.nn.Module, record: dict[str, Any]) -> Path:
    """The serving layout plus ``eval.json`` (step and metrics) written to a temporary folder, then
    renamed over ``export-best``: a reader never sees a half-written export."""
    from dflash_train.models.export import save_drafter
    from dflash_train.train.logging import finite_or_null

    output_dir = Path(run.cfg.output_dir)
    best = recover_export_best(output_dir)
    staging, old = output_dir / f".{BEST_DIR}.tmp", output_dir / f".{BEST_DIR}.old"
    shutil.rmtree(staging, ignore_errors=True)
    save_drafter(
        drafter,
        run.draft_config,
        staging,
        dtype=run.cfg.train.dtype,
        target=run.cfg.target.path,
        served_from=best,
    )
    (staging / BEST_RECORD).write_text(json.dumps(finite_or_null(record), indent=2) + "\n")
    shutil.rmtree(old, ignore_errors=True)
    if best.exists():
        best.rename(old)
    staging.rename(best)
    shutil.rmtree(old, ignore_errors=True)
    metric = run.cfg.eval.best_metric()
    log_main(f"eval: step {run.step} {metric} {record[metric]:.3f} is the best so far -> {best}")
    return best
