"""The cost model: what one `llama_decode` of n tokens at context length c costs on this machine,
measured, and the one way it is read (`CostProfile.cost`, piecewise linear, extended beyond the
measured sizes). The tuner profiles draft, target and slims with it (`measure`); the copy
policy of `lookup` prices a verification of n tokens in single steps with `verify_cost`, live
(`batch_cost`: measured once per model file, machine and thread count, kept next to the tuned
choices) and in the tuner's replay alike, so both size copy drafts the same way.
`prompt_helper` measures whether the target's prompts decode faster on its copy loaded without
weight repacking (llama/prefill.py).

A profile is measured interleaved (every model at every point before the next repeat, in rotated
order) so that noise on this shared machine hits all models alike; medians are kept. A slim's
cost depends on how many blocks it keeps, not which, so slims of any size are priced by
interpolating, per (n, c), between the measured block counts and the target; `fit_error` says
how well that holds.
"""

from __future__ import annotations

import bisect
import json
import logging
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from importlib.resources import files
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import ViaEdgeError
from ..files import write_json
from ..llama import LlamaModel, LoadParams
from ..llama.prefill import Prefiller
from ..llama.runtime import default_threads
from ..machine import machine_key
from ..weights.catalog import model_dir, sha256_cached
from ..weights.formats import source_file

Cost = Callable[[str, int, int], float]  # (model, tokens, context) -> seconds of one call
VERIFY_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # 64: a 63-token draft and the target's own token
VERIFY_CONTEXT = 256
log = logging.getLogger("via_edge.costs")
PROFILE_BATCHES = VERIFY_BATCHES[:8]  # the tuner's cost profile, 1..16: sizes between are interpolated
PROFILE_CONTEXTS = (64, 384, 1024)


@dataclass
class CostProfile:
    """Median seconds per decode call: table[model][ci][bi] for contexts[ci] and batches[bi]."""

    batches: list[int]
    contexts: list[int]
    table: dict[str, list[list[float]]]
    blocks: dict[str, int]           # blocks of each measured model ("target", "draft", "slim-K")
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the tuner's replay prices half a million calls from a few thousand distinct (model, n, ctx)
        self._memo: dict[tuple[str, int, int], float] = {}

    @classmethod
    def from_dict(cls, data: Mapping) -> "CostProfile":
        return cls(list(data["batches"]), list(data["contexts"]), dict(data["table"]), dict(data["blocks"]),
                   dict(data.get("meta", {})))

    def to_dict(self) -> dict:
        return asdict(self)

    def scaled(self, ratios: Mapping[int, float]) -> Callable[[str, int, int], float]:
        """Costs of the same models in another weight format: every target-derived call (target,
        slims) times that format's measured cost ratio to the shipped file at this batch size
        (interpolated between the measured sizes, held beyond them); the draft's cost as is (it
        was profiled in its own chosen format)."""
        ns = sorted(ratios)
        ys = [ratios[n] for n in ns]
        memo: dict[tuple[str, int, int], float] = {}

        def cost(model: str, n: int, ctx: int) -> float:
            c = memo.get((model, n, ctx))
            if c is None:
                base = self.cost(model, n, ctx)
                c = memo[model, n, ctx] = base if model == "draft" else base * float(np.interp(n, ns, ys))
            return c
        return cost

    def cost(self, model: str, n: int, ctx: int) -> float:
        """Seconds for one call of `model` ("target", "draft" or "slim-K" for a K-block slim)."""
        c = self._memo.get((model, n, ctx))
        if c is None:
            if model.startswith("slim-") and model not in self.table:
                c = self.slim_cost(int(model[5:]), n, ctx)
            else:
                c = _bilinear(self.table[model], self.contexts, self.batches, ctx, n)
            self._memo[model, n, ctx] = c
        return c

    def slim_cost(self, blocks: int, n: int, ctx: int) -> float:
        """A K-block slim, interpolated between measured slims and the target by block count."""
        points = sorted((b, m) for m, b in self.blocks.items() if m.startswith("slim-") or m == "target")
        xs = [b for b, _ in points]
        ys = [self.cost(m, n, ctx) for _, m in points]
        return float(_interp_extrap(blocks, xs, ys))

    def fit_error(self) -> dict:
        """Relative error (median and worst point) of predicting each measured slim from the other
        measured models by block count: how far the per-block interpolation can be trusted."""
        slims = [m for m in self.table if m.startswith("slim-")]
        if not slims:
            return {"median": float("nan"), "max": float("nan")}
        errors = []
        for m in slims:
            rest = CostProfile(self.batches, self.contexts, {k: v for k, v in self.table.items() if k != m},
                               {k: v for k, v in self.blocks.items() if k != m})
            for ci, c in enumerate(self.contexts):
                for bi, n in enumerate(self.batches):
                    actual = self.table[m][ci][bi]
                    errors.append(abs(rest.slim_cost(self.blocks[m], n, c) - actual) / actual)
        return {"median": statistics.median(errors), "max": max(errors)}


