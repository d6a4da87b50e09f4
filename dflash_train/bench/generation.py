"""``dflash-train bench generation``: the generation engines side by side (``generate/engine.py``):
rows/s, generated tokens/s, peak memory, and whether their greedy outputs agree (the eval's
tie-aware verdict).

Engines: ``padded`` (the padded-batch loop synth and regen ran before, ``generate.sampling.sample_batch``,
run in waves of ``--batch-size`` rows), ``slots`` (the slot engine: continuous batching over
``--batch-size`` slots, preallocated cache, CUDA-graphed decode step on CUDA, its defaults: on CUDA
with an attention-only target the flex decode attention inside the compiled step, else the grouped
one, eager), ``slots-flex`` / ``slots-grouped`` (FlexAttention over each slot's live blocks, or the
grouped matmuls over the attended bucket; ``slots-flex-compiled`` / ``slots-grouped-compiled``: either
inside the compiled step), ``slots-eager`` (no graphs, to
separate the gains), ``slots-compiled`` / ``slots-uncompiled`` (the decode forward and draw under
torch.compile inside the graphs, or not, whatever the engine's default: ``SlotEngine(compile_decode=)``;
with ``--profile`` and ``slots-compiled`` the compiled step is profiled beside the uncompiled one). Every engine runs the same prompts, greedy
(or ``--temperature``), after an untimed warm-up on one batch of them (CUDA graph captures, kernel
autotuning). The first engine's greedy outputs are the reference; each other engine's are compared
row by row and every first divergence is judged by ``eval.verdict`` (logits of one plain target
forward: a tie within bf16 rounding, or a clear margin / length difference = a bug).

    dflash-train bench generation --target /path/smollm2 --batch-sizes 1024 \\
        --num-prompts 2048 --max-new-tokens 512 --profile
    dflash-train bench generation --preset qwen3.6-27b --num-layers 8 \\
        --batch-sizes 64,256 --num-prompts 512 --max-new-tokens 256 --num-stop-ids 2
    dflash-train bench generation --preset tiny-hybrid --device cpu \\
        --batch-sizes 4 --num-prompts 10 --max-new-tokens 16 --num-stop-ids 3 --profile   # dry run

``--profile`` adds, per batch size, a profile of the slot engine's decode step (``bench.decode_profile``):
the graphed step's time against its memory-traffic floor (weights + each slot's live K/V + the
recurrent states, at the measured 4.16 TB/s copy bandwidth of an H200), and an eager step's GPU time
by operator, with the share spent copying (written to ``decode_profile_<batch>.txt``).

A slot-engine run also reports its compiled step's compilations (``compile_decode``) and their seconds,
in the warm-up (``warmup_decode_compiles``, ``warmup_decode_compile_s``) and in the timed run
(``decode_compiles``, ``decode_compile_s``: its rows/s include them).

``--sampler-shapes 1024x49152,64x248320`` first times the top-p draw alone at each ROWSxVOCAB shape
(``bench.sampler_timing``): the sort-based draw the engines ran before, the exact draw eagerly and
compiled, each captured in a CUDA graph as the decode step runs it. ``--attention-shapes 1024x256,1024x1024`` times
one layer's decode attention alone at each SLOTSxKV shape, per kernel the step could run
(``bench.attention_timing``: grouped eager and compiled, flex over live blocks, sdpa with GQA).

Random-weight presets rarely emit EOS: ``--num-stop-ids K`` makes K random token ids stop ids so
rows end at different lengths (what continuous batching is for); a checkpoint stops at its EOS ids.
Each step (an engine's warm-up and timed run, a verdict, a profile) runs under ``--step-timeout-s``;
a step that fails or runs past it is recorded with its error and the next one runs. ``--out``
(default ``$OUT/generation_bench.json``, else ./generation_bench.json) is rewritten after every
step, and a short table goes to stderr last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_train.bench.attention_timing import ATTENTION_KERNELS, time_attentions
from dflash_train.bench.decode_profile import profile_decode
from dflash_train.bench.progress import StepLimits, StepProgress
from dflash_train.bench.sampler_timing import time_samplers
from dflash_train.generate.compiled_step import compile_report
from dflash_train.generate.engine import SlotEngine
from dflash_train.generate.sampling import PaddedEngine, Sampling

HELP = "Generation engines (slots on either decode attention, padded): rows/s, tokens/s, decode profile."
ENGINES = (
    "padded",
    "slots",
    "slots-flex",
    "slots-flex-compiled",
    "slots-grouped",
    "slots-grouped-compiled",
    "slots-eager",
    "slots-compiled",
    "slots-uncompiled",
)


@dataclass(frozen=True, kw_only=True)
class GenerationBenchOptions(StepLimits):
    """What ``dflash-train bench generation`` measures; the defaults are the CLI's."""

    # An HF checkpoint directory (with tokenizer), or "" with a preset.
    target: str = ""
    # A random-weight target preset (models/presets.py), e.g. qwen3.6-27b, tiny-hybrid; or "".
    preset: str = ""
    # Preset only: build the first N decoder layers (0 = all).
    num_layers: int = 0
    # A JSONL prompt file ("" = the built-in chat requests); checkpoint targets only.
    prompts: str = ""
    num_prompts: int = 512
    # Preset only: random prompt lengths, "MIN,MAX" tokens.
    prompt_len: str = "32,256"
    max_new_tokens: int = 512
    # Comma lists: slot counts, and engines (padded, slots, slots-flex, slots-grouped, slots-eager).
    batch_sizes: str = "64,256"
    engines: str = "padded,slots,slots-eager"
    # Preset only: this many random token ids stop rows (random weights rarely emit EOS).
    num_stop_ids: int = 0
    temperature: float = 0.0
    check_every: int = 4
    kv_bucket: int = 0  # 0: the engine's default
    profile: bool = False
    # Comma list of ROWSxVOCAB shapes at which to time the top-p draw alone (sort, exact, exact compiled); "" = none.
    sampler_shapes: str = ""
    # Comma list of SLOTSxKV shapes at which to time one layer's decode attention alone; "" = none.
    attention_shapes: str = ""
    dtype: str = "auto"
    device: str = "auto"
    out: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.target) == bool(self.preset):
            raise ValueError("give exactly one of --target DIR and --preset NAME")
        if set(self.engine_list) - set(ENGINES) or not self.engine_list:
            raise ValueError(f"--engines {self.engines!r}: a comma list of {', '.join(ENGINES)}")
        if not self.batch_size_list or min(self.batch_size_list) < 1 or min(self.prompt_len_range) < 1:
            raise ValueError("--batch-sizes and --prompt-len take positive integers, e.g. 64,256 and 32,256")
        self.sampler_shape_list  # noqa: B018 (raises on a malformed list)
        self.attention_shape_list  # noqa: B018

    @property
    def engine_list(self) -> list[str]:
        return [e for e in self.engines.split(",") if e]

    @property
    def batch_size_list(self) -> list[int]:
        return [int(b) for b in self.batch_sizes.split(",") if b]

    @property
    def sampler_shape_list(self) -> list[tuple[int, int]]:
        return shape_list("--sampler-shapes", self.sampler_shapes, "ROWSxVOCAB, e.g. 1024x49152")

    @property
    def attention_shape_list(self) -> list[tuple[int, int]]:
        shapes = shape_list("--attention-shapes", self.attention_shapes, "SLOTSxKV, e.g. 1024x256")
        if any(kv % 256 for _, kv in shapes):
            raise ValueError(
                f"--attention-shapes {self.attention_shapes!r}: KV is a multiple of 256 (a bucket)"
            )
        return shapes

    @property
    def prompt_len_range(self) -> tuple[int, int]:
        low, _, high = self.prompt_len.partition(",")
        return int(low), int(high or low)


