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
    """The argmax and its untempered probability."""
    best = int(row.argmax())
    x = row.astype(np.float64, copy=False)
    return best, float(1.0 / np.exp(x - x[best]).sum())


def probs(row: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """The full-vocabulary distribution that `sp` samples from (float64, sums to 1)."""
    x = row.astype(np.float64)
    x -= x.max()
    p = np.exp(x)
    p /= p.sum()
    keep = None
    if sp.top_k and sp.top_k < p.size:
        keep = np.argpartition(-p, sp.top_k - 1)[: sp.top_k]
    if sp.top_p < 1.0:
        keep = _top_p_keep(p, keep, sp.top_p)
    if keep is not None:
        mask = np.zeros(p.size, dtype=bool)
        mask[keep] = True
    else:
        mask = np.ones(p.size, dtype=bool)
    if sp.min_p > 0:
        mask &= p >= sp.min_p * p.max()
    logit = np.where(mask, x / sp.temperature, -np.inf)
    logit -= logit.max()
    out = np.exp(logit)
    out /= out.sum()
    return out


def _top_p_keep(p: np.ndarray, keep: np.ndarray | None, top_p: float) -> np.ndarray:
    """Smallest set of most likely tokens whose mass reaches top_p, sorting as few as possible."""
    cand = np.arange(p.size) if keep is None else keep
    m = min(64, cand.size)
    while True:
        part = cand[np.argpartition(-p[cand], m - 1)[:m]] if m < cand.size else cand
        order = part[np.argsort(-p[part], kind="stable")]
        cum = np.cumsum(p[order])
        total = cum[-1] if keep is None else p[cand].sum()
        hit = np.searchsorted(cum, top_p * (total if keep is not None else 1.0))
        if hit < order.size or m >= cand.size:
            return order[: min(hit + 1, order.size)]
        m = min(m * 4, cand.size)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    cum = np.cumsum(p)
    return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), p.size - 1))


def pick(row: np.ndarray, sp: SamplingParams, rng: np.random.Generator) -> int:
    """One token from a logits row: argmax when greedy, else a sample from `probs`."""
    if sp.greedy:
        return int(row.argmax())
    return sample(probs(row, sp), rng)
