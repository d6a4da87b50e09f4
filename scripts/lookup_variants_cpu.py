"""How much prompt lookup the eval's ``ngram`` baseline leaves in loops, on the target's own replies.

The eval's ``ngram`` (``NgramProposer``) copies what followed the most recent earlier match of the
last n tokens and pads the block with the last copied token; inside a loop of period p < B-1 that
match lies p tokens back, so it copies p tokens and pads. Two other rules on the same matches:
``periodic`` copies on past the end of the text, each token p back (an overlapping copy, as the loop
continues: the eval's method ``ngram-overlap``, ``NgramIndex.propose_copied_on``), and ``earliest``
copies after the first occurrence instead of the latest. Each is simulated over regenerated rows
(the target's greedy replies, re-tokenized; one-turn rows, a spread sample) with the eval's round
bookkeeping (``eval/simulate.py``), block 16, at most 512 reply tokens.

    python3 scripts/lookup_variants_cpu.py --tokenizer DIR --rows R.part00.jsonl.xz ... --sample 1500
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_train.eval.simulate import NgramIndex, padded_block, simulate_chain  # noqa: E402

RULES = ("recent", "periodic", "earliest")


class LookupRules(NgramIndex):
    """The eval's most-recent-match index, plus the earliest start of every n-gram (``first``)."""

    def __init__(self, ids: Sequence[int], n: int):
        super().__init__(ids, n)
        self.first: list[dict[tuple[int, ...], int]] = [{} for _ in range(n + 1)]

    def _index_until(self, end: int) -> None:
        for stop in range(self.indexed + 1, end + 1):
            for size in range(1, self.n + 1):
                if stop - size >= 0:
                    self.first[size].setdefault(tuple(self.ids[stop - size : stop]), stop - size)
        super()._index_until(end)

    def draft(self, rule: str, length: int, block_size: int) -> list[int]:
        """B-1 draft tokens for ``ids[:length]`` by ``rule``."""
        if rule == "recent":
            return self.propose(length, block_size)
        if rule == "periodic":
            return self.propose_copied_on(length, block_size)
        src = self.source(length, self.first)
        if src is None:
            return [self.ids[length - 1]] * (block_size - 1)
        return padded_block(self.ids[src:length][: block_size - 1], block_size)


def lookup_taus(
    prompt: Sequence[int],
    reply: Sequence[int],
    eos: set[int],
    n: int = 3,
    block_size: int = 16,
    limit: int = 512,
) -> dict[str, float]:
    """tau of each rule over one reply (tokens per round; the eval's ``simulate_chain``)."""
    taus = {}
    for rule in RULES:
        index = LookupRules([*prompt, *reply], n)
        gen = simulate_chain(
            reply,
            lambda out, r=rule, i=index: i.draft(r, len(prompt) + out, block_size),
            block_size=block_size,
            max_new_tokens=limit,
            eos_token_ids=eos,
        )
        taus[rule] = gen.tau
    return taus


def lines_of_parts(parts: list[str]) -> Iterator[str]:
    """The lines of one xz stream split into parts (``regen-rows.partNN.jsonl.xz``), read in order."""
    decompressor, pending = lzma.LZMADecompressor(), b""
    for part in parts:
        with open(part, "rb") as stream:
            while chunk := stream.read(1 << 20):
                *lines, pending = (pending + decompressor.decompress(chunk)).split(b"\n")
                yield from (line.decode("utf-8") for line in lines)
    if pending:
        yield pending.decode("utf-8")


def one_turn_rows(parts: list[str], every: int, sample: int) -> Iterator[list[dict]]:
    seen = kept = 0
    for line in lines_of_parts(parts):
        messages = json.loads(line)["messages"]
        if len(messages) != 2 or messages[1]["role"] != "assistant":
            continue
        seen += 1
        if seen % every == 0:
            yield messages
            kept += 1
            if kept == sample:
                return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="the target's HF directory")
    p.add_argument(
        "--rows",
        action="append",
        required=True,
        help="the parts of the regenerated rows' .jsonl.xz, in order (repeatable)",
    )
    p.add_argument("--sample", type=int, default=1500)
    p.add_argument("--every", type=int, default=37, help="take every Nth one-turn row")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    per_rule: dict[str, list[float]] = {rule: [] for rule in RULES}
    for messages in one_turn_rows(args.rows, args.every, args.sample):
        prompt = list(
            tok.apply_chat_template(
                messages[:1], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        reply = tok(messages[1]["content"], add_special_tokens=False)["input_ids"][:511] + [end]
        for rule, tau in lookup_taus(prompt, reply, {end}).items():
            per_rule[rule].append(tau)
    base = statistics.mean(per_rule["recent"])
    result = {
        rule: {
            "rows": len(t),
            "tau": round(statistics.mean(t), 3),
            "vs_recent": round(statistics.mean(t) / base, 3),
        }
        for rule, t in per_rule.items()
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
