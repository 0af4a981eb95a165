"""Tool calls in the forms models write them, whole and streamed.

Qwen2.5 and Hermes tag a call (`<tool_call>{...}</tool_call>`); Qwen2.5-Coder often writes it as a
fenced JSON block or bare JSON, sometimes with the doubled braces of its template; Llama 3.x names
the arguments `parameters`; Mistral lists calls after `[TOOL_CALLS]`. Several may follow one another.
A tagged block is a call whatever function it names; untagged JSON is a call only when it opens
with `{"name": "<a declared function>"` (after an optional code fence, as llama-server's trigger
has it), so an answer that merely contains JSON stays text. The streamed split (`CallStream`)
holds back only text that may still become such a call, and gives the calls the whole parse gives.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Collection, Iterator

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
FENCE = "```"
_FENCE_HEAD = re.compile(r"```[ \t]*(?:json)?[ \t]*(?:\r?\n)?")
_STARTS = re.compile(r"[{\[<`]")
_DECODER = json.JSONDecoder()
Span = tuple[int, int, list[dict]]  # (start, end, calls) of text that is calls


def parse_calls(text: str, names: Collection[str] | None = None) -> tuple[str | None, list[dict]]:
    """The answer's prose (None if there is none) and its tool calls in OpenAI's shape; `names`:
    the declared functions (None: tagged blocks only)."""
    spans = find_calls(text, names, final=True)
    if not spans:
        return text, []
    prose, at = [], 0
    for start, end, _ in spans:
        prose.append(text[at:start])
        at = end
    prose.append(text[at:])
    content = "".join(prose).strip()
    return content or None, [c for _, _, calls in spans for c in calls]


def find_calls(text: str, names: Collection[str] | None, final: bool = True) -> list[Span]:
    spans, i = [], 0
    while (m := _STARTS.search(text, i)) is not None:
        state = _at(text, m.start(), names, final)
        if isinstance(state, tuple):
            spans.append(state)
            i = state[1]
        else:
            i = m.start() + 1
    return spans


def _at(text: str, i: int, names: Collection[str] | None, final: bool) -> Span | str:
    """What starts at `i`: a span of calls, "maybe" (more text may make it one) or "no"."""
    rest = text[i:]
    if rest.startswith(OPEN) or (not final and OPEN.startswith(rest)):
        end = text.find(CLOSE, i)
        if end < 0:
            return "no" if final else "maybe"
        got = _json(text[i + len(OPEN):end].strip(), 0)
        calls = _calls(got[0], None) if got else None
        return (i, end + len(CLOSE), calls) if calls else "no"
    if names is None:
        return "no"
    if rest.startswith(FENCE) or rest.startswith(MISTRAL) or (not final and (FENCE.startswith(rest)
                                                                             or MISTRAL.startswith(rest))):
        if not rest.startswith(FENCE) and not rest.startswith(MISTRAL):
            return "maybe"
        if not final and rest.startswith(FENCE) and re.fullmatch(r"[ \t]*(j(s(o(n)?)?)?)?[ \t]*", rest[len(FENCE):]):
            return "maybe"  # the fence's language may still be on its way
        j = _FENCE_HEAD.match(text, i).end() if rest.startswith(FENCE) else i + len(MISTRAL)
        j += len(text[j:]) - len(text[j:].lstrip())
        if j >= len(text):
            return "no" if final else "maybe"
        state = _json_call(text, j, names, final)
        if not isinstance(state, tuple) or not rest.startswith(FENCE):
            return state if not isinstance(state, tuple) else (i, state[1], state[2])
        k = state[1] + len(text[state[1]:]) - len(text[state[1]:].lstrip())
        if text.startswith(FENCE, k):
            return i, k + len(FENCE), state[2]
        if not final and FENCE.startswith(text[k:]):
            return "maybe"  # the closing fence may be on its way
        return i, state[1], state[2]
    return _json_call(text, i, names, final)


def _json_call(text: str, i: int, names: Collection[str], final: bool) -> Span | str:
    """Untagged JSON at `i`: a call (or a list of calls) that opens with a declared name."""
    compact = re.sub(r"\s+", "", text[i:i + 400])
    heads = [f'{{"name":"{n}"' for n in names]
    opens = [h for h in heads] + ["{" + h for h in heads] + ["[" + h for h in heads]
    if not any(compact.startswith(h) for h in opens):
        return "maybe" if not final and any(h.startswith(compact) for h in opens) else "no"
    got = _json(text, i)
    if got is None:
        return "no" if final else "maybe"
    if not final and text.startswith("{{", i) and got[1] == len(text) and not _closes_double(text, i, got[1]):
        return "maybe"  # the doubled closing brace may still come
    calls = _calls(got[0], names)
    return (i, got[1], calls) if calls else "no"


def _json(text: str, i: int) -> tuple[object, int] | None:
    """The JSON value at `i` and where it ends; doubled braces (a template's `{{ }}` copied) count once."""
    try:
        return _DECODER.raw_decode(text, i)
    except ValueError:
        pass
    if text.startswith("{{", i):  # its closing double brace, when written, goes with it
        try:
            value, end = _DECODER.raw_decode(text, i + 1)
        except ValueError:
            return None
        return value, end + text.startswith("}", end)
    return None


def _closes_double(text: str, i: int, end: int) -> bool:
    """Did the value at `i`, opened with a doubled brace, also take its extra closing one?"""
    try:
        return _DECODER.raw_decode(text, i + 1)[1] < end
    except ValueError:
        return False


def _calls(value: object, names: Collection[str] | None) -> list[dict] | None:
    """A call object, or a list of them, in OpenAI's shape (arguments as a JSON string)."""
    items = value if isinstance(value, list) else [value]
    out = []
    for v in items:
        if not isinstance(v, dict) or not isinstance(v.get("name"), str):
            return None
        if names is not None and v["name"] not in names:
            return None
        args = v.get("arguments", v.get("parameters", {}))
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": v["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out or None


class CallStream:
    """Streamed text split into prose and calls: prose goes out as it comes, except what may still
    become a call, which waits until it is one (then its calls) or cannot be (then prose)."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = names
        self.held = ""

    def feed(self, text: str) -> Iterator[str | dict]:
        self.held += text
        i = 0
        while (m := _STARTS.search(self.held, i)) is not None:
            state = _at(self.held, m.start(), self.names, final=False)
            if state == "no":
                i = m.start() + 1
                continue
            if m.start():
                yield self.held[:m.start()]
            if state == "maybe":
                self.held = self.held[m.start():]
                return
            yield from state[2]
            self.held, i = self.held[state[1]:], 0
        if self.held:
            yield self.held
            self.held = ""

    def flush(self) -> list[str | dict]:
        """What is held at the end: calls where it completes as calls (an unclosed fence), else text."""
        held, self.held = self.held, ""
        if not held:
            return []
        spans = find_calls(held, self.names, final=True)
        out: list[str | dict] = []
        at = 0
        for start, end, calls in spans:
            if held[at:start]:
                out.append(held[at:start])
            out.extend(calls)
            at = end
        if held[at:]:
            out.append(held[at:])
        return out
