"""How prompt lookup and the drafter could share the rounds: rules beyond llama.cpp's "lookup
first", simulated along the target's greedy continuations (docs/quality.md, "Which proposal a round
takes").

Every rule is lossless at T = 0 and is judged by tau on the same continuations and the same drafter
blocks (``eval/exact.py``'s ``draft_all``, one block per candidate anchor); the lookup is llama.cpp's
``ngram-simple`` (``eval/ngram_simple.py``) with key size ``--key`` and at most ``--max-draft`` tokens.

- ``lookup``: the lookup alone (a round without a match verifies no draft)
- ``dflash``: the drafter alone
- ``lookup-first``: the lookup's draft when it has one, else the drafter's block (``ngram+dflash``)
- ``agree1`` / ``agree2``: the lookup's draft only when its first 1 / 2 tokens are the drafter's
- ``dflash+ext``: the drafter's block, then what the lookup copies after it (from the context with
  the block appended): the round verifies up to B - 1 + max-draft tokens
- ``lookup-first+ext``, ``agree1+ext``: the same rules with the drafter's block so extended
- ``oracle``: the better of the lookup's draft and the drafter's block, as verifying both as two
  branches of one tree would take (its drafted tokens: both); the bound of any rule that picks one
- ``lookup-overlap``, ``lookup-overlap-first``: ``lookup`` and ``lookup-first`` with the lookup's
  draft copied on past the end of the text to ``--max-draft`` tokens (an overlapping copy: in a loop
  of period p, token k is the one p back; llama.cpp stops at the text's end, p - 1 tokens)
- ``ngram``, ``ngram-overlap``: the eval's own baseline (``NgramProposer``, n = 3: the most recent
  match, B - 1 tokens padded with the last one) and the same match copied on instead of padded (the
  eval's ``ngram-overlap``; scripts/lookup_variants_cpu.py measures the two on regenerated rows
  without a drafter)

    python3 scripts/lookup_rules.py --target DIR --drafter EXPORT --prompts a.jsonl b.jsonl \\
        --num-prompts 24 --cache drafts.pt       # the drafts are kept; a rerun only simulates
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lookup_variants_cpu import LookupRules  # noqa: E402

from dflash_train.eval.command import check_drafter_fits, load_eval_drafter, load_eval_target  # noqa: E402
from dflash_train.eval.exact import draft_all, drafter_config  # noqa: E402
from dflash_train.eval.generate import greedy_continuations, pad_token_for  # noqa: E402
from dflash_train.eval.ngram_simple import NgramSimpleIndex, ngram_simple_draft  # noqa: E402
from dflash_train.eval.prompts import load_prompt_file  # noqa: E402
from dflash_train.eval.runner import default_eos_ids  # noqa: E402
from dflash_train.eval.simulate import copied_on, matched_prefix, simulate_rounds  # noqa: E402
from dflash_train.models.variant import drafted_tokens  # noqa: E402

RULES = (
    "lookup",
    "dflash",
    "lookup-first",
    "agree1",
    "agree2",
    "dflash+ext",
    "lookup-first+ext",
    "agree1+ext",
    "oracle",
    "lookup-overlap",
    "lookup-overlap-first",
    "ngram",
    "ngram-overlap",
)
NGRAM_N = 3  # the eval's --ngram-n default


def drafts_for(args) -> dict:
    """Prompts, greedy continuations and every anchor's drafter block (from ``--cache`` if there)."""
    if args.cache and Path(args.cache).is_file():
        return torch.load(args.cache)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target, tokenizer = load_eval_target(args.target, dtype, device)
    drafter = load_eval_drafter(args.drafter, device, dtype)
    frozen = check_drafter_fits(drafter_config(drafter), target, tokenizer)
    eos = default_eos_ids(target, tokenizer)
    pad = pad_token_for(tokenizer, eos)
    prompts, files = [], []
    for path in args.prompts:
        loaded = load_prompt_file(path, tokenizer, num_prompts=args.num_prompts)
        prompts += loaded.prompts
        files += [Path(path).stem] * len(loaded.prompts)
    common = {"max_new_tokens": args.max_new_tokens, "eos_token_ids": eos, "pad_token_id": pad}
    continuations = greedy_continuations(target, prompts, batch_size=args.batch_size, **common)
    timings = {"features": 0.0, "drafter": 0.0, "simulation": 0.0}
    drafts = draft_all(
        frozen, drafter, prompts, continuations, topk=0, budget=65536, timings=timings, **common
    )
    data = {
        "prompts": prompts, "continuations": continuations, "files": files, "eos": sorted(eos),
        "drafts": [d.tokens for d in drafts], "block_size": drafter_config(drafter).block_size,
    }  # fmt: skip
    if args.cache:
        torch.save(data, args.cache)
    return data


