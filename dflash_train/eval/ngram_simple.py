"""llama.cpp's ``ngram-simple`` prompt lookup, the n-gram side of the eval's ``ngram+dflash``.

llama-server combines a draftless n-gram type with a draft model in one ``--spec-type`` list
(``ngram-simple,draft-dflash``): every round asks the n-gram type first and the drafter only when
the n-gram type proposed nothing (docs/evaluation.md, "Prompt lookup first, the drafter
otherwise", names the source files this follows). ``ngram-simple``'s rule, with key size n
(``--spec-ngram-simple-size-n``) and draft limit m (``--spec-ngram-simple-size-m``), for the
sequence ``ids[:length]`` whose last token is the one just sampled:

- the history is ``ids[:length - 1]``; with ``length - 1 <= n + m + 1`` tokens of it, no draft;
- the key is the last n tokens, ``ids[length - n : length]``;
- its latest earlier occurrence starts at the largest ``j`` with ``1 <= j <= length - n - 2``
  (position 0 is never a match; an occurrence ending right before the key's last token is not
  searched), none: no draft;
- the tokens of the history after that occurrence, ``min(m, length - 1 - j - n)`` of them, are the
  draft, unless fewer than n: then no draft (older occurrences are not tried);
- no padding: the draft has between n and m tokens; the server then cuts it to the request's
  remaining tokens minus one.

So a loop of period p <= n is never copied (its latest occurrence leaves p - 1 < n tokens), a
longer loop is copied p - 1 tokens at a time, and a round drafts up to m tokens, more than the
drafter's block when m > B - 1.

The eval can measure the combination at several key sizes in one run (``--ngram-min-match 3,4,6``):
the drafts are computed once and each key size is a host simulation. The first key size keeps the
name ``ngram+dflash``, which every earlier ``eval.json``, SERVING.md and serve-check know; each
further key size K is the method ``ngram+dflash@K`` (``combined_methods``).
"""

from __future__ import annotations

from collections.abc import Sequence

COMBINED_METHOD = "ngram+dflash"
LOOKUP_ALONE_METHOD = "ngram-simple"  # the lookup of COMBINED_METHOD alone (--ngram-simple)


def combined_methods(key_sizes: Sequence[int]) -> dict[str, int]:
    """The lookup-first methods of a key-size sweep, method name -> key size: ``ngram+dflash`` for
    the first, ``ngram+dflash@K`` for each further K. ``@`` reads "at key size"; it is no separator
    the eval uses elsewhere (``+`` joins the combined drafters, ``/`` the file in training metrics)."""
    first, *more = key_sizes
    return {COMBINED_METHOD: first, **{f"{COMBINED_METHOD}@{k}": k for k in more}}


def swept_key_size(method: str) -> int | None:
    """K of a method named ``ngram+dflash@K`` (K >= 1); None for every other name, ``ngram+dflash``
    included (its key size is the run's first, passed beside the method names)."""
    base, at, key = method.partition("@")
    if base != COMBINED_METHOD or not at or not key.isdecimal():
        return None
    size = int(key)
    return size if size >= 1 and method == f"{COMBINED_METHOD}@{size}" else None  # one spelling: no @03


def ngram_simple_draft(ids: Sequence[int], length: int, key_size: int, max_draft: int) -> list[int]:
    """The draft for ``ids[:length]`` by the rule above, searched directly (the reference the
    incremental ``NgramSimpleIndex`` is tested against)."""
    history = length - 1
    if history <= key_size + max_draft + 1:
        return []
    key = list(ids[length - key_size : length])
    for start in range(length - key_size - 2, 0, -1):
        if list(ids[start : start + key_size]) == key:
            count = min(max_draft, history - start - key_size)
            return list(ids[start + key_size : start + key_size + count]) if count >= key_size else []
    return []


class NgramSimpleIndex:
    """``ngram_simple_draft`` at increasing lengths of one sequence in O(key_size) per call: every
    key-size n-gram that may be a match (start 1 .. length - n - 2) is kept in a dict with its
    latest start, extended as the length grows."""

    def __init__(self, ids: Sequence[int], key_size: int, max_draft: int):
        if key_size < 1 or max_draft < 1:
            raise ValueError(
                f"ngram-simple key size {key_size}, draft limit {max_draft}: use >= 1 for both "
                "(llama.cpp's --spec-ngram-simple-size-n / -size-m)"
            )
        self.ids, self.key_size, self.max_draft = list(ids), key_size, max_draft
        self.latest: dict[tuple[int, ...], int] = {}
        self.next_start = 1  # position 0 is never a match
        self.asked = 0  # the longest length asked so far

    def draft(self, length: int) -> list[int]:
        """The draft for ``ids[:length]`` (empty when the rule proposes nothing)."""
        start = self.match(length)
        if start is None:
            return []
        copy = start + self.key_size
        return self.ids[copy : copy + min(self.max_draft, length - 1 - copy)]

    def match(self, length: int) -> int | None:
        """Where the key's occurrence that ``draft`` copies after starts (None: no draft)."""
        assert length >= self.asked, "NgramSimpleIndex only grows: ask increasing lengths"
        self.asked = length
        n, history = self.key_size, length - 1
        for start in range(self.next_start, length - n - 1):  # the starts 1 .. length - n - 2
            self.latest[tuple(self.ids[start : start + n])] = start
        self.next_start = max(self.next_start, length - n - 1)
        if history <= n + self.max_draft + 1:
            return None
        start = self.latest.get(tuple(self.ids[length - n : length]))
        if start is None or min(self.max_draft, history - start - n) < n:
            return None
        return start