def shape_list(flag: str, value: str, form: str) -> list[tuple[int, int]]:
    """ "AxB,CxD" -> [(A, B), (C, D)] of positive integers, or a ValueError naming the flag."""
    shapes = [shape.split("x") for shape in value.split(",") if shape]
    if any(len(s) != 2 or not all(n.isdigit() and int(n) > 0 for n in s) for s in shapes):
        raise ValueError(f"{flag} {value!r}: a comma list of {form}")
    return [(int(a), int(b)) for a, b in shapes]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", default="", help="HF checkpoint directory (with tokenizer)")
    where.add_argument(
        "--preset", default="", help="random-weight target preset, e.g. qwen3.6-27b, tiny-hybrid"
    )
    parser.add_argument("--num-layers", type=int, default=0, help="preset: build only the first N layers")
    parser.add_argument("--prompts", default="", help="JSONL prompt file (default: built-in chat prompts)")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--prompt-len", default="32,256", help="preset: random prompt lengths MIN,MAX")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--batch-sizes", default="64,256", help="comma list of slot counts")
    parser.add_argument(
        "--engines", default="padded,slots,slots-eager", help=f"comma list of {', '.join(ENGINES)}"
    )
    parser.add_argument("--num-stop-ids", type=int, default=0, help="preset: random stop ids (0: none)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--check-every", type=int, default=4, help="slot engine: steps between host syncs")
    parser.add_argument("--kv-bucket", type=int, default=0, help="slot engine: attended-length granularity")
    parser.add_argument("--profile", action="store_true", help="profile the slot engine's decode step")
    parser.add_argument(
        "--sampler-shapes",
        default="",
        help="time the top-p draw alone (sort, exact, exact compiled) at ROWSxVOCAB,...",
    )
    parser.add_argument(
        "--attention-shapes",
        default="",
        help="time one layer's decode attention alone per kernel at SLOTSxKV,...",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="", help="JSON rewritten after every step ($OUT or . by default)")


