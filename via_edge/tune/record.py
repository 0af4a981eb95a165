"""Record once, evaluate many: the target's greedy output on calibration prompts, and what the
draft and each slim predict at every position of it (teacher-forced, one batched call per prompt).

Along the target's own greedy output, everything a greedy round of `sd`, `lookup` or `hier`
decides is a function of these records: a draft token is accepted exactly when it equals the
target's token there. So the target runs once, and a candidate slim costs one batched pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..bench.suite import EDIT, SPEC_BENCH, Prompt, packaged_rows, to_prompt
from ..llama import LlamaModel
from ..weights.quality import greedy_continuations


@dataclass
class Trace:
    """One calibration prompt: the target's greedy tokens and the draft's prediction at each."""

    prompt: list[int]
    target: np.ndarray   # (L,) the target's greedy tokens
    draft: np.ndarray    # (L,) the draft's argmax at each position, given the target's prefix
    draft_p: np.ndarray  # (L,) the draft's probability of that token


@dataclass
class SlimTrace:
    """A slim along one trace: its own argmax and its routing score of the draft's token."""

    top: np.ndarray    # (L,) the slim's argmax
    ratio: np.ndarray  # (L,) p_slim(draft token) / max p_slim: the `via` routing score r


def calibration_prompts(per_category: int = 1, skip: int = 0, max_words: int = 220) -> list[Prompt]:
    """Spec-Bench prompts and code edits (data/edit) taken from the end of each category;
    `via-edge bench` takes them from the start. `skip` steps past the ones an earlier call took
    (held-out prompts); Spec-Bench prompts over `max_words` words are passed over to keep tuning
    quick (an edit's length is its point: it carries the file to copy).
    """
    rows = packaged_rows(SPEC_BENCH) + [r for r in packaged_rows(EDIT) if not r.get("multi_turn")]
    prompts = [to_prompt(r, i) for i, r in enumerate(rows)]
    out = []
    for cat in dict.fromkeys(p.category for p in prompts):
        mine = [p for p in prompts if p.category == cat and (cat == "edit" or len(p.text.split()) <= max_words)]
        out += mine[::-1][skip:skip + per_category]
    return out


def _rows_stats(rows: np.ndarray, tokens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the argmax and either its probability or (given tokens) p(token) / max p."""
    rows = rows.astype(np.float64)
    top = rows.argmax(axis=1)
    mx = rows[np.arange(len(rows)), top]
    if tokens is None:
        return top, 1.0 / np.exp(rows - mx[:, None]).sum(axis=1)
    return top, np.exp(rows[np.arange(len(rows)), tokens] - mx)


def record(target: LlamaModel, draft: LlamaModel | None, prompts: Sequence[list[int]], max_new: int,
           progress: Callable[[int, int], None] | None = None) -> list[Trace]:
    """The target's greedy output for each prompt (as `ar` makes it), and the draft along it."""
    traces = []
    for i, prompt in enumerate(prompts):
        out = greedy_continuations(target, [prompt], max_new)[0]
        if draft is not None:
            draft.reset()
            dtop, dp = _rows_stats(draft.seqs[0].eval(prompt + out[:-1], len(out)))
        else:
            dtop, dp = np.full(len(out), -1), np.zeros(len(out))
        traces.append(Trace(list(prompt), np.array(out), dtop, dp))
        if progress:
            progress(i + 1, len(prompts))
    return traces


def slim_traces(slim: LlamaModel, traces: Sequence[Trace], hidden: bool = False
                ) -> tuple[list[SlimTrace], np.ndarray | None]:
    """The slim along every trace; with `hidden` (a model loaded with `capture_names`), also each
    block's influence: 1 - cos(block input, block output), averaged over positions, the signal
    the greedy removal uses to pick which blocks to try dropping (Men et al. 2024, ShortGPT).
    """
    out, influence, weight = [], np.zeros(slim.n_layer), 0
    for tr in traces:
        slim.reset()
        rows = slim.seqs[0].eval(tr.prompt + list(tr.target[:-1]), len(tr.target))
        top, ratio = _rows_stats(rows, tr.draft if tr.draft[0] >= 0 else tr.target)
        out.append(SlimTrace(top, ratio))
        if hidden:
            prev = slim.captured("inp_embd") if _has(slim, "inp_embd") else None
            for k in range(slim.n_layer):
                cur = slim.captured(f"l_out-{k}")
                if prev is not None:
                    a = prev[-len(cur):]
                    cos = (a * cur).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(cur, axis=1) + 1e-12)
                    influence[k] += float((1 - cos).mean())
                else:
                    influence[k] += np.inf
                prev = cur
            weight += 1
    return out, (influence / max(weight, 1) if hidden else None)


def _has(model: LlamaModel, name: str) -> bool:
    try:
        model.captured(name)
        return True
    except KeyError:
        return False


def capture_names(n_layer: int) -> tuple[str, ...]:
    return ("inp_embd",) + tuple(f"l_out-{k}" for k in range(n_layer))
