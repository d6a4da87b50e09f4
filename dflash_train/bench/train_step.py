"""``dflash-train bench train`` (also plain ``dflash-train bench``): the full train step at a preset
shape with random weights.

Builds the target (only the layers the features need) and the drafter directly on the device,
feeds fixed-shape synthetic rows (random ids, a 10% prompt then response tokens), runs warm-up
steps, then times full optimizer steps (target forward + drafter forward/backward + one-pass
LM-head loss + AdamW) with the same ``train_step`` the trainer uses. Reports target tokens/s,
the step-time split, MFU against the measured 798 TFLOP/s bf16 peak of an H200, and peak memory.
``bench lengths`` times buckets against packing on a real length distribution (``bench/lengths.py``).
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.bench.progress import StepLimits, StepProgress
from dflash_train.config import load_config
from dflash_train.models.presets import DRAFTER_PRESETS
from dflash_train.models.variant import DEFAULT_VARIANT, variant_names
from dflash_train.train.flops import mfu, train_step_flops
from dflash_train.train.parallel import DistInfo, pick_device, use_expandable_segments
from dflash_train.train.step_timer import PhaseTimer

# preset -> (target preset, drafter preset, default seq len, default anchors, block size)
BENCH_SHAPES = {
    "qwen3.6-27b": ("qwen3.6-27b", "qwen3.6-27b", 4096, 512, 16),
    "qwen3-8b": ("qwen3-8b", "qwen3-8b", 4096, 512, 16),
    "tiny": ("tiny-hybrid", "tiny", 256, 32, 8),
}


HELP = "Throughput of the full train step at a preset shape with random weights (the default mode)."


@dataclass(frozen=True, kw_only=True)
class BenchOptions(StepLimits):
    """What ``dflash-train bench train`` measures; the defaults are the CLI's."""

    # Shape preset: qwen3.6-27b, qwen3-8b or tiny (BENCH_SHAPES).
    preset: str = "tiny"
    # Tokens per row and anchors per row; 0 = the preset's (4096 and 512; tiny: 256 and 32).
    seq_len: int = 0
    num_anchors: int = 0
    rows: int = 1
    # Timed steps, after untimed warm-up steps.
    steps: int = 5
    warmup: int = 2
    attention_backend: str = "auto"
    # Compile the drafter layers, flex attention and loss kernel (None: on, off for tiny), and the
    # target's MLPs, norms and attention blocks (None: as ``compile``).
    compile: bool | None = None
    target_compile: bool | None = None
    # target.fp8: the target's decoder linears in FP8 (torchao; CUDA sm89+, not the float32 tiny preset).
    target_fp8: bool = False
    # After timing, profile one step and write its kernel table to this path ("" = no profile).
    profile: str = ""
    activation_checkpointing: bool = False
    loss_chunk_tokens: int = 2048
    # train.loss: kl and ce+kl run the whole target and a teacher LM head per chunk.
    loss: str = "ce"
    # Time the drafter step alone on fixed features.
    drafter_only: bool = False
    device: str = "auto"
    # drafter.variant: a registered variant, dflash, dflash2 or dspark (docs/training.md "Variants").
    variant: str = DEFAULT_VARIANT

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preset not in BENCH_SHAPES:
            raise ValueError(f"--preset {self.preset!r}: use one of {list(BENCH_SHAPES)}")
        if self.attention_backend not in ("auto", "flex", "sdpa"):
            raise ValueError(f"--attention-backend {self.attention_backend!r}: use auto, flex or sdpa")
        if min(self.rows, self.steps) < 1 or min(self.warmup, self.seq_len, self.num_anchors) < 0:
            raise ValueError("--rows and --steps must be >= 1; --warmup, --seq-len, --num-anchors >= 0")
        if self.variant not in variant_names():
            raise ValueError(f"--variant {self.variant!r}: use one of {variant_names()}")
        if self.target_fp8 and self.preset == "tiny":
            raise ValueError(
                "--target-fp8 needs a bfloat16 preset (qwen3.6-27b, qwen3-8b); tiny runs in float32"
            )


