"""The format step: derive each weight format of the target and draft, measure what a decode of
1, 4 and 8 tokens costs in each on this machine, measure each variant's quality against its
source, and pick. `via-edge models optimize` runs it alone; `via-edge tune` runs it first and
then replays every mode on each format that clears the quality floor.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..decode import costs
from ..errors import InvalidParameterError, ViaEdgeError
from ..files import write_json
from ..llama import LlamaModel, LoadParams
from ..machine import build
from ..weights import formats
from ..weights.catalog import model_dir, sha256_cached
from ..weights.quality import Quality, compare, greedy_continuations, work_units

SURVEY_BATCHES = (1, 2, 4, 8, 16)  # 4 and 16: the repack kernels' row blocks
SURVEY_CONTEXT = 384
SURVEY_STEADY = 8  # one-token decodes per timing: a format is chosen for plain decoding's steady pace
# Teacher-forced top-1 agreement a variant must keep with its source. Measured for the default
# pair (docs/benchmarks.md, section 14): the target's 4-bit variants keep 0.938-0.972 (perplexity
# +1-8%), the draft's IQ4_NL 0.924 and its Q4_0 0.897 (perplexity +14%); a Q2_K SmolLM2 falls far
# below (tests/test_formats.py). 0.90 admits the 4-bit target formats and rejects the rest.
QUALITY_FLOOR = 0.90
# The format step's calibration, shared by the automatic format (weights/autoformat.py) and the
# tuner, so that the quality one measured is found in the other's cache: the first prompts of
# `calibration_prompts()` (one per category), and the source's tokens compared after each.
FORMAT_PROMPTS, FORMAT_TOKENS = 6, 32


def format_prompts(model: LlamaModel) -> list[list[int]]:
    """The format step's calibration prompts in `model`'s chat template, each cut to leave room
    for its answer in a small context."""
    from ..prompts import chat_tokens
    from .record import calibration_prompts

    keep = min(1024, model.n_ctx // 2)
    return [chat_tokens(model, [{"role": "user", "content": q.text}])[:keep]
            for q in calibration_prompts(1)[:FORMAT_PROMPTS]]


def check_floor(floor: float) -> None:
    if not 0.0 <= floor <= 1.0:
        raise InvalidParameterError(f"--quality-floor must be in [0, 1], got {floor}")


@dataclass
class FormatRow:
    """One (model, format): its file, its measured costs and quality (None for the shipped file)."""

    role: str
    format: str
    path: Path
    size: int
    cost: dict[int, float] = field(default_factory=dict)   # batch -> seconds at SURVEY_CONTEXT
    quality: Quality | None = None

    def clears(self, floor: float) -> bool:
        return self.quality is None or self.quality.agreement >= floor

    def to_dict(self) -> dict:
        return {"role": self.role, "format": self.format, "path": str(self.path), "size": self.size,
                "cost_ms": {str(n): s * 1e3 for n, s in self.cost.items()},
                "quality": self.quality.to_dict() if self.quality else None}


def pick(rows: Sequence[FormatRow], floor: float, n: int = 1) -> FormatRow:
    """The cheapest format for a decode of `n` tokens among those that clear the floor (the
    shipped file always does): plain decoding costs one such call per token."""
    ok = [r for r in rows if r.clears(floor)]
    return min(ok, key=lambda r: r.cost[n])


def survey(sources: Mapping[str, Path], names: Sequence[str], prompts: Sequence[list[int]], load: LoadParams, *,
           continuation: int = 48, repeats: int = 5, batches: Sequence[int] = SURVEY_BATCHES,
           log: Callable[[str], None] = lambda m: None, quiet: bool = False,
           progress: Callable[[str, float], None] | None = None,
           reused: list[str] | None = None) -> dict[str, list[FormatRow]]:
    """Per role ("target", "draft"), one row per format in `names` (the shipped file first);
    `progress(stage, fraction)` follows the quality and cost measurements; `reused` collects the
    "role/format" whose quality came from the cache."""
    formats.check_names(list(names))
    names = [formats.SHIPPED] + [n for n in names if n != formats.SHIPPED]
    paths = {(role, n): formats.derive(src, n, quiet=quiet, threads=load.n_threads)
             for role, src in sources.items() for n in names}
    rows = {role: [FormatRow(role, n, paths[(role, n)], paths[(role, n)].stat().st_size) for n in names]
            for role in sources}
    for role in sources:
        t0 = time.monotonic()
        found = qualities(sources[role], {n: paths[(role, n)] for n in names if n != formats.SHIPPED}, prompts,
                          continuation, load, (lambda f, role=role: progress(f"quality of the {role}'s formats", f))
                          if progress else None, reused=reused, role=role)
        for r in rows[role]:
            r.quality = found.get(r.format)
        log(f"quality of the {role}'s {len(found)} variants in {time.monotonic() - t0:.0f}s")
    opened: dict[str, LlamaModel] = {}
    try:
        for (role, n), path in paths.items():
            opened[f"{role}/{n}"] = LlamaModel(path, load)
        fill = [t for p in prompts for t in p]
        t0 = time.monotonic()
        profile = costs.measure(opened, fill, batches=batches, contexts=(SURVEY_CONTEXT,), repeats=repeats,
                                steady=SURVEY_STEADY,
                                progress=(lambda done, total: progress("timing each format", done / total))
                                if progress else None)
        log(f"costs of {len(opened)} models at n={','.join(map(str, batches))} in {time.monotonic() - t0:.0f}s")
    finally:
        for m in opened.values():
            m.close()
    for role in sources:
        for r in rows[role]:
            r.cost = {n: profile.cost(f"{role}/{r.format}", n, SURVEY_CONTEXT) for n in batches}
    return rows


def qualities(source: Path, variants: Mapping[str, Path], prompts: Sequence[list[int]], continuation: int,
              load: LoadParams, progress: Callable[[float], None] | None = None, reused: list[str] | None = None,
              role: str = "model") -> dict[str, Quality]:
    """Each variant's quality against its source, cached per (source SHA-256, format, prompts,
    continuation, kernels): the figures depend on the weights and the kernels that run them, not
    on the machine, so a re-tune or another machine with the same build reuses them.

    The reference is the source on plain kernels (no extra buffer types), so whatever the fast
    kernels a variant runs on change (AMX, repacking) counts against the quality floor.
    """
    kernels = f"{build()['flavor']}-{'extra' if load.resolved_extra_bufts() else 'plain'}"
    digest = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts] + [continuation, kernels]).encode())
    sha = sha256_cached(source)

    def cache_path(name: str) -> Path:
        return model_dir() / "quality" / f"{sha[:16]}--{name}--{digest.hexdigest()[:12]}.json"

    out: dict[str, Quality] = {}
    for name in variants:
        try:
            out[name] = Quality(**json.loads(cache_path(name).read_text())["quality"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if reused is not None:
        reused += [f"{role}/{n}" for n in out]
    todo = {n: p for n, p in variants.items() if n not in out}
    if not todo:
        return out
    opened: dict[str, LlamaModel] = {}
    try:
        reference = LlamaModel(source, replace(load, use_extra_bufts=False))
        opened["source"] = reference
        for name, path in todo.items():
            opened[name] = LlamaModel(path, load)
        total, done = work_units(len(prompts), len(todo)), [0]

        def tick() -> None:
            done[0] += 1
            if progress:
                progress(min(done[0] / total, 0.99))

        conts = greedy_continuations(reference, prompts, continuation, tick)
        found = compare(reference, {n: opened[n] for n in todo}, prompts, conts, tick=tick)
        if progress:
            progress(1.0)
    finally:
        for m in opened.values():
            m.close()
    for name, q in found.items():
        out[name] = q
        try:
            write_json(cache_path(name), {"source": source.name, "format": name, "kernels": kernels,
                                          "continuation": continuation, "prompts": len(prompts),
                                          "quality": {k: v for k, v in q.to_dict().items() if k != "ppl_ratio"}})
        except (OSError, ViaEdgeError):
            pass  # a read-only model directory: measured again next time
    return out


def table(rows: Mapping[str, Sequence[FormatRow]], floor: float) -> str:
    """A markdown table of the survey, with what `pick` would choose per role."""
    ns = sorted(next(iter(rows.values()))[0].cost)
    head = ["model", "format", "MB"] + [f"n={n} ms" for n in ns] + ["agreement", "KL", "ppl ratio", ""]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for role, rs in rows.items():
        chosen = pick(rs, floor)
        for r in rs:
            q = r.quality
            mark = "picked" if r is chosen else ("" if r.clears(floor) else f"below floor {floor:.2f}")
            out.append("| " + " | ".join([role, r.format, f"{r.size / 1e6:.0f}"]
                                          + [f"{r.cost[n] * 1e3:.1f}" for n in ns]
                                          + ([f"{q.agreement:.3f}", f"{q.kl:.4f}", f"{q.ppl_ratio:.3f}"]
                                             if q else ["1 (source)", "0", "1"]) + [mark]) + " |")
    return "\n".join(out)
