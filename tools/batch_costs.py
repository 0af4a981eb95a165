"""What one llama_decode of several sequences costs: the measurements behind the scheduler's and
the server's choices (docs/benchmarks.md sections 17 and 21). Three questions, one per command:

    .venv/bin/python tools/batch_costs.py layouts [--model GGUF] [--slots 4] [--cached 200]
    .venv/bin/python tools/batch_costs.py kernels [--model GGUF] [--cached 100]
    .venv/bin/python tools/batch_costs.py prefill [--model GGUF] [--cached 100] [--prompt 160]
    .venv/bin/python tools/batch_costs.py chunks [--model GGUF] [--cached 100]

  layouts  per KV layout (one sequence per context; `--slots` sequences on one unified buffer; one
           buffer per sequence): 1 sequence x 1 token, every sequence x 1, a non-contiguous pair
           (ids 0 and 2: llama.cpp splits a batch at every gap in the ids of a per-sequence layout),
           and a mixed step (one sequence verifying 5 tokens beside the others' 1)
  kernels  k = 1, 2, 3, 4, 8 sequences x 1 token with weight repacking on and off (8 slots)
  prefill  prompt chunks of 3 sequences in one decode against one decode each, and one chunk
           beside the other sequences' next tokens against the two decodes it replaces
  chunks   one prompt chunk of 9..505 tokens alone and beside 7 sequences' next tokens (8 slots):
           what a prompt token costs by chunk size, and what the running slots' tokens add to it

Every sequence first holds `--cached` tokens; each case is timed interleaved round-robin over the
models and cases, `--repeats` times, and rolled back after. Medians in ms, spread min..max.
Default model: the default pair's shipped target.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

from via_edge.llama import LlamaModel, LoadParams
from via_edge.weights import catalog

Step = list  # one decode_batch's parts: [(seq, tokens, rows)]
Case = Callable[[LlamaModel], list[Step]]  # the decodes one case makes, timed as a sum


def _one(seq, n: int = 1, token: int = 7) -> tuple:
    return seq, [token] * n, [n - 1]


def _several(m: LlamaModel) -> list:
    """The model's sequences, for cases that need more than one (a one-sequence layout skips them)."""
    if len(m.seqs) < 2:
        raise IndexError("one sequence")
    return m.seqs


def layouts(args: argparse.Namespace) -> tuple[dict[str, LoadParams], dict[str, Case]]:
    n, ctx = args.slots, args.ctx
    loads = {"n_seq=1": LoadParams(n_ctx=ctx),
             "unified": LoadParams(n_ctx=ctx * n, n_seq=n, kv_unified=True),
             "per-seq": LoadParams(n_ctx=ctx * n, n_seq=n, kv_unified=False)}
    cases = {"1 seq x 1": lambda m: [[_one(m.seqs[0])]],
             "all x 1": lambda m: [[_one(s) for s in _several(m)]],
             "ids 0,2 x 1": lambda m: [[_one(m.seqs[0]), _one(m.seqs[2])]],
             "mixed 5+1s": lambda m: [[_one(m.seqs[0], 5)] + [_one(s) for s in _several(m)[1:]]]}
    return loads, cases


def kernels(args: argparse.Namespace) -> tuple[dict[str, LoadParams], dict[str, Case]]:
    loads = {name: LoadParams(n_ctx=8 * args.ctx, n_seq=8, kv_unified=True, use_extra_bufts=on)
             for name, on in (("repack", True), ("no repack", False))}
    cases = {f"{k} x 1": (lambda m, k=k: [[_one(s) for s in m.seqs[:k]]]) for k in (1, 2, 3, 4, 8)}
    return loads, cases


