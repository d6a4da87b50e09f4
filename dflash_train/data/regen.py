"""``dflash-train regen``: replace a dataset's assistant turns with the target's own generations.

Why: the drafter learns to predict the target. Trained on human- or other-model-written replies it
learns a different distribution, and its acceptance at serving time is lower than its training
accuracy suggests. Regenerated, the training labels are what the target actually says, so
teacher-forced accuracy approximates real acceptance (and equals it for greedy decoding).

Each assistant turn is regenerated given the preceding, already regenerated turns (user, system
and tool turns are kept). A row with no assistant turn (a prompt-only dataset) gets one reply.
Output is JSONL in ``messages`` form; each row carries ``regen.key`` (source file name, line and a
hash of the source messages). The output is appended to and flushed per batch, so an interrupted
run resumes: rows whose key is already in the output are skipped, and a partially written last line
is cut off first. vLLM is used when installed and the device is CUDA (or when asked for);
otherwise batched transformers ``generate`` with left padding.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from dflash_train.data.readers import ChatRow, expand_paths, iter_chat_rows
from dflash_train.data.skips import SkipCounts
from dflash_train.data.tokenize import template_kwargs

THINKING = {"on": True, "off": False, "default": None}


def run_regen(args) -> dict[str, Any]:
    """Regenerate ``args.data`` into ``args.output``; see the ``regen`` CLI options."""
    output = Path(args.output)
    done = read_done_keys(output)
    skips = SkipCounts(max_bad_rows=args.max_bad_rows)
    rows = iter_chat_rows(expand_paths(list(args.data)), skips, require_assistant=False)
    if args.max_rows:
        rows = islice(rows, args.max_rows)
    todo, num_skipped = [], 0
    for row in rows:
        if row_key(row) in done:
            num_skipped += 1
        else:
            todo.append(row)
    engine = build_engine(args) if todo else None
    num_done, num_unfinished = 0, 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as out:
        for batch in chunked(todo, args.batch_size):
            for row, messages, finished in regenerate(engine, batch):
                out.write(json.dumps(output_row(row, messages, finished, args, engine.name)) + "\n")
                num_done, num_unfinished = num_done + 1, num_unfinished + (not all(finished))
            out.flush()
            os.fsync(out.fileno())  # a crash after this point never loses the batch
    return {
        "rows_done": num_done,
        "rows_skipped": num_skipped,
        "rows_hit_max_new_tokens": num_unfinished,
        "bad_rows": skips.to_dict(),
        "engine": engine.name if engine else "none",
        "output": str(output),
    }


# ----------------------------------------------------------------------------- resume


def row_key(row: ChatRow) -> str:
    digest = hashlib.sha1(json.dumps(row.messages, sort_keys=True).encode()).hexdigest()[:12]
    return f"{Path(row.source).name}:{row.line}:{digest}"


def read_done_keys(output: Path) -> set[str]:
    """Keys of rows already in ``output``; a torn last line (crash mid-write) is cut off."""
    if not output.is_file():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        print(f"regen: {output}: dropping a partially written last line", file=sys.stderr)
        with open(output, "r+b") as fh:
            fh.truncate(keep)
        data = data[:keep]
    keys = set()
    for line_no, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        try:
            keys.add(json.loads(line)["regen"]["key"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(
                f"{output}:{line_no}: not a regen output row ({type(err).__name__}); "
                "use a new --output file or remove the line"
            ) from err
    return keys


def output_row(row: ChatRow, messages: list[dict], finished: list[bool], args, engine: str) -> dict:
    meta = {
        "key": row_key(row),
        "source": row.source,
        "line": row.line,
        "target": args.target,
        "engine": engine,
        "temperature": args.temperature,
        "thinking": args.thinking,
        "finished": finished,  # False where the reply hit --max-new-tokens
    }
    extra = {k: v for k, v in (row.extra or {}).items() if k != "regen"}
    return {**extra, "messages": messages, "regen": meta}


def chunked(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), max(size, 1)):
        yield items[i : i + size]


# ----------------------------------------------------------------------------- generation


def regenerate(engine, rows: list[ChatRow]) -> list[tuple[ChatRow, list[dict], list[bool]]]:
    """Regenerate a batch turn by turn: turn t of every row is generated in one engine call."""
    conversations: list[list[dict]] = [[] for _ in rows]
    cursors = [0] * len(rows)
    finished: list[list[bool]] = [[] for _ in rows]
    while True:
        waiting = [i for i, row in enumerate(rows) if advance_to_reply(row, conversations[i], cursors, i)]
        if not waiting:
            break
        replies = engine.generate([conversations[i] for i in waiting])
        for i, (text, complete) in zip(waiting, replies):
            conversations[i].append({"role": "assistant", "content": text})
            finished[i].append(complete)
            cursors[i] += 1  # past the original assistant turn (or the end of a prompt-only row)
    return [(row, conv, fin) for row, conv, fin in zip(rows, conversations, finished)]


def advance_to_reply(row: ChatRow, conversation: list[dict], cursors: list[int], i: int) -> bool:
    """Copy non-assistant turns; True when the row needs a generated reply next."""
    messages = row.messages
    while cursors[i] < len(messages) and messages[cursors[i]]["role"] != "assistant":
        conversation.append(messages[cursors[i]])
        cursors[i] += 1
    if cursors[i] < len(messages):
        return True
    prompt_only = not any(m["role"] == "assistant" for m in messages)
    return prompt_only and cursors[i] == len(messages)  # one past the end once its reply exists


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_engine(args):
    """vLLM when allowed and usable, else transformers."""
    device = resolve_device(args.device)
    want_vllm = args.engine == "vllm" or (args.engine == "auto" and device.startswith("cuda"))
    if want_vllm:
        try:
            import vllm  # noqa: F401
        except ImportError as err:
            if args.engine == "vllm":
                raise ValueError(
                    "--engine vllm needs vLLM: pip install vllm (or use --engine transformers)"
                ) from err
        else:
            return VllmEngine(args)
    return TransformersEngine(args, device)


class TransformersEngine:
    """Batched ``generate`` with left padding; greedy at temperature 0."""

    name = "transformers"

    def __init__(self, args, device: str):
        import torch

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model, self.tokenizer = load_model(args.target, dtype, device)
        self.tokenizer.padding_side = "left"
        self.device, self.args = device, args
        self.template_kwargs = template_kwargs(THINKING[args.thinking])
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self.num_calls = 0

    def generate(self, conversations: list[list[dict]]) -> list[tuple[str, bool]]:
        import torch

        prompts = [
            self.tokenizer.apply_chat_template(
                c, tokenize=False, add_generation_prompt=True, **self.template_kwargs
            )
            for c in conversations
        ]
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(
            self.device
        )
        sampling = self.args.temperature > 0
        torch.manual_seed(self.args.seed + self.num_calls)  # sampled runs are reproducible per call
        self.num_calls += 1
        with torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=self.args.max_new_tokens,
                do_sample=sampling,
                temperature=self.args.temperature if sampling else None,
                top_p=None,
                top_k=None,
                eos_token_id=sorted(self.stop_ids),
                pad_token_id=self.tokenizer.pad_token_id,
            )
        return [self.decode(ids) for ids in out[:, enc["input_ids"].shape[1] :].tolist()]

    def decode(self, ids: list[int]) -> tuple[str, bool]:
        """Text before the first stop token; False when the reply ran out of new tokens."""
        stop = next((k for k, t in enumerate(ids) if t in self.stop_ids), None)
        reply = ids if stop is None else ids[:stop]
        return self.tokenizer.decode(reply, skip_special_tokens=False), stop is not None


def stop_token_ids(model, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    ids.discard(None)
    if not ids:
        raise ValueError("the target has no eos token; set eos_token_id in its generation_config.json")
    return ids


def load_model(path: str, dtype, device: str):
    """(model, tokenizer); prefers the project's target loader when it exists."""
    try:
        from dflash_train.models.target import load_causal_lm
    except ImportError:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(path)
    model, tokenizer = load_causal_lm(path, dtype=dtype, device=device)
    if tokenizer is None:
        raise ValueError(
            f"--target {path} has no tokenizer; regen needs the target's tokenizer and chat template"
        )
    return model.eval(), tokenizer


class VllmEngine:
    """vLLM offline generation; prompts are rendered with the target's own chat template."""

    name = "vllm"

    def __init__(self, args):
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=args.target, seed=args.seed)
        self.tokenizer = self.llm.get_tokenizer()
        self.params = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_new_tokens, seed=args.seed
        )
        self.template_kwargs = template_kwargs(THINKING[args.thinking])

    def generate(self, conversations: list[list[dict]]) -> list[tuple[str, bool]]:
        prompts = [
            self.tokenizer.apply_chat_template(
                c, tokenize=False, add_generation_prompt=True, **self.template_kwargs
            )
            for c in conversations
        ]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        return [(o.outputs[0].text, o.outputs[0].finish_reason == "stop") for o in outputs]
