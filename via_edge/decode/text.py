"""Turning token bytes into text as it streams: whole UTF-8 characters only, stop strings held back."""

from __future__ import annotations

import codecs
from typing import Sequence


class StreamDecoder:
    """Bytes in, text out; an incomplete UTF-8 sequence waits for the bytes that complete it."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._dec.decode(data)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class StopMatcher:
    """Finds the first stop string in streamed text and holds back any tail that could start one.

    `feed` returns the text that is safe to show now and whether a stop string was found (the
    text before it is returned, the stop string itself and anything after are dropped).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return buf[: min(hits)], True
        cut = len(buf)
        # keep the longest suffix that is a prefix of some stop string
        for k in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                cut = len(buf) - k
                break
        self._pending = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