@dataclass
class SyntheticBatch:
    """Duck-types ``data.Batch``: random ids, prompt-then-response loss mask, no padding."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    sample_index: torch.Tensor


class SyntheticData:
    """An endless stream of identical-shape random batches (the data pipeline is not timed)."""

    epoch = 0
    steps_per_epoch = 1 << 30

    def __init__(self, rows: int, seq_len: int, vocab_size: int, device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (rows, seq_len), generator=g)
        loss_mask = torch.ones(rows, seq_len, dtype=torch.bool)
        loss_mask[:, : seq_len // 10] = False
        self.batch = SyntheticBatch(
            ids.to(device),
            loss_mask.to(device),
            torch.ones_like(loss_mask).to(device),
            torch.arange(rows, device=device),
        )
        self.calls = 0

    def next_batch(self):
        self.calls += 1
        batch = self.batch
        # A new sample index per call draws new anchors, as real data would.
        batch.sample_index = batch.sample_index + batch.sample_index.numel()
        return batch, 0

    def log_stats(self) -> dict[str, float]:
        return {}


def bench_config(args: BenchOptions):
    """A RunConfig for the preset shape; only target, drafter and train sections matter here."""
    target_preset, drafter_preset, seq_len, anchors, block_size = BENCH_SHAPES[args.preset]
    seq_len = args.seq_len or seq_len
    anchors = args.num_anchors or anchors
    tiny = args.preset == "tiny"
    compile_drafter = args.compile if args.compile is not None else not tiny
    compile_target = args.target_compile if args.target_compile is not None else compile_drafter
    overrides = [
        f"target.path=preset:{target_preset}",
        f"target.dtype={'float32' if tiny else 'bfloat16'}",
        f"target.compile={str(compile_target).lower()}",
        f"target.fp8={str(args.target_fp8).lower()}",
        f"drafter.preset={drafter_preset}",
        f"drafter.block_size={block_size}",
        f"drafter.variant={args.variant}",
        f"train.num_anchors={anchors}",
        f"train.dtype={'float32' if tiny else 'bfloat16'}",
        f"train.attention_backend={args.attention_backend}",
        f"train.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        f"train.loss_chunk_tokens={args.loss_chunk_tokens}",
        f"train.loss={args.loss}",
        f"train.compile={str(compile_drafter).lower()}",
        f"data.seq_buckets=[{seq_len}]",
        f"data.token_budget={seq_len * args.rows}",
        "train.max_steps=1000000",
        "output_dir=runs/bench",
    ]
    if tiny:
        overrides += ["target.target_layer_ids=[0,2]", "drafter.mask_token_id=319"]
    else:  # the drafter preset's feature layers, e.g. [1,16,31,46,61] for Qwen3.6-27B
        overrides += [f"target.target_layer_ids={DRAFTER_PRESETS[drafter_preset]['target_layer_ids']}"]
    return load_config("tiny-cpu", overrides), seq_len, anchors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The train mode's arguments: the shape, the timed steps and the profile."""
    add_shape_arguments(parser)
    parser.add_argument(
        "--profile", default="", help="after timing, profile one step and write a kernel table here"
    )
    parser.add_argument(
        "--drafter-only", action="store_true", help="time the drafter step alone on random features"
    )


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """What the train and lengths modes share: preset shape, steps, compilation, loss, device."""
    parser.add_argument("--preset", default="tiny", help="qwen3.6-27b, qwen3-8b or tiny")
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per row (default: 4096, tiny: 256)")
    parser.add_argument("--num-anchors", type=int, default=0, help="anchors per row (default: 512, tiny: 32)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--attention-backend", choices=["auto", "flex", "sdpa"], default="auto")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the drafter layers, flex attention and loss kernel (default: on, off for tiny)",
    )
    parser.add_argument(
        "--target-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the target's MLPs, norms and attention blocks (default: as --compile)",
    )
    parser.add_argument(
        "--target-fp8",
        action="store_true",
        help="target.fp8: the target's decoder linears in FP8 (torchao float8; CUDA sm89+, the fp8 extra)",
    )
    parser.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--loss-chunk-tokens", type=int, default=2048)
    parser.add_argument(
        "--loss",
        choices=["ce", "kl", "ce+kl"],
        default="ce",
        help="train.loss; kl/ce+kl run the target to full depth and a teacher LM head per chunk",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--variant", choices=variant_names(), default=DEFAULT_VARIANT, help="drafter.variant")


def run_bench(args: BenchOptions) -> dict[str, Any]:
    """Build the bench run, time ``args.steps`` full train steps after ``args.warmup`` warm-up steps."""
    from dflash_train.train.builders import resolve_backend

    cfg, seq_len, anchors = bench_config(args)
    use_expandable_segments()  # the allocator configuration training uses
    bench_run = build_bench_run(
        cfg, args.rows, seq_len, pick_device(args.device), drafter_only=args.drafter_only
    )
    with StepProgress("train", args.warmup + args.steps + bool(args.profile), args) as progress:
        result = time_train_steps(bench_run, args.steps, args.warmup, progress)
        if args.profile:
            with progress.step("profiled step"):
                profile_train_step(bench_run, args.profile)
    flops = train_step_flops(
        bench_run.target.config, bench_run.draft_config, seq_len=seq_len, num_anchors=anchors, rows=args.rows
    )
    if args.drafter_only:
        flops["total"] -= flops["target"]
    if needs_teacher(cfg):  # drafter-only: the teacher's LM head still runs in every step
        flops["total"] += teacher_flops(
            bench_run.target.config, bench_run.draft_config, seq_len, anchors, args.rows,
            target_layers=not args.drafter_only,
        )  # fmt: skip
    device = bench_run.info.device
    return {
        **result_header(args, device, seq_len, anchors),
        "block_size": bench_run.draft_config.block_size,
        "variant": bench_run.draft_config.variant,
        "drafter_only": bool(args.drafter_only),
        "objective": cfg.train.loss,
        "attention_backend": resolve_backend(cfg, bench_run.info),  # what the drafter ran on
        "compile": cfg.train.compile,
        "target_compile": cfg.target.compile,
        "target_fp8": cfg.target.fp8,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "tokens_per_s": args.rows * seq_len / result["step_s"],
        "samples_per_s": args.rows / result["step_s"],
        **result,
        "tflop_per_step": flops["total"] / 1e12,
        "mfu": mfu(flops["total"], result["step_s"]),
        "target_kernels": bench_run.target.kernels,
        "torch": torch.__version__,
    }


# The mode's entry points (bench/modes.py).
Options = BenchOptions
run = run_bench


def result_header(args: BenchOptions, device: torch.device, seq_len: int, anchors: int) -> dict[str, Any]:
    """The shape and machine fields every bench result starts with."""
    return {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "seq_len": seq_len,
        "rows": args.rows,
        "num_anchors": anchors,
    }


def build_bench_run(
    cfg, rows: int, seq_len: int, device: torch.device, *, drafter_only: bool = False, target=None
):
    """Target (truncated to its feature layers; or ``target`` reused), drafter, optimizer and
    synthetic data on ``device``."""
    from dflash_train.models.target import load_target
    from dflash_train.train.builders import build_drafter, build_optimizer, build_scheduler
    from dflash_train.train.run import Run

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    torch.manual_seed(0)
    uses_kl = needs_teacher(cfg)  # a teacher needs the whole target, final norm included
    if target is None:
        target = load_target(
            cfg.target, device, truncate_unused_layers=not uses_kl, compile_regions=cfg.target.compile
        )
    draft_config, model = build_drafter(cfg, target, info)
    optimizer = build_optimizer(model, cfg, info)
    data = SyntheticData(rows, seq_len, target.vocab_size, device)
    if drafter_only:
        kwargs = {"with_final_hidden": True} if uses_kl else {}
        features = target.features(data.batch.input_ids, data.batch.attention_mask, **kwargs)
        target.features = lambda ids, mask, **kw: features  # time the drafter side alone
    return Run(
        cfg=cfg,
        info=info,
        target=target,
        draft_config=draft_config,
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg, 1_000_000),
        data=data,
        total_steps=1_000_000,
    )


