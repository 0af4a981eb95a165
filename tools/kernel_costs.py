"""Decode cost by batch size per GGUF, with and without an environment setting llama.cpp reads
once at start-up (default: GGML_CPU_TILED_MM=0, which turns off the tiled K-quant matmul used
for n >= 8). Each setting runs in its own process, alternating, `--rounds` times; medians kept.

    .venv/bin/python tools/kernel_costs.py MODEL.gguf [MODEL.gguf ...] [--env GGML_CPU_TILED_MM=0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

BATCHES = (1, 2, 4, 8, 16)


def child(paths: list[str], ctx: int, repeats: int) -> None:
    from via_edge.decode.costs import measure
    from via_edge.llama import LlamaModel, LoadParams

    models = {p: LlamaModel(p, LoadParams(n_ctx=2048)) for p in paths}
    fill = list(range(1000, 1000 + ctx + max(BATCHES)))
    prof = measure(models, fill, batches=BATCHES, contexts=(ctx,), repeats=repeats)
    print(json.dumps({p: prof.table[p][0] for p in paths}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--env", default="GGML_CPU_TILED_MM=0")
    ap.add_argument("--ctx", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.models, a.ctx, a.repeats)
        return
    key, _, value = a.env.partition("=")
    settings = {"default": {k: v for k, v in os.environ.items() if k != key}, a.env: {**os.environ, key: value}}
    samples: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(a.rounds):
        for name, env in list(settings.items())[:: 1 if r % 2 == 0 else -1]:  # order alternates by round
            out = subprocess.run([sys.executable, __file__, *a.models, "--child", "--ctx", str(a.ctx),
                                  "--repeats", str(a.repeats)], env=env, capture_output=True, text=True, check=True)
            samples[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| model | setting | " + " | ".join(f"n={n} ms" for n in BATCHES) + " |")
    print("| --- | --- |" + " --- |" * len(BATCHES))
    for p in a.models:
        for name in settings:
            med = [statistics.median(s[p][i] for s in samples[name]) * 1e3 for i in range(len(BATCHES))]
            print(f"| {os.path.basename(p)} | {name} | " + " | ".join(f"{x:.1f}" for x in med) + " |")


if __name__ == "__main__":
    main()
