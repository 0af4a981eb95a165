"""Tool calls, OpenAI style, on models that write them as Hermes/Qwen `<tool_call>` blocks.

A request's `tools` go through the model's chat template (Qwen2.5's renders them itself); a
template that knows nothing of tools gets them as a system message in the same words, and the
conversation's earlier calls and results as the text the model would have seen. The answer's
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become OpenAI `tool_calls`.
`tool_choice` "required" or a named function constrains the answer to such blocks with a grammar
made from the functions' parameter schemas, so it parses whatever the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..decode.constraints import schema_grammar
from ..errors import InvalidParameterError
from .callparse import CLOSE, OPEN


@dataclass(frozen=True)
class Tools:
    """A request's functions and its tool_choice: "none", "auto", "required" or one function's name."""

    functions: tuple[Mapping[str, Any], ...]
    choice: str
    named: str | None = None

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any = None) -> "Tools | None":
        if tools is None:
            if tool_choice not in (None, "none"):
                raise InvalidParameterError("'tool_choice' needs 'tools'", "tool_choice")
            return None
        if not isinstance(tools, list) or not tools:
            raise InvalidParameterError("'tools' must be a non-empty list of functions", "tools")
        functions = []
        for i, t in enumerate(tools):
            f = t.get("function") if isinstance(t, Mapping) and t.get("type", "function") == "function" else None
            if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) or not f["name"]:
                raise InvalidParameterError(f"'tools.{i}' must be {{\"type\": \"function\", \"function\": "
                                            "{\"name\": ..., \"parameters\": {...}}}", f"tools.{i}")
            if not isinstance(f.get("parameters", {}), Mapping):
                raise InvalidParameterError(f"'tools.{i}.function.parameters' must be a JSON schema object",
                                            f"tools.{i}")
            functions.append(f)
        names = [f["name"] for f in functions]
        if tool_choice is None or tool_choice in ("none", "auto", "required"):
            return cls(tuple(functions), tool_choice or "auto")
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, Mapping) else None
        if name not in names:
            raise InvalidParameterError("'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                                        f"\"function\": {{\"name\": one of {names}}}}}", "tool_choice")
        return cls(tuple(functions), "named", name)

    @property
    def names(self) -> frozenset[str]:
        """The declared functions: untagged JSON naming one of them is a call (callparse)."""
        return frozenset(f["name"] for f in self.functions)

    @property
    def offered(self) -> list[dict]:
        """The tools the template sees (none with tool_choice "none")."""
        return [] if self.choice == "none" else [{"type": "function", "function": dict(f)} for f in self.functions]

    def grammar(self) -> str | None:
        """GBNF for one call of an offered function (the named one) with arguments matching its
        schema; None where the model may answer in prose (auto, none)."""
        if self.choice not in ("required", "named"):
            return None
        funcs = [f for f in self.functions if self.choice == "required" or f["name"] == self.named]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in funcs]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = schema_grammar(schema, "tools", prop_order=("name", "arguments"))
        body = re.sub(r"^root ::=", "call ::=", body, count=1, flags=re.M)
        return body + f'\nroot ::= {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n'


def constrain(tools: "Tools | None", kwargs: dict) -> dict:
    """`kwargs` (Engine.stream's) with the grammar tool_choice asks for; a request may not also
    constrain the answer in another way."""
    gbnf = tools.grammar() if tools is not None else None
    if gbnf is None:
        return kwargs
    if kwargs.get("grammar") is not None or (kwargs.get("response_format") or {}).get("type", "text") != "text":
        raise InvalidParameterError("tool_choice required or named constrains the answer already: drop "
                                    "'grammar' / 'response_format'", "tool_choice")
    return {**kwargs, "grammar": gbnf}


def template_messages(messages: Sequence[Mapping[str, Any]], tools: "Tools | None",
                      template: str | None) -> tuple[list[dict], list[dict] | None]:
    """Messages and tools as the chat template takes them.

    Arguments of earlier calls are objects there (templates write them with `tojson`). A template
    that does not mention tools gets them as a first system message, earlier calls as the blocks
    the model writes and tool results as user turns, in Qwen2.5's own words.
    """
    native = bool(template) and "tool" in template
    offered = tools.offered if tools is not None else []
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_template_call(c) for c in calls]
            if not native:
                blocks = "\n".join(f'{OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})}\n{CLOSE}'
                                   for c in m.pop("tool_calls"))
                m["content"] = ((m.get("content") or "") + "\n" + blocks).lstrip("\n")
        if m.get("content") is None:
            m["content"] = ""
        if m["role"] == "tool" and not native:
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if offered and not native:
        system = "\n\n" + _describe(offered)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + system}
        else:
            out.insert(0, {"role": "system", "content": "You are a helpful assistant." + system})
        return out, None
    return out, offered or None


def _template_call(call: Mapping[str, Any]) -> dict:
    f = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
        raise InvalidParameterError("each 'tool_calls' entry needs a function with a name", "messages")
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise InvalidParameterError(f"the arguments of the call to {f['name']} are not JSON", "messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}}


def _describe(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(t) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
            f"with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\nFor each "
            "function call, return a json object with function name and arguments within <tool_call></tool_call> "
            'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
