"""Sampling parameters and the token distributions every decoding mode shares.

The filters follow llama.cpp's default chain (top-k, top-p, min-p on the untempered softmax, then
temperature), so the same parameters mean the same thing as in llama-cli. `temperature == 0`
means greedy. Speculative modes apply the identical transform to draft and target rows, which
keeps the Leviathan/Chen acceptance rule exact for the filtered distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidParameterError


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


def ratio_to_top(row: np.ndarray, token: int) -> float:
    """p(token) / max p under the untempered softmax: a confidence score that needs no full softmax."""
    return float(np.exp(np.float64(row[token]) - np.float64(row.max())))


def top_prob(row: np.ndarray) -> tuple[int, float]:
    """The argmax and its untempered probability (one float32 pass over the row, no copy kept)."""
    best = int(row.argmax())
    return best, float(1.0 / np.exp(row - row[best], dtype=np.float32).sum(dtype=np.float64))


def probs(row: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """The full-vocabulary distribution that `sp` samples from (float32, sums to 1).

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
    if cand is None:
        e = np.exp((x - top) / np.float32(sp.temperature))
        if floor is not None:
            e[x < floor] = 0.0
        return e / np.float32(e.sum(dtype=np.float64))
    if floor is not None:
        cand = cand[x[cand] >= floor]
    e = np.exp((x[cand] - top) / np.float32(sp.temperature))
    out = np.zeros(x.size, dtype=np.float32)
    out[cand] = e / np.float32(e.sum(dtype=np.float64))
    return out


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


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    cum = np.cumsum(p, dtype=np.float64)
    return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), p.size - 1))


def pick(row: np.ndarray, sp: SamplingParams, rng: np.random.Generator) -> int:
    """One token from a logits row: argmax when greedy, else a sample from `probs`."""
    if sp.greedy:
        return int(row.argmax())
    return sample(probs(row, sp), rng)