def build(options: GenerationBenchOptions, device: torch.device, dtype: torch.dtype):
    """(model, prompts as token ids, stop ids); GatedDeltaNet presets on fla's kernels on a GPU."""
    from dflash_train.models.target_kernels import bind_fla_causal_conv, check_fast_kernels
    from dflash_train.models.target_loading import load_causal_lm

    if options.target:
        from dflash_train.eval.prompts import benchmark_prompts, load_prompts
        from dflash_train.eval.runner import default_eos_ids

        model, tokenizer = load_causal_lm(options.target, dtype=dtype, device=device)
        if options.prompts:
            prompts = load_prompts(options.prompts, tokenizer, num_prompts=options.num_prompts)
        else:
            prompts = benchmark_prompts(tokenizer, options.num_prompts)
        return model.eval(), prompts, set(default_eos_ids(model, tokenizer))
    model, _ = load_causal_lm(
        f"preset:{options.preset}", dtype=dtype, device=device, num_hidden_layers=options.num_layers or None
    )
    bind_fla_causal_conv(model, device)
    check_fast_kernels(model, device, False)
    rng = random.Random(0)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    low, high = options.prompt_len_range
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(options.num_prompts)
    ]
    stops = {rng.randrange(vocab) for _ in range(options.num_stop_ids)}
    return model.eval(), prompts, stops


def make_engine(name: str, model, batch_size: int, options: GenerationBenchOptions):
    if name == "padded":
        return PaddedEngine(model, num_slots=batch_size)
    attention = (
        "flex" if name.startswith("slots-flex") else "grouped" if name.startswith("slots-grouped") else None
    )
    compiled = name.endswith("-compiled")
    return SlotEngine(
        model, num_slots=batch_size, use_cuda_graphs=False if name == "slots-eager" else None,
        check_every=options.check_every, kv_bucket=options.kv_bucket or None, decode_attention=attention,
        compile_decode=True if compiled else False if name == "slots-uncompiled" else None,
    )  # fmt: skip


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(
    name, model, prompts, stops, batch_size, options, device, progress
) -> tuple[dict, list | None]:
    """Warm-up, then the timed run; (record, outputs with the stop token appended)."""
    engine = make_engine(name, model, batch_size, options)
    sampling = Sampling(temperature=options.temperature, seed=0)
    keys = list(range(len(prompts)))

    def generate(rows):
        return engine.generate(
            [prompts[i] for i in rows], [keys[i] for i in rows], max_new_tokens=options.max_new_tokens,
            stop_ids=stops, pad_id=0, sampling=sampling,
        )  # fmt: skip

    record: dict = {"engine": name, "batch_size": batch_size}
    with progress.step(f"{name} x{batch_size} warm-up"):
        started = time.perf_counter()
        generate(range(min(batch_size, len(prompts))))
        synchronize(device)
        record["warmup_s"] = round(time.perf_counter() - started, 2)
    warmup = compile_report(engine)  # the compiled step's compilations in the warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps_before = getattr(engine, "num_steps", 0)
    with progress.step(f"{name} x{batch_size}"):
        started = time.perf_counter()
        generations = generate(range(len(prompts)))
        synchronize(device)
        elapsed = time.perf_counter() - started
    if hasattr(engine, "num_steps"):
        total = compile_report(engine)
        record |= {
            "decode_steps": engine.num_steps - steps_before,
            "decode_attention": engine.decode_attention,
            "warmup_decode_compiles": warmup["decode_compiles"],
            "warmup_decode_compile_s": warmup["decode_compile_s"],
            # in the timed run (its rows/s pay for them): 0 where the warm-up compiled all it needs
            "decode_compiles": total["decode_compiles"] - warmup["decode_compiles"],
            "decode_compile_s": round(total["decode_compile_s"] - warmup["decode_compile_s"], 2),
        }
    tokens = sum(len(g.token_ids) + g.finished for g in generations)
    record |= {
        "status": "ok",
        "elapsed_s": round(elapsed, 3),
        "rows_per_s": round(len(prompts) / elapsed, 2),
        "generated_tokens_per_s": round(tokens / elapsed, 1),
        "generated_tokens": tokens,
        "rows_hit_limit": sum(not g.finished for g in generations),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
    }
    outputs = [g.token_ids + ([g.stop_id] if g.finished else []) for g in generations]
    return record, outputs