def _interp_extrap(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear, extended linearly beyond both ends (costs keep growing with size)."""
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = bisect.bisect_left(xs, x) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _bilinear(table: Sequence[Sequence[float]], contexts: Sequence[int], batches: Sequence[int], ctx: int, n: int) -> float:
    by_ctx = [_interp_extrap(n, batches, row) for row in table]
    return _interp_extrap(ctx, contexts, by_ctx)


def measure(models: Mapping[str, LlamaModel], fill: Sequence[int], *, batches: Sequence[int] = PROFILE_BATCHES,
            contexts: Sequence[int] = PROFILE_CONTEXTS, repeats: int = 3, steady: int = 0,
            progress: Callable[[int, int], None] | None = None) -> CostProfile:
    """Time every model at every (context, batch) point, interleaved and repeated; keep medians.

    `fill` supplies real tokens for the context (at least max(contexts) + max(batches) + steady).
    Each point rolls the cache back to c tokens and decodes n more, asking for all n rows as a
    verification does. With `steady`, a one-token point is the mean of that many one-token decodes
    after an untimed one, as plain decoding runs them: the first decode after another model's or
    another batch size's cost the shipped Q4_K_M 7% more than the next ones and put the format
    step's one-token gain of `q4_0` at 1.27x where whole answers gained 1.03x (docs/benchmarks.md
    section 79).
    """
    top = max(contexts) + max(batches) + steady
    if len(fill) < top:
        fill = (list(fill) * (top // max(1, len(fill)) + 1))[:top]
    names = list(models)
    samples: dict[tuple[str, int, int], list[float]] = {}
    total, done = repeats * len(contexts) * len(batches) * len(names), 0
    for rep in range(repeats):
        # every other repeat walks the contexts down: rolling back is free, refilling the longest
        # context again cost each model a prefill of it (most of the tuner's profile on a slow CPU)
        order = list(enumerate(contexts))
        for ci, c in (order if rep % 2 == 0 else order[::-1]):
            for bi, n in enumerate(batches):
                k = (rep + ci + bi) % len(names)
                for name in names[k:] + names[:k]:
                    m = models[name]
                    seq = m.seqs[0]
                    seq.prefill(fill[:c])  # rolls back, or refills after a shorter context (untimed)
                    if n == 1 and steady:
                        seq.decode(fill[c:c + 1], "all")
                        t0 = time.perf_counter()
                        for j in range(c + 1, c + 1 + steady):
                            seq.decode(fill[j:j + 1], "all")
                        seconds = (time.perf_counter() - t0) / steady
                    else:
                        t0 = time.perf_counter()
                        seq.decode(fill[c:c + n], "all")
                        seconds = time.perf_counter() - t0
                    samples.setdefault((name, ci, bi), []).append(seconds)
                    done += 1
                if progress:
                    progress(done, total)
    table = {name: [[statistics.median(samples[(name, ci, bi)]) for bi in range(len(batches))]
                    for ci in range(len(contexts))] for name in names}
    return CostProfile(list(batches), list(contexts), table, {name: models[name].n_layer for name in names})


def verify_cost(cost: Cost, ctx: int) -> Callable[[int], float]:
    """A target verification of n tokens in single decoding steps (1 at n = 1), at context `ctx`:
    the price `copying.CopyPolicy` weighs draft lengths against."""
    return lambda n: cost("target", n, ctx) / cost("target", 1, ctx)


def _points(model: LlamaModel) -> tuple[list[int], int]:
    """The batch sizes and context measured: as many of VERIFY_BATCHES and VERIFY_CONTEXT as the window holds."""
    batches = [n for n in VERIFY_BATCHES if 2 * n <= model.n_ctx] or [1]
    return batches, max(0, min(VERIFY_CONTEXT, model.n_ctx - batches[-1]))


def _path(model: LlamaModel) -> Path:
    batches, context = _points(model)
    # without flash attention batches cost otherwise (decode/attention.py); on is llama.cpp's default
    attention = "--nofa" if model.params.flash_attn is False else ""
    return model_dir() / "tuned" / (f"batch-cost--{sha256_cached(model.path)[:16]}--{machine_key()}"
                                    f"--t{measured_threads(model.params)}--n{batches[-1]}c{context}{attention}.json")


def measured_threads(params: LoadParams) -> int:
    """The threads a measurement ran on: the default's count, so that a default engine and one
    asked for as many threads read the same measurement (two noisy measurements of one setting
    could disagree: the `generate` default with a prefill helper and a 2-thread bench without)."""
    return params.n_threads or default_threads()


def calibration_tokens(model: LlamaModel) -> list[int]:
    """Real code to decode while measuring (the perplexity text), as `model` tokenizes it."""
    text = (files("via_edge") / "data" / "perplexity" / "textwrap.py.txt").read_text()
    return model.tokenize(text, add_special=False)


@contextmanager
def reported(progress: Callable[[float], None] | None) -> Iterator[None]:
    """0 before a measurement and 1 after it, for the status line."""
    if progress is not None:
        progress(0.0)
    yield
    if progress is not None:
        progress(1.0)


@contextmanager
def untallied(*models: LlamaModel) -> Iterator[None]:
    """A measurement is no one's generation: every usage counter of `models` as it was before."""
    before = [(m, replace(m.usage), [replace(s.usage) for s in m.seqs]) for m in models]
    try:
        yield
    finally:
        for m, usage, seqs in before:
            m.usage = usage
            for seq, seq_usage in zip(m.seqs, seqs):
                seq.usage = seq_usage


