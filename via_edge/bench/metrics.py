"""Small, exact statistics for the benchmark report, and the orders its runs take (tested on hand-made inputs)."""

from __future__ import annotations

import math
from typing import Sequence, TypeVar

from ..llama import common_prefix


def geomean(values: Sequence[float]) -> float:
    vals = [v for v in values if v > 0]
    if not vals or len(vals) != len(values):
        return float("nan")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def log_se(values: Sequence[float]) -> float:
    """Standard error of the mean log of positive ratios: the geomean's uncertainty, as a factor's
    logarithm (0.01 is about +-1%). NaN below two values."""
    vals = [math.log(v) for v in values if v > 0]
    if len(vals) < 2 or len(vals) != len(values):
        return float("nan")
    mean = sum(vals) / len(vals)
    return math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) / len(vals))


def spread(values: Sequence[float]) -> dict:
    """Per-prompt min / median / max."""
    if not values:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan")}
    s = sorted(values)
    n = len(s)
    median = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return {"min": s[0], "median": median, "max": s[-1]}


def fmt(x: float | None, nd: int = 2) -> str:
    """A number for a report table; missing or NaN as n/a."""
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def fidelity(reference: Sequence[int], output: Sequence[int]) -> dict:
    """How far `output` stays with the reference (the target's own greedy tokens).

    exact: identical sequences. prefix: length of the identical prefix, and its share of the
    reference. agreement: position-wise equal tokens over the longer length (0..1).
    """
    p = common_prefix(reference, output)
    longer = max(len(reference), len(output))
    same = sum(1 for x, y in zip(reference, output) if x == y)
    return {
        "exact": list(reference) == list(output),
        "prefix": p,
        "prefix_share": p / len(reference) if reference else 1.0,
        "agreement": same / longer if longer else 1.0,
    }


def run_orders(n: int) -> list[list[int]]:
    """Orders of n methods (Williams' design) in which, taken together, every method runs as often
    in each place and right after each other method as often: a cyclic rotation of three or more
    puts each method right after the same one every time, so whatever a run leaves behind for the
    next (a warm cache, a busy core, a server's idle threads) would count for one method only."""
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 and n > 1 else rows


T = TypeVar("T")


def in_run_order(items: Sequence[T], k: int) -> list[T]:
    """`items` in the k-th of `run_orders` (cycling): the order of the k-th prompt or round."""
    orders = run_orders(len(items))
    return [items[j] for j in orders[k % len(orders)]]
