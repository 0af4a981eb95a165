#!/usr/bin/env python3
"""Build the code-edit benchmark suite (`via_edge/data/edit/`) from CPython's standard library.

Each prompt is one real module (60-200 lines, PSF licence, copied from the Python running this
script, 3.11 when the suite was made), one instruction of the kinds editors send (rename a
symbol, add type hints, add docstrings, fix a seeded bug, convert to a dataclass, add logging)
and the request for the whole edited file, as aider's whole-file format and Continue's apply ask
for it. A seeded bug is a one-line change made here and described by its symptom. Each edit row
carries the file as `prediction`, as editors send it with OpenAI's Predicted Outputs (bench's
`<mode>:predicted`). Then a two-turn chat: turn 2 asks to change the code the model wrote in
turn 1 (bench runs the first turn's answer greedily, then times the second). Last, four agent
sequences (category `agent`): a module written in one request, then two follow-up requests that
ask for it again with changes without sending it or the history (rows of `requests`: bench runs
the earlier ones untimed on the same method, then times the last).

    python tools/make_edit_suite.py            # rewrites via_edge/data/edit/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "via_edge" / "data" / "edit" / "prompts.jsonl"
ASK = "Return the whole edited file in a single ```python code block, with no explanation."

# (module path under Lib/, kind, instruction, seeded bug as (original line, buggy line) or None)
EDITS = [
    ("bisect.py", "type-hints",
     "Add type hints to every function signature (use typing where needed). Change nothing else.", None),
    ("colorsys.py", "rename",
     "Rename the helper function `_v` to `_hue_to_channel` everywhere it is defined or used.", None),
    ("sched.py", "dataclass",
     "Replace the `Event` namedtuple with an equivalent frozen, ordered dataclass named `Event` "
     "with the same fields in the same order; keep the field documentation as comments.", None),
    ("reprlib.py", "type-hints",
     "Add type hints to every method and function signature. Change nothing else.", None),
    ("genericpath.py", "bug",
     "`samestat` says two different files are the same file when their inode number happens to "
     "equal the other's device number. Find the bug and fix it.",
     ("    return (s1.st_ino == s2.st_ino and", "    return (s1.st_ino == s2.st_dev and")),
    ("chunk.py", "docstrings",
     "Add a concise docstring to every method of the Chunk class that does not have one.", None),
    ("fnmatch.py", "rename",
     "Rename the function `_compile_pattern` to `_pattern_matcher` everywhere.", None),
    ("html/__init__.py", "type-hints",
     "Add type hints to the signatures of `escape`, `unescape` and `_replace_charref`.", None),
    ("json/tool.py", "logging",
     "Add logging: a module-level logger, a debug message naming each input and output file "
     "as it is opened, and an error message before exiting on invalid JSON.", None),
    ("wsgiref/util.py", "bug",
     "`guess_scheme` returns 'http' for a request whose HTTPS variable is 'on'. Find the bug and fix it.",
     ("    if environ.get(\"HTTPS\") in ('yes','on','1'):", "    if environ.get(\"HTTPS\") in ('yes','no','1'):")),
    ("netrc.py", "docstrings",
     "Add a concise docstring to every method of `_netrclex` and `netrc` that does not have one.", None),
    ("unittest/signals.py", "logging",
     "Add logging: a module-level logger and an info message whenever the interrupt handler is "
     "installed or removed and whenever a result is registered or removed.", None),
]

CHAT = {
    "id": "edit-chat-1", "category": "edit-chat", "multi_turn": True,
    "turns": [
        "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` methods and a fixed "
        "capacity, using collections.OrderedDict. Include docstrings.",
        "Change the class so that `get` also takes a default value returned when the key is "
        "missing, and add a `__len__` method. Return the whole class again.",
    ],
}


WHOLE = "Return the whole module in a single ```python code block, with no explanation."
# An agent's sequences: (module, first change, both changes). Each first request writes the module,
# the follow-ups ask for it again with changes, without sending it or the history.
AGENTS = [
    ("a Python module `inventory.py`: a dataclass `Item` (name, quantity, price) and a class "
     "`Inventory` keeping items by name, with methods `add(item)`, `remove(name)`, `total_value()` and "
     "`low_stock(threshold)`, each with a docstring",
     "but with type hints on every method",
     "with type hints on every method, and add a method `restock(name, amount)` that raises KeyError "
     "for an unknown name"),
    ("a Python module `expr.py`: a function `tokenize(text)` that splits an arithmetic expression into "
     "numbers, the operators + - * / and parentheses with a regular expression, raising ValueError on "
     "any other character, and a function `evaluate(text)` that computes its value with the "
     "shunting-yard algorithm, each with a docstring",
     "but with `evaluate` renamed to `calculate` everywhere",
     "with `evaluate` renamed to `calculate`, and support the power operator `^`, right-associative "
     "and binding tighter than * and /"),
    ("a Python module `shapes.py`: an abstract base class `Shape` with abstract methods `area()` and "
     "`perimeter()`, and subclasses `Circle(radius)`, `Rectangle(width, height)` and `Triangle(a, b, c)` "
     "(Heron's formula for the area), each class and method with a docstring",
     "but with a `__repr__` method on every class",
     "with a `__repr__` method on every class, and add a function `largest(shapes)` returning the "
     "shape with the largest area"),
    ("a Python module `bank.py`: a class `Account(owner, balance=0)` with methods `deposit(amount)`, "
     "`withdraw(amount)` and `transfer(other, amount)`, raising ValueError for a non-positive amount or "
     "insufficient funds, and keeping a list of transactions, each method with a docstring",
     "but logging every transaction with the logging module",
     "logging every transaction with the logging module, and add a method `statement()` that returns "
     "the transactions as lines of text"),
]


def agent_rows() -> list[dict]:
    """Rows agent-1, agent-2 for the first sequence, agent-3, agent-4 for the next, ...: the first
    follow-up, then the second (each row's earlier requests are run before it, untimed)."""
    rows = []
    for i, (module, first, both) in enumerate(AGENTS):
        requests = [f"Write {module}. {WHOLE}",
                    f"Write {module} again, the same as before, {first}. {WHOLE}",
                    f"Write {module} again, the same as before {both}. {WHOLE}"]
        rows += [{"id": f"agent-{2 * i + n}", "category": "agent", "requests": requests[:n + 1]} for n in (1, 2)]
    return rows


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    lib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for i, (module, kind, instruction, bug) in enumerate(EDITS, 1):
        source = (lib / module).read_text()
        if bug is not None:
            assert source.count(bug[0]) == 1, (module, bug[0])
            source = source.replace(bug[0], bug[1])
        lines = source.count("\n")
        assert 60 <= lines <= 200, (module, lines)
        prompt = f"{instruction}\n\n`Lib/{module}`:\n```python\n{source}```\n\n{ASK}"
        rows.append({"id": f"edit-{i}", "category": "edit", "kind": kind, "source": f"Lib/{module}",
                     "lines": lines, "prompt": prompt, "prediction": source})
    rows.append(CHAT)
    rows += agent_rows()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{OUT}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