def measure_verification(model: LlamaModel, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one decode of n tokens after VERIFY_CONTEXT tokens, for n in
    VERIFY_BATCHES (as many of both as a small context window holds)."""
    fill = calibration_tokens(model)
    batches, context = _points(model)
    with untallied(model):
        table = measure({"target": model}, fill, batches=batches, contexts=(context,), repeats=repeats)
        model.reset()
    return dict(zip(batches, table.table["target"][0]))


def store(model: LlamaModel, seconds: Mapping[int, float]) -> None:
    """Keep a verification measurement (seconds per batch size) where `batch_cost` reads it."""
    write_json(_path(model), {"model": model.path.name, "context": _points(model)[1],
                              "seconds": {str(n): s for n, s in seconds.items()}})


def batch_cost(model: LlamaModel, progress: Callable[[float], None] | None = None) -> Callable[[int], float]:
    """`verify_cost` of this model here, from its stored measurement, measuring it first if there
    is none (`progress` sees 0 and 1 around the measurement)."""
    path = _path(model)
    try:
        seconds = {int(n): float(s) for n, s in json.loads(path.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError):
        with reported(progress):
            seconds = measure_verification(model)
        try:
            store(model, seconds)
        except (OSError, ViaEdgeError) as exc:
            log.info("batch costs not stored (%s); measured again next time", exc)
    return tiled(seconds)


def tiled(seconds: Mapping[int, float]) -> Callable[[int], float]:
    """Single steps of a verification of n tokens from measured seconds per batch size: what the
    cheapest measured batch of at least n tokens costs, extended linearly past the largest.

    The CPU kernels work in row tiles (16 rows on x86: on an AMD EPYC 64 rows cost what 48 do and
    a fifth less than 63, docs/benchmarks.md section 44), so a size between two measured ones is
    priced as the next: the copy policy then drafts to fill the tile its step pays for.
    """
    ns = sorted(seconds)
    raw = [seconds[n] for n in ns]
    ys = list(raw)
    for i in range(len(ys) - 2, -1, -1):  # the cheapest batch at least this large
        ys[i] = min(ys[i], ys[i + 1])
    one = max(ys[0], 1e-12)

    def cost(n: int) -> float:
        if n > ns[-1]:
            return max(_interp_extrap(n, ns, raw), ys[-1]) / one
        return ys[int(np.searchsorted(ns, n))] / one
    return cost


PROMPT_GAIN = 1.15  # prompts go to the unrepacked copy where they decode at least this much faster


def _prompt_path(model: LlamaModel) -> Path:
    return model_dir() / "tuned" / (f"prompt-layout--{sha256_cached(model.path)[:16]}--{machine_key()}"
                                    f"--t{measured_threads(model.params)}.json")


def measure_prompts(model: LlamaModel, copies: Mapping[str, LlamaModel], repeats: int = 3) -> dict:
    """Median seconds of one prompt decode (up to 128 tokens) on `model` ("repacked") and on each
    of its unrepacked `copies`, interleaved."""
    fill = calibration_tokens(model)
    n = min(128, model.n_ctx // 2, len(fill))
    pairs = [("repacked", model), *copies.items()]
    seconds: dict[str, list[float]] = {name: [] for name, _ in pairs}
    with untallied(model, *copies.values()):
        for rep in range(repeats):
            k = rep % len(pairs)
            for name, m in pairs[k:] + pairs[:k]:
                m.seqs[0].reset()
                t0 = time.perf_counter()
                m.seqs[0].decode(fill[:n], "last")
                seconds[name].append(time.perf_counter() - t0)
                m.seqs[0].reset()
    return {"tokens": n, **{name: statistics.median(v) for name, v in seconds.items()}}


COPIES = ("plain", "source_plain")  # the model's own file unrepacked; the file it was derived from, unrepacked


def _best_copy(d: Mapping, with_source: bool) -> tuple[str, float]:
    """The copy that decodes prompts fastest in a measurement, and how much faster than the model."""
    name = min((k for k in COPIES if k in d and (with_source or k == "plain")), key=lambda k: float(d[k]))
    return name, float(d["repacked"]) / float(d[name])


def _stored(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
        _best_copy(d, True)
        return d
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def stored_prompt_gains() -> list[tuple[str, float, str, str]]:
    """Every stored measurement of this machine, any thread count: (model file, how much faster its
    prompts decode on the best copy, which copy, threads) for `via-edge info`."""
    out = []
    for path in sorted((model_dir() / "tuned").glob(f"prompt-layout--*--{machine_key()}--t*.json")):
        d = _stored(path)
        if d is not None:
            copy, gain = _best_copy(d, True)
            where = f"{d['source']} unrepacked" if copy == "source_plain" else "its own file unrepacked"
            out.append((str(d["model"]), gain, where, path.stem.rsplit("--t", 1)[1]))
    return out


def prompt_helper(model: LlamaModel, progress: Callable[[float], None] | None = None) -> Prefiller | None:
    """The unrepacked copy that decodes `model`'s long prompts, where it does so at least
    PROMPT_GAIN faster here: the model's own file, or for a derived format the file it was made
    from (its prompt's KV cache is then the shipped model's own, closer to it than the format's;
    docs/benchmarks.md section 64), whichever is faster. Measured once per model file, machine and
    thread count (the copies are loaded for it; `progress` sees 0 and 1 around it), kept next to
    the tuned choices."""
    path = _prompt_path(model)
    source = source_file(model.path)
    d = _stored(path)
    if d is not None and (source is None or "source_plain" in d):
        copy, gain = _best_copy(d, source is not None)
        return None if gain < PROMPT_GAIN else Prefiller(model, source if copy == "source_plain" else None)
    with reported(progress):
        copies = {"plain": Prefiller(model), **({"source_plain": Prefiller(model, source)} if source else {})}
        seconds = measure_prompts(model, {k: p.helper for k, p in copies.items()})
    try:
        write_json(path, {"model": model.path.name, **({"source": source.name} if source else {}), **seconds})
    except (OSError, ViaEdgeError) as exc:
        log.info("prompt costs not stored (%s); measured again next time", exc)
    copy, gain = _best_copy(seconds, True)
    for k, p in copies.items():
        if k != copy or gain < PROMPT_GAIN:
            p.close()
    return copies[copy] if gain >= PROMPT_GAIN else None
