"""What prompt chunks of several sequences cost in one decode, against one sequence's chunk at a time
(docs/benchmarks.md section 17: how the scheduler should place prefill).

    .venv/bin/python tools/prefill_mix.py [--model PATH] [--prompt 160] [--repeats 5]

Per KV layout (4 sequences, unified buffer or one per sequence), interleaved round-robin, each
from the same 100 cached tokens per sequence:
  3 prompts, 1 decode each   three decodes of `--prompt` tokens, one sequence each (summed)
  3 prompts in one decode     the same three chunks as one batch
  prompt + 3 x 1              one chunk beside the other sequences' next tokens, one decode
  prompt, then 3 x 1          the same as two decodes (summed)
Medians in ms, spread min..max.
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
    ap.add_argument("--model", default=None, help="GGUF (default: the default pair's shipped target)")
    ap.add_argument("--prompt", type=int, default=160, help="tokens per prompt chunk")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = Path(args.model) if args.model else catalog.resolve(catalog.pair(None)["target"])
    layouts = {"unified": True, "per-seq": False}
    models = {name: LlamaModel(path, LoadParams(n_ctx=4 * 1024, n_seq=4, kv_unified=u))
              for name, u in layouts.items()}
    cached = list(range(1000, 1100))
    chunk = list(range(2000, 2000 + args.prompt))
    for m in models.values():
        for seq in m.seqs:
            seq.prefill(cached)

    def seq_each(m):
        return [[(s, chunk, [len(chunk) - 1])] for s in m.seqs[1:]]

    cases = {
        "3 prompts, 1 decode each": seq_each,
        "3 prompts in one decode": lambda m: [[(s, chunk, [len(chunk) - 1]) for s in m.seqs[1:]]],
        "prompt + 3 x 1": lambda m: [[(m.seqs[0], chunk, [len(chunk) - 1])] + [(s, [7], [0]) for s in m.seqs[1:]]],
        "prompt, then 3 x 1": lambda m: [[(m.seqs[0], chunk, [len(chunk) - 1])], [(s, [7], [0]) for s in m.seqs[1:]]],
    }
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        for case, make in cases.items():
            names = list(models) if r % 2 == 0 else list(models)[::-1]
            for name in names:
                m = models[name]
                t = 0.0
                for parts in make(m):
                    t0 = time.perf_counter()
                    m.decode_batch(parts)
                    t += time.perf_counter() - t0
                times.setdefault((case, name), []).append(t * 1e3)
                for seq in m.seqs:
                    seq.truncate(len(cached))
    print(f"model {path.name}, 4 sequences, {len(cached)} cached tokens each, chunks of {args.prompt}, "
          f"{args.repeats} repeats")
    print(f"{'case':26} {'layout':8} {'median ms':>9}  spread")
    for (case, name), ts in times.items():
        print(f"{case:26} {name:8} {statistics.median(ts):9.1f}  {min(ts):.1f}..{max(ts):.1f}")


if __name__ == "__main__":
    main()
