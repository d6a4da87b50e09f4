"""Bad-row accounting: every row that is dropped or changed is counted by reason, never silently.

Two kinds of reasons exist. *Bad rows* (malformed JSON, invalid UTF-8, no assistant turn, ...) are
defects of the data: they are skipped only while their total stays within ``data.max_bad_rows``;
the first one past the limit raises a ``ValueError`` that names the file and line and shows the
counts so far. *Policy outcomes* (over-long rows dropped or truncated by ``data.overlong``) are what
the user asked for: they are counted and reported but never count towards the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Defects of the data, limited by data.max_bad_rows.
BAD_ROW_REASONS = (
    "malformed_json",
    "invalid_utf8",
    "not_a_chat_row",
    "ambiguous_chat_row",
    "empty_messages",
    "unknown_role",
    "no_assistant_turn",
    "template_error",
    "no_response_tokens",
    "no_valid_anchor",
    "malformed_token_ids",
    "malformed_regen_finished",
)
# Outcomes of data.overlong, counted but not limited.
POLICY_REASONS = ("overlong_dropped", "overlong_truncated", "truncated_without_anchor")

REMEDIES = {
    "malformed_json": "fix or remove the line",
    "invalid_utf8": "re-encode the file as UTF-8",
    "not_a_chat_row": "give each row a 'messages' list (role/content) or a ShareGPT 'conversations' list",
    "ambiguous_chat_row": "keep one of 'messages' and 'conversations' per row, or set data.format to the one to read",
    "empty_messages": "remove rows without messages",
    "unknown_role": "use roles system/user/assistant/tool (ShareGPT: system/human/gpt)",
    "no_assistant_turn": "add an assistant turn or remove the row",
    "template_error": "check that the row fits the target's chat template",
    "no_response_tokens": "the assistant turns render to no tokens; remove the row",
    "no_valid_anchor": "a row needs at least 2 consecutive response tokens; remove the row",
    "malformed_token_ids": "store token_ids with their prompt (prompt_token_ids, or prompt_token_ids_from_previous and prompt_token_ids_tail) as regen writes them (docs/data.md), or remove them",
    "malformed_regen_finished": "give regen.finished one true/false per assistant message (docs/data.md), or remove it",
}


class BadRowError(ValueError):
    """One row that cannot be used, with the reason key and a human-readable explanation."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class SkipCounts:
    """Counts of skipped/changed rows by reason, enforcing ``max_bad_rows`` as rows arrive.

    ``examples`` keeps the first location per reason so a log line can point at a real row.
    """

    max_bad_rows: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    @property
    def num_bad_rows(self) -> int:
        return sum(n for reason, n in self.by_reason.items() if reason in BAD_ROW_REASONS)

    @property
    def num_skipped(self) -> int:
        """Rows that did not make it into the dataset (truncated rows are kept, so not counted)."""
        return sum(n for reason, n in self.by_reason.items() if reason != "overlong_truncated")

    def record(self, reason: str, where: str, detail: str = "") -> None:
        """Count one row; raise if it is a bad row and the limit is exceeded."""
        if reason not in BAD_ROW_REASONS and reason not in POLICY_REASONS:
            raise AssertionError(f"unknown skip reason {reason!r}")
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        self.examples.setdefault(reason, f"{where}: {detail}" if detail else where)
        if reason in BAD_ROW_REASONS and self.num_bad_rows > self.max_bad_rows:
            raise ValueError(self._limit_message(reason, where, detail))

    def _limit_message(self, reason: str, where: str, detail: str) -> str:
        remedy = REMEDIES.get(reason, "")
        head = f"{where}: bad row ({reason}): {detail}".rstrip(": ")
        if self.max_bad_rows == 0:
            return f"{head}. To fix: {remedy}, or allow skipping with data.max_bad_rows=N."
        return (
            f"{head}. Too many bad rows: {self.num_bad_rows} > data.max_bad_rows={self.max_bad_rows} "
            f"(counts {dict(sorted(self.by_reason.items()))}). To fix: {remedy}, or raise data.max_bad_rows."
        )

    def check_limit(self) -> None:
        """Raise if already over the limit (counts loaded from a cache built with a higher limit)."""
        if self.num_bad_rows > self.max_bad_rows:
            reason = next(r for r in BAD_ROW_REASONS if self.by_reason.get(r))
            where, _, detail = self.examples.get(reason, "").partition(": ")
            raise ValueError(self._limit_message(reason, f"{where} (first {reason} row)", detail))

    def merge(self, other: SkipCounts) -> None:
        for reason, n in other.by_reason.items():
            self.by_reason[reason] = self.by_reason.get(reason, 0) + n
        for reason, text in other.examples.items():
            self.examples.setdefault(reason, text)

    def to_dict(self) -> dict[str, int]:
        return dict(sorted(self.by_reason.items()))