def agreement(model, prompts, reference, outputs, temperature: float) -> dict:
    """Rows identical to the reference, and the tie-aware verdict over the differing ones."""
    from dflash_train.eval.verdict import describe_divergence, verdict

    differing = [i for i, (a, b) in enumerate(zip(reference, outputs)) if a != b]
    divergences = [describe_divergence(model, prompts[i], reference[i], outputs[i], i) for i in differing]
    result = verdict(divergences, len(prompts), temperature)
    return {
        "rows_identical": len(prompts) - len(differing),
        "rows_differing": len(differing),
        "divergences_at_ties": sum(d["is_tie"] for d in divergences),
        **result,
        "first_divergences": divergences[:5],
    }


def guarded(record: dict, step) -> tuple[dict, Any]:
    """``step()`` -> (record, value), or the record with the error it raised and None: one engine
    failing (its time limit, a capture error) must not hide the others' numbers, so this is a
    deliberate recovery boundary."""
    try:
        return step()
    except Exception as err:  # recorded in the result, its traceback on stderr
        traceback.print_exc()
        return record | {"status": f"error: {type(err).__name__}: {err}"}, None


def run_generation_bench(options: GenerationBenchOptions) -> dict[str, Any]:
    from dflash_train.eval.command import resolve_device, resolve_eval_dtype

    device = resolve_device(options.device)
    dtype = resolve_eval_dtype(options.dtype, device)
    out = Path(options.out or Path(os.environ.get("OUT", ".")) / "generation_bench.json")
    model, prompts, stops = build(options, device, dtype)
    result: dict[str, Any] = {
        "workload": options.target or f"preset:{options.preset}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "num_prompts": len(prompts),
        "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
        "max_new_tokens": options.max_new_tokens,
        "stop_ids": sorted(stops),
        "runs": [],
        "agreement": [],
        "profiles": [],
        "sampler": [],
        "attention": [],
    }

    def save() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    sizes, engines = options.batch_size_list, options.engine_list
    # profiled: the plain slot engine's step, and the compiled one's when slots-compiled is benched
    profiled = [False, True][: 1 + ("slots-compiled" in engines)] if options.profile else []
    num_steps = len(sizes) * (2 * len(engines) + len(engines) - 1 + len(profiled))
    alone = len(options.sampler_shape_list) + len(options.attention_shape_list)
    with StepProgress("generation", num_steps + alone, options) as progress:
        for rows, vocab in options.sampler_shape_list:
            result["sampler"].append(sampler_step(rows, vocab, device, progress))
            save()
        for slots, kv in options.attention_shape_list:
            result["attention"].append(attention_step(model, slots, kv, device, dtype, progress))
            save()
        for batch_size in sizes:
            for compiled in profiled:
                result["profiles"].append(
                    profile_step(model, prompts, stops, batch_size, options, out, progress, compiled)
                )
                save()
            reference = None
            for name in engines:
                record, outputs = guarded(
                    {"engine": name, "batch_size": batch_size},
                    lambda name=name, size=batch_size: run_engine(
                        name, model, prompts, stops, size, options, device, progress
                    ),
                )
                gc.collect()  # the engine's cache and graphs go before the next engine allocates
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                result["runs"].append(record)
                save()
                if outputs is None:
                    continue
                if reference is None:
                    reference = (name, outputs)
                    continue
                base = {"batch_size": batch_size, "reference": reference[0], "engine": name}

                def compare(outputs=outputs, base=base, reference=reference):
                    with progress.step(f"verdict {base['engine']} x{base['batch_size']}"):
                        return base | agreement(
                            model, prompts, reference[1], outputs, options.temperature
                        ), None

                result["agreement"].append(guarded(base, compare)[0])
                save()
    print_table(result)
    return result | {"out": str(out)}


