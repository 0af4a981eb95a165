"""What constrained decoding costs per token: time inside the grammar (constraints.py and llama.cpp's
grammar sampler) against the target's own step, on JSON-schema prompts (docs/benchmarks.md).

    .venv/bin/python tools/grammar_cost.py [--modes ar,lookup,sd] [-n 128]
        [--suite docs/bench/json/prompts.jsonl] [--schema docs/bench/json/schema.json]

Runs every prompt in every mode with the schema's grammar (greedy, the default pair as
`Engine.from_pair` loads it on this machine) and times every call into the grammar that the
decoding loop and the drafters make (outermost calls only, so nested ones count once).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

from via_edge import Engine
from via_edge.bench.suite import load_prompts
from via_edge.decode import constraints

spent = [0.0]
depth = [0]


def timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if depth[0]:
            return fn(*args, **kwargs)
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
            depth[0] -= 1
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="ar,lookup,sd")
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--suite", default="docs/bench/json/prompts.jsonl")
    ap.add_argument("--schema", default="docs/bench/json/schema.json")
    args = ap.parse_args()
    for cls, names in ((constraints.ConstrainedRows, ("argmax", "ratio", "dist", "allowed", "logprobs")),
                       (constraints.Constraint, ("commit", "allows", "allowed_prefix", "rows"))):
        for name in names:
            setattr(cls, name, timed(getattr(cls, name)))
    fmt = {"type": "json_schema", "json_schema": {"name": "schema", "schema": json.loads(Path(args.schema).read_text())}}
    prompts = load_prompts(args.suite, None, 100)
    with Engine.from_pair() as engine:
        print(f"target {engine.target_path.name}, {len(prompts)} prompts, {args.max_tokens} tokens at most")
        for mode in args.modes.split(","):
            engine.prepare(mode)
            per_token, shares, valid = [], [], 0
            for p in prompts:
                engine.reset()
                spent[0] = 0.0
                res = engine.generate(p.text, mode=mode, max_tokens=args.max_tokens, response_format=fmt)
                t = res.stats.target
                step = t.seconds / t.calls
                per_token.append(spent[0] / len(res.tokens))
                shares.append(per_token[-1] / step)
                try:
                    json.loads(res.text)
                    valid += 1
                except ValueError:
                    pass
            print(f"{mode:7s} grammar {statistics.median(per_token) * 1e3:6.2f} ms per token "
                  f"(min {min(per_token) * 1e3:.2f}, max {max(per_token) * 1e3:.2f}); "
                  f"{statistics.median(shares):.1%} of a target step (max {max(shares):.1%}); "
                  f"{valid}/{len(prompts)} answers parse")


if __name__ == "__main__":
    main()
