"""The copy memory: recent answers and predictions of the engine's own requests, kept as copy
sources for the requests after them.

An agent that asks for the same file again, or sends its next turn without the history, gets
drafts from what was already produced. Drafts are verified like any copy, so the output is
unchanged; the memory only decides what can be drafted. It lives in the process and is bounded
in tokens and entries, oldest dropped first.
"""

from __future__ import annotations

import threading
from typing import Sequence

from ..errors import InvalidParameterError
from .sources import CopySource, request_grams

DEFAULT_TOKENS = 8192  # Engine's and the CLI's default (docs/benchmarks.md: measured before it was turned on)
MAX_ENTRIES = 16   # entries kept at most, whatever their length
MIN_TOKENS = 16    # shorter answers are not worth an entry: a copy that short rarely pays
LEAD = 32          # prompt tokens kept before an answer (docs/benchmarks.md section 55)


class CopyMemory:
    def __init__(self, max_tokens: int, max_entries: int = MAX_ENTRIES) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidParameterError(f"copy_memory must be a number of tokens >= 0 (0 = off), got {max_tokens!r}")
        self.max_tokens, self.max_entries = max_tokens, max_entries
        self._entries: list[CopySource] = []  # newest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return sum(len(e.tokens) for e in self._entries)

    def sources(self) -> list[CopySource]:
        """The entries, newest first (a copy anchors on the newest of equally long matches)."""
        with self._lock:
            return list(self._entries)

    def add(self, tokens: Sequence[int], lead: Sequence[int] = ()) -> None:
        """Keep `tokens` as the newest entry (an equal one moves to the front), then drop the
        oldest until both bounds hold. Text longer than the whole memory keeps its end.

        `lead` is the prompt the tokens answered: its last LEAD tokens go in front of them, so an
        answer to a request that repeats this one (an agent asking for the same file again with a
        change) is drafted from its first token, not after MEMORY_RUN tokens of its own."""
        if len(tokens) < MIN_TOKENS or not self.max_tokens:
            return
        answer = list(tokens)
        tokens = (list(lead)[max(0, len(lead) - LEAD):] + answer)[-self.max_tokens:]
        n_lead = max(0, len(tokens) - len(answer))
        entry = CopySource("memory", tokens, n_lead, request_grams(lead) if n_lead else frozenset())
        with self._lock:
            self._entries = [e for e in self._entries if e.tokens != tokens]
            self._entries.insert(0, entry)
            total = sum(len(e.tokens) for e in self._entries)
            while len(self._entries) > self.max_entries or total > self.max_tokens:
                total -= len(self._entries.pop().tokens)

    def clear(self) -> None:
        with self._lock:
            self._entries = []

    def copy(self) -> "CopyMemory":
        """The same entries in a memory of their own (entries are immutable, so they are shared)."""
        twin = CopyMemory(self.max_tokens, self.max_entries)
        twin._entries = self.sources()
        return twin
