"""Python overhead of the decoding loop: the share of one generation's wall time spent outside
llama_decode (every model's decode time is measured by the adapter, synchronised).

    .venv/bin/python tools/overhead.py                 # sd on the default pair, greedy and sampled
    PYTHONPATH=/path/to/old/checkout python tools/overhead.py   # the same on another version

Runs each setting `--repeats` times after a warm-up, interleaved, and prints the median share.
"""

from __future__ import annotations

import argparse
import statistics

from via_edge import Engine

PROMPT = "Write a Python function that parses an ISO 8601 date string and explain each step."


def share(engine: Engine, mode: str, sampled: bool, max_tokens: int) -> tuple[float, int, float]:
    engine.reset()
    kw = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1) if sampled else {}
    res = engine.generate(PROMPT, mode=mode, max_tokens=max_tokens, **kw)
    s = res.stats
    decode = s.target.seconds + s.draft.seconds + s.slim.seconds
    wall = s.prefill_seconds + s.generate_seconds
    return 1 - decode / wall, s.generated_tokens, s.tokens_per_second


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--mode", default="sd")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    kw = {"tuned": False} if "tuned" in Engine.from_pair.__code__.co_varnames else {}
    with Engine.from_pair(a.pair, mode=a.mode, **kw) as engine:
        share(engine, a.mode, False, 16)  # warm-up
        runs: dict[str, list] = {"greedy": [], "sampled": []}
        for _ in range(a.repeats):
            for name in runs:
                runs[name].append(share(engine, a.mode, name == "sampled", a.max_tokens))
        for name, rs in runs.items():
            shares = [r[0] for r in rs]
            print(f"{a.mode} {name}: outside llama_decode {statistics.median(shares):.1%} of wall time "
                  f"(min {min(shares):.1%}, max {max(shares):.1%}; {rs[0][1]} tokens, "
                  f"{statistics.median(r[2] for r in rs):.1f} tok/s)")


if __name__ == "__main__":
    main()
