"""The embedded demo target: a small Qwen3.5-style hybrid LM trained on the Python stdlib, on CPU.

``build_demo_target(out_dir)`` trains a byte-level BPE tokenizer (``tiny.build_tokenizer``, ChatML
template) on the train split of ``demo.corpus``, then a 4-layer hybrid causal LM (3 GatedDeltaNet
layers + 1 full-attention layer, transformers' ``Qwen3_5ForCausalLM``) for a few minutes, and saves
model + tokenizer + ``build_info.json``. Every training row is a chat: the user turn is
``corpus.continuation_prompt(prefix)`` for a line-aligned prefix of a file, the assistant turn is
the file's continuation (ended by ``<|im_end|>`` only where the file ends), tokenized exactly as
the demo later tokenizes prompt and generated reply. So the target's greedy replies to the demo's
prompts are Python continuations: predictable enough to learn, varied enough not to be copied.

``demo.builtin_targets.builtin_target_path("demo-target")`` (what ``target.path: builtin:demo-target``
resolves to) builds it into a cache directory on first use. Builds go to a temporary sibling
directory that is renamed into place only when complete, so an interrupted build is never loaded.

Rebuild by hand: ``python -m dflash_train.demo.target_build --out DIR`` (docs/demo.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3_5TextConfig

from dflash_train.demo.corpus import continuation_prompt, read_source, stdlib_files
from dflash_train.tiny import build_tokenizer

CACHE_VERSION = "v2"  # v2: the builtin target trains its full schedule (v1 stopped at 180 s)
EMPTY_THINK = "<think>\n\n</think>\n\n"


@dataclass(kw_only=True)
class DemoTargetSettings:
    """Shape and training schedule of the demo target; the defaults are the shipped build."""

    vocab_size: int = 2048  # BPE vocabulary incl. the 6 ChatML/mask specials
    hidden_size: int = 128
    num_hidden_layers: int = 4  # every 4th layer is full attention, the rest GatedDeltaNet
    num_attention_heads: int = 4
    seq_len: int = 256  # tokens per row; a multiple of 64 (the GatedDeltaNet fallback's chunk)
    batch_size: int = 8  # rows per optimizer step
    max_steps: int = 700  # the schedule's length when the time budget allows it
    lr: float = 5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    num_eval_rows: int = 64  # fixed held-out rows for the final loss
    log_every_steps: int = 25

    def __post_init__(self):
        if self.seq_len % 64:
            raise ValueError(f"seq_len={self.seq_len}: use a multiple of 64 (the GatedDeltaNet chunk size)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must divide by num_attention_heads={self.num_attention_heads}"
            )


def demo_target_config(settings: DemoTargetSettings, tokenizer: PreTrainedTokenizerFast) -> Qwen3_5TextConfig:
    """The hybrid target's transformers config (Qwen3.5 layout, tiny widths)."""
    hidden, heads = settings.hidden_size, settings.num_attention_heads
    return Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 4,
        linear_conv_kernel_dim=4,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(settings.num_hidden_layers)
        ],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


