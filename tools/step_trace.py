"""Where a batched run's time goes: every llama_decode of the target timed, by shape, against the
same requests one at a time (docs/benchmarks.md section 17).

    .venv/bin/python tools/step_trace.py [--model GGUF] [--requests 8] [-n 96] [--parallel 4] [--repeats 2]

Two engines (`ar` on `--model`, default: the default pair as `Engine.from_pair` loads it): one slot (requests one by one) and `--parallel`
slots (`generate_batch` over all requests, queued beyond the slots), alternated per repeat, the
same Spec-Bench prompts (one per category) each time. Per run: wall time, time inside
llama_decode, the decode thread's idle time between decodes, and the median cost of decodes by
shape ("k x 1" = k sequences one token each; "prompt" = any decode holding a prompt chunk).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from via_edge import Engine
from via_edge.bench.suite import load_prompts
from via_edge.llama import LlamaModel

_log: list[tuple[float, float, int, int, list[int]]] = []  # (start, seconds, parts, tokens, chunk lengths)
_run = LlamaModel._run


def _timed_run(self, parts):
    t0 = time.perf_counter()
    try:
        return _run(self, parts)
    finally:
        lens = [len(c) for _, c, _ in parts]
        _log.append((t0, time.perf_counter() - t0, len(parts), sum(lens), lens))


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
    prompts = [p.text for p in load_prompts("spec-bench", None, 1)][:args.requests]
    def engine(n: int) -> Engine:
        if args.model:
            return Engine(args.model, mode="ar", n_parallel=n, n_ctx=4096 * n)
        return Engine.from_pair(None, n_parallel=n, n_ctx=4096 * n)

    engines = {1: engine(1), args.parallel: engine(args.parallel)}
    print("target:", engines[1].target.path, flush=True)
    LlamaModel._run = _timed_run
    for e in engines.values():
        e.generate(prompts[0], max_tokens=2)
    rows = []
    for r in range(args.repeats):
        for n in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            e = engines[n]
            e.reset()  # start cold: no slot holds an earlier run's prompt
            _log.clear()
            t0 = time.perf_counter()
            if n == 1:
                results = [e.generate(p, max_tokens=args.n) for p in prompts]
            else:
                results = e.generate_batch(prompts, max_tokens=args.n).results
            wall = time.perf_counter() - t0
            log = [x for x in _log if x[0] >= t0]
            tok = sum(len(x.tokens) for x in results)
            busy = sum(x[1] for x in log)
            by = defaultdict(list)
            for _, d, p, t, lens in log:
                by[_shape(p, t)].append(d)
                if p != t:
                    print(f"  prompt decode {lens}: {1000 * d:.0f} ms")
            rows.append((r, n, tok, wall, busy, by, [x.text for x in results]))
            shapes = "  ".join(f"{k}: {len(v)} x {1000 * statistics.median(v):.0f} ms"
                               for k, v in sorted(by.items()))
            print(f"repeat {r} slots {n}: {tok} tokens in {wall:.1f} s = {tok / wall:.1f} tok/s; "
                  f"in llama_decode {busy:.1f} s, idle {wall - busy:.1f} s; prompt decodes "
                  f"{sum(by['prompt']):.1f} s; {shapes}", flush=True)
    for r in range(args.repeats):
        one, many = [x for x in rows if x[0] == r and x[1] == 1][0], [x for x in rows if x[0] == r and x[1] != 1][0]
        same = sum(a == b for a, b in zip(one[6], many[6]))
        print(f"repeat {r}: {args.parallel} slots / 1 slot = {(many[2] / many[3]) / (one[2] / one[3]):.2f}x, "
              f"same text {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