def prefill(args: argparse.Namespace) -> tuple[dict[str, LoadParams], dict[str, Case]]:
    chunk = list(range(2000, 2000 + args.prompt))
    loads = {name: LoadParams(n_ctx=4 * args.ctx, n_seq=4, kv_unified=u)
             for name, u in (("unified", True), ("per-seq", False))}

    def part(s) -> tuple:
        return s, chunk, [len(chunk) - 1]

    cases = {"3 prompts, 1 decode each": lambda m: [[part(s)] for s in m.seqs[1:]],
             "3 prompts in one decode": lambda m: [[part(s) for s in m.seqs[1:]]],
             "prompt + 3 x 1": lambda m: [[part(m.seqs[0])] + [_one(s) for s in m.seqs[1:]]],
             "prompt, then 3 x 1": lambda m: [[part(m.seqs[0])], [_one(s) for s in m.seqs[1:]]]}
    return loads, cases


def chunks(args: argparse.Namespace) -> tuple[dict[str, LoadParams], dict[str, Case]]:
    loads = {"unified": LoadParams(n_ctx=8 * args.ctx, n_seq=8, kv_unified=True)}
    cases: dict[str, Case] = {"7 x 1": lambda m: [[_one(s) for s in m.seqs[1:]]]}
    for c in (9, 16, 25, 32, 57, 64, 128, 256, 512 - 7):  # 9, 25, 57: 7 more make whole 16-row tiles
        chunk = list(range(2000, 2000 + c))
        cases[f"prompt {c}"] = lambda m, chunk=chunk: [[(m.seqs[0], chunk, [len(chunk) - 1])]]
        cases[f"prompt {c} + 7 x 1"] = lambda m, chunk=chunk: [[(m.seqs[0], chunk, [len(chunk) - 1])]
                                                                + [_one(s) for s in m.seqs[1:]]]
    return loads, cases


QUESTIONS = {"layouts": layouts, "kernels": kernels, "prefill": prefill, "chunks": chunks}


def measure(path: Path, loads: dict[str, LoadParams], cases: dict[str, Case], cached: int,
            repeats: int) -> dict[tuple[str, str], list[float]]:
    """ms per (case, model), interleaved: every repeat visits every case on every model, the
    models' order reversed on odd repeats."""
    models = {name: LlamaModel(path, p) for name, p in loads.items()}
    prompt = list(range(1000, 1000 + cached))
    try:
        for m in models.values():
            for seq in m.seqs:
                seq.prefill(prompt)
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(repeats):
            for case, make in cases.items():
                for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
                    m = models[name]
                    try:
                        steps = make(m)
                    except IndexError:  # the case needs more sequences than this layout has
                        continue
                    t = 0.0
                    for parts in steps:
                        t0 = time.perf_counter()
                        m.decode_batch(parts)
                        t += time.perf_counter() - t0
                    times.setdefault((case, name), []).append(1e3 * t)
                    for seq in m.seqs:
                        seq.truncate(cached)
        return times
    finally:
        for m in models.values():
            m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("question", choices=sorted(QUESTIONS))
    ap.add_argument("--model", default=None, help="GGUF (default: the default pair's shipped target)")
    ap.add_argument("--slots", type=int, default=4, help="layouts: sequences per context")
    ap.add_argument("--cached", type=int, default=None,
                    help="tokens each sequence holds (default: 200 for layouts, 100 otherwise)")
    ap.add_argument("--ctx", type=int, default=1024, help="KV cells per sequence")
    ap.add_argument("--prompt", type=int, default=160, help="prefill: tokens per prompt chunk")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cached = args.cached if args.cached is not None else (200 if args.question == "layouts" else 100)
    if args.question == "layouts" and args.slots < 3:
        ap.error("layouts needs --slots 3 or more (it times ids 0 and 2)")
    path = Path(args.model) if args.model else catalog.resolve(catalog.pair(None)["target"])
    loads, cases = QUESTIONS[args.question](args)
    times = measure(path, loads, cases, cached, args.repeats)
    print(f"{path.name}: {args.question}, {cached} cached tokens per sequence, medians of {args.repeats} (ms)")
    print(f"{'case':26} {'model':10} {'median ms':>9}  spread   vs the first case")
    first: dict[str, float] = {}
    for (case, name), ts in times.items():
        med = statistics.median(ts)
        base = first.setdefault(name, med)
        print(f"{case:26} {name:10} {med:9.1f}  {min(ts):.1f}..{max(ts):.1f}  {med / base:.2f}x")


if __name__ == "__main__":
    main()
