"""One status line on stderr for long steps (downloads, hashing, deriving formats, benchmarks,
model loading): rewritten in place on a terminal; in a log or a pipe, where every `\\r` update
would be kept, one line per tenth of the work instead."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class StatusLine:
    def __init__(self, quiet: bool = False, stream: TextIO | None = None, interval: float = 0.2) -> None:
        self.quiet, self.interval = quiet, interval
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._last = float("-inf")  # time of the last rewrite (terminal)
        self._tenth = -1            # last tenth written (log)
        self._ended = False

    def show(self, frac: float, text: str) -> None:
        """`text` as the state at `frac` (0..1) of the work; the line ends when `frac` reaches 1."""
        if self.quiet or self._ended:
            return
        done = frac >= 1.0
        if self.tty:
            now = time.monotonic()
            if not done and now - self._last < self.interval:
                return
            self._last = now
            self.stream.write("\r" + text + ("\n" if done else ""))
        else:
            tenth = min(int(frac * 10), 10)
            if tenth <= self._tenth:
                return
            self._tenth = tenth
            self.stream.write(text + "\n")
        self._ended = done
        self.stream.flush()

    def end(self) -> None:
        """Close a line that stopped short of 1 (an error, or a total that was an estimate)."""
        if not self.quiet and not self._ended and self.tty and self._last > float("-inf"):
            self.stream.write("\n")
            self.stream.flush()
        self._ended = True
