"""Cost of one llama_decode carrying several sequences, per KV layout (docs/benchmarks.md §17).

    .venv/bin/python tools/seq_costs.py [--model PATH] [--slots 4] [--repeats 5]

For each layout (one context with n_seq=1; n_seq=slots with a unified KV buffer; with one buffer
per sequence) it prefills every sequence with a 200-token prompt, then times, interleaved
round-robin: 1 sequence x 1 token, all sequences x 1 token, and a mixed step (one sequence
verifying 5 tokens, the others 1 each). Medians in ms, spread as min..max.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from via_edge import models as catalog
from via_edge.llama import LlamaModel, LoadParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF (default: the default pair's target)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=1024, help="tokens per sequence")
    args = ap.parse_args()
    path = Path(args.model) if args.model else catalog.resolve(catalog.pair(None)["target"])
    layouts = {"n_seq=1": LoadParams(n_ctx=args.ctx),
               "unified": LoadParams(n_ctx=args.ctx * args.slots, n_seq=args.slots, kv_unified=True),
               "per-seq": LoadParams(n_ctx=args.ctx * args.slots, n_seq=args.slots, kv_unified=False)}
    models = {name: LlamaModel(path, p) for name, p in layouts.items()}
    prompt = list(range(1000, 1200))
    for m in models.values():
        for seq in m.seqs:
            seq.prefill(prompt)
    steps = {"1 seq x 1": lambda m: [(m.seqs[0], [7], [0])],
             "all x 1": lambda m: [(s, [7], [0]) for s in m.seqs],
             "mixed 5+1s": lambda m: [(m.seqs[0], [7] * 5, list(range(5)))] + [(s, [7], [0]) for s in m.seqs[1:]]}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for step, make in steps.items():
            for name, m in models.items():
                if name == "n_seq=1" and step != "1 seq x 1":
                    continue
                parts = make(m)
                t0 = time.perf_counter()
                m.decode_batch(parts)
                times.setdefault((step, name), []).append((time.perf_counter() - t0) * 1e3)
                for seq, toks, _ in parts:
                    seq.truncate(len(prompt))
    print(f"model {path.name}, {args.slots} slots, {args.ctx} tokens each, {args.repeats} repeats")
    print(f"{'step':12} {'layout':9} {'median ms':>9}  spread")
    for (step, name), ts in times.items():
        print(f"{step:12} {name:9} {statistics.median(ts):9.1f}  {min(ts):.1f}..{max(ts):.1f}")


if __name__ == "__main__":
    main()
