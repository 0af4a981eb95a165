"""Two checkouts of via-edge, the same modes, prompts and weights, in one interleaved run: is a
change speed-neutral? (docs/benchmarks.md, section 28)

    .venv/bin/python tools/ab_speed.py --base /tmp/before [--new .] [--modes ar,lookup]
        [--suite edit] [--categories agent] [--prompts 4] [-n 128] [--rounds 2] [--target GGUF] [--per-prompt]
        [--base-env KEY=VALUE ...] [--new-env KEY=VALUE ...]

`--base` is another checkout (e.g. `git worktree add /tmp/before HEAD~1`), or the same one with
another environment: `--base . --new-env GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (section 80). Each
round starts one process per (checkout, mode), which loads the target and warms up, then hands every
prompt to each process in turn, the order changing by prompt and round (`run_orders`: base right
after new as often as new right after base): only one generates at a time (two llama.cpp processes
at once slow each other down many times on 2 cores), and a checkout's prompt runs seconds from the
other's, not minutes, so the machine's drift over a round is shared. Whole processes still differ
(section 53: the same decodes ran 1.01-1.14x between two processes alive side by side): read the
spread, and `--per-prompt` for whether the work changed. Each prompt runs greedily from a cold cache
(an agent row's earlier requests first, untimed, so its copy memory holds their answers as in
`via-edge bench`). Reported per mode: the new checkout's tok/s over the base's, per prompt (geomean,
min-max over prompts and rounds), each checkout's share of wall time spent outside llama_decode (the
Python the loop adds), and how many answers of the first round are token for token the base's, and
`ar`'s (a change of kernels can change greedy answers at near-ties).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# run in the child, with the checkout first on sys.path: only what every version has is used
CHILD = r"""
import hashlib, json, sys
from via_edge import Engine
from via_edge.bench.suite import prompts_in_turn
a = json.loads(sys.argv[1])
prompts = prompts_in_turn(a["suite"], a["categories"], a["prompts"])
with Engine(a["target"], mode=a["mode"], n_ctx=4096) as engine:
    engine.generate(prompts[0].text, max_tokens=8)  # warm-up (and lookup's batch costs)
    print(json.dumps({"module": __import__("via_edge").__file__, "prompts": len(prompts)}), flush=True)
    for line in sys.stdin:  # the parent names the next prompt once the other processes are idle
        p = prompts[int(line)]
        engine.reset()
        for before in p.earlier:
            engine.generate(before, max_tokens=a["n"])
        res = engine.generate(p.text, max_tokens=a["n"])
        s = res.stats
        decode = s.target.seconds + s.draft.seconds + s.slim.seconds
        answer = hashlib.sha256(json.dumps(res.tokens).encode()).hexdigest()[:16]
        print(json.dumps({"id": p.id, "tok_s": s.tokens_per_second, "tokens": s.generated_tokens, "answer": answer,
                          "calls": s.target.calls, "rows": s.target.tokens,
                          "python": 1 - decode / (s.prefill_seconds + s.generate_seconds)}), flush=True)
"""


def env_setting(text: str) -> tuple[str, str]:
    """KEY=VALUE from the command line, checked before any process starts."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got '{text}'")
    return key, value


