"""One KV sequence of a context, and the token bookkeeping that keeps it in sync.

A sequence remembers which tokens its KV cache holds, so callers hand it the whole token
context and it decodes only what is new, rolling back whatever diverged.
"""

from __future__ import annotations

from typing import ContextManager, Protocol, Sequence

import numpy as np

from ..errors import ContextOverflowError
from .usage import ModelUsage

Part = tuple["Seq", Sequence[int], Sequence[int]]  # (sequence, tokens at its next positions, rows wanted)


class Primer(Protocol):
    """What decodes a context's long prompts elsewhere and hands the KV cache over (llama/prefill.py)."""

    min_tokens: int

    def prime(self, seq: "Seq", tokens: Sequence[int], keep: int, last: bool = True) -> np.ndarray | None: ...
    def close(self) -> None: ...


class Context(Protocol):
    """What a sequence needs of the llama.cpp context it lives in (llama.model.LlamaModel)."""

    lock: ContextManager
    n_batch: int
    n_vocab: int
    usage: ModelUsage
    prefiller: Primer | None  # decodes long prompts for `prime`

    def run_batch(self, parts: Sequence[Part]) -> tuple[np.ndarray, float]: ...
    def kv_remove(self, seq_id: int, start: int) -> None: ...
    def kv_state_size(self, seq_id: int) -> int: ...
    def kv_state(self, seq_id: int, into: np.ndarray | None = None) -> memoryview: ...
    def kv_set_state(self, seq_id: int, data: bytes | memoryview) -> None: ...


