"""What a step of k sequences x 1 token costs with weight repacking on and off (docs/benchmarks.md
section 17): the repacked 4-row gemm against llama.cpp's other batch kernels (tinyBLAS for
Q4_0/IQ4_NL/Q8_0, vec_dot for K-quants below 8 tokens).

    .venv/bin/python tools/seq_kernels.py [--model PATH] [--cached 100] [--repeats 7]

Two contexts of 8 sequences (one KV buffer each, as the server loads them), each sequence
prefilled with `--cached` tokens; k = 1, 2, 3, 4, 8 sequences decode one token, interleaved
round-robin over both contexts and every k, then the tokens are rolled back. Medians in ms, min..max.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from via_edge import models as catalog
from via_edge.llama import LlamaModel, LoadParams

KS = (1, 2, 3, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF (default: the default pair's shipped target)")
    ap.add_argument("--cached", type=int, default=100, help="tokens each sequence holds")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    path = Path(args.model) if args.model else catalog.resolve(catalog.pair(None)["target"])
    models = {name: LlamaModel(path, LoadParams(n_ctx=8 * 1024, n_seq=8, use_extra_bufts=on))
              for name, on in {"repack": True, "no repack": False}.items()}
    cached = list(range(1000, 1000 + args.cached))
    for m in models.values():
        for seq in m.seqs:
            seq.prefill(cached)
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(args.repeats):
        for k in KS:
            for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
                m = models[name]
                t0 = time.perf_counter()
                m.decode_batch([(s, [7], [0]) for s in m.seqs[:k]])
                times.setdefault((name, k), []).append(1000 * (time.perf_counter() - t0))
                for s in m.seqs[:k]:
                    s.prefill(cached)  # rolls the token back
    print(f"{path.name}, {args.cached} cached tokens per sequence, medians of {args.repeats} (ms)")
    for name in models:
        one = statistics.median(times[(name, 1)])
        for k in KS:
            t = times[(name, k)]
            print(f"{name:10s} {k} x 1 {statistics.median(t):6.1f} ({min(t):.0f}..{max(t):.0f}) = "
                  f"{statistics.median(t) / one:.2f}x one token, {k * one / statistics.median(t):.2f}x throughput")


if __name__ == "__main__":
    main()
