"""Benchmark prompts: the packaged Spec-Bench copy (Apache-2.0, see data/spec_bench) or a user file."""

from __future__ import annotations

import json
from itertools import cycle, islice, zip_longest
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from ..errors import InvalidParameterError
from .tasks import HUMANEVAL, Problem, humaneval_rows

SPEC_BENCH = "spec-bench"
EDIT = "edit"
PACKAGED = {SPEC_BENCH: "spec_bench/question.jsonl", EDIT: "edit/prompts.jsonl"}  # under via_edge/data


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str                      # the (last) user message
    turns: tuple[str, ...] = ()    # a multi-turn row's user messages, `text` the last of them
    check: Problem | None = field(default=None, compare=False)  # unit tests the answer must pass (tasks.py)
    prediction: str | None = None  # what the answer will likely repeat (an edit's file), for `<mode>:predicted`
    earlier: tuple[str, ...] = ()  # an agent's requests before this one, each without the history


def packaged_rows(suite: str) -> list[dict]:
    """The rows of a suite shipped with the package: Spec-Bench (Apache-2.0, data/spec_bench) or
    the code-edit prompts made from CPython's standard library (PSF licence, data/edit)."""
    path = files("via_edge") / "data" / PACKAGED[suite]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _file_rows(suite: str) -> list[dict]:
    path = Path(suite)
    try:
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"cannot read prompt file {path}: {exc}") from exc
    except ValueError as exc:
        raise InvalidParameterError(f"prompt file {path} is not JSONL: {exc}") from exc


def to_prompt(row: dict, i: int, suite: str = "") -> Prompt:
    """A row with `prompt`, `turns` (the first turn, or every turn when `multi_turn`), or
    `requests` (separate requests, the last one timed); optionally a `prediction`."""
    if not isinstance(row, dict):
        raise InvalidParameterError(f"{suite}: row {i + 1} is not a JSON object")
    turns = row.get("turns") or []
    requests = row.get("requests") or []
    text = row.get("prompt") or (turns[-1] if row.get("multi_turn") else (turns or [None])[0]) or \
        (requests or [None])[-1]
    if not isinstance(text, str) or not text.strip():
        raise InvalidParameterError(f"{suite}: row {i + 1} has no 'prompt' or 'turns'")
    check = Problem(**row["check"]) if isinstance(row.get("check"), dict) else None
    prediction = row.get("prediction")
    if prediction is not None and not isinstance(prediction, str):
        raise InvalidParameterError(f"{suite}: row {i + 1}: 'prediction' must be text")
    return Prompt(str(row.get("question_id", row.get("id", i + 1))), row.get("category", "default"), text,
                  tuple(turns) if row.get("multi_turn") else (), check, prediction, tuple(requests[:-1]))


def prompts_in_turn(suite: str, categories: list[str] | None, n: int) -> list[Prompt]:
    """`n` prompts, the categories in turn (the first of each, then the second...; a category
    that runs out drops from the turn), all of them before any repeats: the load benchmark's
    requests."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in load_prompts(suite, categories, n):
        by_cat.setdefault(p.category, []).append(p)
    in_turn = [q for group in zip_longest(*by_cat.values()) for q in group if q is not None]
    return list(islice(cycle(in_turn), n))


def load_prompts(suite: str, categories: list[str] | None, per_category: int) -> list[Prompt]:
    """A fixed subset: the first `per_category` prompts of each category in file order.

    `suite` is a comma-separated list of packaged suites (`spec-bench`, `edit`, `humaneval`: task
    accuracy, tasks.py) and JSONL files
    whose rows hold `prompt` or `turns` (the first turn, or all with `multi_turn`), optionally
    `category` and `id`.
    """
    if per_category < 1:
        raise InvalidParameterError("--per-category must be at least 1")
    prompts: list[Prompt] = []
    for name in [x.strip() for x in suite.split(",") if x.strip()]:
        rows = humaneval_rows() if name == HUMANEVAL else packaged_rows(name) if name in PACKAGED else \
            _file_rows(name)
        prompts += [to_prompt(row, i, name) for i, row in enumerate(rows)]
    known = list(dict.fromkeys(p.category for p in prompts))
    wanted = categories or known
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise InvalidParameterError(f"unknown or empty categories: {', '.join(unknown)}; "
                                    f"this suite has: {', '.join(known)}")
    chosen = []
    for cat in wanted:
        chosen += [p for p in prompts if p.category == cat][:per_category]
    if not chosen:
        raise InvalidParameterError(f"no prompts selected from {suite}")
    return chosen
