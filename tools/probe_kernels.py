#!/usr/bin/env python3
"""How far do batched decodes drift from single-token decodes? (the source of greedy mismatches)

For each model and kernel setting: decode the same 120 tokens one at a time, then in chunks of
c tokens, and print, per chunk size, the largest logit difference and how many argmaxes flip.

    .venv/bin/python tools/probe_kernels.py smollm2-135m-instruct qwen2.5-coder-1.5b-instruct
"""

import sys

import numpy as np

from via_edge.llama import EXACT_F32, LlamaModel, LoadParams
from via_edge.models import resolve
from via_edge.slim import build_f32

SETTINGS = {
    "llama.cpp defaults": {},
    "no repacking": {"use_extra_bufts": False},
    "no repacking, F32 KV, no flash attn": EXACT_F32,
}
CHUNKS = (2, 4, 7, 8, 16, 120)


def probe(path, label: str) -> None:
    seq = [(i * 37) % 250 + 3 for i in range(120)]
    for name, overrides in SETTINGS.items():
        with LlamaModel(path, LoadParams(n_ctx=512, **overrides)) as m:
            m.reset()
            single = np.stack([m.decode([t])[0].copy() for t in seq])
            cells = []
            for c in CHUNKS:
                m.reset()
                rows = np.concatenate([m.decode(seq[i:i + c], "all").copy() for i in range(0, len(seq), c)])
                flips = int((rows.argmax(1) != single.argmax(1)).sum())
                cells.append(f"{np.abs(rows - single).max():.0e}/{flips}")
        print(f"| {label} | {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    print("| model | kernels | " + " | ".join(f"chunks of {c}" for c in CHUNKS) + " |")
    print("| --- | --- |" + " --- |" * len(CHUNKS))
    for spec in sys.argv[1:]:
        path = resolve(spec)
        probe(path, spec)
        if spec.startswith("smollm2"):
            probe(build_f32(path), spec + " (F32 copy)")


if __name__ == "__main__":
    main()
