"""Python time per sampled token: a draw from the filtered distribution, and one speculative
verification step (p(tok), q(tok), the rejection residual, a draw), on full-size vocabulary rows.

    .venv/bin/python tools/sampling_cost.py
    .venv/bin/python tools/sampling_cost.py --reference <(git show ad8c9c0:via_edge/sampling.py)

`--reference` times an older `via_edge/sampling.py` (full-vocabulary `probs` and `sample`) beside
the current one. Rows are N(0, 3^2) logits: flatter than a model's, so top-p keeps far more
candidates than it would on real text (the worst case for a candidate filter).
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import numpy as np

from via_edge.sampling import SamplingParams, dist

SETTINGS = (SamplingParams(0.7, 40, 0.95, 0.05), SamplingParams(0.8, 0, 0.95, 0.0),
            SamplingParams(0.8, 0, 1.0, 0.05), SamplingParams(1.0))


def current(sp: SamplingParams, rng: np.random.Generator):
    def draw(a, _b):
        return dist(a, sp).sample(rng)

    def verify(a, b):
        p, q = dist(a, sp), dist(b, sp)
        tok = q.sample(rng)
        return tok if rng.random() * q.prob(tok) < p.prob(tok) else p.residual(q, tok).sample(rng)

    return draw, verify


def reference(mod, sp: SamplingParams, rng: np.random.Generator):
    def draw(a, _b):
        return mod.sample(mod.probs(a, sp), rng)

    def verify(a, b):
        p, q = mod.probs(a, sp), mod.probs(b, sp)
        tok = mod.sample(q, rng)
        if rng.random() * q[tok] < p[tok]:
            return tok
        residual = np.maximum(p - q, 0.0)
        return mod.sample(residual if residual.sum() > 0 else p, rng)

    return draw, verify


def ms_per_call(fn, rows, n: int = 200, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n):
            fn(rows[i % len(rows)], rows[(i + 3) % len(rows)])
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reference", help="an older via_edge/sampling.py to time beside the current one")
    args = ap.parse_args()
    rows = [(np.random.default_rng(i).standard_normal(args.vocab) * 3).astype(np.float32) for i in range(8)]
    old = None
    if args.reference:
        old = types.ModuleType("via_edge.sampling_reference")  # in the package: its relative imports work
        old.__package__ = "via_edge"
        sys.modules[old.__name__] = old
        exec(compile(Path(args.reference).read_text(), args.reference, "exec"), old.__dict__)
    print("| temperature, top_k, top_p, min_p | draw (ms) | verify step (ms) |" + (" reference draw / verify (ms) |" if old else ""))
    print("| --- | --- | --- |" + (" --- |" if old else ""))
    for sp in SETTINGS:
        draw, verify = current(sp, np.random.default_rng(1))
        line = f"| {sp.temperature}, {sp.top_k}, {sp.top_p}, {sp.min_p} | {ms_per_call(draw, rows):.2f} | {ms_per_call(verify, rows):.2f} |"
        if old:
            d, v = reference(old, sp, np.random.default_rng(1))
            line += f" {ms_per_call(d, rows):.2f} / {ms_per_call(v, rows):.2f} |"
        print(line)


if __name__ == "__main__":
    main()