def simulate(rule: str, prompt, continuation, drafts, *, eos, block_size, key, max_draft, max_new_tokens):
    """One request under ``rule``: its ``Generation`` (rounds drafted and accepted)."""
    sequence = [*prompt, *continuation]
    index = NgramSimpleIndex(sequence, key, max_draft)
    ngram = LookupRules(sequence, NGRAM_N)

    def accept(out: int, max_drafts: int) -> tuple[int, int]:
        block = drafted_tokens(drafts[out - 1].tolist()[: block_size - 1])
        lookup = index.draft(len(prompt) + out)

        def verified(draft):
            draft = list(draft)[:max_drafts]
            return len(draft), matched_prefix(draft, continuation, out, eos)

        def extended(draft):  # the draft, then what the lookup copies after it
            context = [*sequence[: len(prompt) + out], *draft]
            return [*draft, *ngram_simple_draft(context, len(context), key, max_draft)]

        def both(first, second):  # two branches of one tree: both verified, the longer accepted
            return first[0] + second[0], max(first[1], second[1])

        def lookup_copied_on():  # ngram-simple's match, its copy continued past the text's end
            start = index.match(len(prompt) + out)
            return [] if start is None else copied_on(sequence, len(prompt) + out, start + key, max_draft)

        agrees = {n: bool(lookup) and lookup[:n] == block[:n] for n in (1, 2)}
        choices = {
            "lookup": lambda: verified(lookup) if lookup else (0, 0),
            "dflash": lambda: verified(block),
            "lookup-first": lambda: verified(lookup or block),
            "agree1": lambda: verified(lookup if agrees[1] else block),
            "agree2": lambda: verified(lookup if agrees[2] else block),
            "dflash+ext": lambda: verified(extended(block)),
            "lookup-first+ext": lambda: verified(lookup or extended(block)),
            "agree1+ext": lambda: verified(lookup if agrees[1] else extended(block)),
            "oracle": lambda: both(verified(lookup), verified(block)),
            "lookup-overlap": lambda: verified(lookup_copied_on()) if lookup else (0, 0),
            "lookup-overlap-first": lambda: verified(lookup_copied_on() if lookup else block),
            "ngram": lambda: verified(ngram.draft("recent", len(prompt) + out, block_size)),
            "ngram-overlap": lambda: verified(ngram.draft("periodic", len(prompt) + out, block_size)),
        }
        return choices[rule]()

    return simulate_rounds(continuation, max_new_tokens, eos, block_size + max_draft, accept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", nargs="+", required=True)
    parser.add_argument("--num-prompts", type=int, default=24, help="the first N of each file (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--key", type=int, default=4, help="ngram-simple's key size")
    parser.add_argument("--max-draft", type=int, default=48, help="ngram-simple's draft limit")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cache", default="", help="keep the continuations and drafts here")
    args = parser.parse_args()
    data = drafts_for(args)
    totals = defaultdict(lambda: [0, 0, 0])  # (rule, file) -> tokens, rounds, drafted
    for prompt, continuation, file, drafts in zip(
        data["prompts"], data["continuations"], data["files"], data["drafts"], strict=True
    ):
        for rule in RULES:
            gen = simulate(
                rule, prompt, continuation, drafts, eos=set(data["eos"]), block_size=data["block_size"],
                key=args.key, max_draft=args.max_draft, max_new_tokens=args.max_new_tokens,
            )  # fmt: skip
            for where in (file, "all"):
                total = totals[rule, where]
                total[0] += sum(a + 1 for a in gen.num_accepted)
                total[1] += len(gen.num_accepted)
                total[2] += sum(gen.num_drafted)
    files = [*dict.fromkeys(data["files"]), "all"]
    print(
        f"tau per round ({len(data['prompts'])} prompts, key {args.key}, lookup drafts <= {args.max_draft})"
    )
    width = max(map(len, RULES)) + 2
    print(f"{'rule':<{width}}" + "".join(f"{f[:11]:>12}" for f in files) + "  drafted/round")
    for rule in RULES:
        taus = "".join(f"{totals[rule, f][0] / max(totals[rule, f][1], 1):12.2f}" for f in files)
        print(f"{rule:<{width}}{taus}  {totals[rule, 'all'][2] / max(totals[rule, 'all'][1], 1):13.1f}")


if __name__ == "__main__":
    main()
