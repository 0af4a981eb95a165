"""What one target verification costs by batch size on this machine: the price the copy policy
(drafters.CopyPolicy) weighs draft length against.

Measured once per model file, machine (CPU and llama.cpp build) and thread count, with the cost
profile's own interleaved timing (tune/profile.py), and kept next to the tuned choices, so a
first `lookup` run pays a few seconds and later ones nothing. Where the model directory is not
writable the figures are kept for the process only.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from importlib.resources import files
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import ViaEdgeError
from .files import write_json
from .llama import LlamaModel
from .machine import machine_key
from .models import model_dir, sha256_cached

BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33)  # 33: a 32-token draft and the target's own token
CONTEXT = 256
log = logging.getLogger("via_edge.costs")


def _points(model: LlamaModel) -> tuple[list[int], int]:
    """The batch sizes and context measured: as many of BATCHES and CONTEXT as the window holds."""
    batches = [n for n in BATCHES if 2 * n <= model.n_ctx] or [1]
    return batches, max(0, min(CONTEXT, model.n_ctx - batches[-1]))


def _path(model: LlamaModel) -> Path:
    threads = model.params.n_threads or "auto"
    batches, context = _points(model)
    return model_dir() / "tuned" / (f"batch-cost--{sha256_cached(model.path)[:16]}--{machine_key()}"
                                    f"--t{threads}--n{batches[-1]}c{context}.json")


def measure(model: LlamaModel, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one decode of n tokens after CONTEXT tokens, for n in BATCHES (as many
    of both as a small context window holds)."""
    from .tune.profile import measure as profile

    text = (files("via_edge") / "data" / "perplexity" / "textwrap.py.txt").read_text()
    fill = model.tokenize(text, add_special=False)
    batches, context = _points(model)
    before = (replace(model.usage), [replace(s.usage) for s in model.seqs])
    table = profile({"target": model}, fill, batches=batches, contexts=(context,), repeats=repeats)
    model.reset()
    model.usage = before[0]  # the measurement is no one's generation: it counts in no statistics
    for seq, usage in zip(model.seqs, before[1]):
        seq.usage = usage
    return dict(zip(batches, table.table["target"][0]))


def batch_cost(model: LlamaModel) -> Callable[[int], float]:
    """cost(n): one verification of n tokens in single decoding steps (cost(1) == 1), from the
    stored measurement of this model here, measuring it first if there is none."""
    path = _path(model)
    try:
        seconds = {int(n): float(s) for n, s in json.loads(path.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError):
        seconds = measure(model)
        try:
            write_json(path, {"model": model.path.name, "context": _points(model)[1],
                              "seconds": {str(n): s for n, s in seconds.items()}})
        except (OSError, ViaEdgeError) as exc:
            log.info("batch costs not stored (%s); measured again next time", exc)
    ns = sorted(seconds)
    rel = [seconds[n] / seconds[1] for n in ns]
    slope = (rel[-1] - rel[-2]) / (ns[-1] - ns[-2]) if len(ns) > 1 else 1.0

    def cost(n: int) -> float:
        if n > ns[-1]:
            return rel[-1] + slope * (n - ns[-1])
        return float(np.interp(n, ns, rel))
    return cost
