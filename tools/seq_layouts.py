"""Decode cost of 1, 2 and 4 sequences (contiguous ids or not) per KV layout (docs/benchmarks.md section 17).

    .venv/bin/python tools/seq_layouts.py TOKENS_PER_SEQUENCE [GGUF]
"""
import statistics
import sys
import time
from via_edge.llama import LlamaModel, LoadParams
from via_edge import formats
from via_edge import models as catalog

P = sys.argv[2] if len(sys.argv) > 2 else formats.derive(catalog.resolve(catalog.pair(None)["target"]), "iq4_nl")
L = int(sys.argv[1])
for uni in (False, True):
    m = LlamaModel(P, LoadParams(n_ctx=4*4096, n_seq=4, kv_unified=uni))
    for seq in m.seqs:
        seq.prefill(list(range(1000, 1000 + L)))
    res = {}
    for rep in range(5):
        for ids in ([0], [0, 1], [0, 2], [1, 3], [0, 1, 2, 3]):
            parts = [(m.seqs[i], [7], [0]) for i in ids]
            t = time.perf_counter()
            m.decode_batch(parts)
            res.setdefault(str(ids), []).append(time.perf_counter() - t)
            for i in ids:
                m.seqs[i].truncate(L)
    print("unified" if uni else "per-seq", {k: round(1000 * statistics.median(v)) for k, v in res.items()})
    m.close()
