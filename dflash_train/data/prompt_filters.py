"""Quality filters and de-duplication for synthesized prompts, each rejection counted by reason.

Reasons, in the order they are tested: ``hit_token_limit`` (no end-of-turn token within the limit),
``template_tokens`` (the text contains the template's own special tokens, e.g. it wrote a new
``<|im_start|>`` header), ``empty_or_short``, ``not_printable`` (under 95% printable characters,
U+FFFD from broken bytes included), ``exact_duplicate`` (same normalised text: NFKC, lower case,
punctuation dropped, whitespace collapsed) and ``near_duplicate`` (Jaccard similarity of the
normalised character 5-gram sets at or above the threshold with an earlier kept prompt). ``synth``
also counts ``reply_hit_token_limit`` (a reply between turns did not end), ``heldout_overlap`` (a
training prompt that is an exact or near duplicate of another task's held-out prompt),
``training_overlap`` (the converse, on a rerun that completes held-out files after training rows
were written) and, with
``--stop-loops``, ``looped`` / ``reply_looped`` (a user turn or a reply stopped as a repetition loop).

Near duplicates without pairwise comparison (locality-sensitive hashing): each prompt gets a
signature of 24 min-hashes of its 5-gram set (the crc32 of every 5-gram through 24 random
multiply-xorshift maps, the minimum of each), cut into 6 bands of 4. Kept prompts are indexed under
their 6 band keys; a new prompt is a candidate pair with prompts sharing a band (probability
1 - (1 - J^4)^6 at similarity J: 96% at 0.8, 99.8% at 0.9, 1% at 0.2), candidates agreeing on
fewer than half of the 24 min-hashes are dropped, and the rest are compared exactly (Jaccard on the
5-gram sets). So a rare near duplicate can slip through, a pair below the threshold is never
rejected, and common n-grams such as "how d" do not pile every prompt into one bucket.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections import Counter, defaultdict

import numpy as np

NGRAM = 5
NUM_BANDS, BAND_WIDTH = 6, 4
# Candidates whose signatures agree on fewer min-hashes than this are not compared exactly: a pair
# at similarity 0.8 agrees on under half of 24 with probability ~1e-4.
MIN_SIGNATURE_AGREEMENT = 0.5
_RNG = np.random.default_rng(20240617)  # fixed: signatures must agree across runs and resumes
HASH_MUL = _RNG.integers(1, 2**63, size=NUM_BANDS * BAND_WIDTH, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
HASH_ADD = _RNG.integers(0, 2**63, size=NUM_BANDS * BAND_WIDTH, dtype=np.uint64)
MIN_PRINTABLE = 0.95
REASONS = (
    "hit_token_limit",
    "template_tokens",
    "empty_or_short",
    "not_printable",
    "exact_duplicate",
    "near_duplicate",
    "reply_hit_token_limit",
    "heldout_overlap",
    "training_overlap",
    "looped",
    "reply_looped",
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
        self.signatures = np.zeros((1024, NUM_BANDS * BAND_WIDTH), dtype=np.uint64)  # grows by doubling
        self.index: defaultdict[tuple, list[int]] = defaultdict(list)
        self.last: tuple | None = None

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

    def features(self, text: str) -> tuple[str, frozenset[str], np.ndarray]:
        """(normalised text, 5-gram set, signature); the last one is reused by ``remember``."""
        if self.last is None or self.last[0] != text:
            norm = normalise(text)
            grams = shingles(norm)
            self.last = (text, norm, grams, min_hashes(grams))
        return self.last[1:]

    def duplicate_problem(self, text: str) -> str | None:
        """``exact_duplicate``/``near_duplicate`` against the kept prompts, or None."""
        norm, grams, signature = self.features(text)
        if norm in self.exact:
            return "exact_duplicate"
        candidates = sorted({c for key in band_keys(signature) for c in self.index.get(key, ())})
        if not candidates:
            return None
        agreement = (self.signatures[candidates] == signature[None, :]).mean(axis=1)
        for candidate in np.asarray(candidates)[agreement >= MIN_SIGNATURE_AGREEMENT].tolist():
            other = self.sets[candidate]
            if len(grams & other) / len(grams | other) >= self.threshold:
                return "near_duplicate"
        return None

    def remember(self, text: str) -> None:
        """Index a kept prompt (also used to rebuild the index when a run resumes)."""
        norm, grams, signature = self.features(text)
        row = len(self.sets)
        self.exact.add(norm)
        self.sets.append(grams)
        if row == len(self.signatures):
            self.signatures = np.concatenate([self.signatures, np.zeros_like(self.signatures)])
        self.signatures[row] = signature
        for key in band_keys(signature):
            self.index[key].append(row)

    def reject(self, reason: str) -> None:
        self.counts[reason] += 1

    def summary(self) -> dict[str, int]:
        return {reason: self.counts.get(reason, 0) for reason in REASONS}


def min_hashes(grams: frozenset[str]) -> np.ndarray:
    """The min-hash signature of an n-gram set: [NUM_BANDS * BAND_WIDTH] uint64 (stable across runs)."""
    base = np.fromiter((zlib.crc32(g.encode()) for g in grams), dtype=np.uint64, count=len(grams))
    with np.errstate(over="ignore"):  # multiplication modulo 2**64 is the point
        mixed = HASH_MUL[:, None] * base[None, :] + HASH_ADD[:, None]
    mixed ^= mixed >> np.uint64(29)
    return mixed.min(axis=1)


def band_keys(signature: np.ndarray) -> list[tuple]:
    """The index keys of a signature: (band, its BAND_WIDTH min-hashes) per band."""
    values = signature.tolist()
    return [(band, *values[band * BAND_WIDTH : (band + 1) * BAND_WIDTH]) for band in range(NUM_BANDS)]
