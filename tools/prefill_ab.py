#!/usr/bin/env python3
"""The prefill helper on and off (llama/prefill.py), one process, the same prompts, interleaved:
how much sooner a request starts and ends, and whether its answer stays the same
(docs/benchmarks.md, section 61).

    .venv/bin/python tools/prefill_ab.py [--suite edit] [--categories edit,edit-chat] [--per-category 6]
        [-n 128] [--mode lookup] [--target GGUF] [--parallel 4 [--beside]]

One engine with the helper takes each prompt twice, with the helper attached and detached (the
order alternating by prompt), from cold caches: the same target instance generates in both arms
(two instances of one model can differ in speed by where their weights landed in memory). Per prompt: the prefill's seconds, the generation's
tok/s, the whole request's wall time, and whether the two answers are identical; then geomeans over
the prompts of 64 tokens or more (the ones the helper takes) and the shorter ones.

With `--parallel N` the engine has N slots, as `serve` has (a long prompt leaves the shared
batches for the copy); `--beside` starts a short chat request with each prompt, in the next
slot, and reports that request's whole time (arrival to last token) in both arms: what a running
generation pays while another slot's prompt is decoded, on the copy or in the shared batches.
"""

from __future__ import annotations

import argparse
import math
import time

from via_edge import Engine
from via_edge.bench.runner import prompt_tokens
from via_edge.bench.suite import load_prompts
from via_edge.llama.prefill import MIN_TOKENS
from via_edge.weights import catalog


def geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="edit")
    ap.add_argument("--categories", default="edit,edit-chat", help="comma-separated; '' for all")
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--mode", default="lookup")
    ap.add_argument("--target", default=None, help="GGUF (default: the default pair's shipped target)")
    ap.add_argument("--parallel", type=int, default=1, help="slots, as serve --parallel (context 4096 each)")
    ap.add_argument("--beside", action="store_true", help="with --parallel >= 2: a short request beside each prompt")
    a = ap.parse_args()
    if a.beside and a.parallel < 2:
        ap.error("--beside needs --parallel 2 or more")
    target = a.target or catalog.resolve(catalog.pair(None)["target"], pull_missing=True)
    engine = Engine(target, mode=a.mode, n_ctx=4096 * a.parallel, n_parallel=a.parallel, prefill_helper=True)
    helper = engine.target.prefiller
    short = engine.tokens_for("Name three prime numbers and say why each is prime.", True)
    rows, beside = [], []
    for i, p in enumerate(load_prompts(a.suite, [c for c in a.categories.split(",") if c] or None, a.per_category)):
        toks = prompt_tokens(engine, p)
        got = {}
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            engine.target.prefiller = helper if on else None
            engine.reset()
            t0 = time.perf_counter()
            if a.beside:
                r, b = engine.generate_batch([toks, short], max_tokens=a.max_tokens)
                got[on, "beside"] = b.stats.queue_seconds + b.stats.prefill_seconds + b.stats.generate_seconds
            else:
                r = engine.generate(toks, max_tokens=a.max_tokens)
            got[on] = (r.stats.prefill_seconds, r.stats.tokens_per_second, time.perf_counter() - t0, r.tokens)
        h, o = got[True], got[False]
        rows.append((len(toks), o[0] / h[0], h[1] / o[1], o[2] / h[2], h[3] == o[3]))
        side = ""
        if a.beside:
            beside.append(got[False, "beside"] / got[True, "beside"])
            side = f"; beside {got[True, 'beside']:.2f} / {got[False, 'beside']:.2f} s"
        print(f"{p.category}/{p.id} {len(toks)} tokens: prefill {h[0]:.2f} s with, {o[0]:.2f} s without "
              f"({o[0] / h[0]:.2f}x); generation {h[1]:.1f} / {o[1]:.1f} tok/s; request {o[2] / h[2]:.2f}x; "
              f"identical {h[3] == o[3]}{side}", flush=True)
    for label, sel in ((f">= {MIN_TOKENS} prompt tokens", [r for r in rows if r[0] >= MIN_TOKENS]),
                       (f"< {MIN_TOKENS}", [r for r in rows if r[0] < MIN_TOKENS])):
        if sel:
            cols = [(name, [r[k] for r in sel]) for k, name in ((1, "prefill"), (2, "generation"), (3, "request"))]
            print(f"{label} ({len(sel)}): " + ", ".join(f"{name} {geomean(v):.3f}x ({min(v):.2f}-{max(v):.2f})"
                                                       for name, v in cols)
                  + f", identical {sum(r[4] for r in sel)} of {len(sel)}")
    if beside:
        print(f"the request beside, whole request {geomean(beside):.3f}x as fast with the helper "
              f"({min(beside):.2f}-{max(beside):.2f})")
    engine.target.prefiller = helper
    engine.close()


if __name__ == "__main__":
    main()
