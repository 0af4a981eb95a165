"""Engine.generate_batch against the same prompts one by one, with per-request prefill and decode times
(docs/benchmarks.md section 17).

    .venv/bin/python tools/batch_vs_sequential.py 1    # one slot, the prompts one by one
    .venv/bin/python tools/batch_vs_sequential.py 4    # four slots, generate_batch
"""
import sys
import time

from via_edge import Engine
from via_edge.bench.suite import load_prompts
ps = [p.text for p in load_prompts("spec-bench", None, 1)][:4]
n = int(sys.argv[1])
with Engine.from_pair(None, n_parallel=n, n_ctx=4096 * n) as e:
    print(e.mode, e.weight_format)
    e.generate(ps[0], max_tokens=4)
    t = time.time()
    if n == 1:
        rs = [e.generate(p, max_tokens=48) for p in ps]
    else:
        rs = e.generate_batch(ps, max_tokens=48).results
    dt = time.time() - t
    tok = sum(len(r.tokens) for r in rs)
    print(n, tok, round(dt, 1), round(tok / dt, 1), "prefill", [round(r.stats.prefill_seconds, 2) for r in rs],
          "gen", [round(r.stats.generate_seconds, 2) for r in rs], "steps", e._scheduler.steps if e._scheduler else None,
          "calls", e.target.usage.calls, "tok", e.target.usage.tokens, "dec s", round(e.target.usage.seconds, 1))