class Seq:
    """One sequence of a model's KV cache: its id, the tokens it holds (position i = tokens[i]),
    its share of the context and of the decode work.

    It hands the model the whole token context and decodes only what is new, rolling back
    whatever diverged: that is how the draft, the slim verifier and the target stay in sync
    without re-prefilling each round.
    """

    def __init__(self, model: Context, seq_id: int, n_ctx: int) -> None:
        self.model, self.id, self.n_ctx = model, seq_id, n_ctx
        self.tokens: list[int] = []
        self.usage = ModelUsage()
        self._held: np.ndarray | None = None  # the last position's logits, kept by `prime` for the next eval

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def check_room(self, n: int) -> None:
        """The one "context window full" check: may `n` more tokens be decoded here?"""
        if len(self.tokens) + n > self.n_ctx:
            raise ContextOverflowError(f"context window full: {len(self.tokens)} + {n} tokens exceed the "
                                       f"sequence's n_ctx={self.n_ctx}; raise n_ctx (--ctx)")

    def commit(self, chunk: Sequence[int], seconds: float) -> None:
        """The tokens a decode put into this sequence's cache, and its share of the work."""
        self.tokens.extend(chunk)
        self.usage.calls += 1
        self.usage.tokens += len(chunk)
        self.usage.seconds += seconds

    def truncate(self, n: int) -> None:
        """Roll this sequence's KV back so that it holds its first `n` tokens."""
        if n < len(self.tokens):
            with self.model.lock:
                self.model.kv_remove(self.id, n)
            del self.tokens[n:]
            self._held = None

    def reset(self) -> None:
        self.truncate(0)

    def decode(self, tokens: Sequence[int], rows: Sequence[int] | str = "last") -> np.ndarray:
        """Append `tokens` at the next positions; logits for the asked rows (indices into `tokens`).

        `rows` is "last", "all", "none" or a sorted list of indices. Returns (len(rows), n_vocab)
        float32, a read-only view when the rows fall in one llama.cpp batch.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("decode needs at least one token")
        self._held = None
        want = row_indices(rows, n)
        self.check_room(n)
        model = self.model
        out = None
        filled = 0
        for start in range(0, n, model.n_batch):
            chunk = tokens[start:start + model.n_batch]
            chunk_rows = [r - start for r in want if start <= r < start + len(chunk)]
            with model.lock:
                view, seconds = model.run_batch(((self, chunk, chunk_rows),))
                self.commit(chunk, seconds)
            if chunk_rows and len(chunk_rows) == len(want):
                return view
            if chunk_rows:
                if out is None:
                    out = np.empty((len(want), model.n_vocab), dtype=np.float32)
                out[filled:filled + len(chunk_rows)] = view
                filled += len(chunk_rows)
        return out if out is not None else np.empty((0, model.n_vocab), dtype=np.float32)

    def plan_prefill(self, tokens: Sequence[int]) -> Sequence[int]:
        """Roll back to the common prefix with `tokens`; what is left to decode."""
        keep = common_prefix(self.tokens, tokens)
        self.truncate(keep)
        return tokens[keep:]

    def primer(self, n_new: int) -> Primer | None:
        """The prefiller that decodes `n_new` new prompt tokens for this sequence, if one takes them."""
        p = self.model.prefiller
        return p if p is not None and n_new >= p.min_tokens else None

    def prefill(self, tokens: Sequence[int]) -> None:
        """Make the KV cache hold exactly `tokens`, computing no logits."""
        missing = self.plan_prefill(tokens)
        primer = self.primer(len(missing))
        if primer is not None:  # a long prompt, decoded faster elsewhere
            primer.prime(self, tokens, len(tokens) - len(missing), last=False)
        elif missing:
            self.decode(missing, "none")

    def prime(self, tokens: Sequence[int]) -> None:
        """Make the KV cache hold exactly `tokens` and keep the last position's logits, so that the
        next `eval(tokens)` costs nothing: a prompt and its first answer token's logits in one
        decode, as llama.cpp's own server runs them, not a prefill then a decode of the last
        token (one step more before the first token)."""
        keep = min(common_prefix(self.tokens, tokens), len(tokens) - 1)
        self.truncate(keep)
        primer = self.primer(len(tokens) - keep)
        if primer is not None:  # a long prompt, decoded faster elsewhere
            self._held = primer.prime(self, tokens, keep)
        else:
            self._held = np.array(self.decode(tokens[keep:], "last"))

    def plan_eval(self, tokens: Sequence[int], n_rows: int) -> tuple[Sequence[int], list[int]]:
        """Roll back for an eval of `tokens`: (tokens to decode, their rows to return)."""
        n = len(tokens)
        if not 1 <= n_rows <= n:
            raise ValueError(f"n_rows must be in 1..{n}")
        keep = reuse_point(self.tokens, tokens, n_rows)
        self.truncate(keep)
        missing = tokens[keep:]
        first_row = len(missing) - n_rows
        return missing, list(range(first_row, len(missing)))

    def eval(self, tokens: Sequence[int], n_rows: int = 1) -> np.ndarray:
        """Make the KV cache hold exactly `tokens`; logits of its last `n_rows` positions.

        Reuses the longest common prefix already in the cache, rolls back the rest and decodes
        what is missing in one batch. Row j predicts the token after tokens[len - n_rows + j].
        """
        held, extra = self._held, len(tokens) - len(self.tokens)
        if held is not None and n_rows == extra + 1 and common_prefix(self.tokens, tokens) == len(self.tokens):
            # the first row is the one `prime` kept: decode only what follows (a first draft to verify)
            return held if extra == 0 else np.concatenate([held, self.decode(tokens[len(self.tokens):], "all")])
        return self.decode(*self.plan_eval(tokens, n_rows))

    # ---- state (KV import for prefix slims) -----------------------------------------------------
    def state(self, into: np.ndarray | None = None) -> memoryview:
        """This sequence's KV state (llama.cpp's serialization), in `into` if given (at least
        `state_size()` long)."""
        with self.model.lock:
            return self.model.kv_state(self.id, into)

    def state_size(self) -> int:
        with self.model.lock:
            return self.model.kv_state_size(self.id)

    def set_state(self, data: bytes | memoryview, tokens: Sequence[int]) -> None:
        """Replace this sequence's KV with `data` (another context's `state()` holding `tokens`)."""
        self.reset()
        try:
            with self.model.lock:
                self.model.kv_set_state(self.id, data)
            self.tokens = list(tokens)
        except BaseException:  # refused or interrupted (Ctrl-C): leave it empty, never out of step
            with self.model.lock:
                self.model.kv_remove(self.id, 0)
            self.tokens = []
            raise
        self._held = None


def row_indices(rows: Sequence[int] | str, n: int) -> list[int]:
    """Which of `n` decoded tokens get logits: "last", "all", "none" or the indices given."""
    if rows == "last":
        return [n - 1]
    if rows == "all":
        return list(range(n))
    if rows == "none":
        return []
    return list(rows)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the shared prefix; contexts usually differ only near the end, so compare the
    bulk as slices (C speed) and walk only the tail in Python."""
    n = min(len(a), len(b))
    lo = 0
    for probe in (n, n - 64, n - 1024):
        if probe > 0 and a[:probe] == b[:probe]:
            lo = probe
            break
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo


def reuse_point(cached: Sequence[int], tokens: Sequence[int], n_rows: int) -> int:
    """How much of a cache holding `cached` an eval of `tokens` keeps: the common prefix, but never
    the positions whose rows are asked for (their logits must be computed)."""
    return min(common_prefix(cached, tokens), len(tokens) - n_rows)
