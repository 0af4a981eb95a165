#!/usr/bin/env python3
"""What the copy drafter's Python costs per round, by context length (docs/benchmarks.md, section 20).

A context of N tokens of real code (CPython's textwrap.py, tokenized with a byte-level stand-in:
one token per byte, so repeats are as frequent as in code) is indexed once, then rounds append
a few tokens and propose, as the decoding loop does. Reports the one-time indexing cost and the
median per-round cost of `propose`; no model is loaded.

    .venv/bin/python tools/copy_cost.py
"""

from __future__ import annotations

import statistics
import time
from importlib.resources import files

from via_edge.spec import SpecParams
from via_edge.drafters import CopyDrafter, CopyPolicy
from via_edge.sampling import SamplingParams


def main() -> None:
    text = (files("via_edge") / "data" / "perplexity" / "textwrap.py.txt").read_text()
    base = list(text.encode())
    spec, sp = SpecParams(), SamplingParams()
    print("| context tokens | indexing, once (ms) | propose per round, median (µs) | max (µs) |")
    print("| --- | --- | --- | --- |")
    for n in (1000, 4000, 16000, 64000):
        tokens = (base * (n // len(base) + 2))[:n + 4000]
        ctx = tokens[:n]
        drafter = CopyDrafter(CopyPolicy(lambda k: 1.0 + 0.15 * (k - 1)))
        t0 = time.perf_counter()
        drafter.propose(ctx, 32, sp, None, spec)
        index_ms = (time.perf_counter() - t0) * 1e3
        times, at = [], n
        for _ in range(400):
            ctx.extend(tokens[at:at + 3])  # three committed tokens per round
            at += 3
            t0 = time.perf_counter()
            drafter.propose(ctx, 32, sp, None, spec)
            times.append((time.perf_counter() - t0) * 1e6)
        print(f"| {n} | {index_ms:.1f} | {statistics.median(times):.1f} | {max(times):.1f} |")


if __name__ == "__main__":
    main()