def profile_step(model, prompts, stops, batch_size, options, out: Path, progress, compiled=False) -> dict:
    def step():
        label = f"profile x{batch_size}" + (" compiled" if compiled else "")
        with progress.step(label):
            return profile_decode(model, prompts, stops, batch_size, options, out.parent, compiled), None

    record, _ = guarded({}, step)
    return record | {"batch_size": batch_size, "compile_decode": compiled}


def sampler_step(rows: int, vocab: int, device: torch.device, progress) -> dict:
    def step():
        with progress.step(f"sampler {rows}x{vocab}"):
            return time_samplers(rows, vocab, device), None

    return guarded({"rows": rows, "vocab": vocab}, step)[0]


def attention_step(model, slots: int, kv: int, device: torch.device, dtype: torch.dtype, progress) -> dict:
    config = model.config.get_text_config(decoder=True)

    def step():
        with progress.step(f"attention {slots}x{kv}"):
            return time_attentions(slots, kv, config, device, dtype), None

    return guarded({"slots": slots, "kv": kv}, step)[0]


def print_table(result: dict) -> None:
    """The runs, the decode profiles and the agreement, for a reader (stderr)."""
    lines = [
        f"{'batch':>6} {'engine':<14} {'status':<8} {'rows/s':>9} {'gen tok/s':>11} {'peak GiB':>9} {'hit limit':>9}"
        f" {'compiles':>9}"
    ]
    for r in result["runs"]:
        ok = r.get("status") == "ok"
        cells = [
            r.get(k, "-") if ok else "-"
            for k in ("rows_per_s", "generated_tokens_per_s", "peak_memory_gib", "rows_hit_limit")
        ]
        # compilations of the decode step: warm-up + timed run
        compiles = f"{r['warmup_decode_compiles']}+{r['decode_compiles']}" if "decode_compiles" in r else "-"
        lines.append(
            f"{r['batch_size']:>6} {r['engine']:<14} {str(r.get('status'))[:8]:<8} "
            f"{cells[0]!s:>9} {cells[1]!s:>11} {cells[2]!s:>9} {cells[3]!s:>9} {compiles:>9}"
        )
    for r in result["profiles"]:
        if "step_ms" in r:
            lines.append(
                f"decode step at {r['batch_size']} slots ({r['decode_attention']}): {r['step_ms']:.2f} ms, floor "
                f"{r['floor_ms']:.2f} ms (x{r['step_over_floor']:.1f}); eager: {r['copy_share']:.1%} in copies"
            )
    for r in result["sampler"]:
        if r.get("status") != "ok":
            lines.append(f"top-p draw at {r['rows']}x{r['vocab']}: {r.get('status')}")
            continue
        times = ", ".join(
            f"{name} {r[f'{name}_ms']:.3f} ms" if f"{name}_ms" in r else f"{name} failed"
            for name in ("sort", "exact", "exact_compiled")
        )
        lines.append(
            f"top-p draw at {r['rows']}x{r['vocab']}: {times}; nucleus differs in {r['nucleus_rows_differing']} rows"
        )
    for r in result["attention"]:
        times = ", ".join(
            f"{name} {r[f'{name}_ms']:.3f} ms" if f"{name}_ms" in r else f"{name} failed"
            for name in ATTENTION_KERNELS
        )
        lines.append(
            f"decode attention at {r['slots']}x{r['kv']}: {times} (bucket {r.get('bucket_mb')} MB, "
            f"live {r.get('live_mb')} MB)"
            if r.get("status") == "ok"
            else f"decode attention at {r['slots']}x{r['kv']}: {r.get('status')}"
        )
    for a in result["agreement"]:
        if "rows_identical" not in a:
            lines.append(
                f"agreement batch {a['batch_size']} {a['engine']} vs {a['reference']}: {a.get('status')}"
            )
            continue
        lines.append(
            f"agreement batch {a['batch_size']} {a['engine']} vs {a['reference']}: {a['rows_identical']} rows "
            f"identical, {a['rows_differing']} differ ({a['divergences_at_ties']} at ties, "
            f"{a['num_clear_divergences']} clear: {'BUG' if a['num_clear_divergences'] else 'ok'})"
        )
    print("\n".join(lines), file=sys.stderr, flush=True)


# The mode's entry points (bench/modes.py).
Options = GenerationBenchOptions
run = run_generation_bench
