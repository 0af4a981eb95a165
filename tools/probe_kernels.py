#!/usr/bin/env python3
"""How far do batched decodes drift from single-token decodes? (the source of greedy mismatches)

For each model: decode the same 120 tokens one at a time, in chunks of 3, and in one batch, and
print the largest logit difference and the first position where it exceeds 1e-3, under the
exact kernels (no repacking, F32 KV, no flash attention) and llama.cpp's defaults.

    .venv/bin/python tools/probe_kernels.py smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
"""

import sys

import numpy as np

from via_edge.llama import EXACT, LlamaModel, LoadParams
from via_edge.models import resolve
from via_edge.slim import build_f32


def probe(path, params, label):
    with LlamaModel(path, params) as m:
        seq = [(i * 37) % 250 + 3 for i in range(120)]
        m.reset()
        single = np.stack([m.decode([t])[0].copy() for t in seq])
        m.reset()
        full = m.decode(seq, "all").copy()
        m.reset()
        chunks = np.concatenate([m.decode(seq[i:i + 3], "all").copy() for i in range(0, len(seq), 3)])
    for name, other in (("batch of 120", full), ("chunks of 3", chunks)):
        d = np.abs(other - single).max(axis=1)
        first = int(np.argmax(d > 1e-3)) if (d > 1e-3).any() else None
        flips = int((other.argmax(1) != single.argmax(1)).sum())
        print(f"{label:45s} {name:13s} max |diff| {d.max():.2e}  first >1e-3 at {first}  argmax flips {flips}/120")


def main() -> None:
    for spec in sys.argv[1:]:
        path = resolve(spec)
        probe(path, LoadParams(n_ctx=512), f"{spec} (defaults)")
        probe(path, LoadParams(n_ctx=512, **EXACT), f"{spec} (exact kernels)")
        if spec.startswith("smollm2"):
            probe(build_f32(path), LoadParams(n_ctx=512, **EXACT), f"{spec} F32 copy (exact kernels)")


if __name__ == "__main__":
    main()
