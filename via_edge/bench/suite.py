"""Benchmark prompts: the packaged Spec-Bench copy (Apache-2.0, see data/spec_bench) or a user file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from ..errors import InvalidParameterError

SPEC_BENCH = "spec-bench"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def _spec_bench_rows() -> list[dict]:
    path = files("via_edge") / "data" / "spec_bench" / "question.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spec_bench_categories() -> list[str]:
    seen: list[str] = []
    for row in _spec_bench_rows():
        if row["category"] not in seen:
            seen.append(row["category"])
    return seen


def load_prompts(suite: str, categories: list[str] | None, per_category: int) -> list[Prompt]:
    """A fixed subset: the first `per_category` prompts of each category in file order.

    `suite` is `spec-bench` or a JSONL file whose rows hold `prompt` or `turns` (first turn used),
    optionally `category` and `id`.
    """
    if per_category < 1:
        raise InvalidParameterError("--per-category must be at least 1")
    if suite == SPEC_BENCH:
        rows = _spec_bench_rows()
    else:
        path = Path(suite)
        try:
            lines = path.read_text().splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidParameterError(f"cannot read prompt file {path}: {exc}") from exc
        except ValueError as exc:
            raise InvalidParameterError(f"prompt file {path} is not JSONL: {exc}") from exc
    prompts: list[Prompt] = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InvalidParameterError(f"{suite}: row {i + 1} is not a JSON object")
        text = row.get("prompt") or (row.get("turns") or [None])[0]
        if not isinstance(text, str) or not text.strip():
            raise InvalidParameterError(f"{suite}: row {i + 1} has no 'prompt' or 'turns'")
        prompts.append(Prompt(str(row.get("question_id", row.get("id", i + 1))), row.get("category", "default"),
                              text))
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
