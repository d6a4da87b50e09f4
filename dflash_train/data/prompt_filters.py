"""Quality filters and de-duplication for synthesized prompts, each rejection counted by reason.

Reasons, in the order they are tested: ``hit_token_limit`` (no end-of-turn token within the limit),
``template_tokens`` (the text contains the template's own special tokens, e.g. it wrote a new
``<|im_start|>`` header), ``empty_or_short``, ``not_printable`` (under 95% printable characters,
U+FFFD from broken bytes included), ``exact_duplicate`` (same normalised text: NFKC, lower case,
punctuation dropped, whitespace collapsed) and ``near_duplicate`` (Jaccard similarity of the
normalised character 5-gram sets at or above the threshold with an earlier kept prompt).

Near duplicates without pairwise comparison: each kept prompt is indexed under its few n-grams with
the smallest (crc32) hashes; a new prompt is compared exactly only with the prompts that share one
of its own smallest n-grams. Two sets of Jaccard similarity J share their smallest-hash n-gram with
probability J, and the chance that none of the 4 smallest agrees is small (about (1-J)^4: 0.2% at
0.8), so a rare near duplicate can slip through, while a pair below the threshold is never rejected.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections import Counter, defaultdict

NGRAM = 5
INDEX_KEYS = 4
MIN_PRINTABLE = 0.95
REASONS = (
    "hit_token_limit",
    "template_tokens",
    "empty_or_short",
    "not_printable",
    "exact_duplicate",
    "near_duplicate",
    "reply_hit_token_limit",
)
NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalise(text: str) -> str:
    """Case- and punctuation-insensitive form used for duplicate detection."""
    return " ".join(NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower()).split())


def shingles(normalised: str) -> frozenset[str]:
    """Character 5-grams (the whole text when shorter)."""
    if len(normalised) <= NGRAM:
        return frozenset([normalised])
    return frozenset(normalised[i : i + NGRAM] for i in range(len(normalised) - NGRAM + 1))


def printable_fraction(text: str) -> float:
    """Share of characters that are printable or ordinary whitespace (U+FFFD counts as not)."""
    if not text:
        return 0.0
    good = sum(1 for c in text if (c.isprintable() or c in "\n\t") and c != "\ufffd")
    return good / len(text)


class PromptFilter:
    """Decides keep/reject for each prompt and remembers kept ones for de-duplication."""

    def __init__(self, template_texts: list[str], min_chars: int, near_dup_threshold: float):
        if not 0 < near_dup_threshold <= 1:
            raise ValueError(f"near_dup_threshold {near_dup_threshold}: use a similarity in (0, 1]")
        self.template_texts = [t for t in template_texts if t]
        self.min_chars, self.threshold = min_chars, near_dup_threshold
        self.counts: Counter[str] = Counter()
        self.exact: set[str] = set()
        self.sets: list[frozenset[str]] = []
        self.index: defaultdict[int, list[int]] = defaultdict(list)

    def text_problem(self, text: str, finished: bool, special_ids_seen: bool) -> str | None:
        """The first per-text rejection reason of one user turn, or None."""
        if not finished:
            return "hit_token_limit"
        if special_ids_seen or any(t in text for t in self.template_texts):
            return "template_tokens"
        if len(text.strip()) < self.min_chars:
            return "empty_or_short"
        if printable_fraction(text) < MIN_PRINTABLE:
            return "not_printable"
        return None

    def duplicate_problem(self, text: str) -> str | None:
        """``exact_duplicate``/``near_duplicate`` against the kept prompts, or None."""
        norm = normalise(text)
        if norm in self.exact:
            return "exact_duplicate"
        grams = shingles(norm)
        for candidate in {c for key in index_keys(grams) for c in self.index.get(key, ())}:
            other = self.sets[candidate]
            if len(grams & other) / len(grams | other) >= self.threshold:
                return "near_duplicate"
        return None

    def remember(self, text: str) -> None:
        """Index a kept prompt (also used to rebuild the index when a run resumes)."""
        norm = normalise(text)
        grams = shingles(norm)
        self.exact.add(norm)
        self.sets.append(grams)
        for key in index_keys(grams):
            self.index[key].append(len(self.sets) - 1)

    def reject(self, reason: str) -> None:
        self.counts[reason] += 1

    def summary(self) -> dict[str, int]:
        return {reason: self.counts.get(reason, 0) for reason in REASONS}


def index_keys(grams: frozenset[str]) -> list[int]:
    """The few smallest stable hashes of an n-gram set (Python's ``hash`` is salted per process)."""
    return sorted(zlib.crc32(g.encode()) for g in grams)[:INDEX_KEYS]