class Child:
    """One (checkout, mode) process, loaded once per round, generating each prompt it is sent."""

    def __init__(self, checkout: Path, mode: str, args: argparse.Namespace,
                 extra_env: list[tuple[str, str]]) -> None:
        arg = json.dumps({"suite": args.suite, "categories": args.categories, "prompts": args.prompts,
                          "n": args.n, "mode": mode, "target": args.target})
        self.name = f"{checkout} {mode}"
        self.log = tempfile.TemporaryFile("w+")  # llama.cpp's log: a pipe nobody reads would fill and block it
        env = dict(os.environ, PYTHONPATH=str(checkout), **dict(extra_env))
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, arg], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd="/")
        hello = self._read()
        if not hello["module"].startswith(str(checkout)):
            self.close()
            raise SystemExit(f"{checkout}: imported {hello['module']} instead (is it a via-edge checkout?)")
        self.prompts = hello["prompts"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise SystemExit(f"{self.name} failed:\n{self.log.read()[-2000:]}")
        return json.loads(line)

    def run(self, i: int) -> dict:
        self.proc.stdin.write(f"{i}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def _equal(a: list[dict], b: list[dict]) -> str:
    """How many of the first round's greedy answers two processes share, token for token."""
    return f"{sum(x['answer'] == y['answer'] for x, y in zip(a, b))} of {len(a)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the checkout to compare against")
    ap.add_argument("--new", type=Path, default=Path(__file__).resolve().parent.parent, help="default: this one")
    ap.add_argument("--modes", default="ar,lookup")
    ap.add_argument("--suite", default="edit", help="edit or spec-bench")
    ap.add_argument("--categories", default=None, type=lambda s: s.split(","),
                    help="comma-separated categories of the suite (e.g. agent; default: all in turn)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("-n", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", default=None, help="GGUF (default: the catalog's default target)")
    for side in ("base", "new"):
        ap.add_argument(f"--{side}-env", action="append", default=[], metavar="KEY=VALUE", type=env_setting,
                        help=f"an environment variable for the {side} checkout's processes (repeatable)")
    ap.add_argument("--per-prompt", action="store_true", help="also a row per prompt: its ratio per round, and the "
                    "target calls and rows (prompt included) each checkout spent, the same work in every round")
    args = ap.parse_args()
    if args.target is None:
        from via_edge.weights import catalog
        args.target = str(catalog.resolve(catalog.pair(None)["target"]))
    from via_edge.bench.metrics import in_run_order

    checkouts = {"base": args.base.resolve(), "new": args.new.resolve()}
    jobs = [(name, mode) for mode in args.modes.split(",") for name in checkouts]
    got: dict[tuple[str, str], list[list[dict]]] = {job: [] for job in jobs}
    for r in range(args.rounds):
        children: dict[tuple[str, str], Child] = {}
        try:
            for job in jobs:  # loaded one at a time, each then idle until named a prompt
                children[job] = Child(checkouts[job[0]], job[1], args, getattr(args, f"{job[0]}_env"))
                got[job].append([])
            for i in range(children[jobs[0]].prompts):  # each prompt by every process in turn, in balanced orders
                for job in in_run_order(jobs, r + i):
                    got[job][-1].append(children[job].run(i))
        finally:
            for child in children.values():
                child.close()
        print(f"round {r + 1} done", file=sys.stderr, flush=True)
    cats = f" ({','.join(args.categories)})" if args.categories else ""
    print(f"target {Path(args.target).name}, suite {args.suite}{cats}, {args.prompts} prompts x {args.n} tokens, "
          f"{args.rounds} rounds; base {checkouts['base']} {' '.join('='.join(e) for e in args.base_env)}, "
          f"new {checkouts['new']} {' '.join('='.join(e) for e in args.new_env)}")
    print("| mode | new / base tok/s (geomean, min-max) | base tok/s (median) | new tok/s (median) "
          "| outside llama_decode, base / new | answers equal to base's | equal to `ar`'s, base / new |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in args.modes.split(","):
        base, new = got[("base", mode)], got[("new", mode)]
        ratios = [n["tok_s"] / b["tok_s"] for rb, rn in zip(base, new) for b, n in zip(rb, rn)]
        med = {k: statistics.median(x["tok_s"] for rs in got[(k, mode)] for x in rs) for k in checkouts}
        py = {k: statistics.median(x["python"] for rs in got[(k, mode)] for x in rs) for k in checkouts}
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        same = _equal(base[0], new[0])
        vs_ar = (" / ".join(_equal(got[(k, "ar")][0], got[(k, mode)][0]) for k in checkouts)
                 if mode != "ar" and ("base", "ar") in got else "")
        print(f"| {mode} | {geo:.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) | {med['base']:.1f} | {med['new']:.1f} "
              f"| {py['base']:.1%} / {py['new']:.1%} | {same} | {vs_ar} |")
    if args.per_prompt:
        print("\n| mode | prompt | new / base tok/s per round | target calls, base / new | rows verified, base / new |")
        print("| --- | --- | --- | --- | --- |")
        for mode in args.modes.split(","):
            base, new = got[("base", mode)], got[("new", mode)]
            for i, first in enumerate(base[0]):
                per_round = " ".join(f"{rn[i]['tok_s'] / rb[i]['tok_s']:.3f}" for rb, rn in zip(base, new))
                print(f"| {mode} | {first['id']} | {per_round} | {first['calls']} / {new[0][i]['calls']} "
                      f"| {first['rows']} / {new[0][i]['rows']} |")


if __name__ == "__main__":
    main()
