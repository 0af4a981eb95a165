#!/usr/bin/env python3
"""Prompt KV for a prefix slim: import the target's (sliced) sequence state vs prefill it again.

    .venv/bin/python tools/probe_kv_import.py qwen2.5-coder-1.5b-instruct 0-23
"""

import statistics
import sys
import time

from via_edge.bench.suite import load_prompts
from via_edge.llama import LlamaModel, LoadParams
from via_edge.models import resolve
from via_edge.slim import build_slim, parse_layers, slice_seq_state


def main() -> None:
    target_path = resolve(sys.argv[1])
    spec = sys.argv[2]
    slim_path = build_slim(target_path, spec)
    params = LoadParams(n_ctx=4096)
    with LlamaModel(target_path, params) as target, LlamaModel(slim_path, params) as slim:
        keep = len(parse_layers(spec, target.n_layer))
        for p in load_prompts("spec-bench", ["coding", "summarization", "rag"], 1):
            toks = target.tokenize(p.text)
            target.reset()
            target.prefill(toks)
            imp, pre = [], []
            for _ in range(3):
                slim.reset()
                t0 = time.perf_counter()
                slim.set_seq_state(slice_seq_state(target.seq_state(), keep), target.tokens)
                imp.append(time.perf_counter() - t0)
                slim.reset()
                t0 = time.perf_counter()
                slim.prefill(toks)
                pre.append(time.perf_counter() - t0)
            i, f = statistics.median(imp), statistics.median(pre)
            print(f"{p.category:14s} {len(toks):4d} tokens: import {i * 1e3:7.1f} ms, prefill {f * 1e3:8.1f} ms "
                  f"(median of 3), prefill/import {f / i:6.1f}x")


if __name__ == "__main__":
    main()