def needs_teacher(cfg) -> bool:
    """A KL loss or DSpark's TV / confidence terms read the target's own distribution."""
    from dflash_train.train.loss_options import LossOptions

    return LossOptions.from_train_config(cfg.train, cfg.drafter).needs_teacher


def teacher_flops(
    target_config, draft_config, seq_len: int, num_anchors: int, rows: int, *, target_layers: bool = True
) -> float:
    """What a KL loss adds to a step: the target layers after max(target_layer_ids) (not with
    ``target_layers`` False: drafter-only, the features were computed once) and the teacher's
    LM-head forward over every scored block token."""
    from dflash_train.models.presets import text_config
    from dflash_train.train.flops import target_layer_flops

    tc = text_config(target_config)
    first = max(draft_config.target_layer_ids) + 1 if target_layers else tc.num_hidden_layers
    layers = sum(target_layer_flops(tc, i, seq_len) for i in range(first, tc.num_hidden_layers))
    head = (
        2.0 * num_anchors * draft_config.num_draft_tokens * draft_config.hidden_size * draft_config.vocab_size
    )
    return rows * (layers + head)


def time_train_steps(run, steps: int, warmup: int, progress: StepProgress | None = None) -> dict[str, float]:
    """Mean wall time of ``steps`` train steps after ``warmup`` untimed ones, its phase split, the
    peak memory of the timed steps, and the warm-up's wall time and compilations (a graph compiled
    during the timed steps, or code that dynamo gave up compiling, is warned about). Each step runs
    under ``progress`` (its bar and time limit; none by default)."""
    from dflash_train.train.colocated import train_step
    from dflash_train.train.run import TrainHooks

    device = run.info.device
    timer = PhaseTimer(device)
    hooks = TrainHooks()
    progress = progress or StepProgress("train", warmup + steps, StepLimits(step_timeout_s=0, progress=False))
    before = compile_counts()
    t0 = time.perf_counter()
    for index in range(warmup):
        with progress.step(f"warm-up {index + 1}/{warmup}"):
            train_step(run, timer, hooks)
            _sync(device)
    warmup_s = time.perf_counter() - t0
    warmed = compile_counts()
    timer.collect()
    _sync(device)  # without warm-up steps, the work queued before (weights, drafter-only features)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for index in range(steps):
        with progress.step(f"step {index + 1}/{steps}"):
            result = train_step(run, timer, hooks)
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    phases = timer.collect()
    compiles = check_compiles(before, warmed, compile_counts())
    return {
        "step_s": step_s,
        "warmup_s": warmup_s,
        **compiles,
        "target_s": phases.get("target", 0.0) / steps,
        "drafter_s": phases.get("drafter", 0.0) / steps,
        "optimizer_s": phases.get("optimizer", 0.0) / steps,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0,
        "loss": float(result["loss"]),
    }


