"""Start-up: the wall time of `via-edge generate -n 1` against llama-cpp-python loading the same
file and answering one token, each a fresh process, alternated (docs/benchmarks.md, section 30).

    .venv/bin/python tools/startup_time.py [--target GGUF] [--rounds 5]

A laptop chat user waits for this at every start: process start, imports, reading the GGUF header,
loading the weights, the chat template, one token. Both sides use the same context size and the
chat template; the medians and spreads of each and their ratio are printed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Say hi."
LLAMA_CPP_PYTHON = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=4096, n_threads=2, verbose=False)
llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=1, temperature=0)
"""


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed:\n{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="GGUF (default: the catalog's default target)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.target is None:
        from via_edge.weights import catalog
        args.target = str(catalog.resolve(catalog.pair(None)["target"]))
    runs = {
        "via-edge generate -n 1": [sys.executable, "-m", "via_edge", "generate", PROMPT, "--target", args.target,
                                   "--mode", "ar", "-n", "1", "--ctx", "4096", "--threads", "2"],
        "llama-cpp-python": [sys.executable, "-c", LLAMA_CPP_PYTHON, args.target, PROMPT],
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % 2:] + names[:r % 2]:
            times[name].append(timed(runs[name]))
    print(f"{Path(args.target).name}, {args.rounds} rounds, each a fresh process, alternated")
    for name, ts in times.items():
        print(f"  {name:24s} median {statistics.median(ts):5.2f} s (min {min(ts):.2f}, max {max(ts):.2f})")
    ratio = statistics.median(times[names[0]]) / statistics.median(times[names[1]])
    print(f"  ratio (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
