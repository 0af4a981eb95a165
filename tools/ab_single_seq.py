"""Single-sequence speed of two via_edge checkouts: one generate per prompt, tok/s (docs/benchmarks.md section 17).

    .venv/bin/python tools/ab_single_seq.py PATH_TO_CHECKOUT   # run alternately for each checkout
"""
import sys, time, json
sys.path.insert(0, sys.argv[1])
from via_edge import Engine
from via_edge.bench.suite import load_prompts
ps = [p.text for p in load_prompts("spec-bench", ["coding", "writing", "math"], 1)]
with Engine.from_pair(None) as e:
    e.generate(ps[0], max_tokens=4)
    out = []
    for p in ps:
        r = e.generate(p, max_tokens=64)
        out.append(r.stats.tokens_per_second)
print(json.dumps(out))
