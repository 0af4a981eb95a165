"""What a copy can come from, indexed: `NgramIndex` over a token list, and `CopySource`, the
tokens beside the context a copy may come from (a request's prediction, a copy-memory entry)."""

from __future__ import annotations

from typing import Sequence

from .spec import NGRAM_LIMIT

REQUEST_N = 8        # requests are compared by their distinct 8-grams ...
REQUEST_SHARED = 48  # ... and one repeats another only if it shares at least this many (see `repeats`)


class NgramIndex:
    """Every n-gram (n = 1..NGRAM_LIMIT) of a token list, mapped to the position right after its
    latest occurrence whose continuation is known. Updated per appended token (no rescans): the
    n-grams ending at the previous token are entered when the next one arrives, so the context's
    own suffix is never its own match.
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(NGRAM_LIMIT + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        toks, i = self.tokens, len(self.tokens)
        for n in range(1, min(NGRAM_LIMIT, i) + 1):
            self._after[n][tuple(toks[i - n:i])] = i
        toks.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def longest_match(self, n_max: int, n_min: int = 1) -> tuple[int, int] | None:
        """(n, position after the latest earlier occurrence of the last n tokens) for the largest
        n in n_min..n_max that occurs earlier, or None."""
        toks = self.tokens
        return self.find([tuple(toks[len(toks) - n:]) for n in range(min(n_max, NGRAM_LIMIT, len(toks) - 1), n_min - 1, -1)])

    def find(self, keys: Sequence[tuple[int, ...]]) -> tuple[int, int] | None:
        """(n, position after the latest occurrence) of the first of `keys` (n-grams, longest
        first) that occurs here with a known continuation, or None."""
        for key in keys:
            at = self._after[len(key)].get(key)
            if at is not None:
                return len(key), at
        return None

    def snapshot(self) -> list[dict[tuple[int, ...], int]]:
        """The tables, for comparing an incrementally built index with one built from scratch."""
        return [dict(d) for d in self._after]


def request_grams(prompt: Sequence[int]) -> frozenset[int]:
    """The prompt's distinct REQUEST_N-grams (hashed): what `repeats` compares two requests by."""
    return frozenset(hash(tuple(prompt[i:i + REQUEST_N])) for i in range(len(prompt) - REQUEST_N + 1))


def repeats(prompt: frozenset, earlier: frozenset) -> bool:
    """Whether a request mostly repeats an earlier one (an agent asking for the same file again
    with a change): half its n-grams and at least REQUEST_SHARED of them are the earlier's. The
    chat template and a system prompt share about 20 (Spec-Bench's short questions share up to
    58% with other prompts); two edit requests with the same instruction, 2-8%; an agent's
    follow-ups, 76-100% (docs/benchmarks.md section 55)."""
    shared = len(prompt & earlier)
    return shared >= REQUEST_SHARED and 2 * shared >= len(prompt)


class CopySource:
    """Tokens a copy may come from beside the context: a request's prediction (OpenAI's Predicted
    Outputs) or an entry of the engine's copy memory. Indexed once, on first use, then read only,
    so one source serves every slot at once.

    A memory entry starts with the last `lead` tokens of the prompt it answered, and keeps that
    prompt's `request_grams`: a match reaching back into the lead counts only for a request that
    `repeats` it (others share the instruction's last words, not the answer)."""

    def __init__(self, kind: str, tokens: Sequence[int], lead: int = 0,
                 request: frozenset[int] = frozenset()) -> None:
        self.kind = kind
        self.tokens = list(tokens)
        self.lead, self.request = lead, request
        self._index: NgramIndex | None = None

    @property
    def index(self) -> NgramIndex:
        if self._index is None:
            self._index = NgramIndex(self.tokens)
        return self._index
