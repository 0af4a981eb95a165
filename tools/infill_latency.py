#!/usr/bin/env python3
"""Latency of a short editor completion: via-edge's `/infill` against llama-server's, same GGUF
and threads, requests alternated one at a time (docs/benchmarks.md, section 39).

    .venv/bin/python tools/infill_latency.py [--model GGUF] [--requests 12] [-n 32]

Each request cuts a module of the edit suite (CPython's standard library) at a line: the prefix
is the code before (its last 60 lines), the suffix the code after (its next 20 lines), as
llama.vim sends them, plus the module before it as `input_extra`. Both servers answer greedily
(`temperature` 0; via-edge in its default mode, `lookup`), both reusing the cached prefix of the
previous request (llama-server: `cache_prompt`; via-edge: always); llama-server is the binary
`tools/build_llama_server.sh` builds (or VIA_EDGE_LLAMA_SERVER). Per server: median and spread
of the wall time per request, and the ratio of medians.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

import httpx

from via_edge.bench.peers import server_binary
from via_edge.bench.suite import packaged_rows
from via_edge.weights.catalog import resolve


def start(argv: list[str], base: str) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{argv[0]} exited: {proc.stderr.read()[-1000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"{argv[0]} did not start")


def requests_from_suite(count: int, n_predict: int) -> list[dict]:
    files = [re.search(r"```python\n(.*?)```", r["prompt"], re.S).group(1)
             for r in packaged_rows("edit") if r["category"] == "edit"]
    out = []
    for i in range(count):
        lines = files[i % len(files)].splitlines(keepends=True)
        cut = len(lines) // 3 + 7 * (i // len(files))  # a line in the body, another one on the next pass
        line = lines[cut]
        typed = line[:len(line) - len(line.lstrip()) + 4]  # the indentation and a little of the line
        out.append({"input_prefix": "".join(lines[max(0, cut - 60):cut]), "prompt": typed,
                    "input_suffix": line[len(typed):] + "".join(lines[cut + 1:cut + 21]),
                    "input_extra": [{"filename": "other.py", "text": files[i - 1 if i else -1][:3000]}],
                    "n_predict": n_predict, "temperature": 0, "cache_prompt": True})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the catalog target, as shipped)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("-n", type=int, default=32, help="n_predict per request")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = args.model or str(resolve("qwen2.5-coder-1.5b-instruct", pull_missing=True))
    binary = server_binary()
    if binary is None:
        sys.exit("llama-server is not built here: bash tools/build_llama_server.sh")
    ours, theirs = "http://127.0.0.1:18181", "http://127.0.0.1:18182"
    procs = [start([sys.executable, "-m", "via_edge", "serve", "--target", model, "--port", "18181", "--parallel",
                    "1", "--threads", str(args.threads), "--format", "shipped"], ours),
             start([str(binary), "-m", model, "--port", "18182", "-np", "1", "-c", "4096", "-t", str(args.threads),
                    "-tb", str(args.threads)], theirs)]
    try:
        reqs = requests_from_suite(args.requests, args.n)
        times: dict[str, list[float]] = {"via-edge": [], "llama-server": []}
        same = 0
        warm = {"input_prefix": "def f(x):\n    return ", "input_suffix": "\n", "n_predict": 4, "temperature": 0}
        for base in (ours, theirs):  # warm-up (a request of its own: a repeated prompt would be cached)
            httpx.post(base + "/infill", json=warm, timeout=600).raise_for_status()
        for i, body in enumerate(reqs):
            order = [("via-edge", ours), ("llama-server", theirs)][:: 1 if i % 2 == 0 else -1]
            texts = {}
            for name, base in order:
                t0 = time.perf_counter()
                r = httpx.post(base + "/infill", json=body, timeout=600)
                times[name].append(time.perf_counter() - t0)
                r.raise_for_status()
                texts[name] = r.json()["content"]
            same += texts["via-edge"] == texts["llama-server"]
        for name, ts in times.items():
            print(f"{name}: median {1e3 * statistics.median(ts):.0f} ms (min {1e3 * min(ts):.0f}, max "
                  f"{1e3 * max(ts):.0f}) over {len(ts)} requests")
        ratios = [a / b for a, b in zip(times["via-edge"], times["llama-server"])]
        print(f"via-edge / llama-server: median of per-request ratios {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}); same completion {same}/{len(reqs)}")
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)


if __name__ == "__main__":
    main()
