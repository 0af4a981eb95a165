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
from .drafters import CopySource

DEFAULT_TOKENS = 8192  # Engine's and the CLI's default (docs/benchmarks.md: measured before it was turned on)
MAX_ENTRIES = 16   # entries kept at most, whatever their length
MIN_TOKENS = 16    # shorter answers are not worth an entry: a copy that short rarely pays


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

    def add(self, tokens: Sequence[int]) -> None:
        """Keep `tokens` as the newest entry (an equal one moves to the front), then drop the
        oldest until both bounds hold. Text longer than the whole memory keeps its end."""
        tokens = list(tokens)[-self.max_tokens:] if self.max_tokens else []
        if len(tokens) < MIN_TOKENS:
            return
        with self._lock:
            self._entries = [e for e in self._entries if e.tokens != tokens]
            self._entries.insert(0, CopySource("memory", tokens))
            total = sum(len(e.tokens) for e in self._entries)
            while len(self._entries) > self.max_entries or total > self.max_tokens:
                total -= len(self._entries.pop().tokens)

    def clear(self) -> None:
        with self._lock:
            self._entries = []
