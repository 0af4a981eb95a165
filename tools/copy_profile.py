#!/usr/bin/env python3
"""Where copy drafting's time goes on edits: every round of `lookup` on the edit suite traced
(docs/benchmarks.md, section 38).

    .venv/bin/python tools/copy_profile.py [--prompts 4] [--agent] [-n 256] [--predicted] [--json out.json] [--target GGUF]

The default pair as `Engine.from_pair` loads it (its automatic format and any tuned knobs), or
`--target` with the default knobs; no copy memory, except with `--agent`: the edit suite's agent
rows, each request before the traced one answered first (untimed) with the memory on, as
`via-edge bench` runs them. Per round:
context length, the draft (length, source, the copy's run length), the tokens the target kept,
the target's decode time, and the Python time around it. Printed per prompt and overall:
verification cost by batch size in single steps (medians at the prompt's context length), tokens
per round, rounds that drafted nothing, rounds spent re-anchoring (after a rejected draft, until
a draft is kept again), and Python milliseconds per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

from via_edge import Engine
from via_edge.bench.suite import load_prompts


def trace(engine: Engine, prompt, max_tokens: int, predicted: bool) -> list[dict]:
    """One generation's rounds: a round runs from one `propose` to the next."""
    rounds: list[dict] = []
    decodes: list[tuple[int, float]] = []
    engine.target.observers[:] = [lambda parts, s: decodes.append((sum(len(c) for _, c, _ in parts), s))]
    engine.reset()  # a fresh drafter, memory and cold caches, as bench runs it
    for before in prompt.earlier:  # an agent's earlier requests fill the memory and teach the policy
        engine.generate(before, mode="lookup", max_tokens=max_tokens)
    drafter = engine.slots.drafter(engine.slots.slots[0], "lookup")
    propose, accept = type(drafter).propose, type(drafter).accept

    def traced_propose(self, context, *args, **kw):
        draft = propose(self, context, *args, **kw)
        rounds.append({"t": time.perf_counter(), "ctx": len(context), "k": len(draft.tokens), "run": self.run,
                       "source": draft.source, "kept": None, "decodes": len(decodes)})
        return draft

    def traced_accept(self, n):
        rounds[-1]["kept"] = n
        accept(self, n)

    drafter.propose, drafter.accept = traced_propose.__get__(drafter), traced_accept.__get__(drafter)
    try:
        res = engine.generate(prompt.text, mode="lookup", max_tokens=max_tokens,
                              prediction=prompt.prediction if predicted else None)
        end = time.perf_counter()
    finally:
        engine.target.observers.clear()
    for i, r in enumerate(rounds):  # the round's decodes and wall time
        stop = rounds[i + 1]["decodes"] if i + 1 < len(rounds) else len(decodes)
        mine = decodes[r["decodes"]:stop]
        r["decode_s"] = sum(s for _, s in mine)
        r["batch"] = max((n for n, _ in mine), default=0)
        r["wall_s"] = (rounds[i + 1]["t"] if i + 1 < len(rounds) else end) - r["t"]
    for r in rounds:
        del r["t"], r["decodes"]
    rounds[0]["tokens"] = res.stats.generated_tokens
    return rounds


def summary(rounds: list[dict]) -> dict:
    by = defaultdict(list)
    for r in rounds:
        if r["batch"]:
            by[r["batch"]].append(r["decode_s"])
    one = statistics.median(by[1]) if by.get(1) else float("nan")
    rejected = anchoring = 0
    for r in rounds:
        if rejected and r["k"] and r["kept"]:
            rejected = 0
        elif rejected:
            anchoring += 1
        if r["k"] and r["kept"] is not None and r["kept"] < r["k"]:
            rejected = 1
    committed = sum((r["kept"] or 0) + 1 for r in rounds)
    return {
        "rounds": len(rounds), "tokens_per_round": committed / len(rounds),
        "no_draft_rounds": sum(r["k"] == 0 for r in rounds),
        "rejected_drafts": sum(r["k"] > 0 and r["kept"] is not None and r["kept"] < r["k"] for r in rounds),
        "drafted": sum(r["k"] for r in rounds), "kept": sum(r["kept"] or 0 for r in rounds),
        "reanchoring_rounds": anchoring,
        "single_step_ms": 1e3 * one,
        "verify_cost_in_steps": {n: round(statistics.median(v) / one, 2) for n, v in sorted(by.items())},
        "python_ms_per_round": 1e3 * statistics.median(r["wall_s"] - r["decode_s"] for r in rounds),
        "decode_share": sum(r["decode_s"] for r in rounds) / sum(r["wall_s"] for r in rounds),
        "sources": {s: sum(r["k"] for r in rounds if r["source"] == s) for s in {r["source"] for r in rounds if r["k"]}},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="the first N edit prompts")
    ap.add_argument("-n", type=int, default=256, help="max tokens per answer")
    ap.add_argument("--agent", action="store_true", help="the agent rows (follow-ups drafted from the copy memory)")
    ap.add_argument("--predicted", action="store_true", help="send each prompt's file as prediction")
    ap.add_argument("--json", default=None, help="write every round here")
    ap.add_argument("--target", default=None, help="this GGUF with default knobs, not the default pair as loaded")
    args = ap.parse_args()
    prompts = load_prompts("edit", ["agent" if args.agent else "edit"], args.prompts)
    memory = {} if args.agent else {"copy_memory": 0}
    engine = (Engine(args.target, mode="lookup", n_ctx=4096, **memory) if args.target
              else Engine.from_pair(None, **memory))
    with engine:
        engine.prepare("lookup")
        engine.generate("Say hi.", max_tokens=4)  # warm-up
        traces = {}
        for p in prompts:
            traces[p.id] = trace(engine, p, args.n, args.predicted)
            s = summary(traces[p.id])
            print(p.id, json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}), flush=True)
        every = [r for t in traces.values() for r in t]
        print("all", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in summary(every).items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(traces, f)


if __name__ == "__main__":
    main()