def compile_counts() -> tuple[int, int]:
    """(graphs dynamo compiled, frames it gave up on) in this process so far; a frame it gives up
    on (recompile limit hit, compile error) runs eagerly from then on."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return counters["stats"]["unique_graphs"], frames["total"] - frames["ok"]


def check_compiles(
    before: tuple[int, int], warmed: tuple[int, int], after: tuple[int, int]
) -> dict[str, int]:
    """Compilations of the warm-up and of the timed steps from three ``compile_counts``; warns when
    the timed steps compiled (their time includes compilation) or any frame fell back to eager."""
    counts = {
        "compiled_graphs_warmup": warmed[0] - before[0],
        "compiled_graphs_timed": after[0] - warmed[0],
        "eager_fallbacks": after[1] - before[1],
    }
    if counts["compiled_graphs_timed"]:
        warnings.warn(
            f"bench: {counts['compiled_graphs_timed']} graph(s) compiled during the timed steps, so step_s "
            "includes compilation; raise --warmup (TORCH_LOGS=recompiles names the cause).",
            RuntimeWarning,
            stacklevel=3,
        )
    if counts["eager_fallbacks"]:
        warnings.warn(
            f"bench: dynamo gave up compiling {counts['eager_fallbacks']} frame(s) (recompile limit or a "
            "compile error; see its log warnings), which then ran eagerly: the times are not the compiled step's.",
            RuntimeWarning,
            stacklevel=3,
        )
    return counts


def profile_train_step(run, path: str, rows: int = 40) -> None:
    """Profile one train step and write the ``rows`` most expensive kernels/ops as a text table."""
    from torch.profiler import ProfilerActivity, profile

    from dflash_train.train.colocated import train_step
    from dflash_train.train.run import TrainHooks

    device = run.info.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        train_step(run, PhaseTimer(device), TrainHooks())
        _sync(device)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=90)
    with open(path, "w") as f:
        f.write(table)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
