"""Where a batched run's time goes: every llama_decode of the target timed, by shape, against the
same requests one at a time (docs/benchmarks.md sections 17 and 27).

    .venv/bin/python tools/step_trace.py [--model GGUF] [--requests 8] [-n 96] [--parallel 4] [--repeats 2]

Engines in `ar` on `--model` (default: the default pair as `Engine.from_pair` loads it): one slot
(requests one by one) and `--parallel` slots (`generate_batch` over all requests, queued beyond
the slots), alternated per repeat on the load benchmark's requests (Spec-Bench, the
categories in turn). Per run: wall time, time inside llama_decode, the decode thread's idle time
between decodes, and the median cost of decodes by shape ("k x 1" = k sequences one token each;
"prompt" = any decode holding a prompt chunk); then each batched run's tok/s over the one-slot
run of the same repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from via_edge import Engine
from via_edge.bench.suite import prompts_in_turn

_log: list[tuple[float, float, int, int]] = []  # (start, seconds, parts, tokens)


def _observe(parts, seconds: float) -> None:
    """The adapter's decode observer: one entry per llama_decode."""
    _log.append((time.perf_counter() - seconds, seconds, len(parts), sum(len(c) for _, c, _ in parts)))


def _shape(parts: int, tokens: int) -> str:
    return f"{parts} x 1" if parts == tokens else "prompt"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target GGUF for `ar` (default: Engine.from_pair's)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("-n", type=int, default=96, help="max tokens per request")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    prompts = [p.text for p in prompts_in_turn("spec-bench", None, args.requests)]

    def engine(n: int) -> Engine:
        if args.model:
            return Engine(args.model, mode="ar", n_parallel=n, n_ctx=4096 * n)
        return Engine.from_pair(None, n_parallel=n, n_ctx=4096 * n)

    solo, batched = engine(1), engine(args.parallel)
    runs = [("1 slot", solo, False), (f"{args.parallel} slots", batched, True)]
    print("target:", solo.target.path, flush=True)
    for e in (solo, batched):
        e.target.observers.append(_observe)
    for e in (solo, batched):
        e.generate(prompts[0], max_tokens=2)
    rows: dict[tuple[int, str], tuple[float, list[str]]] = {}
    for r in range(args.repeats):
        for name, e, batch in (runs if r % 2 == 0 else runs[::-1]):
            e.reset()  # start cold: no slot holds an earlier run's prompt
            _log.clear()
            t0 = time.perf_counter()
            if not batch:
                results = [e.generate(p, max_tokens=args.n) for p in prompts]
            else:
                results = e.generate_batch(prompts, max_tokens=args.n).results
            wall = time.perf_counter() - t0
            log = [x for x in _log if x[0] >= t0]
            tok = sum(len(x.tokens) for x in results)
            busy = sum(x[1] for x in log)
            by = defaultdict(list)
            for _, d, p, t in log:
                by[_shape(p, t)].append(d)
            rows[(r, name)] = (tok / wall, [x.text for x in results])
            shapes = "  ".join(f"{k}: {len(v)} x {1000 * statistics.median(v):.0f} ms"
                               for k, v in sorted(by.items()))
            print(f"repeat {r} {name}: {tok} tokens in {wall:.1f} s = {tok / wall:.1f} tok/s; "
                  f"in llama_decode {busy:.1f} s, idle {wall - busy:.1f} s; prompt decodes "
                  f"{sum(by['prompt']):.1f} s; {shapes}", flush=True)
    for r in range(args.repeats):
        (_, one), (name, many) = [(n, rows[(r, n)]) for n, _, _ in runs]
        same = sum(a == b for a, b in zip(one[1], many[1]))
        print(f"repeat {r}: {name} / 1 slot = {many[0] / one[0]:.2f}x, same text {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
