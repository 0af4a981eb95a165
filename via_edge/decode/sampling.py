"""Sampling parameters and the token distributions every decoding mode shares.

The filters follow llama.cpp's default chain (top-k, top-p, min-p on the untempered softmax, then
temperature), so the same parameters mean the same thing as in llama-cli. `temperature == 0`
means greedy. Speculative modes apply the identical transform to draft and target rows, which
keeps the Leviathan/Chen acceptance rule exact for the filtered distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..errors import InvalidParameterError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidParameterError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidParameterError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise InvalidParameterError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and self.seed < 0:
            raise InvalidParameterError(f"seed must be >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)



SAMPLING_NAMES = tuple(f.name for f in fields(SamplingParams))  # how every surface spells them

def ratio_to_top(row: np.ndarray, token: int) -> float:
    """p(token) / max p under the untempered softmax: a confidence score that needs no full softmax."""
    return float(np.exp(np.float64(row[token]) - np.float64(row.max())))


def top_prob(row: np.ndarray) -> tuple[int, float]:
    """The argmax and its untempered probability (one float32 pass over the row, no copy kept)."""
    best = int(row.argmax())
    return best, float(1.0 / np.exp(row - row[best], dtype=np.float32).sum(dtype=np.float64))


@dataclass(frozen=True)
class Dist:
    """A distribution to sample from, held on its support only: `p` over the sorted token ids
    `ids`, or over the whole vocabulary (`ids` None, `p[token]`) when no filter cut it.

    With top-k, top-p or min-p the support is a few dozen tokens, so drawing a token, reading
    p(token) and forming the rejection residual cost that much, not a pass over 151,936 entries.
    Draws walk the support in token order, as a full-vocabulary array would.
    """

    p: np.ndarray
    ids: np.ndarray | None = None

    def prob(self, token: int) -> float:
        if self.ids is None:
            return float(self.p[token])
        j = int(np.searchsorted(self.ids, token))
        return float(self.p[j]) if j < self.ids.size and self.ids[j] == token else 0.0

    def sample(self, rng: np.random.Generator) -> int:
        cum = np.cumsum(self.p, dtype=np.float64)
        j = int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), self.p.size - 1))
        return j if self.ids is None else int(self.ids[j])

    def residual(self, q: "Dist") -> "Dist":
        """The sd rule's fallback after rejecting a draft drawn from q: max(0, p - q)
        renormalised; p itself when nothing is left. (A copy's point mass needs none: loop._verify.)"""
        r = np.array(self.p, dtype=np.float64)
        if self.ids is None:
            if q.ids is None:
                r -= q.p
            else:
                r[q.ids] -= q.p
        else:
            r -= q.probs_at(self.ids)
        np.maximum(r, 0.0, out=r)
        total = r.sum()
        return Dist(r / total, self.ids) if total > 0 else self

    def probs_at(self, tokens: np.ndarray) -> np.ndarray:
        if self.ids is None:
            return self.p[tokens]
        j = np.minimum(np.searchsorted(self.ids, tokens), self.ids.size - 1)
        return np.where(self.ids[j] == tokens, self.p[j], 0.0)

    def dense(self, n_vocab: int) -> np.ndarray:
        """The full-vocabulary array (for tests and references)."""
        if self.ids is None:
            return np.asarray(self.p)
        out = np.zeros(n_vocab, dtype=self.p.dtype)
        out[self.ids] = self.p
        return out


def dist(row: np.ndarray, sp: SamplingParams) -> Dist:
    """The distribution `sp` samples from for a logits row.

    Filters work on logits (the softmax is monotone), so top-k touches the row once and the
    softmax runs over the kept candidates only; only a bare temperature pays a full-row exp.
    """
    x = np.asarray(row, dtype=np.float32)
    top = x.max()
    cand = None
    if sp.top_k and sp.top_k < x.size:
        cand = np.argpartition(x, x.size - sp.top_k)[x.size - sp.top_k:]
    if sp.top_p < 1.0:
        cand = _top_p_keep(x, top, cand, sp.top_p)
    floor = top + np.float32(np.log(sp.min_p)) if sp.min_p > 0 else None  # p >= min_p * max p
    if cand is None and floor is not None:
        cand = np.flatnonzero(x >= floor)
    if cand is None:
        e = np.exp((x - top) / np.float32(sp.temperature))
        return Dist(e / np.float32(e.sum(dtype=np.float64)))
    cand = np.sort(cand)
    if floor is not None:
        cand = cand[x[cand] >= floor]
    e = np.exp((x[cand] - top) / np.float32(sp.temperature))
    return Dist(e / np.float32(e.sum(dtype=np.float64)), cand)


def _top_p_keep(x: np.ndarray, top: np.float32, cand: np.ndarray | None, top_p: float) -> np.ndarray:
    """Smallest set of most likely candidates whose mass reaches top_p of theirs, sorting as few
    as possible (top-p after top-k is relative to the top-k mass, as in llama.cpp's chain)."""
    idx = np.arange(x.size) if cand is None else cand
    w = np.exp(x[idx] - top)
    goal = top_p * w.sum(dtype=np.float64)
    m = min(64, idx.size)
    while True:
        part = np.argpartition(-w, m - 1)[:m] if m < idx.size else np.arange(idx.size)
        order = part[np.argsort(-w[part], kind="stable")]
        cum = np.cumsum(w[order], dtype=np.float64)
        hit = int(np.searchsorted(cum, goal))
        if hit < order.size or m >= idx.size:
            return idx[order[: min(hit + 1, order.size)]]
        m = min(m * 4, idx.size)