class ContinuationRows:
    """Random "continue this file" chat rows of exactly ``seq_len`` tokens, with labels.

    A row is a line-aligned prefix of a file in the user turn and the file's continuation as the
    assistant reply. Prompt and reply are tokenized separately, as at generation time. Files are
    drawn in proportion to their length. Labels are -100 on padding only.
    """

    def __init__(self, texts: list[str], tokenizer: PreTrainedTokenizerFast, seq_len: int):
        self.files = [text.splitlines(keepends=True) for text in texts if text.strip()]
        if not self.files:
            raise ValueError("the demo corpus is empty: no source file to train on")
        self.weights = [len(text) for text in texts if text.strip()]
        self.tokenizer = tokenizer
        self.seq_len = seq_len

    def row(self, rng: random.Random) -> tuple[list[int], list[int]]:
        lines = rng.choices(self.files, weights=self.weights)[0]
        start = 0 if rng.random() < 0.3 else rng.randrange(len(lines))
        # Prefixes of ~1/8 to ~5/8 of the row, in whole lines (~3 bytes a token). A prompt longer than
        # half the row is cut, chat header included: such rows teach plain code continuation.
        prefix_chars = rng.randint(self.seq_len * 3 // 8, self.seq_len * 15 // 8)
        end, size = start, 0
        while end < len(lines) and size < prefix_chars:
            size += len(lines[end])
            end += 1
        prefix = "".join(lines[start:end])
        think = EMPTY_THINK if rng.random() < 0.25 else ""
        prompt = f"<|im_start|>user\n{continuation_prompt(prefix)}<|im_end|>\n<|im_start|>assistant\n{think}"
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"][: self.seq_len // 2]
        # Enough text to fill the row (tokens average ~3 bytes; 8 bytes a token is ample).
        stop, size = end, 0
        while stop < len(lines) and size < 8 * self.seq_len:
            size += len(lines[stop])
            stop += 1
        reply = self.tokenizer("".join(lines[end:stop]), add_special_tokens=False)["input_ids"]
        if stop == len(lines) and len(ids) + len(reply) < self.seq_len:
            reply.append(self.tokenizer.eos_token_id)  # the file ends inside the row
        ids = (ids + reply)[: self.seq_len]
        labels = ids + [-100] * (self.seq_len - len(ids))
        ids = ids + [self.tokenizer.pad_token_id] * (self.seq_len - len(ids))
        return ids, labels

    def batch(self, rng: random.Random, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.row(rng) for _ in range(num_rows)]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


def lr_factor(progress: float, step: int, settings: DemoTargetSettings) -> float:
    """Linear warmup over steps, then cosine to ``min_lr_ratio`` over ``progress`` in [0, 1]."""
    warmup = min(1.0, (step + 1) / settings.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return warmup * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cosine)


def build_optimizer(model: torch.nn.Module, settings: DemoTargetSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norms, biases, decay/gate vectors are not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-token loss (nats) over fixed held-out rows, weighted by labelled tokens."""
    model.eval()
    total, count = 0.0, 0
    for ids, labels in batches:
        num_tokens = int((labels[:, 1:] != -100).sum())
        total += model(input_ids=ids, labels=labels).loss.item() * num_tokens
        count += num_tokens
    model.train()
    return total / max(count, 1)


def train_target(
    model: torch.nn.Module,
    rows: ContinuationRows,
    settings: DemoTargetSettings,
    *,
    seconds_budget: float,
    seed: int,
    log: Callable[[str], None],
) -> dict:
    """Train until ``max_steps`` or ``seconds_budget``, whichever ends first; the LR schedule follows
    whichever is further along, so a slow machine still ends on an annealed model."""
    rng = random.Random(seed)
    optimizer = build_optimizer(model, settings)
    model.train()
    start, start_cpu = time.perf_counter(), time.process_time()
    step, losses = 0, []
    while True:
        progress = max(step / settings.max_steps, (time.perf_counter() - start) / seconds_budget)
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * lr_factor(progress, step, settings)
        ids, labels = rows.batch(rng, settings.batch_size)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # host sync is free on CPU
        step += 1
        if step % settings.log_every_steps == 0:
            elapsed = time.perf_counter() - start
            recent = sum(losses[-settings.log_every_steps :]) / len(losses[-settings.log_every_steps :])
            tokens_per_s = step * settings.batch_size * settings.seq_len / elapsed
            log(f"demo target: step {step} loss {recent:.3f} {tokens_per_s:,.0f} tok/s {elapsed:.0f}s")
    tail = losses[-settings.log_every_steps :] or [float("nan")]
    return {
        "steps": step,
        "train_seconds": time.perf_counter() - start,
        # CPU seconds of this process: ~num_threads x train_seconds when it had the machine to itself.
        "train_cpu_seconds": time.process_time() - start_cpu,
        "final_train_loss": sum(tail) / len(tail),
    }


def build_demo_target(
    out_dir: str | Path,
    *,
    seconds_budget: float = 180.0,
    seed: int = 0,
    progress: bool = True,
    settings: DemoTargetSettings | None = None,
    train_files: list[Path] | None = None,
    eval_files: list[Path] | None = None,
) -> Path:
    """Train the demo target and publish it at ``out_dir`` atomically (temp dir, then rename).

    ``train_files``/``eval_files`` default to ``corpus.stdlib_files("train"/"eval")``. Raises
    ``FileExistsError`` if ``out_dir`` exists.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; remove it or choose another --out")
    settings = settings or DemoTargetSettings()
    train_files = stdlib_files("train") if train_files is None else train_files
    eval_files = stdlib_files("eval") if eval_files is None else eval_files

    def log(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        _build_into(staging, settings, train_files, eval_files, seconds_budget, seed, log)
        return _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename


def _build_into(
    directory: Path,
    settings: DemoTargetSettings,
    train_files: list[Path],
    eval_files: list[Path],
    seconds_budget: float,
    seed: int,
    log: Callable[[str], None],
) -> None:
    started = time.perf_counter()
    num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(num_threads)
    train_texts = [read_source(p) for p in train_files]
    log(f"demo target: training a {settings.vocab_size}-token BPE on {len(train_texts)} stdlib files")
    tokenizer = build_tokenizer(train_texts, vocab_size=settings.vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(demo_target_config(settings, tokenizer), dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    log(
        f"demo target: {num_params / 1e6:.2f}M-parameter hybrid, up to {settings.max_steps} steps "
        f"or {seconds_budget:.0f}s on {num_threads} threads"
    )
    rows = ContinuationRows(train_texts, tokenizer, settings.seq_len)
    stats = train_target(model, rows, settings, seconds_budget=seconds_budget, seed=seed, log=log)
    eval_rows = ContinuationRows([read_source(p) for p in eval_files], tokenizer, settings.seq_len)
    eval_rng = random.Random(1_000_003 + seed)
    eval_batches = [
        eval_rows.batch(eval_rng, min(settings.batch_size, settings.num_eval_rows - i))
        for i in range(0, settings.num_eval_rows, settings.batch_size)
    ]
    eval_loss = held_out_loss(model, eval_batches)
    log(f"demo target: held-out loss {eval_loss:.3f} (perplexity {math.exp(eval_loss):.1f})")
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    info = {
        **stats,
        "held_out_loss": eval_loss,
        "held_out_perplexity": math.exp(eval_loss),
        "num_parameters": num_params,
        "num_train_files": len(train_files),
        "num_eval_files": len(eval_files),
        "total_seconds": time.perf_counter() - started,
        "seconds_budget": seconds_budget,
        "num_threads": num_threads,
        "seed": seed,
        "settings": dataclasses.asdict(settings),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    # Written last: a directory with build_info.json is a complete build.
    (directory / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")


def _publish(staging: Path, out_dir: Path) -> Path:
    """Rename the finished build into place; if another process won the race, keep theirs."""
    try:
        os.rename(staging, out_dir)
    except OSError:
        if not (out_dir / "build_info.json").exists():
            raise
    return out_dir


def default_cache_dir() -> Path:
    """``$DFLASH_TRAIN_CACHE`` or ``~/.cache/dflash-train``."""
    root = os.environ.get("DFLASH_TRAIN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "dflash-train"


def main(argv: list[str] | None = None) -> None:
    """``python -m dflash_train.demo.target_build --out DIR``: build the demo target into DIR."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to create (must not exist)")
    parser.add_argument("--seconds", type=float, default=180.0, help="wall-clock training budget")
    parser.add_argument("--max-steps", type=int, default=DemoTargetSettings().max_steps)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = build_demo_target(
        args.out,
        seconds_budget=args.seconds,
        seed=args.seed,
        settings=DemoTargetSettings(max_steps=args.max_steps),
    )
    print(json.dumps(json.loads((out / "build_info.json").read_text()), indent=2))


if __name__ == "__main__":
    main()
