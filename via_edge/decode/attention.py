"""Flash attention on or off for a model: whichever decodes faster here, measured once per model
file, machine and thread count.

llama.cpp's CPU flash-attention kernel walks the keys once per query head; without it the attention
is two matrix products. Which is faster depends on the CPU and grows with the context: on an
AVX2-only AMD EPYC the products took 8% less per token at 1,500 tokens of context and 11-17% less
for a 16-row verification (docs/benchmarks.md sections 68 and 69). llama.cpp turns it on by default
on CPUs, llama-cpp-python off. Neither keeps a batch's rows equal to single decodes beyond 256
tokens of context (the kernel splits long single-token attention between threads, section 69), so
the choice costs the lossless modes nothing there; below it only flash attention is batch-invariant,
which is why `--exact` keeps it on (llama.EXACT).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ..errors import ViaEdgeError
from ..files import write_json
from ..llama import LlamaModel, LoadParams
from ..machine import machine_key
from ..weights.catalog import model_dir, sha256_cached
from .costs import calibration_tokens, measured_threads, reported, untallied

log = logging.getLogger(__name__)

CONTEXT = 512  # where it is measured: a long chat turn, a short edit (the gap grows with the context)
STEPS, ROWS = 8, 16  # one measurement: 8 single steps (plain decoding) and one 16-row verification
# Flash attention goes off where that is at least this much faster. Off, a batch's rows differ from
# single decodes also within the first 256 tokens (lossless modes then match `ar` up to rounding
# there too, section 69): a gain inside the measurement's noise is not worth that.
GAIN = 1.05
# Smaller files keep llama.cpp's default (on) unmeasured: a second load and two 512-token prefills
# are not worth it for a model whose step costs 11 ms (SmolLM2-135M, 100 MB, on the Zen 3 EPYC),
# and the test suite's models stay on one setting.
MIN_BYTES = 300_000_000


def _path(path: Path, params: LoadParams) -> Path:
    return model_dir() / "tuned" / (f"attention--{sha256_cached(path)[:16]}--{machine_key()}"
                                    f"--t{measured_threads(params)}.json")


def measure(on: LlamaModel, off: LlamaModel, repeats: int = 5) -> dict:
    """Median seconds of STEPS single decodes and one ROWS-token decode at CONTEXT tokens (or half
    the window), on the model loaded with flash attention `on` and `off`, interleaved."""
    fill = calibration_tokens(on)
    ctx = min(CONTEXT, on.seqs[0].n_ctx // 2, len(fill) - ROWS)
    models = {"on": on, "off": off}
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    with untallied(on, off):
        for m in models.values():
            m.seqs[0].reset()
            m.seqs[0].decode(fill[:ctx], "none")
        for rep in range(repeats):
            for name in ("on", "off") if rep % 2 == 0 else ("off", "on"):
                s = models[name].seqs[0]
                t0 = time.perf_counter()
                for t in fill[ctx:ctx + STEPS]:
                    s.decode([t], "last")
                s.truncate(ctx)
                s.decode(fill[ctx:ctx + ROWS], "all")
                seconds[name].append(time.perf_counter() - t0)
                s.truncate(ctx)
        for m in models.values():
            m.seqs[0].reset()
    return {"context": ctx, **{k: statistics.median(v) for k, v in seconds.items()}}


def _stored(path: Path) -> bool | None:
    try:
        return bool(json.loads(path.read_text())["flash_attn"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stored_choices() -> list[tuple[str, bool, float, str]]:
    """Every choice measured on this machine, any thread count: (model file, flash attention on,
    how much faster decoding ran with it off, threads) for `via-edge info`."""
    out = []
    for path in sorted((model_dir() / "tuned").glob(f"attention--*--{machine_key()}--t*.json")):
        try:
            d = json.loads(path.read_text())
            out.append((str(d["model"]), bool(d["flash_attn"]), float(d["off_gain"]), path.stem.rsplit("--t", 1)[1]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def open_fastest(path: Path, params: LoadParams, open_model: Callable[[LoadParams], LlamaModel],
                 progress: Callable[[float], None] | None = None) -> LlamaModel:
    """`path` opened with `open_model` and flash attention as measured here; measured first if it
    never was (both settings loaded; the slower one closed). `params.flash_attn` given: as given."""
    if params.flash_attn is not None or params.rpc or not path.is_file() or path.stat().st_size < MIN_BYTES:
        return open_model(params)  # a missing file fails here, with the loader's message
    store = _path(path, params)
    choice = _stored(store)
    if choice is not None:
        return open_model(replace(params, flash_attn=choice))
    on, off = open_model(replace(params, flash_attn=True)), None
    try:
        with reported(progress):
            off = open_model(replace(params, flash_attn=False))
            seconds = measure(on, off)
    except BaseException:  # Ctrl-C or a failed load: nothing stored, nothing left open
        for m in (on, off):
            if m is not None:
                m.close()
        raise
    gain = seconds["on"] / seconds["off"]
    result = {"flash_attn": gain < GAIN, **seconds, "off_gain": round(gain, 4)}
    kept, dropped = (on, off) if result["flash_attn"] else (off, on)
    dropped.close()
    try:
        write_json(store, {"model": path.name, **result})
    except (OSError, ViaEdgeError) as exc:
        log.info("attention choice not stored (%s); measured again next time", exc)
    return kept


def open_measured(path: Path, params: LoadParams, open_model: Callable[[LoadParams], LlamaModel],
                  progress: Callable[[float], None] | None = None) -> tuple[LlamaModel, LoadParams]:
    """`open_fastest`, and `params` with the setting it opened with, for the models that load
    beside it: a draft or slim that hands KV caches to it needs the same V cache layout."""
    model = open_fastest(path, params, open_model, progress)
    return model, replace(params, flash_attn=model.params.flash_attn)
