"""Which of the target's blocks the slim verifier keeps: a search under a block budget.

Candidates, cheapest ideas first (each scored by the caller's `evaluate`, memoised):
1. early-exit prefixes (blocks 0..K-1), the only slims that can import the target's prompt KV;
2. keep-first-and-last windows (0..a-1 plus the last b blocks);
3. greedy removal from the whole target: drop the block whose removal costs least agreement,
   repeatedly, trying at each step only the blocks that change the hidden state least (block
   influence, from the same evaluation pass), because trying all of them costs a full pass per
   block: up to `shortlist` of them, as many as the evaluation budget leaves for the steps still
   to go (with a tight budget, one: removal by block influence alone, as ShortGPT does; with
   fewer evaluations left than blocks to remove, none: it could not reach the budget);
4. random search around the best: swap one kept block for a dropped one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

Layers = tuple[int, ...]


@dataclass
class Scored:
    layers: Layers
    agreement: float          # teacher-forced: slim argmax == target token, over all positions
    strategy: str
    extra: dict = field(default_factory=dict)  # routing precision etc., from the evaluator


# evaluate(layers, want_influence) -> (agreement, extra, influence per kept block or None)
Evaluate = Callable[[Layers, bool], tuple[float, dict, "np.ndarray | None"]]


class Search:
    def __init__(self, n_blocks: int, budget: int, evaluate: Evaluate, *, max_evals: int = 24,
                 shortlist: int = 3, seed: int = 0, log: Callable[[str], None] | None = None) -> None:
        if not 1 <= budget < n_blocks:
            raise ValueError(f"the block budget must be in 1..{n_blocks - 1}, got {budget}")
        self.n, self.budget, self.evaluate = n_blocks, budget, evaluate
        self.max_evals, self.shortlist = max_evals, shortlist
        self.rng = random.Random(seed)
        self.log = log or (lambda msg: None)
        self.scored: dict[Layers, Scored] = {}
        self._influence: dict[Layers, np.ndarray] = {}

    def score(self, layers: Sequence[int], strategy: str, influence: bool = False) -> Scored | None:
        key = tuple(sorted(layers))
        if key in self.scored and (not influence or key in self._influence):
            return self.scored[key]
        if len(self.scored) >= self.max_evals:
            return None
        agreement, extra, infl = self.evaluate(key, influence)
        if infl is not None:
            self._influence[key] = infl
        if key not in self.scored:
            self.scored[key] = Scored(key, agreement, strategy, extra)
            self.log(f"{strategy:8s} {_fmt(key):24s} agreement {agreement:.3f}")
        return self.scored[key]

    def best(self) -> Scored:
        fits = [s for s in self.scored.values() if len(s.layers) <= self.budget]
        return max(fits, key=lambda s: (s.agreement, -len(s.layers)))

    def run(self) -> list[Scored]:
        n, b = self.n, self.budget
        for k in sorted({b, max(1, round(b * 0.85))}, reverse=True):
            self.score(range(k), "prefix")
        for a in (2, 4, 6, 8):
            if a < b:
                self.score(list(range(a)) + list(range(n - (b - a), n)), "window")
        self._greedy_removal(reserve=max(2, self.max_evals // 6))  # leave some for the random search
        self._random_search()
        return sorted((s for s in self.scored.values() if len(s.layers) <= b),
                      key=lambda s: (-s.agreement, len(s.layers)))

    def _greedy_removal(self, reserve: int) -> None:
        current: Layers = tuple(range(self.n))
        steps = self.n - self.budget  # one evaluation each at the least, after the whole target's
        if self.max_evals - len(self.scored) < steps + 1:
            self.log(f"greedy removal skipped: it needs {steps + 1} evaluations to reach {self.budget} blocks, "
                     f"{self.max_evals - len(self.scored)} are left (the random search takes them)")
            return
        while len(current) > self.budget:
            if self.score(current, "greedy", influence=True) is None:
                return
            infl = self._influence.get(current)
            order = np.argsort(infl) if infl is not None else range(len(current))
            left = self.max_evals - len(self.scored) - reserve
            k = max(1, min(self.shortlist, left // (len(current) - self.budget)))
            tries = [current[:i] + current[i + 1:] for i in list(order)[:k]]
            done = [s for s in (self.score(t, "greedy", influence=len(t) > self.budget) for t in tries) if s]
            if not done:
                return
            current = max(done, key=lambda s: s.agreement).layers

    def _random_search(self) -> None:
        stale = 0
        while len(self.scored) < self.max_evals and stale < 20:
            best = self.best().layers
            dropped = [i for i in range(self.n) if i not in best]
            if not dropped:
                return
            cand = set(best)
            cand.remove(self.rng.choice(best))
            cand.add(self.rng.choice(dropped))
            key = tuple(sorted(cand))
            if key in self.scored:
                stale += 1
                continue
            stale = 0
            self.score(key, "random")


def _fmt(layers: Layers) -> str:
    from ..weights.slim import format_layers

    return format_layers(layers)
