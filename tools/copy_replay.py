#!/usr/bin/env python3
"""`lookup`'s copy policy replayed on stored greedy answers: how often a copy's next token is the
answer's next token by run length, and the speed-up over `ar` a prior would give (docs/benchmarks.md,
section 44).

    .venv/bin/python tools/copy_replay.py --results edit=/tmp/bench/editA/results.json \\
        --results spec-bench=/tmp/bench/specB1/results.json [--prior 0.2,0.45,...] [--prior-weight 1] [--context 1536] \\
        [--memory [--lead 32]] [--costs /tmp/costs.json | --curve amx.json] [--shifts 16] [--by-category] [--oracle]

`--results SUITE=FILE` is a `via-edge bench` results file with an `ar` run per prompt (its tokens
are the answers). The replay runs the real `CopyDrafter` and `CopyPolicy` over each answer: a round
drafts what the policy picks (within the tokens an answer cut at the token limit has left, as the
decoding loop does), keeps the tokens that match the answer, and costs one verification
of that many rows. The policy prices verifications with the target's stored batch costs (as
`lookup` does); the replay charges what they cost at `--context` tokens, measured here first
(every size from 1 to 80, 3 repeats, about a minute). Nothing else runs the model (but an agent
row's earlier requests, below): a prior is judged on both suites in seconds, then confirmed by a
real interleaved run (`tools/ab_speed.py`). `--memory` replays a suite's answers in the file's
order with the copy memory going on across them (each entry led by its prompt's last `--lead`
tokens), as the bench runs a method; an agent row's earlier requests are answered here with `ar`
first and go into the memory before it. `--shifts 16` judges a prior in expectation over where
the drafts meet a copy's breaks (section 58): on one placement, priors that tie in expectation
differed by 6%. `--curve` replays as on another machine from its cost curve (an AMX Xeon's, say,
whose verification rows cost a fraction of this CPU's), and `--oracle` sets each draft's length
by where its copy really breaks: the policy's distance from the best its anchors allow (section 78).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from importlib.resources import files
from pathlib import Path

import numpy as np

from via_edge import Engine
from via_edge.bench.metrics import geomean
from via_edge.bench.suite import load_prompts
from via_edge.decode import copying, costs
from via_edge.decode import memory as copy_memory
from via_edge.decode.copying import CopyDrafter, CopyPolicy
from via_edge.decode.memory import DEFAULT_TOKENS, CopyMemory
from via_edge.decode.sampling import SamplingParams
from via_edge.decode.spec import SpecParams
from via_edge.files import write_json
from via_edge.weights import catalog

GREEDY = SamplingParams()
SIZES = (1, 2, 4, 8, 16, 24, 32, 33, 40, 47, 48, 49, 56, 63, 64, 65, 72, 80)


def answers(engine: Engine, suite: str, path: str, agents: bool) -> list[tuple[list[int], list[int], list, str, bool]]:
    """(prompt tokens, ar's answer tokens, earlier requests, category, whether the answer ended
    itself rather than at the token limit) of every prompt the results
    file ran in `ar`: the prompt tokenized as the engine tokenizes a generation's text. With `agents`, an
    agent row's earlier requests come as (prompt tokens, answer tokens) pairs, their answers
    generated here with `ar` as the bench generates them before the row (untimed, so the file
    does not hold them; each about 10 s)."""
    data = json.load(open(path))
    prompts = {p.id: p for p in load_prompts(suite, None, 1000)}
    made: dict[str, tuple[list[int], list[int]]] = {}

    def earlier(text: str) -> tuple[list[int], list[int]]:
        if text not in made:
            tokens = engine.tokens_for(text, chat_template=True)
            made[text] = (tokens, _answer(engine, engine.generate(tokens, mode="ar",
                                                                  max_tokens=data["meta"]["params"]["max_tokens"]).tokens))
        return made[text]
    return [(engine.tokens_for(prompts[r["prompt_id"]].text, chat_template=True), _answer(engine, r["tokens"]),
             [earlier(text) for text in prompts[r["prompt_id"]].earlier] if agents else [], r["category"],
             bool(r["tokens"]) and engine.target.is_eog(r["tokens"][-1]))
            for r in data["runs"] if r["method"] == "ar" and r["prompt_id"] in prompts and r.get("round", 0) == 0]


def _answer(engine: Engine, tokens: list[int]) -> list[int]:
    """Without its end-of-generation token: the answer the next request may copy."""
    return tokens[:-1] if tokens and engine.target.is_eog(tokens[-1]) else tokens


def calibration(rows) -> dict[int, tuple[int, int]]:
    """Per run bucket: (copies whose next token was the answer's, copies whose was not)."""
    seen = defaultdict(lambda: [0, 0])
    for prompt, out, *_ in rows:
        d = CopyDrafter(CopyPolicy(lambda n: 1.0))  # drafts wherever a copy is aligned
        d.begin(prompt)
        for i, tok in enumerate(out):
            draft = d.propose(prompt + out[:i], 1, GREEDY, None, SpecParams())
            if draft.tokens:
                seen[copying._bucket(d.run)][draft.tokens[0] != tok] += 1
                d.accept(int(draft.tokens[0] == tok))
    return {b: tuple(v) for b, v in sorted(seen.items())}


def replay(rows, policy_cost, true_cost, memory: CopyMemory | None = None, shifts: int = 1,
           oracle: bool = False) -> list[float]:
    """Speed-up over ar per answer: tokens / single steps spent. With a `memory`, each answer
    drafts from the answers before it and goes into it after, as in `via-edge bench`. With
    `shifts` > 1, the mean over that many replays whose first draft is put off by 0, 2, 4, ...
    tokens: where a copy breaks relative to the drafts is luck, and a prior judged on one
    placement can win by it (docs/benchmarks.md section 58). An agent row's earlier requests go
    into the memory before it, as the bench runs them. With `oracle`, each draft's length is the
    best for where its copy really breaks (same anchors): what the policy's lengths leave."""
    out_speed = []
    for prompt, out, earlier, _, ended in rows:
        if memory is not None:
            for before, answer in earlier:
                memory.add(answer, lead=before)
        speeds = [_one(prompt, out, ended, policy_cost, true_cost, memory, 2 * s, oracle) for s in range(shifts)]
        out_speed.append(sum(speeds) / len(speeds))
        if memory is not None:
            memory.add(out, lead=prompt)
    return out_speed


def _one(prompt, out, ended: bool, policy_cost, true_cost, memory: CopyMemory | None, delay: int,
         oracle: bool) -> float:
    d = CopyDrafter(CopyPolicy((lambda n: 1.0) if oracle else policy_cost))  # the oracle sees the whole copy
    d.begin(prompt, memory.sources() if memory is not None else ())
    i, steps, first = 0, 0.0, None
    while i < len(out):
        # the decoding loop drafts within the tokens left (Decoder._draft); an answer that ended
        # itself did not know where, and a draft past its end is rejected there
        room = 64 if ended else min(64, len(out) - i - 1)
        draft = d.propose(prompt + out[:i], room, GREEDY, None, SpecParams())
        if oracle and draft.tokens:
            holds = _kept(draft.tokens, out, i)
            k = max(range(len(draft.tokens) + 1), key=lambda n: (min(n, holds) + 1) / true_cost(n + 1))
            draft.tokens = draft.tokens[:k]
            d._last = (d._last[0], draft.tokens, d._last[2]) if k else None
        if draft.tokens and first is None:
            first = i
        if draft.tokens and i < first + delay:  # put off: a plain step, nothing learned
            draft.tokens, d._last = [], None
        kept = _kept(draft.tokens, out, i)
        if draft.tokens:
            d.accept(kept)
        steps += true_cost(len(draft.tokens) + 1)
        i += kept + 1
    return len(out) / steps


def _kept(draft: list[int], out: list[int], i: int) -> int:
    """How many of the draft's tokens the answer has from position i on."""
    kept = 0
    while kept < len(draft) and i + kept < len(out) and draft[kept] == out[i + kept]:
        kept += 1
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", action="append", required=True, help="SUITE=FILE (repeatable)")
    ap.add_argument("--prior", default=None, help="comma-separated acceptance per run bucket (runs 1 to 7 one "
                    "each, then 8-15, 16-31, ..., 128+); default: the shipped prior")
    ap.add_argument("--prior-weight", type=float, default=None,
                    help="observed tokens each bucket's prior weighs (default: the shipped weight)")
    ap.add_argument("--memory", action="store_true", help="replay each suite's answers in order with the copy "
                    "memory going on across them, as `via-edge bench` runs them")
    ap.add_argument("--lead", type=int, default=None, help="prompt tokens a memory entry keeps before its "
                    "answer (default: the shipped LEAD)")
    ap.add_argument("--shifts", type=int, default=1, help="mean over this many placements of the drafts "
                    "(each answer's first draft put off by 0, 2, 4, ... tokens)")
    ap.add_argument("--context", type=int, default=1536, help="context the replay's costs are measured at")
    ap.add_argument("--costs", default=None, help="keep the measured costs in this JSON file and reuse them "
                    "if it exists: replays compared on one measurement")
    ap.add_argument("--curve", default=None, help="replay as on another machine: a JSON file of its verification "
                    "costs (\"sizes\" and \"seconds\", e.g. its --costs file); the policy prices its drafts with "
                    "them too, and nothing is measured here")
    ap.add_argument("--oracle", action="store_true", help="also replay with each draft as long as is best for "
                    "where its copy really breaks (same anchors): what the policy's lengths leave")
    ap.add_argument("--target", default=None, help="GGUF (default: the catalog's default target, shipped file)")
    ap.add_argument("--by-category", action="store_true", help="also the replayed speed-up per category: "
                    "what the policy itself gains or loses there, apart from a measured run's noise")
    args = ap.parse_args()
    results = [spec.partition("=")[::2] for spec in args.results]
    for suite, path in results:
        if not suite or not os.path.isfile(path):
            ap.error(f"--results wants SUITE=FILE with an existing bench results file, got {suite}={path}")
    if args.prior:
        try:
            ps = [float(x) for x in args.prior.split(",")]
        except ValueError:
            ap.error(f"--prior wants comma-separated numbers, got {args.prior!r}")
        if len(ps) != len(copying.PRIOR) or not all(0 < p < 1 for p in ps):
            ap.error(f"--prior wants {len(copying.PRIOR)} probabilities in (0, 1), one per run bucket")
        copying.PRIOR = tuple(ps)
    if args.prior_weight is not None:
        if not args.prior_weight > 0:
            ap.error(f"--prior-weight wants a positive number, got {args.prior_weight}")
        copying.PRIOR_WEIGHT = args.prior_weight
    if args.curve and args.costs:
        ap.error("--curve replays another machine's costs and --costs keeps this one's: give one")
    curve = None
    if args.curve:
        try:
            stored = json.load(open(args.curve))
            curve = {int(n): float(t) for n, t in zip(stored["sizes"], stored["seconds"], strict=True)}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--curve {args.curve} is unreadable ({exc}); it wants \"sizes\" and \"seconds\" lists")
        if 1 not in curve or min(curve.values()) <= 0:
            ap.error(f"--curve {args.curve} needs a positive cost for every size, 1 among them")
    if args.shifts < 1:
        ap.error(f"--shifts wants a number >= 1, got {args.shifts}")
    if args.lead is not None:
        if args.lead < 0:
            ap.error(f"--lead wants a number of tokens >= 0, got {args.lead}")
        copy_memory.LEAD = args.lead
    target = args.target or str(catalog.resolve(catalog.pair(None)["target"]))
    with Engine(target, mode="lookup", n_ctx=4096, copy_memory=0) as engine:
        policy_cost = costs.batch_cost(engine.target) if curve is None else costs.tiled(curve)
        kept = {"target": os.path.basename(target), "context": args.context, "sizes": list(SIZES)}
        sizes = SIZES if curve is None else sorted(curve)
        if curve is not None:
            seconds = [curve[n] for n in sizes]
        elif args.costs and os.path.isfile(args.costs):
            try:
                stored = json.load(open(args.costs))
                seconds = stored["seconds"]
            except (OSError, ValueError, KeyError) as exc:
                ap.error(f"--costs {args.costs} is unreadable ({exc}); delete it to measure again")
            if {k: stored.get(k) for k in kept} != kept:
                ap.error(f"--costs {args.costs} was measured for {stored.get('target')} at context "
                         f"{stored.get('context')}, not {kept['target']} at {args.context}; give another file")
        else:  # measured on a fixed text, only when neither a curve nor a kept measurement is given
            text = (files("via_edge") / "data" / "perplexity" / "textwrap.py.txt").read_text()
            fill = engine.target.tokenize(text, add_special=False)
            measured = costs.measure({"t": engine.target}, fill, batches=SIZES, contexts=(args.context,), repeats=3)
            seconds = measured.table["t"][0]
            if args.costs:
                write_json(Path(args.costs), {**kept, "seconds": seconds})
        where = f"from {args.curve}" if curve is not None else f"at context {args.context}"
        print(f"verification cost {where}, single steps: "
              + ", ".join(f"{n}: {s / seconds[0]:.2f}" for n, s in zip(sizes, seconds)))

        def true_cost(n: int) -> float:
            return float(np.interp(n, sizes, seconds)) / seconds[0]
        suites = {suite: answers(engine, suite, path, args.memory) for suite, path in results}
    print("prior acceptance per run bucket:", ", ".join(f"{p:.2f}" for p in copying.PRIOR),
          f"(each weighing {copying.PRIOR_WEIGHT:g} observed tokens)")
    for suite, rows in suites.items():
        cal = calibration(rows)
        print(f"{suite}: next token copied by run bucket (kept/seen): "
              + ", ".join(f"{b}: {a}/{a + r} = {a / (a + r):.3f}" for b, (a, r) in cal.items()))
        speed = replay(rows, policy_cost, true_cost, CopyMemory(DEFAULT_TOKENS) if args.memory else None, args.shifts)
        geo = geomean(speed)
        print(f"{suite}: replayed speed-up over ar, geomean {geo:.3f} (min {min(speed):.3f}, max {max(speed):.3f}, "
              f"{len(speed)} answers)")
        if args.by_category:
            by_category(suite, "", rows, speed)
        if args.oracle:
            best = replay(rows, policy_cost, true_cost, CopyMemory(DEFAULT_TOKENS) if args.memory else None,
                          args.shifts, oracle=True)
            print(f"{suite}: oracle lengths, geomean {geomean(best):.3f} (min {min(best):.3f}, max {max(best):.3f}); "
                  "per answer, policy/oracle: " + " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(speed, best)))
            if args.by_category:
                by_category(suite, "oracle lengths, ", rows, best)


def by_category(suite: str, label: str, rows, speed: list[float]) -> None:
    by: dict[str, list[float]] = defaultdict(list)
    for row, s in zip(rows, speed):
        by[row[3]].append(s)
    print(f"{suite}: {label}per category, " + ", ".join(f"{c} {geomean(v):.3f} ({len(v)})" for c, v in sorted(by.items())))


if __name__ == "__main__":
    main()
